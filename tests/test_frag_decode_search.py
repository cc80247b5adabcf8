"""benchmarks/frag_decode_search.py: the offline E2M1 -> bf16 decode designs for the swap-AB kernel's weight words
decode every code in every place of a word exactly as the kernel's decode must (m, e0, e1, s at bits 6, 7, 8, 15 of
each half, zeros elsewhere); the first rotation design is the kernel's (`kernels.w4a16_swapped.frag_words` stores the
words this search packs); the within-halves design reads no bit across a half."""

import torch

from benchmarks.frag_decode_search import (
    MASK,
    Design,
    check,
    decode,
    pack,
    search,
    search_within_halves,
    target,
)


def test_rotation_design_found_and_exact():
    designs = search()
    assert Design(True, (0, 10, 13), 0, (2, 7, 12), (0, 1, 3, 4, 16, 17, 19, 20)) in designs
    for d in designs:
        check(d, trials=256)
        assert d.r_mask == 0x001B001B and d.multiplier == 0x1084


def test_kernel_words_are_the_first_design():
    """The kernel's constants are the first design's, and its loader stores the words `pack` makes: register j's
    halves are codes 2j, 2j + 1 = the low nibbles of elements 0-3, then their high nibbles."""
    from kernels.w4a16_swapped import FRAG_O3, FRAG_ROTATIONS, frag_words

    d = search()[0]
    assert d.amounts[1:] == FRAG_ROTATIONS and (d.r_mask, d.multiplier) == FRAG_O3
    plain = torch.randint(0, 256, (500, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for p, w in zip(plain.tolist(), frag_words(plain).view(torch.int32).view(-1).tolist()):
        assert w & 0xFFFFFFFF == pack([b & 0xF for b in p] + [b >> 4 for b in p], d), p


def test_within_halves_design_found_exact_and_half_local():
    (d,) = search_within_halves()
    assert d == Design(False, (0, 3, 6), 7, (0, 5, 11), (3, 4, 6, 7, 19, 20, 22, 23))
    check(d, trials=256)
    for src in d.sources():
        assert all(p // 16 == b // 16 for p, b in src.items())  # no bit crosses a 16-bit half
    codes = list(range(8))  # one word by hand: register j holds codes 2j (low half) and 2j + 1 (high half)
    out = decode(pack(codes, d), d)
    assert out == [target(2 * j) | target(2 * j + 1) << 16 for j in range(4)]
    assert all(o & ~MASK == 0 for o in out)
