"""A GDN layer's decode-row preparation and its recurrent step in ONE Triton launch: registry op
"gdn_decode_prep_step" = `gdn_decode_prep_ba` (kernels/gdn_prep.py: the conv step + SiLU, the q / k L2 norms, the
b / a projections and the beta / decay gates) then `gdn_decode_rows` (kernels/gdn_decode.py: the step over the state
pool, in place), without q / k / v / beta / g going through memory between them.

Contract. `gdn_decode_prep_step_reference(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool,
num_k_heads, head_k_dim, head_v_dim)` = `gdn_decode_prep_ba_reference` on the first eight arguments, then
`gdn_decode_rows_reference` of its q, k, v, g, beta over `pool` [S, Hv, Dk, Dv] at the same `rows` (int64 [D]) ->
(o [D, Hv, Dv] fp32, conv_pool, pool), both pools advanced in place at `rows`.

Why. At 32 streams the prep is a ~7.3 us launch between the in_proj GEMM and the ~45 us step on every GDN layer
(H100 trace, results/profile54_run1: 30 calls, 0.22 ms of an 8.55 ms step), and it writes 1.5 MB of fp32 q / k / v
that the step reads back. Here each program of the step's grid (B Hv, cdiv(Dv, BLOCK_V)) prepares what its state
slice needs itself: the conv + norms of its k-head's q / k channels (128 + 128 at Qwen3.6), the conv of its own
BLOCK_V value channels, and its head's gates -- with early loads (`pdl.early_options`), everything but qkv_in before
the PDL wait, beside its state slice. The q / k work is repeated by the R cdiv(Dv, BLOCK_V) programs that share a
k-head (4 at 32 streams: R = 2 value heads a k-head, 2 slices of 64), the b / a dot products by the slices of a head
(each program computes the R heads of its k-head, as the prep's program does, and keeps its own: the same tile, so
the same fp32 sums).

The conv window in place. A value slice's channels belong to one program: it reads their window, then (after a CTA
barrier: warps hold replicated elements) stores it shifted. A k-head's q / k channels are read by R cdiv(Dv, BLOCK_V)
programs, so the one that arrives last (`split_k.last_arrival` on a per-(row, k-head) counter, re-armed to 0) stores
their shifted window: every other reader has read it before its own arrival. CUDA-graph padding rows share the
scratch slot (their pool rows are then unspecified, as in both ops), but not counters (one per batch row).

Numerics: the same operations as the two launches in the same tiles (`_conv_taps` / `_conv_of`, the [1, BLOCK_K]
norms, `_gate_inputs`' [BLOCK_R, BLOCK_H] dot products, `_advance`), so the same bits as `gdn_decode_prep_ba` then
`gdn_decode_rows` at the engine's warps (the tests check it under the interpreter and on CUDA); against the torch
reference the prep's tolerance carries over (`compare`).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import gdn_decode, gdn_prep, pdl, tolerance

try:
    import triton
    import triton.language as tl

    from kernels.gdn_decode import _advance, _state_tile
    from kernels.gdn_prep import _conv_of, _conv_taps, _gate_inputs, _gates, _store_shifted
    from kernels.pdl import enter as pdl_enter
    from kernels.split_k import last_arrival, rearm, split_counters
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "gdn_decode_prep_step"
# The launch (module variables: benchmarks/gdn_prep_step_bench.py times the alternatives). Offline sm_90 (Triton 3.6,
# tests/sm90_compile.py): at the step's 64 state columns and 4 warps every build spills (the state slice alone is 64
# registers a thread beside the prep's tiles; with early loads 1.9-2.4 KB of stack); 8 warps hold 64 columns without
# early loads (193 registers) and 32 columns with them (127). 8 warps retile the q / k norms' reductions, so q / k may
# differ from the 4-warp prep's by an fp32 rounding (within `compare`).
BLOCK_V = None  # state columns a program; None: the step's rule (`gdn_decode._block_v`: 64 at 32 streams)
NUM_WARPS = 4
TAPS_EARLY = False  # with early loads: the conv taps and weights before the wait too (else right after it)
BA_EARLY = False  # with early loads: the b / a dot products before the wait too (else right after it)
OWN_GATES = False  # each program's b / a dot products for its own value head only instead of its k-head's R (the
#                    prep's tile: the same sums); another tile may round b / a otherwise


# ---- reference -------------------------------------------------------------------------------------------------------
def gdn_decode_prep_step_reference(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool,
                                   num_k_heads: int, head_k_dim: int, head_v_dim: int):
    """`gdn_decode_prep_ba_reference`, then `gdn_decode_rows_reference` on its outputs (module docstring)."""
    q, k, v, beta, g, _, conv_pool = gdn_prep.gdn_decode_prep_ba_reference(
        qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, num_k_heads, head_k_dim, head_v_dim)
    o, pool = gdn_decode.gdn_decode_rows_reference(q, k, v, g, beta, pool, rows)
    return o, conv_pool, pool


def gdn_decode_prep_then_step(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool, num_k_heads: int,
                              head_k_dim: int, head_v_dim: int):
    """The op in two launches, the prep kernel then the step kernel: what a decode step ran before this kernel, and
    its fallback where the kernel cannot run (no arrival counters inside a capture)."""
    q, k, v, beta, g, _, conv_pool = gdn_prep.gdn_decode_prep_ba_triton(
        qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, num_k_heads, head_k_dim, head_v_dim)
    o, pool = gdn_decode.gdn_decode_rows_triton(q, k, v, g, beta, pool, rows)
    return o, conv_pool, pool


# ---- Triton kernel ---------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gdn_prep_step_kernel(qkv, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool, o, counters,
                              HK, HV, H, s_qd, s_pr, s_pc, s_wc, s_xd, s_wr, q_scale, s_sb, s_sh, s_sk, s_ob, s_oh,
                              DK: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, KM1: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_G: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
                              USE_PDL: tl.constexpr = False, EARLY: tl.constexpr = False,
                              TAPS_EARLY: tl.constexpr = False, BA_EARLY: tl.constexpr = False):
        # grid (D HV, cdiv(DV, BLOCK_V)): program (d HV + h, pv) owns value head h's state columns
        # [pv BLOCK_V, (pv + 1) BLOCK_V) of row d's slot and those value channels of the conv pool; it serves k-head
        # j = h // R. EARLY (with PDL): before the wait everything the predecessor (the in_proj GEMM, whose output is
        # qkv) does not write -- the row, the state slice, the gates' parameters, the b / a dot products over the
        # layer input x (the in_proj's input: complete before that GEMM passed its own wait, which precedes this
        # launch; read through L2), the conv taps and weights -- and no store; then qkv, the arithmetic and stores.
        if not EARLY:
            pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        pid, pv = tl.program_id(0), tl.program_id(1)
        d, h = pid // HV, pid % HV
        j = h // R
        row = tl.load(rows + d)
        dt = qkv.dtype.element_ty
        # the heads whose gates the program computes: BLOCK_G = BLOCK_R, the k-head's R value heads, as the prep's
        # program does (the same tiles: the same sums); 1: its own head only (half the b / a weights' reads)
        ri = tl.arange(0, BLOCK_G)
        r_ok = ri < R
        if BLOCK_G == 1:
            heads = h + ri
        else:
            heads = j * R + ri
        kk = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
        k_ok = kk < DK
        key_dim = HK * DK
        q_ch, k_ch = j * DK + kk, key_dim + j * DK + kk
        vv = pv * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]  # [1, BV]: this program's value channels
        v_ok = vv < DV
        v_ch = 2 * key_dim + h * DV + vv
        dt_b = tl.load(dt_bias + heads, mask=r_ok, other=0.0).to(tl.float32)
        a_lg = tl.load(a_log + heads, mask=r_ok, other=0.0).to(tl.float32)
        if BA_EARLY or not EARLY:
            bb, u = _gate_inputs(x, w_ba, x, d, heads, r_ok, HV, H, s_xd, s_wr, dt, True, BLOCK_G, BLOCK_H,
                                 INTERPRET, False)  # (no store: ba_out is not an output here)
        if EARLY:
            s_raw, off, ok = _state_tile(pool, row, pid, pv, HV, DK, DV, s_sb, s_sh, s_sk, BLOCK_K, BLOCK_V)
        if TAPS_EARLY:
            q_taps, q_w = _conv_taps(conv_pool, conv_w, row, q_ch, k_ok, s_pr, s_pc, s_wc, KM1, BLOCK_T)
            k_taps, k_w = _conv_taps(conv_pool, conv_w, row, k_ch, k_ok, s_pr, s_pc, s_wc, KM1, BLOCK_T)
            v_taps, v_w = _conv_taps(conv_pool, conv_w, row, v_ch, v_ok, s_pr, s_pc, s_wc, KM1, BLOCK_T)
        if EARLY:
            pdl_enter(USE_PDL)  # now qkv (the predecessor's output), then every store
        if EARLY and not BA_EARLY:  # the dot products after the wait: their tiles and the state slice's registers
            bb, u = _gate_inputs(x, w_ba, x, d, heads, r_ok, HV, H, s_xd, s_wr, dt, True, BLOCK_G, BLOCK_H,
                                 INTERPRET, False)
        if not TAPS_EARLY:
            q_taps, q_w = _conv_taps(conv_pool, conv_w, row, q_ch, k_ok, s_pr, s_pc, s_wc, KM1, BLOCK_T)
            k_taps, k_w = _conv_taps(conv_pool, conv_w, row, k_ch, k_ok, s_pr, s_pc, s_wc, KM1, BLOCK_T)
            v_taps, v_w = _conv_taps(conv_pool, conv_w, row, v_ch, v_ok, s_pr, s_pc, s_wc, KM1, BLOCK_T)
        qf, q_win = _conv_of(qkv, d, q_ch, k_ok, q_taps, q_w, s_qd, KM1, BLOCK_T, dt, INTERPRET)
        kf, k_win = _conv_of(qkv, d, k_ch, k_ok, k_taps, k_w, s_qd, KM1, BLOCK_T, dt, INTERPRET)
        qn = qf * (1.0 / tl.sqrt(tl.sum(qf * qf, axis=1) + 1e-6))[:, None] * q_scale  # [1, BK], the prep's
        kn = kf * (1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) + 1e-6))[:, None]
        vf, v_win = _conv_of(qkv, d, v_ch, v_ok, v_taps, v_w, s_qd, KM1, BLOCK_T, dt, INTERPRET)
        # the gates of the R heads, as the prep computes them (kernels/gdn_prep.py), then this program's head
        beta, g = _gates(bb, u, dt_b, a_lg, dt, INTERPRET)
        mine = heads == h
        bt = tl.sum(tl.where(mine, beta, 0.0), axis=0)  # exact picks (x + 0s)
        decay = tl.exp(tl.sum(tl.where(mine, g, 0.0), axis=0))
        if not EARLY:  # the token's inputs before the state, as the plain step loads them
            s_raw, off, ok = _state_tile(pool, row, pid, pv, HV, DK, DV, s_sb, s_sh, s_sk, BLOCK_K, BLOCK_V)
        # the step: q, k, v as the 1-D vectors `_advance` takes (sums over a size-1 axis: the values themselves)
        _advance(tl.sum(qn, axis=0), tl.sum(kn, axis=0), tl.sum(vf, axis=0), decay, bt, s_raw, off, ok, pool, o,
                 pid, pv, HV, DV, s_ob, s_oh, BLOCK_V, INTERPRET)
        # the conv windows: this program's value channels now (every warp has read them: the barrier), the
        # k-head's q / k channels by the last of the R cdiv(DV, BLOCK_V) programs that read them
        tl.debug_barrier()
        _store_shifted(conv_pool, row, v_ch, v_ok, v_win, s_pr, s_pc, KM1, BLOCK_T)
        tile = d * HK + j
        if last_arrival(counters, tile, R * tl.num_programs(1)):
            _store_shifted(conv_pool, row, q_ch, k_ok, q_win, s_pr, s_pc, KM1, BLOCK_T)
            _store_shifted(conv_pool, row, k_ch, k_ok, k_win, s_pr, s_pc, KM1, BLOCK_T)
            rearm(counters, tile)


def _interpreted() -> bool:
    return triton is not None and type(_gdn_prep_step_kernel).__name__ == "InterpretedFunction"


def _launch(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool, num_k_heads: int, head_k_dim: int,
            head_v_dim: int) -> torch.Tensor:
    """o [D, Hv, Dv] fp32; both pools advanced in place (the launch: the module's BLOCK_V, NUM_WARPS, TAPS_EARLY,
    BA_EARLY)."""
    d = qkv_in.shape[0]
    hv = w_ba.shape[0] // 2
    o = torch.empty((d, hv, head_v_dim), dtype=torch.float32, device=qkv_in.device)
    if d == 0:
        return o
    counters = split_counters(qkv_in.device, d * num_k_heads)
    if counters is None:  # a first use inside a capture (the engine's warm-up allocates them first): two launches
        o.copy_(gdn_decode_prep_then_step(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool,
                                          num_k_heads, head_k_dim, head_v_dim)[0])
        return o
    bv = min(BLOCK_V, triton.next_power_of_2(head_v_dim)) if BLOCK_V else gdn_decode._block_v(d * hv, head_v_dim)
    _gdn_prep_step_kernel[(d * hv, triton.cdiv(head_v_dim, bv))](
        qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool, o, counters,
        num_k_heads, hv, x.shape[1], qkv_in.stride(0), conv_pool.stride(0), conv_pool.stride(1), conv_w.stride(0),
        x.stride(0), w_ba.stride(0), head_k_dim ** -0.5, pool.stride(0), pool.stride(1), pool.stride(2),
        o.stride(0), o.stride(1),
        DK=head_k_dim, DV=head_v_dim, R=hv // num_k_heads, KM1=conv_pool.shape[-1],
        BLOCK_K=triton.next_power_of_2(head_k_dim), BLOCK_V=bv,
        BLOCK_G=1 if OWN_GATES else triton.next_power_of_2(hv // num_k_heads),
        BLOCK_T=triton.next_power_of_2(conv_pool.shape[-1] + 1), BLOCK_H=gdn_prep.BA_BLOCK_H,
        INTERPRET=_interpreted(), TAPS_EARLY=TAPS_EARLY, BA_EARLY=BA_EARLY, num_warps=NUM_WARPS,
        **pdl.launch_options(),
        # early loads (the engine's `early_loads`): the launch's predecessor writes qkv_in only -- the engine's
        # in_proj GEMM; x is its input, the pools and weights no kernel of the layer's step writes before this one
        **pdl.early_options())
    return o


@torch.library.custom_op("qwen::gdn_decode_prep_step_", mutates_args=("conv_pool", "pool"))
def gdn_decode_prep_step_(qkv_in: torch.Tensor, conv_pool: torch.Tensor, rows: torch.Tensor, conv_w: torch.Tensor,
                          x: torch.Tensor, w_ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                          pool: torch.Tensor, num_k_heads: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """o [D, Hv, Dv]; advances conv_pool[rows] and pool[rows] in place. Guards: `supports` (checked by the
    registry)."""
    return _launch(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool, num_k_heads, head_k_dim,
                   head_v_dim)


@gdn_decode_prep_step_.register_fake
def _(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool, num_k_heads, head_k_dim, head_v_dim):
    return qkv_in.new_empty((qkv_in.shape[0], w_ba.shape[0] // 2, head_v_dim), dtype=torch.float32)


def gdn_decode_prep_step_triton(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool, num_k_heads,
                                head_k_dim, head_v_dim):
    """Same contract as `gdn_decode_prep_step_reference`."""
    o = gdn_decode_prep_step_(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool, num_k_heads,
                              head_k_dim, head_v_dim)
    return o, conv_pool, pool


# ---- guard, registry entry -------------------------------------------------------------------------------------------
def describe(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, pool, num_k_heads, head_k_dim, head_v_dim
             ) -> dict[str, Any]:
    """The prep's description (`gdn_prep.describe_ba`) and the state pool's: [S, Hv, Dk, Dv], contiguous, fp32 or
    bf16 (`gdn_decode.POOL_DTYPES`), on the same device; int64 rows."""
    out = gdn_prep.describe_ba(qkv_in, conv_pool, rows, conv_w, x, w_ba, a_log, dt_bias, num_k_heads, head_k_dim,
                               head_v_dim)
    hv = w_ba.shape[0] // 2 if w_ba.dim() == 2 else -1
    out["pool_ok"] = (pool.dim() == 4 and tuple(pool.shape[1:]) == (hv, head_k_dim, head_v_dim)
                      and pool.is_contiguous() and pool.dtype in gdn_decode.POOL_DTYPES
                      and pool.device == qkv_in.device and rows.dtype == torch.int64)
    return out


def supports(*, pool_ok: bool, **info: Any) -> bool:
    """`gdn_prep.supports` (Triton on the device or the interpreter; one model dtype; consistent shapes) and the
    pool's conditions (`describe`)."""
    return triton is not None and pool_ok and gdn_prep.supports(**info)


def compare(out, ref, tol: float | None = None) -> str | None:
    """The conv pool bit for bit (exact copies); o and the state pool within tol x max |ref| (1e-5 for an fp32 model
    dtype: fp32 summation order and exp ulps; 1e-2 for bf16 / fp16, the prep's: one model-dtype ulp of a rounded
    conv output carried through the L2 norm and the step)."""
    if out[1].shape != ref[1].shape or out[1].dtype != ref[1].dtype or not torch.equal(out[1], ref[1]):
        return "conv_pool: not bit-identical to the reference's"
    if tol is None:
        tol = 1e-5 if ref[1].dtype == torch.float32 else 1e-2
    for name, a, b in (("o", out[0], ref[0]), ("pool", out[2], ref[2])):
        problem = tolerance.compare(a, b, tol)  # (also fails on NaN)
        if problem:
            return f"{name}: {problem}"
    return None


def random_inputs(d: int, num_k_heads: int, head_k_dim: int, r: int, head_v_dim: int, hidden: int = 96,
                  kernel: int = 4, slots: int | None = None, dtype=torch.bfloat16, seed: int = 0, device="cpu",
                  exact_ba: bool = False):
    """`gdn_prep.random_inputs_ba` and a state pool [slots, Hv, Dk, Dv] fp32 of O(1) entries (positional args of the
    op). exact_ba: x in {-1, 0, 1} and w_ba in multiples of 1/64 (a: 3/64), |entries| <= 1/8 (3/8), so that every
    fp32 sum of their products is exact whatever its order -- b and a then round to the same model-dtype values in
    the kernel and in the reference's F.linear, and the comparison is about the rest."""
    args = list(gdn_prep.random_inputs_ba(d, num_k_heads, head_k_dim, r, head_v_dim, hidden, kernel, slots, dtype,
                                          seed, device))
    gen = torch.Generator().manual_seed(seed + 2)
    hv = num_k_heads * r
    if exact_ba:
        x = torch.randint(-1, 2, (d, hidden), generator=gen).float()
        w_ba = torch.randint(-8, 9, (2 * hv, hidden), generator=gen).float() / 64
        w_ba[hv:] *= 3
        args[4], args[5] = x.to(dtype).to(device), w_ba.to(dtype).to(device)
    pool = torch.randn(args[1].shape[0], hv, head_k_dim, head_v_dim, generator=gen)
    return (*args[:8], pool.to(device), *args[8:])


def _sample(device) -> tuple[tuple, dict]:
    return random_inputs(3, 2, 32, 2, 16, hidden=600, exact_ba=True, device=device), {}


def register(registry) -> None:
    registry.add_op(NAME, gdn_decode_prep_step_reference, sample=_sample, compare=compare, describe=describe,
                    mutates=True,
                    tolerance="o and the state pool within 1e-2 x max |ref| for bf16/fp16 (the prep's: one "
                              "model-dtype ulp of a rounded conv output through the L2 norm and the step), 1e-5 for "
                              "fp32; the conv pool bit for bit")
    registry.add_implementation(NAME, "triton", gdn_decode_prep_step_triton, supports)
    registry.add_implementation(NAME, "prep+step", gdn_decode_prep_then_step, supports)
