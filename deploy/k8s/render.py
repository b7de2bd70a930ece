"""Render the Kubernetes manifests of a DFlash deployment: plain YAML from validated values.

    python deploy/k8s/render.py -o rendered/                                 # deploy/k8s/values.yaml
    python deploy/k8s/render.py -f deploy/k8s/values/tp2.yaml --set model.build=coder-v2 -o rendered/
    kubectl apply -f rendered/

A small renderer rather than Helm or kustomize because the facts the manifests must agree with live
in Python: ports, probe paths, the drain timeout, the build layout and the presets in dflash_contract,
the builder's flags in builder/options.py (none of them imports torch). They are imported here, not
retyped, and values that make no sense are refused with a message before anything is written.

Writes one file per resource (kubectl applies them in file-name order) and, under prometheus-adapter/,
the rules to merge into your prometheus-adapter Helm release (they are not a Kubernetes object).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import re
import sys
from pathlib import Path

import yaml

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from builder.options import build_parser
from dflash_contract.layout import MANIFEST_FILE, REPO_ROOT, REPOSITORY_DIR
from dflash_contract.presets import PRESETS
from dflash_contract.server import (GATEWAY_HEALTH_PATH, LIVE_PATH, METRICS_PATH, OPENAI_API_KEY_ENV, PORTS, READY_PATH,
                                    SHUTDOWN_SECONDS)

DEFAULTS = Path(__file__).resolve().parent / "values.yaml"
# The model store (PVC) is mounted here in the build Job and the servers: build B is <MODEL_STORE>/B,
# its Triton repository <MODEL_STORE>/B/<REPOSITORY_DIR>.
MODEL_STORE = "/models"
HF_HOME = f"{MODEL_STORE}/.hf-cache"  # downloaded checkpoints survive rebuilds
DFLASH_CACHE = f"{MODEL_STORE}/.dflash-cache"  # the embedded GGUF target, converted once
HF_TOKEN_DIR = "/var/run/secrets/huggingface"
APP_UID = 10001  # the user deploy/docker/Dockerfile and Dockerfile.cpu create
# Both image kinds run dflash-serve, for its drain on SIGTERM (in-flight streams end with a final
# response); it runs the container's own tritonserver where there is one.
IMAGE_KINDS = ("gpu", "cpu")
SERVER_COMMAND = "dflash-serve"
# The OpenAI-compatible gateway that dflash-serve runs beside tritonserver (PORTS["openai"]) reads its optional
# API key from OPENAI_API_KEY_ENV (--openai-api-key would show the key in the pod spec).

# Pods metrics that prometheus-adapter serves to the HPA (rules: adapter_values).
QUEUE_TIME_METRIC = "dflash_queue_time_us_per_request"
QUEUE_TIME_RECORD = "dflash:queue_time_us_per_request:rate2m"
QUEUED_METRIC = "dflash_queued_sequences"  # the engine gauge of model_repository/dflash/1/model.py

JOB_HASH_LENGTH = 6
FREE_FORM = {"nodeSelector", "prometheusLabels"}  # maps an overlay replaces whole instead of merging
DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # a Secret's name
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")  # a key of a Secret's data
MEMORY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


class RenderError(ValueError):
    pass


# --- values: defaults, overlays, --set, validation ------------------------------------------------

def load_values(overlays: list[Path] = (), sets: list[str] = ()) -> dict:
    """deploy/k8s/values.yaml, then each overlay, then each KEY=VALUE; validated."""
    values = yaml.safe_load(DEFAULTS.read_text())
    for path in overlays:
        values = merge(values, yaml.safe_load(Path(path).read_text()) or {}, str(path))
    for assignment in sets:
        values = merge(values, _set_overlay(assignment), f"--set {assignment}")
    validate(values)
    return values


def merge(base: dict, overlay: dict, source: str, path: str = "") -> dict:
    """`overlay` over `base`: maps merge key by key, anything else replaces; unknown keys are errors."""
    if not isinstance(overlay, dict):
        raise RenderError(f"{source}: {path or 'the top level'} must be a mapping, got {overlay!r}")
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        where = f"{path}.{key}" if path else key
        if key not in base:
            raise RenderError(f"{source}: unknown value {where!r} (the known ones are in {DEFAULTS})")
        if isinstance(base[key], dict) and key not in FREE_FORM:
            merged[key] = merge(base[key], value, source, where)
        else:
            merged[key] = value
    return merged


def _set_overlay(assignment: str) -> dict:
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise RenderError(f"--set {assignment!r}: expected KEY.PATH=VALUE")
    *parents, leaf = key.split(".")
    overlay = node = {}
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = yaml.safe_load(raw)
    return overlay


def validate(values: dict) -> None:
    """Refuse values that would render a deployment that cannot work, saying which value and why."""
    for path, minimum in [("server.gpus", 0), ("server.tensorParallel", 1), ("server.replicas", 0),
                          ("server.startupBudgetSeconds", 60), ("server.preStopSeconds", 0),
                          ("server.maxSurge", 0), ("server.maxUnavailable", 0), ("build.deadlineSeconds", 60),
                          ("autoscaling.minReplicas", 0), ("autoscaling.maxReplicas", 1)]:
        _require_int(values, path, minimum)
    for path in ("createNamespace", "modelStore.create", "build.enabled", "autoscaling.enabled"):
        if not isinstance(_get(values, path), bool):
            raise RenderError(f"{path} must be true or false, got {_get(values, path)!r}")
    _validate_names(values)
    _validate_image(values)
    _validate_model_store(values)
    _validate_replicas(values)
    _validate_parallelism(values)
    _validate_memory(values)
    _validate_build_args(values, parse_build_args(values))
    _validate_placement(values)
    _validate_openai(values)
    clients = values["network"]["clientNamespaces"]
    if not isinstance(clients, list) or not all(isinstance(n, str) and DNS_NAME.fullmatch(n) for n in clients):
        raise RenderError(f"network.clientNamespaces must be a list of namespace names, got {clients!r}")


def _get(values: dict, path: str):
    for part in path.split("."):
        values = values[part]
    return values


def _require_int(values: dict, path: str, minimum: int) -> None:
    value = _get(values, path)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RenderError(f"{path} must be an integer >= {minimum}, got {value!r}")


def _validate_names(values: dict) -> None:
    for path in ("name", "namespace", "model.build", "monitoring.namespace"):
        value = _get(values, path)
        if not isinstance(value, str) or not DNS_NAME.fullmatch(value) or len(value) > 63:
            raise RenderError(f"{path} must be a DNS label (lowercase letters, digits, '-'), got {value!r}")
    job = f"{values['name']}-build-{values['model']['build']}-{'0' * JOB_HASH_LENGTH}"
    if len(job) > 63:
        raise RenderError(f"name + model.build are too long: the build Job's name ({job!r}, the zeros stand for a "
                          "hash) would exceed 63 characters")
    if values["model"]["preset"] not in PRESETS:
        raise RenderError(f"model.preset {values['model']['preset']!r} is not a preset ({', '.join(PRESETS)})")


def _validate_image(values: dict) -> None:
    image = values["image"]
    if image["kind"] not in IMAGE_KINDS:
        raise RenderError(f"image.kind must be one of {', '.join(IMAGE_KINDS)}, got {image['kind']!r}")
    if image["digest"] and not re.fullmatch(r"sha256:[0-9a-f]{64}", str(image["digest"])):
        raise RenderError(f"image.digest must look like sha256:<64 hex digits>, got {image['digest']!r}")
    if not image["repository"] or not (image["tag"] or image["digest"]):
        raise RenderError("image.repository and image.tag (or image.digest) are required")


def _validate_model_store(values: dict) -> None:
    store = values["modelStore"]
    if not store["claimName"] or not DNS_NAME.fullmatch(str(store["claimName"])):
        raise RenderError("modelStore.claimName is missing: the servers read their model repository from this "
                          "PersistentVolumeClaim and the build Job fills it (set create: true to render it)")
    modes = ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod", "ReadOnlyMany")
    if store["accessMode"] not in modes:
        raise RenderError(f"modelStore.accessMode must be one of {', '.join(modes)}, got {store['accessMode']!r}")
    if store["accessMode"] == "ReadOnlyMany" and values["build"]["enabled"]:
        raise RenderError("modelStore.accessMode ReadOnlyMany: the build Job cannot write the build into it")
    if store["accessMode"] != "ReadWriteMany" and max_replicas(values) > 1:
        raise RenderError(f"modelStore.accessMode {store['accessMode']} allows one node (or one pod) only, but up to "
                          f"{max_replicas(values)} replicas may run on different nodes: use ReadWriteMany storage")


def _validate_replicas(values: dict) -> None:
    if values["server"]["maxSurge"] == 0 and values["server"]["maxUnavailable"] == 0:
        raise RenderError("server.maxSurge and server.maxUnavailable are both 0: a rolling update could never "
                          "replace a pod (maxSurge 1 needs a spare pod's GPUs; maxUnavailable 1 serves one pod short)")
    scaling = values["autoscaling"]
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(scaling["queueModel"])):
        raise RenderError(f"autoscaling.queueModel must be a Triton model name, got {scaling['queueModel']!r}")
    if not scaling["enabled"]:
        return
    if values["server"]["replicas"] == 0:
        raise RenderError("server.replicas is 0 but autoscaling is enabled: the HPA would scale it straight back to "
                          "autoscaling.minReplicas. To stop serving, set autoscaling.enabled: false")
    if scaling["minReplicas"] < 1:
        raise RenderError("autoscaling.minReplicas must be >= 1: the HPA cannot scale up from 0 replicas on a "
                          "queue metric (an idle deployment exports none)")
    if scaling["maxReplicas"] < scaling["minReplicas"]:
        raise RenderError(f"autoscaling.maxReplicas ({scaling['maxReplicas']}) is below autoscaling.minReplicas "
                          f"({scaling['minReplicas']})")
    if not _positive_number(scaling["queueTimeTargetMs"]):
        raise RenderError(f"autoscaling.queueTimeTargetMs must be > 0, got {scaling['queueTimeTargetMs']!r}")
    if scaling["queuedSequencesTarget"] is not None and not _positive_number(scaling["queuedSequencesTarget"]):
        raise RenderError("autoscaling.queuedSequencesTarget must be > 0 or null, "
                          f"got {scaling['queuedSequencesTarget']!r}")


def _validate_parallelism(values: dict) -> None:
    gpus, tp = values["server"]["gpus"], values["server"]["tensorParallel"]
    if values["image"]["kind"] == "cpu":
        if gpus or tp != 1:
            raise RenderError(f"image.kind cpu runs without GPUs: server.gpus must be 0 and server.tensorParallel 1 "
                              f"(got {gpus} and {tp})")
        return
    if gpus == 0:
        raise RenderError("image.kind gpu needs server.gpus >= 1 (image.kind cpu runs without GPUs)")
    if gpus % tp:
        raise RenderError(f"server.tensorParallel ({tp}) does not divide server.gpus ({gpus}): each tensor-parallel "
                          "group needs exactly tensorParallel GPUs of the pod. A pod runs on one node; for more GPUs "
                          "than a node has, see 'Multi-node' in deploy/README.md")


def _validate_memory(values: dict) -> None:
    server = values["server"]
    memory = memory_bytes(server["memory"], "server.memory")
    shared = memory_bytes(server["sharedMemory"], "server.sharedMemory")
    memory_bytes(server["tmpSize"], "server.tmpSize")
    memory_bytes(values["build"]["memory"], "build.memory")
    memory_bytes(values["modelStore"]["size"], "modelStore.size")
    if shared >= memory:
        raise RenderError(f"server.sharedMemory ({server['sharedMemory']}) must be below server.memory "
                          f"({server['memory']}): /dev/shm is memory-backed and counts against the limit")


def _validate_placement(values: dict) -> None:
    for path in ("server.nodeSelector", "monitoring.prometheusLabels"):
        labels = _get(values, path)
        if not isinstance(labels, dict) or not all(isinstance(x, str) for x in [*labels, *labels.values()]):
            raise RenderError(f"{path} must map label names to strings (quote \"true\"), got {labels!r}")
    tolerations = values["server"]["tolerations"]
    if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
        raise RenderError(f"server.tolerations must be a list of tolerations, got {tolerations!r}")


def _validate_openai(values: dict) -> None:
    secret = values["openai"]["apiKeySecret"]
    if not isinstance(secret, dict):
        raise RenderError(f"openai.apiKeySecret must be a mapping {{name: <Secret>, key: <key in it>}} (name \"\": "
                          f"no API key), got {secret!r}")
    name, key = secret["name"], secret["key"]
    if not name:  # off: the gateway answers without a key (it is reachable from the clients' namespaces only)
        return
    if not isinstance(name, str) or not DNS_SUBDOMAIN.fullmatch(name) or len(name) > 253:
        raise RenderError(f"openai.apiKeySecret.name must be the name of a Secret in namespace {values['namespace']} "
                          f"(lowercase letters, digits, '-', '.'), got {name!r}")
    if not isinstance(key, str) or not SECRET_KEY.fullmatch(key) or len(key) > 253:
        raise RenderError(f"openai.apiKeySecret.key must be a key of Secret {name!r} (letters, digits, '-', '_', '.'), "
                          f"got {key!r}")


def _validate_build_args(values: dict, args: argparse.Namespace) -> None:
    kind, tp = values["image"]["kind"], values["server"]["tensorParallel"]
    if kind == "gpu" and args.runtime == "torch" and not args.device.startswith("cuda"):
        raise RenderError(f"build.args build for --device {args.device} but the servers have GPUs: add "
                          "--device cuda (or use --runtime trtllm)")
    # device auto is the CPU in the CPU image (its torch has no CUDA)
    if kind == "cpu" and (args.runtime != "torch" or args.device not in ("cpu", "auto")):
        raise RenderError(f"image.kind cpu needs the torch runtime on the CPU, but build.args ask for --runtime "
                          f"{args.runtime} --device {args.device}")
    if tp > 1 and args.runtime != "trtllm":
        raise RenderError(f"server.tensorParallel {tp} needs --runtime trtllm in build.args: the torch runtime "
                          "runs a model on one device")


def parse_build_args(values: dict) -> argparse.Namespace:
    """The build Job's flags parsed by builder/build.py's own parser: what it rejects, we reject now."""
    if not isinstance(values["build"]["args"], list):
        raise RenderError(f"build.args must be a list of builder/build.py flags, got {values['build']['args']!r}")
    extra = [str(arg) for arg in values["build"]["args"]]
    for flag in ("--target", "--output"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in extra):
            raise RenderError(f"build.args must not set {flag}: it comes from model.preset / model.build")
    parser = build_parser()
    parser.exit_on_error = False
    try:
        args, unknown = parser.parse_known_args(builder_args(values))
    except argparse.ArgumentError as e:
        raise RenderError(f"build.args: {e}") from None
    if unknown:
        raise RenderError(f"build.args: builder/build.py does not know {' '.join(unknown)}")
    return args


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def memory_bytes(quantity, path: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(quantity))
    if not match:
        raise RenderError(f"{path} must be a memory quantity such as 64Gi, got {quantity!r}")
    return float(match[1]) * MEMORY_UNITS[match[2] or ""]


# --- facts derived from values ------------------------------------------------------------------

def max_replicas(values: dict) -> int:
    return values["autoscaling"]["maxReplicas"] if values["autoscaling"]["enabled"] else values["server"]["replicas"]


def build_path(values: dict) -> str:
    return f"{MODEL_STORE}/{values['model']['build']}"


def repository_path(values: dict) -> str:
    return f"{build_path(values)}/{REPOSITORY_DIR}"


def builder_args(values: dict) -> list[str]:
    return ["--target", values["model"]["preset"], "--output", build_path(values), *map(str, values["build"]["args"])]


def downloads(values: dict) -> list[str]:
    """Hugging Face repos the preset's build needs, in the order presets.resolve_checkpoint looks."""
    preset = PRESETS[values["model"]["preset"]]
    repos = [] if preset.gguf else [preset.target]
    if preset.drafter and not (REPO_ROOT / preset.drafter).is_dir():  # else shipped in the image
        repos.append(preset.drafter)
    return repos


def image(values: dict) -> str:
    image = values["image"]
    ref = f"{image['repository']}:{image['tag']}" if image["tag"] else image["repository"]
    return f"{ref}@{values['image']['digest']}" if values["image"]["digest"] else ref


def server_command(values: dict) -> list[str]:
    ports = [f"--{name}-port={port}" for name, port in PORTS.items()]
    return [SERVER_COMMAND, repository_path(values), *ports,
            f"--ready-timeout={values['server']['startupBudgetSeconds']}"]


def termination_grace_seconds(values: dict) -> int:
    # preStop keeps the pod serving while it leaves the endpoints; then dflash-serve drains in-flight
    # streams and stops tritonserver, SHUTDOWN_SECONDS at most; the margin covers process exit.
    return values["server"]["preStopSeconds"] + SHUTDOWN_SECONDS + 15


# --- building blocks -------------------------------------------------------------------------------

def selector(values: dict, component: str) -> dict:
    return {"app.kubernetes.io/name": "dflash", "app.kubernetes.io/instance": values["name"],
            "app.kubernetes.io/component": component}


def metadata(values: dict, name: str, component: str, namespaced: bool = True, **extra_labels) -> dict:
    meta = {"name": name, "labels": {**selector(values, component), "app.kubernetes.io/part-of": "dflash",
                                     "app.kubernetes.io/managed-by": "dflash-render", **extra_labels}}
    return {**meta, "namespace": values["namespace"]} if namespaced else meta


POD_SECURITY = {"runAsNonRoot": True, "runAsUser": APP_UID, "runAsGroup": APP_UID, "fsGroup": APP_UID,
                # a model store holds hundreds of GB: re-chowning it at every mount would stall pod starts
                "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}
# The root filesystem is read-only: everything that writes caches (torch, Triton kernels, TensorRT-LLM,
# Hugging Face) is pointed at /tmp, an emptyDir. The servers download nothing: a build holds its own
# copy of the checkpoints, so only the build Job uses the Hugging Face cache in the model store.
WRITABLE_HOME = [{"name": "HOME", "value": "/tmp"}, {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"}]
OFFLINE = [{"name": "HF_HUB_OFFLINE", "value": "1"}]
STORE_CACHE = [{"name": "HF_HOME", "value": HF_HOME}]


def resources(cpu: str, memory: str, gpus: int = 0) -> dict:
    # requests == limits: Guaranteed QoS, evicted last, and eligible for exclusive cores
    amounts = {"cpu": str(cpu), "memory": str(memory), **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def container(values: dict, name: str, command: list[str], env: list[dict], mounts: list[dict], res: dict) -> dict:
    return {"name": name, "image": image(values), "imagePullPolicy": "Always", "command": command, "env": env,
            "volumeMounts": mounts, "resources": res, "securityContext": CONTAINER_SECURITY}


def store_mount(read_only: bool) -> dict:
    return {"name": "models", "mountPath": MODEL_STORE, "readOnly": read_only}


TMP_MOUNT = {"name": "tmp", "mountPath": "/tmp"}


def store_volumes(values: dict, read_only: bool, tmp_size: str) -> list[dict]:
    return [{"name": "models", "persistentVolumeClaim": {"claimName": values["modelStore"]["claimName"],
                                                         "readOnly": read_only}},
            {"name": "tmp", "emptyDir": {"sizeLimit": tmp_size}}]


def placement(values: dict) -> dict:
    server = values["server"]
    return {**({"nodeSelector": server["nodeSelector"]} if server["nodeSelector"] else {}),
            **({"tolerations": server["tolerations"]} if server["tolerations"] else {})}


def pod_basics(values: dict) -> dict:
    return {"serviceAccountName": values["name"], "automountServiceAccountToken": False,
            "enableServiceLinks": False, "securityContext": POD_SECURITY}


# --- resources -------------------------------------------------------------------------------------

def namespace(values: dict) -> dict:
    meta = metadata(values, values["namespace"], "namespace", namespaced=False)
    # The restricted Pod Security Standard: the API server itself refuses pods that would run as root,
    # escalate privileges or keep capabilities.
    meta["labels"].update({"pod-security.kubernetes.io/enforce": "restricted",
                           "pod-security.kubernetes.io/warn": "restricted"})
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def service_account(values: dict) -> dict:
    # The pods call no Kubernetes API: no token is mounted.
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(values, values["name"], "server"),
            "automountServiceAccountToken": False}


def model_claim(values: dict) -> dict:
    store = values["modelStore"]
    spec = {"accessModes": [store["accessMode"]], "resources": {"requests": {"storage": store["size"]}}}
    if store["storageClassName"]:
        spec["storageClassName"] = store["storageClassName"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": metadata(values, store["claimName"], "model-store"), "spec": spec}


def build_job(values: dict) -> dict:
    build, gpus = values["build"], values["server"]["gpus"]
    token = build["hfTokenSecret"]
    download_env = WRITABLE_HOME + STORE_CACHE + (
        [{"name": "HF_TOKEN_PATH", "value": f"{HF_TOKEN_DIR}/token"}] if token else [])
    download_mounts = [store_mount(False), TMP_MOUNT] + (
        [{"name": "hf-token", "mountPath": HF_TOKEN_DIR, "readOnly": True}] if token else [])
    # Downloads run first, in containers without GPUs: a GPU is not held while checkpoints arrive.
    init = [container(values, f"download-{i}", ["hf", "download", repo], download_env, download_mounts,
                      resources("1", "2Gi")) for i, repo in enumerate(downloads(values))]
    builder = container(values, "build", ["dflash-build", *builder_args(values)],
                        WRITABLE_HOME + STORE_CACHE + OFFLINE + [{"name": "DFLASH_CACHE", "value": DFLASH_CACHE}],
                        [store_mount(False), TMP_MOUNT], resources(build["cpu"], build["memory"], gpus))
    volumes = store_volumes(values, read_only=False, tmp_size=values["server"]["tmpSize"])
    if token and init:  # a file, not an environment variable: it shows in no `kubectl describe` or crash dump
        volumes.append({"name": "hf-token", "secret": {"secretName": token, "defaultMode": 0o440,
                                                        "items": [{"key": "token", "path": "token"}]}})
    pod = {**pod_basics(values), "restartPolicy": "Never", **({"initContainers": init} if init else {}),
           "containers": [builder], "volumes": volumes, **(placement(values) if gpus else {})}
    labels = {**selector(values, "build"), "dflash/build": values["model"]["build"]}
    template = {"metadata": {"labels": labels}, "spec": pod}
    # A Job's pod template is immutable: when it changes (a new image, new flags) this is a new Job, named
    # by a hash of the template, which `kubectl apply` creates beside the old one. Running the builder
    # again for an unchanged build costs little: it reuses the identical build it finds.
    spec_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:JOB_HASH_LENGTH]
    name = f"{values['name']}-build-{values['model']['build']}-{spec_hash}"
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata(values, name, "build"),
            "spec": {"backoffLimit": 1, "activeDeadlineSeconds": build["deadlineSeconds"],
                     "ttlSecondsAfterFinished": 7 * 24 * 3600, "template": template}}


def wait_for_build(values: dict) -> dict:
    # The builder writes the build beside its final place and renames it when complete, manifest
    # included: a pod never starts tritonserver on a half-written build, and a rolling upgrade's new
    # pods wait here until the new build exists.
    script = (f'until [ -f "$BUILD/{MANIFEST_FILE}" ]; do echo "waiting for the build Job to write $BUILD"; '
              "sleep 10; done")
    return container(values, "wait-for-build", ["sh", "-c", script], [{"name": "BUILD", "value": build_path(values)}],
                     [store_mount(True)], resources("50m", "32Mi"))


def api_key_env(values: dict) -> list[dict]:
    secret = values["openai"]["apiKeySecret"]
    if not secret["name"]:
        return []
    # optional: false (written out): a missing Secret or key keeps the container from starting
    # (CreateContainerConfigError) rather than serving the gateway without the key that was asked for.
    return [{"name": OPENAI_API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"],
                                                                        "optional": False}}}]


# checkov's CKV_K8S_35 (CIS 5.4.1) prefers Secrets as files; the gateway's key can only be passed as an
# environment variable (or a flag, which would put it in the pod spec). Skipped only when a key is set.
API_KEY_ENV_SKIP = {"checkov.io/skip1": f"CKV_K8S_35=dflash-serve reads the gateway's API key from {OPENAI_API_KEY_ENV}"
                                        " only; the Secret is referenced, its value is in no manifest"}


def server_container(values: dict) -> dict:
    # Health (deploy/README.md, "Probes and a dead engine"): readiness is Triton's strict readiness (every
    # model loaded; from Triton 26.01 every backend process alive, from 26.03 the engine loop too);
    # liveness, that the server answers. A dead engine or backend process is dflash-serve's to catch on any
    # Triton version: it stops tritonserver within seconds and exits non-zero, and the kubelet restarts the
    # container (restartPolicy Always), whose startup probe then covers the reload.
    #
    # The OpenAI gateway (PORTS["openai"]): its GATEWAY_HEALTH_PATH answers 200 only while tritonserver is
    # ready, so it is the startup probe: startup then ends when Triton is ready *and* the gateway listens,
    # and a pod never turns Ready (joining the Service on every port) while :9000 still refuses. Readiness
    # stays Triton's own: the gateway adds nothing to it once started, because when the gateway dies
    # dflash-serve exits non-zero and the container restarts (as for a dead engine), faster than a probe
    # would notice, and a gateway hiccup must not take the pod away from its HTTP/gRPC clients. Nor is it
    # liveness: it fails whenever Triton is not ready (a drain, a dead engine), which readiness and
    # dflash-serve already handle. It must answer without the API key: probes send none.
    server = values["server"]
    ready = {"httpGet": {"path": READY_PATH, "port": "http"}}
    started = {"httpGet": {"path": GATEWAY_HEALTH_PATH, "port": "openai"}}
    triton = container(values, "tritonserver", server_command(values), WRITABLE_HOME + OFFLINE + api_key_env(values),
                     [store_mount(True), TMP_MOUNT, {"name": "dshm", "mountPath": "/dev/shm"}],
                     resources(server["cpu"], server["memory"], server["gpus"]))
    triton["ports"] = [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in PORTS.items()]
    triton["startupProbe"] = {**started, "periodSeconds": 10, "timeoutSeconds": 5,
                            "failureThreshold": math.ceil(server["startupBudgetSeconds"] / 10)}
    triton["readinessProbe"] = {**ready, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3}
    triton["livenessProbe"] = {"httpGet": {"path": LIVE_PATH, "port": "http"}, "periodSeconds": 15,
                             "timeoutSeconds": 5, "failureThreshold": 4}
    triton["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(server["preStopSeconds"])]}}}
    return triton


def spread(values: dict) -> list[dict]:
    # ScheduleAnyway: GPUs are scarce, and a replica on a crowded node beats a Pending one.
    # matchLabelKeys: during a rollout, old and new pods are balanced separately.
    return [{"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": selector(values, "server")}, "matchLabelKeys": ["pod-template-hash"]}
            for key in ("topology.kubernetes.io/zone", "kubernetes.io/hostname")]


def deployment(values: dict) -> dict:
    server = values["server"]
    volumes = store_volumes(values, read_only=True, tmp_size=server["tmpSize"]) + [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": server["sharedMemory"]}}]
    labels = {**selector(values, "server"), "dflash/build": values["model"]["build"]}
    # Always (a Deployment's only choice, written out because the health design rests on it): dflash-serve
    # exits non-zero when the engine dies, and a new container is the recovery
    pod = {**pod_basics(values), "restartPolicy": "Always",
           "terminationGracePeriodSeconds": termination_grace_seconds(values),
           "initContainers": [wait_for_build(values)], "containers": [server_container(values)], "volumes": volumes,
           "topologySpreadConstraints": spread(values), **placement(values)}
    spec = {"revisionHistoryLimit": 5, "selector": {"matchLabels": selector(values, "server")},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": server["maxSurge"], "maxUnavailable": server["maxUnavailable"]}},
            "minReadySeconds": 10, "progressDeadlineSeconds": server["startupBudgetSeconds"] + 600,
            "template": {"metadata": {"labels": labels}, "spec": pod}}
    if not values["autoscaling"]["enabled"]:  # with an HPA, replicas belong to it: applying must not reset them
        spec = {"replicas": server["replicas"], **spec}
    meta = metadata(values, values["name"], "server")
    if values["openai"]["apiKeySecret"]["name"]:
        meta["annotations"] = dict(API_KEY_ENV_SKIP)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}


def service(values: dict, name: str, component: str, ports: list[str], headless: bool = False) -> dict:
    protocols = {"http": "http", "grpc": "kubernetes.io/h2c", "metrics": "http", "openai": "http"}
    spec = {"selector": selector(values, "server"),
            "ports": [{"name": p, "port": PORTS[p], "targetPort": p, "protocol": "TCP", "appProtocol": protocols[p]}
                      for p in ports]}
    if headless:
        spec = {"clusterIP": "None", **spec}
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(values, name, component), "spec": spec}


def services(values: dict) -> list[dict]:
    name = values["name"]
    # openai: the OpenAI-compatible gateway (HTTP/1.1, streaming as server-sent events); OpenAI SDKs point
    # their base_url at http://<name>.<namespace>.svc:9000/v1
    return [service(values, name, "server", ["http", "grpc", "openai"]),
            # gRPC keeps one HTTP/2 connection per client, which a ClusterIP pins to one pod: clients that
            # balance themselves (dns:///<name>-headless:8001, round_robin) spread over every ready pod.
            service(values, f"{name}-headless", "server", ["grpc", "http"], headless=True),
            # metrics apart: only Prometheus reaches this port (NetworkPolicy), and clients never see it
            service(values, f"{name}-metrics", "metrics", ["metrics"])]


def disruption_budget(values: dict) -> dict:
    # maxUnavailable rather than minAvailable: a single-replica deployment must not block node drains.
    # AlwaysAllow: a crash-looping pod never stops a drain either.
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(values, values["name"], "server"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(values, "server")},
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def autoscaler(values: dict) -> dict:
    scaling = values["autoscaling"]

    def per_pod(metric: str, average) -> dict:
        return {"type": "Pods", "pods": {"metric": {"name": metric},
                                         "target": {"type": "AverageValue", "averageValue": str(average)}}}

    # Two signals, the HPA follows the larger proposal: Triton's queue time sees requests waiting for
    # a model instance; the engine's gauge sees requests waiting for a batch slot inside the decoupled
    # dflash model, where Triton's queue time stays near zero.
    metrics = [per_pod(QUEUE_TIME_METRIC, round(scaling["queueTimeTargetMs"] * 1000))]
    if scaling["queuedSequencesTarget"] is not None:
        metrics.append(per_pod(QUEUED_METRIC, scaling["queuedSequencesTarget"]))
    # New GPU pods take minutes to load: scale up promptly, scale down slowly (a flapping replica costs
    # a full model load).
    behavior = {"scaleUp": {"stabilizationWindowSeconds": 60,
                            "policies": [{"type": "Pods", "value": 2, "periodSeconds": 120}]},
                "scaleDown": {"stabilizationWindowSeconds": 900,
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}]}}
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": metadata(values, values["name"], "server"),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": values["name"]},
                     "minReplicas": scaling["minReplicas"], "maxReplicas": scaling["maxReplicas"],
                     "metrics": metrics, "behavior": behavior}}


def _namespace_peer(name: str) -> dict:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}


def _ports(*names: str) -> list[dict]:
    return [{"port": PORTS[n], "protocol": "TCP"} for n in names]


def server_network_policy(values: dict) -> dict:
    clients = [{"podSelector": {}}] + [_namespace_peer(n) for n in values["network"]["clientNamespaces"]]
    spec = {"podSelector": {"matchLabels": selector(values, "server")}, "policyTypes": ["Ingress", "Egress"],
            # the gateway reaches tritonserver over the pod's loopback, which no NetworkPolicy filters
            "ingress": [{"from": clients, "ports": _ports("http", "grpc", "openai")},
                        {"from": [_namespace_peer(values["monitoring"]["namespace"])], "ports": _ports("metrics")}],
            # no egress at all: the servers download nothing and call nothing
            "egress": []}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(values, f"{values['name']}-server", "server"), "spec": spec}


def build_network_policy(values: dict) -> dict:
    dns = {"to": [{**_namespace_peer("kube-system"), "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
           "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    spec = {"podSelector": {"matchLabels": selector(values, "build")}, "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            # the Hugging Face Hub and its CDN over HTTPS; nothing reaches into the build
            "egress": [dns, {"ports": [{"port": 443, "protocol": "TCP"}]}]}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(values, f"{values['name']}-build", "build"), "spec": spec}


def service_monitor(values: dict) -> dict:
    meta = metadata(values, values["name"], "metrics", **values["monitoring"]["prometheusLabels"])
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta,
            "spec": {"selector": {"matchLabels": selector(values, "metrics")},
                     "endpoints": [{"port": "metrics", "path": METRICS_PATH, "interval": "15s",
                                    "scrapeTimeout": "10s"}]}}


def queue_time_expr(values: dict) -> str:
    model = values["autoscaling"]["queueModel"]
    series = f'{{namespace="{values["namespace"]}", service="{values["name"]}-metrics", model="{model}"}}'
    # Average Triton queue time per request over 2 minutes; a pod with no requests reads 0, a pod whose
    # requests all still wait reads very high (the divisor is clamped, not zero).
    return (f"sum by (namespace, pod) (rate(nv_inference_queue_duration_us{series}[2m]))\n"
            f"/\nclamp_min(sum by (namespace, pod) (rate(nv_inference_request_success{series}[2m])), 0.001)")


def prometheus_rule(values: dict) -> dict:
    target_us = round(values["autoscaling"]["queueTimeTargetMs"] * 1000)
    scrape = f'up{{namespace="{values["namespace"]}", service="{values["name"]}-metrics"}}'
    rules = [{"record": QUEUE_TIME_RECORD, "expr": queue_time_expr(values)},
             {"alert": "DFlashQueueTimeHigh", "expr": f"avg({QUEUE_TIME_RECORD}) > {2 * target_us}", "for": "15m",
              "labels": {"severity": "warning"},
              "annotations": {"summary": "DFlash requests queue twice as long as the autoscaling target",
                              "description": "Scaling is not keeping up: maxReplicas reached, or new pods cannot "
                                             "get GPUs (check Pending pods and the HPA's events)."}},
             {"alert": "DFlashMetricsMissing", "expr": f"absent({scrape} == 1)", "for": "10m",
              "labels": {"severity": "warning"},
              "annotations": {"summary": "No DFlash Triton metrics are scraped",
                              "description": "The HPA scales on these metrics: without them it cannot react to "
                                             "load. Check the ServiceMonitor and the NetworkPolicy."}}]
    meta = metadata(values, values["name"], "metrics", **values["monitoring"]["prometheusLabels"])
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": meta,
            "spec": {"groups": [{"name": "dflash", "rules": rules}]}}


def adapter_values(values: dict) -> dict:
    """Rules for prometheus-adapter (Helm values rules.custom): per-pod metrics for the HPA."""
    def rule(series: str, name: str, aggregate: str) -> dict:
        return {"seriesQuery": f'{series}{{namespace!="",pod!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                "name": {"matches": f"^{re.escape(series)}$", "as": name},
                "metricsQuery": f"{aggregate}(<<.Series>>{{<<.LabelMatchers>>}}) by (<<.GroupBy>>)"}

    return {"rules": {"custom": [rule(QUEUE_TIME_RECORD, QUEUE_TIME_METRIC, "max"),
                                 rule(QUEUED_METRIC, QUEUED_METRIC, "sum")]}}


def render(values: dict) -> list[dict]:
    """Every resource, in apply order: the network policies exist before any pod they protect."""
    out = [namespace(values)] if values["createNamespace"] else []
    out.append(service_account(values))
    if values["modelStore"]["create"]:
        out.append(model_claim(values))
    out.append(server_network_policy(values))
    if values["build"]["enabled"]:
        out += [build_network_policy(values), build_job(values)]
    out += [deployment(values), *services(values), disruption_budget(values)]
    if values["autoscaling"]["enabled"]:
        out.append(autoscaler(values))
    return out + [service_monitor(values), prometheus_rule(values)]


# --- output ----------------------------------------------------------------------------------------

class _Dumper(yaml.SafeDumper):
    """Plain YAML for people: no &anchors for shared dicts, multi-line strings (PromQL) as | blocks."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def dump(data: dict) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=120)


ADAPTER_HEADER = ("# Merge into the values of your prometheus-adapter Helm release (prometheus-community/"
                  "prometheus-adapter),\n# which serves these per-pod metrics to the HorizontalPodAutoscaler.\n")


def write(values: dict, output: Path) -> list[Path]:
    output.mkdir(parents=True, exist_ok=True)
    if any(output.iterdir()):
        raise RenderError(f"{output} is not empty: render into a new folder (stale files would be applied too)")
    files = []
    for i, resource in enumerate(render(values)):
        path = output / f"{i:02d}-{resource['kind'].lower()}-{resource['metadata']['name']}.yaml"
        path.write_text(dump(resource))
        files.append(path)
    adapter = output / "prometheus-adapter" / "values.yaml"
    adapter.parent.mkdir()
    adapter.write_text(ADAPTER_HEADER + dump(adapter_values(values)))
    return files + [adapter]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="render.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-f", "--values", action="append", default=[], type=Path,
                        help="overlay over deploy/k8s/values.yaml (repeatable, applied in order)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one value, parsed as YAML, e.g. --set model.build=qwen3-8b-v2 (repeatable)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="folder for the manifests (new or empty)")
    args = parser.parse_args(argv)
    try:
        values = load_values(args.values, args.set)
        files = write(values, args.output)
    except (RenderError, OSError, yaml.YAMLError) as e:
        print(f"render.py: error: {e}", file=sys.stderr)
        return 2
    if not values["image"]["digest"]:
        print("render.py: warning: image.digest is not set: nodes that pull the same tag at different times may run "
              "different images (--set image.digest=sha256:...)", file=sys.stderr)
    print(f"wrote {len(files)} files to {args.output}: kubectl apply -f {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
