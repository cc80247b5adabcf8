"""Mask encodings for the HTTP API (sammie/masks.py): exact round trips, polygon fidelity, batch path, sizes/times."""

from __future__ import annotations

import base64
import io
import json
import time

import numpy as np
import pytest
from PIL import Image

from sammie import masks as M

mask_utils = pytest.importorskip("pycocotools.mask")

# pycocotools 2.0.11's decode trips numpy 2's __array__(copy=...) deprecation; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def _blobs(h: int, w: int, sigma: float, seed: int = 0, thr: float = 0.5) -> np.ndarray:
    """Irregular blobs: smoothed Gaussian noise thresholded (several components, holes, border contact)."""
    from scipy import ndimage

    f = ndimage.gaussian_filter(np.random.default_rng(seed).standard_normal((h, w)), sigma)
    return f > thr * f.std()


def _star(h: int, w: int) -> np.ndarray:
    """One smooth star-shaped blob (what a segmentation mask mostly looks like)."""
    yy, xx = np.mgrid[:h, :w]
    cy, cx = h / 2, w / 2
    r, th = np.hypot(yy - cy, xx - cx), np.arctan2(yy - cy, xx - cx)
    return r < min(h, w) * (0.3 + 0.06 * np.sin(5 * th) + 0.02 * np.cos(13 * th))


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    ring = np.zeros((40, 50), bool)
    ring[5:35, 5:45] = True
    ring[12:28, 12:38] = False  # a hole
    ring[18:22, 20:30] = True  # an island inside the hole
    return {
        "random": rng.random((37, 53)) < 0.5,
        "sparse": rng.random((64, 48)) < 0.02,
        "blobs": _blobs(120, 90, 4),
        "ring": ring,
        "empty": np.zeros((31, 17), bool),
        "full": np.ones((17, 31), bool),
        "1x1-on": np.ones((1, 1), bool),
        "1x1-off": np.zeros((1, 1), bool),
        "row": rng.random((1, 40)) < 0.5,
        "col": rng.random((40, 1)) < 0.5,
        "checker": (np.indices((16, 16)).sum(0) % 2).astype(bool),
    }


CASES = _cases()


# ------------------------------------------------------------------------------------------------ RLE


@pytest.mark.parametrize("name", list(CASES))
def test_rle_round_trip_exact(name):
    m = CASES[name]
    rle = M.encode_rle(m)
    assert rle["size"] == list(m.shape) and isinstance(rle["counts"], str)
    json.dumps(rle)  # plain JSON types
    # Decodable by pycocotools itself, as a client would.
    back = mask_utils.decode({"size": rle["size"], "counts": rle["counts"].encode()})
    assert back.shape == m.shape and np.array_equal(back.astype(bool), m)
    assert np.array_equal(M.decode_rle(rle), m)
    assert int(mask_utils.area({"size": rle["size"], "counts": rle["counts"].encode()})) == int(m.sum())


def test_rle_non_contiguous_and_other_dtypes():
    base = _blobs(80, 60, 3)
    views = {
        "transposed": base.T,
        "strided": base[::2, ::3],
        "flipped": base[::-1, ::-1],
        "fortran": np.asfortranarray(base),
        "uint8": base.astype(np.uint8),
        "float": base.astype(np.float32),
    }
    for name, v in views.items():
        expect = np.asarray(v) != 0
        assert np.array_equal(M.decode_rle(M.encode_rle(v)), expect), name
    # The input is not modified or required to be writable.
    ro = base.copy()
    ro.setflags(write=False)
    assert np.array_equal(M.decode_rle(M.encode_rle(ro)), base)


def test_rle_matches_pycocotools_reference():
    m = _blobs(70, 110, 3, seed=3)
    ref = mask_utils.encode(np.asfortranarray(m.astype(np.uint8)))
    assert M.encode_rle(m)["counts"] == ref["counts"].decode()


def test_rle_batch_equals_single_and_layouts():
    ms = np.stack([_blobs(64, 96, 3, seed=s) for s in range(5)] + [np.zeros((64, 96), bool), np.ones((64, 96), bool)])
    single = [M.encode_rle(m) for m in ms]
    assert M.encode_rle_batch(ms) == single
    # [K, W, H]-contiguous view (the zero-copy layout) and a strided view give the same answer.
    kwh = np.ascontiguousarray(ms.transpose(0, 2, 1))
    assert M.encode_rle_batch(kwh.transpose(0, 2, 1)) == single
    assert M.encode_rle_batch(ms[::2]) == single[::2]
    assert M.encode_rle_batch(np.zeros((0, 64, 96), bool)) == []
    assert M.encode_many(ms, "rle") == single
    with pytest.raises(ValueError):
        M.encode_rle_batch(ms[0])


def test_uncompressed_rle_decodes():
    m = CASES["blobs"]
    flat = m.ravel(order="F").astype(np.uint8)
    change = np.flatnonzero(np.diff(np.concatenate([[0], flat, [2]])))  # run starts, beginning with 0s
    counts = np.diff(np.concatenate([[0], change])).tolist()
    counts = counts if flat[0] == 0 else [0] + counts[1:]
    # Sanity: the run lengths sum to H*W.
    assert sum(counts) == m.size
    assert np.array_equal(M.decode_rle({"size": list(m.shape), "counts": counts}), m)


# ------------------------------------------------------------------------------------------------ PNG


@pytest.mark.parametrize("name", list(CASES))
def test_png_round_trip_exact(name):
    m = CASES[name]
    s = M.encode_png(m)
    assert isinstance(s, str)
    raw = base64.b64decode(s)
    with Image.open(io.BytesIO(raw)) as img:
        assert img.format == "PNG" and img.mode == "1" and img.size == (m.shape[1], m.shape[0])
    assert np.array_equal(M.decode_png(s), m)
    assert np.array_equal(M.decode_png(raw), m)


def test_png_non_contiguous():
    base = _blobs(50, 70, 2)
    assert np.array_equal(M.decode_png(M.encode_png(base[::-1, 1::2])), base[::-1, 1::2])


# ------------------------------------------------------------------------------------------------ polygons


def _rasterise_coco(polys, h, w):
    if not polys:
        return np.zeros((h, w), bool)
    return mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects(polys, h, w))).astype(bool)


def _rasterise_skimage(polys, h, w):
    from skimage.draw import polygon

    out = np.zeros((h, w), bool)
    for p in polys:
        xy = np.asarray(p, float).reshape(-1, 2) - 0.5  # COCO coords -> skimage's integer pixel centres
        rr, cc = polygon(xy[:, 1], xy[:, 0], (h, w))
        out[rr, cc] = True
    return out


def _iou(a, b):
    u = (a | b).sum()
    return 1.0 if u == 0 else (a & b).sum() / u


@pytest.mark.parametrize("shape", ["star", "blobs-small", "blobs-large", "ring", "full", "1x1-on"])
def test_polygons_rasterise_back(shape):
    from scipy import ndimage

    m = {
        "star": _star(200, 300),
        "blobs-small": _blobs(96, 128, 3, seed=4),
        "blobs-large": _blobs(512, 384, 10, seed=5),
        "ring": CASES["ring"],
        "full": CASES["full"],
        "1x1-on": CASES["1x1-on"],
    }[shape]
    h, w = m.shape
    polys = M.encode_polygons(m)
    json.dumps(polys)
    assert polys and all(len(p) >= 6 and len(p) % 2 == 0 for p in polys)
    xs = np.concatenate([p[0::2] for p in polys])
    ys = np.concatenate([p[1::2] for p in polys])
    assert xs.min() >= 0 and ys.min() >= 0 and xs.max() <= w and ys.max() <= h
    filled = ndimage.binary_fill_holes(m)  # COCO polygons cannot carry holes
    for rasterise in (_rasterise_coco, _rasterise_skimage):
        back = rasterise(polys, h, w)
        assert _iou(back, filled) > 0.95, (shape, rasterise.__name__)
    # Lossless mode: pycocotools reproduces the hole-filled mask to within a few boundary pixels.
    assert (_rasterise_coco(polys, h, w) ^ filled).sum() <= max(2, 0.001 * filled.sum())
    # Simplification keeps blobs recognisable and shortens the rings.
    if shape in ("star", "blobs-large"):
        simple = M.encode_polygons(m, tolerance=1.0)
        assert sum(map(len, simple)) < sum(map(len, polys))
        assert _iou(_rasterise_coco(simple, h, w), filled) > 0.95


def test_polygons_geometry():
    m = np.zeros((10, 12), bool)
    m[2:7, 3:9] = True  # x in [3, 9), y in [2, 7)
    (ring,) = M.encode_polygons(m)
    xy = np.asarray(ring).reshape(-1, 2)
    assert xy[:, 0].min() == 3 and xy[:, 0].max() == 9 and xy[:, 1].min() == 2 and xy[:, 1].max() == 7
    assert len(xy) == 8  # a rectangle with its four corners chamfered by half a pixel; no collinear vertices
    # Two components -> two rings; the hole of the ring case -> no ring; the island inside it -> its own ring.
    two = np.zeros((10, 20), bool)
    two[2:5, 2:5] = two[5:8, 12:18] = True
    assert len(M.encode_polygons(two)) == 2
    assert len(M.encode_polygons(CASES["ring"])) == 2
    assert M.encode_polygons(CASES["empty"]) == []


# ------------------------------------------------------------------------------------------------ dispatch


def test_encode_dispatch_and_errors():
    m = CASES["blobs"]
    assert M.MASK_FORMATS == ("rle", "png", "polygon")
    assert M.encode(m, "rle") == M.encode_rle(m)
    assert M.encode(m, "png") == M.encode_png(m)
    assert M.encode(m, "polygon") == M.encode_polygons(m)
    ms = np.stack([m, ~m])
    for fmt in M.MASK_FORMATS:
        assert M.encode_many(ms, fmt) == [M.encode(x, fmt) for x in ms]
    with pytest.raises(ValueError, match="unknown mask format"):
        M.encode(m, "bitmap")
    with pytest.raises(ValueError, match="unknown mask format"):
        M.encode_many(ms, "RLE")
    with pytest.raises(ValueError, match="2-D"):
        M.encode_rle(ms)


# ------------------------------------------------------------------------------------------------ report


def _best_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def test_report_sizes_and_times(capsys):
    """Size and encode time per format on 1024x1024 masks (serving.md §11.2 used an irregular one, 21.5 % area).

    "ragged": ~100 small blobs, 22 % area (a crowd or foliage; many runs per column, the hard case for every format);
    "smooth": one star-shaped object, 29 % area (a typical instance mask). Prints a table (it shows with plain
    `pytest`); asserts only the ordering that makes RLE the default. Best of a few runs, one thread.
    """
    irregular = _blobs(1024, 1024, 12, seed=0, thr=0.8)
    smooth = _star(1024, 1024)
    batch = np.stack([_blobs(1024, 1024, 12, seed=s, thr=0.8) for s in range(8)])
    rows = []
    for label, m in (("ragged", irregular), ("smooth", smooth)):
        rle = M.encode_rle(m)
        rows.append((label, "rle", len(json.dumps(rle)), _best_ms(lambda: M.encode_rle(m), 5)))
        rows.append((label, "rle decode", None, _best_ms(lambda: M.decode_rle(rle), 5)))
        png = M.encode_png(m)
        rows.append((label, "png (base64)", len(json.dumps(png)), _best_ms(lambda: M.encode_png(m), 3)))
        poly = M.encode_polygons(m)
        rows.append((label, "polygon", len(json.dumps(poly)), _best_ms(lambda: M.encode_polygons(m), 2)))
        if label == "smooth":
            p1 = M.encode_polygons(m, tolerance=1.0)
            rows.append((label, "polygon tol=1", len(json.dumps(p1)), _best_ms(lambda: M.encode_polygons(m, 1.0), 2)))
    t_single = _best_ms(lambda: [M.encode_rle(x) for x in batch], 3) / len(batch)
    t_batch = _best_ms(lambda: M.encode_rle_batch(batch), 3) / len(batch)
    kwh_view = np.ascontiguousarray(batch.transpose(0, 2, 1)).transpose(0, 2, 1)  # as if transposed on the GPU
    t_zero_copy = _best_ms(lambda: M.encode_rle_batch(kwh_view), 3) / len(batch)
    with capsys.disabled():
        print(f"\n1024x1024 masks: ragged area {irregular.mean():.1%}, smooth area {smooth.mean():.1%}")
        print(f"{'mask':10s} {'format':14s} {'JSON bytes':>10s} {'ms':>8s}")
        for label, fmt, size, ms in rows:
            print(f"{label:10s} {fmt:14s} {size if size is not None else '-':>10} {ms:8.2f}")
        print(
            f"RLE of 8 ragged masks: {t_single:.2f} ms/mask one by one, {t_batch:.2f} ms/mask batched, "
            f"{t_zero_copy:.2f} ms/mask batched from a [K, W, H] buffer (no transposing copy)"
        )
    sizes = {(lbl, fmt): size for lbl, fmt, size, _ in rows}
    for label in ("ragged", "smooth"):
        assert sizes[(label, "rle")] < sizes[(label, "png (base64)")]
        assert sizes[(label, "rle")] < sizes[(label, "polygon")]
