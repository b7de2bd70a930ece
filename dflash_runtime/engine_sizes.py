"""The engine's sizes, fixed when it is built: the keys a pass reads, KV memory and the context it leaves one
sequence, the verify lengths a step may choose, the widest KV-injection call; and the checks of what a caller asked."""
from __future__ import annotations

from dflash_contract.presets import AUTO_BLOCK_SIZE, DEFAULT_KV_CONTEXT

from .config import DFlashError
from .drafter import DFlashDrafter
from .drafter_context import MAX_PENDING_CONTEXT
from .kv_cache import BLOCK_SIZE
from .verify_length import doubling

CACHE_ALIGNMENT = 16  # SDPA's memory-efficient kernel needs a mask's key axis in multiples of 16 elements


def cache_capacity(max_context: int, block_size: int) -> int:
    """Keys a pass may read: block positions run up to (max_context - 1) + (block_size - 1)."""
    return -(-(max_context + block_size) // CACHE_ALIGNMENT) * CACHE_ALIGNMENT


def injection_tokens(max_context: int, max_batch_size: int, block_size: int) -> int:
    """The most positions one KV-injection call gets (a prefill's padded rows may bring more, written in parts): a
    power of two, so that the op's token buckets up to it, timed at start-up, cover every call
    (SpeculativeEngine._time_kv_injection)."""
    most = max(max_context, max_batch_size * max(block_size, MAX_PENDING_CONTEXT))
    return 1 << (most - 1).bit_length()


def verify_lengths(block_size: int, adaptive: bool, static_shapes: bool) -> tuple[int, ...]:
    """The k a step may verify: the block under a fixed one; under "auto" any up to it with dynamic shapes (a CPU's
    cost grows with every row: a draft of 5 is verified as 6 rows, not 8), the doubling lengths with static ones
    (a graph each)."""
    if not adaptive:
        return (block_size,)
    return doubling(block_size) if static_shapes else tuple(range(1, block_size + 1))


def default_kv_cache_tokens(max_batch_size: int, max_context: int, block_size: int,
                            kv_context: int = DEFAULT_KV_CONTEXT) -> int:
    """KV memory when none is set: max_batch_size contexts of kv_context (a preset's) or of max_context if shorter,
    and at least one whole max_context, so that a sequence alone can always reach it (presets.DEFAULT_KV_CONTEXT)."""
    per_place = cache_capacity(min(max_context, kv_context), block_size)
    return max(max_batch_size * per_place, cache_capacity(max_context, block_size))


def context_in(blocks: int, max_context: int, block_size: int) -> int:
    """max_context cut to what `blocks` KV blocks hold for one sequence with its draft block: one sequence alone
    must always fit, or once preempted it could never be admitted again."""
    context = min(max_context, blocks * BLOCK_SIZE - block_size)
    if context < 2:
        raise DFlashError(f"a KV cache of {blocks * BLOCK_SIZE} tokens cannot hold a sequence with a block of "
                          f"{block_size}")
    return context


def check_sizes(drafter: DFlashDrafter | None, block_size: int, max_batch_size: int,
                 prefill_chunk: int | None) -> None:
    if not isinstance(block_size, int):
        raise DFlashError(f"block size must be an integer or {AUTO_BLOCK_SIZE!r}, got {block_size!r}")
    if block_size < 1:
        raise DFlashError(f"block size must be >= 1, got {block_size}")
    if block_size > 1 and drafter is None:
        raise DFlashError(f"block size {block_size} needs a drafter (use block size 1 without one)")
    if drafter is not None and block_size > drafter.config.block_size:
        raise DFlashError(f"block size {block_size} is larger than the drafter supports "
                          f"({drafter.config.block_size})")
    if max_batch_size < 1:
        raise DFlashError(f"max batch size must be >= 1, got {max_batch_size}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise DFlashError(f"prefill chunk must be >= 1 token, got {prefill_chunk}")
