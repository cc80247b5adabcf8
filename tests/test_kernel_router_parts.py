"""kernels/moe_router.py "router_linear_topk" (the router's GEMM at 5-64 rows as a Triton split-H tensor-core GEMM,
then the top-k over its fp32 partials) against its reference, F.linear then `router_topk_reference`, under the Triton
interpreter on CPU (on CUDA where there is one). Tolerance: `compare_linear` -- logits within one ulp of the dtype
plus the fp32 bound of two summation orders, weights and ids exactly router_topk's on the returned logits, the extra
column exact."""

import pytest
import torch
import torch.nn.functional as F

from engine_core.registry import Registry
from kernels import moe_router as mr
from kernels import pdl
from kernels.moe_router import (
    PARTS_MAX_ROWS,
    compare_linear,
    describe_linear,
    router_linear_topk_reference,
    router_linear_topk_triton,
    router_topk_reference,
)

pytestmark = pytest.mark.skipif(mr.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n, e, h, dtype=torch.bfloat16, seed=0, ints=False):
    gen = torch.Generator().manual_seed(seed)
    if ints:  # small integers: every fp32 sum exact, whatever the order
        x, w = torch.randint(-2, 3, (n, h), generator=gen), torch.randint(-2, 3, (e, h), generator=gen)
    else:
        x, w = torch.randn(n, h, generator=gen), torch.randn(e, h, generator=gen) * h ** -0.5
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


@pytest.mark.parametrize("n,e,h", [(5, 60, 600), (8, 256, 256), (32, 256, 512), (64, 40, 320)])
@pytest.mark.parametrize("extra", [-1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(n, e, h, extra, dtype):
    """Random inputs: within `compare_linear` (its fp32 bound from x and w); H not a multiple of the tile (masked);
    with the extra column (expert E + extra here, past the router's experts as the shared expert's is)."""
    x, w = _inputs(n, e, h, dtype, seed=n + e + h)
    ex = -1 if extra < 0 else e + extra
    out = router_linear_topk_triton(x, w, 8, ex)
    ref = router_linear_topk_reference(x, w, 8, ex)
    assert out[1].shape == (n, 8 + (ex >= 0)) and out[2].dtype == torch.int64
    assert compare_linear(out, ref, x, w) is None


def test_exact_sums_bit_equal():
    """Exact fp32 sums (small integers): the logits are F.linear's bit for bit, and the weights / ids router_topk's on
    them, over 3 H tiles with a masked tail."""
    x, w = _inputs(32, 256, 600, ints=True, seed=3)
    logits, top, idx = router_linear_topk_triton(x, w, 8, 256)
    assert torch.equal(logits, F.linear(x, w))
    rt, ri = router_topk_reference(logits, 8, 256)
    assert torch.equal(idx[:, :8], ri[:, :8]) or mr.compare((top[:, :8], idx[:, :8]), (rt[:, :8], ri[:, :8]),
                                                             logits) is None
    assert torch.equal(idx[:, 8], torch.full((32,), 256, device=DEVICE)) and bool((top[:, 8] == 1).all())


def test_early_same_bits(monkeypatch):
    """EARLY (the weight tile read before the PDL wait; `pdl.early_options`): the same logits, weights and ids bit
    for bit. Under the interpreter the wait is a no-op: the EARLY build's arithmetic; its order is
    tests/sm90_compile.py's "early" check."""
    x, w = _inputs(32, 256, 512, seed=9)
    runs = []
    for early in (False, True):
        monkeypatch.setattr(pdl, "early_options", lambda early=early: {"EARLY": True} if early else {})
        runs.append(router_linear_topk_triton(x, w, 8, 256))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_guard_and_errors():
    """The Triton implementation: 16-bit x / w of one dtype, 1..PARTS_MAX_ROWS rows (else the registry takes F.linear
    + router_topk); the launcher refuses the rest with a clear error."""
    x, w = _inputs(PARTS_MAX_ROWS, 64, 128)
    assert describe_linear(x, w, 8)["parts"]
    big = torch.cat([x, x[:1]])
    assert not describe_linear(big, w, 8)["parts"] and describe_linear(big, w, 8)["two_launch"]
    assert not describe_linear(x.float(), w.float(), 8)["parts"]
    with pytest.raises(ValueError, match="takes 1..64 rows"):
        mr._launch_parts(big, w, 8)
    with pytest.raises(ValueError, match="router_linear_topk needs"):
        mr._launch_parts(x, w[:, :64], 8)


def test_compare_catches_errors():
    x, w = _inputs(6, 60, 256, seed=4)
    ref = router_linear_topk_reference(x, w, 8, 60)
    bad_extra = (ref[0], ref[1].clone(), ref[2].clone())
    bad_extra[2][2, -1] = 59
    assert compare_linear(ref, ref, x, w) is None
    assert "extra column" in compare_linear(bad_extra, ref, x, w)
    bad_logit = (ref[0].clone(), ref[1], ref[2])
    bad_logit[0][1, 3] += 0.5
    assert "logits" in compare_linear(bad_logit, ref, x, w)


def test_registry_self_check():
    reg = Registry()
    mr.register(reg)
    out = reg.self_check(torch.device(DEVICE), ops=[mr.LINEAR_NAME])
    assert out[mr.LINEAR_NAME] == "triton passed; linear+router_topk passed", out


def test_router_module_takes_it_when_asked(monkeypatch):
    """`TopKRouter.parts` (the engine's `router_parts`, on by default): above MAX_ROWS rows the fused router calls
    "router_linear_topk" with the extra column inside (or appended after it without `extra_in_kernel`), and gives
    what F.linear + router_topk give within `compare_linear`; off, it never calls it."""
    from engine_core.registry import default_registry
    from qwen_engine.config import QwenConfig
    from qwen_engine.model.moe import TopKRouter

    cfg = QwenConfig.tiny()
    router = TopKRouter(cfg).to(DEVICE).to(torch.bfloat16)
    torch.manual_seed(0)
    router.weight.data = torch.randn_like(router.weight) * cfg.hidden_size ** -0.5
    x = torch.randn(6, cfg.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    calls = []
    real = default_registry().call
    monkeypatch.setattr(default_registry(), "call", lambda op, *a, **k: calls.append(op) or real(op, *a, **k))
    monkeypatch.setattr(TopKRouter, "fused", True)
    monkeypatch.setattr(TopKRouter, "parts", False)
    e = cfg.num_experts
    ref = router(x, e)
    assert mr.LINEAR_NAME not in calls
    monkeypatch.setattr(TopKRouter, "parts", True)
    for in_kernel in (True, False):
        monkeypatch.setattr(TopKRouter, "extra_in_kernel", in_kernel)
        calls.clear()
        out = router(x, e)
        assert calls == [mr.LINEAR_NAME]
        assert compare_linear(out, ref, x, router.weight) is None
