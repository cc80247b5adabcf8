"""An offline search for a cheaper E2M1 -> bf16 decode of the swap-AB expert kernel's weight words (no GPU needed).

Why. At 32 streams the routed experts run `kernels/w4a16_swapped.py`, whose K loop is issue-bound: offline sm_90 SASS
(`benchmarks/sass_loop.py --opcodes`, Triton 3.8) counts 493 instructions per K tile in gate_up, of which the decode
of the packed weights into bf16 pairs is ~17 per 8 weights (PRMT 4.25, shifts 8.25, LOP3 4.75; HMUL2's block scale
apart). RESULTS.md (thirty-ninth session, item 8) puts the 32-stream step's expert instructions at ~2.6 G warp
instructions, ~2.5 ms at perfect issue: above what a 5,000 tok/s step would leave the experts.

The decode's target, per 32-bit output register (two bf16, `_frag_ptx`'s trick): an E2M1 code (s e1 e0 m) with m at
bit 6, e0 at 7, e1 at 8 and s at 15 of its 16-bit half, every other bit 0, is the code's value x 2^-126 in bf16
(e1 e0 = 00 lands in the subnormals, which keeps 0 / 0.5 in scale with the normals); HMUL2 by the block scale x 2^119
follows. Mask M = 0x81C081C0.

The kernel spreads bytes into 16-bit halves (PRMT) so that two shifted copies OR together without collisions. This
search instead lets the loader place the 32 bits of a word's 8 weights anywhere in the word (it already rewrites the
bytes: `split_frag`, the sign-first high nibble) and looks for outputs of the forms
    O0 = w & M,   O1 = rotl(w, r1) & M,   O2 = rotl(w, r2) & M,   O3 = ((w & R) * C) & M
with C a sum of powers of two (one IMAD; its shifted copies may carry, as long as no carry reaches a bit of M: checked
over all 2^8 values of R's bits). Rotations and masks alone cannot give all four (no four translates of {6, 7, 8, 15}
tile Z_16), hence the multiply. Found: r1 = 10, r2 = 13, R = 0x001B001B, C = 0x1084 (copies shifted by 2, 7 and 12):
8 instructions per 8 weights (LOP3 x 5, SHF.L.W x 2, IMAD x 1 in sm_90 SASS: `--sass`), against the loop's ~17.
The rotations move bits between the word's 16-bit halves. Where the kernel's registers only keep 16-bit units
together (the thirty-seventh session's search assumed so: Triton's packing of the loaded weights), the halves must not
mix; then (`within_halves`)
    O0 = w & M,   O1 = (w << 3) & M,   O2 = (w << 6) & M,   O3 = (((w >> 7) & R') * C') & M
with R' = 0x00D800D8, C' = 0x821 (copies shifted by 0, 5 and 11): 9 instructions per 8 weights, each half of the word
holding the four weights of the four registers' halves (plus a PRMT where the two halves arrive in two registers).
The first rotation design is the kernel's since the fortieth session (`kernels/w4a16_swapped.py`: `frag_words`, the
loader's side, and `_e2m1x2_bf16_frag_ptx`; its constants FRAG_ROTATIONS / FRAG_O3; `tests/test_frag_decode_search.py`
checks that this search still finds them). The word the asm gets is the 4 bytes Triton packs for it, assembled by one
PRMT from the low (or high) halves of two LDSM registers; the rotations mixing the halves cost nothing there.

    python benchmarks/frag_decode_search.py [--sass]      (--sass: outside TRITON_INTERPRET, compiles for sm_90)
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from typing import NamedTuple

M_ROLES = (6, 7, 8, 15)  # bit of the low half that takes the code's m, e0, e1, s (the high half: + 16)
M_BITS = tuple(sorted(p + h for p in M_ROLES for h in (0, 16)))


def _bits(positions) -> int:
    """The integer with these bits set (a mask from bit positions, a multiplier from shifts)."""
    return sum(1 << p for p in positions)


MASK = _bits(M_BITS)  # 0x81C081C0


def _o3_routes(r_bits: tuple[int, ...], shifts: tuple[int, ...]) -> dict[int, list[int]]:
    """O3's routing: for each bit of MASK, the bits of R that (x & R) * sum(1 << shifts) copies onto it."""
    return {p: [b for b in r_bits for s in shifts if b + s == p] for p in M_BITS}


class Design(NamedTuple):
    """O_j = shift(w, k_j) & MASK for j < 3 (a rotation left, or a plain left shift), and O3 = (((w >> pre) & r_mask)
    * multiplier) & MASK. Rotations may move bits between the word's 16-bit halves; left shifts by <= 6 never do."""

    rotate: bool  # the first three outputs by rotations (True) or left shifts
    amounts: tuple[int, int, int]  # k_0, k_1, k_2
    pre: int  # O3's right shift
    shifts: tuple[int, ...]  # O3's multiplier, as shifts
    r_bits: tuple[int, ...]  # the bits O3 reads, after the right shift

    @property
    def r_mask(self) -> int:
        return _bits(self.r_bits)

    @property
    def multiplier(self) -> int:
        return _bits(self.shifts)

    def sources(self) -> list[dict[int, int]]:
        """Per output register, {output bit of MASK: the word bit it reads}."""
        wrap = 32 if self.rotate else 64  # a left shift by <= 6 never takes bits from below bit 0
        o3 = {p: b + self.pre for p, (b,) in _o3_routes(self.r_bits, self.shifts).items()}
        return [{p: (p - k) % wrap for p in M_BITS} for k in self.amounts] + [o3]


def _o3_exact(r_bits: tuple[int, ...], shifts: tuple[int, ...]) -> bool:
    """((w & R) * C) & MASK routes exactly one R bit to each bit of MASK, for all 2^len(R) values (carries checked)."""
    routes = _o3_routes(r_bits, shifts)
    if any(len(v) != 1 for v in routes.values()) or len({v[0] for v in routes.values()}) != len(M_BITS):
        return False
    c = _bits(shifts)
    for v in range(1 << len(r_bits)):
        w = _bits(b for i, b in enumerate(r_bits) if v >> i & 1)
        want = _bits(p for p, (b,) in routes.items() if w >> b & 1)
        if (w * c) & MASK & 0xFFFFFFFF != want:
            return False
    return True


def search(max_shifts: int = 3) -> list[Design]:
    """Every (r1, r2) whose rotated masks and MASK itself read disjoint bits, with the first multiplier (fewest
    shifts, then smallest) that routes the 8 remaining bits exactly."""
    found = []
    for r1, r2 in itertools.combinations(range(1, 32), 2):
        taken = [set(M_BITS), {(p - r1) % 32 for p in M_BITS}, {(p - r2) % 32 for p in M_BITS}]
        if len(set().union(*taken)) != 24:
            continue
        rest = tuple(sorted(set(range(32)) - set().union(*taken)))
        for n in range(1, max_shifts + 1):
            hit = next((s for s in itertools.combinations(range(32), n) if _o3_exact(rest, s)), None)
            if hit is not None:
                found.append(Design(True, (0, r1, r2), 0, hit, rest))
                break
    return found


def search_within_halves(max_shifts: int = 3) -> list[Design]:
    """The cheapest designs whose every output bit reads a bit of its own 16-bit half: three left-shifted masks
    (k = 0 costs one LOP3, others a shift too) and O3."""
    found = []
    for ks in itertools.combinations(range(7), 3):
        taken = [{p - k for p in M_BITS} for k in ks]
        if len(set().union(*taken)) != 24:
            continue
        rest = sorted(set(range(32)) - set().union(*taken))
        for pre in range(min(rest) + 1):
            r_bits = tuple(b - pre for b in rest)
            hit = next((sh for n in range(1, max_shifts + 1) for sh in itertools.combinations(range(20), n)
                        if _o3_exact(r_bits, sh) and all((b + pre) // 16 == (b + s) // 16
                                                          for b in r_bits for s in sh if b + s in M_BITS)), None)
            if hit is not None:
                found.append(Design(False, ks, pre, hit, r_bits))
                break
    return found


def pack(codes: list[int], d: Design) -> int:
    """8 E2M1 codes (s e1 e0 m, 4 bits each) -> the word the loader would store: code 2j in O_j's low half, code
    2j + 1 in its high half."""
    w = 0
    for j, src in enumerate(d.sources()):
        for half in (0, 1):
            code = codes[2 * j + half]
            for role, p in enumerate(M_ROLES):
                if code >> role & 1:
                    w |= 1 << src[p + 16 * half]
    return w


def decode(w: int, d: Design) -> list[int]:
    """The decode (8 or 9 instructions): the four bf16x2 registers of a word."""
    shift = (lambda x, k: (x << k) | (x >> (32 - k))) if d.rotate else (lambda x, k: x << k)
    return [shift(w, k) & MASK for k in d.amounts] + [(((w >> d.pre) & d.r_mask) * d.multiplier) & MASK]


def target(code: int) -> int:
    """The 16-bit half the kernel's decode makes of one code: m, e0, e1, s at bits 6, 7, 8, 15."""
    return _bits(p for role, p in enumerate(M_ROLES) if code >> role & 1)


def check(d: Design, trials: int = 2000) -> None:
    """Every code in every one of the 8 places (the other 7 random) decodes to `target`: AssertionError if not."""
    rng = random.Random(0)
    for place, code in itertools.product(range(8), range(16)):
        for _ in range(trials // 128 + 1):
            codes = [rng.randrange(16) for _ in range(8)]
            codes[place] = code
            out = decode(pack(codes, d), d)
            for j in range(4):
                assert out[j] == target(codes[2 * j]) | target(codes[2 * j + 1]) << 16, (d, codes, j)


def sass_counts(d: Design) -> dict[str, int]:
    """Opcode counts of the decode compiled for sm_90 (a Triton kernel of the four formulas; addressing included)."""
    import collections
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def _decode(w_ptr, o_ptr, R1: tl.constexpr, R2: tl.constexpr, RM: tl.constexpr, C: tl.constexpr,
                N: tl.constexpr):
        i = tl.arange(0, N)
        w = tl.load(w_ptr + i)
        tl.store(o_ptr + 4 * i, w & 0x81C081C0)
        tl.store(o_ptr + 4 * i + 1, ((w << R1) | (w >> (32 - R1))) & 0x81C081C0)
        tl.store(o_ptr + 4 * i + 2, ((w << R2) | (w >> (32 - R2))) & 0x81C081C0)
        tl.store(o_ptr + 4 * i + 3, ((w & RM) * C) & 0x81C081C0)

    consts = dict(R1=d.amounts[1], R2=d.amounts[2], RM=d.r_mask, C=d.multiplier, N=128)  # a rotation design
    build = triton.compile(ASTSource(fn=_decode, signature={"w_ptr": "*u32", "o_ptr": "*u32",
                                                           **{k: "constexpr" for k in consts}}, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(build.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ins = [m.group(1) for m in (re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line) for line in text.splitlines()) if m]
    return dict(collections.Counter(i.split()[0].split(".")[0] for i in ins))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", action="store_true", help="also compile the first design for sm_90 and count opcodes")
    args = ap.parse_args()
    designs, halves = search(), search_within_halves()
    for title, found in (("rotations", designs), ("left shifts within 16-bit halves", halves)):
        print(f"{len(found)} designs by {title}")
        for d in found:
            check(d)
            print(f"  O0-O2: {'rotl' if d.rotate else 'shl'} {d.amounts}; O3: ((w >> {d.pre}) & {d.r_mask:#010x}) * "
                  f"{d.multiplier:#x} (shifts {d.shifts}); exact for every code in every place")
    if args.sass and designs:
        print(f"sm_90 SASS of the first (4 words' stores and addressing included): {sass_counts(designs[0])}")
    return 0 if designs and halves else 1


if __name__ == "__main__":
    sys.exit(main())
