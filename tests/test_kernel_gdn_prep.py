"""kernels/gdn_prep.py (GDN decode-row preparation in one launch) against its reference, the model's own torch ops
(`gdn_decode_prep_reference`), under the Triton interpreter on CPU. Tolerances: the module's `compare` (1e-5 of
max |ref| for fp32, 1e-2 for bf16: one bf16 ulp of a rounded conv / SiLU output carried through the L2 norm; the
conv pool, advanced in place by both, bit for bit)."""

import pytest
import torch

from engine_core.registry import Registry
from kernels import gdn_prep, pdl
from kernels.gdn_prep import (
    compare,
    compare_ba,
    gdn_decode_prep_ba_reference,
    gdn_decode_prep_ba_triton,
    gdn_decode_prep_reference,
    gdn_decode_prep_triton,
    random_inputs,
    random_inputs_ba,
)

pytestmark = pytest.mark.skipif(gdn_prep.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hk,dk,r,dv", [(1, 2, 32, 2, 16), (3, 2, 32, 2, 32), (4, 1, 16, 1, 16), (2, 2, 24, 2, 16),
                                          (5, 3, 32, 4, 8), (2, 2, 24, 3, 24), (2, 4, 16, 5, 12)])
@pytest.mark.parametrize("tiny", [False, True])
def test_matches_reference(dtype, d, hk, dk, r, dv, tiny):
    """Non-power-of-two head dims and repeat counts (masks); `tiny`: inputs scaled so that some q/k heads have
    squared norms near the L2 eps (1e-6 inside the root), which the eps placement then decides."""
    args = list(random_inputs(d, hk, dk, r, dv, dtype=dtype, seed=d * 7 + dk, device=DEVICE))
    if tiny:
        args[0] = (args[0].float() * 1e-4).to(dtype)
        args[1] = (args[1].float() * 1e-4).to(dtype)
    pool_before = args[1].clone()
    ref = gdn_decode_prep_reference(*with_pool(args, pool_before.clone()))
    out = gdn_decode_prep_triton(*args)
    assert out[-1] is args[1]  # the pool, written in place
    problem = compare(out, ref)
    assert problem is None, problem
    # the shifted window is an exact copy (no arithmetic): bit for bit; the other rows untouched
    assert torch.equal(out[-1], ref[-1])
    rows, untouched = args[2], torch.ones(pool_before.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[rows] = False
    assert torch.equal(out[-1][untouched], pool_before[untouched])
    km1 = pool_before.shape[-1]
    assert torch.equal(out[-1][rows, :, :km1 - 1], pool_before[rows, :, 1:])  # shifted by one
    assert torch.equal(out[-1][rows, :, km1 - 1], args[0])  # the new input last
    if dtype == torch.bfloat16:  # beta (sigmoid) and v (conv -> SiLU, two bf16 roundings) are elementwise: identical
        for i, name in ((3, "beta"), (2, "v")):  # but for exp / summation-order ulps landing on a rounding tie
            assert float((out[i] == ref[i]).float().mean()) >= 0.99, name


def with_pool(args, pool):
    """args with the conv pool replaced (the op writes it in place: reference and kernel each get their own)."""
    return (args[0], pool, *args[2:])


def test_in_place_window_read_before_written():
    """K = 4 and K = 2 (one tap: the window is just the previous input), int32 rows, and every row of a small pool
    advanced twice in a row: the second step must see the first one's writes (a stale or half-shifted window would
    change the conv output)."""
    for kernel, dtype in ((4, torch.bfloat16), (2, torch.float32), (5, torch.float32)):
        args = list(random_inputs(3, 2, 16, 2, 16, kernel=kernel, slots=3, dtype=dtype, seed=kernel, device=DEVICE))
        args[2] = args[2].to(torch.int32)
        ref_pool = args[1].clone()
        for step in range(2):
            args[0] = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(step)).to(dtype).to(DEVICE)
            ref = gdn_decode_prep_reference(*with_pool(args, ref_pool))
            out = gdn_decode_prep_triton(*args)
            assert compare(out, ref) is None, (kernel, step, compare(out, ref))


def test_mutating_op_schema():
    args = random_inputs(2, 2, 16, 2, 16, dtype=torch.float32, device=DEVICE)
    torch.library.opcheck(torch.ops.qwen.gdn_decode_prep_.default, args, test_utils=("test_schema", "test_faketensor"))


def test_gates_cover_softplus_branches():
    """a + dt_bias spanning very negative (series log1p), moderate and > 20 (identity) values."""
    args = list(random_inputs(4, 2, 16, 2, 16, dtype=torch.float32, seed=3, device=DEVICE))
    args[5] = torch.tensor([[-30.0, -12.0, -1.0, 0.5], [3.0, 19.5, 20.5, 40.0], [-5.0, 0.0, 1e-3, 8.0],
                            [25.0, -25.0, 2.0, -2.0]], device=DEVICE)
    args[7] = torch.zeros(4, device=DEVICE)
    ref = gdn_decode_prep_reference(*with_pool(args, args[1].clone()))
    out = gdn_decode_prep_triton(*args)
    g_ref, g = ref[4], out[4]
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-12)


def test_breaking_the_l2_norm_is_caught():
    """The comparison has teeth: q without its Dk^-1/2 scale differs far beyond the tolerance."""
    args = random_inputs(2, 2, 32, 2, 16, dtype=torch.float32, seed=5, device=DEVICE)
    ref = gdn_decode_prep_reference(*with_pool(args, args[1].clone()))
    out = list(gdn_decode_prep_triton(*args))
    assert compare(tuple(out), ref) is None
    out[0] = out[0] * 32 ** 0.5
    assert compare(tuple(out), ref) is not None
    out = list(gdn_decode_prep_triton(*args))  # a second step: the pool moved on from the reference's
    assert compare(tuple(out), ref) is not None


def test_registry_self_check():
    reg = Registry("auto")
    gdn_prep.register(reg)
    assert reg.self_check(DEVICE) == {"gdn_decode_prep": "triton passed",
                                      "gdn_decode_prep_ba": "triton passed; gemm+triton passed"}
    args = random_inputs(2, 2, 32, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    assert reg.choose("gdn_decode_prep", **gdn_prep.describe(*args)).name == "triton"
    args64 = random_inputs(2, 2, 32, 2, 16, dtype=torch.float64, device=DEVICE)
    assert reg.choose("gdn_decode_prep", **gdn_prep.describe(*args64)).name == "reference"


# ---- gdn_decode_prep_ba: the b / a projections inside the kernel ----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hk,dk,r,dv,hidden", [(1, 2, 32, 2, 16, 2048), (3, 2, 32, 2, 32, 600), (4, 1, 16, 1, 16, 96),
                                                 (2, 3, 24, 3, 8, 1030), (5, 2, 16, 4, 16, 512),
                                                 (2, 2, 16, 2, 16, 4100)])
def test_ba_matches_reference(dtype, d, hk, dk, r, dv, hidden):
    """Hidden sizes below, at, between and above multiples of BA_BLOCK_H (2,048: 4,100 takes three steps, the last
    masked; test_ba_tilings covers steps of 512 and 1,024 at 2,048) (masked tails), non-power-of-two repeat
    counts. `compare_ba`'s bounds; in bf16 the kernel's b / a are the reference's bit for bit but for fp32 summation
    order landing on a rounding boundary (>= 97% here), and q / k / v and the pool are exactly the plain op's."""
    args = random_inputs_ba(d, hk, dk, r, dv, hidden=hidden, dtype=dtype, seed=d * 5 + hidden, device=DEVICE)
    ref = gdn_decode_prep_ba_reference(*with_pool(args, args[1].clone()))
    plain_pool = args[1].clone()
    out = gdn_decode_prep_ba_triton(*args)
    assert out[-1] is args[1]
    problem = compare_ba(out, ref)
    assert problem is None, problem
    assert out[5].shape == (d, 2 * hk * r) and out[5].dtype == dtype
    if dtype == torch.bfloat16:
        assert float((out[5] == ref[5]).float().mean()) >= 0.97
    # the plain op on the kernel's own b / a: the same q, k, v, beta, g, bit for bit
    hv = hk * r
    plain = gdn_decode_prep_triton(args[0], plain_pool, args[2], args[3], out[5][:, :hv], out[5][:, hv:], *args[6:])
    for i in range(5):
        assert torch.equal(out[i], plain[i]), i
    assert torch.equal(out[-1], plain[-1])


@pytest.mark.parametrize("d,hk,dk,r,dv,hidden", [(1, 2, 32, 2, 16, 2048), (3, 2, 24, 3, 8, 600),
                                                 (2, 1, 16, 1, 16, 96), (2, 2, 16, 4, 16, 512)])
@pytest.mark.parametrize("ba_first", [False, True])
def test_split_v_same_bits(monkeypatch, d, hk, dk, r, dv, hidden, ba_first):
    """SPLIT_V (each k-head's q / k channels, then each of its value heads, in programs of their own): every output
    and the advanced pool bit for bit as the one-program-a-k-head launch, with b / a inside (BA) and given, at repeat
    counts 1-4 and head dims that are not powers of two; BA_FIRST too."""
    args = random_inputs_ba(d, hk, dk, r, dv, hidden=hidden, dtype=torch.bfloat16, seed=d + hidden, device=DEVICE)
    monkeypatch.setattr(gdn_prep, "BA_FIRST", ba_first)
    monkeypatch.setattr(gdn_prep, "SPLIT_V_ROWS", 0)
    one = gdn_decode_prep_ba_triton(*with_pool(args, args[1].clone()))
    hv = hk * r
    plain_args = (args[0], args[1].clone(), args[2], args[3], one[5][:, :hv], one[5][:, hv:], *args[6:])
    plain_one = gdn_decode_prep_triton(*plain_args)
    monkeypatch.setattr(gdn_prep, "SPLIT_V_ROWS", d)
    split = gdn_decode_prep_ba_triton(*with_pool(args, args[1].clone()))
    for i in range(7):
        assert torch.equal(split[i], one[i]), i
    plain_split = gdn_decode_prep_triton(args[0], args[1].clone(), *plain_args[2:])
    for i in range(6):
        assert torch.equal(plain_split[i], plain_one[i]), i


@pytest.mark.parametrize("d,hk,dk,r,dv,hidden", [(1, 2, 32, 2, 16, 2048), (3, 2, 24, 3, 8, 600),
                                                 (2, 2, 16, 4, 16, 512)])
@pytest.mark.parametrize("split,ba_first", [(False, False), (True, False), (False, True)])
def test_early_same_bits(monkeypatch, d, hk, dk, r, dv, hidden, split, ba_first):
    """EARLY (early loads, the engine's `early_loads`: the row, the gates' parameters, the conv windows' taps and
    weights and, BA, the b / a dot products before the PDL wait; qkv after it): every output and the advanced pool
    bit for bit as the plain launch's, with b / a inside and given, SPLIT_V and BA_FIRST too (random weights: no
    exact zero, whose sign `_conv_of` may not keep). Under the interpreter the wait is a no-op, so this checks the
    EARLY build's arithmetic; its order (loads, no store, before the wait) is tests/sm90_compile.py's "early" check."""
    args = random_inputs_ba(d, hk, dk, r, dv, hidden=hidden, dtype=torch.bfloat16, seed=7 * d + hidden, device=DEVICE)
    monkeypatch.setattr(gdn_prep, "BA_FIRST", ba_first)
    monkeypatch.setattr(gdn_prep, "SPLIT_V_ROWS", d if split else 0)
    hv = hk * r
    runs = {}
    for early in (False, True):
        monkeypatch.setattr(pdl, "early_options", lambda early=early: {"EARLY": True} if early else {})
        ba = gdn_decode_prep_ba_triton(*with_pool(args, args[1].clone()))
        plain = gdn_decode_prep_triton(args[0], args[1].clone(), *args[2:4], ba[5][:, :hv], ba[5][:, hv:], *args[6:])
        runs[early] = (ba, plain)
    for got, want in zip(runs[True], runs[False]):
        assert len(got) == len(want)
        for i, (x, y) in enumerate(zip(got, want)):
            assert torch.equal(x, y), i
    assert compare_ba(runs[True][0], gdn_decode_prep_ba_reference(*with_pool(args, args[1].clone()))) is None


@pytest.mark.parametrize("ba_first,block_h,warps", [(True, None, None), (True, 2048, 8), (False, 1024, 4)])
def test_ba_tilings(monkeypatch, ba_first, block_h, warps):
    """The launch's alternatives (benchmarks/gdn_prep_bench.py): the gate inputs first (BA_FIRST, the same operations)
    bit for bit as the default order; other b / a steps (BA_BLOCK_H) or warps within `compare_ba` of the reference,
    v and the pool bit for bit, and q / k too at the default's warps (other warps retile the L2 norms' reductions
    when compiled: H200, gdn_prep_bench run 2)."""
    args = random_inputs_ba(3, 2, 32, 2, 16, hidden=2048, dtype=torch.bfloat16, seed=7, device=DEVICE)
    ref = gdn_decode_prep_ba_reference(*with_pool(args, args[1].clone()))
    default = gdn_decode_prep_ba_triton(*with_pool(args, args[1].clone()))
    monkeypatch.setattr(gdn_prep, "BA_FIRST", ba_first)
    if block_h is not None:
        monkeypatch.setattr(gdn_prep, "BA_BLOCK_H", block_h)
        monkeypatch.setattr(gdn_prep, "NUM_WARPS", warps)
    out = gdn_decode_prep_ba_triton(*with_pool(args, args[1].clone()))
    assert compare_ba(out, ref) is None
    for i in (0, 1, 2, 6) if warps in (None, gdn_prep.DEFAULT_TILING[2]) else (2, 6):  # q, k, v, the pool
        assert torch.equal(out[i], default[i]), i
    if block_h is None:
        for i in range(7):
            assert torch.equal(out[i], default[i]), i


def test_ba_step_engine_option(monkeypatch):
    """The engine's `gdn_prep_ba_step` (the baseline one flag away): a power of two in 16..8192, else a clear error;
    an engine sets the module's BA_BLOCK_H from it (process-wide, before its self-checks and warm-up)."""
    from qwen_engine.engine import QwenEngineConfig
    from tests.test_qwen_engine import engine_config, run

    assert QwenEngineConfig().gdn_prep_ba_step == 2048 == gdn_prep.BA_BLOCK_H
    for bad in (0, 8, 1000, 16384, 512.0, "512"):
        with pytest.raises(ValueError, match="gdn_prep_ba_step"):
            QwenEngineConfig(gdn_prep_ba_step=bad)
    monkeypatch.setattr(gdn_prep, "BA_BLOCK_H", gdn_prep.BA_BLOCK_H)  # restored after the test

    async def body(engine):
        return gdn_prep.BA_BLOCK_H
    assert run(engine_config(gdn_prep_ba_step=512), body) == 512


def test_split_v_rows():
    """SPLIT_V_ROWS: calls of 1..SPLIT_V_ROWS rows launch split, larger ones and 0 rows whole; 0 never splits."""
    saved = gdn_prep.SPLIT_V_ROWS
    try:
        gdn_prep.SPLIT_V_ROWS = 2
        assert [gdn_prep.split_v(d) for d in (0, 1, 2, 3, 32)] == [False, True, True, False, False]
        gdn_prep.SPLIT_V_ROWS = 0
        assert not any(gdn_prep.split_v(d) for d in (0, 1, 2, 32))
    finally:
        gdn_prep.SPLIT_V_ROWS = saved


def test_split_v_engine_option(monkeypatch):
    """The engine's `gdn_prep_split_v_rows` (default 4: H200 variants run 2) sets the module's SPLIT_V_ROWS,
    process-wide; a negative, bool or non-int value is a clear error; the engine's greedy tokens are the same split
    or not (the same bits)."""
    from qwen_engine.engine import QwenEngineConfig
    from tests.test_qwen_engine import CPU_TRITON, collect, engine_config, run

    assert QwenEngineConfig().gdn_prep_split_v_rows == 4
    for bad in (-1, True, 1.0, "2", None):
        with pytest.raises(ValueError, match="gdn_prep_split_v_rows"):
            QwenEngineConfig(gdn_prep_split_v_rows=bad)
    monkeypatch.setattr(gdn_prep, "SPLIT_V_ROWS", gdn_prep.SPLIT_V_ROWS)  # restored after the test

    async def body(engine):
        tokens, _ = await collect(engine, [5, 9, 2, 7, 11], max_new_tokens=4)
        return gdn_prep.SPLIT_V_ROWS, tokens, engine.registry.choices().get("gdn_decode_prep_ba", {}).get("last")

    # CPU_TRITON: the decode prep on its Triton kernel where Triton runs on the engine's CPU tensors (the
    # interpreter, asked for as "triton": "auto" on a CPU device applies the references); a GPU host's compiled
    # Triton does not, so "auto" and the reference there; a lone request decodes 1 row
    split_on, tokens_on, impl = run(engine_config(gdn_prep_split_v_rows=4, kernels=CPU_TRITON), body)
    split_off, tokens_off, _ = run(engine_config(gdn_prep_split_v_rows=0, kernels=CPU_TRITON), body)
    assert split_on == 4 and split_off == 0 and impl is not None
    assert (impl != "reference") == gdn_prep._interpreted(), impl
    assert tokens_on == tokens_off and len(tokens_on) == 4



    """compare_ba fails on b / a off by 2%, on g off by 1e-3 where a is the reference's, and on q unscaled; it
    accepts g moved by exactly what one ulp of a moves it (the reach bound), and refuses the same g when a was not
    moved."""
    import torch.nn.functional as F

    args = random_inputs_ba(3, 2, 32, 2, 16, hidden=300, dtype=torch.bfloat16, seed=9, device=DEVICE)
    ref = gdn_decode_prep_ba_reference(*with_pool(args, args[1].clone()))
    out = list(gdn_decode_prep_ba_triton(*with_pool(args, args[1].clone())))
    assert compare_ba(tuple(out), ref) is None
    hv = out[5].shape[-1] // 2
    bad = list(out)
    bad[5] = (out[5].float() * 1.02).to(out[5].dtype)
    assert "ba" in compare_ba(tuple(bad), ref)
    bad = list(out)
    bad[4] = out[4] * (1 + 1e-3)
    assert "g" in compare_ba(tuple(bad), ref)
    bad = list(out)
    bad[0] = out[0] * 32 ** 0.5
    assert compare_ba(tuple(bad), ref) is not None
    # one bf16 ulp up on a[0, 0], and g[0, 0] recomputed from it with the op's own gate parameters
    a_log, dt_bias = args[6], args[7]
    moved = out[5].clone()
    moved[0, hv] = (moved[0, hv].view(torch.int16) + 1).view(torch.bfloat16)  # one ulp away from zero
    g_moved = out[4].clone()
    g_moved[0, 0] = -a_log[0].float().exp() * F.softplus(moved[0, hv].float() + dt_bias[0].float())
    assert not torch.equal(g_moved, out[4])
    ok = list(out)
    ok[5], ok[4] = moved, g_moved
    assert compare_ba(tuple(ok), ref) is None
    ok[5] = out[5]  # the same g without the moved input: beyond 1e-5
    assert "g" in compare_ba(tuple(ok), ref)


def test_ba_fallback_is_the_gemm_then_the_plain_kernel():
    """A disabled fused kernel hands the call to F.linear + the plain prep kernel (not the torch reference), whose ba
    is the reference's bit for bit."""
    reg = Registry("auto")
    gdn_prep.register(reg)
    args = random_inputs_ba(2, 2, 32, 2, 16, hidden=200, dtype=torch.bfloat16, seed=4, device=DEVICE)
    reg.disable("gdn_decode_prep_ba", "triton", "test")
    assert reg.choose("gdn_decode_prep_ba", **gdn_prep.describe_ba(*args)).name == "gemm+triton"
    ref = gdn_decode_prep_ba_reference(*with_pool(args, args[1].clone()))
    out = reg.call("gdn_decode_prep_ba", *args)
    assert torch.equal(out[5], ref[5]) and compare_ba(out, ref) is None


def test_ba_mutating_op_schema():
    args = random_inputs_ba(2, 2, 16, 2, 16, hidden=64, dtype=torch.float32, device=DEVICE)
    torch.library.opcheck(torch.ops.qwen.gdn_decode_prep_ba_.default, args,
                          test_utils=("test_schema", "test_faketensor"))
