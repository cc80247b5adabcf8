"""Request queue and batch former shared by the engines; device-free (no torch), synchronous and deterministic.

Request path (Sammie)::

    submit(SegmentRequest(image, K prompts))            -> 1 IMAGE item        (or Overloaded, raised at once)
    schedule(IMAGE)     -> Batch of <= 8 images, padded to a bucket  -> runner: ViT        -> complete(batch, features)
        each completed image enqueues its K GROUNDING items (features, prompt_k)
    schedule(GROUNDING) -> Batch of <= 16 pairs, padded to a bucket  -> runner: grounding  -> complete(batch, masks)
        a request is answered once all K of its pairs are done        -> pop_answers() -> [Answer]

The two stages are separate queues with their own batch size, buckets and wait budget, and each may have a batch
on the device at the same time, so the grounding of images 1..8 overlaps the ViT of images 9..16.

Rules (each one is a test in `tests/test_scheduler.py`):

- **Batch release.** A stage releases a batch when its queue holds `max_batch_size` items, or when the oldest
  queued item has waited `max_wait_ms` (counted from when it entered *this* stage's queue), or, with
  `release_when_idle`, when no batch of any stage is running (when both stages then hold items, the one the
  driver schedules first goes -- `AsyncBatchLoop` tries the image stage first -- and the other waits for its budget
  or a slot, as under load); and fewer than `max_inflight_batches` of its batches are
  running. The batch takes the oldest items (FIFO per stage).
- **Buckets.** `Batch.bucket_size` is the smallest `StageConfig.buckets` entry >= the number of real items; the
  runner pads to it so the compiled model only ever sees those batch sizes.
- **Exactly one answer.** Every admitted request (`submit` returned an id) gets exactly one `Answer`, through
  `pop_answers()`: its K outputs, or `DeadlineExceeded`, `Cancelled` or `RunFailed`. A request never gets a second
  answer; outputs that arrive for an answered request are dropped (counted in `StageStats.dropped_items`).
- **Deadlines** (`SegmentRequest.deadline_s`, absolute clock seconds, expired when `now >= deadline_s`). `expire()`
  answers expired requests with `DeadlineExceeded` at once and removes their queued work, which is never run; it
  is called at the start of `schedule`, `complete` and `fail`, so an expired request is never put in a batch and
  outputs of one that expired while running are discarded.
- **Cancellation.** `cancel(id)` answers with `Cancelled` (the one answer; callers that no longer listen may drop
  it) and removes queued work; outputs of running work are dropped. Cancelling an answered request is a no-op.
- **Backpressure.** At most `max_queued` requests are admitted and unanswered at once (queued or running, either
  stage), which also bounds the image features held between the stages. `submit` beyond that raises `Overloaded`
  with a retry-after hint and changes nothing.
- **Time.** Only the injected `Clock` is read. `next_wakeup()` says when waiting could next change anything (a wait
  budget or a deadline running out); a driver sleeps until then or until it is poked (submit, batch done).

The scheduler is not thread-safe: one owner (the asyncio loop thread in `AsyncBatchLoop`) makes every call.

Continuous batching (the Qwen engine) lives in `engine_core/continuous.py`: the same `Clock`, errors and `Answer`
messages and the exactly-one-answer rule, with its own add / step / finish API (a token budget, chunked prefill, KV
blocks, preemption) driven by `qwen_engine/engine.py`'s step loop. The asyncio driver of this scheduler is
`engine_core/batch_loop.py`.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from engine_core.request import (
    Answer,
    Batch,
    Cancelled,
    Clock,
    DeadlineExceeded,
    GroundingInput,
    MonotonicClock,
    Overloaded,
    RequestId,
    RequestTimings,
    RunFailed,
    SchedulerError,
    SegmentRequest,
    Stage,
    WorkItem,
)

logger = logging.getLogger(__name__)

RequestT = TypeVar("RequestT")


# --------------------------------------------------------------------------------------------------------------
# Configuration


def _default_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two below max_batch_size, then max_batch_size itself: 8 -> (1, 2, 4, 8); 12 -> (1, 2, 4, 8, 12)."""
    powers = itertools.takewhile(lambda b: b < max_batch_size, (2**i for i in itertools.count()))
    return (*powers, max_batch_size)


@dataclass(frozen=True)
class StageConfig:
    """Batching knobs of one stage."""

    max_batch_size: int = 8  # real items per batch
    max_wait_ms: float = 5.0  # wait budget: a partial batch goes once its oldest item has queued this long (ms)
    buckets: tuple[int, ...] = ()  # batch sizes the device sees, ascending, last == max_batch_size; () = powers of 2
    max_inflight_batches: int = 1  # batches of this stage running at once; overlap comes from the *other* stage
    release_when_idle: bool = False  # a partial batch also goes at once while no batch of ANY stage runs: the
    #                                  device would otherwise idle through the wait budget (a lone request skips
    #                                  both budgets; under load a batch runs and the queue fills)

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.max_inflight_batches < 1:
            raise ValueError(f"max_inflight_batches must be >= 1, got {self.max_inflight_batches}")
        buckets = tuple(self.buckets) or _default_buckets(self.max_batch_size)
        if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be positive and strictly ascending, got {buckets}")
        if buckets[-1] != self.max_batch_size:
            raise ValueError(f"the largest bucket must equal max_batch_size={self.max_batch_size}, got {buckets}")
        object.__setattr__(self, "buckets", buckets)

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0

    def bucket_for(self, n: int) -> int:
        """Smallest bucket >= n (1 <= n <= max_batch_size)."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} items exceed max_batch_size={self.max_batch_size}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything `PipelineScheduler` needs; an engine config embeds one of these."""

    # 8 images fill the H200 at 1008 px; K prompts per image means the grounding stage sees ~K x as many items.
    image: StageConfig = field(default_factory=lambda: StageConfig(max_batch_size=8, max_wait_ms=5.0))
    grounding: StageConfig = field(default_factory=lambda: StageConfig(max_batch_size=16, max_wait_ms=2.0))
    max_queued: int = 64  # admitted-but-unanswered requests (queued or running, either stage) before Overloaded
    default_retry_after_s: float = 1.0  # Overloaded hint before any request has been answered
    min_retry_after_s: float = 0.05  # clamp of the Overloaded hint (s); > 0 so clients always back off a little
    max_retry_after_s: float = 30.0

    def __post_init__(self):
        if self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {self.max_queued}")
        if not 0 < self.min_retry_after_s <= self.default_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 < min_retry_after_s <= default_retry_after_s <= max_retry_after_s")

    def stage(self, stage: Stage) -> StageConfig:
        return {Stage.IMAGE: self.image, Stage.GROUNDING: self.grounding}[stage]


# --------------------------------------------------------------------------------------------------------------
# Metrics


class Samples:
    """One measurement: total count and sum, plus the most recent `window` values (for quantiles/histograms)."""

    def __init__(self, window: int = 4096):
        self.count = 0
        self.total = 0.0
        self.recent: deque[float] = deque(maxlen=window)

    def record(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.recent.append(value)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    @property
    def max(self) -> float:
        return max(self.recent, default=0.0)

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile (0 <= q <= 1) over the recent window; 0.0 when empty."""
        if not self.recent:
            return 0.0
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One finished batch, as passed to `SchedulerStats.on_batch` hooks (e.g. Prometheus histograms)."""

    stage: Stage
    batch_id: int
    size: int  # real items
    bucket_size: int  # padded size the device saw
    queue_wait_s: tuple[float, ...]  # per item: entered the stage queue -> batch formed
    run_s: float  # batch formed -> complete/fail
    ok: bool  # False: the runner failed
    dropped: int  # items whose request was already answered (cancelled / expired) when the batch finished


@dataclass
class StageStats:
    batches: int = 0
    items: int = 0  # real items run
    padding: int = 0  # padded rows run (bucket_size - size, summed)
    failed_batches: int = 0
    dropped_items: int = 0  # outputs discarded: their request was answered while they ran
    batch_size: Samples = field(default_factory=Samples)  # real items per batch
    queue_wait_s: Samples = field(default_factory=Samples)  # per item, seconds
    run_s: Samples = field(default_factory=Samples)  # per batch, seconds


@dataclass
class SchedulerStats:
    """Counters and sample windows a server exports; hooks in `on_batch` see every finished batch (must not raise)."""

    submitted: int = 0  # admitted requests
    rejected: int = 0  # Overloaded at submit
    answered_ok: int = 0
    deadline_exceeded: int = 0
    cancelled: int = 0
    failed: int = 0  # RunFailed
    latency_s: Samples = field(default_factory=Samples)  # submit -> ok answer
    stages: dict[Stage, StageStats] = field(default_factory=lambda: {s: StageStats() for s in Stage})
    on_batch: list[Callable[[BatchRecord], None]] = field(default_factory=list)

    def snapshot(self) -> dict[str, float]:
        """Flat name -> value map, e.g. `image.batch_size.mean`, `grounding.run_s.p99`, `answered_ok`."""
        out: dict[str, float] = {
            k: float(getattr(self, k))
            for k in ("submitted", "rejected", "answered_ok", "deadline_exceeded", "cancelled", "failed")
        }
        out |= {"latency_s.mean": self.latency_s.mean, "latency_s.p50": self.latency_s.quantile(0.5),
                "latency_s.p99": self.latency_s.quantile(0.99)}
        for stage, s in self.stages.items():
            p = stage.value
            out |= {f"{p}.batches": s.batches, f"{p}.items": s.items, f"{p}.padding": s.padding,
                    f"{p}.failed_batches": s.failed_batches, f"{p}.dropped_items": s.dropped_items,
                    f"{p}.batch_size.mean": s.batch_size.mean, f"{p}.batch_size.max": s.batch_size.max,
                    f"{p}.queue_wait_s.mean": s.queue_wait_s.mean,
                    f"{p}.queue_wait_s.p99": s.queue_wait_s.quantile(0.99),
                    f"{p}.run_s.mean": s.run_s.mean, f"{p}.run_s.p99": s.run_s.quantile(0.99)}
        return out


# --------------------------------------------------------------------------------------------------------------
# Interface


class SchedulerInterface(ABC, Generic[RequestT]):
    """What a driver (`AsyncBatchLoop`, a test, a benchmark) needs from a scheduler; the Sammie pipeline implements
    it (the Qwen engine's continuous scheduler has its own add / step / finish API).

    The loop is three verbs (`schedule` -> runner -> `complete`/`fail`) plus `pop_answers` to collect answers.
    Every method is synchronous, reads time only from `clock`, and never blocks.
    """

    clock: Clock
    stats: SchedulerStats

    @property
    @abstractmethod
    def stages(self) -> tuple[Stage, ...]:
        """The stages, in pipeline order; a driver polls `schedule` for each."""

    @abstractmethod
    def submit(self, request: RequestT) -> RequestId:
        """Admit a request and return its id, or raise `Overloaded` (nothing changes) / `ValueError` (malformed).

        An admitted request is answered exactly once, through `pop_answers()`.
        """

    @abstractmethod
    def schedule(self, stage: Stage) -> Batch | None:
        """Expire deadlines, then release the next batch of `stage` if it is full or its wait budget is spent and
        the stage has room on the device; otherwise None. The returned batch is running until `complete`/`fail`."""

    @abstractmethod
    def complete(self, batch: Batch, outputs: Sequence[Any]) -> None:
        """Take one output per real item of a running batch (item order). Raises ValueError, changing nothing, for
        an unknown/finished batch or a wrong output count."""

    @abstractmethod
    def fail(self, batch: Batch, error: BaseException) -> None:
        """The runner raised on a running batch: answer each live request in it with `RunFailed` (cause = error)."""

    @abstractmethod
    def cancel(self, request_id: RequestId) -> bool:
        """Answer with `Cancelled` and drop its work; False (no-op) if already answered or unknown."""

    @abstractmethod
    def expire(self) -> int:
        """Answer every request whose deadline has passed with `DeadlineExceeded`; return how many."""

    @abstractmethod
    def next_wakeup(self) -> float | None:
        """Earliest clock time at which `schedule`/`expire` could act without outside events: a runnable stage's
        oldest item exhausting its wait budget (or now, if the queue is already full), or a deadline.
        None: nothing will happen until the next submit/complete/fail/cancel."""

    @abstractmethod
    def pop_answers(self) -> list[Answer]:
        """Answers produced since the last call, in the order they were produced."""

    @property
    @abstractmethod
    def num_unfinished(self) -> int:
        """Admitted requests not yet answered."""


# --------------------------------------------------------------------------------------------------------------
# Sammie's two-stage scheduler


@dataclass(slots=True)
class _Live:
    """Book-keeping of one unanswered request."""

    request: SegmentRequest
    arrival_s: float
    outputs: list[Any]  # K grounding outputs, filled as pairs complete
    remaining: int  # grounding outputs still missing
    stage: Stage = Stage.IMAGE  # GROUNDING once its image output arrived
    running: int = 0  # of its items, how many are in running batches
    image_started_s: float | None = None
    image_done_s: float | None = None


class PipelineScheduler(SchedulerInterface[SegmentRequest]):
    """Two-stage batch former for Sammie: IMAGE (one item per request) then GROUNDING (K items per request)."""

    _EWMA_ALPHA = 0.2  # weight of the newest latency in the retry-after estimate (~ last 5-10 answers)

    def __init__(self, config: SchedulerConfig | None = None, clock: Clock | None = None):
        self.config = config or SchedulerConfig()
        self.clock = clock or MonotonicClock()
        self.stats = SchedulerStats()
        self._queues: dict[Stage, deque[WorkItem]] = {s: deque() for s in Stage}
        self._live: dict[RequestId, _Live] = {}  # unanswered requests, arrival order
        self._running: dict[int, Batch] = {}  # batch_id -> batch
        self._answers: list[Answer] = []
        self._request_ids = itertools.count()
        self._batch_ids = itertools.count()
        self._latency_ewma_s: float | None = None

    # ---- introspection

    @property
    def stages(self) -> tuple[Stage, ...]:
        return (Stage.IMAGE, Stage.GROUNDING)

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    def num_queued(self, stage: Stage) -> int:
        """Items waiting in `stage`'s queue (not running)."""
        return len(self._queues[stage])

    def running_batches(self, stage: Stage | None = None) -> list[Batch]:
        return [b for b in self._running.values() if stage is None or b.stage is stage]

    def retry_after_s(self) -> float:
        """The hint `Overloaded` would carry now; for an engine that rejects before `submit` (e.g. while decoding)."""
        return self._retry_after_s()

    # ---- the verbs

    def submit(self, request: SegmentRequest) -> RequestId:
        if not isinstance(request, SegmentRequest):
            raise TypeError(f"expected a SegmentRequest, got {type(request).__name__}")
        if len(self._live) >= self.config.max_queued:
            self.stats.rejected += 1
            raise Overloaded(self._retry_after_s(), len(self._live), self.config.max_queued)
        now = self.clock.now()
        rid = next(self._request_ids)
        k = len(request.prompts)
        self._live[rid] = _Live(request, arrival_s=now, outputs=[None] * k, remaining=k)
        self.stats.submitted += 1
        if request.deadline_s is not None and now >= request.deadline_s:
            self._answer(rid, error=DeadlineExceeded(rid, request.deadline_s, now, stage=None, running=False))
        else:
            self._queues[Stage.IMAGE].append(WorkItem(rid, 0, request.image, enqueued_s=now))
        return rid

    def schedule(self, stage: Stage) -> Batch | None:
        self.expire()
        cfg = self.config.stage(stage)
        queue = self._queues[stage]
        if not queue or len(self.running_batches(stage)) >= cfg.max_inflight_batches:
            return None
        now = self.clock.now()
        # `now >= enqueued + wait` (not `now - enqueued >= wait`) so a FakeClock set to next_wakeup() releases exactly.
        if not self._release_now(stage) and now < queue[0].enqueued_s + cfg.max_wait_s:
            return None
        n = min(len(queue), cfg.max_batch_size)
        items = tuple(queue.popleft() for _ in range(n))
        batch = Batch(next(self._batch_ids), stage, items, cfg.bucket_for(n), formed_s=now)
        self._running[batch.batch_id] = batch
        for item in items:
            live = self._live[item.request_id]  # queued items always belong to live requests (answering purges)
            live.running += 1
            if stage is Stage.IMAGE:
                live.image_started_s = now
            self.stats.stages[stage].queue_wait_s.record(now - item.enqueued_s)
        return batch

    def complete(self, batch: Batch, outputs: Sequence[Any]) -> None:
        self._check_running(batch)
        try:
            n_outputs = len(outputs)
        except TypeError:
            raise ValueError(f"runner outputs must be a sequence, got {type(outputs).__name__}") from None
        if n_outputs != batch.size:
            raise ValueError(
                f"{batch.stage.value} batch {batch.batch_id}: {n_outputs} outputs for {batch.size} real items "
                f"(bucket {batch.bucket_size}); the runner must drop padding rows"
            )
        self.expire()  # a request whose deadline passed while this batch ran is answered now; its output dropped
        del self._running[batch.batch_id]
        now = self.clock.now()
        dropped = 0
        for item, out in zip(batch.items, outputs):
            live = self._live.get(item.request_id)
            if live is None:
                dropped += 1
                continue
            live.running -= 1
            if batch.stage is Stage.IMAGE:
                live.stage, live.image_done_s = Stage.GROUNDING, now
                grounding = self._queues[Stage.GROUNDING]
                for k, prompt in enumerate(live.request.prompts):
                    grounding.append(WorkItem(item.request_id, k, GroundingInput(out, prompt), enqueued_s=now))
            else:
                live.outputs[item.index] = out
                live.remaining -= 1
                if live.remaining == 0:
                    self._answer(item.request_id, outputs=tuple(live.outputs))
        self._record_batch(batch, now, ok=True, dropped=dropped)

    def fail(self, batch: Batch, error: BaseException) -> None:
        self._check_running(batch)
        self.expire()
        del self._running[batch.batch_id]
        dropped = 0
        for item in batch.items:
            if item.request_id not in self._live:  # already answered, incl. an earlier pair of this batch
                dropped += 1
                continue
            self._answer(item.request_id, error=RunFailed(item.request_id, batch.stage, batch.batch_id, error))
        self._record_batch(batch, self.clock.now(), ok=False, dropped=dropped)

    def cancel(self, request_id: RequestId) -> bool:
        if request_id not in self._live:
            return False
        self._answer(request_id, error=Cancelled(request_id))
        return True

    def expire(self) -> int:
        now = self.clock.now()
        expired = [rid for rid, live in self._live.items()
                   if live.request.deadline_s is not None and now >= live.request.deadline_s]
        for rid in expired:
            live = self._live[rid]
            error = DeadlineExceeded(rid, live.request.deadline_s, now, stage=live.stage, running=live.running > 0)
            self._answer(rid, error=error, purge=False)
        if expired:
            self._purge(set(expired))
        return len(expired)

    def next_wakeup(self) -> float | None:
        times: list[float] = []
        for stage in self.stages:
            cfg, queue = self.config.stage(stage), self._queues[stage]
            if queue and len(self.running_batches(stage)) < cfg.max_inflight_batches:
                times.append(self.clock.now() if self._release_now(stage) else queue[0].enqueued_s + cfg.max_wait_s)
        times += [live.request.deadline_s for live in self._live.values() if live.request.deadline_s is not None]
        return min(times, default=None)

    def pop_answers(self) -> list[Answer]:
        answers, self._answers = self._answers, []
        return answers

    # ---- internals

    def _release_now(self, stage: Stage) -> bool:
        """A queued partial batch need not wait out its budget: the queue is full, or (release_when_idle) no batch
        of any stage is running (the device would idle; a batch of the other stage running means it is busy and the
        queue can fill: the per-stage rule measured 60.1 -> 45.6 img/s under load, waterfall run 4)."""
        cfg = self.config.stage(stage)
        return len(self._queues[stage]) >= cfg.max_batch_size or (
            cfg.release_when_idle and not self._running)

    def _check_running(self, batch: Batch) -> None:
        if self._running.get(batch.batch_id) is not batch:
            raise ValueError(f"{batch.stage.value} batch {batch.batch_id} is not running (finished twice?)")

    def _answer(self, rid: RequestId, *, outputs: tuple[Any, ...] | None = None,
                error: SchedulerError | None = None, purge: bool = True) -> None:
        """Emit the request's one answer and forget it; with an error, also drop its queued work."""
        live = self._live.pop(rid)
        now = self.clock.now()
        timings = RequestTimings(live.arrival_s, now, live.image_started_s, live.image_done_s)
        self._answers.append(Answer(rid, outputs if error is None else None, error, timings))
        if error is None:
            self.stats.answered_ok += 1
            self.stats.latency_s.record(timings.total_s)
            a = self._EWMA_ALPHA
            self._latency_ewma_s = timings.total_s if self._latency_ewma_s is None else (
                a * timings.total_s + (1 - a) * self._latency_ewma_s)
            return
        if isinstance(error, DeadlineExceeded):
            self.stats.deadline_exceeded += 1
        elif isinstance(error, Cancelled):
            self.stats.cancelled += 1
        else:
            self.stats.failed += 1
        if purge:
            self._purge({rid})

    def _purge(self, rids: set[RequestId]) -> None:
        """Remove queued items of answered requests (O(queue length); queues hold <= max_queued x K items)."""
        for stage, queue in self._queues.items():
            if any(item.request_id in rids for item in queue):
                self._queues[stage] = deque(item for item in queue if item.request_id not in rids)

    def _retry_after_s(self) -> float:
        """Overloaded hint: the recent submit->answer latency. By Little's law that is about how long the current
        full backlog takes to turn over, so clients told to come back then find room (and don't retry in a storm)."""
        cfg = self.config
        estimate = cfg.default_retry_after_s if self._latency_ewma_s is None else self._latency_ewma_s
        return min(max(estimate, cfg.min_retry_after_s), cfg.max_retry_after_s)

    def _record_batch(self, batch: Batch, now: float, *, ok: bool, dropped: int) -> None:
        s = self.stats.stages[batch.stage]
        s.batches += 1
        s.items += batch.size
        s.padding += batch.num_padding
        s.failed_batches += 0 if ok else 1
        s.dropped_items += dropped
        s.batch_size.record(batch.size)
        s.run_s.record(now - batch.formed_s)
        if self.stats.on_batch:
            record = BatchRecord(batch.stage, batch.batch_id, batch.size, batch.bucket_size,
                                 tuple(batch.formed_s - i.enqueued_s for i in batch.items), now - batch.formed_s,
                                 ok, dropped)
            for hook in self.stats.on_batch:
                hook(record)
