"""CUDA graphs of the decode step: one captured `forward_paged` per decode batch size (the scheduler's
`decode_buckets`), replayed for every step whose rows are all decode tokens -- the steady state of generation.

Why. Measured on the H200 (benchmarks/results/qwen_profile_run1, full size, eager): a decode step launches ~6,500
kernels; at batch 1 the GPU works 17.6 ms of a 270 ms step (93% of the step is the host issuing launches), at batch
32 42 ms of 330 ms. A replayed graph issues the same kernels with one launch.

Static state. A graph replays fixed pointers and shapes, so each bucket b reads its step from static device buffers
(views of one int64 block, filled by one host->device copy per step):
    ids [b], positions [b], slot_mapping [b], context_lens [b], state_slots [b], block_tables [b, max_blocks]
and writes logits into its own output tensor [b, vocab] (valid until the next replay; the runner samples from it
at once). Rows n..b-1 of a step with n < b decode rows are padding: token 0 at position 0 of a scratch sequence
whose one KV block (`scratch_block`, one past the scheduler's pool) and GDN state row (`scratch_slot`, one past the
scheduler's slots) nobody else owns, so padding writes land there and every real row computes exactly what it
would alone (rows never mix: attention, the GDN step, norms and the MoE are per token).

Requirements on the model's decode path (met by `forward_paged` with `FlatBatch.decode_attention` and
`gdn_decode` set from the registry): no host reads of device values, shapes fixed by the bucket, no allocation
outside the graph's pool. Attention uses the paged decode kernel (`kernels/paged_attention.py`, bounds read on the
device); the eager fallback `paged_decode_attention` sizes its gather from host context lengths and cannot be
captured. Triton autotuning happens in the warm-up runs before capture.

Modes: "capture" (CUDA graphs; CUDA only) and "static" (the same static buffers and padding, run eagerly: what the
CPU tests compare against the plain path, and a debugging aid on the GPU).
"""

from __future__ import annotations

import logging
import time

import torch

from .model.paged import FlatBatch, PagedCache

log = logging.getLogger(__name__)

MODES = ("capture", "static")


class CaptureError(RuntimeError):
    """The decode step cannot be captured (a chosen kernel reads device values on the host, or capture failed)."""


_FIELDS = ("ids", "positions", "slot_mapping", "context_lens", "state_slots")  # then block_tables


class BucketGraphs:
    """What the decode and prefill graphs share: a forward per bucket over static buffers (`_forward(b)`, the
    subclass's), captured as CUDA graphs ("capture") or run eagerly ("static"); the static inputs uploaded from a
    pinned host block (`_host` -> `_dev`) whose rewrite waits for the previous upload; replay counts and stats."""

    kind = "bucket"  # "decode" / "prefill": names in errors and logs
    unit = "bucket sizes"  # what a bucket counts, for the log

    def __init__(self, model, cache: PagedCache, buckets: tuple[int, ...], device: torch.device, mode: str):
        if mode not in MODES:
            raise ValueError(f"{self.kind} graph mode must be one of {MODES}, got {mode!r}")
        if mode == "capture" and torch.device(device).type != "cuda":
            raise ValueError(f"{self.kind} graph mode 'capture' needs a CUDA device ('static' runs the same path "
                             f"eagerly)")
        self.model, self.cache, self.mode = model, cache, mode
        self.buckets = tuple(sorted(set(buckets)))
        self.bmax = self.buckets[-1]
        self.device = torch.device(device)
        self.block_size = cache.block_size
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.capture_s: float | None = None
        self.replays = {b: 0 for b in self.buckets}
        self._copied: torch.cuda.Event | None = None

    def _forward(self, b: int) -> torch.Tensor:
        raise NotImplementedError

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _capture(self, check=None) -> float:
        """`warm_and_capture` of every bucket, kept only if every bucket captured ('static': nothing, 0 s)."""
        if self.mode != "capture":
            return 0.0
        t0 = time.perf_counter()
        self._graphs, self._outputs = warm_and_capture(self._forward, self.buckets, self.device,
                                                       f"{self.kind} graph ({self.unit})", check)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %s graphs for %s %s in %.1f s", self.kind, self.unit, list(self.buckets), self.capture_s)
        return self.capture_s

    @property
    def captured(self) -> bool:
        return len(self._graphs) == len(self.buckets)

    def _host_free(self) -> None:
        """Wait until the last upload has left the pinned host block (normally long done: it ran before the replay
        the host has since waited for, or before the step now running ahead of this one with async_decode)."""
        if self._copied is not None:
            self._copied.synchronize()

    def _upload(self, end: int) -> None:
        """Copy the host block's first `end` entries to the device (non-blocking) and mark when that is done."""
        self._dev[:end].copy_(self._host[:end], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _replay(self, b: int) -> torch.Tensor:
        """The bucket's forward over the uploaded inputs: its graph's replay, or the forward itself ('static')."""
        self.replays[b] += 1
        if self.mode == "capture":
            self._graphs[b].replay()
            return self._outputs[b]
        with torch.inference_mode():
            return self._forward(b)

    def stats(self) -> dict:
        return {"mode": self.mode, "buckets": list(self.buckets), "captured": self.captured,
                "capture_s": None if self.capture_s is None else round(self.capture_s, 2),
                "replays": {str(b): n for b, n in self.replays.items() if n}}


class DecodeGraphs(BucketGraphs):
    """Per-bucket decode forwards over static buffers; `run(rows)` -> logits [n, vocab]."""

    kind, unit = "decode", "batch sizes"

    def __init__(self, model, cache: PagedCache, *, buckets: tuple[int, ...], max_blocks: int, scratch_block: int,
                 scratch_slot: int, device: torch.device, gdn_decode, decode_attention, gdn_prep=None,
                 mode: str = "capture", gdn_prep_ba=None):
        super().__init__(model, cache, buckets, device, mode)
        if decode_attention is None:
            raise ValueError("decode graphs need a paged decode attention op (kernels/paged_attention.py)")
        self.max_blocks = max_blocks
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        bmax = self.bmax
        n = len(_FIELDS) * bmax + bmax * max_blocks
        pin = self.device.type == "cuda"
        self._host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._dev = torch.zeros(n, dtype=torch.int64, device=self.device)
        views = self._views(self._dev)
        self._host_views = self._views(self._host.numpy())  # numpy views: cheap per-row writes on the host
        self._pad_rows(0, bmax)
        self._dev.copy_(self._host)
        self._batches = {
            b: FlatBatch(views["positions"][:b], views["slot_mapping"][:b], views["block_tables"][:b],
                         views["context_lens"][:b], views["state_slots"][:b], starts=tuple(range(b + 1)),
                         context_lens=(1,) * b, state_slots=tuple(range(b)), num_decode=b,
                         block_size=self.block_size, gdn_decode=gdn_decode, decode_attention=decode_attention,
                         gdn_prep=gdn_prep, gdn_prep_ba=gdn_prep_ba)
            for b in self.buckets}
        self._ids = views["ids"]

    def _views(self, flat):
        bmax = self.bmax
        v = {name: flat[i * bmax:(i + 1) * bmax] for i, name in enumerate(_FIELDS)}
        v["block_tables"] = flat[len(_FIELDS) * bmax:].reshape(bmax, self.max_blocks)
        return v

    def _pad_rows(self, lo: int, hi: int) -> None:
        """Host rows lo..hi-1 -> the scratch sequence: token 0 at position 0 in the scratch block and state row."""
        h = self._host_views
        h["ids"][lo:hi] = 0
        h["positions"][lo:hi] = 0
        h["slot_mapping"][lo:hi] = self.scratch_block * self.block_size
        h["context_lens"][lo:hi] = 1
        h["state_slots"][lo:hi] = self.scratch_slot
        h["block_tables"][lo:hi] = self.scratch_block

    def _forward(self, b: int) -> torch.Tensor:
        return self.model.forward_paged(self._ids[:b], self._batches[b], self.cache, None)

    @torch.inference_mode()
    def capture(self, blockers=None) -> float:
        """`warm_and_capture` of every bucket; the graphs are kept only if every bucket captured. Touches only the
        scratch block and state row. `blockers()` (after the warm-up) lists the chosen implementations that cannot
        be captured (host reads); any -> CaptureError before capturing. Returns seconds taken ('static': 0)."""
        def check() -> None:
            found = list(blockers()) if blockers is not None else []
            if found:
                raise CaptureError("decode graphs cannot be captured: " + "; ".join(found))

        return self._capture(check)

    def run(self, rows: list[tuple[int, int, tuple[int, ...], int]],
            fed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """rows: (token id, position, block table, state slot) per decode sequence -> logits [n, vocab] (a view of
        the bucket's output: consume it before the next call). `fed` (ids [M] on the device, index [n]): the rows'
        input tokens are ids[index], copied on the device after the host's fields (a step formed ahead, whose inputs
        the host has not seen; the rows' token ids are then placeholders)."""
        n = len(rows)
        b = self.bucket_for(n)
        if b is None or n == 0:
            raise ValueError(f"{n} decode rows: the largest decode graph holds {self.bmax}")
        self._host_free()
        h, bs = self._host_views, self.block_size
        for i, (tok, pos, table, slot) in enumerate(rows):
            nb = len(table)
            if nb > self.max_blocks or pos // bs >= nb:
                raise ValueError(f"decode row {i}: position {pos} / {nb} blocks exceed the graph's "
                                 f"{self.max_blocks} blocks of {bs}")
            h["ids"][i] = tok
            h["positions"][i] = pos
            h["slot_mapping"][i] = table[pos // bs] * bs + pos % bs
            h["context_lens"][i] = pos + 1
            h["state_slots"][i] = slot
            h["block_tables"][i, :nb] = table  # entries past the context are never read (the kernel's bounds)
        self._pad_rows(n, b)  # rows a previous, larger step filled
        # one H2D copy of the fields and the first b block-table rows (a prefix of the layout)
        self._upload(len(_FIELDS) * self.bmax + b * self.max_blocks)
        if fed is not None:  # one gather straight into the graph's input ids
            torch.index_select(fed[0], 0, fed[1], out=self._ids[:n])
        return self._replay(b)[:n]


def warm_and_capture(forward, buckets: tuple[int, ...], device: torch.device, what: str,
                     check=None) -> tuple[dict, dict]:
    """The decode and prefill graphs' capture: `forward(b)` of every bucket twice on a side stream (lazy allocations,
    Triton autotuning, the kernels' registry choices), then `check()` (may raise CaptureError), then one capture per
    bucket, largest first, into one memory pool. Returns ({bucket: graph}, {bucket: output}). Any failure, the warm-up
    included (out of memory at the largest bucket, a compile error), is a CaptureError naming `what`, the stage and
    the bucket; nothing is kept then."""
    b, stage = buckets[-1], "warm-up"
    with torch.cuda.device(device):
        pool, graphs, outputs = None, {}, {}
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for b in buckets:
                    for _ in range(2):
                        forward(b)
            torch.cuda.current_stream(device).wait_stream(side)
            torch.cuda.synchronize(device)
            if check is not None:
                check()
            stage = "capture"
            for b in reversed(buckets):
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls of other threads (the event loop) cannot invalidate this capture
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    outputs[b] = forward(b)
                pool = graph.pool()
                graphs[b] = graph
        except CaptureError:
            raise
        except Exception as exc:
            # the stack of the call that broke the capture (a sync, an allocation or a module load the capture cannot
            # hold): the CaptureError's one line does not name it
            log.warning("%s %s failed at %d: where", what, stage, b, exc_info=exc)
            raise CaptureError(f"{what} {stage} failed at {b}: {exc!r}") from exc
        torch.cuda.synchronize(device)
    return graphs, outputs


def as_rows(plan) -> list[tuple[int, int, tuple[int, ...], int]]:
    """A decode-only StepPlan -> `DecodeGraphs.run` rows."""
    return [(s.token_ids[0], s.start, s.block_table, s.state_slot) for s in plan.seqs]

