"""The GPU timer the benchmark scripts share: median of CUDA-event-timed calls on the current stream."""

from __future__ import annotations

import statistics
import time

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


def median_ms(fn, device: torch.device, iters: int = 10, warmup: int = 3) -> float:
    """`cuda_median_ms` on a CUDA device; elsewhere (the probes' CPU dry runs) the median wall time of `iters` calls
    after `warmup` untimed ones."""
    if device.type == "cuda":
        return cuda_median_ms(fn, iters=iters, warmup=warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def graph_per_call_us(calls, replays: int = 5) -> float:
    """Decode-kernel timing as the engine runs them: the `calls` (no-argument callables, each typically on its own
    weight copy or routing) captured in one CUDA graph after two warm-up calls (autotuning happens there), the
    graph replayed once untimed and `replays` times timed; -> median us per call (replay time / len(calls))."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    return 1e3 * cuda_median_ms(graph.replay, iters=replays, warmup=0) / len(calls)
