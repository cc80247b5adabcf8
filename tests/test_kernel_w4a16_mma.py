"""kernels/w4a16_mma.py: the decode GEMV on the tensor cores (NVFP4 W4A16, one m16n8k16 per 8 weights a lane) against
`kernels/nvfp4.py`'s references (CPU: Triton's interpreter, where the two PTX blocks run as Triton code -- the
fragment bits as integer ops, the MMA as a sum over each quad's lanes; a GPU: the compiled kernel, autotuned).

Tolerances (tests/test_kernel_w4a16.py's `check_gemm` / `check_swiglu`): every weight is built exactly and the exact
products are summed in fp32 in another order than the reference, then rounded once: per element <= 2^-8 |ref| +
2^-20 (|x| @ |W|^T), and >= 95% equal to the reference rounded to bf16. The MoE block rounds the SwiGLU activations to
bf16 between its two launches (as every path does): the registry's `compare` (1e-2 of max |ref|). The PTX text is
checked bit for bit against the formulas on the CPU (tests/ptx_emu.py); the lane layout its fragments assume is
checked on the sm_90 compile (tests/sm90_compile.py `mma_lanes_ok`).
"""

import pytest
import torch

from engine_core.registry import Registry
from kernels import w4a16_gemm
from kernels.nvfp4 import E2M1_VALUES, NVFP4Tensor, dequantize_nvfp4
from kernels.w4a16_gemm import compare, moe_experts_w4a16_reference
from kernels.w4a16_mma import (
    CHUNK_K,
    MMA,
    MMA_MAX_ROWS,
    SORTED_BLOCK_M,
    SORTED_MAX_TOKENS,
    moe_experts_w4a16_mma,
    set_sorted_tokens,
    supports_dense_mma,
    supports_moe_mma,
    w4a16_mma_launch,
)
from tests import ptx_emu
from tests.test_kernel_w4a16 import DEVICE, check_gemm, check_swiglu, moe_inputs, rand_weight, rand_x

# On a GPU each autotuned key compiles its first configuration only (tests/conftest.py one_autotune_config): these are
# correctness tests over many shapes, and tuning all nine configurations of every key cold kept the file past its
# 110 s limit on the H200 (step 109); the tuned configurations run in the engine's start-up checks and the benches.
# Under the interpreter nothing is autotuned and the fixture changes nothing.
pytestmark = pytest.mark.usefixtures("one_autotune_config")

# the interpreter's default (2 warps, 1 chunk), one warp with two chunks an iteration (the unrolled loop), and more
# warps than chunks (lanes past K masked); a GPU autotunes
CONFIGS = [None] if DEVICE == "cuda" else [None, dict(WARPS=1, CHUNKS=2), dict(WARPS=4, CHUNKS=1)]


def _dq(w: NVFP4Tensor) -> torch.Tensor:
    return dequantize_nvfp4(w.packed, w.scales, w.global_scale, dtype=torch.float32)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m,n,k,per_row", [(1, 40, 256, True), (3, 24, 128, False), (8, 33, 384, True),
                                           (2, 32, 256, True)])  # N not a multiple of 16; 8 rows; N, K even
def test_dense_matches_reference(m, n, k, per_row, config):
    w = rand_weight(n, k, seed=n + k, per_row=per_row)
    x = rand_x(m, k, seed=m)
    y = w4a16_mma_launch(x, *w, config=config)
    assert y.shape == (m, n) and y.dtype == x.dtype
    check_gemm(y, x, _dq(w), x.float() @ _dq(w).T, f"mma {m}x{n}x{k}")


@pytest.mark.parametrize("m", [1, 2])
def test_dense_swiglu(m):
    w = rand_weight(2 * 24, 256, seed=3)  # 24 outputs: the gate and up tiles' last rows masked
    x = rand_x(m, 256, seed=4)
    y = w4a16_mma_launch(x, *w, swiglu=True)
    assert y.shape == (m, 24)
    check_swiglu(y, x, _dq(w), "mma swiglu")


@pytest.mark.parametrize("config", CONFIGS)
def test_grouped_rows_read_their_expert_and_token(config):
    """Output row r = x[r // a_div] @ W[pair_expert[r]]^T x row_scale[r], for repeated and unused experts."""
    e, n, k, t, top_k = 5, 48, 256, 3, 2
    w = rand_weight(e, n, k, seed=7)
    x = rand_x(t, k, seed=8)
    idx = torch.tensor([[4, 1], [1, 1], [0, 4]], device=DEVICE)  # expert 1 twice in one token; 2 and 3 unused
    rs = torch.rand(t, top_k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(DEVICE)
    y = w4a16_mma_launch(x, *w, pair_expert=idx, a_div=top_k, row_scale=rs, config=config)
    assert y.shape == (t * top_k, n)
    for r in range(t * top_k):
        ex = int(idx.view(-1)[r])
        we = NVFP4Tensor(w.packed[ex], w.scales[ex], w.global_scale[ex])
        ref = x[r // top_k: r // top_k + 1].float() @ _dq(we).T * rs.view(-1)[r].float()
        check_gemm(y[r:r + 1], x[r // top_k: r // top_k + 1], _dq(we) * rs.view(-1)[r].float(), ref, f"row {r}")


@pytest.mark.parametrize("t", [1, 4, 6, 16])
def test_moe_block_matches_reference(t):
    """The routed-expert block (gate_up + SwiGLU, down x routing weight, sum over top-k) against the reference: one
    program a pair up to 4 tokens, the pairs grouped by expert in blocks of 8 beyond (padding rows, several blocks of
    one expert at 16 tokens, an empty expert)."""
    e, h, i, top_k = 6, 256, 128, 3
    w13, w2, idx, weights, x = moe_inputs(t, e, h, i, top_k, seed=11, empty=(2,))
    out = moe_experts_w4a16_mma(x, w13, w2, idx, weights)
    ref = moe_experts_w4a16_reference(x, w13, w2, idx, weights)
    assert out.shape == (t, h) and out.dtype == x.dtype
    assert compare(out, ref) is None, compare(out, ref)


def test_fragment_ptx_bits():
    """`_frag_ptx`'s inline PTX, run from its source text on the CPU (tests/ptx_emu.py): for words of every byte value
    and random ones, with scales over all positive e4m3 codes (as the kernel passes them: scale x 2^119 in bf16, in
    both halves of an int32), the A fragments hold, per half, the weight x 2^-7 of the byte / nibble the module's
    fragment map names, exactly (bf16 bits), and the B fragments the named activations' bits."""
    from kernels import w4a16_mma

    asm = ptx_emu.asm_text(w4a16_mma._frag_ptx)
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every positive finite code
    s_bf16 = (e4m3 * 2.0**119).to(torch.bfloat16)
    assert torch.equal(s_bf16.float(), e4m3 * 2.0**119)  # exact: e4m3 has 4 significant bits
    g = torch.Generator().manual_seed(5)
    words = [b * 0x01010101 for b in range(256)] + [0x01234567, 0x89ABCDEF, 0xFFFFFFFF, 0]
    words += torch.randint(0, 2**31, (300,), generator=g).tolist()
    xs = torch.randint(0, 2**31, (len(words), 4), generator=g).tolist()

    def bf16_bits(v: torch.Tensor) -> int:
        return int(v.to(torch.bfloat16).view(torch.int16)) & 0xFFFF

    def weight(word: int, byte: int, high: bool, scale: float) -> int:
        code = (word >> (8 * byte + 4 * high)) & 0xF
        return bf16_bits(E2M1_VALUES.float()[code] * scale * 2.0**-7)

    for n, wa in enumerate(words):
        wb = words[(n * 7 + 3) % len(words)]
        sa, sb = e4m3[n % len(e4m3)], e4m3[(n * 5 + 1) % len(e4m3)]
        sab, sbb = (bf16_bits(s * 2.0**119) for s in (sa, sb))
        reg = ptx_emu.run(asm, {"$12": wa, "$13": wb, "$14": sab | (sab << 16), "$15": sbb | (sbb << 16),
                                **{f"${16 + j}": xs[n][j] for j in range(4)}})
        for h in range(2):  # bytes 2h, 2h + 1
            a0, a1, a2, a3, b0, b1 = (reg[f"${6 * h + j}"] for j in range(6))
            for half, byte in ((0, 2 * h), (1, 2 * h + 1)):
                def got(r):
                    return (r >> (16 * half)) & 0xFFFF
                assert got(a0) == weight(wa, byte, False, sa), (hex(wa), h, half)
                assert got(a1) == weight(wb, byte, False, sb), (hex(wb), h, half)
                assert got(a2) == weight(wa, byte, True, sa), (hex(wa), h, half)
                assert got(a3) == weight(wb, byte, True, sb), (hex(wb), h, half)
            # activations: word j = (x[2j], x[2j+1]); b0 = (x[4h], x[4h+2]), b1 = (x[4h+1], x[4h+3])
            xp, xq = xs[n][2 * h], xs[n][2 * h + 1]
            assert b0 == (xp & 0xFFFF) | ((xq & 0xFFFF) << 16)
            assert b1 == (xp >> 16) | (xq & 0xFFFF0000)


def _info(**kw):
    base = dict(device="cuda", capability=(9, 0), dtype=torch.bfloat16, k=2048, weight_ok=True, weight_k=2048,
                global_ok=True, rows=1, n=1024)
    return {**base, **kw}


def test_supports_takes_the_gemv_calls_in_bf16_on_cuda(monkeypatch):
    """The GEMV's calls (1 row; 2-4 rows of small weights), bf16 on CUDA, K a multiple of CHUNK_K; nothing else.
    (Judged as a compiled build would: under the interpreter every CUDA call is refused.)"""
    monkeypatch.setattr(w4a16_gemm, "_interpreted", lambda: False)
    assert supports_dense_mma(**_info())
    assert supports_dense_mma(**_info(rows=4))
    assert not supports_dense_mma(**_info(rows=5))  # not a GEMV call: the tensor-core GEMM's
    assert not supports_dense_mma(**_info(dtype=torch.float16))
    assert not supports_dense_mma(**_info(device="cpu"))  # PTX: never the interpreter's choice
    assert not supports_dense_mma(**_info(capability=(8, 0)))  # mul.rn.bf16x2: sm_90
    assert not supports_dense_mma(**_info(k=2048 - CHUNK_K // 2, weight_k=2048 - CHUNK_K // 2))
    moe = dict(device="cuda", capability=(9, 0), dtype=torch.bfloat16, shapes_ok=True, globals_ok=True, tokens=1,
               layout=w4a16_gemm.CHECKPOINT, k=2048, k_down=512)
    assert supports_moe_mma(**moe) and supports_moe_mma(**{**moe, "tokens": 4})
    assert not supports_moe_mma(**{**moe, "capability": (8, 9)})
    assert not supports_moe_mma(**{**moe, "tokens": 5})  # the sorted path: only when asked (set_sorted_tokens)
    try:
        assert set_sorted_tokens(32) == 32
        assert supports_moe_mma(**{**moe, "tokens": 32}) and not supports_moe_mma(**{**moe, "tokens": 33})
    finally:
        set_sorted_tokens(0)
    with pytest.raises(ValueError, match="sorted tokens"):
        set_sorted_tokens(SORTED_MAX_TOKENS + 1)
    assert not supports_moe_mma(**{**moe, "k_down": 192})
    assert not supports_moe_mma(**{**moe, "layout": w4a16_gemm.EXPERT_LAYOUTS["tile_major"]})


def test_wide_takes_lm_head_calls_only(monkeypatch):
    """"triton_mma_wide" (ahead of the GEMV in w4a16_linear): the dense calls of >= WIDE_MIN_N outputs that the
    tensor-core GEMV takes -- lm_head (N = vocab) at 1 row -- and no projection-sized call; the registry then routes
    an lm_head-wide call to it and a shared-expert-sized one to the GEMV."""
    from kernels.w4a16_mma import MMA_WIDE, WIDE_MIN_N, supports_dense_mma_wide

    monkeypatch.setattr(w4a16_gemm, "_interpreted", lambda: False)
    assert supports_dense_mma_wide(**_info(n=248320)) and supports_dense_mma_wide(**_info(n=WIDE_MIN_N))
    assert not supports_dense_mma_wide(**_info(n=WIDE_MIN_N - 16))  # the projections: the GEMV's
    assert not supports_dense_mma_wide(**_info(n=248320, device="cpu"))
    assert not supports_dense_mma_wide(**_info(n=248320, capability=(8, 0)))
    assert not supports_dense_mma_wide(**_info(n=248320, rows=5))  # beyond the GEMV's rows: the GEMM's
    reg = Registry()
    w4a16_gemm.register(reg)
    assert reg.choose(w4a16_gemm.DENSE, **_info(n=248320)).name == MMA_WIDE
    assert reg.choose(w4a16_gemm.DENSE, **_info(n=2048, k=512, weight_k=512)).name == "triton_gemv"


def test_registry_order():
    """The MoE tries it first (H200: faster than the GEMV at <= 4 tokens); the dense ops after the GEMV."""
    reg = Registry()
    w4a16_gemm.register(reg)
    for op in (w4a16_gemm.DENSE, w4a16_gemm.SWIGLU):
        names = [i.name for i in reg.spec(op).implementations]
        assert names.index(MMA) == names.index("triton_gemv") + 1 and names.index(MMA) < names.index("triton"), names
    assert [i.name for i in reg.spec(w4a16_gemm.MOE).implementations][:3] == [MMA, "triton_gemv", "triton"]


def test_sorted_launch_writes_every_pair_row_once():
    """The sorted launch (`routing`) writes row p of y for every real pair p (y is allocated uninitialised: a row it
    missed would hold garbage) with that pair's token, expert and row scale: equal to the one-program-per-pair
    launch to fp32 summation order."""
    from kernels.w4a16_gemm import moe_align

    e, n, k, t, top_k = 5, 32, 256, 6, 3
    w = rand_weight(e, n, k, seed=12)
    x = rand_x(t, k, seed=13)
    idx = torch.tensor([[0, 1, 2], [0, 1, 3], [0, 2, 3], [0, 1, 2], [1, 0, 3], [0, 2, 1]], device=DEVICE)
    rs = torch.rand(t, top_k, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16).to(DEVICE)
    routing = moe_align(idx, e, SORTED_BLOCK_M)  # expert 0: 6 pairs, 1: 5, 2: 4, 3: 3, 4: none
    by_block = w4a16_mma_launch(x, *w, pair_expert=idx, a_div=top_k, row_scale=rs, routing=routing)
    by_pair = w4a16_mma_launch(x, *w, pair_expert=idx, a_div=top_k, row_scale=rs)
    assert by_block.shape == (t * top_k, n)
    for r in range(t * top_k):  # row by row: a row missed or written with another pair's numbers fails alone
        assert compare(by_block[r].float(), by_pair[r].float()) is None, r


def test_model_choice_cache_keeps_the_sorted_range_apart():
    """The model's choice cache (`quantized._Dispatch`) asks the registry again past MID_ROWS (= SORTED_MAX_TOKENS):
    the sorted MoE path takes only calls up to it, so a prefill chunk must not reuse a decode batch's choice."""
    from types import SimpleNamespace

    from qwen_engine.model.quantized import MID_ROWS, SMALL_ROWS, _Dispatch

    assert MID_ROWS == SORTED_MAX_TOKENS and SMALL_ROWS < MID_ROWS
    asked = []

    class Counting:
        def preference(self, op):
            return "auto"

        def spec(self, op):
            return SimpleNamespace(describe=lambda x: dict(rows=x.shape[0]))

        def choose(self, op, rows):
            asked.append(rows)
            return SimpleNamespace(name=f"for {rows}", fn=lambda x: x)

    d = _Dispatch("w4a16_moe", registry=Counting())
    for rows in (5, MID_ROWS, MID_ROWS + 1, 2048, 6):
        d._call(torch.zeros(rows, 8))
    assert asked == [5, MID_ROWS + 1], asked  # one choice for 5..MID_ROWS, one above


def test_engine_small_batch_tokens_sets_the_dual_copies_threshold():
    """QwenEngineConfig.small_batch_tokens: validated (1..SORTED_MAX_TOKENS or None), and `set_small_batch_tokens`
    moves every dual stack's threshold (None keeps the loader's); stacks without a copy stay without one."""
    from qwen_engine.engine import QwenEngineConfig, set_small_batch_tokens
    from qwen_engine.model.quantized import NVFP4Experts

    for bad in (0, SORTED_MAX_TOKENS + 1, 2.0, True):
        with pytest.raises(ValueError, match="small_batch_tokens"):
            QwenEngineConfig(small_batch_tokens=bad)
    reg = Registry("auto")
    w4a16_gemm.register(reg)
    g = torch.Generator().manual_seed(8)
    from kernels.nvfp4 import quantize_nvfp4

    gu = quantize_nvfp4(torch.randn(4, 512, 256, generator=g) * 0.05, torch.rand(4, generator=g) * 1e-3 + 1e-4)
    dn = quantize_nvfp4(torch.randn(4, 256, 256, generator=g) * 0.05, torch.rand(4, generator=g) * 1e-3 + 1e-4)
    dual, single = NVFP4Experts(gu, dn, reg), NVFP4Experts(gu, dn, reg)
    assert dual.repack_dual()
    model = torch.nn.ModuleList([dual, single])
    from kernels import w4a16_mma

    try:
        assert set_small_batch_tokens(model, None) == 4 and dual.small_tokens == 4
        assert w4a16_mma._SORTED_TOKENS[0] == 0  # <= 4: no sorted path
        assert set_small_batch_tokens(model, 32) == 32 and dual.small_tokens == 32 and single.small_tokens == 0
        assert w4a16_mma._SORTED_TOKENS[0] == 32  # the registry hands it the copy's 5-32-token calls
        assert set_small_batch_tokens(torch.nn.ModuleList([single]), 32) == 0 and single.small_tokens == 0
        assert w4a16_mma._SORTED_TOKENS[0] == 0
    finally:
        w4a16_mma.set_sorted_tokens(0)
    with pytest.raises(ValueError, match="decode GEMVs"):
        NVFP4Experts(gu, dn, reg).repack_dual(small_tokens=SORTED_MAX_TOKENS + 1)


def test_describe_moe_gives_both_k():
    w13, w2, idx, weights, x = moe_inputs(1, 4, 256, 128, 2, seed=3)
    info = w4a16_gemm.describe_moe(x, w13, w2, idx, weights)
    assert (info["k"], info["k_down"]) == (256, 128)


def test_errors():
    w = rand_weight(32, 192, seed=1)
    with pytest.raises(ValueError, match="multiple of 128"):
        w4a16_mma_launch(rand_x(1, 192, seed=2), *w)
    w = rand_weight(32, 256, seed=1)
    with pytest.raises(ValueError, match="bf16 activations"):
        w4a16_mma_launch(rand_x(1, 256, seed=2, dtype=torch.float16), *w)
    with pytest.raises(ValueError, match=f"<= {MMA_MAX_ROWS} rows"):
        w4a16_mma_launch(rand_x(MMA_MAX_ROWS + 1, 256, seed=2), *w)
    off = rand_x(2, 264, seed=2)[:, 2:258]  # activation rows 4 bytes off their 8-byte words: copied, not refused
    check_gemm(w4a16_mma_launch(off, *w), off, _dq(w), off.float() @ _dq(w).T, "misaligned activations")
    wide = rand_weight(32, 272, seed=1)  # rows of 136 bytes: a view 4 bytes in is off its 8-byte words
    with pytest.raises(ValueError, match="8-byte aligned"):
        w4a16_mma_launch(rand_x(1, 256, seed=2), wide.packed[:, 4:132], wide.scales[:, :16], wide.global_scale)
    w13, w2, idx, weights, x = moe_inputs(SORTED_MAX_TOKENS + 1, 4, 256, 128, 2, seed=3)
    with pytest.raises(ValueError, match=f"takes <= {SORTED_MAX_TOKENS} tokens"):
        moe_experts_w4a16_mma(x, w13, w2, idx, weights)
    routing = w4a16_gemm.moe_align(idx[:6], 4, 16)
    with pytest.raises(ValueError, match=f"block_m {SORTED_BLOCK_M}"):
        w4a16_mma_launch(x[:6], *w13, pair_expert=idx[:6], a_div=2, swiglu=True, routing=routing)


@pytest.mark.skipif(DEVICE != "cuda", reason="engine shapes on the compiled kernel: a GPU (the CPU runs the above)")
@pytest.mark.parametrize("case", ["gate_up", "down", "shared", "lm_head_rows"])
def test_engine_shapes_on_cuda(case):
    """The model's decode calls on the compiled PTX path (autotuned): the routed experts' two launches at 1-64 tokens
    x top-8 of 16 and of 256 experts (one program a pair to 4 tokens, the sorted path beyond), each (token, slot)
    row against the reference; the shared expert's SwiGLU; a dense call of 8 rows."""
    if case in ("gate_up", "down"):  # one program a pair (1, 4 tokens) and the sorted path (8, 32, 64), per row
        e, h, i, top_k = 256 if case == "down" else 16, 2048, 512, 8
        for t in (1, 4, 8, 32, 64):
            w13, w2, idx, weights, x = moe_inputs(t, e, h, i, top_k, seed=30 + t)
            out = moe_experts_w4a16_mma(x, w13, w2, idx, weights, reduce=False)
            ref = moe_experts_w4a16_reference(x, w13, w2, idx, weights, reduce=False)
            for r in range(t):
                for j in range(top_k):
                    assert compare(out[r, j].float(), ref[r, j].float()) is None, (t, r, j)
        return
    if case == "shared":
        w = rand_weight(2 * 512, 2048, seed=40)
        x = rand_x(1, 2048, seed=41)
        check_swiglu(w4a16_mma_launch(x, *w, swiglu=True), x, _dq(w), "shared expert")
        return
    w = rand_weight(4096, 2048, seed=42)
    x = rand_x(8, 2048, seed=43)
    check_gemm(w4a16_mma_launch(x, *w), x, _dq(w), x.float() @ _dq(w).T, "8 rows")
