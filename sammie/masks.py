"""Mask encodings for the HTTP API (`mask_format` = rle | png | polygon).

Every encoder takes one bool mask ``[H, W]`` (row-major, as the model returns it) and returns something JSON can
carry:

- ``rle`` (default): COCO compressed RLE ``{"size": [h, w], "counts": "<ascii>"}``, column-major; decode with
  ``pycocotools.mask.decode({"size": s, "counts": c.encode()})`` or :func:`decode_rle`.
- ``png``: base64 of a 1-bit PNG (mode ``"1"``, ``w x h`` pixels); decode with
  ``PIL.Image.open(BytesIO(b64decode(s)))`` or :func:`decode_png`.
- ``polygon``: a list of outer rings, each a flat ``[x0, y0, x1, y1, ...]`` list; rasterise with
  ``pycocotools.mask.frPyObjects(polys, h, w)`` (then ``merge`` and ``decode``).

RLE and PNG are lossless. Polygons trace the 0.5 iso-line of the mask (marching squares: vertices on the half-pixel
grid, between inside and outside pixel centres) and keep outer rings only (COCO polygons are a union of rings and
cannot express holes). Coordinates follow the COCO convention: pixel ``(x, y)`` covers ``[x, x+1) x [y, y+1)``, so
its centre is ``(x + 0.5, y + 0.5)``; pycocotools gives back the hole-filled mask (exactly, in our tests).
``skimage.draw.polygon`` samples at integer centres: subtract 0.5 first, and it is exact too.
``PIL.ImageDraw.polygon`` also fills the outline's pixels and grows every ring by up to a pixel (IoU 0.83-0.96 on
our test blobs): not for exact work.

Contours come from ``skimage.measure.find_contours`` (marching squares) rather than OpenCV's ``findContours``:
scikit-image is already in the test and bench extras and on the GPU image, while OpenCV's headless wheel alone is
~50 MB of native code; the contours are sub-pixel iso-lines, not chains of boundary-pixel centres (which sit half a
pixel inside the edge, so rasterising them back loses a ring of pixels); and it is imported lazily, so only servers
asked for polygons need it.

Speed and size (1024x1024 masks, one CPU thread; tests/test_masks.py::test_report_sizes_and_times, table in
benchmarks/README.md): RLE ~2.5 ms and 2 KB for a smooth object mask (PNG 5-14 ms / 5.6 KB, lossless polygons
10-30 ms / 16 KB). Most of RLE's time is the transposing copy to column-major order; :func:`encode_rle_batch` skips
it when handed a ``[K, W, H]``-contiguous buffer.

Packed masks. The engine's device post-processing (registry op ``mask_post``, ``kernels/mask_post.py``) returns each
mask with its bits packed per COLUMN: uint8 ``[W, ceil(H / 8)]``, MSB = first row (numpy ``packbits`` order). COCO RLE
runs go down columns too, so :func:`encode_rle_packed` expands the bits straight into pycocotools' Fortran
``[H, W, K]`` layout (``np.unpackbits`` along the last axis: a linear 8x expansion, no transpose, no bool ``[H, W]``
image) and pycocotools counts the runs in C. :func:`encode_instances` is what a server calls on a prompt's
``sammie.segmenter.Instance`` list: RLE from the packed bits when every instance has them, else the bool masks.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

MASK_FORMATS = ("rle", "png", "polygon")

__all__ = [
    "MASK_FORMATS",
    "encode",
    "encode_many",
    "encode_rle",
    "encode_rle_batch",
    "encode_rle_packed",
    "encode_instances",
    "unpack_masks",
    "decode_rle",
    "encode_png",
    "decode_png",
    "encode_polygons",
]


def _as_mask(mask: Any) -> np.ndarray:
    m = np.asarray(mask)
    if m.ndim != 2:
        raise ValueError(f"a mask must be 2-D [H, W], got shape {m.shape}")
    if m.dtype != np.bool_:
        m = m != 0
    return m


# ---------------------------------------------------------------------------------------------------- COCO RLE


def encode_rle(mask: np.ndarray) -> dict:
    """COCO compressed RLE of a bool ``[H, W]`` mask: ``{"size": [h, w], "counts": str}`` (column-major runs)."""
    from pycocotools import mask as mask_utils

    m = _as_mask(mask)
    # pycocotools wants uint8, Fortran order; a bool array reinterprets as uint8 without a copy.
    rle = mask_utils.encode(np.asfortranarray(m.view(np.uint8)))
    return {"size": [int(m.shape[0]), int(m.shape[1])], "counts": rle["counts"].decode("ascii")}


def encode_rle_batch(masks: np.ndarray) -> list[dict]:
    """COCO RLE of K masks ``[K, H, W]`` in one pycocotools call (one transposing copy, then C loops).

    pycocotools takes ``[H, W, K]`` in Fortran order, which is the memory layout of a C-ordered ``[K, W, H]`` array.
    A caller that already holds masks as ``[K, W, H]`` (e.g. transposed on the GPU before the copy to host) can pass
    ``kwh.transpose(0, 2, 1)`` and no copy is made here at all.
    """
    from pycocotools import mask as mask_utils

    m = np.asarray(masks)
    if m.ndim != 3:
        raise ValueError(f"masks must be 3-D [K, H, W], got shape {m.shape}")
    if m.dtype != np.bool_:
        m = m != 0
    k, h, w = m.shape
    if k == 0:
        return []
    hwk = np.asfortranarray(m.view(np.uint8).transpose(1, 2, 0))  # no copy when m is a [K, W, H] view
    size = [int(h), int(w)]
    return [{"size": size, "counts": r["counts"].decode("ascii")} for r in mask_utils.encode(hwk)]


def unpack_masks(packed: np.ndarray, height: int) -> np.ndarray:
    """Column-packed masks uint8 ``[K, W, ceil(H / 8)]`` -> bool ``[K, H, W]``, a transposed view of a C-ordered
    ``[K, W, H]`` array (pycocotools' layout; :func:`encode_rle_batch` takes it without a copy)."""
    p = np.asarray(packed)
    if p.ndim != 3 or p.dtype != np.uint8 or p.shape[2] != (height + 7) // 8:
        raise ValueError(f"packed masks must be uint8 [K, W, ceil(H / 8)] for H={height}, got {p.dtype} {p.shape}")
    return np.unpackbits(p, axis=2, count=height).view(np.bool_).transpose(0, 2, 1)


def encode_rle_packed(packed: np.ndarray, height: int) -> list[dict]:
    """COCO RLE of K column-packed masks uint8 ``[K, W, ceil(H / 8)]`` (see the module docstring): equal to
    :func:`encode_rle` of each unpacked bool mask. One unpack into the Fortran layout, then one pycocotools call."""
    from pycocotools import mask as mask_utils

    masks = unpack_masks(packed, height)  # [K, H, W] view of [K, W, H]
    k, h, w = masks.shape
    if k == 0:
        return []
    hwk = masks.view(np.uint8).transpose(1, 2, 0)  # [H, W, K], Fortran-contiguous: no copy below
    size = [int(h), int(w)]
    return [{"size": size, "counts": r["counts"].decode("ascii")} for r in mask_utils.encode(hwk)]


def encode_instances(instances: list, fmt: str = "rle") -> list:
    """Encode the masks of a list of `sammie.segmenter.Instance` (all of one image) in ``fmt``. RLE reads the
    column-packed bits when every instance carries them (the engine's instances do); everything else, and instances
    built from bool masks, goes through :func:`encode_many`."""
    if fmt not in MASK_FORMATS:
        raise ValueError(f"unknown mask format {fmt!r}; expected one of {', '.join(MASK_FORMATS)}")
    if not instances:
        return []
    packed = [getattr(i, "packed", None) for i in instances]
    if fmt == "rle" and all(p is not None for p in packed) and len({p.shape for p in packed}) == 1:
        return encode_rle_packed(np.stack(packed), instances[0].height)  # [K, W, HB]: a small copy (1 bit/pixel)
    return encode_many(np.stack([i.mask for i in instances]), fmt)


def decode_rle(rle: dict) -> np.ndarray:
    """Inverse of :func:`encode_rle` (also accepts bytes counts and uncompressed list counts) -> bool ``[H, W]``."""
    from pycocotools import mask as mask_utils

    h, w = (int(v) for v in rle["size"])
    counts = rle["counts"]
    if isinstance(counts, list):  # uncompressed COCO RLE
        obj = mask_utils.frPyObjects({"size": [h, w], "counts": counts}, h, w)
    else:
        obj = {"size": [h, w], "counts": counts.encode("ascii") if isinstance(counts, str) else counts}
    return mask_utils.decode(obj).astype(bool)


# ---------------------------------------------------------------------------------------------------- PNG


def encode_png(mask: np.ndarray) -> str:
    """Base64 (ascii) of a 1-bit PNG of the mask."""
    from PIL import Image

    m = _as_mask(mask)
    h, w = m.shape
    # Build the 1-bit image from packed rows (MSB first, rows padded to a byte): no per-pixel Python work.
    img = Image.frombytes("1", (w, h), np.packbits(m, axis=1).tobytes()) if h and w else Image.new("1", (w, h))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_png(data: str | bytes) -> np.ndarray:
    """Inverse of :func:`encode_png` (base64 str or raw PNG bytes) -> bool ``[H, W]``."""
    from PIL import Image

    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
    with Image.open(io.BytesIO(raw)) as img:
        return np.array(img.convert("L")) > 0


# ---------------------------------------------------------------------------------------------------- polygons


def encode_polygons(mask: np.ndarray, tolerance: float = 0.0) -> list[list[float]]:
    """Outer contours of the mask as flat ``[x0, y0, x1, y1, ...]`` lists in COCO pixel coordinates.

    One ring per connected component (8-connected foreground, as marching squares at level 0.5 with
    ``fully_connected="high"`` joins diagonal neighbours); rings around holes are dropped (COCO polygons cannot express
    them), so rasterising the result gives the hole-filled mask. An island inside a hole keeps its own ring. Rings are
    closed implicitly (the first point is not repeated) and have at least 3 points.

    ``tolerance=0`` (default) is lossless: only vertices in the middle of straight runs are removed (vectorised, about
    3x fewer points). ``tolerance > 0`` further simplifies with Douglas-Peucker at that many pixels; it is
    ``skimage.measure.approximate_polygon``, a Python loop, and costs far more than the contour tracing itself on
    ragged masks, so it is opt-in.
    """
    from skimage import measure

    m = _as_mask(mask)
    if not m.any():
        return []
    # Pad so that components touching the border still give closed rings.
    padded = np.pad(m, 1).view(np.uint8)
    polys: list[list[float]] = []
    for contour in measure.find_contours(padded, 0.5, fully_connected="high"):
        # (row, col) in the padded array -> (x, y) with pixel centres at +0.5: x = col - 1 + 0.5.
        xy = contour[:, ::-1] - 0.5
        if len(xy) > 1 and np.array_equal(xy[0], xy[-1]):
            xy = xy[:-1]
        if len(xy) < 3:
            continue
        x, y = xy[:, 0], xy[:, 1]
        if np.dot(x, np.roll(y, -1)) - np.dot(np.roll(x, -1), y) <= 0:  # shoelace: holes wind the other way
            continue
        xy = _drop_collinear(xy)
        if tolerance > 0:
            ring = measure.approximate_polygon(np.vstack([xy, xy[:1]]), tolerance)
            xy = ring[:-1] if np.array_equal(ring[0], ring[-1]) else ring
            if len(xy) < 3:
                continue
        polys.append(xy.ravel().tolist())
    return polys


def _drop_collinear(xy: np.ndarray) -> np.ndarray:
    """Remove the vertices of a closed ring whose incoming and outgoing edges point the same way (exact: marching
    squares on a binary mask puts every vertex on the half-pixel grid, so the cross products are exact)."""
    d_in = xy - np.roll(xy, 1, axis=0)
    d_out = np.roll(xy, -1, axis=0) - xy
    cross = d_in[:, 0] * d_out[:, 1] - d_in[:, 1] * d_out[:, 0]
    dot = (d_in * d_out).sum(axis=1)
    keep = (cross != 0) | (dot <= 0)
    return xy[keep] if keep.sum() >= 3 else xy


# ---------------------------------------------------------------------------------------------------- dispatch


def encode(mask: np.ndarray, fmt: str = "rle") -> Any:
    """Encode one mask in ``fmt`` (one of :data:`MASK_FORMATS`)."""
    if fmt == "rle":
        return encode_rle(mask)
    if fmt == "png":
        return encode_png(mask)
    if fmt == "polygon":
        return encode_polygons(mask)
    raise ValueError(f"unknown mask format {fmt!r}; expected one of {', '.join(MASK_FORMATS)}")


def encode_many(masks: np.ndarray, fmt: str = "rle") -> list:
    """Encode K masks ``[K, H, W]``; RLE goes through the batched fast path."""
    if fmt not in MASK_FORMATS:
        raise ValueError(f"unknown mask format {fmt!r}; expected one of {', '.join(MASK_FORMATS)}")
    if fmt == "rle":
        return encode_rle_batch(masks)
    return [encode(m, fmt) for m in np.asarray(masks)]
