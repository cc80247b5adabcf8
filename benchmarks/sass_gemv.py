"""SASS instructions per weight of the two decode GEMVs, from an offline sm_90 compile (no GPU needed): the CUDA-core
GEMV (`kernels/w4a16_gemv.py`, its K loop at the tiles the H200's autotuner picked) and the tensor-core one
(`kernels/w4a16_mma.py`, the whole kernel at one 128-weight chunk a warp, and its per-chunk cost from a build of four
chunks a warp). Compiled as `benchmarks/sass_loop.py` compiles (pointers and strides 16-divisible), disassembled with
the cuobjdump Triton bundles; opcodes counted.

    env -u TRITON_INTERPRET python benchmarks/sass_gemv.py [--opcodes]

(The numbers in benchmarks/RESULTS.md's thirty-third session came from Triton 3.8 here; the H200 runs 3.6, whose
counts for the GEMV were ~5% higher in the tenth session: compare within one Triton.)
"""

from __future__ import annotations

import argparse
import collections
import inspect
import sys
from pathlib import Path

import triton
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sass_loop  # noqa: E402
from kernels import w4a16_gemv, w4a16_mma  # noqa: E402

POINTERS = {"x": "*bf16", "w": "*u8", "s": "*u8", "g": "*fp32", "rs": "*bf16", "y": "*bf16", "pair_expert": "*i64",
            "sorted_pairs": "*i32", "block_expert": "*i32"}
ALIGNED = set(POINTERS) | {"N", "K", "s_xm", "s_we", "s_wn", "s_se", "s_sn", "s_ym"}
SKIP = ("nw", "ns", "s_nwe", "s_nse", "NEXT_W_BYTES", "NEXT_S_BYTES")  # the GEMV's optional prefetch arguments


def compiled(kernel, consts: dict, warps: int):
    params = inspect.signature(kernel.fn).parameters
    consts = {**{n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty
                 and n not in SKIP}, **consts}
    names = list(params)
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ALIGNED and n not in consts}
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                          target=sass_loop.TARGET, options=dict(num_warps=warps, num_stages=1))


def opcodes(instructions: list[str]) -> collections.Counter:
    return collections.Counter(sass_loop._unpredicated(t).split()[0].split(".")[0] for t in instructions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--opcodes", action="store_true", help="also the 12 most frequent opcodes")
    args = ap.parse_args()
    print(f"[sass_gemv] triton {triton.__version__}, sm_90")
    rows = []
    # the CUDA-core GEMV's K loop: (name, BLOCK_N, BLOCK_K, warps, SwiGLU, grouped)
    for name, bn, bk, w, sw, grouped in (("routed gate_up", 4, 512, 2, True, True),
                                         ("routed down", 4, 256, 1, False, True),
                                         ("shared gate_up", 4, 1024, 4, True, False)):
        c = compiled(w4a16_gemv._w4a16_gemv_kernel, dict(GROUPED=grouped, SWIGLU=sw, HAS_ROW_SCALE=grouped and not sw,
                                                         DEQ=w4a16_gemv.DEQ_WIDE, INTERPRET=False, BLOCK_N=bn,
                                                         BLOCK_K=bk), w)
        ops = opcodes(sass_loop.loop_instructions(sass_loop.sass_of(c)))
        weights = bn * bk * (2 if sw else 1) / (32 * w)  # a thread's weights per K tile
        rows.append((f"GEMV {name} (K loop, {bn} x {bk}, {w} warps)", sum(ops.values()), weights, ops))
    # the tensor-core GEMV: whole kernel at one chunk a warp, and per chunk (4 chunks a warp minus 1 chunk a warp)
    for name, sw in (("routed gate_up", True), ("routed down", False)):
        base = dict(GROUPED=True, SORTED=False, SWIGLU=sw, HAS_ROW_SCALE=not sw, INTERPRET=False, EVEN=True)
        one = opcodes([t for _, t in sass_loop.instructions(sass_loop.sass_of(
            compiled(w4a16_mma._w4a16_mma_kernel, dict(base, WARPS=4, CHUNKS=1), 4)))])
        four = opcodes([t for _, t in sass_loop.instructions(sass_loop.sass_of(
            compiled(w4a16_mma._w4a16_mma_kernel, dict(base, WARPS=4, CHUNKS=4), 4)))])
        per_chunk = 16 * w4a16_mma.CHUNK_K * (2 if sw else 1) / 32  # a lane's weights per chunk
        rows.append((f"MMA {name} (whole kernel, 1 chunk a warp)", sum(one.values()), per_chunk, one))
        rows.append((f"MMA {name} (per extra chunk)", sum(four.values()) - sum(one.values()), 3 * per_chunk,
                     four - one))
    for name, n, weights, ops in rows:
        print(f"[sass_gemv] {name:52s} {n:5d} instructions / {weights:4.0f} weights = {n / weights:5.2f} a weight; "
              f"HMMA {ops['HMMA']}, FFMA {ops['FFMA']}, BAR {ops['BAR']}")
        if args.opcodes:
            print("           ", ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))


if __name__ == "__main__":
    main()
