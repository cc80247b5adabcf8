"""Paged decoding state and the metadata of one variable-length step (many sequences, one flat token batch).

The engine's state, next to the contiguous `QwenState` of `state.py` (kept for the reference and the tests):

- full-attention layers: a KV pool `[num_blocks, block_size, kv_heads, head_dim]` for k and for v, shared by every
  sequence; a sequence's position p lives in block `block_table[p // block_size]` at offset `p % block_size`
  (`engine_core/block_manager.py`), i.e. at flat slot `slot_mapping` = block * block_size + offset;
- Gated DeltaNet layers: one row per *state slot* (`ScheduledSeq.state_slot`, 0..max_num_seqs-1) of the conv
  state `[slots, conv_dim, K-1]` (model dtype) and of the fp32 recurrent state `[slots, v_heads, Dk, Dv]`.

A step (`FlatBatch`) feeds the tokens of S sequences concatenated, `N = sum(n_i)` tokens: the first
`num_decode` sequences are decode rows (one token each, batched through the attention and the GDN recurrent step),
the rest prefill chunks (run one sequence at a time: SDPA with a causal offset mask, the chunked delta rule).
Host-side per-sequence numbers (`starts`, `context_lens`, ...) are plain tuples taken from the scheduler's plan, so
the per-sequence Python loops read no device value (no host syncs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.fp8_quant import kv_pool_cast

from ..config import FULL_ATTENTION, QwenConfig


@dataclass
class PagedKV:
    """Keys/values of one full-attention layer for every sequence, in blocks (after k_norm and RoPE). The pools hold
    the model dtype, or e4m3 codes at scale 1.0 (`QwenEngineConfig.kv_cache_dtype` "fp8": half the bytes a token;
    `kernels.fp8_quant.kv_pool_cast`); every reader attends to the stored values, so a prompt's own keys in its
    prefill are the rounded ones its later decode steps read back (`stored`)."""

    k: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, kv_heads, head_dim] at flat slots slot_mapping [N] (int64)."""
        kv_heads, head_dim = self.k.shape[2:]
        for pool, x in ((self.k, k), (self.v, v)):
            rows = kv_pool_cast(x, pool.dtype)
            if pool.dtype == torch.float8_e4m3fn:  # torch has no fp8 index_copy_ (CPU): the codes as bytes
                pool, rows = pool.view(torch.uint8), rows.view(torch.uint8)
            pool.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, rows)

    def stored(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x (keys or values) as the pool keeps them, read back in `dtype` (no copy when both are x's dtype)."""
        return kv_pool_cast(x, self.k.dtype).to(dtype)


@dataclass
class GDNSlots:
    """Gated DeltaNet state of one layer for every state slot."""

    conv: torch.Tensor  # [slots, conv_dim, kernel - 1] previous in_proj_qkv outputs (model dtype), oldest first
    recurrent: torch.Tensor  # [slots, v_heads, k_head_dim, v_head_dim] fp32 (or bf16: `PagedCache.empty`'s
    #                          state_dtype; every step computes in fp32 and rounds the state it stores)


@dataclass
class PagedCache:
    """The state of every layer: `layers[i]` is a `PagedKV` for full-attention layers, a `GDNSlots` otherwise."""

    layers: list[PagedKV | GDNSlots]
    block_size: int

    @classmethod
    def empty(cls, cfg: QwenConfig, num_blocks: int, block_size: int, num_slots: int, dtype=torch.float32,
              device=None, state_dtype=torch.float32, kv_dtype: torch.dtype | None = None) -> PagedCache:
        """kv_dtype: the KV pools' (None: `dtype`, the model's; torch.float8_e4m3fn: codes at scale 1.0)."""
        layers: list[PagedKV | GDNSlots] = []
        for t in cfg.layer_types:
            if t == FULL_ATTENTION:
                shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
                pool = kv_dtype or dtype
                layers.append(PagedKV(torch.zeros(shape, dtype=pool, device=device),
                                      torch.zeros(shape, dtype=pool, device=device)))
            else:
                conv = torch.zeros(num_slots, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype,
                                   device=device)
                rec = torch.zeros(num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim, dtype=state_dtype, device=device)
                layers.append(GDNSlots(conv, rec))
        return cls(layers, block_size)

    def reset_slots(self, slots: torch.Tensor) -> None:
        """Zero the GDN state rows `slots` [R] int64 (sequences starting from position 0)."""
        for layer in self.layers:
            if isinstance(layer, GDNSlots):
                layer.conv.index_fill_(0, slots, 0)
                layer.recurrent.index_fill_(0, slots, 0)


@dataclass
class FlatBatch:
    """Metadata of one step over S sequences / N tokens (device tensors + the host tuples they came from)."""

    positions: torch.Tensor  # [N] int64 position id of every token
    slot_mapping: torch.Tensor  # [N] int64 flat KV slot of every token
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0 (padding is masked by context_lens)
    context_lens_t: torch.Tensor  # [S] int64: keys visible to each sequence's last token (= start + n)
    state_slots_t: torch.Tensor  # [S] int64 GDN state rows
    starts: tuple[int, ...]  # S + 1 token offsets into the flat batch (cu_seqlens)
    context_lens: tuple[int, ...]  # [S] host copy
    state_slots: tuple[int, ...]  # [S] host copy
    num_decode: int  # rows 0..num_decode-1 are decode rows: 1 token each, starts[i] == i
    block_size: int
    # the GDN one-token recurrent step over the state pool, in place: (q, k, v, g, beta, pool [S, H, Dk, Dv], rows
    # int64 [B]) -> o [B, H, Dv]; None -> `gdn.gated_delta_rows` (kernels/gdn_decode.py's "gdn_decode_rows" op);
    # with `norm=(z, weight, eps, input_scale)` -> (the gated norm of o, its e4m3 codes), "gdn_decode_rows_norm_fp8"
    gdn_decode: Callable | None = None
    # attention of the decode rows over the paged pool: (q [D, H, Dh], k_pool, v_pool, block_tables [D, max_blocks],
    # context_lens [D], scale) -> o [D, H, Dh] in q's dtype (`kernels/paged_attention.py`, bounds read on the
    # device: capturable);
    # None -> `attention.paged_decode_attention` (gather sized from the host context lengths + SDPA)
    decode_attention: Callable | None = None
    # GDN decode-row preparation (conv step, head norms, gates) for decode-only steps: `kernels/gdn_prep.py`'s op
    # signature; None -> the plain torch path of `GatedDeltaNet.forward_paged`
    gdn_prep: Callable | None = None
    # the same with the in_proj_b / in_proj_a projections inside: `kernels/gdn_prep.py`'s gdn_decode_prep_ba op
    # signature (x and the concatenated [2 Hv, hidden] b/a weight in place of b, a); None -> `gdn_prep` after the
    # projections' own GEMM
    gdn_prep_ba: Callable | None = None
    # GDN prefill of all prefill rows in one call: (q, k, v, g, beta of their tokens, entering states [P, H, Dk, Dv],
    # cu_seqlens int64 [P + 1] on the device, the same on the host) -> (o, final states) (`kernels/gdn_chunk.py`:
    # flash-linear-attention's kernels on CUDA); None -> `gdn.gated_delta_rule_chunked` per sequence
    gdn_chunk: Callable | None = None
    # GDN prefill conv of one sequence's chunk: (x rows [n, C], conv pool [S, C, K-1], state row int, weight [C, K],
    # valid int64 [1] | None) -> (y [n, C], pool advanced in place) (`kernels/gdn_conv.py`'s op); None -> the torch
    # `gdn.causal_conv1d`
    gdn_conv: Callable | None = None
    # padded single-sequence prefill (`prefill_graphs.py`): int64 [1] on the device, the number of real tokens; the
    # step is one prefill sequence from position 0 whose tokens at or past it are padding (they must not touch the
    # sequence's GDN state or be attended to by its real tokens). None: every token is real.
    valid_tokens: torch.Tensor | None = None
    # the prefill rows' token offsets relative to the first of them, int64 [P + 1] (device, host), built once per
    # step when P >= 2 (one prefill row: None, fla's fixed-length path). One object for every GDN layer of the step:
    # fla caches its chunk indices by the tensors' identity, and the host copy spares it a device sync to build them
    # (a fresh tensor per layer cost two syncs per layer: 60 per 2,048-token step, Qwen profile run 18)
    prefill_cu: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return self.starts[-1]

    @classmethod
    def build(cls, seqs: list[tuple[int, int, tuple[int, ...], int]], num_decode: int, block_size: int,
              device, gdn_decode: Callable | None = None, decode_attention: Callable | None = None,
              gdn_prep: Callable | None = None, gdn_chunk: Callable | None = None,
              gdn_conv: Callable | None = None, gdn_prep_ba: Callable | None = None) -> FlatBatch:
        """From per-sequence (start, num_tokens, block_table, state_slot), decode rows first; one host->device copy
        per field (pinned, non-blocking on CUDA)."""
        positions, slots, starts, ctx = [], [], [0], []
        width = max(len(bt) for _, _, bt, _ in seqs)
        tables = []
        for start, n, table, _ in seqs:
            end = start + n
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            starts.append(starts[-1] + n)
            ctx.append(end)
            tables.append(list(table) + [0] * (width - len(table)))
        state_slots = tuple(s for *_, s in seqs)
        pin = torch.device(device).type == "cuda"

        def put(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=True)

        prefill_cu = None
        if len(seqs) - num_decode >= 2:
            host = torch.tensor([b - starts[num_decode] for b in starts[num_decode:]], dtype=torch.int64)
            prefill_cu = (host.pin_memory().to(device, non_blocking=True) if pin else host.to(device), host)
        return cls(put(positions), put(slots), put(tables), put(ctx), put(list(state_slots)), tuple(starts),
                   tuple(ctx), state_slots, num_decode, block_size, gdn_decode, decode_attention, gdn_prep,
                   gdn_prep_ba, gdn_chunk, gdn_conv, prefill_cu=prefill_cu)
