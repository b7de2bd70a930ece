"""The drafter trainer: it learns, it checkpoints and resumes, and what it exports drafts losslessly."""
from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch

from conftest import BLOCK, MASK, PROMPTS, REPO
from dflash_runtime import SamplingParams, SpeculativeEngine, load_target
from dflash_runtime.pipeline import load_pipeline
from dflash_tools.prompts import sharegpt_conversations
from dflash_training import memory
from dflash_training.block_loss import block_loss, draw_anchors, recipe_decay
from dflash_training.features import CachedSequence, target_features
from dflash_training.train_drafter import main, new_drafter
from dflash_training.training_data import training_texts


@pytest.mark.parametrize("soft_labels", [False, True], ids=["argmax labels", "distribution labels"])
def test_loss_decreases_on_a_fixed_batch(tiny, soft_labels):
    torch.manual_seed(0)
    target = load_target(tiny[0])
    drafter = new_drafter(target, num_layers=1, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=(1, 3))
    batch = [s.prompt_ids + s.output_ids for s in SpeculativeEngine(target, max_batch_size=4).generate(
        PROMPTS, SamplingParams(max_new_tokens=40, ignore_eos=True))]
    tokens, features, final = target_features(target, batch, (1, 3))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses, first_accuracy = [], None
    for _ in range(60):
        generator = torch.Generator().manual_seed(0)  # the same anchors every step: a fixed batch
        loss, correct, counted = block_loss(drafter, target, tokens, features, final, [len(b) for b in batch],
                                            BLOCK, 8, 7.0, generator, soft_labels=soft_labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        first_accuracy = first_accuracy if first_accuracy is not None else (correct[0] / counted[0]).item()
    # measured: Qwen3 fixture 4.82 -> ~3.3, Llama fixture falls further
    assert losses[-1] < 0.8 * losses[0], losses
    assert (correct[0] / counted[0]).item() > first_accuracy


def test_trainer_checkpoints_resumes_and_exports_a_lossless_drafter(tmp_path, capsys):
    """A few real steps on the embedded default (SmolLM2 + ShareGPT), then two more after a restart."""
    out = tmp_path / "run"
    common = ["--target", "smollm2-135m", "--output", str(out), "--draft-layers", "1", "--batch-size", "1",
              "--seq-len", "64", "--anchors", "2", "--eval-every", "2", "--save-every", "2", "--warmup", "1",
              "--train-vocab", "512", "--tau-prompts", "1"]
    assert main(common + ["--steps", "2"]) == 0
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 2
    assert main(common + ["--steps", "4"]) == 0
    assert "resumed at step 2" in capsys.readouterr().err
    curve = [json.loads(line) for line in (out / "learning_curve.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve] == [2, 4]
    assert curve[1]["tokens_seen"] > curve[0]["tokens_seen"] > 0
    assert len(curve[1]["heldout_accuracy_by_position"]) == 15
    assert 1.0 <= curve[1]["heldout_measured_tau"] <= 16
    assert (out / "learning_curve.png").stat().st_size > 0

    # a new run can start from the exported drafter (how the committed drafter is trained further)
    follow = [a if a != str(out) else str(tmp_path / "follow") for a in common]
    assert main(follow + ["--steps", "1", "--init", str(out / "drafter")]) == 0
    assert (tmp_path / "follow" / "drafter" / "model.safetensors").is_file()
    follow_curve = (tmp_path / "follow" / "learning_curve.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in follow_curve] == [0, 1]  # the starting point, then step 1

    pipe = load_pipeline("smollm2-135m", drafter=str(out / "drafter"))
    assert pipe.drafter.config.num_target_layers == 30 and pipe.drafter.config.mask_token_id == 16
    prompt = pipe.encode("Name a color.")
    params = SamplingParams(max_new_tokens=12)
    assert (pipe.engine(max_batch_size=1).generate([prompt], params)[0].output_ids
            == pipe.engine(block_size=1, max_batch_size=1).generate([prompt], params)[0].output_ids)


def test_target_responses_are_its_greedy_output_resume_and_train_a_drafter(tmp_path, capsys):
    """dflash-drafter-data on the embedded default: greedy responses, appended and resumed; the trainer reads them."""
    from dflash_training import drafter_data

    data = tmp_path / "data"
    common = ["--output", str(data), "--max-new-tokens", "6", "--batch-size", "2", "--max-prompt-tokens", "64"]
    assert drafter_data.main(common + ["--num-prompts", "3"]) == 0
    assert drafter_data.main(common + ["--num-prompts", "1"]) == 0  # resumes after the last index
    records = drafter_data.read_responses(data)
    indices = [r["index"] for r in records]
    # answers are written as they finish, in any order; a resumed run continues after the highest index
    assert len(records) == 4 and len(set(indices[:3])) == 3 and indices[3] > max(indices[:3])
    pipe = load_pipeline("smollm2-135m", drafter=None)
    first = sorted(records, key=lambda r: r["index"])[0]
    engine = pipe.engine(block_size=1, max_batch_size=1)
    greedy = engine.generate([first["prompt_ids"]], SamplingParams(max_new_tokens=6))
    assert first["response_ids"] == greedy[0].output_ids and first["finish_reason"] == greedy[0].finish_reason
    (data / drafter_data.RESPONSES_FILE).open("a").write('{"index": 99, "prompt_ids": [1, 2')  # a killed writer
    assert len(drafter_data.read_responses(data)) == 4

    out = tmp_path / "run"
    train = ["--target", "smollm2-135m", "--output", str(out), "--responses", str(data), "--draft-layers", "1",
             "--batch-size", "2", "--seq-len", "64", "--anchors", "2", "--eval-every", "1", "--train-vocab", "512",
             "--tau-prompts", "1"]
    assert main(train + ["--steps", "1", "--feature-cache", "40"]) == 0
    assert torch.load(out / "checkpoint.pt", weights_only=False)["seen_tokens"] > 0
    saved = torch.load(out / "features.pt", weights_only=False)
    assert saved["source"]["data"] == str(data.resolve()) and saved["source"]["seq_len"] == 64
    cached = [CachedSequence(*fields) for fields in saved["sequences"]]
    assert sum(len(c.tokens) for c in cached) >= 40
    expected = [drafter_data.training_sequence(r)[:64] for r in records]
    for c in cached:
        record = records[expected.index(c.tokens.tolist())]
        assert c.features.shape == (len(c.tokens), 5 * 576) and c.final.shape == (len(c.tokens), 576)
        # greedy responses: the target's argmax at a response position is the next response token
        prompt_length = len(record["prompt_ids"])
        assert c.labels[prompt_length - 1:-1].tolist() == c.tokens[prompt_length:].tolist()
        assert c.first_anchor == prompt_length  # blocks start in the response, as when decoding

    # a larger --feature-cache (or more responses) extends the cache; the entries made before stay
    assert main(train + ["--steps", "2", "--feature-cache", "100000"]) == 0
    grown = torch.load(out / "features.pt", weights_only=False)
    usable = sum(len(ids) >= 32 and len(ids) - len(r["prompt_ids"]) >= 2 for ids, r in zip(expected, records))
    assert saved["texts_read"] < grown["texts_read"] == 4 and len(grown["sequences"]) == usable
    assert all(torch.equal(a[1], b[1]) for a, b in zip(saved["sequences"], grown["sequences"]))

    # a cache made from other data or options is refused, not silently reused
    assert main([a if a != "64" else "80" for a in train] + ["--steps", "3", "--feature-cache", "100"]) == 2
    assert "delete it to rebuild" in capsys.readouterr().err


def test_blocks_start_at_the_first_anchor(tiny):
    """An anchor never lies before its sequence's first anchor: from the last possible one only position 1 has
    a label."""
    target = load_target(tiny[0])
    drafter = new_drafter(target, num_layers=1, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=(1, 3))
    batch = [list(range(5, 45)), list(range(7, 37))]
    tokens, features, final = target_features(target, batch, (1, 3))
    lengths = [len(b) for b in batch]
    common = (drafter, target, tokens, features, final, lengths, BLOCK, 4, 7.0)
    _, _, counted = block_loss(*common, torch.Generator().manual_seed(0), first_anchors=[n - 2 for n in lengths])
    assert counted.tolist() == [8.0] + [0.0] * (BLOCK - 2)
    _, _, counted = block_loss(*common, torch.Generator().manual_seed(0))
    assert counted[1:].sum() > 0


@pytest.mark.parametrize("script, command", [("train_drafter", "dflash-train-drafter"),
                                             ("drafter_data", "dflash-drafter-data")])
def test_builder_scripts_still_run_and_name_the_new_command(script, command):
    """`python builder/<script>.py` was the public command: it warns and runs the new one."""
    run = subprocess.run([sys.executable, f"builder/{script}.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines()[0] == (f"builder/{script}.py is deprecated: use {command} "
                                          f"(or python -m dflash_training.{script})")
    assert run.stdout.startswith(f"usage: {command} ")


# block_loss on a fixed batch, computed at commit 7aa692b (before --device/--dtype) on the Qwen3 fixture target
# (seed 0, 1 draft layer), first anchors [1, 5, 20]: (soft labels, 43-id softmax) -> (loss, hits, counted).
LOSS_BEFORE_DEVICE_SUPPORT = {(False, False): (4.872997760772705, 0, 125),
                              (False, True): (4.261246681213379, 4, 125),
                              (True, False): (0.024341261014342308, 0, 125),
                              (True, True): (0.025385351851582527, 4, 125)}


@pytest.fixture(scope="module")
def fixed_batch(tmp_path_factory):
    """The Qwen3 fixture target, a fresh drafter and three fixed token sequences (no engine involved)."""
    from conftest import make_target

    target_dir = make_target(tmp_path_factory.mktemp("fixed") / "target", "qwen3")
    torch.manual_seed(0)
    target = load_target(target_dir)
    drafter = new_drafter(target, num_layers=1, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=(1, 3))
    g = torch.Generator().manual_seed(5)
    return target_dir, target, drafter, [torch.randint(0, MASK, (n,), generator=g).tolist() for n in (40, 33, 57)]


def _fixed_loss(target, drafter, batch, soft_labels: bool, subset: bool):
    tokens, features, final = target_features(target, batch, (1, 3))
    ids = torch.arange(0, 128, 3, device="cpu") if subset else None  # the fixed batch's 43-id softmax
    return block_loss(drafter, target, tokens, features, final, [len(b) for b in batch], BLOCK, 4, 7.0,
                      torch.Generator().manual_seed(0), ids, soft_labels, first_anchors=[1, 5, 20])


@pytest.mark.parametrize("soft_labels, subset", list(LOSS_BEFORE_DEVICE_SUPPORT))
def test_cpu_loss_on_a_fixed_batch_is_what_it_was_before_device_support(fixed_batch, soft_labels, subset):
    _, target, drafter, batch = fixed_batch
    loss, correct, counted = _fixed_loss(target, drafter, batch, soft_labels, subset)
    expected, hits, count = LOSS_BEFORE_DEVICE_SUPPORT[soft_labels, subset]
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert (correct.sum().item(), counted.sum().item()) == (hits, count)


def test_every_tensor_follows_the_inputs_device_and_anchors_come_from_the_host(fixed_batch):
    """With "meta" as the default device, a tensor created without an explicit device would be a meta tensor and
    the loss would fail or change: the same loss proves every tensor is made on its inputs' device. The anchors
    come from the CPU generator whatever the device: the same seed gives the same blocks on a GPU."""
    _, target, drafter, batch = fixed_batch
    expected = _fixed_loss(target, drafter, batch, True, True)[0].item()
    with torch.device("meta"):
        assert _fixed_loss(target, drafter, batch, True, True)[0].item() == pytest.approx(expected, rel=1e-6)
        anchors = draw_anchors([1, 5], [40, 33], 4, torch.Generator().manual_seed(0))
    assert anchors.device.type == "cpu"
    assert torch.equal(anchors, draw_anchors([1, 5], [40, 33], 4, torch.Generator().manual_seed(0)))


def test_bfloat16_target_and_autocast_give_a_float32_loss_close_to_float32(fixed_batch):
    target_dir, target, drafter, batch = fixed_batch
    expected = _fixed_loss(target, drafter, batch, False, True)[0].item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _fixed_loss(load_target(target_dir, torch.bfloat16), drafter, batch, False, True)[0]
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected, rel=0.02)
    loss.backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in drafter.parameters())
    drafter.zero_grad(set_to_none=True)


def test_memory_estimate_matches_the_h200_run():
    """Its one calibration point: SmolLM2-135M fp32, batch 96 x 32 anchors x block 16, 640 tokens, 8,192-id
    softmax: torch.cuda.max_memory_allocated 22.06 GB (20.5 GiB). The estimate errs on the safe side."""
    shape = load_pipeline("smollm2-135m", drafter=None).target.config.shape
    h200 = memory.step_memory(shape, 134_515_008 * 4, memory.StepSizes(96, 640, 32, 16, 2, 5, 8192 + 96 * 32, 4))
    assert 20.5 <= h200["total"] <= 1.25 * 20.5
    smaller = memory.step_memory(shape, 134_515_008 * 4, memory.StepSizes(8, 640, 32, 8, 2, 5, 8192, 2))
    assert smaller["total"] < h200["total"] / 10 and smaller["target weights"] == h200["target weights"]
    assert "GiB of 3.0 GiB free" in memory.describe(smaller, 3.0)
    # what to change, by what does not fit: the batch, or the target's weights (0.50 GiB) themselves
    assert "lower --batch-size" in memory.describe(smaller, smaller["target weights"] + smaller["drafter + AdamW"] + .1)
    assert "--shard-target shards its layers" in memory.describe(smaller, 0.4)
    assert "even with the target's layers sharded: train on more ranks" in memory.describe(smaller, 0.4, sharded=True)


def test_recipe_options_and_a_missing_device(tmp_path, capsys):
    assert (recipe_decay(8), recipe_decay(16)) == (4.0, 7.0)  # ModelOpt's DFlash recipe
    if not torch.cuda.is_available():
        assert main(["--output", str(tmp_path / "run"), "--device", "cuda", "--steps", "1"]) == 2
        assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err
    pipe = load_pipeline("smollm2-135m", drafter=None)
    prompt, _ = next(sharegpt_conversations("train"))
    ids, first = next(training_texts(pipe, 512, 0, None, answer_only=True))  # blocks start in the reply
    assert first == len(pipe.encode(prompt)) and (ids, 1) == next(training_texts(pipe, 512, 0, None))


def test_later_turns_and_a_sampled_second_pass(tmp_path):
    """--later-turns adds each conversation's later user turns (sent alone); --temperature samples the same
    prompts again; a rerun answers only prompts not answered yet, per pass."""
    from dflash_tools.prompts import sharegpt_dialogues
    from dflash_training import drafter_data

    data = tmp_path / "data"
    argv = ["--output", str(data), "--max-new-tokens", "4", "--batch-size", "3", "--max-prompt-tokens", "64",
            "--num-prompts", "3", "--later-turns", "--temperature", "0.8"]
    assert drafter_data.main(argv) == 0
    records = drafter_data.read_responses(data)
    greedy = {(r["index"], r["turn"]) for r in records if r["temperature"] == 0.0}
    assert len(records) == 6 and greedy == {(r["index"], r["turn"]) for r in records if r["temperature"] == 0.8}
    pipe = load_pipeline("smollm2-135m", drafter=None)
    dialogues = list(itertools.islice(sharegpt_dialogues("train"), max(i for i, _ in greedy) + 1))
    later = [r for r in records if r["turn"] > 0]
    assert later, "the first train conversations have short later turns"
    for r in later:
        assert r["prompt_ids"] == pipe.encode(dialogues[r["index"]][2][r["turn"] - 1])  # alone, as one turn
    assert drafter_data.main(argv) == 0
    keys = [drafter_data.response_key(r) for r in drafter_data.read_responses(data)]
    assert len(keys) == 12 and len(set(keys)) == 12
