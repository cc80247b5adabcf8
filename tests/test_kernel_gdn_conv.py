"""kernels/gdn_conv.py: the GDN prefill conv (one sequence's chunk: depthwise causal conv + SiLU, state advanced in
place) against its reference, the torch `causal_conv1d` path of `GatedDeltaNet.forward_paged` (on CPU through
Triton's interpreter, tests/conftest.py; on a GPU the compiled kernel).

Tolerances (the module's `compare`): y within 1e-2 x max |ref| for bf16 / fp16 (a conv output on a rounding boundary
moves one ulp when the taps are summed in another order), 1e-5 for fp32; the whole conv pool bit for bit (the
advanced row holds copies of inputs, the other rows are untouched).
"""

import pytest
import torch

from engine_core.registry import Registry
from kernels import gdn_conv
from kernels.gdn_conv import compare, describe, gdn_prefill_conv_reference, gdn_prefill_conv_triton, supports

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(n, c, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g).to(dtype).to(DEVICE)
    pool = torch.randn(3, c, k - 1, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(c, k, generator=g) * 0.5).to(dtype).to(DEVICE)
    return x, pool, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,valid", [(1, None), (2, None), (17, None), (40, None), (40, 29), (40, 2), (40, 0),
                                     (16, 16)])
def test_prefill_conv_matches_reference(dtype, n, valid):
    """Chunks shorter than the conv window (the old state feeds every output), one token block and a ragged second,
    and padded buckets whose real length is long, shorter than K-1, or zero (the state then stays as it was)."""
    c, k, row = 300, 4, 1  # two channel blocks, the second ragged
    x, pool, w = inputs(n, c, k, dtype, seed=n + (valid or 0))
    v = None if valid is None else torch.tensor([valid], device=DEVICE)
    ref = gdn_prefill_conv_reference(x, pool.clone(), row, w, v)
    out = gdn_prefill_conv_triton(x, pool.clone(), row, w, v)
    assert compare(out, ref) is None, compare(out, ref)
    assert out[0].shape == (n, c) and out[0].dtype == dtype
    assert torch.equal(out[1][0], pool[0]) and torch.equal(out[1][2], pool[2])  # the other rows untouched
    if valid == 0:
        assert torch.equal(out[1][row], pool[row])


def test_strided_rows_and_the_state_is_really_advanced():
    """x as a column slice of a wider projection output (row stride > C, as in_proj outputs can be); and a
    mutation: the reference's result with the state left as it was is not what the kernel returns."""
    n, c, k = 9, 64, 4
    wide, pool, w = inputs(n, 2 * c, k, torch.float32, seed=3)
    x = wide[:, :c]
    assert x.stride(0) == 2 * c
    ref = gdn_prefill_conv_reference(x, pool[:, :c].clone(), 0, w[:c])
    out = gdn_prefill_conv_triton(x, pool[:, :c].clone(), 0, w[:c])
    assert compare(out, ref) is None, compare(out, ref)
    assert compare((out[0], pool[:, :c]), ref) is not None  # a stale state row would fail


def test_guard_and_registry_self_check():
    x, pool, w = inputs(5, 32, 4, torch.bfloat16, seed=1)
    assert supports(**describe(x, pool, 0, w))
    assert not supports(**describe(x.float(), pool, 0, w))  # mixed dtypes
    assert not supports(**describe(x, pool, 3, w))  # no such state row
    assert not supports(**describe(x, pool, 0, w, torch.tensor([2], dtype=torch.int32, device=DEVICE)))
    reg = Registry()
    gdn_conv.register(reg)
    outcome = reg.self_check(DEVICE)
    assert all("passed" in v for v in outcome.values()), outcome
