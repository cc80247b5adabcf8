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
import torch.nn.functional as F

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


@pytest.mark.parametrize("block_r", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extra_column(block_r, dtype):
    """`extra` >= 0 (the shared expert as a (k+1)-th pair): the first k columns exactly the plain call's, column k
    (1, extra) on every row -- also on the masked tail of packed rows (N = 5) -- as the reference's torch.cat."""
    logits = random_logits(5, 60, seed=11, dtype=dtype, device=DEVICE)
    w, idx = mr._launch(logits, 8, block_r=block_r)
    we, ie = mr._launch(logits, 8, block_r=block_r, extra=60)
    assert we.shape == ie.shape == (5, 9) and we.dtype == dtype and ie.dtype == torch.int64
    assert torch.equal(we[:, :8], w) and torch.equal(ie[:, :8], idx)
    assert torch.equal(ie[:, 8], torch.full((5,), 60, device=DEVICE))
    assert torch.equal(we[:, 8], torch.ones_like(we[:, 8]))
    rw, ri = router_topk_reference(logits, 8, extra=60)
    assert rw.shape == ri.shape == (5, 9) and torch.equal(ri[:, 8], ie[:, 8]) and torch.equal(rw[:, 8], we[:, 8])
    assert compare((we[:, :8], ie[:, :8]), (rw[:, :8], ri[:, :8]), logits) is None
    assert torch.equal(torch.ops.qwen.router_topk(logits, 8, 60)[1], ie)  # the custom op passes it through
    if block_r == 1:  # the op's fake (torch.compile's shapes) has the extra column too
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            fw, fi = torch.ops.qwen.router_topk(mode.from_tensor(logits), 8, 60)
        assert fw.shape == fi.shape == (5, 9)


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


# ---- router_gemv_topk: the router's F.linear fused with the top-k ----------------------------------------------------
# Logits: within one ulp of x.dtype of F.linear's plus the fp32 summation-order bound 2 H 2^-24 (|x| @ |w|^T)
# (`compare_gemv` with the inputs); bit-equal where every sum is exact (small integers). Weights and idx: exactly
# `router_topk_reference` on the kernel's own logits (`compare`), and the lowest-index-first order (`stable_topk_idx`).

def router_inputs(n: int, e: int, h: int, seed: int, dtype=torch.float32, integers: bool = False):
    """x [N, H] ~ N(0, 1) (a normed hidden state) and w [E, H] ~ N(0, 0.05) (logits of a few units), or small
    integers in [-3, 3] (every fp32 sum exact: |sum| <= 9 H < 2^24; bf16 too: integers <= 256 are exact)."""
    gen = torch.Generator().manual_seed(seed)
    if integers:
        x = torch.randint(-3, 4, (n, h), generator=gen).float()
        w = torch.randint(-3, 4, (e, h), generator=gen).float()
    else:
        x = torch.randn(n, h, generator=gen)
        w = 0.05 * torch.randn(e, h, generator=gen)
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


def check_gemv(x, w, k, config=None):
    # the registry guard takes decode sizes only (MAX_ROWS); the kernel itself any N (row blocks, masked tail)
    assert mr.supported_gemv(x, w, k) == (x.shape[0] <= mr.MAX_ROWS)
    out = mr._launch_gemv(x, w, k, config) if config is not None else mr.router_gemv_topk_triton(x, w, k)
    ref = mr.router_gemv_topk_reference(x, w, k)
    problem = mr.compare_gemv(out, ref, x, w)
    assert problem is None, problem
    logits, weights, idx = out
    assert logits.dtype == weights.dtype == x.dtype and idx.dtype == torch.int64
    assert logits.shape == (x.shape[0], w.shape[0]) and weights.shape == idx.shape == (x.shape[0], k)
    own = router_topk_reference(logits, k)  # the selection is router_topk's on the returned logits
    assert compare((weights, idx), own, logits) is None
    assert torch.equal(idx, stable_topk_idx(logits, k))
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [64, 200])
@pytest.mark.parametrize("e", [8, 64, 256])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_gemv_matches_reference(n, e, h, dtype):
    """Random inputs, top-1, -2 and -8 (k <= E); the logits' error is measured in ulps (`pytest -s`)."""
    x, w = router_inputs(n, e, h, seed=n * 1000 + e * 10 + h, dtype=dtype)
    worst = 0.0
    for k in (1, 2, 8):
        (logits, _, _), (ref, _, _) = check_gemv(x, w, k)
        worst = max(worst, float(((logits.float() - ref.float()).abs() / mr._ulp(ref.float(), dtype)).max()))
    print(f"\nN={n} E={e} H={h} {dtype}: logits within {worst:.2g} ulp of F.linear's")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_exact_sums_bit_equal(dtype):
    """Integer-valued inputs: every sum is exact in fp32, so the logits equal F.linear's bit for bit (whatever either
    summation order), under several tilings: row blocks with a masked tail (17 rows in blocks of 4 / 8 / 16), E tiles
    with a masked tail (E = 60 in tiles of 16), H tiles with a masked tail (H = 200 in tiles of 16-64), uneven splits
    (13 H tiles over 4 splits: the last split has 1), one split, one program."""
    x, w = router_inputs(17, 60, 200, seed=5, dtype=dtype, integers=True)
    ref = F.linear(x, w)
    configs = [None, dict(BLOCK_R=8, BLOCK_E=16, BLOCK_H=16, SPLIT=4, num_warps=1),
               dict(BLOCK_R=4, BLOCK_E=32, BLOCK_H=64, SPLIT=1, num_warps=2),
               dict(BLOCK_R=32, BLOCK_E=64, BLOCK_H=256, SPLIT=1, num_warps=4),
               dict(BLOCK_R=16, BLOCK_E=32, BLOCK_H=32, SPLIT=7, num_warps=1)]
    for cfg in configs:
        (logits, weights, idx), _ = check_gemv(x, w, 8, cfg)
        assert torch.equal(logits, ref), cfg
        assert torch.equal(idx, stable_topk_idx(ref, 8)), cfg  # exact ties abound: lowest index first


def test_gemv_counters_rearm_and_fallback(monkeypatch):
    """Twice in a row: the same bits (the arrival counters were re-armed to 0; a stale count would skip or repeat
    the epilogue) and all counters 0 after. Without counters (a first use inside a CUDA-graph capture) the partials
    are summed by torch and router_topk selects: the same results here (2 splits: fp32 addition is commutative)."""
    x, w = router_inputs(5, 64, 200, seed=9, dtype=torch.bfloat16)
    cfg = dict(BLOCK_R=2, BLOCK_E=16, BLOCK_H=32, SPLIT=2, num_warps=1)  # 4 E tiles x 2 splits x 3 row blocks
    first = mr._launch_gemv(x, w, 8, cfg)
    counters = mr.split_counters(x.device, 3)
    assert counters is not None and int(counters.abs().sum()) == 0
    second = mr._launch_gemv(x, w, 8, cfg)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert int(counters.abs().sum()) == 0
    monkeypatch.setattr(mr, "split_counters", lambda device, tiles: None)
    third = mr._launch_gemv(x, w, 8, cfg)
    assert all(torch.equal(a, b) for a, b in zip(first, third))
    assert mr.compare_gemv(third, mr.router_gemv_topk_reference(x, w, 8), x, w) is None


def test_gemv_strided_rows():
    """x and w as row-strided views (unit last stride): not copied, same answer."""
    xw, ww = router_inputs(3, 40, 160, seed=2, dtype=torch.bfloat16)
    x, w = xw[:, :150], ww[:36, :150]
    assert x.stride(0) == 160 and w.stride(0) == 160
    check_gemv(x, w, 8)


def test_gemv_compare_catches_errors():
    """compare_gemv fails on a logit off by two ulps, a top-k that is not the one of the returned logits (a wrong
    expert, a weight off by two ulps), and wrong dtypes; it passes a logit one ulp off."""
    x, w = router_inputs(4, 64, 64, seed=4, dtype=torch.bfloat16, integers=True)
    ref = mr.router_gemv_topk_reference(x, w, 8)
    logits, weights, idx = mr.router_gemv_topk_triton(x, w, 8)
    assert mr.compare_gemv((logits, weights, idx), ref) is None  # exact sums: no slack needed
    j = int(idx[0, 5])  # a selected expert whose logit is not the row's max

    def bump(t, r, c, ulps):
        t = t.clone()
        t[r, c] = (t[r, c].view(torch.int16) + ulps).view(torch.bfloat16)
        return t

    assert mr.compare_gemv((bump(logits, 0, j, 2), weights, idx), ref, x, w) is not None
    unselected = int(stable_topk_idx(logits, 9)[1, 8])
    bad = idx.clone()
    bad[1, 7] = unselected
    assert mr.compare_gemv((logits, weights, bad), ref) is not None
    big = int((weights[2] > 0.05).nonzero()[-1])
    assert mr.compare_gemv((logits, bump(weights, 2, big, 2), idx), ref) is not None
    assert mr.compare_gemv((logits.float(), weights, idx), ref) is not None
    # one ulp on a logit is allowed; the top-k must then be the one of the bumped logits (recomputed here)
    lb = bump(logits, 3, 0, 1)
    wb, ib = router_topk_reference(lb, 8)
    assert mr.compare_gemv((lb, wb, ib), ref) is None


def test_gemv_guards_and_empty():
    x, w = router_inputs(2, 16, 64, seed=0)
    assert mr.supported_gemv(x, w, 8) and mr.supported_gemv(x.bfloat16(), w.bfloat16(), 16)
    assert mr.supported_gemv(x.half(), w.half(), 1)
    big = router_inputs(mr.MAX_ROWS + 1, 16, 64, seed=0)[0]
    assert mr.supported_gemv(big[:mr.MAX_ROWS], w, 8) and not mr.supported_gemv(big, w, 8)  # prefill: F.linear
    assert not mr.supported_gemv(x, w, 17)  # k > E
    assert not mr.supported_gemv(x, w, 0)
    assert not mr.supported_gemv(x.bfloat16(), w, 8)  # mixed dtypes
    assert not mr.supported_gemv(x.double(), w.double(), 8)
    assert not mr.supported_gemv(x[:, :32], w, 8)  # H mismatch
    assert not mr.supported_gemv(x.t().contiguous().t(), w, 8)  # non-unit last stride
    assert not mr.supported_gemv(x, w.t().contiguous().t(), 8)
    assert not mr.supported_gemv(x[0], w, 8)  # 1-D
    assert not mr.supported_gemv(x, router_inputs(2, mr.MAX_EXPERTS + 1, 64, seed=0)[1], 8)
    assert not mr.supported_gemv(torch.empty(2, 64, device="meta"), torch.empty(16, 64, device="meta"), 2)
    with pytest.raises(ValueError, match="unit last strides"):
        mr.router_gemv_topk_triton(x, w.t().contiguous().t(), 2)
    logits, weights, idx = mr.router_gemv_topk_triton(x[:0], w, 4)
    assert logits.shape == (0, 16) and weights.shape == idx.shape == (0, 4) and idx.dtype == torch.int64


def test_gemv_custom_op_traces_and_registry():
    """Schema and fake implementation agree with the op; torch.compile traces it in one graph; the registry's sample
    passes its own compare (the engine's start-up self-check)."""
    x, w = router_inputs(3, 32, 64, seed=1, dtype=torch.bfloat16)
    torch.library.opcheck(mr.router_gemv_topk_op, (x, w, 4), test_utils=("test_schema", "test_faketensor"))
    fn = torch.compile(lambda a, b: mr.router_gemv_topk_triton(a, b, 4), backend="eager", fullgraph=True)
    logits, _, idx = fn(x, w)
    assert torch.equal(idx, stable_topk_idx(logits, 4))
    from engine_core.registry import Registry

    reg = Registry()
    mr.register(reg)
    assert reg.self_check(DEVICE, ops=[mr.GEMV_NAME]) == {
        mr.GEMV_NAME: "triton passed; linear+router_topk passed"}


def test_gemv_falls_back_to_two_launches_not_the_reference():
    """With the fused kernel disabled (a failed self-check, or by hand) the registry picks F.linear + the router_topk
    kernel, not the plain-torch reference (3x slower on the H200); its logits are F.linear's bit for bit. Rows past
    MAX_ROWS take it too."""
    from engine_core.registry import Registry

    reg = Registry()
    mr.register(reg)
    x, w = router_inputs(3, 64, 96, seed=4, dtype=torch.bfloat16)
    assert reg.choose(mr.GEMV_NAME, **mr.describe_gemv(x, w, 8)).name == "triton"
    big = router_inputs(mr.MAX_ROWS + 1, 64, 96, seed=5, dtype=torch.bfloat16)[0]
    assert reg.choose(mr.GEMV_NAME, **mr.describe_gemv(big, w, 8)).name == "linear+router_topk"
    reg.disable(mr.GEMV_NAME, "triton", "test")
    impl = reg.choose(mr.GEMV_NAME, **mr.describe_gemv(x, w, 8))
    assert impl.name == "linear+router_topk"
    out, ref = impl.fn(x, w, 8), mr.router_gemv_topk_reference(x, w, 8)
    assert torch.equal(out[0], ref[0]) and mr.compare_gemv(out, ref, x, w) is None


def test_router_module_uses_the_fused_op(monkeypatch):
    """`TopKRouter` with fused = True: decode-sized N through "router_gemv_topk", larger N through F.linear +
    "router_topk"; both equal the plain module within the ops' tolerances."""
    from types import SimpleNamespace

    from engine_core.registry import default_registry
    from qwen_engine.model.moe import TopKRouter

    monkeypatch.setattr(TopKRouter, "parts", False)  # above MAX_ROWS: F.linear + router_topk (tests/
    #                                                   test_kernel_router_parts.py covers router_linear_topk)
    cfg = SimpleNamespace(num_experts=64, hidden_size=96, num_experts_per_tok=8)
    router = TopKRouter(cfg).to(torch.bfloat16).to(DEVICE)
    with torch.no_grad():
        router.weight.copy_(router_inputs(1, 64, 96, seed=3, dtype=torch.bfloat16)[1])
    reg = default_registry()
    before = {op: reg.preference(op) for op in (mr.NAME, mr.GEMV_NAME)}
    calls0 = {op: reg.choices()[op]["calls"].get("triton", 0) for op in before}
    try:
        for op in before:
            reg.set_preference("auto", op)
        for n, op in ((3, mr.GEMV_NAME), (mr.MAX_ROWS + 3, mr.NAME)):
            x = router_inputs(n, 64, 96, seed=n, dtype=torch.bfloat16)[0]
            with torch.no_grad():
                monkeypatch.setattr(TopKRouter, "fused", False)
                plain = router(x)
                monkeypatch.setattr(TopKRouter, "fused", True)
                fused = router(x)
            assert reg.choices()[op]["calls"].get("triton", 0) == calls0[op] + 1, op
            assert mr.compare_gemv(fused, plain, x, router.weight) is None
            # `extra` (the shared expert's (k+1)-th pair): written by the router_topk kernel above MAX_ROWS (one more
            # "triton" call), appended by torch.cat on the other paths; the same k columns either way
            with torch.no_grad():
                monkeypatch.setattr(TopKRouter, "fused", False)
                plain_x = router(x, extra=64)
                monkeypatch.setattr(TopKRouter, "fused", True)
                fused_x = router(x, extra=64)
            assert reg.choices()[op]["calls"].get("triton", 0) == calls0[op] + 2, op
            for got, want in ((fused_x, fused), (plain_x, plain)):
                assert got[1].shape == got[2].shape == (n, 9) and torch.equal(got[0], want[0])
                assert torch.equal(got[1][:, :8], want[1]) and torch.equal(got[2][:, :8], want[2])
                assert torch.equal(got[2][:, 8], torch.full((n,), 64, device=DEVICE))
                assert torch.equal(got[1][:, 8], torch.ones(n, dtype=torch.bfloat16, device=DEVICE))
    finally:
        for op, pref in before.items():
            reg.set_preference(pref, op)
