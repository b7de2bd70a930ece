"""Drafter training past one process: torchrun with the gloo backend on this CPU (2 ranks), and answers from an
OpenAI-compatible server (the project's gateway on the embedded default).

Two ranks must train as one process does (the same losses and held-out curve, step for step), share the data
generator's prompts without overlap or gap, and a checkpoint written at one world size must resume at another.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from dflash_runtime.checkpoint import resolve_target
from dflash_runtime.text import load_tokenizer
from dflash_training import drafter_data
from dflash_training.distributed import Ranks

TRAIN = ["--target", "smollm2-135m", "--batch-size", "4", "--seq-len", "64", "--anchors", "4", "--draft-layers", "1",
         "--tau-prompts", "0", "--eval-every", "1", "--save-every", "2", "--warmup", "1", "--train-vocab", "512"]
DATA = ["--max-new-tokens", "6", "--batch-size", "2", "--max-prompt-tokens", "64"]


def launch(module: str, args: list[str], ranks: int) -> subprocess.CompletedProcess:
    """`python -m module args` as one process, or under torchrun with `ranks` processes (gloo on this CPU); one
    torch thread per process: the 2 cores are shared. The trainer runs without the suite's DFLASH_CPU_WEIGHTS, as
    from a user's shell: its target's format is its own (train_drafter.TRAINING_CPU_WEIGHTS)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    if module == "dflash_training.train_drafter":
        del env["DFLASH_CPU_WEIGHTS"]
    command = [sys.executable, "-m", module, *args] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
        "-m", module, *args]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def curve(out) -> list[dict]:
    return [json.loads(line) for line in (out / "learning_curve.jsonl").read_text().splitlines()]


def assert_same_curve(one: list[dict], other: list[dict]) -> None:
    assert [r["step"] for r in one] == [r["step"] for r in other]
    for a, b in zip(one, other):
        assert a["tokens_seen"] == b["tokens_seen"]
        for field in ("train_loss", "heldout_loss"):
            assert b[field] == pytest.approx(a[field], rel=1e-3, abs=1e-3), (field, a, b)
        assert b["heldout_accuracy_by_position"] == pytest.approx(a["heldout_accuracy_by_position"], abs=1e-3)


# sharded: 1050 tokens are 17 texts, 9 prefilled by rank 0 in 2 prefills, 8 by rank 1 in one, which then joins rank
# 0's second with a spare (every prefill of a sharded target is a collective)
@pytest.mark.parametrize("data", [[], ["--feature-cache", "3000"], ["--feature-cache", "1050", "--shard-target"]],
                         ids=["a prefill per step", "feature cache", "sharded target"])
def test_two_ranks_train_as_one_process_and_a_checkpoint_resumes_at_another_world_size(tmp_path, data):
    """4 steps in one process; 2 steps on 2 ranks, then steps 3-4 resumed in one process from their checkpoint:
    the same losses at every step, so the curve continues as if one process had trained throughout. With
    --shard-target the 2 ranks hold half the target's layers each (FSDP2; one process holds them whole)."""
    single, mixed = tmp_path / "single", tmp_path / "mixed"
    whole = launch("dflash_training.train_drafter", TRAIN + data + ["--output", str(single), "--steps", "4"], ranks=1)
    shared = launch("dflash_training.train_drafter", TRAIN + data + ["--output", str(mixed), "--steps", "2"], ranks=2)
    if "--shard-target" in data:  # rank 0's estimate: its half of the layers, two whole ones, and the rest
        held = [float(re.search(r"target weights ([0-9.]+)", run.stderr)[1]) for run in (whole, shared)]
        assert 0.5 * held[0] < held[1] < 0.75 * held[0], held
    assert [r["world_size"] for r in curve(mixed)] == [2, 2]
    resumed = launch("dflash_training.train_drafter", TRAIN + data + ["--output", str(mixed), "--steps", "4"], ranks=1)
    assert "resumed at step 2" in resumed.stderr
    assert [r["world_size"] for r in curve(mixed)] == [2, 2, 1, 1]
    assert_same_curve(curve(single), curve(mixed))
    assert curve(single)[-1]["train_loss"] < curve(single)[0]["train_loss"]  # it trains: the check can fail
    if data:  # the ranks' shares of the cache, put back in order, are the single process's cache
        import torch

        one, two = (torch.load(out / "features.pt", weights_only=False) for out in (single, mixed))
        assert one["texts_read"] == two["texts_read"] and len(one["sequences"]) == len(two["sequences"])
        assert all(torch.equal(a[0], b[0]) and a[4] == b[4] for a, b in zip(one["sequences"], two["sequences"]))
        assert not list(mixed.glob("*.tmp"))


def test_the_ranks_prompt_shares_are_disjoint_and_together_every_prompt():
    tokenizer = load_tokenizer(resolve_target("smollm2-135m")[0])

    def keys(ranks: Ranks, count: int) -> list[tuple[int, int]]:
        stream = drafter_data.prompt_stream(tokenizer, 64, True, lambda key: False, ranks)
        return [(key["index"], key["turn"]) for key, _, _ in (next(stream) for _ in range(count))]
    whole = keys(Ranks(0, 1), 60)
    shares = [keys(Ranks(r, 3), 40) for r in range(3)]
    assert all(index % 3 == r for r, share in enumerate(shares) for index, _ in share)
    seen = [key for share in shares for key in share]
    assert len(seen) == len(set(seen))  # disjoint
    below = min([whole[-1][0]] + [share[-1][0] for share in shares])  # where every stream is complete
    together = sorted(key for key in seen if key[0] < below)
    assert len(together) > 20 and together == sorted(key for key in whole if key[0] < below)  # every prompt
    assert [drafter_data.rank_share(10, Ranks(r, 3)) for r in range(3)] == [4, 3, 3]


def test_two_ranks_answer_their_own_prompts_and_a_run_of_another_size_resumes_after_them(tmp_path):
    """torchrun with 2 ranks: one file per rank, conversations of the rank's parity, the budget split; a single
    process then answers only what no file holds, and the trainer reads the three files as one data set."""
    data = tmp_path / "data"
    launch("dflash_training.drafter_data", DATA + ["--output", str(data), "--num-prompts", "5"], ranks=2)
    ranked = [[json.loads(line) for line in (data / f"responses.rank{r}.jsonl").read_text().splitlines()]
              for r in range(2)]
    assert [len(records) for records in ranked] == [3, 2]
    assert all(rec["index"] % 2 == r for r, records in enumerate(ranked) for rec in records)
    launch("dflash_training.drafter_data", DATA + ["--output", str(data), "--num-prompts", "2"], ranks=1)
    records = drafter_data.read_responses(data)
    keys = [drafter_data.response_key(r) for r in records]
    assert len(records) == 7 and len(set(keys)) == 7
    assert [p.name for p in drafter_data.responses_files(data)] == [
        "responses.jsonl", "responses.rank0.jsonl", "responses.rank1.jsonl"]

    # each rank's answers are the target's greedy answers, as one process gives them
    solo = tmp_path / "solo"
    launch("dflash_training.drafter_data", DATA + ["--output", str(solo), "--num-prompts", "7"], ranks=1)
    by_key = {drafter_data.response_key(r): r for r in drafter_data.read_responses(solo)}
    common = [r for r in records if drafter_data.response_key(r) in by_key]
    assert len(common) >= 5
    assert all(r["prompt_ids"] == by_key[drafter_data.response_key(r)]["prompt_ids"] and
               r["response_ids"] == by_key[drafter_data.response_key(r)]["response_ids"] for r in common)


def test_server_answers_equal_the_in_process_ones_on_the_embedded_default(tmp_path, default_server):
    """dflash-drafter-data --server against the project's gateway: the same prompt ids and the same greedy answers
    as the target in this process: the same ids, or (the documented re-tokenisation difference, seen on 2 of 32
    answers of 64 tokens: the model emits "\\n\\n" as one token, its tokenizer encodes it as two) the same text, with
    the server's own count equal to the sampled ids'."""
    server, local = tmp_path / "server", tmp_path / "local"
    tokenizer = load_tokenizer(resolve_target("smollm2-135m")[0])
    common = ["--num-prompts", "6", "--max-new-tokens", "12", "--max-prompt-tokens", "64"]
    assert drafter_data.main(common + ["--output", str(server), "--server", f"{default_server.gateway.url}/v1",
                                       "--concurrency", "4"]) == 0
    assert drafter_data.main(common + ["--output", str(local), "--batch-size", "4"]) == 0
    served = {drafter_data.response_key(r): r for r in drafter_data.read_responses(server)}
    made = {drafter_data.response_key(r): r for r in drafter_data.read_responses(local)}
    assert served.keys() == made.keys() and len(made) == 6
    for key, record in made.items():
        answer = served[key]
        assert answer["prompt_ids"] == record["prompt_ids"]
        assert answer["finish_reason"] == record["finish_reason"] and answer["response_ids_from"] == "text"
        eos = answer["finish_reason"] == "stop"
        assert answer["server_completion_tokens"] == len(record["response_ids"]) - eos, key
        if answer["response_ids"] != record["response_ids"]:
            assert tokenizer.decode(answer["response_ids"]) == tokenizer.decode(record["response_ids"]), key


def test_a_server_that_cannot_answer_is_named_and_loses_nothing(tmp_path, default_server, capsys):
    out = tmp_path / "data"
    url = f"{default_server.gateway.url}/v1"
    assert drafter_data.main(["--output", str(out), "--num-prompts", "1", "--max-new-tokens", "4",
                              "--server", url, "--model", "no-such-model"]) == 2
    assert f"{url} answered HTTP 404" in capsys.readouterr().err
    assert drafter_data.read_responses(out, missing_ok=True) == []
    assert drafter_data.main(["--output", str(out), "--server", default_server.gateway.url, "--num-prompts", "1"]) == 2
    assert "ending in /v1" in capsys.readouterr().err


def test_options_are_checked_before_any_work(tmp_path, capsys):
    from dflash_training.train_drafter import main

    with pytest.raises(SystemExit):
        main(["--output", str(tmp_path), "--anchors", "0"])
    assert "--anchors: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        drafter_data.main(["--output", str(tmp_path), "--concurrency", "0"])
    assert "--concurrency: must be >= 1, got 0" in capsys.readouterr().err
