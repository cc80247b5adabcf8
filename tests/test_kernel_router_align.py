"""kernels/router_align.py (the router's top-k and the MoE routing alignment in one launch) against
`router_topk_align_reference` = `router_topk_reference` then the torch `moe_align` (on CPU through Triton's
interpreter, tests/conftest.py); and its op over the router GEMM's partials, "router_linear_topk_align", against
F.linear then the same, and bit for bit against "router_linear_topk". The weights and ids are `router_topk`'s
(its tolerance; ties by lowest index); the alignment is integers, so it must equal `moe_align` of the returned ids
exactly."""

import pytest
import torch

from kernels import moe_router as mr
from kernels import router_align as ra
from kernels.w4a16_gemm import moe_align

pytestmark = pytest.mark.skipif(ra.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, params=[True, False], ids=["gather", "reload"])
def last_program_form(request, monkeypatch):
    """Every test with both forms of the last program's alignment (`router_align.GATHER`: register gathers from one
    round trip; or member[e_p] and start[e_p] read back from memory, the default until the first is timed)."""
    monkeypatch.setattr(ra, "GATHER", request.param)
    return request.param


def stable_topk_idx(logits: torch.Tensor, k: int) -> torch.Tensor:
    """router_topk's exact order: descending logit, lowest index first among equal ones."""
    return torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :k]


def check(logits, k, extra, num_experts, block_m, block_r=None):
    out = ra._launch(logits, k, extra, num_experts, block_m, block_r=block_r)
    ref = ra.router_topk_align_reference(logits, k, extra, num_experts, block_m)
    problem = ra.compare(out, ref, logits, k, num_experts, block_m)
    assert problem is None, problem
    w, idx, sorted_pairs, block_expert = out
    assert torch.equal(idx[:, :k], stable_topk_idx(logits, k))  # router_topk's order exactly
    plain = mr.router_topk_triton(logits, k, extra)  # the two-launch path's first launch: the same bits
    assert torch.equal(w, plain[0]) and torch.equal(idx, plain[1])
    routing = moe_align(idx, num_experts, block_m)
    assert torch.equal(sorted_pairs, routing.sorted_pairs) and torch.equal(block_expert, routing.block_expert)
    return out


# (tokens, experts E, top-k, extra, num_experts, block_m, rows per program): the 32-stream step (top-8 of 256 + the
# shared expert as 257th at the register kernel's 8-row blocks and the swap-AB kernel's 16), one to four member words
# (1, 32, 33, 64, 113 tokens: 113 x 9 pairs is the MAX_PAIRS limit's largest token count), no extra column, tiny
# experts with long groups (E 6 at 3 tokens a block), several programs (block_r) so that the last-arrival path runs
CASES = [(32, 256, 8, 256, 257, 8, None), (32, 256, 8, 256, 257, 16, 4), (1, 256, 8, 256, 257, 8, None),
         (33, 256, 8, 256, 257, 8, 8), (64, 60, 8, 60, 61, 8, 16), (113, 256, 8, 256, 257, 8, 32),
         (5, 64, 4, -1, 64, 16, 1), (40, 6, 2, -1, 6, 3, 8), (7, 16, 1, 16, 17, 1, 2), (3, 8, 8, 8, 9, 64, None)]


@pytest.mark.parametrize("n,e,k,extra,num_experts,block_m,block_r", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_router_topk_then_moe_align(n, e, k, extra, num_experts, block_m, block_r, dtype):
    logits = mr.random_logits(n, e, seed=n * 7 + e, dtype=dtype, device=DEVICE)
    check(logits, k, extra, num_experts, block_m, block_r)


def test_gather_form_runs_where_it_fits(last_program_form):
    """GATHER's last program never touches the `starts` workspace (its group starts stay in registers); the reload
    form writes them there. So with the workspace's starts poisoned: at 32 tokens (`gather_fits`) GATHER leaves them
    as they were, the reload form overwrites them; at 33 tokens (two member words) both forms are the reload one.
    The alignment is right either way (`check`)."""
    ws = ra._workspace(torch.device(DEVICE))
    starts = ws[ra.MAX_EXPERTS * ra.MAX_WORDS:]
    assert ra.gather_fits(512, 1) and not ra.gather_fits(1024, 1) and not ra.gather_fits(512, 2)
    for n, gathered in ((32, last_program_form), (33, False)):
        starts.fill_(-7)
        logits = mr.random_logits(n, 256, seed=n, device=DEVICE)
        check(logits, 8, 256, 257, 8, 8)
        assert bool((starts[:257] == -7).all()) == gathered, (n, last_program_form)


@pytest.mark.parametrize("block_r", [1, 8])
def test_ties_and_hot_experts(block_r):
    """Tied logits (router_topk's lowest-index order) and a zero row (every expert tied: the first k), and a hot
    expert every token picks (one long group over several blocks)."""
    logits = mr.random_logits(40, 64, seed=3, ties=True, device=DEVICE)
    check(logits, 8, 64, 65, 8, block_r)
    hot = mr.random_logits(40, 64, seed=4, device=DEVICE)
    hot[:, 5] = 100.0
    check(hot, 8, -1, 64, 8, block_r)


def test_repeated_launches_find_the_workspace_cleared():
    """Each launch leaves its member words at 0 and re-arms the counter (CUDA-graph replays rerun the same launch):
    alternating inputs give each one's own answer, and the workspace is zero afterwards."""
    a = mr.random_logits(32, 256, seed=1, dtype=torch.bfloat16, device=DEVICE)
    b = mr.random_logits(32, 256, seed=2, dtype=torch.bfloat16, device=DEVICE)
    first = ra._launch(a, 8, 256, 257, 8, block_r=4)
    for x, want in ((b, None), (a, first), (b, None)):
        out = check(x, 8, 256, 257, 8, block_r=4)
        if want is not None:
            assert all(torch.equal(u, v) for u, v in zip(out, want))
    ws = ra._WORKSPACE[(a.device.type, a.device.index, "")]  # the launch's own key (cuda:0, not "cuda")
    assert int(ws[:ra.MAX_EXPERTS * ra.MAX_WORDS].abs().sum()) == 0
    from kernels.split_k import _COUNTERS

    assert int(_COUNTERS[(a.device.type, a.device.index, "")][0]) == 0


def test_compare_catches_errors():
    logits = mr.random_logits(32, 256, seed=5, dtype=torch.bfloat16, device=DEVICE)
    kw = dict(k=8, num_experts=257, block_m=8)
    out = ra._launch(logits, 8, 256, 257, 8)
    ref = ra.router_topk_align_reference(logits, 8, 256, 257, 8)
    assert ra.compare(out, ref, logits, **kw) is None
    w, idx, sp, be = out
    used = int((sp < 32 * 9).nonzero()[3])
    swapped = sp.clone()
    swapped[[used, used + 1]] = swapped[[used + 1, used]]  # two rows of a group in the wrong order
    assert "sorted_pairs" in ra.compare((w, idx, swapped, be), ref, logits, **kw)
    owner = be.clone()
    owner[0] += 1
    assert "block_expert" in ra.compare((w, idx, sp, owner), ref, logits, **kw)
    extra = idx.clone()
    extra[0, 8] = 3
    assert "extra column" in ra.compare((w, extra, sp, be), ref, logits, **kw)
    heavier = w.clone()
    heavier[1, 0] *= 1.5
    assert "weights" in ra.compare((heavier, idx, sp, be), ref, logits, **kw)
    assert ra.compare((w, idx, sp[:-8], be), ref, logits, **kw) is not None


def test_guards():
    logits = mr.random_logits(4, 64, device=DEVICE)
    assert ra.supported(logits, 8, 64, 65, 8) and ra.supported(logits, 8, -1, 64, 16)
    assert not ra.supported(logits, 8, 3, 65, 8)  # extra inside the routed experts: not distinct from them
    assert not ra.supported(logits, 8, 65, 65, 8)  # extra past num_experts
    assert not ra.supported(logits, 8, -1, 63, 8)  # fewer experts than the logits name
    assert not ra.supported(logits, 8, -1, ra.MAX_EXPERTS + 1, 8)
    assert not ra.supported(mr.random_logits(ra.MAX_TOKENS + 1, 64, device=DEVICE), 1, -1, 64, 8)
    assert not ra.supported(mr.random_logits(114, 64, device=DEVICE), 8, 64, 65, 8)  # 1,026 pairs > MAX_PAIRS
    assert ra.supported(mr.random_logits(113, 64, device=DEVICE), 8, 64, 65, 8)
    assert not ra.supported(logits, 8, 64, 65, 0)
    assert not ra.supported(logits.double(), 8, 64, 65, 8)
    with pytest.raises(ValueError, match="extra=3"):
        ra._launch(logits, 8, 3, 65, 8)


def test_custom_op_and_registry():
    """Schema and fake implementation agree with the op; the registry's sample passes its own compare for both
    implementations (the engine's start-up self-check), and with the kernel disabled the registry picks the two
    launches, not the plain-torch reference."""
    from engine_core.registry import Registry

    logits = mr.random_logits(5, 32, device=DEVICE, dtype=torch.bfloat16)
    torch.library.opcheck(ra.router_topk_align_op, (logits, 4, 32, 33, 8),
                          test_utils=("test_schema", "test_faketensor"))
    reg = Registry()
    ra.register(reg)
    assert reg.self_check(DEVICE, ops=[ra.NAME]) == {ra.NAME: "triton passed; router_topk+moe_align passed"}
    big = mr.random_logits(ra.MAX_TOKENS + 1, 32, device=DEVICE)
    assert reg.choose(ra.NAME, **ra.describe(big, 4, -1, 32, 8)).name == "router_topk+moe_align"
    reg.disable(ra.NAME, "triton", "test")
    impl = reg.choose(ra.NAME, **ra.describe(logits, 4, 32, 33, 8))
    assert impl.name == "router_topk+moe_align"
    out = impl.fn(logits, 4, 32, 33, 8)
    assert ra.compare(out, ra.router_topk_align_reference(logits, 4, 32, 33, 8), logits, 4, 33, 8) is None


# ---- "router_linear_topk_align": the router GEMM in Triton, then this kernel over its partials -------------------
def router_inputs(n: int, e: int, h: int, seed: int, dtype=torch.bfloat16):
    """x [n, h], w [e, h] like the engine's router: random activations, weights ~0.05 (logits of a few units)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype).to(DEVICE)
    w = (0.05 * torch.randn(e, h, generator=g)).to(dtype).to(DEVICE)
    return x, w


def check_linear(x, w, k, extra, num_experts, block_m, block_r=None, num_warps=None):
    out = ra._launch_linear(x, w, k, extra, num_experts, block_m, block_r=block_r, num_warps=num_warps)
    ref = ra.router_linear_topk_align_reference(x, w, k, extra, num_experts, block_m)
    problem = ra.compare_linear(out, ref, x, w, num_experts, block_m)
    assert problem is None, problem
    # the same logits, weights and ids as "router_linear_topk" (the same partials, summed in the same order, the
    # same selection), which `forward` runs: route_aligned and forward route alike, bit for bit
    parts = mr._launch_parts(x, w, k, extra)
    assert all(torch.equal(a, b) for a, b in zip(out[:3], parts))
    routing = moe_align(out[2], num_experts, block_m)
    assert torch.equal(out[3], routing.sorted_pairs) and torch.equal(out[4], routing.block_expert)
    return out


# (tokens, experts E, H, top-k, extra, num_experts, block_m, rows per program): the 32-stream step's shapes (top-8
# of 256 + the shared expert; H cut to 512: four H tiles under the interpreter), one to two member words, the
# PARTS_MAX_ROWS limit, no extra column, a masked H tail, several programs so that the last-arrival path runs
LINEAR_CASES = [(32, 256, 512, 8, 256, 257, 8, None), (32, 256, 512, 8, 256, 257, 16, 4),
                (5, 64, 200, 8, 64, 65, 8, 2), (33, 60, 300, 8, 60, 61, 8, 8), (64, 64, 256, 4, -1, 64, 16, 16),
                (7, 16, 96, 1, 16, 17, 1, 2)]


@pytest.mark.parametrize("n,e,h,k,extra,num_experts,block_m,block_r", LINEAR_CASES)
def test_linear_matches_router_linear_topk_then_moe_align(n, e, h, k, extra, num_experts, block_m, block_r):
    x, w = router_inputs(n, e, h, seed=n + e + h)
    check_linear(x, w, k, extra, num_experts, block_m, block_r)


def test_linear_fp16_and_warps():
    """fp16 activations and weights; 1 and 4 warps (the engine's PARTS_ALIGN_WARPS), the same bits. (The interpreter
    ignores warps: on the CPU this checks fp16; on a GPU also the warps, as the graph test below does at 4 against
    "router_linear_topk"'s 1.)"""
    x, w = router_inputs(24, 128, 256, seed=11, dtype=torch.float16)
    one = check_linear(x, w, 8, 128, 129, 8, num_warps=1)
    four = check_linear(x, w, 8, 128, 129, 8, num_warps=4)
    assert all(torch.equal(a, b) for a, b in zip(one, four))


def test_linear_repeated_launches_and_compare():
    """Alternating inputs give each its own answer (the workspace re-armed by each launch); compare_linear catches a
    logit off by more than its bound, a swapped pair in a group, a wrong block owner and a wrong extra column."""
    a, b = router_inputs(32, 256, 256, seed=1), router_inputs(32, 256, 256, seed=2)
    first = check_linear(*a, 8, 256, 257, 8, block_r=4)
    for inputs, want in ((b, None), (a, first)):
        out = check_linear(*inputs, 8, 256, 257, 8, block_r=4)
        if want is not None:
            assert all(torch.equal(u, v) for u, v in zip(out, want))
    ws = ra._WORKSPACE[(a[0].device.type, a[0].device.index, "")]
    assert int(ws[:ra.MAX_EXPERTS * ra.MAX_WORDS].abs().sum()) == 0
    x, w = a
    ref = ra.router_linear_topk_align_reference(x, w, 8, 256, 257, 8)
    lo, wo, io, sp, be = first
    kw = dict(x=x, w=w, num_experts=257, block_m=8)
    off = lo.clone()
    off[3, 7] += 0.25
    assert "logits" in ra.compare_linear((off, wo, io, sp, be), ref, **kw)
    used = int((sp < 32 * 9).nonzero()[3])
    swapped = sp.clone()
    swapped[[used, used + 1]] = swapped[[used + 1, used]]
    assert "sorted_pairs" in ra.compare_linear((lo, wo, io, swapped, be), ref, **kw)
    owner = be.clone()
    owner[0] += 1
    assert "block_expert" in ra.compare_linear((lo, wo, io, sp, owner), ref, **kw)
    extra = io.clone()
    extra[0, 8] = 3
    assert "extra column" in ra.compare_linear((lo, wo, extra, sp, be), ref, **kw)


def test_linear_guards_and_registry():
    """The op's limits (PARTS_MAX_ROWS rows, a 16-bit dtype, the alignment's), its schema and fake implementation,
    its registry sample passing both implementations, and the fallback (F.linear + "router_topk_align") where the
    Triton GEMM cannot take the call."""
    from engine_core.registry import Registry

    x, w = router_inputs(6, 64, 128, seed=3)
    d = ra.describe_linear(x, w, 8, 64, 65, 8)
    assert d["supported"] and d["two_launch"]
    assert not ra.describe_linear(x.float(), w.float(), 8, 64, 65, 8)["supported"]  # fp32: no tensor-core dot
    big = router_inputs(mr.PARTS_MAX_ROWS + 1, 64, 128, seed=4)
    assert not ra.describe_linear(*big, 8, 64, 65, 8)["supported"]
    assert not ra.describe_linear(x, w, 8, 3, 65, 8)["supported"]  # extra inside the routed experts
    with pytest.raises(ValueError, match="extra=3"):
        ra._launch_linear(x, w, 8, 3, 65, 8)
    with pytest.raises(ValueError, match="rows"):
        ra._launch_linear(*big, 8, 64, 65, 8)
    torch.library.opcheck(ra.router_linear_topk_align_op, (x, w, 4, 64, 65, 8),
                          test_utils=("test_schema", "test_faketensor"))
    reg = Registry()
    mr.register(reg)
    ra.register(reg)
    assert reg.self_check(DEVICE, ops=[ra.LINEAR_NAME]) == {
        ra.LINEAR_NAME: "triton passed; linear+router_topk_align passed"}
    assert reg.choose(ra.LINEAR_NAME, **ra.describe_linear(*big, 8, 64, 65, 8)).name == "linear+router_topk_align"
    out = ra.linear_then_topk_align(*big, 8, 64, 65, 8)
    ref = ra.router_linear_topk_align_reference(*big, 8, 64, 65, 8)
    assert ra.compare_linear(out, ref, *big, 65, 8) is None


def graph_replays(inputs: list, step, replays: int, scale: float = 1.0):
    """`step()` run eagerly on random `inputs` (the workspace, the counters and the compiles, outside the capture),
    captured into one CUDA graph, then replayed `replays` times on fresh random inputs (N(0, scale^2)), yielding the
    captured outputs after each replay."""
    dev = inputs[0].device
    gen = torch.Generator(device=dev).manual_seed(0)
    for t in inputs:
        t.copy_(torch.randn(t.shape, device=dev, generator=gen))
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(replays):
        for t in inputs:
            t.copy_(scale * torch.randn(t.shape, device=dev, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        yield outs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and PDL need a CUDA GPU")
def test_graph_replays_under_pdl():
    """What the interpreter cannot show (it runs programs one after another): the last arrival's memory ordering on
    the GPU. Eight launches at the 32-stream shape (one per MoE layer) in one CUDA graph, each followed by another
    user of split_k's counter 0 (the router GEMV + top-k at one row), with programmatic dependent launch where the
    GPU has it, replayed 40 times on fresh logits: every replay's ids are router_topk's order and its alignment
    equals moe_align of them, and the workspace and counter end zeroed."""
    from kernels import pdl
    from kernels.split_k import _COUNTERS

    before = pdl.enabled()
    pdl.set_enabled(pdl.device_supports())
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        logits = [torch.zeros(32, 256, dtype=torch.bfloat16, device=dev) for _ in range(8)]
        x1 = torch.randn(1, 2048, device=dev).to(torch.bfloat16)  # the engine's router shape at one row
        w1 = (0.05 * torch.randn(256, 2048, device=dev)).to(torch.bfloat16)

        def step():
            outs = []
            for lg in logits:
                outs.append(ra._launch(lg, 8, 256, 257, 8))
                mr.router_gemv_topk_triton(x1, w1, 8)  # counter 0 again, between the alignment launches
            return outs

        for outs in graph_replays(logits, step, 40, scale=2.0):
            for lg, (w, idx, sorted_pairs, block_expert) in zip(logits, outs):
                assert torch.equal(idx[:, :8], stable_topk_idx(lg, 8)) and bool((idx[:, 8] == 256).all())
                routing = moe_align(idx, 257, 8)
                assert torch.equal(sorted_pairs, routing.sorted_pairs)
                assert torch.equal(block_expert, routing.block_expert)
        ws = ra._WORKSPACE[(dev.type, dev.index, "")]
        assert int(ws[:ra.MAX_EXPERTS * ra.MAX_WORDS].abs().sum()) == 0
        assert int(_COUNTERS[(dev.type, dev.index, "")][0]) == 0
    finally:
        pdl.set_enabled(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and PDL need a CUDA GPU")
def test_linear_graph_replays_under_pdl():
    """The op at the engine's 32-stream shape (x [32, 2048], w [256, 2048], top-8 + the shared pair, 8-row blocks) in
    one CUDA graph, eight launches each followed by another user of split_k's counter 0 (the router GEMV + top-k at
    one row), with programmatic dependent launch (and early loads) where the GPU has it, replayed 20 times on fresh
    x: every replay's outputs equal "router_linear_topk"'s and moe_align's of its ids, run eagerly afterwards."""
    from kernels import pdl

    from kernels.split_k import _COUNTERS

    before, early = pdl.enabled(), pdl._EARLY  # the flag itself: pdl.early() is False while PDL is off
    pdl.set_enabled(pdl.device_supports())
    pdl.set_early(pdl.device_supports())
    try:
        dev = torch.device("cuda", torch.cuda.current_device())
        xs = [torch.zeros(32, 2048, dtype=torch.bfloat16, device=dev) for _ in range(8)]
        w = (0.05 * torch.randn(256, 2048, device=dev)).to(torch.bfloat16)
        x1 = torch.randn(1, 2048, device=dev).to(torch.bfloat16)

        def step():
            outs = []
            for x in xs:
                outs.append(ra._launch_linear(x, w, 8, 256, 257, 8))
                mr.router_gemv_topk_triton(x1, w, 8)
            return outs

        for outs in graph_replays(xs, step, 20):
            for x, out in zip(xs, outs):
                parts = mr._launch_parts(x, w, 8, 256)
                assert all(torch.equal(a, b) for a, b in zip(out[:3], parts))
                routing = moe_align(out[2], 257, 8)
                assert torch.equal(out[3], routing.sorted_pairs) and torch.equal(out[4], routing.block_expert)
        # the graph ran the kernel (its workspace and counter re-armed), not the two-launch fallback of a capture
        # without a workspace (whose outputs would be the same)
        assert dev not in ra._CAPTURED_FALLBACK
        ws = ra._WORKSPACE[(dev.type, dev.index, "")]
        assert int(ws[:ra.MAX_EXPERTS * ra.MAX_WORDS].abs().sum()) == 0
        assert int(_COUNTERS[(dev.type, dev.index, "")][0]) == 0
    finally:
        pdl.set_enabled(before)
        pdl.set_early(early)
