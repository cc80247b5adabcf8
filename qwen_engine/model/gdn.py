"""Gated DeltaNet (30 of the 40 layers): causal depthwise conv + the gated delta rule, with an fp32 recurrent state.

Mirrors `Qwen3_5MoeGatedDeltaNet` in transformers 5.24 `modeling_qwen3_5_moe.py` (whose pure-torch fallbacks are
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`); the algorithm is GatedDeltaNet (Yang et al. 2024,
arXiv 2412.06464) with the WY/UT chunked form of DeltaNet (arXiv 2406.06484).

Per value head h, with decay a_t = exp(g_t), the state S [Dk, Dv] evolves as
    S_t = a_t S_{t-1} + k_t delta_t^T,    delta_t = beta_t (v_t - a_t S_{t-1}^T k_t),    o_t = S_t^T q_t
`gated_delta_step` is that recurrence for one token (decode); `gated_delta_rule_recurrent` loops it (reference);
`gated_delta_rule_chunked` is the prefill form: within a chunk of C tokens, with Gamma the in-chunk cumulative log
decay and S0 the state entering the chunk,
    (I + A) Delta = diag(beta) V - diag(beta e^Gamma) K S0,  A[t,s] = beta_t e^(Gamma_t - Gamma_s) k_t.k_s  (s < t)
    O = diag(e^Gamma) Q S0 + (M o Q K^T) Delta,               M[t,s] = e^(Gamma_t - Gamma_s)             (s <= t)
    S_C = e^Gamma_C S0 + (e^(Gamma_C - Gamma) o K)^T Delta
so a chunk costs two triangular solves and a few [C, C] matmuls; only the state crosses chunk boundaries.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.rms_norm import rounds_x

from ..config import QwenConfig
from . import streams
from .norm import GatedRMSNorm
from .paged import FlatBatch, GDNSlots
from .quantized import drop_fused_projections, producer_scale, project_together
from .state import GDNState


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor,
                  valid: torch.Tensor | None = None):
    """Depthwise causal conv + SiLU. x [B, C, T]; conv_state [B, C, K-1] (previous inputs, zeros at sequence start);
    weight [C, 1, K]. Returns (y [B, C, T], new conv state [B, C, K-1] = the last K-1 inputs). `valid` (int64 [1] on
    x's device): only the first valid[0] of the T inputs are real (padding after them); the new state ends at the
    last real input (read on the device: no host sync)."""
    k = weight.shape[-1]
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[0], x.shape[1], k - 1)
    full = torch.cat((conv_state.to(x.dtype), x), dim=-1)  # [B, C, K-1+T]
    y = F.conv1d(full.to(weight.dtype), weight, groups=x.shape[1])  # no padding: T outputs
    if valid is None:
        return F.silu(y).to(x.dtype), full[:, :, -(k - 1):]
    # inputs valid-K+1 .. valid-1 are columns valid .. valid+K-2 of `full` (K-1 state columns first)
    tail = full.index_select(-1, valid + torch.arange(k - 1, device=x.device))
    return F.silu(y).to(x.dtype), tail


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's L2 norm: x * rsqrt(sum(x^2) + eps) (eps inside the root, unlike F.normalize)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_step(q, k, v, g, beta, state):
    """One token. q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dk, Dv]; all fp32.
    Returns (o [B, H, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def widened(state: torch.Tensor) -> torch.Tensor:
    """State rows of the pool as the recurrence computes them: at least fp32 (a bf16 pool, `QwenEngineConfig.
    gdn_state_dtype`, widened; fp32 as it is, no copy). Stores round back to the pool's dtype."""
    return state.to(torch.promote_types(state.dtype, torch.float32))


def gated_delta_rows(q, k, v, g, beta, pool, rows):
    """`gated_delta_step` for batch rows that own rows `rows` (int64 [B]) of a state pool [S, H, Dk, Dv]: gather,
    step, scatter back in place. Returns o [B, H, Dv]. (`kernels/gdn_decode.py`'s rows op does it in one pass.) A
    bf16 pool (`QwenEngineConfig.gdn_state_dtype`): the step in fp32 on the widened rows, the new state rounded to
    bf16 (RNE) as it is stored."""
    o, new_state = gated_delta_step(q, k, v, g, beta, widened(pool[rows]))
    pool.index_copy_(0, rows, new_state.to(pool.dtype))
    return o


def gated_delta_rule_recurrent(q, k, v, g, beta, state):
    """Token-by-token reference. q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; state [B, H, Dk, Dv]; fp32."""
    outs = []
    for t in range(q.shape[1]):
        o, state = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
    return torch.stack(outs, dim=1), state


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """Chunked prefill, same contract as `gated_delta_rule_recurrent` (see the module docstring for the maths)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    n = math.ceil(t / c)
    pad = n * c - t
    # [B, H, n, C, D]; padded tokens have k = v = beta = g = 0: no write, no decay, so the final state is exact
    q, k, v = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)).reshape(b, h, n, c, -1) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)).reshape(b, h, n, c) for x in (g, beta))

    gam = g.cumsum(-1)  # [B, H, n, C] in-chunk cumulative log decay
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~incl, float("-inf")).exp()  # M, zero above diag
    kb = k * beta[..., None]
    a = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    tri = a + torch.eye(c, dtype=a.dtype, device=a.device)
    u = torch.linalg.solve_triangular(tri, v * beta[..., None], upper=False, unitriangular=True)  # [B,H,n,C,Dv]
    w = torch.linalg.solve_triangular(tri, kb * gam.exp()[..., None], upper=False, unitriangular=True)  # [..,C,Dk]
    attn = (q @ k.transpose(-1, -2)) * decay  # [B, H, n, C, C]
    q_dec = q * gam.exp()[..., None]
    k_dec = k * (gam[..., -1:] - gam).exp()[..., None]
    chunk_decay = gam[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]

    out = torch.empty(b, h, n, c, dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        delta = u[:, :, i] - w[:, :, i] @ state  # [B, H, C, Dv]
        out[:, :, i] = q_dec[:, :, i] @ state + attn[:, :, i] @ delta
        state = state * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ delta
    return out.reshape(b, h, n * c, dv)[:, :, :t].transpose(1, 2), state


def _norm_input(o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The GDN core's output o as the gated norm takes it: as it is where the norm rounds it to z's dtype itself
    (`rounds_x`), else `o.to(dtype)` (fp32: no-op; fp64 (tests): widen)."""
    return o if z.dtype == dtype and rounds_x(o, z) else o.to(dtype)


class GatedDeltaNet(nn.Module):
    # decode-only steps compute in_proj_b / in_proj_a inside the prep op (`batch.gdn_prep_ba`) when the runner offers
    # it and both are plain linears; False: their concatenated GEMM, then `batch.gdn_prep` (tests pin either path)
    fused_ba = True
    # CUDA decode-only steps compute in_proj_z (the output norm's gate, needed only after the recurrent step) on a
    # second stream (`streams.py`), beside in_proj_qkv -> prep -> recurrent step on the main one, instead of inside
    # one fused q/k/v/z GEMV; joined before the gated norm. Both read the same FP8 codes; each projection's own GEMV
    # call may tile its sums differently from the fused call's (fp32 summation order). Set by the engine
    # (QwenEngineConfig.gdn_z_stream)
    z_stream = False
    # decode-only steps with out_proj's input codes: the recurrent step and the gated norm + codes after it in one
    # launch (`batch.gdn_decode(..., norm=...)`: kernels/gdn_decode.py "gdn_decode_rows_norm_fp8"; the engine's
    # `gdn_decode_norm`); the same operations
    decode_norm = False

    def __init__(self, cfg: QwenConfig, chunk_size: int = 64):
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.chunk_size = chunk_size
        conv_dim = cfg.linear_conv_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, conv_dim, bias=False)  # [q | k | v] channels
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)  # output-norm gate
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.num_v_heads, bias=False)  # beta = sigmoid(b)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.num_v_heads, bias=False)  # decay input
        # depthwise, weight [conv_dim, 1, K]; applied through `causal_conv1d` (which carries the state), never called
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))  # decay rate A = exp(A_log) > 0
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def _apply(self, fn, recurse=True):
        # `.to()` & co. move the buffers: free the fused FP8 projections and the b/a weight copy now, not at the
        # next decode call (both are rebuilt from the moved buffers)
        drop_fused_projections(self)
        self.__dict__.pop("_ba_cache", None)
        return super()._apply(fn, recurse)

    # ---- shared pieces (any leading dims [...]: [B, T] for the contiguous path, [N] for the flat one)

    def _project_ba(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_proj_b(x), in_proj_a(x)), each [..., Hv], as one GEMM on the concatenated [2 Hv, hidden] weight (one
        launch instead of two: 30 per decode step): two column views of its output, rows strided 2 Hv (what
        gdn_prep reads through its row strides). The same dot products as two GEMMs; only the GEMM's summation order
        may differ (tests/test_gdn_fused_glue.py states the tolerance). Falls back to the two projections when
        either is not a plain bias-free nn.Linear (a quantized replacement)."""
        if not self._plain_ba():
            return self.in_proj_b(x), self.in_proj_a(x)
        ba = F.linear(x, self._ba_weight())
        return ba[..., :self.num_v_heads], ba[..., self.num_v_heads:]

    def _plain_ba(self) -> bool:
        """in_proj_b and in_proj_a are plain bias-free nn.Linear (BF16 in the checkpoints), so one concatenated weight
        computes both (not a quantized replacement)."""
        b_lin, a_lin = self.in_proj_b, self.in_proj_a
        return (type(b_lin) is nn.Linear and type(a_lin) is nn.Linear and b_lin.bias is None
                and a_lin.bias is None)

    def _ba_weight(self) -> torch.Tensor:
        """cat(in_proj_b.weight, in_proj_a.weight) [2 Hv, hidden], built lazily and cached. Never stale: the cache is
        keyed on both source weights' data_ptr and `_version` (bumped by every in-place write: load_state_dict,
        copy_, normal_; `.to()` / `.data =` swaps change the data_ptr), and it keeps the sources it was built from
        alive so that a freed address cannot be reused under the same key. Built on the first decode-fused step,
        which the CUDA-graph warm-up runs eagerly before capture; a weight reload between captures rebuilds it on
        the next eager step (the graphs must be re-captured after a reload anyway: they hold the old pointers)."""
        wb, wa = self.in_proj_b.weight, self.in_proj_a.weight
        key = (wb.data_ptr(), wb._version, wa.data_ptr(), wa._version)
        cached = getattr(self, "_ba_cache", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, torch.cat((wb, wa), dim=0), wb.detach(), wa.detach())
            self._ba_cache = cached  # a plain attribute: not a parameter or buffer (no state_dict entry)
        return cached[1]

    def _project(self, x: torch.Tensor):
        """x [..., hidden] -> z [..., Hv, Dv], beta / g [..., Hv] fp32, raw conv input [..., conv_dim]."""
        z = self.in_proj_z(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
        beta = torch.sigmoid(self.in_proj_b(x)).float()  # sigmoid in the model dtype (upstream), then fp32
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())  # <= 0
        return z, beta, g, self.in_proj_qkv(x)

    def _heads(self, qkv: torch.Tensor):
        """Conv output [..., conv_dim] -> q, k [..., Hv, Dk] (L2-normalised, q scaled), v [..., Hv, Dv]; fp32."""
        hv, hk = self.num_v_heads, self.num_k_heads
        q, k, v = qkv.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q = l2norm(q.unflatten(-1, (hk, self.head_k_dim)).float()) * self.head_k_dim ** -0.5
        k = l2norm(k.unflatten(-1, (hk, self.head_k_dim)).float())
        v = v.unflatten(-1, (hv, self.head_v_dim)).float()
        # q/k head j serves v heads r*j .. r*j + r-1 (r = 2 in the real model)
        return q.repeat_interleave(hv // hk, dim=-2), k.repeat_interleave(hv // hk, dim=-2), v

    def _output(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o [..., Hv, Dv] fp32, z [..., Hv, Dv] in `dtype` -> [..., hidden]: gated norm per value head, out_proj.
        For a bf16/fp16 model the norm takes the fp32 o and rounds it to z's dtype itself (`GatedRMSNorm.forward`:
        the same numbers as `o.to(dtype)` first, without that copy's launch on the fused path)."""
        return self.out_proj(self.norm(_norm_input(o, z, dtype), z).flatten(-2))

    # ---- contiguous state (reference)

    def forward(self, x: torch.Tensor, state: GDNState | None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; `state` (if given) is read and advanced in place."""
        b, t, _ = x.shape
        z, beta, g, qkv = self._project(x)
        qkv, conv_state = causal_conv1d(qkv.transpose(1, 2), None if state is None else state.conv,
                                        self.conv1d.weight)
        q, k, v = self._heads(qkv.transpose(1, 2))  # [B, T, Hv, D]

        if state is None:
            s0 = torch.zeros(b, self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32,
                             device=x.device)
        else:
            s0 = state.recurrent
        if state is not None and t == 1:  # decode: the recurrent step (the GDN decode kernel replaces this)
            o, s = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
            o = o[:, None]
        else:
            o, s = gated_delta_rule_chunked(q, k, v, g, beta, s0, self.chunk_size)
        if state is not None:
            state.conv.copy_(conv_state)
            state.recurrent.copy_(s)
        return self._output(o, z, x.dtype)

    # ---- paged state (engine)

    @staticmethod
    def _takes_decode_fused(x: torch.Tensor, batch: FlatBatch) -> bool:
        """A decode-only step with the fused prep op offered: `_decode_fused` serves it."""
        return batch.gdn_prep is not None and batch.num_decode == x.shape[0]

    def decode_input_scale(self, x: torch.Tensor, batch: FlatBatch) -> torch.Tensor | None:
        """The static scale the input norm quantises x with for this step's in_proj_qkv / in_proj_z, where the
        decode path reads such codes (`quantized.producer_scale`), else None."""
        if not self._takes_decode_fused(x, batch):
            return None
        return producer_scale(self, ("in_proj_qkv", "in_proj_z"))

    def _decode_fused(self, x: torch.Tensor, slots: GDNSlots, batch: FlatBatch,
                      codes: torch.Tensor | None = None) -> torch.Tensor:
        """Decode rows only: projections, then conv step + head norms + gates in one op (`batch.gdn_prep`), the
        recurrent step, the gated norm and out_proj. Same maths as the general path below. `codes`: x's FP8
        activation codes from the input norm (`decode_input_scale`)."""
        rows = batch.state_slots_t
        with contextlib.ExitStack() as window:  # the z fork's window closes (joins) before the gated norm reads z
            if self.z_stream and streams.forkable(x):
                # the modules' own calls: project_together on one name would re-fuse (and re-view) its weight
                extra = () if codes is None else (codes,)
                side = window.enter_context(streams.branch(x.device))  # x and its codes are ready
                with streams.on_side(side):
                    z = self.in_proj_z(x, *extra)
                qkv_in = self.in_proj_qkv(x, *extra)
            else:
                qkv_in, z = project_together(self, ("in_proj_qkv", "in_proj_z"), x, codes)  # fused: one GEMV
            if self.fused_ba and batch.gdn_prep_ba is not None and self._plain_ba():  # b / a inside: a GEMM fewer
                q, k, v, beta, g, _, _ = batch.gdn_prep_ba(  # advances slots.conv[rows] in place
                    qkv_in, slots.conv, rows, self.conv1d.weight[:, 0], x, self._ba_weight(),
                    self.A_log, self.dt_bias, self.num_k_heads, self.head_k_dim, self.head_v_dim)
            else:
                q, k, v, beta, g, _ = batch.gdn_prep(  # advances slots.conv[rows] in place
                    qkv_in, slots.conv, rows, self.conv1d.weight[:, 0], *self._project_ba(x),
                    self.A_log, self.dt_bias, self.num_k_heads, self.head_k_dim, self.head_v_dim)
            scale = producer_scale(self, ("out_proj",))
            fused_norm = self.decode_norm and scale is not None and batch.gdn_decode is not None
            if not fused_norm:  # (fused: after the window, which joins z's fork)
                o = (batch.gdn_decode or gated_delta_rows)(q, k, v, g, beta, slots.recurrent, rows)
        z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        if fused_norm:  # the step + the gated norm + out_proj's codes in one op
            o, o_codes = batch.gdn_decode(q, k, v, g, beta, slots.recurrent, rows,
                                          norm=(z, self.norm.weight, self.norm.eps, scale))
            return self.out_proj(o.flatten(-2), o_codes.flatten(-2))
        if scale is None:
            return self._output(o, z, x.dtype)
        o, o_codes = self.norm.forward_fp8(_norm_input(o, z, x.dtype), z, scale)  # + out_proj's activation codes
        return self.out_proj(o.flatten(-2), o_codes.flatten(-2))

    def forward_paged(self, x: torch.Tensor, slots: GDNSlots, batch: FlatBatch,
                      codes: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] (the flat tokens of `batch`) -> [N, hidden]; each sequence reads and advances its own
        state row `batch.state_slots[i]`. Decode rows: one batched conv step and one batched recurrent step
        (`batch.gdn_decode`, default `gated_delta_rows`); prefill chunks: all in one call of `batch.gdn_chunk` where
        the runner sets it (CUDA: flash-linear-attention's kernels) and the model is bf16 / fp16, else per sequence,
        the chunked rule (the recurrent step for a 1-token chunk, as the contiguous path does)."""
        nd = batch.num_decode
        if self._takes_decode_fused(x, batch):  # a decode-only step: one fused launch (gdn_prep.py)
            return self._decode_fused(x, slots, batch, codes)
        z, beta, g, qkv_in = self._project(x)
        conv_out = torch.empty_like(qkv_in)  # [N, conv_dim]
        w = self.conv1d.weight
        if nd:
            rows = batch.state_slots_t[:nd]
            y, new_conv = causal_conv1d(qkv_in[:nd, :, None], slots.conv[rows], w)  # [D, C, 1]
            conv_out[:nd] = y[:, :, 0]
            slots.conv.index_copy_(0, rows, new_conv.to(slots.conv.dtype))
        valid = batch.valid_tokens
        for i in range(nd, batch.num_seqs):
            s, e, r = batch.starts[i], batch.starts[i + 1], batch.state_slots[i]
            if batch.gdn_conv is not None:  # one launch: rows in, rows out, the state row advanced in place
                y = batch.gdn_conv(qkv_in[s:e], slots.conv, r, w[:, 0], valid)[0]  # [n, C]
                if nd == 0 and batch.num_seqs == 1:
                    conv_out = y  # the whole batch (a lone prefill, e.g. a prefill graph): no copy
                else:
                    conv_out[s:e] = y
                continue
            y, new_conv = causal_conv1d(qkv_in[s:e].T[None], slots.conv[r:r + 1], w, valid)  # [1, C, n]
            conv_out[s:e] = y[0].T
            slots.conv[r:r + 1] = new_conv
        q, k, v = self._heads(conv_out)  # [N, Hv, D]
        if valid is not None:  # padding tokens (g = 0, beta = 0) leave the recurrent state as it is: S_t = S_{t-1}
            real = (torch.arange(x.shape[0], device=x.device) < valid)[:, None]  # [N, 1]
            g, beta = g * real, beta * real

        o = torch.empty_like(v)  # [N, Hv, Dv] fp32
        if nd:
            rows = batch.state_slots_t[:nd]
            o[:nd] = (batch.gdn_decode or gated_delta_rows)(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd],
                                                            slots.recurrent, rows)
        # every prefill row in one call (kernels/gdn_chunk: fla's kernels on CUDA, TF32 products, ~2e-3 relative):
        # for bf16 / fp16 models, whose projections feed it rounded inputs anyway; an fp32 model keeps the exact
        # torch chunked rule below (the oracle's fp32 gates are 1e-4)
        if batch.gdn_chunk is not None and batch.num_seqs > nd and x.dtype in (torch.bfloat16, torch.float16):
            t0, rows = batch.starts[nd], batch.state_slots_t[nd:]
            # one prefill sequence: no cu_seqlens (fla's fixed-length path: no host reads of them, capturable);
            # several: the step's one pair of offsets (device, host), shared by every GDN layer (`FlatBatch`)
            cu, cu_host = batch.prefill_cu or (None, None)
            o[t0:], final = batch.gdn_chunk(q[t0:], k[t0:], v[t0:], g[t0:], beta[t0:],
                                            widened(slots.recurrent[rows]), cu, cu_host)
            slots.recurrent[rows] = final.to(slots.recurrent.dtype)  # (index_put: the dtypes must match)
            return self._output(o, z, x.dtype)
        for i in range(nd, batch.num_seqs):
            s, e, r = batch.starts[i], batch.starts[i + 1], batch.state_slots[i]
            s0 = widened(slots.recurrent[r:r + 1])  # (rounded back to the pool's dtype as it is stored)
            if e - s == 1:
                oi, new_state = gated_delta_step(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], s0)
            else:
                oi, new_state = gated_delta_rule_chunked(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e],
                                                         beta[None, s:e], s0, self.chunk_size)
                oi = oi[0]
            o[s:e] = oi
            slots.recurrent[r:r + 1] = new_state
        return self._output(o, z, x.dtype)
