"""End to end on the embedded default: SmolLM2-135M-Instruct from its GGUF package plus our drafter."""
from __future__ import annotations

import json

import pytest
import torch

from dflash_runtime import SamplingParams
from dflash_runtime.sampling import DRAFT_SHARPNESS_CHOICES
from dflash_tools.cli import main
from dflash_runtime.pipeline import load_pipeline
from dflash_contract.presets import PRESETS

QUESTIONS = ["What is the capital of France? Answer in one sentence.", "Write a Python function that adds two numbers."]


@pytest.fixture(scope="module")
def smollm2():
    return load_pipeline("smollm2-135m")


def test_preset_drafter_is_lossless_against_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2.target_dir, dtype=torch.float32).eval()
    eos = list(smollm2.target.config.eos_token_ids)
    prompts = [smollm2.encode(q) for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=32)
    dflash = smollm2.engine(max_batch_size=2).generate(prompts, params)
    plain = smollm2.engine(block_size=1, max_batch_size=2).generate(prompts, params)
    for prompt, fast, slow in zip(prompts, dflash, plain):
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos[0])[0, len(prompt):].tolist()
        assert fast.output_ids == slow.output_ids == reference
        assert len(fast.stats.acceptance_lengths) <= len(fast.output_ids)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_a_sampled_answer_is_the_same_at_every_block_size(smollm2, temperature):
    """Seeded sampling (top-k 50, top-p 0.95) on the embedded default: block 1, 4, 8 and auto, alone and in a
    batch beside a greedy request, give the same tokens, and with a stop string the same end."""
    prompts = [smollm2.encode(q) for q in QUESTIONS]
    sampled = SamplingParams(max_new_tokens=32, temperature=temperature, top_k=50, top_p=0.95, seed=21)
    plain = [s.output_ids for s in smollm2.engine(block_size=1, max_batch_size=2).generate(prompts, sampled)]
    for block_size in (4, 8, "auto"):
        engine = smollm2.engine(block_size=block_size, max_batch_size=2)
        assert [s.output_ids for s in engine.generate(prompts, sampled)] == plain, block_size
    mixed = smollm2.engine(block_size=8, max_batch_size=2).generate(prompts[:2], [SamplingParams(max_new_tokens=32),
                                                                                 sampled])
    assert mixed[1].output_ids == plain[1]
    # a stop string from the middle of the sampled answer ends it at the same token at every block size
    words = smollm2.decode(plain[0]).split()
    stopped = SamplingParams(**{**sampled.__dict__, "stop_strings": (words[len(words) // 2],)})
    ends = {block_size: smollm2.engine(block_size=block_size, max_batch_size=2).generate(prompts[:1], stopped)[0]
            for block_size in (1, 8, "auto")}
    assert len({tuple(seq.output_ids) for seq in ends.values()}) == 1
    assert ends[8].finish_reason == "stop" and len(ends[8].output_ids) < len(plain[0])
    assert ends[8].output_ids == plain[0][:len(ends[8].output_ids)]


def test_second_turns_through_the_prefix_cache_are_plain_decoding(smollm2):
    """A conversation's second turn on the embedded default, greedy and seeded, prefilled in chunks of 24 on KV
    memory for about two sequences (so one is preempted as they grow): its prompt is found in the prefix cache, the tokens
    are plain decoding's (block 1, no cache), and a hit drafts as the same request served cold."""
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)  # answers that grow: 24 tokens each
    sampled = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, top_k=50, top_p=0.95, seed=5)
    params = [greedy, sampled, greedy]
    firsts = [[{"role": "user", "content": q}] for q in QUESTIONS + ["Name three primary colours."]]
    plain = smollm2.engine(block_size=1, max_batch_size=3, prefix_caching=False)
    answers = [smollm2.decode(s.output_ids) for s in plain.generate([smollm2.encode(m) for m in firsts], params)]
    seconds = [smollm2.encode(m + [{"role": "assistant", "content": a}, {"role": "user", "content": "And why?"}])
               for m, a in zip(firsts, answers)]
    expected = [s.output_ids for s in plain.generate(seconds, params)]
    # blocks of 16 for the first two prompts and a draft block (the blocks they share once): both run, and as they
    # grow one is preempted
    shared = next(i for i, (a, b) in enumerate(zip(*seconds[:2])) if a != b) // 16
    blocks = sum(-(-(len(ids) + 8) // 16) for ids in seconds[:2]) - shared
    engine = smollm2.engine(block_size=8, max_batch_size=3, kv_cache_tokens=blocks * 16, prefill_chunk=24)
    engine.generate([smollm2.encode(m) for m in firsts], params)
    served = engine.generate(seconds, params)
    assert [s.output_ids for s in served] == expected
    assert all(s.num_cached_tokens > 0 for s in served) and engine.occupancy().preemptions > 0
    cold = smollm2.engine(block_size=8, max_batch_size=1, prefix_caching=False).generate(seconds[:1], params[:1])[0]
    hit = smollm2.engine(block_size=8, max_batch_size=1)
    hit.generate(seconds[:1], params[:1])
    again = hit.generate(seconds[:1], params[:1])[0]
    assert again.num_cached_tokens > 0 and again.stats.acceptance_lengths == cold.stats.acceptance_lengths


def test_generate_command_answers_through_the_chat_template(capsys):
    assert main(["--prompt", QUESTIONS[0], "--max-new-tokens", "24", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "Paris" in result["text"]
    assert result["finish_reason"] == "stop" and result["output_ids"][-1] == 2  # <|im_end|>


def test_stop_string_ends_generation_and_leaves_the_text_unless_kept(capsys):
    # dflash_contract.protocol's rule, the server's too: generation ends at the token completing the stop
    # string; the text ends before it (OpenAI's rule), or after it with --include-stop-str-in-output
    texts = []
    for kept in ([], ["--include-stop-str-in-output"]):
        assert main(["--prompt", QUESTIONS[0], "--max-new-tokens", "24", "--stop", "Paris", "--json", *kept]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["finish_reason"] == "stop" and result["output_ids"][-1] != 2  # not the end-of-sequence token
        texts.append(result["text"])
    assert texts[0].startswith("The capital of France is") and "Paris" not in texts[0]
    assert texts[1] == texts[0] + "Paris"


def test_benchmark_reports_side_by_side_and_checks_identity(tmp_path, capsys):
    from dflash_tools.benchmark import main as bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Name three colors."}\n')
    assert bench(["--prompts", "chat", str(prompts), "--num-prompts", "1", "--max-new-tokens", "12", "--no-hf",
                  "--block-size", "auto", "8", "--suffix-drafts", "on", "off", "--json", str(tmp_path / "bench.json"),
                  "--plot", str(tmp_path / "bench.png")]) == 0
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert summary["block_sizes"] == ["auto", "8"] and summary["drafter_block_size"] == 8
    assert summary["modes"] == ["auto", "auto drafter-only", "8"]
    assert list(summary["prompt_sets"]) == ["chat", str(prompts)]
    for result in summary["prompt_sets"].values():
        assert result["token_identical_prompts"] == "1/1"
        assert set(result["tokens_per_second"]) == {"autoregressive", "dflash auto", "dflash auto drafter-only",
                                                    "dflash 8"}
        fixed, auto, alone = result["dflash"]["8"], result["dflash"]["auto"], result["dflash"]["auto drafter-only"]
        assert fixed["mean_acceptance_length"] >= 1 and fixed["speedup_vs_autoregressive"] > 0
        assert len(fixed["acceptance_by_position"]) <= PRESETS["smollm2-135m"].block_size - 1
        # on a CPU auto may verify any length up to the block; each step counted under one draft source
        assert set(fixed["verify_lengths"]) == {"8"} and set(auto["verify_lengths"]) <= {str(k) for k in range(1, 9)}
        assert set(fixed["by_source"]) == {"drafter"} and "suffix" not in alone["by_source"]
        assert sum(s["steps"] for s in auto["by_source"].values()) == sum(auto["verify_lengths"].values())
    assert (tmp_path / "bench.png").stat().st_size > 0
    table = capsys.readouterr().err.split("prompt set", 1)[1]  # the summary table after the progress lines
    assert "dflash auto drafter-only" in table and table.count("1/1") == 2


def test_benchmark_compares_the_ways_to_draft_under_sampling(tmp_path):
    """Sampled runs beside the greedy one, on the packaged MT-Bench and MATH-500 sets: every exact mode keeps the
    plain decoding's sample whatever the proposal rule; rejection sampling runs beside them."""
    from dflash_tools.benchmark import main as bench

    assert bench(["--prompts", "mtbench", "math500", "--num-prompts", "1", "--max-new-tokens", "12", "--no-hf",
                  "--block-size", "8", "--temperature", "0", "1", "--speculative-sampling", "exact", "rejection",
                  "--draft-sharpness", "auto", "1", "--json", str(tmp_path / "bench.json")]) == 0
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert summary["modes"] == ["8 exact sharpness auto", "8 exact sharpness 1", "8 rejection"]
    assert list(summary["prompt_sets"]) == ["mtbench", "math500", "mtbench T=1", "math500 T=1"]
    for name, result in summary["prompt_sets"].items():
        assert result["token_identical_prompts"] == "1/1"
        # the sampled sets repeat the greedy sets' prompts: every engine finds them in its prefix cache
        assert (result["prefix_cache_hit_rate"] > 0.5) == ("T=" in name)
        assert all(result["dflash"][mode]["mean_acceptance_length"] >= 1 for mode in summary["modes"])
        # the rule each exact mode drafted with after the set: learned among the choices, or the one asked for
        sharpness = result["draft_sharpness"]
        if "T=" in name:
            assert list(sharpness) == ["8 exact sharpness auto", "8 exact sharpness 1"]
            assert sharpness["8 exact sharpness 1"] == 1
            assert sharpness["8 exact sharpness auto"] in DRAFT_SHARPNESS_CHOICES
        else:
            assert sharpness == {}

