"""Gated full attention (10 of the 40 layers): GQA 16/2, head 256, q/k zero-centred RMSNorm, partial RoPE, output gate.

Mirrors `Qwen3_5MoeAttention` + `Qwen3_5MoeTextRotaryEmbedding` in transformers 5.24 `modeling_qwen3_5_moe.py`.
Text-only positions: the three mRoPE rows (t, h, w) are equal, so the interleaved mRoPE reduces to plain 1-D RoPE
(NeoX `rotate_half` on the first `rotary_dim` = 64 dims of each head; the other 192 pass through).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kernels.fp8_quant import kv_pool_rows
from kernels.paged_attention import GATED_NAME as GATED_OP

from ..config import QwenConfig
from .norm import ZeroCentredRMSNorm
from .paged import FlatBatch, PagedKV
from .quantized import drop_fused_projections, producer_scale, project_together
from .state import KVCache

# Decode steps with FP8 o_proj codes: the output gate and o_proj's codes in the decode attention's combine launch
# ("paged_decode_attention_gated_fp8", kernels/paged_attention.py; the same bits) instead of a launch of their own
# after it: 10 launches fewer a lone decode step. Process-wide, set by the engine (QwenEngineConfig
# .attn_gate_in_combine, on by default since H200 variants run 1); off here until an engine sets it.
GATE_IN_COMBINE = False


class RotaryEmbedding(nn.Module):
    # No buffer: `model.to(torch.bfloat16)` would round a stored inv_freq to bf16, a phase error of radians at
    # position ~1000 (transformers' `from_pretrained(dtype=bf16)` keeps it fp32; its `.to(bf16)` does not).
    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.rotary_dim, self.theta = cfg.rotary_dim, cfg.rope_theta
        # (device, dtype) -> [2, P, rotary_dim]: `forward`'s cos and sin of positions 0..P-1 (`reserve`)
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def reserve(self, positions: int, device, dtype: torch.dtype) -> None:
        """Precompute `forward`'s cos / sin of positions [0, positions) on `device` in `dtype` (the same elementwise
        fp32 operations on the same values: the same bits), for `lookup`. Grows, never shrinks (engines sharing a
        model each reserve their max_model_len)."""
        grid = torch.arange(positions, device=device)
        key = (grid.device, dtype)
        have = self._tables.get(key)
        if have is None or have.shape[1] < positions:
            self._tables[key] = torch.stack(self(grid, dtype))

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` by one gather from the `reserve`d table where there is one (one launch instead of ~10 a decode
        step; the caller guarantees positions below the reserved count: the engine's max_model_len), else `forward`."""
        table = self._tables.get((positions.device, dtype))
        if table is None:
            return self(positions, dtype)
        both = table.index_select(1, positions)  # [2, T, rotary_dim]
        return both[0], both[1]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim], in fp32 then cast to the activation dtype (as upstream)."""
        rd = self.rotary_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=positions.device) / rd))
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; rotate the first cos.shape[-1] dims (NeoX halves), pass the rest through."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((xr * cos + rotated * sin, xp), dim=-1)


class GatedAttention(nn.Module):
    """In a decode-only paged step on CUDA (or with `fused = True`), the q/k norms, the partial RoPE and the k/v pool
    write are one launch of the registry op "attn_decode_prep" (`kernels/attn_prep.py`, ~18 launches -> 1) when the
    batch has a decode attention kernel; `fused = False` never. Every other path runs the torch code below."""

    fused: bool | None = None

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        # q_proj rows, per head: d query rows then d gate rows (the checkpoint's interleaving, kept as is)
        self.q_proj = nn.Linear(cfg.hidden_size, h * d * 2, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.scaling = d ** -0.5

    def _apply(self, fn, recurse=True):
        drop_fused_projections(self)  # `.to()` & co. move the projections' buffers: free the fused copy now
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """x [B, T, hidden]; cos/sin [T, rotary_dim] for the T new positions; cache appended in place."""
        b, t, _ = x.shape
        q, gate = self.q_proj(x).view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [B, T, H, D] each
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)  # [B, KV, T, D]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)

        if cache is not None:
            k, v = cache.append(k, v)  # [B, KV, past + T, D]
        o = causal_attention(q, k, v, self.scaling)  # [B, H, T, D]
        o = o.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        o = o * torch.sigmoid(gate.reshape(b, t, -1))  # output gate, elementwise over all H*D channels
        return self.o_proj(o)

    def _takes_decode_fused(self, x: torch.Tensor, batch: FlatBatch) -> bool:
        fused = self.fused if self.fused is not None else x.is_cuda
        return (fused and batch.num_decode == x.shape[0] and batch.decode_attention is not None
                and self.q_norm.eps == self.k_norm.eps)  # (the op takes one eps; the model's are equal)

    def decode_input_scale(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor | None:
        """The static scale the input norm quantises x with for this step's q/k/v_proj, where the decode path reads
        such codes (`quantized.producer_scale`), else None."""
        if not self._takes_decode_fused(x, batch):
            return None
        return producer_scale(self, ("q_proj", "k_proj", "v_proj"))

    def forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: PagedKV,
                      batch: FlatBatch, codes: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] (the flat tokens of `batch`); cos/sin [N, rotary_dim]; writes the N new keys/values into
        the pool at `batch.slot_mapping`, then attends each token to its own sequence's keys 0..position."""
        n = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self._takes_decode_fused(x, batch):
            return self._decode_fused(x, cos, sin, kv, batch, codes)
        q, gate = self.q_proj(x).view(n, h, 2 * d).chunk(2, dim=-1)  # [N, H, D] each
        q = self.q_norm(q).transpose(0, 1)[None]  # [1, H, N, D]
        k = self.k_norm(self.k_proj(x).view(n, kvh, d)).transpose(0, 1)[None]  # [1, KV, N, D]
        v = self.v_proj(x).view(n, kvh, d)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        kv.write(batch.slot_mapping, k[0].transpose(0, 1), v)

        o = q.new_empty(1, h, n, d)
        nd = batch.num_decode
        if nd:
            q_dec = q[0, :, :nd].transpose(0, 1)  # [D, H, Dh]
            if batch.decode_attention is None:
                o_dec = paged_decode_attention(q_dec, kv, batch, self.scaling)
            else:
                o_dec = batch.decode_attention(q_dec.contiguous(), kv.k, kv.v, batch.block_tables[:nd],
                                               batch.context_lens_t[:nd], self.scaling)
            o[:, :, :nd] = o_dec.transpose(0, 1)[None]
        for i in range(nd, batch.num_seqs):
            s, e, ctx = batch.starts[i], batch.starts[i + 1], batch.context_lens[i]
            if ctx == e - s:  # the whole sequence is in this step: its keys are the ones just written (no gather; also
                # what a padded prefill graph needs: its padding keys live in the scratch block, after the real ones)
                keys = kv.stored(k[:, :, s:e], q.dtype)  # as the pool keeps them (e4m3 pools: rounded)
                values = kv.stored(v[s:e].transpose(0, 1)[None], q.dtype)
            else:  # a chunk continuing its sequence: its token j (position ctx - (e - s) + j) sees keys 0 .. that
                keys, values = gather_kv(kv, batch.block_tables[i], ctx, q.dtype)  # [1, KV, ctx, D]
            o[:, :, s:e] = causal_attention(q[:, :, s:e], keys, values, self.scaling)
        o = o[0].transpose(0, 1).reshape(n, h * d)
        o = o * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(o)


    def _decode_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: PagedKV,
                      batch: FlatBatch, codes: torch.Tensor | None = None) -> torch.Tensor:
        """A decode-only step (one token per sequence): projections, one "attn_decode_prep" launch (norms, RoPE,
        pool write), the decode attention kernel, the output gate ("attn_output_gate": the strided gate's copy, the
        sigmoid and the product in one launch), o_proj. Same maths as `forward_paged`."""
        from engine_core.registry import default_registry

        n = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = project_together(self, ("q_proj", "k_proj", "v_proj"), x, codes)  # fused: one GEMV
        q, gate = q.view(n, h, 2 * d).chunk(2, dim=-1)  # [N, H, D] each (strided views)
        k = k.view(n, kvh, d)
        v = v.view(n, kvh, d)
        q, _, _ = default_registry().call("attn_decode_prep", q, k, v, self.q_norm.weight, self.k_norm.weight,
                                          self.q_norm.eps, cos, sin, batch.slot_mapping, kv.k, kv.v)  # [N, H, D]
        attn_args = (q, kv.k, kv.v, batch.block_tables[:n], batch.context_lens_t[:n], self.scaling)
        scale = producer_scale(self, ("o_proj",))
        if GATE_IN_COMBINE and scale is not None:  # the gate and o_proj's codes in the attention's combine
            o, o_codes = default_registry().call(GATED_OP, *attn_args, gate, scale)
            return self.o_proj(o, o_codes)
        o = batch.decode_attention(*attn_args)
        if scale is None:
            o = default_registry().call("attn_output_gate", o, gate)  # o * sigmoid(gate) [N, H * D]: 3 launches -> 1
            return self.o_proj(o)
        o, o_codes = default_registry().call("attn_output_gate_fp8", o, gate, scale)  # + o_proj's activation codes
        return self.o_proj(o, o_codes)


# The prefill attention's SDPA backends: none that builds a plan per shape. cuDNN's attention (torch's first choice on
# Hopper) builds one at each new (queries, keys) shape, and chunked prefill makes a new shape nearly every step of a
# burst of requests (each cut where the step's token budget ends). H200, benchmarks/sdpa_shapes.py
# (results/sdpa_shapes_run1): 12 new causal shapes took 1,874 ms by default against 1.8 ms with flash (60-71 ms a
# shape after the first), 12 new masked ones 7,659 ms against 4.1 ms as flash's lower-right causal; Qwen
# run 33: the last of 32 concurrent 1k prompts' first tokens at 17.8 s in a process's first engine, 4.7 s in its
# second (the same prompts and budget: the same shapes, planned); run 35, on these backends: 12.7 s in the first.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, T, D] at the last T of the ctx positions of k / v [B, KV, ctx, D] (GQA: H a multiple of KV) -> o
    [B, H, T, D]: query j (position ctx - T + j) sees keys 0..ctx - T + j. One query sees every key; T = ctx is
    plain causal; a chunk continuing its sequence (T < ctx) takes the lower-right causal mask (torch's CausalBias,
    flash's own alignment) with the kv heads repeated to H (the form sdpa_shapes.py measured; CausalBias with
    enable_gqa is not measured on a GPU)."""
    t, ctx = q.shape[2], k.shape[2]
    with sdpa_kernel(PREFILL_BACKENDS):
        if t == 1 or t == ctx:
            return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=scale, enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                              attn_mask=causal_lower_right(t, ctx), scale=scale)


def gather_kv(kv: PagedKV, block_table: torch.Tensor, ctx: int,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys/values for positions 0..ctx-1: block_table [max_blocks] -> k, v [1, KV, ctx, D] in
    `dtype` (None: the pool's; e4m3 codes convert exactly to the model dtypes)."""
    nb = -(-ctx // kv.k.shape[1])
    blocks = block_table[:nb]
    kvh, d = kv.k.shape[2:]
    k = kv_pool_rows(kv.k, blocks).reshape(-1, kvh, d)[:ctx].transpose(0, 1)[None]
    v = kv_pool_rows(kv.v, blocks).reshape(-1, kvh, d)[:ctx].transpose(0, 1)[None]
    return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))



def paged_decode_attention(q: torch.Tensor, kv: PagedKV, batch: FlatBatch, scale: float) -> torch.Tensor:
    """The decode rows 0..D-1 of `batch` at once: q [D, H, D_h] (one token per sequence) -> o [D, H, D_h].

    Gathers every row's blocks into a padded [D, KV, L, D_h] (L = the longest context, rounded up to whole blocks)
    and runs one batched SDPA with a key-padding mask; the reference `paged_decode_attention_reference` loops."""
    nd = q.shape[0]
    bs = kv.k.shape[1]
    kvh, d = kv.k.shape[2:]
    nb = -(-max(batch.context_lens[:nd]) // bs)
    tables = batch.block_tables[:nd, :nb]  # [D, nb]
    k = kv_pool_rows(kv.k, tables).reshape(nd, nb * bs, kvh, d).transpose(1, 2).to(q.dtype)  # [D, KV, L, D_h]
    v = kv_pool_rows(kv.v, tables).reshape(nd, nb * bs, kvh, d).transpose(1, 2).to(q.dtype)
    keep = torch.arange(nb * bs, device=q.device)[None, :] < batch.context_lens_t[:nd, None]  # [D, L]
    o = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=keep[:, None, None, :], scale=scale,
                                       enable_gqa=True)  # [D, H, 1, D_h]
    return o[:, :, 0]


def paged_decode_attention_reference(q: torch.Tensor, kv: PagedKV, batch: FlatBatch, scale: float) -> torch.Tensor:
    """Row by row: each decode token against its own gathered keys, no padding. Same contract."""
    outs = []
    for i in range(q.shape[0]):
        k, v = gather_kv(kv, batch.block_tables[i], batch.context_lens[i], q.dtype)
        outs.append(F.scaled_dot_product_attention(q[i][None, :, None], k, v, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(outs)
