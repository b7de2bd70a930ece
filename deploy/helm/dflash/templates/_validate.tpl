{{/*
What values.schema.json cannot say: combinations of values that would deploy something that cannot work.
Each refusal names the value. Included once, by deployment.yaml (always rendered).
*/}}

{{/* A memory quantity (64Gi, 500M, 1e9 is not one) in bytes, as a float. */}}
{{- define "dflash.bytes" -}}
{{- $units := dict "" 1.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 }}
{{- $q := toString . }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $q }}
{{- mulf (float64 $number) (get $units (trimPrefix $number $q)) }}
{{- end }}

{{- define "dflash.maxReplicas" -}}
{{- if or .Values.autoscaling.enabled .Values.autoscaling.keda.enabled }}{{ .Values.autoscaling.maxReplicas }}{{ else }}{{ .Values.server.replicas }}{{ end }}
{{- end }}

{{/*
build.args read the way builder/build.py's parser reads them, with its flags and choices from the contract:
an unknown flag, a bad choice or a flag that values own is refused here, before a GPU pod runs the builder.
Returns the options the deployment's shape depends on, as JSON.
*/}}
{{- define "dflash.buildOptions" -}}
{{- $builder := (include "dflash.contract" . | fromYaml).builder }}
{{- $owned := dict "--target" "model.preset or model.target" "--drafter" "model.drafter" "--output" "model.build" "--gpu" "server.gpuType" "--tensor-parallel-size" "server.tensorParallel" }}
{{- $notInJob := list "--dry-run" "--check" "--help" "-h" }}
{{- $options := dict "--runtime" "torch" "--device" "auto" "--quant" "none" }}
{{- $pending := "" }}
{{- $errors := list }}
{{- range .Values.build.args }}
{{- $arg := toString . }}
{{- $flag := "" }}
{{- $value := "" }}
{{- $hasValue := false }}
{{- if $pending }}
{{- $flag = $pending }}{{ $value = $arg }}{{ $hasValue = true }}{{ $pending = "" }}
{{- else if hasPrefix "-" $arg }}
{{- $flag = regexReplaceAll "=.*" $arg "" }}
{{- if not (hasKey $builder.flags $flag) }}
{{- $errors = append $errors (printf "build.args: builder/build.py does not know %s (see dflash-build --help)" $flag) }}
{{- end }}
{{- if hasKey $owned $flag }}
{{- $errors = append $errors (printf "build.args must not set %s: it comes from %s" $flag (get $owned $flag)) }}
{{- end }}
{{- if has $flag $notInJob }}
{{- $errors = append $errors (printf "build.args must not set %s: the Job must write the build the servers wait for" $flag) }}
{{- end }}
{{- if contains "=" $arg }}
{{- $value = trimPrefix (printf "%s=" $flag) $arg }}{{ $hasValue = true }}
{{- else if not (has $flag $builder.valueless) }}
{{- $pending = $flag }}
{{- end }}
{{- else }}
{{- $errors = append $errors (printf "build.args: %q is not a flag of builder/build.py nor a flag's value" $arg) }}
{{- end }}
{{- if $hasValue }}
{{- $choices := get $builder.flags $flag }}
{{- if and $choices (not (has $value $choices)) }}
{{- $errors = append $errors (printf "build.args: %s %s: invalid choice %q (choose from %s)" $flag $value $value (join ", " $choices)) }}
{{- end }}
{{- $_ := set $options $flag $value }}
{{- end }}
{{- end }}
{{- if $pending }}
{{- $errors = append $errors (printf "build.args: %s needs a value after it" $pending) }}
{{- end }}
{{- $_ := set $options "errors" $errors }}
{{- toJson $options }}
{{- end }}

{{/*
A training tool's extra flags against its parser's (from the contract): (dict "args" list "flags" dict "owned" dict
"value" "training.train.args" "tool" "dflash-train-drafter"). owned: flag -> the value that sets it.
*/}}
{{- define "dflash.checkToolFlags" -}}
{{- range .args }}
{{- $arg := toString . }}
{{- if hasPrefix "-" $arg }}
{{- $flag := regexReplaceAll "=.*" $arg "" }}
{{- if not (hasKey $.flags $flag) }}
{{- fail (printf "%s: %s does not know %s (see %s --help)" $.value $.tool $flag $.tool) }}
{{- end }}
{{- if hasKey $.owned $flag }}
{{- fail (printf "%s must not set %s: it comes from %s" $.value $flag (get $.owned $flag)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dflash.validateTraining" -}}
{{- $v := .Values }}
{{- $t := $v.training }}
{{- $contract := include "dflash.contract" . | fromYaml }}
{{- if or $t.data.enabled $t.train.enabled }}
{{- if eq $v.modelStore.accessMode "ReadOnlyMany" }}
{{- fail "modelStore.accessMode ReadOnlyMany: the training Jobs write their answers and checkpoints into it" }}
{{- end }}
{{- if eq $t.responses $t.run }}
{{- fail (printf "training.responses and training.run are both %q: the answers and the run need folders of their own" $t.run) }}
{{- end }}
{{- end }}
{{- if $t.data.enabled }}
{{- $owned := dict "--target" "model.preset or model.target" "--output" "training.responses" "--server" "this release's gateway" "--num-prompts" "training.data.numPrompts" "--concurrency" "training.data.concurrency" }}
{{- include "dflash.checkToolFlags" (dict "args" $t.data.args "flags" $contract.training.dataFlags "owned" $owned "value" "training.data.args" "tool" "dflash-drafter-data") }}
{{- end }}
{{- if $t.train.enabled }}
{{- $job := printf "%s-train-%s-000000-%d" (include "dflash.fullname" .) $t.run (sub (int $t.train.nodes) 1) }}
{{- if gt (len $job) 63 }}
{{- fail (printf "the release name (or fullnameOverride) + training.run are too long: the last training pod's hostname (%s, the zeros stand for a hash) would exceed 63 characters" $job) }}
{{- end }}
{{- $owned := dict "--target" "model.preset or model.target" "--output" "training.run" "--responses" "training.responses" }}
{{- include "dflash.checkToolFlags" (dict "args" $t.train.args "flags" $contract.training.trainerFlags "owned" $owned "value" "training.train.args" "tool" "dflash-train-drafter") }}
{{- $device := "cpu" }}
{{- range $i, $arg := $t.train.args }}
{{- if hasPrefix "--device=" (toString $arg) }}{{ $device = trimPrefix "--device=" (toString $arg) }}{{ end }}
{{- if and (eq (toString $arg) "--device") (lt (add1 $i) (len $t.train.args)) }}{{ $device = toString (index $t.train.args (add1 $i)) }}{{ end }}
{{- end }}
{{- $gpus := int $t.train.gpusPerNode }}
{{- if and (eq $v.image.kind "cpu") $gpus }}
{{- fail (printf "image.kind cpu runs without GPUs: training.train.gpusPerNode must be 0 (got %d)" $gpus) }}
{{- end }}
{{- if and $gpus (not (hasPrefix "cuda" $device)) }}
{{- fail (printf "training.train.gpusPerNode is %d but training.train.args train on --device %s: add --device cuda (each rank takes its node's GPU LOCAL_RANK)" $gpus $device) }}
{{- end }}
{{- if and (not $gpus) (hasPrefix "cuda" $device) }}
{{- fail (printf "training.train.args train on --device %s but training.train.gpusPerNode is 0: the pods get no GPU" $device) }}
{{- end }}
{{- if and (gt (int $t.train.nodes) 1) (ne $v.modelStore.accessMode "ReadWriteMany") }}
{{- fail (printf "training.train.nodes is %d but modelStore.accessMode is %s: the ranks on every node read the answers and rank 0 writes the checkpoints into one folder: use ReadWriteMany storage" (int $t.train.nodes) $v.modelStore.accessMode) }}
{{- end }}
{{- if ge (float64 (include "dflash.bytes" $t.train.sharedMemory)) (float64 (include "dflash.bytes" $t.train.memory)) }}
{{- fail (printf "training.train.sharedMemory (%s) must be below training.train.memory (%s): /dev/shm is memory-backed and counts against the limit" $t.train.sharedMemory $t.train.memory) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The model: a preset, or a target of one's own with its drafter (the forms of model.target and model.drafter, a
folder under /models or a hub id, are the schema's).
*/}}
{{- define "dflash.validateModel" -}}
{{- $m := .Values.model }}
{{- if and $m.preset $m.target }}
{{- fail (printf "model.target (%s) and model.preset (%s) both name the target: set model.preset to \"\" to deploy your own target, or model.target to \"\" for the preset's" $m.target $m.preset) }}
{{- end }}
{{- if not (or $m.preset $m.target) }}
{{- fail "model.preset or model.target must name the target (a preset of dflash_contract/presets.py, a folder under /models or a hub id)" }}
{{- end }}
{{- if and $m.target (not $m.drafter) }}
{{- fail (printf "model.target %s needs model.drafter: its DFlash drafter (a folder under /models or a hub id), or none for plain decoding" $m.target) }}
{{- end }}
{{- $buildPath := include "dflash.buildPath" . }}
{{- range $key := list "target" "drafter" }}
{{- $ref := get $m $key | toString }}
{{- if hasPrefix (printf "%s/" $buildPath) (printf "%s/" $ref) }}
{{- fail (printf "model.%s %s is inside the build's own folder %s, which every build replaces: keep checkpoints in a folder of their own (e.g. /models/checkpoints/...)" $key $ref $buildPath) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dflash.validate" -}}
{{- include "dflash.validateModel" . }}
{{- include "dflash.validateTraining" . }}
{{- $v := .Values }}
{{- $contract := include "dflash.contract" . | fromYaml }}
{{- $job := printf "%s-build-%s-000000" (include "dflash.fullname" .) $v.model.build }}
{{- if gt (len $job) 63 }}
{{- fail (printf "the release name (or fullnameOverride) + model.build are too long: the build Job's name (%s, the zeros stand for a hash) would exceed 63 characters" $job) }}
{{- end }}
{{- $maxReplicas := int (include "dflash.maxReplicas" .) }}
{{- /* the model store */}}
{{- if and (eq $v.modelStore.accessMode "ReadOnlyMany") $v.build.enabled }}
{{- fail "modelStore.accessMode ReadOnlyMany: the build Job cannot write the build into it" }}
{{- end }}
{{- if and (ne $v.modelStore.accessMode "ReadWriteMany") (gt $maxReplicas 1) }}
{{- fail (printf "modelStore.accessMode %s allows one node (or one pod) only, but up to %d replicas may run on different nodes: use ReadWriteMany storage" $v.modelStore.accessMode $maxReplicas) }}
{{- end }}
{{- /* replicas and rollouts */}}
{{- if and (eq (int $v.server.maxSurge) 0) (eq (int $v.server.maxUnavailable) 0) }}
{{- fail "server.maxSurge and server.maxUnavailable are both 0: a rolling update could never replace a pod (maxSurge 1 needs a spare pod's GPUs; maxUnavailable 1 serves one pod short)" }}
{{- end }}
{{- if and $v.autoscaling.enabled $v.autoscaling.keda.enabled }}
{{- fail "autoscaling.enabled and autoscaling.keda.enabled are both on: KEDA makes an HPA of its own for the Deployment, and two HPAs fight over its replicas. Turn autoscaling.enabled off to scale with KEDA" }}
{{- end }}
{{- if and $v.autoscaling.keda.enabled (not $v.monitoring.enabled) }}
{{- fail "autoscaling.keda.enabled reads the engine's queue from Prometheus, which scrapes it through the ServiceMonitor: turn monitoring.enabled on" }}
{{- end }}
{{- $gatewayNamespace := $v.inferencePool.gateway.namespace }}
{{- if and $v.inferencePool.enabled $gatewayNamespace (ne $gatewayNamespace .Release.Namespace) (not (has $gatewayNamespace $v.network.clientNamespaces)) }}
{{- fail (printf "inferencePool.gateway.namespace %s is not in network.clientNamespaces: the NetworkPolicy would keep the gateway's proxy from the pods; add it" $gatewayNamespace) }}
{{- end }}
{{- if and $v.inferencePool.enabled (not (or $v.inferencePool.picker.weights.queue $v.inferencePool.picker.weights.kvCacheUtilization $v.inferencePool.picker.weights.prefixCache)) }}
{{- fail "inferencePool.picker.weights are all 0: the endpoint picker would score every pod alike" }}
{{- end }}
{{- if or $v.autoscaling.enabled $v.autoscaling.keda.enabled }}
{{- if eq (int $v.server.replicas) 0 }}
{{- fail "server.replicas is 0 but autoscaling is enabled: the HPA would scale it straight back to autoscaling.minReplicas. To stop serving, set autoscaling.enabled: false" }}
{{- end }}
{{- if lt (int $v.autoscaling.maxReplicas) (int $v.autoscaling.minReplicas) }}
{{- fail (printf "autoscaling.maxReplicas (%d) is below autoscaling.minReplicas (%d)" (int $v.autoscaling.maxReplicas) (int $v.autoscaling.minReplicas)) }}
{{- end }}
{{- end }}
{{- /* GPUs */}}
{{- $gpus := int $v.server.gpus }}
{{- $tp := int $v.server.tensorParallel }}
{{- if eq $v.image.kind "cpu" }}
{{- if or $gpus (ne $tp 1) $v.server.gpuType }}
{{- fail (printf "image.kind cpu runs without GPUs: server.gpus must be 0, server.tensorParallel 1 and server.gpuType empty (got %d, %d and %q)" $gpus $tp $v.server.gpuType) }}
{{- end }}
{{- else }}
{{- if eq $gpus 0 }}
{{- fail "image.kind gpu needs server.gpus >= 1 (image.kind cpu runs without GPUs)" }}
{{- end }}
{{- if mod $gpus $tp }}
{{- fail (printf "server.gpus (%d) must be a multiple of server.tensorParallel (%d): each model copy takes tensorParallel GPUs of the pod. A pod runs on one node; for more GPUs than a node has, see 'Multi-node' in deploy/README.md" $gpus $tp) }}
{{- end }}
{{- end }}
{{- /* memory: /dev/shm is memory-backed and counts against the limit */}}
{{- if ge (float64 (include "dflash.bytes" $v.server.sharedMemory)) (float64 (include "dflash.bytes" $v.server.memory)) }}
{{- fail (printf "server.sharedMemory (%s) must be below server.memory (%s): /dev/shm is memory-backed and counts against the limit" $v.server.sharedMemory $v.server.memory) }}
{{- end }}
{{- /* the build against the servers */}}
{{- $build := include "dflash.buildOptions" . | fromJson }}
{{- with $build.errors }}{{ fail (first .) }}{{ end }}
{{- $runtime := get $build "--runtime" }}
{{- $device := get $build "--device" }}
{{- with $v.model.preset }}
{{- $preset := get $contract.presets . }}
{{- if not (has $runtime $preset.runtimes) }}
{{- fail (printf "model.preset %s runs on --runtime %s only, but build.args ask for --runtime %s" . (join " or " $preset.runtimes) $runtime) }}
{{- end }}
{{- end }}
{{- if eq $v.image.kind "cpu" }}
{{- /* device auto is the CPU in the CPU image (its torch has no CUDA) */}}
{{- if or (ne $runtime "torch") (not (has $device (list "cpu" "auto"))) }}
{{- fail (printf "image.kind cpu needs the torch runtime on the CPU, but build.args ask for --runtime %s --device %s" $runtime $device) }}
{{- end }}
{{- else if and (eq $runtime "torch") (not (hasPrefix "cuda" $device)) }}
{{- fail (printf "build.args build for --device %s but the servers have GPUs: add --device cuda (or use --runtime trtllm)" $device) }}
{{- end }}
{{- if and (gt $tp 1) (ne $runtime "trtllm") }}
{{- fail (printf "server.tensorParallel %d needs --runtime trtllm in build.args: the torch runtime runs a model on one device" $tp) }}
{{- end }}
{{- if eq $runtime "trtllm" }}
{{- if not $v.server.gpuType }}
{{- fail (printf "--runtime trtllm needs server.gpuType, the nodes' GPU (%s): the build checks its quantization against it" (join ", " (keys $contract.builder.gpus | sortAlpha))) }}
{{- end }}
{{- $sm := int (get $contract.builder.gpus $v.server.gpuType) }}
{{- $quant := get $build "--quant" }}
{{- $needs := int (get $contract.builder.quantMinSm $quant) }}
{{- if lt $sm $needs }}
{{- fail (printf "build.args --quant %s does not run on server.gpuType %s (SM%d): it needs SM%d or newer" $quant $v.server.gpuType $sm $needs) }}
{{- end }}
{{- end }}
{{- end }}
