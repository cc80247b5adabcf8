"""The decode kernels' weight prefetch (kernels/pdl.py `prefetch_l2`, the Qwen engine's `weight_prefetch`): asked
for only while PDL is on and the ranges are 16-byte aligned; the grouped GEMV's prefetch of the next launch's experts
only for contiguous, aligned slabs; and on a GPU every kernel's output the same bits with and without it (a prefetch
moves no data into registers). The PTX (the prefetch before griddepcontrol.wait, nothing else that touches memory)
is compiled for sm_90 in tests/sm90_compile.py; the source rule in tests/test_pdl.py; the speed in
benchmarks/RESULTS.md."""

import pytest
import torch

from kernels import pdl

triton = pytest.importorskip("triton")


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
    assert pdl.set_prefetch(False) == "off" and pdl.prefetch_options(True) == {} and not pdl.prefetch_next()
    assert pdl.set_prefetch(True) == "all"
    with pytest.raises(ValueError, match="weight prefetch"):
        pdl.set_prefetch("some")
    assert pdl.aligned16(0, 16, 4096) and not pdl.aligned16(16, 8) and not pdl.aligned16(2050)


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


# ---- on a GPU: the same bits with and without the prefetch ----------------------------------------------------------
needs_hopper = pytest.mark.skipif(not (pdl.available() and pdl.device_supports()),
                                  reason="needs compiled Triton on an sm_90 / sm_100 CUDA GPU")


@pytest.fixture
def pdl_on(prefetch_state):
    pdl.set_enabled(True)
    yield


def _both(fn):
    """fn() with the prefetch off, then "all" (PDL on for both): the two results."""
    pdl.set_prefetch("off")
    off = fn()
    pdl.set_prefetch("all")
    on = fn()
    torch.cuda.synchronize()
    return off, on


def _assert_same(off, on):
    off, on = (off,) if torch.is_tensor(off) else off, (on,) if torch.is_tensor(on) else on
    for a, b in zip(off, on, strict=True):
        assert torch.equal(a, b)


@needs_hopper
@pytest.mark.parametrize("m,n,k", [(1, 12288, 2048), (1, 2048, 4096), (2, 1000, 2048), (1, 520, 2064)])
def test_fp8_gemv_same_bits(pdl_on, m, n, k):
    from kernels.fp8_gemv import fp8_gemv_op

    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)
    ws = torch.rand(n, device="cuda", generator=g) * 0.01
    s_in = torch.tensor(0.05, device="cuda")
    pdl.set_prefetch("all")
    assert pdl.prefetch_options(pdl.aligned16(w.data_ptr(), k))  # the launch asks for it (w: contiguous rows)
    off, on = _both(lambda: fp8_gemv_op(x, w, ws, s_in, torch.bfloat16, prequantize=True, block_n=8, block_k=512,
                                        num_warps=1))  # a pinned tile: two builds to compile, not the tuner's 30
    _assert_same(off, on)


@needs_hopper
@pytest.mark.parametrize("n", [1, 4])
def test_router_same_bits(pdl_on, n):
    from kernels.moe_router import _launch_gemv

    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(256, 2048, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    _assert_same(*_both(lambda: _launch_gemv(x, w, 8)))


@needs_hopper
def test_w4a16_gemv_same_bits(pdl_on):
    """The dense GEMV (its own rows prefetched: the shared expert, SwiGLU and down) and the MoE GEMV, whose gate_up
    launch prefetches the down projection's slabs of its experts."""
    from kernels.w4a16_gemv import next_prefetch_args, w4a16_gemv_launch
    from tests.test_kernel_w4a16 import moe_inputs, rand_weight, rand_x

    cfg = dict(BLOCK_N=4, BLOCK_K=512, num_warps=2)  # pinned: two builds a launch kind, not the tuner's 34
    gate_up, down, x = rand_weight(1024, 2048, seed=1), rand_weight(2048, 512, seed=2), rand_x(1, 2048, seed=3)
    off, on = _both(lambda: w4a16_gemv_launch(x, *gate_up, swiglu=True, config=cfg))
    _assert_same(off, on)
    _assert_same(*_both(lambda: w4a16_gemv_launch(off, *down, config=cfg)))
    w13, w2, idx, wts, xe = moe_inputs(1, e=16, h=2048, i=512, top_k=8, seed=4)
    pdl.set_prefetch("all")
    assert next_prefetch_args(w2.packed, w2.scales)  # gate_up prefetches down's slabs

    def moe():  # moe_experts_w4a16_gemv's two launches
        h = w4a16_gemv_launch(xe, *w13, pair_expert=idx, a_div=8, swiglu=True, then=(w2.packed, w2.scales),
                              config=cfg)
        return h, w4a16_gemv_launch(h, *w2, pair_expert=idx, row_scale=wts, config=cfg)

    _assert_same(*_both(moe))


@needs_hopper
def test_gdn_prep_same_bits(pdl_on):
    from kernels.gdn_prep import gdn_decode_prep_ba_triton, random_inputs_ba

    args = random_inputs_ba(1, 16, 128, 2, 128, hidden=2048, dtype=torch.bfloat16, seed=5, device="cuda")
    pool = args[1].clone()

    def run():
        return gdn_decode_prep_ba_triton(args[0], pool.clone(), *args[2:])

    _assert_same(*_both(run))
