"""sammie.decode's JPEG fast paths: the header check (`is_plain_jpeg`), torchvision's CPU decode (bit-identical
to the PIL reference `decode_image_pil`; `decode_image` dispatches). No GPU decode: see sammie/decode.py.

The header check decides which decoder runs on untrusted bytes, so it is tested on every kind of JPEG PIL can
write, on JPEGs patched into kinds PIL cannot write (arithmetic coding, lossless, 12-bit, 4 components), on
truncations of a valid file and on random bytes (it must answer False, never raise).
"""

import struct

import numpy as np
import pytest
import torch
from PIL import Image

from sammie.decode import (
    InvalidImage,
    decode_image,
    decode_image_pil,
    decode_jpeg_cpu,
    is_plain_jpeg,
    jpeg_frame,
)
from tests.test_engine import bad_images, encode, odd_images, photos

MAX_PIXELS = 40_000_000


def jpeg(array: np.ndarray, **kwargs) -> bytes:
    return encode(Image.fromarray(array), "JPEG", **kwargs)


def _sof_offset(data: bytes) -> int:
    """Byte offset of the start-of-frame marker (FF Cn) of a JPEG written by PIL."""
    i = 2
    while True:
        marker, (length,) = data[i + 1], struct.unpack_from(">H", data, i + 2)
        if marker in (0xC0, 0xC1, 0xC2):
            return i
        i += 2 + length


def _patched(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + bytes([value]) + data[offset + 1:]


@pytest.fixture(scope="module")
def rgb() -> np.ndarray:
    return photos()[1]  # 300 x 380 coffee crop: real image content


# ------------------------------------------------------------------------------------------------- header check


@pytest.mark.parametrize("subsampling", [0, 1, 2], ids=["444", "422", "420"])
@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_plain_jpegs_are_decodable(rgb, subsampling, progressive):
    data = jpeg(rgb, quality=90, subsampling=subsampling, progressive=progressive)
    assert is_plain_jpeg(data)
    marker, precision, height, width, comps, adobe = jpeg_frame(data)
    assert (marker, precision, height, width, len(comps), adobe) == (0xC2 if progressive else 0xC0, 8, 300, 380,
                                                                     3, False)


def test_gray_and_exif_jpegs_are_decodable(rgb):
    assert is_plain_jpeg(jpeg(rgb[..., 0]))
    exif = Image.Exif()
    exif[0x0112] = 6
    assert is_plain_jpeg(jpeg(rgb, exif=exif))


def test_other_kinds_are_not(rgb):
    data = jpeg(rgb, quality=90)
    sof = _sof_offset(data)
    cases = {
        "cmyk": encode(Image.fromarray(rgb).convert("CMYK"), "JPEG"),
        "adobe_rgb": encode(Image.fromarray(rgb), "JPEG", keep_rgb=True),  # components stored as R, G, B
        "arithmetic": _patched(data, sof + 1, 0xC9),  # SOF9: arithmetic-coded sequential
        "lossless": _patched(data, sof + 1, 0xC3),
        "12_bit": _patched(data, sof + 4, 12),
        "zero_height": _patched(_patched(data, sof + 5, 0), sof + 6, 0),  # height from a DNL marker
        "truncated": data[:-100],
        "no_eoi": data[:-2],
        "png": encode(Image.fromarray(rgb)),
        "webp": encode(Image.fromarray(rgb), "WEBP"),
        "empty": b"",
        "soi_only": b"\xff\xd8\xff\xd9",
    }
    for name, d in cases.items():
        assert not is_plain_jpeg(d), name
    assert not is_plain_jpeg(data, max_pixels=300 * 380 - 1)
    assert is_plain_jpeg(data, max_pixels=300 * 380)


def test_odd_and_bad_images():
    decodable = {name for name, (data, _, _) in odd_images().items() if is_plain_jpeg(data)}
    assert decodable == {"exif_rotated"}  # the CMYK JPEG, PNGs and GIF go to PIL
    assert not any(is_plain_jpeg(data) for data, _ in bad_images().values())


def test_never_raises_on_garbage(rgb):
    data = jpeg(rgb, quality=80, progressive=True)
    rng = np.random.default_rng(0)
    for cut in range(0, 700, 3):  # every truncation of the header area
        is_plain_jpeg(data[:cut] + b"\xff\xd9")
    for _ in range(300):  # random header bytes after a valid SOI, ending with EOI
        junk = bytes(rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8))
        is_plain_jpeg(b"\xff\xd8" + junk + b"\xff\xd9")
        flipped = bytearray(data)
        flipped[int(rng.integers(2, 600))] = int(rng.integers(0, 256))
        is_plain_jpeg(bytes(flipped))


# ------------------------------------------------------------------------------------------------- CPU fast path


def _exif_jpeg(array: np.ndarray, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return jpeg(array, exif=exif, quality=92)


def test_cpu_fast_path_is_bit_identical_to_pil():
    """torchvision and Pillow both decode with libjpeg-turbo (same IDCT, same fancy upsampling): equal bytes."""
    n = 0
    for array in photos():
        for kwargs in ({"quality": 90}, {"quality": 75, "subsampling": 1}, {"quality": 95, "subsampling": 0},
                       {"quality": 85, "progressive": True}):
            for data in (jpeg(array, **kwargs), jpeg(np.ascontiguousarray(array[..., 1]), **kwargs)):
                assert is_plain_jpeg(data)
                assert torch.equal(decode_jpeg_cpu(data), decode_image_pil(data, MAX_PIXELS))
                n += 1
    for orientation in range(1, 9):  # every EXIF orientation, including the mirrored ones
        data = _exif_jpeg(photos()[3], orientation)
        fast, ref = decode_jpeg_cpu(data), decode_image_pil(data, MAX_PIXELS)
        assert fast.shape == ref.shape and torch.equal(fast, ref), orientation
        n += 1
    assert n == 4 * 4 * 2 + 8


def test_cpu_fast_path_falls_back_and_keeps_errors():
    for name, (data, _, _) in odd_images().items():
        assert torch.equal(decode_image(data, MAX_PIXELS), decode_image_pil(data, MAX_PIXELS)), name
    for name, (data, code) in bad_images().items():
        for decode in (decode_jpeg_cpu, lambda d: decode_image(d, MAX_PIXELS)):
            with pytest.raises(InvalidImage) as err:
                decode(data)
            assert err.value.code == code, name
