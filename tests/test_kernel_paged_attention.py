"""kernels/paged_attention.py: the flash-decoding paged attention kernel against its row-by-row fp32 SDPA reference
(on CPU through Triton's interpreter, tests/conftest.py; on a GPU the compiled kernel).

Tolerance (`compare`): max |o - ref| <= 1e-5 x max |ref| for fp32 (the same fp32 math; summation order and exp2
ulps only, measured ~2e-7), 1e-2 for bf16/fp16 (one output rounding, 2^-9 relative; on a GPU p is also rounded to
bf16 for the P V dot). Measured errors are printed with `pytest -s`.

Inputs (`random_inputs`): every sequence's blocks are distinct and shuffled through the pool, and every table entry
past a context holds a random valid block id, so a kernel that reads past the context reads real, wrong data.
"""

import math

import pytest
import torch

from kernels.paged_attention import (
    MAX_SPLITS,
    compare,
    describe,
    launch_tiles,
    num_splits_for,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
    random_inputs,
    supports,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def contexts_for(block_size: int) -> list[int]:
    """One token; exactly one block (boundary); a partial third block; six blocks and one token."""
    return [1, block_size, 2 * block_size + 3, 5 * block_size + 1]


def check(args, num_splits, label=""):
    out = paged_decode_attention_triton(*args, num_splits=num_splits)
    ref = paged_decode_attention_reference(*args)
    problem = compare(out, ref)
    assert problem is None, f"{label}: {problem}"
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    print(f"\n{label}: max error / max |ref| = {err:.2g}")
    return out


@pytest.mark.parametrize("num_splits", [1, 3])  # 3: the 1-token and 1-block rows leave splits without keys
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("group", [1, 4])  # H / KVH
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(dtype, group, head_dim, block_size, num_splits):
    args = random_inputs(contexts_for(block_size), heads=2 * group, kv_heads=2, head_dim=head_dim,
                         block_size=block_size, dtype=dtype, seed=group * 100 + head_dim + block_size, device=DEVICE)
    check(args, num_splits, f"{dtype} G={group} Dh={head_dim} bs={block_size} splits={num_splits}")


def test_fp16_odd_block_size_more_splits_than_blocks():
    """Block size 6 (not a power of two: a BLOCK_N step spans partial blocks); 8 splits over <= 3 blocks."""
    args = random_inputs([1, 6, 13], heads=4, kv_heads=1, head_dim=32, block_size=6, dtype=torch.float16, seed=7,
                         device=DEVICE)
    check(args, 8, "fp16 bs=6 splits=8")


def test_model_head_shape_with_heuristic_splits():
    """The real layer's heads (H 16, KVH 2, Dh 256, block 16), batch 1: the heuristic splits the context."""
    args = random_inputs([100], heads=16, kv_heads=2, head_dim=256, block_size=16, dtype=torch.bfloat16, seed=3,
                         device=DEVICE)
    check(args, None, "H16 KVH2 Dh256 bs16 ctx 100 heuristic splits")


def test_split_count_is_not_a_compile_time_constant():
    """The split count follows the batch (`num_splits_for`): it comes from the grid (`tl.num_programs(2)`), so a new
    count reuses the compiled kernel instead of compiling a variant (each was ~0.3-0.5 s, some first met in traffic).
    Every count still matches the reference; on a GPU the kernel's cache gains no entry after the first count."""
    import inspect

    from kernels.paged_attention import _paged_decode_kernel

    assert "NUM_SPLITS" not in inspect.signature(_paged_decode_kernel.fn).parameters
    args = random_inputs([5, 40, 77], heads=8, kv_heads=2, head_dim=64, block_size=8, dtype=torch.bfloat16, seed=11,
                         device=DEVICE)
    check(args, 2, "splits=2")
    compiled = (lambda: len(_paged_decode_kernel.device_caches[torch.cuda.current_device()][0])) \
        if DEVICE == "cuda" else (lambda: 0)
    before = compiled()
    for splits in (3, 5, 7, 10):
        check(args, splits, f"splits={splits}")
    assert compiled() == before


@pytest.mark.parametrize("num_splits", [1, 3])
def test_only_visible_keys_matter(num_splits):
    """Poison every pool slot that no sequence can see (the tail of each last block, spare blocks) with large
    finite values: the output must not change at all (masked loads never touch them)."""
    bs = 4
    ctx = contexts_for(bs)
    q, k, v, tables, lens, scale = random_inputs(ctx, heads=8, kv_heads=2, head_dim=32, block_size=bs, seed=11,
                                                 device=DEVICE)
    before = paged_decode_attention_triton(q, k, v, tables, lens, scale, num_splits=num_splits)
    visible = torch.zeros(k.shape[:2], dtype=torch.bool, device=DEVICE)  # [num_blocks, block_size]
    for i, c in enumerate(ctx):
        pos = torch.arange(c, device=DEVICE)
        visible[tables[i, pos // bs], pos % bs] = True
    assert not visible.all()
    k, v = k.clone(), v.clone()
    k[~visible] = 1e4  # scores ~1e4 x 1e4^0.5: any leak dominates the softmax
    v[~visible] = -3e4
    after = paged_decode_attention_triton(q, k, v, tables, lens, scale, num_splits=num_splits)
    assert torch.equal(before, after)
    assert compare(after, paged_decode_attention_reference(q, k, v, tables, lens, scale)) is None


def test_int32_tables_and_strided_views():
    """What the engine passes: q a view into a fused projection, the table a column slice of a wider one."""
    bs, ctx = 8, [5, 17, 8]
    q, k, v, tables, lens, scale = random_inputs(ctx, heads=4, kv_heads=2, head_dim=32, block_size=bs, seed=5,
                                                 device=DEVICE)
    qkv = torch.cat((q, torch.randn_like(q), torch.randn_like(q)), dim=-1)  # [D, H, 3 Dh]
    q_view = qkv[..., :32]
    wide = torch.cat((tables, torch.zeros_like(tables)), dim=1).to(torch.int32)  # [D, 2 max_blocks]
    t_view = wide[:, : tables.shape[1]]
    assert not q_view.is_contiguous() and not t_view.is_contiguous()
    out = paged_decode_attention_triton(q_view, k, v, t_view, lens.to(torch.int32), scale, num_splits=2)
    assert compare(out, paged_decode_attention_reference(q, k, v, tables, lens, scale)) is None


def test_zero_context_row_gives_zeros():
    """Context 0 is outside the contract (>= 1) but is what a CUDA-graph padding row may carry: zeros, no NaN, and
    the other rows unaffected."""
    bs = 4
    q, k, v, tables, lens, scale = random_inputs([6, 9], heads=4, kv_heads=2, head_dim=32, block_size=bs, seed=2,
                                                 device=DEVICE)
    lens0 = lens.clone()
    lens0[0] = 0
    for splits in (1, 3):
        out = paged_decode_attention_triton(q, k, v, tables, lens0, scale, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        ref = paged_decode_attention_reference(q[1:], k, v, tables[1:], lens[1:], scale)
        assert compare(out[1:], ref) is None


def test_num_splits_heuristic():
    assert num_splits_for(2, 512, 132) == 66  # batch 1 of the real model: ~one program per SM
    assert num_splits_for(64, 512, 132) == 3  # batch 32
    assert num_splits_for(132, 512, 132) == 1  # enough programs already
    assert num_splits_for(2, 4, 132) == 4  # never more splits than table blocks
    assert num_splits_for(1, 10_000, 10_000) == MAX_SPLITS


def test_launch_tiles_lone_and_many_sequences(monkeypatch):
    """The lone rule below FEW_PROGRAMS (num_splits_for's splits, 8 warps above Dh 128); from it ~FEW_PER_SM programs an
    SM at 4 warps (the fastest at 4 and 8 streams, 1k and 8k, fifty-ninth session, H100); from MANY_PROGRAMS on
    ~MANY_PER_SM programs an SM at 4 warps, at most MANY_MAX_SPLITS: step 171's fastest at 24, 32, 48 and 64 streams
    (8 / 6 / 4 / 3 splits), and 8 splits at 12-20 streams (fifty-fourth session, H100)."""
    import kernels.paged_attention as pa

    assert launch_tiles(2, 512, 132, 256, 16) == (66, 32, 8)  # one stream of the real model
    assert launch_tiles(2, 512, 132, 128, 16) == (66, 32, 4)
    assert launch_tiles(2, 512, 132, 256, 16, interpreted=True) == (66, 16, 8)
    assert launch_tiles(6, 512, 132, 256, 16) == (22, 32, 8)  # 3 streams: still the lone rule
    assert launch_tiles(8, 512, 132, 256, 16) == (33, 32, 4)  # 4 streams: ~2 programs an SM
    assert launch_tiles(16, 512, 132, 256, 16) == (16, 32, 4)  # 8 streams
    assert launch_tiles(16, 512, 132, 256, 16, kv_bytes=1) == (16, 32, 4)  # e4m3 pools the same
    assert launch_tiles(16, 10, 132, 256, 16) == (10, 32, 4)  # never more splits than table blocks
    assert [launch_tiles(2 * s, 512, 132, 256, 16) for s in (12, 16, 20, 24, 32, 48, 64)] == [
        (8, 32, 4), (8, 32, 4), (8, 32, 4), (8, 32, 4), (6, 32, 4), (4, 32, 4), (3, 32, 4)]
    assert launch_tiles(600, 512, 132, 256, 16) == (1, 32, 4)  # never fewer than one split
    assert launch_tiles(64, 2, 132, 256, 16) == (2, 32, 4)  # never more splits than table blocks
    assert launch_tiles(64, 512, 132, 256, 128) == (6, 128, 4)  # a step holds at least one KV block
    # e4m3 pools: ~2 programs an SM (4 splits at 32 streams, fifty-eighth session, H100); the lone rule unchanged
    assert launch_tiles(64, 512, 132, 256, 16, kv_bytes=1) == (4, 32, 4)
    assert launch_tiles(2, 512, 132, 256, 16, kv_bytes=1) == (66, 32, 8)
    monkeypatch.setattr(pa, "MANY_PROGRAMS", None)  # the few-sequence rule from FEW_PROGRAMS on
    assert launch_tiles(64, 512, 132, 256, 16) == (4, 32, 4)
    monkeypatch.setattr(pa, "FEW_PROGRAMS", None)  # the lone rule everywhere (qwen_gpu.py --attn-lone-tiles)
    assert launch_tiles(64, 512, 132, 256, 16) == (3, 32, 8)
    assert launch_tiles(16, 512, 132, 256, 16) == (9, 32, 8)


def test_many_sequence_tiles_match_the_reference(monkeypatch):
    """The kernel under the many-sequence tiles (4 warps, several splits whose ranges end mid-step) against the
    reference: MANY_PROGRAMS lowered so that a small batch takes them."""
    import kernels.paged_attention as pa

    monkeypatch.setattr(pa, "MANY_PROGRAMS", 4)
    monkeypatch.setattr(pa, "MANY_PER_SM", 9)  # 3 splits on the interpreter's 4 "SMs": ranges of 44 tokens
    bs = 4
    args = random_inputs(contexts_for(bs) + [70, 129], heads=8, kv_heads=2, head_dim=32, block_size=bs,
                         dtype=torch.bfloat16, seed=13, device=DEVICE)
    splits, _, warps = launch_tiles(12, args[3].shape[1], pa.num_sms(args[0].device.index), 32, bs)
    assert warps == 4 and splits > 1
    check(args, None, f"many-sequence tiles ({splits} splits)")


# ---- guards, custom op, registry ------------------------------------------------------------------------------------
def test_guard_boundaries():
    args = random_inputs([3, 9], heads=8, kv_heads=2, head_dim=32, block_size=4, dtype=torch.bfloat16,
                         device=DEVICE)
    q, k, v, tables, lens, scale = args
    info = describe(*args)
    assert supports(**info)
    assert not supports(**describe(q.float(), k, v, tables, lens, scale))  # mixed dtypes
    assert not supports(**describe(q.double(), k.double(), v.double(), tables, lens, scale))
    assert not supports(**describe(q, k, v, tables.float(), lens, scale))
    assert not supports(**describe(q[:, :7], k, v, tables, lens, scale))  # H % KVH != 0
    assert not supports(**describe(q[:1], k, v, tables, lens, scale))  # rows != table rows
    assert not supports(**describe(q[..., :24], k[..., :24], v[..., :24], tables, lens, scale))  # Dh not 2^n
    assert not supports(**describe(q[..., :8], k[..., :8], v[..., :8], tables, lens, scale))  # Dh < 16
    assert not supports(**describe(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, tables, lens, scale))
    assert not supports(**{**info, "head_dim": 512})
    assert not supports(**{**info, "device": "cuda" if DEVICE == "cpu" else "cpu", "capability": (9, 0)})
    if DEVICE == "cuda":
        assert not supports(**{**info, "capability": (7, 5)})


def test_custom_op_fake_and_schema():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = random_inputs([3, 9], heads=8, kv_heads=2, head_dim=32, block_size=4, dtype=torch.bfloat16,
                         device=DEVICE)
    with FakeTensorMode(allow_non_fake_inputs=True):
        o = torch.ops.qwen.paged_decode_attention(*args)
        assert o.shape == args[0].shape and o.dtype == torch.bfloat16
    torch.library.opcheck(torch.ops.qwen.paged_decode_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_new_contexts():
    """Captured once, replayed after the contexts and tables change in place: nothing was read on the host."""
    bs = 16
    q, k, v, tables, lens, scale = random_inputs([40, 100], heads=16, kv_heads=2, head_dim=256, block_size=bs,
                                                 dtype=torch.bfloat16, device=DEVICE)
    paged_decode_attention_triton(q, k, v, tables, lens, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention_triton(q, k, v, tables, lens, scale)
    tables.copy_(tables.flip(0))  # row 0 now holds row 1's 7 blocks, row 1 row 0's 3 blocks (+ garbage)
    lens.copy_(torch.tensor([100, 33], device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert compare(out, paged_decode_attention_reference(q, k, v, tables, lens, scale)) is None


def test_registry_self_check_and_choice(monkeypatch):
    from engine_core.registry import Registry

    from kernels import fp8_quant, paged_attention

    monkeypatch.setattr(fp8_quant, "E4M3_POOL_SAMPLES", False)  # (an fp8 engine earlier in the process sets it)
    assert len(paged_attention._sample(DEVICE)) == 1  # bf16 pools only, unless an engine uses e4m3 ones
    monkeypatch.setattr(fp8_quant, "E4M3_POOL_SAMPLES", True)
    reg = Registry()
    paged_attention.register(reg)
    outcome = reg.self_check(DEVICE)["paged_decode_attention"]
    assert "triton passed" in outcome, outcome  # on both samples: bf16 pools, then e4m3 ones
    (args, _), (e4m3, _) = paged_attention._sample(DEVICE)
    assert e4m3[1].dtype == torch.float8_e4m3fn and e4m3[0].dtype == torch.bfloat16
    assert reg.choose("paged_decode_attention", **describe(*args)).name == "triton"
    assert reg.choose("paged_decode_attention", **describe(*e4m3)).name == "triton"
    q, k, v, tables, lens, scale = args
    fp64 = describe(q.double(), k.double(), v.double(), tables, lens, scale)
    assert reg.choose("paged_decode_attention", **fp64).name == "reference"  # recorded fallback
    assert reg.choices()["paged_decode_attention"]["fallback"]
    assert math.isclose(scale, 32**-0.5)


@pytest.mark.parametrize("splits,dh,dtype", [(3, 64, torch.float32), (66, 256, torch.bfloat16), (5, 32, torch.float16)])
def test_combine_kernel_matches_torch_combine(splits, dh, dtype):
    """The split combine in one launch vs its torch reference `_combine`: random partials with empty splits
    (lse = -inf) scattered in, and a row whose splits are all empty (a CUDA-graph padding row: zeros)."""
    from kernels.paged_attention import _combine, combine_triton

    g = torch.Generator().manual_seed(splits + dh)
    o_part = torch.randn(3, 4, splits, dh, generator=g)
    lse = torch.randn(3, 4, splits, generator=g) * 4
    lse[torch.rand(3, 4, splits, generator=g) < 0.3] = float("-inf")
    lse[2, 1] = float("-inf")
    o_part[2, 1] = 0.0
    o_part, lse = o_part.to(DEVICE), lse.to(DEVICE)
    out, ref = combine_triton(o_part, lse, dtype), _combine(o_part, lse).to(dtype)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out.float()).all() and (out[2, 1] == 0).all()
    assert compare(out, ref) is None, compare(out, ref)
