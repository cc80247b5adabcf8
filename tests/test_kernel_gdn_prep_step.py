"""kernels/gdn_prep_step.py (the GDN decode prep and recurrent step in one launch) against its reference (the prep's
then the step's, `gdn_decode_prep_step_reference`) and against the two launches it replaces, under the Triton
interpreter on CPU (compiled on a GPU host). Tolerances: the module's `compare` (o and the state pool within 1e-5 of
max |ref| for fp32, 1e-2 for bf16 -- the prep's; the conv pool bit for bit); against the two launches at the same
warps: every output bit for bit."""

import pytest
import torch

from engine_core.registry import Registry
from kernels import gdn_prep_step, pdl, split_k
from kernels.gdn_prep_step import (
    compare,
    gdn_decode_prep_step_reference,
    gdn_decode_prep_step_triton,
    gdn_decode_prep_then_step,
    random_inputs,
)

pytestmark = pytest.mark.skipif(gdn_prep_step.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fresh(args):
    """args with both pools copied (the op advances them in place: each run gets its own)."""
    return (args[0], args[1].clone(), *args[2:8], args[8].clone(), *args[9:])


def counters_clear() -> bool:
    buf = split_k.split_counters(torch.device(DEVICE), 1)
    return buf is None or int(buf.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hk,dk,r,dv,hidden", [(1, 2, 32, 2, 16, 96), (3, 2, 32, 2, 32, 64), (4, 1, 16, 1, 16, 40),
                                                 (2, 2, 24, 3, 24, 50), (5, 2, 32, 2, 128, 96)])
def test_matches_reference_and_the_two_launches(dtype, d, hk, dk, r, dv, hidden):
    """Non-power-of-two head dims and repeat counts (masks); (5, 2, 32, 2, 128): 8 slices of 16 state columns a head,
    so 16 programs share a k-head's q / k window and the last of them writes it. b / a exact in any order (bf16:
    `random_inputs`' exact_ba), so the reference's F.linear rounds them as the kernel does."""
    args = random_inputs(d, hk, dk, r, dv, hidden=hidden, dtype=dtype, seed=d * 7 + dk, device=DEVICE,
                         exact_ba=dtype != torch.float32)
    ref = gdn_decode_prep_step_reference(*fresh(args))
    two = gdn_decode_prep_then_step(*fresh(args))
    run = fresh(args)
    out = gdn_decode_prep_step_triton(*run)
    assert out[1] is run[1] and out[2] is run[8]  # both pools, advanced in place
    problem = compare(out, ref)
    assert problem is None, problem
    for name, x, y in zip(("o", "conv_pool", "pool"), out, two):
        assert torch.equal(x, y), name
    # the untouched pool rows stay as they were; the written conv rows hold the window shifted by one
    rows, untouched = args[2], torch.ones(args[1].shape[0], dtype=torch.bool, device=DEVICE)
    untouched[rows] = False
    assert torch.equal(out[1][untouched], args[1][untouched]) and torch.equal(out[2][untouched], args[8][untouched])
    km1 = args[1].shape[-1]
    assert torch.equal(out[1][rows, :, :km1 - 1], args[1][rows, :, 1:])
    assert torch.equal(out[1][rows, :, km1 - 1], args[0])
    assert counters_clear()  # the last arrivals re-armed every counter they used


@pytest.mark.parametrize("block_v,warps,taps_early,ba_early,own", [
    (16, 4, False, False, False), (32, 8, False, False, False), (64, 4, True, True, False),
    (32, 4, True, False, False), (32, 4, False, False, True), (None, 8, False, True, True)])
@pytest.mark.parametrize("early", [False, True])
def test_launch_variants(monkeypatch, block_v, warps, taps_early, ba_early, own, early):
    """The launch's alternatives (benchmarks/gdn_prep_step_bench.py), with and without early loads: within `compare`
    of the reference, and at the prep's 4 warps and gate tile bit for bit as the two launches (other warps may retile
    the q / k norms' sums, a one-head gate tile the b / a sums); the conv pool always bit for bit."""
    args = random_inputs(3, 2, 32, 2, 128, hidden=80, dtype=torch.bfloat16, seed=11, device=DEVICE, exact_ba=True)
    two = gdn_decode_prep_then_step(*fresh(args))
    ref = gdn_decode_prep_step_reference(*fresh(args))
    monkeypatch.setattr(gdn_prep_step, "BLOCK_V", block_v)
    monkeypatch.setattr(gdn_prep_step, "NUM_WARPS", warps)
    monkeypatch.setattr(gdn_prep_step, "TAPS_EARLY", taps_early)
    monkeypatch.setattr(gdn_prep_step, "BA_EARLY", ba_early)
    monkeypatch.setattr(gdn_prep_step, "OWN_GATES", own)
    monkeypatch.setattr(pdl, "early_options", lambda: {"EARLY": True} if early else {})
    out = gdn_decode_prep_step_triton(*fresh(args))
    assert compare(out, ref) is None
    assert torch.equal(out[1], two[1])
    if (warps == 4 and not own) or DEVICE == "cpu":  # (the interpreter has no warps, and sums in one order)
        for x, y in zip(out, two):
            assert torch.equal(x, y)
    assert counters_clear()


def test_no_counters_runs_the_two_launches(monkeypatch):
    """Where no arrival counters can be had (a first use inside a CUDA-graph capture) the op runs the prep and the
    step as two launches: the same outputs."""
    args = random_inputs(2, 2, 16, 2, 16, hidden=48, dtype=torch.float32, seed=3, device=DEVICE)
    want = gdn_decode_prep_step_triton(*fresh(args))
    calls = []
    monkeypatch.setattr(gdn_prep_step, "split_counters", lambda device, tiles: None)
    real = gdn_prep_step.gdn_decode_prep_then_step
    monkeypatch.setattr(gdn_prep_step, "gdn_decode_prep_then_step", lambda *a: calls.append(1) or real(*a))
    got = gdn_decode_prep_step_triton(*fresh(args))
    assert calls and all(torch.equal(x, y) for x, y in zip(got, want))


def test_compare_catches_what_matters():
    """`compare` fails on a conv pool off by one element, a state pool or o off by 2% (bf16 tolerance 1e-2), and on
    NaN; it passes the reference against itself."""
    args = random_inputs(2, 2, 16, 2, 16, hidden=48, dtype=torch.bfloat16, seed=5, device=DEVICE, exact_ba=True)
    ref = gdn_decode_prep_step_reference(*fresh(args))
    assert compare(ref, ref) is None
    conv = ref[1].clone()
    conv.view(-1)[0] += 1
    assert "conv_pool" in compare((ref[0], conv, ref[2]), ref)
    assert "pool" in compare((ref[0], ref[1], ref[2] * 1.02), ref)
    assert "o" in compare((ref[0] * 1.02, ref[1], ref[2]), ref)
    nan = ref[0].clone()
    nan.view(-1)[0] = float("nan")
    assert compare((nan, ref[1], ref[2]), ref) is not None


def test_registry_self_check_and_guards():
    """Both implementations pass the start-up self-check; int32 rows, a pool of another head shape or a
    non-contiguous pool are refused (the reference serves them)."""
    reg = Registry()
    gdn_prep_step.register(reg)
    report = reg.self_check(DEVICE)
    assert report[gdn_prep_step.NAME] == "triton passed; prep+step passed", report
    args = list(random_inputs(2, 2, 16, 2, 16, hidden=48, dtype=torch.float32, seed=8, device=DEVICE))
    assert gdn_prep_step.supports(**gdn_prep_step.describe(*args))
    for i, bad in ((2, args[2].int()), (8, args[8][:, :, :8]), (8, args[8].transpose(2, 3))):
        worse = list(args)
        worse[i] = bad
        assert not gdn_prep_step.supports(**gdn_prep_step.describe(*worse)), i


def test_mutating_op_schema():
    args = random_inputs(2, 2, 16, 2, 16, hidden=48, dtype=torch.float32, device=DEVICE)
    torch.library.opcheck(torch.ops.qwen.gdn_decode_prep_step_.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_engine_option(monkeypatch):
    """The engine's `gdn_prep_in_step_rows` (default 0: never): an int >= 0, else a clear error; with it every GDN
    layer of the one-row decode steps calls the fused op (on its Triton kernel where the interpreter runs on the
    engine's CPU tensors) and the greedy tokens are the engine's without it."""
    from qwen_engine.engine import QwenEngineConfig
    from tests.test_qwen_engine import CPU_TRITON, engine_config
    from tests.test_qwen_shared_stream import one_by_one

    assert QwenEngineConfig().gdn_prep_in_step_rows == 0
    for bad in (-1, True, 1.0, "2", None):
        with pytest.raises(ValueError, match="gdn_prep_in_step_rows"):
            QwenEngineConfig(gdn_prep_in_step_rows=bad)
    h_off, off = one_by_one(engine_config(kernels=CPU_TRITON))
    assert h_off["gdn_prep_in_step_layers"] == 0 and gdn_prep_step.NAME not in h_off["kernels"]
    h_on, on = one_by_one(engine_config(kernels=CPU_TRITON, gdn_prep_in_step_rows=1))
    assert h_on["gdn_prep_in_step_layers"] > 0
    assert h_on["kernels"].get(gdn_prep_step.NAME) == ("triton" if gdn_prep_step._interpreted() else "reference")
    assert on == off and sum(map(len, on)) > 0
    h_big, big = one_by_one(engine_config(kernels=CPU_TRITON, gdn_prep_in_step_rows=2))  # one-row steps: not taken
    assert gdn_prep_step.NAME not in h_big["kernels"] and big == off
