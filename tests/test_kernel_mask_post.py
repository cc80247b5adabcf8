"""kernels/mask_post.py: upsample + threshold + column bit-packing against Meta's tail (`F.interpolate` +
`sigmoid > 0.5`) and numpy's packbits; the exact sigmoid cut; the unpacked masks feeding pycocotools without a copy.

Bit-exact except pixels whose upsampled logit lies within ulps of the cut (a different FMA contraction can move it by
an ulp): every mismatch must be such a pixel, and their number is printed (`pytest -s`; 0 measured on CPU).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.mask_post import (
    MAX_SIDE,
    compare,
    describe,
    mask_post_packed,
    mask_post_reference,
    mask_post_triton,
    pack_columns,
    sigmoid_cut,
    supports,
    unpack_columns,
    upsample_threshold_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def logits(k, m, seed, dtype=torch.float32, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(k, m, m, generator=g) * scale).to(dtype).to(DEVICE)


def check_against_reference(x, h, w):
    """Kernel vs reference (torch packing) vs numpy packbits; returns the number of boundary mismatches."""
    out = mask_post_triton(x, h, w)
    ref = mask_post_reference(x, h, w)
    masks = upsample_threshold_reference(x, h, w).cpu().numpy()  # bool [K, H, W], Meta's
    assert out.shape == ref.shape == (x.shape[0], w, (h + 7) // 8) and out.dtype == torch.uint8
    assert np.array_equal(ref.cpu().numpy(), np.packbits(masks.transpose(0, 2, 1), axis=2))  # reference packing
    got = unpack_columns(out, h)
    bad = np.nonzero(got != masks)
    if len(bad[0]):
        v = F.interpolate(x.float()[:, None], (h, w), mode="bilinear", align_corners=False)[:, 0].cpu().numpy()
        cut = sigmoid_cut(0.5, str(x.device))
        near = np.abs(v[bad] - cut) <= 1e-6 * (1 + float(x.abs().max()))
        assert near.all(), f"{(~near).sum()} mismatches away from the cut, e.g. v={v[bad][~near][:5]}"
    return len(bad[0])


@pytest.mark.parametrize("k,m,h,w,dtype", [
    (3, 16, 37, 53, torch.float32),  # upsample, H and W not multiples of 8
    (2, 72, 131, 97, torch.float32),
    (1, 32, 8, 16, torch.float32),  # exact bytes
    (4, 8, 9, 7, torch.float32),  # one spare bit per column
    (2, 72, 61, 45, torch.bfloat16),  # downsample, bf16 logits (upcast like the reference's .float())
    (2, 72, 50, 70, torch.float16),
    (2, 20, 1, 1, torch.float32),  # one pixel
    (1, 5, 300, 17, torch.float32),  # tall: several byte tiles
])
def test_matches_reference(k, m, h, w, dtype):
    n = check_against_reference(logits(k, m, seed=k * m + h, dtype=dtype), h, w)
    print(f"\nK={k} {m}^2 -> {h}x{w} {dtype}: {n} boundary mismatches")


def test_empty_and_strided_inputs():
    assert mask_post_triton(logits(0, 16, 0), 10, 13).shape == (0, 13, 2)
    base = logits(3, 40, seed=5)
    view = base[:, 3:35, 5:37].transpose(1, 2)  # [3, 32, 32], non-contiguous
    assert check_against_reference(view, 45, 27) == 0
    assert torch.equal(mask_post_triton(view, 45, 27), mask_post_triton(view.contiguous(), 45, 27))


def test_threshold_edge_is_sigmoid_not_sign():
    """With the output the size of the input, the upsample is the identity (weights 1 and 0), so logits reach the
    threshold bit for bit: values in (0, cut] are OFF, as `sigmoid(x) > 0.5` says and `x > 0` would not."""
    cut = sigmoid_cut(0.5, DEVICE)
    assert 0 < cut < 1e-7  # 8.94e-8 on CPU (1.5 * 2^-24)
    up = float(np.nextafter(np.float32(cut), np.float32(1)))
    vals = [0.0, -0.0, 1e-45, 3e-8, 5e-8, cut, up, 1e-7, -1e-7, 1.0, -2.0, 2.5, 8.9e-8, 9e-8]
    x = torch.zeros(1, 7, 7)
    x[0, :2] = torch.tensor(vals).view(2, 7)
    x = x.to(DEVICE)
    got = unpack_columns(mask_post_triton(x, 7, 7), 7)[0, :2].reshape(-1)
    assert got.tolist() == upsample_threshold_reference(x, 7, 7)[0, :2].reshape(-1).tolist()
    assert got.tolist() == [float(np.float32(v)) > cut for v in vals]
    assert not got[vals.index(5e-8)] and got[vals.index(up)]
    assert [v > 0 for v in vals] != got.tolist()  # the sign test would switch 1e-45 .. cut on


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy: inf - inf
def test_non_finite_logits_follow_the_reference():
    """NaN is OFF, +inf ON; a weight of 0 times a non-finite neighbour gives NaN, in the reference as here."""
    x = logits(2, 16, seed=12)
    x[0, 3, 4], x[1, 10, 10], x[1, 0, 15] = float("nan"), float("inf"), -float("inf")
    assert check_against_reference(x, 37, 53) == 0


@pytest.mark.parametrize("threshold", [0.5, 0.3, 0.9])
def test_sigmoid_cut_is_exact(threshold):
    cut = sigmoid_cut(threshold, DEVICE)
    c = np.float32(cut).view(np.int32)
    bits = torch.arange(int(c) - (1 << 20), int(c) + (1 << 20), dtype=torch.int32)  # 2M floats around the cut
    x = bits.view(torch.float32).to(DEVICE)
    assert torch.equal(torch.sigmoid(x) > threshold, x > cut)


def test_sigmoid_cut_extremes():
    assert sigmoid_cut(1.0, DEVICE) == float("inf")  # nothing is > 1
    assert sigmoid_cut(-0.5, DEVICE) == float("-inf")  # everything finite is > -0.5
    cut0 = sigmoid_cut(0.0, DEVICE)  # sigmoid underflows to 0 below about -88 to -104
    x = torch.tensor([cut0, float(np.nextafter(np.float32(cut0), np.float32(0)))], device=DEVICE)
    assert (torch.sigmoid(x) > 0).tolist() == [False, True]


def test_unpacked_masks_feed_pycocotools_without_a_copy():
    mask_utils = pytest.importorskip("pycocotools.mask")
    x = logits(4, 24, seed=11)
    h, w = 45, 37
    masks = unpack_columns(mask_post_triton(x, h, w), h)  # bool [K, H, W] view
    hwk = masks.view(np.uint8).transpose(1, 2, 0)
    assert hwk.flags.f_contiguous and np.shares_memory(np.asfortranarray(hwk), masks)
    ours = mask_utils.encode(np.asfortranarray(hwk))
    ref = upsample_threshold_reference(x, h, w).cpu().numpy()
    theirs = mask_utils.encode(np.asfortranarray(ref.view(np.uint8).transpose(1, 2, 0)))
    assert [r["counts"] for r in ours] == [r["counts"] for r in theirs]


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    m = torch.rand(3, 21, 10, generator=g) > 0.5
    assert np.array_equal(unpack_columns(pack_columns(m), 21), m.numpy())


def test_op_traces_with_fullgraph_compile():
    x = logits(3, 16, seed=7)
    cut = sigmoid_cut(0.5, DEVICE)

    def f(x):
        return torch.ops.sammie.mask_post(x * 1.0, 37, 53, cut)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), f(x))
    assert torch.equal(f(x), mask_post_packed(x, 37, 53, cut))


def test_supports_guard():
    x = logits(3, 16, seed=8)
    good = describe(x, 37, 53)
    assert supports(**good)
    assert supports(**describe(logits(0, 16, 0), 10, 10))  # K = 0
    assert supports(**{**good, "dtype": torch.bfloat16}) and supports(**{**good, "height": MAX_SIDE})
    other = "cuda" if DEVICE == "cpu" else "cpu"  # interpreter: CPU only; compiled: CUDA only
    cases = {
        "other device": {**good, "device": other},
        "fp64 logits": {**good, "dtype": torch.float64},
        "int logits": {**good, "dtype": torch.int32},
        "2-D logits": {**good, "shape": (16, 16)},
        "empty mask side": {**good, "shape": (3, 0, 16)},
        "height 0": {**good, "height": 0},
        "width 0": {**good, "width": 0},
        "too tall": {**good, "height": MAX_SIDE + 1},
        "too wide": {**good, "width": MAX_SIDE + 1},
    }
    for name, info in cases.items():
        assert not supports(**info), name


def test_compare_counts_bits():
    a = torch.zeros(2, 10, 3, dtype=torch.uint8)
    b = a.clone()
    b[0, 0, 0] = 0b1000_0000
    assert compare(a, b) is None  # one bit of 480 (>= 1 allowed)
    b[1, 2, 2] = 0b0000_0011
    assert compare(a, b) == "3 of 480 mask bits differ"
