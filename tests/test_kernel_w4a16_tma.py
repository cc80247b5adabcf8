"""kernels/w4a16_tma.py: the TMA-ring expert kernel (Gluon, sm_90), the register-streamed kernel's weights moved to the
copy engine.

On the CPU: the launcher's errors, `fit_build` / `launch_build` for TMA builds, the shared-memory sum, and an offline
sm_90 compile of gate_up and down builds whose K loop is checked in SASS (per stage and projection one TMA of words and
one of scales, the words read by LDS.128, no global load of weights, 8 wgmma k-steps a K tile and projection; the
compile also proves the scales' relabelling trivial: `convert_layout(..., assert_trivial=True)`). On an sm_90 GPU: bit
for bit the register kernel's outputs (same decode, same wgmma K order) over shapes, builds and routings, and within
the exact-dequant tolerance of `w4a16_grouped_reference`. Gluon has no CPU interpreter."""

import pytest
import torch

from kernels import w4a16_regs, w4a16_tma
from kernels.nvfp4 import quantize_nvfp4
from kernels.w4a16_regs import fit_build, thread_order
from tests.test_kernel_w4a16_regs import _case  # experts, routing, activations (device: cuda unless asked)

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_gluon = pytest.mark.skipif(w4a16_regs.gluon is None, reason="this Triton has no Gluon")


def test_fit_build_fits_tma_builds():
    tma = dict(kernel="tma", tiles=4, stages=3, w_cols=256, cols=4)
    assert fit_build(tma, 2048, 512) == tma  # gate_up: 16 K tiles, 8 column tiles
    assert fit_build(tma, 512, 2048)["tiles"] == 4  # down: 4
    assert fit_build(tma, 256, 128) == {**tma, "tiles": 2, "cols": 2}  # the self-check's sample: 2 K tiles, 2 columns
    assert fit_build(tma, 128, 2048) == {}  # one K tile: the register kernel's defaults
    assert fit_build(dict(ahead=4), 256, 2048) == dict(ahead=2, cols=1)  # register builds as before


def test_smem_bytes_counts_the_rings_and_the_activations():
    # gate_up at 2 tiles x 4 stages, 8-row blocks: 4 x 2 x 2 x 4.5 KB rings + 32 barrier bytes + 32 KB activations
    assert w4a16_tma.smem_bytes(2048, 8, True, 2, 4) == 4 * 2 * 2 * 4608 + 32 + 8 * 2048 * 2
    assert w4a16_tma.smem_bytes(512, 8, False, 2, 2) == 2 * 2 * 4608 + 16 + 8 * 512 * 2


@needs_gluon
def test_launcher_refuses_what_it_cannot_run():
    w, idx, x, rs, a_div, routing = _case(4, 8, 16, 256, 512, False, seed=3, device="cpu")
    args = (x, thread_order(w.packed), w.scales, w.global_scale, routing)
    with pytest.raises(ValueError, match="tiles must be one of"):
        w4a16_tma.w4a16_tma_launch(*args, row_scale=rs, tiles=3)
    with pytest.raises(ValueError, match="tiles must be one of"):
        w4a16_tma.w4a16_tma_launch(*args, row_scale=rs, tiles=8)  # 4 K tiles: 8 does not divide them
    with pytest.raises(ValueError, match="stages must be one of"):
        w4a16_tma.w4a16_tma_launch(*args, row_scale=rs, stages=5)
    with pytest.raises(ValueError, match="w_cols must be"):
        w4a16_tma.w4a16_tma_launch(*args, row_scale=rs, w_cols=64)
    with pytest.raises(ValueError, match="cols must be"):
        w4a16_tma.w4a16_tma_launch(*args, row_scale=rs, cols=8)  # N_out 256: 4 column tiles
    # 16-row blocks at K 2048 (64 KB of activations) with 6 slots of 4 tiles (2 columns: 8 stages, none clamped away)
    bw, _, bx, _, b_div, b_routing = _case(4, 8, 4, 256, 2048, True, seed=4, block_m=16, device="cpu")
    with pytest.raises(ValueError, match="shared memory"):
        w4a16_tma.w4a16_tma_launch(bx, thread_order(bw.packed), bw.scales, bw.global_scale, b_routing, a_div=b_div,
                                   swiglu=True, tiles=4, stages=6, cols=2)
    with pytest.raises(ValueError, match="must be bf16"):
        w4a16_tma.w4a16_tma_launch(x.float(), *args[1:], row_scale=rs)
    with pytest.raises(ValueError, match="row_scale has"):
        w4a16_tma.w4a16_tma_launch(*args, row_scale=rs[:-1])


# (tiles, stages, block_m, w_cols, cols) compiled for sm_90 offline, at gate_up (K 2048, SwiGLU) and down (K 512)
COMPILED = [(2, 4, 8, 256, 1), (4, 2, 8, 256, 1), (2, 3, 8, 32, 1), (2, 2, 16, 256, 1), (2, 3, 8, 256, 2),
            (2, 4, 8, 256, 4)]
_SM90_SCRIPT = """
import inspect, json, sys
from pathlib import Path
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
sys.path.insert(0, "benchmarks")
from sass_loop import sass_of
from kernels import w4a16_regs, w4a16_tma
out, builds = Path(sys.argv[1]), json.loads(sys.argv[2])
kern = w4a16_tma._w4a16_tma_kernel
names = list(inspect.signature(kern.fn).parameters)
ptrs = {"x": "*bf16", "g": "*fp32", "rs": "*bf16", "y": "*bf16", "sorted_pairs": "*i32", "block_expert": "*i32"}
aligned = set(ptrs) | {"N", "s_xm", "s_ym"}  # 16-divisible at the engine's shapes, as the JIT marks them
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
for k, swiglu in ((2048, True), (512, False)):
    n = 1024 if swiglu else 2048
    for tiles, stages, block_m, w_cols, cols in builds:
        stages = min(stages, cols * (k // 128) // tiles)  # as the launcher allocates
        p = torch.zeros(2, n, k // 2, dtype=torch.uint8)
        s = torch.zeros(2, n, k // 16, dtype=torch.uint8)
        wd, sd = w4a16_tma._descriptors(p, s, tiles, w_cols)
        consts = dict(K=k, SWIGLU=swiglu, HAS_ROW_SCALE=not swiglu, BLOCK_M=block_m, TILES=tiles, STAGES=stages,
                      W_COLS=w_cols, COLS=cols, XS_STACK=w4a16_regs.stacked_tiles_layout(block_m, k // 128),
                      USE_PDL=True)
        sig = {nm: "constexpr" if nm in consts else ptrs.get(nm, "i32") for nm in names}
        sig["w_desc"], sig["s_desc"] = mangle_type(wd), mangle_type(sd)
        build = triton.compile(GluonASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        (out / f"{k}-{tiles}-{stages}-{block_m}-{w_cols}-{cols}.sass").write_text(sass_of(build))
"""


@pytest.fixture(scope="module")
def sm90_sass(tmp_path_factory):
    """COMPILED at both shapes compiled for sm_90 in a subprocess without TRITON_INTERPRET (as
    tests/test_kernel_w4a16_regs.py's fixture, for the same reason: an interpreted jit call earlier in the process
    leaves triton.language patched)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("tma_sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, str(out), json.dumps(COMPILED)],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                         timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@needs_gluon
@pytest.mark.parametrize("k", [2048, 512])
@pytest.mark.parametrize("tiles,stages,block_m,w_cols,cols", COMPILED)
def test_compiles_for_sm90_with_the_weights_on_tma(sm90_sass, k, tiles, stages, block_m, w_cols, cols):
    import collections
    import re

    from benchmarks.sass_loop import instructions

    stages = min(stages, cols * (k // 128) // tiles)
    text = (sm90_sass / f"{k}-{tiles}-{stages}-{block_m}-{w_cols}-{cols}.sass").read_text()
    ins = instructions(text)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+ ", "", t).split()[0].split(".")[0] for _, t in ins)
    proj = 2 if k == 2048 else 1
    # TMA: every stage's words and scales of each projection, issued in the prologue (min(stages, stages a program))
    # and in the loop's refill (when there are more stages than slots)
    ns = cols * (k // 128) // tiles  # stages a program streams
    assert ops["UTMALDG"] == 2 * proj * (stages + (ns > stages)), ops
    assert ops["HGMMA"] == 8 * proj * tiles, ops  # the stage's tiles unrolled: 8 k-steps each
    lds128 = [t for _, t in ins if re.sub(r"^@!?U?P\w+ ", "", t).startswith("LDS.128")]
    assert len(lds128) == 2 * proj * tiles  # each thread's two 16-byte runs of a tile's words
    # no global load of weights (their words were 16-byte loads): the routing (block expert, the pairs twice),
    # global scales, row scales only
    unpred = [re.sub(r"^@!?U?P\w+ ", "", t) for _, t in ins]
    assert not [t for t in unpred if t.startswith("LDG.") and ".128" in t.split()[0]] and ops["LDG"] <= 12, ops
    assert ops["LDGSTS"] >= 1 and ops["SHFL"] == 8 * proj * tiles, ops  # the activations' cp.async; scale shuffles


# ---- GPU (sm_90) ----------------------------------------------------------------------------------------------------
GPU_CASES = [(t, swiglu, k, n, tiles, stages, w_cols, block_m, cols)
             for t, swiglu, k, n in ((1, True, 2048, 1024), (32, True, 2048, 1024), (32, False, 512, 2048),
                                     (7, False, 256, 256), (5, True, 1024, 256))
             for tiles, stages, w_cols, block_m, cols in ((2, 2, 256, 8, 1), (2, 4, 256, 8, 1), (4, 3, 256, 8, 1),
                                                           (2, 3, 32, 8, 1), (2, 6, 256, 8, 1), (2, 2, 256, 16, 1),
                                                           (2, 3, 256, 8, 2), (2, 4, 256, 8, 4), (4, 2, 256, 8, 2))
             if k // 128 % tiles == 0 and (n // 2 if swiglu else n) % (64 * cols) == 0]


@pytest.mark.skipif(not SM90 or w4a16_regs.gluon is None, reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("t,swiglu,k,n,tiles,stages,w_cols,block_m,cols", GPU_CASES)
def test_same_bits_as_the_register_kernel(t, swiglu, k, n, tiles, stages, w_cols, block_m, cols):
    from kernels.w4a16_gemm import w4a16_grouped_reference

    w, idx, x, rs, a_div, routing = _case(t, 8, 64, n, k, swiglu, seed=7 + t + k, block_m=block_m)
    args = (x, thread_order(w.packed), w.scales, w.global_scale, routing)
    kw = dict(a_div=a_div, swiglu=swiglu, row_scale=rs)
    y = w4a16_tma.w4a16_tma_launch(*args, tiles=tiles, stages=stages, w_cols=w_cols, cols=cols, **kw)
    want = w4a16_regs.w4a16_regs_launch(*args, ahead=1, **kw)
    assert torch.equal(y, want), float((y.float() - want.float()).abs().max())
    ref = w4a16_grouped_reference(x.float(), w, idx.reshape(-1), a_div=a_div, row_scale=rs, swiglu=swiglu)
    err = (y.float() - ref).abs()
    assert bool((err <= 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()).all()), float(err.max())


@pytest.mark.skipif(not SM90 or w4a16_regs.gluon is None, reason="the Gluon kernel needs an sm_90 GPU")
def test_engine_op_takes_a_tma_build(monkeypatch):
    """`w4a16_moe_op`'s THREAD_ORDER branch with ENGINE_BUILDS naming TMA builds gives the register builds' bits."""
    from kernels.w4a16_gemm import THREAD_ORDER, w4a16_moe_op

    g = torch.Generator().manual_seed(9)
    w13 = quantize_nvfp4(torch.randn(32, 1024, 2048, generator=g) * 0.02)
    w2 = quantize_nvfp4(torch.randn(32, 2048, 512, generator=g) * 0.02)
    idx = torch.stack([torch.randperm(32, generator=g)[:8] for _ in range(12)]).cuda()
    wts = torch.rand(12, 8, generator=g).cuda()
    x = torch.randn(12, 2048, generator=g).to(torch.bfloat16).cuda()
    t13, t2 = (thread_order(w.packed).cuda() for w in (w13, w2))
    args = (x, t13, w13.scales.cuda(), w13.global_scale.cuda(), t2, w2.scales.cuda(), w2.global_scale.cuda(), idx,
            wts)
    want = w4a16_moe_op(*args, layout=THREAD_ORDER)
    monkeypatch.setattr(w4a16_regs, "ENGINE_BUILDS", {"gate_up": dict(kernel="tma", tiles=2, stages=4, cols=2),
                                                      "down": dict(kernel="tma", tiles=2, stages=2, cols=4)})
    assert torch.equal(w4a16_moe_op(*args, layout=THREAD_ORDER), want)
