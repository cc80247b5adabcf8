"""Safe decoding of untrusted image bytes into the uint8 RGB tensor the engine batches.

    bytes -> size check from the header (decompression-bomb cap, before any pixel is decoded)
          -> full decode (truncated / corrupt files are errors, never silently padded)
          -> first frame of animations, EXIF orientation, 8-bit RGB (`sammie.preprocess.to_rgb_uint8`:
             grayscale, palette, RGBA, CMYK, 16-bit all handled)              -> uint8 [3, H, W]

Runs on a worker thread (`SammieEngine`'s pool), never on the event loop: PIL holds the GIL for parts of a
decode and a 20 MP JPEG takes ~0.2 s. Every failure is an `InvalidImage` naming the problem; nothing here
touches PIL's process-wide settings (`Image.MAX_IMAGE_PIXELS`, `ImageFile.LOAD_TRUNCATED_IMAGES`).

JPEG fast path (plain JPEGs only, as told by `is_plain_jpeg`, a header walk of a few microseconds):
`decode_jpeg_cpu`, torchvision's libjpeg-turbo decode straight into [3, H, W] (no PIL image, no HWC -> CHW copy),
bit-identical to PIL's `decode_image_pil` (tests/test_decode.py); `decode_image` uses it, ~2x less CPU (640x480
photo: 1.9 vs 3.7 ms, measured on the 2-core dev machine).

No GPU decode. torchvision's nvJPEG path (on the H200 machine's torch 2.11 build; `benchmarks/nvjpeg_probe.py`,
RESULTS.md) decoded a 143 x 61 photograph with 4:2:0 or 4:2:2 chroma 13 levels off PIL on average (torchvision's
own tests allow 2), and with `apply_exif_orientation=True` orientations 2-8 came out ~61 levels off (flips) or in
the wrong shape (transposes), as if not applied; batched or one image at a time. A `decode_jpeg_batch_cuda` helper,
unused by the engine, was removed with its tests on 2026-12-02.

Everything else (PNG, WebP, CMYK/YCCK or Adobe-RGB JPEGs, 12-bit, arithmetic-coded or lossless JPEGs, ...) goes
through PIL (`decode_image_pil`).
"""

from __future__ import annotations

import io
import struct
import warnings

import torch
from PIL import Image, UnidentifiedImageError

from sammie.preprocess import to_rgb_uint8

# Formats a client may upload (JPEG includes MPO). Everything else PIL could open (EPS via ghostscript, PSD, ICO,
# XBM, ...) is refused: less decoder attack surface, and nobody sends those to a segmentation API.
ACCEPTED_FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF")


class InvalidImage(ValueError):
    """The bytes are not an image we accept. `code`: empty_image | invalid_image | image_too_large."""

    def __init__(self, code: str, message: str):
        self.code = code
        super().__init__(message)


def decode_image(data: bytes, max_pixels: int) -> torch.Tensor:
    """Untrusted bytes -> uint8 RGB tensor [3, H, W] (H, W after EXIF rotation). Raises `InvalidImage`.
    Plain JPEGs take torchvision's libjpeg-turbo path (`decode_jpeg_cpu`, bit-identical, ~2x less CPU), the rest
    `decode_image_pil`."""
    return decode_jpeg_cpu(data, max_pixels)


def decode_image_pil(data: bytes, max_pixels: int) -> torch.Tensor:
    """`decode_image` through PIL for every format: the reference, and the path for all but plain JPEGs."""
    if not data:
        raise InvalidImage("empty_image", "the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise InvalidImage("invalid_image", "the data is not an image in a supported format "
                           f"({', '.join(ACCEPTED_FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidImage("image_too_large", f"the image has more than {max_pixels} pixels") from None
    except Exception as exc:  # a malformed header can raise anything from inside a plugin
        raise InvalidImage("invalid_image", f"the image header is corrupt ({exc})") from None
    with image:
        width, height = image.size
        if width < 1 or height < 1:
            raise InvalidImage("invalid_image", f"the image has no pixels ({width} x {height})")
        if width * height > max_pixels:  # checked before decoding: a 40 MB PNG can hold 10^10 pixels
            raise InvalidImage("image_too_large",
                               f"the image is {width} x {height} = {width * height} pixels; the limit is {max_pixels}")
        try:
            image.seek(0)  # animated GIF / WebP / multi-page TIFF: the first frame
            image.load()  # raises on truncated data unless ImageFile.LOAD_TRUNCATED_IMAGES (left False)
            return to_rgb_uint8(image)
        except MemoryError:
            raise
        except Exception as exc:
            raise InvalidImage("invalid_image", f"the {image.format} image is truncated or corrupt ({exc})") from None


# --------------------------------------------------------------------------------------------------------------
# Plain JPEGs: header check and torchvision's libjpeg-turbo decoder

# Start-of-frame markers torchvision decodes: SOF0 baseline, SOF1 extended sequential (Huffman, 8-bit
# here), SOF2 progressive (Huffman). Not: SOF3 lossless, SOF5-7 hierarchical, SOF9-15 arithmetic coding.
_SOF_OK = (0xC0, 0xC1, 0xC2)
_SOF_ALL = (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF)
_STANDALONE = (0x01, *range(0xD0, 0xD8))  # TEM, RST0-7: markers without a length field
DEFAULT_MAX_PIXELS = 40_000_000  # EngineConfig.max_image_pixels' default


def jpeg_frame(data: bytes) -> tuple[int, int, int, int, tuple[tuple[int, int, int], ...], bool] | None:
    """Walk a JPEG's marker segments up to its start-of-frame: (SOF marker, precision, height, width, components
    as (id, h_sampling, v_sampling), Adobe APP14 transform==0 seen before the frame), or None if `data` is not a
    JPEG or its header is malformed. Reads only the header segments (a few hundred bytes to ~64 KB of EXIF)."""
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    i, n, adobe_rgb = 2, len(data), False
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None  # a segment must start with a marker
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or start-of-scan before a frame: malformed
            return None
        (length,) = struct.unpack_from(">H", data, i + 2)
        if length < 2 or i + 2 + length > n:
            return None
        seg = data[i + 4:i + 2 + length]
        if marker == 0xEE and seg[:5] == b"Adobe" and len(seg) >= 12:
            adobe_rgb = seg[11] == 0  # transform flag 0: RGB (3 components) or CMYK (4), not YCbCr/YCCK
        if marker in _SOF_ALL:
            if len(seg) < 6:
                return None
            precision, height, width, nc = struct.unpack_from(">BHHB", seg)
            if len(seg) < 6 + 3 * nc:
                return None
            comps = tuple((seg[6 + 3 * k], seg[7 + 3 * k] >> 4, seg[7 + 3 * k] & 15) for k in range(nc))
            return marker, precision, height, width, comps, adobe_rgb
        i += 2 + length
    return None


def is_plain_jpeg(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> bool:
    """True if `data` is a plain JPEG that torchvision's CPU decoder (libjpeg-turbo) turns into the same RGB image
    PIL does: Huffman-coded baseline or progressive, 8-bit, 1 component (gray) or 3 components in YCbCr (no Adobe
    RGB transform, no 'R','G','B' component ids), chroma sampled 4:4:4 / 4:2:2 / 4:2:0 / 4:4:0, at most
    `max_pixels` pixels, and the data ends with the end-of-image marker (a cheap guard against truncated uploads,
    which libjpeg would pad with grey instead of failing). False means: use `decode_image` (PIL)."""
    if len(data) < 4 or data[-2:] != b"\xff\xd9":
        return False
    frame = jpeg_frame(data)
    if frame is None:
        return False
    marker, precision, height, width, comps, adobe_rgb = frame
    if marker not in _SOF_OK or precision != 8 or height < 1 or width < 1 or height * width > max_pixels:
        return False  # height 0 = defined later by a DNL marker: rare, leave it to PIL
    if len(comps) == 1:
        return True
    if len(comps) != 3 or adobe_rgb or bytes(c[0] for c in comps) == b"RGB":
        return False
    (_, hy, vy), (_, hcb, vcb), (_, hcr, vcr) = comps
    return hy in (1, 2) and vy in (1, 2) and (hcb, vcb) == (hcr, vcr) == (1, 1)


def _as_uint8_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a copy: frombuffer needs writable memory


def decode_jpeg_cpu(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """A plain JPEG (`is_plain_jpeg`) -> uint8 RGB [3, H, W] via torchvision's libjpeg-turbo, EXIF orientation
    applied; bit-identical to `decode_image`. Anything else -> `decode_image` (PIL). Raises `InvalidImage`."""
    if not is_plain_jpeg(data, max_pixels):
        return decode_image_pil(data, max_pixels)
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(_as_uint8_tensor(data), mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError:  # corrupt entropy-coded data: let PIL name the problem (or decode what it can)
        return decode_image_pil(data, max_pixels)
