"""Compile the Qwen engine's newest Triton kernels for an H200 (sm_90) on a machine without a GPU: Triton's NVIDIA
backend lowers them to PTX and assembles them with its bundled ptxas, which catches the errors the CPU interpreter
cannot (constexpr misuse, unsupported ops, type rules of compiled Triton). Run without TRITON_INTERPRET (the kernels
must be real JITFunctions); prints one line per kernel, exits 1 if any failed. Used by tests/test_kernels_compile.py.

    env -u TRITON_INTERPRET python tests/sm90_compile.py
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import fp8_quant, gdn_decode, gdn_prep, moe_align, moe_combine, moe_router, paged_attention, rms_norm  # noqa: E402,E501
from kernels import attn_prep, fp8_gemv, fp8_skinny, fp8_swapped, gdn_conv, w4a16_gemm, w4a16_gemv, w4a16_swapped  # noqa: E402
from kernels import gelu_fp8_quant, linear_gelu, moe_decode, router_align, w4a16_mma  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(name: str, kernel, types: dict[str, str], consts: dict, ptx_has: str | None = None,
                num_warps: int = 4, runtime: tuple[str, ...] = (), ttgir_check=None,
                divisible: tuple[str, ...] = (), num_stages: int = 3) -> bool:
    """types: pointer / float argument types by name (other non-constexpr args are i32); constexpr parameters with a
    default (USE_PDL) take it unless `consts` names them; `runtime`: parameters with a default compiled as arguments
    (pointers / i32 by `types`). `ptx_has`: text the PTX must contain; `ttgir_check(ttgir)`: None or what is wrong.
    `divisible`: arguments marked divisible by 16, as Triton's JIT specialises such pointers and ints at a launch
    (without it a 2-D load of a runtime row stride compiles to byte loads and no cp.async pipeline).
    Prints the kernel's registers per thread and stack frame bytes (where spills go) from the cubin."""
    params = inspect.signature(kernel.fn).parameters
    consts = {**{n: p.default for n, p in params.items()
                 if p.default is not inspect.Parameter.empty and n not in runtime}, **consts}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in params}
    try:
        names = list(params)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
        compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as exc:  # noqa: BLE001 - reported
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:2000]}")
        return False
    if ptx_has is not None and ptx_has not in compiled.asm["ptx"]:
        print(f"FAIL {name}: no {ptx_has!r} in its PTX")
        return False
    wrong = ttgir_check(compiled.asm["ttgir"]) if ttgir_check else None
    if wrong:
        print(f"FAIL {name}: {wrong}")
        return False
    print(f"ok   {name}{resources(compiled.asm['cubin'])}")
    if "USE_PDL" in params and not consts["USE_PDL"]:  # a PDL participant (kernels/pdl.py): also with USE_PDL
        if not pdl_order_ok(name, kernel, sig, {**consts, "USE_PDL": True}):
            return False
        if "EARLY" in params and not consts["EARLY"]:  # and with its early loads (kernels/pdl.py set_early)
            if not early_order_ok(name, kernel, sig, {**consts, "USE_PDL": True, "EARLY": True}):
                return False
            if "PREFETCH" in params and not consts["PREFETCH"] and not early_order_ok(  # both (weight_prefetch)
                    f"{name} PREFETCH", kernel, sig, {**consts, "USE_PDL": True, "EARLY": True, "PREFETCH": True}):
                return False
        if "PREFETCH" in params and not consts["PREFETCH"]:  # and with its weight prefetch before the wait
            return pdl_order_ok(name, kernel, sig, {**consts, "USE_PDL": True, "PREFETCH": True}, prefetch=True)
    return True


def _pdl_ptx(name: str, tag: str, kernel, sig: dict, consts: dict) -> tuple[str | None, int, int]:
    """(PTX, offset of griddepcontrol.wait, of launch_dependents) of the build, or (None, -1, -1) after printing why
    it did not compile."""
    try:
        ptx = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=TARGET).asm["ptx"]
    except Exception as exc:  # noqa: BLE001 - reported
        print(f"FAIL {name} {tag}: {type(exc).__name__}: {str(exc)[:2000]}")
        return None, -1, -1
    return ptx, ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")


def early_order_ok(name: str, kernel, sig: dict, consts: dict) -> bool:
    """A Triton kernel's EARLY build with USE_PDL (kernels/pdl.py set_early): griddepcontrol.wait, then
    launch_dependents, with global loads before them (the point: what the predecessor does not write) but no store,
    atomic or async copy (a store before the wait could overwrite what the predecessor still reads). Prints
    "early" and the count of global loads before the wait."""
    ptx, wait, launch = _pdl_ptx(name, "USE_PDL EARLY", kernel, sig, consts)
    if ptx is None:
        return False
    before = ptx[:max(wait, 0)]
    loads = len(re.findall(r"ld\.global", before))
    # (\b: not ld.sha-red.; the bulk L2 prefetch of PREFETCH builds moves nothing into memory)
    writes = re.findall(r"\b(?:st\.global|atom\.|red\.|cp\.async(?!\.bulk\.prefetch))", before)
    if not (0 <= wait < launch) or writes or loads == 0:
        print(f"FAIL {name} USE_PDL EARLY: griddepcontrol at {wait} / {launch}, {loads} global loads and "
              f"{len(writes)} writes before the wait")
        return False
    print(f"early {name}: {loads} global loads before the wait")
    return True


def frag_words_layout(ttgir: str) -> str | None:
    """None where every fragment-order decode asm (`w4a16_swapped._e2m1x2_bf16_frag_ptx`, mask 0x81C081C0) packs
    the 4 bytes `w4a16_swapped._word_elements` stores as one word: its input layout's first register bases [0, 0, 1]
    (the next byte) and [8, 0, 0] (row + 8). Else what differs."""
    layouts = dict(re.findall(r"^#(\w+) = (.*)$", ttgir, re.M))
    asm = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line and "0x81C081C0" in line]
    if not asm:
        return "no fragment-order decode asm in the TTGIR"
    for line in asm:
        name = re.search(r"tensor<[^>]*?, #(\w+)> ->", line).group(1)
        if not layouts.get(name, "").startswith("#ttg.linear<{register = [[0, 0, 1], [8, 0, 0], "):
            return f"the decode's words are not rows r, r + 8 x 2 bytes: #{name} = {layouts.get(name, '?')[:120]}"
    return None


def resources(cubin: bytes) -> str:
    """' (N registers, M spill bytes)' from the cubin (the bundled cuobjdump), or '' without it."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, spill = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return f" ({regs.group(1)} registers, stack {spill.group(1)} bytes)" if regs and spill else ""


PREFETCH_OP = "cp.async.bulk.prefetch.L2"  # kernels/pdl.py prefetch_l2: reads nothing into registers


def mma_lanes_ok(name: str, types: dict[str, str], consts: dict, warps: int) -> bool:
    """kernels/w4a16_mma.py's fragments assume element i of its 1-D [32 x warps] tensors lives in lane i % 32 of warp
    i // 32: every inline-asm operand and result of the compiled kernel (TTGIR) must have that layout
    (sizePerThread [1], threadsPerWarp [32], warpsPerCTA [warps]); Triton picks layouts, so a change there fails
    here instead of computing garbage on the GPU. Prints 'lanes' per build."""
    kernel = w4a16_mma._w4a16_mma_kernel
    params = inspect.signature(kernel.fn).parameters
    consts = {**{n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}, **consts}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in params}
    ttgir = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=TARGET,
                           options=dict(num_warps=warps)).asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    lane = f"#ttg.blocked<{{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [{warps}], order = [0]}}>"
    asm = [line for line in ttgir.splitlines() if "tt.elementwise_inline_asm" in line]
    used = {m.group(2) for line in asm for m in re.finditer(r"tensor<(\d+)x\w+, (#\w+)>", line)}
    sizes = {m.group(1) for line in asm for m in re.finditer(r"tensor<(\d+)x\w+, (#\w+)>", line)}
    if not asm or sizes != {str(32 * warps)} or any(layouts.get(u) != lane for u in used):
        print(f"FAIL {name}: inline-asm operands in {sorted(layouts.get(u, u) for u in used)}, sizes {sorted(sizes)}")
        return False
    print(f"lanes {name}: {len(asm)} inline-asm ops, one element a lane")
    return True


def pdl_order_ok(name: str, kernel, sig: dict, consts: dict, prefetch: bool = False) -> bool:
    """The kernel compiled with USE_PDL: griddepcontrol.wait, then launch_dependents, before its first global memory
    access (load, store, atomic, async copy; an L2 prefetch excepted) in the PTX. `prefetch` (compiled with PREFETCH
    too): prints "pf   " when the build prefetches before the wait, "pf-  " when it has nothing to prefetch there (a
    grouped GEMV: its experts come from the router's output; PREFETCH_NEXT's prefetches follow the wait)."""
    tag = "USE_PDL PREFETCH" if prefetch else "USE_PDL"
    ptx, wait, launch = _pdl_ptx(name, tag, kernel, sig, consts)
    if ptx is None:
        return False
    ops = ("ld.global", "st.global", "atom.", "red.", "cp.async")
    memory = [m.start() for m in re.finditer("|".join(re.escape(op) for op in ops), ptx)
              if not ptx.startswith(PREFETCH_OP, m.start())]
    if not (0 <= wait < launch and all(launch < i for i in memory)):
        print(f"FAIL {name} {tag}: griddepcontrol at {wait} / {launch}, first global memory access at "
              f"{min(memory, default=-1)}")
        return False
    if not prefetch:
        print(f"pdl  {name}")
        return True
    print(f"{'pf   ' if 0 <= ptx.find(PREFETCH_OP) < wait else 'pf-  '}{name}")
    return True


def main() -> int:
    print(f"triton {triton.__version__} from {Path(triton.__file__).parent}")
    ok = []
    for p in (256, 1024):  # the sorted one-program path at 32 tokens x top-8 and at its MAX_PAIRS
        ok.append(compile_one(f"moe_align sort ({p} pairs, 256 experts)", moe_align._moe_align_sort_kernel,
                              {"ids": "*i64", "sorted_pairs": "*i32", "block_expert": "*i32"},
                              dict(BLOCK_M=16, BLOCK_P=p)))
    # its multi-program path for prefill sizes (1,024 tokens x top-8: 32 chunks of 256 pairs, BLOCK_M 64)
    ints = {"ids": "*i64", "partial": "*i32", "starts": "*i32", "sorted_pairs": "*i32", "block_expert": "*i32"}
    ok.append(compile_one("moe_align count (chunks of 256 pairs, 256 experts)", moe_align._count_kernel, ints,
                          dict(CHUNK_G=256, SUB=32, BLOCK_E=256)))
    ok.append(compile_one("moe_align offsets (256 experts, BLOCK_M 64)", moe_align._offsets_kernel, ints,
                          dict(BLOCK_M=64, BLOCK_E=256, BLOCK_B=32)))
    ok.append(compile_one("moe_align scatter (chunks of 256 pairs)", moe_align._scatter_kernel, ints,
                          dict(CHUNK_G=256, SUB=32)))
    # the GDN decode step over pool rows with the gated norm + FP8 codes of its output (the last program of a head)
    ok.append(compile_one("gdn_decode_norm (Dk = Dv = 128, BLOCK_V = 16, bf16 norm, codes)",
                          gdn_decode._gdn_decode_norm_kernel,
                          {**{n: "*fp32" for n in ("q", "k", "v", "g", "beta", "pool", "o")}, "rows": "*i64",
                           "z": "*bf16", "w": "*bf16", "out": "*bf16", "codes": "*fp8e4nv", "s_in": "*fp32",
                           "counters": "*i32", "eps": "fp32"},
                          dict(BLOCK_K=128, BLOCK_V=16, BLOCK_D=128, ROUND_PRODUCT=True, ROUND_X=True, INTERPRET=False,
                               QUANT=True)))
    types = {n: "*bf16" for n in ("qkv", "pool", "w", "b", "a", "a_log", "dt_bias", "ba_out")}
    types.update({n: "*fp32" for n in ("q_out", "k_out", "v_out", "beta_out", "g_out")}, rows="*i64", q_scale="fp32")
    # b / a read, or computed from x and w_ba (gdn_decode_prep_ba: the engine's default); SPLIT_V: a k-head's work
    # over 1 + R programs (the engine's gdn_prep_split_v_rows)
    for ba, split in ((False, False), (True, False), (True, True)):
        ok.append(compile_one(f"gdn_prep (Dk = Dv = 128, r = 2, K = 4, bf16, BA={int(ba)}, SPLIT_V={int(split)})",
                              gdn_prep._gdn_prep_kernel, types,
                              dict(DK=128, DV=128, R=2, KM1=3, BLOCK_K=128, BLOCK_V=128, BLOCK_R=2, BLOCK_T=4,
                                   BA=ba, BLOCK_H=gdn_prep.BA_BLOCK_H, INTERPRET=False, SPLIT_V=split)))
    ok.append(compile_one("rms_norm_zc (D = 2048, bf16)", rms_norm._rms_norm_zc_kernel,
                          {"x": "*bf16", "w": "*bf16", "out": "*bf16", "eps": "fp32"},
                          dict(BLOCK_R=1, BLOCK_D=2048, INTERPRET=False)))
    ok.append(compile_one("add_rms_norm_zc (D = 2048, bf16)", rms_norm._add_rms_norm_zc_kernel,
                          {n: "*bf16" for n in ("x", "h", "w", "s_out", "out")} | {"eps": "fp32"},
                          dict(BLOCK_R=1, BLOCK_D=2048, INTERPRET=False)))
    ok.append(compile_one("rms_norm_gated (D = 128, fp32 x rounded to bf16)", rms_norm._rms_norm_gated_kernel,
                          {"x": "*fp32", "z": "*bf16", "w": "*bf16", "out": "*bf16", "eps": "fp32"},
                          dict(ROUND_PRODUCT=True, ROUND_X=True, BLOCK_R=8, BLOCK_D=128, INTERPRET=False)))
    # the FP8 projections' quantiser in the producing op (quantized.QUANT_IN_PRODUCERS): codes beside the output
    codes = {"codes": "*fp8e4nv", "s_in": "*fp32"}
    ok.append(compile_one("rms_norm_zc + e4m3 codes (D = 2048, bf16)", rms_norm._rms_norm_zc_kernel,
                          {"x": "*bf16", "w": "*bf16", "out": "*bf16", "eps": "fp32", **codes},
                          dict(BLOCK_R=1, BLOCK_D=2048, INTERPRET=False, QUANT=True)))
    ok.append(compile_one("rms_norm_gated + e4m3 codes (D = 128, fp32 x)", rms_norm._rms_norm_gated_kernel,
                          {"x": "*fp32", "z": "*bf16", "w": "*bf16", "out": "*bf16", "eps": "fp32", **codes},
                          dict(ROUND_PRODUCT=True, ROUND_X=True, BLOCK_R=8, BLOCK_D=128, INTERPRET=False, QUANT=True)))
    ok.append(compile_one("rms_norm_gated + e4m3 codes, z as [T, 32 heads] slices (D = 128, fp32 x)",
                          rms_norm._rms_norm_gated_kernel,
                          {"x": "*fp32", "z": "*bf16", "w": "*bf16", "out": "*bf16", "eps": "fp32", **codes},
                          dict(ROUND_PRODUCT=True, ROUND_X=True, BLOCK_R=8, BLOCK_D=128, INTERPRET=False, QUANT=True,
                               Z_HEADS=32), runtime=("s_zh",)))
    ok.append(compile_one("paged_decode (Dh = 256, GQA 8, bf16)", paged_attention._paged_decode_kernel,
                          {"q": "*bf16", "k_pool": "*bf16", "v_pool": "*bf16", "tables": "*i64", "ctx_lens": "*i64",
                           "o_part": "*fp32", "lse": "*fp32", "qk_scale": "fp32"},
                          dict(HEAD_DIM=256, BLOCK_G=16, BLOCK_N=32, IEEE=False, INTERPRET=False)))
    ok.append(compile_one("paged_decode on e4m3 pools (Dh = 256, GQA 8, bf16 q; kv_cache_dtype fp8)",
                          paged_attention._paged_decode_kernel,
                          {"q": "*bf16", "k_pool": "*fp8e4nv", "v_pool": "*fp8e4nv", "tables": "*i64",
                           "ctx_lens": "*i64", "o_part": "*fp32", "lse": "*fp32", "qk_scale": "fp32"},
                          dict(HEAD_DIM=256, BLOCK_G=16, BLOCK_N=32, IEEE=False, INTERPRET=False)))
    ok.append(compile_one("fp8_quant_static (bf16 -> e4m3, 1 x 1024 tile)", fp8_quant._quant_static_kernel,
                          {"x_ptr": "*bf16", "s_ptr": "*fp32", "q_ptr": "*fp8e4nv"},
                          dict(BLOCK_M=1, BLOCK_K=1024)))
    ok.append(compile_one("fp8_quant_rows (bf16 -> e4m3 + row scales, 1 x 8192 tile)", fp8_quant._quant_rows_kernel,
                          {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, dict(BLOCK_M=1, BLOCK_K=8192)))
    # the ViT fc2's input: the GELU, rounded to bf16, then the row-wise codes (kernels/gelu_fp8_quant.py)
    # (4,096 + 1,024 lanes a row, rounded by the cast alone: the PTX must hold the RNE, saturating fp32 -> e4m3 cvt)
    ok.append(compile_one("fp8_gelu_quant_rows (bf16 -> e4m3 + row scales, 4096 + 1024 tiles, cast-rounded)",
                          gelu_fp8_quant._gelu_quant_rows_kernel,
                          {"h_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                          dict(DTYPE=triton.language.bfloat16, INTERPRET=False, ROUND_IN_FP32=False, BLOCK_M=1,
                               BLOCK_HEAD=4096, BLOCK_TAIL=1024), ptx_has="cvt.rn.satfinite.e4m3x2.f32"))
    ok.append(compile_one("fp8_gelu_quant_rows max-first (one row in 1024-wide chunks, its largest input first)",
                          gelu_fp8_quant._gelu_quant_rows_max_first_kernel,
                          {"h_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                          dict(DTYPE=triton.language.bfloat16, INTERPRET=False, ROUND_IN_FP32=False, BLOCK_K=1024),
                          ptx_has="cvt.rn.satfinite.e4m3x2.f32"))
    # the ViT's fc1 + exact GELU (kernels/linear_gelu.py): TMA descriptors in, wgmma on the tensor cores
    ok.append(compile_one("linear_gelu (bf16, 128 x 256 x 64 tiles through TMA descriptors, erf GELU epilogue)",
                          linear_gelu._linear_gelu_kernel,
                          {"x_desc": "tensordesc<bf16[128,64]>", "w_desc": "tensordesc<bf16[256,64]>", "b_ptr": "*bf16",
                           "o_desc": "tensordesc<bf16[128,256]>"},
                          dict(HAS_BIAS=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, INTERPRET=False),
                          ptx_has="wgmma.mma_async"))
    ok.append(compile_one("linear_gelu persistent (132 programs walking the tiles, tile and K loops flattened)",
                          linear_gelu._linear_gelu_persistent_kernel,
                          {"x_desc": "tensordesc<bf16[128,64]>", "w_desc": "tensordesc<bf16[256,64]>", "b_ptr": "*bf16",
                           "o_desc": "tensordesc<bf16[128,256]>"},
                          dict(HAS_BIAS=True, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, INTERPRET=False,
                               NUM_PROGRAMS=132, FLATTEN=True), ptx_has="wgmma.mma_async"))
    ok.append(compile_one("moe_combine (H = 2048, bf16)", moe_combine._moe_combine_kernel,
                          {n: "*bf16" for n in ("x", "w", "shared", "routed", "residual", "out")},
                          dict(S=8, BLOCK_H=2048, INTERPRET=False)))
    ok.append(compile_one("moe_combine + the next layer's input norm and its e4m3 codes (H = 2048, bf16)",
                          moe_combine._moe_combine_kernel,
                          {**{n: "*bf16" for n in ("x", "w", "shared", "routed", "residual", "out", "nw", "normed")},
                           "eps": "fp32", "codes": "*fp8e4nv", "s_in": "*fp32"},
                          dict(S=8, BLOCK_H=2048, INTERPRET=False, NORM=True, QUANT=True), num_warps=8,
                          ptx_has="cvt.rn.satfinite.e4m3x2.f32"))
    ok.append(compile_one("moe_combine over partial rows (H = 2048, bf16, fp32 rows)",
                          moe_combine._moe_combine_parts_kernel,
                          {**{n: "*bf16" for n in ("x", "w", "residual", "out")}, "shared": "*fp32", "routed": "*fp32"},
                          dict(BLOCK_H=2048, BLOCK_C=moe_combine.PARTS_BLOCK_C, BLOCK_S=moe_combine.PARTS_BLOCK_S,
                               INTERPRET=False)))
    # the decode MoE in one launch (kernels/moe_decode.py): DEQ_WIDE and the byte path at the first config's tiles
    # (2026-12-02, every config of then: 182-245 registers, no stack; results/moe_decode_bench_run2/sm90_registers.txt)
    decode = {"x": "*bf16", "idx": "*i64", "rw": "*bf16", "hidden": "*fp32", "parts": "*fp32",
              **{n: "*u8" for n in ("w13", "s13", "w2", "s2", "sw13", "ss13", "sw2", "ss2")},
              **{n: "*fp32" for n in ("g13", "g2", "sg13", "sg2")}}
    for deq, cfg in ((3, moe_decode._CONFIGS[0]), (2, moe_decode._CONFIGS[0])):
        tiles = dict(cfg.kwargs)
        ok.append(compile_one(f"moe_decode DEQ={deq} {tiles} warps={cfg.num_warps}", moe_decode._moe_decode_kernel,
                              decode, dict(DEQ=deq, INTERPRET=False, **tiles), num_warps=cfg.num_warps))
    ok.append(compile_one("gdn_decode over pool rows (Dk = Dv = 128)", gdn_decode._gdn_decode_kernel,
                          {**{n: "*fp32" for n in ("q", "k", "v", "g", "beta", "s_in", "s_out", "o")}, "rows": "*i64"},
                          dict(BLOCK_K=128, BLOCK_V=32, HAS_ROWS=True)))
    ok.append(compile_one("gdn_decode over a bf16 pool's rows (Dk = Dv = 128; gdn_state_dtype bfloat16)",
                          gdn_decode._gdn_decode_kernel,
                          {**{n: "*fp32" for n in ("q", "k", "v", "g", "beta", "o")}, "s_in": "*bf16",
                           "s_out": "*bf16", "rows": "*i64"},
                          dict(BLOCK_K=128, BLOCK_V=32, HAS_ROWS=True), ptx_has="cvt.rn.bf16"))
    ok.append(compile_one("router_topk (E = 256, top-8, bf16)", moe_router._router_topk_kernel,
                          {"logits": "*bf16", "w_out": "*bf16", "i_out": "*i64"},
                          dict(K=8, BLOCK_K=8, BLOCK_R=1, BLOCK_E=256, INTERPRET=False)))
    # the router's GEMM at 5-64 rows (router_linear_topk): 32 rows x 16 experts x one 256-wide H tile on the tensor
    # cores, then the top-k over 8 partials with the shared pair's column
    ok.append(compile_one("router_parts (32 rows, 16 experts x 256 of H, bf16)", moe_router._router_parts_kernel,
                          {"x": "*bf16", "w": "*bf16", "ws": "*fp32"},
                          dict(BLOCK_R=32, BLOCK_E=16, BLOCK_H=256, INTERPRET=False)))
    ok.append(compile_one("router_parts_topk (E = 256, top-8, 8 partials, bf16) HAS_EXTRA",
                          moe_router._router_parts_topk_kernel,
                          {"ws": "*fp32", "logits": "*bf16", "w_out": "*bf16", "i_out": "*i64"},
                          dict(K=8, BLOCK_K=8, BLOCK_E=256, SPLIT=8, INTERPRET=False, HAS_EXTRA=True),
                          num_warps=1))
    ok.append(compile_one("router_topk (E = 256, top-8, bf16) HAS_EXTRA (the shared pair's column)",
                          moe_router._router_topk_kernel, {"logits": "*bf16", "w_out": "*bf16", "i_out": "*i64"},
                          dict(K=8, BLOCK_K=8, BLOCK_R=1, BLOCK_E=256, INTERPRET=False, HAS_EXTRA=True)))
    # the router's top-k with the routing alignment in its last program, at the 32-stream step's sizes (top-8 of 256
    # + the shared pair over 257 experts, 8-row blocks: the register-streamed experts'); atomics, popcounts, a scan;
    # one warp, as router_topk's tiling launches it at E = 256; in both forms of the last program (GATHER: register
    # gathers, opt-in; else the reload form, the default)
    for gather in (False, True):
        form = "GATHER" if gather else "reload"
        ok.append(compile_one(f"router_topk_align (N = 32, E = 256 + 1, top-8 + 1, 8-row blocks, bf16, 1 warp) {form}",
                              router_align._router_topk_align_kernel,
                              {"logits": "*bf16", "w_out": "*bf16", "i_out": "*i64", "member": "*i32",
                               "starts": "*i32", "counters": "*i32", "sorted_pairs": "*i32", "block_expert": "*i32"},
                              dict(K=8, KP=9, BLOCK_K=16, BLOCK_R=1, BLOCK_E=256, WORDS=1, BLOCK_NE=512,
                                   BLOCK_P=512, BLOCK_M=8, INTERPRET=False, GATHER=gather),
                              ptx_has="atom.global.gpu.relaxed.or.b32", num_warps=1))
        # the same over the router GEMM's fp32 partials (router_linear_topk_align: 8 H tiles summed, the logits
        # stored), at its 4 warps (router_align.PARTS_ALIGN_WARPS)
        ok.append(compile_one(f"router_linear_topk_align (N = 32, E = 256 + 1, 8 partials, 8-row blocks, bf16, 4 "
                              f"warps) {form}", router_align._router_topk_align_kernel,
                              {"logits": "*bf16", "w_out": "*bf16", "i_out": "*i64", "member": "*i32",
                               "starts": "*i32", "counters": "*i32", "sorted_pairs": "*i32", "block_expert": "*i32",
                               "ws": "*fp32"},
                              dict(K=8, KP=9, BLOCK_K=16, BLOCK_R=1, BLOCK_E=256, WORDS=1, BLOCK_NE=512,
                                   BLOCK_P=512, BLOCK_M=8, INTERPRET=False, SPLIT=8, GATHER=gather),
                              ptx_has="atom.global.gpu.relaxed.or.b32", num_warps=4, runtime=("ws",)))
    # and its largest launch over the partials (64 tokens x 9 pairs: 1,024 pairs, two member words), which
    # `gather_fits` keeps in the reload form
    ok.append(compile_one("router_linear_topk_align (N = 64, 1,024 pairs, 2 words, 4 warps) reload",
                          router_align._router_topk_align_kernel,
                          {"logits": "*bf16", "w_out": "*bf16", "i_out": "*i64", "member": "*i32", "starts": "*i32",
                           "counters": "*i32", "sorted_pairs": "*i32", "block_expert": "*i32", "ws": "*fp32"},
                          dict(K=8, KP=9, BLOCK_K=16, BLOCK_R=1, BLOCK_E=256, WORDS=2, BLOCK_NE=512, BLOCK_P=1024,
                               BLOCK_M=8, INTERPRET=False, SPLIT=8, GATHER=False),
                          ptx_has="atom.global.gpu.relaxed.or.b32", num_warps=4, runtime=("ws",)))
    grouped = {n: t for n, t in (("x", "*bf16"), ("w", "*u8"), ("s", "*u8"), ("g", "*fp32"), ("rs", "*bf16"),
                                 ("y", "*bf16"), ("sorted_pairs", "*i32"), ("block_expert", "*i32"))}
    # the grouped W4A16 kernel (SwiGLU epilogue) at decode tiles, in each bf16 dequant mode (2: inline PTX, which only
    # a real compile checks) and scale look-ahead
    # (the fourth: the down projection's checkpoint-layout defaults, GROUPED_MODES[False])
    # and tile-major experts (`expert_layout` tile_major) (TILE_MAJOR_TILES / TILE_MAJOR_MODES: gate_up 32 x 128,
    # down 64 x 128, DEQ 2, scales 1 ahead), and its prefill programs over several stored tiles
    # (TILE_MAJOR_PREFILL: gate_up 64 wide over tiles of 32 rows, BLOCK_M 32)
    for bn, bk, deq, ahead, swiglu, tiled, tile_n, bm in (
            (32, 128, 2, 1, True, 0, 0, 16), (32, 128, 1, 2, True, 1, 32, 16), (64, 256, 2, 0, True, 0, 0, 16),
            (64, 128, 2, 2, False, 0, 0, 16), (32, 128, 2, 1, True, 1, 32, 16), (64, 128, 2, 1, False, 1, 64, 16),
            (64, 128, 2, 1, True, 1, 32, 32)):
        what = "SwiGLU" if swiglu else "routing weight"
        ok.append(compile_one(f"w4a16 grouped BLOCK_M={bm} BLOCK_N={bn} BLOCK_K={bk} DEQ={deq} SCALE_AHEAD={ahead} "
                              f"TILED={tiled} TILE_N={tile_n} ({what}, bf16)",
                              w4a16_gemm._w4a16_grouped_kernel.fn, grouped,
                              dict(SWIGLU=swiglu, HAS_ROW_SCALE=not swiglu, INTERPRET=False, BLOCK_M=bm, BLOCK_N=bn,
                                   BLOCK_K=bk, DEQ=deq, SCALE_AHEAD=ahead, TILED=tiled, TILE_N=tile_n)))
    # the swap-AB grouped kernel on split-halves experts (the engine's MoE path on CUDA): decode (BLOCK_M 16, SwiGLU)
    # and prefill (BLOCK_M 64, routing weight) programs, PTX dequant
    # (FRAG: the bytes in fragment order, `split_frag`, with its scale conversion; its words as the loader stores
    # them: `frag_words_layout`)
    for bm, swiglu, frag in ((16, True, False), (64, False, False), (16, True, True), (64, False, True)):
        what = "SwiGLU" if swiglu else "routing weight"
        ok.append(compile_one(f"w4a16 grouped swap-AB BLOCK_M={bm} BLOCK_N=64 BLOCK_K=128 DEQ=2 FRAG={int(frag)} "
                              f"({what}, bf16)", w4a16_swapped._w4a16_grouped_swapped_kernel, grouped,
                              dict(SWIGLU=swiglu, HAS_ROW_SCALE=not swiglu, INTERPRET=False, DEQ=2, TILE_N=64,
                                   BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, FRAG=frag),
                              ttgir_check=frag_words_layout if frag else None))
    # split K with the last arrival's in-kernel reduction (decode-sized calls; not run on a GPU yet)
    for swiglu in (True, False):
        what = "SwiGLU" if swiglu else "routing weight"
        ok.append(compile_one(f"w4a16 grouped swap-AB BLOCK_M=16 FRAG=1 SPLIT=4 ({what}, bf16)",
                              w4a16_swapped._w4a16_grouped_swapped_kernel,
                              {**grouped, "ws": "*fp32", "counters": "*i32"},
                              dict(SWIGLU=swiglu, HAS_ROW_SCALE=not swiglu, INTERPRET=False, DEQ=2, TILE_N=64,
                                   BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, FRAG=True, SPLIT=4),
                              ttgir_check=frag_words_layout))
    # the dense call on fragment-order bytes (lm_head, `dense_routing`: the rows computed in the kernel, DENSE)
    for bm in (16, 32, 64):
        ok.append(compile_one(f"w4a16 grouped swap-AB DENSE BLOCK_M={bm} FRAG=1 DEQ=2 (lm_head, bf16)",
                              w4a16_swapped._w4a16_grouped_swapped_kernel, grouped,
                              dict(SWIGLU=False, HAS_ROW_SCALE=False, INTERPRET=False, DEQ=2, TILE_N=64,
                                   BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, FRAG=True, DENSE=True),
                              ttgir_check=frag_words_layout))
    # the GDN prefill conv (a padded bucket: valid count read on the device), bf16
    ok.append(compile_one("gdn_prefill_conv (C = 8192, K = 4, valid on the device, bf16)",
                          gdn_conv._gdn_prefill_conv_kernel,
                          {"x": "*bf16", "pool": "*bf16", "w": "*bf16", "y": "*bf16", "valid": "*i64"},
                          dict(HAS_VALID=True, KM1=3, BLOCK_S=4, BLOCK_T=gdn_conv.BLOCK_T, BLOCK_C=gdn_conv.BLOCK_C,
                               INTERPRET=False)))
    # the dense W4A16 kernel: split K reduced in the kernel (arrival counter, acq_rel atomics, .cg loads) with the
    # shared expert's SwiGLU epilogue, the same without SwiGLU, and split K left to torch (REDUCE off)
    dense = {n: t for n, t in (("x", "*bf16"), ("w", "*u8"), ("s", "*u8"), ("g", "*fp32"), ("y", "*bf16"),
                               ("ws", "*fp32"), ("counters", "*i32"))}
    for split, reduce, swiglu in ((4, True, True), (4, True, False), (4, False, True)):
        ok.append(compile_one(f"w4a16 dense SPLIT_K={split} REDUCE={reduce} SWIGLU={swiglu} (bf16)",
                              w4a16_gemm._w4a16_dense_kernel.fn, dense,
                              dict(SPLIT_K=split, REDUCE=reduce, SWIGLU=swiglu, INTERPRET=False, DEQ=0,
                                   SCALE_AHEAD=0, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128)))
    ok.append(compile_one("paged attention split combine (Dh = 256, 66 splits)", paged_attention._combine_kernel,
                          {"o_part": "*fp32", "lse": "*fp32", "out": "*bf16"},
                          dict(HEAD_DIM=256, BLOCK_S=128, BLOCK_D=64, INTERPRET=False)))
    # with the output gate and o_proj's codes (paged_decode_attention_gated_fp8: attn_gate_in_combine)
    ok.append(compile_one("paged attention split combine + gate + codes (Dh = 256, 66 splits)",
                          paged_attention._combine_kernel,
                          {"o_part": "*fp32", "lse": "*fp32", "out": "*bf16", "gate": "*bf16", "codes": "*fp8e4nv",
                           "s_in": "*fp32"},
                          dict(HEAD_DIM=256, BLOCK_S=128, BLOCK_D=64, INTERPRET=False, GATE=True, QUANT=True),
                          runtime=("gate", "s_gd", "s_gh", "codes", "s_cd", "s_in")))
    ok.append(compile_one("attn_decode_prep (D = 256, RoPE 64, bf16)", attn_prep._attn_prep_kernel,
                          {**{n: "*bf16" for n in ("q", "k", "v", "wq", "wk", "cos", "sin", "k_pool", "v_pool",
                                                    "q_out")}, "slots": "*i64", "eps": "fp32"},
                          dict(BLOCK_D=256, INTERPRET=False)))
    ok.append(compile_one("attn_decode_prep into e4m3 pools (D = 256, RoPE 64, bf16; kv_cache_dtype fp8)",
                          attn_prep._attn_prep_kernel,
                          {**{n: "*bf16" for n in ("q", "k", "v", "wq", "wk", "cos", "sin", "q_out")},
                           "k_pool": "*fp8e4nv", "v_pool": "*fp8e4nv", "slots": "*i64", "eps": "fp32"},
                          dict(BLOCK_D=256, INTERPRET=False, KV_CODES=True)))
    ok.append(compile_one("attn_output_gate (D = 256, bf16)", attn_prep._gate_kernel,
                          {n: "*bf16" for n in ("o", "gate", "out")}, dict(BLOCK_D=256, INTERPRET=False)))
    ok.append(compile_one("attn_output_gate + e4m3 codes (D = 256, bf16)", attn_prep._gate_kernel,
                          {**{n: "*bf16" for n in ("o", "gate", "out")}, "codes": "*fp8e4nv", "s_in": "*fp32"},
                          dict(BLOCK_D=256, INTERPRET=False, QUANT=True)))
    # the decode FP8 linear: the static quantiser fused, CUDA-core products, split K reduced in the kernel (and no
    # split)
    skinny = {"x": "*bf16", "w": "*fp8e4nv", "s_in": "*fp32", "s_w": "*fp32", "y": "*bf16", "ws": "*fp32",
              "counters": "*i32"}
    for split in (4, 1):
        ok.append(compile_one(f"fp8_skinny SPLIT_K={split} BLOCK_M=1 BLOCK_N=32 BLOCK_K=256 (bf16)",
                              fp8_skinny._fp8_skinny_kernel, skinny,
                              dict(SPLIT_K=split, BLOCK_M=1, BLOCK_N=32, BLOCK_K=256)))
    # the few-row FP8 linear on the tensor cores (weights as the wgmma's M, e4m3 x e4m3, promoted every 128 products)
    swapped = {"q": "*fp8e4nv", "w": "*fp8e4nv", "s_in": "*fp32", "s_w": "*fp32", "y": "*bf16", "ws": "*fp32",
               "counters": "*i32"}
    for split, bm, even in ((4, 32, True), (1, 16, False), (1, 64, True)):
        ok.append(compile_one(f"fp8_swapped SPLIT={split} BLOCK_M={bm} BLOCK_N=64 BLOCK_K=128 EVEN={even} (bf16)",
                              fp8_swapped._fp8_swapped_kernel, swapped,
                              dict(SPLIT=split, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, EVEN=even, PROMOTE=128),
                              ptx_has=f"wgmma.mma_async.sync.aligned.m64n{bm}k32.f32.e4m3.e4m3", num_stages=4,
                              divisible=("q", "w", "s_in", "s_w", "y", "ws", "counters", "N", "K", "s_qm", "s_wn",
                                         "s_ym")))
    # the router GEMV + top-k in one launch (split H reduced in the kernel), at a lone decode row's tiling
    tiling = moe_router._gemv_tiling(1, 256, 2048)
    tiling.pop("num_warps")  # a launch option, not a constexpr (the offline compile keeps the default)
    ok.append(compile_one(f"router_gemv_topk N=1 E=256 H=2048 {tiling} (bf16)", moe_router._router_gemv_topk_kernel,
                          {"x": "*bf16", "w": "*bf16", "logits": "*bf16", "w_out": "*bf16", "i_out": "*i64",
                           "ws": "*fp32", "counters": "*i32"},
                          dict(K=8, BLOCK_K=8, REDUCE=True, BLOCK_EF=256, INTERPRET=False, **tiling)))
    # the decode W4A16 GEMV: grouped gate_up + SwiGLU (bf16, PTX dequant), grouped down x routing weight, dense fp16;
    # DEQ_WIDE (int32 words, fp32 weights out of PTX) for grouped gate_up and dense lm_head-style calls
    gemv = {"x": "*bf16", "w": "*u8", "s": "*u8", "g": "*fp32", "rs": "*bf16", "y": "*bf16", "pair_expert": "*i64"}
    for grouped, swiglu, dtype, deq in ((True, True, "bf16", 2), (True, False, "bf16", 2), (False, False, "fp16", 0),
                                        (True, True, "bf16", 3), (False, False, "bf16", 3), (False, True, "bf16", 3)):
        types = {**gemv, **({"x": "*fp16", "y": "*fp16", "rs": "*fp16"} if dtype == "fp16" else {})}
        ok.append(compile_one(f"w4a16_gemv GROUPED={grouped} SWIGLU={swiglu} DEQ={deq} BLOCK_N=8 BLOCK_K=512 ({dtype})",
                              w4a16_gemv._w4a16_gemv_kernel, types,
                              dict(GROUPED=grouped, SWIGLU=swiglu, HAS_ROW_SCALE=grouped and not swiglu, DEQ=deq,
                                   INTERPRET=False, BLOCK_N=8, BLOCK_K=512)))
    # the decode GEMV on the tensor cores (kernels/w4a16_mma.py): mma.sync in its PTX, its fragments' lane layout (at
    # 1, 2, 4, 8 and 16 warps: the autotuner's range)
    mma = {**gemv, "sorted_pairs": "*i32", "block_expert": "*i32"}
    for grouped, srt, swiglu, warps, chunks, even in (
            (True, False, True, 16, 1, True), (True, True, False, 4, 1, True), (False, False, False, 4, 2, False),
            (True, True, True, 8, 1, True), (True, False, False, 1, 4, True), (False, False, True, 2, 2, False)):
        name = f"w4a16_mma GROUPED={grouped} SORTED={srt} SWIGLU={swiglu} WARPS={warps} CHUNKS={chunks} EVEN={even}"
        consts = dict(GROUPED=grouped, SORTED=srt, SWIGLU=swiglu, HAS_ROW_SCALE=grouped and not swiglu,
                      INTERPRET=False, WARPS=warps, CHUNKS=chunks, EVEN=even)
        ok.append(compile_one(name, w4a16_mma._w4a16_mma_kernel, mma, consts,
                              ptx_has="mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", num_warps=warps))
        ok.append(mma_lanes_ok(name, mma, consts, warps))
    # the decode FP8 GEMV: on the quantiser's codes (the default; whole tiles and masked edges) and with the
    # quantiser's division in its loop
    for codes, even in ((True, True), (True, False), (False, True)):
        ok.append(compile_one(f"fp8_gemv X_CODES={codes} EVEN={even} BLOCK_N=4 BLOCK_K=512",
                              fp8_gemv._fp8_gemv_kernel,
                              {"x": "*fp8e4nv" if codes else "*bf16", "w": "*fp8e4nv", "s_in": "*fp32",
                               "s_w": "*fp32", "y": "*bf16"},
                              dict(X_CODES=codes, INTERPRET=False, EVEN=even, BLOCK_N=4, BLOCK_K=512)))
    # the greedy sampler's argmax (kernels/argmax_rows.py): bf16 rows, the engine's 64 slices of 1,024-value tiles
    from kernels import argmax_rows
    ok.append(compile_one("argmax_rows PROGRAMS=64 BLOCK=1024 (bf16)", argmax_rows._argmax_rows_kernel,
                          {"x": "*bf16", "part_v": "*fp32", "part_i": "*i32", "out": "*i64", "counters": "*i32"},
                          dict(PROGRAMS_=64, BLOCK_=1024)))
    # grouped gate_up prefetching the down projection's slabs of its experts (weight_prefetch: PREFETCH_NEXT)
    ok.append(compile_one("w4a16_gemv GROUPED SWIGLU DEQ=3 PREFETCH_NEXT BLOCK_N=4 BLOCK_K=512 (bf16)",
                          w4a16_gemv._w4a16_gemv_kernel, {**gemv, "nw": "i64", "ns": "i64"},
                          dict(GROUPED=True, SWIGLU=True, HAS_ROW_SCALE=False, DEQ=3, INTERPRET=False, BLOCK_N=4,
                               BLOCK_K=512, PREFETCH_NEXT=True), ptx_has="cp.async.bulk.prefetch.L2",
                          runtime=("nw", "ns", "s_nwe", "s_nse", "NEXT_W_BYTES", "NEXT_S_BYTES")))
    ok.append(compile_one("w4a16_mma GROUPED SWIGLU PREFETCH_NEXT WARPS=8 CHUNKS=1 (bf16)",
                          w4a16_mma._w4a16_mma_kernel, {**mma, "nw": "i64", "ns": "i64"},
                          dict(GROUPED=True, SORTED=False, SWIGLU=True, HAS_ROW_SCALE=False, INTERPRET=False, WARPS=8,
                               CHUNKS=1, EVEN=True, PREFETCH_NEXT=True), ptx_has="cp.async.bulk.prefetch.L2",
                          num_warps=8, runtime=("nw", "ns", "s_nwe", "s_nse", "NEXT_W_BYTES", "NEXT_S_BYTES")))
    # programmatic dependent launch (kernels/pdl.py): the GEMV and a norm with USE_PDL, griddepcontrol in their PTX
    ok.append(compile_one("w4a16_gemv DEQ=3 BLOCK_N=4 BLOCK_K=512 USE_PDL=1", w4a16_gemv._w4a16_gemv_kernel, gemv,
                          dict(GROUPED=False, SWIGLU=False, HAS_ROW_SCALE=False, DEQ=3, INTERPRET=False, BLOCK_N=4,
                               BLOCK_K=512, USE_PDL=True), ptx_has="griddepcontrol.wait"))
    ok.append(compile_one("rms_norm_zc (D = 2048, bf16) USE_PDL=1", rms_norm._rms_norm_zc_kernel,
                          {"x": "*bf16", "w": "*bf16", "out": "*bf16", "eps": "fp32"},
                          dict(BLOCK_R=1, BLOCK_D=2048, INTERPRET=False, USE_PDL=True),
                          ptx_has="griddepcontrol.launch_dependents"))
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
