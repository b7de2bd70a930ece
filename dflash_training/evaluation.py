"""Evaluating a drafter while it trains: held-out loss and accuracy by block position, tau estimated from them and
measured by greedy DFlash decoding, recorded in learning_curve.jsonl and drawn into learning_curve.png."""
from __future__ import annotations

import copy
import importlib.util
import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from tqdm import tqdm

from dflash_runtime.drafter import DFlashDrafter
from dflash_runtime.engine import SpeculativeEngine
from dflash_runtime.layers import prepare_for_inference
from dflash_runtime.sampling import SamplingParams
from dflash_runtime.target import TargetModel
from dflash_tools.prompts import sharegpt_conversations
from dflash_training.block_loss import autocast, block_loss, estimated_acceptance
from dflash_training.features import target_features
from dflash_training.training_data import heldout_texts

if TYPE_CHECKING:  # the run evaluated (train_drafter imports this module)
    from dflash_training.train_drafter import TrainingRun


class HeldOut(NamedTuple):
    texts: list[list[int]]  # held-out ShareGPT conversations: loss and per-position accuracy
    features: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # target_features(texts)
    prompts: list[list[int]]  # held-out prompts decoded to measure tau


def heldout_data(run: TrainingRun) -> HeldOut:
    """The same held-out texts and prompts at every evaluation, and the target's features of the texts."""
    args = run.args
    texts = heldout_texts(run.pipe, args.seq_len, args.batch_size * 2)
    prompts = [run.pipe.encode(p) for p, _ in itertools.islice(
        ((p, r) for p, r in sharegpt_conversations("heldout") if len(p) < 300), args.tau_prompts)]
    return HeldOut(texts, target_features(run.target, texts, run.drafter.config.target_layer_ids), prompts)


@torch.no_grad()
def measured_acceptance(drafter: DFlashDrafter, target: TargetModel, prompts: list[list[int]], block_size: int,
                        max_new_tokens: int = 48) -> float:
    """Real tau: greedy DFlash decoding of held-out prompts with a frozen copy of the drafter."""
    frozen = copy.deepcopy(drafter).requires_grad_(False).to(target.dtype)  # the engine runs one dtype
    prepare_for_inference(frozen)
    engine = SpeculativeEngine(target, frozen, block_size=block_size, max_batch_size=len(prompts))
    seqs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    lengths = [a for s in seqs for a in s.stats.acceptance_lengths]
    return sum(lengths) / len(lengths)


def evaluate(run: TrainingRun, heldout: HeldOut) -> dict:
    """A learning-curve record: the last step's training loss, held-out loss, accuracy by block position, tau
    estimated and (with --tau-prompts) measured. cpu_hours are rank 0's under torchrun (world_size says how many
    ranks trained the last step)."""
    drafter, args = run.drafter, run.args
    drafter.eval()
    tokens, features, final = heldout.features
    generator = torch.Generator().manual_seed(1234)  # the same anchors every time: comparable points
    with torch.no_grad(), autocast(args):
        loss, correct, counted = block_loss(drafter, run.target, tokens, features, final,
                                            [len(b) for b in heldout.texts], drafter.config.block_size, args.anchors,
                                            args.decay, generator)
    record = {
        "step": run.step,
        "tokens_seen": run.seen_tokens,
        "cpu_hours": round(run.total_cpu_seconds() / 3600, 4),
        "world_size": run.ranks.world,
        **({"train_loss": round(run.last_loss, 4)} if run.last_loss is not None else {}),
        "heldout_loss": round(loss.item(), 4),
        "heldout_accuracy_by_position": [round(x, 4) for x in (correct / counted.clamp_min(1)).tolist()],
        "heldout_estimated_tau": round(estimated_acceptance(correct, counted), 3),
    }
    if heldout.prompts:
        record["heldout_measured_tau"] = round(measured_acceptance(drafter, run.target, heldout.prompts,
                                                                   drafter.config.block_size), 3)
    return record


def evaluate_and_record(run: TrainingRun, heldout: HeldOut, curve) -> None:
    """Evaluate, append the record to learning_curve.jsonl and redraw learning_curve.png."""
    record = evaluate(run, heldout)
    curve.write(json.dumps(record) + "\n")
    curve.flush()
    plot_learning_curve(run.out / "learning_curve.jsonl", run.out / "learning_curve.png")
    measured = f", measured {record['heldout_measured_tau']:.2f}" if "heldout_measured_tau" in record else ""
    tqdm.write(f"step {run.step}: held-out loss {record['heldout_loss']:.3f}, "
               f"acc@1 {record['heldout_accuracy_by_position'][0]:.3f}, tau estimated "
               f"{record['heldout_estimated_tau']:.2f}{measured}")


def plot_learning_curve(curve_path: Path, png_path: Path) -> None:
    """tau (measured and estimated) and held-out block-position-1 accuracy against training tokens.

    Skipped where matplotlib is not installed (a lent GPU machine): learning_curve.jsonl is the record."""
    if importlib.util.find_spec("matplotlib") is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in curve_path.read_text().splitlines() if line.strip()]
    tokens = [r["tokens_seen"] / 1e6 for r in records]
    fig, (tau, acc) = plt.subplots(1, 2, figsize=(11, 4))
    measured = [(t, r["heldout_measured_tau"]) for t, r in zip(tokens, records) if "heldout_measured_tau" in r]
    if measured:
        tau.plot(*zip(*measured), marker="o", label="measured (greedy decoding, held-out prompts)")
    tau.plot(tokens, [r["heldout_estimated_tau"] for r in records], marker=".", label="estimated from accuracies")
    tau.set(xlabel="training tokens (millions)", ylabel="mean acceptance length tau", title="tau vs training tokens")
    tau.legend()
    acc.plot(tokens, [r["heldout_accuracy_by_position"][0] for r in records], marker=".", label="block position 1")
    acc.plot(tokens, [r["heldout_accuracy_by_position"][-1] for r in records], marker=".", label="last position")
    if records[-1]["cpu_hours"] > records[0]["cpu_hours"]:
        top = acc.twiny()
        top.set_xlim(records[0]["cpu_hours"], records[-1]["cpu_hours"])
        top.set_xlabel("CPU hours")
    acc.set(xlabel="training tokens (millions)", ylabel="held-out accuracy", ylim=(0, 1))
    acc.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)

