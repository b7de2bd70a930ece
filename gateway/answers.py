"""Our results -> OpenAI's objects: whole responses, stream chunks, usage, logprobs in OpenAI's shapes, and our
statistics beside them (the requests' way in: api.py). Pure functions, no server."""
from __future__ import annotations

from clients.results import SpeculationStats

from .api import Translated
from .reasoning import split as split_reasoning

EXTENSION_FIELD = "dflash"  # our statistics, in the final chunk and in a whole response


def finish_reason(ours: str) -> str:
    """OpenAI's finish_reason for ours: "stop" (an end-of-sequence id or a stop string) or "length"; "tool_calls"
    (chat_message's) as it is."""
    return ours if ours in ("length", "tool_calls") else "stop"


def combined(stats: list[SpeculationStats]) -> SpeculationStats:
    """The counts of a request's choices together, as OpenAI counts n choices: the prompt once, every choice's
    completion (and drafts)."""
    first = stats[0]
    drafted = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_draft_tokens for s in stats)
    steps = sum(s.draft_steps for s in stats)
    return SpeculationStats(accepted, drafted, accepted / drafted if drafted else None, steps,
                            (accepted + steps) / steps if steps else None, first.prompt_tokens, first.cached_tokens,
                            sum(s.completion_tokens for s in stats))


def usage(stats: SpeculationStats) -> dict:
    rejected = stats.draft_tokens - stats.accepted_draft_tokens
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},  # OpenAI's own field
            # SGLang's fields for speculative decoding's drafted tokens
            "completion_tokens_details": {"accepted_prediction_tokens": stats.accepted_draft_tokens,
                                          "rejected_prediction_tokens": rejected}}


def statistics(stats: SpeculationStats) -> dict:
    return {"draft_steps": stats.draft_steps, "accepted_draft_tokens": stats.accepted_draft_tokens,
            "draft_tokens": stats.draft_tokens,  # the ratios are None (null) with nothing to report
            "acceptance_rate": stats.acceptance_rate and round(stats.acceptance_rate, 4),
            "mean_acceptance_length": stats.mean_acceptance_length and round(stats.mean_acceptance_length, 4)}


def chat_response(t: Translated, model_id: str, results: list[tuple[str, str, SpeculationStats, list]]) -> dict:
    """The whole answer; results: (text, our finish reason, counts, logprobs entries) per choice."""
    choices = []
    for i, (text, reason, _, entries) in enumerate(results):
        message, reason = chat_message(t, text, reason)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(t, entries),
                        "finish_reason": reason})
    stats = combined([r[2] for r in results])
    return {"id": f"chatcmpl-{t.id}", "object": "chat.completion", "created": t.created, "model": model_id,
            "choices": choices, "usage": usage(stats), EXTENSION_FIELD: statistics(stats)}


def rendered(t: Translated, model_id: str, token_ids: list[int], chat: bool) -> dict | list[dict]:
    """A render's answer, as vLLM's render endpoints give it (its GenerateRequest: the fields a router reads; the
    sampling parameters and the rest are left out): one for a chat request, a list of one per prompt for a
    completion (one prompt per request here)."""
    if chat:
        return {"request_id": f"chatcmpl-{t.id}", "model": model_id, "token_ids": token_ids}
    return [{"request_id": f"cmpl-{t.id}-0", "model": model_id, "token_ids": token_ids}]


def chat_message(t: Translated, text: str, reason: str) -> tuple[dict, str]:
    """The assistant's message and OpenAI's finish_reason: the reasoning apart where the build names a parser
    (reasoning.py), tool calls where the request's tools parse some in the rest (then finish_reason "tool_calls"),
    else the text."""
    thought, text = split_reasoning(text) if t.reasoning else (None, text)
    message = {"role": "assistant", **({"reasoning_content": thought} if thought is not None else {})}
    content, calls = t.tools.calls(text) if t.tools is not None and reason != "length" else (text, [])
    if not calls:
        return {**message, "content": text}, finish_reason(reason)
    return {**message, "content": content, "tool_calls": calls}, "tool_calls"


def completion_response(t: Translated, model_id: str, results: list[tuple[str, str, SpeculationStats, list]]) -> dict:
    choices = [{"index": i, "text": text, "logprobs": completion_logprobs(t, entries),
                "finish_reason": finish_reason(reason)} for i, (text, reason, _, entries) in enumerate(results)]
    stats = combined([r[2] for r in results])
    return {"id": f"cmpl-{t.id}", "object": "text_completion", "created": t.created, "model": model_id,
            "choices": choices, "usage": usage(stats), EXTENSION_FIELD: statistics(stats)}


def chat_chunk(t: Translated, model_id: str, delta: dict | None, reason: str | None = None,
               stats: SpeculationStats | None = None, index: int = 0, entries: list | None = None) -> dict:
    """A chat.completion.chunk of choice `index`: a delta (and its tokens' logprobs entries); with `reason`, the one
    chunk that carries finish_reason (and our statistics); with delta None, the usage chunk (no choices)."""
    chunk = {"id": f"chatcmpl-{t.id}", "object": "chat.completion.chunk", "created": t.created, "model": model_id,
             "choices": [] if delta is None else [{"index": index, "delta": delta,
                                                    "logprobs": chat_logprobs(t, entries),
                                                    "finish_reason": reason and finish_reason(reason)}]}
    return _with_extras(chunk, t, delta is None, reason, stats)


def completion_chunk(t: Translated, model_id: str, text: str | None, reason: str | None = None,
                     stats: SpeculationStats | None = None, index: int = 0, entries: list | None = None) -> dict:
    chunk = {"id": f"cmpl-{t.id}", "object": "text_completion", "created": t.created, "model": model_id,
             "choices": [] if text is None else [{"index": index, "text": text,
                                                   "logprobs": completion_logprobs(t, entries),
                                                   "finish_reason": reason and finish_reason(reason)}]}
    return _with_extras(chunk, t, text is None, reason, stats)


def chat_logprobs(t: Translated, entries: list | None) -> dict | None:
    """Chat's logprobs of some tokens: {"content": the server's entries} (None where the request asked for none)."""
    if t.request.params.logprobs is None:
        return None
    return {"content": list(entries or []), "refusal": None}


def completion_logprobs(t: Translated, entries: list | None) -> dict | None:
    """The completions API's legacy shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset."""
    if t.request.params.logprobs is None:
        return None
    entries, offsets, at = entries or [], [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{top["token"]: top["logprob"] for top in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def _with_extras(chunk: dict, t: Translated, usage_chunk: bool, reason: str | None, stats) -> dict:
    if t.include_usage:  # OpenAI: null in every chunk but the last, which has the usage
        chunk["usage"] = usage(stats) if usage_chunk else None
    if reason and not usage_chunk:
        chunk[EXTENSION_FIELD] = statistics(stats)
    return chunk
