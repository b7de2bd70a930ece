"""Which KV blocks each sequence holds, and the prefix cache over them (nano-vllm's block_manager.py, vLLM's
hash-chained prefix cache).

The target's and the drafter's paged caches (kv_cache.py) share one block table per sequence: block i of a
sequence holds positions [i * block_size, (i + 1) * block_size) in both. A full block enters the prefix cache
under a hash chained with the previous block's, once both its target K/V and its drafter context are written:
the drafter's context K/V of a token depends only on the target's features of the committed prefix, so a hit
restores the drafts as well as the target's keys (vLLM #47930 loses them, TensorRT-LLM recomputes them). A hit
compares token ids, so a hash collision is never a hit. Freed blocks stay findable until they are reused,
least recently freed first.

Once asked (record_events), it also records what enters and leaves the prefix cache, as CacheEvents, for a router
that routes each request to the replica holding its prefix (dflash_serving/kv_events.py publishes them).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

NULL_BLOCK = 0  # never handed out: padding rows and table entries past a sequence's blocks point here


@dataclass(eq=False)
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and cached
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CacheEvent:
    """A change of the prefix cache: blocks "stored" (a chain: each block's hash, the hash before the first, their
    tokens in order), blocks "removed" (evicted for reuse), or "cleared" (the whole cache)."""

    kind: str
    block_hashes: tuple[int, ...] = ()
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(previous: int | None, token_ids: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is deterministic (no per-process salt), and a hit compares the ids anyway
    return hash((previous, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        """num_blocks: physical blocks of each cache, the null block included."""
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in the order they are reused: least recently freed first; a cached one keeps its hash
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[int, int] = {}  # chained hash -> block id
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache, and those found there
        self.hit_tokens = 0
        self.events: list[CacheEvent] | None = None  # None: not recorded

    def record_events(self) -> None:
        """From now on, record every change of the prefix cache (take_events hands them over)."""
        self.events = []

    def take_events(self) -> list[CacheEvent]:
        """The changes recorded since the last call, oldest first."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    @property
    def num_blocks(self) -> int:
        """Blocks a sequence may hold (the null block aside)."""
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def admit(self, table: list[int], hashes: list[int], token_ids: list[int], reserve: int) -> int | None:
        """Blocks for a sequence joining the batch with the empty `table`: the cached blocks of the longest prefix
        of `token_ids` made of whole blocks (their hashes go to `hashes`), then new blocks up to `reserve` positions.
        Returns the prefix's token count, or None (nothing taken) if the free blocks do not suffice."""
        hits = self._match(token_ids)
        taken_from_free = sum(1 for b in hits if b.ref_count == 0)
        if self.blocks_for(reserve) - len(hits) + taken_from_free > self.num_free:
            return None
        for block in hits:
            if block.ref_count == 0:
                del self.free[block.id]
            block.ref_count += 1
            table.append(block.id)
            hashes.append(block.hash)
        self.queried_tokens += len(token_ids)
        self.hit_tokens += len(hits) * self.block_size
        if not self.grow(table, reserve):  # cannot fail: checked above
            raise AssertionError("free blocks miscounted")
        return len(hits) * self.block_size

    def grow(self, table: list[int], positions: int) -> bool:
        """New blocks at the end of `table` until it covers `positions` positions; False (nothing taken) if too few
        are free."""
        need = self.blocks_for(positions) - len(table)
        if need > self.num_free:
            return False
        for _ in range(need):
            table.append(self._take_free())
        return True

    def cache_full_blocks(self, table: list[int], hashes: list[int], token_ids: list[int], written: int) -> None:
        """Enter the sequence's blocks that are full within its first `written` tokens (target K/V and drafter
        context both written) into the prefix cache, continuing the chain of `hashes`."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(hashes), written // bs):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hashes[-1] if hashes else None
            h = chain_hash(parent, chunk)
            hashes.append(h)
            block = self.blocks[table[i]]
            if h not in self.cached:  # else another sequence cached the same tokens first: this copy stays private
                block.hash, block.token_ids = h, chunk
                self.cached[h] = block.id
                self._stored(h, parent, chunk)

    def _stored(self, h: int, parent: int | None, chunk: tuple[int, ...]) -> None:
        """Record a block entering the cache, joined to the last event when that stored the block before it."""
        if self.events is None:
            return
        last = self.events[-1] if self.events else None
        if last is not None and last.kind == "stored" and last.block_hashes[-1] == parent:
            self.events[-1] = CacheEvent("stored", last.block_hashes + (h,), last.parent_hash, last.token_ids + chunk)
        else:
            self.events.append(CacheEvent("stored", (h,), parent, chunk))

    def release(self, table: list[int]) -> None:
        """Give back a sequence's blocks; its cached ones stay findable until reused. The last block is reused
        first: a conversation's next turn is likelier to share its beginning than its end."""
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        table.clear()

    def forget(self) -> None:
        """Empty the prefix cache (blocks in use keep their contents)."""
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        self.cached.clear()
        if self.events is not None:
            self.events.append(CacheEvent("cleared"))

    def _match(self, token_ids: list[int]) -> list[Block]:
        hits, h, bs = [], None, self.block_size
        if not self.prefix_caching:
            return hits
        for start in range(0, len(token_ids) - bs + 1, bs):
            chunk = tuple(token_ids[start:start + bs])
            h = chain_hash(h, chunk)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(self.blocks[block_id])
        return hits

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.events is not None:
                    self.events.append(CacheEvent("removed", (block.hash,)))
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
