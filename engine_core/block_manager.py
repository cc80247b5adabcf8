"""Paged KV-cache block manager: which fixed-size blocks of the KV pool each sequence owns. Device-free (no torch).

The KV pool of every full-attention layer is `[num_blocks, block_size, kv_heads, head_dim]` (the runner owns it); a
sequence's keys/values for positions 0..n-1 live in `block_table[p // block_size]` at offset `p % block_size`, so
the slot of position p is `block_table[p // block_size] * block_size + p % block_size`. This class only hands out
block ids; it never sees a tensor. (The GDN recurrent and conv states are O(1) per sequence and are not paged: the
continuous scheduler gives each resident sequence a state slot instead.)

Mirrors nano-vllm `nanovllm/engine/block_manager.py` (free list, per-block ref counts, allocate / append /
deallocate) without its hashing, plus vLLM's admission watermark:

- **Free list.** A deque of free block ids; allocation takes from the left, freeing appends on the right, so a
  block just freed is reused last (the order a future prefix cache wants: evict least recently freed first).
- **Ref counts.** A block is free iff its ref count is 0. `fork` shares a sequence's *full* blocks with another
  sequence (ref count + 1): the hook for prefix sharing. Only full blocks are shared, so the block a sequence
  writes into (its last, partial one) is always its own and no copy-on-write is ever needed.
- **Watermark.** `can_allocate` (admitting a new sequence) keeps `watermark_blocks` free, so resident sequences
  can still grow by a decode token without an immediate preemption; `can_append` (growing a resident sequence)
  may use every free block.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable

SeqId = Hashable  # the scheduler uses its RequestId


class NoFreeBlocks(RuntimeError):
    """`allocate` / `append` was asked for more blocks than are free (callers check `can_*` first)."""


class BlockManager:
    """Block tables of the resident sequences over a pool of `num_blocks` blocks of `block_size` token slots."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark is a fraction of the pool in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # vLLM default 0.01: on a pool of 10k blocks, 100 blocks = 100 sequences' next decode block stay in reserve.
        self.watermark_blocks = int(watermark * num_blocks)
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[SeqId, list[int]] = {}
        self._tokens: dict[SeqId, int] = {}  # token slots reserved per sequence (<= len(table) * block_size)

    # ---- queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1."""
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` token slots."""
        return math.ceil(num_tokens / self.block_size)

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        return tuple(self._tables[seq_id])

    def num_tokens(self, seq_id: SeqId) -> int:
        """Token slots reserved for the sequence (positions 0..n-1 have a home)."""
        return self._tokens[seq_id]

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def can_allocate(self, num_tokens: int, *, use_watermark: bool = True) -> bool:
        """Could a new sequence get slots for `num_tokens` tokens while leaving the watermark free?"""
        reserve = self.watermark_blocks if use_watermark else 0
        return len(self._free) - self.blocks_for(num_tokens) >= reserve

    def blocks_to_append(self, seq_id: SeqId, num_new_tokens: int = 1) -> int:
        """New blocks `append(seq_id, num_new_tokens)` would take (0 while the last block has room)."""
        return self.blocks_for(self._tokens[seq_id] + num_new_tokens) - len(self._tables[seq_id])

    def can_append(self, seq_id: SeqId, num_new_tokens: int = 1) -> bool:
        """Could a resident sequence grow by `num_new_tokens` slots (watermark not applied)?"""
        return self.blocks_to_append(seq_id, num_new_tokens) <= len(self._free)

    # ---- changes

    def allocate(self, seq_id: SeqId, num_tokens: int) -> tuple[int, ...]:
        """Give a new sequence blocks for `num_tokens` slots; return its block table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        need = self.blocks_for(num_tokens)
        if need > len(self._free):
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {need} blocks, {len(self._free)} free")
        self._tables[seq_id] = [self._take() for _ in range(need)]
        self._tokens[seq_id] = num_tokens
        return tuple(self._tables[seq_id])

    def append(self, seq_id: SeqId, num_new_tokens: int = 1) -> tuple[int, ...]:
        """Reserve `num_new_tokens` more slots; return the blocks newly added to the table (often none)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        need = self.blocks_to_append(seq_id, num_new_tokens)
        if need > len(self._free):
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {need} more blocks, {len(self._free)} free")
        new = [self._take() for _ in range(need)]
        self._tables[seq_id].extend(new)
        self._tokens[seq_id] += num_new_tokens
        return tuple(new)

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence's references; blocks nobody else references go back to the free list.

        Freed in reverse table order, so a later allocation reuses the sequence's tail blocks last (nano-vllm)."""
        for block_id in reversed(self._tables.pop(seq_id)):
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free.append(block_id)
        del self._tokens[seq_id]

    def fork(self, src: SeqId, dst: SeqId, num_tokens: int | None = None) -> tuple[int, ...]:
        """Start `dst` as a sharer of `src`'s full blocks covering its first `num_tokens` (default: all) tokens.

        `num_tokens` is rounded down to whole blocks: `dst` gets `num_tokens // block_size * block_size` slots whose
        KV it must not rewrite, and grows with `append` into blocks of its own. Returns `dst`'s block table.
        """
        if dst in self._tables:
            raise ValueError(f"sequence {dst!r} already has blocks")
        n = self._tokens[src] if num_tokens is None else min(num_tokens, self._tokens[src])
        shared = self._tables[src][: n // self.block_size]
        for block_id in shared:
            self._ref[block_id] += 1
        self._tables[dst] = list(shared)
        self._tokens[dst] = len(shared) * self.block_size
        return tuple(shared)

    def check(self) -> None:
        """Assert the book-keeping is consistent (ref counts = table references; free iff ref 0). For tests."""
        refs = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            assert self.blocks_for(self._tokens[seq_id]) <= len(table), f"{seq_id!r}: tokens beyond its blocks"
            for block_id in table:
                refs[block_id] += 1
        assert refs == self._ref, "ref counts disagree with the block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free == {b for b in range(self.num_blocks) if refs[b] == 0}, "free list != blocks with ref count 0"

    # ---- internals

    def _take(self) -> int:
        block_id = self._free.popleft()
        assert self._ref[block_id] == 0
        self._ref[block_id] = 1
        return block_id
