"""The next decoder layer's weights pulled into L2 while this layer runs, on a detached stream (the engine's
`weight_warm_ahead`; kernels/l2_warm.py).

In a decode step of at most MAX_ROWS tokens, at the start of layer i the warm stream forks off the main stream and
queues reads of layer i + 1's weights -- every parameter and buffer outside the routed experts (which the step's router
picks only in layer i + 1) of at least MIN_BYTES: the FP8 projections (GDN in_proj 25 MB and out_proj 8 MB, attention
q/k/v 19 MB and o_proj 8 MB), the router (1 MB), the shared expert (1.5 MB). The main stream waits for the warm stream
only after the last layer, so no kernel of the chain waits for a warm-up; in a CUDA graph the warm-ups are a branch
joined at the end. Warm-ups only read weights and write the warm kernel's own checksum buffer, so the step's outputs
are the same bits with or without them.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import nn

from . import streams

MODES = ("off", "load", "load_last", "prefetch")  # kernels/l2_warm.py MODES, or off
MAX_ROWS = 4  # steps of up to this many tokens: the decode graphs' buckets, where the step is a latency-bound chain;
#               above, the routed experts' reads dominate and the projections are read once per step anyway
MIN_BYTES = 512 * 1024  # smaller tensors (norm weights, conv taps, b / a rows) are not worth a launch each


def layer_weights(layer: nn.Module, min_bytes: int | None = None) -> list[torch.Tensor]:
    """One tensor per storage among `layer`'s parameters and buffers outside `layer.mlp.experts` (the routed experts),
    each storage of at least `min_bytes` (None: MIN_BYTES), in module order. A projection that is a view of a fused
    buffer (`quantized.fused_fp8_projections`) stands for the whole buffer (`l2_warm.words_of`)."""
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    skip = set() if experts is None else {id(t) for t in chain(experts.parameters(), experts.buffers())}
    seen, out = set(), []
    for t in chain(layer.parameters(), layer.buffers()):
        if id(t) in skip:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() < min_bytes:
            continue
        seen.add(storage.data_ptr())
        out.append(t)
    return out


class WarmAhead:
    """One step's warm-ups: `issue(layer)` forks the warm stream off the main stream at this point and queues the
    layer's weight reads on it; `join()` makes the main stream wait for all of them (call it once, at the step's
    end)."""

    def __init__(self, device: torch.device, mode: str):
        from kernels import l2_warm

        self.mode, self.device, self.warm = mode, device, l2_warm.warm
        self.main, self.side, self.forked = None, None, False

    def issue(self, layer: nn.Module) -> None:
        self.main, self.side = streams.fork_warm(self.device)
        self.forked = True
        with torch.cuda.stream(self.side):
            for t in layer_weights(layer):
                self.warm(t, self.mode)

    def join(self) -> None:
        if self.forked:
            streams.join(self.main, self.side)


def start(x: torch.Tensor, mode: str) -> WarmAhead | None:
    """The step's warm-ups for its flat tokens x [N, hidden], or None: mode off, not a CUDA step, or more than
    MAX_ROWS tokens."""
    if mode == "off" or x.shape[0] > MAX_ROWS or not streams.forkable(x):
        return None
    return WarmAhead(x.device, mode)
