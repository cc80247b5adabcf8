"""kernels/fp8_skinny.py: the decode-sized FP8 W8A8 linear (quantiser fused, split K) against `fp8_linear_reference`.

Runs on the CPU under TRITON_INTERPRET=1 (tests/conftest.py) and on a GPU compiled. Tolerance, per output element,
with S = sum_k |q_k w_k| x input_scale x weight_scale (the products' magnitudes):
* fp32 output: |y - ref| <= A x S, A = (K - 1) 2^-24: both sum the same exact products in fp32 (CUDA-core FMAs on
  the GPU), in other orders -- the recursive-summation bound (cuBLASLt's FP8 path needs 2^-9, `kernels.fp8_linear`).
* bf16 output: the same plus 2^-8 |ref| (one rounding; 2x for a flipped tie).
Exactly representable sums (integer-valued activations and weights) must come out bit for bit, split or not.
"""

import pytest
import torch

from kernels import fp8_skinny
from kernels.fp8_linear import fp8_linear_skinny, fp8_linear_triton_quant
from kernels.fp8_quant import quantize_static_reference
from kernels.nvfp4 import E4M3_MAX, FP8Tensor, fp8_linear_reference, quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = fp8_skinny.triton is not None and (DEVICE == "cuda" or fp8_skinny._interpreted())
pytestmark = pytest.mark.skipif(not TRITON_HERE, reason="Triton does not run here")


def make(m, n, k, seed, rowwise=False, x_dtype=torch.bfloat16, clip=0.8):
    """e4m3 weight [N, K] with a per-tensor (or per-row) scale; x [M, K] with a static input scale that saturates
    its largest values (clip < 1)."""
    g = torch.Generator().manual_seed(seed)
    data, s = quantize_fp8(torch.randn(n, k, generator=g) * 0.05)
    if rowwise:
        s = s * (0.5 + torch.rand(n, generator=g))
    x = (torch.randn(m, k, generator=g) * 2).to(x_dtype)
    input_scale = x.float().abs().amax() / E4M3_MAX * clip
    return x.to(DEVICE), FP8Tensor(data.to(DEVICE), s.to(DEVICE), input_scale.to(DEVICE))


def bound(x, w):
    """A x S per output element (the module docstring)."""
    k = x.shape[-1]
    a = (k - 1) * 2.0**-24
    xq = quantize_static_reference(x, w.input_scale).float()
    return a * (xq.abs() @ w.data.float().abs().T) * (w.input_scale * w.scale)


def run(x, w, out_dtype, **kw):
    return fp8_skinny.fp8_skinny_op(x, w.data, w.scale.float(), w.input_scale.float(), out_dtype, **kw)


@pytest.mark.parametrize("m,n,k", [(1, 96, 128), (3, 70, 200), (4, 64, 256), (2, 130, 64)])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("rowwise", [False, True])
def test_matches_reference_fp32(m, n, k, split, rowwise):
    x, w = make(m, n, k, seed=m * 100 + n + split, rowwise=rowwise)
    y = run(x, w, torch.float32, split_k=split)
    ref = fp8_linear_reference(x, w, out_dtype=torch.float32)
    err = (y - ref).abs()
    b = bound(x, w)
    assert (err <= b).all(), f"max err {err.max():.3g}, worst err / bound {(err / b).max():.3g}"


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bf16_output_and_input_dtypes(x_dtype):
    x, w = make(4, 96, 160, seed=7, x_dtype=x_dtype)
    y = run(x, w, torch.bfloat16, split_k=2)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 96)
    ref32 = fp8_linear_reference(x, w, out_dtype=torch.float32)
    err = (y.float() - ref32).abs()
    assert (err <= 2.0**-8 * ref32.abs() + bound(x, w)).all(), err.max()


@pytest.mark.parametrize("split", [1, 2, 4])
def test_exact_sums_bit_for_bit(split):
    """Integer activations and weights with input_scale 1: every product and partial sum is an exact fp32 integer,
    so any summation order gives the reference's bits (fp32 out) -- the quantiser, the masks at ragged K and N,
    and the split-K reduction cannot hide an error behind the tolerance."""
    g = torch.Generator().manual_seed(split)
    m, n, k = 3, 77, 300
    w = torch.randint(-16, 17, (n, k), generator=g).float().to(torch.float8_e4m3fn)  # |w| <= 16: exact in e4m3
    x = torch.randint(-8, 9, (m, k), generator=g).to(torch.bfloat16)
    x[0, :5] = torch.tensor([500.0, -600.0, 448.0, 3.0, -0.0])  # saturation at +-448 and a signed zero
    wt = FP8Tensor(w.to(DEVICE), torch.tensor(0.5, device=DEVICE), torch.tensor(1.0, device=DEVICE))
    x = x.to(DEVICE)
    y = run(x, wt, torch.float32, split_k=split)
    assert torch.equal(y, fp8_linear_reference(x, wt, out_dtype=torch.float32))


def test_nan_stays_in_its_row():
    x, w = make(3, 64, 128, seed=3)
    x[1, 17] = float("nan")
    y = run(x, w, torch.float32, split_k=2)
    assert y[1].isnan().all()
    assert not y[0].isnan().any() and not y[2].isnan().any()
    ref = fp8_linear_reference(x, w, out_dtype=torch.float32)
    assert ((y[[0, 2]] - ref[[0, 2]]).abs() <= bound(x, w)[[0, 2]]).all()


def test_split_counters_rearmed_between_calls():
    """The last split re-arms its tile's counter: repeated launches (CUDA-graph replays) give the same bits."""
    x, w = make(2, 96, 256, seed=5)
    first = run(x, w, torch.float32, split_k=4)
    second = run(x, w, torch.float32, split_k=4)
    assert torch.equal(first, second)
    from kernels.split_k import split_counters

    assert int(split_counters(x.device, 1).abs().sum()) == 0


def test_dispatch_by_rows_and_outputs(monkeypatch):
    """`fp8_linear_skinny`: calls of up to SKINNY_MAX_M rows and SKINNY_MAX_N outputs through the fused kernel
    (leading dims kept), every other call -- more rows, more outputs, no input scale -- through the Triton quantiser
    + torch._scaled_mm (on the CPU too: torch 2.14 runs `_scaled_mm` there)."""
    calls = []
    real = fp8_skinny.fp8_skinny_op
    monkeypatch.setattr(fp8_skinny, "fp8_skinny_op", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    x, w = make(2, 96, 128, seed=9)
    y = fp8_linear_skinny(x.reshape(1, 2, 128), w)
    assert calls == [(2, 128)] and y.shape == (1, 2, 96) and y.dtype == x.dtype
    assert torch.equal(y.reshape(2, 96), real(x, w.data, w.scale.float(), w.input_scale.float(), x.dtype))
    for m, n in ((fp8_skinny.SKINNY_MAX_M + 1, 96), (1, fp8_skinny.SKINNY_MAX_N + 16)):
        big, wb = make(m, n, 128, seed=m + n)
        assert torch.equal(fp8_linear_skinny(big, wb), fp8_linear_triton_quant(big, wb))
    _, w_only = make(1, 96, 128, seed=11)
    with pytest.raises(ValueError, match="static input_scale"):  # weight-only: not this op's path
        fp8_linear_skinny(x, FP8Tensor(w_only.data, w_only.scale, None))
    assert calls == [(2, 128)]


def test_no_counters_no_split(monkeypatch):
    """Without arrival counters (a first use inside a CUDA-graph capture, or too many tiles) the launch does not
    split K: the same bits as an explicit split of 1."""
    x, w = make(3, 96, 256, seed=12)
    one = run(x, w, torch.float32, split_k=1)
    monkeypatch.setattr(fp8_skinny, "split_counters", lambda device, tiles: None)
    assert torch.equal(run(x, w, torch.float32, split_k=4), one)


def test_clear_errors():
    x, w = make(fp8_skinny.SKINNY_MAX_M + 1, 32, 64, seed=1)
    with pytest.raises(ValueError, match="M <="):
        run(x, w, torch.bfloat16)
    x, w = make(2, 32, 64, seed=1)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_skinny.fp8_skinny_op(x, w.data.float(), w.scale, w.input_scale, torch.bfloat16)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_skinny.fp8_skinny_op(x, w.data, torch.ones(3, device=DEVICE), w.input_scale, torch.bfloat16)


@pytest.mark.skipif(DEVICE != "cuda", reason="the autotuned launch (configs benchmarked) needs a GPU")
@pytest.mark.parametrize("m,n,k", [(1, 512, 2048), (4, 512, 2048), (1, 2048, 4096), (4, 8192, 2048)])
def test_autotuned_model_shapes(m, n, k):
    """The kernel on the GPU as the engine launches it (autotuned tiles, `skinny_split`'s split) at Qwen3.6's
    projection shapes: k/v_proj (where the engine uses it) and the wider ones."""
    x, w = make(m, n, k, seed=n)
    y = run(x, w, torch.bfloat16)
    ref32 = fp8_linear_reference(x, w, out_dtype=torch.float32)
    assert ((y.float() - ref32).abs() <= 2.0**-8 * ref32.abs() + bound(x, w)).all()
