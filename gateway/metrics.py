"""The gateway's own metrics, in Prometheus' text format on its port (GATEWAY_METRICS_PATH, no API key, like the
health path): requests by endpoint and HTTP status, their duration, and the time to the first text of a stream,
labelled model_name as every series of the server is.

The gateway is a process of its own, so it cannot add to tritonserver's metrics port; Prometheus scrapes both
(the chart's ServiceMonitor). A request the gateway passes on is counted by the server too, as dflash_bls's. No
client library: a few counters and histograms, written out here, keep the gateway's dependencies as they are.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from dflash_contract.server import E2E_BUCKETS, GATEWAY_HEALTH_PATH, GATEWAY_METRICS_PATH, TTFT_BUCKETS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
GENERATE_ENDPOINTS = (CHAT_PATH, COMPLETIONS_PATH)
CHAT_RENDER_PATH, COMPLETIONS_RENDER_PATH = CHAT_PATH + "/render", COMPLETIONS_PATH + "/render"  # vLLM's
MODEL_ENDPOINT = "/v1/models/{model}"
# the `endpoint` label: these paths, MODEL_ENDPOINT for /v1/models/<id>, and "other" for any other path (bounded)
ENDPOINTS = (*GENERATE_ENDPOINTS, CHAT_RENDER_PATH, COMPLETIONS_RENDER_PATH, "/v1/models", MODEL_ENDPOINT,
             GATEWAY_HEALTH_PATH, GATEWAY_METRICS_PATH)
OTHER = "other"
CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer ended
# a health check or a model list takes milliseconds; an answer the time of its tokens
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025) + E2E_BUCKETS

REQUESTS = ("dflash_gateway_requests_total", "counter",
            "HTTP requests by endpoint and status (499: the client closed the connection before the answer ended)")
DURATION = ("dflash_gateway_request_duration_seconds", "histogram",
            "From the request's arrival to the end of its answer (a stream's last event)")
TIME_TO_FIRST_TOKEN = ("dflash_gateway_time_to_first_token_seconds", "histogram",
                       "Streamed completions: from the request's arrival to its first event with text")


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{{labels},le="{bound:g}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        return out + [f"{name}_sum{{{labels}}} {self.total!r}", f"{name}_count{{{labels}}} {self.count}"]


class GatewayMetrics:
    """Counts and times requests; written out by `render`. One event loop uses it: no locks."""

    def __init__(self, model_name: str):
        self.model_label = f'model_name="{label_value(model_name)}"'  # the server's and the engine's label, too
        self.requests: dict[tuple[str, int], int] = {}
        self.duration = {endpoint: _Histogram(DURATION_BUCKETS) for endpoint in (*ENDPOINTS, OTHER)}
        self.first_token = {endpoint: _Histogram(TTFT_BUCKETS) for endpoint in GENERATE_ENDPOINTS}

    def request_done(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1
        self.duration[endpoint].observe(seconds)

    def first_text(self, endpoint: str, seconds: float) -> None:
        self.first_token[endpoint].observe(seconds)

    def render(self) -> str:
        lines = []
        name, kind, description = REQUESTS
        lines += [f"# HELP {name} {description}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{{self.model_label},endpoint="{endpoint}",status="{status}"}} {count}'
                  for (endpoint, status), count in sorted(self.requests.items())]
        for (name, kind, description), histograms in ((DURATION, self.duration),
                                                      (TIME_TO_FIRST_TOKEN, self.first_token)):
            lines += [f"# HELP {name} {description}", f"# TYPE {name} {kind}"]
            for endpoint, histogram in histograms.items():
                lines += histogram.lines(name, f'{self.model_label},endpoint="{endpoint}"')
        return "\n".join(lines) + "\n"


def label_value(text: str) -> str:
    """`text` as a Prometheus label value, escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class FirstText:
    """A stream's time to its first event with text: call it after each such event (only the first counts)."""

    def __init__(self, metrics: GatewayMetrics, endpoint: str, started: float):
        self.metrics, self.endpoint, self.started, self.seen = metrics, endpoint, started, False

    def __call__(self) -> None:
        if not self.seen:
            self.seen = True
            self.metrics.first_text(self.endpoint, time.monotonic() - self.started)


def endpoint_of(path: str) -> str:
    if path in ENDPOINTS:
        return path
    return MODEL_ENDPOINT if path.startswith("/v1/models/") else OTHER


class MetricsMiddleware:
    """ASGI middleware: each HTTP request counted once its answer ended (or broke off), with its status."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status, ended = time.monotonic(), None, False

        async def sending(message):
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            # no answer begun: the exception handler outside this middleware answers 500
            code = 500 if status is None else status if ended else CLIENT_CLOSED
            self.metrics.request_done(endpoint_of(scope["path"]), code, time.monotonic() - started)
