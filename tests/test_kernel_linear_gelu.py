"""kernels/linear_gelu.py: fc1 + exact GELU as one Triton GEMM, against F.gelu(F.linear(...)) on random inputs.

CPU: under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes and tiles: ragged M and N (the descriptors' zero
fill and clipped stores), several K tiles, no bias, leading dims, an empty batch. GPU (Hopper): the ViT's fc1 shape at
one image with three launches (the default, 128 x 128 x 64, the persistent kernel); the ragged and empty cases run
under the interpreter only. Tolerance: max |diff| <= 1e-2 x max |ref| (bf16: the GEMM's summation order is
the only difference, the epilogue rounds as torch does), and most outputs bit-identical (>= 90%; measured ~99.9% under
the interpreter); a wrong tile, a missing bias or the tanh GELU fails both by far.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.linear_gelu import TOLERANCE, Launch, linear_gelu_reference, linear_gelu_triton, linear_triton, supports

SMALL = Launch(32, 32, 16, 2, 4, 2)
SMALL_PERSISTENT = Launch(32, 32, 16, 2, 4, 2, persistent=True)  # 4 programs under the interpreter, tiles looped


def _inputs(m: int, n: int, k: int, seed: int, device: str = "cpu", bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, torch.bfloat16)
    b = (0.5 * torch.randn(n, generator=gen)).to(device, torch.bfloat16) if bias else None
    return x, w, b


def _check(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape, got.dtype)
    err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    same = (got == ref).float().mean().item()
    assert err <= TOLERANCE and same >= 0.9, f"{what}: rel err {err:.2e}, {100 * same:.2f}% identical"


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter shapes; the GPU test is below")
@pytest.mark.parametrize("m, n, k, bias", [(64, 64, 32, True),    # whole tiles, two K steps
                                           (70, 40, 48, True),    # ragged M, N and K (zero-filled tails)
                                           (33, 96, 64, False),   # no bias
                                           (0, 32, 16, True)])    # empty batch
@pytest.mark.parametrize("launch", [SMALL, SMALL_PERSISTENT], ids=["tile_per_program", "persistent"])
def test_matches_reference_under_interpreter(m, n, k, bias, launch):
    x, w, b = _inputs(m, n, k, seed=m + n + k, bias=bias)
    got, ref = linear_gelu_triton(x, w, b, launch), linear_gelu_reference(x, w, b)
    if m == 0:
        assert got.shape == (0, n)
        return
    _check(got, ref, f"M={m} N={n} K={k} bias={bias}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter shapes")
def test_persistent_equals_tile_per_program_and_linear_only_equals_f_linear():
    """More tiles (3 x 3) than the persistent kernel's 4 programs: each program loops; the same per-tile sums, so the
    same bits. Without the GELU the kernel is F.linear (exact here: fp32 sums of exact bf16 products, one rounding)."""
    x, w, b = _inputs(96, 96, 48, seed=5)
    base = linear_gelu_triton(x, w, b, SMALL)
    for launch in (SMALL_PERSISTENT, Launch(32, 32, 16, 2, 4, 2, persistent=True, flatten=False)):
        assert torch.equal(linear_gelu_triton(x, w, b, launch), base), launch
    _check(linear_triton(x, w, b, SMALL_PERSISTENT), F.linear(x, w, b), "linear only")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter shapes")
def test_leading_dims_and_the_difference_from_tanh():
    x, w, b = _inputs(2 * 24, 32, 32, seed=3)
    x3 = x.reshape(2, 24, 32)
    got = linear_gelu_triton(x3, w, b, SMALL)
    _check(got, linear_gelu_reference(x3, w, b), "[2, 24, K]")
    strided_bias = torch.stack([b, -b], dim=1)[:, 0]  # b's values with stride 2: the wrapper makes it contiguous
    assert torch.equal(linear_gelu_triton(x3, w, strided_bias, SMALL), got)
    tanh = F.gelu(F.linear(x3, w, b), approximate="tanh")  # what cuBLASLt's epilogue computes: must not pass
    assert (got == tanh).float().mean().item() < 0.9


def test_refuses_what_it_cannot_run():
    x, w, b = _inputs(8, 16, 16, seed=0)
    assert not supports(x.float(), w.float(), b.float())
    with pytest.raises(ValueError, match="not supported"):
        linear_gelu_triton(x.float(), w.float(), b.float())
    assert not supports(x[:, :12], w[:, :12], b)  # K not a multiple of 8: rows not 16-byte aligned
    assert not supports(x, w, b[:8])  # a bias shorter than N would be read past its end


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA descriptors need Hopper")
@pytest.mark.parametrize("launch", [Launch(), Launch(128, 128, 64, 8, 4, 4), Launch(persistent=True)])
def test_vit_fc1_shape_on_gpu(launch):
    x, w, b = _inputs(5_184, 4_736, 1_024, seed=1, device="cuda")  # one image's tokens through fc1
    _check(linear_gelu_triton(x, w, b, launch), linear_gelu_reference(x, w, b), f"ViT fc1 {launch}")
