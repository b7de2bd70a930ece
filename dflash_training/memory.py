"""What one training step of dflash-train-drafter needs in device memory, estimated before the first step.

A large target (Qwen3-8B: 16 GB of bf16 weights) leaves less room than one expects for the batch: the
estimate names the parts so that a user who runs out knows which option to turn down (--batch-size,
--anchors, --seq-len, --train-vocab). Calibrated on the H200 run of 2026-11-30 (SmolLM2-135M, fp32,
batch 96 x 32 anchors x block 16, 640 tokens, 8,192-token softmax): estimated 23.1 GiB against 22.06 GB
(20.5 GiB) measured by torch.cuda.max_memory_allocated. It adds the prefill's KV cache to the drafter's
activations although they never coexist, so it errs on the safe side.
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash_runtime.config import TransformerShape

GIB = 1024 ** 3
ADAM_BYTES_PER_PARAMETER = 16  # float32 weight, gradient and AdamW's two moments
SAVED_BLOCK_TENSORS = 12  # [block tokens, H] tensors a draft layer keeps for backward (norms, q/k/v, o, residuals)


@dataclass(frozen=True)
class StepSizes:
    batch: int  # sequences per step
    seq_len: int  # tokens per sequence (padded)
    anchors: int  # blocks per sequence
    block_size: int
    draft_layers: int
    num_features: int  # target layers concatenated into the context features
    softmax_vocab: int  # ids the loss's softmax runs over (--train-vocab, or the whole vocabulary)
    activation_bytes: int  # 2 under bf16, else 4


def step_memory(target: TransformerShape, target_weight_bytes: int, sizes: StepSizes) -> dict[str, float]:
    """GiB per part of a training step's peak, and their sum as "total"."""
    s, B, T = sizes, sizes.batch, sizes.seq_len
    queries = B * s.anchors * s.block_size  # block tokens drafted in one forward
    kv_width = target.num_kv_heads * target.head_dim
    drafter_parameters = s.draft_layers * (
        target.hidden_size * (2 * target.num_heads * target.head_dim + 2 * kv_width)  # q, o, k, v
        + 3 * target.hidden_size * target.intermediate_size + 2 * target.hidden_size + 2 * target.head_dim
    ) + s.num_features * target.hidden_size ** 2 + 2 * target.hidden_size
    prefill = s.activation_bytes * B * T * (
        2 * target.num_layers * kv_width  # the prefill's KV cache
        + (s.num_features + 1) * target.hidden_size  # features and final hidden states, kept for the loss
        + target.num_heads * T)  # one layer's attention scores at a time
    per_layer = s.activation_bytes * (
        SAVED_BLOCK_TENSORS * queries * target.hidden_size
        + 3 * queries * target.intermediate_size  # SwiGLU: gate, up, their product
        + 2 * B * T * kv_width  # the context's K/V, computed in the graph
        + 2 * B * target.num_heads * s.anchors * s.block_size * (T + s.anchors * s.block_size))  # scores, probs
    loss_rows = B * s.anchors * (s.block_size - 1)
    parts = {
        "target weights": target_weight_bytes,
        "target prefill": prefill,
        "drafter + AdamW": drafter_parameters * ADAM_BYTES_PER_PARAMETER,
        "drafter activations": s.draft_layers * per_layer + s.activation_bytes * B * T * target.hidden_size,
        "loss (logits, softmax, labels)": 4 * 4 * loss_rows * s.softmax_vocab,
    }
    parts = {name: size / GIB for name, size in parts.items()}
    return {**parts, "total": sum(parts.values())}


def describe(parts: dict[str, float], free: float | None = None, sharded: bool = False) -> str:
    """One line for the log: each part and the total, the device's free memory if known, and what to change when
    the step does not fit it. sharded: the target's layers are sharded across the ranks (--shard-target)."""
    shown = ", ".join(f"{name} {size:.2f}" for name, size in parts.items() if name != "total")
    room = f" of {free:.1f} GiB free" if free is not None else ""
    line = f"estimated memory per step: {parts['total']:.2f} GiB{room} ({shown})"
    if free is None or parts["total"] <= free:
        return line
    if parts["target weights"] + parts["drafter + AdamW"] < free:
        return line + ("; it does not fit: lower --batch-size, --anchors or --seq-len, or train on more ranks "
                       "(torchrun: the batch splits across them, each rank's share is what is estimated here)")
    if sharded:
        return line + ("; it does not fit, whatever the batch, even with the target's layers sharded: train on more "
                       "ranks (each holds 1/N of the layers) or on devices with more memory")
    return line + ("; it does not fit, whatever the batch: the frozen target's weights are whole on every rank; under "
                   "torchrun, --shard-target shards its layers across the ranks (each holds 1/N of them)")
