"""The decode step's second CUDA stream: independent work of a layer forked onto it and joined back, which the decode
and prefill CUDA graphs capture as parallel branches (the engine's `shared_expert_stream`: `SparseMoE.shared_stream`;
`gdn_z_stream`: `GatedDeltaNet.z_stream`).

Why: a lone decode step is a chain of ~550 small kernels, each latency-bound (H200: the W4A16 GEMV reads its
weights at ~0.7 TB/s of ~4.8), so two independent ones run side by side cost little more than one.

Contract of a fork (`fork` then `join`): the forked work reads only tensors that are ready when the fork is issued;
its outputs are read on the main stream only after `join`. Memory: tensors the fork reads were made on the main
stream and are freed there after the join; tensors it makes are freed after their main-stream readers were issued,
and the side stream's next work waits on the main stream again (the next fork), so a block the caching allocator
hands out again is never still in use.
"""

from __future__ import annotations

import torch

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def forkable(x: torch.Tensor) -> bool:
    """Whether work on x can be forked: CUDA tensors (tests stub this, `fork` and `join` to run the forked code
    paths on the CPU, where `torch.cuda.stream(None)` is a no-op)."""
    return x.is_cuda


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One second stream per CUDA device, made on first use (the engine's warm-up, before any graph capture) and
    kept for the process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _SIDE_STREAMS[index]


def fork(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(main, side): the side stream waits for everything issued on the main stream so far (under capture it joins
    the graph here); run the forked work under `torch.cuda.stream(side)`."""
    main, side = torch.cuda.current_stream(device), side_stream(device)
    side.wait_stream(main)
    return main, side


def join(main: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
    """The main stream waits for the forked work (under capture: the branch's edge back)."""
    main.wait_stream(side)
