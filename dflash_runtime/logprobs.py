"""Log-probabilities of the tokens a sequence emits, from the target's logits at each position.

They are the target's own: log-softmax of the logits the token was chosen from (after penalties, a grammar's mask
and min_tokens' hold, divided by the temperature of a sampled request; top-k and top-p not applied), at the position
that chose the token. A verify pass has those logits for every block position, so speculation reports exactly what
plain decoding would (within float tolerance: a block's pass and a one-token pass round differently).
"""
from __future__ import annotations

import torch

from .sampling import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs

# per emitted token: (its log-probability, [(token id, log-probability)] of the `logprobs` most likely, best first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, params: SamplingParams) -> list[TokenLogprobs]:
    """Each position's chosen token's log-probability and the top `params.logprobs`: logits [k, V], chosen [k]."""
    scores = logits.float() / (params.temperature if not params.greedy else 1.0)
    logprobs = torch.log_softmax(scores, dim=-1)
    own = logprobs.gather(-1, chosen[:, None].to(logprobs.device))[:, 0].tolist()
    if not params.logprobs:
        return [(lp, []) for lp in own]
    top = logprobs.topk(params.logprobs, dim=-1)
    return [(lp, list(zip(ids, values))) for lp, ids, values in zip(own, top.indices.tolist(), top.values.tolist())]
