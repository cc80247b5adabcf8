"""kernels/moe_combine.py: the decoder layer's MoE tail (shared-expert gate GEMV, sigmoid, gating, sums, residual) in
one launch, against `moe_combine_reference` (the model's torch code), on CPU through Triton's interpreter
(tests/conftest.py), on a GPU compiled.

Tolerances: `compare` (max |diff| <= 1e-5 x max |ref| in fp32; 1e-2 in bf16). With a one-hot gate weight (an exact
GEMV on any device) bf16 outputs must be bit-identical to the reference: that is what shows the kernel reproduces the
reference's five roundings (a kernel that skips the rounding of gate * shared or of routed + t still passes 1e-2 but
not this; `test_roundings_matter`). On the H200 (2026-11-30) the first version, which rounded with `.to(bf16)
.to(fp32)`, had only 96-98% of its outputs bit-identical: compiled, those round trips were contracted away; the
integer rounding now used is bit-identical there (results/qwen_gpu_run8/moe_combine_fix.log). With a full random gate
weight a row's gate can still move an ulp (the GEMV sums in another order than cuBLAS), hence the one-hot weight.
"""

import pytest
import torch

from kernels.moe_combine import (
    compare,
    describe,
    moe_combine_reference,
    moe_combine_triton,
    random_inputs,
    supports,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _runs_here() -> bool:
    return supports(**describe(*random_inputs(1, 8, device=DEVICE)))


pytestmark = pytest.mark.skipif(not _runs_here(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")


@pytest.mark.parametrize("n,h", [(1, 2048), (3, 96), (17, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(n, h, dtype):
    args = random_inputs(n, h, dtype, seed=n + h, device=DEVICE)
    out, ref = moe_combine_triton(*args), moe_combine_reference(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    problem = compare(out, ref)
    assert problem is None, problem
    same = float((out == ref).float().mean())
    print(f"\nN={n} H={h} {dtype}: {same:.4f} bit-identical")


@pytest.mark.parametrize("n,h", [(3, 96), (17, 256), (2, 2048)])
def test_roundings_reproduced_bit_for_bit(n, h):
    """bf16 with a one-hot gate weight, so the GEMV is one exact product on every device (a full GEMV's summation
    order may move a row's gate by an ulp, which shifts that row): then all five roundings are the reference's and
    every output is bit-identical."""
    x, w, shared, routed, residual = random_inputs(n, h, torch.bfloat16, seed=n + h, device=DEVICE)
    w = torch.zeros_like(w)
    w[0, h // 3] = 0.75
    out, ref = moe_combine_triton(x, w, shared, routed, residual), moe_combine_reference(x, w, shared, routed, residual)
    assert torch.equal(out, ref), f"{float((out != ref).float().mean()):.4f} of the outputs differ"


@pytest.mark.parametrize("k", [1, 3, 8])
def test_unsummed_routed_rows(k):
    """routed handed over as the k weighted expert outputs [N, k, H] (`w4a16_moe(..., reduce=False)`): the kernel
    sums them in fp32 and rounds once, as the reference's `sum(1, dtype=fp32)`. The rows are multiples of 2^-12 below
    1 in magnitude, so every partial sum is exact in fp32 in any order, and with a one-hot gate (as above) the
    outputs are bit-identical; a kernel reading one slot, or rounding each partial sum, differs."""
    x, w, shared, _, residual = random_inputs(5, 256, torch.bfloat16, seed=k, device=DEVICE)
    g = torch.Generator().manual_seed(k)
    routed = (torch.randint(-4095, 4096, (5, k, 256), generator=g) * 2.0**-12).to(torch.bfloat16).to(DEVICE)
    w = torch.zeros_like(w)
    w[0, 7] = 0.75
    out, ref = (f(x, w, shared, routed, residual) for f in (moe_combine_triton, moe_combine_reference))
    assert torch.equal(out, ref), f"{float((out != ref).float().mean()):.4f} of the outputs differ"
    summed = routed.float().sum(1).to(torch.bfloat16)
    assert torch.equal(moe_combine_triton(x, w, shared, summed, residual), ref)  # = the [N, H] form
    if k > 1:
        assert not torch.equal(moe_combine_reference(x, w, shared, routed[:, 0], residual), ref)
    assert supports(**describe(x, w, shared, routed, residual))
    assert not supports(**describe(x, w, shared, routed[:, :, :128], residual))  # [N, k, H'] with H' != H


def test_roundings_matter():
    """The same sum without the reference's intermediate bf16 roundings differs from it in many elements (so the
    bit-identical count above can fail)."""
    x, w, shared, routed, residual = random_inputs(17, 256, torch.bfloat16, seed=3, device=DEVICE)
    ref = moe_combine_reference(x, w, shared, routed, residual)
    gate = torch.sigmoid(x.float() @ w.float().T)
    unrounded = (residual.float() + routed.float() + gate * shared.float()).to(torch.bfloat16)
    assert float((unrounded == ref).float().mean()) < 0.99


def test_registry_check_sees_the_moe_part():
    """The registry's sample (no massive residual row): a kernel that returned the residual alone, or dropped the
    routed experts, would fail its self-check (with a x100 row the MoE part hides inside 1e-2 x max |ref|)."""
    from kernels import moe_combine

    (x, w, shared, routed, residual), _ = moe_combine._sample(DEVICE)
    ref = moe_combine_reference(x, w, shared, routed, residual)
    assert compare(moe_combine_triton(x, w, shared, routed, residual), ref) is None
    assert compare(residual, ref) is not None
    assert compare(moe_combine_reference(x, w, shared, torch.zeros_like(routed), residual), ref) is not None


def test_nan_propagates():
    """A NaN in the routed output stays NaN in that row's output, as in the reference (the integer rounding must not
    turn it into a number). Teeth on the GPU only: there fp32 arithmetic makes the canonical NaN 0x7FFFFFFF, which
    the rounding would carry into -0; the interpreter's NaNs (0x7FC00000) survive it either way."""
    x, w, shared, routed, residual = random_inputs(2, 64, torch.bfloat16, seed=4, device=DEVICE)
    routed[1, 5] = float("nan")
    out = moe_combine_triton(x, w, shared, routed, residual)
    assert torch.isnan(out[1, 5]) and torch.isfinite(out[0]).all()


def test_guards():
    args = random_inputs(3, 64, torch.bfloat16, device=DEVICE)
    info = describe(*args)
    assert supports(**info)
    x, w, shared, routed, residual = args
    assert not supports(**describe(x, w, shared, routed, residual.float()))  # mixed dtypes
    assert not supports(**describe(x, w.T.contiguous(), shared, routed, residual))  # [H, 1] gate weight
    assert not supports(**describe(x, w, shared[:2], routed, residual))  # shape mismatch
    assert not supports(**describe(x[:, ::2], w[:, ::2], shared[:, ::2], routed[:, ::2], residual[:, ::2]))
    assert not supports(**{**info, "dim": 16384})
    assert not supports(**describe(*(t.half() for t in args)))  # fp16: not supported (module docstring)


def test_registry_self_check():
    from engine_core.registry import Registry

    from kernels import moe_combine

    reg = Registry()
    moe_combine.register(reg)
    assert reg.self_check(DEVICE) == {"moe_combine": "triton passed", "moe_combine_norm": "triton passed",
                                      "moe_combine_norm_fp8": "triton passed"}
