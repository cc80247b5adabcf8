"""kernels/w4a16_gemm.py: the NVFP4 W4A16 Triton GEMMs against `kernels/nvfp4.py` (on CPU through Triton's
interpreter, tests/conftest.py; on a GPU the compiled kernels).

Tolerances, and why:
* dequantised tile: bit-exact (E2M1 x e4m3 is exact in bf16 and fp16), for all 16 codes x e4m3 scales from the
  smallest subnormal 2^-9 to 448;
* GEMMs: the kernel and the reference compute the same exact products in fp32 and differ only in summation order
  and in where the global scale multiplies, then both round once to bf16. Per element:
  |y - ref_fp32| <= 2^-8 |ref_fp32| (bf16 round-to-nearest is <= 2^-9 relative; 2x for a tie flipped by an fp32-level
  difference) + 2^-20 * (|x| @ |W|^T) (fp32 summation-order error over K <= 256 terms). In addition at least 95 % of
  the outputs must equal the reference rounded to bf16 (measured: ~99 %, printed with `pytest -s`), and the
  registry's coarser `compare` (max error <= 1e-2 x max |ref|) holds.
* grouped / MoE: the same per GEMM; the full expert block rounds the SwiGLU activations to bf16 between the two GEMMs
  (the reference keeps fp32), so it is held to `compare`'s 1e-2 of max |ref| (measured ~3e-3).
"""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from engine_core.registry import Registry
from kernels import split_k as splits
from kernels import w4a16_gemm, w4a16_swapped
from kernels.nvfp4 import (
    E2M1_VALUES,
    NVFP4Tensor,
    dequantize_nvfp4,
    nvfp4_block_values,
    pack_e2m1,
    quantize_nvfp4,
    w4a16_linear_reference,
)
from kernels.w4a16_gemm import (
    compare,
    dequantize_nvfp4_triton,
    describe_dense,
    describe_moe,
    moe_align,
    moe_experts_w4a16_reference,
    moe_experts_w4a16_triton,
    supports_dense,
    supports_moe,
    w4a16_dense_launch,
    w4a16_grouped_launch,
    w4a16_grouped_reference,
    w4a16_linear_triton,
    w4a16_swiglu_reference,
    w4a16_swiglu_triton,
)
from tests import ptx_emu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand_weight(*shape, seed, per_row=True, scale=0.02):
    """NVFP4 weight [..., N, K] with a per-row global scale ([..., N]) or ModelOpt's per-matrix one."""
    g = torch.Generator().manual_seed(seed)
    w = quantize_nvfp4(torch.randn(*shape, generator=g) * scale)
    if per_row:  # distinct per-row globals (what the loader hands over for fused projections)
        w = NVFP4Tensor(w.packed, w.scales, w.global_scale * (0.5 + torch.rand(*shape[:-1], generator=g)))
    return NVFP4Tensor(*(t.to(DEVICE) for t in w))


def rand_x(m, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype).to(DEVICE)


def check_gemm(y, x, w_dq, ref32, what=""):
    """The per-element bound of the module docstring; returns the fraction equal to the rounded reference."""
    bound = 2.0**-8 * ref32.abs() + 2.0**-20 * (x.float().abs() @ w_dq.abs().T)
    err = (y.float() - ref32).abs()
    assert (err <= bound).all(), f"{what}: max err {err.max():.3g}, worst excess {(err - bound).max():.3g}"
    same = (y == ref32.to(y.dtype)).float().mean().item()
    assert same >= 0.95, f"{what}: only {same:.3f} equal to the rounded reference"
    return same


# ---- dequantisation -------------------------------------------------------------------------------------------------
# bf16 dequant modes (kernels.w4a16_gemm.DEQ_MODES): 2 is inline PTX, compiled only on a GPU. Under the interpreter
# modes 1 and 2 run one fp32 emulation of the same bit construction (test_bf16_bit_construction checks the bf16 and
# PTX bit formulas themselves on the CPU); on a GPU each mode runs its own code.
DEQS = [0, 1] + ([2] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype,deq", [(torch.bfloat16, d) for d in DEQS] + [(torch.float16, 0)])
@pytest.mark.parametrize("k", [48, 192])  # 48: a masked K tail
def test_dequant_tile_is_exact_for_every_code_and_scale(dtype, deq, k):
    # row r: all 16 codes twice over K = 32 (2 blocks) -> each code meets two scales; 16 distinct e4m3 scales per
    # row pair, covering subnormals (2^-9 .. 7 * 2^-9), 1.875 mantissas, and the max 448
    scale_vals = torch.tensor([2**-9, 3 * 2**-9, 7 * 2**-9, 2**-6, 0.1171875, 0.5, 0.875, 1.0, 1.875, 3.75, 15.0,
                               26.0, 100.0, 240.0, 448.0, 0.0])
    n = 40  # not a multiple of BLOCK_N = 32
    codes = (torch.arange(n * k) * 7 % 16).to(torch.uint8).view(n, k)  # every code in every column position
    scales = scale_vals[torch.arange(n * k // 16) % 16].view(n, k // 16).to(torch.float8_e4m3fn)
    packed = pack_e2m1(codes)
    out = dequantize_nvfp4_triton(packed.to(DEVICE), scales.to(DEVICE), dtype=dtype, block_n=32, block_k=64, deq=deq)
    ref = nvfp4_block_values(packed, scales)
    assert torch.equal(ref.to(dtype).float(), ref)  # the premise: exact in the dot dtype
    assert torch.equal(out.cpu().view(torch.int16), ref.to(dtype).view(torch.int16))  # bit-exact, -0 included
    pairs = set(zip(codes.flatten().tolist(), scales.float().repeat_interleave(16, 1).flatten().tolist()))
    assert len(pairs) == 16 * 16  # coverage: every code met every scale
    assert len(E2M1_VALUES) == 16


def _bf16_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 tensor of 16-bit patterns -> their bf16 values as fp32 (bf16 = the top half of an fp32)."""
    return (bits.to(torch.int64) << 16).to(torch.int32).view(torch.float32)


def test_bf16_bit_construction_and_its_ptx_version():
    """The GPU modes' bit formulas, checked on the CPU (the interpreter runs an fp32 emulation instead): DEQ 1's
    `((c & 7) << 6) | ((c & 8) << 12)` is E2M1(c) x 2^-126 for all 16 codes, and DEQ 2's inline PTX, executed from
    its source text by a small interpreter of the four instructions it uses, gives the same patterns for every byte:
    byte i of the word -> element i, two elements per output register (low half first), outputs 0, 1 = the low
    nibbles of bytes 0-1 and 2-3, outputs 2, 3 = the high nibbles."""
    c = torch.arange(16, dtype=torch.int32)
    bits = ((c & 7) << 6) | ((c & 8) << 12)
    assert torch.equal(_bf16_bits(bits), E2M1_VALUES.float() * 2.0**-126)  # exact (code 1: the subnormal 2^-127)

    asm = ptx_emu.asm_text(w4a16_gemm._e2m1x2_bf16_tiny_ptx)

    def ptx(word: int) -> list[int]:
        """Run the asm text of `_e2m1x2_bf16_tiny_ptx` on one word -> $0..$3."""
        reg = ptx_emu.run(asm, {"$4": word})
        return [reg[f"${i}"] for i in range(4)]

    g = torch.Generator().manual_seed(0)
    words = [0, 0xFFFFFFFF, 0x01234567, 0x89ABCDEF] + torch.randint(0, 2**31, (500,), generator=g).tolist()
    words += [b * 0x01010101 for b in range(256)]  # every byte value in every position
    for word in words:
        out = ptx(word)
        halves = [(out[r] >> (16 * h)) & 0xFFFF for r in (0, 1) for h in (0, 1)] + \
                 [(out[r] >> (16 * h)) & 0xFFFF for r in (2, 3) for h in (0, 1)]
        want = [int(bits[(word >> (8 * i)) & 0xF]) for i in range(4)] + \
               [int(bits[(word >> (8 * i + 4)) & 0xF]) for i in range(4)]
        assert halves == want, hex(word)


# ---- dense ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k,per_row", [(96, 160, True), (48, 224, False)])  # K % 64 != 0; N % 32 != 0 for 48
def test_dense_matches_reference(m, n, k, per_row):
    w = rand_weight(n, k, seed=n + k, per_row=per_row)
    x = rand_x(m, k, seed=m)
    w_dq = dequantize_nvfp4(*w)
    ref32 = x.float() @ w_dq.T
    y = w4a16_linear_triton(x, w)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    same = check_gemm(y, x, w_dq, ref32, f"M={m} N={n} K={k}")
    assert compare(y, w4a16_linear_reference(x, w)) is None
    print(f"\nM={m} N={n} K={k} per_row={per_row}: {same:.4f} equal to the bf16-rounded reference")


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_dense_split_k(split_k, ahead):
    """fp32 partials over K splits (3 splits of 4 K tiles: uneven, one split gets fewer tiles); with the scales
    requested ahead, a split's look-ahead reaches into the next split's tiles (loaded, never used)."""
    w = rand_weight(64, 256, seed=1)
    x = rand_x(3, 256, seed=2)
    w_dq = dequantize_nvfp4(*w)
    y = w4a16_dense_launch(x, *w, split_k=split_k, modes=dict(SCALE_AHEAD=ahead))
    check_gemm(y, x, w_dq, x.float() @ w_dq.T, f"split {split_k}, scales {ahead} ahead")


@pytest.mark.parametrize("split_k", [2, 3])
def test_dense_split_k_reduced_in_kernel_matches_torch_reduction(split_k, monkeypatch):
    """The last split of each tile sums the partials (the arrival counters); with no counters (SPLIT_COUNTERS too
    small) the kernel writes partials and torch sums them. Both meet the GEMM bound, agree to fp32 summation
    order, and the counters are all zero (re-armed) after every launch."""
    w = rand_weight(96, 256, seed=7)
    x = rand_x(17, 256, seed=8)  # 2 row tiles x 3 column tiles: 6 counters in use
    w_dq = dequantize_nvfp4(*w)
    ref32 = x.float() @ w_dq.T
    fused = w4a16_dense_launch(x, *w, split_k=split_k)
    fused_again = w4a16_dense_launch(x, *w, split_k=split_k)  # the counters were re-armed: same result
    counters = splits._COUNTERS[(x.device.type, x.device.index, "")]
    assert int(counters.abs().sum()) == 0
    monkeypatch.setattr(splits, "SPLIT_COUNTERS", 0)
    plain = w4a16_dense_launch(x, *w, split_k=split_k)
    for y, what in ((fused, "in-kernel"), (fused_again, "in-kernel, again"), (plain, "torch reduction")):
        check_gemm(y, x, w_dq, ref32, f"split {split_k}, {what}")
    assert torch.equal(fused, fused_again)
    assert ((fused.float() - plain.float()).abs() <= 2.0**-7 * plain.float().abs()).all()  # <= 1 bf16 ulp


def check_swiglu(y, x, w_dq, what=""):
    """SwiGLU of the two halves against the fp32 GEMM: the GEMM bound carried through silu(g) * u (|d silu| <= 1.1)
    plus the one bf16 rounding."""
    i = w_dq.shape[0] // 2
    g32, u32 = x.float() @ w_dq[:i].T, x.float() @ w_dq[i:].T
    ref = F.silu(g32) * u32
    acc = x.float().abs() @ w_dq.abs().T * 2.0**-20  # fp32 summation bound of each GEMM
    bound = 2.0**-8 * ref.abs() + 1.1 * acc[:, :i] * u32.abs() + F.silu(g32).abs() * acc[:, i:] + 1e-30
    err = (y.float() - ref).abs()
    assert (err <= bound).all(), f"{what}: max err {err.max():.3g}, worst excess {(err - bound).max():.3g}"


@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 17])
def test_dense_swiglu(split_k, m, monkeypatch):
    """The shared expert's gate/up GEMM with SiLU x up in the epilogue: direct, split K reduced in the kernel, and
    split K reduced by torch (no counters)."""
    w = rand_weight(2 * 48, 192, seed=9)  # gate rows 0..47, up rows 48..95, distinct per-row globals
    x = rand_x(m, 192, seed=10)
    w_dq = dequantize_nvfp4(*w)
    y = w4a16_dense_launch(x, *w, swiglu=True, split_k=split_k)
    assert y.shape == (m, 48) and y.dtype == torch.bfloat16
    check_swiglu(y, x, w_dq, f"split {split_k}")
    assert compare(y, w4a16_swiglu_reference(x, w)) is None
    if split_k > 1:
        monkeypatch.setattr(splits, "SPLIT_COUNTERS", 0)
        check_swiglu(w4a16_dense_launch(x, *w, swiglu=True, split_k=split_k), x, w_dq, f"split {split_k}, torch")
    with pytest.raises(ValueError, match="even number of rows"):
        w4a16_dense_launch(x, *rand_weight(47, 192, seed=9), swiglu=True)


def test_swiglu_op_leading_dims_and_registry():
    w = rand_weight(64, 128, seed=11)
    x = rand_x(6, 128, seed=12).view(2, 3, 128)
    y = w4a16_swiglu_triton(x, w)
    assert y.shape == (2, 3, 32)
    check_swiglu(y.view(6, 32), x.view(6, 128), dequantize_nvfp4(*w))
    reg = Registry()
    w4a16_gemm.register(reg)
    chosen = reg.choose(w4a16_gemm.SWIGLU, **reg.spec(w4a16_gemm.SWIGLU).describe(x, w))
    assert chosen.name == "triton"  # 6 rows: more than the decode GEMV (kernels/w4a16_gemv.py) takes
    odd = NVFP4Tensor(w.packed[:63], w.scales[:63], w.global_scale[:63])
    assert reg.choose(w4a16_gemm.SWIGLU, **reg.spec(w4a16_gemm.SWIGLU).describe(x, odd)).name == "reference"


@pytest.mark.parametrize("cfg,k", [(dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128), 208),
                                   (dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=256), 208),
                                   *[(dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, DEQ=d), 192) for d in DEQS],
                                   *[(dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SCALE_AHEAD=a), 192) for a in (1, 2)]])
def test_dense_other_tile_shapes(cfg, k):
    """Tiles from the autotune list that exceed the problem (masked rows, columns and K groups), each bf16 dequant
    mode, and the block scales requested 1 or 2 K tiles early (0, DENSE_MODES' default, in the other cases)."""
    w = rand_weight(80, k, seed=3)
    x = rand_x(17, k, seed=4)
    w_dq = dequantize_nvfp4(*w)
    check_gemm(w4a16_dense_launch(x, *w, split_k=1, config=cfg), x, w_dq, x.float() @ w_dq.T, str(cfg))


def test_dense_fp16_leading_dims_and_empty():
    w = rand_weight(32, 64, seed=5)
    x = rand_x(6, 64, seed=6, dtype=torch.float16).view(2, 3, 64)
    w_dq = dequantize_nvfp4(*w)
    y = w4a16_linear_triton(x, w)
    assert y.shape == (2, 3, 32) and y.dtype == torch.float16
    check_gemm(y.view(6, 32), x.view(6, 64), w_dq, x.view(6, 64).float() @ w_dq.T, "fp16")
    assert w4a16_linear_triton(rand_x(0, 64, seed=0), w).shape == (0, 32)


# ---- grouped (MoE) --------------------------------------------------------------------------------------------------
def routing_ids(t, top_k, num_experts, seed, empty=()):
    """[T, k] distinct expert ids per token, never using the experts in `empty`."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in empty])
    return torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(t)]).to(DEVICE)


@pytest.mark.parametrize("t", [1, 3, 17])
def test_moe_align_covers_every_pair_once(t):
    idx = routing_ids(t, 4, 10, seed=t, empty=(0, 9))
    r = moe_align(idx, 10, block_m=16)
    pairs, be = r.sorted_pairs.cpu().long(), r.block_expert.cpu().long()
    flat = idx.reshape(-1).cpu()
    real = pairs[pairs < r.num_pairs]
    assert sorted(real.tolist()) == list(range(t * 4))  # each pair exactly once, the rest padding
    row_expert = be.repeat_interleave(16)
    assert torch.equal(row_expert[pairs < r.num_pairs], flat[real])  # each row sits in its expert's blocks
    used = be < 10
    assert used.sum() == sum(-(-int((flat == e).sum()) // 16) for e in range(10))  # empty experts: no block
    assert not used[used.sum():].any()  # unused blocks (sentinel E) only at the end


@pytest.mark.parametrize("t,mode,block_m,k,cfg", [
    (1, "plain", 16, 160, None), (3, "plain", 16, 160, None), (17, "plain", 32, 160, dict(BLOCK_N=64, BLOCK_K=128)),
    (3, "swiglu", 16, 160, None), (17, "swiglu", 16, 160, None), (17, "row_scale", 16, 160, None),
    # each bf16 dequant mode; the block scales requested 0, 1 or 2 K tiles early (K = 192 with BLOCK_K = 128: a
    # masked K tail, and look-ahead loads past the end)
    *[(3, "swiglu", 16, 192, dict(BLOCK_N=32, BLOCK_K=128, DEQ=d)) for d in DEQS],
    *[(17, "row_scale", 32, 160, dict(BLOCK_N=16, BLOCK_K=64, DEQ=d)) for d in DEQS],
    *[(17, "swiglu", 16, 192, dict(BLOCK_N=32, BLOCK_K=64, SCALE_AHEAD=a)) for a in (0, 1, 2)],
    (5, "plain", 16, 192, dict(BLOCK_N=32, BLOCK_K=128, SCALE_AHEAD=1))])
def test_grouped_matches_per_expert_reference(t, mode, block_m, k, cfg):
    """Grouped GEMM vs a loop of the dense reference over the experts; experts 0 and 5 get no tokens."""
    e, n, top_k = 6, 96, 2
    idx = routing_ids(t, top_k, e, seed=10 + t, empty=(0, 5))
    w = rand_weight(e, n, k, seed=7)
    x = rand_x(t, k, seed=8)
    rs = torch.rand(t * top_k, generator=torch.Generator().manual_seed(9)).to(DEVICE) if mode == "row_scale" else None
    swiglu = mode == "swiglu"
    y = w4a16_grouped_launch(x, w, moe_align(idx, e, block_m), a_div=top_k, row_scale=rs, swiglu=swiglu, config=cfg)
    ref32 = w4a16_grouped_reference(x.float(), w, idx.reshape(-1), a_div=top_k, row_scale=rs, swiglu=swiglu)
    assert y.shape == (t * top_k, n // 2 if swiglu else n) and y.dtype == x.dtype
    if swiglu:  # nonlinear epilogue: no per-element linear bound; bf16 rounding + fp32 noise
        err = (y.float() - ref32).abs()
        assert (err <= 2.0**-8 * ref32.abs() + 1e-6 * ref32.abs().max()).all(), err.max()
    else:
        flat = idx.reshape(-1).cpu()
        w_rows = torch.stack([dequantize_nvfp4(*_one(w, int(flat[p]))) for p in range(t * top_k)])  # [P, N, K]
        xs = x.float()[torch.arange(t * top_k) // top_k]
        bound = 2.0**-8 * ref32.abs() + 2.0**-20 * torch.einsum("pk,pnk->pn", xs.abs(), w_rows.abs()) * (
            1 if rs is None else rs[:, None])
        err = (y.float() - ref32).abs()
        assert (err <= bound).all(), err.max()
    assert compare(y, ref32.to(y.dtype)) is None


@pytest.mark.parametrize("mode,bn,bk", [("swiglu", 32, 64), ("swiglu", 16, 128), ("row_scale", 32, 64)])
def test_grouped_tile_major_weights_give_identical_results(mode, bn, bk):
    """TILED=1 over `tile_major` weights (each row tile x K tile one contiguous block) computes bit for bit what the
    checkpoint layout does with the same config: only the addresses differ. The layout must match the config."""
    from kernels.w4a16_gemm import tile_major

    e, n, k, t, top_k = 6, 128, 256, 9, 2
    idx = routing_ids(t, top_k, e, seed=3, empty=(4,))
    w = rand_weight(e, n, k, seed=5)
    x = rand_x(t, k, seed=6)
    rs = torch.rand(t * top_k, generator=torch.Generator().manual_seed(7)).to(DEVICE) if mode == "row_scale" else None
    cfg = dict(BLOCK_N=bn, BLOCK_K=bk)
    args = dict(a_div=top_k, row_scale=rs, swiglu=mode == "swiglu", config=cfg)
    routing = moe_align(idx, e, 16)
    y = w4a16_grouped_launch(x, w, routing, **args, modes=dict(TILED=0))
    wt = NVFP4Tensor(tile_major(w.packed, bn, bk), w.scales, w.global_scale)
    assert not torch.equal(wt.packed, w.packed)  # the bytes did move
    y_tiled = w4a16_grouped_launch(x, wt, routing, **args, modes=dict(TILED=1))
    assert torch.equal(y_tiled, y)
    with pytest.raises(ValueError, match="TILED needs a config"):
        w4a16_grouped_launch(x, wt, routing, **{**args, "config": dict(BLOCK_N=48, BLOCK_K=bk)}, modes=dict(TILED=1))


@pytest.mark.parametrize("mode,bn,tile_n", [("swiglu", 64, 32), ("row_scale", 128, 64), ("row_scale", 64, 64)])
def test_grouped_program_over_several_stored_tiles(mode, bn, tile_n):
    """A program BLOCK_N wide over weights stored tile-major in tiles of TILE_N < BLOCK_N rows (the prefill configs,
    TILE_MAJOR_PREFILL) computes bit for bit what the checkpoint layout does with the same config; a BLOCK_N that is
    not a multiple of TILE_N is refused."""
    from kernels.w4a16_gemm import tile_major

    e, n, k, t, top_k, bk = 5, 256, 256, 23, 2, 128
    idx = routing_ids(t, top_k, e, seed=13, empty=(2,))
    w = rand_weight(e, n, k, seed=15)
    x = rand_x(t, k, seed=16)
    rs = torch.rand(t * top_k, generator=torch.Generator().manual_seed(17)).to(DEVICE) if mode == "row_scale" else None
    args = dict(a_div=top_k, row_scale=rs, swiglu=mode == "swiglu")
    routing = moe_align(idx, e, 32)
    y = w4a16_grouped_launch(x, w, routing, **args, config=dict(BLOCK_N=bn, BLOCK_K=bk), modes=dict(TILED=0))
    wt = NVFP4Tensor(tile_major(w.packed, tile_n, bk), w.scales, w.global_scale)
    y_tiled = w4a16_grouped_launch(x, wt, routing, **args, config=dict(BLOCK_N=bn, BLOCK_K=bk, TILE_N=tile_n),
                                   modes=dict(TILED=1))
    assert torch.equal(y_tiled, y)
    with pytest.raises(ValueError, match="multiple of its TILE_N"):
        w4a16_grouped_launch(x, wt, routing, **args, config=dict(BLOCK_N=48, BLOCK_K=bk, TILE_N=32),
                             modes=dict(TILED=1))


def _one(w, e):
    return NVFP4Tensor(w.packed[e], w.scales[e], w.global_scale[e])


def moe_inputs(t, e, h, i, top_k, seed, empty=()):
    """Stacked NVFP4 experts gate_up [E, 2I, H] and down [E, H, I], routing ids [T, k] (experts `empty` get no
    tokens), bf16 softmax routing weights and bf16 tokens [T, H]."""
    w13 = rand_weight(e, 2 * i, h, seed=seed, scale=0.1)
    w2 = rand_weight(e, h, i, seed=seed + 1, scale=0.1)
    idx = routing_ids(t, top_k, e, seed=seed + 2, empty=empty)
    weights = torch.softmax(torch.randn(t, top_k, generator=torch.Generator().manual_seed(seed + 3)), -1)
    return w13, w2, idx, weights.to(torch.bfloat16).to(DEVICE), rand_x(t, h, seed=seed + 4)


@pytest.mark.parametrize("t", [1, 5])
def test_moe_block_matches_reference_and_model(t):
    """The whole routed-expert block (gate_up + SwiGLU, down + routing weight, sum over top-k) vs the reference, and
    the reference vs qwen_engine's `Experts` module run in fp32 on the dequantised weights (same semantics)."""
    from types import SimpleNamespace

    from qwen_engine.model.moe import Experts

    e, h, i, top_k = 8, 64, 32, 3
    w13, w2, idx, weights, x = moe_inputs(t, e, h, i, top_k, seed=11, empty=(2,))
    ref = moe_experts_w4a16_reference(x, w13, w2, idx, weights)
    out = moe_experts_w4a16_triton(x, w13, w2, idx, weights)
    assert out.shape == (t, h) and out.dtype == x.dtype
    problem = compare(out, ref)
    assert problem is None, problem
    print(f"\nT={t}: max err {(out.float() - ref.float()).abs().max():.3g} of max |ref| {ref.float().abs().max():.3g}")

    model = Experts(SimpleNamespace(num_experts=e, hidden_size=h, moe_intermediate_size=i)).to(DEVICE)
    with torch.no_grad():
        model.gate_up_proj.copy_(dequantize_nvfp4(*w13))
        model.down_proj.copy_(dequantize_nvfp4(*w2))
        y_model = model(x.float(), idx, weights.float())
    ref32 = moe_experts_w4a16_reference(x.float(), w13, w2, idx, weights)
    torch.testing.assert_close(ref32, y_model, rtol=1e-5, atol=1e-5 * float(y_model.abs().max()))


@pytest.mark.parametrize("t", [1, 5, 40])
@pytest.mark.parametrize("layout", [w4a16_gemm.TILE_MAJOR, w4a16_gemm.SPLIT_HALVES, w4a16_gemm.SPLIT_FRAG])
def test_moe_repacked_experts(t, layout):
    """Experts repacked for a kernel (`experts_repack`): tile-major, where the op runs the grouped kernel's fixed
    tiles of TILE_MAJOR_TILES (decode) or TILE_MAJOR_PREFILL's wider programs over them (t = 40: 26 pairs per used
    expert, BLOCK_M 32); split halves (the engine's layout on CUDA), where it runs the swap-AB kernel
    (`kernels/w4a16_swapped.py`; BLOCK_M 64 at t = 40), and split halves in fragment order (the same kernel). Each
    equals the reference on the checkpoint layout (and the
    reference handed the repacked bytes with their `layout`); unsummed rows (`reduce=False`) too; the layout
    round-trips; the guard refuses repacked stacks whose shapes do not split into the tiles."""
    e, h, i, top_k = 4, 256, 256, 2  # two K tiles of 128 in both projections (one tile: the layouts coincide)
    w13, w2, idx, weights, x = moe_inputs(t, e, h, i, top_k, seed=21, empty=(1,))
    block_m = w4a16_gemm.moe_block_m(t * top_k, e)
    prefill = block_m >= w4a16_gemm.PREFILL_BLOCK_M
    assert prefill == (t == 40)
    assert ("TILE_N" in w4a16_gemm._tile_major_config(True, block_m)) == prefill
    # wide prefill programs only where they divide the output columns (else the stored tile's own width)
    assert "TILE_N" not in w4a16_gemm._tile_major_config(True, 32, n_out=96)
    assert w4a16_swapped.swapped_block_m(t * top_k, e) == (64 if prefill else 16)
    t13, t2 = w4a16_gemm.experts_repack(w13, w2, layout)
    assert not torch.equal(t13.packed, w13.packed) and not torch.equal(t2.packed, w2.packed)
    back13, back2 = w4a16_gemm.experts_repack(t13, t2, layout, inverse=True)
    assert torch.equal(back13.packed, w13.packed) and torch.equal(back2.packed, w2.packed)
    ref = moe_experts_w4a16_reference(x, w13, w2, idx, weights)
    assert torch.equal(moe_experts_w4a16_reference(x, t13, t2, idx, weights, layout=layout), ref)
    out = moe_experts_w4a16_triton(x, t13, t2, idx, weights, layout=layout)
    assert compare(out, ref) is None, compare(out, ref)
    rows = moe_experts_w4a16_triton(x, t13, t2, idx, weights, reduce=False, layout=layout)
    assert rows.shape == (t, top_k, h)
    assert torch.equal(rows.sum(1, dtype=torch.float32).to(x.dtype), out)
    info = describe_moe(x, t13, t2, idx, weights, layout=layout)
    assert supports_moe(**info)
    # the bytes handed over in another layout than they are in: wrong numbers (the layouts are really different)
    other = w4a16_gemm.SPLIT_HALVES if layout != w4a16_gemm.SPLIT_HALVES else w4a16_gemm.SPLIT_FRAG
    assert compare(moe_experts_w4a16_triton(x, t13, t2, idx, weights, layout=other), ref) is not None
    small13, small2 = rand_weight(e, 2 * 64, h, seed=1), rand_weight(e, h, 64, seed=2)  # I = 64: no 128-wide K tile
    assert not supports_moe(**describe_moe(x, small13, small2, idx, weights, layout=layout))
    assert supports_moe(**describe_moe(x, small13, small2, idx, weights))
    assert not supports_moe(**describe_moe(x, t13, t2, idx, weights, layout=7))  # no such layout


@pytest.mark.parametrize("t", [1, 4, 5])
def test_moe_decode_split(t, monkeypatch):
    """`w4a16_swapped.DECODE_SPLIT` (split K of the swap-AB experts at <= DECODE_SPLIT_TOKENS tokens, for engines
    without the GEMV's dual copy): at 1 and 4 tokens both projections run split (gate_up 2 of its 2 K tiles, down 4
    capped to its 2), within the reference's bound, the same bits on a second call (the counters re-armed); at 5
    tokens the op ignores it (bit-equal to unsplit). Each projection alone, split 2 against unsplit on the same
    inputs, is within one rounding of its output (a flip moves a bf16 by at most 2^-7 of it) plus 2^-12 of its largest
    |value| (fp32 summation order). The whole block is not held to that: a flipped rounding of the SwiGLU output is
    carried through the down projection (the H200 broke such a bound; tests/test_kernel_w4a16.py, run 5)."""
    e, h, i, top_k = 4, 256, 256, 2
    w13, w2, idx, weights, x = moe_inputs(t, e, h, i, top_k, seed=23, empty=(1,))
    t13, t2 = w4a16_gemm.experts_repack(w13, w2, w4a16_gemm.SPLIT_FRAG)
    ref = moe_experts_w4a16_reference(x, w13, w2, idx, weights)
    one = moe_experts_w4a16_triton(x, t13, t2, idx, weights, layout=w4a16_gemm.SPLIT_FRAG)
    calls = []
    launch = w4a16_swapped.w4a16_grouped_swapped_launch
    monkeypatch.setattr(w4a16_swapped, "w4a16_grouped_swapped_launch",
                        lambda *a, **kw: calls.append(kw["split"]) or launch(*a, **kw))
    monkeypatch.setattr(w4a16_swapped, "DECODE_SPLIT", (2, 4))
    split = moe_experts_w4a16_triton(x, t13, t2, idx, weights, layout=w4a16_gemm.SPLIT_FRAG)
    again = moe_experts_w4a16_triton(x, t13, t2, idx, weights, layout=w4a16_gemm.SPLIT_FRAG)
    assert torch.equal(split, again)
    assert calls == ([2, 2] * 2 if t <= w4a16_swapped.DECODE_SPLIT_TOKENS else [1, 1] * 2)
    if t > w4a16_swapped.DECODE_SPLIT_TOKENS:
        assert torch.equal(split, one)
    assert compare(split, ref) is None, compare(split, ref)
    routing = moe_align(idx, e, 16)
    inp = x  # gate_up's input, then the unsplit gate_up's output (down's)
    for w, kw in ((t13, dict(a_div=top_k, swiglu=True)), (t2, dict(row_scale=weights.reshape(-1)))):
        y1, y2 = (launch(inp, w.packed, w.scales, w.global_scale, routing, frag=True, split=sp, **kw)
                  for sp in (1, 2))
        f1, f2 = y1.float(), y2.float()
        assert ((f2 - f1).abs() <= 2.0**-7 * f1.abs() + 2.0**-12 * f1.abs().max()).all(), kw
        inp = y1
    assert w4a16_swapped.decode_split(1, (16, 4)) == (2, 4) and w4a16_swapped.decode_split(9, (16, 4)) == (1, 1)
    monkeypatch.setattr(w4a16_swapped, "DECODE_SPLIT", (8, 8))
    assert w4a16_swapped.decode_split(1, (16, 4)) == (8, 4)  # capped at the projection's K tiles


def test_moe_no_tokens():
    w13, w2 = rand_weight(4, 32, 64, seed=1), rand_weight(4, 64, 16, seed=2)
    idx = torch.zeros(0, 2, dtype=torch.long, device=DEVICE)
    out = moe_experts_w4a16_triton(rand_x(0, 64, seed=0), w13, w2, idx, torch.zeros(0, 2, device=DEVICE))
    assert out.shape == (0, 64)


# ---- guards, custom op, registry ------------------------------------------------------------------------------------
def test_supports_guard_boundaries():
    w = rand_weight(32, 64, seed=1)
    x = rand_x(2, 64, seed=2)
    assert supports_dense(**describe_dense(x, w))
    assert not supports_dense(**describe_dense(x.float(), w))  # fp32 activations: tl.dot would use tf32
    assert not supports_dense(**describe_dense(rand_x(2, 32, seed=3), w))  # K mismatch
    assert not supports_dense(**describe_dense(x, NVFP4Tensor(w.packed, w.scales, torch.ones(7))))  # bad global
    assert not supports_dense(**describe_dense(x, NVFP4Tensor(w.packed, w.scales.float(), w.global_scale)))
    assert not supports_dense(**describe_dense(x, NVFP4Tensor(w.packed.t(), w.scales, w.global_scale)))
    info = describe_dense(x, w)
    other = "cuda" if info["device"] == "cpu" else "cpu"  # the interpreter runs CPU tensors only, a GPU cuda ones
    assert not supports_dense(**{**info, "device": other, "capability": (9, 0)})
    if info["device"] == "cuda":
        assert not supports_dense(**{**info, "capability": (7, 5)})

    w13, w2 = rand_weight(4, 32, 64, seed=1), rand_weight(4, 64, 16, seed=2)
    idx = routing_ids(3, 2, 4, seed=0)
    wts = torch.full((3, 2), 0.5, device=DEVICE)
    assert supports_moe(**describe_moe(rand_x(3, 64, seed=0), w13, w2, idx, wts))
    assert not supports_moe(**describe_moe(rand_x(3, 64, seed=0), w2, w13, idx, wts))  # swapped weights
    assert not supports_moe(**describe_moe(rand_x(3, 64, seed=0), w13, w2, idx[:2], wts))  # routing rows != tokens


def test_custom_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = rand_weight(32, 64, seed=1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = torch.ops.qwen.w4a16_linear(torch.empty(2, 5, 64, dtype=torch.bfloat16, device=DEVICE), w.packed,
                                        w.scales, w.global_scale)
        assert y.shape == (2, 5, 32) and y.dtype == torch.bfloat16


def test_registry_self_check():
    from engine_core.registry import Registry

    from kernels import w4a16_gemm

    reg = Registry()
    w4a16_gemm.register(reg)
    outcomes = reg.self_check(DEVICE)
    assert all("passed" in v for v in outcomes.values()), outcomes
    samples = w4a16_gemm._sample_dense(DEVICE)  # CUDA: also lm_head's wide one-row call (triton_mma_wide's)
    x, w = (samples[0] if isinstance(samples, list) else samples)[0]
    assert reg.choose("w4a16_linear", **describe_dense(x, w)).name == "triton_gemv"  # kernels/w4a16_gemv.py first
    assert reg.choose("w4a16_linear", **describe_dense(x.float(), w)).name == "reference"  # recorded fallback
    assert reg.choices()["w4a16_linear"]["fallback"]
    # on CUDA the routed-expert sample is in split halves (what the engine's loader stores there): the same check here,
    # and for tile-major experts
    assert w4a16_gemm.default_expert_layout("cpu") == w4a16_gemm.CHECKPOINT
    for cap, want in (((9, 0), w4a16_gemm.SPLIT_HALVES), ((10, 0), w4a16_gemm.TILE_MAJOR),
                      ((8, 0), w4a16_gemm.TILE_MAJOR)):
        with mock.patch("torch.cuda.get_device_capability", return_value=cap):
            assert w4a16_gemm.default_expert_layout("cuda") == want, cap
    # the loader's "auto": dual_frag (fragment-order split halves + a checkpoint-layout copy for small batches) on
    # Hopper, else the above
    from qwen_engine.load_packed import resolve_expert_layout

    assert resolve_expert_layout("auto", "cpu") == "checkpoint"
    for cap, want in (((9, 0), "dual_frag"), ((10, 0), "tile_major"), ((8, 9), "tile_major")):
        with mock.patch("torch.cuda.get_device_capability", return_value=cap):
            assert resolve_expert_layout("auto", "cuda") == want, cap
            assert resolve_expert_layout("split_halves", "cuda") == "split_halves"
            assert resolve_expert_layout("dual", "cuda") == "dual"
    with pytest.raises(ValueError, match="expert_layout must be one of"):
        resolve_expert_layout("halves", "cpu")
    for layout in (w4a16_gemm.SPLIT_HALVES, w4a16_gemm.SPLIT_FRAG, w4a16_gemm.TILE_MAJOR):
        args, _ = w4a16_gemm._sample_moe(DEVICE, layout=layout)
        assert args[-1] == layout and supports_moe(**describe_moe(*args))
        assert compare(moe_experts_w4a16_triton(*args), moe_experts_w4a16_reference(*args)) is None
