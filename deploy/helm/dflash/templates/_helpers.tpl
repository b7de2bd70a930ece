{{/*
Names, labels and the pieces every pod shares. The facts shared with Python (ports, probe paths, the drain
timeout, presets, the builder's flags) are files/contract.yaml, generated from dflash_contract and builder/.
*/}}

{{- define "dflash.contract" -}}
{{ .Files.Get "files/contract.yaml" }}
{{- end }}

{{- define "dflash.name" -}}
{{ default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release name, unless it lacks the chart's name (then <release>-dflash), or fullnameOverride. */}}
{{- define "dflash.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Selector labels of a component (server, build, metrics, model-store, test): (dict "ctx" $ "component" "server") */}}
{{- define "dflash.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dflash.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "dflash.labels" -}}
{{ include "dflash.selectorLabels" . }}
app.kubernetes.io/part-of: dflash
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* metadata: name, labels, namespace: (dict "ctx" $ "component" "server" "name" "x" "extraLabels" (dict)) */}}
{{- define "dflash.metadata" -}}
name: {{ .name }}
labels:
  {{- include "dflash.labels" . | nindent 2 }}
  {{- with .extraLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
namespace: {{ .ctx.Release.Namespace }}
{{- end }}

{{/* The model store (PVC) is mounted at /models: build B is /models/B, its Triton repository /models/B/model_repository. */}}
{{- define "dflash.buildPath" -}}
/models/{{ .Values.model.build }}
{{- end }}

{{- define "dflash.image" -}}
{{- $ref := .Values.image.repository }}
{{- if .Values.image.tag }}{{ $ref = printf "%s:%s" $ref .Values.image.tag }}{{ end }}
{{- if .Values.image.digest }}{{ $ref = printf "%s@%s" $ref .Values.image.digest }}{{ end }}
{{- $ref }}
{{- end }}

{{/* uid/gid 10001: the user deploy/docker/Dockerfile and Dockerfile.cpu create. */}}
{{- define "dflash.podBasics" -}}
serviceAccountName: {{ include "dflash.fullname" . }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  # a model store holds hundreds of GB: re-chowning it at every mount would stall pod starts
  fsGroupChangePolicy: OnRootMismatch
  seccompProfile:
    type: RuntimeDefault
{{- end }}

{{- define "dflash.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  privileged: false
  readOnlyRootFilesystem: true
  capabilities:
    drop:
    - ALL
{{- end }}

{{/* requests == limits: Guaranteed QoS, evicted last, and eligible for exclusive cores. (dict "cpu" .. "memory" .. "gpus" N) */}}
{{- define "dflash.resources" -}}
{{- $amounts := dict "cpu" (toString .cpu) "memory" (toString .memory) }}
{{- if .gpus }}{{ $_ := set $amounts "nvidia.com/gpu" (toString .gpus) }}{{ end -}}
resources:
  requests:
    {{- toYaml $amounts | nindent 4 }}
  limits:
    {{- toYaml $amounts | nindent 4 }}
{{- end }}

{{/*
The root filesystem is read-only: everything that writes caches (torch, Triton kernels, TensorRT-LLM,
Hugging Face) is pointed at /tmp, an emptyDir.
*/}}
{{- define "dflash.writableHome" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
{{- end }}

{{- define "dflash.storeVolumes" -}}
- name: models
  persistentVolumeClaim:
    claimName: {{ .ctx.Values.modelStore.claimName }}
    readOnly: {{ .readOnly }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .ctx.Values.server.tmpSize }}
{{- end }}

{{- define "dflash.placement" -}}
{{- with .Values.server.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.server.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The builder's --target: model.target (a path under /models or a hub id), else model.preset. */}}
{{- define "dflash.target" -}}
{{- default .Values.model.preset .Values.model.target }}
{{- end }}

{{/*
The Hugging Face repos the build Job downloads, as a JSON list: the preset's target and drafter unless model.*
replaces them (the contract names them by part), and model.target and model.drafter where they are hub ids
(a path starts with /, the schema's rule).
*/}}
{{- define "dflash.downloads" -}}
{{- $m := .Values.model }}
{{- $repos := list }}
{{- if $m.preset }}
{{- $preset := (get (include "dflash.contract" . | fromYaml).presets $m.preset).downloads }}
{{- if $preset.target }}{{ $repos = append $repos $preset.target }}{{ end }}
{{- if and $preset.drafter (not $m.drafter) }}{{ $repos = append $repos $preset.drafter }}{{ end }}
{{- end }}
{{- range list $m.target $m.drafter }}
{{- if and . (ne . "none") (not (hasPrefix "/" .)) }}{{ $repos = append $repos . }}{{ end }}
{{- end }}
{{- toJson $repos }}
{{- end }}

{{/*
The build Job's flags: from model.* and server.*, then build.args (checked in dflash.buildOptions).
--gpu and --tensor-parallel-size come from the servers' values, so the build and the pods cannot disagree.
*/}}
{{- define "dflash.builderArgs" -}}
{{- $args := list "--target" (include "dflash.target" .) "--output" (include "dflash.buildPath" .) }}
{{- with .Values.model.drafter }}{{ $args = concat $args (list "--drafter" .) }}{{ end }}
{{- if .Values.server.gpuType }}{{ $args = concat $args (list "--gpu" .Values.server.gpuType) }}{{ end }}
{{- if gt (int .Values.server.tensorParallel) 1 }}
{{- $args = concat $args (list "--tensor-parallel-size" (toString .Values.server.tensorParallel)) }}
{{- end }}
{{- range .Values.build.args }}{{ $args = append $args (toString .) }}{{ end }}
{{- toJson $args }}
{{- end }}

{{/* The endpoint picker's objects' name (endpoint-picker.yaml), which the InferencePool names too. */}}
{{- define "dflash.pickerName" -}}
{{ include "dflash.fullname" . }}-picker
{{- end }}

{{/* The endpoint picker's ext-proc port, where the Inference Gateway asks it for a pod (its default, 9002). */}}
{{- define "dflash.pickerGrpcPort" -}}
9002
{{- end }}

{{/* The name the servers serve the model under (the OpenAI API's model id, the metrics' model_name): the preset, or
the last part of model.target, as the build's manifest names it (dflash_contract.layout.BuildManifest.model_id). */}}
{{- define "dflash.servedModel" -}}
{{- .Values.model.preset | default (base .Values.model.target) }}
{{- end }}

{{/* Whether the servers publish their prefix caches' changes: behind the pool, unless turned off. */}}
{{- define "dflash.kvEvents" -}}
{{- if and .Values.inferencePool.enabled .Values.inferencePool.kvEvents }}true{{ end }}
{{- end }}
