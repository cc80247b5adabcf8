"""engine_core.continuous with a fake clock and a fake model runner: no torch, no device, deterministic.

The fake runner is a "model" whose next token is a hash of the whole context and the request's (seed, output
index), and which reads that context back from a fake paged KV pool through the plan's block tables and slot mapping,
while keeping a fake GDN state (count + rolling hash) per state slot. So a wrong block table, a block shared by two
live sequences, a block freed too early, a wrong chunk boundary or a missing state reset all change the tokens (or
trip the runner's asserts), and every answer can be checked against a plain uninterrupted generation.
"""

import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine_core.continuous import (
    Completion,
    ContinuousConfig,
    ContinuousScheduler,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    SeqStatus,
    SequenceDeadlineExceeded,
    StepFailed,
    StepOutput,
    StepPlan,
    TokenLogprobs,
)
from engine_core.request import Cancelled, DeadlineExceeded, FakeClock, Overloaded, RunFailed

T0 = 100.0  # fake clock origin (s)
VOCAB = 20
EOS = 0


def next_token(context, seed: int, output_index: int) -> int:
    """The fake model + sampler: deterministic in (full context, seed, output index). Token 0 (EOS) ~ 1 in 20."""
    return hash((tuple(context), seed, output_index)) % VOCAB


def fold(h: int, token: int) -> int:
    return hash((h, token))


class FakeRunner:
    """Executes a StepPlan against a fake paged KV pool and fake per-slot GDN states."""

    def __init__(self, cfg: ContinuousConfig, clock: FakeClock | None = None, step_s: float = 0.01):
        self.kv: list[int | None] = [None] * (cfg.num_kv_blocks * cfg.block_size)  # one token id per KV slot
        self.state: list[tuple[int, int] | None] = [None] * cfg.max_num_seqs  # (tokens consumed, rolling hash)
        self.clock, self.step_s = clock, step_s

    def run(self, plan: StepPlan, fed: StepOutput | None = None) -> StepOutput:
        """`fed`: the sampled ids of step `plan.feed_from` (a step formed by `step_ahead`: its rows' inputs, as the
        device would hand them over; the plan's own token ids are placeholders)."""
        slots = iter(plan.slot_mapping())
        bs = plan.block_size
        sampled = []
        if plan.feed_from is not None:
            assert fed is not None and all(s.token_ids == (0,) for s in plan.seqs)
            inputs = [(fed.sampled_token_ids[i],) for i in plan.feed_index]
        else:
            inputs = [s.token_ids for s in plan.seqs]
        for s, token_ids in zip(plan.seqs, inputs):
            if s.reset_state:
                self.state[s.state_slot] = (0, 0)
            n, h = self.state[s.state_slot]
            assert n == s.start, f"request {s.request_id}: state slot has {n} tokens, chunk starts at {s.start}"
            for tok in token_ids:
                self.kv[next(slots)] = tok  # write this chunk's KV
                h = fold(h, tok)
            self.state[s.state_slot] = (s.end, h)
            if s.sample:
                context = [self.kv[s.block_table[p // bs] * bs + p % bs] for p in range(s.end)]  # "attention"
                check = 0
                for tok in context:
                    check = fold(check, tok)
                assert check == h, f"request {s.request_id}: KV blocks and GDN state disagree"
                sampled.append(next_token(context, s.seed, s.output_index))
        if self.clock is not None:
            self.clock.advance(self.step_s)
        return StepOutput(tuple(sampled))


def reference(req: GenerateRequest, seed: int, max_model_len: int) -> tuple[tuple[int, ...], FinishReason]:
    """Uninterrupted generation with the same fake model: the stream every answer must equal."""
    tokens, out = list(req.prompt_token_ids), []
    while True:
        t = next_token(tokens, seed, len(out))
        tokens.append(t)
        out.append(t)
        if t in req.eos_token_ids:
            return tuple(out), FinishReason.EOS
        if any(tuple(out[-len(s):]) == s for s in req.stop_token_ids if len(s) <= len(out)):
            return tuple(out), FinishReason.STOP
        if len(out) >= req.max_new_tokens or len(tokens) >= max_model_len:
            return tuple(out), FinishReason.LENGTH


def seed_of(rid: int) -> int:
    """The seed `make()`'s scheduler (config.seed=0) draws for request `rid` when every request so far was
    unseeded: the rid-th draw of random.Random(0)."""
    rng = random.Random(0)
    for _ in range(rid):
        rng.getrandbits(63)
    return rng.getrandbits(63)


def make(**overrides) -> tuple[ContinuousScheduler, FakeClock, FakeRunner]:
    kw = dict(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              max_waiting=16, watermark=0.0, seed=0)
    cfg = ContinuousConfig(**(kw | overrides))
    clock = FakeClock(T0)
    return ContinuousScheduler(cfg, clock), clock, FakeRunner(cfg, clock)


def req(n_prompt: int, max_new: int = 8, first: int = 1, **kw) -> GenerateRequest:
    prompt = tuple(1 + (first + i) % (VOCAB - 1) for i in range(n_prompt))  # never EOS
    return GenerateRequest(prompt, max_new, **kw)


def run_to_end(sched, runner, max_steps=10_000) -> dict:
    """Step until nothing is left; return {request_id: Answer}, asserting each is answered once."""
    answers = {}
    for _ in range(max_steps):
        plan = sched.step()
        if plan is not None:
            sched.finish(plan, runner.run(plan))
        for a in sched.pop_answers():
            assert a.request_id not in answers, f"request {a.request_id} answered twice"
            answers[a.request_id] = a
        if plan is None and sched.num_unfinished == 0:
            return answers
    raise AssertionError("did not drain")


def check_plan(sched: ContinuousScheduler, plan: StepPlan) -> None:
    """Invariants every plan must satisfy."""
    cfg = sched.config
    assert 0 < plan.num_tokens <= cfg.max_num_batched_tokens
    assert all(s.num_tokens > 0 for s in plan.seqs), "an empty chunk"
    assert plan.num_seqs <= cfg.max_num_seqs
    ids = [s.request_id for s in plan.seqs]
    assert len(set(ids)) == len(ids)
    kinds = [s.is_decode for s in plan.seqs]
    assert kinds == sorted(kinds, reverse=True), "decode rows must come first"
    used: set[int] = set()
    for s in plan.seqs:
        seq = sched.sequence(s.request_id)
        assert seq.status is SeqStatus.RUNNING and seq.state_slot == s.state_slot
        assert s.token_ids == tuple(seq.token_ids[s.start:s.end]) and s.start == seq.num_computed_tokens
        assert len(s.block_table) * cfg.block_size >= s.end
        assert s.sample == (s.end == seq.num_tokens)
        assert not used & set(s.block_table), "two sequences in one step share a block"
        used |= set(s.block_table)
    decoding = {rid for rid in sched.running_ids if sched.sequence(rid).decoding}
    if plan.lone_prefill:  # one whole prompt from position 0 within the rule's limit, alone
        (s,) = plan.seqs
        assert s.start == 0 and s.sample and not s.is_decode and s.reset_state
        assert cfg.lone_prefill_min_tokens <= s.num_tokens <= min(sched.lone_prefill_tokens, cfg.max_num_batched_tokens)
        assert all(sched.sequence(rid).decoding for rid in sched.running_ids if rid != s.request_id)
    else:  # every decoding resident sequence gets its token (the budget always fits them)
        assert decoding == {s.request_id for s in plan.seqs if s.is_decode}
    sched.blocks.check()
    assert all(sched.blocks.ref_count(b) == 1 for b in used)
    assert plan.bucket_size is None or (plan.num_decode == plan.num_seqs and plan.bucket_size >= plan.num_seqs)


# --------------------------------------------------------------------------------------------------------------
# Chunked prefill, decode priority, budget


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    sched, _, runner = make(max_num_batched_tokens=8)
    rid = sched.add(req(20, max_new=3))
    chunks = []
    while (plan := sched.step()) is not None:
        check_plan(sched, plan)
        (s,) = plan.seqs
        chunks.append((s.start, s.end, s.sample, s.reset_state, s.is_decode))
        sched.finish(plan, runner.run(plan))
    # 20 prompt tokens in chunks of 8, 8, 4 (only the last one samples), then 2 decode tokens for outputs 2 and 3
    assert chunks == [(0, 8, False, True, False), (8, 16, False, False, False), (16, 20, True, False, False),
                      (20, 21, True, False, True), (21, 22, True, False, True)]
    (answer,) = sched.pop_answers()
    assert answer.request_id == rid and answer.ok
    assert answer.outputs[0].token_ids == reference(req(20, max_new=3), seed_of(rid), 128)[0]


def test_decode_tokens_first_then_prefill_chunks_fifo():
    sched, _, runner = make(max_num_batched_tokens=8)
    a = sched.add(req(3, max_new=50))
    plan = sched.step()
    sched.finish(plan, runner.run(plan))  # a sampled its first token: now decoding
    b = sched.add(req(30, max_new=5, first=7))
    c = sched.add(req(5, max_new=5, first=9))
    plan = sched.step()
    check_plan(sched, plan)
    # a's decode token first; b takes the other 7 tokens of the budget; c (behind b, FIFO) waits
    assert [(s.request_id, s.num_tokens, s.is_decode) for s in plan.seqs] == [(a, 1, True), (b, 7, False)]
    assert sched.sequence(c).status is SeqStatus.WAITING
    sched.finish(plan, runner.run(plan))
    plan = sched.step()
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [(a, 1), (b, 7)]  # b keeps its place before c


def test_short_prompts_share_a_step_and_decode_only_steps_get_a_bucket():
    sched, _, runner = make(max_num_batched_tokens=16, max_num_seqs=6, decode_buckets=(1, 2, 4, 6))
    rids = [sched.add(req(4, max_new=4, first=i)) for i in range(3)]
    plan = sched.step()
    assert [s.request_id for s in plan.seqs] == rids and plan.bucket_size is None  # a prefill step
    sched.finish(plan, runner.run(plan))
    plan = sched.step()
    assert plan.num_decode == 3 and plan.bucket_size == 4 and plan.num_tokens == 3


def kinds(plan: StepPlan) -> list[tuple[int, int, int, bool]]:
    """(request, start, tokens, decode) of each row."""
    return [(s.request_id, s.start, s.num_tokens, s.is_decode) for s in plan.seqs]


def test_lone_prefill_alternates_with_decode_steps_and_keeps_the_streams():
    sched, _, runner = make(max_num_batched_tokens=16, lone_prefill_tokens=8)
    a = sched.add(req(3, max_new=30))
    plan = sched.step()
    assert plan.lone_prefill and kinds(plan) == [(a, 0, 3, False)] and plan.bucket_size is None
    sched.finish(plan, runner.run(plan))
    b, c = sched.add(req(5, max_new=30, first=3)), sched.add(req(8, max_new=30, first=5))
    d, e = sched.add(req(12, max_new=4, first=7)), sched.add(req(2, max_new=4, first=9))  # d: longer than the rule's 8
    seen = []
    for _ in range(5):
        plan = sched.step()
        check_plan(sched, plan)
        seen.append((plan.lone_prefill, kinds(plan), plan.bucket_size))
        sched.finish(plan, runner.run(plan))
    assert seen == [
        (False, [(a, 3, 1, True)], 1),  # right after a's lone prefill: the decoders' step, graph-bucketed
        (True, [(b, 0, 5, False)], None),
        (False, [(a, 4, 1, True), (b, 5, 1, True)], 2),
        (True, [(c, 0, 8, False)], None),
        # d exceeds the limit: the mixed step of the rules without it (the decoders get their tokens in it too)
        (False, [(a, 5, 1, True), (b, 6, 1, True), (c, 8, 1, True), (d, 0, 12, False)], None),
    ]
    assert sched.sequence(e).status is SeqStatus.WAITING  # four residents: e waits for a slot (d's, 4 tokens on)
    answers = run_to_end(sched, runner)
    for rid, request in ((a, req(3, max_new=30)), (b, req(5, max_new=30, first=3)), (c, req(8, max_new=30, first=5)),
                         (d, req(12, max_new=4, first=7)), (e, req(2, max_new=4, first=9))):
        assert answers[rid].outputs[0].token_ids == reference(request, seed_of(rid), 128)[0], rid
    assert sched.stats.lone_prefill_steps == 3 + 1  # a, b, c, then e once d's slot was free


def test_lone_prefill_waits_for_a_resident_mid_prefill_and_needs_a_slot():
    sched, _, runner = make(max_num_batched_tokens=8, max_num_seqs=2, lone_prefill_tokens=8)
    a = sched.add(req(12, max_new=3))  # longer than the limit: chunked, 8 then 4
    b = sched.add(req(4, max_new=3, first=5))
    plan = sched.step()
    assert not plan.lone_prefill and kinds(plan) == [(a, 0, 8, False)]
    sched.finish(plan, runner.run(plan))
    plan = sched.step()  # a is mid-prefill: its chunk first, b rides in the same mixed step (budget left)
    assert not plan.lone_prefill and kinds(plan) == [(a, 8, 4, False), (b, 0, 4, False)]
    sched.finish(plan, runner.run(plan))
    c = sched.add(req(3, max_new=3, first=9))
    plan = sched.step()  # both slots taken: c waits, the decoders run
    assert not plan.lone_prefill and plan.num_decode == 2 and sched.sequence(c).status is SeqStatus.WAITING
    sched.finish(plan, runner.run(plan))
    answers = run_to_end(sched, runner)
    assert all(x.ok for x in answers.values()) and sched.stats.lone_prefill_steps == 1  # c, once a slot was free


def test_lone_prefill_validation_and_its_lower_limit():
    with pytest.raises(ValueError, match="lone_prefill_tokens"):
        make(lone_prefill_tokens=-1)
    with pytest.raises(ValueError, match="lone_prefill_tokens"):
        make(lone_prefill_tokens=True)
    with pytest.raises(ValueError, match="lone_prefill_min_tokens"):
        make(lone_prefill_min_tokens=-2)
    sched, _, runner = make(max_num_batched_tokens=16, lone_prefill_tokens=8, lone_prefill_min_tokens=4)
    a, b, c = sched.add(req(3, max_new=2)), sched.add(req(2, max_new=2, first=4)), sched.add(req(6, max_new=2, first=5))
    plan = sched.step()  # a and b are shorter than 4: one mixed step takes all three (c fits the budget behind them)
    assert not plan.lone_prefill and kinds(plan) == [(a, 0, 3, False), (b, 0, 2, False), (c, 0, 6, False)]
    sched.finish(plan, runner.run(plan))
    d = sched.add(req(4, max_new=2, first=6))
    plan = sched.step()  # d: 4 tokens, within [4, 8], taken alone
    assert plan.lone_prefill and kinds(plan) == [(d, 0, 4, False)]


def test_max_num_seqs_limits_residents():
    sched, _, runner = make(max_num_seqs=2, max_num_batched_tokens=64)
    rids = [sched.add(req(2, max_new=3, first=i)) for i in range(4)]
    plan = sched.step()
    assert [s.request_id for s in plan.seqs] == rids[:2] and sched.num_waiting == 2
    sched.finish(plan, runner.run(plan))
    answers = run_to_end(sched, runner)
    assert sorted(answers) == rids


# --------------------------------------------------------------------------------------------------------------
# Preemption


def test_preemption_and_resume_give_exactly_the_uninterrupted_stream():
    requests = [req(n, max_new=m, first=i, sampling=SamplingParams(0.7, seed=100 + i))
                for i, (n, m) in enumerate([(9, 30), (3, 25), (14, 20), (6, 30), (1, 30)])]
    results = {}
    for blocks in (200, 12):  # 12 blocks of 4 slots: not enough for all five at once
        sched, _, runner = make(num_kv_blocks=blocks, max_num_seqs=5)
        rids = [sched.add(r) for r in requests]
        answers = run_to_end(sched, runner)
        results[blocks] = [answers[rid].outputs[0] for rid in rids]
        if blocks == 12:
            assert sched.stats.preemptions > 0 and sum(c.num_preemptions for c in results[blocks]) > 0
        assert sched.blocks.num_free_blocks == blocks
    assert [c.token_ids for c in results[12]] == [c.token_ids for c in results[200]]
    for r, c in zip(requests, results[12]):
        assert (c.token_ids, c.finish_reason) == reference(r, r.sampling.seed, 128)


def test_the_youngest_is_preempted_and_requeued_at_the_front():
    sched, _, runner = make(num_kv_blocks=4, block_size=2, max_num_seqs=3, max_num_batched_tokens=8)
    a = sched.add(req(2, max_new=5))  # each sequence holds 1 block after its prompt
    b = sched.add(req(2, max_new=5, first=3))
    c = sched.add(req(2, max_new=5, first=6))
    d = sched.add(req(2, max_new=5, first=9))
    plan = sched.step()  # a, b, c admitted (3 blocks); d waits (one free block left, but no state slot)
    assert [s.request_id for s in plan.seqs] == [a, b, c]
    sched.finish(plan, runner.run(plan))
    # decode: a takes the last free block; b needs one -> c (youngest) is preempted; then b gets c's block
    plan = sched.step()
    assert plan.preempted == (c,) and [s.request_id for s in plan.seqs] == [a, b]
    assert list(sched.waiting_ids) == [c, d] and sched.sequence(c).num_computed_tokens == 0
    assert sched.sequence(c).num_preemptions == 1 and sched.sequence(c).num_output_tokens == 1  # output kept
    sched.finish(plan, runner.run(plan))
    answers = run_to_end(sched, runner)
    for rid, r in zip((a, b, c, d), (req(2, 5), req(2, 5, 3), req(2, 5, 6), req(2, 5, 9))):
        assert answers[rid].outputs[0].token_ids == reference(r, seed_of(rid), 128)[0]


def test_the_fifo_head_is_never_overtaken():
    sched, _, runner = make(num_kv_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    big = sched.add(req(24, max_new=8))  # 6 blocks for its prompt
    plan = sched.step()
    sched.finish(plan, runner.run(plan))
    huge = sched.add(req(8, max_new=2, first=5))  # needs 2 blocks; 1 left after big's decode block -> waits
    tiny = sched.add(req(1, max_new=2, first=9))  # would fit, but must not overtake `huge`
    plan = sched.step()
    assert [s.request_id for s in plan.seqs] == [big]
    assert list(sched.waiting_ids) == [huge, tiny]
    sched.finish(plan, runner.run(plan))
    answers = run_to_end(sched, runner)
    assert all(a.ok for a in answers.values()) and set(answers) == {big, huge, tiny}


def test_admission_keeps_the_watermark_free_unless_nothing_is_resident():
    sched, _, runner = make(num_kv_blocks=8, block_size=4, watermark=0.25)  # 2 blocks in reserve
    a = sched.add(req(16, max_new=8))  # 4 blocks
    b = sched.add(req(9, max_new=2, first=5))  # 3 blocks: 8 - 4 - 3 = 1 < 2 in reserve -> waits
    plan = sched.step()
    assert [s.request_id for s in plan.seqs] == [a] and sched.waiting_ids == (b,)
    sched.finish(plan, runner.run(plan))
    big = make(num_kv_blocks=8, block_size=4, watermark=0.25)[0]
    only = big.add(req(30, max_new=2))  # 8 blocks, the whole pool: admitted since nothing is resident
    assert [s.request_id for s in big.step().seqs] == [only]
    answers = run_to_end(sched, runner)
    assert answers[a].ok and answers[b].ok


# --------------------------------------------------------------------------------------------------------------
# Stops


def generate(request: GenerateRequest, **config) -> Completion:
    sched, _, runner = make(**config)
    rid = sched.add(request)
    answer = run_to_end(sched, runner)[rid]
    assert answer.ok
    return answer.outputs[0]


def test_stop_conditions():
    prompt, sampling = req(5).prompt_token_ids, SamplingParams(seed=7)
    stream, _ = reference(GenerateRequest(prompt, 40, sampling), 7, 128)  # 40 tokens, no stop condition but length

    c = generate(GenerateRequest(prompt, 6, sampling))
    assert (c.token_ids, c.finish_reason, c.matched_stop) == (stream[:6], FinishReason.LENGTH, None)
    assert c.text_token_ids == c.token_ids and c.first_token_s >= T0 and c.num_prompt_tokens == 5

    c = generate(GenerateRequest(prompt, 40, sampling), max_model_len=11)  # 5 prompt + 6 outputs = 11
    assert (c.token_ids, c.finish_reason) == (stream[:6], FinishReason.LENGTH)

    eos = stream[4]
    n = stream.index(eos) + 1  # the first occurrence ends it (at output 5 or earlier)
    c = generate(GenerateRequest(prompt, 40, sampling, eos_token_ids=(99, eos)))
    assert (c.token_ids, c.finish_reason, c.matched_stop) == (stream[:n], FinishReason.EOS, (eos,))
    assert c.text_token_ids == stream[:n - 1]

    stop = tuple(stream[2:4])
    n = next(i for i in range(2, 5) if stream[i - 2:i] == stop)  # first output count ending with `stop`
    c = generate(GenerateRequest(prompt, 40, sampling, stop_token_ids=((99, 98), stop)))
    assert (c.token_ids, c.finish_reason, c.matched_stop) == (stream[:n], FinishReason.STOP, stop)
    assert c.text_token_ids == stream[:n - 2]


def test_streaming_deltas_concatenate_to_the_completion():
    sched, _, runner = make(max_num_batched_tokens=5)
    rids = [sched.add(req(7, max_new=6, first=i, eos_token_ids=(EOS,))) for i in range(3)]
    streamed = {rid: [] for rid in rids}
    finished = {}
    while (plan := sched.step()) is not None:
        for d in sched.finish(plan, runner.run(plan)):
            assert d.request_id not in finished
            streamed[d.request_id] += d.token_ids
            if d.finish_reason is not None:
                finished[d.request_id] = d.finish_reason
    for a in sched.pop_answers():
        assert tuple(streamed[a.request_id]) == a.outputs[0].token_ids
        assert finished[a.request_id] is a.outputs[0].finish_reason


# --------------------------------------------------------------------------------------------------------------
# Errors: admission, deadlines, cancellation, runner failure, misuse


def test_add_validates_and_bounds_the_waiting_queue():
    sched, _, _ = make(max_waiting=2, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(req(32))
    sched2, _, _ = make(max_waiting=2, num_kv_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        sched2.add(req(10, max_new=8))  # 17 slots = 5 blocks > 4
    sched2.add(req(1))
    sched2.add(req(1))
    with pytest.raises(Overloaded) as info:
        sched2.add(req(1))
    assert info.value.retry_after_s > 0 and sched2.stats.rejected == 1 and sched2.num_unfinished == 2
    with pytest.raises(ValueError):
        GenerateRequest((), 4)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        ContinuousConfig(num_kv_blocks=4, max_num_seqs=8, max_num_batched_tokens=4)


def test_deadlines_while_waiting_running_and_on_arrival():
    sched, clock, runner = make(max_num_seqs=1)
    late = sched.add(req(3, deadline_s=T0))  # expired on arrival: answered at once
    running = sched.add(req(3, max_new=50, deadline_s=T0 + 0.05))
    waiting = sched.add(req(3, deadline_s=T0 + 0.02))
    for _ in range(8):  # the runner advances the clock 10 ms per step
        if (plan := sched.step()) is not None:
            sched.finish(plan, runner.run(plan))
    answers = {a.request_id: a for a in sched.pop_answers()}
    assert isinstance(answers[late].error, DeadlineExceeded) and answers[late].error.stage is None
    assert isinstance(answers[waiting].error, SequenceDeadlineExceeded) and not answers[waiting].error.running
    assert isinstance(answers[running].error, DeadlineExceeded) and answers[running].error.running
    assert sched.stats.deadline_exceeded == 3 and sched.blocks.num_free_blocks == sched.config.num_kv_blocks
    assert sched.next_wakeup() is None


def test_cancel_while_in_flight_drops_the_token_and_frees_blocks():
    sched, _, runner = make()
    a = sched.add(req(5))
    b = sched.add(req(5, first=4))
    plan = sched.step()
    assert sched.cancel(a) and not sched.cancel(a)
    assert a not in sched.blocks
    deltas = sched.finish(plan, runner.run(plan))
    assert [d.request_id for d in deltas] == [b] and sched.stats.dropped_tokens == 1
    (answer,) = sched.pop_answers()
    assert isinstance(answer.error, Cancelled) and answer.outputs is None
    answers = run_to_end(sched, runner)
    assert list(answers) == [b] and answers[b].ok


def test_runner_failure_answers_the_plans_sequences_only():
    sched, _, runner = make(max_num_seqs=1)
    a = sched.add(req(5))
    b = sched.add(req(5, first=3))
    plan = sched.step()
    boom = RuntimeError("device lost")
    sched.fail(plan, boom)
    (answer,) = sched.pop_answers()
    assert answer.request_id == a and isinstance(answer.error, StepFailed) and isinstance(answer.error, RunFailed)
    assert answer.error.__cause__ is boom and sched.stats.failed == 1 and sched.stats.failed_steps == 1
    answers = run_to_end(sched, runner)
    assert answers[b].ok


def test_logprobs_ride_the_deltas_and_a_wrong_count_is_refused():
    """StepOutput.logprobs (one entry per sampling row) reaches each row's TokenDelta; a wrong count raises and
    changes nothing, like a wrong token count."""
    sched, _, runner = make()
    sched.add(req(5))
    plan = sched.step()
    lp = TokenLogprobs(-0.5, ((3, -0.5), (9, -1.25)))
    with pytest.raises(ValueError, match="logprobs"):
        sched.finish(plan, StepOutput(runner.run(plan).sampled_token_ids, (lp, lp)))
    assert sched.in_flight is plan and sched.sequence(0).num_computed_tokens == 0
    (delta,) = sched.finish(plan, StepOutput(runner.run(plan).sampled_token_ids, (lp,)))
    assert delta.logprobs == (lp,) and len(delta.token_ids) == 1
    plan = sched.step()
    (delta,) = sched.finish(plan, runner.run(plan))
    assert delta.logprobs is None


def test_misuse_raises_and_changes_nothing():
    sched, _, runner = make()
    sched.add(req(5))
    plan = sched.step()
    with pytest.raises(RuntimeError, match="in flight"):
        sched.step()
    with pytest.raises(ValueError, match="sampled tokens"):
        sched.finish(plan, StepOutput(()))
    assert sched.in_flight is plan and sched.sequence(0).num_computed_tokens == 0
    assert sched.next_wakeup() is None  # nothing to do but wait for the plan
    sched.finish(plan, runner.run(plan))
    with pytest.raises(ValueError, match="not in flight"):
        sched.finish(plan, runner.run(plan))
    assert sched.next_wakeup() == sched.clock.now()


# --------------------------------------------------------------------------------------------------------------
# Seeded property loop


@pytest.mark.parametrize("trial", range(12))
def test_random_traffic_every_request_answered_once_with_the_exact_stream(trial):
    """Random add / cancel / deadline / runner failure / clock jumps over a small KV pool (many preemptions):
    every admitted request is answered exactly once, every plan satisfies `check_plan`, and every ok answer is the
    uninterrupted stream."""
    rng = random.Random(trial)
    block_size = rng.choice([1, 2, 4])
    max_num_seqs = rng.randint(1, 5)
    cfg = dict(num_kv_blocks=-(-40 // block_size) + rng.randint(0, 8), block_size=block_size,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=rng.randint(max_num_seqs, max_num_seqs + 12),
               max_model_len=rng.choice([24, 64]), max_waiting=rng.randint(2, 8), watermark=rng.choice([0.0, 0.1]),
               seed=trial, lone_prefill_tokens=rng.choice([0, 0, 4, 12, 64]))
    sched, clock, runner = make(**cfg)
    submitted: dict[int, tuple[GenerateRequest, int | None]] = {}
    answers = {}
    steps = 0

    def collect():
        for a in sched.pop_answers():
            assert a.request_id in submitted and a.request_id not in answers, "unknown or twice-answered request"
            answers[a.request_id] = a

    for _ in range(300):
        r = rng.random()
        if r < 0.3:
            sampling = SamplingParams(rng.choice([0.0, 1.0]), seed=rng.choice([None, rng.randrange(1 << 40)]))
            stops = ((rng.randrange(1, VOCAB), rng.randrange(1, VOCAB)),) if rng.random() < 0.3 else ()
            deadline = clock.now() + rng.uniform(0, 2) if rng.random() < 0.2 else None
            request = GenerateRequest(tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))),
                                      rng.randint(1, 20), sampling, eos_token_ids=(EOS,), stop_token_ids=stops,
                                      deadline_s=deadline)
            try:
                rid = sched.add(request)
            except (Overloaded, ValueError):
                continue
            seed = sched.sequence(rid).seed if rid in sched else None
            submitted[rid] = (request, seed)
        elif r < 0.35 and submitted:
            sched.cancel(rng.choice(list(submitted)))
        elif r < 0.4:
            clock.advance(rng.uniform(0, 0.3))
        plan = sched.step()
        if plan is not None:
            steps += 1
            check_plan(sched, plan)
            if rng.random() < 0.05:
                sched.cancel(rng.choice(plan.seqs).request_id)
            if rng.random() < 0.02:
                sched.fail(plan, RuntimeError("injected"))
            else:
                sched.finish(plan, runner.run(plan))
        collect()
    while sched.num_unfinished:
        plan = sched.step()
        if plan is None:  # the last ones expired inside step()
            assert sched.num_unfinished == 0, "unanswered requests but nothing to run"
            break
        check_plan(sched, plan)
        sched.finish(plan, runner.run(plan))
        collect()
    collect()

    assert set(answers) == set(submitted), "a request was lost"
    n_ok = 0
    for rid, a in answers.items():
        request, seed = submitted[rid]
        if a.ok:
            n_ok += 1
            c = a.outputs[0]
            assert (c.token_ids, c.finish_reason) == reference(request, seed, cfg["max_model_len"]), rid
        else:
            assert isinstance(a.error, (Cancelled, DeadlineExceeded, StepFailed))
    assert n_ok > 0 and steps > 0
    s = sched.stats
    assert s.submitted == len(submitted)
    assert s.answered_ok + s.cancelled + s.deadline_exceeded + s.failed == len(submitted)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks and sched.num_running == 0
    sched.blocks.check()


def test_property_loop_exercises_preemption():
    """Guard against a vacuous property loop: across its trials the small pools really do preempt."""
    total = 0
    for trial in range(12):
        rng = random.Random(1000 + trial)
        sched, _, runner = make(num_kv_blocks=10, block_size=2, max_num_seqs=4, max_num_batched_tokens=8,
                                max_model_len=64, seed=trial)
        for i in range(6):
            sched.add(GenerateRequest(tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))), 12))
        run_to_end(sched, runner)
        total += sched.stats.preemptions
    assert total >= 12


def test_lone_prefill_under_preemption_gives_the_exact_streams():
    """The lone-prefill rule with small pools (preemptions re-queue sequences whose prompt + outputs then fit the
    rule or not): every stream is the uninterrupted one, and both the rule and preemption really happen."""
    lone = pre = 0
    for trial in range(12):
        rng = random.Random(2000 + trial)
        sched, _, runner = make(num_kv_blocks=10, block_size=2, max_num_seqs=4, max_num_batched_tokens=8,
                                max_model_len=64, seed=trial, lone_prefill_tokens=6)
        requests = {}
        for i in range(6):
            r = GenerateRequest(tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))), 12)
            requests[sched.add(r)] = r
        seeds = {rid: sched.sequence(rid).seed for rid in requests}
        answers = run_to_end(sched, runner)
        for rid, r in requests.items():
            c = answers[rid].outputs[0]
            assert (c.token_ids, c.finish_reason) == reference(r, seeds[rid], 64), (trial, rid)
        lone += sched.stats.lone_prefill_steps
        pre += sched.stats.preemptions
    assert lone >= 12 and pre >= 12


def test_the_scheduler_imports_no_torch():
    code = "import sys, engine_core.continuous, engine_core.block_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# --------------------------------------------------------------------------------------------------------------
# Overlap: step_ahead


def run_ahead(sched, runner, cancel_at: dict | None = None, max_steps=10_000) -> dict:
    """`run_to_end` with the engine's overlap: after launching a decode-only step N, form N+1 with `step_ahead` and
    "launch" it (fed N's sampled ids) before finishing N. `cancel_at`: {step_id: request_id} cancelled while that
    step and the one ahead of it are in flight."""
    answers, cancel_at = {}, dict(cancel_at or {})

    def collect():
        for a in sched.pop_answers():
            assert a.request_id not in answers, f"request {a.request_id} answered twice"
            answers[a.request_id] = a

    for _ in range(max_steps):
        plan = sched.step()
        if plan is None:
            collect()
            if sched.num_unfinished == 0:
                return answers
            continue
        out = runner.run(plan)
        while True:
            ahead = sched.step_ahead(plan)
            if ahead is not None:
                check_ahead(sched, plan, ahead)
            out_ahead = runner.run(ahead, fed=out) if ahead is not None else None
            if plan.step_id in cancel_at:
                sched.cancel(cancel_at.pop(plan.step_id))
            sched.finish(plan, out)
            collect()
            if ahead is None:
                break
            plan, out = ahead, out_ahead
    raise AssertionError("did not drain")


def check_ahead(sched, plan, ahead) -> None:
    """Invariants of a step formed ahead of `plan`'s finish."""
    assert ahead.feed_from == plan.step_id and ahead.bucket_size is not None and sched.in_flight is plan
    assert len(ahead.feed_index) == ahead.num_seqs and all(s.token_ids == (0,) for s in ahead.seqs)
    for s, i in zip(ahead.seqs, ahead.feed_index):
        prev = plan.seqs[i]
        assert prev.request_id == s.request_id and s.start == prev.end and s.state_slot == prev.state_slot
        assert len(s.block_table) * sched.config.block_size >= s.end and s.output_index == prev.output_index + 1
    assert list(ahead.feed_index) == sorted(ahead.feed_index)  # same order: oldest first
    sched.blocks.check()


@pytest.mark.parametrize("blocks", [64, 16])
def test_step_ahead_streams_equal_the_serial_loop(blocks):
    """Many requests (EOS ends, stop sequences, max_new_tokens ends, preemption with 16 blocks): with the overlap
    every answer equals the uninterrupted reference, exactly as the serial loop's do; steps were formed ahead, rows
    ending by length were left out of them, and tokens of rows that ended by EOS / stop while a step ahead was in
    flight were dropped."""
    results = {}
    for mode in ("serial", "ahead"):
        sched, _, runner = make(num_kv_blocks=blocks)
        kw = dict(stop_token_ids=((5, 6),), eos_token_ids=(EOS,))
        rids = [sched.add(req(3 + 5 * i % 11, max_new=4 + 7 * i % 13, first=i, **kw)) for i in range(12)]
        answers = run_ahead(sched, runner) if mode == "ahead" else run_to_end(sched, runner)
        for rid in rids:
            r = sched.config.max_model_len
            i = rids.index(rid)
            ref = reference(req(3 + 5 * i % 11, max_new=4 + 7 * i % 13, first=i, **kw), seed_of(rid), r)
            got = answers[rid].outputs[0]
            assert (got.token_ids, got.finish_reason) == ref, (mode, rid)
        results[mode] = sched.stats
        ends = {answers[rid].outputs[0].finish_reason for rid in rids}
        assert sched.blocks.num_used_blocks == 0 and sched.num_running == 0
    ahead = results["ahead"]
    assert ahead.steps_ahead > 10 and results["serial"].steps_ahead == 0
    assert ahead.dropped_tokens > 0  # EOS / stop at N with N+1 already computed for that row
    assert FinishReason.LENGTH in ends and ends & {FinishReason.EOS, FinishReason.STOP}  # both kinds of end ran


def test_step_ahead_refuses_what_only_step_may_do():
    """None (serial `step` next) while a request waits, while a resident sequence is mid-prefill (not in the plan),
    for a plan with prefill rows, with a second plan already ahead, and when the rows need more blocks than are
    free; a row ending by length at N is left out and the feed index skips it."""
    sched, _, runner = make(max_num_batched_tokens=16)
    a = sched.add(req(4, max_new=2))
    b = sched.add(req(4, max_new=9))
    plan = sched.step()  # both prefills
    assert sched.step_ahead(plan) is None  # prefill rows: their first tokens are not decode inputs yet
    sched.finish(plan, runner.run(plan))
    plan = sched.step()  # decode: a's 2nd (last) token, b's 2nd
    out = runner.run(plan)
    ahead = sched.step_ahead(plan)
    assert [s.request_id for s in ahead.seqs] == [b] and ahead.feed_index == (1,)  # a ends by length at N
    assert sched.step_ahead(plan) is None and sched.step_ahead(ahead) is None  # one step ahead at most
    out_ahead = runner.run(ahead, fed=out)
    with pytest.raises(ValueError, match="launch order"):
        sched.finish(ahead, out_ahead)
    sched.finish(plan, out)
    c = sched.add(req(3))  # waiting: the next step must admit it
    assert sched.step_ahead(ahead) is None
    sched.finish(ahead, out_ahead)
    assert a not in sched and sched.sequence(b).num_output_tokens == 3
    plan = sched.step()  # b decodes, c prefills
    assert sched.step_ahead(plan) is None
    sched.finish(plan, runner.run(plan))
    sched.cancel(c)
    # no free blocks for the rows' next positions: b needs a new block at its block boundary
    while True:
        plan = sched.step()
        if sched.blocks.blocks_to_append(b, 1):  # the step ahead of this one would start a new block
            break
        sched.finish(plan, runner.run(plan))
    free = sched.blocks.num_free_blocks
    hog = sched.blocks.allocate("hog", free * sched.config.block_size)  # everything else taken
    assert hog and sched.step_ahead(plan) is None
    sched.blocks.free("hog")
    assert sched.step_ahead(plan) is not None


def test_step_ahead_cancel_and_failure():
    """A request cancelled while N and N+1 are in flight gets exactly one answer (Cancelled), both steps' tokens for
    it are dropped, and its blocks come back; a failed N fails its live sequences, and N+1 is failed after it."""
    sched, _, runner = make()
    rids = [sched.add(req(4, max_new=30, first=i, eos_token_ids=())) for i in range(3)]
    # cancel request 1 while the first decode step and the one ahead of it are in flight
    plan = sched.step()
    sched.finish(plan, runner.run(plan))
    answers = run_ahead(sched, runner, cancel_at={plan.step_id + 1: rids[1]})
    assert isinstance(answers[rids[1]].error, Cancelled)
    assert all(answers[r].ok and len(answers[r].outputs[0].token_ids) == 30 for r in (rids[0], rids[2]))
    assert sched.stats.dropped_tokens >= 2 and sched.blocks.num_used_blocks == 0
    sched2, _, runner2 = make()
    r = sched2.add(req(4, max_new=30, eos_token_ids=()))
    plan = sched2.step()
    sched2.finish(plan, runner2.run(plan))
    plan = sched2.step()
    ahead = sched2.step_ahead(plan)
    sched2.fail(plan, RuntimeError("device"))
    sched2.fail(ahead, RuntimeError("device"))
    (answer,) = sched2.pop_answers()
    assert isinstance(answer.error, StepFailed) and answer.request_id == r and sched2.in_flight is None


# --------------------------------------------------------------------------------------------------------------
# Prompt log-probabilities


def with_prompt_logprobs(runner: FakeRunner, plan: StepPlan) -> StepOutput:
    """The fake runner's output plus each row's prompt targets' entries, encoding what a real runner must get right:
    logprob -t for prompt token t (its index), top (the target's own id, the position's token id)."""
    out = runner.run(plan)
    rows = tuple(tuple(TokenLogprobs(-float(s.prompt_first + j), ((tok, 0.0), (s.token_ids[s.prompt_first - 1 -
                                                                                              s.start + j], -1.0)))
                       for j, tok in enumerate(s.prompt_targets)) for s in plan.seqs)
    return StepOutput(out.sampled_token_ids, out.logprobs,
                      rows if any(s.prompt_targets for s in plan.seqs) else None)


@pytest.mark.parametrize("blocks", [200, 12])  # 12 blocks of 4 slots: preemption, some mid-prompt
def test_prompt_logprobs_come_once_in_order_on_the_first_delta(monkeypatch, blocks):
    """Every prompt token after the first gets exactly one entry, in order, from the logits at the position before
    it (the fake encodes the token index and both ids), on the request's first delta; chunks that keep every
    position's logits hold at most PROMPT_LOGPROBS_CHUNK tokens a step in all; preemption computes none twice and
    the streams stay the uninterrupted ones; requests that did not ask get none."""
    from engine_core import continuous

    monkeypatch.setattr(continuous, "PROMPT_LOGPROBS_CHUNK", 5)
    sched, _, runner = make(num_kv_blocks=blocks, max_num_seqs=5)
    asks = [SamplingParams(0.7, seed=7 + i, prompt_logprobs=(2 if i % 2 == 0 else None)) for i in range(5)]
    requests = [req(n, max_new=m, first=i, sampling=asks[i])
                for i, (n, m) in enumerate([(13, 20), (3, 25), (14, 20), (6, 30), (1, 30)])]
    rids = [sched.add(r) for r in requests]
    firsts, answers = {}, {}
    for _ in range(10_000):
        plan = sched.step()
        if plan is not None:
            check_plan(sched, plan)
            scored = sum(s.num_tokens for s in plan.seqs if s.sampling.prompt_logprobs is not None
                         and s.prompt_targets)
            assert scored <= 5
            for s in plan.seqs:
                assert not s.prompt_targets or s.sampling.prompt_logprobs is not None
            for d in sched.finish(plan, with_prompt_logprobs(runner, plan)):
                if d.request_id not in firsts:
                    firsts[d.request_id] = d
                else:
                    assert d.prompt_logprobs is None
        for a in sched.pop_answers():
            answers[a.request_id] = a
        if plan is None and sched.num_unfinished == 0:
            break
    if blocks == 12:
        assert sched.stats.preemptions > 0
    for rid, r in zip(rids, requests):
        c = answers[rid].outputs[0]
        assert (c.token_ids, c.finish_reason) == reference(r, r.sampling.seed, 128)
        got = firsts[rid].prompt_logprobs
        if r.sampling.prompt_logprobs is None:
            assert got is None
            continue
        p = r.prompt_token_ids
        assert got is not None and len(got) == len(p) - 1
        assert [lp.logprob for lp in got] == [-float(t) for t in range(1, len(p))]
        assert [lp.top for lp in got] == [((p[t], 0.0), (p[t - 1], -1.0)) for t in range(1, len(p))]


def test_prompt_logprobs_skip_the_lone_prefill_rule_and_a_missing_entry_is_refused():
    sched, _, runner = make(lone_prefill_tokens=16)
    sched.add(req(6, sampling=SamplingParams(prompt_logprobs=0)))
    plan = sched.step()
    assert not plan.lone_prefill and plan.seqs[0].prompt_targets == plan.seqs[0].token_ids[1:]
    assert plan.seqs[0].prompt_first == 1
    with pytest.raises(ValueError, match="prompt log-probabilities"):
        sched.finish(plan, runner.run(plan))  # no prompt entries for a row that has targets
    assert sched.in_flight is plan
    (delta,) = sched.finish(plan, with_prompt_logprobs(runner, plan))
    assert len(delta.prompt_logprobs) == 5
    sched.add(req(6))  # without prompt log-probabilities the rule takes it
    assert sched.step().lone_prefill


def test_prompt_logprobs_validation():
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
