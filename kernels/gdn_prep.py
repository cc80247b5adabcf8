"""Gated DeltaNet decode-row preparation in one Triton launch: the depthwise causal conv step (+ SiLU) over the new
token, the conv-state shift, the q/k L2 norms and q scale, the repeat of q/k to the value heads, and the beta / decay
gates -- everything between a GDN layer's input projections and its recurrent step (`kernels/gdn_decode.py`).

Reference `gdn_decode_prep_reference`: exactly the torch code of `GatedDeltaNet._project` (gates) +
`causal_conv1d` + `GatedDeltaNet._heads` for decode rows (one token per sequence):
    inputs   qkv_in [D, C] (in_proj_qkv output, model dtype), conv_pool [S, C, K-1] (model dtype) with the rows'
             state slots `rows` [D] int64, conv weight [C, K] (model dtype), b, a [D, Hv] (in_proj_b / in_proj_a
             outputs), A_log, dt_bias [Hv]
    outputs  q, k [D, Hv, Dk] fp32 (L2-normalised with eps 1e-6 inside the root, q * Dk^-1/2, head j of Hk serving
             value heads r j .. r j + r-1), v [D, Hv, Dv] fp32, beta = sigmoid(b) rounded to the model dtype then
             fp32 [D, Hv], g = -exp(A_log) softplus(a + dt_bias) fp32 [D, Hv], and conv_pool itself,
             whose rows `rows` now hold the window shifted by one (the last K-1 inputs), written in place (custom op
             `qwen::gdn_decode_prep_`, mutates_args=("conv_pool",); the registry's self-check gives each call its
             own copy). In place safely: each program reads its whole window before a barrier and writes it after,
             and no other program reads the channels it writes (disjoint channels per k-head, distinct rows per
             sequence; CUDA-graph padding rows share the scratch row, left unspecified). This saves the
             `index_copy_` launch that wrote a returned new_conv back: 30 per decode step.
Casts as in the reference: the conv accumulates in fp32 and rounds to the model dtype, SiLU runs in fp32 on that and
rounds again (torch's bf16 `F.silu`), then q/k/v go to fp32.

Why: in a graphed decode step these are ~35 separate small kernels per GDN layer (cat, conv1d, silu, casts, index
gathers, five-op L2 norms twice, repeat_interleave twice, sigmoid, softplus, exp ...), ~1,000 of the step's kernels
over 30 layers; this is one launch per layer. Grid (D, Hk): a program owns one sequence's k-head j: its Dk q and Dk k
channels and the r Dv value channels they serve (Qwen3.6: Dk = Dv = 128, Hk = 16, Hv = 32, r = 2, K = 4, C = 8192).

Numerics: the same fp32 operations, reductions (conv taps, L2 sums) in another order -> ~1 ulp of the rounded
intermediates; tolerance: max |diff| <= 1e-2 x max |ref| per output for bf16 (a conv output that lands on a bf16
rounding boundary can move one bf16 ulp = 2^-8 relative, which the L2 norm passes on), 1e-5 for fp32; the decay g
(fp32 from the inputs alone) within 1e-5 relative per element.
Under the interpreter the bf16 roundings use `kernels.rms_norm._cast` (round to nearest even, as on the GPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels import pdl, tolerance
from kernels.device import triton_device_ok

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
    from kernels.pdl import prefetch_l2_once
    from kernels.rms_norm import _cast
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "gdn_decode_prep"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
L2_EPS = 1e-6  # FLA's l2norm eps (qwen_engine.model.gdn.l2norm)


def gdn_decode_prep_reference(qkv_in, conv_pool, rows, conv_w, b, a, a_log, dt_bias, num_k_heads: int,
                              head_k_dim: int, head_v_dim: int):
    """(q, k, v, beta, g, conv_pool); see the module docstring. conv_pool[rows] is advanced in place (read whole
    first, then written); duplicate rows (CUDA-graph padding on the scratch row) leave that row unspecified."""
    from qwen_engine.model.gdn import causal_conv1d, l2norm

    d, c = qkv_in.shape
    hv = b.shape[-1]
    key_dim = num_k_heads * head_k_dim
    beta = torch.sigmoid(b).float()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    y, new_conv = causal_conv1d(qkv_in[:, :, None], conv_pool[rows], conv_w[:, None, :])  # [D, C, 1], [D, C, K-1]
    y = y[:, :, 0]
    q, k, v = y.split((key_dim, key_dim, c - 2 * key_dim), dim=-1)
    q = l2norm(q.unflatten(-1, (num_k_heads, head_k_dim)).float()) * head_k_dim ** -0.5
    k = l2norm(k.unflatten(-1, (num_k_heads, head_k_dim)).float())
    v = v.unflatten(-1, (hv, head_v_dim)).float()
    r = hv // num_k_heads
    conv_pool.index_copy_(0, rows.long(), new_conv.to(conv_pool.dtype))
    return q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2), v, beta, g, conv_pool


if triton is not None:

    @triton.jit
    def _conv_window(qkv, pool, w, d, row, ch, ok, s_qd, s_pr, s_pc, s_wc,
                     KM1: tl.constexpr, BLOCK_T: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
        """Channels ch [A, B] of row d: conv over [pool taps 0..K-2, new x] + SiLU -> y fp32 [A, B] (after the two
        model-dtype roundings), and the window [A, B, BLOCK_T] in the model dtype (taps 0..K-2, x at K-1) for
        `_store_shifted`. Reads only: the pool row is written after every read of the program (`_gdn_prep_kernel`)."""
        tt = tl.arange(0, BLOCK_T)[None, None, :]
        x = tl.load(qkv + d * s_qd + ch, mask=ok, other=0.0)  # [A, B]
        taps = tl.load(pool + row * s_pr + ch[:, :, None] * s_pc + tt, mask=ok[:, :, None] & (tt < KM1), other=0.0)
        tf = taps.to(tl.float32)
        acc = x.to(tl.float32) * tl.load(w + ch * s_wc + KM1, mask=ok, other=0.0).to(tl.float32)
        for t in tl.static_range(KM1):  # the taps in order, each picked out of the window exactly (x + 0s)
            tap = tl.sum(tl.where(tt == t, tf, 0.0), axis=2)
            acc += tap * tl.load(w + ch * s_wc + t, mask=ok, other=0.0).to(tl.float32)
        y = _cast(acc, DTYPE, INTERPRET).to(tl.float32)  # conv1d output in the model dtype
        y = _cast(y / (1.0 + tl.exp(-y)), DTYPE, INTERPRET).to(tl.float32)  # SiLU, rounded, then .float()
        return y, tl.where(tt == KM1, x[:, :, None], taps)

    @triton.jit
    def _store_shifted(pool, row, ch, ok, win, s_pr, s_pc, KM1: tl.constexpr, BLOCK_T: tl.constexpr):
        """The new state of channels ch: window entries 1..K-1 into pool positions 0..K-2 (exact copies)."""
        tt = tl.arange(0, BLOCK_T)[None, None, :]
        tl.store(pool + row * s_pr + ch[:, :, None] * s_pc + (tt - 1), win,
                 mask=ok[:, :, None] & (tt >= 1) & (tt <= KM1))

    @triton.jit
    def _conv_taps(pool, w, row, ch, ok, s_pr, s_pc, s_wc, KM1: tl.constexpr, BLOCK_T: tl.constexpr):
        """EARLY's first half of `_conv_window`: the pool taps of channels ch [A, B] (positions 0..K-2; 0 at K-1 and
        past) and their K conv weights, both [A, B, BLOCK_T] in the model dtype -- nothing the predecessor writes."""
        tt = tl.arange(0, BLOCK_T)[None, None, :]
        taps = tl.load(pool + row * s_pr + ch[:, :, None] * s_pc + tt, mask=ok[:, :, None] & (tt < KM1), other=0.0)
        wt = tl.load(w + ch[:, :, None] * s_wc + tt, mask=ok[:, :, None] & (tt <= KM1), other=0.0)
        return taps, wt

    @triton.jit
    def _conv_of(qkv, d, ch, ok, taps, wt, s_qd, KM1: tl.constexpr, BLOCK_T: tl.constexpr, DTYPE: tl.constexpr,
                 INTERPRET: tl.constexpr):
        """EARLY's second half: `_conv_window`'s result from the new inputs x (the predecessor's output) and
        `_conv_taps`'. The same operations in the same order; each weight is picked out of its tile exactly (w + 0s),
        as the taps are, so the only possible difference is the sign of an exact zero weight (-0 picks as +0)."""
        tt = tl.arange(0, BLOCK_T)[None, None, :]
        x = tl.load(qkv + d * s_qd + ch, mask=ok, other=0.0)  # [A, B]
        tf = taps.to(tl.float32)
        wf = wt.to(tl.float32)
        acc = x.to(tl.float32) * tl.sum(tl.where(tt == KM1, wf, 0.0), axis=2)
        for t in tl.static_range(KM1):  # the taps in order, as `_conv_window`
            tap = tl.sum(tl.where(tt == t, tf, 0.0), axis=2)
            acc += tap * tl.sum(tl.where(tt == t, wf, 0.0), axis=2)
        y = _cast(acc, DTYPE, INTERPRET).to(tl.float32)  # conv1d output in the model dtype
        y = _cast(y / (1.0 + tl.exp(-y)), DTYPE, INTERPRET).to(tl.float32)  # SiLU, rounded, then .float()
        return y, tl.where(tt == KM1, x[:, :, None], taps)

    @triton.jit
    def _gate_inputs(b, a, ba_out, d, heads, r_ok, HV, H, s_bd, s_ad, dt: tl.constexpr, BA: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr, STORE: tl.constexpr):
        """(b, a) of the value heads `heads` [BLOCK_R] of row d in fp32, after their model-dtype rounding. BA: the
        dot products x . w_ba rows (heads) and (HV + heads) over the hidden size in BLOCK_H steps, also stored to
        ba_out when STORE; else loaded from the projections' outputs. Not STORE: EARLY's call before its wait, which
        reads x through L2 (".cg": x was written two launches back, never a stale L1 line of an earlier layer's x)
        and stores after the wait."""
        if BA:
            hh = tl.arange(0, BLOCK_H)[None, :]
            acc_b = tl.zeros([BLOCK_R], dtype=tl.float32)
            acc_a = tl.zeros([BLOCK_R], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                h_ok = (h0 + hh) < H
                if STORE:
                    xv = tl.load(b + d * s_bd + h0 + hh, mask=h_ok, other=0.0).to(tl.float32)  # [1, BH]
                else:
                    xv = tl.load(b + d * s_bd + h0 + hh, mask=h_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                w_ok = r_ok[:, None] & h_ok
                wb = tl.load(a + heads[:, None] * s_ad + h0 + hh, mask=w_ok, other=0.0).to(tl.float32)
                wa = tl.load(a + (HV + heads)[:, None] * s_ad + h0 + hh, mask=w_ok, other=0.0).to(tl.float32)
                acc_b += tl.sum(wb * xv, axis=1)
                acc_a += tl.sum(wa * xv, axis=1)
            b_dt = _cast(acc_b, dt, INTERPRET)  # the projections' outputs in the model dtype
            a_dt = _cast(acc_a, dt, INTERPRET)
            if STORE:
                tl.store(ba_out + d * 2 * HV + heads, b_dt, mask=r_ok)
                tl.store(ba_out + d * 2 * HV + HV + heads, a_dt, mask=r_ok)
            return b_dt.to(tl.float32), a_dt.to(tl.float32)
        bb = tl.load(b + d * s_bd + heads, mask=r_ok, other=0.0).to(tl.float32)
        u = tl.load(a + d * s_ad + heads, mask=r_ok, other=0.0).to(tl.float32)
        return bb, u

    @triton.jit
    def _gdn_prep_kernel(qkv, pool, rows, w, b, a, a_log, dt_bias, q_out, k_out, v_out, beta_out, g_out, ba_out,
                         C, HK, HV, H, s_qd, s_pr, s_pc, s_wc, s_bd, s_ad, q_scale,
                         DK: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, KM1: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
                         BA: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
                         BA_FIRST: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                         PREFETCH: tl.constexpr = False, SPLIT_V: tl.constexpr = False, EARLY: tl.constexpr = False):
        # BA (`gdn_decode_prep_ba`): `b` is the layer input x [D, H] (row stride s_bd) and `a` the concatenated
        # [in_proj_b; in_proj_a] weight [2 HV, H] (row stride s_ad); the program computes its value heads' b and a
        # itself (fp32 dot products, rounded to the model dtype as F.linear's output is) and writes them to ba_out
        # [D, 2 HV]. Otherwise `b`, `a` are the projections' outputs [D, HV] (row strides s_bd, s_ad).
        # BA_FIRST: those gate inputs first, so that their loads are in flight beside the conv window's (they read
        # neither the pool nor what this program writes) rather than after the barrier; the same operations.
        # In place: this program is the only reader and writer of its channels of pool row `row` (channel sets of
        # the HK programs of a row are disjoint; rows of distinct sequences are distinct -- CUDA-graph padding rows
        # share the scratch row, whose contents then do not matter). All reads of the row come first, then a
        # barrier (warps of a small tile hold replicated elements: one warp's store must not overtake another's
        # load), then the stores.
        # PREFETCH (kernels/pdl.py, with PDL; BA only): the program's w_ba rows (b and a of its value heads) into L2
        # before the wait.
        # SPLIT_V (grid (D, HK, 1 + R)): the k-head's work over 1 + R programs -- part 0 its q / k channels (conv,
        # norms, the q / k rows of all R value heads), part 1 + i value head j R + i alone (its v channels and gates).
        # Each program reads and writes only its own channels, so the in-place rule above holds per program; every
        # sum is the one the unsplit program computes (the same bits), in 3x the programs.
        # EARLY (with PDL; `pdl.early_options`): before the wait, everything the predecessor (the in_proj GEMM, whose
        # output is qkv) does not write -- the row, the gates' parameters, the conv windows' pool taps and weights and,
        # BA, the b / a dot products over the layer input x (the in_proj's input, so complete before that GEMM
        # passed its own wait, which precedes this launch) -- so that only qkv's loads, the conv sums, the norms and
        # the stores follow it. No store before the wait (ba_out's follows it). The same operations (`_conv_of`).
        d, j = tl.program_id(0), tl.program_id(1)
        part = tl.program_id(2) if SPLIT_V else 0
        if PREFETCH and BA:  # rows j R .. j R + R - 1 of each half, contiguous (the launch checks s_ad == H)
            nbytes = R * H * (a.dtype.element_ty.primitive_bitwidth // 8)
            prefetch_l2_once(a + (j * R).to(tl.int64) * s_ad, nbytes)
            prefetch_l2_once(a + (HV + j * R).to(tl.int64) * s_ad, nbytes)
        if not EARLY:
            pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        row = tl.load(rows + d)
        dt = qkv.dtype.element_ty
        ri = tl.arange(0, BLOCK_R)
        if SPLIT_V:  # part 0: the R heads' q / k rows only; part 1 + i: head j R + i alone
            r_ok = ri < tl.where(part == 0, R, 1)
            heads = j * R + tl.maximum(part - 1, 0) + ri
        else:
            r_ok = ri < R
            heads = j * R + ri  # the value heads this k-head serves
        do_qk = part == 0
        do_v = (part > 0) | (not SPLIT_V)
        # the gates' per-head parameters now: after the conv windows' norms (CTA barriers, which later loads do not
        # cross) each would be one more L2 round trip on the kernel's chain
        dt_b = tl.load(dt_bias + heads, mask=r_ok, other=0.0).to(tl.float32)
        a_lg = tl.load(a_log + heads, mask=r_ok, other=0.0).to(tl.float32)
        g_ok = r_ok & do_v  # the heads whose v channels and gates this program computes
        if BA_FIRST and not EARLY:
            bb, u = _gate_inputs(b, a, ba_out, d, heads, g_ok, HV, H, s_bd, s_ad, dt, BA, BLOCK_R, BLOCK_H,
                                 INTERPRET, True)
        kk = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]: 2-D like the value channels
        k_ok = (kk < DK) & do_qk
        key_dim = HK * DK
        q_ch, k_ch = j * DK + kk, key_dim + j * DK + kk
        if EARLY:
            vv = tl.arange(0, BLOCK_V)
            v_ok = g_ok[:, None] & (vv < DV)[None, :]
            v_ch = 2 * key_dim + heads[:, None] * DV + vv[None, :]
            if BA:  # x . w_ba now, stored after the wait
                bb, u = _gate_inputs(b, a, ba_out, d, heads, g_ok, HV, H, s_bd, s_ad, dt, BA, BLOCK_R, BLOCK_H,
                                     INTERPRET, False)
            q_taps, q_w = _conv_taps(pool, w, row, q_ch, k_ok, s_pr, s_pc, s_wc, KM1, BLOCK_T)
            k_taps, k_w = _conv_taps(pool, w, row, k_ch, k_ok, s_pr, s_pc, s_wc, KM1, BLOCK_T)
            v_taps, v_w = _conv_taps(pool, w, row, v_ch, v_ok, s_pr, s_pc, s_wc, KM1, BLOCK_T)
            pdl_enter(USE_PDL)  # now qkv (the predecessor's output), then every store
            if BA:
                tl.store(ba_out + d * 2 * HV + heads, bb.to(dt), mask=g_ok)  # (bb, u: model-dtype values, exact)
                tl.store(ba_out + d * 2 * HV + HV + heads, u.to(dt), mask=g_ok)
            qf, q_win = _conv_of(qkv, d, q_ch, k_ok, q_taps, q_w, s_qd, KM1, BLOCK_T, dt, INTERPRET)
            kf, k_win = _conv_of(qkv, d, k_ch, k_ok, k_taps, k_w, s_qd, KM1, BLOCK_T, dt, INTERPRET)
        else:
            qf, q_win = _conv_window(qkv, pool, w, d, row, q_ch, k_ok, s_qd, s_pr, s_pc, s_wc, KM1, BLOCK_T, dt,
                                     INTERPRET)
            kf, k_win = _conv_window(qkv, pool, w, d, row, k_ch, k_ok, s_qd, s_pr, s_pc, s_wc, KM1, BLOCK_T, dt,
                                     INTERPRET)
        qn = qf * (1.0 / tl.sqrt(tl.sum(qf * qf, axis=1) + 1e-6))[:, None] * q_scale  # [1, BK]
        kn = kf * (1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) + 1e-6))[:, None]
        if EARLY:
            vf, v_win = _conv_of(qkv, d, v_ch, v_ok, v_taps, v_w, s_qd, KM1, BLOCK_T, dt, INTERPRET)
        else:
            vv = tl.arange(0, BLOCK_V)
            v_ok = g_ok[:, None] & (vv < DV)[None, :]
            v_ch = 2 * key_dim + heads[:, None] * DV + vv[None, :]
            vf, v_win = _conv_window(qkv, pool, w, d, row, v_ch, v_ok, s_qd, s_pr, s_pc, s_wc, KM1, BLOCK_T, dt,
                                     INTERPRET)
        tl.debug_barrier()
        _store_shifted(pool, row, q_ch, k_ok, q_win, s_pr, s_pc, KM1, BLOCK_T)
        _store_shifted(pool, row, k_ch, k_ok, k_win, s_pr, s_pc, KM1, BLOCK_T)
        _store_shifted(pool, row, v_ch, v_ok, v_win, s_pr, s_pc, KM1, BLOCK_T)
        qk_off = (d * HV + heads)[:, None] * DK + kk
        qk_ok = r_ok[:, None] & k_ok
        tl.store(q_out + qk_off, tl.broadcast_to(qn, (BLOCK_R, BLOCK_K)), mask=qk_ok)
        tl.store(k_out + qk_off, tl.broadcast_to(kn, (BLOCK_R, BLOCK_K)), mask=qk_ok)
        tl.store(v_out + (d * HV + heads)[:, None] * DV + vv[None, :], vf, mask=v_ok)
        # gates of the value heads
        if not ((BA_FIRST and not EARLY) or (EARLY and BA)):  # (EARLY without BA: b and a may be the
            #                                                     predecessor's outputs: after the wait)
            bb, u = _gate_inputs(b, a, ba_out, d, heads, g_ok, HV, H, s_bd, s_ad, dt, BA, BLOCK_R, BLOCK_H,
                                 INTERPRET, True)
        beta = _cast(1.0 / (1.0 + tl.exp(-bb)), dt, INTERPRET).to(tl.float32)  # sigmoid in the model dtype
        u = u + dt_b
        # softplus = max(u, 0) + log1p(exp(-|u|)); log1p(t) for t in (0, 1] as 2 atanh(s), s = t / (2 + t) <= 1/3:
        # 2 s (1 + s^2/3 + ... + s^14/15), truncation < 2e-9 relative (log(1 + t) would lose bits for small t)
        t = tl.exp(-tl.abs(u))
        sv = t / (2.0 + t)
        s2 = sv * sv
        series = 1.0 + s2 * (1.0 / 3 + s2 * (1.0 / 5 + s2 * (1.0 / 7 + s2 * (1.0 / 9 + s2 * (1.0 / 11 + s2 * (
            1.0 / 13 + s2 * (1.0 / 15)))))))
        softplus = tl.where(u > 20.0, u, tl.maximum(u, 0.0) + 2.0 * sv * series)  # torch's threshold 20
        g = -tl.exp(a_lg) * softplus
        tl.store(beta_out + d * HV + heads, beta, mask=g_ok)
        tl.store(g_out + d * HV + heads, g, mask=g_ok)


def split_v(rows: int) -> bool:
    """Whether a call of `rows` decode rows launches split (SPLIT_V_ROWS)."""
    return 0 < rows <= SPLIT_V_ROWS


def _interpreted() -> bool:
    return triton is not None and type(_gdn_prep_kernel).__name__ == "InterpretedFunction"


def _launch(qkv_in, conv_pool, rows, conv_w, b, a, a_log, dt_bias, hv: int, num_k_heads: int, head_k_dim: int,
            head_v_dim: int, ba: bool):
    """(q, k, v, beta, g, ba_out); `b`, `a`: the projections' outputs [D, Hv] or (ba) x [D, H] and w_ba [2 Hv, H]."""
    d, c = qkv_in.shape
    km1 = conv_pool.shape[-1]
    dev = qkv_in.device
    q = torch.empty((d, hv, head_k_dim), dtype=torch.float32, device=dev)
    k = torch.empty_like(q)
    v = torch.empty((d, hv, head_v_dim), dtype=torch.float32, device=dev)
    beta = torch.empty((d, hv), dtype=torch.float32, device=dev)
    g = torch.empty_like(beta)
    ba_out = torch.empty((d, 2 * hv) if ba else (0, 2 * hv), dtype=qkv_in.dtype, device=dev)
    if d == 0:
        return q, k, v, beta, g, ba_out
    r = hv // num_k_heads
    hidden = b.shape[-1] if ba else 0
    split = split_v(d)
    _gdn_prep_kernel[(d, num_k_heads, 1 + r if split else 1)](
        qkv_in, conv_pool, rows, conv_w, b, a, a_log, dt_bias, q, k, v, beta, g, ba_out,
        c, num_k_heads, hv, hidden, qkv_in.stride(0), conv_pool.stride(0), conv_pool.stride(1), conv_w.stride(0),
        b.stride(0), a.stride(0), head_k_dim ** -0.5,
        DK=head_k_dim, DV=head_v_dim, R=r, KM1=km1, BLOCK_K=triton.next_power_of_2(head_k_dim),
        BLOCK_V=triton.next_power_of_2(head_v_dim), BLOCK_R=triton.next_power_of_2(r),
        BLOCK_T=triton.next_power_of_2(km1 + 1), BA=ba, BLOCK_H=BA_BLOCK_H, INTERPRET=_interpreted(),
        BA_FIRST=BA_FIRST, SPLIT_V=split, num_warps=NUM_WARPS, **pdl.launch_options(),
        # early loads (the engine's `early_loads`): the launch's predecessor writes qkv_in (and, without ba, b / a)
        # only -- the engine's in_proj GEMM (and the b / a GEMM)
        **pdl.early_options(),
        **(pdl.prefetch_options(a.stride(0) == hidden and pdl.aligned16(a.data_ptr(), hidden * a.element_size()))
           if ba else {}))
    return q, k, v, beta, g, ba_out


# The launch's tiling (module variables: benchmarks/gdn_prep_bench.py times the alternatives). H200,
# results/gdn_prep_bench_run2 (30 layers' calls graphed, PDL), us per call at 1 / 32 rows: b / a in steps of 512 5.33
# / 9.48, of 2,048 4.12 / 8.01 (q / k / v and the pool the same bits); b / a first 4.15 / 8.17; 8 warps 3.68 / 7.97
# but q / k differ by ulps (their reductions retiled). Qwen run 51, the engine: lone decode 412.5 / 413.6 -> 424.3
# tok/s with steps of 2,048 (b / a sum in another fp32 order: 8 of 32 streams' greedy tokens diverge after 7-44)
BA_BLOCK_H = 2048  # hidden elements per step of gdn_decode_prep_ba's b / a dot products (Qwen3.6: all 2,048 in one;
#                   the engine sets it from QwenEngineConfig.gdn_prep_ba_step, 512 the previous default)
BA_FIRST = False  # the b / a dot products (or loads) before the conv windows instead of after the pool's barrier
# Each k-head's work over 1 + R programs instead of one (the kernel's SPLIT_V: its q / k channels, then each value head
# alone; the same bits) for calls of at most SPLIT_V_ROWS rows: 48 programs a Qwen3.6 decode row instead of 16, each
# with a third of the loads and sums. It pays while the split grid fits one wave: H200 (132 SMs), variants run 1 /
# gdn_prep_bench, us per call at 1 row 4.11 -> 3.70, at 32 rows 8.12 -> 15.02; the engine's lone decode 476.4 / 476.6
# -> 486.5 tok/s, 32 streams 3,453.7 / 3,457.0 -> 3,368.1 (the same greedy tokens). 0: never split. The engine sets it
# from QwenEngineConfig.gdn_prep_split_v_rows
SPLIT_V_ROWS = 0
NUM_WARPS = 4
DEFAULT_TILING = (BA_FIRST, BA_BLOCK_H, NUM_WARPS)  # what a benchmark that changes the three restores


@torch.library.custom_op("qwen::gdn_decode_prep_", mutates_args=("conv_pool",))
def gdn_decode_prep_(qkv_in: torch.Tensor, conv_pool: torch.Tensor, rows: torch.Tensor, conv_w: torch.Tensor,
                     b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, num_k_heads: int,
                     head_k_dim: int, head_v_dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, beta, g); advances conv_pool[rows] in place. Guards: `supports` (checked by the registry)."""
    return _launch(qkv_in, conv_pool, rows, conv_w, b, a, a_log, dt_bias, b.shape[-1], num_k_heads, head_k_dim,
                   head_v_dim, ba=False)[:5]


def _fake_outputs(qkv_in, hv, head_k_dim, head_v_dim):
    d = qkv_in.shape[0]
    q = qkv_in.new_empty((d, hv, head_k_dim), dtype=torch.float32)
    return (q, torch.empty_like(q), qkv_in.new_empty((d, hv, head_v_dim), dtype=torch.float32),
            qkv_in.new_empty((d, hv), dtype=torch.float32), qkv_in.new_empty((d, hv), dtype=torch.float32))


@gdn_decode_prep_.register_fake
def _(qkv_in, conv_pool, rows, conv_w, b, a, a_log, dt_bias, num_k_heads, head_k_dim, head_v_dim):
    return _fake_outputs(qkv_in, b.shape[-1], head_k_dim, head_v_dim)


@torch.library.custom_op("qwen::gdn_decode_prep_ba_", mutates_args=("conv_pool",))
def gdn_decode_prep_ba_(qkv_in: torch.Tensor, conv_pool: torch.Tensor, rows: torch.Tensor, conv_w: torch.Tensor,
                        x: torch.Tensor, w_ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                        num_k_heads: int, head_k_dim: int, head_v_dim: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, beta, g, ba [D, 2 Hv]); advances conv_pool[rows] in place. Guards: `supports_ba`."""
    return _launch(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, w_ba.shape[0] // 2, num_k_heads,
                   head_k_dim, head_v_dim, ba=True)


@gdn_decode_prep_ba_.register_fake
def _(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, num_k_heads, head_k_dim, head_v_dim):
    hv = w_ba.shape[0] // 2
    return (*_fake_outputs(qkv_in, hv, head_k_dim, head_v_dim), qkv_in.new_empty((qkv_in.shape[0], 2 * hv)))


def gdn_decode_prep_triton(qkv_in, conv_pool, rows, conv_w, b, a, a_log, dt_bias, num_k_heads, head_k_dim,
                           head_v_dim):
    """Same contract as `gdn_decode_prep_reference`."""
    return (*gdn_decode_prep_(qkv_in, conv_pool, rows, conv_w, b, a, a_log, dt_bias, num_k_heads, head_k_dim,
                              head_v_dim), conv_pool)


def _ba_by_gemm(prep, qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, num_k_heads, head_k_dim, head_v_dim):
    """b, a = the two halves of F.linear(x, w_ba) (the model's `_project_ba`), then `prep` (the plain op's reference
    or kernel) on them -> (q, k, v, beta, g, ba [D, 2 Hv] in the model dtype, conv_pool)."""
    hv = w_ba.shape[0] // 2
    ba = F.linear(x, w_ba)
    out = prep(qkv_in, conv_pool, rows, conv_w, ba[:, :hv], ba[:, hv:], a_log, dt_bias, num_k_heads, head_k_dim,
               head_v_dim)
    return (*out[:5], ba, out[5])


def gdn_decode_prep_ba_reference(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, num_k_heads: int,
                                 head_k_dim: int, head_v_dim: int):
    """`gdn_decode_prep_reference` after the b / a GEMM: x [D, H] (model dtype), w_ba = cat(in_proj_b.weight,
    in_proj_a.weight) [2 Hv, H] -> (q, k, v, beta, g, ba [D, 2 Hv] in the model dtype, conv_pool)."""
    return _ba_by_gemm(gdn_decode_prep_reference, qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias,
                       num_k_heads, head_k_dim, head_v_dim)


def gdn_decode_prep_ba_gemm_triton(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, num_k_heads,
                                   head_k_dim, head_v_dim):
    """The fallback after `gdn_decode_prep_ba_triton`: b / a by their GEMM (F.linear, as the reference), then the
    plain prep kernel (the engine's path before b / a moved inside; should the fused one fail its self-check on a
    GPU, the engine keeps this speed instead of the torch reference's ~35 launches per layer)."""
    return _ba_by_gemm(gdn_decode_prep_triton, qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias,
                       num_k_heads, head_k_dim, head_v_dim)


def gdn_decode_prep_ba_triton(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, num_k_heads, head_k_dim,
                              head_v_dim):
    """Same contract as `gdn_decode_prep_ba_reference`."""
    return (*gdn_decode_prep_ba_(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, num_k_heads, head_k_dim,
                                 head_v_dim), conv_pool)


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(qkv_in, conv_pool, rows, conv_w, b, a, a_log, dt_bias, num_k_heads, head_k_dim, head_v_dim
             ) -> dict[str, Any]:
    d, c = qkv_in.shape if qkv_in.dim() == 2 else (0, 0)
    hv = b.shape[-1] if b.dim() == 2 else 0
    shapes_ok = (qkv_in.dim() == 2 and conv_pool.dim() == 3 and conv_pool.shape[1] == c and rows.shape == (d,)
                 and conv_w.shape == (c, conv_pool.shape[-1] + 1) and b.shape == a.shape == (d, hv)
                 and a_log.shape == dt_bias.shape == (hv,) and num_k_heads > 0 and hv % num_k_heads == 0
                 and c == 2 * num_k_heads * head_k_dim + hv * head_v_dim)
    return dict(device=qkv_in.device.type, capability=(torch.cuda.get_device_capability(qkv_in.device)
                                                        if qkv_in.is_cuda else None),
                dtypes={qkv_in.dtype, conv_pool.dtype, conv_w.dtype, b.dtype, a.dtype}, shapes_ok=shapes_ok,
                head_dims=(head_k_dim, head_v_dim), rows_dtype=rows.dtype,
                unit_strides=all(t.stride(-1) == 1 for t in (qkv_in, conv_pool, conv_w, b, a) if t.dim()))


def supports(*, device: str, capability, dtypes: set, shapes_ok: bool, head_dims: tuple, rows_dtype, unit_strides,
             **_: Any) -> bool:
    """Triton able to run on `device` (cuda >= sm_80, or the interpreter on CPU); one model dtype for every
    activation / state / weight input; consistent shapes; head dims <= 256; int64 or int32 rows; unit inner strides."""
    if triton is None:
        return False
    return (triton_device_ok(device, capability, _interpreted()) and len(dtypes) == 1 and next(iter(dtypes)) in DTYPES
            and shapes_ok and unit_strides and rows_dtype in (torch.int64, torch.int32)
            and all(1 <= h <= 256 for h in head_dims))


def compare(out, ref, tol: float | None = None) -> str | None:
    """Every output within tol x max |ref| (1e-2 when the model dtype is bf16/fp16, 1e-5 for fp32; see module); the
    decay g, computed in fp32 from the inputs alone, within 1e-5 elementwise (relative) in every dtype; the conv
    pool (written rows: exact copies of inputs; the rest untouched) bit for bit."""
    names = ("q", "k", "v", "beta", "g")
    if tol is None:
        tol = 1e-5 if ref[-1].dtype == torch.float32 else 1e-2
    if out[5].shape != ref[5].shape or out[5].dtype != ref[5].dtype or not torch.equal(out[5], ref[5]):
        return "conv_pool: not bit-identical to the reference's"
    g, g_ref = out[4], ref[4]
    if g.shape == g_ref.shape and g.numel():
        worst = float(((g - g_ref).abs() / g_ref.abs().clamp_min(1e-30)).max())
        if worst > 1e-5:
            return f"g: max relative error {worst:.3g} > 1e-5"
    for name, x, y in zip(names, out, ref):
        problem = tolerance.compare(x, y, tol)  # (also fails on NaN)
        if problem:
            return f"{name}: {problem}"
    return None


def random_inputs(d: int, num_k_heads: int, head_k_dim: int, r: int, head_v_dim: int, kernel: int = 4,
                  slots: int | None = None, dtype=torch.bfloat16, seed: int = 0, device="cpu"):
    """Model-like decode-prep inputs: rows are a permutation of state slots (positional args of the op)."""
    gen = torch.Generator().manual_seed(seed)
    hv = num_k_heads * r
    c = 2 * num_k_heads * head_k_dim + hv * head_v_dim
    slots = slots or d + 2
    qkv_in = torch.randn(d, c, generator=gen)
    pool = torch.randn(slots, c, kernel - 1, generator=gen)
    rows = torch.randperm(slots, generator=gen)[:d]
    conv_w = torch.randn(c, kernel, generator=gen) * 0.5
    b, a = torch.randn(d, hv, generator=gen), torch.randn(d, hv, generator=gen) * 3
    a_log = torch.empty(hv).uniform_(0.05, 3.0, generator=gen).log()
    dt_bias = torch.randn(hv, generator=gen) * 0.5
    acts = tuple(t.to(dtype).to(device) for t in (qkv_in, pool))
    return (*acts, rows.to(device), *(t.to(dtype).to(device) for t in (conv_w, b, a, a_log, dt_bias)), num_k_heads,
            head_k_dim, head_v_dim)


def _sample(device) -> tuple[tuple, dict]:
    return random_inputs(3, 2, 32, 2, 16, device=device), {}


# ---- gdn_decode_prep_ba: the same with the b / a projections inside (x and their concatenated weight in) ----------
# Why: the model's `_project_ba` is one bf16 cuBLAS GEMM per GDN layer, [D, 2,048] x [2,048, 64]: ~5 us per launch,
# 30 per decode step (H200 profile run 16: 0.153 ms of a lone request's 2.97 ms step). Each program here reads its
# r value heads' 2 r weight rows (r = 2: 16 KB) and the row of x (4 KB) and does the dot products on CUDA cores.
NAME_BA = "gdn_decode_prep_ba"


def describe_ba(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, num_k_heads, head_k_dim, head_v_dim
                ) -> dict[str, Any]:
    hv = w_ba.shape[0] // 2 if w_ba.dim() == 2 else 0
    d = qkv_in.shape[0] if qkv_in.dim() == 2 else -1
    ba_ok = (x.dim() == 2 and w_ba.dim() == 2 and x.shape[0] == d and w_ba.shape == (2 * hv, x.shape[1])
             and x.shape[1] > 0)
    fake_b = qkv_in.new_empty((max(d, 0), hv), device="meta")  # the gates' shapes as the plain op sees them
    out = describe(qkv_in, conv_pool, rows, conv_w, fake_b, fake_b, a_log, dt_bias, num_k_heads, head_k_dim,
                   head_v_dim)
    out["shapes_ok"] = out["shapes_ok"] and ba_ok
    out["dtypes"] = out["dtypes"] | {x.dtype, w_ba.dtype}
    out["unit_strides"] = out["unit_strides"] and all(t.stride(-1) == 1 for t in (x, w_ba) if t.dim())
    return out


def compare_ba(out, ref, tol: float | None = None) -> str | None:
    """ba (the kernel's own projections, model dtype) within tol x max |ref| (1e-2 bf16/fp16: one ulp of a rounded
    dot product whose fp32 sum ran in another order; 1e-5 fp32). The decay g: within 1e-5 relative where the
    kernel's a equals the reference's, and where it does not, |log(g / g_ref)| <= |a - a_ref| + 1e-5 -- the exact
    reach of a different input, since g = -exp(A_log) softplus(a + dt_bias) and d log softplus(u) / du =
    sigmoid(u) / softplus(u) <= 1 (log(1 + t) >= t / (1 + t)); one bf16 ulp of a moves g by up to ~6% at |u| = 10.
    Then everything else `compare` checks (q, k, v, beta -- one ulp of b moves sigmoid by less than 1e-2 --, the
    conv pool bit for bit)."""
    if tol is None:
        tol = 1e-5 if ref[-1].dtype == torch.float32 else 1e-2
    ba, ba_ref = out[5], ref[5]
    if ba.shape != ba_ref.shape or ba.dtype != ba_ref.dtype:
        return f"ba: {tuple(ba.shape)} {ba.dtype}, expected {tuple(ba_ref.shape)} {ba_ref.dtype}"
    hv = ba.shape[-1] // 2
    for name, part in (("b", slice(0, hv)), ("a", slice(hv, None))):  # each against its own scale (a ~ 3x b)
        problem = tolerance.compare(ba[:, part], ba_ref[:, part], tol)
        if problem:
            return f"ba ({name}): {problem}"
    g, g_ref = out[4], ref[4]
    if g.shape != g_ref.shape:
        return f"g: shape {tuple(g.shape)}, expected {tuple(g_ref.shape)}"
    if g.numel():
        da = (ba[:, hv:].float() - ba_ref[:, hv:].float()).abs()
        reach = torch.where(da == 0, torch.full_like(da, 1e-5), da + 1e-5)
        log_ratio = (g.double() / g_ref.double()).log().abs()  # g, g_ref < 0; both 0 (softplus underflow): equal
        log_ratio = torch.where((g == 0) & (g_ref == 0), torch.zeros_like(log_ratio), log_ratio)
        worst = float((log_ratio - reach).max())
        if not worst <= 0:  # (also fails on NaN)
            return f"g: |log(g / g_ref)| exceeds its bound by {worst:.3g}"
    return compare((*out[:4], g_ref, out[6]), (*ref[:5], ref[6]), tol)


def random_inputs_ba(d: int, num_k_heads: int, head_k_dim: int, r: int, head_v_dim: int, hidden: int = 96,
                     kernel: int = 4, slots: int | None = None, dtype=torch.bfloat16, seed: int = 0, device="cpu"):
    """`random_inputs` with x [D, hidden] and w_ba [2 Hv, hidden] in place of b, a (b ~ N(0, 1), a ~ N(0, 9) as
    there); `hidden` need not be a multiple of BA_BLOCK_H (masked tail)."""
    args = random_inputs(d, num_k_heads, head_k_dim, r, head_v_dim, kernel, slots, dtype, seed, device)
    gen = torch.Generator().manual_seed(seed + 1)
    hv = num_k_heads * r
    x = torch.randn(d, hidden, generator=gen)
    w_ba = torch.randn(2 * hv, hidden, generator=gen) * hidden ** -0.5
    w_ba[hv:] *= 3
    return (*args[:4], x.to(dtype).to(device), w_ba.to(dtype).to(device), *args[6:])


def _sample_ba(device) -> tuple[tuple, dict]:
    return random_inputs_ba(3, 2, 32, 2, 16, hidden=600, device=device), {}


def register(registry) -> None:
    registry.add_op(NAME, gdn_decode_prep_reference, sample=_sample, compare=compare, describe=describe,
                    mutates=True,
                    tolerance="each output within 1e-2 x max |ref| for bf16/fp16 (one model-dtype ulp of a rounded "
                              "conv / SiLU output carried through the L2 norm), 1e-5 for fp32; the conv pool bit "
                              "for bit")
    registry.add_implementation(NAME, "triton", gdn_decode_prep_triton, supports)
    registry.add_op(NAME_BA, gdn_decode_prep_ba_reference, sample=_sample_ba, compare=compare_ba,
                    describe=describe_ba, mutates=True,
                    tolerance="as gdn_decode_prep, plus ba (b / a) within 1e-2 x max |ref| for bf16/fp16 (1e-5 fp32) "
                              "and the decay g within the reach of the kernel's own a: |log(g / g_ref)| <= |a - a_ref| "
                              "+ 1e-5")
    registry.add_implementation(NAME_BA, "triton", gdn_decode_prep_ba_triton, supports)
    registry.add_implementation(NAME_BA, "gemm+triton", gdn_decode_prep_ba_gemm_triton, supports)
