"""Gated attention's decode-row preparation in one Triton launch: the q and k head RMSNorms (zero-centred), the
partial RoPE of q and k, and the write of the new k / v rows into the paged KV pool.

Reference `attn_decode_prep_reference` -- exactly the torch code of `GatedAttention.forward_paged` between the
projections and the attention (transformers' `Qwen3_5MoeAttention`):
    q = apply_partial_rope(q_norm(q)),  k = apply_partial_rope(k_norm(k))     (q [N, H, D], k [N, KVH, D])
    k_pool / v_pool [slot_mapping[n]] = k[n] / v[n]                            (pools [blocks, block_size, KVH, D])
(the pools of the model dtype, or both e4m3: then the rows' codes at scale 1.0, `fp8_quant.kv_pool_cast`)
-> q [N, H, D] contiguous (what the decode attention reads); the pools are written in place. Partial RoPE (NeoX
halves on the first RD = cos.shape[-1] dims of each head, the rest passed through), in the model dtype as upstream:
    out_i = R(R(y_i cos_i) + R(rot_i sin_i)),  rot_i = -y_{i + RD/2} (i < RD/2), y_{i - RD/2} (RD/2 <= i < RD)
with y = the normed head (rounded to the model dtype) and R = rounding to the model dtype (none in fp32; there the
compiled kernel may fuse a product and the sum into one FMA, a difference of at most an fp32 ulp from torch).

Why: in a graphed decode step each of the 10 attention layers spends ~18 launches here (two norms, two RoPEs of
~6 ops each: slices, neg, two cats, two muls, an add; two index_copy_ writes; a contiguous copy of q): ~180 of a
lone step's ~1,700 launches. Grid (N, H + KVH): a program normalises and rotates one head of one token; the KVH
programs of a token also copy its v rows. One row of D = 256 per program; the rotation partner of lane i is read
again from memory (lane i +- RD/2) and normalised with the same 1/rms, so no register shuffles are needed.

Numerics: the norm is the `rms_norm_zc` kernel's (fp32 sum of squares, `tl.rsqrt`, x * inv * (1 + w), one rounding);
the RoPE products and sum are rounded like torch's bf16 ops, with integer round-to-nearest-even (`rms_norm._round`:
compiled `.to(bf16).to(fp32)` round trips get contracted). Tolerance as the norm kernels': max |diff| <= 1e-2 x
max |ref| for bf16 (an ulp of the normed value can move with rsqrt), 1e-5 for fp32; k / v pool rows the same, and
every pool row not written must stay bit-identical. bf16 and fp32 only (like moe_combine).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import pdl, tolerance
from kernels.device import E4M3_MIN_CAPABILITY, MIN_CAPABILITY, triton_device_ok

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from kernels.pdl import enter as pdl_enter
    from kernels.fp8_quant import static_codes
    from kernels.rms_norm import _cast, _codes_args, _round, _stored_value
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "attn_decode_prep"
GATE = "attn_output_gate"
GATE_FP8 = "attn_output_gate_fp8"  # + the e4m3 codes of the output (o_proj's static scale)
DTYPES = (torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 1024  # one head row per program in registers; the model has 256
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def attn_decode_prep_reference(q, k, v, q_weight, k_weight, eps: float, cos, sin, slot_mapping, k_pool, v_pool):
    """q [N, H, D]; k, v [N, KVH, D]; q/k norm weights [D]; cos, sin [N, RD]; slot_mapping int64 [N]; pools
    [blocks, block_size, KVH, D] -> (q normed + rotated [N, H, D] contiguous, k_pool, v_pool), the pools written at
    the token slots (in place). Precondition 0 <= slot_mapping < blocks x block_size: the reference raises on a bad
    slot, the kernel (no host sync) would write outside the pool. Duplicate slots (CUDA-graph padding rows sharing
    the scratch block) leave that slot with one of the rows, unspecified which."""
    from kernels.rms_norm import rms_norm_zc_reference
    from qwen_engine.model.attention import apply_partial_rope

    qn = rms_norm_zc_reference(q, q_weight, eps)
    kn = rms_norm_zc_reference(k, k_weight, eps)
    qr = apply_partial_rope(qn.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)  # [N, H, D]
    kr = apply_partial_rope(kn.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    from qwen_engine.model.paged import PagedKV

    PagedKV(k_pool, v_pool).write(slot_mapping, kr, v)  # (the cast of the engine's pools: kv_pool_cast)
    return qr.contiguous(), k_pool, v_pool


def attn_output_gate_reference(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gated attention's output gate, `GatedAttention`'s `o.reshape(n, h * d) * torch.sigmoid(gate.reshape(n,
    -1))`: o [N, H, D] (the decode attention's output), gate [N, H, D] (a strided view of the fused q/gate
    projection) -> [N, H * D] in o's dtype. torch rounds sigmoid(gate) to the dtype, then the product."""
    n = o.shape[0]
    return o.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))


if triton is not None:

    @triton.jit
    def _gate_kernel(o, gate, out, H, D, s_on, s_oh, s_gn, s_gh, s_outn, codes, s_cn, s_in, BLOCK_D: tl.constexpr,
                     INTERPRET: tl.constexpr, QUANT: tl.constexpr = False, USE_PDL: tl.constexpr = False):
        # grid (N, H): one head row. Replaces three launches per attention layer: the copy of the strided gate that
        # its reshape makes, the sigmoid and the product (`_gate_store`: torch's numbers)
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        n, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        dt = out.dtype.element_ty
        g = tl.load(gate + n * s_gn + h * s_gh + d, mask=ok, other=0.0)
        x = tl.load(o + n * s_on + h * s_oh + d, mask=ok, other=0.0)
        _gate_store(x, g, out + n * s_outn + h * D + d, codes + n * s_cn + h * D + d, s_in, ok, dt, INTERPRET, QUANT)

    @triton.jit
    def _gate_store(x, g, out_p, codes_p, s_in, ok, DT: tl.constexpr, INTERPRET: tl.constexpr, QUANT: tl.constexpr):
        """x * sigmoid(g) with torch's numbers -- sigmoid 1 / (1 + exp(-g)) in fp32 with an accurate expf and an IEEE
        division (CUDA's opmath), rounded to DT (`_round`: bit ops, not contracted), the product of the two DT values
        in fp32 (exact for bf16) rounded once -- stored at out_p (mask ok); QUANT: o_proj's activation codes of the
        stored value at codes_p (`fp8_quant.quantize_static_reference`'s bits). x, g: DT values (any shape). Also the
        epilogue of the decode attention's combine (`kernels/paged_attention.py`, GATE)."""
        g = g.to(tl.float32)
        if INTERPRET:  # numpy's exp; libdevice is not interpreted
            e = tl.exp(-g)
        else:  # torch's accurate expf, not tl.exp's ex2.approx
            e = libdevice.exp(-g)
        sig = _round(tl.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + e), DT, INTERPRET)
        x = x.to(tl.float32)
        y = _cast(x * sig, DT, INTERPRET)
        tl.store(out_p, y, mask=ok)
        if QUANT:
            tl.store(codes_p, static_codes(_stored_value(x * sig, y, DT, INTERPRET), tl.load(s_in)), mask=ok)

    @triton.jit
    def _norm_rope(src, w, eps, cos_row, sin_row, d, ok, D, RD, DT: tl.constexpr, INTERPRET: tl.constexpr):
        """One head row: zero-centred RMSNorm (rounded to DT) then partial RoPE (rounded like torch), fp32 out."""
        half = RD // 2
        rope = d < RD
        pd = tl.where(d < half, d + half, d - half)  # rotation partner (only used where rope)
        # every load before the norm's sum (a reduction: a CTA barrier, which later loads do not cross)
        x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        xp = tl.load(src + pd, mask=ok & rope, other=0.0).to(tl.float32)
        w1 = 1.0 + tl.load(w + d, mask=ok, other=0.0).to(tl.float32)
        wp1 = 1.0 + tl.load(w + pd, mask=ok & rope, other=0.0).to(tl.float32)
        c = tl.load(cos_row + d, mask=ok & rope, other=0.0).to(tl.float32)
        s = tl.load(sin_row + d, mask=ok & rope, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)  # as kernels/rms_norm.py's _inv_rms
        y = _round(x * inv * w1, DT, INTERPRET)
        yp = _round(xp * inv * wp1, DT, INTERPRET)
        rot = tl.where(d < half, -yp, yp)
        r = _round(_round(y * c, DT, INTERPRET) + _round(rot * s, DT, INTERPRET), DT, INTERPRET)
        return tl.where(rope, r, y)

    @triton.jit
    def _attn_prep_kernel(q, k, v, wq, wk, cos, sin, slots, k_pool, v_pool, q_out, H, D, RD, eps,
                          s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_cn, s_sn, s_on, s_oh, s_pt, s_ph,
                          BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr = False,
                          KV_CODES: tl.constexpr = False):
        # grid (N, H + KVH): program (n, j) -- query head j of token n for j < H, else kv head j - H (k and v);
        # KV_CODES: e4m3 pools, each row's codes at scale 1.0 (`fp8_quant.kv_pool_cast`'s bits: static_codes)
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        n, j = tl.program_id(0), tl.program_id(1)
        n64 = n.to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        dt = q_out.dtype.element_ty
        cos_row = cos + n64 * s_cn
        sin_row = sin + n64 * s_sn
        if j < H:
            out = _norm_rope(q + n64 * s_qn + j * s_qh, wq, eps, cos_row, sin_row, d, ok, D, RD, dt, INTERPRET)
            tl.store(q_out + n64 * s_on + j * s_oh + d, out.to(dt), mask=ok)
        else:
            h = j - H
            slot = tl.load(slots + n).to(tl.int64)  # (loads before the norm's reduction, as in _norm_rope)
            vv = tl.load(v + n64 * s_vn + h * s_vh + d, mask=ok, other=0.0)
            out = _norm_rope(k + n64 * s_kn + h * s_kh, wk, eps, cos_row, sin_row, d, ok, D, RD, dt, INTERPRET)
            if KV_CODES:
                tl.store(k_pool + slot * s_pt + h * s_ph + d, static_codes(out, 1.0), mask=ok)
                tl.store(v_pool + slot * s_pt + h * s_ph + d, static_codes(vv.to(tl.float32), 1.0), mask=ok)
            else:
                tl.store(k_pool + slot * s_pt + h * s_ph + d, out.to(k_pool.dtype.element_ty), mask=ok)
                tl.store(v_pool + slot * s_pt + h * s_ph + d, vv.to(v_pool.dtype.element_ty), mask=ok)


def _interpreted() -> bool:
    return triton is not None and type(_attn_prep_kernel).__name__ == "InterpretedFunction"


def _gate(o: torch.Tensor, gate: torch.Tensor, input_scale: torch.Tensor | None):
    n, heads, d = o.shape
    out = o.new_empty((n, heads * d))
    codes, cargs, quant = _codes_args(out, input_scale)  # (a placeholder without a scale)
    if out.numel():
        _gate_kernel[(n, heads)](o, gate, out, heads, d, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1),
                                 out.stride(0), *cargs, BLOCK_D=triton.next_power_of_2(d), INTERPRET=_interpreted(),
                                 **quant, num_warps=1 if d <= 256 else 4, **pdl.launch_options())
    return out, codes


@torch.library.custom_op("qwen::attn_output_gate", mutates_args=())
def attn_output_gate_op(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o, gate [N, H, D] -> o * sigmoid(gate) [N, H * D] contiguous in o's dtype; contract:
    `attn_output_gate_reference`. Guards: `supports_gate` (checked by the registry)."""
    return _gate(o, gate, None)[0]


@torch.library.custom_op("qwen::attn_output_gate_fp8", mutates_args=())
def attn_output_gate_fp8_op(o: torch.Tensor, gate: torch.Tensor, input_scale: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`attn_output_gate_op` and the e4m3 codes of its output with o_proj's static scale (fp32 []), one launch;
    contract: `attn_output_gate_fp8_reference`."""
    return _gate(o, gate, input_scale)


@attn_output_gate_fp8_op.register_fake
def _(o, gate, input_scale):
    shape = (o.shape[0], o.shape[1] * o.shape[2])
    return o.new_empty(shape), o.new_empty(shape, dtype=torch.float8_e4m3fn)


def attn_output_gate_fp8_reference(o: torch.Tensor, gate: torch.Tensor, input_scale: torch.Tensor
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, codes): y = `attn_output_gate_reference`, codes = `fp8_quant.quantize_static_reference(y, input_scale)`."""
    from kernels.fp8_quant import with_static_codes

    return with_static_codes(attn_output_gate_reference(o, gate), input_scale)


def attn_output_gate_fp8_triton(o, gate, input_scale):
    """Same contract as `attn_output_gate_fp8_reference`."""
    return attn_output_gate_fp8_op(o, gate, input_scale)


@attn_output_gate_op.register_fake
def _(o, gate):
    return o.new_empty((o.shape[0], o.shape[1] * o.shape[2]))


def attn_output_gate_triton(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Same contract as `attn_output_gate_reference`."""
    return attn_output_gate_op(o, gate)


@torch.library.custom_op("qwen::attn_decode_prep_", mutates_args=("k_pool", "v_pool"))
def attn_decode_prep_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                      k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      slot_mapping: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
    """Writes the pools in place; returns q [N, H, D] contiguous. Guards: `supports` (checked by the registry)."""
    n, heads, d = q.shape
    kvh = k.shape[1]
    q_out = q.new_empty((n, heads, d))
    if n == 0:
        return q_out
    kp, vp = k_pool.view(-1, kvh, d), v_pool.view(-1, kvh, d)  # [slots, KVH, D] (contiguous pools)
    _attn_prep_kernel[(n, heads + kvh)](
        q, k, v, q_weight, k_weight, cos, sin, slot_mapping, kp, vp, q_out, heads, d, cos.shape[-1], eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), kp.stride(0), kp.stride(1),
        BLOCK_D=triton.next_power_of_2(d), INTERPRET=_interpreted(), num_warps=1 if d <= 256 else 4,
        KV_CODES=k_pool.dtype == torch.float8_e4m3fn, **pdl.launch_options())
    return q_out


@attn_decode_prep_.register_fake
def _(q, k, v, q_weight, k_weight, eps, cos, sin, slot_mapping, k_pool, v_pool):
    return q.new_empty(q.shape)


def attn_decode_prep_triton(q, k, v, q_weight, k_weight, eps, cos, sin, slot_mapping, k_pool, v_pool):
    """Same contract as `attn_decode_prep_reference`."""
    return attn_decode_prep_(q, k, v, q_weight, k_weight, eps, cos, sin, slot_mapping, k_pool, v_pool), k_pool, v_pool


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(q, k, v, q_weight, k_weight, eps, cos, sin, slot_mapping, k_pool, v_pool) -> dict[str, Any]:
    ts = (q, k, v, q_weight, k_weight, cos, sin, k_pool, v_pool)
    n = q.shape[0] if q.dim() == 3 else -1
    d = q.shape[-1] if q.dim() == 3 else 0
    rd = cos.shape[-1] if cos.dim() == 2 else -1
    shapes_ok = (q.dim() == 3 and k.dim() == 3 and k.shape == v.shape and k.shape[0] == n and k.shape[2] == d
                 and q_weight.shape == k_weight.shape == (d,) and cos.shape == sin.shape == (n, rd)
                 and 0 < rd <= d and rd % 2 == 0 and k_pool.dim() == 4 and k_pool.shape == v_pool.shape
                 and k_pool.shape[2:] == k.shape[1:] and slot_mapping.shape == (n,))
    return dict(device=q.device.type, capability=torch.cuda.get_device_capability(q.device) if q.is_cuda else None,
                same_device=len({t.device for t in (*ts, slot_mapping)}) == 1, dtypes={t.dtype for t in ts[:7]},
                pool_dtypes={k_pool.dtype, v_pool.dtype},
                slots_ok=slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous(), shapes_ok=shapes_ok,
                head_dim=d, pools_contiguous=k_pool.is_contiguous() and v_pool.is_contiguous(),
                unit_strides=all(t.dim() and t.stride(-1) == 1 for t in ts))


def supports(*, device: str, capability, same_device: bool, dtypes: set, slots_ok: bool, shapes_ok: bool,
             head_dim: int, pools_contiguous: bool, unit_strides: bool, pool_dtypes: set = frozenset(),
             **_: Any) -> bool:
    """Triton able to run on `device` (cuda >= sm_80, or the interpreter on CPU); every tensor there and of one dtype
    (bf16 or fp32), the pools too or both e4m3 on sm_89+ (`pool_dtypes`, absent: the others';
    `kernels.device.E4M3_MIN_CAPABILITY`); consistent shapes, an even rotary width <= D, D <= MAX_HEAD_DIM; int64
    slots; contiguous pools; unit inner strides (q may be a strided view of the fused q/gate projection)."""
    if triton is None:
        return False
    e4m3 = pool_dtypes == {torch.float8_e4m3fn}
    device_ok = triton_device_ok(device, capability, _interpreted(), E4M3_MIN_CAPABILITY if e4m3 else MIN_CAPABILITY)
    pools_ok = not pool_dtypes or pool_dtypes <= dtypes or e4m3
    return (device_ok and same_device and len(dtypes) == 1 and next(iter(dtypes)) in DTYPES and pools_ok and slots_ok
            and shapes_ok and 1 <= head_dim <= MAX_HEAD_DIM and pools_contiguous and unit_strides)


def describe_gate(o, gate) -> dict[str, Any]:
    d = o.shape[-1] if o.dim() == 3 else 0
    return dict(device=o.device.type, capability=torch.cuda.get_device_capability(o.device) if o.is_cuda else None,
                same_device=o.device == gate.device, dtypes={o.dtype, gate.dtype},
                shapes_ok=o.dim() == 3 and gate.shape == o.shape, head_dim=d,
                unit_strides=o.dim() == 3 and o.stride(-1) == 1 and gate.stride(-1) == 1)


def supports_gate(*, device: str, capability, same_device: bool, dtypes: set, shapes_ok: bool, head_dim: int,
                  unit_strides: bool, **_: Any) -> bool:
    """Triton able to run on `device`; o and gate there, of one dtype (bf16 or fp32), one shape [N, H, D] with
    D <= MAX_HEAD_DIM; unit inner strides (rows and heads may be strided: the gate is a view)."""
    if triton is None:
        return False
    return (triton_device_ok(device, capability, _interpreted()) and same_device and len(dtypes) == 1
            and next(iter(dtypes)) in DTYPES and shapes_ok and 1 <= head_dim <= MAX_HEAD_DIM and unit_strides)


def describe_gate_fp8(o, gate, input_scale=None) -> dict[str, Any]:
    from kernels.rms_norm import _scale_ok

    return dict(describe_gate(o, gate), scale_ok=_scale_ok(input_scale, o))


def supports_gate_fp8(*, scale_ok: bool, **info: Any) -> bool:
    """`supports_gate`, and a one-element fp32 scale on o's device."""
    return scale_ok and supports_gate(**info)


def compare_gate_fp8(out, ref) -> str | None:
    """The output by `compare_gate`, the codes as `kernels.rms_norm.compare_fp8`'s (equal where the output is)."""
    from kernels.rms_norm import compare_fp8

    return compare_fp8(out, ref, TOLERANCE[ref[0].dtype])


def _sample_gate_fp8(device) -> tuple[tuple, dict]:
    return (*gate_inputs(3, 4, 96, seed=3, device=device), torch.tensor(0.004, device=device)), {}


def compare_gate(out, ref) -> str | None:
    """Within TOLERANCE x max |ref| (bf16: an exp ulp may move sigmoid's rounding by one bf16 ulp; fp32 ulps)."""
    return tolerance.compare(out, ref, TOLERANCE[ref.dtype])


def compare(out, ref) -> str | None:
    """q and both whole pools within TOLERANCE x max |ref| (rows not written are then equal up to that too; the
    tests check them bit for bit); e4m3 pools by `compare_codes`."""
    if ref[1].dtype == torch.float8_e4m3fn:
        problem = tolerance.compare(out[0], ref[0], TOLERANCE[ref[0].dtype])
        return f"q: {problem}" if problem else compare_codes(out[1], ref[1], out[2], ref[2])
    for name, a, b in zip(("q", "k_pool", "v_pool"), out, ref):
        problem = tolerance.compare(a, b, TOLERANCE[b.dtype])
        if problem:
            return f"{name}: {problem}"
    return None


def compare_codes(k_pool, k_ref, v_pool, v_ref) -> str | None:
    """e4m3 pools (`fp8_quant.kv_pool_cast`'s codes): v's bit for bit (copied, then cast the same way); k's each
    within one e4m3 step of the reference's (2^-3 relative, + 2^-9 near zero) -- the normed value may differ by a
    model-dtype ulp (TOLERANCE) and so cross a code's rounding boundary; tests/test_kv_fp8.py also holds >= 99% of
    them equal at the model's head size."""
    if k_pool.dtype != k_ref.dtype or v_pool.dtype != v_ref.dtype or k_pool.shape != k_ref.shape:
        return f"pools {k_pool.dtype} / {v_pool.dtype} {tuple(k_pool.shape)}, want {k_ref.dtype} {tuple(k_ref.shape)}"
    if not torch.equal(v_pool.view(torch.uint8), v_ref.view(torch.uint8)):
        return "v_pool: e4m3 codes differ"
    got, want = k_pool.float(), k_ref.float()
    off = (got - want).abs() > want.abs() * 2 ** -3 + 2 ** -9
    return f"k_pool: {int(off.sum())} codes more than one e4m3 step off" if bool(off.any()) else None


def random_inputs(n: int, heads: int, kv_heads: int, d: int, rd: int, num_blocks: int = 4, block_size: int = 4,
                  dtype=torch.float32, seed: int = 0, device="cpu") -> tuple:
    """Model-like decode inputs: q as a strided view of a fused [N, H, 2D] q/gate projection, k / v [N, KVH, D] ~N(0,
    1) (one k head scaled by 30: a large-norm head), zero-centred norm weights ~N(0, 0.3), cos / sin of real
    positions, distinct slots in a pool of random contents."""
    gen = torch.Generator().manual_seed(seed)
    qg = torch.randn(n, heads, 2 * d, generator=gen)
    k = torch.randn(n, kv_heads, d, generator=gen)
    k[:, 0] *= 30
    v = torch.randn(n, kv_heads, d, generator=gen)
    wq, wk = (0.3 * torch.randn(d, generator=gen) for _ in range(2))
    pos = torch.randint(0, 4096, (n,), generator=gen).float()
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rd, 2).float() / rd))
    emb = torch.cat([pos[:, None] * inv_freq[None]] * 2, dim=-1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    k_pool = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, d, generator=gen)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return (cast(qg)[..., :d], cast(k), cast(v), cast(wq), cast(wk), 1e-6, cast(emb.cos()), cast(emb.sin()),
            slots.to(device), cast(k_pool), cast(v_pool))


def _sample(device) -> list[tuple[tuple, dict]]:
    # in an engine of e4m3 KV pools the same on e4m3 pools too (`fp8_quant.with_e4m3_pools`): the self-check covers
    # the codes such an engine writes
    from kernels.fp8_quant import with_e4m3_pools

    args = random_inputs(3, 4, 2, 64, 16, dtype=torch.bfloat16, seed=1, device=device)
    return with_e4m3_pools(args, len(args) - 2)  # k_pool, v_pool: random_inputs' last two


def gate_inputs(n: int, heads: int, d: int, dtype=torch.bfloat16, seed: int = 0, device="cpu"):
    """(o [N, H, D] ~N(0, 1) contiguous, gate [N, H, D] ~N(0, 4) as the strided second half of a fused [N, H, 2D]
    projection): gates from saturated to ~0.5."""
    gen = torch.Generator().manual_seed(seed)
    qg = torch.randn(n, heads, 2 * d, generator=gen) * 2
    return torch.randn(n, heads, d, generator=gen).to(dtype).to(device), qg.to(dtype).to(device)[..., d:]


def _sample_gate(device) -> tuple[tuple, dict]:
    return gate_inputs(3, 4, 96, seed=2, device=device), {}


def register(registry) -> None:
    registry.add_op(NAME, attn_decode_prep_reference, sample=_sample, compare=compare, describe=describe, mutates=True,
                    tolerance="q and the pools within 1e-2 x max |ref| for bf16 (the norm's rsqrt may move a normed "
                              "value one ulp; RoPE roundings reproduced), 1e-5 for fp32")
    registry.add_implementation(NAME, "triton", attn_decode_prep_triton, supports)
    registry.add_op(GATE, attn_output_gate_reference, sample=_sample_gate, compare=compare_gate,
                    describe=describe_gate, tolerance="within 1e-2 x max |ref| for bf16 (torch's roundings "
                    "reproduced; an exp ulp can move one), 1e-5 for fp32")
    registry.add_implementation(GATE, "triton", attn_output_gate_triton, supports_gate)
    registry.add_op(GATE_FP8, attn_output_gate_fp8_reference, sample=_sample_gate_fp8, compare=compare_gate_fp8,
                    describe=describe_gate_fp8, tolerance="the output as attn_output_gate's; its e4m3 codes equal "
                    "wherever the output is bit-identical")
    registry.add_implementation(GATE_FP8, "triton", attn_output_gate_fp8_triton, supports_gate_fp8)
