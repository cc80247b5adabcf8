"""kernels/w4a16_gemv.py: the decode GEMV (NVFP4 W4A16 on CUDA cores, 1-4 rows) against `kernels/nvfp4.py`'s
references (CPU: Triton's interpreter, tests/conftest.py; a GPU: the compiled kernel, autotuned).

Tolerances (tests/test_kernel_w4a16.py's module docstring, whose `check_gemm` / `check_swiglu` these reuse): the
GEMV builds every weight exactly and sums the exact fp32 products in another order than the reference, then rounds
once: per element <= 2^-8 |ref| + 2^-20 (|x| @ |W|^T), and >= 95% equal to the reference rounded to bf16. The MoE
block rounds the SwiGLU activations to bf16 between its two GEMVs (so does the tensor-core path): the registry's
`compare` (1e-2 of max |ref|), and equal to the tensor-core path's result within the same bound.
"""

import pytest
import torch

from engine_core.registry import Registry
from kernels import w4a16_gemm
from kernels.nvfp4 import NVFP4Tensor, dequantize_nvfp4, w4a16_linear_reference
from kernels.w4a16_gemm import compare, moe_experts_w4a16_reference, w4a16_swiglu_reference
from kernels.w4a16_gemv import (
    GEMV,
    GEMV_MAX_TOKENS,
    gemv_ok,
    moe_experts_w4a16_gemv,
    w4a16_gemv_launch,
    w4a16_linear_gemv,
    w4a16_swiglu_gemv,
)
from tests import ptx_emu
from tests.test_kernel_w4a16 import DEVICE, check_gemm, check_swiglu, moe_inputs, rand_weight, rand_x

CONFIGS = [None] if DEVICE == "cuda" else [dict(BLOCK_N=8, BLOCK_K=64), dict(BLOCK_N=4, BLOCK_K=128)]


def _dq(w: NVFP4Tensor) -> torch.Tensor:
    return dequantize_nvfp4(w.packed, w.scales, w.global_scale, dtype=torch.float32)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m,n,k,per_row", [(1, 40, 192, True), (3, 24, 48, False), (4, 33, 256, True),
                                           (2, 8, 16, True)])  # N not a multiple of BLOCK_N; K of BLOCK_K; K = 16
def test_dense_matches_reference(m, n, k, per_row, config):
    w = rand_weight(n, k, seed=n + k, per_row=per_row)
    x = rand_x(m, k, seed=m)
    y = w4a16_gemv_launch(x, *w, config=config)
    assert y.shape == (m, n) and y.dtype == x.dtype
    check_gemm(y, x, _dq(w), x.float() @ _dq(w).T, f"gemv {m}x{n}x{k}")


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m", [1, 4])
def test_dense_swiglu(m, config):
    w = rand_weight(2 * 24, 192, seed=3)
    x = rand_x(m, 192, seed=4)
    y = w4a16_gemv_launch(x, *w, swiglu=True, config=config)
    assert y.shape == (m, 24)
    check_swiglu(y, x, _dq(w), "gemv swiglu")


def test_fp16_activations():
    w = rand_weight(40, 128, seed=5)
    x = rand_x(2, 128, seed=6, dtype=torch.float16)
    y = w4a16_gemv_launch(x, *w)
    assert y.dtype == torch.float16
    check_gemm(y, x, _dq(w), x.float() @ _dq(w).T, "gemv fp16")


@pytest.mark.parametrize("config", CONFIGS)
def test_grouped_rows_read_their_expert_and_token(config):
    """Output row r = x[r // a_div] @ W[pair_expert[r]]^T x row_scale[r], for repeated and unused experts."""
    e, n, k, t, top_k = 5, 40, 96, 3, 2
    w = rand_weight(e, n, k, seed=7)
    x = rand_x(t, k, seed=8)
    idx = torch.tensor([[4, 1], [1, 1], [0, 4]], device=DEVICE)  # expert 1 twice in one token; 2 and 3 unused
    rs = torch.rand(t, top_k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(DEVICE)
    y = w4a16_gemv_launch(x, *w, pair_expert=idx, a_div=top_k, row_scale=rs, config=config)
    assert y.shape == (t * top_k, n)
    for r in range(t * top_k):
        ex = int(idx.view(-1)[r])
        we = NVFP4Tensor(w.packed[ex], w.scales[ex], w.global_scale[ex])
        xr = x[r // top_k: r // top_k + 1]
        ref = xr.float() @ _dq(we).T
        assert compare(y[r:r + 1].float(), ref * rs.view(-1)[r].float()) is None, r  # the row scale multiplies last
        plain = w4a16_gemv_launch(xr, we.packed, we.scales, we.global_scale, config=config)
        check_gemm(plain, xr, _dq(we), ref, f"row {r}")


@pytest.mark.parametrize("t", [1, 2, GEMV_MAX_TOKENS])
def test_moe_block_matches_reference_and_tensor_core_path(t):
    w13, w2, idx, wts, x = moe_inputs(t, e=6, h=64, i=32, top_k=2, seed=10 + t)
    ref = moe_experts_w4a16_reference(x, w13, w2, idx, wts)
    y = moe_experts_w4a16_gemv(x, w13, w2, idx, wts)
    assert y.shape == ref.shape and compare(y, ref) is None
    assert compare(y, w4a16_gemm.moe_experts_w4a16_triton(x, w13, w2, idx, wts)) is None
    y3 = moe_experts_w4a16_gemv(x, w13, w2, idx, wts, reduce=False)  # the k weighted rows, unsummed
    assert y3.shape == (t, 2, 64) and compare(y3, moe_experts_w4a16_reference(x, w13, w2, idx, wts, False)) is None


def test_registry_hands_other_calls_to_the_tensor_cores():
    """`supports_*_gemv` take the call's rows: the registry chooses the GEMV for what it serves (<= GEMV_MAX_TOKENS
    tokens; checkpoint-layout experts; dense weights within `gemv_ok`) and "triton" for the rest, and a direct call
    outside that is refused (so a disabled "triton" can never run behind the GEMV)."""
    reg = Registry("auto")
    w4a16_gemm.register(reg)
    moe, dense, swiglu = (reg.spec(op) for op in (w4a16_gemm.MOE, w4a16_gemm.DENSE, w4a16_gemm.SWIGLU))
    w13, w2, idx, wts, x = moe_inputs(GEMV_MAX_TOKENS + 1, e=4, h=256, i=256, top_k=2, seed=20)
    assert reg.choose(moe.name, **moe.describe(x, w13, w2, idx, wts)).name == "triton"  # 5 tokens
    assert reg.choose(moe.name, **moe.describe(x[:1], w13, w2, idx[:1], wts[:1])).name == GEMV
    t13, t2 = w4a16_gemm.experts_repack(w13, w2, w4a16_gemm.TILE_MAJOR)  # repacked experts: not the GEMV's bytes
    tiled = (x[:1], t13, t2, idx[:1], wts[:1], True, w4a16_gemm.TILE_MAJOR)
    assert reg.choose(moe.name, **moe.describe(*tiled)).name == "triton"
    for args in ((x, w13, w2, idx, wts), tiled):
        with pytest.raises(ValueError, match="checkpoint-layout experts"):
            moe_experts_w4a16_gemv(*args)
    w = rand_weight(48, 64, seed=11)
    for spec in (dense, swiglu):
        assert reg.choose(spec.name, **spec.describe(rand_x(GEMV_MAX_TOKENS + 1, 64, seed=12), w)).name == "triton"
        assert reg.choose(spec.name, **spec.describe(rand_x(3, 64, seed=12).view(3, 1, 64), w)).name == GEMV
    with pytest.raises(ValueError, match="not a GEMV call"):
        w4a16_linear_gemv(rand_x(GEMV_MAX_TOKENS + 1, 64, seed=12), w)


def test_dense_dispatch_rule_and_leading_dims():
    """`gemv_ok`: one row at any size, up to GEMV_MAX_TOKENS rows when the weight is at most GEMV_MAX_REPEAT_BYTES
    (each row re-reads it). Leading dims are kept."""
    assert gemv_ok(1, 1024, 2048) and gemv_ok(4, 2048, 512) and not gemv_ok(5, 1024, 2048)
    assert gemv_ok(1, 248320, 2048) and not gemv_ok(2, 248320, 2048)  # lm_head: one row only
    assert not gemv_ok(0, 8, 16)
    w = rand_weight(48, 64, seed=11)
    x3 = rand_x(3, 64, seed=12).reshape(3, 1, 64)
    y = w4a16_linear_gemv(x3, w)
    assert y.shape == (3, 1, 48) and compare(y, w4a16_linear_reference(x3, w)) is None
    assert compare(w4a16_swiglu_gemv(x3, w), w4a16_swiglu_reference(x3, w)) is None


def test_registry_order_and_self_check():
    """The GEMV is the dense W4A16 ops' first choice (then kernels/w4a16_mma.py's, for the same calls on CUDA; the dense
    linear's lm_head-wide calls go to that kernel before it: too wide for the sample) and the
    MoE's second (after kernels/w4a16_mma.py's, CUDA only), and the registry's start-up check passes it on its
    samples."""
    reg = Registry("auto")
    w4a16_gemm.register(reg)
    assert [i.name for i in reg.spec(w4a16_gemm.DENSE).implementations][:4] == [
        "triton_mma_wide", GEMV, "triton_mma", "triton"]  # the wide one: lm_head-sized calls only
    assert [i.name for i in reg.spec(w4a16_gemm.SWIGLU).implementations][:3] == [GEMV, "triton_mma", "triton"]
    assert [i.name for i in reg.spec(w4a16_gemm.MOE).implementations][:3] == ["triton_mma", GEMV, "triton"]
    report = reg.self_check(DEVICE)
    # the wide path on its own sample (lm_head's one-row call, CUDA only: `_sample_dense`'s second)
    wide = ("triton_mma_wide passed; " if DEVICE == "cuda"
            else "triton_mma_wide skipped (does not support the sample on cpu); ")
    for op in (w4a16_gemm.DENSE, w4a16_gemm.SWIGLU):
        mma = "triton_mma passed" if DEVICE == "cuda" else "triton_mma skipped (does not support the sample on cpu)"
        head = wide if op == w4a16_gemm.DENSE else ""
        assert report[op] == f"{head}{GEMV} passed; {mma}; triton passed", report
    args, _ = w4a16_gemm._sample_moe(DEVICE, layout=w4a16_gemm.CHECKPOINT)
    impl = reg.choose(w4a16_gemm.MOE, **reg.spec(w4a16_gemm.MOE).describe(*args))
    assert impl.name == ("triton_mma" if DEVICE == "cuda" else GEMV)  # the MoE's first choice on CUDA
    assert compare(impl.fn(*args), moe_experts_w4a16_reference(*args)) is None


def test_wide_dequant_ptx_bits():
    """DEQ_WIDE's inline PTX (`_e2m1x8_f32_scaled_ptx`), run from its source text on the CPU (tests/ptx_emu.py): for
    every byte value in every position and scales over all positive e4m3 codes (as the kernel passes them: scale x
    2^119 in bf16, in both halves of an int32), output j of a word is the weight at k offset (0, 2, 4, 6, 1, 3, 5,
    7)[j] -- byte j % 4's low nibble for j < 4, its high nibble after -- times its scale x 2^-7, exactly, in fp32."""
    from kernels import w4a16_gemv
    from kernels.nvfp4 import E2M1_VALUES

    asm = ptx_emu.asm_text(w4a16_gemv._e2m1x8_f32_scaled_ptx)
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every positive finite code
    s_bf16 = (e4m3 * 2.0**119).to(torch.bfloat16)  # exact: e4m3 has 4 significant bits
    assert torch.equal(s_bf16.float(), e4m3 * 2.0**119)
    g = torch.Generator().manual_seed(3)
    words = [b * 0x01010101 for b in range(256)] + [0x01234567, 0x89ABCDEF, 0xFFFFFFFF, 0]
    words += torch.randint(0, 2**31, (200,), generator=g).tolist()
    for n, word in enumerate(words):
        s = s_bf16[n % len(s_bf16)]
        sbits = int(s.view(torch.int16)) & 0xFFFF
        reg = ptx_emu.run(asm, {"$8": word, "$9": sbits | (sbits << 16)})
        got = torch.tensor([reg[f"${i}"] for i in range(8)], dtype=torch.int64).to(torch.int32).view(torch.float32)
        codes = [(word >> (8 * (j % 4) + 4 * (j // 4))) & 0xF for j in range(8)]
        want = E2M1_VALUES.float()[codes] * e4m3[n % len(e4m3)] * 2.0**-7
        assert torch.equal(got, want), (hex(word), got, want)


@pytest.mark.skipif(DEVICE != "cuda", reason="DEQ_WIDE is inline PTX: GPU only (its bits: test_wide_dequant_ptx_bits)")
@pytest.mark.parametrize("case", ["dense", "swiglu", "grouped"])
def test_wide_dequant_matches_reference(case):
    """`w4a16_gemv_launch(deq=DEQ_WIDE)` (the default on a GPU) within the module's bounds of the reference, and equal
    to mode 2's result to fp32 summation order (the same weights, products summed in another order)."""
    from kernels.w4a16_gemv import DEQ_WIDE

    k = 2048
    if case == "grouped":  # routed-expert rows with row scales (the MoE's down launch), 4-byte words per row
        e, n, t, top_k = 8, 256, 2, 4
        w = rand_weight(e, n, k, seed=23)
        x = rand_x(t, k, seed=24)
        idx = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(25 + i))[:top_k]
                           for i in range(t)]).to(DEVICE)
        rs = torch.rand(t, top_k, generator=torch.Generator().manual_seed(26)).to(torch.bfloat16).to(DEVICE)
        wide = w4a16_gemv_launch(x, *w, pair_expert=idx, a_div=top_k, row_scale=rs, deq=DEQ_WIDE)
        for r in range(t * top_k):
            ex = int(idx.view(-1)[r])
            we = NVFP4Tensor(w.packed[ex], w.scales[ex], w.global_scale[ex])
            ref = x[r // top_k: r // top_k + 1].float() @ _dq(we).T
            assert compare(wide[r:r + 1].float(), ref * rs.view(-1)[r].float()) is None, r
        assert compare(wide, w4a16_gemv_launch(x, *w, pair_expert=idx, a_div=top_k, row_scale=rs, deq=2)) is None
        return
    n = 1024
    w = rand_weight(n, k, seed=21)
    x = rand_x(1, k, seed=22)
    swiglu = case == "swiglu"
    wide = w4a16_gemv_launch(x, *w, swiglu=swiglu, deq=DEQ_WIDE)
    base = w4a16_gemv_launch(x, *w, swiglu=swiglu, deq=2)
    if swiglu:
        check_swiglu(wide, x, _dq(w), "DEQ_WIDE swiglu")
    else:
        check_gemm(wide, x, _dq(w), x.float() @ _dq(w).T, "DEQ_WIDE dense")
    assert compare(wide, base) is None


@pytest.mark.skipif(DEVICE != "cuda", reason="DEQ_WIDE is inline PTX: GPU only")
def test_wide_dequant_default_takes_mode_2_on_unaligned_rows():
    """The default (DEQ_WIDE) on activations that are not 4-byte aligned (a bf16 view one element in): mode 2's result,
    not an error; DEQ_WIDE asked for by name on them: ValueError."""
    from kernels.w4a16_gemv import DEQ_GPU, DEQ_WIDE

    assert DEQ_GPU == DEQ_WIDE
    w = rand_weight(256, 512, seed=31)
    x = rand_x(1, 513, seed=32)[:, 1:]  # data_ptr % 4 == 2
    assert x.data_ptr() % 4
    assert torch.equal(w4a16_gemv_launch(x, *w), w4a16_gemv_launch(x, *w, deq=2))
    with pytest.raises(ValueError, match="4-byte"):
        w4a16_gemv_launch(x, *w, deq=DEQ_WIDE)


def test_errors():
    w = rand_weight(8, 64, seed=13)
    for deq in (5, True):
        with pytest.raises(ValueError, match="deq must be"):
            w4a16_gemv_launch(rand_x(1, 64, seed=1), *w, deq=deq)
    with pytest.raises(ValueError, match="K = 32"):
        w4a16_gemv_launch(rand_x(1, 32, seed=1), *w)
    with pytest.raises(ValueError, match="even number of rows"):
        w4a16_gemv_launch(rand_x(1, 64, seed=1), *rand_weight(9, 64, seed=14), swiglu=True)
    assert w4a16_gemv_launch(rand_x(0, 64, seed=1), *w).shape == (0, 8)


def test_small_rows_constant_matches_the_model_cache():
    """The model's choice cache keeps row counts <= SMALL_ROWS apart: it must cover the GEMV's range."""
    from qwen_engine.model.quantized import SMALL_ROWS

    assert SMALL_ROWS == GEMV_MAX_TOKENS
