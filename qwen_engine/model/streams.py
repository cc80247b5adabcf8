"""The decode step's second CUDA stream: independent work of a layer forked onto it and joined back, which the decode
and prefill CUDA graphs capture as parallel branches (the engine's `shared_expert_stream`: `SparseMoE.shared_stream`;
`gdn_z_stream`: `GatedDeltaNet.z_stream`).

Why: a lone decode step is a chain of ~550 small kernels, each latency-bound (H200: the W4A16 GEMV reads its
weights at ~0.7 TB/s of ~4.8), so two independent ones run side by side cost little more than one.

Use: `with branch(device) as side:` opens the window: the side stream waits for everything issued on the main
stream so far; work issued under `with on_side(side):` runs on it; the rest of the body runs on the main stream beside
it; leaving the window (also by an exception, so that a failed capture reports its own error, not unjoined work)
makes the main stream wait for the side stream. The forked work may read only tensors ready when the window opens;
its outputs are read after the window. Memory: tensors the fork reads were made on the main stream and are freed
there after the window; tensors it makes are freed after their main-stream readers were issued, and the side
stream's next work waits on the main stream again (the next window), so a block the caching allocator hands out
again is never still in use. Split-K arrival counters: the side stream's launches use their own set
(`kernels.split_k.counters_of("side")`), as they may overlap the main stream's. One side stream per device, made
during the eager warm-up (the form measured on the H200): the argument above assumes every window on it is opened
from one main stream at a time -- one engine per process, its steps on one thread, as deployed. Two engines stepping
on one GPU from two threads would need a side stream each (keyed by main stream; a side stream made during a
capture is not measured).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def forkable(x: torch.Tensor) -> bool:
    """Whether work on x can be forked: CUDA tensors (tests stub this, `fork` and `join` to run the forked code
    paths on the CPU, where `torch.cuda.stream(None)` is a no-op)."""
    return x.is_cuda


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's second stream, made on first use (the engine's warm-up, before any graph capture) and kept for
    the process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _SIDE_STREAMS[index]


def fork(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(main, side): the side stream waits for everything issued on the main stream so far (under capture it joins
    the graph here)."""
    main, side = torch.cuda.current_stream(device), side_stream(device)
    side.wait_stream(main)
    return main, side


def join(main: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
    """The main stream waits for the forked work (under capture: the branch's edge back)."""
    main.wait_stream(side)


@contextmanager
def branch(device: torch.device):
    """The fork window (module docstring); yields the side stream for `on_side`."""
    main, side = fork(device)
    try:
        yield side
    except BaseException:
        try:  # joined also here; a join that fails too (an invalidated capture) must not hide the first error
            join(main, side)
        except Exception:
            pass
        raise
    join(main, side)


@contextmanager
def on_side(side: torch.cuda.Stream | None):
    """Issue work on the side stream, with the side stream's own split-K counters."""
    from kernels.split_k import counters_of

    with torch.cuda.stream(side), counters_of("side"):
        yield
