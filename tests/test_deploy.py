"""Deployment: the container images and the Kubernetes manifests rendered by deploy/k8s/render.py.

No cluster and no Docker engine here. Every overlay is rendered; its built-in objects are validated
against the Kubernetes API schemas (kubernetes-validate, strict); the Prometheus Operator objects
(ServiceMonitor, PrometheusRule), whose schemas kubernetes-validate does not carry, and the
prometheus-adapter rules are checked structurally against each other and the HPA; checkov runs on the
manifests and the Dockerfiles; ports, probes and paths are checked against what the launcher
and the builder actually use (dflash_contract, builder/options.py).
"""
from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from deploy.k8s import render
from deploy.k8s.render import RenderError, load_values
from dflash_contract.layout import MANIFEST_FILE, REPOSITORY_DIR
from dflash_contract.presets import PRESETS
from dflash_contract.server import GATEWAY_HEALTH_PATH, LIVE_PATH, METRICS_PATH, PORTS, READY_PATH, SHUTDOWN_SECONDS

REPO = Path(__file__).resolve().parent.parent
OVERLAYS = {"default": [], **{p.stem: [p] for p in sorted((REPO / "deploy/k8s/values").glob("*.yaml"))}}
# What is rendered and checked (schemas, checkov, ...): every overlay, and the defaults with the OpenAI
# gateway's API key from a Secret (off by default, so no overlay has it).
API_KEY_SECRET = {"name": "dflash-openai", "key": "token"}
RENDERINGS = {**{name: (overlays, []) for name, overlays in OVERLAYS.items()},
              "openai-api-key": ([], [f"openai.apiKeySecret.{k}={v}" for k, v in API_KEY_SECRET.items()])}
# Kubernetes' IsValidPortName: a named container port (and a targetPort by name) is an IANA_SVC_NAME
IANA_SVC_NAME = re.compile(r"(?=.{1,15}$)(?=[-a-z0-9]*[a-z])(?!.*--)[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# A deployment pins the image it pushed (deploy/README.md): checkov's CKV_K8S_43 requires the digest.
DIGEST = "sha256:" + "ab" * 32
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
OLDEST_KUBERNETES = "1.29.0"  # the oldest release the manifests are written for (deploy/README.md)
CHECKOV = REPO / ".venv" / "tools" / "bin" / "checkov"  # its own venv: see the Makefile
DOCKERFILES = {"gpu": REPO / "deploy/docker/Dockerfile", "cpu": REPO / "deploy/docker/Dockerfile.cpu"}


@dataclass
class Rendered:
    values: dict
    folder: Path
    objects: list[dict]
    adapter: dict

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [o for o in self.objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def all(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Rendered]:
    root = tmp_path_factory.mktemp("rendered")
    out = {}
    for name, (overlays, sets) in RENDERINGS.items():
        values = load_values(overlays, [f"image.digest={DIGEST}", *sets])
        folder = root / name
        render.write(values, folder)
        objects = [yaml.safe_load(f.read_text()) for f in sorted(folder.glob("*.yaml"))]
        adapter = yaml.safe_load((folder / "prometheus-adapter" / "values.yaml").read_text())
        out[name] = Rendered(values, folder, objects, adapter)
    return out


def server_container(r: Rendered) -> dict:
    return r.one("Deployment")["spec"]["template"]["spec"]["containers"][0]


def build_command(r: Rendered) -> list[str]:
    return r.one("Job")["spec"]["template"]["spec"]["containers"][0]["command"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


# --- schemas ----------------------------------------------------------------------------------------

def test_every_overlay_renders_the_whole_deployment(rendered):
    for name, r in rendered.items():
        kinds = sorted(o["kind"] for o in r.objects)
        expected = ["Deployment", "Job", "Namespace", "NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim",
                    "PodDisruptionBudget", "PrometheusRule", "Service", "Service", "Service", "ServiceAccount",
                    "ServiceMonitor"]
        if r.values["autoscaling"]["enabled"]:
            expected = sorted(expected + ["HorizontalPodAutoscaler"])
        assert kinds == expected, name


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, latest_version()])
def test_builtin_objects_validate_against_the_kubernetes_api_schema(rendered, version):
    for name, r in rendered.items():
        for obj in r.objects:
            if obj["kind"] in CRD_KINDS:
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} at {'.'.join(map(str, e.path))}: "
                            f"{e.message} (Kubernetes {version})")


def test_schema_validation_is_not_vacuous(rendered):
    deployment = copy.deepcopy(rendered["default"].one("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5  # a typo
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(deployment, OLDEST_KUBERNETES, strict=True)


def _balanced(expr: str) -> bool:
    depth = {"(": 0, "{": 0, "[": 0}
    closing = {")": "(", "}": "{", "]": "["}
    for ch in re.sub(r'"[^"]*"', "", expr):
        if ch in depth:
            depth[ch] += 1
        elif ch in closing:
            depth[closing[ch]] -= 1
            if depth[closing[ch]] < 0:
                return False
    return not any(depth.values())


def test_monitoring_objects_fit_the_services_the_hpa_and_the_adapter(rendered):
    """CRD objects, checked structurally: kubernetes-validate has no schema for them."""
    model_py = (REPO / "model_repository/dflash/1/model.py").read_text()
    for name, r in rendered.items():
        metrics_service = r.one("Service", f"{r.values['name']}-metrics")
        monitor = r.one("ServiceMonitor")
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics_service["metadata"]["labels"].items()
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in metrics_service["spec"]["ports"]}
        assert endpoint["path"] == METRICS_PATH
        for obj in (monitor, r.one("PrometheusRule")):  # what Prometheus selects them by
            assert r.values["monitoring"]["prometheusLabels"].items() <= obj["metadata"]["labels"].items()

        rule = r.one("PrometheusRule")
        assert rule["apiVersion"] == "monitoring.coreos.com/v1"
        (group,) = rule["spec"]["groups"]
        for entry in group["rules"]:
            assert ("record" in entry) != ("alert" in entry), entry
            assert isinstance(entry["expr"], str) and _balanced(entry["expr"]), entry["expr"]
            assert re.fullmatch(r"\d+[smh]", entry.get("for", "1m")), entry
        records = {e["record"]: e["expr"] for e in group["rules"] if "record" in e}
        queue_model = f'model="{r.values["autoscaling"]["queueModel"]}"'
        assert "nv_inference_queue_duration_us" in records[render.QUEUE_TIME_RECORD] and \
            queue_model in records[render.QUEUE_TIME_RECORD]

        adapter_rules = r.adapter["rules"]["custom"]
        served = {}
        for adapter_rule in adapter_rules:
            series = adapter_rule["seriesQuery"].split("{")[0]
            assert re.fullmatch(adapter_rule["name"]["matches"], series)
            assert set(adapter_rule["resources"]["overrides"]) == {"namespace", "pod"}  # Pods metrics
            served[adapter_rule["name"]["as"]] = series
        # every series the adapter serves is recorded by the rule or exported by the dflash model
        assert served[render.QUEUE_TIME_METRIC] in records
        assert f'"{served[render.QUEUED_METRIC]}"' in model_py

        if r.values["autoscaling"]["enabled"]:
            hpa = r.one("HorizontalPodAutoscaler")
            assert hpa["spec"]["scaleTargetRef"]["name"] == r.one("Deployment")["metadata"]["name"]
            used = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
            assert used <= served.keys(), name
            assert "replicas" not in r.one("Deployment")["spec"]  # the HPA owns the replica count


# --- checkov --------------------------------------------------------------------------------------

def _checkov_reports(output: str) -> list[dict]:
    data = json.loads(output)
    return data if isinstance(data, list) else [data]


def test_checkov_passes_on_the_manifests_and_the_dockerfiles(rendered, tmp_path):
    assert CHECKOV.is_file(), f"{CHECKOV} is missing: run `make install` (it installs checkov in its own venv)"
    scanned = tmp_path / "scan"
    for name, r in rendered.items():
        shutil.copytree(r.folder, scanned / name)
    for kind, dockerfile in DOCKERFILES.items():  # copied with their inline skip comments
        (scanned / "docker" / kind).mkdir(parents=True)
        shutil.copy(dockerfile, scanned / "docker" / kind / "Dockerfile")
    proc = subprocess.run([str(CHECKOV), "-d", str(scanned), "--framework", "kubernetes", "dockerfile",
                           "--skip-download", "--compact", "-o", "json"],
                          capture_output=True, text=True, timeout=300)
    reports = _checkov_reports(proc.stdout)
    assert {rep["check_type"] for rep in reports} == {"kubernetes", "dockerfile"}, proc.stderr[-2000:]
    failed = [f"{c['check_id']} {c['resource']} ({c['file_path']})" for rep in reports
              for c in rep["results"]["failed_checks"]]
    assert not failed, "checkov failed:\n" + "\n".join(failed)
    assert sum(rep["summary"]["passed"] for rep in reports) > 500  # it did look at everything
    assert not any(rep["summary"]["parsing_errors"] for rep in reports)
    # A skipped check must be explained in deploy/README.md.
    skipped = {c["check_id"] for rep in reports for c in rep["results"]["skipped_checks"]}
    readme = (REPO / "deploy/README.md").read_text()
    assert all(check in readme for check in skipped), skipped


# --- one source of truth: launcher, builder, images ---------------------------------------------------

def test_ports_and_probes_are_the_launchers(rendered):
    for name, r in rendered.items():
        server = server_container(r)
        assert {p["name"]: p["containerPort"] for p in server["ports"]} == PORTS
        assert all(IANA_SVC_NAME.fullmatch(p["name"]) for p in server["ports"]), server["ports"]
        # startup: the gateway's health, 200 only once Triton is ready and the gateway listens (render.py);
        # readiness stays Triton's own
        assert server["startupProbe"]["httpGet"] == {"path": GATEWAY_HEALTH_PATH, "port": "openai"}
        assert server["readinessProbe"]["httpGet"] == {"path": READY_PATH, "port": "http"}
        assert server["livenessProbe"]["httpGet"] == {"path": LIVE_PATH, "port": "http"}
        startup = server["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= r.values["server"]["startupBudgetSeconds"]
        pod = r.one("Deployment")["spec"]["template"]["spec"]
        # recovery from a dead engine: dflash-serve (the command) exits, the kubelet restarts the container
        assert server["command"][0] == "dflash-serve" and pod["restartPolicy"] == "Always"
        pre_stop = int(server["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] > pre_stop + SHUTDOWN_SECONDS, name
        for service in r.all("Service"):
            for port in service["spec"]["ports"]:
                assert port["targetPort"] == port["name"] and port["port"] == PORTS[port["name"]]
            assert service["spec"]["selector"].items() <= pod_labels(r).items()
        allowed = {p["port"] for policy in r.all("NetworkPolicy") if "server" in policy["metadata"]["name"]
                   for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert allowed == set(PORTS.values())
        command = server["command"]
        assert all(f"--{port_name}-port={port}" in command for port_name, port in PORTS.items())


def test_the_openai_gateway_is_exposed_to_the_clients_only(rendered):
    for name, r in rendered.items():
        openai = {"name": "openai", "port": PORTS["openai"], "targetPort": "openai", "protocol": "TCP",
                  "appProtocol": "http"}
        client = r.one("Service", r.values["name"])
        assert openai in client["spec"]["ports"], name
        assert [p["name"] for p in client["spec"]["ports"]] == ["http", "grpc", "openai"]
        # the headless Service is for gRPC client-side balancing, the metrics Service for Prometheus only
        for suffix, ports in (("-headless", ["grpc", "http"]), ("-metrics", ["metrics"])):
            assert [p["name"] for p in r.one("Service", r.values["name"] + suffix)["spec"]["ports"]] == ports, name

        policy = r.one("NetworkPolicy", f"{r.values['name']}-server")
        clients, monitoring = policy["spec"]["ingress"]
        assert {p["port"] for p in clients["ports"]} == {PORTS[p] for p in ("http", "grpc", "openai")}
        assert all(p["protocol"] == "TCP" for p in clients["ports"])
        namespaces = [peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                      for peer in clients["from"] if "namespaceSelector" in peer]
        assert {"podSelector": {}} in clients["from"] and namespaces == r.values["network"]["clientNamespaces"]
        assert [p["port"] for p in monitoring["ports"]] == [PORTS["metrics"]]  # not the gateway
        assert policy["spec"]["egress"] == []  # the gateway calls tritonserver over the pod's loopback


def test_client_namespaces_reach_the_gateway():
    policy = render.server_network_policy(load_values([], ["network.clientNamespaces=[chat-frontend]"]))
    clients = policy["spec"]["ingress"][0]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "chat-frontend"}}} in clients["from"]
    assert {"port": PORTS["openai"], "protocol": "TCP"} in clients["ports"]


def test_the_gateways_api_key_comes_from_a_secret_only_when_asked(rendered):
    for name, r in rendered.items():
        server = server_container(r)
        deployment = r.one("Deployment")
        keyed = [e for e in server["env"] if e["name"] == render.OPENAI_API_KEY_ENV]
        if name != "openai-api-key":  # off by default, in every overlay
            assert not keyed and "annotations" not in deployment["metadata"], name
            continue
        assert keyed == [{"name": render.OPENAI_API_KEY_ENV,
                          "valueFrom": {"secretKeyRef": {**API_KEY_SECRET, "optional": False}}}]
        # the key itself is never in a manifest, nor passed as a flag
        assert not any(a.startswith("--openai-api-key") for a in server["command"])
        # checkov's CKV_K8S_35 (secrets as files) is skipped for it, with the reason (README: "Security checks skipped")
        annotations = deployment["metadata"]["annotations"]
        assert list(annotations) == ["checkov.io/skip1"] and annotations["checkov.io/skip1"].startswith("CKV_K8S_35=")
        # only the server reads it: the build Job has no key
        job_pod = r.one("Job")["spec"]["template"]["spec"]
        assert not any(e["name"] == render.OPENAI_API_KEY_ENV
                       for c in job_pod["containers"] + job_pod.get("initContainers", []) for e in c["env"])


def test_the_launcher_reads_the_api_key_variable_the_manifests_set():
    # dflash-serve (deploy/serve.py or the gateway it starts) must read the variable the Deployment sets
    sources = [p for p in REPO.glob("*/**/*.py") if p.parts[len(REPO.parts)] not in ("tests", ".venv")
               and "k8s" not in p.parts]
    assert any(render.OPENAI_API_KEY_ENV in p.read_text() for p in sources), \
        f"no launcher code reads {render.OPENAI_API_KEY_ENV}"
    usage = subprocess.run([sys.executable, "-m", "deploy.serve", "--help"], capture_output=True, text=True,
                           cwd=REPO, timeout=60).stdout
    assert "--openai-api-key" in usage and "--openai-port" in usage


def pod_labels(r: Rendered) -> dict:
    return r.one("Deployment")["spec"]["template"]["metadata"]["labels"]


def test_the_server_reads_the_repository_the_build_job_writes(rendered):
    for name, r in rendered.items():
        job_pod = r.one("Job")["spec"]["template"]["spec"]
        server_pod = r.one("Deployment")["spec"]["template"]["spec"]
        output = flag(build_command(r), "--output")
        command = server_container(r)["command"]
        repository = command[1]
        assert repository == f"{output}/{REPOSITORY_DIR}", name
        wait = server_pod["initContainers"][0]
        assert wait["env"] == [{"name": "BUILD", "value": output}] and f"$BUILD/{MANIFEST_FILE}" in wait["command"][-1]
        claim = r.one("PersistentVolumeClaim")["metadata"]["name"]
        for pod, read_only in ((job_pod, False), (server_pod, True)):
            (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
            assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": read_only}
            for c in pod["containers"]:
                (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
                assert output.startswith(mount["mountPath"] + "/") and mount["readOnly"] == read_only


def test_the_build_job_downloads_what_the_preset_needs(rendered):
    for name, r in rendered.items():
        preset = PRESETS[r.values["model"]["preset"]]
        job_pod = r.one("Job")["spec"]["template"]["spec"]
        downloaded = [c["command"][-1] for c in job_pod.get("initContainers", [])]
        expected = [] if preset.gguf else [preset.target]
        if not (REPO / preset.drafter).is_dir():
            expected.append(preset.drafter)
        assert downloaded == expected, name
        assert all(c["command"][:2] == ["hf", "download"] for c in job_pod.get("initContainers", []))
        # the GPU is requested by the build container only, never while checkpoints download
        assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in job_pod.get("initContainers", []))


def test_a_changed_build_job_is_a_new_job():
    """Jobs are immutable: re-applying unchanged values keeps the Job, any change makes a new one."""
    def job(sets):
        return render.build_job(load_values([], sets))["metadata"]["name"]

    first = job(["model.build=qwen3-8b-v1"])
    assert first == job(["model.build=qwen3-8b-v1"]) and first.startswith("dflash-build-qwen3-8b-v1-")
    assert first != job([f"image.digest={DIGEST}"]) and first != job(["build.args=[--device, cuda]"])


def test_the_builder_accepts_the_build_jobs_command(rendered, tmp_path):
    """The CPU overlay's Job command, run as a --dry-run by builder/build.py, with the model store here."""
    r = rendered["cpu"]
    command = build_command(r)
    assert command[0] == "dflash-build"
    args = [a.replace(render.MODEL_STORE, str(tmp_path), 1) if a.startswith(render.MODEL_STORE) else a
            for a in command[1:]]
    proc = subprocess.run([sys.executable, str(REPO / "builder/build.py"), *args, "--dry-run"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"{tmp_path}/{r.values['model']['build']}/{REPOSITORY_DIR}" in proc.stdout


def test_the_launcher_accepts_the_cpu_servers_flags(rendered):
    command = server_container(rendered["cpu"])["command"]
    assert command[0] == "dflash-serve"
    usage = subprocess.run([sys.executable, "-m", "deploy.serve", "--help"], capture_output=True, text=True,
                           cwd=REPO, timeout=60).stdout
    for arg in command[2:]:
        assert arg.split("=")[0] in usage, arg


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_images_agree_with_the_manifests(rendered, kind):
    path = DOCKERFILES[kind]
    steps = dockerfile(path)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in steps if i == "ARG" and "=" in a}
    base = args["BASE_IMAGE"]
    assert re.fullmatch(r"[\w./-]+:[\w.-]+", base) and not base.endswith(":latest"), base  # pinned tag
    assert int(args["APP_UID"]) == render.APP_UID
    assert dict(steps)["USER"] == "${APP_UID}:${APP_UID}"
    exposed = {int(p) for i, a in steps if i == "EXPOSE" for p in a.split()}
    assert exposed == set(PORTS.values())
    health = next(a for i, a in steps if i == "HEALTHCHECK")
    assert f"localhost:{PORTS['http']}{READY_PATH}" in health
    entrypoint = json.loads(next(a for i, a in steps if i == "ENTRYPOINT"))
    assert entrypoint == [render.SERVER_COMMAND]
    manifest = next(r for r in rendered.values() if r.values["image"]["kind"] == kind)
    assert server_container(manifest)["command"][0] == entrypoint[0]
    cmd = json.loads(next(a for i, a in steps if i == "CMD"))
    assert any(a.endswith(f"/{REPOSITORY_DIR}") for a in cmd)
    if kind == "gpu":
        assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-trtllm-python-py3", base), base
    # every COPY source exists and is let through by the Dockerfile's own .dockerignore
    ignore = path.with_name(path.name + ".dockerignore").read_text().split()
    copied = [s for i, a in steps if i == "COPY" for s in shlex.split(a)[:-1]]
    for source in copied:
        assert (REPO / source).exists(), f"{path.name} copies {source}, which does not exist"
        assert f"!{source}" in ignore, f"{source} is excluded from the build context by .dockerignore"
    # and every package of the project is copied (the editable install finds what is there)
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages <= {source.rstrip("/") for source in copied}, packages


# --- bad input ---------------------------------------------------------------------------------------

BAD_VALUES = [
    (["server.replicas=0"], "server.replicas is 0 but autoscaling is enabled"),
    (["autoscaling.minReplicas=0"], r"autoscaling.minReplicas must be >= 1"),
    (["autoscaling.minReplicas=4", "autoscaling.maxReplicas=2"], "maxReplicas .2. is below"),
    (["server.gpus=3", "server.tensorParallel=2", "build.args=[--runtime, trtllm]"],
     r"tensorParallel \(2\) does not divide server.gpus \(3\)"),
    (["server.gpus=2", "server.tensorParallel=4", "build.args=[--runtime, trtllm]"],
     r"tensorParallel \(4\) does not divide server.gpus \(2\)"),
    (["server.gpus=2", "server.tensorParallel=2"], "needs --runtime trtllm"),
    (["modelStore.claimName="], "modelStore.claimName is missing"),
    (["modelStore.claimName=null"], "modelStore.claimName is missing"),
    (["modelStore.accessMode=ReadWriteOnce"], "allows one node .* up to 8 replicas"),
    (["server.maxSurge=0"], "maxSurge and server.maxUnavailable are both 0"),
    (['autoscaling.queueModel=dflash"} or vector(1'], "queueModel must be a Triton model name"),
    (["server.sharedMemory=64Gi"], "sharedMemory .* must be below server.memory"),
    (["server.memory=lots"], "server.memory must be a memory quantity"),
    (["build.args=[--device, cpu]"], "build for --device cpu but the servers have GPUs"),
    (["build.args=[--quantize, fp8]"], "builder/build.py does not know --quantize"),
    (["build.args=[--quant, int3]"], "invalid choice: 'int3'"),
    (["build.args=[--output, /elsewhere]"], "must not set --output"),
    (["build.args=--device cuda"], "build.args must be a list"),
    (["autoscaling.enabled=no way"], "autoscaling.enabled must be true or false"),
    (["model.preset=gpt-5"], "model.preset 'gpt-5' is not a preset"),
    (["model.build=Qwen3_8B"], "model.build must be a DNS label"),
    ([f"model.build={'v' * 45}"], "would exceed 63 characters"),
    (["image.digest=latest"], "image.digest must look like sha256"),
    (["image.kind=tpu"], "image.kind must be one of gpu, cpu"),
    (["server.gpus=0"], "image.kind gpu needs server.gpus >= 1"),
    (["server.tensorParallel=two"], "server.tensorParallel must be an integer"),
    (["sever.gpus=2"], "unknown value 'sever'"),
    (["server.nodeSelector=[gpu]"], "server.nodeSelector must map label names to strings"),
    (["server.nodeSelector={nvidia.com/gpu.present: true}"], "must map label names to strings"),
    (["server.tolerations={key: nvidia.com/gpu}"], "server.tolerations must be a list"),
    (["network.clientNamespaces=[Bad_Name]"], "network.clientNamespaces must be a list of namespace names"),
    (["server"], "expected KEY.PATH=VALUE"),
    (["openai.apiKeySecret=dflash-openai"], "openai.apiKeySecret must be a mapping"),
    (["openai.apiKeySecret.secret=dflash-openai"], "unknown value 'openai.apiKeySecret.secret'"),
    (["openai.apiKeySecret.name=OpenAI_Key"], "apiKeySecret.name must be the name of a Secret in namespace dflash"),
    (["openai.apiKeySecret.name=[dflash-openai]"], "openai.apiKeySecret.name must be the name of a Secret"),
    ([f"openai.apiKeySecret.name={'s' * 254}"], "openai.apiKeySecret.name must be the name of a Secret"),
    (["openai.apiKeySecret.name=dflash-openai", "openai.apiKeySecret.key="],
     "openai.apiKeySecret.key must be a key of Secret 'dflash-openai'.*got None"),
    (["openai.apiKeySecret.name=dflash-openai", "openai.apiKeySecret.key=api/key"],
     "openai.apiKeySecret.key must be a key of Secret"),
]


@pytest.mark.parametrize("sets,message", BAD_VALUES, ids=[" ".join(sets) for sets, _ in BAD_VALUES])
def test_values_that_make_no_sense_are_refused(sets, message):
    with pytest.raises(RenderError, match=message):
        load_values([], sets)


def test_cpu_values_refuse_gpus():
    with pytest.raises(RenderError, match="image.kind cpu runs without GPUs"):
        load_values(OVERLAYS["cpu"], ["server.gpus=1"])


def test_the_command_line_renders_warns_and_refuses(tmp_path):
    script = [sys.executable, str(REPO / "deploy/k8s/render.py")]
    ok = subprocess.run([*script, "-f", str(OVERLAYS["cpu"][0]), "-o", str(tmp_path / "out")],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "image.digest is not set" in ok.stderr
    assert (tmp_path / "out" / "prometheus-adapter" / "values.yaml").is_file()
    again = subprocess.run([*script, "-f", str(OVERLAYS["cpu"][0]), "-o", str(tmp_path / "out")],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "is not empty" in again.stderr
    bad = subprocess.run([*script, "--set", "server.gpus=3", "--set", "server.tensorParallel=2", "-o",
                          str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "does not divide" in bad.stderr and not (tmp_path / "bad").exists()
