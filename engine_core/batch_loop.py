"""`AsyncBatchLoop`: drives a `SchedulerInterface` (`engine_core/scheduler.py`) with a `Runner` on an asyncio loop.

The scheduler itself is synchronous, device-free and single-owner; this is the owner: one asyncio task that expires,
schedules, starts batches (blocking runners on one worker thread per stage), resolves one future per request and
sleeps until the scheduler's next wake-up or a poke.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from collections.abc import Sequence
from typing import Any, Generic, Protocol

from engine_core.request import Answer, Batch, RequestId, Stage
from engine_core.scheduler import RequestT, SchedulerInterface

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------------
# asyncio driver


class Runner(Protocol):
    """The engine's model calls. `run` gets a running batch and returns one output per real item (item order).

    May be a plain (blocking) method, run on a per-stage worker thread so the event loop stays free, or an
    `async def`, awaited on the loop. For IMAGE batches the outputs become `GroundingInput.features`; for
    GROUNDING batches they become `Answer.outputs[k]`. Raising fails every request in the batch (`RunFailed`).
    """

    def run(self, stage: Stage, batch: Batch) -> Sequence[Any]: ...


class AsyncRunner(Protocol):
    """`Runner` whose `run` is a coroutine (awaited on the event loop, e.g. one that awaits a CUDA event)."""

    async def run(self, stage: Stage, batch: Batch) -> Sequence[Any]: ...


class AsyncBatchLoop(Generic[RequestT]):
    """Drives a `SchedulerInterface` with a `Runner` on an asyncio loop and resolves one future per request.

    One background task: expire -> schedule every stage -> start each batch as its own task (stages overlap) ->
    hand answers to futures -> sleep until `next_wakeup()` or a poke. Each future is resolved at most once, and a
    caller whose task is cancelled (client disconnect) cancels its request. All scheduler calls happen on the
    loop's thread; a blocking runner runs on one worker thread per stage (kernels of a stage issued in order from
    one thread; an engine can bind a CUDA stream per stage inside `run`), so with a blocking runner a stage's
    `max_inflight_batches > 1` only helps if `run` returns before the device is done (outputs still on the GPU).
    """

    def __init__(self, scheduler: SchedulerInterface[RequestT], runner: Runner | AsyncRunner):
        self.scheduler = scheduler
        self.runner = runner
        self._runner_is_async = inspect.iscoroutinefunction(runner.run)
        self._executors = {
            s: concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{s.value}")
            for s in scheduler.stages
        }
        self._futures: dict[RequestId, asyncio.Future[Answer]] = {}
        self._batch_tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._main: asyncio.Task | None = None
        self._closing = False

    async def __aenter__(self) -> AsyncBatchLoop[RequestT]:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose(drain=exc[0] is None)

    def start(self) -> None:
        """Start the background task (call from a running event loop)."""
        if self._main is None:
            self._main = asyncio.get_running_loop().create_task(self._run(), name="engine-batch-loop")

    @property
    def running(self) -> bool:
        """The background task is started and has not ended (it ends on `aclose`, or if it crashed)."""
        return self._main is not None and not self._main.done()

    def submit(self, request: RequestT) -> tuple[RequestId, asyncio.Future[Answer]]:
        """Admit a request (raises `Overloaded` at once) and return its id and a future for its `Answer`."""
        if self._main is None or self._closing:
            raise RuntimeError("AsyncBatchLoop is not running")
        rid = self.scheduler.submit(request)
        future = asyncio.get_running_loop().create_future()
        self._futures[rid] = future
        self._wake.set()
        return rid, future

    async def infer(self, request: RequestT) -> Answer:
        """Submit and wait: the ok `Answer`, or raise its error (`Overloaded` comes from submit, before waiting)."""
        rid, future = self.submit(request)
        try:
            answer = await future
        except asyncio.CancelledError:
            self.cancel(rid)
            raise
        if answer.error is not None:
            raise answer.error
        return answer

    def cancel(self, request_id: RequestId) -> bool:
        cancelled = self.scheduler.cancel(request_id)
        self._wake.set()
        return cancelled

    async def aclose(self, *, drain: bool = True) -> None:
        """Stop: with drain, answer everything already admitted first; without, cancel it. New submits fail."""
        self._closing = True
        if not drain:
            for rid in list(self._futures):
                self.scheduler.cancel(rid)
        self._wake.set()
        if self._main is not None:
            await self._main
        for executor in self._executors.values():
            executor.shutdown(wait=False)

    # ---- internals

    async def _run(self) -> None:
        clock = self.scheduler.clock
        try:
            while True:
                self._wake.clear()
                self._drive()
                if self._closing and self.scheduler.num_unfinished == 0 and not self._batch_tasks:
                    return
                wake_at = self.scheduler.next_wakeup()
                timeout = None if wake_at is None else max(wake_at - clock.now(), 0.0)
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
        except Exception as exc:  # a scheduler bug: fail loudly and free every waiter rather than hang them
            logger.exception("batch loop crashed")
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"batch loop crashed: {exc!r}"))
            self._futures.clear()
            raise

    def _drive(self) -> None:
        self.scheduler.expire()
        for stage in self.scheduler.stages:
            while (batch := self.scheduler.schedule(stage)) is not None:
                task = asyncio.get_running_loop().create_task(self._run_batch(batch))
                self._batch_tasks.add(task)
                task.add_done_callback(self._batch_tasks.discard)
        for answer in self.scheduler.pop_answers():
            future = self._futures.pop(answer.request_id, None)
            if future is not None and not future.done():  # done: its caller was cancelled and left
                future.set_result(answer)

    async def _run_batch(self, batch: Batch) -> None:
        try:
            if self._runner_is_async:
                outputs = await self.runner.run(batch.stage, batch)
            else:
                loop = asyncio.get_running_loop()
                outputs = await loop.run_in_executor(self._executors[batch.stage], self.runner.run, batch.stage, batch)
        except Exception as exc:
            self.scheduler.fail(batch, exc)
        else:
            try:
                self.scheduler.complete(batch, outputs)
            except ValueError as exc:  # wrong output count: nothing was applied, so fail the batch instead
                self.scheduler.fail(batch, exc)
        finally:
            # Leave the task set *before* poking the loop: a closing loop exits once no batch task is left, and the
            # done-callback discard alone could run after the loop has already gone back to sleep.
            self._batch_tasks.discard(asyncio.current_task())
            self._wake.set()
