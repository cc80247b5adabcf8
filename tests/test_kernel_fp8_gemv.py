"""kernels/fp8_gemv.py: the decode FP8 W8A8 GEMV (CUDA cores; the quantiser in its loop or one launch before it)
against `fp8_linear_reference`, and its registry handoff (`kernels.fp8_linear`: "triton_quant+gemv" / "triton_gemv"
for 1-4 rows, the next implementation otherwise).

Runs on the CPU under TRITON_INTERPRET=1 (tests/conftest.py) and on a GPU compiled. Tolerance per output element, as
tests/test_kernel_fp8_skinny.py (the same arithmetic): fp32 output |y - ref| <= (K - 1) 2^-24 x S, S = sum_k |q_k w_k|
x input_scale x weight_scale (both sum the same exact products in fp32, in other orders); bf16 output: plus 2^-8
|ref|. Integer-valued sums must come out bit for bit, and both quantiser placements must give the same bits.
"""

import pytest
import torch

from engine_core.registry import Registry
from kernels import fp8_gemv, fp8_linear
from kernels.nvfp4 import FP8Tensor, fp8_linear_reference
from tests.test_kernel_fp8_skinny import DEVICE, bound, make

TRITON_HERE = fp8_gemv.triton is not None and (DEVICE == "cuda" or fp8_gemv._interpreted())
pytestmark = pytest.mark.skipif(not TRITON_HERE, reason="Triton does not run here")


def run(x, w, out_dtype, prequantize=False, **kw):
    return fp8_gemv.fp8_gemv_op(x, w.data, w.scale.float(), w.input_scale.float(), out_dtype, prequantize, **kw)


# (BLOCK_N, BLOCK_K): ragged N and K against the tiles, one K tile and several
@pytest.mark.parametrize("m,n,k,tile", [(1, 96, 128, (16, 128)), (3, 70, 200, (8, 64)), (4, 64, 256, (4, 128)),
                                        (2, 130, 144, (16, 32))])
@pytest.mark.parametrize("rowwise", [False, True])
def test_matches_reference_fp32(m, n, k, tile, rowwise):
    x, w = make(m, n, k, seed=m * 100 + n, rowwise=rowwise)
    y = run(x, w, torch.float32, block_n=tile[0], block_k=tile[1])
    ref = fp8_linear_reference(x, w, out_dtype=torch.float32)
    err, b = (y - ref).abs(), bound(x, w)
    assert (err <= b).all(), f"max err {err.max():.3g}, worst err / bound {(err / b).max():.3g}"
    # the quantiser launch before the GEMV writes the codes the loop computes: the same bits
    assert torch.equal(run(x, w, torch.float32, prequantize=True, block_n=tile[0], block_k=tile[1]), y)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("prequantize", [False, True])
def test_bf16_output_and_input_dtypes(x_dtype, prequantize):
    x, w = make(2, 96, 160, seed=7, x_dtype=x_dtype)
    y = run(x, w, torch.bfloat16, prequantize)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 96)
    ref32 = fp8_linear_reference(x, w, out_dtype=torch.float32)
    assert ((y.float() - ref32).abs() <= 2.0**-8 * ref32.abs() + bound(x, w)).all()


@pytest.mark.parametrize("prequantize", [False, True])
def test_exact_sums_bit_for_bit(prequantize):
    """Integer activations and weights with input_scale 1: every product and partial sum is an exact fp32 integer,
    so any summation order gives the reference's bits -- the quantiser (saturation at +-448, a signed zero), the
    masks at ragged K and N and the K loop cannot hide an error behind the tolerance."""
    g = torch.Generator().manual_seed(1)
    m, n, k = 3, 77, 300
    w = torch.randint(-16, 17, (n, k), generator=g).float().to(torch.float8_e4m3fn)  # |w| <= 16: exact in e4m3
    x = torch.randint(-8, 9, (m, k), generator=g).to(torch.bfloat16)
    x[0, :5] = torch.tensor([500.0, -600.0, 448.0, 3.0, -0.0])
    wt = FP8Tensor(w.to(DEVICE), torch.tensor(0.5, device=DEVICE), torch.tensor(1.0, device=DEVICE))
    x = x.to(DEVICE)
    y = run(x, wt, torch.float32, prequantize, block_n=8, block_k=64)
    assert torch.equal(y, fp8_linear_reference(x, wt, out_dtype=torch.float32))


@pytest.mark.parametrize("prequantize", [False, True])
def test_nan_stays_in_its_row(prequantize):
    x, w = make(3, 64, 128, seed=3)
    x[1, 17] = float("nan")
    y = run(x, w, torch.float32, prequantize, block_k=64)
    assert y[1].isnan().all()
    assert not y[0].isnan().any() and not y[2].isnan().any()
    ref = fp8_linear_reference(x, w, out_dtype=torch.float32)
    assert ((y[[0, 2]] - ref[[0, 2]]).abs() <= bound(x, w)[[0, 2]]).all()


def test_gemv_ok_rule():
    assert fp8_gemv.gemv_ok(1, 248_320, 2048)  # one row: any size
    assert fp8_gemv.gemv_ok(2, 2048, 4096) and not fp8_gemv.gemv_ok(4, 2048, 4096)  # rows x 8 MiB <= 16 MiB
    assert fp8_gemv.gemv_ok(4, 512, 2048) and not fp8_gemv.gemv_ok(2, 8192, 2048)
    assert not fp8_gemv.gemv_ok(fp8_gemv.GEMV_MAX_ROWS + 1, 64, 64)
    assert not fp8_gemv.gemv_ok(0, 64, 64) and not fp8_gemv.gemv_ok(1, 0, 64)


def on_gpu(monkeypatch, capability=(9, 0)):
    """The registry's view of a GPU for calls that run on the CPU here: `describe` reports CUDA with `capability`,
    and the static quantiser's guard accepts it (the kernels themselves run under the interpreter)."""
    real = fp8_linear.describe
    monkeypatch.setattr(fp8_linear, "describe",
                        lambda *a, **kw: {**real(*a, **kw), "device": "cuda", "capability": capability})
    monkeypatch.setattr(fp8_linear, "static_supports", lambda **info: True)


def test_registry_hands_larger_calls_on(monkeypatch):
    """`fp8_linear.register`: the GEMV implementations are first and take the calls `gemv_ok` accepts; a call with
    more rows goes to the next implementation (5-64 rows on Hopper: the few-row tensor-core GEMM)."""
    on_gpu(monkeypatch)
    reg = Registry()
    fp8_linear.register(reg)
    impls = {impl.name: impl for impl in reg.spec(fp8_linear.NAME).implementations}
    names = list(impls)
    assert names[:2] == ["triton_quant+gemv", "triton_gemv"], names
    for m, expect in ((1, "triton_quant+gemv"), (4, "triton_quant+gemv"), (5, "triton_quant+swapped"),
                      (64, "triton_quant+swapped"), (65, "triton_skinny+scaled_mm")):  # 96 x 128
        x, w = make(m, 96, 128, seed=m)
        assert reg.choose(fp8_linear.NAME, **fp8_linear.describe(x, w)).name == expect
    on_gpu(monkeypatch, capability=(10, 0))  # the few-row GEMM is Hopper's (measured there only): cuBLASLt's elsewhere
    x, w = make(5, 96, 128, seed=5)
    assert reg.choose(fp8_linear.NAME, **fp8_linear.describe(x, w)).name == "triton_skinny+scaled_mm"
    x, w = make(3, 96, 128, seed=4)
    y = impls["triton_quant+gemv"].fn(x.reshape(1, 3, 128), w)  # leading dims kept
    assert y.shape == (1, 3, 96) and torch.equal(y.reshape(3, 96), run(x, w, x.dtype, True))
    assert torch.equal(impls["triton_gemv"].fn(x, w), run(x, w, x.dtype, False))


@pytest.mark.parametrize("capability,out_dtype", [((9, 0), torch.float16), ((9, 0), torch.float32),
                                                  ((8, 9), torch.bfloat16)])
def test_registry_gives_per_row_scales_the_gemv(monkeypatch, capability, out_dtype):
    """Per-row weight scales (the fused decode projections) with outputs or GPUs cuBLASLt's row-wise mode does not
    take (fp16 / fp32 out, sm_89): still the GEMV, not the dequantising reference; N and K need not be multiples of
    16 for it (K of 4)."""
    on_gpu(monkeypatch, capability)
    reg = Registry()
    fp8_linear.register(reg)
    x, w = make(1, 90, 132, seed=5, rowwise=True)
    assert reg.choose(fp8_linear.NAME, **fp8_linear.describe(x, w, out_dtype)).name == "triton_quant+gemv"
    w_misaligned = FP8Tensor(w.data.view(-1)[1:1 + 90 * 128].view(90, 128), w.scale, w.input_scale)
    assert reg.choose(fp8_linear.NAME, **fp8_linear.describe(x[:, :128], w_misaligned, out_dtype)).name not in (
        "triton_quant+gemv", "triton_gemv")  # an odd address: not int32 words


def test_nan_weight_codes():
    """A NaN weight code (0x7F / 0xFF) makes its output row NaN, as the reference's dequantised weight does (the
    interpreter needs the explicit mapping; the GPU's cvt does it itself)."""
    x, w = make(2, 40, 64, seed=6)
    data = w.data.clone()
    data.view(torch.uint8)[3, 10] = 0x7F
    data.view(torch.uint8)[7, 0] = 0xFF
    w = FP8Tensor(data, w.scale, w.input_scale)
    y = run(x, w, torch.float32, True, block_n=8, block_k=32)
    assert y[:, 3].isnan().all() and y[:, 7].isnan().all()
    ok = [i for i in range(40) if i not in (3, 7)]
    ref = fp8_linear_reference(x, w, out_dtype=torch.float32)
    assert ref[:, 3].isnan().all() and not y[:, ok].isnan().any()


def test_clear_errors():
    x, w = make(fp8_gemv.GEMV_MAX_ROWS + 1, 32, 64, seed=1)
    with pytest.raises(ValueError, match="M <="):
        run(x, w, torch.bfloat16)
    with pytest.raises(ValueError, match="not a GEMV call"):
        fp8_linear.fp8_linear_gemv(x, w)
    x, w = make(2, 32, 64, seed=1)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_gemv.fp8_gemv_op(x, w.data.float(), w.scale, w.input_scale, torch.bfloat16)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_gemv.fp8_gemv_op(x, w.data, torch.ones(3, device=DEVICE), w.input_scale, torch.bfloat16)
    x6, w6 = make(1, 32, 6, seed=2)
    with pytest.raises(ValueError, match="multiples of 4"):  # rows are read as int32 words
        run(x6, w6, torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 4"):  # an odd address
        fp8_gemv.fp8_gemv_op(x[:, :60].contiguous(), w.data.view(-1)[1:1 + 32 * 60].view(32, 60), w.scale,
                             w.input_scale, torch.bfloat16)
    with pytest.raises(ValueError, match="not a GEMV call"):  # weight-only FP8 is the reference's
        fp8_linear.fp8_linear_gemv(x, FP8Tensor(w.data, w.scale, None))


@pytest.mark.skipif(DEVICE != "cuda", reason="the autotuned launch (configs benchmarked) needs a GPU")
@pytest.mark.parametrize("m,n,k,rowwise", [(1, 512, 2048, False), (4, 512, 2048, False), (1, 2048, 4096, False),
                                           (2, 8192, 2048, False), (4, 12288, 2048, False),
                                           (1, 9216, 2048, True), (1, 12288, 2048, True)])
@pytest.mark.parametrize("prequantize", [False, True])
def test_autotuned_model_shapes(m, n, k, rowwise, prequantize):
    """As the engine launches it (autotuned tiles) at Qwen3.6's projection shapes, the fused decode projections'
    (attention q/k/v 9216 x 2048, GDN in_proj_qkv/z 12288 x 2048) with their per-row weight scales."""
    x, w = make(m, n, k, seed=n, rowwise=rowwise)
    y = run(x, w, torch.bfloat16, prequantize)
    ref32 = fp8_linear_reference(x, w, out_dtype=torch.float32)
    assert ((y.float() - ref32).abs() <= 2.0**-8 * ref32.abs() + bound(x, w)).all()
