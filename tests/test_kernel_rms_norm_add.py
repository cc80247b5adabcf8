"""kernels/rms_norm.py's "add_rms_norm_zc" (the decoder layer's residual add + post-attention norm in one launch)
against its reference `x + h; rms_norm_zc(x + h)`, through the Triton interpreter on the CPU (compiled on a GPU).

Tolerances: the sum must be bit-identical (both compute the fp32 sum of two model-dtype values and round it once to
nearest even). The norm: bit-identical to the unfused *kernel* path (`x + h` then `rms_norm_zc_triton`: the same
reduction code on the same rounded sum), and within `compare` of the torch reference (1e-5 x max |ref| fp32, 1e-2
bf16, the rms_norm_zc tolerance) with >= 99% of bf16 elements bit-identical (the `check` of test_kernel_rms_norm).
"""

import pytest
import torch

from kernels import rms_norm
from kernels.rms_norm import (
    add_rms_norm_zc_reference,
    add_rms_norm_zc_triton,
    compare_add,
    describe_add,
    random_inputs,
    rms_norm_zc_triton,
    supports_add,
)
from tests.test_kernel_rms_norm import check

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def inputs(shape, dtype, seed):
    """x like the residual stream (one massive-activation row), h like a mixer output (N(0, 1), some rows x 1e3 to
    make the sum's rounding matter, and one h = -x row: a zero sum, the eps-only norm)."""
    x, w, eps = random_inputs(shape, dtype, seed=seed, device=DEVICE)
    h = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 100)).to(dtype).to(DEVICE)
    h.view(-1, shape[-1])[1::3] *= 1e3
    if h.numel() // shape[-1] >= 3:
        h.view(-1, shape[-1])[2] = -x.view(-1, shape[-1])[2]
    return x, h, w, eps


@pytest.mark.parametrize("shape", [(5, 2048), (3, 96), (1, 64), (2, 3, 128)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_add_norm_matches_unfused(dtype, shape):
    x, h, w, eps = inputs(shape, dtype, seed=shape[-1])
    s, y = add_rms_norm_zc_triton(x, h, w, eps)
    s_ref, y_ref = add_rms_norm_zc_reference(x, h, w, eps)
    assert s.dtype == y.dtype == dtype and s.shape == y.shape == x.shape
    assert torch.equal(s, s_ref), "the rounded sum differs from torch's x + h"
    assert torch.equal(y, rms_norm_zc_triton(s_ref, w, eps)), "not bit-identical to the unfused kernel path"
    check(y, y_ref, f"add+zc {dtype} {shape}")
    assert compare_add((s, y), (s_ref, y_ref)) is None


def test_norm_reads_the_rounded_sum():
    """bf16: the norm of the fp32 (unrounded) sum differs from the reference in many elements, so the bit-identity
    above is what pins the rounding of the sum before the norm."""
    x, h, w, eps = inputs((64, 256), torch.bfloat16, seed=7)
    _, y_ref = add_rms_norm_zc_reference(x, h, w, eps)
    unrounded = rms_norm.rms_norm_zc_reference(x.float() + h.float(), w, eps).to(torch.bfloat16)
    assert float((unrounded == y_ref).float().mean()) < 0.99
    assert torch.equal(add_rms_norm_zc_triton(x, h, w, eps)[1], rms_norm_zc_triton(x + h, w, eps))


def test_strided_rows_and_empty():
    x, h, w, eps = inputs((4, 96), torch.bfloat16, seed=3)
    wide = torch.cat((h, torch.randn_like(h)), dim=-1)[:, :96]  # rows strided (a slice of a wider buffer)
    s, y = add_rms_norm_zc_triton(x, wide, w, eps)
    s_ref, y_ref = add_rms_norm_zc_reference(x, h, w, eps)
    assert torch.equal(s, s_ref) and torch.equal(y, rms_norm_zc_triton(s_ref, w, eps))
    s, y = add_rms_norm_zc_triton(x[:0], h[:0], w, eps)
    assert s.shape == y.shape == (0, 96)


def test_guard_and_registry():
    from engine_core.registry import Registry

    x, h, w, eps = inputs((2, 96), torch.bfloat16, seed=1)
    assert supports_add(**describe_add(x, h, w, eps)) and supports_add(**describe_add(x.float(), h.float(), w, eps))
    assert not supports_add(**describe_add(x.half(), h.half(), w, eps))  # fp16: no `_round` for it
    assert not supports_add(**describe_add(x, h.float(), w, eps))  # mixed activation dtypes
    assert not supports_add(**describe_add(x, h[:1], w, eps))
    reg = Registry()
    rms_norm.register(reg)
    assert "triton passed" in reg.self_check(DEVICE, ops=["add_rms_norm_zc"])["add_rms_norm_zc"]
    assert reg.choose("add_rms_norm_zc", **describe_add(x, h, w, eps)).name == "triton"
    assert compare_add((x + h, x), add_rms_norm_zc_reference(x, h, w, eps)) is not None  # compare can fail


def test_custom_op_schema_and_compile():
    x, h, w, eps = inputs((2, 3, 64), torch.bfloat16, seed=2)
    torch.library.opcheck(torch.ops.qwen.add_rms_norm_zc.default, (x, h, w, eps),
                          test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda a, b: add_rms_norm_zc_triton(a, b, w, eps), backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(x, h), add_rms_norm_zc_triton(x, h, w, eps)):
        assert torch.equal(got, want)


def test_norm_module_forward_add(monkeypatch):
    """`ZeroCentredRMSNorm.forward_add`, fused and plain, equals `x + h` then `forward`."""
    from qwen_engine.model.norm import ZeroCentredRMSNorm

    x, h, w, eps = inputs((3, 128), torch.bfloat16, seed=4)
    norm = ZeroCentredRMSNorm(128, eps).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(w)
        monkeypatch.setattr(ZeroCentredRMSNorm, "fused", False)
        s0, y0 = norm.forward_add(x, h)
        assert torch.equal(s0, x + h) and torch.equal(y0, norm(x + h))
        monkeypatch.setattr(ZeroCentredRMSNorm, "fused", True)
        s1, y1 = norm.forward_add(x, h)
    assert torch.equal(s1, s0) and compare_add((s1, y1), (s0, y0)) is None


# ---- the gated norm taking the GDN core's fp32 output (task: drop GatedDeltaNet._output's `o.to(dtype)` launch) ----
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [128, 96])
def test_gated_norm_rounds_fp32_x_like_the_cast(dtype, dim):
    """fp32 x with a bf16/fp16 z: bit-identical to the kernel on `x.to(dtype)` (so to the separate cast), and within
    `check` of the torch reference (the rms_norm_gated tolerances); output in z's dtype. x is given values that are
    not representable in bf16 (a kernel that skipped the rounding would differ: asserted)."""
    from kernels.rms_norm import describe_gated, rms_norm_gated_reference, rms_norm_gated_triton, supports

    x, z, w, eps = random_inputs((6, 4, dim), torch.float32, gated=True, seed=dim, device=DEVICE)
    x = x * (1 + 1e-3 * torch.rand(x.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE))  # off-grid
    z, w = z.to(dtype), w.to(dtype)
    assert supports(**describe_gated(x, z, w, eps))
    out = rms_norm_gated_triton(x, z, w, eps)
    assert out.dtype == dtype
    assert torch.equal(out, rms_norm_gated_triton(x.to(dtype), z, w, eps))
    ref = rms_norm_gated_reference(x, z, w, eps)
    assert torch.equal(ref, rms_norm_gated_reference(x.to(dtype), z, w, eps))
    check(out, ref, f"gated fp32 x, {dtype} z")
    unrounded = rms_norm_gated_reference(x, z.float(), w.float(), eps).to(dtype)  # x never rounded
    assert float((unrounded == ref).float().mean()) < 0.99


def test_gated_norm_module_takes_fp32_x(monkeypatch):
    from qwen_engine.model.norm import GatedRMSNorm

    x, z, w, eps = random_inputs((3, 2, 64), torch.float32, gated=True, seed=5, device=DEVICE)
    z, w = z.bfloat16(), w.bfloat16()
    norm = GatedRMSNorm(64, eps).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(w)
        monkeypatch.setattr(GatedRMSNorm, "fused", False)
        plain = norm(x, z)
        assert torch.equal(plain, norm(x.bfloat16(), z))
        monkeypatch.setattr(GatedRMSNorm, "fused", True)
        fused = norm(x, z)
    assert fused.dtype == torch.bfloat16
    check(fused, plain, "gated module fp32 x")
