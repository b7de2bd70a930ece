"""The documented commands as a user runs them: the console scripts beside the interpreter, in an environment without
the suite's DFLASH_CPU_WEIGHTS=float32 (conftest.py), so the embedded default loads in whatever format this host
serves it in (gguf-int4 wherever the GGUF kernels build). Everything else in the suite pins float32; a command that
breaks only on a user's defaults (the trainer did, on gguf-int4) is caught here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

BIN = Path(sys.executable).parent


def run(command: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_CPU_WEIGHTS"}
    done = subprocess.run([str(BIN / command), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    return done


def test_the_readmes_training_commands_run_on_a_users_defaults_and_train_a_lossless_drafter(tmp_path):
    """docs/training.md: dflash-drafter-data, then dflash-train-drafter on ShareGPT and on those answers
    (tiny sizes); the drafter it exports then serves through dflash-generate on the host's default weights, DFlash
    token-identical to plain decoding."""
    data, sharegpt, answers = tmp_path / "responses", tmp_path / "sharegpt-drafter", tmp_path / "answers-drafter"
    run("dflash-drafter-data", "--output", str(data), "--num-prompts", "2", "--max-new-tokens", "6",
        "--batch-size", "2", "--max-prompt-tokens", "64")
    assert len((data / "responses.jsonl").read_text().splitlines()) == 2
    small = ["--steps", "2", "--draft-layers", "1", "--batch-size", "2", "--seq-len", "64", "--anchors", "2",
             "--train-vocab", "512", "--tau-prompts", "0"]
    run("dflash-train-drafter", "--output", str(sharegpt), *small)
    run("dflash-train-drafter", "--output", str(answers), "--responses", str(data), "--feature-cache", "40", *small)
    for out in (sharegpt, answers):
        assert (out / "drafter" / "model.safetensors").is_file()

    outputs = {}
    for block_size in ("1", "8"):
        done = run("dflash-generate", "--drafter", str(sharegpt / "drafter"), "--prompt", "Name three colors.",
                   "--max-tokens", "16", "--block-size", block_size, "--json")
        outputs[block_size] = json.loads(done.stdout)["output_ids"]
    assert len(outputs["1"]) > 1 and outputs["8"] == outputs["1"]
