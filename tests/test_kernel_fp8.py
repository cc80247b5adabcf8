"""kernels/fp8_linear.py: static-scale FP8 linear through `torch._scaled_mm` against `fp8_linear_reference`.

`torch._scaled_mm` runs on CPU in torch 2.14, so the call itself (operand layouts, scale shapes, tensor-wise and
row-wise modes) is exercised here; on a GPU with cc >= 8.9 the same tests run cuBLASLt / CUTLASS.
Tolerance: the activations are quantised identically (checked bit for bit); the GEMM sums the same exact e4m3
products in fp32 in another order and applies the scales on the accumulator, then rounds once. Per element:
|y - ref_fp32| <= 2^-8 |ref_fp32| (bf16 rounding, 2x for a flipped tie) + 2^-20 (|xq| @ |W|^T) s_in s_w (fp32
summation order over K <= 256 terms), and the registry's `compare` (1e-2 of max |ref|).
"""

import pytest
import torch

from kernels.fp8_linear import (
    compare,
    describe,
    fp8_linear_scaled_mm,
    quantize_input_fp8,
    supports,
)
from kernels.nvfp4 import E4M3_MAX, FP8Tensor, fp8_linear_reference, quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(m, n, k, seed, rowwise=False, x_dtype=torch.bfloat16, clip=0.8):
    """Weight quantised per tensor (or per row), x with a static input scale that clips its largest values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    if rowwise:
        s = w.abs().amax(1) / E4M3_MAX
        data = (w / s[:, None]).to(torch.float8_e4m3fn)
    else:
        data, s = quantize_fp8(w)
    x = (torch.randn(m, k, generator=g) * 2).to(x_dtype)
    input_scale = x.float().abs().amax() / E4M3_MAX * clip  # saturation exercised: clip < 1
    return x.to(DEVICE), FP8Tensor(data.to(DEVICE), s.to(DEVICE), input_scale.to(DEVICE))


def reference_fp32(x, w):
    return fp8_linear_reference(x, w, out_dtype=torch.float32)


def check(y, x, w, what):
    ref32 = reference_fp32(x, w)
    xq = quantize_input_fp8(x, w.input_scale).float()
    s = w.input_scale * w.scale
    bound = 2.0**-8 * ref32.abs() + 2.0**-20 * (xq.abs() @ w.data.float().abs().T) * s
    err = (y.float() - ref32).abs()
    assert (err <= bound).all(), f"{what}: max err {err.max():.3g}"
    assert compare(y, fp8_linear_reference(x, w, out_dtype=y.dtype)) is None


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k", [(96, 160), (48, 256)])
def test_tensorwise_matches_reference(m, n, k):
    x, w = make(m, n, k, seed=m + n)
    y = fp8_linear_scaled_mm(x, w)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    check(y, x, w, f"M={m} N={n} K={k}")
    same = (y == fp8_linear_reference(x, w)).float().mean().item()
    print(f"\nM={m} N={n} K={k}: {same:.4f} of outputs bit-equal to the reference")


def test_rowwise_scales_and_leading_dims():
    x, w = make(6, 64, 128, seed=3, rowwise=True)
    y = fp8_linear_scaled_mm(x.view(2, 3, 128), w)
    assert y.shape == (2, 3, 64)
    check(y.view(6, 64), x, w, "row-wise")


@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float16, None), (torch.float32, torch.float32)])
def test_other_dtypes(x_dtype, out_dtype):
    x, w = make(5, 32, 64, seed=4, x_dtype=x_dtype)
    y = fp8_linear_scaled_mm(x, w, out_dtype=out_dtype)
    assert y.dtype == (out_dtype or x_dtype)
    check(y, x, w, str(x_dtype))


def test_activation_quantisation_is_the_references():
    """Saturation at +-448 and RNE: identical to `quantize_fp8`, bit for bit, incl. values past the static scale."""
    x, w = make(4, 16, 64, seed=5, clip=0.5)
    xq = quantize_input_fp8(x, w.input_scale)
    ref, _ = quantize_fp8(x, w.input_scale)
    assert torch.equal(xq.view(torch.uint8), ref.view(torch.uint8))
    assert xq.float().abs().max() == E4M3_MAX  # something did saturate


def test_guard_boundaries():
    x, w = make(3, 64, 128, seed=6)
    info = describe(x, w)
    cuda = {**info, "device": "cuda"}
    assert supports(**{**cuda, "capability": (9, 0)})
    assert supports(**{**cuda, "capability": (8, 9)})  # Ada has FP8 tensor cores
    assert not supports(**{**cuda, "capability": (8, 0)})  # A100: reference fallback
    assert not supports(**{**info, "device": "cpu", "capability": None})  # CPU is not a serving target
    assert not supports(**{**cuda, "capability": (9, 0), "has_input_scale": False})
    assert not supports(**{**cuda, "capability": (9, 0), "k": 120, "weight_shape": (64, 120)})  # K % 16
    assert not supports(**{**cuda, "capability": (9, 0), "weight_shape": (72, 128)})  # N % 16
    rw = {**describe(*make(3, 64, 128, seed=7, rowwise=True)), "device": "cuda"}
    assert supports(**{**rw, "capability": (9, 0)})
    assert not supports(**{**rw, "capability": (8, 9)})  # row-wise needs sm_90
    assert not supports(**{**rw, "capability": (9, 0), "out_dtype": torch.float32})
    with pytest.raises(ValueError, match="input_scale"):
        fp8_linear_scaled_mm(x, FP8Tensor(w.data, w.scale, None))


def test_registry_records_the_fallback():
    from engine_core.registry import Registry

    from kernels import fp8_linear

    reg = Registry()
    fp8_linear.register(reg)
    (x, w), _ = fp8_linear._sample(DEVICE)
    impl = reg.choose("fp8_linear", **describe(x, w))
    on_fp8_gpu = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    assert impl.name == ("scaled_mm" if on_fp8_gpu else "reference")
    if not on_fp8_gpu:
        assert "scaled_mm does not support" in reg.choices()["fp8_linear"]["fallback"]
    outcome = reg.self_check(DEVICE)["fp8_linear"]
    assert "FAILED" not in outcome, outcome
