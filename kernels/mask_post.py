"""Mask post-processing on the device: mask logits [K, M, M] -> bilinear upsample to (H, W) (align_corners=False,
as `F.interpolate`) -> threshold -> bits packed per COLUMN: uint8 [K, W, ceil(H / 8)], so that only COCO RLE encoding
is left to the CPU.

Reference: Meta's `Sam3Processor` tail, as `sammie.segmenter.postprocess_pair` does it:
`F.interpolate(logits.float()[:, None], (H, W), mode="bilinear", align_corners=False).sigmoid() > 0.5`.
`mask_post_reference` is that, followed by the same column packing in plain PyTorch (any device).

Threshold. `sigmoid(x) > 0.5` in fp32 is NOT `x > 0`: for 0 < x <= 8.94e-8 (on CPU; 1.5 * 2^-24) `exp(-x)` rounds to
a value whose `1 + exp(-x)` rounds to 2.0, so sigmoid is exactly 0.5 and the pixel is OFF. The kernel reproduces the
reference exactly with `x > cut`, where `cut = sigmoid_cut(threshold, device)` is the largest fp32 value whose sigmoid
on that device is <= threshold (found once by bisection over fp32 values with `torch.sigmoid` itself; cached). This
holds for any threshold, and NaN stays OFF as in the reference.

Packing. Column-major, MSB first (numpy `packbits` convention): byte b of column x of mask k holds rows 8b..8b+7,
row 8b in bit 7; rows past H are 0. COCO RLE runs go down columns, and pycocotools takes masks as Fortran-ordered
[H, W, K], which is the memory of a C-ordered [K, W, H] array: `np.unpackbits(packed, axis=2, count=H)` is exactly
that, so `unpack_columns(packed, H)` gives the bool [K, H, W] masks as a transposed VIEW and
`sammie.masks.encode_rle_batch(unpack_columns(packed, H))` encodes them without any transposing copy (row-major
packing would need one full [K, H, W] transpose on the host). The device->host copy is 8x smaller than bool masks.

Arithmetic: torch's CUDA `upsample_bilinear2d_out_frame` (UpSampleBilinear2d.cu): `src = scale * (dst + 0.5) - 0.5`
clamped at 0, `i0 = int(src)`, `i1 = i0 + (i0 < in - 1)`, `l1 = src - i0`, `l0 = 1 - l1`,
`v = l0y * (l0x * a + l1x * b) + l1y * (l0x * c + l1x * d)`, in fp32 (bf16/fp16 logits are upcast first, as the
reference's `.float()` does), same expression order; Triton's default FMA contraction stands in for nvcc's.

Tolerance: bit-exact, except pixels whose upsampled logit lies within a few ulps of `cut` (a different FMA contraction
moves v by an ulp). On random logits such pixels essentially never occur; the tests count them (0 measured on CPU at
every tested shape) and the registry self-check allows 1e-5 of pixels.

Napkin math (K = 8 masks of 288^2 fp32 logits -> 640 x 480): reads 2.65 MB (each logit is reused ~3.7x from L2),
writes 8 x 640 x 60 B = 0.31 MB: ~3 MB -> 0.6 us at 4.8 TB/s, so launch-bound (~3-5 us). The reference writes a
9.8 MB fp32 upsample, reads/writes it again for sigmoid (19.7 MB) and the compare (12.3 MB), then copies 2.5 MB of
bool to the host (~50 us over PCIe at ~50 GB/s vs ~6 us for 0.31 MB packed) and pycocotools makes a Fortran copy.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "mask_post"
IN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_SIDE = 1 << 15  # output side limit of the guard (int32 index math; 32768 px covers any photo we serve)


# ---- references -----------------------------------------------------------------------------------------------------
def upsample_threshold_reference(mask_logits: torch.Tensor, height: int, width: int,
                                 threshold: float = 0.5) -> torch.Tensor:
    """bool [K, H, W]: exactly `postprocess_pair`'s masks (Meta's processor)."""
    if mask_logits.shape[0] == 0:
        return torch.zeros((0, height, width), dtype=torch.bool, device=mask_logits.device)
    up = F.interpolate(mask_logits.float().unsqueeze(1), (height, width), mode="bilinear", align_corners=False)
    return (up.sigmoid() > threshold)[:, 0]


def pack_columns(masks: torch.Tensor) -> torch.Tensor:
    """bool [K, H, W] -> uint8 [K, W, ceil(H / 8)], column-major, MSB first (see the module docstring)."""
    k, h, w = masks.shape
    hb = (h + 7) // 8
    cols = F.pad(masks.transpose(1, 2).to(torch.uint8), (0, hb * 8 - h))  # [K, W, 8 * HB]
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32, device=masks.device)
    return (cols.view(k, w, hb, 8).int() * weights).sum(-1).to(torch.uint8)


def mask_post_reference(mask_logits: torch.Tensor, height: int, width: int, threshold: float = 0.5) -> torch.Tensor:
    """The reference of the op: upsample + sigmoid > threshold + column packing -> uint8 [K, W, ceil(H / 8)]."""
    return pack_columns(upsample_threshold_reference(mask_logits, height, width, threshold))


def unpack_columns(packed: np.ndarray | torch.Tensor, height: int) -> np.ndarray:
    """uint8 [K, W, ceil(H / 8)] -> bool [K, H, W] on the host, a transposed view of a C-ordered [K, W, H] array
    (pycocotools' Fortran [H, W, K] layout: `sammie.masks.encode_rle_batch` takes it without a copy)."""
    if isinstance(packed, torch.Tensor):
        packed = packed.cpu().numpy()
    bits = np.unpackbits(packed, axis=2, count=height)  # [K, W, H], C order
    return bits.view(np.bool_).transpose(0, 2, 1)


# ---- the exact threshold --------------------------------------------------------------------------------------------
def _key(x: float) -> int:
    """fp32 value -> int in the same order (negative floats mirrored below -0.0 = -1, +0.0 = 0)."""
    bits = int(np.array(x, dtype=np.float32).view(np.int32))
    return bits if bits >= 0 else -1 - (bits & 0x7FFFFFFF)


def _f32_from_key(key: int) -> float:
    bits = key if key >= 0 else 0x80000000 | (-1 - key)
    return float(np.array(bits, dtype=np.uint32).view(np.float32))


@functools.lru_cache(maxsize=64)
def sigmoid_cut(threshold: float, device: str) -> float:
    """The largest fp32 x with `torch.sigmoid(x) <= threshold` (compared in fp32, as the reference does) on `device`:
    then `sigmoid(x) > threshold` <=> `x > cut` for every fp32 x, NaN included (assuming the device's sigmoid is
    monotone; checked densely around the cut on CPU by the tests). -inf / +inf when every / no finite x passes.
    One bisection of 32 steps (one host sync each), cached per (threshold, device)."""

    def ok(key: int) -> bool:  # sigmoid(x) <= threshold
        x = torch.tensor([_f32_from_key(key)], dtype=torch.float32, device=device)
        return bool((torch.sigmoid(x) <= threshold).item())

    lo, hi = _key(-3.4028234663852886e38), _key(3.4028234663852886e38)  # -FLT_MAX, FLT_MAX
    if not ok(lo):
        return float("-inf")
    if ok(hi):
        return float("inf")
    while hi - lo > 1:  # invariant: ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return _f32_from_key(lo)


# ---- the Triton kernel ----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _source(dst, scale, in_size):
        """torch's area_pixel_compute_source_index (align_corners=False, linear) + the CUDA kernel's index/lambda."""
        src = scale * (dst.to(tl.float32) + 0.5) - 0.5
        src = tl.where(src < 0.0, 0.0, src)
        i0 = tl.minimum(src.to(tl.int32), in_size - 1)  # the min only matters past the output (masked rows)
        i1 = i0 + (i0 < in_size - 1).to(tl.int32)
        l1 = src - i0.to(tl.float32)
        return i0, i1, 1.0 - l1, l1

    @triton.jit
    def _mask_post_kernel(logits, out, in_h, in_w, s_k, s_y, s_x, H, W, HB, scale_h, scale_w, cut,
                          BLOCK_X: tl.constexpr, BLOCK_B: tl.constexpr):
        # grid: (cdiv(W, BLOCK_X), cdiv(HB, BLOCK_B), K); one program = BLOCK_X columns x 8 * BLOCK_B rows of mask k
        k = tl.program_id(2)
        xs = tl.program_id(0) * BLOCK_X + tl.arange(0, BLOCK_X)  # [BX] output columns
        bs = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)  # [BB] output bytes of a column
        bit = tl.arange(0, 8)
        ys = bs[:, None] * 8 + bit[None, :]  # [BB, 8] output rows
        y0, y1, ly0, ly1 = _source(ys, scale_h, in_h)
        x0, x1, lx0, lx1 = _source(xs, scale_w, in_w)
        base = logits + k.to(tl.int64) * s_k
        r0 = (y0 * s_y)[None, :, :]
        r1 = (y1 * s_y)[None, :, :]
        c0 = (x0 * s_x)[:, None, None]
        c1 = (x1 * s_x)[:, None, None]
        a = tl.load(base + r0 + c0).to(tl.float32)  # [BX, BB, 8]; indices are clamped in range, no mask needed
        b = tl.load(base + r0 + c1).to(tl.float32)
        c = tl.load(base + r1 + c0).to(tl.float32)
        d = tl.load(base + r1 + c1).to(tl.float32)
        wx0 = lx0[:, None, None]
        wx1 = lx1[:, None, None]
        v = ly0[None, :, :] * (wx0 * a + wx1 * b) + ly1[None, :, :] * (wx0 * c + wx1 * d)
        on = (v > cut) & (ys < H)[None, :, :]
        byte = tl.sum(on.to(tl.int32) << (7 - bit)[None, None, :], axis=2)  # [BX, BB], MSB = first row
        m = (xs < W)[:, None] & (bs < HB)[None, :]
        tl.store(out + k.to(tl.int64) * W * HB + xs[:, None] * HB + bs[None, :], byte.to(tl.uint8), mask=m)


def _interpreted() -> bool:
    """True when the kernel was built by Triton's interpreter (TRITON_INTERPRET=1 at import): CPU tensors only."""
    return triton is not None and type(_mask_post_kernel).__name__ == "InterpretedFunction"


def _scale(in_size: int, out_size: int) -> float:
    """area_pixel_compute_scale<float>(in, out, align_corners=False, no scale factor) = fp32(in) / fp32(out)."""
    return float(np.float32(in_size) / np.float32(out_size))


@torch.library.custom_op("sammie::mask_post", mutates_args=())
def mask_post_packed(mask_logits: torch.Tensor, height: int, width: int, cut: float) -> torch.Tensor:
    """The kernel: [K, M, M'] logits (fp32/bf16/fp16, any strides) -> uint8 [K, W, ceil(H / 8)] of `v > cut`."""
    k, in_h, in_w = mask_logits.shape
    hb = (height + 7) // 8
    out = torch.empty((k, width, hb), dtype=torch.uint8, device=mask_logits.device)
    if k == 0 or width == 0 or hb == 0:
        return out
    if _interpreted():  # few, large programs: the interpreter's cost is per operation, not per element
        block_x, block_b = min(128, triton.next_power_of_2(width)), min(32, triton.next_power_of_2(hb))
    else:  # 32 columns x 128 rows per program
        block_x, block_b = 32, 16
    grid = (triton.cdiv(width, block_x), triton.cdiv(hb, block_b), k)
    s_k, s_y, s_x = mask_logits.stride()
    _mask_post_kernel[grid](mask_logits, out, in_h, in_w, s_k, s_y, s_x, height, width, hb,
                            _scale(in_h, height), _scale(in_w, width), cut, BLOCK_X=block_x, BLOCK_B=block_b)
    return out


@mask_post_packed.register_fake
def _(mask_logits, height, width, cut):
    return mask_logits.new_empty((mask_logits.shape[0], width, (height + 7) // 8), dtype=torch.uint8)


def mask_post_triton(mask_logits: torch.Tensor, height: int, width: int, threshold: float = 0.5) -> torch.Tensor:
    """Same contract as `mask_post_reference`. The first call per (threshold, device) finds the exact cut (syncs)."""
    return mask_post_packed(mask_logits, height, width, sigmoid_cut(float(threshold), str(mask_logits.device)))


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(mask_logits: torch.Tensor, height: int, width: int, threshold: float = 0.5) -> dict[str, Any]:
    return dict(device=mask_logits.device.type, dtype=mask_logits.dtype, shape=tuple(mask_logits.shape),
                height=height, width=width)


def supports(*, device: str, dtype: torch.dtype, shape: tuple[int, ...], height: int, width: int, **_: Any) -> bool:
    """Triton present and able to run on `device`; [K, M, M'] logits in fp32/bf16/fp16 (K may be 0); an output of
    1..MAX_SIDE pixels per side."""
    if triton is None or device != ("cpu" if _interpreted() else "cuda"):
        return False
    if dtype not in IN_DTYPES or len(shape) != 3 or min(shape[1:]) < 1:
        return False
    return 1 <= height <= MAX_SIDE and 1 <= width <= MAX_SIDE


def _sample(device) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(3, 72, 72, generator=g).mul_(4).to(device), 131, 97), {}


def compare(out: torch.Tensor, ref: torch.Tensor, max_fraction: float = 1e-5) -> str | None:
    """None when the packed masks agree bit for bit, but for at most `max_fraction` of the pixels (>= 1): those
    whose logit sits within ulps of the cut (see the module docstring)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"shape/dtype {tuple(out.shape)} {out.dtype} != {tuple(ref.shape)} {ref.dtype}"
    n_bits = int(np.unpackbits((out ^ ref).cpu().numpy()).sum())
    pixels = out.shape[0] * out.shape[1] * out.shape[2] * 8
    if n_bits > max(1.0, max_fraction * pixels):
        return f"{n_bits} of {pixels} mask bits differ"
    return None


def register(registry) -> None:
    registry.add_op(NAME, mask_post_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="bit-exact but for pixels whose upsampled logit is within ulps of the sigmoid cut "
                              "(<= 1e-5 of pixels)")
    registry.add_implementation(NAME, "triton", mask_post_triton, supports)
