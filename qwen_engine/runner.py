"""ModelRunner: executes one `StepPlan` of the continuous scheduler on the device -> `StepOutput`.

    plan (host: token ids, positions, block tables, state slots)
      -> FlatBatch: flat input_ids [N], positions, slot_mapping, block tables [S, max_blocks], state slots
         (one pinned host->device copy per field, non-blocking)
      -> zero the GDN state slots of sequences that start at position 0 (new, or resumed after preemption)
      -> model.forward_paged: logits only at the last token of each sampling row  [M, vocab]
         (and at the positions of the rows' prompt targets, when a request asks for prompt log-probabilities)
      -> engine_core.sampling.sample (no host syncs)  -> the one device->host copy of the step: M token ids
         (and, when a row's request asks for log-probabilities, `token_logprobs`' three small tensors beside them;
         for prompt log-probabilities, three more over the prompt targets)

It owns the paged state (`PagedCache`): the KV pool of every full-attention layer and the GDN state slots. The
kernel registry of the runner picks the GDN decode step (`kernels/gdn_decode.py`: Triton on CUDA, the torch
reference otherwise or when `kernels="reference"`). Not thread-safe: one caller (the engine's step worker).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass

import torch

from engine_core.continuous import StepOutput, StepPlan, TokenLogprobs
from engine_core.registry import KernelPreference, Registry
from engine_core.sampling import SamplingTensors, sample, token_logprobs

from .config import FULL_ATTENTION, LINEAR_ATTENTION, QwenConfig
from .model.paged import FlatBatch, PagedCache


def kv_block_bytes(cfg: QwenConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across every full-attention layer (k and v), pools of `dtype`."""
    n_layers = sum(t == FULL_ATTENTION for t in cfg.layer_types)
    return 2 * n_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize


def gdn_state_bytes(cfg: QwenConfig, num_slots: int, dtype: torch.dtype,
                    state_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of `num_slots` GDN state rows across every linear-attention layer (conv in dtype, recurrent in
    state_dtype)."""
    n_layers = sum(t == LINEAR_ATTENTION for t in cfg.layer_types)
    conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype.itemsize
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_dtype.itemsize
    return n_layers * num_slots * (conv + rec)


@dataclass
class PendingStep:
    """A launched step (`ModelRunner.launch`): its sampled ids are computed or being computed on the device, on their
    way to the host; `ModelRunner.result` waits for them."""

    plan: StepPlan
    ids: torch.Tensor | None  # [M] int64 sampled ids on the device (None: nothing samples); a step formed ahead
    #                           (StepPlan.feed_from) reads its inputs from here
    host: torch.Tensor | None  # [M] the same ids in (pinned) host memory once `event` has passed
    event: torch.cuda.Event | None  # recorded after the device->host copy (CUDA); None: `host` is ready
    launch_s: float  # host seconds spent launching
    # `token_logprobs`' (sampled [M], top [M, n], top ids [M, n]) in host memory, copied before `event`; None when no
    # row of the plan asks for log-probabilities
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # the same over the plan's prompt targets, rows concatenated ([P], [P, n], [P, n]); None when no row has any
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


# prompt targets' rows a log-softmax takes at once (`launch`): its fp32 copies of the logits stay ~250 MB at Qwen's
# 248,320-token vocabulary
PROMPT_LOGPROBS_ROWS = 128
RUNNER_KERNEL_MODULES = ("kernels.gdn_decode", "kernels.paged_attention", "kernels.gdn_prep", "kernels.gdn_chunk",
                         "kernels.gdn_conv", "kernels.argmax_rows")
DECODE_GRAPH_MODES = ("auto", "capture", "static", "off")


def _takes_gated_op(model: torch.nn.Module) -> bool:
    """Whether any attention layer of `model` hands its o_proj FP8 codes (a producer scale: `quantized.producer_scale`),
    i.e. would call the gated attention op under attn_gate_in_combine."""
    from .model.attention import GatedAttention
    from .model.quantized import producer_scale

    return any(isinstance(m, GatedAttention) and producer_scale(m, ("o_proj",)) is not None for m in model.modules())


def gdn_registry(preference: KernelPreference | str = KernelPreference.AUTO) -> Registry:
    """A registry with the ops the runner calls (its own, so an engine's preference does not leak into others):
    the GDN decode step and its prep, the GDN prefill, the paged decode attention and the greedy sampler's argmax."""
    registry = Registry(preference)
    for module in RUNNER_KERNEL_MODULES:
        importlib.import_module(module).register(registry)
    return registry


class ModelRunner:
    """The model plus its paged state on one device; `execute(plan) -> StepOutput`."""

    def __init__(self, model, cfg: QwenConfig, device: torch.device | str, num_blocks: int, block_size: int,
                 max_num_seqs: int, registry: Registry | None = None, *, max_model_len: int | None = None,
                 decode_buckets: tuple[int, ...] = (), decode_graphs: str = "off", prefill_graphs: str = "off",
                 prefill_buckets: tuple[int, ...] = (), state_dtype: torch.dtype = torch.float32,
                 kv_dtype: torch.dtype | None = None):
        """`decode_graphs` (see `decode_graphs.py`): "capture" (CUDA graphs per decode bucket, captured by
        `capture_decode_graphs()`), "static" (the same static-buffer path run eagerly), "off" (every step eager),
        "auto" (capture on CUDA, off elsewhere). `decode_buckets`: the scheduler's decode batch sizes (last =
        max_num_seqs); `max_model_len` sizes the graphs' block tables. `prefill_graphs` (same modes;
        `prefill_graphs.py`): graphs of a lone sequence's prefill from position 0, one per `prefill_buckets` token
        count (captured by `capture_prefill_graphs()`; () = `default_buckets` up to max_model_len: the engine passes
        its own, bounded by its step token budget too). `state_dtype`: the GDN recurrent state pool's
        (`QwenEngineConfig.gdn_state_dtype`); `kv_dtype`: the KV pools' (None: the model's; `kv_cache_dtype`)."""
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.registry = registry if registry is not None else gdn_registry()
        dtype = model.embed_tokens.weight.dtype  # packed NVFP4/FP8 modules hold uint8/e4m3 buffers, not this
        # one block and one GDN state row past the scheduler's: the scratch sequence of the decode graphs' padding
        self.cache = PagedCache.empty(cfg, num_blocks + 1, block_size, max_num_seqs + 1, dtype, self.device,
                                      state_dtype=state_dtype, kv_dtype=kv_dtype)
        if max_model_len is not None and hasattr(model, "rotary"):  # the rotary cos / sin of every position a step
            model.rotary.reserve(max_model_len, self.device, dtype)  # can hold (< max_model_len): one gather a step
        self.steps = 0  # steps whose sampled ids were read (`result`)
        self.launches = 0  # steps queued on the device (`launch`): async decode keeps one ahead of `steps`
        self.graph_steps = 0
        self.prefill_graph_steps = 0
        self.busy_s = 0.0  # host wall time in launch + result (incl. the wait for the sampled ids) of read steps
        # the feed index of a step formed ahead, kept on the device while it repeats (a batch that does not change
        # repeats it every step): one host->device copy fewer between two decode steps
        self._feed_index: tuple[tuple[int, ...], torch.Tensor] | None = None
        # penalized requests' output-token counts per GDN state slot [max_num_seqs, vocab] int32, made on first use:
        # a penalized row's slot is set at its reset row (zeros, or its outputs before a preemption) and counts each
        # token it samples, on the device, so steps formed ahead see the token of the step before them
        self._counts: torch.Tensor | None = None
        # greedy ids by the registry's "argmax_rows" (one launch spread over the GPU) instead of torch.argmax (one
        # block a row): QwenEngineConfig.argmax_kernel
        self.argmax_kernel = False
        for name, mode in (("decode_graphs", decode_graphs), ("prefill_graphs", prefill_graphs)):
            if mode not in DECODE_GRAPH_MODES:
                raise ValueError(f"{name} must be one of {DECODE_GRAPH_MODES}, got {mode!r}")
        if decode_graphs == "auto":
            decode_graphs = "capture" if self.device.type == "cuda" else "off"
        if prefill_graphs == "auto":
            prefill_graphs = "capture" if self.device.type == "cuda" else "off"
        self.prefill_graphs = None
        self.prefill_graphs_disabled: str | None = None
        if prefill_graphs != "off":
            from .prefill_graphs import PrefillGraphs, default_buckets

            if not prefill_buckets and max_model_len is None:
                raise ValueError("prefill graphs need prefill_buckets or max_model_len")
            self.prefill_graphs = PrefillGraphs(
                model, self.cache, buckets=tuple(prefill_buckets) or default_buckets(max_model_len, max_model_len),
                scratch_block=num_blocks, scratch_slot=max_num_seqs, device=self.device,
                gdn_chunk=self._gdn_chunk if self.device.type == "cuda" else None, gdn_conv=self._gdn_conv,
                mode=prefill_graphs)
        self.graphs = None
        self.graphs_disabled: str | None = None
        if decode_graphs != "off":
            from .decode_graphs import DecodeGraphs

            if max_model_len is None:
                raise ValueError("decode graphs need max_model_len (the block tables' width)")
            self.graphs = DecodeGraphs(
                model, self.cache, buckets=tuple(decode_buckets) or (max_num_seqs,),
                max_blocks=-(-max_model_len // block_size), scratch_block=num_blocks, scratch_slot=max_num_seqs,
                device=self.device, gdn_decode=self._gdn_decode, decode_attention=self._decode_attention,
                gdn_prep=self._gdn_prep, mode=decode_graphs, gdn_prep_ba=self._gdn_prep_ba)

    def _gdn_decode(self, q, k, v, g, beta, pool, rows, norm=None):
        """o [B, H, Dv]; `norm` = (z, weight, eps, input_scale): the gated norm of o and its FP8 codes instead, from
        the same launch ("gdn_decode_rows_norm_fp8")."""
        if norm is not None:
            return self.registry.call("gdn_decode_rows_norm_fp8", q, k, v, g, beta, pool, rows, *norm)[:2]
        return self.registry.call("gdn_decode_rows", q, k, v, g, beta, pool, rows)[0]

    def _gdn_prep(self, *args):
        return self.registry.call("gdn_decode_prep", *args)

    def _gdn_prep_ba(self, *args):
        return self.registry.call("gdn_decode_prep_ba", *args)

    def _gdn_chunk(self, q, k, v, g, beta, states, cu_seqlens, cu_seqlens_cpu=None):
        return self.registry.call("gdn_chunk_prefill", q, k, v, g, beta, states, cu_seqlens, cu_seqlens_cpu)

    def _gdn_conv(self, x, conv_pool, row, conv_w, valid=None):
        return self.registry.call("gdn_prefill_conv", x, conv_pool, row, conv_w, valid)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy ids of logits [B, V] (the registry's "argmax_rows": one launch spread over the GPU)."""
        return self.registry.call("argmax_rows", logits)

    def _decode_attention(self, q, k_pool, v_pool, block_tables, context_lens, scale):
        return self.registry.call("paged_decode_attention", q, k_pool, v_pool, block_tables, context_lens, scale)

    def capture_blockers(self) -> list[str]:
        """The decode path's chosen implementations that read device values on the host and so cannot be captured
        (valid after a decode step ran): the paged-attention references (host context lengths; the gated one with
        attn_gate_in_combine) and the packed MoE reference (`nonzero`). The other references (GDN step, dense W4A16,
        FP8) are plain tensor code."""
        found = []
        if self.registry.choices().get("paged_decode_attention", {}).get("last") == "reference":
            found.append("paged_decode_attention runs its reference (kernels preference, device or dtype)")
        from engine_core.registry import default_registry

        from .model import attention

        gated = default_registry().choices().get(attention.GATED_OP, {}).get("last")
        # attn_gate_in_combine: the op the model calls where its attention layers hand o_proj FP8 codes (the choice
        # is process-wide: another model's calls must not block this one)
        if attention.GATE_IN_COMBINE and gated == "reference" and _takes_gated_op(self.model):
            found.append(f"{attention.GATED_OP} runs its reference (kernels preference, device or dtype)")
        from .model.quantized import NVFP4Experts

        if any(isinstance(m, NVFP4Experts) and m.implementation == "reference" for m in self.model.modules()):
            found.append("the packed MoE (w4a16_moe) runs its reference")
        return found

    def capture_decode_graphs(self) -> float | None:
        """Capture the decode graphs (mode "capture"). Raises `decode_graphs.CaptureError` (graphs left
        uncaptured, eager decode still works) when a chosen kernel cannot be captured or capture fails. Returns
        seconds taken, None without graphs."""
        if self.graphs is None:
            return None
        return self.graphs.capture(self.capture_blockers)

    def capture_prefill_graphs(self) -> float | None:
        """Capture the prefill graphs (mode "capture"); `decode_graphs.CaptureError` when capture fails (the graphs
        stay uncaptured; eager prefill still works). Returns seconds taken, None without prefill graphs."""
        if self.prefill_graphs is None:
            return None
        return self.prefill_graphs.capture()

    def disable_prefill_graphs(self, reason: str) -> None:
        """Run every prefill eagerly from now on (after a failed capture); `reason` shows in stats."""
        self.prefill_graphs = None
        self.prefill_graphs_disabled = reason

    def disable_graphs(self, reason: str) -> None:
        """Run every step eagerly from now on (after a failed capture in "auto" mode); `reason` shows in stats."""
        self.graphs = None
        self.graphs_disabled = reason

    def flat_batch(self, plan: StepPlan) -> FlatBatch:
        """The device metadata of `plan` (decode rows must come first, as the scheduler emits them)."""
        num_decode = plan.num_decode
        if any(not s.is_decode for s in plan.seqs[:num_decode]):
            raise ValueError(f"step {plan.step_id}: decode rows must precede prefill chunks")
        if plan.block_size != self.block_size:
            raise ValueError(f"plan block_size {plan.block_size} != runner's {self.block_size}")
        rows = [(s.start, s.num_tokens, s.block_table, s.state_slot) for s in plan.seqs]
        # the prefill op only on CUDA, where fla may serve it (elsewhere the registry would pick the reference, the
        # same chunked rule the model's own loop runs)
        return FlatBatch.build(rows, num_decode, self.block_size, self.device, self._gdn_decode,
                               self._decode_attention, self._gdn_prep,
                               self._gdn_chunk if self.device.type == "cuda" else None, self._gdn_conv,
                               self._gdn_prep_ba)

    def _use_graphs(self, plan: StepPlan) -> bool:
        """Decode-only steps (the scheduler sets bucket_size) once the graphs exist (or in "static" mode)."""
        g = self.graphs
        return (g is not None and plan.bucket_size is not None and (g.mode == "static" or g.captured)
                and g.bucket_for(plan.num_seqs) is not None)

    def _use_prefill_graph(self, plan: StepPlan) -> bool:
        """One prefill chunk from position 0 and nothing else, in a captured bucket (or in "static" mode)."""
        g = self.prefill_graphs
        if g is None or not (g.mode == "static" or g.captured) or plan.num_decode or len(plan.seqs) != 1:
            return False
        seq = plan.seqs[0]  # a graph keeps the last position's logits only: no prompt targets
        return seq.start == 0 and not seq.prompt_targets and g.bucket_for(len(seq.token_ids)) is not None

    def _fed_ids(self, plan: StepPlan, feed: PendingStep | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a plan formed ahead (`plan.feed_from`): (the feeding step's sampled ids on the device, the device
        index of each row's input among them)."""
        if plan.feed_from is None:
            return None
        if feed is None or feed.plan.step_id != plan.feed_from or feed.ids is None:
            raise ValueError(f"step {plan.step_id} takes its inputs from step {plan.feed_from}: launch it with that "
                             f"step's PendingStep")
        if self._feed_index is None or self._feed_index[0] != plan.feed_index:  # never written once made
            index = torch.tensor(plan.feed_index, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self._feed_index = (plan.feed_index, index.to(self.device, non_blocking=True))
        return feed.ids, self._feed_index[1]

    @torch.inference_mode()
    def forward(self, plan: StepPlan, feed: PendingStep | None = None) -> torch.Tensor:
        """Run the model over `plan`: logits [len(plan.sampled), vocab] at the last token of each sampling row,
        then [P, vocab] at the positions before the rows' P prompt targets (`ScheduledSeq.prompt_targets`, rows in
        order; none in graph steps). `feed`: the launched step whose sampled ids are the inputs of a plan formed
        ahead (`StepPlan.feed_from`)."""
        fed = self._fed_ids(plan, feed)
        if self._use_prefill_graph(plan):
            seq = plan.seqs[0]
            self.prefill_graph_steps += 1
            logits = self.prefill_graphs.run(seq.token_ids, seq.block_table, seq.state_slot)
            return logits if seq.sample else logits[:0]
        if self._use_graphs(plan):
            from .decode_graphs import as_rows

            self.graph_steps += 1
            return self.graphs.run(as_rows(plan), fed)
        batch = self.flat_batch(plan)
        put = self._to_device
        resets = [s.state_slot for s in plan.seqs if s.reset_state]
        if resets:
            self.cache.reset_slots(put(resets))
        if fed is not None:  # a decode-only plan formed ahead: one input per row, from the feeding step's samples
            input_ids = fed[0].index_select(0, fed[1])
        else:
            input_ids = put([t for s in plan.seqs for t in s.token_ids])
        last = [batch.starts[i + 1] - 1 for i, s in enumerate(plan.seqs) if s.sample]
        # prompt token t's log-probability comes from the logits at position t - 1 (inside the row's chunk)
        last += [batch.starts[i] + s.prompt_first - 1 - s.start + j
                 for i, s in enumerate(plan.seqs) for j in range(len(s.prompt_targets))]
        if not last:  # every row is a mid-prompt chunk: state advances, nothing to sample
            self.model.forward_paged(input_ids, batch, self.cache, put([0]))
            return torch.empty(0, self.cfg.vocab_size, device=self.device)
        return self.model.forward_paged(input_ids, batch, self.cache, put(last))

    def execute(self, plan: StepPlan) -> StepOutput:
        """One step: forward, sample the rows that need a token, one device->host copy of the sampled ids (the
        step's one sync) = `result(launch(plan))`."""
        return self.result(self.launch(plan))

    def launch(self, plan: StepPlan, feed: PendingStep | None = None) -> PendingStep:
        """Forward and sampling of `plan` queued on the device, and the sampled ids' copy to the host; returns
        without waiting for them (CUDA; elsewhere the work is done on return). `feed`: see `forward`."""
        t0 = time.perf_counter()
        logits = self.forward(plan, feed)
        targets = [t for r in plan.seqs for t in r.prompt_targets]
        prompt_lps = None
        if targets:  # the prompt targets' rows come after the sampled rows'
            n_sampled = logits.shape[0] - len(targets)
            prompt_logits, logits = logits[n_sampled:], logits[:n_sampled]
            n = max(r.sampling.prompt_logprobs for r in plan.seqs if r.prompt_targets)
            with torch.inference_mode():  # in row slices: fp32 [P, vocab] copies of 512 rows would be ~1 GB
                ids = self._to_device(targets)
                parts = [token_logprobs(prompt_logits[i:i + PROMPT_LOGPROBS_ROWS], ids[i:i + PROMPT_LOGPROBS_ROWS], n)
                         for i in range(0, len(targets), PROMPT_LOGPROBS_ROWS)]
                prompt_lps = tuple(torch.cat(t) for t in zip(*parts))
            del prompt_logits
        if any(r.reset_state and r.sampling.penalized for r in plan.seqs):
            self._reset_counts(plan)
        ids = host = event = logprobs = None
        prompt_host = prompt_lps
        if prompt_lps is not None and self.device.type == "cuda":
            prompt_host = tuple(_to_host(t) for t in prompt_lps)
        if logits.shape[0]:
            asks = [r.sampling.logprobs for r in plan.sampled if r.sampling.logprobs is not None]
            with torch.inference_mode():
                counts = self._penalty_counts(plan)
                ids = sample(logits, SamplingTensors.from_plan(plan, self.device),
                             argmax=self._argmax if self.argmax_kernel else None, counts=counts)
                if counts is not None:
                    self._count_sampled(plan, ids)
                # queued before the next step's launch (one stream), so a graph's logits buffer is read first
                lps = token_logprobs(logits, ids, max(asks)) if asks else None
            if self.device.type == "cuda":
                host = _to_host(ids)
                logprobs = None if lps is None else tuple(_to_host(t) for t in lps)
            else:
                host, logprobs = ids, lps
        if self.device.type == "cuda" and (host is not None or prompt_host is not None):
            event = torch.cuda.Event()
            event.record()
        self.launches += 1  # queued (a launch that raised is not counted)
        return PendingStep(plan, ids, host, event, time.perf_counter() - t0, logprobs, prompt_host)

    def _penalty_counts(self, plan: StepPlan) -> torch.Tensor | None:
        """The sampled rows' output-token counts [len(plan.sampled), vocab] when a row is penalized (None when none
        is). Rows without penalties read their slot's stale counts, which their zero penalties ignore."""
        if not any(r.sampling.penalized for r in plan.sampled):
            return None
        return self._counts.index_select(0, self._to_device([r.state_slot for r in plan.sampled]))

    def _reset_counts(self, plan: StepPlan) -> None:
        """Set the slots of the plan's penalized reset rows (a request's first row, or its first after preemption;
        before any row of it samples): zeros, plus the outputs sampled before a preemption."""
        if self._counts is None:
            self._counts = torch.zeros(self.max_num_seqs, self.cfg.vocab_size, dtype=torch.int32,
                                       device=self.device)
        for r in plan.seqs:
            if r.reset_state and r.sampling.penalized:
                row = self._counts[r.state_slot]
                row.zero_()
                if r.prior_outputs:  # rare (preemption): one small host->device copy
                    prior = self._to_device(list(r.prior_outputs))
                    row.index_add_(0, prior, torch.ones_like(prior, dtype=torch.int32))

    def _count_sampled(self, plan: StepPlan, ids: torch.Tensor) -> None:
        """Add each penalized sampled row's new token to its slot's counts (on the device: no sync)."""
        rows = [i for i, r in enumerate(plan.sampled) if r.sampling.penalized]
        slots = self._to_device([plan.sampled[i].state_slot for i in rows])
        picked = ids.index_select(0, self._to_device(rows))
        self._counts.index_put_((slots, picked), torch.ones_like(picked, dtype=torch.int32), accumulate=True)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """int64 host values -> the device, through pinned memory, non-blocking (no sync)."""
        return torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == "cuda").to(
            self.device, non_blocking=True)

    def result(self, pending: PendingStep) -> StepOutput:
        """Wait for a launched step's sampled ids -> StepOutput."""
        t0 = time.perf_counter()
        if pending.event is not None:
            pending.event.synchronize()
        ids = pending.host.tolist() if pending.host is not None else []
        logprobs = None if pending.logprobs is None else _row_logprobs(pending.plan, *pending.logprobs)
        prompt = None if pending.prompt_logprobs is None else _prompt_logprobs(pending.plan, *pending.prompt_logprobs)
        self.steps += 1
        self.busy_s += pending.launch_s + time.perf_counter() - t0
        return StepOutput(tuple(ids), logprobs, prompt)

    def stats(self) -> dict[str, float]:
        out = {"steps": self.steps, "launches": self.launches, "graph_steps": self.graph_steps,
               "prefill_graph_steps": self.prefill_graph_steps, "busy_s": round(self.busy_s, 3),
               "num_blocks": self.num_blocks, "block_size": self.block_size, "state_slots": self.max_num_seqs}
        if self.graphs is not None:
            out["decode_graphs"] = self.graphs.stats()
        elif self.graphs_disabled:
            out["decode_graphs"] = {"mode": "off", "disabled": self.graphs_disabled}
        if self.prefill_graphs is not None:
            out["prefill_graphs"] = self.prefill_graphs.stats()
        elif self.prefill_graphs_disabled:
            out["prefill_graphs"] = {"mode": "off", "disabled": self.prefill_graphs_disabled}
        return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy into fresh pinned host memory, queued (non-blocking): read it after an event."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _entries(chosen: torch.Tensor, top: torch.Tensor, top_ids: torch.Tensor, ns) -> list[TokenLogprobs]:
    """`token_logprobs`' host tensors -> one TokenLogprobs per row i, with its own ns[i] of the batch's largest n."""
    chosen_l, top_l, ids_l = chosen.tolist(), top.tolist(), top_ids.tolist()
    return [TokenLogprobs(chosen_l[i], tuple(zip(ids_l[i][:n], top_l[i][:n]))) for i, n in enumerate(ns)]


def _row_logprobs(plan: StepPlan, chosen: torch.Tensor, top: torch.Tensor, top_ids: torch.Tensor
                  ) -> tuple[TokenLogprobs | None, ...]:
    """`token_logprobs`' host tensors -> one TokenLogprobs per sampled row whose request asked (its own n of the
    batch's largest n), None for the others."""
    asks = [row.sampling.logprobs for row in plan.sampled]
    entries = _entries(chosen, top, top_ids, [n or 0 for n in asks])
    return tuple(None if n is None else e for n, e in zip(asks, entries))


def _prompt_logprobs(plan: StepPlan, chosen: torch.Tensor, top: torch.Tensor, top_ids: torch.Tensor
                     ) -> tuple[tuple[TokenLogprobs, ...], ...]:
    """`token_logprobs`' host tensors over the plan's prompt targets (rows concatenated) -> per plan row its targets'
    TokenLogprobs (its own n of the batch's largest), () for a row without targets."""
    entries = _entries(chosen, top, top_ids, [r.sampling.prompt_logprobs for r in plan.seqs
                                              for _ in r.prompt_targets])
    out, at = [], 0
    for row in plan.seqs:
        out.append(tuple(entries[at:at + len(row.prompt_targets)]))
        at += len(row.prompt_targets)
    return tuple(out)
