"""kernels/router_add_norm.py's "add_norm_router_gemv_topk": the decoder layer's residual add + post-mixer norm inside
the router's GEMV + top-k launch (`moe_router._router_gemv_topk_kernel` ADD_NORM), and the engine option that takes it
(`QwenEngineConfig.norm_in_router_rows`, `SparseMoE.norm_in_router_rows`).

Tolerances: s (one rounding of an exact fp32 add) bit for bit everywhere; y under the interpreter (CPU) bit for bit
the add + norm kernel's (the same fp32 operations on the same tile), compiled within rms_norm's tolerance (its sum of
squares may reduce in another order); logits / weights / idx router_gemv_topk's contract on the returned y
(`moe_router.compare_gemv` with the router weight: the fp32 summation order's slack). The kernel tests run on DEVICE:
the GPU where there is one (compiled), else the CPU (the interpreter, tests/conftest.py).
"""

import pytest
import torch

from engine_core.registry import Registry, default_registry
from kernels import moe_router, rms_norm
from kernels import router_add_norm as ran
from qwen_engine.config import QwenConfig
from qwen_engine.engine import QwenEngineConfig, set_norm_in_router_rows
from qwen_engine.model.moe import SparseMoE, TopKRouter
from qwen_engine.model.norm import ZeroCentredRMSNorm
from tests.test_qwen_engine import engine_config
from tests.test_qwen_shared_stream import one_by_one as tokens_one_by_one

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = QwenConfig.tiny()


def _runs_here() -> bool:
    x, hm, nw, _, w, k = ran.random_inputs(1, 64, 16, device=DEVICE)
    return ran.supported(x, hm, nw, w, k)


pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not _runs_here(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")]


@pytest.mark.parametrize("n,h,e,dtype", [(1, 256, 64, torch.bfloat16), (3, 200, 60, torch.bfloat16),
                                         (4, 128, 32, torch.float32), (2, 2048, 256, torch.bfloat16)])
def test_against_reference_and_the_two_launches(n, h, e, dtype):
    """Within the reference's contract (s bit for bit, y within rms_norm's tolerance, the router's outputs
    router_gemv_topk's on our y) at 1-4 rows, masked H and E tails, bf16 and fp32; s and y bit for bit the add + norm
    kernel's under the interpreter (compiled: s, and y within the tolerance)."""
    args = ran.random_inputs(n, h, e, seed=n + h, dtype=dtype, device=DEVICE)
    out = ran.add_norm_router_gemv_topk_triton(*args)
    assert ran.compare(out, ran.add_norm_router_gemv_topk_reference(*args), w=args[4]) is None
    s2, y2 = rms_norm.add_rms_norm_zc_triton(*args[:4])
    assert torch.equal(out[0], s2)
    if DEVICE == "cpu":
        assert torch.equal(out[1], y2)
    else:
        assert rms_norm.compare(out[1], y2) is None
    assert out[0].is_contiguous() and out[1].is_contiguous() and out[4].dtype == torch.int64


def test_explicit_tilings_every_split_writes_its_tiles():
    """Tilings with several splits and expert tiles: only the first expert tile's programs store s and y, and the
    splits' tiles together cover the row (a tile left unwritten would keep torch.empty's garbage and fail)."""
    args = ran.random_inputs(3, 300, 40, seed=9, device=DEVICE)
    ref = ran.add_norm_router_gemv_topk_reference(*args)
    for cfg in (dict(BLOCK_R=1, BLOCK_E=16, BLOCK_H=64, SPLIT=5, num_warps=1),
                dict(BLOCK_R=4, BLOCK_E=8, BLOCK_H=128, SPLIT=3, num_warps=1)):
        logits, weights, idx, s, y = moe_router._launch_gemv(args[0], args[4], args[5], cfg,
                                                             add_norm=(args[1], args[2], args[3]))
        assert ran.compare((s, y, logits, weights, idx), ref, w=args[4]) is None, cfg


def test_registry_self_check_and_guards():
    """The registered op passes the registry's self-check on its exact sample; `supported` refuses a mixer output of
    another shape / dtype / stride, fp16 (the sum's rounding is bf16 or none), a norm weight of another length, and
    more rows than the fused router takes (MAX_ROWS)."""
    reg = Registry()
    ran.register(reg)
    assert reg.self_check(torch.device(DEVICE), ops=[ran.NAME])[ran.NAME].startswith("triton passed")
    x, hm, nw, eps, w, k = ran.random_inputs(2, 64, 16, device=DEVICE)
    assert ran.supported(x, hm, nw, w, k)
    assert not ran.supported(x, hm[:, :32], nw, w, k)
    assert not ran.supported(x, hm.float(), nw, w, k)
    assert not ran.supported(x, torch.empty(2, 128, dtype=hm.dtype, device=DEVICE)[:, :64], nw, w, k)
    assert not ran.supported(x.half(), hm.half(), nw.half(), w.half(), k)
    assert not ran.supported(x, hm, nw[:32], w, k)
    big = ran.random_inputs(moe_router.MAX_ROWS + 1, 64, 16, device=DEVICE)
    assert not ran.supported(*big[:3], big[4], big[5])


def _calls(op: str) -> int:
    return sum(default_registry().choices().get(op, {}).get("calls", {}).values())


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_engine_same_tokens_one_launch_fewer(monkeypatch, kernels):
    """Through the engine on the packed tiny model (the MoE's, router's and norms' fused paths as on a GPU): the same
    greedy tokens with norm_in_router_rows as without; with it the one-row decode steps' layers call the fused op
    and not add_rms_norm_zc (the prefill steps, more rows, keep the two launches); reference ops and the Triton
    kernels (the interpreter here)."""
    monkeypatch.setattr(SparseMoE, "fused", True)
    monkeypatch.setattr(TopKRouter, "fused", True)
    monkeypatch.setattr(ZeroCentredRMSNorm, "fused", True)
    ops = (ran.NAME, rms_norm.ADD_ZC)
    before = {op: _calls(op) for op in ops}
    h_off, off = tokens_one_by_one(engine_config(weights="packed", kernels=kernels, norm_in_router_rows=0))
    c_off = {op: _calls(op) - before[op] for op in ops}
    before = {op: _calls(op) for op in ops}
    h_on, on = tokens_one_by_one(engine_config(weights="packed", kernels=kernels, norm_in_router_rows=4))
    c_on = {op: _calls(op) - before[op] for op in ops}
    assert h_off["norm_in_router_layers"] == 0 and h_on["norm_in_router_layers"] == CFG.num_hidden_layers
    assert on == off
    assert c_off[ran.NAME] == 0 and c_on[ran.NAME] > 0
    assert c_on[ran.NAME] + c_on[rms_norm.ADD_ZC] == c_off[rms_norm.ADD_ZC], (c_off, c_on)
    decode_steps = 4 * 4  # 4 prompts x 4 one-row decode steps after the first token
    assert c_on[ran.NAME] >= decode_steps * CFG.num_hidden_layers, c_on


def test_engine_option_checked_and_set_on_every_moe():
    """norm_in_router_rows: an int >= 0 (0: off, the default until measured), else a clear error; the setter puts it
    on every MoE layer and back."""
    from tests.test_qwen_shared_stream import packed_model

    assert QwenEngineConfig().norm_in_router_rows == 0
    for bad in (-1, True, 1.5, "4", None):
        with pytest.raises(ValueError, match="norm_in_router_rows"):
            QwenEngineConfig(norm_in_router_rows=bad)
    model = packed_model("cpu")
    assert set_norm_in_router_rows(model, 4) == CFG.num_hidden_layers
    assert all(m.norm_in_router_rows == 4 for m in model.modules() if isinstance(m, SparseMoE))
    assert set_norm_in_router_rows(model, 0) == 0
