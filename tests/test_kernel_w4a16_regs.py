"""kernels/w4a16_regs.py: the register-streamed expert kernel (Gluon; the engine's decode-sized expert calls on sm_90,
`expert_regs` "auto").

On the CPU: the thread-order layout (round trip; every stored byte is the fragment byte the module docstring names;
the kernel's weight and scale index chains, mirrored op for op in torch by `kernel_codes` and `kernel_block_scales`,
read the checkpoint's codes and block scales back), an offline sm_90 compile of the engine's builds (which also
proves at compile time that the decoded words are the wgmma A fragment without a move: `convert_layout(...,
assert_trivial=True)` inside the kernel), the launcher's errors, and the engine's copy (`NVFP4Experts.repack_regs`,
`expert_regs`). On an sm_90 GPU: the kernel against `w4a16_grouped_reference` (tolerance as
tests/test_kernel_w4a16_swapped.py: exact dequant, so only fp32 summation order and one bf16 rounding differ) and, at
16-row blocks, bit for bit against the swap-AB kernel on the same routing (the same products summed in the same wgmma
K order). Gluon has no CPU interpreter, so the kernel's results are checked only there (H200, 2026-12-05: 60
passed, the 2 skips the layout test's on Triton 3.6)."""

import pytest
import torch

from kernels import w4a16_regs
from kernels.nvfp4 import NVFP4Tensor, quantize_nvfp4, unpack_e2m1
from kernels.w4a16_regs import kernel_codes, thread_order, unthread_order
from kernels.w4a16_swapped import frag_words

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _packed(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)


def test_thread_order_round_trip():
    p = _packed(3, 128, 256, seed=1)
    t = thread_order(p)
    assert t.shape == p.shape and t.dtype == torch.uint8 and not torch.equal(t, p)
    assert torch.equal(unthread_order(t), p)
    assert torch.equal(unthread_order(thread_order(p[1])), p[1])  # unstacked [N, K/2]


def test_kernel_index_chain_reads_the_checkpoint_codes():
    """`kernel_codes` (the kernel's reshape / decode / join / permute chain in torch) on thread-order bytes gives the
    checkpoint's codes for every (expert, row, k): a wrong axis in the loader or the chain moves codes."""
    p = _packed(2, 192, 384, seed=2)
    assert torch.equal(kernel_codes(thread_order(p)), unpack_e2m1(p))


def test_kernel_scale_chain_reads_the_checkpoint_scales():
    """`kernel_block_scales` (the kernel's scale loads, quad shuffles, joins and permutes in torch) gives every weight
    its checkpoint block scale scales[row, k // 16]: a wrong lane, join order or axis moves scales."""
    g = torch.Generator().manual_seed(6)
    scales = torch.randint(0, 0x7F, (2, 128, 512 // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = scales.float().repeat_interleave(16, dim=-1)
    assert torch.equal(w4a16_regs.kernel_block_scales(scales), want)


def test_stored_bytes_are_the_fragment_bytes():
    """Byte (s_hi, w, i, c, s_lo, e) of a tile, unscrambled, is code(row, k) | code(row, k + 8) << 4 with row =
    16 w + 8 (e // 2) + i and k = 16 (4 s_hi + s_lo) + 2 c + e % 2 (the wgmma A fragment's thread order), at byte
    s_hi * 2048 + (32 w + 4 i + c) * 16 + 4 s_lo + e; checked one position at a time on a 64 x 256 weight (tile 1)."""
    p = _packed(1, 64, 256, seed=3)
    codes = unpack_e2m1(p)[0]
    plain = frag_words(thread_order(p).reshape(-1, 4), inverse=True).reshape(-1)
    g = torch.Generator().manual_seed(4)
    for _ in range(200):
        s_hi, w, i, c, s_lo, e = (int(torch.randint(0, m, (1,), generator=g)) for m in (2, 4, 8, 4, 4, 4))
        row, k = 16 * w + 8 * (e // 2) + i, 128 + 16 * (4 * s_hi + s_lo) + 2 * c + e % 2
        at = 4096 + s_hi * 2048 + (32 * w + 4 * i + c) * 16 + 4 * s_lo + e
        assert int(plain[at]) == int(codes[row, k]) | int(codes[row, k + 8]) << 4


def test_launcher_refuses_what_it_cannot_run():
    """Argument errors come before any Triton work (so on the CPU too)."""
    from kernels.w4a16_gemm import moe_align

    w = quantize_nvfp4(torch.randn(2, 128, 256) * 0.02)
    idx = torch.tensor([[0], [1]])
    x = torch.randn(2, 256).to(torch.bfloat16)
    launch = w4a16_regs.w4a16_regs_launch
    if w4a16_regs.gluon is None:
        pytest.skip("this Triton has no Gluon")
    with pytest.raises(ValueError, match="bf16"):
        launch(x.float(), thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16))
    with pytest.raises(ValueError, match="block_m 8 or 16"):
        launch(x, thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 32))
    with pytest.raises(ValueError, match="ahead"):
        launch(x, thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16), ahead=3)
    with pytest.raises(ValueError, match="128 x a power of two"):
        launch(x[:, :192], w.packed[..., :96], w.scales[..., :12], w.global_scale, moe_align(idx, 2, 16))
    w1 = quantize_nvfp4(torch.randn(2, 128, 128) * 0.02)  # one K tile: nothing to hold two ahead
    with pytest.raises(ValueError, match="dividing the number of K tiles"):
        launch(x[:, :128], thread_order(w1.packed), w1.scales, w1.global_scale, moe_align(idx, 2, 16), ahead=2)
    with pytest.raises(ValueError, match="dividing the number of K tiles"):  # 2 K tiles: not 4 ahead
        launch(x, thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16), ahead=4)
    with pytest.raises(ValueError, match="cols_first takes at most 65,535 row blocks"):
        many = moe_align(torch.zeros(65536 * 16, 1, dtype=torch.int64), 2, 16)  # 65,536 blocks of expert 0
        launch(x, thread_order(w.packed), w.scales, w.global_scale, many, cols_first=True)
    with pytest.raises(ValueError, match="early is for the down projection"):
        launch(x, thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16), swiglu=True, early=True)
    with pytest.raises(ValueError, match="l2_ahead"):
        launch(x, thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16), l2_ahead=-1)
    with pytest.raises(ValueError, match="ring must be"):
        launch(x, thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16), ring=3)
    with pytest.raises(ValueError, match="ring must be"):  # the ring reads one tile ahead itself
        launch(x, thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16), ring=4, ahead=2)
    with pytest.raises(ValueError, match="ring must be"):
        launch(x, thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16), ring=4, l2_ahead=2)
    with pytest.raises(ValueError, match="cols must be"):  # 2 column tiles of 64
        launch(x, thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16), cols=4)
    with pytest.raises(ValueError, match="row_scale"):
        launch(x, thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16), row_scale=torch.ones(3))
    with pytest.raises(ValueError, match="bf16"):
        launch(x[None], thread_order(w.packed), w.scales, w.global_scale, moe_align(idx, 2, 16))
    stored = thread_order(w.packed)
    shifted = torch.empty(stored.numel() + 1, dtype=torch.uint8)[1:].view(stored.shape).copy_(stored)
    with pytest.raises(ValueError, match="16-byte-aligned"):  # contiguous, but one byte off
        launch(x, shifted, w.scales, w.global_scale, moe_align(idx, 2, 16))
    with pytest.raises(ValueError, match="16-byte-aligned"):
        launch(x, stored.transpose(0, 1).contiguous().transpose(0, 1), w.scales, w.global_scale,
               moe_align(idx, 2, 16))


def test_fit_build_fits_every_shape_the_op_meets():
    """The engine's builds are fitted to each call (`fit_build`): ahead halved to a divisor of the K tiles and cols to
    one of the column tiles -- an ahead-4 down build at the self-check sample's 2 K tiles runs ahead 2 (on the H200 the
    launcher's refusal there disabled the kernel at start-up) -- and a build that fits is unchanged."""
    fit = w4a16_regs.fit_build
    assert fit({"ahead": 4, "l2_ahead": 0}, 256, 2048) == {"ahead": 2, "l2_ahead": 0, "cols": 1}
    assert fit({"ahead": 4}, 128, 64) == {"ahead": 1, "cols": 1}
    assert fit({"ahead": 4, "cols": 1, "early": True}, 512, 2048) == {"ahead": 4, "cols": 1, "early": True}
    assert fit({"ahead": 2, "cols": 8}, 2048, 128) == {"ahead": 2, "cols": 2}
    assert fit({}, 2048, 512) == {"ahead": w4a16_regs.AHEAD, "cols": w4a16_regs.COLS}


@pytest.mark.parametrize("early_loads", [False, True])
def test_moe_op_asks_early_for_down_only(monkeypatch, early_loads):
    """The experts op (THREAD_ORDER) launches gate_up never EARLY (the alignment right before it wrote its routing)
    and down EARLY exactly when early loads are in force (`pdl.early`, the engine's `early_loads`) or ENGINE_BUILDS
    says so: its routing is two launches old. The launcher is recorded, not run (Gluon has no CPU interpreter)."""
    from kernels import pdl
    from kernels.w4a16_gemm import THREAD_ORDER, w4a16_moe_op

    calls = []

    def record(x, packed, scales, g, routing, **kw):
        calls.append(kw)
        n_out = packed.shape[1] // 2 if kw.get("swiglu") else packed.shape[1]
        return torch.zeros(routing.num_pairs, n_out, dtype=x.dtype)

    monkeypatch.setattr(w4a16_regs, "w4a16_regs_launch", record)
    monkeypatch.setattr(pdl, "early", lambda: early_loads)
    e, h, i, t, k = 4, 256, 128, 3, 2
    p13, s13 = torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8), torch.zeros(e, 2 * i, h // 16, dtype=torch.uint8)
    p2, s2 = torch.zeros(e, h, i // 2, dtype=torch.uint8), torch.zeros(e, h, i // 16, dtype=torch.uint8)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]])
    w4a16_moe_op(torch.zeros(t, h, dtype=torch.bfloat16), p13, s13.view(torch.float8_e4m3fn), torch.ones(e), p2,
                 s2.view(torch.float8_e4m3fn), torch.ones(e), idx, torch.ones(t, k, dtype=torch.bfloat16),
                 layout=THREAD_ORDER)
    assert [c.get("swiglu", False) for c in calls] == [True, False]
    assert calls[0]["early"] is False and calls[1]["early"] is early_loads


def test_thread_order_refuses_ragged_weights():
    with pytest.raises(ValueError, match="do not split"):
        thread_order(_packed(1, 96, 256, seed=5))
    with pytest.raises(ValueError, match="do not split"):
        thread_order(_packed(1, 64, 192, seed=5))


@pytest.mark.skipif(w4a16_regs.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("block_m", [16, 8])
def test_stacked_tiles_layout_is_the_wgmma_tiles(block_m):
    """`stacked_tiles_layout` (the activations' one-copy fill) holds each K tile exactly where the rank-2 128-byte
    swizzled NVMMA layout of [BLOCK_M, 128] (the wgmma B operand the kernel reinterprets it as) puts it: its bases
    are that layout's, then the tile index above them (Triton's own linear-layout conversion as the reference)."""
    import triton
    from triton._C.libtriton import gluon_ir, ir
    from triton.experimental.gluon import language as gl

    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 8):  # 3.6 aborts the process on a shared one
        pytest.skip(f"Triton {triton.__version__} converts only distributed layouts to linear ones (3.8 does both)")
    ctx = ir.context()
    ir.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)
    tile = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    want = builder.to_linear_layout(tile._to_ir(builder), [block_m, 128])
    for kt in (1, 4, 16):
        got = w4a16_regs.stacked_tiles_layout(block_m, kt)
        n = len(want.offset_bases)
        assert [b[1:] for b in got.offset_bases[:n]] == want.offset_bases and all(b[0] == 0 for b in
                                                                                   got.offset_bases[:n])
        assert got.offset_bases[n:] == [[1 << i, 0, 0] for i in range(kt.bit_length() - 1)]
        assert got.alignment == want.alignment
    with pytest.raises(ValueError, match="power of two"):
        w4a16_regs.stacked_tiles_layout(block_m, 3)


# (ahead, block_m, l2_ahead, ring, cols) compiled for sm_90 offline
COMPILED = [(1, 16, 0, 0, 1), (2, 16, 0, 0, 1), (1, 8, 0, 0, 1), (2, 8, 0, 0, 1), (2, 16, 4, 0, 1), (1, 8, 0, 4, 1),
            (2, 16, 4, 0, 4), (1, 8, 0, 4, 2), (4, 8, 0, 0, 1), (4, 8, 4, 0, 1), (2, 8, 4, 0, 1)]
EARLY_COMPILED = [(4, 8, 0, 0, 1, 1), (2, 8, 4, 0, 1, 1)]  # + EARLY (the down projection's first loads before
#                                                           the PDL wait)
COLS_FIRST_COMPILED = [(2, 8, 0, 0, 1, 0, 1), (2, 8, 4, 0, 1, 0, 1)]  # the builds shipped until the forty-seventh
#                                                                      session with the grid in column order
MMA_V2_COMPILED = [(1, 8, 0, 0, 1, 0, 0, 1), (2, 8, 0, 0, 1, 0, 0, 1), (4, 8, 0, 0, 1, 0, 0, 1),
                   (2, 16, 0, 0, 1, 0, 0, 1)]  # + the products on mma.sync (`mma_v2`) instead of wgmma
SHAPES = [(2048, True), (512, False)]  # the engine's gate_up (K 2048, SwiGLU) and down (K 512, row scale)
_SM90_SCRIPT = """
import inspect, json, subprocess, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
sys.path.insert(0, "benchmarks")
from sass_loop import sass_of
from kernels import w4a16_regs
out, builds, shapes = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
kern = w4a16_regs._w4a16_regs_kernel
names = list(inspect.signature(kern.fn).parameters)
ptrs = {"x": "*bf16", "w": "*i32", "s": "*i32", "g": "*fp32", "rs": "*bf16", "y": "*bf16", "sorted_pairs": "*i32",
        "block_expert": "*i32"}
aligned = set(ptrs) | {"N", "s_xm", "s_we", "s_se", "s_sn", "s_ym"}  # 16-divisible at the engine's shapes, as the JIT
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}  # marks them at a launch
tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
for k, swiglu in shapes:
    for ahead, block_m, l2, ring, cols, *rest in builds:
        early, cols_first = bool(rest and rest[0]), bool(len(rest) > 1 and rest[1])
        mma_v2 = bool(len(rest) > 2 and rest[2])
        if early and swiglu:  # the down projection's option only
            continue
        tag = (f"{k}-{swiglu}-{ahead}-{block_m}-{l2}-{ring}-{cols}" + ("-early" if early else "")
               + ("-colsfirst" if cols_first else "") + ("-mmav2" if mma_v2 else ""))
        for pdl in (False, True):
            consts = dict(K=k, SWIGLU=swiglu, HAS_ROW_SCALE=not swiglu, BLOCK_M=block_m, AHEAD=ahead, L2_AHEAD=l2,
                          RING=ring, COLS=cols, XS_STACK=w4a16_regs.stacked_tiles_layout(block_m, k // 128),
                          EARLY=early, COLS_FIRST=cols_first, USE_PDL=pdl, MMA_V2=mma_v2)
            sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
            build = triton.compile(GluonASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
            (out / f"{tag}-{pdl}.ptx").write_text(build.asm["ptx"])
            if pdl and early:
                (out / f"{tag}-pdl.sass").write_text(sass_of(build))
            if not pdl:
                (out / f"{tag}.sass").write_text(sass_of(build))
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(build.asm["cubin"])
                    f.flush()
                    res = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
                (out / f"{tag}.res").write_text(res)
"""


@pytest.fixture(scope="module")
def sm90_builds(tmp_path_factory):
    """The COMPILED builds of both SHAPES compiled for sm_90 (with and without USE_PDL) in one subprocess without
    TRITON_INTERPRET: its SASS, PTX and resource usage as files. A subprocess because Triton's interpreter leaves
    `triton.language.core` patched after a jit function is called directly (`InterpretedFunction.__call__` never
    restores it), after which compiling a Gluon kernel in the same process fails -- the order of a whole test run
    decides whether that happened."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("regs_sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, str(out),
                          json.dumps(COMPILED + EARLY_COMPILED + COLS_FIRST_COMPILED + MMA_V2_COMPILED),
                          json.dumps(SHAPES)],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                         timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def _loop_checks(sass: str, ops, proj: int, ring: int) -> None:
    """test_compiles_for_sm90's K-loop checks (`ops`: the loop's opcodes, `proj`: projections x K tiles a trip)."""
    from benchmarks.sass_loop import loop_instructions

    assert ops["HGMMA"] == 8 * proj  # 8 wgmma k-steps of 16 per projection and K tile
    if ring:  # per projection and tile: the words (2 x 16 B) and one scale word by cp.async, then read back
        lds = [i for i in loop_instructions(sass, inner=True) if i.split()[0].split(".")[0] in ("LDS", "LDSM")]
        assert ops["LDG"] == 0 and ops["LDGSTS"] == 3 * proj and len(lds) == 3 * proj, ops  # not "@!PT LDS": a no-op
        assert ops["STS"] == 0 and ops["STSM"] == 0 and ops["BAR"] <= 2, ops
    else:
        assert ops["LDG"] == 3 * proj  # per projection and tile: the words (2 x 16 B) and one scale word
        assert ops["LDS"] == 0 and ops["LDSM"] == 0 and ops["STS"] == 0 and ops["STSM"] == 0 and ops["BAR"] == 0
    assert ops["SHFL"] == 8 * proj  # the quad's four scale words, two registers each
    moves = [i for i in loop_instructions(sass, inner=True) if i.split()[0] in ("MOV", "IMAD.MOV.U32")]
    assert len(moves) <= proj, moves  # 0-2 a loop; rotated buffers copied 9 registers a projection and tile


@pytest.mark.skipif(w4a16_regs.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("ahead,block_m,l2_ahead,ring,cols", COMPILED)
@pytest.mark.parametrize("k,swiglu", SHAPES)
def test_compiles_for_sm90(sm90_builds, k, swiglu, ahead, block_m, l2_ahead, ring, cols):
    """Both engine builds (gate_up: K 2048, SwiGLU; down: K 512, row scale) compile for sm_90 offline -- which
    includes the kernel's `assert_trivial` conversion of the decoded words to the A fragment -- with no spills, and
    the K loop (AHEAD tiles a trip) loads each thread's weight words and its one scale word from global memory,
    shares the scales within each quad by shuffles and touches shared memory only as the wgmma's B operand (no LDS /
    STS / barrier), copies no rotated buffers at AHEAD 2 (at most one register move a projection and tile), and no
    instruction writes a register an in-flight wgmma still reads
    (`sass_loop.writes_into_in_flight_a_registers`); with a RING the words and scale words come by cp.async (LDGSTS)
    and back by LDS instead, with the hazard analysis' 2 barriers a tile. The activations' fill is one run of
    cp.async with no barrier between them. With USE_PDL its PTX waits for the predecessor grid before any global
    memory access (tests/test_pdl.py checks the source's order)."""
    import collections

    from benchmarks.sass_loop import (_unpredicated, instructions, loop_instructions, loop_opcodes,
                                      writes_into_in_flight_a_registers)

    tag = f"{k}-{swiglu}-{ahead}-{block_m}-{l2_ahead}-{ring}-{cols}"
    sass = (sm90_builds / f"{tag}.sass").read_text()
    proj = (2 if swiglu else 1) * ahead  # projections x K tiles a trip
    assert writes_into_in_flight_a_registers(sass, whole=True) == 0
    if k // 128 * cols == ahead:  # the whole stream loaded up front (down at AHEAD 4): one trip, no K loop
        with pytest.raises(RuntimeError, match="found 0 backward"):
            loop_instructions(sass)
        ops = collections.Counter(_unpredicated(i).split()[0].split(".")[0] for _, i in instructions(sass))
        assert ops["HGMMA"] == 8 * proj and ops["SHFL"] == 8 * proj, ops
        # the words and scale words once (the trip's dead reloads dropped), + the ids, pairs, global and row scales
        assert 3 * proj <= ops["LDG"] <= 3 * proj + 8, ops
    else:
        ops = loop_opcodes(sass, inner=True)  # the K loop (inside the column tiles' loop when COLS > 1)
        # the ptxas hazard of w4a16_swapped's SETTLE comment: no register of an in-flight wgmma's A operand written
        assert writes_into_in_flight_a_registers(sass, inner=True) == 0
        _loop_checks(sass, ops, proj, ring)
    fill = sass[:sass.index("LDGDEPBAR")]  # the activations' cp.async run, then its one wait
    ldgsts = [i for i, line in enumerate(fill.splitlines()) if "LDGSTS" in line]
    assert len(ldgsts) == block_m * k // 1024  # [BLOCK_M, K] bf16 over 128 threads, 16 B (8 values) a copy
    assert "BAR" not in "\n".join(fill.splitlines()[ldgsts[0]:ldgsts[-1]])
    ptx = (sm90_builds / f"{tag}-True.ptx").read_text()  # with PDL: wait, then launch_dependents, before the first
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")  # memory access
    first = min(ptx.find(op) for op in ("ld.global", "ld.relaxed.gpu.global", "st.global", "cp.async", "prefetch.")
                if op in ptx)  # any load, store, copy or prefetch
    assert 0 <= wait < launch < first, (wait, launch, first)
    assert "griddepcontrol" not in (sm90_builds / f"{tag}-False.ptx").read_text()  # without it: nothing
    res = (sm90_builds / f"{tag}.res").read_text()
    assert "STACK:0" in res, res


@pytest.mark.skipif(w4a16_regs.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("ahead,block_m,l2_ahead,ring,cols,early", EARLY_COMPILED)
def test_early_builds_wait_before_the_activations(sm90_builds, ahead, block_m, l2_ahead, ring, cols, early):
    """EARLY's contract (the down projection: K 512, row scale) with PDL: the routing (relaxed gpu-scope loads, from
    L2) and the first AHEAD tiles' words (2 x 16 B a thread and tile) are loaded before `griddepcontrol.wait` --
    in the PTX and in the SASS ptxas scheduled (ACQBULK is the wait) --, but no store and no cp.async (the
    activations' fill: the predecessor's output); the wait comes before launch_dependents; without PDL neither is
    there. And the build is the same kernel otherwise: as many wgmmas and no spills."""
    tag = f"512-False-{ahead}-{block_m}-{l2_ahead}-{ring}-{cols}-early"
    ptx = (sm90_builds / f"{tag}-True.ptx").read_text()
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert 0 <= wait < launch, (wait, launch)
    before = ptx[:wait]
    assert before.count("ld.global.v4") == 2 * ahead, before  # the point of EARLY: the weights before the wait
    assert before.count("ld.relaxed.gpu") >= 2  # the block's expert and pairs
    assert all(op not in before for op in ("st.global", "cp.async.ca", "cp.async.cg", "st.shared", "atom.")), before
    lines = (sm90_builds / f"{tag}-pdl.sass").read_text().splitlines()
    acq = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
    assert sum("LDG.E.128" in line for line in lines[:acq]) == 2 * ahead
    assert not any(op in line for line in lines[:acq] for op in ("LDGSTS", "STG", "STS", "ATOM")), lines[:acq]
    assert "griddepcontrol" not in (sm90_builds / f"{tag}-False.ptx").read_text()
    plain = tag.removesuffix("-early")  # the same build without EARLY (in COMPILED)
    assert (sm90_builds / f"{tag}.sass").read_text().count("HGMMA") == (
        sm90_builds / f"{plain}.sass").read_text().count("HGMMA")
    assert "STACK:0" in (sm90_builds / f"{tag}.res").read_text()


@pytest.mark.skipif(w4a16_regs.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("ahead,block_m,l2_ahead,ring,cols,early,cols_first", COLS_FIRST_COMPILED)
@pytest.mark.parametrize("k,swiglu", SHAPES)
def test_cols_first_swaps_only_the_program_ids(sm90_builds, k, swiglu, ahead, block_m, l2_ahead, ring, cols, early,
                                               cols_first):
    """cols_first (the grid in column order: the routing's empty row blocks dispatched last) is the same kernel with
    the two program ids swapped: its PTX reads the row block from %ctaid.y and the column tile from %ctaid.x, as often
    as the default build reads them the other way round, and its K loop does the default build's work (the same
    wgmmas, loads, shuffles and decode instructions, `_loop_checks`) with at most a few moves more and no spill.
    ptxas schedules the two a little differently (it knows %ctaid.y < 65,536): the shipped builds' loops come out
    identical, down without the L2 prefetch has 2 uniform moves and 4 registers more (Triton 3.8's ptxas)."""
    import collections

    from benchmarks.sass_loop import loop_instructions

    tag = f"{k}-{swiglu}-{ahead}-{block_m}-{l2_ahead}-{ring}-{cols}"
    for pdl in (False, True):
        plain = (sm90_builds / f"{tag}-{pdl}.ptx").read_text()
        first = (sm90_builds / f"{tag}-colsfirst-{pdl}.ptx").read_text()
        assert (first.count("%ctaid.x"), first.count("%ctaid.y")) == (plain.count("%ctaid.y"), plain.count("%ctaid.x"))
        assert plain.count("%ctaid.y") >= 1
    sass = {t: (sm90_builds / f"{t}.sass").read_text() for t in (tag, f"{tag}-colsfirst")}
    loops = {t: collections.Counter(i.split()[0].split(".")[0] for i in loop_instructions(v, inner=True))
             for t, v in sass.items()}
    a, b = loops[tag], loops[f"{tag}-colsfirst"]
    for op in ("HGMMA", "LDG", "SHFL", "HMUL2", "LOP3", "WARPGROUP"):
        assert a[op] == b[op], (op, a, b)
    assert sum(a.values()) <= sum(b.values()) <= sum(a.values()) + 4, (a, b)
    _loop_checks(sass[f"{tag}-colsfirst"], b, (2 if swiglu else 1) * ahead, ring)
    regs = [int((sm90_builds / f"{t}.res").read_text().split("REG:")[1].split()[0]) for t in sass]
    assert regs[0] <= regs[1] <= regs[0] + 8, regs
    assert "STACK:0" in (sm90_builds / f"{tag}-colsfirst.res").read_text()


@pytest.mark.skipif(w4a16_regs.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("ahead,block_m,l2_ahead,ring,cols,early,cols_first,mma_v2", MMA_V2_COMPILED)
@pytest.mark.parametrize("k,swiglu", SHAPES)
def test_mma_v2_builds(sm90_builds, k, swiglu, ahead, block_m, l2_ahead, ring, cols, early, cols_first, mma_v2):
    """`mma_v2` (the products on mma.sync m16n8k16) compiles for sm_90 offline -- the decoded words ARE its A fragment
    (the kernel's `assert_trivial` conversion, the same registers as wgmma's) -- with no spill, no wgmma, and per
    projection and K tile 8 x BLOCK_M / 8 HMMA, the words and scale word loaded once (3 LDG), 8 shuffles, the
    activations' fragments by ldmatrix (gate and up share them) and no barrier; and, at the engine's 8-row blocks, with
    fewer registers than the wgmma build of the same AHEAD (none is held by an asynchronous MMA): the point of the
    option."""
    import collections

    from benchmarks.sass_loop import _unpredicated, instructions, loop_opcodes

    tag = f"{k}-{swiglu}-{ahead}-{block_m}-{l2_ahead}-{ring}-{cols}"
    sass = (sm90_builds / f"{tag}-mmav2.sass").read_text()
    proj = (2 if swiglu else 1) * ahead  # projections x K tiles a trip
    if k // 128 == ahead:  # the whole stream up front (down at AHEAD 4): no K loop, count the kernel
        ops = collections.Counter(_unpredicated(i).split()[0].split(".")[0] for _, i in instructions(sass))
        assert 3 * proj <= ops["LDG"] <= 3 * proj + 8, ops
    else:
        ops = loop_opcodes(sass, inner=True)
        # two trips (K tiles = 2 AHEAD): the second buffer's reload is tile KT - 1 in both (clamped), which the
        # compiler hoists out of the loop here (not in the wgmma build)
        hoisted = k // 128 == 2 * ahead and ops["LDG"] == 3 * proj // 2
        assert (ops["LDG"] == 3 * proj or hoisted) and ops["BAR"] == 0 and ops["STS"] == 0, ops
    assert ops["HGMMA"] == 0 and ops["HMMA"] == 8 * proj * block_m // 8, ops
    assert ops["SHFL"] == 8 * proj and ops["LDSM"] >= 1, ops
    regs = {t: int((sm90_builds / f"{t}.res").read_text().split("REG:")[1].split()[0]) for t in (tag, f"{tag}-mmav2")}
    if block_m == 8:  # the engine's row blocks (16-row ones hold two B fragments a k step: 130 against 128)
        assert regs[f"{tag}-mmav2"] < regs[tag], regs
    assert "STACK:0" in (sm90_builds / f"{tag}-mmav2.res").read_text()
    ptx = (sm90_builds / f"{tag}-mmav2-True.ptx").read_text()  # PDL: the wait before any memory access
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= wait < min(ptx.find(op) for op in ("ld.global", "cp.async", "st.global") if op in ptx)


# ---- GPU (sm_90) ----------------------------------------------------------------------------------------------------
def _case(t, top_k, e, n, k, swiglu, seed, block_m=w4a16_regs.BLOCK_M, device="cuda"):
    """Random NVFP4 experts (per-row global scales), a routing of t tokens' top_k over e experts and its alignment at
    block_m-row blocks, activations (x per token with SwiGLU, per pair without) and row scales (without SwiGLU), on
    `device`."""
    from kernels.w4a16_gemm import moe_align

    g = torch.Generator().manual_seed(seed)
    w = quantize_nvfp4(torch.randn(e, n, k, generator=g) * 0.02)
    w = NVFP4Tensor(w.packed, w.scales, w.global_scale * (0.5 + torch.rand(e, n, generator=g)))
    idx = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)])
    a_div = top_k if swiglu else 1
    x = torch.randn(t * top_k // a_div, k, generator=g).to(torch.bfloat16)
    rs = None if swiglu else torch.rand(t * top_k, generator=g)
    w, x, idx = NVFP4Tensor(*(v.to(device) for v in w)), x.to(device), idx.to(device)
    return w, idx, x, None if rs is None else rs.to(device), a_div, moe_align(idx, e, block_m)


GPU_CASES = [(t, swiglu, k, *build)  # (tokens, SwiGLU, K) x (ahead, block_m, l2_ahead, ring, cols): AHEAD divides
             for t, swiglu, k in ((1, True, 256), (32, True, 2048), (32, False, 512), (7, False, 128))  # 2+ K tiles
             for build in ((1, 16, 0, 0, 1), (2, 16, 0, 0, 1), (2, 16, 4, 0, 1), (1, 8, 0, 0, 1), (2, 8, 2, 0, 1),
                           (1, 16, 0, 4, 1), (1, 8, 0, 2, 1), (2, 16, 4, 0, 2), (1, 8, 0, 4, 2), (1, 16, 0, 0, 4),
                           (4, 8, 0, 0, 1), (4, 16, 8, 0, 2), (4, 8, 0, 0, 4))
             if k // 128 % build[0] == 0 and (build[4] <= 2 or not swiglu)]  # N_out: 128 with SwiGLU, else 256


@pytest.mark.skipif(not SM90 or w4a16_regs.gluon is None, reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("t,swiglu,k,ahead,block_m,l2_ahead,ring,cols", GPU_CASES)
def test_matches_reference_and_swapped_kernel(t, swiglu, k, ahead, block_m, l2_ahead, ring, cols):
    from kernels.w4a16_gemm import w4a16_grouped_reference
    from kernels.w4a16_swapped import split_frag, w4a16_grouped_swapped_launch

    w, idx, x, rs, a_div, routing = _case(t, 8, 16, 256, k, swiglu, seed=11 + t, block_m=block_m)
    y = w4a16_regs.w4a16_regs_launch(x, thread_order(w.packed), w.scales, w.global_scale, routing, a_div=a_div,
                                     swiglu=swiglu, row_scale=rs, ahead=ahead, l2_ahead=l2_ahead, ring=ring,
                                     cols=cols)
    ref = w4a16_grouped_reference(x.float(), w, idx.reshape(-1), a_div=a_div, row_scale=rs, swiglu=swiglu)
    err = (y.float() - ref).abs()
    assert bool((err <= 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()).all()), float(err.max())
    if block_m == 16:  # the swap-AB kernel's routing: the same products in the same wgmma K order
        old = w4a16_grouped_swapped_launch(x, split_frag(w.packed, 64, 128), w.scales, w.global_scale, routing,
                                           a_div=a_div, swiglu=swiglu, row_scale=rs, frag=True)
        assert torch.equal(y, old)


@pytest.mark.skipif(not SM90 or w4a16_regs.gluon is None, reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("t,swiglu,k,ahead,block_m,l2_ahead,cols",
                         [(t, sw, k, *b) for t, sw, k in ((1, True, 256), (32, True, 2048), (32, False, 512),
                                                          (7, False, 128))
                          for b in ((1, 8, 0, 1), (2, 8, 0, 1), (4, 8, 0, 1), (2, 16, 0, 1), (2, 8, 2, 1),
                                    (1, 8, 0, 2)) if k // 128 % b[0] == 0])
def test_mma_v2_matches_reference_and_wgmma_build(t, swiglu, k, ahead, block_m, l2_ahead, cols):
    """`mma_v2` (the products on mma.sync, m16n8k16): within the reference's tolerance, as the wgmma build is, and
    within one bf16 rounding of the wgmma build's output on the same routing (the same exact products, summed 16 K at
    a time in the same order; whether the two MMA units round a 16-product step alike is the GPU's to say, so
    equality is not asserted but counted by the per-call bench, `swapped_ab.py` equal_to_swapped)."""
    from kernels.w4a16_gemm import w4a16_grouped_reference

    w, idx, x, rs, a_div, routing = _case(t, 8, 16, 256, k, swiglu, seed=31 + t, block_m=block_m)
    args = (x, thread_order(w.packed), w.scales, w.global_scale, routing)
    kw = dict(a_div=a_div, swiglu=swiglu, row_scale=rs, ahead=ahead, l2_ahead=l2_ahead, cols=cols)
    y = w4a16_regs.w4a16_regs_launch(*args, **kw, mma_v2=True)
    ref = w4a16_grouped_reference(x.float(), w, idx.reshape(-1), a_div=a_div, row_scale=rs, swiglu=swiglu)
    err = (y.float() - ref).abs()
    assert bool((err <= 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()).all()), float(err.max())
    base = w4a16_regs.w4a16_regs_launch(*args, **kw).float()
    assert bool(((y.float() - base).abs() <= 2.0**-8 * base.abs() + 1e-6 * base.abs().max()).all())


def test_mma_v2_refuses_a_ring():
    """mma_v2 has no ring build: refused before any launch (also without a GPU: the checks come first)."""
    w, idx, x, rs, a_div, routing = _case(4, 8, 16, 256, 256, False, seed=3, device="cpu")
    if w4a16_regs.gluon is None:
        pytest.skip("this Triton has no Gluon: the launcher refuses everything")
    with pytest.raises(ValueError, match="mma_v2 has no ring"):
        w4a16_regs.w4a16_regs_launch(x, thread_order(w.packed), w.scales, w.global_scale, routing, row_scale=rs,
                                     ahead=1, ring=4, mma_v2=True)


@pytest.mark.skipif(not SM90 or w4a16_regs.gluon is None, reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("swiglu,k,build", [(True, 2048, dict(ahead=2)), (False, 512, dict(ahead=2, l2_ahead=4)),
                                            (False, 512, dict(ahead=4, cols=4))])
def test_cols_first_same_bits(swiglu, k, build):
    """The grid in column order (`cols_first`) runs the same programs: bit for bit the default order's output, at 32
    tokens over 64 experts of the engine's widths (some of the 8-row blocks are the routing's empty ones)."""
    w, idx, x, rs, a_div, routing = _case(32, 8, 64, 1024 if swiglu else 2048, k, swiglu, seed=5, block_m=8)
    args = (x, thread_order(w.packed), w.scales, w.global_scale, routing)
    kw = dict(a_div=a_div, swiglu=swiglu, row_scale=rs, **build)
    assert int((routing.block_expert == 64).sum()) > 0  # the empty row blocks cols_first dispatches last
    assert torch.equal(w4a16_regs.w4a16_regs_launch(*args, **kw, cols_first=True),
                       w4a16_regs.w4a16_regs_launch(*args, **kw))


@pytest.mark.skipif(not SM90 or w4a16_regs.gluon is None, reason="the Gluon kernel needs an sm_90 GPU")
def test_misaligned_activation_rows_are_copied_first():
    """Rows of x that are not 16-byte aligned (a column slice of a wider tensor; a one-row view with an odd stride)
    are copied to aligned rows before the launch (the cp.async fill copies 16 bytes) and give the same result."""
    w, idx, x, rs, a_div, routing = _case(5, 8, 16, 256, 512, False, seed=21)
    wide = torch.zeros(x.shape[0], 512 + 4, dtype=x.dtype, device=x.device)  # rows 8 bytes off, stride 516
    wide[:, 4:] = x
    y = w4a16_regs.w4a16_regs_launch(x, thread_order(w.packed), w.scales, w.global_scale, routing, row_scale=rs)
    y_view = w4a16_regs.w4a16_regs_launch(wide[:, 4:], thread_order(w.packed), w.scales, w.global_scale, routing,
                                          row_scale=rs)
    assert torch.equal(y, y_view)


# ---- the layout and the engine's copy (CPU) --------------------------------------------------------------------------
def test_regs_ok_names_where_the_kernel_runs(monkeypatch):
    from kernels import w4a16_gemm

    monkeypatch.setattr(w4a16_gemm, "_interpreted", lambda: False)
    ok = dict(device="cuda", capability=(9, 0), dtype=torch.bfloat16, k=2048, k_down=512)
    assert w4a16_regs.regs_ok(**ok) == (w4a16_regs.gluon is not None)
    for bad in (dict(device="cpu", capability=None), dict(capability=(8, 0)), dict(capability=(10, 0)),
                dict(dtype=torch.float16), dict(k=4096), dict(k_down=192), dict(k=384)):
        assert not w4a16_regs.regs_ok(**{**ok, **bad}), bad
    monkeypatch.setattr(w4a16_gemm, "_interpreted", lambda: True)  # Gluon has no interpreter
    assert not w4a16_regs.regs_ok(**ok)


def _experts(e=4, h=256, i=256, seed=7):
    from kernels.nvfp4 import quantize_nvfp4
    from qwen_engine.model.quantized import NVFP4Experts

    g = torch.Generator().manual_seed(seed)
    gu = quantize_nvfp4(torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.rand(e, generator=g) * 1e-3 + 1e-4)
    dn = quantize_nvfp4(torch.randn(e, h, i, generator=g) * 0.05, torch.rand(e, generator=g) * 1e-3 + 1e-4)
    return NVFP4Experts(gu, dn), NVFP4Experts(gu, dn)


@torch.no_grad()
def test_experts_regs_copy_serves_the_16_row_calls():
    """`NVFP4Experts.repack_regs`: calls of at most 16 pairs an expert (the swap-AB kernel's 16-row blocks) read the
    thread-order copy (layout THREAD_ORDER; on the CPU the op's reference serves it: bit for bit the reference on the
    checkpoint-layout stacks), larger calls the main stacks; the copy is not in the state_dict and `repack` drops it."""
    from kernels.w4a16_gemm import CHECKPOINT, SPLIT_FRAG, THREAD_ORDER, experts_repack, moe_experts_w4a16_reference

    plain, experts = _experts()
    assert experts.repack(SPLIT_FRAG) and experts.repack_regs() and experts.regs_copy
    w13, w2 = experts_repack(experts.gate_up_nvfp4, experts.down_nvfp4, SPLIT_FRAG, inverse=True)
    assert torch.equal(experts.regs_gate_up_packed, thread_order(w13.packed))
    assert torch.equal(experts.regs_down_packed, thread_order(w2.packed))
    assert set(experts.state_dict()) == set(plain.state_dict())
    assert experts._stacks(3, pairs=6)[2] == THREAD_ORDER  # 1.5 pairs an expert
    assert experts._stacks(40, pairs=64)[2] == THREAD_ORDER  # 16 an expert: still 16-row blocks
    assert experts._stacks(40, pairs=68)[2] == SPLIT_FRAG  # 17: the swap-AB kernel's 64-row blocks
    assert experts._stacks(3)[2] == SPLIT_FRAG  # no pair count given (the decode-MoE probe): the main stacks
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(3)])
    wts = torch.softmax(torch.randn(3, 2, generator=g), -1)
    want = moe_experts_w4a16_reference(x, plain.gate_up_nvfp4, plain.down_nvfp4, idx, wts.to(x.dtype))
    assert torch.equal(experts(x, idx, wts), want)
    assert experts.repack(CHECKPOINT) and not experts.regs_copy and not hasattr(experts, "regs_gate_up_packed")


def test_engine_expert_regs_option(caplog):
    """`QwenEngineConfig.expert_regs`: true, false or "auto" (the default); where the kernel cannot run (here: the
    CPU) true warns and holds no copy, "auto" holds none quietly; off drops a copy an earlier engine left on a shared
    model."""
    import logging

    import torch.nn as nn

    from qwen_engine.engine import QwenEngineConfig, set_expert_regs

    with pytest.raises(ValueError, match="expert_regs"):
        QwenEngineConfig(expert_regs="yes")
    assert QwenEngineConfig().expert_regs == "auto"
    _, experts = _experts()
    model = nn.ModuleList([experts])
    with caplog.at_level(logging.WARNING, logger="qwen_engine.engine"):
        assert set_expert_regs(model, "auto", torch.device("cpu"), torch.float32) == 0
    assert "expert_regs" not in caplog.text and not experts.regs_copy
    with caplog.at_level(logging.WARNING, logger="qwen_engine.engine"):
        assert set_expert_regs(model, True, torch.device("cpu"), torch.float32) == 0
    assert "does not run here" in caplog.text and not experts.regs_copy
    assert experts.repack_regs()  # as an earlier engine on a GPU would have
    assert set_expert_regs(model, False, torch.device("cpu"), torch.float32) == 0 and not experts.regs_copy


@pytest.mark.skipif(not SM90 or w4a16_regs.gluon is None, reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("ahead", [2, 4])
def test_early_down_after_gate_up_under_pdl(ahead):
    """The MoE's chain as the engine launches it under PDL: the Triton alignment (`moe_align_fast`, a PDL launch),
    gate_up, then down with EARLY (its routing and first weights loaded before its wait; the activations gate_up
    writes after it), 30 times over fresh routings and inputs: down's output bit for bit a plain (non-EARLY) down's
    on the same gate_up output, and within the reference's tolerance. (Whether the launches overlapped is not
    observed here; test_pdl.py's late-writer test shows that PDL launches do.)"""
    from kernels import pdl
    from kernels.w4a16_gemm import moe_align_fast, w4a16_grouped_reference

    g = torch.Generator().manual_seed(5)
    e, i_size, h_size, t = 16, 512, 1024, 32
    w13 = quantize_nvfp4(torch.randn(e, 2 * i_size, h_size, generator=g) * 0.02)
    w2 = quantize_nvfp4(torch.randn(e, h_size, i_size, generator=g) * 0.02)
    w13, w2 = NVFP4Tensor(*(v.cuda() for v in w13)), NVFP4Tensor(*(v.cuda() for v in w2))
    t13, t2 = thread_order(w13.packed), thread_order(w2.packed)
    was = pdl.enabled()
    pdl.set_enabled(True)
    try:
        for rep in range(30):
            idx = torch.stack([torch.randperm(e, generator=g)[:8] for _ in range(t)]).cuda()
            x = torch.randn(t, h_size, generator=g).to(torch.bfloat16).cuda()
            rs = torch.rand(t * 8, generator=g).cuda()
            routing = moe_align_fast(idx, e, 8)
            h = w4a16_regs.w4a16_regs_launch(x, t13, w13.scales, w13.global_scale, routing, a_div=8, swiglu=True)
            y = w4a16_regs.w4a16_regs_launch(h, t2, w2.scales, w2.global_scale, routing, row_scale=rs, ahead=ahead,
                                             early=True)
            torch.cuda.synchronize()
            plain = w4a16_regs.w4a16_regs_launch(h, t2, w2.scales, w2.global_scale, routing, row_scale=rs,
                                                 ahead=ahead)
            assert torch.equal(y, plain), rep
            ref = w4a16_grouped_reference(h.float(), w2, idx.reshape(-1), row_scale=rs)
            err = (y.float() - ref).abs()
            assert bool((err <= 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()).all()), (rep, float(err.max()))
    finally:
        pdl.set_enabled(was)
