"""Instructions per K tile of the swap-AB expert kernel's main loop, from an offline sm_90 compile (no GPU needed):
the cost model behind `kernels/w4a16_swapped.py`'s dequant changes. Each build is compiled as a launch would be --
pointers, K, N and the strides marked divisible by 16 (Triton's specialisation of 16-aligned arguments; without it
the loads are not vectorised and the loop is not pipelined at all) -- then the cubin is disassembled with the
cuobjdump Triton bundles, and the loop (the span of the one backward branch) is counted by opcode.

Use the device's Triton version for numbers comparable with it (the H200 image has 3.6: `python -m venv
--system-site-packages /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0`), outside the interpreter:

    env -u TRITON_INTERPRET /tmp/t36/bin/python benchmarks/sass_loop.py [--stages 3] [--opcodes]
"""

from __future__ import annotations

import argparse
import collections
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

from kernels import w4a16_swapped  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {"x": "*bf16", "w": "*u8", "s": "*u8", "g": "*fp32", "rs": "*bf16", "y": "*bf16", "sorted_pairs": "*i32",
            "block_expert": "*i32", "ws": "*fp32", "counters": "*i32"}
ALIGNED = set(POINTERS) | {"N", "K", "s_xm", "s_we", "s_se", "s_sn", "s_ym"}  # 16-divisible at the engine's shapes
# the kernel's constexprs per call kind (`w4a16_swapped.FRAG_KINDS`)
KIND_CONSTS = {"swiglu": dict(SWIGLU=True, HAS_ROW_SCALE=False, DENSE=False),
               "plain": dict(SWIGLU=False, HAS_ROW_SCALE=True, DENSE=False),
               "dense": dict(SWIGLU=False, HAS_ROW_SCALE=False, DENSE=True)}
# (name, kind, constexprs): the engine's builds (SPLIT_TILE 64 x 128, fragment order, the PTX dequant)
BUILDS = [(f"{what} BLOCK_M={bm}", kind, dict(KIND_CONSTS[kind], BLOCK_M=bm))
          for what, kind, bms in (("gate_up (SwiGLU)", "swiglu", (16, 64)), ("down (routing weight)", "plain", (16, 64)),
                                  ("lm_head (dense)", "dense", (16, 32)))
          for bm in bms]


def compiled(consts: dict, stages: int):
    """One build of the swap-AB kernel compiled for sm_90 as a launch would (Triton's CompiledKernel: .asm["ptx"],
    .asm["cubin"])."""
    kernel = w4a16_swapped._w4a16_grouped_swapped_kernel
    params = inspect.signature(kernel.fn).parameters
    consts = {**{n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty},
              **dict(INTERPRET=False, DEQ=2, TILE_N=64, BLOCK_N=64, BLOCK_K=128, FRAG=True, SETTLE=True), **consts}
    names = list(params)
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ALIGNED and n not in consts}
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                          options=dict(num_warps=4, num_stages=stages))


def sass(consts: dict, stages: int) -> str:
    """The cubin's SASS of one build of the swap-AB kernel."""
    return sass_of(compiled(consts, stages))


def sass_of(build) -> str:
    """A compiled kernel's SASS (the cuobjdump Triton bundles)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(build.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def instructions(text: str) -> list[tuple[int, str]]:
    """cuobjdump SASS text -> (address, instruction with its predicate) for every instruction."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in text.splitlines()) if m]


def _unpredicated(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+ ", "", ins)


def loop_instructions(text: str, inner: bool = False) -> list[str]:
    """The SASS instructions from a backward branch's target to the branch (the K loop), predicates kept. `inner`:
    of several loops, the shortest (the innermost of nested loops, e.g. the K loop inside a column loop)."""
    ins = instructions(text)
    back = [(int(m.group(1), 16), a) for a, t in ins
            if (m := re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", t)) and int(m.group(1), 16) < a]
    if inner and back:
        back = [min(back, key=lambda span: span[1] - span[0])]
    if len(back) != 1:
        raise RuntimeError(f"expected one loop, found {len(back)} backward branches")
    lo, hi = back[0]
    return [t for a, t in ins if lo <= a <= hi]


def loop_opcodes(text: str, inner: bool = False) -> collections.Counter:
    """Opcode counts of the K loop's instructions (`loop_instructions`)."""
    return collections.Counter(_unpredicated(t).split()[0].split(".")[0] for t in loop_instructions(text, inner))


# opcodes whose first operand is not a register they write
_NO_DEST = {"ST", "STG", "STS", "STSM", "BAR", "BRA", "HGMMA", "WARPGROUP", "LDGDEPBAR", "DEPBAR", "NOP", "EXIT", "RED",
            "ATOM", "ISETP", "FSETP", "HSETP2", "PLOP3", "LDGSTS", "SYNCS", "WARPSYNC", "FENCE", "MEMBAR", "CCTL"}


def _written_registers(ins: str) -> set[int]:
    """General registers an instruction writes: its first operand, widened by the access size."""
    op, _, rest = _unpredicated(ins).partition(" ")
    m = re.match(r"R(\d+)\b", rest.strip())
    if op.split(".")[0] in _NO_DEST or not m:
        return set()
    width = 4 if (".128" in op or op.endswith(".M88.4")) else 2 if (".64" in op or ".WIDE" in op
                                                                      or op.endswith(".M88.2")) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def writes_into_in_flight_a_registers(text: str, whole: bool = False, inner: bool = False) -> int:
    """The race's hazard itself, on the SASS: instructions in the K loop that write a register holding the A operand
    of an HGMMA (wgmma with A in registers) before a `WARPGROUP.DEPBAR` has waited for it. The loop body is walked
    twice, so windows that cross the back edge count (`whole`: the function's instructions once instead, for kernels
    without a single loop); a DEPBAR that allows groups to stay pending (`0x` > 0) is taken to wait for none (an
    over-count, never an under-count). ptxas < 13.3 emits such writes (triton issue 9433)."""
    if whole:
        walk, first = [t for _, t in instructions(text)], 0
    else:
        body = loop_instructions(text, inner)
        walk, first = body + body, len(body)
    in_flight: set[int] = set()
    hazards = 0
    for i, ins in enumerate(walk):
        if "HGMMA" in ins:
            if a := re.search(r"HGMMA\S* R\d+, R(\d+),", ins):  # A in registers: 4 of them (m64 x k16 bf16)
                in_flight |= set(range(int(a.group(1)), int(a.group(1)) + 4))
        elif "WARPGROUP.DEPBAR" in ins:
            if re.search(r", 0x0\b", ins) or not re.search(r", 0x", ins):
                in_flight = set()
        elif i >= first and _written_registers(ins) & in_flight:
            hazards += 1
    return hazards


def wgmma_groups_in_flight_at_back_edge(ptx: str) -> int:
    """wgmma groups committed in the K loop's body after its last `wgmma.wait_group` and before its backward branch:
    groups still reading their registers when the next K tile's code runs (0 with SETTLE; the race under ptxas <
    13.3 needs one). Counted on the PTX, whose loop is the one block ending in a branch back to its own header."""
    lines = ptx.splitlines()
    back = [(i, m.group(1)) for i, line in enumerate(lines)
            if (m := re.search(r"@%p\d+ bra\s+(\$L__BB\d+_\d+);", line))
            and any(lines[j].startswith(m.group(1) + ":") for j in range(i))]
    if len(back) != 1:
        raise RuntimeError(f"expected one loop, found {len(back)} backward branches")
    end, label = back[0]
    start = next(j for j in range(end) if lines[j].startswith(label + ":"))
    in_flight = 0
    for line in lines[start:end]:
        if "wgmma.commit_group" in line:
            in_flight += 1
        elif m := re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", line):
            in_flight = min(in_flight, int(m.group(1)))
    return in_flight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=None, help="num_stages (default: the engine's per build, "
                                                             "`default_stages` in kernels/w4a16_swapped.py)")
    ap.add_argument("--opcodes", action="store_true", help="also the 12 most frequent opcodes of each loop")
    args = ap.parse_args()
    print(f"[sass_loop] triton {triton.__version__}, sm_90, SETTLE, per K tile of 128")
    for name, kind, consts in BUILDS:
        stages = args.stages or w4a16_swapped.default_stages(consts["BLOCK_M"], True, 2, kind)
        ops = loop_opcodes(sass(consts, stages))
        print(f"[sass_loop] {name:28s} {stages} stages {sum(ops.values()):5d} instructions; HGMMA {ops['HGMMA']}, "
              f"BAR {ops['BAR']}, "
              f"LDS {ops['LDS'] + ops['LDSM']}, STS {ops['STS']}")
        if args.opcodes:
            print("           ", ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))


if __name__ == "__main__":
    main()
