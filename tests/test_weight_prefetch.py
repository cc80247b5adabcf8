"""The decode kernels' weight prefetch (kernels/pdl.py `prefetch_l2`, the Qwen engine's `weight_prefetch`): asked for
only while PDL is on and, by each launcher's guard, only for contiguous 16-byte-aligned ranges; the grouped GEMV's
prefetch of the next launch's experts only for contiguous, aligned slabs; and on a GPU, with the launches shown to
have asked for it, every kernel's output the same bits with and without it (a prefetch moves no data into registers:
what these can catch is a fault or a clobbered register, not a numeric change). The PTX (the prefetch before
griddepcontrol.wait, nothing else that touches memory) is compiled for sm_90 in tests/sm90_compile.py; the source
rule in tests/test_pdl.py; the speed in benchmarks/RESULTS.md."""

import pytest
import torch

from kernels import pdl

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton takes GPU tensors only


@pytest.fixture
def prefetch_state():
    """Restores the process-wide PDL and prefetch settings after a test that changes them."""
    saved = pdl._ENABLED, pdl._PREFETCH
    yield
    pdl._ENABLED, pdl._PREFETCH = saved


def test_options_need_pdl_prefetch_and_alignment(prefetch_state):
    pdl._ENABLED = False
    assert pdl.set_prefetch("all") == "all"
    assert pdl.prefetch_options(True) == {} and pdl.prefetch_mode() == "off"  # no PDL: nothing to overlap
    pdl._ENABLED = True  # (as set_enabled does on a Hopper GPU; nothing is launched here)
    assert pdl.prefetch_options(True) == {"PREFETCH": True} and pdl.prefetch_next()
    assert pdl.prefetch_options(False) == {}
    pdl.set_prefetch("own")
    assert pdl.prefetch_options(True) == {"PREFETCH": True} and not pdl.prefetch_next()
    assert pdl.set_prefetch("next") == "next"  # only the MoE gate_up's prefetch of down: no kernel's own weights
    assert pdl.prefetch_options(True) == {} and pdl.prefetch_next()
    assert pdl.set_prefetch(False) == "off" and pdl.prefetch_options(True) == {} and not pdl.prefetch_next()
    assert pdl.set_prefetch(True) == "all"
    with pytest.raises(ValueError, match="weight prefetch"):
        pdl.set_prefetch("some")
    assert pdl.aligned16(0, 16, 4096) and not pdl.aligned16(16, 8) and not pdl.aligned16(2050)
    before = dict(pdl.PREFETCH_LAUNCHES)
    pdl.prefetch_options(True), pdl.prefetch_options(False)
    assert pdl.PREFETCH_LAUNCHES["own"] == before["own"] + 1  # counted where a launch takes it


def test_next_prefetch_args_only_for_contiguous_aligned_slabs():
    from kernels.w4a16_gemv import next_prefetch_args

    packed = torch.zeros(4, 64, 32, dtype=torch.uint8)  # [E, N, K/2]: K = 64
    scales = torch.zeros(4, 64, 4, dtype=torch.float8_e4m3fn)
    args = next_prefetch_args(packed, scales)
    assert args["PREFETCH_NEXT"] is True
    assert (args["s_nwe"], args["NEXT_W_BYTES"], args["s_nse"], args["NEXT_S_BYTES"]) == (2048, 2048, 256, 256)
    # addresses as ints: tensors would add their dtypes to the autotuner's key and miss the shipped table's picks
    assert (args["nw"], args["ns"]) == (packed.data_ptr(), scales.data_ptr())
    assert next_prefetch_args(packed[:, :, :16], scales[:, :, :2]) == {}  # rows with gaps: not one slab
    assert next_prefetch_args(packed[:, :3], scales[:, :3]) == {}  # 3 of 64 rows: gaps between the experts' slabs
    odd = torch.zeros(4, 3, 2, dtype=torch.uint8), torch.zeros(4, 3, 1, dtype=torch.uint8)  # 6-byte slabs
    assert next_prefetch_args(*odd) == {}


def test_engine_option(prefetch_state):
    """Off by default; off | own | all (a clear error otherwise)."""
    from qwen_engine.engine import QwenEngineConfig

    assert QwenEngineConfig().weight_prefetch == "off"
    assert QwenEngineConfig(weight_prefetch="own").weight_prefetch == "own"
    for bad in ("yes", True):
        with pytest.raises((TypeError, ValueError), match="weight_prefetch"):
            QwenEngineConfig(weight_prefetch=bad)


# ---- the launchers' guards (CPU: the interpreter runs the kernels without PDL; the decision is recorded) ------------
@pytest.fixture
def asked(monkeypatch):
    """Every `aligned` argument the launchers hand `pdl.prefetch_options` (which then returns {}: the interpreter has
    no PTX), and every `next_prefetch_args` result, in call order."""
    seen = {"own": [], "next": []}
    monkeypatch.setattr(pdl, "prefetch_options", lambda aligned: seen["own"].append(bool(aligned)) or {})
    monkeypatch.setattr(pdl, "prefetch_next", lambda: True)
    from kernels import w4a16_gemv

    real = w4a16_gemv.next_prefetch_args
    monkeypatch.setattr(w4a16_gemv, "next_prefetch_args", lambda *a: seen["next"].append(real(*a)) or {})
    return seen


def test_fp8_gemv_guard_needs_contiguous_aligned_rows(asked):
    from kernels.fp8_gemv import fp8_gemv_op

    x, s_in = torch.randn(1, 64, device=DEVICE), torch.tensor(0.05, device=DEVICE)
    w = (torch.randn(24, 80, device=DEVICE) * 40).to(torch.float8_e4m3fn)
    ws = torch.rand(24, device=DEVICE) * 0.01
    fp8_gemv_op(x, w[:, :64], ws, s_in, torch.float32, prequantize=True)  # rows of 80 bytes, 64 read: not one range
    fp8_gemv_op(x, w[:, :64].contiguous(), ws, s_in, torch.float32, prequantize=True)
    x2 = torch.randn(1, 72, device=DEVICE)
    fp8_gemv_op(x2, w[:, :72].contiguous(), ws, s_in, torch.float32, prequantize=True)  # 72-byte rows: not 16s
    assert asked["own"] == [False, True, False]


def test_w4a16_guards(asked):
    from kernels.w4a16_gemv import w4a16_gemv_launch
    from tests.test_kernel_w4a16 import moe_inputs, rand_weight, rand_x

    dense = rand_weight(16, 256, seed=1)
    w4a16_gemv_launch(rand_x(1, 256, seed=2), *dense)  # 128 packed + 16 scale bytes a row: aligned
    w4a16_gemv_launch(rand_x(1, 64, seed=3), *rand_weight(16, 64, seed=4))  # 4 scale bytes a row: not
    assert asked["own"] == [True, False]
    w13, w2, idx, wts, x = moe_inputs(1, e=4, h=64, i=32, top_k=2, seed=5)
    w4a16_gemv_launch(x, *w13, pair_expert=idx, a_div=2, swiglu=True, then=(w2.packed, w2.scales))
    assert asked["next"] == [dict(nw=w2.packed.data_ptr(), ns=w2.scales.data_ptr(), s_nwe=64 * 16, s_nse=64 * 2,
                                  NEXT_W_BYTES=64 * 16, NEXT_S_BYTES=64 * 2, PREFETCH_NEXT=True)]
    assert asked["own"] == [True, False]  # a grouped launch prefetches nothing of its own (its experts are data)


def test_w4a16_mma_takes_next_only_one_program_a_pair(asked):
    """The tensor-core GEMV's gate_up asks for down's slabs (`then`) one program a pair; its sorted path (programs of
    8 pairs of one expert) does not: `next_prefetch_args` is not even asked."""
    from kernels.w4a16_gemm import moe_align_fast
    from kernels.w4a16_mma import SORTED_BLOCK_M, w4a16_mma_launch
    from tests.test_kernel_w4a16 import moe_inputs

    w13, w2, idx, wts, x = moe_inputs(1, e=4, h=128, i=32, top_k=2, seed=5)
    w4a16_mma_launch(x, *w13, pair_expert=idx, a_div=2, swiglu=True, then=(w2.packed, w2.scales))
    assert asked["next"] == [dict(nw=w2.packed.data_ptr(), ns=w2.scales.data_ptr(), s_nwe=128 * 16, s_nse=128 * 2,
                                  NEXT_W_BYTES=128 * 16, NEXT_S_BYTES=128 * 2, PREFETCH_NEXT=True)]
    w13, w2, idx, wts, x = moe_inputs(6, e=4, h=128, i=32, top_k=2, seed=6)
    routing = moe_align_fast(idx, 4, SORTED_BLOCK_M)
    w4a16_mma_launch(x, *w13, pair_expert=idx, a_div=2, swiglu=True, routing=routing, then=(w2.packed, w2.scales))
    assert len(asked["next"]) == 1


def test_router_and_gdn_prep_guards(asked):
    from kernels.gdn_prep import gdn_decode_prep_ba_triton, random_inputs_ba
    from kernels.moe_router import _launch_gemv

    # fp32 rows of 512 bytes, then of 120 (not 16s)
    _launch_gemv(torch.randn(1, 128, device=DEVICE), torch.randn(16, 128, device=DEVICE) * 0.02, 4)
    _launch_gemv(torch.randn(1, 30, device=DEVICE), torch.randn(16, 30, device=DEVICE) * 0.02, 4)
    assert asked["own"] == [True, False]
    args = random_inputs_ba(1, 2, 16, 2, 16, hidden=64, dtype=torch.float32, seed=6, device=DEVICE)
    gdn_decode_prep_ba_triton(*args)  # w_ba rows of 256 bytes, contiguous
    assert asked["own"] == [True, False, True]


# ---- on a GPU: the same bits with and without the prefetch, which the launches did ask for ---------------------------
needs_hopper = pytest.mark.skipif(not (pdl.available() and pdl.device_supports()),
                                  reason="needs compiled Triton on an sm_90 / sm_100 CUDA GPU")


@pytest.fixture
def pdl_on(prefetch_state, monkeypatch):
    """PDL on; yields the list of every `prefetch_options` result and `next_prefetch_args` result of the launches."""
    pdl.set_enabled(True)
    from kernels import w4a16_gemv

    taken = []
    real_own, real_next = pdl.prefetch_options, w4a16_gemv.next_prefetch_args
    monkeypatch.setattr(pdl, "prefetch_options", lambda aligned: taken.append(real_own(aligned)) or taken[-1])
    monkeypatch.setattr(w4a16_gemv, "next_prefetch_args", lambda *a: taken.append(real_next(*a)) or taken[-1])
    yield taken


def _both(fn, taken: list):
    """fn() with the prefetch off, then "all" (PDL on for both): the two results; the "all" call's launches must have
    asked for a prefetch (a misaligned range would silently skip it and leave nothing tested)."""
    pdl.set_prefetch("off")
    off = fn()
    taken.clear()
    pdl.set_prefetch("all")
    on = fn()
    torch.cuda.synchronize()
    assert any(taken), "no launch took the prefetch"
    return off, on


def _assert_same(off, on):
    off, on = (off,) if torch.is_tensor(off) else off, (on,) if torch.is_tensor(on) else on
    for a, b in zip(off, on, strict=True):
        assert torch.equal(a, b)


@needs_hopper
@pytest.mark.parametrize("m,n,k", [(1, 12288, 2048), (1, 2048, 4096), (2, 1003, 2048), (1, 517, 2064)])
def test_fp8_gemv_same_bits(pdl_on, m, n, k):
    """Whole tiles and ragged last programs (1003, 517 rows over BLOCK_N 8: a shorter last range)."""
    from kernels.fp8_gemv import fp8_gemv_op

    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)
    ws = torch.rand(n, device="cuda", generator=g) * 0.01
    s_in = torch.tensor(0.05, device="cuda")
    off, on = _both(lambda: fp8_gemv_op(x, w, ws, s_in, torch.bfloat16, prequantize=True, block_n=8, block_k=512,
                                        num_warps=1), pdl_on)  # a pinned tile: two builds, not the tuner's 30
    _assert_same(off, on)


@needs_hopper
@pytest.mark.parametrize("n,e", [(1, 256), (4, 256), (1, 200)])
def test_router_same_bits(pdl_on, n, e):
    """E = 200: the last expert tile half full (its masked rows prefetch nothing)."""
    from kernels.moe_router import _launch_gemv

    g = torch.Generator(device="cuda").manual_seed(n + e)
    x = torch.randn(n, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(e, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    _assert_same(*_both(lambda: _launch_gemv(x, w, 8), pdl_on))


@needs_hopper
def test_w4a16_gemv_same_bits(pdl_on):
    """The dense GEMV (its own rows prefetched: SwiGLU with a ragged last program, and down) and the MoE GEMV, whose
    gate_up launch prefetches the down projection's slabs of its experts."""
    from kernels.w4a16_gemv import w4a16_gemv_launch
    from tests.test_kernel_w4a16 import moe_inputs, rand_weight, rand_x

    cfg = dict(BLOCK_N=4, BLOCK_K=512, num_warps=2)  # pinned: two builds a launch kind, not the tuner's 34
    gate_up, down, x = rand_weight(1022, 2048, seed=1), rand_weight(2048, 512, seed=2), rand_x(1, 2048, seed=3)
    off, on = _both(lambda: w4a16_gemv_launch(x, *gate_up, swiglu=True, config=cfg), pdl_on)  # 511 rows out
    _assert_same(off, on)
    h = torch.cat([off, off[:, :1]], 1)  # [1, 512]: down's K
    _assert_same(*_both(lambda: w4a16_gemv_launch(h, *down, config=cfg), pdl_on))
    w13, w2, idx, wts, xe = moe_inputs(1, e=16, h=2048, i=512, top_k=8, seed=4)

    def moe():  # moe_experts_w4a16_gemv's two launches
        h = w4a16_gemv_launch(xe, *w13, pair_expert=idx, a_div=8, swiglu=True, then=(w2.packed, w2.scales),
                              config=cfg)
        return h, w4a16_gemv_launch(h, *w2, pair_expert=idx, row_scale=wts, config=cfg)

    _assert_same(*_both(moe, pdl_on))


@needs_hopper
def test_gdn_prep_same_bits(pdl_on):
    from kernels.gdn_prep import gdn_decode_prep_ba_triton, random_inputs_ba

    args = random_inputs_ba(1, 16, 128, 2, 128, hidden=2048, dtype=torch.bfloat16, seed=5, device="cuda")
    pool = args[1].clone()

    def run():
        return gdn_decode_prep_ba_triton(args[0], pool.clone(), *args[2:])

    _assert_same(*_both(run, pdl_on))


@needs_hopper
def test_w4a16_mma_same_bits(pdl_on):
    """The tensor-core decode GEMV's gate_up launch prefetching the down projection's slabs of its experts (the lone
    step's routed experts: 1 token, top-8, and 3 tokens: pairs sharing experts prefetch the same slabs twice)."""
    from kernels.w4a16_mma import w4a16_mma_launch
    from tests.test_kernel_w4a16 import moe_inputs

    cfg = dict(WARPS=4, CHUNKS=1)  # pinned: two builds a launch kind, not the tuner's 9
    for t in (1, 3):
        w13, w2, idx, wts, xe = moe_inputs(t, e=16, h=2048, i=512, top_k=8, seed=7 + t)

        def moe():  # moe_experts_w4a16_mma's two launches
            h = w4a16_mma_launch(xe, *w13, pair_expert=idx, a_div=8, swiglu=True, then=(w2.packed, w2.scales),
                                 config=cfg)
            return h, w4a16_mma_launch(h, *w2, pair_expert=idx, row_scale=wts, config=cfg)

        _assert_same(*_both(moe, pdl_on))
