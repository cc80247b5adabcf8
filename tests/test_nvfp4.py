"""NVFP4 / FP8 reference formats (`kernels/nvfp4.py`): codes, packing and scales compared bitwise against the design
doc's formula (section 2.5, reproduced here verbatim as an independent implementation), lossy round trips against a
stated error band, and the Blackwell W4A4 helpers in emulation (their `torch._scaled_mm` call only on the meta
device)."""

import pytest
import torch

from engine_core.registry import Registry
from kernels.nvfp4 import (
    BLOCK,
    E2M1_VALUES,
    FP8Tensor,
    NVFP4Tensor,
    blocked_offset,
    dequantize_fp8,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    fp8_linear_reference,
    from_blocked,
    nvfp4_block_values,
    pack_e2m1,
    quantize_activation_nvfp4,
    quantize_fp8,
    quantize_nvfp4,
    W4A4_OP,
    describe_w4a4,
    register,
    supports_w4a4,
    supports_w4a4_scaled_mm,
    to_blocked,
    unpack_e2m1,
    w4a4_linear_reference,
    w4a4_linear_scaled_mm,
    w4a4_scaled_mm_args,
    w4a16_linear_reference,
)

# ---- the design doc's self-checked reference (section 2.5), verbatim -------------------------------------------------
DOC_E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
DOC_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def doc_dequant_nvfp4(w_u8, w_scale_e4m3, w_scale_2, block=16):
    codes = torch.stack(((w_u8 & 0xF).long(), (w_u8 >> 4).long()), -1).reshape(w_u8.shape[0], -1)
    return DOC_E2M1[codes] * w_scale_e4m3.float().repeat_interleave(block, 1) * w_scale_2.float()


def doc_quant_nvfp4(w, block=16):
    w = w.float(); N, K = w.shape
    g = w.abs().amax() / (6.0 * 448.0)
    blk = w.view(N, K // block, block)
    s = (blk.abs().amax(-1) / (6.0 * g)).clamp(2**-9, 448.0).to(torch.float8_e4m3fn)
    x = blk / (s.float().unsqueeze(-1) * g)
    a = x.abs().contiguous()
    mag = torch.searchsorted(DOC_BOUNDS, a) + torch.isin(a, DOC_BOUNDS[[1, 3, 5]]).long()
    code = (mag.clamp(max=7) | ((x < 0).long() << 3)).view(N, K).to(torch.uint8)
    return code[:, 0::2] | (code[:, 1::2] << 4), s, g


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern, so that -0.0 != 0.0 and NaNs compare."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# ---- E2M1 codes ------------------------------------------------------------------------------------------------------
def test_every_e2m1_code_decodes_per_the_bit_layout():
    """code = s | e e | m (1 sign, 2 exponent bits with bias 1, 1 mantissa bit); e = 0 is subnormal (m x 0.5)."""
    for code in range(16):
        s, e, m = code >> 3, (code >> 1) & 3, code & 1
        mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
        expect = -mag if s else mag
        got = e2m1_decode(torch.tensor([code], dtype=torch.uint8))
        assert bits(got).item() == bits(torch.tensor([expect])).item(), (code, got.item(), expect)
    assert E2M1_VALUES.tolist() == DOC_E2M1.tolist()


def test_e2m1_encode_round_trips_every_code_and_rounds_ties_to_even():
    codes = torch.arange(16, dtype=torch.uint8)
    back = e2m1_encode(e2m1_decode(codes))
    expect = codes.clone()
    expect[8] = 0  # -0.0 is not < 0: ModelOpt's sign bit is (w < 0), so -0 encodes as +0; both decode to 0
    assert torch.equal(back, expect)
    # each midpoint goes to the neighbour with an even mantissa (code with bit 0 clear)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_decode(e2m1_encode(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_decode(e2m1_encode(-ties)).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    # just off the midpoints: nearest; beyond 6: saturate
    eps = 1e-3
    assert e2m1_decode(e2m1_encode(ties + eps)).tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert e2m1_decode(e2m1_encode(ties - eps)).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    assert e2m1_decode(e2m1_encode(torch.tensor([6.0, 7.0, 1e9, -1e9]))).tolist() == [6.0, 6.0, 6.0, -6.0]


def test_pack_order_low_nibble_is_even_element():
    codes = torch.tensor([[0x1, 0x7, 0x9, 0xF]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x71, 0xF9]]
    assert torch.equal(unpack_e2m1(packed), codes)
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    assert torch.equal(pack_e2m1(unpack_e2m1(every)), every)


# ---- NVFP4 quantise / dequantise -------------------------------------------------------------------------------------
def test_self_check_1_hand_packed_bytes():
    """Design doc self-check 1: K = 32 -> 16 bytes, 2 blocks; 0x71 = (+0.5, +6), 0xF9 = (-0.5, -6)."""
    w = torch.full((1, 16), 0x71, dtype=torch.uint8)
    w[0, 8:] = 0xF9
    s = torch.tensor([[2.0, 0.25]]).to(torch.float8_e4m3fn)
    W = dequantize_nvfp4(w, s, torch.tensor(0.5))
    assert W[0, :2].tolist() == [0.5, 6.0] and W[0, 16:18].tolist() == [-0.0625, -0.75]
    assert torch.equal(bits(W), bits(doc_dequant_nvfp4(w, s, torch.tensor(0.5))))
    assert W.shape == (1, 32) and W.dtype == torch.float32


def test_self_check_2_gaussian_round_trip_error():
    """Design doc self-check 2: ~9.5 % relative Frobenius error on Gaussian weights (measured 0.0952 there)."""
    torch.manual_seed(0)
    Wf = torch.randn(512, 2048) * 0.02
    p, s, g = quantize_nvfp4(Wf)
    assert p.shape == (512, 1024) and p.dtype == torch.uint8
    assert s.shape == (512, 128) and s.dtype == torch.float8_e4m3fn
    assert g.shape == () and g.dtype == torch.float32
    err = float((dequantize_nvfp4(p, s, g) - Wf).norm() / Wf.norm())
    assert 0.08 < err < 0.11, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_design_doc_formula_bitwise(dtype):
    torch.manual_seed(1)
    w = (torch.randn(96, 256) * torch.rand(96, 1) * 0.1).to(dtype)  # rows of different magnitude
    w[3, :40] = 0.0  # two all-zero blocks + part of a third
    p, s, g = quantize_nvfp4(w)
    dp, ds, dg = doc_quant_nvfp4(w)
    assert bits(g) == bits(dg)
    assert torch.equal(p, dp)
    zero_block = torch.zeros_like(s, dtype=torch.bool)
    zero_block[3, :2] = True  # the only difference: ModelOpt gives an all-zero block scale 1.0, the doc clamps to 2^-9
    assert torch.equal(bits(s)[~zero_block], bits(ds)[~zero_block])
    assert (s.float()[zero_block] == 1.0).all()
    W = dequantize_nvfp4(p, s, g)
    assert torch.equal(bits(W), bits(doc_dequant_nvfp4(p, s, g)))  # bit-exact dequant, zero blocks included


def test_dequant_vs_modelopt_order_within_one_ulp():
    """ModelOpt's dequantize computes value * (scale * global) (two roundings); ours (value * scale) * global (one)."""
    torch.manual_seed(2)
    p, s, g = quantize_nvfp4(torch.randn(64, 512))
    ours = dequantize_nvfp4(p, s, g)
    modelopt = (e2m1_decode(unpack_e2m1(p)).view(64, -1, BLOCK) * (s.float() * g).unsqueeze(-1)).flatten(-2)
    ulps = (bits(ours).long() - bits(modelopt).long()).abs()
    assert ulps.max() <= 1
    differs = ulps > 0
    assert differs.any()  # the two orders really differ somewhere
    assert (e2m1_decode(unpack_e2m1(p))[differs].abs().log2().frac() != 0).all()  # only at |value| = 1.5 * 2^e


def test_scales_are_exact_e4m3_and_block_values_exact_in_bf16():
    torch.manual_seed(3)
    w = torch.randn(128, 512) * torch.logspace(-4, 1, 128).unsqueeze(1)  # 5 decades of row magnitude
    p, s, g = quantize_nvfp4(w)
    sf = s.float()
    assert torch.isfinite(sf).all() and (sf >= 2**-9).all() and (sf <= 448).all()
    assert torch.equal(sf.to(torch.float8_e4m3fn).float(), sf)  # representable: the cast is the identity
    assert sf.max() == 448.0  # the block holding the tensor amax uses the top of the e4m3 range
    # a block's largest element lands on +-6 where its scale is a normal e4m3 number (relative rounding <= 1/16, so
    # it is scaled into [5.6, 6.4]); subnormal scales (< 2^-6: rows ~1e-3 x the tensor amax here) are coarser
    codes = unpack_e2m1(p).view(128, -1, BLOCK)
    normal = sf >= 2**-6
    assert 0 < normal.sum() < normal.numel()
    assert ((codes & 7).amax(-1)[normal] == 7).all()
    vals = nvfp4_block_values(p, s)
    assert torch.equal(vals.to(torch.bfloat16).float(), vals)  # lossless bf16 tile dequant for W4A16 kernels
    assert torch.equal(bits(vals * g), bits(dequantize_nvfp4(p, s, g)))


def test_stacked_experts_per_matrix_and_per_row_global_scales():
    torch.manual_seed(4)
    w = torch.randn(3, 32, 64) * torch.tensor([1.0, 0.01, 5.0]).view(3, 1, 1)
    per = [quantize_nvfp4(w[e]) for e in range(3)]
    gs = torch.stack([q.global_scale for q in per])
    stacked = quantize_nvfp4(w, global_scale=gs)  # one global per matrix, like ModelOpt's per-expert export
    for e in range(3):
        assert torch.equal(stacked.packed[e], per[e].packed)
        assert torch.equal(bits(stacked.scales[e]), bits(per[e].scales))
    dq = dequantize_nvfp4(*stacked)
    rows = gs[:, None].expand(3, 32)  # the same scale given per output row
    assert torch.equal(bits(dequantize_nvfp4(stacked.packed, stacked.scales, rows)), bits(dq))
    for e in range(3):
        assert torch.equal(bits(dq[e]), bits(dequantize_nvfp4(*per[e])))
    assert NVFP4Tensor(*stacked).shape == (3, 32, 64)


def test_nvfp4_errors():
    with pytest.raises(ValueError, match="divisible by 16"):
        quantize_nvfp4(torch.randn(4, 40))
    p, s, g = quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_nvfp4(p.to(torch.int8), s, g)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_nvfp4(p, s.float(), g)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_nvfp4(p, s[:, :1], g)
    with pytest.raises(ValueError, match="global scale"):
        dequantize_nvfp4(p, s, torch.ones(3))


# ---- FP8 per-tensor --------------------------------------------------------------------------------------------------
def test_fp8_round_trip():
    torch.manual_seed(5)
    w = torch.randn(256, 128) * 0.05
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == () and scale.dtype == torch.float32
    assert bits(scale) == bits(w.abs().amax() / 448.0)
    assert q.float().abs().max() == 448.0
    d = dequantize_fp8(q, scale)
    assert torch.equal(bits(d), bits(q.float() * scale))
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 for normals, absolute <= 2^-10 * scale for subnormals
    assert ((d - w).abs() <= torch.maximum(w.abs() * 2**-4, scale * 2**-10)).all()
    assert float((d - w).norm() / w.norm()) < 0.03
    assert torch.equal(quantize_fp8(d, scale)[0].view(torch.uint8), q.view(torch.uint8))  # re-quantise: identical
    # a static activation scale smaller than needed saturates instead of overflowing to NaN
    x = torch.tensor([1.0, -1000.0, 1e6])
    qx, _ = quantize_fp8(x, torch.tensor(1.0))
    assert qx.float().tolist() == [1.0, -448.0, 448.0]
    with pytest.raises(TypeError):
        dequantize_fp8(w, scale)


def test_fp8_linear_reference_is_scaled_mm_arithmetic():
    """torch._scaled_mm (per-tensor FP8, the Hopper path) also runs on CPU: same products, fp32 sums."""
    torch.manual_seed(8)
    x = torch.randn(7, 256)
    q, s = quantize_fp8(torch.randn(96, 256) * 0.05)
    w = FP8Tensor(q, s, torch.tensor(4.0 / 448))
    y = fp8_linear_reference(x, w, out_dtype=torch.float32)
    xq, _ = quantize_fp8(x, w.input_scale)
    mm = torch._scaled_mm(xq, w.data.t(), scale_a=w.input_scale, scale_b=w.scale, out_dtype=torch.float32)
    torch.testing.assert_close(y, mm, rtol=1e-6, atol=1e-6)  # fp32 summation order only
    exact = x @ dequantize_fp8(q, s).T
    assert float((y - exact).norm() / exact.norm()) < 0.05  # activation quantisation: 3 mantissa bits
    weight_only = fp8_linear_reference(x, FP8Tensor(q, s))
    torch.testing.assert_close(weight_only, exact, rtol=1e-6, atol=1e-6)


def test_w4a16_linear_reference():
    torch.manual_seed(9)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    w = quantize_nvfp4(torch.randn(48, 64) * 0.05)
    y = w4a16_linear_reference(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 48)
    torch.testing.assert_close(y.float(), x.float() @ dequantize_nvfp4(*w).T, rtol=8e-3, atol=1e-3)  # bf16 output
    per_row = NVFP4Tensor(w.packed, w.scales, w.global_scale.expand(48))
    assert torch.equal(w4a16_linear_reference(x, per_row), y)


# ---- Blackwell W4A4, in emulation --------------------------------------------------------------------------------
def torchao_to_blocked(m: torch.Tensor) -> torch.Tensor:
    """torchao `to_blocked` (pytorch/ao torchao/prototype/mx_formats/utils.py), written from its description."""
    rows, cols = m.shape
    rb, cb = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(rb * 128, cb * 4, dtype=m.dtype)
    padded[:rows, :cols] = m
    blocks = padded.view(rb, 128, cb, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


@pytest.mark.parametrize("shape", [(128, 4), (256, 8), (100, 5), (1, 2), (300, 130)])
def test_swizzle_round_trip_and_layout(shape):
    rows, cols = shape
    m = torch.arange(1, rows * cols + 1, dtype=torch.float32).view(rows, cols)  # distinct nonzero entries
    blk = to_blocked(m)
    assert blk.numel() == 128 * -(-rows // 128) * 4 * -(-cols // 4)  # torch._scaled_mm's expected scale numel
    assert torch.equal(blk, torchao_to_blocked(m))
    assert torch.equal(from_blocked(blk, rows, cols), m)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    assert torch.equal(blk[blocked_offset(r, c, cols)], m)  # the cuBLAS layout formula, entry by entry
    assert (blk != 0).sum() == rows * cols  # padding is zero
    e4 = torch.rand(rows, cols).to(torch.float8_e4m3fn)  # and it works on the real dtype
    assert torch.equal(from_blocked(to_blocked(e4), rows, cols).view(torch.uint8), e4.view(torch.uint8))


def test_w4a4_emulation_equals_dequantised_matmul():
    torch.manual_seed(6)
    x = torch.randn(3, 5, 128)
    w = quantize_nvfp4(torch.randn(96, 128) * 0.05)
    y = w4a4_linear_reference(x, w, out_dtype=torch.float32)
    xq = quantize_activation_nvfp4(x)
    assert xq.packed.shape == (15, 64) and bits(xq.global_scale) == bits(x.abs().amax() / 2688.0)
    dense = (dequantize_nvfp4(*xq) @ dequantize_nvfp4(*w).T).view(3, 5, 96)
    torch.testing.assert_close(y, dense, rtol=1e-5, atol=1e-6)  # same products, different rounding of the globals
    # the GEMM as the tensor core sees it: block scales read through the swizzled buffers via the cuBLAS offsets
    (a, b, sa, sb), alpha = w4a4_scaled_mm_args(xq, w)
    assert a.dtype == torch.float4_e2m1fn_x2 and b.shape == (64, 96) and b.stride() == (1, 64)  # b column-major
    M, N, KB = 15, 96, 128 // BLOCK
    kb = torch.arange(128) // BLOCK
    sx = sa.float()[blocked_offset(torch.arange(M)[:, None], kb[None, :], KB)]
    sw = sb.float()[blocked_offset(torch.arange(N)[:, None], kb[None, :], KB)]
    vx = e2m1_decode(unpack_e2m1(a.view(torch.uint8))) * sx
    vw = e2m1_decode(unpack_e2m1(b.t().view(torch.uint8))) * sw
    torch.testing.assert_close(((vx @ vw.T) * alpha).view(3, 5, 96), y, rtol=0, atol=0)
    # a static input scale is honoured
    assert bits(quantize_activation_nvfp4(x, torch.tensor(0.01)).global_scale) == bits(torch.tensor(0.01))
    # dynamic activation quantisation error is of the same order as the weights' (~10 % each)
    exact = x @ dequantize_nvfp4(*w).T
    assert float((y - exact).norm() / exact.norm()) < 0.2


def test_w4a4_scaled_mm_operands_pass_torch_shape_checks_on_meta():
    """torch's meta kernel for `_scaled_mm` validates fp4 dtypes, layouts and swizzled scale sizes without a GPU."""
    for M, N, K in [(1, 256, 2048), (33, 512, 64), (200, 2080, 4096)]:
        xq = quantize_activation_nvfp4(torch.randn(M, K))
        w = quantize_nvfp4(torch.randn(N, K))
        (a, b, sa, sb), _ = w4a4_scaled_mm_args(xq, w)
        meta = [t.to("meta") for t in (a, b, sa, sb)]
        out = torch._scaled_mm(*meta, out_dtype=torch.float32)
        assert out.shape == (M, N)
        # the check is real: row-major scales without the 128-row padding are rejected
        with pytest.raises(RuntimeError, match="scale_a should have"):
            torch._scaled_mm(meta[0], meta[1], xq.scales.flatten().to("meta"), meta[3], out_dtype=torch.float32)


@pytest.mark.skipif(not supports_w4a4_scaled_mm(), reason="native NVFP4 _scaled_mm needs CUDA compute capability >= 10")
def test_w4a4_scaled_mm_on_blackwell():  # pragma: no cover - no sm_100 hardware in CI
    torch.manual_seed(7)
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = NVFP4Tensor(*(t.cuda() for t in quantize_nvfp4(torch.randn(512, 2048) * 0.02)))
    ref = w4a4_linear_reference(x.float(), w, out_dtype=torch.float32)
    got = w4a4_linear_scaled_mm(x, w, out_dtype=torch.float32)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


def test_w4a4_per_row_weight_global_scale():
    """The loader hands every weight over with a per-row global [N] (a fused gate/up has two values): the W4A4
    reference and the `_scaled_mm` epilogue factor apply it per output column. Equal rows give the scalar result bit
    for bit; different rows equal the dequantised matmul."""
    torch.manual_seed(8)
    x = torch.randn(7, 64)
    w = quantize_nvfp4(torch.randn(32, 64) * 0.05)
    per_row = w._replace(global_scale=w.global_scale.expand(32).clone())
    y = w4a4_linear_reference(x, w, out_dtype=torch.float32)
    assert torch.equal(w4a4_linear_reference(x, per_row, out_dtype=torch.float32), y)
    g = torch.rand(32) * 1e-4 + 1e-5  # rows with different globals (gate rows vs up rows)
    fused = w._replace(global_scale=g)
    xq = quantize_activation_nvfp4(x)
    dense = dequantize_nvfp4(*xq) @ dequantize_nvfp4(*fused).T
    torch.testing.assert_close(w4a4_linear_reference(x, fused, out_dtype=torch.float32), dense, rtol=1e-5, atol=1e-9)
    _, alpha = w4a4_scaled_mm_args(xq, fused)
    assert alpha.shape == (32,)
    with pytest.raises(ValueError, match=r"scalar or per-row \[N=32\]"):
        w4a4_linear_reference(x, w._replace(global_scale=torch.ones(31)))


def _w4a4_info(n=96, k=160, **override):
    """describe_w4a4 of CPU tensors, then the device / capability a GPU would report (the guard sees only info)."""
    w = quantize_nvfp4(torch.randn(n, k) * 0.02)
    info = describe_w4a4(torch.randn(3, k).to(torch.bfloat16), w, torch.tensor(0.01), torch.bfloat16)
    return {**info, **override}


def test_w4a4_guard_boundaries():
    """supports_w4a4: CUDA, compute capability >= 10.0, float4 dtypes, K % 32 == 0 and N % 16 == 0 (the alignment
    `torch._scaled_mm` checks for float4 operands), matching K, a 2-D weight."""
    blackwell = dict(device="cuda", capability=(10, 0), float4=True)
    assert not supports_w4a4(**_w4a4_info())  # as described on this machine: CPU
    assert _w4a4_info()["device"] == "cpu" and _w4a4_info()["capability"] is None
    assert supports_w4a4(**_w4a4_info(**blackwell))
    assert supports_w4a4(**_w4a4_info(**{**blackwell, "capability": (12, 0)}))
    assert not supports_w4a4(**_w4a4_info(**{**blackwell, "capability": (9, 0)}))  # H200: W4A16
    assert not supports_w4a4(**_w4a4_info(**{**blackwell, "device": "cpu", "capability": None}))
    assert not supports_w4a4(**_w4a4_info(**{**blackwell, "float4": False}))  # a torch without float4 dtypes
    assert supports_w4a4(**_w4a4_info(n=16, k=32, **blackwell))  # the smallest aligned shape
    assert not supports_w4a4(**_w4a4_info(n=96, k=48, **blackwell))  # K/2 = 24 bytes: not a multiple of 16
    assert not supports_w4a4(**_w4a4_info(n=24, k=160, **blackwell))  # N % 16 != 0
    assert not supports_w4a4(**{**_w4a4_info(**blackwell), "k": 128})  # x's K does not match the weight's
    assert not supports_w4a4(**{**_w4a4_info(**blackwell), "dtype": torch.int8})
    stacked = quantize_nvfp4(torch.randn(2, 32, 64))
    info = describe_w4a4(torch.randn(3, 64), stacked)
    assert not info["weight_ok"] and not supports_w4a4(**{**info, **blackwell})


def test_w4a4_scaled_mm_capability_guard(monkeypatch):
    """`supports_w4a4_scaled_mm` (the check `w4a4_linear_scaled_mm` raises on) with a faked CUDA device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap, ok in [((9, 0), False), ((8, 9), False), ((10, 0), True), ((12, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert supports_w4a4_scaled_mm("cuda") is ok, cap
        assert supports_w4a4_scaled_mm("cpu") is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(RuntimeError, match="compute capability >= 10"):
        w4a4_linear_scaled_mm(torch.randn(2, 64), quantize_nvfp4(torch.randn(16, 64)))


def test_w4a4_registry_entry_on_this_machine():
    """Op "nvfp4_w4a4_linear": reference = the emulation; the native path is a "torch"-kind implementation that the
    self-check skips (not fails) where it cannot run, and AUTO falls back to the reference with the reason recorded."""
    reg = Registry()
    register(reg)
    assert reg.ops() == [W4A4_OP]
    spec = reg.spec(W4A4_OP)
    assert spec.reference.fn is w4a4_linear_reference
    assert [(i.name, i.kind.value) for i in spec.implementations] == [("scaled_mm", "torch")]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    outcome = reg.self_check(device)[W4A4_OP]
    if supports_w4a4_scaled_mm(device):  # pragma: no cover - Blackwell only
        assert outcome == "scaled_mm passed", outcome
    else:
        assert outcome == f"scaled_mm skipped (does not support the sample on {device})", outcome
        assert reg.choices()[W4A4_OP]["disabled"] == {}
        args, kwargs = spec.sample(device)
        impl = reg.choose(W4A4_OP, **spec.describe(*args, **kwargs))
        assert impl.name == "reference" and "scaled_mm does not support" in reg.choices()[W4A4_OP]["fallback"]
        # the sample is a real W4A4 call: the reference runs on it, bf16 out
        assert impl.fn(*args, **kwargs).shape == (3, 96)
        reg.set_preference("torch", W4A4_OP)  # an explicit preference never falls back
        with pytest.raises(NotImplementedError, match="preference torch cannot be met"):
            reg.choose(W4A4_OP, **spec.describe(*args, **kwargs))


@pytest.mark.skipif(not supports_w4a4_scaled_mm(), reason="native NVFP4 _scaled_mm needs CUDA compute capability >= 10")
def test_w4a4_scaled_mm_per_row_global_on_blackwell():  # pragma: no cover - no sm_100 hardware in CI
    """The registry's fast path on hardware: bf16 in/out, per-row weight global, static input scale, odd M."""
    torch.manual_seed(9)
    x = torch.randn(37, 2048, device="cuda", dtype=torch.bfloat16)
    w = quantize_nvfp4(torch.randn(512, 2048) * 0.02)
    w = NVFP4Tensor(w.packed.cuda(), w.scales.cuda(), (w.global_scale * (1 + torch.rand(512))).cuda())
    s_in = x.float().abs().amax() / 2688.0
    ref = w4a4_linear_reference(x, w, s_in, torch.bfloat16)
    got = w4a4_linear_scaled_mm(x, w, s_in, torch.bfloat16)
    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert err <= 1e-2, err  # the registry's tolerance (kernels.tolerance.compare)
