"""The GPU timer the benchmark scripts share: median of CUDA-event-timed calls on the current stream."""

from __future__ import annotations

import statistics

import torch


def cuda_median_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median wall time of `fn` in ms over `iters` calls, each bracketed by CUDA events, after `warmup` untimed
    calls and a synchronize (so queued warm-up work is not counted)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
