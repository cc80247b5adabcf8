"""Inputs and measurement plumbing of benchmarks/waterfall.py (see its docstring): the JPEG photographs, the
per-case score threshold, the shared `Bench` (device, inputs, ground truth, Meta's model, checkpoint), timing loops,
oracle columns, the per-row memory window and the versions header. Imported by waterfall.py, which puts the
repository and benchmarks/ on sys.path first (sammie, engine_core, gpu_parity).
"""

from __future__ import annotations

import contextlib
import gc
import io
import platform
import subprocess
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

IMAGE_SIZE = (640, 480)  # width, height of every request image (issue 4's reference numbers use 640x480)
JPEG_QUALITY = 90
GAP_RANKS = (5, 20)  # per-case threshold: widest score gap between these ranks (see the module docstring)
# An EngineConfig without one of these fields can only behave as this value: dropped (and noted) when absent.
BASELINE_VALUES = {"compile": "none", "kernels": "reference", "vit_fp8": False}


class Skipped(Exception):
    """A row not run by design (no --http-results, time budget spent): the table says "skipped", not "error"."""


# --------------------------------------------------------------------------------------------------------------
# Inputs and ground truth


def jpeg_photos() -> dict[str, bytes]:
    """gpu_parity's photographs as 640x480 JPEG bytes: 4:3 centre crop, LANCZOS, quality 90 (benchmarks/locustfile.py's
    recipe, so the engine rows see what the HTTP row sees)."""
    from gpu_parity import photos
    from PIL import Image

    out = {}
    w_out, h_out = IMAGE_SIZE
    for name, img in photos().items():
        img = img.convert("RGB")
        w, h = img.size
        if w * h_out > h * w_out:  # too wide: crop width
            cw = h * w_out // h_out
            img = img.crop(((w - cw) // 2, 0, (w - cw) // 2 + cw, h))
        else:
            ch = w * h_out // w_out
            img = img.crop((0, (h - ch) // 2, w, (h - ch) // 2 + ch))
        buf = io.BytesIO()
        img.resize(IMAGE_SIZE, Image.Resampling.LANCZOS).save(buf, format="JPEG", quality=JPEG_QUALITY)
        out[name] = buf.getvalue()
    return out


def decode_pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def threshold_in_gap(scores: np.ndarray, ranks: tuple[int, int] = GAP_RANKS) -> float:
    """Midpoint of the widest gap between consecutive scores (highest first) at ranks lo..hi: keeps lo..hi instances."""
    s = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    hi = min(ranks[1], len(s) - 1)
    lo = max(1, min(ranks[0], hi))
    gaps = s[lo - 1:hi] - s[lo:hi + 1]  # gap after rank k (k = lo..hi, 1-based) is s[k-1] - s[k]
    k = lo - 1 + int(np.argmax(gaps))
    return float((s[k] + s[k + 1]) / 2)


@contextlib.contextmanager
def tf32(enabled: bool):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Bench:
    """What every row shares: device, config, inputs, thresholds, ground truth, Meta's model, the checkpoint file."""

    def __init__(self, args):
        from gpu_parity import PAIRS

        import sam3  # noqa: F401  (its import turns TF32 on; every row sets TF32 explicitly)
        from sammie.config import PRESETS
        from sammie.reference import build_reference_model, randomize_

        self.args = args
        self.dev = torch.device(args.device)
        self.cfg = PRESETS[args.config]()
        self.jpeg = jpeg_photos()
        self.cases = [(n, p) for n, ps in PAIRS for p in ps if n in self.jpeg][:args.cases]  # (photo, prompt)
        self.second_prompt = {n: ps[1] for n, ps in PAIRS if (n, ps[1]) in self.cases}  # for extra_prompt
        t0 = time.perf_counter()
        self.meta = randomize_(build_reference_model(self.cfg, device=self.dev, seed=0), seed=0).eval()
        self.meta_bytes = sum(p.numel() * p.element_size() for p in self.meta.parameters())
        self.tmp = tempfile.TemporaryDirectory(prefix="waterfall-")
        self.checkpoint = str(Path(self.tmp.name) / "sam3.pt")  # Meta layout: "detector." + Sam3Image's keys
        torch.save({"detector." + k: v.detach().cpu() for k, v in self.meta.state_dict().items()}, self.checkpoint)
        self.build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.thresholds, self.truth = {}, {}
        with tf32(False):  # ground truth in true fp32
            for case in self.cases:
                every = self.meta_segment(case, -1.0)
                self.thresholds[case] = threshold_in_gap(np.array([i.score for i in every]))
                self.truth[case] = [i for i in every if i.score > self.thresholds[case]]
        self.truth_s = time.perf_counter() - t0
        self.engines: dict[str, Any] = {}  # live bf16 engines kept for the rows that reuse the best one

    def meta_segment(self, case, threshold: float):
        from sammie.reference import reference_segment

        return reference_segment(self.meta, self.cfg, decode_pil(self.jpeg[case[0]]), case[1], threshold, self.dev)[0]

    def free_meta(self) -> None:
        self.meta = None
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def engine_config(self, values: dict) -> tuple[Any, list[str]]:
        """EngineConfig for a row; baseline values of fields this EngineConfig lacks are dropped (returned)."""
        from sammie.engine import EngineConfig

        have = {f.name for f in fields(EngineConfig)}
        dropped = [k for k, v in values.items() if k not in have and BASELINE_VALUES.get(k, object()) == v]
        args = {k: v for k, v in values.items() if k not in dropped}
        args.update(checkpoint=self.checkpoint, config=self.args.config, device=str(self.dev),
                    max_queued=max(64, 2 * self.args.clients), request_timeout_s=300.0)
        return EngineConfig.from_dict(args), dropped


# --------------------------------------------------------------------------------------------------------------
# Measurement helpers


def summarise(latencies_ms: list[float], n_units: int, elapsed_s: float) -> dict[str, float | int]:
    lat = np.asarray(latencies_ms, dtype=np.float64)
    return {"n": len(lat), "rate": n_units / elapsed_s if elapsed_s > 0 else float("nan"),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "mean_ms": float(lat.mean()), "elapsed_s": elapsed_s}


def timed_loop(step, seconds: float, max_iters: int | None = None, min_iters: int = 1,
               dev: torch.device | None = None) -> list[float]:
    """Run `step(i)` (which must synchronise, or pass dev) until `seconds` passed and >= min_iters; ms per call."""
    out, t_end = [], time.perf_counter() + seconds
    while (time.perf_counter() < t_end or len(out) < min_iters) and (max_iters is None or len(out) < max_iters):
        t = time.perf_counter()
        step(len(out))
        if dev is not None:
            sync(dev)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def oracle_columns(outputs: dict, truth: dict) -> dict[str, Any]:
    """Instance metrics of `outputs[case]` vs `truth[case]` over the cases present in `outputs`."""
    from engine_core.oracle import instance_metrics, run_oracle

    cases = list(outputs)
    report = run_oracle(cases, outputs.__getitem__, truth.__getitem__, [instance_metrics], name_of=str)
    return {
        "iou_mean": report.aggregate("mask_iou", "mean"), "iou_min": report.aggregate("mask_iou", "min"),
        "count_mismatch_pct": 100.0 * report.aggregate("count_mismatch", "mean"),
        "score_max_abs_diff": report.aggregate("max_score_delta", "max"),
        "box_max_abs_diff_px": report.aggregate("max_box_delta_px", "max"),
        "oracle_cases": len(cases), "instances_per_case": report.aggregate("n_ours", "mean"),
        "oracle": report.to_json(),
    }


class MemoryWindow:
    """Peak device memory of one row: max_memory_allocated minus what was allocated at the start, plus `own` bytes
    already resident that belong to the row (a model built earlier)."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.cuda = dev.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self.base = torch.cuda.memory_allocated(dev)

    def peak_gb(self, own_bytes: int = 0) -> float | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.dev)
        return (torch.cuda.max_memory_allocated(self.dev) - self.base + own_bytes) / 1e9


def versions(dev: torch.device) -> dict:
    from importlib import metadata

    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("triton", "sam3", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            out["driver"] = None
    else:
        out["gpu"] = None
        out["cpu"] = platform.processor() or platform.machine()
    return out
