"""Typed messages shared by every engine: clock, requests, work items, batches, answers and errors.

Nothing here imports torch: payloads (`SegmentRequest.image`, `WorkItem.payload`, runner outputs) are opaque
objects that only the engine's runner understands, so the scheduler in `engine_core/scheduler.py` can be tested on
a CPU with a fake clock and a fake runner. Shapes the Sammie engine is expected to put in the opaque fields are
noted next to each one.

Times are seconds on the scheduler's injected `Clock` (monotonic, arbitrary origin); durations end in `_s`, and
the only millisecond value is the wait budget `StageConfig.max_wait_ms` in `scheduler.py`.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

RequestId = int  # assigned by the scheduler at submit, unique per scheduler, increasing in arrival order


# --------------------------------------------------------------------------------------------------------------
# Clock


@runtime_checkable
class Clock(Protocol):
    """Where the scheduler reads time. Injected everywhere so that no logic calls `time.*` behind the tests' back."""

    def now(self) -> float:
        """Seconds since an arbitrary origin; never decreases."""
        ...


class MonotonicClock:
    """The real clock: `time.monotonic()` (seconds, unaffected by wall-clock adjustments)."""

    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told to; for deterministic tests."""

    def __init__(self, start_s: float = 0.0):
        self._now_s = float(start_s)

    def now(self) -> float:
        return self._now_s

    def advance(self, dt_s: float) -> float:
        """Move forward by `dt_s` seconds (>= 0) and return the new time."""
        if dt_s < 0:
            raise ValueError(f"a clock cannot go backwards (dt_s={dt_s})")
        self._now_s += dt_s
        return self._now_s

    def set(self, t_s: float) -> None:
        """Jump to absolute time `t_s` (>= now), e.g. to exactly `scheduler.next_wakeup()`."""
        if t_s < self._now_s:
            raise ValueError(f"a clock cannot go backwards ({t_s} < {self._now_s})")
        self._now_s = float(t_s)


# --------------------------------------------------------------------------------------------------------------
# Requests, work items, batches


class Stage(str, enum.Enum):
    """A queue with its own batch size, buckets and wait budget; one runner call per batch.

    Sammie is a two-stage pipeline. The Qwen engine will add a single `STEP` stage (one forward pass over all
    resident sequences); see "Continuous batching" in `scheduler.py`.
    """

    IMAGE = "image"  # one item per request: the image through the ViT backbone (+ FPN neck)
    GROUNDING = "grounding"  # one item per (image, prompt) pair: text features + fusion encoder + DETR decoder + masks


@dataclass(frozen=True, slots=True)
class SegmentRequest:
    """One user request: one image and K >= 1 text prompts, answered once with K outputs (prompt order)."""

    image: Any  # image-stage input, opaque here; for Sammie a preprocessed (3, 1008, 1008) tensor
    prompts: tuple[Any, ...]  # K >= 1 grounding inputs, opaque here; for Sammie prompt strings (text cache key)
    deadline_s: float | None = None  # absolute time on the scheduler's clock; None = no deadline

    def __post_init__(self):
        if not isinstance(self.prompts, tuple):
            object.__setattr__(self, "prompts", tuple(self.prompts))
        if not self.prompts:
            raise ValueError("a SegmentRequest needs at least one prompt")


@dataclass(frozen=True, slots=True)
class GroundingInput:
    """Payload of a GROUNDING work item: the image stage's output for this request plus one prompt."""

    features: Any  # what the runner returned for this request's IMAGE item (e.g. FPN feature maps, batch dim 1)
    prompt: Any  # SegmentRequest.prompts[index]


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One unit of work in one stage's queue: an image (IMAGE) or an (image, prompt) pair (GROUNDING)."""

    request_id: RequestId
    index: int  # IMAGE: 0; GROUNDING: prompt index 0..K-1 within the request
    payload: Any  # IMAGE: SegmentRequest.image; GROUNDING: GroundingInput
    enqueued_s: float  # when it entered this stage's queue (the wait budget counts from here)


@dataclass(frozen=True, slots=True)
class Batch:
    """What `schedule(stage)` hands to the runner: up to `max_batch_size` real items plus padding to a bucket.

    The scheduler never invents padding payloads; the runner pads the device batch from `size` up to
    `bucket_size` (e.g. repeating the last item, as torchao's SAM2 server does) so that the compiled model sees only
    the shapes in `StageConfig.buckets`, and returns exactly `size` outputs, one per real item, in item order.
    """

    batch_id: int  # unique per scheduler; `complete` / `fail` accept each batch once
    stage: Stage
    items: tuple[WorkItem, ...]  # real items, FIFO order
    bucket_size: int  # smallest configured bucket >= len(items): the batch dim the device sees
    formed_s: float  # when `schedule` released it (run time counts from here)

    @property
    def size(self) -> int:
        """Number of real items (<= bucket_size)."""
        return len(self.items)

    @property
    def num_padding(self) -> int:
        """Rows of padding the runner adds: bucket_size - size."""
        return self.bucket_size - len(self.items)

    @property
    def payloads(self) -> tuple[Any, ...]:
        return tuple(item.payload for item in self.items)


# --------------------------------------------------------------------------------------------------------------
# Answers


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where a request's time went, in clock seconds (None for stages it never reached)."""

    arrival_s: float  # submit
    answered_s: float  # answer emitted
    image_started_s: float | None = None  # its IMAGE batch was formed
    image_done_s: float | None = None  # its IMAGE output arrived and its K pairs entered the GROUNDING queue

    @property
    def total_s(self) -> float:
        return self.answered_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class Answer:
    """The one terminal message for an admitted request: outputs, or an error. Emitted exactly once."""

    request_id: RequestId
    outputs: tuple[Any, ...] | None  # one GROUNDING output per prompt, prompt order; None iff error is set
    error: SchedulerError | None
    timings: RequestTimings

    @property
    def ok(self) -> bool:
        return self.error is None


# --------------------------------------------------------------------------------------------------------------
# Errors (a server maps each to one status code; suggested codes in brackets)


class SchedulerError(Exception):
    """Base of every error the scheduler reports for a request."""


class Overloaded(SchedulerError):
    """[503 or 429 + Retry-After] Raised by `submit` when `max_queued` requests are already unanswered.

    The request was not admitted and the scheduler is unchanged. `retry_after_s` (> 0) estimates how long until
    the current backlog has turned over.
    """

    def __init__(self, retry_after_s: float, unanswered: int, max_queued: int):
        self.retry_after_s = retry_after_s
        self.unanswered = unanswered
        self.max_queued = max_queued
        super().__init__(
            f"overloaded: {unanswered}/{max_queued} requests unanswered; retry after {retry_after_s:.3f} s"
        )


class DeadlineExceeded(SchedulerError):
    """[504] The request's deadline passed before its answer; whatever it was doing is abandoned.

    Queued work is removed and never run; outputs of work already running are discarded when they arrive.
    """

    def __init__(self, request_id: RequestId, deadline_s: float, now_s: float, stage: Stage | None, running: bool):
        self.request_id = request_id
        self.deadline_s = deadline_s
        self.now_s = now_s
        self.stage = stage  # the stage it was in (None: expired on arrival)
        self.running = running  # True: some of its work was on the device
        where = "on arrival" if stage is None else f"while {'running' if running else 'queued'} in {stage.value}"
        super().__init__(f"request {request_id} missed its deadline {where} (late by {now_s - deadline_s:.3f} s)")


class Cancelled(SchedulerError):
    """[499] The request was cancelled (e.g. the client disconnected); its queued work is removed, its running
    work's outputs are dropped. This is the request's only answer."""

    def __init__(self, request_id: RequestId):
        self.request_id = request_id
        super().__init__(f"request {request_id} was cancelled")


class RunFailed(SchedulerError):
    """[500] The runner raised (or returned the wrong number of outputs) on a batch holding this request.

    The runner's exception is `__cause__`; every request in the failed batch gets its own `RunFailed`.
    """

    def __init__(self, request_id: RequestId, stage: Stage, batch_id: int, cause: BaseException):
        self.request_id = request_id
        self.stage = stage
        self.batch_id = batch_id
        super().__init__(f"request {request_id}: {stage.value} batch {batch_id} failed: {cause!r}")
        self.__cause__ = cause


# --------------------------------------------------------------------------------------------------------------
# Errors raised before a request is admitted (shared by the engines; their servers map them to 4xx / 503)


class BadRequest(ValueError):
    """The client sent something we refuse. `code` is stable and machine-readable; the message names the problem.
    Each engine documents its codes (`sammie.engine.BAD_REQUEST_CODES`, `qwen_engine.engine.BAD_REQUEST_CODES`)."""

    def __init__(self, code: str, message: str):
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


class NotReady(RuntimeError):
    """The engine has not finished starting (weights + warm-up) or is shutting down."""


def client_timeout(timeout_s: Any, limit_s: float | None) -> float | None:
    """A request's timeout in seconds: the client's `timeout_s` (None: use `limit_s`), which may shorten the
    operator's `limit_s` but never extend it (None = no limit). Anything but a finite number > 0 is BadRequest."""
    if timeout_s is None:
        return limit_s
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise BadRequest("invalid_timeout", f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    return float(timeout_s) if limit_s is None else min(float(timeout_s), limit_s)
