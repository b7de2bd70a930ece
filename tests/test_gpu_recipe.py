"""dflash-gpu-recipe on a CPU: what it would bring to a lent GPU machine and what it would run there."""
from __future__ import annotations

import gzip
import importlib.metadata
import itertools
import json
import os

import pytest

from dflash_training import gpu_recipe


def test_gguf_parts_fit_the_limit_and_join_to_the_same_file(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(os.urandom(200_000) + bytes(300_000))  # half noise, half compressible
    parts = gpu_recipe.split_gzipped(source, tmp_path, 60_000)
    assert len(parts) > 2 and all(p.stat().st_size <= 60_000 for p in parts)
    parts.append(parts.pop(0))  # the order of a directory listing is no order
    assert gpu_recipe.join_parts(parts, tmp_path / "joined.gguf").read_bytes() == source.read_bytes()


def test_prepare_plans_calls_under_the_limit_and_its_sharegpt_reads_the_same(tmp_path, monkeypatch):
    """The compact ShareGPT gives the same train prompts (first and later turns) and held-out texts."""
    from dflash_tools.prompts import prompt_set, sharegpt_dialogues

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(3_000_000))
    monkeypatch.setattr(gpu_recipe, "RUN_LIMIT_BYTES", 2_500_000)
    monkeypatch.setattr(gpu_recipe, "tree_bytes", lambda repo: 400_000)
    args = gpu_recipe.build_parser().parse_args(["prepare", "--gguf", str(gguf)])
    calls = gpu_recipe.prepare(args, tmp_path)
    carry = tmp_path / gpu_recipe.CARRY
    assert [c[0] for c in calls[:2]] == [f"runs/gpu-carry/{gpu_recipe.GGUF_PART}{n}" for n in (1, 2)]
    assert all((tmp_path / c[0]).stat().st_size <= 2_500_000 - 400_000 - (1 << 20) for c in calls[:2])
    assert "runs/gpu-carry/sharegpt.json.gz" in calls[-1] and (carry / "pydeps" / "gguf" / "__init__.py").is_file()
    # with its version: transformers refuses a gguf package without one (it did, on the first GPU run)
    carried = [d.version for d in importlib.metadata.distributions(path=[str(carry / "pydeps")])]
    assert carried == [importlib.metadata.version("gguf")]
    humaneval = [json.loads(line)["prompt"] for line in (carry / "humaneval.jsonl").read_text().splitlines()]
    assert humaneval == prompt_set("humaneval", 164)

    original = (list(itertools.islice(sharegpt_dialogues("train"), 300)), prompt_set("sharegpt", 64),
                list(itertools.islice(sharegpt_dialogues("heldout"), 100)))
    monkeypatch.setenv("DFLASH_SHAREGPT_JSON", str(carry / "sharegpt.json.gz"))
    compact = (list(itertools.islice(sharegpt_dialogues("train"), 300)), prompt_set("sharegpt", 64),
               list(itertools.islice(sharegpt_dialogues("heldout"), 100)))
    for before, after in zip(original, compact):
        assert len(before) == len(after)  # every conversation kept its place
        for b, a in zip(before, after):  # texts over 8,000 characters are cut (far over any prompt limit)
            texts = [b] if isinstance(b, str) else [b[0], b[1], *b[2]]
            assert a == b or max(map(len, texts)) >= 8000
    assert len(gzip.decompress((carry / "sharegpt.json.gz").read_bytes())) < 80_000_000


def test_dry_run_prints_the_stages_within_the_minutes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no runs/gpu-carry here: the plain prompt set names
    argv = ["run", "--dry-run", "--target", "/models/t", "--init", "models/d", "--minutes", "9", "--output", "out"]
    assert gpu_recipe.main(argv) == 0
    commands = [line[2:].split() for line in capsys.readouterr().err.splitlines() if line.startswith("+ ")]
    assert [c[2] for c in commands] == ["dflash_training.drafter_data", "dflash_training.train_drafter",
                                        "dflash_tools.benchmark", "dflash_tools.benchmark"]
    data, train, start, trained = commands
    assert data[data.index("--max-minutes") + 1] == "2.70" and train[train.index("--max-minutes") + 1] == "3.15"
    assert all(c[c.index("--device") + 1:c.index("--device") + 4] == ["cuda", "--dtype", "bfloat16"]
               for c in (data, train))
    assert train[train.index("--init") + 1] == "models/d" and train[train.index("--responses") + 1] == "out/responses"
    assert start[start.index("--drafter") + 1] == "models/d" and trained[trained.index("--drafter") + 1] == \
        "out/train/drafter"
    assert not (tmp_path / "out").exists()


def test_a_real_run_needs_cuda(tmp_path, monkeypatch, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.chdir(tmp_path)
    assert gpu_recipe.main(["run", "--target", "/models/t"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
