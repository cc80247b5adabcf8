"""CUDA graphs of a lone sequence's prefill: one captured `forward_paged` per token bucket, replayed for every step
that is exactly one prefill chunk from position 0 (a new request while nothing else runs: what time to first token
measures).

Why. Measured on the H200 (benchmarks/results/qwen_profile_run10, full size, a 1k-token prompt through the engine):
the prefill step issued ~5,100 kernels for 82 ms of GPU work in a 281 ms step; the host (Python, launches, Triton's
launcher) was the wall. A replayed graph issues the same work with one launch.

Padding. A graph has fixed shapes, so a chunk of n tokens runs in the smallest bucket b >= n, tokens n..b-1 being
padding (token 0). Padding must not change what the real tokens compute or leave behind:
  - attention: padding comes after the real tokens, which (causal) never see it; its keys / values are written to
    the scratch KV block (one past the scheduler's pool), and the chunk attends over its own keys (position 0: no
    past to gather);
  - Gated DeltaNet: the padding's decay g and write strength beta are set to 0 (`FlatBatch.valid_tokens`), so the
    recurrent state passes through it unchanged (S_t = exp(g) S_{t-1} (I - beta k k^T) + beta v k^T = S_{t-1}); the
    conv state is read at the last real token, on the device;
  - everything else (norms, projections, the MoE) is per token: padding rows cost work, not correctness;
  - logits are taken at token n - 1 (a device index).
The graph works on the scratch GDN state row (zeroed first: a sequence at position 0 starts from zero state) and
copies it to the sequence's own row at the end, so host values (the row) never enter the captured code; the shared
scratch row is also the decode graphs' padding row, which is harmless: steps never overlap.

Static buffers (one int64 block, one host->device copy per step): ids [bmax], slot_mapping [bmax], then valid
tokens, logits index, state row. Positions are arange(bmax) (chunks start at 0).

Requirements, as for the decode graphs: the ops the prefill takes read no device values on the host (fla's GDN
prefill without cu_seqlens: `kernels/gdn_chunk.py`; `moe_align` at prefill sizes, Triton or torch, is sync-free,
and its first-use check runs in the warm-up) and are
warmed (Triton autotuning) before capture. Modes: "capture" (CUDA) and "static" (the same buffers and padding run
eagerly: what the CPU tests compare against the plain path).
"""

from __future__ import annotations

import numpy as np
import torch

from .decode_graphs import BucketGraphs
from .model.paged import FlatBatch, GDNSlots, PagedCache

# tokens. Each bucket costs start-up time: on the H200 (2026-11-30, results/qwen_profile_run11) one 1,024-token
# bucket took 87 s to warm (Triton and fla compile + autotune at the new shapes) and capture in a fresh process; five
# buckets (128 .. 2048) did not finish within ~180 s -- before the autotune table (kernels/tuned/): since then the
# Triton kernels' variants do not depend on the token count, and a 4,096 / 8,192 bucket beside 1,024 / 2,048 added
# ~1-1.5 s of start-up on an H100 (results/long57_run2-4). At most 4x padding below 256 tokens (cheap: the MoE reads
# every expert's weights from ~64 tokens on), at most 4x / 2x above. The buckets share one memory pool (the largest's).
# 4,096 / 8,192 (fifty-seventh session, H100, one process each, results/long57_run3-4): a lone 4,096-token prompt's
# first token 116.4 ms against 136.7-180.0 eager, 8 concurrent 4k requests 189.0 against 122.7-125.0 output tok/s
# (first tokens p50 598 against 1,040-1,043 ms); a lone 8,192-token prompt 229.4 against 252.9 ms, 4 concurrent 8k
# requests 83.4-83.6 against 45.8 tok/s (p50 691-694 against 990 ms). They apply only where a step holds that many
# tokens (max_num_batched_tokens: the H200 / B200 serve configs' 8,192).
DEFAULT_BUCKETS = (256, 1024, 2048, 4096, 8192)


def default_buckets(max_num_batched_tokens: int, max_model_len: int) -> tuple[int, ...]:
    """DEFAULT_BUCKETS up to the largest prefill chunk a step can hold (the smaller of the step's token budget and
    the model length), plus that limit itself when it falls between two buckets."""
    limit = min(max_num_batched_tokens, max_model_len)
    buckets = [b for b in DEFAULT_BUCKETS if b <= limit]
    if limit < DEFAULT_BUCKETS[-1] and (not buckets or buckets[-1] < limit):
        buckets.append(limit)
    return tuple(buckets)


class PrefillGraphs(BucketGraphs):
    """Per-bucket prefill forwards of one sequence from position 0; `run(tokens, block_table, state_slot)` -> logits
    [1, vocab] at the last token."""

    kind, unit = "prefill", "tokens"

    def __init__(self, model, cache: PagedCache, *, buckets: tuple[int, ...], scratch_block: int, scratch_slot: int,
                 device: torch.device, gdn_chunk=None, gdn_conv=None, mode: str = "capture"):
        if not buckets or min(buckets) < 1:
            raise ValueError(f"prefill graph buckets must be positive token counts, got {buckets!r}")
        super().__init__(model, cache, buckets, device, mode)
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        pin = self.device.type == "cuda"
        n = 2 * self.bmax + 3
        self._host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._dev = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._h = self._views(self._host.numpy())
        d = self._views(self._dev)
        self._ids, self._last, self._slot = d["ids"], d["last"], d["slot"]
        positions = torch.arange(self.bmax, device=self.device)
        scratch = torch.tensor([scratch_slot], dtype=torch.int64, device=self.device)
        self._scratch_t = scratch
        self._batches = {
            b: FlatBatch(positions[:b], d["slot_mapping"][:b],
                         block_tables=torch.full((1, 1), scratch_block, dtype=torch.int64, device=self.device),
                         context_lens_t=torch.tensor([b], dtype=torch.int64, device=self.device),
                         state_slots_t=scratch, starts=(0, b), context_lens=(b,), state_slots=(scratch_slot,),
                         num_decode=0, block_size=self.block_size, gdn_chunk=gdn_chunk, gdn_conv=gdn_conv,
                         valid_tokens=d["valid"])
            for b in self.buckets}
        self._warmup_content()

    def _views(self, flat):
        m = self.bmax
        return dict(ids=flat[:m], slot_mapping=flat[m:2 * m], valid=flat[2 * m:2 * m + 1],
                    last=flat[2 * m + 1:2 * m + 2], slot=flat[2 * m + 2:2 * m + 3])

    def _warmup_content(self) -> None:
        """One real token (id 0) of a sequence living in the scratch block and state row: what warm-up and capture
        run on, so that they touch nothing of the scheduler's."""
        self._fill(np.zeros(1, dtype=np.int64), (self.scratch_block,), self.scratch_slot)
        self._dev.copy_(self._host)

    def _fill(self, tokens: np.ndarray, table: tuple[int, ...], slot: int) -> None:
        """Host buffers for a chunk of len(tokens) tokens at positions 0.. of a sequence with `table`, state row
        `slot`; the rest of the largest bucket is padding in the scratch block."""
        n, bs, h = len(tokens), self.block_size, self._h
        p = np.arange(self.bmax)
        h["ids"][:n] = tokens
        h["ids"][n:] = 0
        h["slot_mapping"][:n] = np.asarray(table, dtype=np.int64)[p[:n] // bs] * bs + p[:n] % bs
        h["slot_mapping"][n:] = self.scratch_block * bs + p[n:] % bs
        h["valid"][0], h["last"][0], h["slot"][0] = n, n - 1, slot

    def _forward(self, b: int) -> torch.Tensor:
        """The bucket's step: zero the scratch state row, the model over the b static tokens, logits at the last real
        token, then the scratch row's GDN state copied to the sequence's row."""
        self.cache.reset_slots(self._scratch_t)
        logits = self.model.forward_paged(self._ids[:b], self._batches[b], self.cache, self._last)
        s = self.scratch_slot
        for layer in self.cache.layers:
            if isinstance(layer, GDNSlots):  # clone: the source row lives in the destination tensor
                layer.conv.index_copy_(0, self._slot, layer.conv[s:s + 1].clone())
                layer.recurrent.index_copy_(0, self._slot, layer.recurrent[s:s + 1].clone())
        return logits

    @torch.inference_mode()
    def capture(self) -> float:
        """`decode_graphs.warm_and_capture` of every bucket; kept only if every bucket captured. Touches only the
        scratch block and state row (the warm-up content commits the scratch row to itself). Any failure, warm-up
        included (out of memory at the largest bucket, a compile error), is a CaptureError: the engine then prefills
        eagerly. Returns seconds taken ('static': 0)."""
        if self.mode != "capture":
            return 0.0
        self._host_free()
        self._warmup_content()
        return self._capture()

    def run(self, tokens, block_table: tuple[int, ...], state_slot: int) -> torch.Tensor:
        """One prefill chunk of `tokens` at positions 0.. -> logits [1, vocab] at its last token (a view of the
        bucket's output: consume it before the next call)."""
        n = len(tokens)
        b = self.bucket_for(n)
        if b is None or n == 0:
            raise ValueError(f"a {n}-token prefill: the largest prefill graph holds {self.bmax}")
        if len(block_table) * self.block_size < n:
            raise ValueError(f"{n} tokens do not fit the {len(block_table)} blocks of {self.block_size} given")
        self._host_free()
        self._fill(np.asarray(tokens, dtype=np.int64), block_table, state_slot)
        self._upload(self._host.numel())
        return self._replay(b)
