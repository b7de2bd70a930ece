"""Deployment: the container images and the Helm chart deploy/helm/dflash, rendered by Helm's own engine.

No cluster and no Docker engine here. helm-python-sdk runs Helm's Go SDK in process (the same code as the
`helm` CLI, offline): the chart is linted (strict) and rendered for the defaults and every shipped values
file; its built-in objects are validated against the Kubernetes API schemas (kubernetes-validate, strict);
the Prometheus Operator objects (ServiceMonitor, PrometheusRule), whose schemas kubernetes-validate does not
carry, and the prometheus-adapter rules are checked structurally against each other and the HPA; checkov runs
on the manifests and the Dockerfiles; ports, probes, paths, presets and the build Job's flags are checked
against what the launcher and the builder actually use (dflash_contract, builder/build.py, run with --check);
the `helm test` pod's commands run against a real server.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from builder.trtllm import GPUS
from deploy.helm import contract
from deploy.ports import free_ports
from dflash_contract.layout import MANIFEST_FILE, REPOSITORY_DIR
from dflash_contract.presets import PRESETS
from dflash_contract.server import (GATEWAY_HEALTH_PATH, GATEWAY_METRICS_PATH, KV_EVENTS_PORT, LIVE_PATH,
                                    METRICS_PATH, OPENAI_API_KEY_ENV, PORTS, READY_PATH, SHUTDOWN_SECONDS)
from dflash_training import drafter_data, train_drafter
from gateway.protocol_metrics import ENGINE_TYPE, ENGINE_TYPE_LABEL, WAITING

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy/helm/dflash"
ADAPTER_VALUES = REPO / "deploy/helm/prometheus-adapter-values.yaml"
RELEASE, NAMESPACE = "dflash", "dflash"
VALUES_FILES = {p.stem: p for p in sorted((CHART / "values").glob("*.yaml"))}
# A deployment pins the image it pushed (deploy/README.md): checkov's CKV_K8S_43 requires the digest.
DIGEST = "sha256:" + "ab" * 32
API_KEY_SECRET = {"name": "dflash-openai", "key": "token"}
# A drafter's training on the CPU image, small enough to run here: 2 pods of one rank, 4 answers, 2 steps
TRAINING_HERE = ["modelStore.accessMode=ReadWriteMany", "training.data.enabled=true", "training.data.numPrompts=4",
                 "training.data.args={--max-tokens,24}", "training.train.enabled=true", "training.train.nodes=2",
                 "training.train.gpusPerNode=0",
                 "training.train.args={--device,cpu,--steps,2,--batch-size,2,--seq-len,64,--anchors,4,--draft-layers,1,"
                 "--tau-prompts,0,--eval-every,2,--save-every,2,--warmup,1,--train-vocab,512,--threads,1}"]
# What is rendered and checked (schemas, checkov, the builder's --check, ...): the defaults, every shipped
# values file, and the tests' overlays: the gateway's API key from a Secret (which the answers Job reads too),
# a torch build on H100s quantized to FP8 whose GPU type must reach the build, and a drafter's training on GPU
# nodes (the values' defaults) and on the CPU image.
RENDERINGS = {"default": ([], []),
              **{name: ([path], []) for name, path in VALUES_FILES.items()},
              "openai-api-key": ([], [f"openai.apiKeySecret.{k}={v}" for k, v in API_KEY_SECRET.items()]
                                 + ["training.data.enabled=true"]),
              "h100-fp8": ([], ["server.gpuType=h100", "build.args={--device,cuda,--quant,fp8}",
                                "network.clientNamespaces={chat-frontend}"]),
              "training-gpu": ([], ["training.data.enabled=true", "training.train.enabled=true", "training.train.args="
                                    "{--device,cuda,--dtype,bfloat16,--shard-target,--tau-prompts,0}"]),
              "training-cpu": ([VALUES_FILES["cpu"]], TRAINING_HERE),
              # behind the Inference Gateway, its proxy in another namespace, scaled by KEDA on the engine's queue
              "inference-pool": ([], ["inferencePool.enabled=true", f"inferencePool.picker.digest={DIGEST}",
                                      "inferencePool.gateway.namespace=gateways", "network.clientNamespaces={gateways}",
                                      "autoscaling.enabled=false", "autoscaling.keda.enabled=true"])}
# Kubernetes' IsValidPortName: a named container port (and a targetPort by name) is an IANA_SVC_NAME
IANA_SVC_NAME = re.compile(r"(?=.{1,15}$)(?=[-a-z0-9]*[a-z])(?!.*--)[a-z0-9]([-a-z0-9]*[a-z0-9])?")
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "InferencePool", "HTTPRoute", "ScaledObject"}
CRDS = REPO / "tests/fixtures/crds"  # the optional objects' CRDs as upstream publishes them (its README)
OLDEST_KUBERNETES = "1.29.0"  # the oldest release the chart is written for (Chart.yaml kubeVersion)
CHECKOV = REPO / ".venv" / "tools" / "bin" / "checkov"  # its own venv: see the Makefile
DOCKERFILES = {"gpu": REPO / "deploy/docker/Dockerfile", "cpu": REPO / "deploy/docker/Dockerfile.cpu"}
APP_UID = 10001  # the chart's runAsUser; the Dockerfiles create this user
QUEUE_TIME_RECORD = "dflash:queue_time_us_per_request:rate2m"  # the PrometheusRule's record
LINT_WARNING = 2  # helm's support.WarningSev; 1 is INFO (e.g. "icon is recommended")


def merge(base: dict, overlay: dict) -> dict:
    """Helm's merge of user values (-f files, then --set): maps key by key, anything else replaces."""
    merged = dict(base)
    for key, value in overlay.items():
        merged[key] = merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def user_values(files: list[Path] = (), sets: list[str] = ()) -> dict:
    """What `helm install -f FILE... --set SET...` passes: the files, then each --set parsed by Helm."""
    values = {}
    for path in files:
        values = merge(values, helm_python.values_from_yaml(Path(path).read_text()))
    for assignment in sets:
        values = merge(values, helm_python.parse_set_string(assignment))
    return values


def render(values: dict) -> dict[str, str]:
    with helm_python.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)


@dataclass
class Rendered:
    values: dict  # the release's values: the chart's defaults coalesced with the user's
    folder: Path  # one manifest per object, for checkov
    objects: list[dict]
    notes: str

    def one(self, kind: str, name: str | None = None) -> dict:
        """The object of a kind (by name where there are several); without a name, the endpoint picker's objects
        (an InferencePool's: a Deployment, a ServiceAccount of their own) are not counted."""
        found = [o for o in self.objects if o["kind"] == kind and (o["metadata"]["name"] == name if name else
                 o["metadata"]["labels"]["app.kubernetes.io/component"] != "picker")]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def all(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]


def manifests(out: dict[str, str]) -> list[dict]:
    return [doc for path, text in out.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Rendered]:
    root = tmp_path_factory.mktemp("rendered")
    out = {}
    for name, (files, sets) in RENDERINGS.items():
        values = user_values(files, [f"image.digest={DIGEST}", *sets])
        templates = render(values)
        objects = manifests(templates)
        folder = root / name
        folder.mkdir()
        for i, obj in enumerate(objects):
            (folder / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml").write_text(yaml.safe_dump(obj))
        with helm_python.Chart.load(CHART) as chart:
            coalesced = chart.merge_values(values)
        out[name] = Rendered(coalesced, folder, objects, templates[f"{CHART.name}/templates/NOTES.txt"])
    return out


def server_container(r: Rendered) -> dict:
    return r.one("Deployment")["spec"]["template"]["spec"]["containers"][0]


def job(r: Rendered, component: str = "build") -> dict:
    """The rendering's Job of a component: build, answers (the training data) or train."""
    (found,) = [o for o in r.all("Job") if o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return found


def build_command(r: Rendered) -> list[str]:
    return job(r)["spec"]["template"]["spec"]["containers"][0]["command"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def pod_labels(r: Rendered) -> dict:
    return r.one("Deployment")["spec"]["template"]["metadata"]["labels"]


def hook_pod(r: Rendered) -> dict:
    return r.one("Pod", f"{RELEASE}-test-generate")


# --- Helm: lint, schema, package ------------------------------------------------------------------------

@pytest.mark.parametrize("rendering", RENDERINGS)
def test_helm_lint_strict_reports_no_errors_and_no_warnings(rendering):
    files, sets = RENDERINGS[rendering]
    values = user_values(files, [f"image.digest={DIGEST}", *sets])
    report = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= LINT_WARNING] == [], report["messages"]


def test_lint_is_not_vacuous(tmp_path):
    broken = tmp_path / CHART.name
    shutil.copytree(CHART, broken)
    (broken / "templates" / "broken.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x\n")
    report = helm_python.lint(broken, {}, strict=True)
    assert report["errors"] or any(m["severity"] >= LINT_WARNING for m in report["messages"])


def test_every_level_of_the_schema_refuses_unknown_keys():
    schema = json.loads((CHART / "values.schema.json").read_text())

    def objects(node: dict, path: str):
        if node.get("type") == "object" and "properties" in node:
            yield path, node
            for key, child in node["properties"].items():
                yield from objects(child, f"{path}.{key}")

    found = list(objects(schema, "values"))
    assert len(found) > 10
    for path, node in found:
        if path != "values.global":
            assert node.get("additionalProperties") is False, path
    # and every value of values.yaml is described by the schema
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(values: dict, node: dict, path: str):
        for key, value in values.items():
            assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
            child = node["properties"][key]
            if isinstance(value, dict) and "properties" in child:
                walk(value, child, f"{path}.{key}")

    walk(defaults, schema, "values")


def test_the_schema_names_the_presets_and_gpus_python_knows():
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    assert schema["model"]["properties"]["preset"]["enum"] == ["", *PRESETS]
    assert schema["server"]["properties"]["gpuType"]["enum"] == ["", *GPUS]


def test_the_charts_contract_file_is_pythons():
    """Ports, probe paths, the drain timeout, presets and builder flags: generated from Python, never retyped."""
    assert contract.CONTRACT_FILE.read_text() == contract.text(), \
        "deploy/helm/dflash/files/contract.yaml is stale: run python -m deploy.helm.contract"
    data = yaml.safe_load(contract.CONTRACT_FILE.read_text())
    assert data["ports"] == PORTS and data["shutdownSeconds"] == SHUTDOWN_SECONDS
    assert set(data["presets"]) == set(PRESETS)
    check = subprocess.run([sys.executable, "-m", "deploy.helm.contract", "--check"], capture_output=True, text=True,
                           cwd=REPO, timeout=120)
    assert check.returncode == 0, check.stderr


def test_the_chart_version_is_the_projects():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert chart["apiVersion"] == "v2" and chart["appVersion"] == version


def test_package_produces_the_chart_archive_that_renders_the_same(tmp_path, rendered):
    archive = Path(helm_python.package(CHART, destination=tmp_path))
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert archive.name == f"{chart['name']}-{chart['version']}.tgz" and archive.is_file()
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for required in ("Chart.yaml", "values.yaml", "values.schema.json", "files/contract.yaml", "templates/NOTES.txt",
                     "templates/tests/test-generate.yaml", *(f"values/{p.name}" for p in VALUES_FILES.values())):
        assert f"dflash/{required}" in names, required
    with helm_python.Chart.load_archive(archive.read_bytes()) as packaged:
        out = packaged.render(user_values([], [f"image.digest={DIGEST}"]), name=RELEASE, namespace=NAMESPACE)
    assert manifests(out) == rendered["default"].objects


def test_every_rendering_renders_the_whole_deployment(rendered):
    for name, r in rendered.items():
        kinds = sorted(o["kind"] for o in r.objects)
        expected = ["Deployment", "Job", "NetworkPolicy", "NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim",
                    "Pod", "PodDisruptionBudget", "Service", "Service", "Service", "ServiceAccount"]
        if r.values["monitoring"]["enabled"]:
            expected += ["PrometheusRule", "ServiceMonitor"]
            if r.values["monitoring"]["grafanaDashboard"]["enabled"]:
                expected.append("ConfigMap")  # the dashboard (test_metrics checks its queries)
        if r.values["autoscaling"]["enabled"]:
            expected.append("HorizontalPodAutoscaler")
        if r.values["autoscaling"]["keda"]["enabled"]:
            expected.append("ScaledObject")
        if r.values["inferencePool"]["enabled"]:  # the pool, its route, and the endpoint picker with its access
            expected += ["InferencePool", "HTTPRoute", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                         "Deployment", "Service", "NetworkPolicy"]
        if r.values["training"]["data"]["enabled"]:
            expected += ["Job", "NetworkPolicy"]
        if r.values["training"]["train"]["enabled"]:
            expected += ["Job", "NetworkPolicy", "Service"]
        assert kinds == sorted(expected), name
        assert all(o["metadata"].get("namespace") == NAMESPACE for o in r.objects), name


def test_the_cpu_values_need_no_prometheus_operator_nor_gpu_nodes(rendered):
    r = rendered["cpu"]
    assert not r.all("ServiceMonitor") and not r.all("PrometheusRule")
    for pod in (r.one("Deployment")["spec"]["template"]["spec"], job(r)["spec"]["template"]["spec"]):
        assert "nodeSelector" not in pod and "tolerations" not in pod
    assert "Monitoring is off" in r.notes


def test_every_object_carries_helms_standard_labels(rendered):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    for name, r in rendered.items():
        for obj in r.objects:
            labels = obj["metadata"]["labels"]
            assert labels["helm.sh/chart"] == f"{chart['name']}-{chart['version']}", obj["metadata"]["name"]
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
            assert labels["app.kubernetes.io/instance"] == RELEASE
            assert labels["app.kubernetes.io/version"] == chart["appVersion"]
            assert labels["app.kubernetes.io/name"] == "dflash" and labels["app.kubernetes.io/component"]


def test_names_follow_the_release(tmp_path):
    objects = manifests(render(user_values([], ["image.digest=" + DIGEST])))
    with helm_python.Chart.load(CHART) as chart:
        other = manifests(chart.render({}, name="prod", namespace="inference"))
    deployment = next(o for o in other if o["kind"] == "Deployment")
    assert deployment["metadata"]["name"] == "prod-dflash" and deployment["metadata"]["namespace"] == "inference"
    assert {o["metadata"]["name"] for o in other if o["kind"] == "Service"} == \
        {"prod-dflash", "prod-dflash-headless", "prod-dflash-metrics"}
    rule = next(o for o in other if o["kind"] == "PrometheusRule")
    assert 'namespace="inference", service="prod-dflash-metrics"' in rule["spec"]["groups"][0]["rules"][0]["expr"]
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"} == {RELEASE}


# --- Kubernetes schemas, monitoring -------------------------------------------------------------------

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
    adapter_rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    served = {}
    for adapter_rule in adapter_rules:
        series = adapter_rule["seriesQuery"].split("{")[0]
        assert re.fullmatch(adapter_rule["name"]["matches"], series)
        assert set(adapter_rule["resources"]["overrides"]) == {"namespace", "pod"}  # Pods metrics
        served[adapter_rule["name"]["as"]] = series
    # the engine gauge the adapter serves is the one the dflash model exports
    assert f'"{served["dflash_queued_sequences"]}"' in model_py
    for name, r in rendered.items():
        if r.values["autoscaling"]["enabled"]:
            hpa = r.one("HorizontalPodAutoscaler")
            assert hpa["spec"]["scaleTargetRef"]["name"] == r.one("Deployment")["metadata"]["name"]
            used = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
            assert used <= served.keys(), name
            assert "replicas" not in r.one("Deployment")["spec"]  # the HPA owns the replica count
        elif not r.values["autoscaling"]["keda"]["enabled"]:  # KEDA's HPA would own it too
            assert r.one("Deployment")["spec"]["replicas"] == r.values["server"]["replicas"]
        if not r.values["monitoring"]["enabled"]:
            continue
        metrics_service = r.one("Service", f"{RELEASE}-metrics")
        monitor = r.one("ServiceMonitor")
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics_service["metadata"]["labels"].items()
        assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [
            ("metrics", METRICS_PATH), ("openai", GATEWAY_METRICS_PATH)]  # tritonserver's, the gateway's
        assert [p["name"] for p in metrics_service["spec"]["ports"]] == ["metrics", "openai"]
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
        release = f'namespace="{NAMESPACE}", service="{RELEASE}-metrics"'
        series = f'{release}, model="{r.values["autoscaling"]["queueModel"]}"'
        # the engine's own queue time, else Triton's for the queue model
        engine, triton = records[QUEUE_TIME_RECORD].split("\nor\n")
        assert f"dflash_request_queue_time_seconds_sum{{{release}}}" in engine
        assert f"nv_inference_queue_duration_us{{{series}}}" in triton
        # the recorded series is what the adapter serves to the HPA
        assert served["dflash_queue_time_us_per_request"] == QUEUE_TIME_RECORD
        alert = next(e for e in group["rules"] if e.get("alert") == "DFlashQueueTimeHigh")
        queue_time, *waiting = alert["expr"].split("\nor\n")  # the mean wait, or the requests still waiting
        assert queue_time.endswith(f"> {2 * round(r.values['autoscaling']['queueTimeTargetMs'] * 1000)}")
        target = r.values["autoscaling"].get("queuedSequencesTarget")
        assert waiting == ([] if target is None else [f"avg(dflash_queued_sequences{{{release}}}) > {2 * target:g}"])


# --- behind the Inference Gateway: the pool, its endpoint picker, the route, KEDA -----------------------------------

def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the CRD's openAPIV3Schema, made strict: an unknown field is refused, as `kubectl apply
    --validate=strict` refuses it (a CRD's server would prune it silently)."""
    def strict(schema):
        if isinstance(schema, dict):
            if "properties" in schema and "additionalProperties" not in schema \
                    and not schema.get("x-kubernetes-preserve-unknown-fields"):
                schema = {**schema, "additionalProperties": False}
            return {key: strict(value) for key, value in schema.items()}
        return [strict(item) for item in schema] if isinstance(schema, list) else schema

    schemas = {}
    for path in CRDS.glob("*.yaml"):
        for crd in yaml.safe_load_all(path.read_text()):
            for version in crd["spec"]["versions"]:
                api = f"{crd['spec']['group']}/{version['name']}"
                schemas[api, crd["spec"]["names"]["kind"]] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


def crd_errors(obj: dict, schemas: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(schemas[obj["apiVersion"], obj["kind"]])
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


def test_the_pool_the_route_and_the_scaled_object_validate_against_their_crds(rendered):
    schemas = crd_schemas()
    checked = set()
    for name, r in rendered.items():
        for obj in r.objects:
            if obj["kind"] in ("InferencePool", "HTTPRoute", "ScaledObject"):
                assert not crd_errors(obj, schemas), (name, obj["kind"], crd_errors(obj, schemas))
                checked.add(obj["kind"])
    assert checked == {"InferencePool", "HTTPRoute", "ScaledObject"}
    pool = rendered["inference-pool"].one("InferencePool")  # not vacuous: a misspelt field is refused
    misspelt = copy.deepcopy(pool)
    misspelt["spec"]["targetPort"] = misspelt["spec"].pop("targetPorts")
    assert any("targetPort" in e for e in crd_errors(misspelt, schemas))


def test_the_pool_routes_to_the_servers_openai_port_and_its_picker_reads_their_metrics(rendered):
    r = rendered["inference-pool"]
    pool, route, server = r.one("InferencePool"), r.one("HTTPRoute"), r.one("Deployment")
    assert pool["spec"]["selector"]["matchLabels"] == server["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": PORTS["openai"]}]
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    assert route["spec"]["parentRefs"][0]["namespace"] == "gateways"
    picker_name = pool["spec"]["endpointPickerRef"]["name"]
    service, picker = r.one("Service", picker_name), r.one("Deployment", picker_name)
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    (container,) = picker["spec"]["template"]["spec"]["containers"]
    assert f"--pool-name={pool['metadata']['name']}" in container["args"] and container["image"].endswith(DIGEST)
    config = yaml.safe_load(r.one("ConfigMap", picker_name)["data"]["config.yaml"])
    source = next(p for p in config["plugins"] if p["type"] == "metrics-data-source")
    assert source["parameters"]["path"] == GATEWAY_METRICS_PATH  # where the gateway serves the vllm:* gauges
    weights = {p["pluginRef"]: p["weight"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert weights == {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3}
    role = r.one("Role", picker_name)
    assert {"pods", "inferencepools"} <= {res for rule in role["rules"] for res in rule["resources"]}
    # KEDA scales on the waiting requests the gateways serve, and owns the replica count
    (trigger,) = r.one("ScaledObject")["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and f"{WAITING}{{" in trigger["metadata"]["query"]
    assert "replicas" not in server["spec"] and not r.all("HorizontalPodAutoscaler")


def test_behind_the_pool_the_servers_publish_their_prefix_caches_to_the_picker_alone(rendered):
    """Where llm-d's precise prefix scorer dials each pod of the pool (kv-events socketPort), under the topic it knows
    the pod by (kv@<pod IP>:<the pool's target port>@<the model the requests name>); the NetworkPolicy lets this
    release's picker in on that port, and nobody else."""
    r = rendered["inference-pool"]
    (target,) = r.one("InferencePool")["spec"]["targetPorts"]
    container = server_container(r)
    assert f"--kv-events-port={KV_EVENTS_PORT}" in container["command"]
    assert f"--kv-events-topic=kv@$(POD_IP):{target['number']}@qwen3-8b" in container["command"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    picker_labels = r.one("Deployment", f"{RELEASE}-picker")["spec"]["template"]["metadata"]["labels"]
    rules = r.one("NetworkPolicy", f"{RELEASE}-server")["spec"]["ingress"]
    (events,) = [rule for rule in rules if {"port": KV_EVENTS_PORT, "protocol": "TCP"} in rule["ports"]]
    (source,) = events["from"]
    assert list(source) == ["podSelector"] and source["podSelector"]["matchLabels"].items() <= picker_labels.items()
    assert events["ports"] == [{"port": KV_EVENTS_PORT, "protocol": "TCP"}]
    # without the pool, or with the events turned off: no port, no flag
    for sets in (["inferencePool.enabled=false"], ["inferencePool.enabled=true", "inferencePool.kvEvents=false"]):
        objects = manifests(render(user_values(sets=[f"image.digest={DIGEST}", *sets])))
        (server,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == RELEASE]
        assert not any("kv-events" in arg for arg in server["spec"]["template"]["spec"]["containers"][0]["command"])


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
        events = {"kv-events": KV_EVENTS_PORT} if r.values["inferencePool"]["enabled"] else {}  # the picker's
        assert {p["name"]: p["containerPort"] for p in server["ports"]} == {**PORTS, **events}
        assert all(IANA_SVC_NAME.fullmatch(p["name"]) for p in server["ports"]), server["ports"]
        # startup: the gateway's health, 200 only once Triton is ready and the gateway listens; readiness
        # stays Triton's own
        assert server["startupProbe"]["httpGet"] == {"path": GATEWAY_HEALTH_PATH, "port": "openai"}
        assert server["readinessProbe"]["httpGet"] == {"path": READY_PATH, "port": "http"}
        assert server["livenessProbe"]["httpGet"] == {"path": LIVE_PATH, "port": "http"}
        startup = server["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= r.values["server"]["startupBudgetSeconds"]
        pod = r.one("Deployment")["spec"]["template"]["spec"]
        # recovery from a dead engine: dflash-serve (the command) exits, the kubelet restarts the container
        assert server["command"][0] == "dflash-serve" and pod["restartPolicy"] == "Always"
        pre_stop = int(server["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pre_stop == r.values["server"]["preStopSeconds"]
        assert pod["terminationGracePeriodSeconds"] > pre_stop + SHUTDOWN_SECONDS, name
        for service in r.all("Service"):
            if service["metadata"]["labels"]["app.kubernetes.io/component"] in ("train", "picker"):
                continue  # the training pods' rendezvous (test_the_training_job_is_...), the endpoint picker's ports
            for port in service["spec"]["ports"]:
                assert port["targetPort"] == port["name"] and port["port"] == PORTS[port["name"]]
            assert service["spec"]["selector"].items() <= pod_labels(r).items()
        allowed = {p["port"] for policy in r.all("NetworkPolicy") if "server" in policy["metadata"]["name"]
                   for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert allowed == set(PORTS.values()) | set(events.values())
        command = server["command"]
        assert all(f"--{port_name}-port={port}" in command for port_name, port in PORTS.items())


def test_the_openai_gateway_is_exposed_to_the_clients_only(rendered):
    for name, r in rendered.items():
        openai = {"name": "openai", "port": PORTS["openai"], "targetPort": "openai", "protocol": "TCP",
                  "appProtocol": "http"}
        client = r.one("Service", RELEASE)
        assert openai in client["spec"]["ports"], name
        assert [p["name"] for p in client["spec"]["ports"]] == ["http", "grpc", "openai"]
        # the headless Service is for gRPC client-side balancing, the metrics Service for Prometheus only
        for suffix, ports in (("-headless", ["grpc", "http"]), ("-metrics", ["metrics", "openai"])):
            assert [p["name"] for p in r.one("Service", RELEASE + suffix)["spec"]["ports"]] == ports, name
        assert r.one("Service", RELEASE + "-headless")["spec"]["clusterIP"] == "None"

        policy = r.one("NetworkPolicy", f"{RELEASE}-server")
        clients, monitoring, *events = policy["spec"]["ingress"]  # events: the picker's (the test above)
        assert {p["port"] for p in clients["ports"]} == {PORTS[p] for p in ("http", "grpc", "openai")}
        assert all(p["protocol"] == "TCP" for p in clients["ports"])
        namespaces = [peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                      for peer in clients["from"] if "namespaceSelector" in peer]
        assert {"podSelector": {}} in clients["from"] and namespaces == r.values["network"]["clientNamespaces"]
        # tritonserver's metrics port, and the gateway's own /metrics on its port
        assert [p["port"] for p in monitoring["ports"]] == [PORTS["metrics"], PORTS["openai"]]
        assert monitoring["from"] == [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": r.values["monitoring"]["namespace"]}}}]
        assert policy["spec"]["egress"] == []  # the gateway calls tritonserver over the pod's loopback
    assert rendered["h100-fp8"].values["network"]["clientNamespaces"] == ["chat-frontend"]  # not vacuous


def test_the_pods_name_the_metrics_dialect_their_gateway_speaks(rendered):
    """An Inference Gateway endpoint picker reads each pod's engine type from this label and scrapes the metric
    names of that engine: the names gateway/protocol_metrics.py serves."""
    for name, r in rendered.items():
        assert pod_labels(r)[ENGINE_TYPE_LABEL] == ENGINE_TYPE == "vllm", name


def test_the_gateways_api_key_comes_from_a_secret_only_when_asked(rendered):
    for name, r in rendered.items():
        server = server_container(r)
        deployment = r.one("Deployment")
        keyed = [e for e in server["env"] if e["name"] == OPENAI_API_KEY_ENV]
        if name != "openai-api-key":  # off by default, in every values file
            assert not keyed and "annotations" not in deployment["metadata"], name
            continue
        assert keyed == [{"name": OPENAI_API_KEY_ENV,
                          "valueFrom": {"secretKeyRef": {**API_KEY_SECRET, "optional": False}}}]
        # the key itself is never in a manifest, nor passed as a flag
        assert not any(a.startswith("--openai-api-key") for a in server["command"])
        # checkov's CKV_K8S_35 (secrets as files) is skipped for it, with the reason (README: "Security checks skipped")
        annotations = deployment["metadata"]["annotations"]
        assert list(annotations) == ["checkov.io/skip1"] and annotations["checkov.io/skip1"].startswith("CKV_K8S_35=")
        # offline there is no Secret to look up, so no checksum of it (install and upgrade add one)
        assert "annotations" not in deployment["spec"]["template"]["metadata"]
        # only the server reads it: the build Job and the test pod have no key
        answers = job(r, "answers")["spec"]["template"]["spec"]
        for pod in (job(r)["spec"]["template"]["spec"], hook_pod(r)["spec"], answers):
            assert not any(e["name"] == OPENAI_API_KEY_ENV or "valueFrom" in e
                           for c in pod["containers"] + pod.get("initContainers", []) for e in c.get("env", []))
        # the answers Job reads the key from the Secret mounted as a file, into OPENAI_API_KEY for its process only
        assert {"name": "openai-key", "secret": {"secretName": API_KEY_SECRET["name"], "defaultMode": 0o440,
                                                 "items": [{"key": API_KEY_SECRET["key"], "path": "key"}]}} \
            in answers["volumes"]
        (container,) = answers["containers"]
        assert {"name": "KEY_FILE", "value": "/var/run/secrets/openai/key"} in container["env"]
        assert 'OPENAI_API_KEY=$(cat "$KEY_FILE")' in container["command"][2]
        assert "key: Secret dflash-openai" in r.notes


def test_the_launcher_reads_the_api_key_variable_the_chart_sets():
    # dflash-serve (deploy/serve.py or the gateway it starts) must read the variable the Deployment sets
    sources = [p for p in REPO.glob("*/**/*.py") if p.parts[len(REPO.parts)] not in ("tests", ".venv")
               and "helm" not in p.parts]
    assert any(OPENAI_API_KEY_ENV in p.read_text() for p in sources), f"no launcher code reads {OPENAI_API_KEY_ENV}"


def _usage(module: str, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", module, *args, "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=60).stdout


def test_the_launcher_accepts_the_servers_flags(rendered):
    usage = _usage("deploy.serve")
    for name, r in rendered.items():
        command = server_container(r)["command"]
        assert command[0] == "dflash-serve"
        for arg in command[2:]:
            assert arg.split("=")[0] in usage, (name, arg)


def test_the_server_reads_the_repository_the_build_job_writes(rendered):
    for name, r in rendered.items():
        job_pod = job(r)["spec"]["template"]["spec"]
        server_pod = r.one("Deployment")["spec"]["template"]["spec"]
        output = flag(build_command(r), "--output")
        assert output == f"/models/{r.values['model']['build']}"
        command = server_container(r)["command"]
        assert command[1] == f"{output}/{REPOSITORY_DIR}", name
        wait = server_pod["initContainers"][0]
        assert wait["env"] == [{"name": "BUILD", "value": output}] and f"$BUILD/{MANIFEST_FILE}" in wait["command"][-1]
        claim = r.one("PersistentVolumeClaim")["metadata"]["name"]
        for pod, read_only in ((job_pod, False), (server_pod, True)):
            (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
            assert volume["persistentVolumeClaim"] == {"claimName": claim, "readOnly": read_only}
            for c in pod["containers"]:
                (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
                assert output.startswith(mount["mountPath"] + "/") and mount["readOnly"] == read_only


def test_the_build_job_downloads_what_the_model_needs(rendered):
    for name, r in rendered.items():
        model = r.values["model"]
        job_pod = job(r)["spec"]["template"]["spec"]
        downloaded = [c["command"][-1] for c in job_pod.get("initContainers", [])]
        expected = []
        if model["preset"]:  # a GGUF target ships in a package, a drafter of this repository in the image
            preset = PRESETS[model["preset"]]
            expected += [] if preset.gguf else [preset.target]
            expected += [] if model["drafter"] or (REPO / preset.drafter).is_dir() else [preset.drafter]
        # model.target and model.drafter as hub ids (a path on the model store starts with /)
        expected += [ref for ref in (model["target"], model["drafter"]) if ref not in ("", "none") and ref[0] != "/"]
        assert downloaded == expected, name
        assert all(c["command"][:2] == ["hf", "download"] for c in job_pod.get("initContainers", []))
        # the GPU is requested by the build container only, never while checkpoints download
        assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in job_pod.get("initContainers", []))
        gpus = job_pod["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", "0")
        assert int(gpus) == r.values["server"]["gpus"], name


def build_job(sets: list[str]) -> dict:
    """The build Job the chart renders for the defaults with these --set expressions."""
    return next(o for o in manifests(render(user_values([], sets))) if o["kind"] == "Job"
                and o["metadata"]["labels"]["app.kubernetes.io/component"] == "build")


def test_the_hf_token_is_a_mounted_file(rendered):
    pod = build_job([f"image.digest={DIGEST}", "build.hfTokenSecret=hf-token"])["spec"]["template"]["spec"]
    assert {"name": "hf-token", "secret": {"secretName": "hf-token", "defaultMode": 0o440,
                                           "items": [{"key": "token", "path": "token"}]}} in pod["volumes"]
    for download in pod["initContainers"]:
        assert {"name": "HF_TOKEN_PATH", "value": "/var/run/secrets/huggingface/token"} in download["env"]
        assert not any("valueFrom" in e for e in download["env"])


def _job(sets: list[str]) -> str:
    return build_job(sets)["metadata"]["name"]


def test_a_changed_build_job_is_a_new_job():
    """A Job's pod template is immutable: unchanged values keep the Job (an upgrade leaves it alone), any change
    makes a new one (an upgrade creates it and Helm deletes the old one), so `helm upgrade` never patches it."""
    first = _job(["model.build=qwen3-8b-v1"])
    assert first == _job(["model.build=qwen3-8b-v1"]) and re.fullmatch(r"dflash-build-qwen3-8b-v1-[0-9a-f]{6}", first)
    assert first != _job([f"image.digest={DIGEST}"]) and first != _job(["build.args={--device,cuda}"])
    assert _job(["model.build=qwen3-8b-v2"]).startswith("dflash-build-qwen3-8b-v2-")


def _check_build(command: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """builder/build.py's own validation of a Job's command, here: no checkpoints, no GPU (`--check`)."""
    assert command[0] == "dflash-build"
    args = [str(tmp_path) + a[len("/models"):] if a.startswith("/models/") else a for a in command[1:]]
    return subprocess.run([sys.executable, str(REPO / "builder/build.py"), *args, "--check"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_the_builder_accepts_every_build_jobs_command(rendered, tmp_path):
    for name, r in rendered.items():
        command = build_command(r)
        proc = _check_build(command, tmp_path)
        assert proc.returncode == 0, f"{name}: {shlex.join(command)}\n{proc.stderr}"
        assert proc.stdout.startswith("check: ok: "), proc.stdout
        # the servers' values reach the build: the GPU type and the tensor-parallel degree
        server = r.values["server"]
        assert ("--gpu" in command) == bool(server["gpuType"]), name
        if server["gpuType"]:
            assert flag(command, "--gpu") == server["gpuType"] and f"--gpu {server['gpuType']}" in proc.stdout
        tp = int(flag(command, "--tensor-parallel-size")) if "--tensor-parallel-size" in command else 1
        assert tp == server["tensorParallel"], name
    assert "--tensor-parallel-size 2" in _check_build(build_command(rendered["tp2"]), tmp_path).stdout


def test_the_builders_check_is_not_vacuous(tmp_path):
    """A command the chart lets through (the builder's KV-cache rule is its own) is still refused by --check."""
    job = build_job(["server.gpuType=a100", "build.args={--runtime,trtllm,--kv-cache,fp8}", "model.preset=qwen3-8b"])
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    proc = _check_build(command, tmp_path)
    assert proc.returncode == 2 and "--kv-cache fp8 needs --quant" in proc.stderr


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_the_images_agree_with_the_chart(rendered, kind):
    path = DOCKERFILES[kind]
    steps = dockerfile(path)
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in steps if i == "ARG" and "=" in a}
    base = args["BASE_IMAGE"]
    assert re.fullmatch(r"[\w./-]+:[\w.-]+", base) and not base.endswith(":latest"), base  # pinned tag
    assert int(args["APP_UID"]) == APP_UID
    assert dict(steps)["USER"] == "${APP_UID}:${APP_UID}"
    exposed = {int(p) for i, a in steps if i == "EXPOSE" for p in a.split()}
    assert exposed == set(PORTS.values())
    health = next(a for i, a in steps if i == "HEALTHCHECK")
    assert f"localhost:{PORTS['http']}{READY_PATH}" in health
    entrypoint = json.loads(next(a for i, a in steps if i == "ENTRYPOINT"))
    manifest = next(r for r in rendered.values() if r.values["image"]["kind"] == kind)
    assert server_container(manifest)["command"][0] == entrypoint[0] == "dflash-serve"
    pod = manifest.one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsGroup"] == APP_UID
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


# --- helm test ---------------------------------------------------------------------------------------

def test_the_helm_test_pod_is_a_hook_in_the_servers_image(rendered):
    for name, r in rendered.items():
        pod = hook_pod(r)
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        (wait,), (generate,) = pod["spec"]["initContainers"], pod["spec"]["containers"]
        assert wait["image"] == generate["image"] == server_container(r)["image"]
        url = f"--url={RELEASE}:{PORTS['grpc']}"  # through the client Service, which its NetworkPolicy admits
        assert wait["command"][:2] == ["dflash-client", "health"] and url in wait["command"]
        assert generate["command"][:2] == ["dflash-client", "generate"] and url in generate["command"]
        assert ("--raw" in generate["command"]) == ("trtllm" in build_command(r)), name  # the LLM-API model
        assert pod["spec"]["restartPolicy"] == "Never"
        assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "test"  # no Service selects it


def test_the_helm_test_pods_commands_stream_an_answer_from_a_real_server(rendered, default_server):
    """The hook's two commands, as the pod runs them, against the embedded default served here."""
    pod = hook_pod(rendered["cpu"])["spec"]
    bin_dir = Path(sys.executable).parent
    for container in (*pod["initContainers"], *pod["containers"]):
        command = [a.replace(f"{RELEASE}:{PORTS['grpc']}", default_server.grpc_url) for a in container["command"]]
        proc = subprocess.run([str(bin_dir / command[0]), *command[1:]], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{container['name']}: {proc.stderr}"
    assert proc.stdout.strip(), "the generate command streamed no text"


def test_notes_say_how_to_reach_the_server(rendered):
    notes = rendered["default"].notes
    for port in ("http", "grpc", "openai"):  # the metrics port is Prometheus's
        assert f":{PORTS[port]}" in notes
    assert f"helm test {RELEASE} -n {NAMESPACE}" in notes and "WARNING: image.digest" not in notes
    assert "WARNING: image.digest is not set" in render({})[f"{CHART.name}/templates/NOTES.txt"]
    assert "chat-frontend" in rendered["h100-fp8"].notes


# --- training a drafter -------------------------------------------------------------------------------

TRAININGS = ("training-gpu", "training-cpu")


def test_the_training_job_is_one_torchrun_rendezvous_across_its_pods(rendered):
    for name in TRAININGS:
        r = rendered[name]
        train, training = job(r, "train"), r.values["training"]
        spec, pod = train["spec"], train["spec"]["template"]["spec"]
        nodes, gpus = training["train"]["nodes"], training["train"]["gpusPerNode"]
        assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nodes
        # one failed pod fails the Job (the others cannot go on without it); an evicted one is recreated
        assert spec["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
        disrupted = {"type": "DisruptionTarget", "status": "True"}
        assert spec["podFailurePolicy"]["rules"] == [{"action": "Ignore", "onPodConditions": [disrupted]}]
        # pod i is <job>-i.<service>: the headless Service has the Job's name, selects its pods, and is the subdomain
        service = r.one("Service", train["metadata"]["name"])
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": train["metadata"]["name"]}
        assert pod["subdomain"] == service["metadata"]["name"]
        (container,) = pod["containers"]
        command = container["command"]
        assert command[:2] == ["sh", "-c"] and command[3] == "torchrun" and "JOB_COMPLETION_INDEX == 0" in command[2]
        endpoint = flag_value(command, "--rdzv-endpoint")
        port = service["spec"]["ports"][0]["port"]
        assert endpoint == f"{train['metadata']['name']}-0.{service['metadata']['name']}:{port}"
        assert container["ports"] == [{"name": "rendezvous", "containerPort": port, "protocol": "TCP"}]
        assert flag_value(command, "--nnodes") == str(nodes)
        assert flag_value(command, "--nproc-per-node") == str(max(gpus, 1))
        assert int(container["resources"]["limits"].get("nvidia.com/gpu", 0)) == gpus
        assert ("nodeSelector" in pod) == bool(gpus), name
        trainer = command[command.index("dflash_training.train_drafter") + 1:]
        assert trainer[:3] == [f"--target={r.values['model']['preset']}",
                               f"--responses=/models/training/{training['responses']}",
                               f"--output=/models/training/{training['run']}"]
        assert train_drafter.build_parser().parse_args(trainer).output == f"/models/training/{training['run']}"
        # the pods wait for the build (the target's download) and the answers Job's completion
        wait = pod["initContainers"][0]["command"][-1]
        assert f'"$BUILD/{MANIFEST_FILE}"' in wait and '"$ANSWERS/.complete"' in wait
        answers = job(r, "answers")["spec"]["template"]["spec"]["containers"][0]
        assert f"--server=http://{RELEASE}:{PORTS['openai']}/v1" in answers["command"]
        assert "KEY_FILE" not in {e["name"] for e in answers["env"]}  # no key asked for
        # the training pods reach each other only; the answers pod, the servers' gRPC and OpenAI ports only
        policies = {p["metadata"]["name"]: p["spec"] for p in r.all("NetworkPolicy")}
        peers = [{"podSelector": {"matchLabels": pod_selector(r, "train")}}]
        assert policies[f"{RELEASE}-train"]["ingress"] == [{"from": peers}]
        assert policies[f"{RELEASE}-train"]["egress"][1] == {"to": peers}
        assert policies[f"{RELEASE}-answers"]["ingress"] == []
        assert [p["port"] for p in policies[f"{RELEASE}-answers"]["egress"][1]["ports"]] == [PORTS["grpc"],
                                                                                            PORTS["openai"]]


def flag_value(command: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in command if a.startswith(name + "=")]
    return value


def pod_selector(r: Rendered, component: str) -> dict:
    return {"app.kubernetes.io/name": "dflash", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": component}


def test_a_changed_training_job_is_a_new_job(rendered):
    first = job(rendered["training-gpu"], "train")["metadata"]["name"]
    assert re.fullmatch(r"dflash-train-drafter-v1-[0-9a-f]{6}", first)
    again = manifests(render(user_values([], ["image.digest=" + DIGEST, *RENDERINGS["training-gpu"][1]])))
    changed = manifests(render(user_values([], ["image.digest=" + DIGEST, *RENDERINGS["training-gpu"][1],
                                                "training.train.maxRestarts=1"])))
    names = [[o["metadata"]["name"] for o in objects if o["kind"] == "Job"
              and o["metadata"]["labels"]["app.kubernetes.io/component"] == "train"] for objects in (again, changed)]
    assert names[0] == [first] and names[1] != [first]


def test_the_training_jobs_commands_answer_and_train_here(rendered, default_server, default_build, tmp_path):
    """The answers Job's and the training Job's containers as the pods run them (sh included), here: the answers
    through the gateway of the embedded default served here, then the training Job's 2 pods as 2 processes on this
    host, each with its JOB_COMPLETION_INDEX, meeting at the rendered rendezvous (its host made this one)."""
    r = rendered["training-cpu"]
    models = tmp_path / "models"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}

    def here(arg: str) -> str:
        return (arg.replace("/models/", f"{models}/")
                .replace(f"{RELEASE}:{PORTS['grpc']}", default_server.grpc_url)
                .replace(f"http://{RELEASE}:{PORTS['openai']}", default_server.gateway.url))

    def run(container: dict, **extra) -> subprocess.CompletedProcess:
        pod_env = {e["name"]: here(e["value"]) for e in container.get("env", []) if e["name"] in ("ANSWERS", "BUILD")}
        proc = subprocess.run([here(a) for a in container["command"]], env={**env, **pod_env, **extra},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{container['name']}: {proc.stderr[-3000:]}"
        return proc

    answers = job(r, "answers")["spec"]["template"]["spec"]
    run(answers["initContainers"][0])  # the server is ready
    run(answers["containers"][0])
    responses = models / "training" / r.values["training"]["responses"]
    assert (responses / ".complete").is_file()
    assert len(drafter_data.read_responses(responses)) == r.values["training"]["data"]["numPrompts"]

    train = job(r, "train")["spec"]["template"]["spec"]
    run(train["initContainers"][0], BUILD=str(default_build))  # returns at once: the build and the answers are there
    (container,) = train["containers"]
    (port,) = free_ports(1)
    endpoint = flag_value(container["command"], "--rdzv-endpoint")
    command = [here(a).replace(endpoint, f"127.0.0.1:{port}") for a in container["command"]]
    pods = [subprocess.Popen(command, env={**env, "JOB_COMPLETION_INDEX": str(i)}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for i in range(r.values["training"]["train"]["nodes"])]
    logs = [p.communicate(timeout=900)[0] for p in pods]
    assert [p.returncode for p in pods] == [0, 0], "\n".join(log[-3000:] for log in logs)
    out = models / "training" / r.values["training"]["run"]
    curve = [json.loads(line) for line in (out / "learning_curve.jsonl").read_text().splitlines()]
    assert [c["step"] for c in curve] == [2] and curve[0]["world_size"] == 2
    assert (out / "drafter" / "config.json").is_file()


# --- bad input ---------------------------------------------------------------------------------------

# --set expressions (Helm's own parser) -> what the refusal must say: every one names the value
BAD_VALUES = [
    (["server.replicas=0"], "server.replicas is 0 but autoscaling is enabled"),
    (["autoscaling.minReplicas=0"], "/autoscaling/minReplicas"),
    (["autoscaling.minReplicas=4", "autoscaling.maxReplicas=2"], r"maxReplicas \(2\) is below"),
    (["server.gpus=3", "server.tensorParallel=2", "server.gpuType=h100", "build.args={--runtime,trtllm}"],
     r"server.gpus \(3\) must be a multiple of server.tensorParallel \(2\)"),
    (["server.gpus=1", "server.tensorParallel=3", "server.gpuType=h100", "build.args={--runtime,trtllm}"],
     r"server.gpus \(1\) must be a multiple of server.tensorParallel \(3\)"),
    (["server.gpus=2", "server.tensorParallel=2"], "server.tensorParallel 2 needs --runtime trtllm"),
    (["server.tensorParallel=0"], "/server/tensorParallel"),
    (["modelStore.claimName="], "/modelStore/claimName"),
    (["modelStore.claimName=null"], "claimName"),
    (["modelStore.accessMode=ReadWriteOnce"], "allows one node .* up to 8 replicas"),
    (["modelStore.accessMode=ReadOnlyMany"], "the build Job cannot write"),
    (["modelStore.accessMode=NFS"], "/modelStore/accessMode"),
    (["server.maxSurge=0"], "maxSurge and server.maxUnavailable are both 0"),
    (['autoscaling.queueModel=dflash"} or vector(1'], "/autoscaling/queueModel"),
    (["autoscaling.queueTimeTargetMs=0"], "/autoscaling/queueTimeTargetMs"),
    (["server.sharedMemory=64Gi"], r"server.sharedMemory \(64Gi\) must be below server.memory \(64Gi\)"),
    (["server.sharedMemory=65536Mi"], "server.sharedMemory .* must be below server.memory"),
    (["server.memory=lots"], "/server/memory"),
    (["build.args={--device,cpu}"], "build for --device cpu but the servers have GPUs"),
    (["build.args={--device=cpu}"], "build for --device cpu but the servers have GPUs"),
    (["build.args={--quantize,fp8}"], "builder/build.py does not know --quantize"),
    (["build.args={--quant,int3}"], "--quant int3: invalid choice"),
    (["build.args={--quant=int3}"], "--quant int3: invalid choice"),
    (["build.args={--output,/elsewhere}"], "must not set --output: it comes from model.build"),
    (["build.args={--gpu,h100}"], "must not set --gpu: it comes from server.gpuType"),
    (["build.args={--tensor-parallel-size,2}"], "must not set --tensor-parallel-size: it comes from server.tensorParallel"),
    (["build.args={--dry-run}"], "must not set --dry-run"),
    (["build.args={--device}"], "--device needs a value"),
    (["build.args={cuda}"], '"cuda" is not a flag'),
    (["build.args=--device cuda"], "/build/args"),
    (["build.args={--runtime,trtllm}"], "--runtime trtllm needs server.gpuType"),
    (["build.args={--runtime,trtllm,--quant,nvfp4}", "server.gpuType=h100"],
     r"--quant nvfp4 does not run on server.gpuType h100 \(SM90\): it needs SM100"),
    (["model.preset=qwen3-coder-30b-a3b"], "model.preset qwen3-coder-30b-a3b runs on --runtime trtllm only"),
    (["server.gpuType=h1000"], "/server/gpuType"),
    (["autoscaling.enabled=no way"], "/autoscaling/enabled"),
    (["model.preset=gpt-5"], "/model/preset"),
    (["model.build=Qwen3_8B"], "/model/build"),
    (["model.target=acme/llama"], r"model.target \(acme/llama\) and model.preset \(qwen3-8b\) both name the target"),
    (["model.preset="], "model.preset or model.target must name the target"),
    (["model.preset=", "model.target=acme/llama"], "model.target acme/llama needs model.drafter"),
    (["model.preset=", "model.target=/etc/llama", "model.drafter=none"], "/model/target"),  # outside the store
    (["model.preset=", "model.target=/models/../etc/llama", "model.drafter=none"], "/model/target"),
    (["model.preset=", "model.target=/models/.hf-cache/llama", "model.drafter=none"], "/model/target"),
    (["model.preset=", "model.target=llama", "model.drafter=none"], "/model/target"),  # not a path, not org/name
    (["model.drafter=./drafter"], "/model/drafter"),
    (["model.drafter=/models/qwen3-8b-v1/drafter"],
     "model.drafter /models/qwen3-8b-v1/drafter is inside the build's own folder /models/qwen3-8b-v1"),
    (["build.args={--drafter,none}"], "must not set --drafter: it comes from model.drafter"),
    (["build.args={--target,qwen3-4b}"], "must not set --target: it comes from model.preset or model.target"),
    ([f"model.build={'v' * 45}"], "would exceed 63 characters"),
    (["image.digest=latest"], "/image/digest"),
    (["image.kind=tpu"], "/image/kind"),
    (["server.gpus=0"], "image.kind gpu needs server.gpus >= 1"),
    (["server.tensorParallel=two"], "/server/tensorParallel"),
    (["sever.gpus=2"], "additional properties 'sever' not allowed"),
    (["server.gpu=2"], "additional properties 'gpu' not allowed"),
    (["server.nodeSelector={gpu}"], "/server/nodeSelector"),
    (["server.nodeSelector.nvidia\\.com/gpu\\.present=true"], "/server/nodeSelector"),
    (["server.tolerations.key=nvidia.com/gpu"], "/server/tolerations"),
    (["network.clientNamespaces={Bad_Name}"], "/network/clientNamespaces"),
    (["monitoring.enabled=maybe"], "/monitoring/enabled"),
    (["openai.apiKeySecret=dflash-openai"], "/openai/apiKeySecret"),
    (["openai.apiKeySecret.secret=dflash-openai"], "additional properties 'secret' not allowed"),
    (["openai.apiKeySecret.name=OpenAI_Key"], "/openai/apiKeySecret/name"),
    (["openai.apiKeySecret.name={dflash-openai}"], "/openai/apiKeySecret/name"),
    ([f"openai.apiKeySecret.name={'s' * 254}"], "/openai/apiKeySecret/name"),
    (["openai.apiKeySecret.name=dflash-openai", "openai.apiKeySecret.key="], "/openai/apiKeySecret/key"),
    (["openai.apiKeySecret.name=dflash-openai", "openai.apiKeySecret.key=api/key"], "/openai/apiKeySecret/key"),
    (["training.train.enabled=true", "training.train.args={--device,cuda,--learning-rate,1e-4}"],
     "training.train.args: dflash-train-drafter does not know --learning-rate"),
    (["training.train.enabled=true", "training.train.args={--device,cuda,--output=/elsewhere}"],
     "training.train.args must not set --output: it comes from training.run"),
    (["training.train.enabled=true", "training.train.args={--dtype,bfloat16}"],
     "gpusPerNode is 8 but training.train.args train on --device cpu: add --device cuda"),
    (["training.train.enabled=true", "training.train.gpusPerNode=0"],
     "train on --device cuda but training.train.gpusPerNode is 0"),
    (["training.train.enabled=true", "modelStore.accessMode=ReadWriteOnce", "autoscaling.enabled=false",
      "server.replicas=1"], "training.train.nodes is 2 but modelStore.accessMode is ReadWriteOnce"),
    (["training.train.enabled=true", "training.train.sharedMemory=512Gi"],
     r"training.train.sharedMemory \(512Gi\) must be below training.train.memory"),
    (["training.train.enabled=true", f"training.run={'r' * 30}", f"fullnameOverride={'f' * 20}"],
     "the last training pod's hostname .* would exceed 63 characters"),
    (["training.train.enabled=true", "training.train.nodes=0"], "/training/train/nodes"),
    (["training.data.enabled=true", "training.data.args={--server,http://elsewhere/v1}"],
     "training.data.args must not set --server: it comes from this release's gateway"),
    (["training.data.enabled=true", "training.data.args={--max-new-token,8}"],
     "dflash-drafter-data does not know --max-new-token"),
    (["training.data.enabled=true", "training.run=responses-v1"], "training.responses and training.run are both"),
    (["training.run=Drafter_V1"], "/training/run"),
    (["training.data.enable=true"], "additional properties 'enable' not allowed"),
    (["autoscaling.keda.enabled=true"], "autoscaling.enabled and autoscaling.keda.enabled are both on"),
    (["autoscaling.enabled=false", "autoscaling.keda.enabled=true", "monitoring.enabled=false"],
     "autoscaling.keda.enabled reads the engine's queue from Prometheus"),
    (["inferencePool.enabled=true", "inferencePool.gateway.namespace=gateways"],
     "inferencePool.gateway.namespace gateways is not in network.clientNamespaces"),
    (["inferencePool.enabled=true", "inferencePool.picker.weights.queue=0", "inferencePool.picker.weights.prefixCache=0",
      "inferencePool.picker.weights.kvCacheUtilization=0"], "inferencePool.picker.weights are all 0"),
    (["inferencePool.picker.failureMode=FailSometimes"], "/inferencePool/picker/failureMode"),
    (["inferencePool.picker.digest=latest"], "/inferencePool/picker/digest"),
]


@pytest.mark.parametrize("sets,message", BAD_VALUES, ids=[" ".join(sets) for sets, _ in BAD_VALUES])
def test_values_that_make_no_sense_are_refused(sets, message):
    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError), match=message) as refused:
        render(user_values([], sets))
    if refused.type is helm_python.HelmRenderError:  # every refusal of the templates comes from one place
        assert "templates/deployment.yaml" in str(refused.value)


def test_a_set_without_a_value_is_refused_by_helms_parser():
    with pytest.raises(helm_python.HelmValuesError, match="server"):
        helm_python.parse_set_string("server")


def test_cpu_values_refuse_gpus():
    for sets, message in [(["server.gpus=1"], "image.kind cpu runs without GPUs"),
                          (["training.train.enabled=true", "training.train.nodes=1"],
                           "image.kind cpu runs without GPUs: training.train.gpusPerNode must be 0"),
                          (["build.args={--device,cuda}"], "image.kind cpu needs the torch runtime on the CPU")]:
        with pytest.raises(helm_python.HelmRenderError, match=message):
            render(user_values([VALUES_FILES["cpu"]], sets))


def test_the_schema_alone_refuses_an_unknown_key():
    """As `helm install` does before rendering anything (validate_schema is Helm's own check)."""
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(chart.merge_values({}))
        with pytest.raises(helm_python.HelmValuesError, match="'replica' not allowed"):
            chart.validate_schema(chart.merge_values({"server": {"replica": 3}}))


# --- your own model -------------------------------------------------------------------------------------------

def test_a_custom_model_is_built_and_trained_for_from_its_own_target_and_drafter(rendered):
    r = rendered["custom-model"]
    model = r.values["model"]
    command = build_command(r)
    assert flag(command, "--target") == model["target"] == "acme/llama-3.1-8b-support" and not model["preset"]
    assert flag(command, "--drafter") == model["drafter"] and model["drafter"].startswith("/models/")
    # the hub id is downloaded, into the model store's Hugging Face cache as a preset's are; the path is there
    (download,) = job(r)["spec"]["template"]["spec"]["initContainers"]
    assert download["command"] == ["hf", "download", model["target"]]
    assert {"name": "HF_HOME", "value": "/models/.hf-cache"} in download["env"]
    assert f"DFlash {model['target']} with drafter {model['drafter']} (build {model['build']})" in r.notes
    # the training Jobs answer with and train for the same target
    objects = manifests(render(user_values([VALUES_FILES["custom-model"]], [
        f"image.digest={DIGEST}", "training.data.enabled=true", "training.train.enabled=true"])))
    for component in ("answers", "train"):
        (trained,) = [o for o in objects if o["kind"] == "Job"
                      and o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
        assert f"--target={model['target']}" in trained["spec"]["template"]["spec"]["containers"][0]["command"]


def test_a_presets_target_takes_a_drafter_of_ones_own():
    """E.g. the drafter the chart's training exported: the preset's target is downloaded, its drafter is not."""
    pod = build_job([f"image.digest={DIGEST}", "model.drafter=/models/training/drafter-v1/drafter"])
    command = pod["spec"]["template"]["spec"]["containers"][0]["command"]
    assert flag(command, "--target") == "qwen3-8b"
    assert flag(command, "--drafter") == "/models/training/drafter-v1/drafter"
    assert [c["command"][-1] for c in pod["spec"]["template"]["spec"]["initContainers"]] == ["Qwen/Qwen3-8B"]


def test_the_builder_checks_a_custom_targets_heads_against_the_charts_tensor_parallelism(tmp_path):
    """The chart cannot read a checkpoint; the Job's own command under `build.py --check` reads the target's
    config.json on the model store (here tmp_path) and refuses a tensor-parallel size its heads do not split by."""
    from dflash_runtime.checkpoint import resolve_target

    target = tmp_path / "checkpoints" / "my-smollm2"  # SmolLM2's 9 attention heads, 3 KV heads
    target.mkdir(parents=True)
    shutil.copy(resolve_target("smollm2-135m")[0] / "config.json", target)
    sets = ["model.preset=", "model.target=/models/checkpoints/my-smollm2",
            "model.drafter=/models/checkpoints/my-smollm2-dflash", "build.args={--runtime,trtllm}",
            "server.gpuType=h100"]

    def check(gpus: int) -> subprocess.CompletedProcess:
        job_ = build_job([*sets, f"server.gpus={gpus}", f"server.tensorParallel={gpus}"])
        return _check_build(job_["spec"]["template"]["spec"]["containers"][0]["command"], tmp_path)

    refused = check(2)
    assert refused.returncode == 2, refused.stdout
    assert f"--tensor-parallel-size 2 does not split {target}'s 9 attention heads (3 KV heads)" in refused.stderr
    accepted = check(3)
    assert accepted.returncode == 0 and "--tensor-parallel-size 3" in accepted.stdout, accepted.stderr
