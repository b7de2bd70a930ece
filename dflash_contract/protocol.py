"""What travels between a client and the server's front models (`ensemble`, `dflash_bls`).

Names are tensorrtllm_backend's (`inflight_batcher_llm`), so existing Triton LLM clients work
unchanged; `model_repository/*/config.pbtxt` declare the same tensors (tests/test_build.py checks).

Stop strings: a stop string ends generation at the token that completes it, and the text keeps
that whole token, stop string included (tensorrtllm_backend's behaviour). The server, the clients
and `dflash-generate` all follow this rule.
"""
from __future__ import annotations

from dataclasses import dataclass

# Front-model inputs: name -> Triton data type (on the wire). text_input and max_tokens are required.
FRONT_INPUTS = {
    "text_input": "BYTES",
    "max_tokens": "INT32",
    "stream": "BOOL",
    "temperature": "FP32",
    "top_k": "INT32",
    "top_p": "FP32",
    "seed": "UINT64",
    "random_seed": "UINT64",  # the older name of seed
    "end_id": "INT32",
    "pad_id": "INT32",
    "stop_words": "BYTES",
    "bad_words": "BYTES",
    "apply_chat_template": "BOOL",
}
# What the front model passes on to the `dflash` engine model unchanged (text goes through preprocessing).
ENGINE_INPUTS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "random_seed", "end_id", "pad_id",
                 "stop_words", "bad_words")
# `dflash` model outputs besides the statistics: a window of token ids and how many were shown before.
TOKEN_OUTPUTS = ("output_ids", "read_offset")
FINISH_REASON = "finish_reason"  # BYTES: "" while running, then "stop", "length" or "cancelled"


@dataclass(frozen=True)
class Statistic:
    tensor: str  # the output's name; the first three are TensorRT-LLM's (its LLM-API model returns them too)
    data_type: str
    field: str  # its name in response_statistics() and in the clients' SpeculationStats


# Per-request statistics, cumulative over the request, in every response of `dflash` and the front models.
STATISTICS = (
    Statistic("total_accepted_draft_tokens", "INT32", "accepted_draft_tokens"),
    Statistic("total_draft_tokens", "INT32", "draft_tokens"),
    Statistic("acceptance_rate", "FP32", "acceptance_rate"),  # accepted / drafted
    Statistic("draft_steps", "INT32", "draft_steps"),  # verify passes
    Statistic("mean_acceptance_length", "FP32", "mean_acceptance_length"),  # accepted drafts + 1 per pass: tau
)


def response_statistics(draft_steps: int, accepted_draft_tokens: int, draft_tokens: int) -> dict[str, float | int]:
    """The STATISTICS values of a request (by field), from the engine's counts."""
    return {
        "accepted_draft_tokens": accepted_draft_tokens,
        "draft_tokens": draft_tokens,
        "acceptance_rate": accepted_draft_tokens / draft_tokens if draft_tokens else 0.0,
        "draft_steps": draft_steps,
        "mean_acceptance_length": (accepted_draft_tokens + draft_steps) / draft_steps if draft_steps else 0.0,
    }


def config_type(data_type: str) -> str:
    """A wire data type ("BYTES", "INT32", ...) as config.pbtxt and the Python backend spell it."""
    return "TYPE_STRING" if data_type == "BYTES" else f"TYPE_{data_type}"


# Errors a client may retry elsewhere or later: the phrases the server's messages contain. A gRPC
# stream carries an error as a bare message, so the phrase is what survives the trip.
CAPACITY_MESSAGE = "the server is at capacity"
SHUTTING_DOWN_MESSAGE = "the server is shutting down"
CANCELLED_MESSAGE = "request cancelled"
INTERNAL_ERROR_PREFIX = "internal error"
