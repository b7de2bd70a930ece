"""Metrics that count what matters: requests by front model and outcome, latency histograms, the gateway's own
metrics, and the chart's PrometheusRule, checked against what the real server exports (deploy/README.md, "Metrics").

The server tests send a few requests to the session's real server (gRPC, HTTP generate, the OpenAI gateway) and
assert exact deltas: they wait for the server to be idle first, and for the metrics (recorded off the request's
thread) with a timeout, never on timings.
"""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import helm_python
import numpy as np
import pytest
import requests
import yaml

from dflash_contract.protocol import (CANCELLED_MESSAGE, CAPACITY_MESSAGE, ENGINE_STOPPED_MESSAGE,
                                      INTERNAL_ERROR_PREFIX, RENDER_CALL_PREFIX, SHUTTING_DOWN_MESSAGE,
                                      invalid_request)
from dflash_contract.server import GATEWAY_METRICS_PATH
from dflash_serving.metrics import (BLS_CALL_PREFIX, FRONT_MODELS, OUTCOMES, RequestMetrics, counted_at_front,
                                    error_outcome, front_model)
from dflash_contract.engine_counts import Counts
from gateway.metrics import GatewayMetrics, endpoint_of
from gateway.protocol_metrics import protocol_metrics
from test_kv_events import streams
from test_serving import Stream, refusal

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy/helm/dflash"
LABELS = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# --- Triton-free: the rule that names an outcome, the timeline, the gateway's text format ----------------------

@pytest.mark.parametrize("message, tokens, expected", [
    (invalid_request("top_p must be in (0, 1], got 2.0"), 0, ("refused", "INVALID_ARG")),
    (f"{CAPACITY_MESSAGE} (8 running, 16 queued, queue limit 16); retry later", 0, ("refused", "UNAVAILABLE")),
    (f"{CAPACITY_MESSAGE} (waited 61 s for a slot, the limit is 60 s); retry later", 0, ("timed_out", "UNAVAILABLE")),
    (f"in ensemble 'ensemble', {SHUTTING_DOWN_MESSAGE}", 0, ("refused", "UNAVAILABLE")),
    (f"{SHUTTING_DOWN_MESSAGE}; the request was aborted", 12, ("failed", "UNAVAILABLE")),
    (f"{ENGINE_STOPPED_MESSAGE} (the backend process died); retry on another replica", 3, ("failed", "UNAVAILABLE")),
    (CANCELLED_MESSAGE, 0, ("cancelled", "CANCELLED")),
    (f"{INTERNAL_ERROR_PREFIX}: RuntimeError: boom", 0, ("failed", "INTERNAL")),
])
def test_an_error_names_its_outcome(message, tokens, expected):
    assert error_outcome(message, tokens) == expected
    assert expected[1] in OUTCOMES[expected[0]]  # a series made at start-up, not on the way


def test_the_front_model_of_a_dflash_request():
    assert front_model(BLS_CALL_PREFIX + "0123", None) is None  # dflash_bls counts its own
    assert front_model("", np.array([[1]])) == "ensemble" and front_model("abc", None) == "dflash"
    # preprocessing's refusals: the ensemble's own, not dflash_bls's calls nor a client's render
    assert counted_at_front("") and counted_at_front("abc")
    assert not counted_at_front(BLS_CALL_PREFIX + "0123") and not counted_at_front(RENDER_CALL_PREFIX + "0123")


class FakeMetric:
    def __init__(self):
        self.values = []

    def increment(self, value):
        self.values.append(value)

    def observe(self, value):
        self.values.append(value)


class FakeRegistry:
    def __init__(self):
        self.metrics = {}

    def counter(self, name, description, labels):
        return self.metrics.setdefault((name, tuple(sorted(labels.items()))), FakeMetric())

    def histogram(self, name, description, labels, buckets):
        assert list(buckets) == sorted(buckets)
        return self.counter(name, description, labels)

    def values(self, name, **labels):
        return [v for (n, ls), m in self.metrics.items() if n == name and labels.items() <= dict(ls).items()
                for v in m.values]


def test_a_timeline_observes_each_token_once_and_counts_its_first_end_only():
    registry = FakeRegistry()
    metrics = RequestMetrics(registry, ("dflash_bls",), "smollm2-135m")
    # every series is there at start-up, at 0: outcomes x their classes, and the three histograms
    assert len(registry.metrics) == sum(len(c) for c in OUTCOMES.values()) + 3
    clock = iter([10.5, 10.7, 11.1, 11.2]).__next__
    timeline = metrics.timeline("dflash_bls", arrived=10.0)
    timeline._clock = clock
    timeline.responded(1)  # first token at 10.5
    timeline.responded(3)  # two more at 10.7
    timeline.responded(3)  # no new token: nothing observed
    timeline.responded(7)  # four more at 11.1
    timeline.finished("length")  # at 11.2
    timeline.ended_by_error(CANCELLED_MESSAGE)  # a second end (another thread's): ignored
    assert metrics.flush()
    assert registry.values("dflash_time_to_first_token_seconds") == [pytest.approx(0.5)]
    assert registry.values("dflash_inter_token_latency_seconds") == pytest.approx([0.1] * 2 + [0.1] * 4)
    assert registry.values("dflash_e2e_request_latency_seconds") == [pytest.approx(1.2)]
    assert registry.values("dflash_requests_total", outcome="length") == [1]
    assert registry.values("dflash_requests_total", outcome="cancelled") == []

    quiet = metrics.timeline("dflash_bls", streamed=False)  # one response at the end: no first token to time
    quiet.responded(5)
    quiet.ended_by_error(f"{ENGINE_STOPPED_MESSAGE} (x)")  # after its tokens: failed, not refused
    assert metrics.flush()
    assert len(registry.values("dflash_time_to_first_token_seconds")) == 1
    assert registry.values("dflash_requests_total", outcome="failed", error_class="UNAVAILABLE") == [1]


def test_the_gateway_writes_prometheus_text():
    metrics = GatewayMetrics("smollm2-135m")
    metrics.request_done(endpoint_of("/v1/chat/completions"), 200, 0.3)
    metrics.request_done(endpoint_of("/v1/models/some/id"), 404, 0.001)
    metrics.request_done(endpoint_of("/admin"), 404, 0.001)
    metrics.first_text("/v1/chat/completions", 0.02)
    samples = parse(metrics.render())
    assert value(samples, "dflash_gateway_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert value(samples, "dflash_gateway_requests_total", endpoint="/v1/models/{model}", status="404") == 1
    assert value(samples, "dflash_gateway_requests_total", endpoint="other") == 1  # any other path: one label value
    assert value(samples, "dflash_gateway_request_duration_seconds_bucket", endpoint="/v1/chat/completions",
                 le="0.25") == 0
    assert value(samples, "dflash_gateway_request_duration_seconds_bucket", endpoint="/v1/chat/completions",
                 le="0.5") == 1
    assert value(samples, "dflash_gateway_time_to_first_token_seconds_count", endpoint="/v1/chat/completions") == 1


def test_the_protocol_gauges_have_vllms_names_and_meanings():
    """The names the Inference Gateway's endpoint picker reads for engine type vllm (its default), KV usage from 0 to
    1 as vLLM and the picker's scorer take it, the cache geometry in cache_config_info's labels; no counts, no
    families (a pod with no data, not an idle one)."""
    counts = Counts(running=3, waiting=5, kv_blocks_used=40, kv_blocks=160, block_size=16, prompt_tokens=900,
                    generation_tokens=1200, max_context=2048)
    samples = parse(protocol_metrics(counts, 'my "model"'))
    named = {"model_name": 'my \\"model\\"'}  # as Prometheus escapes a label value
    assert value(samples, "vllm:num_requests_running", **named) == 3
    assert value(samples, "vllm:num_requests_waiting", **named) == 5
    assert value(samples, "vllm:kv_cache_usage_perc", **named) == 0.25
    assert value(samples, "vllm:cache_config_info", block_size="16", num_gpu_blocks="160") == 1
    assert value(samples, "vllm:prompt_tokens_total") == 900 and value(samples, "vllm:generation_tokens_total") == 1200
    assert protocol_metrics(None, "m") == ""


# --- the real server -------------------------------------------------------------------------------------

def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text format -> {(name, labels): value}."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, number = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        samples[name, frozenset(LABELS.findall(labels))] = float(number)
    return samples


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return parse(r.read().decode())


def value(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def delta(after, before, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


class Server:
    """Snapshots of the server's and the gateway's metrics."""

    def __init__(self, server):
        self.server = server
        self.gateway_metrics = server.gateway.url + GATEWAY_METRICS_PATH

    def idle(self, timeout: float = 120) -> None:
        """Nothing decoding or queued (an earlier test's uncancellable ensemble stream runs on for a while)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            samples = scrape(self.server.metrics_url)
            if not value(samples, "dflash_active_sequences") and not value(samples, "dflash_queued_sequences"):
                return
            time.sleep(0.2)
        pytest.fail("the server did not go idle")

    def snapshot(self):
        return scrape(self.server.metrics_url)

    def wait_for(self, before, expected: dict, timeout: float = 30):
        """The snapshot once every (name, labels) -> delta in `expected` holds (metrics are recorded off the
        request's thread); the last one seen when the timeout ends."""
        deadline = time.monotonic() + timeout
        while True:
            after = self.snapshot()
            if all(delta(after, before, name, **dict(labels)) == want for (name, labels), want in expected.items())\
                    or time.monotonic() > deadline:
                return after
            time.sleep(0.2)


def requests_of(model: str, **deltas) -> dict:
    """Expected dflash_requests_total deltas: outcome or outcome/error_class -> count."""
    expected = {}
    for key, count in deltas.items():
        outcome, _, kind = key.partition("__")
        labels = {"model": model, "outcome": outcome, **({"error_class": kind} if kind else {})}
        expected["dflash_requests_total", frozenset(labels.items())] = count
    return expected


def histograms_of(model: str, ttft: int, itl: int, e2e: int) -> dict:
    return {(f"dflash_{name}_count", frozenset({("model", model)})): count
            for name, count in (("time_to_first_token_seconds", ttft), ("inter_token_latency_seconds", itl),
                                ("e2e_request_latency_seconds", e2e))}


def stream_once(url: str, model: str, **values) -> tuple[list, str | None]:
    stream = Stream(url)
    try:
        stream.send(model, **values)
        return stream.collect()
    finally:
        stream.close()


def tokens_after_the_first_response(results) -> int:
    counts = [int(r.as_numpy("num_output_tokens").item()) for r in results if r.as_numpy("num_output_tokens") is not None]
    return counts[-1] - counts[0]


@pytest.fixture(scope="module")
def served(default_server):
    return Server(default_server)


@pytest.fixture(scope="module")
def prompt_ids(default_build):
    from dflash_runtime.text import encode_prompt, load_tokenizer

    return np.array([encode_prompt(load_tokenizer(default_build / "target"), "Say hi.")], dtype=np.int32)


@pytest.mark.parametrize("model", FRONT_MODELS)
def test_each_front_model_counts_a_good_and_a_refused_request_and_times_the_good_one(served, prompt_ids, model):
    served.idle()
    prompt = {"input_ids": prompt_ids} if model == "dflash" else {"text_input": "Say hi.", "apply_chat_template": True}
    before = served.snapshot()
    results, error = stream_once(served.server.grpc_url, model, max_tokens=6, stream=True, **prompt)
    assert error is None
    reason = results[-1].as_numpy("finish_reason").item().decode()
    message = refusal(served.server.grpc_url, model, dict(prompt, max_tokens=6, top_p=2.0))
    assert "top_p must be in (0, 1]" in message
    # Triton's own counts, as deploy/README.md says (2.51): a Python model's request counts as a success once its
    # execute() returns, whatever it answers; the ensemble counts its refusal twice, as failures. Triton counts an
    # ensemble's request when the ensemble ends, which may be after the front model's own metrics: waited for too.
    tritons = {"nv_inference_request_success": 1, "nv_inference_request_failure": 2} if model == "ensemble" else \
        {"nv_inference_request_success": 2, "nv_inference_request_failure": 0}
    expected = {**requests_of(model, **{reason: 1, "refused__INVALID_ARG": 1}),
                **histograms_of(model, ttft=1, itl=tokens_after_the_first_response(results), e2e=1),
                **{(name, frozenset({("model", model)})): count for name, count in tritons.items()},
                # the engine's own, whatever the front: the good request's wait for a place and its prefill
                **{(f"dflash_request_{name}_time_seconds_count", frozenset({("model", "dflash")})): 1
                   for name in ("queue", "prefill")}}
    after = served.wait_for(before, expected)
    for (name, labels), want in expected.items():
        assert delta(after, before, name, **dict(labels)) == want, (name, dict(labels))
    assert delta(after, before, "dflash_requests_total", model=model) == 2  # nothing else
    for other in set(FRONT_MODELS) - {model}:  # each request counted once, at the front the client called
        assert delta(after, before, "dflash_requests_total", model=other) == 0, other


def test_every_series_of_ours_is_labelled_with_the_served_model_name(served):
    """One label joins the engine's, the requests' and the gateway's series, and the protocol's: the OpenAI API's
    model id (model says which Triton model counted it, as in Triton's own nv_* series)."""
    ours = [(name, dict(labels)) for name, labels in [*served.snapshot(), *scrape(served.gateway_metrics)]
            if name.startswith(("dflash_", "vllm:"))]
    families = {name.split("_bucket")[0] for name, _ in ours}
    assert {"dflash_requests_total", "dflash_generated_tokens_total", "dflash_gateway_requests_total",
            "dflash_request_queue_time_seconds", "dflash_shared_suffix_tokens", "vllm:num_requests_waiting"} <= families
    unlabelled = {name for name, labels in ours if labels.get("model_name") != "smollm2-135m"}
    assert not unlabelled, unlabelled


def test_cancelled_streams_and_http_generate_refusals_are_counted_at_their_front(served, prompt_ids):
    served.idle()
    before = served.snapshot()
    for model, prompt in (("dflash_bls", {"text_input": "Write a long story about a lighthouse."}),
                          ("dflash", {"input_ids": prompt_ids})):
        stream = Stream(served.server.grpc_url)
        stream.send(model, max_tokens=1000, stream=True, end_id=-1, **prompt)
        for _ in range(3):  # it is running
            stream.responses.get(timeout=120)
        stream.close(cancel=True)
    # HTTP generate: a misspelt field (a request parameter) is refused by the front model itself
    reply = requests.post(f"http://{served.server.http_url}/v2/models/dflash_bls/generate",
                          json={"text_input": "Hi", "max_tokens": 4, "temprature": 0.5}, timeout=120)
    assert reply.status_code == 400 and "did you mean temperature" in reply.json()["error"]
    expected = {**requests_of("dflash_bls", cancelled__CANCELLED=1, refused__INVALID_ARG=1),
                **requests_of("dflash", cancelled__CANCELLED=1)}
    after = served.wait_for(before, expected)
    for (name, labels), want in expected.items():
        assert delta(after, before, name, **dict(labels)) == want, (name, dict(labels))
    for model in ("dflash_bls", "dflash"):  # the cancelled streams had their first tokens, and did not finish
        assert delta(after, before, "dflash_time_to_first_token_seconds_count", model=model) == 1
        assert delta(after, before, "dflash_e2e_request_latency_seconds_count", model=model) == 0
    assert delta(after, before, "dflash_requests_total", model="ensemble") == 0


def test_the_gateway_counts_its_requests_and_the_server_counts_them_as_dflash_bls(served):
    served.idle()
    url = served.server.gateway.url
    before, gateway_before = served.snapshot(), scrape(served.gateway_metrics)
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    whole = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    streamed = requests.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    assert whole.status_code == streamed.status_code == 200 and "data: [DONE]" in streamed.text
    # refused by the gateway itself (never reaches the server), and by the server (over the context)
    assert requests.post(f"{url}/v1/chat/completions", json={**body, "top_p": 2}, timeout=120).status_code == 400
    assert requests.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 100000},
                         timeout=120).status_code == 400
    assert requests.get(f"{url}/no/such/path", timeout=10).status_code == 404
    reasons = [whole.json()["choices"][0]["finish_reason"]]
    reasons += [json.loads(line[6:])["choices"][0]["finish_reason"] for line in streamed.text.splitlines()
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("finish_reason")]
    expected = requests_of("dflash_bls", refused__INVALID_ARG=1, stop=reasons.count("stop"),
                           length=reasons.count("length"))
    # the gateway always streams from the server: both answers have a first token there
    expected[("dflash_time_to_first_token_seconds_count", frozenset({("model", "dflash_bls")}))] = 2
    after = served.wait_for(before, expected)
    for (name, labels), want in expected.items():
        assert delta(after, before, name, **dict(labels)) == want, (name, dict(labels))
    gateway = scrape(served.gateway_metrics)
    chat = "/v1/chat/completions"
    assert delta(gateway, gateway_before, "dflash_gateway_requests_total", endpoint=chat, status="200") == 2
    assert delta(gateway, gateway_before, "dflash_gateway_requests_total", endpoint=chat, status="400") == 2
    assert delta(gateway, gateway_before, "dflash_gateway_requests_total", endpoint="other", status="404") == 1
    assert delta(gateway, gateway_before, "dflash_gateway_request_duration_seconds_count", endpoint=chat) == 4
    assert delta(gateway, gateway_before, "dflash_gateway_time_to_first_token_seconds_count", endpoint=chat) == 1
    # no API key on the metrics path, like the health path (Prometheus sends none)
    assert requests.get(served.gateway_metrics, timeout=10).headers["content-type"].startswith("text/plain")


def test_the_gateway_serves_the_engines_own_queue_and_kv_counts_to_a_router(served, default_build):
    """16 streams on 8 batch places: the protocol gauges on the gateway's port (what the endpoint picker scrapes) say
    8 running and 8 waiting while all are in flight, the KV blocks the build has, and 0 / 0 once they are closed."""
    served.idle()
    url, gateway = served.server.gateway.url, served.gateway_metrics
    before = scrape(gateway)
    assert value(before, "vllm:num_requests_running") == value(before, "vllm:num_requests_waiting") == 0
    kv_tokens = re.search(r'key: "kv_cache_tokens" value: \{ string_value: "(\d+)" \}',
                          (default_build / "model_repository/dflash/config.pbtxt").read_text()).group(1)
    assert value(before, "vllm:cache_config_info", block_size="16", num_gpu_blocks=str(int(kv_tokens) // 16)) == 1
    with streams(url, 16):  # closed at the end: the gateway cancels, the engine frees the place for a waiting one
        deadline, seen = time.monotonic() + 60, []
        while time.monotonic() < deadline and seen[-1:] != [(8, 8)]:  # all 16 in the engine, 8 of them decoding
            samples = scrape(gateway)
            seen.append((value(samples, "vllm:num_requests_running"), value(samples, "vllm:num_requests_waiting")))
            time.sleep(0.1)
        assert seen[-1] == (8, 8), seen[-10:]
        assert all(running <= 8 and running + waiting <= 16 for running, waiting in seen), seen
        assert 0 < value(samples, "vllm:kv_cache_usage_perc") < 1
        prompt = delta(samples, before, "vllm:prompt_tokens_total")
        assert prompt > 0 and prompt % 8 == 0  # one prompt's tokens per request the engine's queue took
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (value(after := scrape(gateway), "vllm:num_requests_running")
                                           or value(after, "vllm:num_requests_waiting")):
        time.sleep(0.2)
    assert value(after, "vllm:num_requests_running") == value(after, "vllm:num_requests_waiting") == 0
    assert delta(after, before, "vllm:generation_tokens_total") >= 8  # each running stream had its tokens


# --- the chart's PrometheusRule names what the servers export --------------------------------------------------

def rendered_rules() -> list[dict]:
    with helm_python.Chart.load(CHART) as chart:
        out = chart.render({"image": {"digest": "sha256:" + "ab" * 32}}, name="dflash", namespace="dflash")
    (rule,) = [doc for doc in yaml.safe_load_all(out["dflash/templates/prometheusrule.yaml"]) if doc]
    (group,) = rule["spec"]["groups"]
    return group["rules"]


def series_names(expr: str) -> set[str]:
    """The metric (and recorded series) names a PromQL expression reads."""
    expr = re.sub(r'"[^"]*"', "", expr)
    for clause in (r"\{[^}]*\}", r"\[[^\]]*\]", r"\b(?:by|without|on|ignoring)\s*\([^)]*\)"):
        expr = re.sub(clause, " ", expr)  # label matchers, ranges, groupings
    return {name for name, call in re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", expr)
            if not call and name not in ("and", "or", "unless")}


def test_the_prometheus_rule_names_only_metrics_and_labels_the_servers_export(served):
    rules = rendered_rules()
    exported = {name for name, _ in served.snapshot()} | {name for name, _ in scrape(served.gateway_metrics)}
    records = {r["record"] for r in rules if "record" in r}
    used = set()
    for rule in rules:
        names = series_names(rule["expr"])
        used |= names
        for name in names - records - {"up"}:  # up: Prometheus' own, per scraped endpoint
            assert name in exported, f"{rule.get('record') or rule.get('alert')} uses {name}, which no server exports"
    assert {"dflash_requests_total", "dflash_request_queue_time_seconds_sum", "dflash_queued_sequences",
            "nv_inference_queue_duration_us", "nv_inference_request_success"} <= used
    assert records <= used  # every recording rule is used
    # the label values the alerts select are the counters' own
    for rule in rules:
        for label, values in re.findall(r'(outcome|error_class)=~?"([^"]*)"', rule["expr"]):
            allowed = set(OUTCOMES) if label == "outcome" else {k for ks in OUTCOMES.values() for k in ks}
            assert set(values.split("|")) <= allowed, rule["expr"]
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    assert {"DFlashRequestsRefused", "DFlashRequestsInvalid", "DFlashRequestsFailing"} <= alerts.keys()
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]["alerts"]
    for alert, key in (("DFlashRequestsRefused", "refusedRatio"), ("DFlashRequestsInvalid", "invalidRatio"),
                       ("DFlashRequestsFailing", "failedRatio")):
        assert alerts[alert]["expr"].endswith(f"> {defaults[key]}"), alerts[alert]["expr"]


def test_the_grafana_dashboard_charts_only_what_the_servers_export(served):
    """The chart's dashboard, as rendered, for Grafana's sidecar: every panel's query names series a server exports
    (the engine's, the requests', the gateway's, the router protocol's), and the panels the issue asks for are there."""
    with helm_python.Chart.load(CHART) as chart:
        out = chart.render({"image": {"digest": "sha256:" + "ab" * 32}}, name="dflash", namespace="dflash")
    (config_map,) = [doc for doc in yaml.safe_load_all(out["dflash/templates/grafana-dashboard.yaml"]) if doc]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (dashboard,) = [json.loads(text) for text in config_map["data"].values()]
    # a request first: the counters by draft source exist from a source's first step
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    assert requests.post(f"{served.server.gateway.url}/v1/chat/completions", json=body, timeout=120).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "dflash_draft_tokens_total" not in {name for name, _ in served.snapshot()}:
        time.sleep(0.2)
    exported = {name for name, _ in served.snapshot()} | {name for name, _ in scrape(served.gateway_metrics)}
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            names = series_names(target["expr"])
            assert names and names <= exported, (panel["title"], names - exported)
            # every series is chosen by the dashboard's model, by the one label all of ours carry
            assert target["expr"].count('{model_name=~"$model_name"}') == len(re.findall(r"\b(?:dflash_|vllm:)",
                                                                                          target["expr"])), target
            used |= names
    assert {"dflash_generated_tokens_total", "dflash_time_to_first_token_seconds_bucket", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc", "dflash_prefix_cache_hit_tokens_total", "dflash_accepted_draft_tokens_total",
            "dflash_request_queue_time_seconds_bucket", "dflash_request_prefill_time_seconds_bucket"} <= used
    (model,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model_name"]
    assert re.fullmatch(r"label_values\(([\w:]+), model_name\)", model["definition"]).group(1) in exported
