"""The model-server protocol of the Kubernetes Inference Gateway (gateway-api-inference-extension's
docs/proposals/003-model-server-protocol): the gauges its endpoint picker scrapes from each replica, at the port it
routes to (this gateway's), to choose one by queue depth and free KV cache.

In vLLM's dialect, the picker's default engine type ("vllm": no pod label needed, and `llm-d.ai/engine-type: vllm`
says it explicitly), whose names and meanings are read from the picker's own defaults (llm-d-router
pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go): a pod labelled `triton-tensorrt-llm` would be
read for TensorRT-LLM's C++ backend's metric names, which describe another engine's batch manager. The counts are the
engine's own (dflash_contract.engine_counts), as of its last change; before the engine's first count, and for a
gateway started without dflash-serve, there are none to serve and these families are left out (the picker logs the
missing metric and treats the pod as having no data, rather than an idle one).
"""
from __future__ import annotations

from dflash_contract.engine_counts import Counts

from .metrics import label_value

ENGINE_TYPE = "vllm"  # the picker's engine type for these names (the chart's pod label llm-d.ai/engine-type)
ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"


def protocol_metrics(counts: Counts | None, model_name: str) -> str:
    """The protocol's families in Prometheus' text format, labelled as vLLM labels them (model_name)."""
    if counts is None:
        return ""
    model_name = label_value(model_name)
    label = f'{{model_name="{model_name}"}}'
    families = (
        (RUNNING, "gauge", "Requests in the engine's running batch", counts.running),
        (WAITING, "gauge", "Requests waiting for a place in the engine's batch", counts.waiting),
        (KV_CACHE_USAGE, "gauge", "KV-cache usage: KV blocks held by running requests / all; 1 means 100 percent",
         counts.kv_cache_usage),
        (PROMPT_TOKENS, "counter", "Prompt tokens of the requests the engine's queue took", counts.prompt_tokens),
        (GENERATION_TOKENS, "counter", "Tokens the engine generated", counts.generation_tokens),
    )
    lines = []
    for name, kind, description, value in families:
        lines += [f"# HELP {name} {description}", f"# TYPE {name} {kind}", f"{name}{label} {value!r}"]
    lines += [f"# HELP {CACHE_CONFIG} The KV cache's geometry: tokens per block and blocks",
              f"# TYPE {CACHE_CONFIG} gauge",
              f'{CACHE_CONFIG}{{block_size="{counts.block_size}",model_name="{model_name}",'
              f'num_gpu_blocks="{counts.kv_blocks}"}} 1']
    return "\n".join(lines) + "\n"
