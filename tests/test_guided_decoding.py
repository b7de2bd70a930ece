"""Guided decoding in the engine (dflash_runtime/grammar.py): lossless under grammars, grammatical outputs, drafts
masked, bad guides refused with the input named, a slow compile refused while the engine keeps serving.

The tiny targets have no tokenizer: their 128 ids get a raw vocabulary here (printable ASCII, a few JSON pieces, the
mask and end ids as special tokens), which xgrammar takes as it takes a real tokenizer's."""
from __future__ import annotations

import json
import re

import pytest
import xgrammar

from conftest import BLOCK, EOS, PROMPTS, VOCAB, load_pair
from dflash_contract import DFlashError
from dflash_contract.guided_decoding import Guide, choice_grammar, guide_of
from dflash_runtime import SamplingParams, SpeculativeEngine
from dflash_runtime.grammar import GrammarCompiler

PIECES = ['{"', '": ', ', "', '"}', "true", "false", "null", "00", "12", "ab", "cd", "  "]
TEXTS = [chr(32 + i) for i in range(95)] + PIECES
TEXTS += [""] * (VOCAB - len(TEXTS))  # the mask and end ids among them: special, never allowed in text
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99},
                                           "tag": {"enum": ["ab", "cd", "abcd"]}},
          "required": ["ok", "n", "tag"]}
GUIDES = [Guide("json_schema", json.dumps(SCHEMA)), Guide("regex", r"(yes|no)! [a-d]{2,9}\."),
          Guide("ebnf_grammar", choice_grammar(["true", "false", "maybe so"]))]
NEW = 40


def decode(ids: list[int]) -> str:
    return "".join(TEXTS[i] for i in ids)


def compiler(seconds: float = 10.0) -> GrammarCompiler:
    info = xgrammar.TokenizerInfo(TEXTS, xgrammar.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[EOS])
    return GrammarCompiler(info, compile_seconds=seconds)


def engine(pair, block_size, **kwargs) -> SpeculativeEngine:
    target, drafter = pair
    return SpeculativeEngine(target, drafter, block_size=block_size, max_batch_size=4, grammars=compiler(), **kwargs)


def requests(guide: Guide) -> list[SamplingParams]:
    """Greedy and seeded sampling guided (the second and third exact: their samples are the target's own), then
    rejection sampling guided (the same distribution; its sample depends on the drafter), and one unguided request."""
    return [SamplingParams(max_new_tokens=NEW, guide=guide),
            SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=7, guide=guide),
            SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=3, guide=guide),
            SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=2, guide=guide, speculative_sampling="rejection"),
            SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=5)]


def matches(guide: Guide, text: str) -> bool:
    if guide.type == "json_schema":  # SCHEMA's rules, checked here (the lent GPU machine has no jsonschema)
        try:
            found = json.loads(text)
        except json.JSONDecodeError:
            return False
        return (isinstance(found, dict) and set(found) == {"ok", "n", "tag"} and isinstance(found["ok"], bool)
                and type(found["n"]) is int and found["n"] <= 99 and found["tag"] in ("ab", "cd", "abcd"))
    if guide.type == "regex":
        return re.fullmatch(guide.text, text) is not None
    return text in ("true", "false", "maybe so")


@pytest.mark.parametrize("guide", GUIDES, ids=[g.type for g in GUIDES])
def test_guided_dflash_equals_guided_plain_decoding(tiny, guide):
    """At block 1, BLOCK and auto, greedy and seeded: the same tokens; each guided output that stopped matches its
    guide (rejection sampling's too), and the unguided request beside them is what it is alone."""
    pair = load_pair(tiny)
    prompts = PROMPTS + PROMPTS[:1]
    runs = {}
    for block_size in (1, BLOCK, "auto"):
        seqs = engine(pair, block_size).generate(prompts, requests(guide))
        runs[block_size] = [(s.output_ids, s.finish_reason) for s in seqs]
    exact = [0, 1, 2, 4]
    assert [runs[1][i] for i in exact] == [runs[BLOCK][i] for i in exact] == [runs["auto"][i] for i in exact]
    for output, reason in [run[i] for run in runs.values() for i in range(4)]:
        if reason == "stop":
            assert output[-1] == EOS and matches(guide, decode(output[:-1])), decode(output)
        else:
            assert reason == "length" and len(output) == NEW
    alone = SpeculativeEngine(*pair, block_size=BLOCK).generate(prompts[4:], requests(guide)[4:])
    assert runs[1][4][0] == alone[0].output_ids


def test_every_draft_of_a_guided_sequence_is_grammatical(tiny):
    """Each block the target verifies: after the sequence's committed tokens, the grammar takes every draft in turn
    (until it has ended)."""
    eng = engine(load_pair(tiny), BLOCK)
    seq = eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=1, guide=GUIDES[0]))
    verify, checked = eng._verify_pass, []

    def checking(block, starts, table, *, length):
        replay = compiler().grammar(GUIDES[0], [EOS])
        assert all(replay.accept(t) for t in seq.output_ids)
        for token in block[0, 1:].tolist():
            if replay.matcher.is_terminated():
                break
            assert replay.accept(token), (decode(seq.output_ids), decode(block[0].tolist()))
        checked.append(block.shape[1])
        return verify(block, starts, table, length=length)

    eng._verify_pass = checking
    while eng.has_unfinished():
        eng.step()
    assert len(checked) > 1 and max(checked) == BLOCK


def test_guided_sequences_survive_preemption(tiny):
    """A KV cache too small for all four: sequences are preempted and recomputed; their grammars keep their state."""
    pair = load_pair(tiny)
    guide = GUIDES[0]
    small = engine(pair, BLOCK, kv_cache_tokens=160).generate(PROMPTS[:3], requests(guide)[:3])
    roomy = engine(pair, BLOCK).generate(PROMPTS[:3], requests(guide)[:3])
    assert [s.output_ids for s in small] == [s.output_ids for s in roomy]


def test_ignore_eos_ends_a_guided_sequence_where_its_grammar_ends(tiny):
    pair = load_pair(tiny)
    seq, = engine(pair, BLOCK).generate([PROMPTS[1]], SamplingParams(
        max_new_tokens=NEW, guide=GUIDES[2], stop_token_ids=(-1,), ignore_eos=True))
    assert seq.finish_reason == "stop" and decode(seq.output_ids) in ("true", "false", "maybe so")


@pytest.mark.parametrize("guide_type,text,words", [
    ("json_schema", '{"type": "integer", "minimum": "x"}', "does not compile"),
    ("regex", "(ab", "does not compile"),
    ("ebnf_grammar", "root ::= undefined_rule", "does not compile"),
])
def test_a_guide_that_does_not_compile_is_refused_naming_the_input(tiny, guide_type, text, words):
    eng = engine(load_pair(tiny), BLOCK)
    with pytest.raises(DFlashError, match=rf"guided_decoding_guide: the {guide_type} guide {words}"):
        eng.add_request(PROMPTS[0], SamplingParams(guide=Guide(guide_type, text)))
    assert not eng.has_unfinished()


@pytest.mark.parametrize("guide_type,text,words", [
    ("yaml", "a: b", "guided_decoding_guide_type must be one of json, json_schema, regex, ebnf_grammar"),
    ("regex", "", "guided_decoding_guide is required for guided_decoding_guide_type regex"),
    ("json", "{}", "guided_decoding_guide must be empty for guided_decoding_guide_type json"),
    ("json_schema", "{type: object}", "the JSON schema is not JSON"),
    ("json_schema", "[1]", "a JSON schema is an object"),
    ("json_schema", "x" * ((1 << 18) + 1), "over the limit"),
    (None, "a+", "guided_decoding_guide needs guided_decoding_guide_type"),
])
def test_bad_guides_are_refused_before_the_engine(guide_type, text, words):
    with pytest.raises(DFlashError, match=re.escape(words)):
        guide_of(guide_type, text)


def test_a_slow_compile_is_refused_and_the_engine_keeps_serving(tiny):
    """A schema whose grammar takes seconds to compile on the embedded default's 49,152-token vocabulary (a pattern
    of nested bounded repetitions: ~2.7 s with xgrammar 0.2.8 and 0.2.9 here) is refused at a 0.2 s limit; a
    request already running finishes as it would have."""
    from dflash_runtime.checkpoint import resolve_target
    from dflash_runtime.text import load_tokenizer

    target, drafter = load_pair(tiny)
    info = xgrammar.TokenizerInfo.from_huggingface(load_tokenizer(resolve_target("smollm2-135m")[0]),
                                                   vocab_size=49152, stop_token_ids=[2])
    slow = GrammarCompiler(info, compile_seconds=0.2)
    eng = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4, grammars=slow)
    running = eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=NEW))
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^([a-z]{1,60}[0-9]{1,60}){1,60}$"}}}
    with pytest.raises(DFlashError, match=r"the json_schema guide did not compile within 0.2 s"):
        eng.add_request(PROMPTS[1], SamplingParams(guide=Guide("json_schema", json.dumps(schema))))
    while eng.has_unfinished():
        eng.step()
    alone, = SpeculativeEngine(target, drafter, block_size=BLOCK).generate([PROMPTS[0]], SamplingParams(
        max_new_tokens=NEW))
    assert running.output_ids == alone.output_ids


def test_guided_requests_need_a_grammar_compiler(tiny):
    target, drafter = load_pair(tiny)
    eng = SpeculativeEngine(target, drafter, block_size=BLOCK)
    with pytest.raises(DFlashError, match="guided decoding needs the target's tokenizer and the xgrammar package"):
        eng.add_request(PROMPTS[0], SamplingParams(guide=GUIDES[0]))
