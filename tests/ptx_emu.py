"""A tiny interpreter for the inline PTX of the Triton kernels' dequantisers, so that their bit formulas are checked on
the CPU (the Triton interpreter cannot run inline asm). It runs the asm text of a `tl.inline_asm_elementwise` call
taken from the jit function's source, on 32-bit registers, for the few instructions those blocks use: prmt.b32,
shl.b32, shf.l.wrap.b32, and.b32, or.b32, mul.lo.u32, mov.b32 and mul.rn.bf16x2."""

from __future__ import annotations

import inspect
import re

import torch


def asm_text(jit_fn) -> str:
    """The asm string of the (first) `inline_asm_elementwise` call in a Triton jit function's source, or of a module
    constant holding the block ("{ ... }") that such a call passes."""
    if isinstance(jit_fn, str):
        return jit_fn.strip()[1:-1]
    src = inspect.getsource(jit_fn.fn)
    start = src.index('"""{', src.index("inline_asm_elementwise")) + 4
    return src[start:src.index('}"""', start)]


def _bf16x2_mul(a: int, b: int) -> int:
    """mul.rn.bf16x2 of two registers: each 16-bit half as bf16, the product rounded to nearest even."""
    def halves(v: int) -> torch.Tensor:
        bits = torch.tensor([v & 0xFFFF, (v >> 16) & 0xFFFF], dtype=torch.int32) << 16
        return bits.view(torch.float32).double()

    prod = (halves(a) * halves(b)).float()  # a bf16 x bf16 product is exact in fp32 (8 x 8 significant bits)
    out = prod.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF  # round to nearest even
    return int(out[0]) | (int(out[1]) << 16)


def run(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Execute `asm` on 32-bit registers; `inputs` names the $-operands ("$8": value); returns every register."""
    reg = dict(inputs)

    def val(t: str) -> int:
        return int(t, 16) if t.startswith("0x") else int(t) if t.isdigit() else reg[t]

    for ins in filter(None, (i.strip() for i in asm.split(";"))):
        op, args = ins.split(None, 1)
        if op == ".reg":
            continue
        d, *a = [t.strip() for t in args.split(",")]
        assert re.fullmatch(r"\$\d+|[a-z]\w*", d), ins
        if op == "prmt.b32":  # byte j of d = byte (sel >> 4j) & 7 of the 8-byte {a[1]:a[0]}
            src8 = [(val(a[0]) >> (8 * i)) & 0xFF for i in range(4)] + [(val(a[1]) >> (8 * i)) & 0xFF
                                                                        for i in range(4)]
            reg[d] = sum(src8[(val(a[2]) >> (4 * j)) & 7] << (8 * j) for j in range(4))
        elif op == "shf.l.wrap.b32":  # the funnel {a[1]:a[0]} shifted left by a[2] % 32, its top 32 bits
            k = val(a[2]) % 32
            reg[d] = (((val(a[1]) << 32 | val(a[0])) << k) >> 32) & 0xFFFFFFFF
        elif op == "mov.b32":
            reg[d] = val(a[0]) & 0xFFFFFFFF
        elif op == "mul.rn.bf16x2":
            reg[d] = _bf16x2_mul(val(a[0]), val(a[1]))
        else:
            f = {"shl.b32": lambda x, y: x << y, "and.b32": lambda x, y: x & y, "or.b32": lambda x, y: x | y,
                 "mul.lo.u32": lambda x, y: x * y}[op]
            reg[d] = f(val(a[0]), val(a[1])) & 0xFFFFFFFF
    return reg
