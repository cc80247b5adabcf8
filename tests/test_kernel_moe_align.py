"""kernels/moe_align.py (MoE routing alignment: one program at decode sizes, three launches at prefill sizes) against
the torch `moe_align` it replaces: integer outputs, so equality, not a tolerance. Runs under the Triton interpreter
on CPU (tests/conftest.py)."""

import pytest
import torch

from kernels import moe_align as align
from kernels.w4a16_gemm import moe_align, moe_align_fast

pytestmark = pytest.mark.skipif(align.triton is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed(t: int, k: int, e: int, seed: int, skew: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if skew:  # most pairs on two experts, the rest spread: long groups, many empty experts
        ids = torch.where(torch.rand(t, k, generator=g) < 0.7, torch.randint(0, 2, (t, k), generator=g),
                          torch.randint(0, e, (t, k), generator=g))
    else:  # distinct experts per token, as top-k gives
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids.to(DEVICE)


# decode sizes (the one-program path)
SMALL = [(1, 8, 256, 16), (3, 8, 256, 16), (32, 8, 256, 16), (16, 16, 256, 16), (5, 2, 6, 16), (17, 4, 10, 32),
         (32, 8, 256, 64), (2, 1, 3, 16)]
# the one-program path's larger sizes: 32 tokens with the shared expert as a 9th pair over 257 experts, 100 tokens over
# 10 experts (long runs), its MAX_PAIRS (128 tokens x top-8)
LARGE_ONE_PROGRAM = [(32, 9, 257, 16), (100, 4, 10, 16), (128, 8, 256, 16)]
# the multi-program path: one token past the one-program limit (a ragged last chunk), many chunks per expert, a
# 1k-token prefill at BLOCK_M 64, 512 experts
MULTI = [(129, 8, 256, 16), (300, 4, 10, 16), (130, 8, 256, 32), (1024, 8, 256, 64), (160, 8, 512, 64)]


def check_equal(idx, e, block_m, **kw):
    ref = moe_align(idx, e, block_m)
    sorted_pairs, block_expert = align.moe_align_triton(idx, e, block_m, **kw)
    assert sorted_pairs.dtype == ref.sorted_pairs.dtype == torch.int32
    assert torch.equal(sorted_pairs, ref.sorted_pairs), (sorted_pairs, ref.sorted_pairs)
    assert torch.equal(block_expert, ref.block_expert), (block_expert, ref.block_expert)


@pytest.mark.parametrize("t,k,e,block_m", SMALL + LARGE_ONE_PROGRAM + MULTI)
@pytest.mark.parametrize("skew", [False, True])
def test_equals_torch_moe_align(t, k, e, block_m, skew):
    idx = routed(t, k, e, seed=t * 31 + e, skew=skew)
    assert align.path(idx, e) == ("one" if t * k <= align.MAX_PAIRS else "multi")
    check_equal(idx, e, block_m)


def test_fast_path_choice():
    idx = routed(4, 8, 256, seed=1)
    fast = moe_align_fast(idx, 256, 16)
    ref = moe_align(idx, 256, 16)
    assert torch.equal(fast.sorted_pairs, ref.sorted_pairs) and fast.num_pairs == ref.num_pairs == 32
    big = routed(align.MAX_PAIRS // 8 + 1, 8, 256, seed=2)  # prefill-sized: the multi-program path
    assert align.path(big, 256) == "multi" and not align.supported(idx, align.MAX_EXPERTS + 1)
    assert torch.equal(moe_align_fast(big, 256, 64).sorted_pairs, moe_align(big, 256, 64).sorted_pairs)
    huge = torch.zeros(align.MAX_PAIRS_MULTI + 1, 1, dtype=torch.int64, device=DEVICE)  # past both: torch
    assert align.path(huge, 256) is None


def test_a_failing_kernel_is_switched_off(monkeypatch):
    """First use checks the kernel against the torch version; a wrong (or crashing) kernel is switched off for the
    device and the torch routing is returned instead."""
    from kernels import w4a16_gemm

    monkeypatch.setattr(w4a16_gemm, "_ALIGN_STATE", {})
    idx = routed(4, 8, 256, seed=3)

    real = align.moe_align_triton

    def wrong(idx_, e, bm):
        sp, be = real(idx_, e, bm)
        return sp.flip(0), be

    monkeypatch.setattr(align, "moe_align_triton", wrong)
    r = moe_align_fast(idx, 256, 16)
    key = (idx.device.type, "one", 16)
    assert torch.equal(r.sorted_pairs, moe_align(idx, 256, 16).sorted_pairs)
    assert w4a16_gemm._ALIGN_STATE[key].startswith("off")
    monkeypatch.setattr(align, "moe_align_triton", real)
    moe_align_fast(idx, 256, 16)  # stays off for the process (here: the monkeypatched state)
    assert w4a16_gemm._ALIGN_STATE[key].startswith("off")
    # the other path has its own check: still on, and checked on first use
    big = routed(align.MAX_PAIRS // 8 + 1, 8, 256, seed=4)
    assert torch.equal(moe_align_fast(big, 256, 32).sorted_pairs, moe_align(big, 256, 32).sorted_pairs)
    assert w4a16_gemm._ALIGN_STATE[(idx.device.type, "multi", 32)] == "ok"


def test_first_use_check_probes_a_routing_of_its_own(monkeypatch):
    """The engine's first call of a path is a warm-up whose tokens may all route alike; a kernel right only on such
    input must still be caught: the check also runs a seeded random routing of the same size."""
    from kernels import w4a16_gemm

    monkeypatch.setattr(w4a16_gemm, "_ALIGN_STATE", {})
    # 129 tokens, all on the same 8 experts (the multi-program path)
    alike = routed(1, 8, 256, seed=5).expand(align.MAX_PAIRS // 8 + 1, 8).contiguous()
    real = align.moe_align_triton

    def right_only_when_alike(idx_, e, bm):
        sp, be = real(idx_, e, bm)
        return (sp, be) if bool((idx_ == idx_[:1]).all()) else (sp.flip(0), be)

    monkeypatch.setattr(align, "moe_align_triton", right_only_when_alike)
    r = moe_align_fast(alike, 256, 32)
    assert torch.equal(r.sorted_pairs, moe_align(alike, 256, 32).sorted_pairs)
    assert w4a16_gemm._ALIGN_STATE[(alike.device.type, "multi", 32)].startswith("off")

