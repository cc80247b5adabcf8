"""qwen_engine/prefill_graphs.py: a lone sequence's prefill run in a padded token bucket (the CUDA-graph path's
static buffers; "static" mode runs them eagerly on the CPU) must compute exactly what the plain paged path does.

References: the contiguous `QwenState` path fed the same tokens (as in tests/test_qwen_engine.py: 1e-5 x max |logit|
in fp64, 1e-4 in fp32), and the engine's greedy streams against `greedy_generate` on each prompt alone."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from engine_core.continuous import ContinuousConfig, ContinuousScheduler, GenerateRequest, StepOutput
from kernels import gdn_conv
from qwen_engine.config import QwenConfig
from qwen_engine.engine import QwenEngine, QwenEngineConfig, randomise
from qwen_engine.model.causal_lm import QwenForCausalLM, greedy_generate
from qwen_engine.model.paged import GDNSlots, PagedKV
from qwen_engine.prefill_graphs import PrefillGraphs, default_buckets
from qwen_engine.runner import ModelRunner

VOCAB = QwenConfig.tiny().vocab_size
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def prompt(i: int, n: int) -> list[int]:
    return [(29 * i + 5 * j + 1) % VOCAB for j in range(n)]


@pytest.fixture(scope="module")
def model():
    m = QwenForCausalLM(QwenConfig.tiny(), gdn_chunk_size=4).eval()  # chunk 4: padding fills whole GDN chunks
    randomise(m, 1)
    return m


CUDA = torch.cuda.is_available()
CASES = [("cpu", "static", torch.float64, 1e-5), ("cpu", "static", torch.float32, 1e-4),
         ("cpu", "static", torch.bfloat16, 3e-2)]
# on a GPU: captured graphs, the engine's kernels (Triton; fla's GDN prefill for bf16, whose TF32 products and bf16
# roundings of padded-shape GEMMs give the bf16 gate of tests/test_gdn_fused_glue.py, 3e-2). bf16 is not checked
# against the contiguous model: on the H200 (2026-11-30) the plain paged path itself ("off") was 1.0e-1 x max |logit|
# from it at the third decode step of the 13-token prompt (different kernels and roundings in bf16 on a random tiny
# model; tests/test_gdn_fused_glue.py and the oracle table cover bf16 paths against each other), so in bf16 the graph
# path is compared with the plain paged path on prefill-only requests: exactly the step the graphs change.
CUDA_CASES = [("cuda", "capture", torch.float32, 1e-4), ("cuda", "capture", torch.bfloat16, 3e-2)]


@pytest.mark.parametrize("device,mode,dtype,tol", CASES + [
    pytest.param(*c, marks=pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")) for c in CUDA_CASES])
def test_padded_prefill_logits_and_state_match_plain_path(model, device, mode, dtype, tol):
    """Requests one at a time (each prefill is the step's only sequence, from position 0): 1 and 2 tokens (fewer than
    the conv's width), 5, 8 (a full bucket), 13 (padded to 16) and 37 tokens (its first 16-token chunk through the
    graph path, the rest as plain chunks). Every sampled row's logits equal the contiguous reference (fp32 / fp64;
    bf16: the plain paged path's, prefill-only requests of 1, 2, 5, 8, 13 and 16 tokens, see CUDA_CASES); after each
    request the whole KV pool and every state row but the scratch ones equal what a runner without prefill graphs
    leaves behind (so padding landed only in the scratch block and state row)."""
    exact = dtype != torch.bfloat16
    requests = ([(1, 2), (2, 2), (5, 3), (8, 2), (13, 4), (37, 2)] if exact else
                [(1, 1), (2, 1), (5, 1), (8, 1), (13, 1), (16, 1)])
    model = copy.deepcopy(model).to(device=device, dtype=dtype)
    blocks, bs, seqs = 32, 4, 4
    runners = {m: ModelRunner(copy.deepcopy(model), model.config, device, blocks, bs, seqs, max_model_len=64,
                              prefill_graphs=m, prefill_buckets=(8, 16)) for m in ("off", mode)}
    if mode == "capture":
        assert runners[mode].capture_prefill_graphs() > 0 and runners[mode].prefill_graphs.captured
    worst, checked = 0.0, 0
    for i, (n, new) in enumerate(requests):
        plans, sampled = {}, {}
        for m, runner in runners.items():
            sched = ContinuousScheduler(ContinuousConfig(num_kv_blocks=blocks, block_size=bs, max_num_seqs=seqs,
                                                         max_num_batched_tokens=16, max_model_len=64))
            sched.add(GenerateRequest(tuple(prompt(i, n)), max_new_tokens=new))
            state = model.new_state(1, 64)
            steps, sampled[m] = [], []
            with torch.no_grad():
                while (plan := sched.step()) is not None:
                    logits = runner.forward(plan)
                    s = plan.seqs[0]
                    ref = model(torch.tensor([s.token_ids], device=device), state)[0, -1].float()
                    if s.sample:
                        sampled[m].append(logits[0].float())
                        if exact:
                            err = float((logits[0].float() - ref).abs().max() / ref.abs().max())
                            worst = max(worst, err)
                            assert err <= tol, f"{m}: prompt {i} step {plan.step_id}: {err:.2e} x max |ref|"
                        checked += 1
                    steps.append((s.block_table, s.state_slot))
                    sched.finish(plan, StepOutput(tuple(int(t) for t in logits.argmax(-1))))
            plans[m] = steps
        assert plans["off"] == plans[mode]  # same blocks and slots: the pools below are comparable
        if not exact:  # the graph path against the plain paged path
            for a, b in zip(sampled["off"], sampled[mode]):
                err = float((b - a).abs().max() / a.abs().max())
                worst = max(worst, err)
                assert err <= tol, f"prompt {i}: graph vs plain paged {err:.2e} x max |logit|"
        # the scheduler's blocks [:blocks] and state rows [:seqs] (the scratch ones lie past them), all of them
        for a, b in zip(runners["off"].cache.layers, runners[mode].cache.layers):
            pairs = ((a.k[:blocks], b.k[:blocks]), (a.v[:blocks], b.v[:blocks])) if isinstance(a, PagedKV) else (
                (a.conv[:seqs], b.conv[:seqs]), (a.recurrent[:seqs], b.recurrent[:seqs]))
            assert isinstance(a, (PagedKV, GDNSlots))
            for pa, pb in pairs:
                pa, pb = pa.float(), pb.float()
                assert float((pa - pb).abs().max()) <= tol * float(pa.abs().max()), f"prompt {i}"
    graph = runners[mode].prefill_graphs
    assert runners[mode].prefill_graph_steps == 6 and runners["off"].prefill_graph_steps == 0
    assert graph.replays == {8: 4, 16: 2}, graph.replays  # 1, 2, 5, 8 -> 8; 13 and 37's first chunk (or 16) -> 16
    assert checked == 2 * sum(new for _, new in requests)
    # both runners' prefill chunks went through kernels/gdn_conv.py (the interpreter on the CPU, compiled on a GPU;
    # fp64 has no kernel: the reference), the padded graph steps with its on-device valid count
    for runner in runners.values():
        want = "triton" if dtype in gdn_conv.DTYPES else "reference"
        calls = runner.registry.choices()["gdn_prefill_conv"]["calls"]
        assert set(calls) == {want}, calls  # every call, not only the last
    # padding went to the scratch block (one past the pool) and row (one past the slots); other blocks untouched
    static = runners[mode].cache
    scratch_kv = next(layer for layer in static.layers if isinstance(layer, PagedKV)).k[blocks]
    assert scratch_kv.abs().sum() > 0
    print(f"padded prefill ({device}, {mode}, {dtype}) vs {'contiguous' if exact else 'plain paged'}: worst "
          f"{worst:.2e} x max |ref|")


def test_graph_buffers_and_errors(model):
    """`run` refuses chunks larger than the largest bucket or than the block table given; padding ids are token 0
    and padding slots the scratch block's; the state row and logits index follow the chunk."""
    runner = ModelRunner(copy.deepcopy(model), model.config, "cpu", 16, 4, 2, max_model_len=32,
                         prefill_graphs="static", prefill_buckets=(8,))
    g = runner.prefill_graphs
    with pytest.raises(ValueError, match="largest prefill graph holds 8"):
        g.run(list(range(9)), (0, 1, 2), 0)
    with pytest.raises(ValueError, match="do not fit"):
        g.run([1, 2, 3, 4, 5], (0,), 0)
    with torch.no_grad():
        logits = g.run([7, 8, 9, 10, 11], (3, 5), 1)
    assert logits.shape == (1, VOCAB)
    h = g._h
    assert h["ids"].tolist() == [7, 8, 9, 10, 11, 0, 0, 0]
    assert h["slot_mapping"].tolist() == [12, 13, 14, 15, 20, 16 * 4 + 1, 16 * 4 + 2, 16 * 4 + 3]
    assert (int(h["valid"][0]), int(h["last"][0]), int(h["slot"][0])) == (5, 4, 1)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        PrefillGraphs(model, runner.cache, buckets=(8,), scratch_block=16, scratch_slot=2, device="cpu")
    with pytest.raises(ValueError, match="prefill_graphs must be one of"):
        ModelRunner(model, model.config, "cpu", 16, 4, 2, max_model_len=32, prefill_graphs="yes")


def test_default_buckets():
    assert default_buckets(2048, 8192) == (256, 1024, 2048)
    assert default_buckets(8192, 32768) == (256, 1024, 2048, 4096, 8192)  # the serve configs' budget
    assert default_buckets(8192, 6000) == (256, 1024, 2048, 4096, 6000)  # the model length caps a chunk
    assert default_buckets(16384, 32768) == (256, 1024, 2048, 4096, 8192)  # larger chunks run eagerly
    assert default_buckets(1000, 8192) == (256, 1000)
    assert default_buckets(2048, 1088) == (256, 1024, 1088)
    assert default_buckets(16, 96) == (16,)


def tiny_engine_config(**kw) -> QwenEngineConfig:
    """The engine tests' tiny fp32 CPU engine on the reference kernels, prefill graphs "static" with buckets 8 and
    16; `kw` overrides."""
    return QwenEngineConfig(**{**dict(config="tiny", device="cpu", dtype="fp32", seed=0, kernels="reference",
                                      max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
                                      max_model_len=96, request_timeout_s=60.0, warmup=False,
                                      kernel_self_check=False, prefill_graphs="static", prefill_buckets=[8, 16]),
                               **kw})


async def greedy(engine: QwenEngine, i: int, n: int, new: int = 5) -> list[int]:
    """The tokens `engine` generates for prompt(i, n)."""
    return [t async for c in engine.generate(prompt(i, n), max_new_tokens=new) for t in c.new_token_ids]


def run_engine(cfg: QwenEngineConfig, body):
    """Start an engine, `await body(engine)`, close it; -> (engine, body's result)."""
    async def main():
        engine = QwenEngine(cfg)
        await engine.start()
        try:
            return engine, await body(engine)
        finally:
            await engine.aclose()
    return asyncio.run(main())


@pytest.mark.parametrize("lone_prefill", ["auto", False])
def test_engine_greedy_through_prefill_graphs(lone_prefill):
    """The engine with prefill_graphs "static": requests alone (the graph path) and together give the single-prompt
    greedy tokens; health shows the graph steps. Together, with the lone-prefill rule (auto: on with the graphs)
    the prompts of <= 16 tokens (the largest bucket) take graph steps of their own between the decode steps and the
    30-token one mixed steps; without it (False) every one of them rides in mixed steps (no graph)."""
    lengths = (3, 16, 11, 30)

    async def body(engine):
        alone = [await greedy(engine, i, n) for i, n in enumerate(lengths)]
        graph_steps = engine.health()["runner"]["prefill_graph_steps"]
        together = await asyncio.gather(*(greedy(engine, i, n, new=8) for i, n in enumerate(lengths)))
        return alone, graph_steps, together

    engine, (alone, alone_graph_steps, together) = run_engine(tiny_engine_config(lone_prefill=lone_prefill), body)
    for i, n in enumerate(lengths):
        ref = greedy_generate(engine.model, torch.tensor([prompt(i, n)]), 8)[0].tolist()
        assert alone[i] == ref[:5] and together[i] == ref, f"prompt {i} ({n} tokens)"
    h = engine.health()
    stats, lone = h["runner"], h["stats"]["lone_prefill_steps"]
    assert alone_graph_steps >= 3, stats  # the three prompts of <= 16 tokens, alone
    assert stats["prefill_graphs"]["mode"] == "static" and stats["prefill_graphs"]["buckets"] == [8, 16], stats
    if lone_prefill == "auto":
        assert h["lone_prefill_tokens"] == 16
        assert lone == 3 + 3 and stats["prefill_graph_steps"] == alone_graph_steps + 3, (lone, stats)
    else:
        assert h["lone_prefill_tokens"] == 0
        assert lone == 0 and stats["prefill_graph_steps"] == alone_graph_steps, (lone, stats)
    with pytest.raises(ValueError, match="prefill_graphs must be"):
        QwenEngineConfig(config="tiny", prefill_graphs="yes")
    with pytest.raises(ValueError, match="lone_prefill must be"):
        QwenEngineConfig(config="tiny", lone_prefill="yes")
    with pytest.raises(ValueError, match="lone_prefill_min_tokens must be"):
        QwenEngineConfig(config="tiny", lone_prefill_min_tokens=-1)
    with pytest.raises(ValueError, match="prefill_buckets must be positive"):
        QwenEngineConfig(config="tiny", prefill_buckets=(0,))


def test_warmup_forms_the_full_decode_batch_with_the_lone_prefill_rule_on():
    """The warm-up turns the lone-prefill rule off while it runs (it would admit the decode batch's prompts one by
    one), so its max_num_seqs prompts decode together in the largest decode bucket; the rule is back on after."""
    async def body(engine):
        return engine.health()

    engine, h = run_engine(tiny_engine_config(warmup=True, decode_graphs="static"), body)
    assert h["lone_prefill_tokens"] == 16
    replays = h["runner"]["decode_graphs"]["replays"]
    assert replays.get("4", 0) > 0, replays  # max_num_seqs = 4 rows in one decode step


def test_bucket_limits_and_failed_capture(monkeypatch):
    """Buckets a step can never fill are refused up front; a CaptureError at start (warm-up or capture) leaves
    prefill_graphs "auto" serving eagerly, health saying why, while an explicit "capture" fails start()."""
    import dataclasses

    from qwen_engine.decode_graphs import CaptureError

    for bad in ((32,), (True,)):
        with pytest.raises(ValueError, match="prefill_buckets"):
            QwenEngineConfig(config="tiny", max_num_batched_tokens=16, max_model_len=96, prefill_buckets=bad)

    def refuse(self):
        raise CaptureError("prefill graph warm-up failed at 16 tokens: test")

    monkeypatch.setattr(ModelRunner, "capture_prefill_graphs", refuse)
    cfg = QwenEngineConfig(config="tiny", device="cpu", dtype="fp32", kernels="reference", max_num_seqs=2,
                           max_num_batched_tokens=16, block_size=4, num_kv_blocks=32, max_model_len=64,
                           warmup=False, kernel_self_check=False, prefill_graphs="static", prefill_buckets=(16,))

    async def main(mode):
        engine = QwenEngine(cfg)
        engine.cfg = dataclasses.replace(engine.cfg, prefill_graphs=mode)
        engine.runner.prefill_graphs.mode = "capture"  # as on a GPU (the CPU cannot build a capture-mode runner)
        try:
            await engine.start()
            tokens = [t async for c in engine.generate(prompt(0, 6), max_new_tokens=3) for t in c.new_token_ids]
            return engine, tokens
        finally:
            await engine.aclose()

    engine, tokens = asyncio.run(main("auto"))
    assert tokens == greedy_generate(engine.model, torch.tensor([prompt(0, 6)]), 3)[0].tolist()
    h = engine.health()["runner"]
    assert h["prefill_graph_steps"] == 0 and "test" in h["prefill_graphs"]["disabled"], h
    assert engine.health()["lone_prefill_tokens"] == 0  # the lone-prefill rule (auto) off with the graphs
    with pytest.raises(RuntimeError, match="set prefill_graphs: auto or off"):
        asyncio.run(main("capture"))


def test_warm_and_capture_order_and_failures(monkeypatch):
    """`decode_graphs.warm_and_capture` (both graph kinds' capture) with torch.cuda's stream / graph calls stubbed so
    that its control flow runs on the CPU: every bucket warmed twice in ascending order, the check between warm-up and
    capture, captures largest first into one pool; a failure in warm-up or capture becomes a CaptureError naming the
    stage and bucket, and a CaptureError from the check passes through unchanged. (The real capture: the CUDA tests.)"""
    import contextlib

    from qwen_engine import decode_graphs
    from qwen_engine.decode_graphs import CaptureError, warm_and_capture

    events = []

    class Graph:
        def pool(self):
            return "pool"

    class Stream:
        def wait_stream(self, other):
            pass

    def graph(g, pool=None, capture_error_mode=None):
        events.append(("capture", pool))
        return contextlib.nullcontext()

    cuda = decode_graphs.torch.cuda
    for name, value in (("device", lambda d: contextlib.nullcontext()), ("Stream", lambda d=None: Stream()),
                        ("current_stream", lambda d=None: Stream()), ("stream", lambda s: contextlib.nullcontext()),
                        ("synchronize", lambda d=None: None), ("CUDAGraph", Graph), ("graph", graph)):
        monkeypatch.setattr(cuda, name, value)

    def forward(b, fail_at=None):
        events.append(b)
        if b == fail_at:
            raise torch.OutOfMemoryError("test")
        return f"out{b}"

    graphs, outputs = warm_and_capture(forward, (2, 8), "cpu", "test graph", check=lambda: events.append("check"))
    assert events == [2, 2, 8, 8, "check", ("capture", None), 8, ("capture", "pool"), 2]
    assert outputs == {8: "out8", 2: "out2"} and set(graphs) == {2, 8}
    with pytest.raises(CaptureError, match="test graph warm-up failed at 8"):
        warm_and_capture(lambda b: forward(b, fail_at=8), (2, 8), "cpu", "test graph")
    calls = iter(range(100))
    with pytest.raises(CaptureError, match="test graph capture failed at 8"):  # fourth warm-up call is fine, 5th not
        warm_and_capture(lambda b: forward(b, fail_at=b if next(calls) == 4 else None), (2, 8), "cpu", "test graph")
    def blocked():
        raise CaptureError("blocked")

    with pytest.raises(CaptureError, match="^blocked$"):
        warm_and_capture(forward, (2,), "cpu", "test graph", check=blocked)
