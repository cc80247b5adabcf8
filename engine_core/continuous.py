"""Continuous batching for the Qwen engine: add / step / finish over paged KV blocks. Device-free (no torch).

Follows "Continuous batching (Qwen engine)" in `engine_core/scheduler.py` (same `Clock`, `Answer`, errors and
`Samples`-based stats) with its own typed verbs instead of `Batch`/`WorkItem`, because a step is not a batch of
independent items but one forward pass over every resident sequence. The engine loop (nano-vllm's
`LLMEngine.step`, vLLM's `EngineCore.step`)::

    sched = ContinuousScheduler(ContinuousConfig(num_kv_blocks=4096, block_size=16, max_num_seqs=32))
    rid = sched.add(GenerateRequest(prompt_ids, max_new_tokens=256, sampling=SamplingParams(0.7, top_p=0.9, seed=1)))
    while (plan := sched.step()) is not None:        # schedule: which tokens of which sequences, which KV blocks
        try:
            out = runner.run(plan)                   # run: forward + sample on the device -> StepOutput (1 D2H copy)
        except Exception as exc:
            sched.fail(plan, exc)                    # every live sequence in the plan is answered with StepFailed
            continue
        for delta in sched.finish(plan, out):        # update: append tokens, stop checks, free finished sequences
            stream(delta)                            # TokenDelta: new tokens of one request (SSE)
        for answer in sched.pop_answers():           # exactly one Answer per admitted request
            reply(answer)                            # outputs=(Completion,), or an error

Rules (each one is a test in `tests/test_continuous.py`):

- **Token budget.** A step feeds at most `max_num_batched_tokens` tokens of at most `max_num_seqs` sequences.
  Decode tokens go first (every decoding resident sequence, 1 token each; the config guarantees they all fit),
  then prefill chunks in FIFO (arrival) order: resident sequences whose prefill is unfinished, then waiting ones.
- **Chunked prefill.** A prompt longer than the budget left is split: the chunk `[start, start + n)` is fed now,
  the rest in later steps; only the chunk that reaches the end of the known tokens is sampled
  (`ScheduledSeq.sample`). A sequence's KV blocks for *all* its known tokens are reserved when it is admitted, so
  prefill chunks never need blocks; only decode tokens grow a sequence.
- **Admission.** The waiting queue's head is admitted while there is a state slot (`max_num_seqs` resident at most),
  budget is left, and `BlockManager.can_allocate` holds with the watermark (without it when nothing is resident).
  FIFO: the head is never skipped. No admission in a step that preempted (it would thrash).
- **Lone prefill** (`lone_prefill_tokens` > 0, set by an engine whose runner replays a lone sequence's prefill from
  position 0 as a CUDA graph of up to that many tokens). When no resident sequence is mid-prefill and the waiting
  head could be admitted with a whole prompt of at least `lone_prefill_min_tokens` and at most that many tokens
  (and the step budget), its prompt is a step of its own (no decode rows), which the runner replays as one graph
  instead of running a mixed step eagerly. While sequences decode, such steps alternate with decode-only steps, so
  a burst of arrivals delays each decoding stream by one prefill step in two, never starves it. Otherwise the rules
  above (longer or shorter prompts, prompts behind a mid-prefill resident). FIFO is kept: only the head is taken.
- **Preemption by recompute.** When a decode token needs a block and none is free, the youngest resident sequence
  (latest arrival) is preempted: its blocks and state slot are freed, its prompt *and generated tokens* kept, and
  it goes to the front of the waiting queue. Re-admitted, it prefills all of them again (`reset_state`) and samples
  its next token with the same `(seed, output_index)`, so its stream is exactly that of an uninterrupted run.
  Preferring the youngest means the oldest request always makes progress (no livelock), as in vLLM.
- **Prompt log-probabilities** (`SamplingParams.prompt_logprobs`). The prompt's chunks also yield the
  log-probability of each prompt token after the first, given the tokens before it (`ScheduledSeq.prompt_targets`:
  the prompt tokens a chunk's logits predict, counted from `prompt_first`); the chunks of such requests hold at most
  `PROMPT_LOGPROBS_CHUNK` tokens a step in all (their logits are kept at every position; a request that finds none
  left waits for the next step, FIFO kept) and never take the lone-prefill rule
  (its graphs keep one position's logits). The runner returns them per row (`StepOutput.prompt_logprobs`); the
  request's first `TokenDelta` carries all of them. A preempted sequence does not compute them again.
- **Stops.** After each sampled token: an id in `eos_token_ids` (EOS), a suffix equal to one of
  `stop_token_ids` (STOP), `max_new_tokens` outputs or `max_model_len` tokens (LENGTH). The terminating tokens are
  kept in `Completion.token_ids`; `Completion.text_token_ids` drops them (OpenAI omits the stop string).
- **Exactly one answer; deadlines; cancellation; backpressure** as in `PipelineScheduler`: `expire()` runs at the
  start of `step`, `finish` and `fail`; `cancel` and expiry free a sequence's blocks at once (safe: only one plan is
  in flight, and the next `step` comes after `finish`); tokens sampled for an answered sequence are dropped
  (`stats.dropped_tokens`). `add` raises `Overloaded` when `max_waiting` requests are waiting (preempted ones are
  re-queued regardless), and `ValueError` for a request that could never run (prompt >= `max_model_len`, or more
  KV blocks than the whole pool).
- **Plans in flight.** `step` raises while a plan awaits `finish`/`fail`. One overlap is allowed: while a
  decode-only plan N is in flight, `step_ahead(N)` may form decode step N+1 (same sequences, inputs = N's sampled ids
  on the device), so that the runner launches N+1 before N's tokens reach the host and the host's scheduling and
  streaming of N run while the device computes N+1. Only when nothing waits for admission, every resident sequence
  is in N, and no row needs preemption; rows that end by length at N are left out, rows that end by EOS / stop ids
  at N are computed and their N+1 token dropped (`stats.dropped_tokens`). `finish` / `fail` take the plans in
  launch order. A sequence answered while N+1 is in flight frees its state slot and blocks at once: the slot is
  handed out again only by `step` (after N+1 is finished), but a block may be taken by the next `step_ahead` (N+2)
  while N+1 still runs. That is safe because the runner executes plans in launch order on one device stream: N+1's
  write into the block lands before N+2's, and the new owner reads only positions it wrote. (A runner that ran
  plans on two streams would have to hold freed blocks back until the plans in flight finish.)

The GDN layers keep an O(1) recurrent + conv state per sequence: the scheduler assigns each resident sequence a
`state_slot` in `0..max_num_seqs-1`, and `ScheduledSeq.reset_state` tells the runner to zero it (the sequence
starts from position 0: new, or resumed after preemption). Not thread-safe: one owner makes every call.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import operator
import random
from bisect import insort
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from engine_core.block_manager import BlockManager
from engine_core.request import (
    Answer,
    Cancelled,
    Clock,
    DeadlineExceeded,
    MonotonicClock,
    Overloaded,
    RequestId,
    RequestTimings,
    RunFailed,
    SchedulerError,
)
from engine_core.scheduler import Samples

# --------------------------------------------------------------------------------------------------------------
# Requests


# Temperatures below this sample greedily. Logits / T overflow fp32 to inf below ~1e-37 (the first infinite logit,
# often a low id, then wins: nonsense), and from here down two logits more than 1e-3 apart already sample as greedy
# (exp(-gap / T) < e^-100); vLLM draws the same line (_SAMPLING_EPS).
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # most likely tokens reported per sampled token (OpenAI's chat top_logprobs limit; vLLM's default)
# prompt tokens a chunk feeds at most while its prompt log-probabilities are computed: the runner keeps the logits of
# every such position ([chunk, vocab]: 512 x 248,320 bf16 = 254 MB, and their fp32 log-softmax twice that)
PROMPT_LOGPROBS_CHUNK = 512
MAX_LOGIT_BIAS = 300  # token ids a request may bias (OpenAI's limit): one step copies every biased row's entries
LOGIT_BIAS_RANGE = 100.0  # |bias| at most (OpenAI's range: -100 bans a token in effect, 100 forces it)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each token (applied in this order: logit bias and penalties, temperature, top-k, top-p; see
    `engine_core/sampling.py`)."""

    temperature: float = 0.0  # 0 = greedy (argmax); top_k / top_p / seed are then irrelevant
    top_p: float = 1.0  # keep the smallest set of most likely tokens with probability >= top_p; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    seed: int | None = None  # None: the scheduler draws one at `add` (still fixed for the request's lifetime)
    # None: no log-probabilities; n >= 0: each sampled token's log-probability under the model's own distribution
    # (log-softmax of the raw logits: before temperature, top-k and top-p, as OpenAI and vLLM report it) and the n
    # most likely tokens' (`TokenLogprobs`); at most MAX_LOGPROBS
    logprobs: int | None = None
    # OpenAI's penalties, subtracted from the logits before anything else (greedy rows too), over this request's
    # output tokens so far: presence * [token appeared] + frequency * (times it appeared); each in [-2, 2]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: (token id, bias) pairs added to the logits before sampling (greedy rows too), each bias in
    # [-100, 100], at most MAX_LOGIT_BIAS ids, each once; a mapping {id: bias} is accepted and stored sorted by id.
    # The engine checks the ids against its vocabulary.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: none; n >= 0: each prompt token's log-probability given the tokens before it (the first has none) and
    # the n most likely tokens' at its position, as `logprobs` reports them (vLLM's `prompt_logprobs`; OpenAI's
    # echo with logprobs); at most MAX_LOGPROBS
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:  # 0 < T < 1e-5: greedy, as vLLM's sampler takes it
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**31:  # int64 sampling tensors: a huge k must not fail a whole batched step
            raise ValueError(f"top_k must be in [0, 2**31) (0 = off), got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:  # NaN too
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Presence or frequency penalties: the sampler needs the request's output-token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def biased(self) -> bool:
        """A logit bias (zero biases are dropped at construction)."""
        return bool(self.logit_bias)


def logit_bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """`SamplingParams.logit_bias` as given (pairs or a mapping) -> pairs sorted by token id, zeros dropped
    (ValueError naming what is wrong: the count, a pair, a bias's range, a negative or repeated id)."""
    pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} token ids, got {len(pairs)}")
    out = []
    for pair in pairs:
        try:
            token, value = pair
            token = operator.index(token)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:  # NaN too
            raise ValueError(f"logit_bias of token {token} must be a number in [-{LOGIT_BIAS_RANGE:g}, "
                             f"{LOGIT_BIAS_RANGE:g}], got {value!r}")
        if token < 0:
            raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
        out.append((token, float(value)))
    out.sort()
    if any(a[0] == b[0] for a, b in zip(out, out[1:])):
        raise ValueError("logit_bias names a token id more than once")
    return tuple(p for p in out if p[1] != 0.0)  # a zero bias changes nothing: no biased path for it


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One completion request: prompt token ids in, up to `max_new_tokens` sampled token ids out."""

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()  # any of these ends the sequence (e.g. Qwen's <|im_end|>, <|endoftext|>)
    stop_token_ids: tuple[tuple[int, ...], ...] = ()  # token sequences that end it when the output ends with one
    deadline_s: float | None = None  # absolute time on the scheduler's clock; None = no deadline

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", tuple(operator.index(t) for t in self.prompt_token_ids))
        object.__setattr__(self, "eos_token_ids", tuple(operator.index(t) for t in self.eos_token_ids))
        object.__setattr__(self, "stop_token_ids", tuple(tuple(s) for s in self.stop_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("a GenerateRequest needs at least one prompt token")
        if min(self.prompt_token_ids) < 0:
            raise ValueError("token ids must be >= 0")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(len(s) == 0 for s in self.stop_token_ids):
            raise ValueError("stop token sequences must be non-empty")


# --------------------------------------------------------------------------------------------------------------
# Per-sequence state and the messages of one step


class SeqStatus(str, enum.Enum):
    WAITING = "waiting"  # in the waiting queue: no blocks, no state slot
    RUNNING = "running"  # resident: holds blocks for all its known tokens and a state slot


class FinishReason(str, enum.Enum):
    EOS = "eos"  # sampled one of eos_token_ids (OpenAI finish_reason "stop")
    STOP = "stop"  # output ended with one of stop_token_ids (OpenAI "stop")
    LENGTH = "length"  # max_new_tokens outputs, or max_model_len tokens in all (OpenAI "length")


@dataclass(slots=True)
class SequenceState:
    """The scheduler's book-keeping of one unanswered request (its KV block table lives in the BlockManager)."""

    request_id: RequestId
    request: GenerateRequest
    seed: int  # request.sampling.seed, or drawn at add
    arrival_s: float
    token_ids: list[int]  # prompt + generated so far
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV / GDN state is in the cache (reset to 0 by preemption)
    decoding: bool = False  # sampled since its last admission: from now on it needs 1 decode token per step
    state_slot: int | None = None  # GDN state row while RUNNING
    first_token_s: float | None = None
    num_preemptions: int = 0
    # SamplingParams.prompt_logprobs: one entry per prompt token from the second on, in order, as chunks yield them
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def prompt_logprobs_next(self) -> int:
        """The first prompt token whose log-probability is still to compute (the first token has none)."""
        return 1 + len(self.prompt_logprobs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asked for prompt log-probabilities and some are not computed yet."""
        return (self.request.sampling.prompt_logprobs is not None
                and self.prompt_logprobs_next < self.num_prompt_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[self.num_prompt_tokens:])

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: feed `token_ids` at positions `start..end-1`, sample after the last if
    `sample`."""

    request_id: RequestId
    start: int  # position of token_ids[0] = tokens already in the cache
    token_ids: tuple[int, ...]  # the tokens to feed: the sequence's tokens [start, end)
    block_table: tuple[int, ...]  # KV blocks of positions 0..(at least) end-1, in position order
    state_slot: int  # GDN recurrent/conv state row of this sequence
    reset_state: bool  # start == 0: zero the state slot first (new sequence, or resumed after preemption)
    is_decode: bool  # a decode token (1 token, after this admission's first sample) rather than a prefill chunk
    sample: bool  # end == all known tokens: the last position's logits give the next token
    output_index: int  # index of the token sampled here among the request's outputs (sampler counter)
    seed: int  # per-request sampler seed
    sampling: SamplingParams
    # reset_state rows of penalized requests resumed after preemption: the outputs sampled before it, whose counts
    # the runner rebuilds (a runner keeps a penalized request's counts per state slot from its reset row on)
    prior_outputs: tuple[int, ...] = ()
    # SamplingParams.prompt_logprobs: the prompt tokens prompt_first .. prompt_first + len - 1 whose log-probabilities
    # this chunk's logits give (token t from the logits at position t - 1, inside [start, end)); () for none
    prompt_targets: tuple[int, ...] = ()
    prompt_first: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What `step()` hands the runner: one forward pass. Decode rows first, then prefill chunks (FIFO)."""

    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    block_size: int  # token slots per KV block
    bucket_size: int | None  # decode-only step: smallest configured decode bucket >= num_seqs (CUDA graph); else None
    formed_s: float
    preempted: tuple[RequestId, ...] = ()  # sequences preempted while forming this step (informational)
    # a step formed ahead (`ContinuousScheduler.step_ahead`): its input tokens are the sampled ids of step
    # `feed_from`, still on the device when this plan is launched; row i takes that step's sampled row
    # feed_index[i] (its ScheduledSeq.token_ids hold a placeholder 0). None: token_ids are the inputs.
    feed_from: int | None = None
    feed_index: tuple[int, ...] = ()
    lone_prefill: bool = False  # formed by the lone-prefill rule: one whole prompt from position 0, no decode rows

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_decode(self) -> int:
        return sum(s.is_decode for s in self.seqs)

    @property
    def sampled(self) -> tuple[ScheduledSeq, ...]:
        """The rows that sample, in plan order: `StepOutput.sampled_token_ids` has one token for each."""
        return tuple(s for s in self.seqs if s.sample)

    def positions(self) -> list[int]:
        """Position id of every fed token, rows concatenated: [num_tokens]."""
        return [p for s in self.seqs for p in range(s.start, s.end)]

    def slot_mapping(self) -> list[int]:
        """KV pool slot (block * block_size + offset) of every fed token, rows concatenated: [num_tokens]."""
        bs = self.block_size
        return [s.block_table[p // bs] * bs + p % bs for s in self.seqs for p in range(s.start, s.end)]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token's log-probability and the most likely tokens' (`SamplingParams.logprobs`): natural logs of
    the model's next-token distribution (fp32 log-softmax of the logits, before temperature / top-k / top-p)."""

    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the n most likely tokens, most likely first


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What the runner returns for a plan: one sampled token per `plan.sampled` row, same order; `logprobs` (None
    when no row asked) one entry per row, None for a row whose request did not ask."""

    sampled_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # one entry per plan row (`plan.seqs`), None when no row has prompt_targets: the rows' targets' log-probabilities
    # (`TokenLogprobs.logprob` of the prompt token itself, `top` the row's SamplingParams.prompt_logprobs most likely),
    # () for a row without targets
    prompt_logprobs: tuple[tuple[TokenLogprobs, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """Streaming message from `finish`: a request's new token this step, and its finish reason if it just ended."""

    request_id: RequestId
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None  # set on the last delta; the Answer follows in pop_answers()
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token id, when the request asked for them
    # on a request's first delta when it asked for prompt log-probabilities: one per prompt token after the first
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """`Answer.outputs[0]` of a finished request."""

    token_ids: tuple[int, ...]  # every sampled token, including a terminating eos / stop sequence
    finish_reason: FinishReason
    matched_stop: tuple[int, ...] | None  # the eos id (1-tuple) or stop sequence that ended it; None for LENGTH
    num_prompt_tokens: int
    num_preemptions: int
    first_token_s: float  # clock time of the first sampled token (TTFT = first_token_s - arrival_s)

    @property
    def text_token_ids(self) -> tuple[int, ...]:
        """token_ids without the terminating eos / stop sequence (what a client sees as text)."""
        return self.token_ids[: len(self.token_ids) - len(self.matched_stop or ())]


# --------------------------------------------------------------------------------------------------------------
# Errors: the pipeline scheduler's types (a server maps them to status codes), with messages that name no stage


class SequenceDeadlineExceeded(DeadlineExceeded):
    """[504] `DeadlineExceeded` of a sequence that was waiting (running=False) or resident (running=True)."""

    def __init__(self, request_id: RequestId, deadline_s: float, now_s: float, running: bool):
        self.request_id, self.deadline_s, self.now_s = request_id, deadline_s, now_s
        self.stage, self.running = None, running
        SchedulerError.__init__(self, f"request {request_id} missed its deadline while "
                                      f"{'running' if running else 'waiting'} (late by {now_s - deadline_s:.3f} s)")


class StepFailed(RunFailed):
    """[500] `RunFailed` for a sequence in a step whose runner raised; the runner's exception is `__cause__`."""

    def __init__(self, request_id: RequestId, step_id: int, cause: BaseException):
        self.request_id, self.stage, self.batch_id = request_id, None, step_id
        SchedulerError.__init__(self, f"request {request_id}: step {step_id} failed: {cause!r}")
        self.__cause__ = cause


# --------------------------------------------------------------------------------------------------------------
# Configuration and stats


def _graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """nano-vllm's CUDA-graph batch sizes: 1, 2, 4, 8, then multiples of 16, then max_num_seqs itself."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class ContinuousConfig:
    """Knobs of the continuous-batching scheduler; the Qwen engine config embeds one."""

    num_kv_blocks: int  # KV pool size in blocks (the runner sizes it from free device memory)
    block_size: int = 16  # token slots per block (the paged-attention kernels' page size)
    max_num_seqs: int = 32  # resident sequences = GDN state slots = largest decode batch
    max_num_batched_tokens: int = 2048  # tokens fed per step (decode + prefill chunks)
    max_model_len: int = 8192  # prompt + generated tokens per sequence
    max_waiting: int = 256  # waiting requests before `add` raises Overloaded
    lone_prefill_tokens: int = 0  # prompts of at most this many tokens are prefilled in a step of their own, between
    #                               decode steps (the lone-prefill rule, module doc): the largest prefill bucket a
    #                               runner replays as a CUDA graph; 0: off (every prompt's chunks ride in mixed steps).
    #                               The scheduler's `lone_prefill_tokens` attribute starts from it (an engine whose
    #                               graphs failed to capture sets that to 0)
    lone_prefill_min_tokens: int = 0  # ... and at least this many: shorter prompts ride in mixed steps, where one
    #                                   step (eager) holds many of them
    watermark: float = 0.01  # fraction of blocks admission leaves free for decode growth (vLLM's default)
    decode_buckets: tuple[int, ...] = ()  # decode-only batch sizes the runner captures; () = nano-vllm's list
    seed: int | None = None  # seeds the per-request seeds drawn for unseeded requests; None = OS entropy
    default_retry_after_s: float = 1.0  # Overloaded hint before any request has been answered
    min_retry_after_s: float = 0.05
    max_retry_after_s: float = 30.0

    def __post_init__(self):
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_model_len", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lone_prefill_tokens", "lone_prefill_min_tokens"):
            if isinstance(getattr(self, name), bool) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a token count >= 0, got {getattr(self, name)!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every resident sequence's decode token must fit in one step, or a decode could be starved
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs})")
        buckets = tuple(self.decode_buckets) or _graph_buckets(self.max_num_seqs)
        if list(buckets) != sorted(set(buckets)) or buckets[0] < 1 or buckets[-1] != self.max_num_seqs:
            raise ValueError(f"decode_buckets must ascend strictly and end at max_num_seqs, got {buckets}")
        object.__setattr__(self, "decode_buckets", buckets)
        if not 0 < self.min_retry_after_s <= self.default_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 < min_retry_after_s <= default_retry_after_s <= max_retry_after_s")


@dataclass
class ContinuousStats:
    """Counters and sample windows a server exports (same style as `SchedulerStats`)."""

    submitted: int = 0
    rejected: int = 0  # Overloaded at add
    answered_ok: int = 0
    deadline_exceeded: int = 0
    cancelled: int = 0
    failed: int = 0  # StepFailed
    preemptions: int = 0
    steps: int = 0  # finished or failed plans
    failed_steps: int = 0
    prefill_tokens: int = 0  # fed in finished steps (incl. recomputation after preemption)
    decode_tokens: int = 0
    dropped_tokens: int = 0  # sampled for a sequence answered while its step ran
    steps_ahead: int = 0  # decode steps formed by `step_ahead` (launched before the previous step's tokens were read)
    lone_prefill_steps: int = 0  # steps formed by the lone-prefill rule (one whole prompt, no decode rows)
    latency_s: Samples = field(default_factory=Samples)  # add -> ok answer
    ttft_s: Samples = field(default_factory=Samples)  # add -> first sampled token
    step_tokens: Samples = field(default_factory=Samples)  # fed tokens per step
    step_seqs: Samples = field(default_factory=Samples)  # sequences per step
    step_run_s: Samples = field(default_factory=Samples)  # step formed -> finish/fail
    kv_usage: Samples = field(default_factory=Samples)  # fraction of KV blocks in use when a step is formed

    def snapshot(self) -> dict[str, float]:
        """Flat name -> value map, e.g. `preemptions`, `ttft_s.p99`, `step_tokens.mean`."""
        out = {k: float(getattr(self, k)) for k in (
            "submitted", "rejected", "answered_ok", "deadline_exceeded", "cancelled", "failed", "preemptions",
            "steps", "failed_steps", "prefill_tokens", "decode_tokens", "dropped_tokens", "steps_ahead",
            "lone_prefill_steps")}
        for name in ("latency_s", "ttft_s", "step_tokens", "step_seqs", "step_run_s", "kv_usage"):
            s: Samples = getattr(self, name)
            out |= {f"{name}.mean": s.mean, f"{name}.p50": s.quantile(0.5), f"{name}.p99": s.quantile(0.99)}
        return out


# --------------------------------------------------------------------------------------------------------------
# The scheduler


class ContinuousScheduler:
    """Continuous batching with chunked prefill, paged KV blocks and preemption by recompute (rules: module doc)."""

    _EWMA_ALPHA: ClassVar[float] = 0.2  # weight of the newest latency in the retry-after estimate

    def __init__(self, config: ContinuousConfig, clock: Clock | None = None):
        self.config = config
        self.clock = clock or MonotonicClock()
        self.stats = ContinuousStats()
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size, config.watermark)
        self._seqs: dict[RequestId, SequenceState] = {}  # unanswered requests
        self._waiting: deque[RequestId] = deque()  # FIFO; preempted sequences re-enter at the front
        self._running: list[RequestId] = []  # resident, ascending id = arrival order (the youngest is last)
        self._free_slots = list(range(config.max_num_seqs))  # min-heap of free GDN state slots
        self._in_flight: list[StepPlan] = []  # launched, not yet finished / failed, in launch order (<= 2)
        self._answers: list[Answer] = []
        self._ids = itertools.count()
        self._step_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._latency_ewma_s: float | None = None
        self.lone_prefill_tokens = config.lone_prefill_tokens  # the lone-prefill rule's limit (0: off; module doc)
        self._last_lone = False  # the last plan `step` formed was a lone prefill

    # ---- queries

    @property
    def num_unfinished(self) -> int:
        """Admitted requests not yet answered."""
        return len(self._seqs)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def waiting_ids(self) -> tuple[RequestId, ...]:
        """Waiting requests, head (next to admit) first."""
        return tuple(self._waiting)

    @property
    def running_ids(self) -> tuple[RequestId, ...]:
        """Resident requests, oldest first (the youngest is the next preemption victim)."""
        return tuple(self._running)

    @property
    def in_flight(self) -> StepPlan | None:
        """The oldest plan awaiting `finish` / `fail` (the next one to finish), or None."""
        return self._in_flight[0] if self._in_flight else None

    def __contains__(self, request_id: RequestId) -> bool:
        """Admitted and not yet answered."""
        return request_id in self._seqs

    def sequence(self, request_id: RequestId) -> SequenceState:
        """The live state of an unanswered request (KeyError once answered)."""
        return self._seqs[request_id]

    def next_wakeup(self) -> float | None:
        """Now while `step` has work (back-to-back steps); else the earliest deadline; None: wait for an event."""
        if not self._in_flight and (self._running or self._waiting):
            return self.clock.now()
        deadlines = [s.request.deadline_s for s in self._seqs.values() if s.request.deadline_s is not None]
        return min(deadlines, default=None)

    def retry_after_s(self) -> float:
        """The hint `Overloaded` carries: recent add->answer latency (Little's law: the backlog's turnover time)."""
        cfg = self.config
        estimate = cfg.default_retry_after_s if self._latency_ewma_s is None else self._latency_ewma_s
        return min(max(estimate, cfg.min_retry_after_s), cfg.max_retry_after_s)

    # ---- the verbs

    def add(self, request: GenerateRequest) -> RequestId:
        """Admit a request into the waiting queue and return its id; raise `Overloaded` or `ValueError`."""
        cfg = self.config
        n_prompt = len(request.prompt_token_ids)
        if n_prompt >= cfg.max_model_len:
            raise ValueError(f"prompt of {n_prompt} tokens leaves no room under max_model_len={cfg.max_model_len}")
        # KV slots it may ever hold: every token but the last sampled one (which is never fed).
        max_slots = min(n_prompt + request.max_new_tokens, cfg.max_model_len) - 1
        if self.blocks.blocks_for(max_slots) > cfg.num_kv_blocks:
            raise ValueError(f"request needs up to {self.blocks.blocks_for(max_slots)} KV blocks, the pool has "
                             f"{cfg.num_kv_blocks}; lower max_new_tokens")
        if len(self._waiting) >= cfg.max_waiting:
            self.stats.rejected += 1
            raise Overloaded(self.retry_after_s(), len(self._waiting), cfg.max_waiting)
        rid, now = next(self._ids), self.clock.now()
        seed = request.sampling.seed if request.sampling.seed is not None else self._seed_rng.getrandbits(63)
        self._seqs[rid] = SequenceState(rid, request, seed, now, list(request.prompt_token_ids))
        self.stats.submitted += 1
        if request.deadline_s is not None and now >= request.deadline_s:
            self._answer(rid, error=DeadlineExceeded(rid, request.deadline_s, now, stage=None, running=False))
        else:
            self._waiting.append(rid)
        return rid

    def step(self) -> StepPlan | None:
        """Expire deadlines, then form the next forward pass (rules: module doc); None when nothing is resident
        or waiting. The plan is in flight until `finish` / `fail`."""
        if self._in_flight:
            raise RuntimeError(f"step {self._in_flight[0].step_id} is still in flight; finish() or fail() it first")
        self.expire()
        cfg, blocks = self.config, self.blocks
        budget = cfg.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        preempted: list[RequestId] = []

        # 0. The lone-prefill rule: the waiting head's whole prompt alone, or (right after such a step, while
        #    sequences decode) a decode-only step.
        lone = self._lone_head()
        if lone is not None and not (self._last_lone and any(self._seqs[r].decoding for r in self._running)):
            self._admit(self._waiting.popleft())
            return self._form(prefills=[self._slice(lone, lone.num_tokens, is_decode=False)], lone=True)
        decode_only = lone is not None

        # 1. One decode token per decoding resident sequence, oldest first; make room by preempting the youngest.
        for rid in list(self._running):
            seq = self._seqs[rid]
            if seq.status is not SeqStatus.RUNNING or not seq.decoding:  # preempted above, or still prefilling
                continue
            while not blocks.can_append(rid, 1):
                victim = self._running[-1]  # youngest; never one already scheduled (those are older than rid)
                self._preempt(victim)
                preempted.append(victim)
                if victim == rid:
                    break
            else:
                blocks.append(rid, 1)
                decodes.append(self._slice(seq, 1, is_decode=True))
        budget -= len(decodes)  # >= 0: max_num_batched_tokens >= max_num_seqs >= resident sequences

        # 2. Prefill chunks, FIFO: resident sequences mid-prefill, then waiting ones (admitted while they fit).
        scored = 0  # prompt tokens fed in chunks that keep every position's logits (prompt log-probabilities)
        for rid in self._running:
            seq = self._seqs[rid]
            if budget > 0 and not seq.decoding:
                n = min(self._chunk_limit(seq, scored), budget)
                if n == 0:  # this step's prompt log-probability positions are spent: its next step
                    continue
                prefills.append(self._slice(seq, n, is_decode=False))
                budget -= n
                scored += n if seq.wants_prompt_logprobs else 0
        # after a preemption, admitting would only thrash; after a lone prefill, the decoders' step comes first
        admit = not (preempted and self._running) and not (decode_only and decodes)
        while admit and self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            seq = self._seqs[self._waiting[0]]
            if not blocks.can_allocate(seq.num_tokens, use_watermark=bool(self._running)):
                break  # FIFO: the head waits for blocks; nobody overtakes it
            if self._chunk_limit(seq, scored) == 0:
                break  # FIFO: the head waits for a step with prompt log-probability positions left
            self._admit(self._waiting.popleft())
            n = min(self._chunk_limit(seq, scored), budget)
            prefills.append(self._slice(seq, n, is_decode=False))
            budget -= n
            scored += n if seq.wants_prompt_logprobs else 0

        if not decodes and not prefills:
            return None
        return self._form(decodes, prefills, preempted)

    def _form(self, decodes: Sequence[ScheduledSeq] = (), prefills: Sequence[ScheduledSeq] = (),
              preempted: Sequence[RequestId] = (), *, lone: bool = False) -> StepPlan:
        """The plan of `step`, in flight from now on (decode-only plans get their graph bucket)."""
        seqs = tuple(decodes) + tuple(prefills)
        bucket = None
        if not prefills:
            bucket = next(b for b in self.config.decode_buckets if b >= len(seqs))
        plan = StepPlan(next(self._step_ids), seqs, self.config.block_size, bucket, self.clock.now(), tuple(preempted),
                        lone_prefill=lone)
        self._in_flight.append(plan)
        self._last_lone = lone
        self.stats.lone_prefill_steps += lone
        self.stats.kv_usage.record(self.blocks.usage)
        return plan

    def _lone_head(self) -> SequenceState | None:
        """The waiting head, when the lone-prefill rule takes it now: the rule is on, no resident sequence is
        mid-prefill (FIFO: its chunks come first), a state slot is free, its whole prompt fits the rule's limits and
        the step budget, and its blocks can be allocated (the admission rule's watermark). Else None."""
        cfg = self.config
        if not self.lone_prefill_tokens or not self._waiting or len(self._running) >= cfg.max_num_seqs:
            return None
        if any(not self._seqs[rid].decoding for rid in self._running):
            return None
        seq = self._seqs[self._waiting[0]]
        if seq.wants_prompt_logprobs:  # the runner's prefill graphs keep one position's logits
            return None
        limit = min(self.lone_prefill_tokens, cfg.max_num_batched_tokens)
        if not cfg.lone_prefill_min_tokens <= seq.num_tokens <= limit:
            return None
        if not self.blocks.can_allocate(seq.num_tokens, use_watermark=bool(self._running)):
            return None
        return seq

    def step_ahead(self, plan: StepPlan) -> StepPlan | None:
        """While the decode-only `plan` is in flight (and nothing else): the next decode step, formed as if every row
        of `plan` goes on, so that the runner can launch it before `plan`'s tokens reach the host (the overlap rule,
        module doc). Its rows are `plan`'s in the same order minus those whose sequence ends by length with
        `plan`'s token; their inputs are `plan`'s sampled ids on the device (`StepPlan.feed_from`). Rows that end by
        EOS or a stop sequence at `plan` (unknown until `finish`) are computed anyway and their token dropped. None
        (form the next step with `step` after `finish`) when: another plan is in flight, `plan` has prefill rows, a
        request is waiting (it must be admitted), a resident sequence is not in `plan`, or the rows need more new
        KV blocks than are free (preemption is `step`'s)."""
        if len(self._in_flight) != 1 or self._in_flight[0] is not plan or plan.bucket_size is None:
            return None
        self.expire()
        if self._waiting:
            return None
        index = {s.request_id: i for i, s in enumerate(plan.seqs)}  # decode-only: every row samples, in order
        if any(rid not in index for rid in self._running):
            return None
        cfg, blocks = self.config, self.blocks
        going = []
        for rid in self._running:
            seq = self._seqs[rid]  # plan's token not yet appended: +1 below
            if seq.num_output_tokens + 1 >= seq.request.max_new_tokens or seq.num_tokens + 1 >= cfg.max_model_len:
                continue  # ends by length at `plan`
            going.append(rid)
        if not going or sum(blocks.blocks_to_append(rid, 1) for rid in going) > blocks.num_free_blocks:
            return None
        seqs = []
        for rid in going:
            seq = self._seqs[rid]
            blocks.append(rid, 1)  # the slot of position num_tokens (the token `plan` samples)
            seqs.append(ScheduledSeq(
                rid, seq.num_tokens, (0,), blocks.block_table(rid), seq.state_slot, reset_state=False,
                is_decode=True, sample=True, output_index=seq.num_output_tokens + 1, seed=seq.seed,
                sampling=seq.request.sampling))
        bucket = next(b for b in cfg.decode_buckets if b >= len(seqs))
        ahead = StepPlan(next(self._step_ids), tuple(seqs), cfg.block_size, bucket, self.clock.now(),
                         feed_from=plan.step_id, feed_index=tuple(index[rid] for rid in going))
        self._in_flight.append(ahead)
        self.stats.steps_ahead += 1
        self.stats.kv_usage.record(blocks.usage)
        return ahead

    def finish(self, plan: StepPlan, output: StepOutput) -> list[TokenDelta]:
        """Apply the runner's sampled tokens: advance every row, append one token per sampling row, answer
        sequences that stopped. Returns the streaming deltas. Raises ValueError, changing nothing, for a plan that is
        not in flight or a wrong token count."""
        self._check_in_flight(plan)
        sampled = [operator.index(t) for t in output.sampled_token_ids]
        n_sampled = sum(s.sample for s in plan.seqs)
        if len(sampled) != n_sampled:
            raise ValueError(f"step {plan.step_id}: {len(sampled)} sampled tokens for {n_sampled} sampling rows")
        if output.logprobs is not None and len(output.logprobs) != n_sampled:
            raise ValueError(f"step {plan.step_id}: {len(output.logprobs)} logprobs for {n_sampled} sampling rows")
        prompt_lps = output.prompt_logprobs
        if prompt_lps is None and any(s.prompt_targets for s in plan.seqs):
            raise ValueError(f"step {plan.step_id}: no prompt log-probabilities for rows that have prompt targets")
        if prompt_lps is not None and (len(prompt_lps) != plan.num_seqs or any(
                len(lp) != len(s.prompt_targets) for lp, s in zip(prompt_lps, plan.seqs))):
            raise ValueError(f"step {plan.step_id}: prompt log-probabilities do not match the rows' prompt targets")
        self.expire()  # a sequence whose deadline passed while the step ran is answered now; its token dropped
        self._in_flight.pop(0)
        now, deltas, tokens = self.clock.now(), [], iter(sampled)
        logprobs = iter(output.logprobs or ())
        for row, item in enumerate(plan.seqs):
            token = next(tokens) if item.sample else None
            lp = next(logprobs, None) if item.sample else None
            seq = self._seqs.get(item.request_id)
            if seq is None:  # cancelled or expired while the step ran
                self.stats.dropped_tokens += token is not None
                continue
            seq.num_computed_tokens = item.end
            if item.prompt_targets and item.prompt_first == seq.prompt_logprobs_next:  # (never twice)
                seq.prompt_logprobs.extend(prompt_lps[row])
            if token is None:
                continue
            seq.token_ids.append(token)
            seq.decoding = True
            prompt = None
            if seq.first_token_s is None:
                seq.first_token_s = now
                self.stats.ttft_s.record(now - seq.arrival_s)
                if seq.request.sampling.prompt_logprobs is not None:
                    prompt = tuple(seq.prompt_logprobs)
            reason, matched = self._stop_reason(seq)
            deltas.append(TokenDelta(item.request_id, (token,), reason, None if lp is None else (lp,), prompt))
            if reason is not None:
                self._answer(item.request_id, completion=Completion(
                    seq.output_token_ids, reason, matched, seq.num_prompt_tokens, seq.num_preemptions,
                    seq.first_token_s))
        self._record_step(plan, now, ok=True)
        return deltas

    def fail(self, plan: StepPlan, error: BaseException) -> None:
        """The runner raised on `plan`: answer every live sequence in it with `StepFailed` (cause = error)."""
        self._check_in_flight(plan)
        self.expire()
        self._in_flight.pop(0)
        for item in plan.seqs:
            if item.request_id in self._seqs:
                self._answer(item.request_id, error=StepFailed(item.request_id, plan.step_id, error))
        self._record_step(plan, self.clock.now(), ok=False)

    def cancel(self, request_id: RequestId) -> bool:
        """Answer with `Cancelled` and free its blocks; False (no-op) if already answered or unknown."""
        if request_id not in self._seqs:
            return False
        self._answer(request_id, error=Cancelled(request_id))
        return True

    def expire(self) -> int:
        """Answer every sequence whose deadline has passed (`now >= deadline_s`); return how many."""
        now = self.clock.now()
        expired = [s for s in self._seqs.values() if s.request.deadline_s is not None and now >= s.request.deadline_s]
        for s in expired:
            running = s.status is SeqStatus.RUNNING
            self._answer(s.request_id, error=SequenceDeadlineExceeded(s.request_id, s.request.deadline_s, now, running))
        return len(expired)

    def pop_answers(self) -> list[Answer]:
        """Answers produced since the last call, in the order they were produced."""
        answers, self._answers = self._answers, []
        return answers

    # ---- internals

    def _check_in_flight(self, plan: StepPlan) -> None:
        if not self._in_flight or self._in_flight[0] is not plan:
            raise ValueError(f"step {plan.step_id} is not in flight (finished twice?), or not the oldest of the "
                             f"steps in flight (they finish in launch order)")

    def _chunk_limit(self, seq: SequenceState, scored: int) -> int:
        """The most tokens `seq`'s next prefill chunk may feed: its uncomputed tokens, and while its prompt
        log-probabilities are computed, what is left of a step's PROMPT_LOGPROBS_CHUNK after `scored` such tokens."""
        n = seq.num_uncomputed
        return min(n, PROMPT_LOGPROBS_CHUNK - scored) if seq.wants_prompt_logprobs else n

    def _slice(self, seq: SequenceState, n: int, *, is_decode: bool) -> ScheduledSeq:
        start = seq.num_computed_tokens
        end = start + n
        sampling = seq.request.sampling
        prior = seq.output_token_ids if start == 0 and sampling.penalized and seq.num_output_tokens else ()
        first = targets = ()
        if seq.wants_prompt_logprobs:  # prompt tokens t with t - 1 in [start, end), not yet computed
            first = max(seq.prompt_logprobs_next, start + 1)
            targets = tuple(seq.token_ids[first:min(end + 1, seq.num_prompt_tokens)])
        return ScheduledSeq(
            seq.request_id, start, tuple(seq.token_ids[start:end]), self.blocks.block_table(seq.request_id),
            seq.state_slot, reset_state=start == 0, is_decode=is_decode, sample=end == seq.num_tokens,
            output_index=seq.num_output_tokens, seed=seq.seed, sampling=sampling, prior_outputs=prior,
            prompt_targets=targets, prompt_first=first if targets else 0)

    def _admit(self, rid: RequestId) -> None:
        seq = self._seqs[rid]
        self.blocks.allocate(rid, seq.num_tokens)  # every known token: prefill chunks never need blocks
        seq.status, seq.state_slot = SeqStatus.RUNNING, heapq.heappop(self._free_slots)
        seq.num_computed_tokens, seq.decoding = 0, False
        insort(self._running, rid)

    def _release(self, seq: SequenceState) -> None:
        """Give back a resident sequence's blocks and state slot."""
        rid = seq.request_id
        self.blocks.free(rid)
        heapq.heappush(self._free_slots, seq.state_slot)
        self._running.remove(rid)
        seq.state_slot = None

    def _preempt(self, rid: RequestId) -> None:
        seq = self._seqs[rid]
        self._release(seq)
        seq.status, seq.num_computed_tokens, seq.decoding = SeqStatus.WAITING, 0, False
        seq.num_preemptions += 1
        self._waiting.appendleft(rid)
        self.stats.preemptions += 1

    def _stop_reason(self, seq: SequenceState) -> tuple[FinishReason | None, tuple[int, ...] | None]:
        req, last = seq.request, seq.token_ids[-1]
        if last in req.eos_token_ids:
            return FinishReason.EOS, (last,)
        n_out = seq.num_output_tokens
        for stop in req.stop_token_ids:
            if len(stop) <= n_out and tuple(seq.token_ids[-len(stop):]) == stop:
                return FinishReason.STOP, stop
        if n_out >= req.max_new_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _answer(self, rid: RequestId, *, completion: Completion | None = None,
                error: SchedulerError | None = None) -> None:
        """Emit the request's one answer and forget it, freeing whatever it holds."""
        seq = self._seqs.pop(rid)
        if seq.status is SeqStatus.RUNNING:
            self._release(seq)
        elif rid in self._waiting:  # absent only when answered inside add (expired on arrival)
            self._waiting.remove(rid)
        now = self.clock.now()
        timings = RequestTimings(seq.arrival_s, now)
        self._answers.append(Answer(rid, (completion,) if error is None else None, error, timings))
        if error is None:
            self.stats.answered_ok += 1
            self.stats.latency_s.record(timings.total_s)
            a, t = self._EWMA_ALPHA, timings.total_s
            self._latency_ewma_s = t if self._latency_ewma_s is None else a * t + (1 - a) * self._latency_ewma_s
        elif isinstance(error, DeadlineExceeded):
            self.stats.deadline_exceeded += 1
        elif isinstance(error, Cancelled):
            self.stats.cancelled += 1
        else:
            self.stats.failed += 1

    def _record_step(self, plan: StepPlan, now: float, *, ok: bool) -> None:
        s = self.stats
        s.steps += 1
        s.failed_steps += not ok
        s.step_run_s.record(now - plan.formed_s)
        if ok:
            s.step_tokens.record(plan.num_tokens)
            s.step_seqs.record(plan.num_seqs)
            s.decode_tokens += plan.num_decode
            s.prefill_tokens += plan.num_tokens - plan.num_decode
