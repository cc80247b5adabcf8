"""kernels/moe_router.py (softmax + top-k + renormalisation in one Triton launch) against `router_topk_reference`,
the router of `qwen_engine.model.moe.TopKRouter` after its F.linear (on CPU through Triton's interpreter,
tests/conftest.py).

Indices: the kernel's order is exact and checked exactly (descending logit, ties by lowest expert index: a stable
descending sort); against the reference through `compare`, which accepts any choice among exact ties. Weights: one
output ulp for bf16, 1e-6 relative for fp32 (the kernel cancels the softmax denominator: a few fp32 ulps; measured
and printed with `pytest -s`).
"""

import pytest
import torch

from kernels import moe_router as mr
from kernels.moe_router import compare, random_logits, router_topk_reference, router_topk_triton, supported

pytestmark = pytest.mark.skipif(mr.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def stable_topk_idx(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel's exact order: descending logit, lowest index first among equal ones (NaN-free logits)."""
    return torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]


def check(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    assert supported(logits, k)
    out = router_topk_triton(logits, k)
    ref = router_topk_reference(logits, k)
    problem = compare(out, ref, logits)
    assert problem is None, problem
    assert torch.equal(out[1], stable_topk_idx(logits, k))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("e", [8, 60, 256])
@pytest.mark.parametrize("n", [1, 3, 32, 70])
def test_matches_reference(n, e, k, dtype):
    logits = random_logits(n, e, seed=n * 1000 + e * 10 + k, dtype=dtype, device=DEVICE)
    w, idx = check(logits, k)
    assert w.dtype == dtype and idx.dtype == torch.int64 and w.shape == idx.shape == (n, k)
    assert torch.allclose(w.float().sum(-1), torch.ones(n, device=DEVICE), atol=k * 2.0**-8)
    if dtype == torch.float32:
        ref = router_topk_reference(logits, k)[0]
        print(f"\nN={n} E={e} k={k}: max relative weight error {float(((w - ref).abs() / ref).max()):.2g}")


@pytest.mark.parametrize("block_r", [1, 2, 4])
def test_rows_per_program(block_r):
    """One row per program (the GPU's decode tiling) and packed rows with a masked tail (N = 3), strided rows."""
    wide = random_logits(3, 70, seed=7, dtype=torch.bfloat16, device=DEVICE)
    logits = wide[:, :60]  # row stride 70: a view, not copied
    assert supported(logits, 8)
    w, idx = mr._launch(logits, 8, block_r=block_r)
    ref = router_topk_reference(logits, 8)
    assert compare((w, idx), ref, logits) is None
    assert torch.equal(idx, stable_topk_idx(logits, 8))


@pytest.mark.parametrize("e", [60, 256])
def test_ties_lowest_index_first(e):
    """bf16 logits on a coarse grid: ties everywhere, at the k-th boundary too, and a row of all zeros (a fresh
    zero-initialised router). The kernel takes the lowest index among equal values; `compare` accepts it and any
    other choice among exact ties (here: the highest index first), whatever torch.topk picked."""
    n, k = 32, 8
    logits = random_logits(n, e, seed=e, dtype=torch.bfloat16, ties=True, device=DEVICE)
    srt = logits.float().sort(dim=-1, descending=True).values
    assert (srt[:, k - 1] == srt[:, k]).float().mean() > 0.5  # the test means something: boundary ties
    w, idx = check(logits, k)  # includes idx == lowest index first
    assert torch.equal(idx[-1], torch.arange(k, device=DEVICE))  # all-zero row: experts 0..k-1 ...
    assert torch.equal(w[-1], torch.full((k,), 1.0 / k, dtype=torch.bfloat16, device=DEVICE))  # ... weight 1/k
    ref = router_topk_reference(logits, k)
    flipped = stable_topk_idx(logits.flip(-1), k)
    highest_first = (e - 1 - flipped, w)[::-1]  # (weights, idx): same values, the other end of every tie
    assert not torch.equal(highest_first[1], idx)
    assert compare(highest_first, ref, logits) is None
    print(f"\nE={e}: torch.topk agrees with lowest-index-first on {float((ref[1] == idx).float().mean()):.0%} "
          f"of the positions")


def test_compare_catches_errors():
    """compare() fails on a wrong expert, a swapped order, a duplicate, an out-of-range index, and a weight off by
    two output ulps (bf16) or 1e-5 (fp32)."""
    logits = random_logits(4, 64, seed=3, device=DEVICE)
    ref = router_topk_reference(logits, 8)
    w, idx = router_topk_triton(logits, 8)
    assert compare((w, idx), ref, logits) is None and compare((w, idx), ref) is None
    unselected = int(stable_topk_idx(logits, 9)[1, 8])
    cases = {}
    bad = idx.clone()
    bad[1, 3] = unselected
    cases["wrong expert"] = (w, bad)
    bad = idx.clone()
    bad[2, [0, 1]] = bad[2, [1, 0]]
    cases["swapped"] = (w, bad)
    bad = idx.clone()
    bad[0, 7] = bad[0, 6]
    cases["duplicate"] = (w, bad)
    bad = idx.clone()
    bad[3, 0] = 64
    cases["out of range"] = (w, bad)
    bad = w.clone()
    bad[0, 2] *= 1 + 1e-5
    cases["weight"] = (bad, idx)
    cases["dtype"] = (w.double(), idx)
    for name, out in cases.items():
        assert compare(out, ref, logits) is not None, name
        if name != "out of range":  # (E unknown without logits)
            assert compare(out, ref) is not None, name
    lb = logits.bfloat16()
    refb = router_topk_reference(lb, 8)
    wb, ib = router_topk_triton(lb, 8)
    assert compare((wb, ib), refb, lb) is None
    j = int((wb[0] > 0.05).nonzero()[-1])  # a weight of some size: two ulps are above any rounding slack
    for ulps in (2, -2):
        bad = wb.clone()
        bad[0, j] = (bad[0, j].view(torch.int16) + ulps).view(torch.bfloat16)
        assert compare((bad, ib), refb, lb) is not None
    nan = wb.clone()
    nan[1, 0] = float("nan")
    assert compare((nan, ib), refb, lb) is not None


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy on inf - inf (NaN rows)
def test_non_finite_logits():
    """No hang, no index out of range or repeated; NaN ranks first; NaN weights where the reference has them; -inf
    logits in a finite row get weight 0; masked lanes (E = 60 < BLOCK_E = 64) are never selected."""
    e, k = 60, 8
    logits = random_logits(5, e, seed=11, device=DEVICE)
    logits[0, 5] = float("nan")
    logits[1, 40] = float("inf")
    logits[2] = float("-inf")
    logits[3, :56] = float("-inf")  # 4 finite experts, 4 more needed: the lowest -inf ones
    logits[4, 30] = float("nan")
    logits[4, 10] = float("nan")
    w, idx = router_topk_triton(logits, k)
    assert ((idx >= 0) & (idx < e)).all()
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all()
    assert int(idx[0, 0]) == 5 and int(idx[1, 0]) == 40 and idx[4, :2].tolist() == [10, 30]
    assert torch.equal(idx[2], torch.arange(k, device=DEVICE))  # all -inf: never a masked lane 60..63
    assert torch.isnan(w[[0, 1, 2, 4]]).all()
    ref = router_topk_reference(logits, k)
    assert torch.isnan(ref[0][[0, 1, 2, 4]]).all()
    assert sorted(idx[3, :4].tolist()) == [56, 57, 58, 59] and idx[3, 4:].tolist() == [0, 1, 2, 3]
    assert torch.equal(idx[3], stable_topk_idx(logits[3:4], k)[0]) and (w[3, 4:] == 0).all()
    assert compare((w[3:4], idx[3:4]), (ref[0][3:4], ref[1][3:4]), logits[3:4]) is None


def test_guards_and_empty():
    logits = random_logits(2, 16, device=DEVICE)
    assert supported(logits, 1) and supported(logits, 16) and supported(logits.bfloat16(), 8)
    assert supported(logits.half(), 8)
    assert not supported(logits, 17)  # k > E
    assert not supported(logits, 0)
    assert not supported(random_logits(2, 64, device=DEVICE), mr.MAX_TOP_K + 1)
    assert not supported(random_logits(1, mr.MAX_EXPERTS + 1, device=DEVICE), 8)
    assert supported(random_logits(1, mr.MAX_EXPERTS, device=DEVICE), 8)
    assert not supported(logits[0], 8)  # 1-D
    assert not supported(logits[None], 8)  # 3-D
    assert not supported(logits.double(), 8)
    assert not supported(random_logits(16, 4, device=DEVICE).t(), 2)  # non-unit last stride
    assert not supported(torch.empty(2, 16, device="meta"), 2)
    with pytest.raises(ValueError, match="unit last stride"):
        router_topk_triton(random_logits(16, 4, device=DEVICE).t(), 2)
    w, idx = router_topk_triton(logits[:0], 4)
    assert w.shape == idx.shape == (0, 4) and idx.dtype == torch.int64


def test_custom_op_traces():
    """Schema and fake (meta) implementation agree with the op; torch.compile traces through it in one graph."""
    logits = random_logits(3, 32, device=DEVICE, dtype=torch.bfloat16)
    torch.library.opcheck(mr.router_topk_op, (logits, 4), test_utils=("test_schema", "test_faketensor"))
    fn = torch.compile(lambda x: mr.router_topk_triton(x, 4), backend="eager", fullgraph=True)
    w, idx = fn(logits)
    assert torch.equal(idx, stable_topk_idx(logits, 4))
