"""Repetition, frequency and presence penalties (dflash_runtime/penalties.py): vLLM's rules, the same tokens at
every block size (the drafts counted as output along the block), and transformers' repetition penalty."""
from __future__ import annotations

import pytest
import torch

from conftest import BLOCK, EOS, PROMPTS, load_pair
from dflash_contract import DFlashError
from dflash_runtime import SamplingParams, SpeculativeEngine

NEW = 40
PENALISED = [SamplingParams(max_new_tokens=NEW, repetition_penalty=1.3),
             SamplingParams(max_new_tokens=NEW, frequency_penalty=0.8, presence_penalty=0.5, temperature=0.9, seed=4),
             SamplingParams(max_new_tokens=NEW, presence_penalty=-1.0, repetition_penalty=0.8),
             SamplingParams(max_new_tokens=NEW)]


def test_penalised_dflash_equals_penalised_plain_decoding(tiny):
    pair = load_pair(tiny)
    runs = {b: [s.output_ids for s in SpeculativeEngine(*pair, block_size=b, max_batch_size=4).generate(
        PROMPTS, PENALISED)] for b in (1, BLOCK, "auto")}
    assert runs[1] == runs[BLOCK] == runs["auto"]
    free = SpeculativeEngine(*pair, block_size=BLOCK).generate(PROMPTS[:1], SamplingParams(max_new_tokens=NEW))
    assert runs[1][0] != free[0].output_ids  # the penalty changed something


def reference(target_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with vLLM's formulas over transformers' logits, one token at a time."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < params.max_new_tokens:
            logits = model(torch.tensor([ids])).logits[0, -1]
            out = ids[len(prompt):]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(logits)).float()
            seen = set(ids) if params.repetition_penalty != 1 else set()
            for t in seen:
                logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * \
                    params.repetition_penalty
            logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
            ids.append(int(logits.argmax()))
            if ids[-1] == EOS:
                break
    return ids[len(prompt):]


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=24, repetition_penalty=1.5),
                                    SamplingParams(max_new_tokens=24, frequency_penalty=1.2, presence_penalty=0.4)],
                         ids=["repetition", "frequency+presence"])
def test_penalties_follow_vllms_rules(tiny, params):
    seqs = SpeculativeEngine(*load_pair(tiny), block_size=BLOCK).generate(PROMPTS[:2], params)
    assert [s.output_ids for s in seqs] == [reference(tiny[0], p, params) for p in PROMPTS[:2]]


@pytest.mark.parametrize("field,value,words", [("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
                                               ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2]"),
                                               ("presence_penalty", float("nan"), "presence_penalty must be in")])
def test_out_of_range_penalties_are_refused(field, value, words):
    with pytest.raises(DFlashError, match=words.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})
