"""The end of a Qwen3.6 decoder layer in one Triton launch: the sum over the top-k routed experts' weighted outputs
(when handed over unsummed, [N, k, H]), the shared expert's sigmoid gate (a [1, H] GEMV), the gated shared expert
added to the routed experts, and the residual add.

Reference `moe_combine_reference` -- exactly the torch code of `SparseMoE.forward`'s tail plus `DecoderLayer`'s
residual (transformers' `Qwen3_5MoeSparseMoeBlock` + `Qwen3_5MoeDecoderLayer`):
    gate = sigmoid(x @ w_gate^T)                [N, 1]  (x: the MoE input, i.e. the post-attention-normed hidden)
    out  = residual + (routed + gate * shared)  [N, H]
in the model dtype, each torch op rounding its result: the GEMV (fp32 accumulation, one rounding), the sigmoid
(computed in fp32, rounded), the product, the two sums.

Why: these are 7 kernels per layer (top-k sum, its cast, GEMV, sigmoid, mul, add, add), 280 of a decode step over 40
layers, each a few microseconds of launch-bound work on [N, 2048] bf16 tensors. One program per row: it reads x,
w_gate, shared, the k routed rows and residual once ((4 + k) x 4 KB at H = 2048, bf16) and writes the row once.

The decode MoE (`kernels/moe_decode.py`) hands over fp32 partial rows instead: routed [N, k S, H] and the shared
expert's [N, S, H] (S intermediate slices: 288 rows of a token at top-8 and S = 32, the kernel's BLOCK_I 16). Those
go to a second kernel with a program per (row, block of 16 columns), which sums each group of rows in fp32 and
rounds it once (the shared expert's sum takes the rounding of the dense shared expert's output), then the same tail.

Numerics: the same fp32 operations and the same roundings to the model dtype (the top-k sum: fp32 in slot order,
one rounding, as `w4a16_moe`'s own sum up to fp32 summation order) (`kernels.rms_norm._round` / `_cast`, RNE
under the interpreter too); only the GEMV's sum runs in another order than cuBLAS's, so the rounded gate may differ
by one bf16 ulp, which moves the output by at most 2^-8 |gate * shared|. Tolerance: max |diff| <= 1e-2 x max |ref|
for bf16, 1e-5 for fp32 (`kernels.tolerance.compare`); the registry's sample has no massive residual row, so that
the MoE part of the output is not lost inside that tolerance (a kernel returning the residual alone fails it). bf16
and fp32 only: the bf16 roundings are done with integer ops (`_round`), since compiled `.to(bf16).to(fp32)` round
trips were contracted into the next add on the H200; fp16 would need the same and the model does not use it.
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
    from triton.language.extra import libdevice

    from kernels.fp8_quant import static_codes
    from kernels.pdl import enter as pdl_enter
    from kernels.rms_norm import _cast, _round, _static_scale, _stored_value
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "moe_combine"
NORM_NAME, NORM_FP8_NAME = "moe_combine_norm", "moe_combine_norm_fp8"  # + the next layer's input norm (its codes)
DTYPES = (torch.bfloat16, torch.float32)  # fp16 would need integer rounding too (compiled, its casts contract)
MAX_DIM = 8192  # one row per program in registers
# partial rows (3-D shared): columns per program and rows per load. At H = 2048 a token's row is 128 programs of 16
# columns, each summing its 288 rows (top-8, BLOCK_I 16): one load of the 256 routed rows and one masked load of the
# 32 shared ones (4 warps: 32 fp32 values a thread per load). H200, one token, L2-hot rows, PDL on, graph-timed
# (results/moe_decode_bench_run3/combine_probe.json): 16 x 256 3.28 us, 8 x 512 3.39, 32 x 128 3.89, 16 x 128
# 3.92, 32 x 64 5.11, 64 x 128 5.67, 64 x 64 8.20, and the first choice 128 x 32 15.5 (16 programs, 9 dependent
# loads each); the one-program kernel over bf16 rows 3.41
PARTS_BLOCK_C = 16
PARTS_BLOCK_S = 256
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # x max |ref|, module docstring


def moe_combine_reference(x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor, routed: torch.Tensor,
                          residual: torch.Tensor) -> torch.Tensor:
    """x, residual [N, H]; routed [N, H], or [N, S, H]: the S weighted expert outputs of each token, summed here in
    fp32 with one rounding (as the grouped W4A16 op's own sum); shared [N, H], or [N, S2, H]: the shared expert's
    output in S2 partial rows, summed the same way (the decode MoE's fp32 slices, `kernels/moe_decode.py`); 3-D
    routed / shared may be fp32 beside a bf16 x; gate_weight [1, H] (`shared_expert_gate.weight`) -> [N, H] in
    x.dtype."""
    if routed.dim() == 3:
        routed = routed.sum(1, dtype=torch.float32).to(x.dtype)
    if shared.dim() == 3:
        shared = shared.sum(1, dtype=torch.float32).to(x.dtype)
    gate = torch.sigmoid(F.linear(x, gate_weight))  # [N, 1]
    return residual + (routed + gate * shared)


def moe_combine_norm_reference(x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor, routed: torch.Tensor,
                               residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, normed): out = `moe_combine_reference(...)` (the layer's output, the next residual stream) and the next
    decoder layer's input norm of it, `rms_norm_zc_reference(out, norm_weight, eps)` (or the final norm's)."""
    from kernels.rms_norm import rms_norm_zc_reference

    out = moe_combine_reference(x, gate_weight, shared, routed, residual)
    return out, rms_norm_zc_reference(out, norm_weight, eps)


def moe_combine_norm_fp8_reference(x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor,
                                   routed: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                   input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, normed, codes): `moe_combine_norm_reference` and the e4m3 codes of `normed` with the static scale of the
    FP8 projections that read it (`fp8_quant.quantize_static_reference`), as `rms_norm_zc_fp8` gives them."""
    from kernels.fp8_quant import with_static_codes

    out, normed = moe_combine_norm_reference(x, gate_weight, shared, routed, residual, norm_weight, eps)
    return (out, *with_static_codes(normed, input_scale))


if triton is not None:

    @triton.jit
    def _shared_gate(xr, w, cols, ok, dt: tl.constexpr, INTERPRET: tl.constexpr):
        """sigmoid(x . w_gate) of the row at xr, both roundings to dt as torch's two ops (`cols` cover all of H)."""
        xv = tl.load(xr + cols, mask=ok, other=0.0).to(tl.float32)
        wv = tl.load(w + cols, mask=ok, other=0.0).to(tl.float32)
        gate = _round(tl.sum(xv * wv, axis=0), dt, INTERPRET)  # the GEMV's one rounding
        # torch's sigmoid: 1 / (1 + expf(-g)) with the accurate expf and an IEEE division (tl.sigmoid is
        # ex2.approx + div.full on NVIDIA: a few fp32 ulps off, enough to flip the rounded gate now and then)
        if INTERPRET:  # numpy's exp; libdevice is not interpreted
            ex = tl.exp(-gate)
        else:
            ex = libdevice.exp(-gate)
        return _round(tl.div_rn(tl.full(ex.shape, 1.0, tl.float32), 1.0 + ex), dt, INTERPRET)

    @triton.jit
    def _sum_rows(base, n, s_row, cols, ok, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        """fp32 sum of n rows (s_row apart) at columns `cols`, BLOCK_S rows per load (all in flight at once)."""
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for r0 in range(0, n, BLOCK_S):
            r = r0 + tl.arange(0, BLOCK_S)
            tile = tl.load(base + r[:, None] * s_row + cols[None, :], mask=(r < n)[:, None] & ok[None, :], other=0.0)
            acc += tl.sum(tile.to(tl.float32), axis=0)
        return acc

    @triton.jit
    def _moe_combine_parts_kernel(x, w, shared, routed, residual, out, H, S, S2, s_x, s_s, s_ss, s_r, s_rs, s_res,
                                  s_o, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
                                  INTERPRET: tl.constexpr, USE_PDL: tl.constexpr = False):
        # grid (N, cdiv(H, BLOCK_C)): routed [N, S, H] and shared [N, S2, H] partial rows (fp32 or dt), summed in
        # fp32 (BLOCK_S rows per load: a decode MoE hands over 288 rows per token), each sum rounded once; the
        # gate's dot is over the whole row in every program (x and w_gate: 8 KB at H = 2048, L2 hits)
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        row = tl.program_id(0).to(tl.int64)
        dt = out.dtype.element_ty
        full = tl.arange(0, BLOCK_H)
        gate = _shared_gate(x + row * s_x, w, full, full < H, dt, INTERPRET)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cols < H
        sh = _round(_sum_rows(shared + row * s_s, S2, s_ss, cols, ok, BLOCK_S, BLOCK_C), dt, INTERPRET)
        ro = _round(_sum_rows(routed + row * s_r, S, s_rs, cols, ok, BLOCK_S, BLOCK_C), dt, INTERPRET)
        res = tl.load(residual + row * s_res + cols, mask=ok, other=0.0).to(tl.float32)
        t = _round(gate * sh, dt, INTERPRET)
        u = _round(ro + t, dt, INTERPRET)
        tl.store(out + row * s_o + cols, _cast(res + u, dt, INTERPRET), mask=ok)

    @triton.jit
    def _moe_combine_kernel(x, w, shared, routed, residual, out, H, s_x, s_s, s_r, s_rs, s_res, s_o,
                            nw, normed, s_n, eps, codes, s_c, s_in,
                            S: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr, NORM: tl.constexpr = False,
                            QUANT: tl.constexpr = False, USE_PDL: tl.constexpr = False):
        # routed: S rows per token, s_rs apart (S = 1 for an already summed [N, H]). NORM: also the next layer's
        # input norm of the stored row (the "moe_combine_norm" ops; nw [H] its zero-centred weight, normed [N, H]),
        # QUANT: and that norm's e4m3 codes with the static scale s_in (fp32 []), as kernels/rms_norm.py's
        # _rms_norm_zc_kernel computes them from the stored row.
        # Every load (the static scale too) is issued before the first reduction (the gate's dot, the norm's sum of
        # squares: CTA barriers that later loads do not cross), and the k routed rows unrolled (S constexpr): one
        # round trip for all of them. With a runtime S the rows' loop waited for each load in turn: 2.9-3.4 us a
        # call at top-8 (H200, moe_decode_bench run 3), ~5.4 us on a profiled lone step's chain (profile run 23).
        # The same operations in the same order: the same bits.
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        ok = cols < H
        dt = out.dtype.element_ty
        ro = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(S):  # the top-k sum in fp32, in slot order, rounded once
            ro += tl.load(routed + row * s_r + j * s_rs + cols, mask=ok, other=0.0).to(tl.float32)
        sh = tl.load(shared + row * s_s + cols, mask=ok, other=0.0).to(tl.float32)
        res = tl.load(residual + row * s_res + cols, mask=ok, other=0.0).to(tl.float32)
        if NORM:
            w1 = 1.0 + tl.load(nw + cols, mask=ok, other=0.0).to(tl.float32)
        sc = _static_scale(s_in, QUANT)
        gate = _shared_gate(x + row * s_x, w, cols, ok, dt, INTERPRET)
        ro = _round(ro, dt, INTERPRET)
        t = _round(gate * sh, dt, INTERPRET)
        u = _round(ro + t, dt, INTERPRET)
        tl.store(out + row * s_o + cols, _cast(res + u, dt, INTERPRET), mask=ok)
        if NORM:  # the norm reads the stored (rounded) row, as the next layer's own norm launch would
            o = _round(res + u, dt, INTERPRET)  # masked columns: 0 (every load there gave 0)
            y = (o * tl.rsqrt(tl.sum(o * o, axis=0) / H + eps)) * w1
            yo = _cast(y, dt, INTERPRET)
            tl.store(normed + row * s_n + cols, yo, mask=ok)
            if QUANT:
                tl.store(codes + row * s_c + cols, static_codes(_stored_value(y, yo, dt, INTERPRET), sc), mask=ok)


def _interpreted() -> bool:
    return triton is not None and type(_moe_combine_kernel).__name__ == "InterpretedFunction"


@torch.library.custom_op("qwen::moe_combine", mutates_args=())
def moe_combine_op(x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor, routed: torch.Tensor,
                   residual: torch.Tensor) -> torch.Tensor:
    """Same contract as `moe_combine_reference`; 2-D tensors with unit inner stride (checked by `supports`)."""
    n, h = x.shape
    out = x.new_empty((n, h))
    if out.numel() == 0:
        return out
    block_h = triton.next_power_of_2(h)
    r3 = routed if routed.dim() == 3 else routed[:, None]
    if shared.dim() == 3:  # the decode MoE's partial rows: a program per (row, column block)
        block_c = min(block_h, PARTS_BLOCK_C)
        _moe_combine_parts_kernel[(n, triton.cdiv(h, block_c))](
            x, gate_weight, shared, r3, residual, out, h, r3.shape[1], shared.shape[1], x.stride(0), shared.stride(0),
            shared.stride(1), r3.stride(0), r3.stride(1), residual.stride(0), out.stride(0), BLOCK_H=block_h,
            BLOCK_C=block_c, BLOCK_S=PARTS_BLOCK_S, INTERPRET=_interpreted(), num_warps=4, **pdl.launch_options())
        return out
    _one_row_launch(x, gate_weight, shared, routed, residual, out)
    return out


def _one_row_launch(x, gate_weight, shared, routed, residual, out, norm_args: tuple = (), **flags) -> None:
    """`_moe_combine_kernel` over 2-D shared (routed 2-D or 3-D). norm_args, with flags NORM (and QUANT): (weight,
    normed, its row stride, eps, codes, their row stride, scale) -- the next layer's input norm (and its e4m3 codes)
    of the stored rows; without them placeholders the kernel never touches."""
    n, h = x.shape
    block_h = triton.next_power_of_2(h)
    r3 = routed if routed.dim() == 3 else routed[:, None]
    _moe_combine_kernel[(n,)](x, gate_weight, shared, r3, residual, out, h, x.stride(0),
                              shared.stride(0), r3.stride(0), r3.stride(1), residual.stride(0), out.stride(0),
                              *(norm_args or (out, out, 0, 0.0, out, 0, out)), S=r3.shape[1], BLOCK_H=block_h,
                              INTERPRET=_interpreted(), num_warps=min(8, max(1, block_h // 256)), **flags,
                              **pdl.launch_options())


def _combine_norm(x, gate_weight, shared, routed, residual, norm_weight, eps, input_scale):
    """(out, normed, codes) of one launch; codes a placeholder (normed itself) without `input_scale`
    (kernels/rms_norm.py `_codes_args`, as the norm ops there)."""
    from kernels.rms_norm import _codes_args

    out, normed = x.new_empty(x.shape), x.new_empty(x.shape)
    codes, cargs, quant = _codes_args(normed, input_scale)
    if out.numel():
        _one_row_launch(x, gate_weight, shared, routed, residual, out, (norm_weight, normed, normed.stride(0), eps,
                                                                        *cargs), NORM=True, **quant)
    return out, normed, codes


@torch.library.custom_op("qwen::moe_combine_norm", mutates_args=())
def moe_combine_norm_op(x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor, routed: torch.Tensor,
                        residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `moe_combine_norm_reference`; shared 2-D (checked by `supports_norm`)."""
    return _combine_norm(x, gate_weight, shared, routed, residual, norm_weight, eps, None)[:2]


@torch.library.custom_op("qwen::moe_combine_norm_fp8", mutates_args=())
def moe_combine_norm_fp8_op(x: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor, routed: torch.Tensor,
                            residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, input_scale: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `moe_combine_norm_fp8_reference`; shared 2-D, a one-element fp32 scale."""
    return _combine_norm(x, gate_weight, shared, routed, residual, norm_weight, eps, input_scale)


@moe_combine_norm_op.register_fake
def _(x, gate_weight, shared, routed, residual, norm_weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@moe_combine_norm_fp8_op.register_fake
def _(x, gate_weight, shared, routed, residual, norm_weight, eps, input_scale):
    return x.new_empty(x.shape), x.new_empty(x.shape), torch.empty(x.shape, dtype=torch.float8_e4m3fn,
                                                                     device=x.device)


@moe_combine_op.register_fake
def _(x, gate_weight, shared, routed, residual):
    return x.new_empty(x.shape)


def moe_combine_triton(x, gate_weight, shared, routed, residual) -> torch.Tensor:
    """Same contract as `moe_combine_reference`."""
    return moe_combine_op(x, gate_weight, shared, routed, residual)


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(x, gate_weight, shared, routed, residual) -> dict[str, Any]:
    ts = (x, gate_weight, shared, routed, residual)
    h = x.shape[-1] if x.dim() == 2 else 0
    return dict(device=x.device.type, capability=torch.cuda.get_device_capability(x.device) if x.is_cuda else None,
                same_device=len({t.device for t in ts}) == 1, dim=h,
                # 3-D partial rows may be fp32 beside a bf16 model
                dtypes={t.dtype for t in ts if not (t.dim() == 3 and t.dtype == torch.float32)} or {torch.float32},
                shapes_ok=x.dim() == 2 and tuple(gate_weight.shape) == (1, h) and residual.shape == x.shape
                and (shared.shape == x.shape or _partial_rows(shared, x))
                and (routed.shape == x.shape or _partial_rows(routed, x)),
                unit_strides=all(t.dim() and t.stride(-1) == 1 for t in ts))


def _partial_rows(t: torch.Tensor, x: torch.Tensor) -> bool:
    """t is [N, S >= 1, H] beside x [N, H], in x's dtype or fp32."""
    return (t.dim() == 3 and x.dim() == 2 and t.shape[0] == x.shape[0] and t.shape[2] == x.shape[1]
            and t.shape[1] >= 1 and t.dtype in (x.dtype, torch.float32))


def supports(*, device: str, capability, same_device: bool, dtypes: set, dim: int, shapes_ok: bool,
             unit_strides: bool, **_: Any) -> bool:
    """Triton able to run on `device` (cuda >= sm_80, or the interpreter on CPU); every tensor on it, of one dtype in
    DTYPES (3-D partial rows also fp32); 2-D [N, H] tensors (routed and shared also [N, S, H]), a [1, H] gate weight,
    1 <= H <= MAX_DIM; unit inner strides."""
    if triton is None:
        return False
    device_ok = triton_device_ok(device, capability, _interpreted())
    return (device_ok and same_device and len(dtypes) == 1 and next(iter(dtypes)) in DTYPES and shapes_ok
            and 1 <= dim <= MAX_DIM and unit_strides)


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> str | None:
    return tolerance.compare(out, ref, TOLERANCE[ref.dtype] if tol is None else tol)


def random_inputs(n: int, h: int, dtype=torch.float32, seed: int = 0, device="cpu", massive_row: bool = True) -> tuple:
    """Model-like: x ~N(0, 1) (normed), gate weight ~N(0, 0.02) (logits O(0.1-1)), shared / routed ~N(0, 0.1), a
    residual stream ~N(0, 1), with (massive_row) its first row x 100."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen)
    w = torch.randn(1, h, generator=gen) * 0.02
    shared, routed = (torch.randn(n, h, generator=gen) * 0.1 for _ in range(2))
    residual = torch.randn(n, h, generator=gen)
    if massive_row:
        residual[0] *= 100
    return tuple(t.to(dtype).to(device) for t in (x, w, shared, routed, residual))


def _sample(device) -> tuple[tuple, dict]:
    return random_inputs(3, 96, torch.bfloat16, device=device, massive_row=False), {}


def _sample_norm(device) -> tuple[tuple, dict]:
    # routed as top-2 unsummed rows (the decode steps' form); a zero-centred norm weight ~N(0, 0.3)
    x, w, shared, routed, residual = random_inputs(3, 96, torch.bfloat16, seed=1, device=device, massive_row=False)
    routed3 = torch.stack((routed, 0.5 * routed), 1)
    nw = (0.3 * torch.randn(96, generator=torch.Generator().manual_seed(2))).to(torch.bfloat16).to(device)
    return (x, w, shared, routed3, residual, nw, 1e-6), {}


def _sample_norm_fp8(device) -> tuple[tuple, dict]:
    args, _ = _sample_norm(device)
    return (*args, torch.tensor(0.01, device=device)), {}


# ---- the next layer's input norm in the same launch ("moe_combine_norm", "moe_combine_norm_fp8") --------------------
# Why: every decoder layer's output goes straight into the next layer's input norm (the last one's into the final
# norm), one more launch of a whole row per token; the one-program-per-row kernel already holds the row it stores.
# 40 launches fewer per decode step (39 input norms, FP8 codes included, and the final norm).
def describe_norm(x, gate_weight, shared, routed, residual, norm_weight, eps=None, input_scale=None
                  ) -> dict[str, Any]:
    from kernels.rms_norm import _scale_ok

    info = describe(x, gate_weight, shared, routed, residual)
    h = info["dim"]
    return dict(info, two_d_shared=shared.dim() == 2,
                norm_ok=tuple(norm_weight.shape) == (h,) and norm_weight.device == x.device
                and norm_weight.dtype in DTYPES and norm_weight.stride(-1) == 1,
                scale_ok=input_scale is None or _scale_ok(input_scale, x))


def supports_norm(*, two_d_shared: bool, norm_ok: bool, scale_ok: bool, **info: Any) -> bool:
    """`supports`, a 2-D shared (the one-row kernel; the decode MoE's partial rows take the column-block kernel,
    which never holds a whole row), a [H] norm weight in DTYPES on x's device, and for the codes a one-element fp32
    scale there."""
    return two_d_shared and norm_ok and scale_ok and supports(**info)


def compare_norm(out, ref, tol: float | None = None) -> str | None:
    """The output by `compare`; the norm (and its codes) as kernels/rms_norm.py compares its own."""
    from kernels import rms_norm

    problem = compare(out[0], ref[0], tol)
    if problem:
        return f"output: {problem}"
    problem = rms_norm.compare(out[1], ref[1], tol) if len(ref) == 2 else rms_norm.compare_fp8(out[1:], ref[1:], tol)
    return None if problem is None else f"norm: {problem}"


def register(registry) -> None:
    tol = ("max |diff| <= 1e-2 x max |ref| for bf16 (the reference's roundings reproduced; the GEMV's summation order "
           "may move the gate one ulp), 1e-5 for fp32")
    registry.add_op(NAME, moe_combine_reference, sample=_sample, compare=compare, describe=describe, tolerance=tol)
    registry.add_implementation(NAME, "triton", moe_combine_triton, supports)
    norm_tol = f"the output as moe_combine's ({tol}); the norm of it as rms_norm_zc's"
    registry.add_op(NORM_NAME, moe_combine_norm_reference, sample=_sample_norm, compare=compare_norm,
                    describe=describe_norm, tolerance=norm_tol)
    registry.add_implementation(NORM_NAME, "triton", moe_combine_norm_op, supports_norm)
    registry.add_op(NORM_FP8_NAME, moe_combine_norm_fp8_reference, sample=_sample_norm_fp8, compare=compare_norm,
                    describe=describe_norm, tolerance=norm_tol + ", its e4m3 codes equal wherever the norm is "
                                                                "bit-identical")
    registry.add_implementation(NORM_FP8_NAME, "triton", moe_combine_norm_fp8_op, supports_norm)
