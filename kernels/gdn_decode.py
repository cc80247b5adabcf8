"""Gated DeltaNet single-token decode step in Triton: the fp32 recurrent state update and readout of one token.

Reference: `qwen_engine.model.gdn.gated_delta_step` (the recurrence of transformers' `torch_recurrent_gated_delta_rule`
for one token). Per (batch b, value head h), with S = state[b, h] of shape [Dk, Dv]:
    S <- exp(g) S;   delta = beta (v - S^T k);   S <- S + k delta^T;   o = S^T q
q, k [B, H, Dk] (already L2-normalised, q scaled, and repeated to the H value heads, as the model passes them);
v [B, H, Dv]; g (log decay, <= 0), beta [B, H]; all fp32.

One program owns a [Dk, BLOCK_V] slice of one head's state: it reads it once, keeps it in registers for the decay,
the k-readout, the rank-1 update and the q-readout, and writes it once -- the minimum traffic. The reference makes
~5 passes over the state (decay, einsum, outer-product add, einsum, plus the model's copy back).

Numerics: the same fp32 operations; the two reductions over Dk are summed in another order than torch's einsum and
exp may differ by an ulp, so results agree to ~1e-6 relative (tests: 1e-5 of max |ref| on o and the new state).

Napkin math (Qwen3.6-35B-A3B: 30 GDN layers x 32 value heads x 128 x 128 fp32 = 2.1 MB of state per layer and
sequence): read + write 4.2 MB -> 0.87 us per layer at 4.8 TB/s, 26 us per decoded token for all 30 layers (q, k, v
are 48 KB). Linear in batch: at 32 streams the state moves 4.0 GB per step (840 us), more than all the weights
(2.25 GB), so this kernel's bandwidth sets the batched decode rate. Grid: B x H x (Dv / BLOCK_V) programs of a
[128, BLOCK_V] fp32 tile (16 KB at BLOCK_V = 32): 128 programs at batch 1, enough for 132 SMs.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import pdl, tolerance

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
    from kernels.rms_norm import _cast, _static_scale, _store_out, gated_rows
    from kernels.split_k import last_arrival, rearm
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "gdn_decode"
ROWS_NAME = "gdn_decode_rows"  # the engine's in-place form over the state pool
ROWS_NORM_NAME = "gdn_decode_rows_norm_fp8"  # that, with the output's gated RMS norm + FP8 codes in the same launch
MAX_HEAD_DIM = 256  # a [Dk, BLOCK_V] fp32 tile in registers; the model has 128


def gdn_decode_reference(q, k, v, g, beta, state):
    """(o [B, H, Dv], new state [B, H, Dk, Dv]); `state` is not modified."""
    from qwen_engine.model.gdn import gated_delta_step

    return gated_delta_step(q, k, v, g, beta, state)


if triton is not None:

    @triton.jit
    def _state_slot(rows, pid, H, HAS_ROWS: tl.constexpr):
        """The state row of program pid's batch row b = pid // H: rows[b] of a pool, else b."""
        b = pid // H
        return tl.load(rows + b) if HAS_ROWS else b.to(tl.int64)

    @triton.jit
    def _state_tile(s_in, slot, pid, pv, H, DK, DV, s_sb, s_sh, s_sk, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        """Program (pid = b H + h, pv): its [Dk, BLOCK_V] slice pv of head h's state in row `slot` as stored (fp32
        or bf16), with the slice's offsets and mask -> (s, off, ok). Reads only the state."""
        h = pid % H
        kk = tl.arange(0, BLOCK_K)
        vv = pv * BLOCK_V + tl.arange(0, BLOCK_V)
        off = slot * s_sb + h * s_sh + kk[:, None] * s_sk + vv[None, :]
        ok = (kk < DK)[:, None] & (vv < DV)[None, :]
        return tl.load(s_in + off, mask=ok, other=0.0), off, ok

    @triton.jit
    def _step_inputs(q, k, v, g, beta, pid, pv, H, DK, DV, s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_gb, s_bb,
                     BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        """The token's inputs of the program's slice: q, k [BLOCK_K], v [BLOCK_V], exp(g), beta (fp32)."""
        b, h = pid // H, pid % H
        kk = tl.arange(0, BLOCK_K)
        vv = pv * BLOCK_V + tl.arange(0, BLOCK_V)
        q_t = tl.load(q + b * s_qb + h * s_qh + kk, mask=kk < DK, other=0.0)
        k_t = tl.load(k + b * s_kb + h * s_kh + kk, mask=kk < DK, other=0.0)
        v_t = tl.load(v + b * s_vb + h * s_vh + vv, mask=vv < DV, other=0.0)
        return q_t, k_t, v_t, tl.exp(tl.load(g + b * s_gb + h)), tl.load(beta + b * s_bb + h)

    @triton.jit
    def _advance(q_t, k_t, v_t, decay, bt, s_raw, off, ok, s_out, o, pid, pv, H, DV, s_ob, s_oh,
                 BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr):
        """The slice `s_raw` (`_state_tile`'s) advanced one token and written once, and its slice of o = S^T q
        (fp32). A bf16 state (the engine's `gdn_state_dtype`) is widened as it is read and rounded to nearest even as
        it is stored; o comes from the unrounded fp32 state, as in `gated_delta_rows`."""
        b, h = pid // H, pid % H
        vv = pv * BLOCK_V + tl.arange(0, BLOCK_V)
        s = s_raw.to(tl.float32) * decay  # [BK, BV]
        delta = (v_t - tl.sum(s * k_t[:, None], axis=0)) * bt  # [BV]
        s = s + k_t[:, None] * delta[None, :]
        tl.store(s_out + off, _cast(s, s_out.dtype.element_ty, INTERPRET), mask=ok)
        tl.store(o + b * s_ob + h * s_oh + vv, tl.sum(s * q_t[:, None], axis=0), mask=vv < DV)

    @triton.jit
    def _gdn_decode_kernel(q, k, v, g, beta, s_in, s_out, o, rows, H, DK, DV,
                           s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_gb, s_bb, s_sb, s_sh, s_sk, s_ob, s_oh,
                           BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_ROWS: tl.constexpr,
                           USE_PDL: tl.constexpr = False, INTERPRET: tl.constexpr = False,
                           EARLY: tl.constexpr = False):
        # grid (B * H, cdiv(DV, BLOCK_V)); s_out may be s_in (in place): each element is read before it is written
        # by the same program, and programs own disjoint slices. State strides are shared by s_in and s_out
        # (s_out is contiguous like s_in, checked by the wrapper); the Dv stride is 1. HAS_ROWS: batch row b
        # owns state row rows[b] of a pool (int64 [B]), else row b.
        # EARLY (with PDL; `pdl.early_options`): the program's state slice (and its row of `rows`) is loaded BEFORE
        # the wait, so that the resident programs' state reads overlap the predecessor (the GDN prep) instead of
        # following it. The caller's contract: the launch's predecessor does not write the state or `rows` (in the
        # engine it is the prep, which writes q / k / v / g / beta; the state was last written by this layer's step
        # of the previous token, `rows` by the host before the graph). The same loads and arithmetic: the same bits.
        if not EARLY:
            pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        pid, pv = tl.program_id(0), tl.program_id(1)
        slot = _state_slot(rows, pid, H, HAS_ROWS)
        if EARLY:
            s_raw, off, ok = _state_tile(s_in, slot, pid, pv, H, DK, DV, s_sb, s_sh, s_sk, BLOCK_K, BLOCK_V)
            pdl_enter(USE_PDL)  # now the predecessor's outputs (q, k, v, g, beta), then the stores
            q_t, k_t, v_t, decay, bt = _step_inputs(q, k, v, g, beta, pid, pv, H, DK, DV, s_qb, s_qh, s_kb, s_kh,
                                                    s_vb, s_vh, s_gb, s_bb, BLOCK_K, BLOCK_V)
        else:  # the token's inputs before the state, as before EARLY existed
            q_t, k_t, v_t, decay, bt = _step_inputs(q, k, v, g, beta, pid, pv, H, DK, DV, s_qb, s_qh, s_kb, s_kh,
                                                    s_vb, s_vh, s_gb, s_bb, BLOCK_K, BLOCK_V)
            s_raw, off, ok = _state_tile(s_in, slot, pid, pv, H, DK, DV, s_sb, s_sh, s_sk, BLOCK_K, BLOCK_V)
        _advance(q_t, k_t, v_t, decay, bt, s_raw, off, ok, s_out, o, pid, pv, H, DV, s_ob, s_oh, BLOCK_V,
                 INTERPRET)

    @triton.jit
    def _gdn_decode_norm_kernel(q, k, v, g, beta, pool, o, rows, z, w, out, codes, s_in, counters, H, DK, DV, eps,
                                s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_gb, s_bb, s_sb, s_sh, s_sk, s_ob, s_oh,
                                s_zb, s_zh, s_nb, s_nh, s_cb, s_ch,
                                BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                                ROUND_PRODUCT: tl.constexpr, ROUND_X: tl.constexpr, INTERPRET: tl.constexpr,
                                QUANT: tl.constexpr, USE_PDL: tl.constexpr = False):
        # `_gdn_decode_kernel` over pool rows in place (o: the fp32 scratch [B, H, Dv] of the slices), then the head's
        # gated RMS norm: the program that finishes head (b, h) last of its cdiv(DV, BLOCK_V) (`split_k`'s arrival
        # counter, one per head: counters[b H + h]) reads the whole o row back through L2 and writes out [B, H, Dv]
        # (z's dtype) = `rms_norm.gated_rows`(o, z, w) and, QUANT, its e4m3 codes with the static scale s_in --
        # the operations of "rms_norm_gated_fp8" on the same row, in the launch that made it.
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        pid, pv = tl.program_id(0), tl.program_id(1)
        q_t, k_t, v_t, decay, bt = _step_inputs(q, k, v, g, beta, pid, pv, H, DK, DV, s_qb, s_qh, s_kb, s_kh, s_vb,
                                                s_vh, s_gb, s_bb, BLOCK_K, BLOCK_V)
        s_raw, off, s_ok = _state_tile(pool, _state_slot(rows, pid, H, True), pid, pv, H, DK, DV, s_sb, s_sh, s_sk,
                                       BLOCK_K, BLOCK_V)
        _advance(q_t, k_t, v_t, decay, bt, s_raw, off, s_ok, pool, o, pid, pv, H, DV, s_ob, s_oh, BLOCK_V,
                 INTERPRET)
        if last_arrival(counters, pid, tl.num_programs(1)):  # every slice of the head's o is stored and visible
            b, h = pid // H, pid % H
            one = tl.arange(0, 1)  # the head's row as a [1, BLOCK_D] tile, as the norm kernel's rows are
            dd = tl.arange(0, BLOCK_D)
            d_ok = dd < DV
            ok = d_ok[None, :]  # [1, BD]
            xf = tl.load(o + b * s_ob + h * s_oh + dd[None, :], mask=ok, other=0.0,
                         cache_modifier=".cg")  # L2: never a stale L1 line of another program's slice
            zf = tl.load(z + b * s_zb + h * s_zh + dd[None, :], mask=ok, other=0.0).to(tl.float32)
            wf = tl.load(w + dd, mask=d_ok, other=0.0).to(tl.float32)
            sc = _static_scale(s_in, QUANT)
            y = gated_rows(xf, zf, wf, DV, eps, out.dtype.element_ty, ROUND_PRODUCT, ROUND_X, INTERPRET)
            _store_out(out + b * s_nb + h * s_nh, codes + b * s_cb + h * s_ch, sc, one, dd, 0, 0, ok, y,
                       INTERPRET, QUANT)
            rearm(counters, pid)


def _interpreted() -> bool:
    return triton is not None and type(_gdn_decode_kernel).__name__ == "InterpretedFunction"


def _block_v(bh: int, dv: int) -> int:
    """Columns of the state per program: wide tiles when B x H alone gives >= ~264 programs (2 per H200 SM)."""
    for bv in (64, 32):
        if bh * triton.cdiv(dv, bv) >= 264:
            return min(bv, triton.next_power_of_2(dv))
    return min(16, triton.next_power_of_2(dv))


def _step_strides(q, k, v, g, beta, state, o) -> tuple[int, ...]:
    """The step's stride arguments, in the order both kernels take them (s_qb .. s_oh)."""
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            beta.stride(0), state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1))


def _launch(q, k, v, g, beta, state, out_state, rows=None, *, block_v: int | None = None, num_warps: int = 4,
            maxnreg: int | None = None, early: bool = False) -> torch.Tensor:
    """rows None: state [B, H, Dk, Dv]; else state is a pool [S, H, Dk, Dv] and batch row b uses pool row rows[b].
    block_v (default `_block_v`), num_warps, maxnreg (a register cap; None: ptxas' choice): the launch, for
    benchmarks/gdn_step_launch_bench.py's sweep. early: the kernel's EARLY (the state read before the PDL wait;
    its contract: the launch's predecessor writes neither the state nor `rows`), with PDL on only."""
    _, heads, dk, dv = state.shape
    bsz = q.shape[0]
    o = torch.empty((bsz, heads, dv), dtype=torch.float32, device=state.device)
    if o.numel() == 0:
        return o
    bv = block_v or _block_v(bsz * heads, dv)
    grid = (bsz * heads, triton.cdiv(dv, bv))
    _gdn_decode_kernel[grid](q, k, v, g, beta, state, out_state, o, state if rows is None else rows, heads, dk, dv,
                             *_step_strides(q, k, v, g, beta, state, o), BLOCK_K=triton.next_power_of_2(dk),
                             BLOCK_V=bv, HAS_ROWS=rows is not None, INTERPRET=_interpreted(),
                             num_warps=num_warps, **({} if maxnreg is None else dict(maxnreg=maxnreg)),
                             **pdl.launch_options(), **(pdl.early_options() if early else {}))
    return o


def _check_inner_strides(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.stride(-1) != 1:
            raise ValueError(f"gdn_decode needs unit stride in the last dimension, got strides {t.stride()}")


@torch.library.custom_op("qwen::gdn_decode_", mutates_args=("state",))
def gdn_decode_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> torch.Tensor:
    """In place: advances `state` [B, H, Dk, Dv] (contiguous) by one token and returns o [B, H, Dv]. The model's
    hot path (no state copy: `GatedDeltaNet` can drop its `state.recurrent.copy_(s)` for this op)."""
    _check_inner_strides(q, k, v, g, beta)
    if not state.is_contiguous():
        raise ValueError("gdn_decode_ updates the state in place and needs it contiguous")
    return _launch(q, k, v, g, beta, state, state)


@gdn_decode_.register_fake
def _(q, k, v, g, beta, state):
    return state.new_empty(state.shape[:2] + state.shape[3:])


@torch.library.custom_op("qwen::gdn_decode", mutates_args=())
def gdn_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place, the reference's contract: (o, new state); `state` is left as it was."""
    _check_inner_strides(q, k, v, g, beta)
    state = state.contiguous()
    new = torch.empty_like(state)
    return _launch(q, k, v, g, beta, state, new), new


@gdn_decode_op.register_fake
def _(q, k, v, g, beta, state):
    return state.new_empty(state.shape[:2] + state.shape[3:]), torch.empty_like(state)


def gdn_decode_triton(q, k, v, g, beta, state):
    """Same contract as `gdn_decode_reference`."""
    return gdn_decode_op(q, k, v, g, beta, state)


# ---- the engine's form: rows of a state pool, advanced in place ------------------------------------------------------
# The engine keeps every sequence's state in one pool [S, H, Dk, Dv] (`GDNSlots.recurrent`). With the out-of-place op
# a decode step gathers the batch's rows (a copy), runs the step and scatters the new rows back (index_copy_): three
# passes over B x 2 MB per layer and two extra launches. The rows form reads and writes each row once, in place.
def gdn_decode_rows_reference(q, k, v, g, beta, pool, rows):
    """q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; pool [S, H, Dk, Dv] fp32; rows int64 [B] (distinct, except
    that padding rows may share one scratch row, whose contents are then unspecified) -> (o [B, H, Dv], pool),
    pool advanced in place at `rows`. Precondition 0 <= rows < S: the reference raises on a bad row, the kernel
    (which cannot check without a host sync) would write outside the pool; the runner's rows come from the
    scheduler's slot allocator (and the scratch slot)."""
    from qwen_engine.model.gdn import gated_delta_rows

    return gated_delta_rows(q, k, v, g, beta, pool, rows), pool


@torch.library.custom_op("qwen::gdn_decode_rows_", mutates_args=("pool",))
def gdn_decode_rows_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """In place on pool rows; returns o [B, H, Dv]. With `pdl.set_early` on (the engine's `early_loads`), the
    kernel reads its state slices before its PDL wait (EARLY): the engine's predecessor of this op, the GDN prep,
    writes neither the pool nor `rows`."""
    _check_inner_strides(q, k, v, g, beta)
    if not pool.is_contiguous():
        raise ValueError("gdn_decode_rows_ updates the state pool in place and needs it contiguous")
    if rows.dtype != torch.int64 or rows.shape != q.shape[:1] or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous int64 [B] tensor, got {rows.dtype} {tuple(rows.shape)}")
    return _launch(q, k, v, g, beta, pool, pool, rows, early=True)


@gdn_decode_rows_.register_fake
def _(q, k, v, g, beta, pool, rows):
    return pool.new_empty((q.shape[0], pool.shape[1], pool.shape[3]))


def gdn_decode_rows_triton(q, k, v, g, beta, pool, rows):
    """Same contract as `gdn_decode_rows_reference`."""
    return gdn_decode_rows_(q, k, v, g, beta, pool, rows), pool


# ---- the step and the gated norm after it in one launch --------------------------------------------------------------
# A GDN decode step runs the recurrent step (o [B, H, Dv] fp32), then the output's gated RMS norm per value head with
# the FP8 codes of out_proj's input ("rms_norm_gated_fp8"): two launches on the critical path of every GDN layer (30 a
# lone decode step). Here the program that finishes a head last norms it (`_gdn_decode_norm_kernel`).
def gdn_decode_rows_norm_fp8_reference(q, k, v, g, beta, pool, rows, z, weight, eps, input_scale):
    """`gdn_decode_rows_reference`, then `rms_norm_gated_fp8_reference` of its o (fp32, rounded to z's dtype by the
    norm) with z [B, H, Dv] (the model dtype), weight [Dv], the static input_scale (fp32 []) -> (out [B, H, Dv] in
    z.dtype, codes e4m3 [B, H, Dv], pool), pool advanced in place at `rows`."""
    from kernels.rms_norm import rms_norm_gated_fp8_reference

    o, pool = gdn_decode_rows_reference(q, k, v, g, beta, pool, rows)
    return (*rms_norm_gated_fp8_reference(o, z, weight, eps, input_scale), pool)


def _launch_norm(q, k, v, g, beta, pool, rows, z, weight, eps: float, input_scale):
    from kernels.rms_norm import rounds_x
    from kernels.split_k import split_counters

    _, heads, dk, dv = pool.shape
    bsz = q.shape[0]
    o = torch.empty((bsz, heads, dv), dtype=torch.float32, device=pool.device)
    out = torch.empty((bsz, heads, dv), dtype=z.dtype, device=pool.device)
    codes = torch.empty((bsz, heads, dv), dtype=torch.float8_e4m3fn, device=pool.device)
    if o.numel() == 0:
        return out, codes
    counters = split_counters(pool.device, bsz * heads)
    if counters is None:  # a first use inside a capture (the engine's warm-up allocates them first): two launches
        from kernels.rms_norm import rms_norm_gated_fp8_op

        return rms_norm_gated_fp8_op(_launch(q, k, v, g, beta, pool, pool, rows), z, weight, eps, input_scale)
    bv = _block_v(bsz * heads, dv)
    _gdn_decode_norm_kernel[(bsz * heads, triton.cdiv(dv, bv))](
        q, k, v, g, beta, pool, o, rows, z, weight, out, codes, input_scale, counters, heads, dk,
        dv, eps, *_step_strides(q, k, v, g, beta, pool, o), z.stride(0), z.stride(1), out.stride(0), out.stride(1),
        codes.stride(0), codes.stride(1),
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=bv, BLOCK_D=triton.next_power_of_2(dv),
        ROUND_PRODUCT=weight.dtype == z.dtype != torch.float32, ROUND_X=rounds_x(o, z), INTERPRET=_interpreted(),
        QUANT=True, **pdl.launch_options())
    return out, codes


@torch.library.custom_op("qwen::gdn_decode_rows_norm_fp8_", mutates_args=("pool",))
def gdn_decode_rows_norm_fp8_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                              pool: torch.Tensor, rows: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                              eps: float, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on pool rows; returns (out, codes) [B, H, Dv]: the gated norm of the step's output and its e4m3
    codes. One launch, no host syncs (CUDA-graph capturable once the arrival counters exist)."""
    _check_inner_strides(q, k, v, g, beta, z)
    if not pool.is_contiguous():
        raise ValueError("gdn_decode_rows_norm_fp8_ updates the state pool in place and needs it contiguous")
    if rows.dtype != torch.int64 or rows.shape != q.shape[:1] or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous int64 [B] tensor, got {rows.dtype} {tuple(rows.shape)}")
    if (z.shape != v.shape or tuple(weight.shape) != (v.shape[-1],) or weight.stride(-1) != 1
            or input_scale.numel() != 1 or input_scale.dtype != torch.float32):
        raise ValueError(f"gdn_decode_rows_norm_fp8_: z must be v's shape {tuple(v.shape)}, weight [Dv] (unit stride) "
                         f"and input_scale one fp32 value; got z {tuple(z.shape)}, weight {tuple(weight.shape)}, "
                         f"input_scale {input_scale.dtype} {tuple(input_scale.shape)}")
    return _launch_norm(q, k, v, g, beta, pool, rows, z, weight, eps, input_scale)


@gdn_decode_rows_norm_fp8_.register_fake
def _(q, k, v, g, beta, pool, rows, z, weight, eps, input_scale):
    return z.new_empty(v.shape), z.new_empty(v.shape, dtype=torch.float8_e4m3fn)


def gdn_decode_rows_norm_fp8_triton(q, k, v, g, beta, pool, rows, z, weight, eps, input_scale):
    """Same contract as `gdn_decode_rows_norm_fp8_reference`."""
    return (*gdn_decode_rows_norm_fp8_(q, k, v, g, beta, pool, rows, z, weight, eps, input_scale), pool)


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(q, k, v, g, beta, state) -> dict[str, Any]:
    shapes_ok = (state.dim() == 4 and q.shape == k.shape == state.shape[:3] and v.shape == state.shape[:2]
                 + state.shape[3:] and g.shape == beta.shape == state.shape[:2])
    return dict(device=state.device.type, dtypes={t.dtype for t in (q, k, v, g, beta, state)}, shapes_ok=shapes_ok,
                head_dims=tuple(state.shape[2:]) if state.dim() == 4 else (),
                unit_strides=all(t.stride(-1) == 1 for t in (q, k, v, g, beta, state) if t.dim()))


def supports(*, device: str, dtypes: set, shapes_ok: bool, head_dims: tuple, unit_strides: bool, **_: Any) -> bool:
    """Triton able to run on `device` (cuda, or the interpreter on CPU); everything fp32 with matching
    [B, H, Dk(, Dv)] shapes and unit inner strides; head dims <= MAX_HEAD_DIM (register tile)."""
    if triton is None or device != ("cpu" if _interpreted() else "cuda"):
        return False
    return (dtypes == {torch.float32} and shapes_ok and unit_strides
            and all(1 <= d <= MAX_HEAD_DIM for d in head_dims))


def describe_rows(q, k, v, g, beta, pool, rows) -> dict[str, Any]:
    """`describe` with the pool's row shape standing in for the per-batch state, plus the rows and pool checks."""
    shapes_ok = (pool.dim() == 4 and q.dim() == 3 and q.shape == k.shape and q.shape[1:] == pool.shape[1:3]
                 and v.shape == q.shape[:2] + pool.shape[3:] and g.shape == beta.shape == q.shape[:2])
    return dict(device=pool.device.type, dtypes={t.dtype for t in (q, k, v, g, beta)}, shapes_ok=shapes_ok,
                head_dims=tuple(pool.shape[2:]) if pool.dim() == 4 else (),
                unit_strides=all(t.stride(-1) == 1 for t in (q, k, v, g, beta, pool) if t.dim()),
                rows_ok=(rows.dtype == torch.int64 and rows.shape == q.shape[:1] and rows.is_contiguous()
                         and rows.device == pool.device),
                pool_contiguous=pool.is_contiguous(), pool_dtype=pool.dtype)


POOL_DTYPES = (torch.float32, torch.bfloat16)  # the state pool's (`QwenEngineConfig.gdn_state_dtype`)


def supports_rows(*, rows_ok: bool, pool_contiguous: bool, pool_dtype: torch.dtype, **info: Any) -> bool:
    """`supports` for the batch against one pool row, int64 [B] rows, a contiguous fp32 or bf16 pool (updated in
    place; bf16: widened as read, rounded to nearest even as stored)."""
    return rows_ok and pool_contiguous and pool_dtype in POOL_DTYPES and supports(**info)


def describe_rows_norm(q, k, v, g, beta, pool, rows, z, weight, eps=None, input_scale=None) -> dict[str, Any]:
    """`describe_rows`, plus the norm's: z of v's shape in bf16 / fp16 (the model dtype: the norm rounds o to it),
    weight [Dv] of a float dtype, one fp32 scale; unit inner strides."""
    from kernels.rms_norm import DTYPES as NORM_DTYPES

    return dict(describe_rows(q, k, v, g, beta, pool, rows),
                norm_ok=(z.shape == v.shape and z.dtype in (torch.bfloat16, torch.float16) and z.stride(-1) == 1
                         and z.device == pool.device and tuple(weight.shape) == (v.shape[-1],)
                         and weight.dtype in NORM_DTYPES and weight.device == pool.device and input_scale is not None
                         and input_scale.numel() == 1 and input_scale.dtype == torch.float32
                         and input_scale.device == pool.device))


def supports_rows_norm(*, norm_ok: bool, **info: Any) -> bool:
    """`supports_rows` and the norm's arguments (`describe_rows_norm`)."""
    return norm_ok and supports_rows(**info)


def compare_rows_norm(out, ref, tol: float | None = None) -> str | None:
    """The norm's output and codes by `rms_norm.compare_fp8` (the model dtype's tolerance; codes equal where the
    outputs are), the pool within 1e-5 x max |ref| (`compare`'s)."""
    from kernels.rms_norm import compare_fp8

    problem = compare_fp8(out[:2], ref[:2], tol)
    if problem:
        return problem
    problem = tolerance.compare(out[2], ref[2], 1e-5)
    return None if problem is None else f"pool: {problem}"


def compare(out, ref, tol: float = 1e-5) -> str | None:
    """Both outputs (o, new state) within tol x max |ref| (fp32 summation order and exp ulps only)."""
    for name, a, b in zip(("o", "state"), out, ref):
        problem = tolerance.compare(a, b, tol)  # (also fails on NaN)
        if problem:
            return f"{name}: {problem}"
    return None


def random_inputs(bsz: int, heads: int, dk: int, dv: int, seed: int = 0, device="cpu"):
    """Model-like decode inputs: unit-norm q (scaled by dk^-1/2) and k, g = -A softplus(.) <= 0, beta in (0, 1), and
    a state that has seen a few hundred tokens (O(1) entries)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(bsz, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(bsz, heads, dk, generator=gen), dim=-1)
    v = torch.randn(bsz, heads, dv, generator=gen)
    g = -torch.rand(bsz, heads, generator=gen) * 0.5
    beta = torch.rand(bsz, heads, generator=gen)
    state = torch.randn(bsz, heads, dk, dv, generator=gen) * 0.5
    return tuple(t.to(device) for t in (q, k, v, g, beta, state))


def _sample(device) -> tuple[tuple, dict]:
    return random_inputs(2, 3, 32, 48, device=device), {}


def _sample_rows(device) -> tuple[tuple, dict]:
    *qkvgb, pool = random_inputs(3, 3, 32, 48, device=device)
    rows = torch.tensor([2, 0], device=device)  # two sequences, out of order; pool row 1 must stay untouched
    return (*(t[:2] for t in qkvgb), pool, rows), {}


def _sample_rows_norm(device) -> tuple[tuple, dict]:
    (q, k, v, g, beta, pool, rows), _ = _sample_rows(device)
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(v.shape, generator=gen).to(torch.bfloat16).to(device)
    weight = (1 + 0.1 * torch.randn(v.shape[-1], generator=gen)).to(torch.bfloat16).to(device)
    return (q, k, v, g, beta, pool, rows, z, weight, 1e-6, torch.tensor(0.02, device=device)), {}


def register(registry) -> None:
    registry.add_op(NAME, gdn_decode_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="o and new state within 1e-5 x max |ref| (same fp32 ops; reduction order, exp ulps)")
    registry.add_implementation(NAME, "triton", gdn_decode_triton, supports)
    registry.add_op(ROWS_NAME, gdn_decode_rows_reference, sample=_sample_rows, compare=compare,
                    describe=describe_rows, mutates=True,
                    tolerance="o and the whole pool within 1e-5 x max |ref| (same fp32 ops; reduction order, exp ulps)")
    registry.add_implementation(ROWS_NAME, "triton", gdn_decode_rows_triton, supports_rows)
    registry.add_op(ROWS_NORM_NAME, gdn_decode_rows_norm_fp8_reference, sample=_sample_rows_norm,
                    compare=compare_rows_norm, describe=describe_rows_norm, mutates=True,
                    tolerance="the norm's output within its dtype's tolerance, codes equal where the outputs are, "
                              "the pool within 1e-5 x max |ref|")
    registry.add_implementation(ROWS_NORM_NAME, "triton", gdn_decode_rows_norm_fp8_triton, supports_rows_norm)
