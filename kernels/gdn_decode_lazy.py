"""The GDN decode step on the lazy state (`QwenEngineConfig.gdn_lazy_rank`) in Triton: the fp32 recurrent state read
every token but written once every R, the tokens between kept as rank-1 terms.

Reference `qwen_engine.model.gdn.gated_delta_rows_lazy` (its comment block gives the maths and the storage); the
plain recurrence it reorders is `gated_delta_rows` (`kernels/gdn_decode.py`'s "gdn_decode_rows").

Why. At 32 streams the plain step reads and writes 128 MiB of fp32 state a GDN layer (2 MiB a sequence: 30 layers,
~3.8 GB a step, ~1 ms of an H200's 7.5 ms step, 15% of an H100's: benchmarks/RESULTS.md, forty-eighth session). The
lazy step reads the 64 MiB, reads the pending terms (< R of 768 B a head and 64-column slice) and writes one term,
folding the terms into the state (a full write) on one step in R: at R = 8 ~76 MiB a layer instead of 128 (-41%).
Below `fold_below` rows (a lone stream: the step is latency-bound, not bandwidth-bound) every step folds: the plain
step's traffic plus the base position, and every term slot of the head is loaded with the state (masked by the base
position only afterwards), so that the base position's load adds no round trip to the step's chain.

One program owns a [Dk, BLOCK_V] slice of one (row, head)'s state, as `_gdn_decode_kernel`: it reads the slice and
its head's pending keys / log decays and its columns of their deltas, computes the two readouts (S_{t-1}^T k, S_{t-1}^T
q) from them, and either folds (the slice written) or stores this token's term (its columns of delta; the first
slice of a head also the key and log decay, which every slice computes alike). Its columns' copy of the base position
(one int32 per GDN_TERM_GRANULE columns) is the only metadata it reads and writes, so no program reads what another
writes in the same launch (the term slots it reads hold positions < t, the one it writes position t).

Numerics: the reference's fp32 operations, reductions in another order: ~1e-6 relative (tests: 1e-5 of max |ref|).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import pdl, tolerance
from kernels.gdn_decode import _block_v, random_inputs

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
    from kernels.rms_norm import _cast
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "gdn_decode_rows_lazy"
FOLD_BELOW_ROWS = 8  # the engine's fold_below: batches of fewer rows fold every step (latency-bound there)
MAX_RANK = 16  # R: pending terms a head holds (a [next_pow2(R), Dk] register tile)
POOL_DTYPES = (torch.float32, torch.bfloat16)  # the state pool's (`QwenEngineConfig.gdn_state_dtype`)
# the launch's columns a program (None: `gdn_decode._block_v`'s rule), warps and register cap, process-wide: what
# benchmarks/gdn_lazy_bench.py sweeps (offline sm_90, Dk = Dv = 128, R = 8: 205 registers at 64 columns and 4 warps
# -- 2 programs an SM, the plain kernel's 164 allow 3 --, 165 at 32 columns, 191 at 64 columns and 8 warps; no spills)
LAUNCH_BLOCK_V: int | None = None
NUM_WARPS = 4
MAXNREG: int | None = None  # a register cap (168 at 64 columns: 3 programs an SM, as the plain step's); None: ptxas'


def gdn_decode_lazy_reference(q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions, fold_below):
    """-> (o [B, H, Dv], pool, base, keys, deltas, logs), the last five advanced in place."""
    from qwen_engine.model.gdn import gated_delta_rows_lazy

    o = gated_delta_rows_lazy(q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions, fold_below)
    return o, pool, base, keys, deltas, logs


if triton is not None:

    @triton.jit
    def _gdn_decode_lazy_kernel(q, k, v, g, beta, pool, base, keys, deltas, logs, o, rows, positions, H, DK, DV,
                                s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_gb, s_bb, s_pb, s_ph, s_pk,
                                s_ob, s_oh, s_nb, s_nh, s_kyb, s_kyh, s_kyr, s_db, s_dh, s_dr, s_lb, s_lh,
                                NG, R: tl.constexpr, FOLD_AT: tl.constexpr, BLOCK_K: tl.constexpr,
                                BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, GRAN: tl.constexpr, GPP: tl.constexpr,
                                INTERPRET: tl.constexpr = False, USE_PDL: tl.constexpr = False):
        # grid (B * H, cdiv(DV, BLOCK_V)); BLOCK_V a multiple of GRAN (or the whole head when DV <= GRAN): GPP of the
        # head's NG granules a program. FOLD_AT: fold when n (pending terms) >= it -- R - 1, or 0 (every step)
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        pid, pv = tl.program_id(0), tl.program_id(1)
        b, h = pid // H, pid % H
        row = tl.load(rows + b)
        p = tl.maximum(tl.load(positions + b), 0)
        kk = tl.arange(0, BLOCK_K)
        vv = pv * BLOCK_V + tl.arange(0, BLOCK_V)
        k_ok, v_ok = kk < DK, vv < DV
        # this program's copy of the head's base position (its first granule's; it rewrites all of its own)
        first = (pv * BLOCK_V) // GRAN
        nb_ptr = base + row * s_nb + h * s_nh + first
        bp = tl.load(nb_ptr).to(tl.int64)
        n = p - 1 - bp
        unset = (bp < 0) | (n < 0) | (n >= R)
        n = tl.where(unset, 0, n)
        bp = tl.where(unset, p - 1, bp)
        j = tl.arange(0, BLOCK_R)
        valid = (j < R) & ((((j - bp - 1) % R) + R) % R < n)  # [BR]: slot j holds a pending position
        lg_ptr = logs + row * s_lb + h * s_lh
        kt_ptrs = keys + row * s_kyb + h * s_kyh + j[:, None] * s_kyr + kk[None, :]  # [BR, BK]
        dt_ptrs = deltas + row * s_db + h * s_dh + j[:, None] * s_dr + vv[None, :]  # [BR, BV]
        if FOLD_AT == 0:  # a small batch (latency-bound): every slot loaded at once, not after the base position
            r_ok = j < R
            lg = tl.where(valid, tl.load(lg_ptr + j, mask=r_ok, other=0.0), 0.0)
            kt = tl.where(valid[:, None], tl.load(kt_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0), 0.0)
            dt = tl.where(valid[:, None], tl.load(dt_ptrs, mask=r_ok[:, None] & v_ok[None, :], other=0.0), 0.0)
        else:  # a large batch (bandwidth-bound): only the pending terms' bytes
            lg = tl.load(lg_ptr + j, mask=valid, other=0.0)
            kt = tl.load(kt_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            dt = tl.load(dt_ptrs, mask=valid[:, None] & v_ok[None, :], other=0.0)
        last = ((p - 1) % R + R) % R
        l_prev = tl.sum(tl.where(valid & (j == last), lg, 0.0), axis=0)  # 0 without pending terms
        coef = tl.where(valid, tl.exp(l_prev - lg), 0.0)
        q_t = tl.load(q + b * s_qb + h * s_qh + kk, mask=k_ok, other=0.0)
        k_t = tl.load(k + b * s_kb + h * s_kh + kk, mask=k_ok, other=0.0)
        v_t = tl.load(v + b * s_vb + h * s_vh + vv, mask=v_ok, other=0.0)
        g_t = tl.load(g + b * s_gb + h)
        bt = tl.load(beta + b * s_bb + h)
        off = row * s_pb + h * s_ph + kk[:, None] * s_pk + vv[None, :]
        ok = k_ok[:, None] & v_ok[None, :]
        s = tl.load(pool + off, mask=ok, other=0.0).to(tl.float32)  # [BK, BV] the base state S_b
        grow = tl.exp(l_prev)
        ak = coef * tl.sum(kt * k_t[None, :], axis=1)  # [BR] e^(L_{t-1} - L_m) (k_m . k)
        aq = coef * tl.sum(kt * q_t[None, :], axis=1)
        read_k = grow * tl.sum(s * k_t[:, None], axis=0) + tl.sum(ak[:, None] * dt, axis=0)  # S_{t-1}^T k [BV]
        read_q = grow * tl.sum(s * q_t[:, None], axis=0) + tl.sum(aq[:, None] * dt, axis=0)
        decay = tl.exp(g_t)
        delta = (v_t - decay * read_k) * bt
        tl.store(o + b * s_ob + h * s_oh + vv, decay * read_q + tl.sum(k_t * q_t, axis=0) * delta, mask=v_ok)
        l_now = l_prev + g_t
        granules = tl.arange(0, GPP)
        g_ok = first + granules < NG
        if n >= FOLD_AT:  # S_t = e^(L_t) S_b + sum_m e^(L_t - L_m) k_m delta_m^T + k delta^T
            s = s * tl.exp(l_now)
            for m in tl.static_range(R):  # each pending term read again (L1 / L2: just loaded), not kept in registers
                use = tl.sum(tl.where(valid & (j == m), 1, 0), axis=0) > 0
                lm = tl.load(lg_ptr + m, mask=use, other=0.0)
                km = tl.load(keys + row * s_kyb + h * s_kyh + m * s_kyr + kk, mask=k_ok & use, other=0.0)
                dm = tl.load(deltas + row * s_db + h * s_dh + m * s_dr + vv, mask=v_ok & use, other=0.0)
                s += (km * tl.where(use, tl.exp(l_now - lm), 0.0))[:, None] * dm[None, :]
            s += k_t[:, None] * delta[None, :]
            tl.store(pool + off, _cast(s, pool.dtype.element_ty, INTERPRET), mask=ok)
            tl.store(nb_ptr + granules, (tl.zeros_like(granules).to(tl.int64) + p).to(tl.int32), mask=g_ok)
        else:  # this token's term in slot p % R
            slot = p % R
            tl.store(deltas + row * s_db + h * s_dh + slot * s_dr + vv, delta, mask=v_ok)
            if pv == 0:
                tl.store(keys + row * s_kyb + h * s_kyh + slot * s_kyr + kk, k_t, mask=k_ok)
                tl.store(lg_ptr + slot, l_now)
            tl.store(nb_ptr + granules, (tl.zeros_like(granules).to(tl.int64) + bp).to(tl.int32), mask=g_ok)


def _interpreted() -> bool:
    return triton is not None and type(_gdn_decode_lazy_kernel).__name__ == "InterpretedFunction"


@torch.library.custom_op("qwen::gdn_decode_rows_lazy_", mutates_args=("pool", "base", "keys", "deltas", "logs"))
def gdn_decode_lazy_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool: torch.Tensor, base: torch.Tensor, keys: torch.Tensor, deltas: torch.Tensor,
                     logs: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, fold_below: int) -> torch.Tensor:
    """In place on the pool rows' lazy state; returns o [B, H, Dv] fp32. No host syncs (CUDA-graph capturable)."""
    from qwen_engine.model.gdn import GDN_TERM_GRANULE

    bsz, heads, dk = q.shape
    dv = v.shape[-1]
    o = torch.empty((bsz, heads, dv), dtype=torch.float32, device=pool.device)
    if o.numel() == 0:
        return o
    r = keys.shape[2]
    bv = LAUNCH_BLOCK_V or _block_v(bsz * heads, dv)  # the plain step's slices: 64 / 32 / 16 columns
    _gdn_decode_lazy_kernel[(bsz * heads, triton.cdiv(dv, bv))](
        q, k, v, g, beta, pool, base, keys, deltas, logs, o, rows, positions, heads, dk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        pool.stride(0), pool.stride(1), pool.stride(2), o.stride(0), o.stride(1), base.stride(0), base.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), deltas.stride(0), deltas.stride(1), deltas.stride(2),
        logs.stride(0), logs.stride(1), base.shape[2], R=r, FOLD_AT=0 if bsz < fold_below else r - 1,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=bv, BLOCK_R=max(2, triton.next_power_of_2(r)),
        GRAN=GDN_TERM_GRANULE, GPP=max(1, bv // GDN_TERM_GRANULE), INTERPRET=_interpreted(), num_warps=NUM_WARPS,
        **({} if MAXNREG is None or _interpreted() else dict(maxnreg=MAXNREG)), **pdl.launch_options())
    return o


@gdn_decode_lazy_.register_fake
def _(q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions, fold_below):
    return pool.new_empty((q.shape[0], pool.shape[1], pool.shape[3]), dtype=torch.float32)


def gdn_decode_lazy_triton(q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions, fold_below):
    """Same contract as `gdn_decode_lazy_reference`."""
    return gdn_decode_lazy_(q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions, fold_below), \
        pool, base, keys, deltas, logs


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions, fold_below=0) -> dict[str, Any]:
    from qwen_engine.model.gdn import gdn_term_granules

    shapes_ok = (pool.dim() == 4 and q.dim() == 3 and q.shape == k.shape and q.shape[1:] == pool.shape[1:3]
                 and v.shape == q.shape[:2] + pool.shape[3:] and g.shape == beta.shape == q.shape[:2]
                 and keys.dim() == 4 and 1 <= keys.shape[2] <= MAX_RANK
                 and keys.shape == pool.shape[:2] + (keys.shape[2], pool.shape[2])
                 and deltas.shape == pool.shape[:2] + (keys.shape[2], pool.shape[3])
                 and logs.shape == keys.shape[:3] and base.shape == pool.shape[:2] + (gdn_term_granules(pool.shape[3]),)
                 and rows.shape == positions.shape == q.shape[:1])
    return dict(device=pool.device.type, shapes_ok=shapes_ok,
                dtypes_ok=({t.dtype for t in (q, k, v, g, beta, keys, deltas, logs)} == {torch.float32}
                           and base.dtype == torch.int32 and rows.dtype == positions.dtype == torch.int64
                           and pool.dtype in POOL_DTYPES),
                contiguous=all(t.is_contiguous() for t in (pool, base, keys, deltas, logs, rows, positions)),
                unit_strides=all(t.stride(-1) == 1 for t in (q, k, v, g, beta) if t.dim()),
                head_dims=tuple(pool.shape[2:]) if pool.dim() == 4 else ())


def supports(*, device: str, shapes_ok: bool, dtypes_ok: bool, contiguous: bool, unit_strides: bool,
             head_dims: tuple, **_: Any) -> bool:
    """Triton able to run on `device` (cuda, or the interpreter on CPU); fp32 inputs and terms, an fp32 or bf16 pool,
    int32 base positions, contiguous state tensors, head dims <= 256 (the plain kernel's register tile)."""
    from kernels.gdn_decode import MAX_HEAD_DIM

    if triton is None or device != ("cpu" if _interpreted() else "cuda"):
        return False
    return shapes_ok and dtypes_ok and contiguous and unit_strides and all(1 <= d <= MAX_HEAD_DIM for d in head_dims)


def compare(out, ref, tol: float = 1e-5) -> str | None:
    """o, the pool, the keys / deltas / logs within tol x max |ref|; the base positions equal."""
    for name, a, b in zip(("o", "pool", "base", "keys", "deltas", "logs"), out, ref):
        if name == "base":
            if not torch.equal(a, b):
                return f"base positions differ at {int((a != b).sum())} of {a.numel()}"
            continue
        problem = tolerance.compare(a.float(), b.float(), tol)  # (also fails on NaN)
        if problem:
            return f"{name}: {problem}"
    return None


def random_lazy_state(slots: int, heads: int, dk: int, dv: int, rank: int, seed: int = 0, device="cpu"):
    """A pool and its terms as a few hundred tokens would leave them (O(1) state, unit keys, small deltas, decreasing
    log decays), every base position -1 (no pending term): (pool, base, keys, deltas, logs)."""
    from qwen_engine.model.gdn import gdn_term_granules

    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(slots, heads, dk, dv, generator=gen) * 0.5
    keys = torch.nn.functional.normalize(torch.randn(slots, heads, rank, dk, generator=gen), dim=-1)
    deltas = torch.randn(slots, heads, rank, dv, generator=gen) * 0.3
    logs = -torch.rand(slots, heads, rank, generator=gen).cumsum(-1) * 0.3
    base = torch.full((slots, heads, gdn_term_granules(dv)), -1, dtype=torch.int32)
    return tuple(t.to(device) for t in (pool, base, keys, deltas, logs))


def _sample(device) -> list[tuple[tuple, dict]]:
    """Three rows of a 4-row pool at rank 4: one with 2 pending terms, one about to fold (3), one with none; once on
    the large-batch build (fold_below 0: rows fold when their rank fills) and once on the small-batch one (fold_below
    FOLD_BELOW_ROWS > 3 rows: every row folds, all term slots loaded with the state). The registry checks both,
    each on its own copy of the tensors (the op is registered mutates=True), so the two calls share them."""
    q, k, v, g, beta, _ = random_inputs(3, 3, 32, 48, device=device)
    pool, base, keys, deltas, logs = random_lazy_state(4, 3, 32, 48, 4, device=device)
    rows = torch.tensor([2, 0, 3], device=device)
    positions = torch.tensor([13, 7, 40], device=device)
    base[2], base[0] = 10, 3  # pending 11, 12 (slots 3, 0) / 4, 5, 6 (slots 0, 1, 2): row 0 folds at position 7
    args = (q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions)
    return [(args + (0,), {}), (args + (FOLD_BELOW_ROWS,), {})]


def register(registry) -> None:
    registry.add_op(NAME, gdn_decode_lazy_reference, sample=_sample, compare=compare, describe=describe,
                    mutates=True,
                    tolerance="o, the pool and the terms within 1e-5 x max |ref| (same fp32 ops; reduction order, "
                              "exp ulps); base positions equal")
    registry.add_implementation(NAME, "triton", gdn_decode_lazy_triton, supports)
