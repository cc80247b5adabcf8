"""engine_core.scheduler with a fake clock and a fake runner: no torch, no device, deterministic.

Fake runner convention: an IMAGE item's output is ("feat", image) and a GROUNDING item's output is
(features, prompt), so an answer's outputs can be checked against the request that produced it.
"""

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_core.request import (
    Batch,
    Cancelled,
    DeadlineExceeded,
    FakeClock,
    GroundingInput,
    Overloaded,
    RunFailed,
    SegmentRequest,
    Stage,
)
from engine_core.batch_loop import AsyncBatchLoop
from engine_core.scheduler import PipelineScheduler, SchedulerConfig, StageConfig

T0 = 100.0  # fake clock origin (s); not 0 so that absolute-vs-relative time mix-ups show


def make(image_bs=4, image_wait_ms=10.0, g_bs=4, g_wait_ms=10.0, max_queued=64, image_buckets=(), g_buckets=(),
         inflight=1):
    clock = FakeClock(T0)
    cfg = SchedulerConfig(
        image=StageConfig(image_bs, image_wait_ms, image_buckets, inflight),
        grounding=StageConfig(g_bs, g_wait_ms, g_buckets, inflight),
        max_queued=max_queued,
    )
    return PipelineScheduler(cfg, clock), clock


def req(name, k=1, deadline_s=None) -> SegmentRequest:
    return SegmentRequest(image=f"img{name}", prompts=tuple(f"{name}/p{i}" for i in range(k)), deadline_s=deadline_s)


def fake_outputs(batch: Batch) -> list:
    if batch.stage is Stage.IMAGE:
        return [("feat", p) for p in batch.payloads]
    return [(p.features, p.prompt) for p in batch.payloads]


def expected_outputs(request: SegmentRequest) -> tuple:
    return tuple((("feat", request.image), p) for p in request.prompts)


def finish(sched, batch):
    sched.complete(batch, fake_outputs(batch))


def rids(batch):
    return [item.request_id for item in batch.items]


def answers_by_id(sched):
    out = {}
    for a in sched.pop_answers():
        assert a.request_id not in out
        out[a.request_id] = a
    return out


# ---------------------------------------------------------------------------------------------------------------
# batch formation and buckets


def test_full_batch_released_at_once():
    sched, clock = make(image_bs=4, image_wait_ms=10.0)
    ids = [sched.submit(req(i)) for i in range(5)]
    batch = sched.schedule(Stage.IMAGE)  # no time has passed: released because full
    assert batch is not None and rids(batch) == ids[:4]
    assert (batch.size, batch.bucket_size, batch.num_padding) == (4, 4, 0)
    assert batch.formed_s == T0
    assert sched.schedule(Stage.IMAGE) is None  # one image batch in flight (max_inflight_batches=1)
    assert sched.num_queued(Stage.IMAGE) == 1


def test_partial_batch_released_after_wait_budget_and_not_before():
    sched, clock = make(image_bs=4, image_wait_ms=10.0)
    first = sched.submit(req(0))
    clock.advance(0.004)
    second = sched.submit(req(1))
    assert sched.schedule(Stage.IMAGE) is None
    assert sched.next_wakeup() == T0 + 0.010  # the *oldest* item's budget, not the newest's
    clock.set(T0 + 0.0099)
    assert sched.schedule(Stage.IMAGE) is None
    clock.set(sched.next_wakeup())
    batch = sched.schedule(Stage.IMAGE)
    assert batch is not None and rids(batch) == [first, second]
    assert (batch.size, batch.bucket_size, batch.num_padding) == (2, 2, 0)
    assert sched.next_wakeup() is None  # queue empty, no deadlines


def test_release_when_idle_skips_the_wait_only_while_no_batch_of_any_stage_runs():
    """release_when_idle: a lone request's image and then its pairs go at once (nothing runs: the device would idle
    through the budgets); while a batch of EITHER stage runs, partial batches wait for their budget (or a slot) as
    without it, so under load they fill (H200, waterfall run 4: the earlier per-stage rule -- release while the own
    stage is idle -- cut 32-client throughput 60.1 -> 45.6 img/s with image batches sent while grounding ran)."""
    clock = FakeClock(T0)
    idle = dict(release_when_idle=True)
    sched = PipelineScheduler(SchedulerConfig(image=StageConfig(4, 10.0, **idle),
                                              grounding=StageConfig(4, 10.0, **idle)), clock)
    first = sched.submit(req(0, k=2))
    assert sched.next_wakeup() == T0
    b1 = sched.schedule(Stage.IMAGE)
    assert b1 is not None and rids(b1) == [first] and b1.formed_s == T0  # no wait: nothing was running
    second = sched.submit(req(1))
    assert sched.schedule(Stage.IMAGE) is None  # b1 runs (max_inflight_batches 1)
    finish(sched, b1)  # nothing runs: the queued partial image batch goes now, before its budget
    assert sched.next_wakeup() == T0
    b2 = sched.schedule(Stage.IMAGE)
    assert b2 is not None and rids(b2) == [second]
    # the first request's 2 pairs queued at T0, but b2 runs: they wait for their budget to batch with more
    assert sched.schedule(Stage.GROUNDING) is None and sched.next_wakeup() == T0 + 0.010
    finish(sched, b2)  # the second request's pair joins them; nothing runs: all 3 go at once
    g1 = sched.schedule(Stage.GROUNDING)
    assert g1 is not None and g1.size == 3 and g1.formed_s == T0
    third = sched.submit(req(2))  # grounding runs: the partial image batch waits for its budget
    assert sched.schedule(Stage.IMAGE) is None and sched.next_wakeup() == T0 + 0.010
    finish(sched, g1)
    b3 = sched.schedule(Stage.IMAGE)
    assert b3 is not None and rids(b3) == [third]
    # off (the default): the same lone request waits for its budget
    plain, clock2 = make(image_bs=4, image_wait_ms=10.0)
    plain.submit(req(0))
    assert plain.schedule(Stage.IMAGE) is None and plain.next_wakeup() == T0 + 0.010


def test_zero_wait_budget_releases_immediately():
    sched, _ = make(image_bs=8, image_wait_ms=0.0)
    sched.submit(req(0))
    assert sched.schedule(Stage.IMAGE).size == 1


@pytest.mark.parametrize("n, bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (6, 8), (7, 8), (8, 8)])
def test_bucket_padding(n, bucket):
    sched, clock = make(image_bs=8, image_buckets=(1, 2, 4, 8))
    for i in range(n):
        sched.submit(req(i))
    clock.advance(1.0)
    batch = sched.schedule(Stage.IMAGE)
    assert (batch.size, batch.bucket_size, batch.num_padding) == (n, bucket, bucket - n)
    assert len(batch.items) == n  # the scheduler never invents padding items; the runner pads


def test_stage_config_buckets():
    assert StageConfig(max_batch_size=8).buckets == (1, 2, 4, 8)
    assert StageConfig(max_batch_size=12).buckets == (1, 2, 4, 8, 12)
    assert StageConfig(max_batch_size=6, buckets=(2, 6)).bucket_for(1) == 2
    with pytest.raises(ValueError, match="largest bucket"):
        StageConfig(max_batch_size=8, buckets=(1, 2, 4))
    with pytest.raises(ValueError, match="ascending"):
        StageConfig(max_batch_size=8, buckets=(4, 2, 8))
    with pytest.raises(ValueError):
        StageConfig(max_batch_size=0)
    with pytest.raises(ValueError):
        SegmentRequest(image="x", prompts=())


def test_fifo_order_across_batches_and_stages():
    sched, clock = make(image_bs=4, g_bs=4)
    ids = [sched.submit(req(i, k=2)) for i in range(10)]
    image_order, grounding_order = [], []
    while sched.num_unfinished:
        progressed = False
        for stage in (Stage.IMAGE, Stage.GROUNDING):
            if (batch := sched.schedule(stage)) is not None:
                (image_order if stage is Stage.IMAGE else grounding_order).extend(
                    (i.request_id, i.index) for i in batch.items)
                finish(sched, batch)
                progressed = True
        if not progressed:
            clock.set(sched.next_wakeup())
    assert [rid for rid, _ in image_order] == ids
    assert grounding_order == [(rid, k) for rid in ids for k in range(2)]
    answers = sched.pop_answers()
    assert [a.request_id for a in answers] == ids  # answered in arrival order too


# ---------------------------------------------------------------------------------------------------------------
# two-stage pipeline


def test_two_stage_request_with_three_prompts():
    sched, clock = make(image_bs=1, g_bs=8, g_wait_ms=10.0)
    request = req("a", k=3)
    rid = sched.submit(request)
    image_batch = sched.schedule(Stage.IMAGE)
    assert image_batch.payloads == ("imga",)
    clock.advance(0.002)
    finish(sched, image_batch)
    assert sched.num_queued(Stage.GROUNDING) == 3
    assert sched.pop_answers() == []
    clock.advance(0.010)
    g = sched.schedule(Stage.GROUNDING)
    assert [(i.request_id, i.index) for i in g.items] == [(rid, 0), (rid, 1), (rid, 2)]
    assert g.payloads[1] == GroundingInput(("feat", "imga"), "a/p1")
    assert (g.size, g.bucket_size) == (3, 4)
    finish(sched, g)
    (answer,) = sched.pop_answers()
    assert answer.ok and answer.request_id == rid
    assert answer.outputs == expected_outputs(request)
    t = answer.timings
    assert (t.arrival_s, t.image_started_s, t.image_done_s, t.answered_s) == (T0, T0, T0 + 0.002, T0 + 0.012)
    assert sched.num_unfinished == 0 and sched.pop_answers() == []


def test_pairs_from_different_requests_batch_together_and_split_across_batches():
    sched, clock = make(image_bs=2, g_bs=4, g_wait_ms=0.0)
    a, b = req("a", k=3), req("b", k=3)
    ra, rb = sched.submit(a), sched.submit(b)
    finish(sched, sched.schedule(Stage.IMAGE))
    g1 = sched.schedule(Stage.GROUNDING)
    assert [(i.request_id, i.index) for i in g1.items] == [(ra, 0), (ra, 1), (ra, 2), (rb, 0)]
    finish(sched, g1)
    assert [x.request_id for x in sched.pop_answers()] == [ra]  # b still has 2 pairs to go
    g2 = sched.schedule(Stage.GROUNDING)
    assert [(i.request_id, i.index) for i in g2.items] == [(rb, 1), (rb, 2)] and g2.bucket_size == 2
    finish(sched, g2)
    (answer,) = sched.pop_answers()
    assert answer.request_id == rb and answer.outputs == expected_outputs(b)


def test_grounding_of_one_batch_overlaps_the_next_image_batch():
    sched, clock = make(image_bs=2, g_bs=4, image_wait_ms=0.0, g_wait_ms=0.0)
    for i in range(4):
        sched.submit(req(i, k=1))
    finish(sched, sched.schedule(Stage.IMAGE))
    grounding = sched.schedule(Stage.GROUNDING)
    image = sched.schedule(Stage.IMAGE)  # both stages now have a batch on the device
    assert grounding is not None and image is not None
    assert {b.stage for b in sched.running_batches()} == {Stage.IMAGE, Stage.GROUNDING}


# ---------------------------------------------------------------------------------------------------------------
# deadlines


def test_deadline_expired_in_queue_is_answered_and_never_run():
    sched, clock = make(image_bs=4, image_wait_ms=10.0)
    doomed = sched.submit(req("d", deadline_s=T0 + 0.005))
    ok = sched.submit(req("o"))
    assert sched.next_wakeup() == T0 + 0.005  # the deadline comes before the wait budget
    clock.set(T0 + 0.005)
    assert sched.schedule(Stage.IMAGE) is None  # the expired one is gone; the other still within budget
    (answer,) = sched.pop_answers()
    assert answer.request_id == doomed and isinstance(answer.error, DeadlineExceeded)
    assert answer.error.stage is Stage.IMAGE and not answer.error.running and answer.outputs is None
    clock.advance(0.010)
    batch = sched.schedule(Stage.IMAGE)
    assert rids(batch) == [ok]
    assert sched.stats.deadline_exceeded == 1


def test_deadline_on_arrival():
    sched, clock = make()
    rid = sched.submit(req("late", deadline_s=T0))
    (answer,) = sched.pop_answers()
    assert answer.request_id == rid and isinstance(answer.error, DeadlineExceeded) and answer.error.stage is None
    assert sched.num_queued(Stage.IMAGE) == 0 and sched.num_unfinished == 0


def test_deadline_expired_while_running_discards_result():
    sched, clock = make(image_bs=2, image_wait_ms=0.0, g_wait_ms=0.0)
    doomed = sched.submit(req("d", k=2, deadline_s=T0 + 0.050))
    ok = sched.submit(req("o", k=2))
    batch = sched.schedule(Stage.IMAGE)
    assert rids(batch) == [doomed, ok]
    clock.advance(0.060)  # deadline passes while the image batch runs
    finish(sched, batch)
    answers = answers_by_id(sched)
    assert set(answers) == {doomed}
    err = answers[doomed].error
    assert isinstance(err, DeadlineExceeded) and err.running and err.stage is Stage.IMAGE
    g = sched.schedule(Stage.GROUNDING)
    assert {i.request_id for i in g.items} == {ok}  # no pairs were enqueued for the expired request
    assert sched.stats.stages[Stage.IMAGE].dropped_items == 1


def test_deadline_expired_during_grounding_is_answered_at_once_then_late_output_dropped():
    sched, clock = make(image_bs=1, g_bs=1, image_wait_ms=0.0, g_wait_ms=0.0)
    rid = sched.submit(req("d", k=2, deadline_s=T0 + 0.050))
    finish(sched, sched.schedule(Stage.IMAGE))
    g = sched.schedule(Stage.GROUNDING)  # pair 0 running, pair 1 queued
    clock.advance(0.050)
    assert sched.expire() == 1  # answered at the deadline, not when the batch returns
    (answer,) = sched.pop_answers()
    assert isinstance(answer.error, DeadlineExceeded) and answer.error.stage is Stage.GROUNDING
    assert sched.num_queued(Stage.GROUNDING) == 0  # pair 1 removed, never run
    finish(sched, g)
    assert sched.pop_answers() == [] and sched.stats.stages[Stage.GROUNDING].dropped_items == 1
    assert rid not in [i.request_id for b in sched.running_batches() for i in b.items]


# ---------------------------------------------------------------------------------------------------------------
# cancellation


def test_cancel_queued_request():
    sched, clock = make(image_bs=4)
    a, b, c = (sched.submit(req(i)) for i in range(3))
    assert sched.cancel(b) is True
    assert sched.cancel(b) is False  # second cancel: no second answer
    (answer,) = sched.pop_answers()
    assert answer.request_id == b and isinstance(answer.error, Cancelled)
    clock.advance(1.0)
    assert rids(sched.schedule(Stage.IMAGE)) == [a, c]
    assert sched.cancel(12345) is False


def test_cancel_running_request_drops_its_outputs():
    sched, clock = make(image_bs=2, g_bs=8, image_wait_ms=0.0, g_wait_ms=0.0)
    a, b = sched.submit(req("a", k=2)), sched.submit(req("b", k=2))
    image = sched.schedule(Stage.IMAGE)
    assert sched.cancel(a)
    assert [x.request_id for x in sched.pop_answers()] == [a]
    finish(sched, image)
    g = sched.schedule(Stage.GROUNDING)
    assert {i.request_id for i in g.items} == {b}
    assert sched.cancel(b)  # cancelled while its pairs are on the device
    finish(sched, g)
    answers = sched.pop_answers()
    assert [(x.request_id, type(x.error)) for x in answers] == [(b, Cancelled)]
    assert sched.cancel(b) is False
    assert sched.stats.cancelled == 2 and sched.stats.stages[Stage.GROUNDING].dropped_items == 2


# ---------------------------------------------------------------------------------------------------------------
# overload


def test_overload_rejects_at_submit_and_changes_nothing():
    sched, clock = make(image_bs=4, max_queued=3)
    ids = [sched.submit(req(i)) for i in range(3)]
    with pytest.raises(Overloaded) as info:
        sched.submit(req("x"))
    assert info.value.retry_after_s > 0
    assert (info.value.unanswered, info.value.max_queued) == (3, 3)
    assert sched.num_queued(Stage.IMAGE) == 3 and sched.num_unfinished == 3
    assert sched.stats.submitted == 3 and sched.stats.rejected == 1 and sched.pop_answers() == []
    # running requests still count: room appears only when a request is answered
    clock.advance(1.0)
    batch = sched.schedule(Stage.IMAGE)
    with pytest.raises(Overloaded):
        sched.submit(req("y"))
    sched.cancel(ids[0])
    assert sched.submit(req("z")) == 3
    assert rids(batch) == ids


def test_retry_after_tracks_recent_latency():
    sched, clock = make(image_bs=1, g_bs=1, image_wait_ms=0.0, g_wait_ms=0.0, max_queued=1)
    with_no_history = SchedulerConfig().default_retry_after_s
    sched.submit(req(0))
    with pytest.raises(Overloaded) as info:
        sched.submit(req(1))
    assert info.value.retry_after_s == with_no_history
    clock.advance(0.5)
    finish(sched, sched.schedule(Stage.IMAGE))
    finish(sched, sched.schedule(Stage.GROUNDING))  # answered 0.5 s after submit
    sched.submit(req(2))
    with pytest.raises(Overloaded) as info:
        sched.submit(req(3))
    assert info.value.retry_after_s == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------------------------
# runner failures, misuse, stats


def test_fail_answers_every_request_in_the_batch_once_and_drops_its_other_work():
    sched, clock = make(image_bs=2, g_bs=2, image_wait_ms=0.0, g_wait_ms=0.0)
    a, b = sched.submit(req("a", k=3)), sched.submit(req("b", k=1))
    finish(sched, sched.schedule(Stage.IMAGE))
    g = sched.schedule(Stage.GROUNDING)  # (a,0), (a,1); (a,2) and (b,0) queued
    boom = RuntimeError("CUDA out of memory")
    sched.fail(g, boom)
    (answer,) = sched.pop_answers()
    assert answer.request_id == a and isinstance(answer.error, RunFailed) and answer.error.__cause__ is boom
    assert [(i.request_id, i.index) for i in sched.schedule(Stage.GROUNDING).items] == [(b, 0)]
    assert sched.stats.failed == 1 and sched.stats.stages[Stage.GROUNDING].failed_batches == 1


def test_complete_rejects_wrong_output_count_and_double_completion_without_changing_state():
    sched, _ = make(image_bs=2, image_wait_ms=0.0)
    sched.submit(req(0)), sched.submit(req(1))
    batch = sched.schedule(Stage.IMAGE)
    with pytest.raises(ValueError, match="padding"):
        sched.complete(batch, fake_outputs(batch) + [None])  # padding rows must not be returned
    assert sched.running_batches() == [batch]
    finish(sched, batch)
    with pytest.raises(ValueError, match="not running"):
        finish(sched, batch)
    with pytest.raises(ValueError, match="not running"):
        sched.fail(batch, RuntimeError())


def test_stats_and_batch_hooks():
    sched, clock = make(image_bs=4, g_bs=8, image_wait_ms=10.0, g_wait_ms=0.0)
    records = []
    sched.stats.on_batch.append(records.append)
    for i in range(3):
        sched.submit(req(i, k=2))
        clock.advance(0.001)
    clock.set(T0 + 0.010)
    image = sched.schedule(Stage.IMAGE)
    clock.advance(0.020)
    finish(sched, image)
    finish(sched, sched.schedule(Stage.GROUNDING))
    rec = records[0]
    assert (rec.stage, rec.size, rec.bucket_size, rec.ok, rec.dropped) == (Stage.IMAGE, 3, 4, True, 0)
    assert rec.queue_wait_s == pytest.approx((0.010, 0.009, 0.008))
    assert rec.run_s == pytest.approx(0.020)
    assert records[1].size == 6 and records[1].bucket_size == 8
    snap = sched.stats.snapshot()
    assert snap["answered_ok"] == 3 and snap["image.batches"] == 1 and snap["image.padding"] == 1
    assert snap["grounding.batch_size.max"] == 6 and snap["image.run_s.mean"] == pytest.approx(0.020)
    assert snap["latency_s.mean"] == pytest.approx((0.030 + 0.029 + 0.028) / 3)


# ---------------------------------------------------------------------------------------------------------------
# randomized: no request is ever lost or answered twice


@pytest.mark.parametrize("seed", range(60))
def test_random_operations_never_lose_or_duplicate_an_answer(seed):
    rng = random.Random(seed)
    sched, clock = make(
        image_bs=rng.choice([1, 2, 4, 8]), image_wait_ms=rng.choice([0.0, 2.0, 10.0]),
        g_bs=rng.choice([1, 3, 4, 16]), g_wait_ms=rng.choice([0.0, 1.0, 5.0]),
        max_queued=rng.choice([2, 8, 64]), inflight=rng.choice([1, 2]),
    )
    admitted: dict[int, SegmentRequest] = {}
    answers: dict[int, object] = {}
    cancelled, failed_requests, run_items = set(), set(), set()
    last_image_rid = -1

    def collect():
        for a in sched.pop_answers():
            assert a.request_id in admitted, "answer for a request never admitted"
            assert a.request_id not in answers, "request answered twice"
            answers[a.request_id] = a

    def check_batch(batch):
        nonlocal last_image_rid
        cfg = sched.config.stage(batch.stage)
        assert 1 <= batch.size <= cfg.max_batch_size and batch.bucket_size == cfg.bucket_for(batch.size)
        for item in batch.items:
            assert item.request_id not in answers, "work of an answered request was scheduled"
            deadline = admitted[item.request_id].deadline_s
            assert deadline is None or clock.now() < deadline, "expired work was scheduled"
            key = (batch.stage, item.request_id, item.index)
            assert key not in run_items, "an item ran twice"
            run_items.add(key)
            if batch.stage is Stage.IMAGE:
                assert item.request_id > last_image_rid, "image stage is not FIFO"
                last_image_rid = item.request_id

    for _ in range(300):
        op = rng.random()
        collect()
        if op < 0.30:
            deadline = clock.now() + rng.uniform(0.0, 0.05) if rng.random() < 0.3 else None
            request = req(len(admitted), k=rng.randint(1, 4), deadline_s=deadline)
            before = (sched.num_unfinished, sched.num_queued(Stage.IMAGE))
            try:
                admitted[sched.submit(request)] = request
            except Overloaded as e:
                assert e.retry_after_s > 0 and sched.num_unfinished == sched.config.max_queued
                assert (sched.num_unfinished, sched.num_queued(Stage.IMAGE)) == before
        elif op < 0.45:
            clock.advance(rng.uniform(0.0, 0.01))
        elif op < 0.65:
            if (batch := sched.schedule(rng.choice(list(Stage)))) is not None:
                collect()  # schedule may have expired requests first
                check_batch(batch)
        elif op < 0.85:
            if running := sched.running_batches():
                batch = rng.choice(running)
                if rng.random() < 0.15:
                    failed_requests |= {i.request_id for i in batch.items}
                    sched.fail(batch, RuntimeError("fake runner failure"))
                else:
                    finish(sched, batch)
        elif op < 0.93:
            if admitted:
                rid = rng.choice(list(admitted))
                collect()
                assert sched.cancel(rid) == (rid not in answers)
                cancelled.add(rid)
        else:
            sched.expire()

    # drain: run everything to completion on the fake clock
    for _ in range(10_000):
        collect()
        if sched.num_unfinished == 0 and not sched.running_batches():
            break
        for batch in sched.running_batches():
            finish(sched, batch)
        scheduled = False
        for stage in Stage:
            while (batch := sched.schedule(stage)) is not None:
                collect()
                check_batch(batch)
                finish(sched, batch)
                scheduled = True
        if not scheduled and not sched.running_batches() and sched.num_unfinished:
            clock.set(max(sched.next_wakeup(), clock.now()))
    collect()

    assert set(answers) == set(admitted), "a request was lost"
    for rid, a in answers.items():
        request = admitted[rid]
        if a.ok:
            assert a.outputs == expected_outputs(request)
        elif isinstance(a.error, Cancelled):
            assert rid in cancelled
        elif isinstance(a.error, DeadlineExceeded):
            assert request.deadline_s is not None and a.timings.answered_s >= request.deadline_s
        else:
            assert isinstance(a.error, RunFailed) and rid in failed_requests
    s = sched.stats
    assert s.submitted == len(admitted) == s.answered_ok + s.deadline_exceeded + s.cancelled + s.failed
    assert sched.pop_answers() == [] and all(sched.num_queued(st) == 0 for st in Stage)


# ---------------------------------------------------------------------------------------------------------------
# asyncio driver (real monotonic clock, small wait budgets; every wait is bounded)


class AsyncFakeRunner:
    def __init__(self, delay_s=0.002, fail_on=None):
        self.delay_s, self.fail_on, self.batches = delay_s, fail_on, []

    async def run(self, stage: Stage, batch: Batch):
        self.batches.append((stage, batch.size, batch.bucket_size))
        await asyncio.sleep(self.delay_s)
        if self.fail_on is not None and self.fail_on in batch.payloads:
            raise RuntimeError(f"cannot process {self.fail_on}")
        return fake_outputs(batch)


class BlockingFakeRunner:
    def __init__(self):
        self.threads = set()

    def run(self, stage: Stage, batch: Batch):
        import threading

        self.threads.add(threading.current_thread().name)
        time.sleep(0.001)  # stands in for a synchronous device call
        return fake_outputs(batch)


def real_scheduler(max_queued=64, image_bs=8, g_bs=16):
    cfg = SchedulerConfig(image=StageConfig(image_bs, 5.0), grounding=StageConfig(g_bs, 2.0), max_queued=max_queued)
    return PipelineScheduler(cfg)


@pytest.mark.parametrize("runner_cls", [AsyncFakeRunner, BlockingFakeRunner])
def test_async_loop_answers_many_concurrent_requests(runner_cls):
    requests = [req(i, k=1 + i % 3) for i in range(40)]
    sched, runner = real_scheduler(), runner_cls()

    async def main():
        async with AsyncBatchLoop(sched, runner) as loop:
            return await asyncio.wait_for(asyncio.gather(*(loop.infer(r) for r in requests)), 10)

    answers = asyncio.run(main())
    assert [a.outputs for a in answers] == [expected_outputs(r) for r in requests]
    assert len({a.request_id for a in answers}) == 40
    assert sched.stats.answered_ok == 40 and sched.num_unfinished == 0
    assert sched.stats.stages[Stage.IMAGE].batch_size.max > 1
    assert sched.stats.stages[Stage.GROUNDING].batch_size.max > 1
    if runner_cls is BlockingFakeRunner:
        assert all(name.startswith("engine-") for name in runner.threads)


def test_async_loop_errors_cancellation_and_overload():
    sched = real_scheduler(max_queued=6, image_bs=2)
    runner = AsyncFakeRunner(delay_s=0.02, fail_on="imgbad")

    async def main():
        async with AsyncBatchLoop(sched, runner) as loop:
            good = asyncio.create_task(loop.infer(req("good", k=2)))
            bad = asyncio.create_task(loop.infer(req("bad")))  # same image batch as "good" -> both fail
            late = asyncio.create_task(loop.infer(req("late", deadline_s=sched.clock.now() + 0.030)))
            gone = asyncio.create_task(loop.infer(req("gone")))
            fillers = [asyncio.create_task(loop.infer(req(f"f{i}"))) for i in range(2)]
            await asyncio.sleep(0)  # every task above submits; nothing can be answered yet
            with pytest.raises(Overloaded) as info:  # 6 admitted and unanswered
                await loop.infer(req("over"))
            assert info.value.retry_after_s > 0
            await asyncio.sleep(0.005)
            gone.cancel()  # a client disconnect
            results = await asyncio.wait_for(
                asyncio.gather(good, bad, late, gone, *fillers, return_exceptions=True), 10)
            after = await loop.infer(req("after"))  # the loop survived all of it
            return results, after

    (good, bad, late, gone, *fillers), after = asyncio.run(main())
    assert isinstance(good, RunFailed) and isinstance(bad, RunFailed) and isinstance(bad.__cause__, RuntimeError)
    assert isinstance(late, DeadlineExceeded)
    assert isinstance(gone, asyncio.CancelledError)
    assert all(f.ok for f in fillers) and after.ok
    assert sched.stats.cancelled == 1 and sched.stats.rejected == 1 and sched.num_unfinished == 0


def test_async_loop_close_without_drain_cancels_pending():
    sched = real_scheduler()

    async def main():
        loop = AsyncBatchLoop(sched, AsyncFakeRunner(delay_s=0.01))
        loop.start()
        tasks = [asyncio.create_task(loop.infer(req(i))) for i in range(5)]
        await asyncio.sleep(0)
        await asyncio.wait_for(loop.aclose(drain=False), 10)
        with pytest.raises(RuntimeError, match="not running"):
            loop.submit(req("x"))
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, Cancelled) for r in results)
    assert sched.num_unfinished == 0


# ---------------------------------------------------------------------------------------------------------------


def test_scheduler_imports_no_torch():
    code = "import sys, engine_core.request, engine_core.scheduler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
