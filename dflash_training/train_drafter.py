"""dflash-train-drafter: train a DFlash drafter for a target: frozen target, online self-distillation, resumable.

Recipe (DFlash paper, adapted to CPU economics):
- Data: ShareGPT conversations (train split, see dflash_tools.prompts) rendered with the target's
  chat template, or (--responses) the target's own greedy responses made by dflash-drafter-data. The
  frozen target runs ONE prefill per batch; its next-token distribution at each position is the
  label (self-distillation: exact for block position 1, along the text's path for later ones; on
  the target's own responses the path is the one it takes when decoding, so every position is
  exact), and its hidden states after `target_layer_ids` are the context features.
- Blocks: random anchor positions per sequence; block = [token at anchor, MASK, ...]; the block
  sees the context features of positions before the anchor (KV injection) and itself (non-causal).
  Many anchors share one forward through an attention mask.
- Loss: KL divergence from the target's distribution to the draft's (through the target's frozen LM
  head) at block positions 1..S-1: logit distillation, ModelOpt's default (--hard-labels: cross-
  entropy against the target's argmax), weighted
  exp(-(k-1)/decay) (the paper's exponential position decay).
- Draft layers start as copies of the target's top layers (q_norm/k_norm at identity).

Devices: --device cuda runs the frozen target and the drafter on a GPU; --dtype bfloat16 keeps the target
(and so its features, computed once per batch) in bf16 and runs the drafter's forward under bf16 autocast,
with float32 master weights, optimizer and loss. Random draws (anchors, cached batches) come from a CPU
generator whatever the device, so a seed means the same blocks everywhere. A memory estimate by part is
printed before the first step (dflash_training.memory). The recipe knobs of ModelOpt's DFlash training are
options: --block-size 8 (decay 4, the default for 8) or 16 (decay 7), --anchors per sequence,
--answer-only, --draft-layers.

Checkpoints (model, optimizer, data cursor, RNG) are written every --save-every steps and training
resumes from them; --max-minutes bounds a session. A JSONL learning curve records every evaluation.

The parts, one file each: the texts (training_data), the target's features, online or cached (features), the block
loss (block_loss) and evaluation (evaluation); here the drafter's start, the loop, its steps and checkpoints.

Under torchrun the ranks share each global batch with DistributedDataParallel over the drafter (a step is the one
process's step on the whole batch; checkpoints resume at any world size), and --shard-target shards the frozen
target's decoder layers across them (FSDP2) where it does not fit one device beside the drafter.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from dflash_runtime.checkpoint import load_weights, read_safetensors
from dflash_runtime.config import DFlashError, DrafterConfig, TransformerShape
from dflash_runtime.drafter import DFlashDrafter, save_drafter
from dflash_runtime.pipeline import Pipeline, load_pipeline
from dflash_runtime.target import TargetModel
from dflash_training import distributed, memory, options
from dflash_training.block_loss import BlockDrafting, autocast, block_loss_terms, draw_anchors, recipe_decay
from dflash_training.distributed import Ranks, ranks_from_env
from dflash_training.evaluation import HeldOut, evaluate_and_record, heldout_data
from dflash_training.features import cached_features, sample_batch, target_features
from dflash_training.training_data import frequent_tokens, training_batches, training_texts

EXAMPLES = """examples:
  dflash-train-drafter --output runs/my-drafter --max-minutes 60
  dflash-train-drafter --output runs/my-drafter --responses runs/responses --feature-cache 200000 \\
      --init models/smollm2-135m-dflash
  dflash-train-drafter --target /models/qwen3-8b --output runs/qwen3-8b-drafter --responses runs/qwen3-responses \\
      --device cuda --dtype bfloat16 --draft-layers 5 --block-size 8 --anchors 512 --seq-len 4096 --batch-size 4 \\
      --mask-token-id ID
  python -m dflash_training.train_drafter --help
"""
# The frozen target's CPU format, whatever DFLASH_CPU_WEIGHTS or a host's measurement would serve it in: the loss
# reaches the drafter back through the target's head, which the GGUF kernels cannot differentiate, and new draft
# layers start as copies of the target's float weights. For the embedded default this is the GGUF's own blocks
# dequantized exactly, so the drafter learns the served model's features up to the kernels' int16 rounding of
# activations (greedy answers agree on 99.97% of tokens: dflash-weights-quality).
TRAINING_CPU_WEIGHTS = "float32"


def spread_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """Evenly spaced target layers from the second to the last (z-lab's choice for Qwen3-8B: 1, 9, 17, 25, 33)."""
    if count == 1:
        return (num_target_layers - 1,)
    step = (num_target_layers - 2) / (count - 1)
    return tuple(round(1 + i * step) for i in range(count))


def new_drafter(target: TargetModel, num_layers: int, block_size: int, mask_token_id: int,
                target_layer_ids: tuple[int, ...]) -> DFlashDrafter:
    s = target.config.shape
    if num_layers > s.num_layers:
        raise DFlashError(f"{num_layers} draft layers > the target's {s.num_layers}")
    shape = TransformerShape(**{**s.__dict__, "num_layers": num_layers})
    config = DrafterConfig(shape, block_size, mask_token_id, target_layer_ids, s.num_layers)
    config.check_against(target.config, "new drafter")
    drafter = DFlashDrafter(config)
    # Start from the target's top layers: same shapes, and a far better start than random.
    top = target.model.layers[s.num_layers - num_layers:]
    with torch.no_grad():
        for layer, source in zip(drafter.layers, top):
            state = {k: v.float().cpu() for k, v in source.state_dict().items()}
            missing = [k for k in layer.load_state_dict(state, strict=False).missing_keys
                       if not k.endswith(("q_norm.weight", "k_norm.weight"))]  # a Llama target has none
            if missing:
                served = target.served_weights.describe() if target.served_weights else "not float"
                raise DFlashError(f"new draft layers copy the target's top layers, but this target's {missing} are "
                                  f"not float weights (served as {served}): load it with "
                                  f"cpu_weights={TRAINING_CPU_WEIGHTS!r}")
        drafter.norm.weight.copy_(target.model.norm.weight.float().cpu())
    return drafter


def initial_drafter(args: argparse.Namespace, target: TargetModel) -> DFlashDrafter:
    """A new drafter from the target's top layers, or (--init) an exported drafter to train further.

    --block-size may change an --init drafter's block size: no weight depends on it.
    """
    if not args.init:
        s = target.config.shape
        layer_ids = tuple(args.target_layer_ids or spread_layer_ids(s.num_layers, args.num_target_features))
        drafter = new_drafter(target, args.draft_layers, args.block_size or 16, args.mask_token_id, layer_ids)
        return drafter.to(args.device)  # float32 master weights whatever the target's dtype
    config = DrafterConfig.from_dir(Path(args.init))  # its config fixes the architecture
    drafter = DFlashDrafter(dataclasses.replace(config, block_size=args.block_size or config.block_size))
    drafter.config.check_against(target.config, args.init)
    load_weights(drafter, read_safetensors(Path(args.init)), args.init, torch.float32, args.device)
    return drafter


@dataclasses.dataclass
class TrainingRun:
    """A training session: the models, the optimizer, and where training stands (what checkpoint.pt keeps).

    Under torchrun every rank holds one: the same drafter, optimizer and generator (the generator draws for the
    whole global batch on every rank, so that the ranks agree on anchors and cached draws without talking, and a
    checkpoint resumes at any world size), and its own share of each batch's sequences."""
    args: argparse.Namespace
    out: Path
    pipe: Pipeline
    target: TargetModel
    drafter: DFlashDrafter
    optimizer: torch.optim.Optimizer
    rng: torch.Generator
    ranks: Ranks
    forward: torch.nn.Module  # BlockDrafting, in DistributedDataParallel under torchrun
    step: int = 0
    seen_texts: int = 0  # the data cursor: texts read in the current epoch
    seen_tokens: int = 0
    cpu_seconds: float = 0.0  # spent training in earlier sessions
    session_cpu: float = 0.0  # time.process_time() when this session's training began
    session_wall: float = 0.0  # time.time() when this session's training began
    last_loss: float | None = None  # the last step's training loss (over the whole batch)

    @property
    def sharded_target(self) -> bool:
        return self.args.shard_target and self.ranks.distributed

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def total_cpu_seconds(self) -> float:
        return self.cpu_seconds + time.process_time() - self.session_cpu


def train(args: argparse.Namespace) -> None:
    """Train the drafter args describe, or resume it, until --steps or --max-minutes; export it to <output>/drafter.

    Under torchrun: rank 0 evaluates, writes the learning curve and the checkpoints; every rank trains."""
    run = start_run(args)
    try:
        # a sharded target's prefill needs every rank; rank 0 alone evaluates the drafter on the features
        heldout = heldout_data(run) if run.ranks.main or run.sharded_target else None
        vocab_subset = frequent_tokens(run.pipe, args.train_vocab, args.responses) if args.train_vocab else None
        if vocab_subset is not None:
            vocab_subset = vocab_subset.to(args.device)
        next_batch = batch_source(run)
        if run.ranks.main:
            print(memory.describe(estimated_memory(run, vocab_subset), free_device_memory(args.device),
                                  run.sharded_target), file=sys.stderr)
        with (run.out / "learning_curve.jsonl").open("a") if run.ranks.main else contextlib.nullcontext() as curve:
            run.session_cpu, run.session_wall = time.process_time(), time.time()
            if run.ranks.main and run.step == 0 and args.init and curve.tell() == 0:
                evaluate_and_record(run, heldout, curve)  # where a continued drafter starts, as this run measures
            training_loop(run, next_batch, vocab_subset, heldout, curve)
        if run.ranks.main:
            save_checkpoint(run)
            print(f"exported drafter to {run.out / 'drafter'} after {run.step} steps ({run.seen_tokens} tokens)",
                  file=sys.stderr)
    finally:
        distributed.leave()


def start_run(args: argparse.Namespace) -> TrainingRun:
    """The frozen target, the drafter and its optimizer, resumed from <output>/checkpoint.pt if there is one."""
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    ranks = ranks_from_env()
    check_options(args, ranks)
    args.device = ranks.device(args.device)
    check_device(args.device)
    distributed.join(ranks, args.device)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    sharded = args.shard_target and ranks.distributed
    # a target to shard is read on the host, and only its shards (and the small rest) go to the device.
    # On a CPU the target trains in float32 whatever format would serve it (TRAINING_CPU_WEIGHTS).
    pipe = load_pipeline(args.target, drafter=None, dtype=args.dtype, device="cpu" if sharded else args.device,
                         prepare=not sharded, cpu_weights=TRAINING_CPU_WEIGHTS)
    target = pipe.target.requires_grad_(False)
    if pipe.tokenizer is None:
        raise DFlashError(f"{pipe.target_dir} has no tokenizer; the trainer needs one")
    drafter = initial_drafter(args, target)  # from the target's whole layers: before they are sharded
    if sharded:
        shard_target(target, args.device)
    args.decay = args.decay or recipe_decay(drafter.config.block_size)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    forward = BlockDrafting(drafter, target)
    run = TrainingRun(args, out, pipe, target, drafter, optimizer, torch.Generator().manual_seed(args.seed), ranks,
                      forward)
    if run.checkpoint_path.is_file():
        resume(run)
    if ranks.distributed:  # after resuming: DDP starts every rank from rank 0's weights
        run.forward = DistributedDataParallel(
            forward, device_ids=[torch.device(args.device).index] if torch.device(args.device).type == "cuda" else None)
    return run


def check_options(args: argparse.Namespace, ranks: Ranks) -> None:
    """What argparse's types cannot see alone, refused before the target loads (and before any step is lost)."""
    if args.batch_size < ranks.world:
        raise DFlashError(f"--batch-size {args.batch_size} (the global batch) is smaller than the {ranks.world} "
                          "ranks: every rank needs at least one sequence per step")
    if args.shard_target and ranks.distributed and args.tau_prompts:
        raise DFlashError(f"--shard-target with --tau-prompts {args.tau_prompts}: the measured tau decodes on rank 0 "
                          "alone, which a sharded target cannot do; pass --tau-prompts 0 (the estimated tau is still "
                          "recorded) and measure the exported drafter with dflash-bench")


def shard_target(target: TargetModel, device: str) -> None:
    """The frozen target's decoder layers sharded across the ranks (distributed.shard); the embedding, the final norm
    and the head stay whole on every rank: the drafter and the loss use them outside the target's forward."""
    distributed.shard(target.model.layers, device)
    for whole in (target.model.embed_tokens, target.model.norm, target.lm_head):
        whole.to(device)


def estimated_memory(run: TrainingRun, vocab_subset: torch.Tensor | None) -> dict[str, float]:
    """dflash_training.memory's estimate for this run's options (GiB by part), on one rank."""
    args, target, config = run.args, run.target, run.drafter.config
    weights = target_weight_bytes(target)
    softmax = len(vocab_subset) + args.batch_size * args.anchors if vocab_subset is not None else \
        target.config.shape.vocab_size
    per_rank = -(-args.batch_size // run.ranks.world)  # the largest share of the batch
    sizes = memory.StepSizes(per_rank, args.seq_len, args.anchors, config.block_size, config.shape.num_layers,
                             len(config.target_layer_ids), softmax, 2 if args.dtype == "bfloat16" else 4)
    return memory.step_memory(target.config.shape, weights, sizes)


def target_weight_bytes(target: TargetModel) -> int:
    """The target's weights held on this rank, by storage (a tied embedding and head are one tensor); with sharded
    layers, this rank's shards plus two whole layers: FSDP gathers the next layer while one runs."""
    state = target.state_dict()
    local = [t.to_local() if isinstance(t, DTensor) else t for t in state.values()]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())
    if not any(isinstance(t, DTensor) for t in state.values()):
        return held
    layer = sum(t.numel() * t.element_size() for t in target.model.layers[0].state_dict().values())
    return held + 2 * layer


def free_device_memory(device: str) -> float | None:
    """Free GiB on a CUDA device (None elsewhere: a CPU's RAM is shared with everything else)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.mem_get_info(torch.device(device))[0] / memory.GIB


def check_device(device: str) -> None:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise DFlashError(f"--device {device}: torch sees no CUDA device (torch {torch.__version__})")
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 GEMMs on tensor cores, as the H200 run did


def resume(run: TrainingRun) -> None:
    # on the host first: a checkpoint written on a GPU resumes on a CPU and the other way round
    state = torch.load(run.checkpoint_path, weights_only=False, map_location="cpu")
    config = run.drafter.config.to_dict()
    if state.get("config", config) != config:
        raise DFlashError(f"{run.checkpoint_path} holds a drafter of another shape ({state['config']}); pass the "
                          "options it was started with (e.g. --block-size), or another --output")
    run.drafter.load_state_dict(state["drafter"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.step, run.seen_texts, run.seen_tokens = state["step"], state["seen_texts"], state["seen_tokens"]
    run.cpu_seconds = state["cpu_seconds"]
    run.rng.set_state(state["rng"])
    print(f"resumed at step {run.step} ({run.seen_tokens} tokens seen)", file=sys.stderr)


def save_checkpoint(run: TrainingRun) -> None:
    """checkpoint.pt (written beside and renamed: never half-written) and the exported drafter/."""
    tmp = run.checkpoint_path.with_suffix(".tmp")
    torch.save({"drafter": run.drafter.state_dict(), "config": run.drafter.config.to_dict(),
                "optimizer": run.optimizer.state_dict(), "rng": run.rng.get_state(),
                "step": run.step, "seen_texts": run.seen_texts, "seen_tokens": run.seen_tokens,
                "cpu_seconds": run.total_cpu_seconds()}, tmp)
    tmp.replace(run.checkpoint_path)
    save_drafter(run.drafter, run.out / "drafter")


def batch_source(run: TrainingRun):
    """A function returning the next batch: (the whole batch's texts, this rank's share of them as (tokens,
    features, final, labels), data cursor).

    Without a feature cache: the next texts and one target prefill (labels None: computed in the
    loss). With --feature-cache: a random draw from the cached features (the cursor stays).
    """
    args, layer_ids = run.args, run.drafter.config.target_layer_ids

    def texts_from(skip: int):
        return training_texts(run.pipe, args.seq_len, skip, args.responses, args.answer_only)
    if not args.feature_cache:
        batches = training_batches(texts_from, args.batch_size, run.seen_texts)

        def next_texts():  # every rank reads the whole batch's texts, and runs the target on its share only
            batch, cursor = next(batches)
            tokens, features, final = target_features(run.target, [ids for ids, _ in run.ranks.share(batch)],
                                                      layer_ids)
            return batch, (tokens, features, final, None), cursor
        return next_texts
    source = {"data": str(Path(args.responses).resolve()) if args.responses else "sharegpt", "seq_len": args.seq_len,
              "target_layer_ids": list(layer_ids)}
    if args.answer_only and not args.responses:  # the key only where it changes the cache: older caches stay valid
        source["answer_only"] = True
    cache = cached_features(run.target, texts_from, layer_ids, args.feature_cache, run.out / "features.pt", source,
                            run.ranks)
    return lambda: (*sample_batch(cache, args.batch_size, run.rng, run.target.dtype, args.device, run.ranks),
                    run.seen_texts)


def training_loop(run: TrainingRun, next_batch, vocab_subset: torch.Tensor | None, heldout: HeldOut | None,
                  curve) -> None:
    """Steps until --steps or --max-minutes, saving every --save-every and evaluating every --eval-every (rank 0;
    the checkpoint first: an evaluation that fails loses no training)."""
    args, main = run.args, run.ranks.main
    bar = tqdm(total=args.steps, initial=run.step, desc="train drafter", unit="step", disable=not main)
    while run.step < args.steps and not out_of_time(run):
        batch, tensors, run.seen_texts = next_batch()
        loss, correct, counted = train_step(run, batch, tensors, vocab_subset)
        acc = (correct / counted.clamp_min(1))
        bar.set_postfix(loss=f"{loss:.3f}", acc1=f"{acc[0]:.2f}", acc4=f"{acc[3]:.2f}" if len(acc) > 3 else "-")
        bar.update()
        if main and (run.step % args.save_every == 0 or run.step == args.steps):
            save_checkpoint(run)
        if main and (run.step % args.eval_every == 0 or run.step == args.steps):
            evaluate_and_record(run, heldout, curve)
    bar.close()


def out_of_time(run: TrainingRun) -> bool:
    """--max-minutes spent, as rank 0's clock says: every rank stops after the same step."""
    spent = (time.time() - run.session_wall) / 60 >= run.args.max_minutes
    if not run.ranks.distributed:
        return spent
    return bool(distributed.all_sum(torch.tensor([float(spent and run.ranks.main)])).item())


def train_step(run: TrainingRun, batch: list[tuple[list[int], int]], tensors, vocab_subset: torch.Tensor | None):
    """One optimizer step (warmup learning rate, block loss, clipped gradient) -> (loss, correct, counted), each over
    the whole batch.

    batch: the whole batch's texts; tensors: this rank's share of them. The anchors are drawn for the whole batch
    on every rank (the same generator everywhere) and each rank takes its share's. Each rank's loss is its weighted
    sum over the whole batch's weight, times the world size: DDP averages the gradients over the ranks, so the
    step is the one a single process would take on the whole batch."""
    args, drafter, ranks = run.args, run.drafter, run.ranks
    tokens, features, final, labels = tensors
    lr = args.lr * min(1.0, (run.step + 1) / args.warmup)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    anchors = ranks.share(draw_anchors([first for _, first in batch], [len(ids) for ids, _ in batch], args.anchors,
                                       run.rng)).to(tokens.device)
    lengths = [len(ids) for ids, _ in ranks.share(batch)]
    drafter.train()
    vocab_size = run.target.lm_head.weight.shape[0]  # the ids the head can predict
    with autocast(args):
        hidden = run.forward(tokens, features, anchors)
        weighted, weight, correct, counted = block_loss_terms(
            hidden, run.target, tokens, final, lengths, anchors, drafter.config.block_size, args.decay,
            vocab_subset, soft_labels=not args.hard_labels, labels=labels,
            vocab_union=lambda ids: label_union(ids, vocab_size, ranks))
    total_weight = distributed.all_sum(weight.detach())
    run.optimizer.zero_grad(set_to_none=True)
    (weighted * ranks.world / total_weight).backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    run.optimizer.step()
    run.step += 1
    run.seen_tokens += sum(len(ids) for ids, _ in batch)
    run.last_loss = (distributed.all_sum(weighted.detach()) / total_weight).item()
    return run.last_loss, distributed.all_sum(correct), distributed.all_sum(counted)


def label_union(ids: torch.Tensor, vocab_size: int, ranks: Ranks) -> torch.Tensor:
    """The label ids of every rank's share (ids itself for one process), through a vocabulary-sized count."""
    if not ranks.distributed:
        return ids
    present = torch.zeros(vocab_size, dtype=torch.int32, device=ids.device)
    present[ids] = 1
    return distributed.all_sum(present).nonzero().flatten()


def build_parser() -> argparse.ArgumentParser:
    return options.train_parser(__doc__, EXAMPLES)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        train(args)
    except DFlashError as e:
        print(f"dflash-train-drafter: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
