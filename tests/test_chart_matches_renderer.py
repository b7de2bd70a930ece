"""Written once, removed with deploy/k8s/render.py: the Helm chart renders what the renderer rendered.

Object for object and field for field, apart from Helm's standard labels and the deliberate differences
listed in DIFFERENCES (each explained in the closing note of issue #25).
"""
from __future__ import annotations

import copy
from pathlib import Path

import helm_python
import pytest
import yaml

from deploy.k8s import render

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy/helm/dflash"
HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/version", "app.kubernetes.io/managed-by"}
# (kind, name) of an object only one of them renders, or (kind, field path) of a field that differs -> why.
# The Job is matched by kind: its name ends in a hash of its pod template, which is Helm's sha256sum here.
DIFFERENCES = {
    ("Namespace", "dflash"): "a chart is installed into the namespace Helm is given (--create-namespace)",
    ("NetworkPolicy", "dflash-test"): "new: the `helm test` pod's (egress to the servers' gRPC port and DNS only)",
    ("Pod", "dflash-test-generate"): "new: the `helm test` hook",
    ("PersistentVolumeClaim", "metadata.annotations"): "helm.sh/resource-policy keep: uninstall keeps the model store",
    ("Job", "metadata.name"): "the hash of the pod template is Helm's (sha256sum of its YAML)",
    ("Job", "spec.ttlSecondsAfterFinished"): "the release owns the Job: a TTL-deleted Job would be recreated "
                                             "by the next upgrade",
    ("Job", "spec.template.spec.containers.0.command"): "tp2: --gpu and --tensor-parallel-size from server.*",
    ("ServiceMonitor", "dflash"): "cpu: monitoring.enabled false",
    ("PrometheusRule", "dflash"): "cpu: monitoring.enabled false",
}
CASES = {"default": ([], {}), "cpu": (["cpu.yaml"], {}), "tp2": (["tp2.yaml"], {}),
         "openai-api-key": ([], {"openai": {"apiKeySecret": {"name": "dflash-openai", "key": "token"}}})}


def _strip(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    for label in HELM_LABELS:
        obj["metadata"].get("labels", {}).pop(label, None)
    return obj


def _differences(old, new, path=()) -> list[tuple[str, object, object]]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in _differences(old.get(k, "<absent>"), new.get(k, "<absent>"), (*path, str(k)))]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, (*path, str(i)))]
    return [] if old == new else [(".".join(path), old, new)]


@pytest.mark.parametrize("case", CASES)
def test_the_chart_renders_what_the_renderer_rendered(case):
    files, extra = CASES[case]
    old_sets = [f"{k}={v}" for k, v in {"openai.apiKeySecret.name": "dflash-openai",
                                        "openai.apiKeySecret.key": "token"}.items()] if extra else []
    old = [_strip(o) for o in render.render(render.load_values([REPO / "deploy/k8s/values" / f for f in files],
                                                               old_sets))]
    values = {}
    for f in files:
        values.update(yaml.safe_load((CHART / "values" / f).read_text()))
    values.update(extra)
    with helm_python.Chart.load(CHART) as chart:
        out = chart.render(values, name="dflash", namespace="dflash")
    new = [_strip(d) for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    by_key = lambda objs: {(o["kind"], "Job" if o["kind"] == "Job" else o["metadata"]["name"]): o for o in objs}
    old, new = by_key(old), by_key(new)
    unexplained = []
    for key in sorted(set(old) | set(new)):
        if key not in old or key not in new:
            if key not in DIFFERENCES:
                unexplained.append(f"{key} only in the {'chart' if key in new else 'renderer'}")
            continue
        for path, a, b in _differences(old[key], new[key]):
            if (key[0], path) not in DIFFERENCES:
                unexplained.append(f"{key} {path}: {a!r} -> {b!r}")
    assert not unexplained, "\n".join(unexplained)
    # the tp2 command differs only by the flags the servers' values now pass
    if case == "tp2":
        old_cmd = old["Job", "Job"]["spec"]["template"]["spec"]["containers"][0]["command"]
        new_cmd = new["Job", "Job"]["spec"]["template"]["spec"]["containers"][0]["command"]
        assert [a for a in new_cmd if a not in ("--gpu", "h100", "--tensor-parallel-size", "2")] == old_cmd
