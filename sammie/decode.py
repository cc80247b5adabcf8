"""Safe decoding of untrusted image bytes into the uint8 RGB tensor the engine batches.

    bytes -> size check from the header (decompression-bomb cap, before any pixel is decoded)
          -> full decode (truncated / corrupt files are errors, never silently padded)
          -> first frame of animations, EXIF orientation, 8-bit RGB (`sammie.preprocess.to_rgb_uint8`:
             grayscale, palette, RGBA, CMYK, 16-bit all handled)              -> uint8 [3, H, W]

Runs on a worker thread (`SammieEngine`'s pool), never on the event loop: PIL holds the GIL for parts of a
decode and a 20 MP JPEG takes ~0.2 s. Every failure is an `InvalidImage` naming the problem; nothing here
touches PIL's process-wide settings (`Image.MAX_IMAGE_PIXELS`, `ImageFile.LOAD_TRUNCATED_IMAGES`).
"""

from __future__ import annotations

import io
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
    """Untrusted bytes -> uint8 RGB tensor [3, H, W] (H, W after EXIF rotation). Raises `InvalidImage`."""
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
