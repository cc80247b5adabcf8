"""The GDN decode step with its output's gated RMS norm + FP8 codes in one launch (kernels/gdn_decode.py
"gdn_decode_rows_norm_fp8", the engine's `gdn_decode_norm`): the kernel against the reference and against the two
launches it replaces, the arrival counters left re-armed, the registry entry, and the engine's greedy tokens with the
option as without it (the same operations). The sm_90 build is compiled in tests/sm90_compile.py; the speed is in
benchmarks/RESULTS.md."""

import pytest
import torch

from engine_core.registry import Registry, default_registry
from kernels import gdn_decode as gd
from kernels import rms_norm
from kernels.split_k import split_counters

pytestmark = pytest.mark.skipif(gd.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU host, the interpreter here


def inputs(b: int, h: int, dk: int, dv: int, seed: int, slots: int | None = None, zdtype=torch.bfloat16):
    """Decode inputs over a pool of `slots` rows (batch row i owns pool row slots - 1 - i: out of order), a gate z,
    a norm weight around 1 and a static scale."""
    q, k, v, g, beta, state = gd.random_inputs(b, h, dk, dv, seed=seed)
    slots = slots or b + 2
    pool = torch.randn(slots, h, dk, dv, generator=torch.Generator().manual_seed(seed + 1)) * 0.5
    rows = torch.arange(slots - 1, slots - 1 - b, -1)
    gen = torch.Generator().manual_seed(seed + 2)
    z = (torch.randn(b, h, dv, generator=gen) * 2).to(zdtype)
    weight = (1 + 0.1 * torch.randn(dv, generator=gen)).to(zdtype)
    scale = torch.tensor(0.02)
    return tuple(t.to(DEVICE) for t in (q, k, v, g, beta, pool, rows, z, weight)) + (1e-6, scale.to(DEVICE))


def test_bf16_pool_the_same_step_as_the_rows_op():
    """`gdn_state_dtype: bfloat16` with `gdn_decode_norm`: the fused launch advances a bf16 pool exactly as the rows
    op does (the same `_advance`: widened as read, rounded to nearest even as stored) and its norm / codes stay
    within the op's tolerance of the reference run on the same bf16 pool."""
    q, k, v, g, beta, pool, rows, z, weight, eps, scale = inputs(3, 2, 16, 64, seed=41)
    pool = pool.to(torch.bfloat16)
    p_ref, p_fused, p_rows = pool.clone(), pool.clone(), pool.clone()
    ref = gd.gdn_decode_rows_norm_fp8_reference(q, k, v, g, beta, p_ref, rows, z, weight, eps, scale)
    out = gd.gdn_decode_rows_norm_fp8_triton(q, k, v, g, beta, p_fused, rows, z, weight, eps, scale)
    gd.gdn_decode_rows_triton(q, k, v, g, beta, p_rows, rows)
    assert p_fused.dtype == torch.bfloat16 and torch.equal(p_fused, p_rows)
    assert gd.compare_rows_norm(out[:2] + (p_ref,), ref) is None
    assert not torch.equal(p_fused, pool)


@pytest.mark.parametrize("b,h,dk,dv,zdtype", [(1, 4, 32, 48, torch.bfloat16), (3, 2, 16, 128, torch.bfloat16),
                                               (2, 3, 64, 16, torch.bfloat16), (2, 2, 32, 64, torch.float16)])
def test_matches_reference_and_the_two_launches(monkeypatch, b, h, dk, dv, zdtype):
    """Within the op's tolerance of the reference; against the unfused launches ("gdn_decode_rows", then
    "rms_norm_gated_fp8" on its o) the pool and o-derived outputs are the same bits in the interpreter (the same
    operations; compiled, the norm's reduction may be tiled differently: within tolerance, codes consistent). The
    fused kernel itself ran: its two-launch fallback is made to fail during the call."""
    args = inputs(b, h, dk, dv, seed=b * 10 + dv, zdtype=zdtype)
    q, k, v, g, beta, pool, rows, z, weight, eps, scale = args
    p_ref, p_fused, p_two = pool.clone(), pool.clone(), pool.clone()
    ref = gd.gdn_decode_rows_norm_fp8_reference(q, k, v, g, beta, p_ref, rows, z, weight, eps, scale)
    counters = split_counters(q.device, b * h)  # the launch's own key (cuda:0: torch.device("cuda") has none)
    with monkeypatch.context() as m:
        m.setattr(rms_norm, "rms_norm_gated_fp8_op", lambda *a: pytest.fail("took the two-launch fallback"))
        out = gd.gdn_decode_rows_norm_fp8_triton(q, k, v, g, beta, p_fused, rows, z, weight, eps, scale)
    assert out[2] is p_fused and out[0].dtype == z.dtype and out[1].dtype == torch.float8_e4m3fn
    assert gd.compare_rows_norm(out, ref) is None
    untouched = [i for i in range(pool.shape[0]) if i not in rows.tolist()]
    assert torch.equal(p_fused[untouched], pool[untouched])  # only the batch's rows advance
    o, _ = gd.gdn_decode_rows_triton(q, k, v, g, beta, p_two, rows)
    two = rms_norm.rms_norm_gated_fp8_triton(o, z, weight, eps, scale)
    assert torch.equal(p_fused, p_two)  # the step itself: the same program, the same bits
    if DEVICE == "cpu":
        assert torch.equal(out[0], two[0]) and torch.equal(out[1].view(torch.uint8), two[1].view(torch.uint8))
    else:
        assert rms_norm.compare_fp8(out[:2], two) is None
    # every code is the static quantiser's code of the kernel's own output
    from kernels.fp8_quant import quantize_static_reference

    assert torch.equal(out[1].view(torch.uint8), quantize_static_reference(out[0], scale).view(torch.uint8))
    assert counters is not None and int(counters[: b * h].abs().sum()) == 0  # re-armed for the next launch / replay


def test_compare_has_teeth():
    args = inputs(2, 2, 16, 32, seed=5)
    q, k, v, g, beta, pool, rows, z, weight, eps, scale = args
    ref = gd.gdn_decode_rows_norm_fp8_reference(q, k, v, g, beta, pool.clone(), rows, z, weight, eps, scale)
    bad_out = (ref[0] * 1.05, ref[1], ref[2])
    assert "output" in gd.compare_rows_norm(bad_out, ref)
    bad_pool = (ref[0], ref[1], ref[2] + 1e-3 * ref[2].abs().max())
    assert "pool" in gd.compare_rows_norm(bad_pool, ref)


def test_errors():
    args = list(inputs(1, 2, 16, 32, seed=6))
    with pytest.raises(ValueError, match="z must be"):
        gd.gdn_decode_rows_norm_fp8_(*args[:7], args[7][..., :16], *args[8:])
    with pytest.raises(ValueError, match="rows must be"):
        gd.gdn_decode_rows_norm_fp8_(*args[:6], args[6].int(), *args[7:])


def test_registry_entry_and_self_check():
    reg = Registry()
    gd.register(reg)
    assert gd.ROWS_NORM_NAME in reg.ops()
    report = reg.self_check(DEVICE)
    assert report[gd.ROWS_NORM_NAME] == "triton passed", report
    args = inputs(1, 2, 16, 32, seed=7, zdtype=torch.float32)  # fp32 z: the norm does not round o: reference only
    assert not gd.supports_rows_norm(**gd.describe_rows_norm(*args))


def test_engine_same_tokens_no_separate_norm(monkeypatch):
    """Through the engine (packed tiny model, the ops' references, the gated norm through the registry as on a
    GPU): the same greedy tokens with the option as without; with it no decode step runs "rms_norm_gated_fp8" and the
    fused op serves every GDN layer of every one-row decode step; without it the reverse."""
    from qwen_engine.model.norm import GatedRMSNorm
    from tests.test_qwen_engine import engine_config
    from tests.test_qwen_shared_stream import one_by_one

    monkeypatch.setattr(GatedRMSNorm, "fused", True)

    def norm_calls():
        return sum(default_registry().choices()[rms_norm.GATED_FP8]["calls"].values())

    before = norm_calls()
    h_off, off = one_by_one(engine_config(weights="packed", gdn_decode_norm=False))
    norms_off = norm_calls() - before
    assert h_off["gdn_decode_norm_layers"] == 0 and norms_off > 0
    assert gd.ROWS_NORM_NAME not in h_off["kernels"]
    before = norm_calls()
    h_on, on = one_by_one(engine_config(weights="packed", gdn_decode_norm=True))
    assert h_on["gdn_decode_norm_layers"] > 0
    assert norm_calls() - before == 0
    assert h_on["kernels"].get(gd.ROWS_NORM_NAME) == "reference"  # test_qwen_engine's kernels="reference"
    assert on == off


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel on a GPU")
def test_engine_on_cuda_tokens(one_autotune_config):
    """On a GPU, bf16 with the decode graphs captured: the fused op chosen as the Triton kernel, and the greedy tokens
    of the engine without it at least 3 in 4 (compiled, the fused norm may sum a head's squares in another fp32
    order than the norm kernel's tile: H200 run 55 kept the lone request's 49 tokens and 25 of 32 streams'; a wrong
    kernel -- a missing gate, a stale slice -- flips nearly every token of random weights)."""
    from tests.test_qwen_engine import engine_config
    from tests.test_qwen_shared_stream import one_by_one

    graphed = dict(device="cuda", dtype="bf16", kernels="auto", decode_graphs="capture", autotune_table="off")
    _, off = one_by_one(engine_config(weights="packed", gdn_decode_norm=False, **graphed))
    health, on = one_by_one(engine_config(weights="packed", gdn_decode_norm=True, **graphed))
    assert health["runner"]["graph_steps"] > 0
    assert health["kernels"].get(gd.ROWS_NORM_NAME) == "triton", health["kernels"]
    same = sum(a == b for o1, o2 in zip(on, off, strict=True) for a, b in zip(o1, o2, strict=True))
    assert same >= 0.75 * sum(len(o) for o in off), (on, off)
