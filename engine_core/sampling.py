"""Batched token sampling on the device without host syncs: greedy, temperature, top-k, top-p, per-request seeds.

`sample(logits [B, V], SamplingTensors) -> token ids [B]` is a straight line of tensor ops (no `.item()`,
`.tolist()`, `nonzero` or data-dependent Python branches; `tests/test_sampling.py` proves it by compiling it with
`fullgraph=True`), so a decode step never waits for the GPU before launching the next kernel. The only choices made in
Python are from host-known flags (`all_greedy`, `needs_sort`) computed from the requests' parameters, never from
tensor values. `reference_sample` / `reference_probs` are the plain per-row versions the tests compare against.

Exponential race (gpt-fast `multinomial_sample_one_no_sync`): if E_v ~ Exp(1) i.i.d., then
`argmax_v p_v / E_v` is distributed as Categorical(p). We take it in log space, `argmax_v (logits_v / T - log E_v)`
(the Gumbel-max trick; -log E is Gumbel), which needs no softmax and puts masked tokens at -inf.

Seeded noise without generators: E_v of row r is `-log(u)` with `u = hash(seed_r, step_r, v)` mapped to (0, 1),
where `step_r` is the index of the token being sampled among the request's outputs (`ScheduledSeq.output_index`).
The hash is counter-based (a pure function, like Philox / Random123, but in plain int64 tensor ops so it compiles
anywhere): a per-row key from (seed, step) chained through `_mix32` (Wellons' lowbias32 finaliser), then per token
`_mix32(key + v * golden)` (a Weyl sequence, as in splitmix). Consequences:

- The token a request samples at output t depends only on its logits row, its parameters, its seed and t: not on
  the batch size, its row position, the other rows, or whether it was preempted and recomputed (the scheduler
  replays the same output index, so preemption-and-resume reproduces the stream exactly).
- No per-row `torch.Generator`s: those need one kernel launch per row, and one batched generator's Philox offset
  advances with the batch composition, tying a request's randomness to its neighbours.
- Cost: ~35 element ops per (row, token), several of them int64 multiplies (emulated on GPUs), fused into one
  kernel under `torch.compile`: napkin math ~1e9 int32 instructions at 32 x 248k, so tens of microseconds
  (unmeasured); in eager mode each op is its own pass over [B, V] (~64 MB each at that size), so compile the
  sampler with the decode step (P9).

Ops are in the order HF / vLLM apply them: logit bias and presence / frequency penalties (both additive; the
penalties over the request's output-token counts, which the engine keeps on the device; `adjust_logits`),
temperature, then top-k, then top-p on the renormalised top-k distribution. Rows with temperature 0 are greedy
(first maximal index, as `torch.argmax`) whatever their other parameters. top-k / top-p sort the row (stable, so
ties break by token id and the result is batch-independent); the sort is skipped when no row in the batch asks for
either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine_core.continuous import SamplingParams, StepPlan

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # 2^32 / golden ratio: the Weyl increment of splitmix / Fibonacci hashing
_SEED_MOD = 1 << 63  # seeds are reduced to int64-safe non-negative values on the host


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) and a constant c < 2^32, with no int64 overflow: c is split into
    16-bit halves so every product stays below 2^48 (signed overflow would be undefined in compiled kernels)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32: a 32-bit finaliser with near-ideal avalanche (bias ~0.17)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_keys(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """seed, step [B] int64 (>= 0) -> 32-bit key per row [B]."""
    k = _mix32((seed >> 32) ^ _GOLDEN32)
    k = _mix32(k ^ (seed & _MASK32))
    return _mix32(k ^ (step & _MASK32))


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """-log(E) with E ~ Exp(1) for every (row, token): seed, step [B]; token_ids [V] or [B, V] -> [B, V] fp32."""
    keys = _row_keys(seed, step)[:, None]  # [B, 1]
    x = _mix32((keys + _mul32(token_ids, _GOLDEN32)) & _MASK32)
    # 23 high bits + 1/2 -> u in [2^-24, 1 - 2^-24]: exact in fp32 (24-bit significand), so log(u) < 0 and E > 0.
    u = ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters on the device, plus host-known flags that pick the code path. An all-greedy batch
    (the common serving case) carries no tensors: `sample` takes the argmax and reads none of them, so building it
    costs no pinned buffers and no host->device copies in the step."""

    temperature: torch.Tensor | None  # [B] fp32; 0 = greedy
    top_p: torch.Tensor | None  # [B] fp32 in (0, 1]
    top_k: torch.Tensor | None  # [B] int64; 0 = off
    seed: torch.Tensor | None  # [B] int64 in [0, 2^63)
    step: torch.Tensor | None  # [B] int64: the output index being sampled
    all_greedy: bool  # every row greedy: just argmax
    needs_sort: bool  # some sampled row uses top-k or top-p
    presence: torch.Tensor | None = None  # [B] fp32 presence penalties (0 = off); None: no row is penalized
    frequency: torch.Tensor | None = None  # [B] fp32 frequency penalties
    # every biased row's (row, token id) [2, E] int64 and bias [E] fp32, E = the batch's biased ids (sparse: a
    # dense [B, V] bias would copy ~1 MB a row); None: no row is biased
    bias_index: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None

    @property
    def adjusts(self) -> bool:
        """Some row is penalized or biased: `sample` reads `adjust_logits`'s fp32 logits."""
        return self.presence is not None or self.bias_index is not None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int],
              device: torch.device | str | None = None) -> SamplingTensors:
        """From host values; one pinned host->device copy per field, non-blocking (no sync); none when every row is
        greedy."""
        device = torch.device(device or "cpu")
        pin = device.type == "cuda"

        def put(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

        sampled = [p for p in params if not p.greedy]
        penalties = {}
        if any(p.penalized for p in params):
            penalties = dict(presence=put([p.presence_penalty for p in params], torch.float32),
                             frequency=put([p.frequency_penalty for p in params], torch.float32))
        if any(p.biased for p in params):
            pairs = [(r, token, bias) for r, p in enumerate(params) for token, bias in p.logit_bias]
            penalties.update(bias_index=put([[r for r, _, _ in pairs], [t for _, t, _ in pairs]], torch.int64),
                             bias_values=put([b for _, _, b in pairs], torch.float32))
        if not sampled:
            return cls(None, None, None, None, None, all_greedy=True, needs_sort=False, **penalties)
        return cls(
            temperature=put([p.temperature for p in params], torch.float32),
            top_p=put([p.top_p for p in params], torch.float32),
            top_k=put([p.top_k for p in params], torch.int64),
            seed=put([s % _SEED_MOD for s in seeds], torch.int64),
            step=put(list(steps), torch.int64),
            all_greedy=False,
            needs_sort=any(p.top_k > 0 or p.top_p < 1.0 for p in sampled),
            **penalties,
        )

    @classmethod
    def from_plan(cls, plan: StepPlan, device: torch.device | str | None = None) -> SamplingTensors:
        """Rows = `plan.sampled` (the rows `StepOutput.sampled_token_ids` answers), in plan order."""
        rows = plan.sampled
        return cls.build([r.sampling for r in rows], [r.seed for r in rows], [r.output_index for r in rows], device)


def adjust_logits(logits: torch.Tensor, st: SamplingTensors, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The logits the sampler reads: logits [B, V] + the rows' logit bias - their penalties, in fp32 (rows asking
    for neither come back unchanged, in fp32); `logits` itself when no row asks. Never writes into `logits` (a CUDA
    graph's output buffer, which the log-probabilities read raw). `counts` [B, V]: see `apply_penalties`."""
    if not st.adjusts:
        return logits
    if st.bias_index is not None:
        out = logits.to(torch.float32, copy=True)  # a copy even of fp32 logits: the add below is in place
        # one index_add over the flat rows (the ids of a row are distinct); index_put(accumulate=True) sorts its
        # indices first: ~0.3 ms of launches a step on an H100 (benchmarks/logprobs_bench.py)
        flat = torch.add(st.bias_index[1], st.bias_index[0], alpha=out.shape[-1])
        out.view(-1).index_add_(0, flat, st.bias_values)
    else:
        out = logits.float()
    if st.presence is not None:
        if counts is None:
            raise ValueError("penalized rows need their output-token counts")
        out = apply_penalties(out, counts, st.presence, st.frequency)
    return out


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's presence / frequency penalties: logits [B, V], counts [B, V] (each row's output-token counts so far),
    presence / frequency [B] -> fp32 logits - presence [count > 0] - frequency count. Rows with both 0 come back
    unchanged (in fp32)."""
    c = counts.float()
    return logits.float() - presence[:, None] * (c > 0).float() - frequency[:, None] * c


def sample(logits: torch.Tensor, st: SamplingTensors,
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
           counts: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> token ids [B] int64, without host syncs. `argmax`: the greedy rows'
    `torch.argmax(logits, dim=-1)` by another route (an engine's kernel: the first maximum, NaN above numbers).
    `counts` [B, V]: the rows' output-token counts, needed (and only read) when `st` carries penalties."""
    if st.adjusts:
        logits = adjust_logits(logits, st, counts)
        argmax = None  # the adjusted fp32 logits: torch's argmax (the kernel's contract is the model's logits)
    greedy = logits.argmax(dim=-1) if argmax is None else argmax(logits)
    if st.all_greedy:
        return greedy
    assert st.temperature is not None and st.seed is not None and st.step is not None  # built for sampled rows
    temperature = torch.where(st.temperature > 0, st.temperature, 1.0)
    scaled = logits.float() / temperature[:, None]  # [B, V]
    if st.needs_sort:
        scaled, token_ids = _top_k_top_p_sorted(scaled, st.top_k, st.top_p)  # both [B, V], sorted by logit
    else:
        token_ids = torch.arange(logits.shape[-1], device=logits.device)  # [V]
    pick = (scaled + gumbel_noise(st.seed, st.step, token_ids)).argmax(dim=-1, keepdim=True)  # [B, 1]
    sampled = pick[:, 0] if not st.needs_sort else token_ids.gather(1, pick)[:, 0]
    return torch.where(st.temperature > 0, sampled, greedy)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, n: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's log-probabilities for `SamplingParams.logprobs`, without host syncs: logits [B, V] (any float
    dtype), sampled ids [B] -> (the sampled tokens' [B] fp32, the n largest [B, n] fp32 descending, their ids [B, n]
    int64). One fp32 log-softmax of the raw logits (temperature, top-k and top-p change what is sampled, not what is
    reported, as OpenAI and vLLM report them); ties among the n largest in `torch.topk`'s order."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    chosen = logp.gather(1, ids[:, None].to(torch.int64))[:, 0]
    top_vals, top_ids = logp.topk(n, dim=-1) if n > 0 else (logp[:, :0], ids[:, None][:, :0].to(torch.int64))
    return chosen, top_vals, top_ids


def _top_k_top_p_sorted(scaled: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled [B, V] -> (logits sorted descending with tokens outside top-k / top-p at -inf, their token ids)."""
    vals, ids = scaled.sort(dim=-1, descending=True, stable=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, vocab)
    vals = vals.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = vals.softmax(dim=-1)  # the renormalised top-k distribution
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly ahead of each token
    vals = vals.masked_fill(before >= top_p[:, None], float("-inf"))  # the top token has 0 ahead: always kept
    return vals, ids


# --------------------------------------------------------------------------------------------------------------
# Plain reference (tests): one row at a time, float64, torch.multinomial


def reference_adjusted(logits: torch.Tensor, outputs: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """logits [V] and the request's outputs so far -> the logits with its logit bias and penalties [V] fp64, token
    by token (the reference of `adjust_logits`)."""
    out = logits.double().clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in set(outputs):
        out[token] -= params.presence_penalty + params.frequency_penalty * list(outputs).count(token)
    return out


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] -> the distribution `params` samples from [V] fp64 (one-hot argmax when greedy)."""
    vocab = logits.shape[-1]
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), vocab).double()
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True).tolist()
    kept = order[: params.top_k] if params.top_k > 0 else order
    total = sum(probs[t].item() for t in kept)
    out = torch.zeros(vocab, dtype=torch.float64)
    mass = 0.0
    for t in kept:  # top-p on the renormalised top-k distribution: add tokens until the mass reaches top_p
        out[t] = probs[t]
        mass += probs[t].item() / total
        if mass >= params.top_p:
            break
    return out / out.sum()


def reference_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """logits [V] -> (log p(token), the n most likely (id, log p)), in float64 (the reference of `token_logprobs`)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    order = torch.argsort(logp, descending=True, stable=True)[:n].tolist()
    return logp[token].item(), [(t, logp[t].item()) for t in order]


def reference_sample(logits: torch.Tensor, params: Sequence[SamplingParams],
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] int64, row by row with torch.multinomial."""
    return torch.stack([torch.multinomial(reference_probs(row, p), 1, generator=generator)[0]
                        for row, p in zip(logits, params)])
