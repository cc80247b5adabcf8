"""Why Sammie does not decode JPEGs on the GPU: 28 JPEGs (4 photographs x quality 90 / 75 + 4:2:2 / 95 + 4:4:4 /
progressive / grayscale, then 8 EXIF orientations of the fourth) decoded by torchvision's nvJPEG path in one batched
call, one call per image, and batched without the grayscale ones; each image's mean |diff| against PIL (torchvision's
own tests allow 2 levels).

Written for a test that failed on the GPU (2026-12-02: image 15, the fourth photograph at quality 90, 13.1 levels
off): `sammie.decode.decode_jpeg_batch_cuda` and that test were removed after nvjpeg_probe run 1 (RESULTS.md).

    python benchmarks/nvjpeg_probe.py --out DIR      # CUDA only; writes DIR/nvjpeg_probe.json, prints one line a case
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sammie.decode import DEFAULT_MAX_PIXELS as MAX_PIXELS  # noqa: E402
from sammie.decode import _as_uint8_tensor, decode_image_pil  # noqa: E402
from tests.test_decode import _exif_jpeg, jpeg  # noqa: E402
from tests.test_engine import photos  # noqa: E402


def cases() -> list[tuple[str, bytes]]:
    out = []
    for p, array in enumerate(photos()):
        out += [(f"photo{p} q90", jpeg(array, quality=90)),
                (f"photo{p} q75 4:2:2", jpeg(array, quality=75, subsampling=1)),
                (f"photo{p} q95 4:4:4", jpeg(array, quality=95, subsampling=0)),
                (f"photo{p} q85 progressive", jpeg(array, quality=85, progressive=True)),
                (f"photo{p} grayscale", jpeg(array[..., 0].copy(), quality=90))]
    out += [(f"photo3 exif {o}", _exif_jpeg(photos()[3], o)) for o in range(1, 9)]
    return out


def mean_diff(got: torch.Tensor, ref: torch.Tensor) -> float | None:
    if tuple(got.shape) != tuple(ref.shape):
        return None
    return float((got.cpu().int() - ref.int()).abs().float().mean())


def main() -> None:
    import torchvision
    from torchvision.io import ImageReadMode, decode_jpeg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = cases()
    refs = [decode_image_pil(d, MAX_PIXELS) for _, d in data]
    tensors = [_as_uint8_tensor(d) for _, d in data]

    def decode(batch):
        return list(decode_jpeg(batch, mode=ImageReadMode.RGB, apply_exif_orientation=True, device="cuda"))

    batched = decode(tensors)
    single = [decode([t])[0] for t in tensors]
    colour = [i for i, (name, _) in enumerate(data) if "grayscale" not in name]
    colour_batched = dict(zip(colour, decode([tensors[i] for i in colour])))
    again = decode(tensors)  # the same batch twice: deterministic?
    rows = []
    for i, (name, _) in enumerate(data):
        row = {"i": i, "case": name, "shape": list(refs[i].shape), "batched": mean_diff(batched[i], refs[i]),
               "single": mean_diff(single[i], refs[i]), "batched_without_gray": (
                   mean_diff(colour_batched[i], refs[i]) if i in colour_batched else None),
               "batched_again_equal": bool(torch.equal(again[i], batched[i]))}
        rows.append(row)
        print("[nvjpeg_probe]", json.dumps(row))
    def off(key):  # >= 2 levels off, or the wrong shape (None); batched_without_gray is None for the grayscale ones
        return [r["i"] for r in rows if (r[key] is None and not (key == "batched_without_gray" and
                                                                 "grayscale" in r["case"])) or (r[key] or 0) >= 2.0]

    print(f"[nvjpeg_probe] >= 2 levels off or the wrong shape: batched {off('batched')}; single {off('single')}; "
          f"batched without grayscale {off('batched_without_gray')}")
    with open(os.path.join(args.out, "nvjpeg_probe.json"), "w") as f:
        json.dump({"torch": torch.__version__, "torchvision": torchvision.__version__,
                   "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
