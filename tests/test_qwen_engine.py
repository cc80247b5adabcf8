"""QwenEngine, ModelRunner and the paged variable-length forward, on the tiny config in fp32 on the CPU.

References: the contiguous `QwenState` path (`model(ids, state)`, itself checked against transformers in
tests/test_qwen_model.py) and `greedy_generate` run on one prompt alone. Tolerances: paged vs contiguous logits
agree to 1e-5 x max |logit| with fp64 weights and 1e-4 in fp32 (see the test for why); engine greedy streams must
be token-identical.
"""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest
import torch

from engine_core.continuous import (
    ContinuousConfig,
    ContinuousScheduler,
    GenerateRequest,
    SamplingParams,
    StepOutput,
)
from engine_core.request import DeadlineExceeded, Overloaded
from engine_core.sampling import reference_logprobs, reference_adjusted
from qwen_engine.config import QwenConfig
from qwen_engine.engine import BadRequest, GenerationChunk, NotReady, QwenEngine, QwenEngineConfig, randomise
from qwen_engine.model.attention import paged_decode_attention, paged_decode_attention_reference
from qwen_engine.model.causal_lm import QwenForCausalLM, greedy_generate
from qwen_engine.model.paged import FlatBatch, PagedKV
from qwen_engine.runner import ModelRunner
from kernels.w4a16_gemm import _interpreted as _kernels_interpreted

VOCAB = QwenConfig.tiny().vocab_size


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
# Triton built by its interpreter (CPU hosts: tests/conftest.py sets TRITON_INTERPRET=1): the kernels then run on the
# CPU tensors of these tests; on a GPU host they are compiled and the CPU engines here run the references
INTERPRETED = _kernels_interpreted()
# The preference under which this module's CPU engines run the Triton kernels: "auto" on a CPU device applies the
# references (engine_core.registry.resolve_preference), so the interpreter is asked for explicitly; on a GPU host the
# compiled kernels cannot take these engines' CPU tensors ("triton" would raise), so "auto" -- the references -- there,
# as "auto" fell back to them before the rule
CPU_TRITON = "triton" if INTERPRETED else "auto"


def auto_as_on_a_gpu(monkeypatch) -> None:
    """For the CPU engines of packed weights that run the interpreted Triton kernels where these take the call and
    the references elsewhere: kernels "auto" keeps AUTO on the CPU device (the engine module's `resolve_preference`
    made the identity for the test). "triton" cannot serve them: fp8_linear's Triton paths are CUDA-only and an
    explicit preference never falls back."""
    import qwen_engine.engine as engine_module
    from engine_core.registry import KernelPreference

    monkeypatch.setattr(engine_module, "resolve_preference",
                        lambda preference, device: KernelPreference.parse(preference))


def prompt(i: int, n: int) -> list[int]:
    return [(31 * i + 7 * j + 3) % VOCAB for j in range(n)]


@pytest.fixture(scope="module")
def model():
    m = QwenForCausalLM(QwenConfig.tiny(), gdn_chunk_size=16).eval()  # chunk 16: prompts span several GDN chunks
    randomise(m, 0)
    return m


# --------------------------------------------------------------------------------------------------------------
# Paged forward vs the contiguous reference


# fp64 weights (GDN still runs its fp32 core): 1e-5 holds with ~20x margin (measured worst ~5e-7). fp32: the
# random tiny model amplifies one-ulp differences of reductions over differently laid-out tensors (e.g. the GDN
# l2norm of a contiguous [N, C] vs a transposed [B, T, C] conv output) to ~2e-5 after a few steps, so fp32 uses
# tests/test_qwen_model.py's REL_TOL 1e-4 (issue 5's fp32 logits gate).
@pytest.mark.parametrize("dtype,num_kv_blocks,tol,graphs,fused,kv_fp8", [
    (torch.float64, 8, 1e-5, "off", False, False), (torch.float32, 32, 1e-4, "off", False, False),
    (torch.float64, 32, 1e-5, "static", False, False), (torch.float32, 32, 1e-4, "static", False, False),
    (torch.float32, 32, 1e-4, "static", True, False),
    (torch.float64, 8, 1e-5, "off", False, True), (torch.float32, 32, 1e-4, "static", True, True)])
def test_paged_forward_matches_contiguous(model, dtype, num_kv_blocks, tol, graphs, fused, kv_fp8, monkeypatch):
    """Drive scheduler + runner greedily; every sampling row's logits equal a contiguous batch-1 state fed the same
    tokens (decode batches, chunked prefill, and re-prefill after preemption: 8 blocks of 4 force it). graphs
    "static": decode-only steps go through the CUDA-graph path's static buffers, padded to the decode buckets
    (1, 2, 4) with the scratch sequence (qwen_engine/decode_graphs.py), run eagerly; padding must change nothing.
    fused: the model's fused ops as on a GPU (norms, router, MoE tail, and the attention layers' decode prep -- q/k
    norms, RoPE, pool write -- which only the paged decode path has), through the Triton interpreter. kv_fp8: e4m3
    KV pools (`kv_cache_dtype` "fp8"), against the contiguous reference with its k / v rounded the same way
    (`fp8_quant.kv_pool_cast`): the paged paths attend to exactly the stored values."""
    from engine_core.registry import default_registry
    from qwen_engine.model.attention import GatedAttention
    from qwen_engine.model.moe import SparseMoE, TopKRouter
    from qwen_engine.model.norm import GatedRMSNorm, ZeroCentredRMSNorm

    fused_ops = ("attn_decode_prep", "rms_norm_zc", "rms_norm_gated", "moe_combine", "router_topk",
                 "router_gemv_topk")
    reg = default_registry()
    before = {op: reg.preference(op) for op in fused_ops}
    calls0 = {op: reg.choices()[op]["calls"].get("triton", 0) for op in fused_ops}
    if fused:
        for cls in (GatedAttention, SparseMoE, TopKRouter, ZeroCentredRMSNorm, GatedRMSNorm):
            monkeypatch.setattr(cls, "fused", True)
        # above MAX_ROWS rows F.linear + the router_topk op (router_linear_topk, the engine's router_parts, takes no
        # fp32 model: tests/test_kernel_router_parts.py covers it)
        monkeypatch.setattr(TopKRouter, "parts", False)
        for op in fused_ops:  # an engine built earlier in this process may have set them
            reg.set_preference("auto", op)
    kv_dtype = None
    if kv_fp8:
        from kernels.fp8_quant import kv_pool_cast
        from qwen_engine.model.state import KVCache

        append, kv_dtype = KVCache.append, torch.float8_e4m3fn
        monkeypatch.setattr(KVCache, "append", lambda self, k, v: append(
            self, kv_pool_cast(k, kv_dtype).to(k.dtype), kv_pool_cast(v, kv_dtype).to(v.dtype)))
    try:
        _drive_paged_vs_contiguous(model, dtype, num_kv_blocks, tol, graphs, kv_dtype)
    finally:
        for op, pref in before.items():
            reg.set_preference(pref, op)
    if fused and INTERPRETED:  # each fused op ran its Triton kernel in this test (interpreted on the CPU)
        for op in fused_ops:
            assert reg.choices()[op]["calls"].get("triton", 0) > calls0[op], op


def _drive_paged_vs_contiguous(model, dtype, num_kv_blocks, tol, graphs, kv_dtype=None):
    model = copy.deepcopy(model).to(dtype)
    sched = ContinuousScheduler(ContinuousConfig(num_kv_blocks=num_kv_blocks, block_size=4, max_num_seqs=4,
                                                 max_num_batched_tokens=16, max_model_len=64))
    runner = ModelRunner(model, model.config, "cpu", num_kv_blocks, 4, 4, max_model_len=64,
                         decode_buckets=sched.config.decode_buckets, decode_graphs=graphs, kv_dtype=kv_dtype)
    assert kv_dtype is None or runner.cache.layers[model.config.full_attention_layers[0]].k.dtype == kv_dtype
    lengths = [6, 20, 1, 10]  # 20 > the 16-token budget: a split prefill
    new_tokens = [6, 3, 8, 5]  # streams end at different steps: decode batches of 4, 3 (padded to 4), 2, 1
    for i, n in enumerate(lengths):
        sched.add(GenerateRequest(tuple(prompt(i, n)), max_new_tokens=new_tokens[i]))
    ref_states, checked, kinds, worst = {}, 0, set(), 0.0
    with torch.no_grad():
        while (plan := sched.step()) is not None:
            logits = runner.forward(plan)
            rows = iter(range(logits.shape[0]))
            for s in plan.seqs:
                if s.reset_state:
                    ref_states[s.request_id] = model.new_state(1, 64)
                st = ref_states[s.request_id]
                assert st.pos == s.start
                ref = model(torch.tensor([s.token_ids]), st)[0, -1]
                if s.sample:
                    got = logits[next(rows)]
                    err = float((got - ref).abs().max() / ref.abs().max())
                    worst = max(worst, err)
                    assert err <= tol, f"step {plan.step_id} request {s.request_id}: max err {err:.2e} x max|ref|"
                    checked += 1
                    kinds.add("decode" if s.is_decode else ("chunk" if s.start > 0 else "prefill"))
            tokens = tuple(int(t) for t in logits.argmax(-1))
            sched.finish(plan, StepOutput(tokens))
    print(f"paged vs contiguous logits ({dtype}): worst max-abs error {worst:.2e} x max |ref|")
    assert checked == sum(new_tokens)  # every sampled token checked once (preemption neither loses nor repeats)
    assert {"decode", "chunk", "prefill"} <= kinds
    if num_kv_blocks == 8:
        assert sched.stats.preemptions > 0
    if dtype == torch.float32 and INTERPRETED:  # the decode-only steps ran the fused GDN prep kernel (interpreted)
        assert runner.registry.choices()["gdn_decode_prep_ba"]["last"] == "triton"
    if graphs == "static":
        replays = runner.graphs.stats()["replays"]
        assert runner.graph_steps > 0 and set(replays) >= {"1", "2", "4"}, replays


def test_paged_decode_attention_matches_loop():
    """Batched padded decode attention == per-sequence gathered SDPA, random pool and scattered block tables."""
    gen = torch.Generator().manual_seed(0)
    nb, bs, kvh, d, h = 20, 4, 2, 8, 4
    kv = PagedKV(torch.randn(nb, bs, kvh, d, generator=gen), torch.randn(nb, bs, kvh, d, generator=gen))
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = [tuple(perm[0:3]), tuple(perm[3:4]), tuple(perm[4:9])]
    ctx = [11, 2, 17]
    batch = FlatBatch.build([(c - 1, 1, t, i) for i, (c, t) in enumerate(zip(ctx, tables))], 3, bs, "cpu")
    q = torch.randn(3, h, d, generator=gen)
    got = paged_decode_attention(q, kv, batch, d ** -0.5)
    ref = paged_decode_attention_reference(q, kv, batch, d ** -0.5)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------------------------
# The engine


def engine_config(**kw) -> QwenEngineConfig:
    base = dict(config="tiny", device="cpu", dtype="fp32", seed=0, kernels="reference", max_num_seqs=4,
                max_num_batched_tokens=16, block_size=4, num_kv_blocks=64, max_model_len=96, max_queued=32,
                request_timeout_s=60.0, warmup=False, kernel_self_check=False)
    base.update(kw)
    return QwenEngineConfig(**base)


def run(cfg: QwenEngineConfig, body):
    """Build and start an engine, run `await body(engine)`, close it."""
    async def main():
        engine = QwenEngine(cfg)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.aclose()
    return asyncio.run(main())


async def collect(engine: QwenEngine, ids, **kw) -> tuple[list[int], list[GenerationChunk]]:
    chunks = [c async for c in engine.generate(ids, **kw)]
    return [t for c in chunks for t in c.new_token_ids], chunks


def reference_greedy(engine: QwenEngine, ids: list[int], n: int) -> list[int]:
    return greedy_generate(engine.model, torch.tensor([ids], device=engine.device), n)[0].tolist()


LENGTHS = [3, 40, 1, 17, 25, 8, 33, 12, 5, 21]  # 40, 33, 25, 21, 17 > the 16-token budget: split prefill


def test_engine_bf16_gdn_state():
    """`gdn_state_dtype: bfloat16`: the GDN recurrent pool is bf16 (half the fp32 pool's bytes, as the KV budget
    counts them) and every request completes. The first token of a prompt that fits one prefill chunk comes from the
    prefill's own fp32 state, so it equals the fp32-state engine's; later tokens read the rounded state and may
    differ (random tiny weights). A dtype outside GDN_STATE_DTYPES is refused."""
    from qwen_engine.engine import GDN_STATE_DTYPES
    from qwen_engine.model.paged import GDNSlots
    from qwen_engine.runner import gdn_state_bytes

    short = [n for n in LENGTHS if n <= 16]

    async def body(engine):
        outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=4) for i, n in enumerate(short)))
        pools = [layer.recurrent for layer in engine.runner.cache.layers if isinstance(layer, GDNSlots)]
        return [o[0] for o in outs], {p.dtype for p in pools}

    bf16, dtypes = run(engine_config(gdn_state_dtype="bfloat16"), body)
    fp32, dtypes32 = run(engine_config(), body)
    assert dtypes == {torch.bfloat16} and dtypes32 == {torch.float32}
    assert all(len(t) == 4 for t in bf16)
    assert [t[0] for t in bf16] == [t[0] for t in fp32]
    c = QwenConfig.tiny()
    saved = gdn_state_bytes(c, 5, torch.float32) - gdn_state_bytes(c, 5, torch.float32, torch.bfloat16)
    gdn_layers = sum(t == "linear_attention" for t in c.layer_types)
    assert saved == gdn_layers * 5 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 2
    assert set(GDN_STATE_DTYPES) == {"float32", "bfloat16"}
    with pytest.raises(ValueError, match="gdn_state_dtype"):
        engine_config(gdn_state_dtype="float16")


@pytest.mark.parametrize("num_kv_blocks,async_decode", [(64, False), (16, False), (64, True), (16, True)])
def test_engine_greedy_equals_single_prompt_reference(num_kv_blocks, async_decode):
    """16 blocks of 4 for up to 4 x 46 tokens: preemption. async_decode: decode steps formed ahead where allowed."""
    async def body(engine):
        outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=6)
                                      for i, n in enumerate(LENGTHS)))
        return engine, outs

    engine, outs = run(engine_config(num_kv_blocks=num_kv_blocks, max_model_len=min(96, 4 * num_kv_blocks),
                                     async_decode=async_decode), body)
    for i, (n, (tokens, chunks)) in enumerate(zip(LENGTHS, outs)):
        assert tokens == reference_greedy(engine, prompt(i, n), 6), f"prompt {i} ({n} tokens)"
        assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 6
        assert chunks[-1].prompt_tokens == n
        assert all(c.finish_reason is None for c in chunks[:-1])
    stats = engine.scheduler.stats
    assert stats.answered_ok == len(LENGTHS)
    assert engine.scheduler.blocks.num_used_blocks == 0
    if num_kv_blocks == 16:
        assert stats.preemptions > 0
    assert (stats.steps_ahead > 0) == async_decode


@pytest.mark.parametrize("async_decode", [False, True])
def test_engine_decode_graph_path_equals_single_prompt_reference(async_decode):
    """decode_graphs="static": the engine's decode-only steps run the CUDA-graph path's static, padded buffers
    (eagerly on the CPU); greedy streams must equal the single-prompt reference. (Logit-level isolation of the
    padding rows is test_paged_forward_matches_contiguous[...static].) async_decode: steps formed ahead take their
    input tokens from the previous step's sampled ids on the device, through the graphs' buffers."""
    lengths = LENGTHS[:5]

    async def body(engine):
        return engine, await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=3 + i)
                                              for i, n in enumerate(lengths)))

    engine, outs = run(engine_config(decode_graphs="static", async_decode=async_decode), body)
    for i, (n, (tokens, _)) in enumerate(zip(lengths, outs)):
        assert tokens == reference_greedy(engine, prompt(i, n), 3 + i), f"prompt {i} ({n} tokens)"
    stats = engine.health()["runner"]
    assert stats["graph_steps"] > 0 and stats["decode_graphs"]["mode"] == "static", stats
    assert (engine.scheduler.stats.steps_ahead > 0) == async_decode
    assert engine.scheduler.blocks.num_used_blocks == 0
    # at rest every launched step has been read (async decode only reads them one step later);
    # benchmarks/qwen_profile.py divides a profile window's kernels by the launches inside it
    assert stats["launches"] == stats["steps"] > 0, stats


def test_capture_blockers_name_host_reading_references(model):
    """Capture is refused up front when a chosen decode kernel reads device values on the host: with kernels
    "reference" the paged-attention reference does; with the interpreter's Triton kernel nothing blocks."""
    from qwen_engine.runner import gdn_registry

    # (on a GPU host, compiled Triton cannot take these CPU tensors: "auto" then runs the reference too)
    for pref, expect in (("reference", ["paged_decode_attention"]),
                         ("auto", [] if INTERPRETED else ["paged_decode_attention"])):
        runner = ModelRunner(copy.deepcopy(model), model.config, "cpu", 8, 4, 2, registry=gdn_registry(pref),
                             max_model_len=32, decode_buckets=(1, 2), decode_graphs="static")
        runner.graphs.run([(5, 0, (3,), 0)])  # one decode row (position 0 of a fresh slot): the choices are made
        found = runner.capture_blockers()
        assert [f.split()[0] for f in found] == expect, (pref, found)


def test_failed_capture_falls_back_or_raises(monkeypatch):
    """decode_graphs "auto": a CaptureError at start leaves the engine serving eagerly (health says why);
    an explicit "capture" fails start() with a clear error and closes the engine."""
    import dataclasses

    from qwen_engine.decode_graphs import CaptureError

    def refuse(self):
        raise CaptureError("decode graphs cannot be captured: test")

    monkeypatch.setattr(ModelRunner, "capture_decode_graphs", refuse)

    async def main(mode):
        engine = QwenEngine(engine_config(decode_graphs="static"))
        engine.cfg = dataclasses.replace(engine.cfg, decode_graphs=mode)
        engine.runner.graphs.mode = "capture"  # as on a GPU (the CPU cannot build a capture-mode runner)
        try:
            await engine.start()
            tokens, _ = await collect(engine, prompt(0, 5), max_new_tokens=3)
            return engine, tokens
        finally:
            await engine.aclose()

    engine, tokens = asyncio.run(main("auto"))
    assert tokens == reference_greedy(engine, prompt(0, 5), 3)
    h = engine.health()["runner"]
    assert h["graph_steps"] == 0 and "test" in h["decode_graphs"]["disabled"], h
    with pytest.raises(RuntimeError, match="set decode_graphs: auto or off"):
        asyncio.run(main("capture"))


def test_decode_graph_config_errors():
    with pytest.raises(ValueError, match="decode_graphs must be"):
        engine_config(decode_graphs="yes")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        QwenEngine(engine_config(decode_graphs="capture"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_engine_cuda_graphs_equal_eager():
    """On a GPU: captured decode graphs give the same greedy tokens as the eager engine (fp32, auto kernels: the
    GDN and paged-attention Triton kernels; fp32 so that batch-shape-dependent GEMM rounding cannot flip a token)."""
    lengths = LENGTHS[:5]

    def tokens(mode, async_decode=False):
        async def body(engine):
            outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=8)
                                          for i, n in enumerate(lengths)))
            return engine.health()["runner"], [o[0] for o in outs]
        return run(engine_config(device="cuda", dtype="fp32", kernels="auto", decode_graphs=mode,
                                 async_decode=async_decode), body)

    (_, eager), (graph_stats, graphed) = tokens("off"), tokens("capture")
    assert graph_stats["decode_graphs"]["captured"] and graph_stats["graph_steps"] > 0, graph_stats
    assert graphed == eager
    async_stats, overlapped = tokens("capture", async_decode=True)  # inputs fed on the device into the graphs
    assert overlapped == eager
    assert async_stats["graph_steps"] > 0, async_stats


def test_engine_with_packed_weights_equals_single_prompt_reference(monkeypatch, caplog):
    """weights="packed": NVFP4 / FP8 layers as packed modules (the full-size default), random weights drawn in the
    ModelOpt formats; the paged engine must still give exactly the single-prompt greedy tokens of that model."""
    lengths = LENGTHS[:4]

    async def body(engine):
        return engine, await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=4)
                                              for i, n in enumerate(lengths)))

    engine, outs = run(engine_config(weights="packed"), body)
    from qwen_engine.model.quantized import NVFP4Experts, NVFP4Linear

    kinds = {type(m) for m in engine.model.modules()}
    assert NVFP4Experts in kinds and NVFP4Linear in kinds, kinds
    for i, (n, (tokens, _)) in enumerate(zip(lengths, outs)):
        assert tokens == reference_greedy(engine, prompt(i, n), 4), f"prompt {i} ({n} tokens)"
    with pytest.raises(ValueError, match="weights must be"):
        engine_config(weights="fp4")
    # expert_layout "auto" keeps the checkpoint layout off CUDA (the layouts themselves: tests/test_qwen_quantized.py)
    n_moe = sum(isinstance(m, NVFP4Experts) for m in engine.model.modules())
    assert engine.health()["expert_layouts"] == {"checkpoint": n_moe}
    with pytest.raises(ValueError, match="expert_layout must be one of"):
        engine_config(expert_layout="tiled")
    # the config's expert_layout reaches the loader (the tiny shapes do not split, so only the call shows it)
    import qwen_engine.load_packed as load_packed

    seen = []
    real = load_packed.apply_expert_layout
    monkeypatch.setattr(load_packed, "apply_expert_layout",
                        lambda experts, layout, device: seen.append(layout) or real(experts, layout, device))
    with caplog.at_level(logging.WARNING, logger="qwen_engine.engine"):
        QwenEngine(engine_config(weights="packed", expert_layout="dual"))  # the base config's kernels: reference
    assert seen and set(seen) == {"dual"}, seen
    assert "unpacks them on every call" in caplog.text
    seen.clear()  # auto with the reference kernels: the checkpoint layout (the reference would undo a repack per call)
    QwenEngine(engine_config(weights="packed", kernels="reference"))
    assert seen and set(seen) == {"checkpoint"}, seen
    seen.clear()  # "auto" on the CPU applies the references (resolve_preference): the checkpoint layout too
    assert QwenEngine(engine_config(weights="packed", kernels="auto")).kernels == "reference"
    assert seen and set(seen) == {"checkpoint"}, seen
    seen.clear()  # a preference that runs kernels: the config's "auto" layout reaches the loader
    QwenEngine(engine_config(weights="packed", kernels="triton"))
    assert seen and set(seen) == {"auto"}, seen


def test_dead_step_loop_fails_open_streams_instead_of_hanging(monkeypatch):
    """A bug that kills the step loop itself (here: the scheduler's step raising) must end every open stream with
    StepFailed at once and turn `alive` / `ready` False, not leave the streams waiting forever."""
    from engine_core.continuous import StepFailed

    async def body(engine):
        def broken_finish(plan, output):  # the model step ran; the loop's own bookkeeping then raises
            raise RuntimeError("scheduler bug")

        monkeypatch.setattr(engine.scheduler, "finish", broken_finish)
        with pytest.raises(StepFailed, match="scheduler bug"):
            await asyncio.wait_for(collect(engine, prompt(0, 5), max_new_tokens=4), timeout=10)
        await asyncio.sleep(0)
        return engine.alive, engine.ready

    alive, ready = run(engine_config(), body)
    assert not alive and not ready


def test_client_timeout_may_shorten_never_extend_the_deadline():
    """request_timeout_s is the operator's cap: a client's larger timeout_s is cut to it, a smaller one is kept."""
    seen = []

    async def body(engine):
        add = engine.scheduler.add

        def spy(request):
            seen.append(request.deadline_s - engine.scheduler.clock.now())
            return add(request)

        engine.scheduler.add = spy
        await collect(engine, prompt(0, 3), max_new_tokens=1, timeout_s=1e9)
        await collect(engine, prompt(1, 3), max_new_tokens=1, timeout_s=5.0)

    run(engine_config(request_timeout_s=60.0), body)
    assert 59.0 < seen[0] <= 60.0 and 4.0 < seen[1] <= 5.0, seen


@pytest.mark.parametrize("async_decode,graphs", [(False, "off"), (True, "off"), (True, "static")])
def test_stop_tokens_and_finish_reasons(async_decode, graphs):
    """EOS, stop sequences and single stop ids; with async_decode the step after a stop is already running (its
    token for the stopped request dropped), also through the decode graphs' static buffers."""
    ids = prompt(1, 10)

    async def body(engine):
        free, _ = await collect(engine, ids, max_new_tokens=8)
        eos, eos_chunks = await collect(engine, ids, max_new_tokens=8, eos_token_ids=[free[2]])
        seq, seq_chunks = await collect(engine, ids, max_new_tokens=8, stop_token_ids=[free[3:5]])
        one, one_chunks = await collect(engine, ids, max_new_tokens=8, stop_token_ids=[free[1]])
        return free, (eos, eos_chunks), (seq, seq_chunks), (one, one_chunks)

    stats = {}

    async def body_with_stats(engine):
        out = await body(engine)
        stats.update(ahead=engine.scheduler.stats.steps_ahead, dropped=engine.scheduler.stats.dropped_tokens)
        return out

    free, (eos, ec), (seq, sc), (one, oc) = run(engine_config(async_decode=async_decode, decode_graphs=graphs),
                                                body_with_stats)
    if async_decode:  # steps ran ahead, and the ones after a stop computed a token that was dropped
        assert stats["ahead"] > 0 and stats["dropped"] > 0, stats
    first = free.index(free[2])  # the eos id may already occur earlier in the stream
    assert eos == free[:first + 1] and ec[-1].finish_reason == "stop" and ec[-1].matched_stop == (free[2],)
    assert seq == free[:5] or seq[-2:] == free[3:5]
    assert sc[-1].finish_reason == "stop" and sc[-1].matched_stop == tuple(free[3:5])
    assert one == free[:free.index(free[1]) + 1] and oc[-1].finish_reason == "stop"
    assert len(free) == 8


def full_forward_logits(engine: QwenEngine, ids: list[int]) -> torch.Tensor:
    """The contiguous reference's next-token logits after `ids` (one prompt alone, no cache reuse) [vocab]."""
    with torch.inference_mode():
        state = engine.model.new_state(1, len(ids))
        return engine.model(torch.tensor([ids], device=engine.device), state, last_only=True)[0, -1].float()


@pytest.mark.parametrize("async_decode,graphs,device", [
    (False, "off", "cpu"), (True, "static", "cpu"),
    pytest.param(True, "capture", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="CUDA graphs need a CUDA device")),
])
def test_logprobs_match_the_contiguous_reference(async_decode, graphs, device):
    """Each streamed token's log-probabilities (SamplingParams.logprobs) equal a float64 log-softmax of the single-
    prompt reference's logits after the same tokens, within 2e-4 (fp32 paged vs contiguous logits, tests above: ~1e-5
    relative); the top list holds the n most likely ids, most likely first; rows that did not ask get none, and a
    request that asks does not change its neighbours' tokens. Greedy and sampled rows (the sampled token's own
    log-probability is reported even where it is not among the top n), n = 0, 3 and 20 in one batch, split prefill
    (40 tokens > the 16-token budget), steps formed ahead and the graph path's static buffers; on a GPU captured
    graphs, whose logits buffer the next step's replay overwrites, and the pinned copies read after their event."""
    asks = [(3, SamplingParams(logprobs=3)), (40, SamplingParams(logprobs=0)),
            (5, SamplingParams(temperature=1.5, seed=7, logprobs=20)), (9, SamplingParams()),
            (12, SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=2))]

    async def body(engine):
        return engine, await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=5, sampling=sp)
                                              for i, (n, sp) in enumerate(asks)))

    engine, outs = run(engine_config(async_decode=async_decode, decode_graphs=graphs, device=device,
                                     kernels="auto" if device == "cuda" else "reference"), body)
    if graphs == "capture":
        assert engine.health()["runner"]["graph_steps"] > 0
    for i, ((n, sp), (tokens, chunks)) in enumerate(zip(asks, outs)):
        lps = [lp for c in chunks for lp in (c.new_logprobs or ())]
        if sp.logprobs is None:
            assert all(c.new_logprobs is None for c in chunks) and tokens == reference_greedy(engine, prompt(i, n), 5)
            continue
        assert len(lps) == len(tokens) == 5, (i, lps)
        for t, (token, lp) in enumerate(zip(tokens, lps)):
            want, want_top = reference_logprobs(full_forward_logits(engine, prompt(i, n) + tokens[:t]), token,
                                                sp.logprobs)
            assert abs(lp.logprob - want) < 2e-4, (i, t, lp.logprob, want)
            # the n largest values in order, and each id's own reference value (near-ties may swap two ids)
            assert len(lp.top) == len(want_top), (i, t)
            assert all(abs(v - w) < 2e-4 for (_, v), (_, w) in zip(lp.top, want_top)), (i, t)
            logits = full_forward_logits(engine, prompt(i, n) + tokens[:t])
            assert all(abs(reference_logprobs(logits, tid, 0)[0] - v) < 2e-4 for tid, v in lp.top), (i, t)
            assert len({tid for tid, _ in lp.top}) == len(lp.top)
            if sp.greedy and want_top:
                assert token == want_top[0][0], (i, t)
        if sp.greedy:
            assert tokens == reference_greedy(engine, prompt(i, n), 5)


@pytest.mark.parametrize("async_decode,graphs,device", [
    (False, "off", "cpu"), (True, "static", "cpu"),
    pytest.param(True, "capture", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="CUDA graphs need a CUDA device")),
])
def test_prompt_logprobs_match_the_contiguous_reference(async_decode, graphs, device, monkeypatch):
    """SamplingParams.prompt_logprobs: on the first chunk, one entry per prompt token after the first, equal to a
    float64 log-softmax of the single-prompt reference's logits at the position before it, within 2e-4 (as the
    output tokens' above), the top list the n most likely; chunks of at most PROMPT_LOGPROBS_CHUNK (here 7) positions
    a step over prompts split by the 16-token budget too, several such requests in one step, beside requests that
    did not ask (whose tokens do not change) and a one-token prompt (no entries); with the prefill graphs where the
    device has them (a scored prompt never replays one: a graph keeps one position's logits)."""
    from engine_core import continuous

    monkeypatch.setattr(continuous, "PROMPT_LOGPROBS_CHUNK", 7)
    asks = [(40, SamplingParams(prompt_logprobs=3, logprobs=1)), (1, SamplingParams(prompt_logprobs=0)),
            (17, SamplingParams()), (9, SamplingParams(temperature=0.8, seed=3, prompt_logprobs=20)),
            (5, SamplingParams(prompt_logprobs=2))]

    async def body(engine):
        return engine, await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=4, sampling=sp)
                                              for i, (n, sp) in enumerate(asks)))

    engine, outs = run(engine_config(async_decode=async_decode, decode_graphs=graphs, device=device,
                                     prefill_graphs="off" if graphs == "off" else graphs,
                                     kernels="auto" if device == "cuda" else "reference"), body)
    for i, ((n, sp), (tokens, chunks)) in enumerate(zip(asks, outs)):
        assert all(c.prompt_logprobs is None for c in chunks[1:])
        got = chunks[0].prompt_logprobs
        if sp.greedy:
            assert tokens == reference_greedy(engine, prompt(i, n), 4), i
        if sp.prompt_logprobs is None:
            assert got is None
            continue
        ids = prompt(i, n)
        assert got is not None and len(got) == n - 1, (i, got)
        if n == 1:
            continue
        with torch.inference_mode():
            logits = engine.model(torch.tensor([ids], device=engine.device), engine.model.new_state(1, n))[0].float()
        for t in range(1, n):
            want, want_top = reference_logprobs(logits[t - 1], ids[t], sp.prompt_logprobs)
            lp = got[t - 1]
            assert abs(lp.logprob - want) < 2e-4, (i, t, lp.logprob, want)
            assert len(lp.top) == len(want_top), (i, t)
            assert all(abs(v - w) < 2e-4 for (_, v), (_, w) in zip(lp.top, want_top)), (i, t)
            assert all(abs(reference_logprobs(logits[t - 1], tid, 0)[0] - v) < 2e-4 for tid, v in lp.top), (i, t)
    stats = engine.health()["runner"]
    if graphs == "capture":
        assert stats["graph_steps"] > 0


@pytest.mark.parametrize("blocks,max_new,chunk", [(12, 20, 7), (13, 12, 5)])
def test_prompt_logprobs_under_preemption_match_the_reference(monkeypatch, blocks, max_new, chunk):
    """Ten scored prompts in a KV pool too small for them: preemption mid-prompt resumes the scoring where it
    stopped, so chunks start with a target that is not their first position (the runner's flat index of position
    t - 1 inside the chunk is exercised, not only position 0), and the log-softmax runs in row slices; every
    prompt's entries still equal the reference's."""
    from engine_core import continuous
    from qwen_engine import runner as runner_mod

    monkeypatch.setattr(continuous, "PROMPT_LOGPROBS_CHUNK", chunk)
    monkeypatch.setattr(runner_mod, "PROMPT_LOGPROBS_ROWS", 3)  # the log-softmax in slices of 3 rows
    offsets = []
    launch = runner_mod.ModelRunner.launch

    def counting_launch(self, plan, feed=None):
        offsets.extend(s.prompt_first - 1 - s.start for s in plan.seqs if s.prompt_targets)
        return launch(self, plan, feed)

    monkeypatch.setattr(runner_mod.ModelRunner, "launch", counting_launch)
    sp = SamplingParams(prompt_logprobs=2)

    async def body(engine):
        return engine, await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=max_new, sampling=sp)
                                              for i, n in enumerate(LENGTHS)))

    engine, outs = run(engine_config(num_kv_blocks=blocks, max_model_len=4 * blocks), body)
    assert engine.scheduler.stats.preemptions > 0 and any(offsets), offsets
    for i, (n, (tokens, chunks)) in enumerate(zip(LENGTHS, outs)):
        got, ids = chunks[0].prompt_logprobs, prompt(i, n)
        assert got is not None and len(got) == n - 1, i
        if n == 1:
            continue
        with torch.inference_mode():
            logits = engine.model(torch.tensor([ids], device=engine.device), engine.model.new_state(1, n))[0].float()
        for t in range(1, n):
            want, want_top = reference_logprobs(logits[t - 1], ids[t], 2)
            assert abs(got[t - 1].logprob - want) < 2e-4, (i, t)
            assert all(abs(v - w) < 2e-4 for (_, v), (_, w) in zip(got[t - 1].top, want_top)), (i, t)


def reference_adjusted_greedy(engine: QwenEngine, ids: list[int], n: int, sp: SamplingParams) -> list[int]:
    """Greedy decoding of the contiguous reference with the logit bias and penalties applied in float64, token by
    token."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(reference_adjusted(full_forward_logits(engine, ids + out), out, sp).argmax()))
    return out


@pytest.mark.parametrize("num_kv_blocks,async_decode,device", [
    (64, False, "cpu"), (64, True, "cpu"), (16, False, "cpu"),
    pytest.param(16, True, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                            reason="needs a CUDA device")),
])
def test_penalties_match_the_reference(num_kv_blocks, async_decode, device):
    """Presence / frequency penalties (greedy, so the tokens are exact): each request's tokens equal the contiguous
    reference's greedy decoding with the penalties applied to its own outputs so far; a batch mixing penalized and
    plain requests (the plain ones unchanged), steps formed ahead (counts advanced on the device before the next
    step samples), and 16 blocks of 4: preemption, whose resumed sequences rebuild their counts from their outputs.
    A random model's greedy stream rarely repeats within 10 tokens, so positive penalties seldom change it here;
    the negative ones do (checked)."""
    asks = [(3, SamplingParams(frequency_penalty=2.0)), (40, SamplingParams(presence_penalty=2.0)),
            (5, SamplingParams()), (17, SamplingParams(presence_penalty=-2.0, frequency_penalty=-0.5)),
            (12, SamplingParams(frequency_penalty=1.5, logprobs=1))]
    if num_kv_blocks == 16:  # every stream's counts matter (negative penalties), so a resume that lost them shows
        asks = [(n, SamplingParams(presence_penalty=-1.0 - 0.2 * i, frequency_penalty=-0.3 * i))
                for i, n in enumerate((21, 40, 25, 17, 33))]

    async def body(engine):
        return engine, await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=10, sampling=sp)
                                              for i, (n, sp) in enumerate(asks)))

    engine, outs = run(engine_config(num_kv_blocks=num_kv_blocks, max_model_len=min(96, 4 * num_kv_blocks),
                                     async_decode=async_decode, device=device,
                                     kernels="auto" if device == "cuda" else "reference"), body)
    for i, ((n, sp), (tokens, _)) in enumerate(zip(asks, outs)):
        assert tokens == reference_adjusted_greedy(engine, prompt(i, n), 10, sp), f"request {i}"
    # negative penalties favour the outputs already sampled: that stream repeats where the plain one does not
    assert outs[3][0] != reference_greedy(engine, prompt(3, asks[3][0]), 10) and len(set(outs[3][0])) < 10
    if num_kv_blocks == 16:
        assert engine.scheduler.stats.preemptions > 0
    assert (engine.scheduler.stats.steps_ahead > 0) == async_decode


@pytest.mark.parametrize("penalty", [-0.3, 0.4])
def test_penalties_count_the_tokens_of_steps_formed_ahead(penalty):
    """One request decoding 40 tokens with async decode: nearly every step is formed ahead, its input (and its
    sampled token's count) still on the device when the next is launched; a weak frequency penalty keeps the stream
    sensitive to every count, so a count lost there changes the tokens against the reference."""
    sp = SamplingParams(frequency_penalty=penalty)

    async def body(engine):
        return engine, await collect(engine, prompt(7, 8), max_new_tokens=40, sampling=sp)

    engine, (tokens, _) = run(engine_config(async_decode=True), body)
    assert engine.scheduler.stats.steps_ahead > 30
    assert tokens == reference_adjusted_greedy(engine, prompt(7, 8), 40, sp)
    assert tokens != reference_greedy(engine, prompt(7, 8), 40)  # the penalty changed the stream


@pytest.mark.parametrize("async_decode,device", [
    (False, "cpu"), (True, "cpu"),
    pytest.param(True, "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
])
def test_logit_bias_matches_the_reference(async_decode, device):
    """OpenAI's logit_bias (greedy, so the tokens are exact): -100 on a request's own plain greedy tokens bans them
    (its stream moves elsewhere and never holds them), +100 forces one, a small bias beside penalties, and a plain
    request in the same batch is unchanged; each equals the contiguous reference's greedy decoding with the bias (and
    penalties) applied in float64. A bias id outside the vocabulary is a BadRequest."""
    from qwen_engine.engine import BadRequest

    async def body(engine):
        banned = reference_greedy(engine, prompt(0, 9), 6)
        asks = [(9, SamplingParams(logit_bias={t: -100.0 for t in banned})),
                (20, SamplingParams(logit_bias={VOCAB - 1: 100.0})),
                (14, SamplingParams(logit_bias={t: 3.0 for t in range(0, VOCAB, 7)}, frequency_penalty=-0.7)),
                (6, SamplingParams())]
        outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=8, sampling=sp)
                                      for i, (n, sp) in enumerate(asks)))
        with pytest.raises(BadRequest, match="logit_bias"):
            await collect(engine, prompt(0, 3), max_new_tokens=2, sampling=SamplingParams(logit_bias={VOCAB: 1.0}))
        return engine, banned, asks, [tokens for tokens, _ in outs]

    engine, banned, asks, outs = run(engine_config(async_decode=async_decode, device=device,
                                                   kernels="auto" if device == "cuda" else "reference"), body)
    for i, ((n, sp), tokens) in enumerate(zip(asks, outs)):
        assert tokens == reference_adjusted_greedy(engine, prompt(i, n), 8, sp), f"request {i}"
    assert not set(outs[0]) & set(banned) and outs[1] == [VOCAB - 1] * 8
    assert outs[2] != reference_greedy(engine, prompt(2, 14), 8)  # the bias changed that stream
    assert outs[3] == reference_greedy(engine, prompt(3, 6), 8)


def test_logprobs_out_of_range_are_refused():
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)


def test_unseeded_requests_differ_between_processes_unless_sampling_seed_is_set():
    """A request without a seed draws one: from OS entropy by default, so two replicas (engines of one config) do
    not return the same "random" completion; from `sampling_seed` when set, reproducibly."""
    sp = SamplingParams(temperature=1.0)

    async def body(engine):
        return [(await collect(engine, prompt(2, 9), max_new_tokens=8, sampling=sp))[0] for _ in range(2)]

    a, b = run(engine_config(), body), run(engine_config(), body)
    assert a[0] != b[0] and a[1] != b[1]  # 8 draws at temperature 1 over 512 tokens: equal with negligible odds
    assert a[0] != a[1]  # and successive requests of one engine differ
    assert run(engine_config(sampling_seed=7), body) == run(engine_config(sampling_seed=7), body)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    """... and independent of the decode overlap (async_decode: the same (seed, output index) per token)."""
    sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234)

    async def body(engine):
        alone, _ = await collect(engine, prompt(2, 9), max_new_tokens=8, sampling=sp)
        crowd = await asyncio.gather(
            collect(engine, prompt(2, 9), max_new_tokens=8, sampling=sp),
            *(collect(engine, prompt(i, 5 + i), max_new_tokens=8, sampling=SamplingParams(0.8, seed=i))
              for i in range(5)))
        other, _ = await collect(engine, prompt(2, 9), max_new_tokens=8, sampling=SamplingParams(1.0, seed=99))
        return alone, crowd[0][0], other

    results = {}
    for async_decode in (False, True):
        async def with_stats(engine):
            return (*await body(engine), engine.scheduler.stats.steps_ahead)

        alone, crowded, other, ahead = run(engine_config(async_decode=async_decode), with_stats)
        assert alone == crowded
        assert alone != other  # 8 draws at temperature 1 over 512 tokens: equal with negligible probability
        assert (ahead > 0) == async_decode
        results[async_decode] = (alone, crowded, other)
    assert results[True] == results[False]


@pytest.mark.parametrize("async_decode", [False, True])
def test_cancellation_frees_blocks(async_decode):
    async def body(engine):
        got = []

        async def consume():
            async for c in engine.generate(prompt(3, 20), max_new_tokens=80):
                got.append(c)

        task = asyncio.create_task(consume())
        while len(got) < 2:
            await asyncio.sleep(0.001)
        assert engine.scheduler.blocks.num_used_blocks > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        used, unfinished = engine.scheduler.blocks.num_used_blocks, engine.scheduler.num_unfinished
        # the engine still serves after the cancellation
        tokens, _ = await collect(engine, prompt(4, 6), max_new_tokens=3)
        return used, unfinished, engine.scheduler.stats.cancelled, tokens

    async def with_stats(engine):
        return (*await body(engine), engine.scheduler.stats.steps_ahead)

    used, unfinished, cancelled, tokens, ahead = run(engine_config(async_decode=async_decode), with_stats)
    assert (used, unfinished, cancelled) == (0, 0, 1)
    assert (ahead > 0) == async_decode
    assert len(tokens) == 3


def test_overloaded_when_queue_full():
    async def body(engine):
        streams = [engine.generate(prompt(i, 4), max_new_tokens=50) for i in range(2)]
        firsts = [await anext(s) for s in streams]  # both admitted and streaming
        with pytest.raises(Overloaded) as exc:
            await anext(engine.generate(prompt(5, 4), max_new_tokens=2))
        for s in streams:
            await s.aclose()
        await asyncio.sleep(0)
        return firsts, exc.value, engine.rejected, engine.scheduler.num_unfinished

    firsts, err, rejected, unfinished = run(engine_config(max_queued=2), body)
    assert all(len(c.new_token_ids) >= 1 for c in firsts)
    assert err.retry_after_s > 0 and rejected == 1 and unfinished == 0


def test_bad_requests_and_deadline():
    async def body(engine):
        errors = {}
        for name, args, kw in [
            ("prompt_too_long", (prompt(0, 96),), dict(max_new_tokens=1)),
            ("empty_prompt", ([],), dict(max_new_tokens=1)),
            ("invalid_token_id", ([VOCAB],), dict(max_new_tokens=1)),
            ("invalid_max_new_tokens", ([1, 2],), dict(max_new_tokens=0)),
            ("invalid_timeout", ([1, 2],), dict(max_new_tokens=1, timeout_s=-1.0)),
        ]:
            with pytest.raises(BadRequest) as exc:
                await anext(engine.generate(*args, **kw))
            errors[name] = exc.value.code
        with pytest.raises(DeadlineExceeded):
            await collect(engine, prompt(1, 8), max_new_tokens=5, timeout_s=1e-9)
        return errors

    errors = run(engine_config(), body)
    assert all(k == v for k, v in errors.items()), errors


def test_shutdown_mid_request_raises_not_ready_after_the_sampled_tokens():
    """aclose() while a request streams: the tokens sampled so far arrive, then NotReady (the request did not
    finish; no finish_reason may claim it did, which a server would send as a whole answer)."""
    async def main():
        engine = QwenEngine(engine_config())
        await engine.start()
        gen = engine.generate(prompt(0, 8), max_new_tokens=80)
        chunks = [await anext(gen)]
        await engine.aclose()
        with pytest.raises(NotReady, match="shut down"):
            async for chunk in gen:
                chunks.append(chunk)
        return chunks

    chunks = asyncio.run(main())
    assert chunks and all(c.finish_reason is None for c in chunks) and chunks[-1].completion_tokens < 80


def test_not_ready_and_config_validation():
    engine = QwenEngine(engine_config())
    with pytest.raises(NotReady):
        asyncio.run(anext(engine.generate([1, 2], max_new_tokens=1)))
    with pytest.raises(ValueError, match="unknown QwenEngineConfig key"):
        QwenEngineConfig.from_dict({"config": "tiny", "max_batch": 3})
    with pytest.raises(ValueError, match="max_num_seqs must be int"):
        QwenEngineConfig.from_dict({"config": "tiny", "max_num_seqs": "8"})
    assert QwenEngineConfig.from_dict({"config": "tiny", "dtype": "fp32"}).dtype == "fp32"
    # router_align: "auto" (the default) follows router_parts; true / false as asked; anything else refused
    from qwen_engine.engine import router_align_on

    assert router_align_on(QwenEngineConfig.from_dict({"config": "tiny"}))
    assert not router_align_on(QwenEngineConfig.from_dict({"config": "tiny", "router_parts": False}))
    assert router_align_on(QwenEngineConfig.from_dict({"config": "tiny", "router_parts": False, "router_align": True}))
    assert not router_align_on(QwenEngineConfig.from_dict({"config": "tiny", "router_align": False}))
    with pytest.raises(ValueError, match="router_align must be true, false or 'auto'"):
        QwenEngineConfig.from_dict({"config": "tiny", "router_align": "on"})
    # a KV pool that cannot hold one max_model_len sequence (chat's default max_tokens would always be refused)
    with pytest.raises(ValueError, match="hold less than one max_model_len"):
        engine_config(num_kv_blocks=8, block_size=4, max_model_len=33)
    assert engine_config(num_kv_blocks=8, block_size=4, max_model_len=32).num_kv_blocks == 8
    h = engine.health()
    assert h["random_weights"] and not h["ready"] and h["kv_blocks"]["total"] == 64


def test_kernel_self_check_at_start():
    """kernel_self_check (default on): every kernel the engine may choose is checked against its reference at
    start (here through the Triton interpreter) and the outcomes show in health(); a failing kernel is disabled.
    kernels="triton": "auto" on a CPU device applies the references, whose check is skipped (no op is called here,
    so "triton" needs no kernel that takes the CPU tensors: on a GPU host the checks report the skips below)."""
    async def body(engine):
        return engine.health()

    h = run(engine_config(kernels="triton", kernel_self_check=True), body)
    checks = h["kernel_checks"]
    # on the CPU through the interpreter; on a GPU host this CPU engine's samples are CPU tensors that compiled
    # Triton cannot take (the GPU engine's checks are in benchmarks/RESULTS.md)
    want = "triton passed" if INTERPRETED else "triton skipped (does not support the sample on cpu)"
    for op in ("gdn_decode", "gdn_decode_rows", "paged_decode_attention", "gdn_decode_prep", "rms_norm_zc",
               "rms_norm_gated", "add_rms_norm_zc", "moe_combine", "router_topk", "attn_decode_prep",
               "attn_output_gate"):
        assert checks[op] == want, (op, checks)
    two = want.replace("triton", "linear+router_topk")  # the fused router's fallback, checked after it
    assert checks["router_gemv_topk"] == f"{want}; {two}", checks
    two = want.replace("triton", "gemm+triton")  # b / a inside the GDN prep, then its GEMM + plain-kernel fallback
    assert checks["gdn_decode_prep_ba"] == f"{want}; {two}", checks
    gemv = want.replace("triton", "triton_gemv")
    mma = "triton_mma skipped (does not support the sample on cpu)"  # the tensor-core decode GEMV: CUDA only
    wide = "triton_mma_wide skipped (does not support the sample on cpu); "  # lm_head-wide calls: not the sample's
    for op in ("w4a16_linear", "w4a16_swiglu"):  # the decode GEMV first, then its tensor-core form, then the GEMM
        head = wide if op == "w4a16_linear" else ""
        assert checks[op] == f"{head}{gemv}; {mma}; {want}", (op, checks)
    assert checks["w4a16_moe"] == f"{mma}; {gemv}; {want}", checks  # the MoE: the tensor-core form first
    assert checks["gdn_chunk_prefill"] == "fla skipped (does not support the sample on cpu)"  # fla: CUDA only
    # the decode MoE in one launch (off by default) is checked only by an engine that may run it
    assert "w4a16_moe_decode" not in checks, checks
    # likewise the router's top-k + alignment: router_align "auto" takes no layer of a dense model (packed experts
    # only), so neither of its ops is checked (test_engine_router_align checks them with router_align true)
    assert "router_topk_align" not in checks and "router_linear_topk_align" not in checks, checks
    fused = run(engine_config(kernels="triton", kernel_self_check=True, moe_fused_decode=True), body)["kernel_checks"]
    assert fused["w4a16_moe_decode"] == want, fused
    assert run(engine_config(kernel_self_check=False), body)["kernel_checks"] is None


def test_health_and_warmup():
    async def body(engine):
        return engine.health(), engine.ready

    h, ready = run(engine_config(warmup=True), body)
    assert ready and h["ready"] and h["warmup_s"] is not None
    assert h["queue"]["unanswered"] == 0 and h["kv_blocks"]["used"] == 0
    assert h["stats"]["steps"] == 0  # warm-up statistics are forgotten


@pytest.mark.parametrize("t,ctx", [(1, 37), (29, 29), (13, 50), (1, 1)], ids=["one-query", "causal", "chunk", "1x1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_attention_against_the_explicit_mask(t, ctx, dtype):
    """`causal_attention` (SDPA on backends without per-shape plans; a chunk continuing its sequence through the
    lower-right CausalBias, kv heads repeated) against the rule written out: query j sees keys 0..ctx - t + j,
    GQA 4:2 by repetition, softmax in fp64. Tolerance relative to max |o|: fp32 1e-5, bf16 2e-2 (inputs rounded to
    bf16 first, so the gap is the kernels' bf16 arithmetic)."""
    from qwen_engine.model.attention import causal_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(t * 100 + ctx)
    q, k, v = (torch.randn(2, n, length, 32, generator=g).to(dtype) for n, length in ((4, t), (2, ctx), (2, ctx)))
    scale = 32 ** -0.5
    out = causal_attention(q.to(device), k.to(device), v.to(device), scale).cpu()
    qd, kd, vd = q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    seen = torch.arange(ctx)[None, :] <= (ctx - t + torch.arange(t))[:, None]  # [t, ctx]
    scores = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    want = scores.softmax(-1) @ vd
    assert out.shape == want.shape and out.dtype == dtype
    err = float((out.double() - want).abs().max() / want.abs().max())
    assert err <= (1e-5 if dtype == torch.float32 else 2e-2), err


@pytest.mark.parametrize("budget,max_len,seqs", [(2048, 4096, 32), (64, 200, 4), (64, 40, 2), (64, 200, 1)])
def test_warmup_burst_makes_the_burst_shapes(budget, max_len, seqs):
    """`warmup_burst` (the GPU warm-up's optional burst) scheduled as the engine schedules it: steps holding two
    prompts' chunks, a chunk continuing its prompt (start > 0) and decode rows beside chunks -- none of which the lone
    prefill and the decode batch make; each prompt fits max_model_len with its 2 tokens; no burst without room for
    two sequences."""
    from qwen_engine.engine import warmup_burst

    cfg = QwenEngineConfig(config="tiny", max_num_batched_tokens=budget, max_model_len=max_len, max_num_seqs=seqs)
    prompts = warmup_burst(cfg, vocab=512)
    if seqs < 2:
        assert prompts == []
        return
    assert len(prompts) == min(3, seqs) and len({tuple(p) for p in prompts}) == len(prompts)
    assert all(len(p) + 2 <= max_len and max(p) < 512 for p in prompts)
    sched = ContinuousScheduler(cfg.scheduler_config(num_kv_blocks=4 * max_len // cfg.block_size))
    for p in prompts:
        sched.add(GenerateRequest(p, 2))
    plans = []
    while (plan := sched.step()) is not None:
        plans.append(plan)
        sched.finish(plan, StepOutput(tuple(1 for _ in plan.sampled)))
    chunks = [[s for s in plan.seqs if not s.is_decode] for plan in plans]
    assert any(len(c) >= 2 for c in chunks), "two prompts' chunks in one step"
    assert any(s.start > 0 for c in chunks for s in c), "a chunk continuing its prompt"
    assert any(plan.num_decode and c for plan, c in zip(plans, chunks)), "decode rows beside chunks"
    assert sched.num_unfinished == 0


def _gdn_triton_runs_here() -> bool:
    from kernels import gdn_decode

    return gdn_decode.triton is not None and (torch.cuda.is_available() or gdn_decode._interpreted())


@pytest.mark.skipif(not _gdn_triton_runs_here(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")
def test_engine_with_gdn_decode_kernel():
    """kernels="triton": the batched GDN decode step goes through kernels/gdn_decode.py (compiled on CUDA,
    interpreted on the CPU) and greedy streams still equal the single-prompt reference."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [4, 19, 7]

    async def body(engine):
        outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=4) for i, n in enumerate(lengths)))
        return engine, [o[0] for o in outs]

    engine, outs = run(engine_config(kernels="triton", device=device), body)
    for i, (n, tokens) in enumerate(zip(lengths, outs)):
        assert tokens == reference_greedy(engine, prompt(i, n), 4)
    assert engine.health()["kernels"]["gdn_decode_rows"] == "triton"


@pytest.mark.parametrize("where", ["launch_ahead", "result"])
def test_async_decode_failures(monkeypatch, where):
    """async_decode error paths: a step formed ahead that fails at launch fails its requests (StepFailed) while the
    step before it delivers its tokens; a step whose result fails fails it and the step fed from it, in order. The
    engine keeps serving."""
    from engine_core.continuous import StepFailed

    launch, result = ModelRunner.launch, ModelRunner.result
    state = {"armed": True}

    def failing_launch(self, plan, feed=None):
        if where == "launch_ahead" and plan.feed_from is not None and state["armed"]:
            state["armed"] = False
            raise RuntimeError("launch failed")
        return launch(self, plan, feed)

    def failing_result(self, pending):
        if where == "result" and state["armed"] and self.steps >= 3:  # after the prefill and a decode step or two
            state["armed"] = False
            raise RuntimeError("result failed")
        return result(self, pending)

    monkeypatch.setattr(ModelRunner, "launch", failing_launch)
    monkeypatch.setattr(ModelRunner, "result", failing_result)

    async def body(engine):
        got = []
        with pytest.raises(StepFailed):
            async for c in engine.generate(prompt(5, 6), max_new_tokens=12):
                got.extend(c.new_token_ids)
        again, _ = await collect(engine, prompt(6, 6), max_new_tokens=4)
        return got, again, engine.scheduler.stats

    got, again, stats = run(engine_config(async_decode=True), body)
    assert not state["armed"] and stats.failed == 1 and stats.failed_steps >= 1
    assert 1 <= len(got) < 12  # the tokens before the failure arrived
    assert len(again) == 4  # still serving


def test_engine_fused_decode_projections(monkeypatch):
    """Packed weights, the decode steps' fused paths as on a GPU: every attention layer's q/k/v and every GDN layer's
    in_proj_qkv/z run as one FP8 call (`quantized.fused_fp8_projections`) in decode steps of <= 4 rows, and the
    greedy streams equal those of the same engine with the switch off (fp32: the registry's references, which
    give each projection's columns bit for bit: tests/test_qwen_quantized.py). On the CPU the registry runs the
    reference for every FP8 call, so "reference" counts as one of `quantized.FUSED_IMPLS` here."""
    from qwen_engine.model import quantized
    from qwen_engine.model.attention import GatedAttention

    monkeypatch.setattr(GatedAttention, "fused", True)
    monkeypatch.setattr(quantized, "FUSED_IMPLS", ("reference", *quantized.FUSED_IMPLS))
    used = []
    real = quantized.fused_fp8_projections

    def spy(owner, names, x):
        out = real(owner, names, x)
        used.append((names[0], out is not None))
        return out

    monkeypatch.setattr(quantized, "fused_fp8_projections", spy)  # what `project_together` calls
    lengths = LENGTHS[:4]

    async def body(engine):
        used.clear()
        outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=5) for i, n in enumerate(lengths)))
        return [o[0] for o in outs], set(used)

    (on, used_on) = run(engine_config(weights="packed"), body)
    monkeypatch.setattr(quantized, "FUSE_DECODE_PROJECTIONS", False)
    (off, used_off) = run(engine_config(weights="packed"), body)
    assert used_on == {("q_proj", True), ("in_proj_qkv", True)}, used_on
    assert used_off == {("q_proj", False), ("in_proj_qkv", False)}, used_off
    assert on == off


def test_engine_shared_expert_in_moe(monkeypatch):
    """shared_expert_in_moe (packed weights, the MoE's fused path as on a GPU): every layer runs its shared expert
    inside the routed experts' launches and the greedy streams equal the dense-shared-expert engine's (fp32
    activations: the registry's references; the kernels' own check is tests/test_qwen_quantized.py)."""
    from qwen_engine.model.moe import SparseMoE
    from qwen_engine.model.quantized import NVFP4SwiGLU

    monkeypatch.setattr(SparseMoE, "fused", True)
    dense_calls = []
    dense_forward = NVFP4SwiGLU.forward
    monkeypatch.setattr(NVFP4SwiGLU, "forward", lambda self, x: (dense_calls.append(1), dense_forward(self, x))[1])
    lengths = LENGTHS[:4]

    async def body(engine):
        dense_calls.clear()
        outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=4) for i, n in enumerate(lengths)))
        return engine.health(), [o[0] for o in outs], len(dense_calls)

    (h_on, on, dense_on), (h_off, off, dense_off) = (
        run(engine_config(weights="packed", shared_expert_in_moe=flag), body) for flag in (True, False))
    assert h_on["shared_expert_in_moe_layers"] == QwenConfig.tiny().num_hidden_layers
    assert h_off["shared_expert_in_moe_layers"] == 0
    assert dense_on == 0 and dense_off > 0  # steps of <= 16 tokens: every shared expert call inside the experts
    assert on == off


def test_engine_router_align(monkeypatch, caplog):
    """router_align (packed weights, the MoE's fused path as on a GPU): the MoE calls of more than MAX_ROWS tokens
    (here the prefill chunks) take their weights, ids and routing alignment from registry op
    "router_linear_topk_align" (router_parts, the default; "router_topk_align" after F.linear without it),
    and the greedy streams equal the engine's without it (the registry's references here: this checks the wiring;
    the kernel's own checks are tests/test_kernel_router_align.py and tests/test_qwen_quantized.py). With it on, the
    start-up self-check covers the op; a dense model takes no layer."""
    from engine_core.registry import default_registry
    from qwen_engine.model.moe import SparseMoE, TopKRouter

    monkeypatch.setattr(SparseMoE, "fused", True)
    monkeypatch.setattr(TopKRouter, "fused", True)  # the router's fused ops, as on a GPU
    lengths = LENGTHS[:4]

    def calls() -> int:  # router_parts (the default) routes through the second, F.linear through the first
        c = default_registry().choices()
        return sum(sum(c[op]["calls"].values()) for op in ("router_topk_align", "router_linear_topk_align"))

    from kernels import w4a16_gemm

    async def body(engine):
        before, rebuilt = calls(), w4a16_gemm.ROUTING_REBUILT[0]
        outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=4) for i, n in enumerate(lengths)))
        assert w4a16_gemm.ROUTING_REBUILT[0] == rebuilt  # every routing the router built fit its experts call
        return engine.health(), [o[0] for o in outs], calls() - before

    # kernels "auto" as on a GPU (auto_as_on_a_gpu): the Triton kernels (interpreted on the CPU) where they take the
    # call, so the experts' grouped kernel reads the router's alignment (with the references, the experts' reference
    # ignores it and only the wiring would be checked); the fold from any pair count (the tiny config's batches have
    # fewer than PARTS_MIN_PAIRS: tests/test_qwen_quantized.py checks the threshold)
    auto_as_on_a_gpu(monkeypatch)
    from kernels import router_align as ra

    monkeypatch.setattr(ra, "PARTS_MIN_PAIRS", 1)
    # every launch of the kernel: (rows, over the router GEMM's partials?)
    launches, launch = [], ra._align_launch
    monkeypatch.setattr(ra, "_align_launch", lambda src, n, *a, **kw: (launches.append((n, "parts" in kw and
                                                                                        kw["parts"] is not None)),
                                                                       launch(src, n, *a, **kw))[1])
    # bf16: the router GEMM in Triton takes 16-bit inputs only, so in fp32 every call would take the F.linear fallback
    (h_on, on, calls_on), (h_off, off, calls_off) = (
        run(engine_config(weights="packed", kernels="auto", router_align=flag, shared_expert_in_moe=True,
                          dtype="bf16"), body)
        for flag in (True, False))
    assert h_on["router_align_layers"] == QwenConfig.tiny().num_hidden_layers and h_off["router_align_layers"] == 0
    assert calls_on > 0 and calls_off == 0
    assert on == off
    assert launches and all(parts for _, parts in launches), launches  # router_parts (default): over the partials
    # decode-only batches above MAX_ROWS (5 short prompts, then 5 streams decoding, padded to the graphs' bucket of 8
    # with the scratch row: "static" runs the CUDA-graph path's static buffers eagerly) take the aligned routing too
    launches.clear()

    async def decoding(engine):
        outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=6)
                                      for i, n in enumerate([3, 1, 8, 5, 12])))
        return [o[0] for o in outs]

    on, off = (run(engine_config(weights="packed", kernels="auto", router_align=flag, shared_expert_in_moe=True,
                                 max_num_seqs=8, decode_graphs="static", dtype="bf16"), decoding)
               for flag in (True, False))
    assert (8, True) in launches and on == off  # the padded decode batch went through the router's alignment
    h_dense = run(engine_config(router_align=True), lambda engine: asyncio.sleep(0, engine.health()))
    assert h_dense["router_align_layers"] == 0
    # "auto" (the default): every packed layer with router_parts, none without; a dense model quietly none
    health = lambda engine: asyncio.sleep(0, engine.health())  # noqa: E731
    layers = QwenConfig.tiny().num_hidden_layers
    assert run(engine_config(weights="packed"), health)["router_align_layers"] == layers
    assert run(engine_config(weights="packed", router_parts=False), health)["router_align_layers"] == 0
    assert "router_align: no MoE layer holds packed experts" in caplog.text  # the explicit true above, dense
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qwen_engine.engine"):
        assert run(engine_config(), health)["router_align_layers"] == 0
    assert "router_align" not in caplog.text
    checks = run(engine_config(kernels="triton", kernel_self_check=True, router_align=True),
                 lambda engine: asyncio.sleep(0, engine.health()))["kernel_checks"]
    want = ("triton passed; router_topk+moe_align passed" if INTERPRETED else
            "triton skipped (does not support the sample on cpu); router_topk+moe_align skipped (does not support "
            "the sample on cpu)")
    assert checks["router_topk_align"] == want, checks
    assert checks["router_linear_topk_align"] == want.replace("router_topk+moe_align", "linear+router_topk_align")


def test_engine_router_align_gather(monkeypatch):
    """router_align_gather sets kernels/router_align.py GATHER process-wide for the engine it builds (the last
    program's register gathers; off by default until timed), and the greedy streams through the aligned routing (the
    Triton kernel, interpreted, as on a GPU) equal the engine's without it; a non-bool is refused."""
    from kernels import router_align as ra
    from qwen_engine.model.moe import SparseMoE, TopKRouter

    with pytest.raises(ValueError, match="router_align_gather must be bool"):
        QwenEngineConfig(router_align_gather=1)
    assert QwenEngineConfig().router_align_gather is False
    monkeypatch.setattr(SparseMoE, "fused", True)
    monkeypatch.setattr(TopKRouter, "fused", True)
    auto_as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(ra, "PARTS_MIN_PAIRS", 1)
    monkeypatch.setattr(ra, "GATHER", ra.GATHER)  # restored after the test
    seen = []
    launch = ra._align_launch
    monkeypatch.setattr(ra, "_align_launch", lambda *a, **kw: (seen.append(ra.GATHER), launch(*a, **kw))[1])

    async def body(engine):
        outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=3)
                                      for i, n in enumerate(LENGTHS[:2])))
        return [o[0] for o in outs]

    on, off = (run(engine_config(weights="packed", kernels="auto", router_align=True, router_align_gather=flag,
                                 shared_expert_in_moe=True, dtype="bf16"), body) for flag in (True, False))
    assert True in seen and False in seen and on == off


def one_by_one_counting(op: str):
    """An engine body for `run`: two prompts (LENGTHS[:2]), one after the other (so their decode steps have one
    row), 4 greedy tokens each -> (health, the token streams, how many calls registry op `op` took meanwhile)."""
    from engine_core.registry import default_registry

    def calls() -> int:
        return sum(default_registry().choices()[op]["calls"].values())

    async def body(engine):
        before = calls()
        outs = [await collect(engine, prompt(i, n), max_new_tokens=4) for i, n in enumerate(LENGTHS[:2])]
        return engine.health(), [o[0] for o in outs], calls() - before

    return body


def test_engine_moe_fused_decode(monkeypatch):
    """moe_fused_decode (packed weights, the MoE's fused path as on a GPU): one-row MoE calls (a lone request's decode
    steps) run the routed and shared experts through the registry op "w4a16_moe_decode" and moe_combine over its
    partial rows, larger ones the unfused path; the greedy streams equal the engine's without it (fp32 activations:
    the registry's references, so this checks the wiring and the combine over partial rows; the kernel's own check
    is tests/test_kernel_moe_decode.py). The requests run one after the other, so their decode steps have one row."""
    from qwen_engine.model.moe import SparseMoE

    monkeypatch.setattr(SparseMoE, "fused", True)
    body = one_by_one_counting("w4a16_moe_decode")
    (h_on, on, calls_on), (h_off, off, calls_off) = (
        run(engine_config(weights="packed", moe_fused_decode=flag), body) for flag in (True, False))
    assert h_on["moe_fused_decode_layers"] == QwenConfig.tiny().num_hidden_layers
    assert h_off["moe_fused_decode_layers"] == 0
    assert calls_on > 0 and calls_off == 0
    assert on == off


def test_engine_lm_head_layout():
    """lm_head_layout (packed weights): split_frag stores lm_head in fragment order and computes it through registry
    op "w4a16_linear_frag" (here its reference: fp32 on the CPU), with the same greedy streams as the checkpoint
    layout; auto on the CPU keeps the checkpoint's, as does the default; dequantized weights report "dense"; a bad
    value is refused."""
    body = one_by_one_counting("w4a16_linear_frag")
    (h_frag, frag, calls_frag), (h_auto, auto, calls_auto) = (
        run(engine_config(weights="packed", lm_head_layout=layout), body) for layout in ("split_frag", "auto"))
    assert h_frag["lm_head_layout"] == "split_frag" and h_auto["lm_head_layout"] == "checkpoint"
    assert calls_frag > 0 and calls_auto == 0
    assert frag == auto
    h_dense, _, _ = run(engine_config(lm_head_layout="split_frag"), body)
    assert h_dense["lm_head_layout"] == "dense"
    h_dual, dual, calls_dual = run(engine_config(weights="packed", lm_head_layout="dual_frag"), body)
    assert h_dual["lm_head_layout"] == "dual_frag" and dual == auto
    assert calls_dual == 0  # one stream at a time: <= 4 rows, the checkpoint copy's op (w4a16_linear)
    assert QwenEngineConfig().lm_head_layout == "auto"
    with pytest.raises(ValueError, match="lm_head_layout must be one of"):
        engine_config(lm_head_layout="tiles")


def test_resolve_lm_head_layout_auto_by_device(monkeypatch):
    """auto: dual_frag on Hopper (measured there: dual_copy run 1) unless the kernels are the references, the
    checkpoint's on other GPUs and on the CPU; a named layout as given."""
    from qwen_engine.engine import resolve_lm_head_layout

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for capability, kernels, want in (((9, 0), "auto", "dual_frag"), ((9, 0), "reference", "checkpoint"),
                                      ((10, 0), "auto", "checkpoint"), ((8, 0), "auto", "checkpoint")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert resolve_lm_head_layout(QwenEngineConfig(kernels=kernels), cuda) == want, (capability, kernels)
        assert resolve_lm_head_layout(QwenEngineConfig(kernels=kernels, lm_head_layout="split_frag"),
                                      cuda) == "split_frag"
    assert resolve_lm_head_layout(QwenEngineConfig(), cpu) == "checkpoint"
    # the engine passes its resolved preference (QwenEngine.kernels), which decides over cfg.kernels
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_lm_head_layout(QwenEngineConfig(kernels="auto"), cuda, "reference") == "checkpoint"
    assert resolve_lm_head_layout(QwenEngineConfig(kernels="auto"), cuda, "triton") == "dual_frag"


def test_kernels_auto_applies_the_references_on_cpu(monkeypatch):
    """QwenEngineConfig.kernels "auto" on a CPU device applies "reference" (engine_core.registry.resolve_preference,
    sammie.segmenter.resolve_kernels' rule): Triton runs there only through its interpreter, ~100x slower, which
    TRITON_INTERPRET=1 (tests/conftest.py on a CPU host) makes importable but must not make chosen. An explicit
    "triton" is kept (the tests that run the interpreted kernels), and on a CUDA device "auto" stays "auto"."""
    from engine_core.registry import KernelPreference, default_registry, resolve_preference
    from qwen_engine.engine import MODEL_OPS

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the rule does not read it (set here for hosts with a GPU)
    reg = default_registry()
    model_ops = [op for op in MODEL_OPS if op in reg.ops()]
    assert model_ops
    # (the process-wide preferences these engines set are put back after the test: tests/conftest.py
    # process_registry_preferences)
    # explicit "triton": kept, in the engine's own registry and the process-wide one (no op is called here, so
    # this holds on a GPU host too, whose compiled kernels would refuse the CPU tensors)
    engine = QwenEngine(engine_config(kernels="triton"))
    assert engine.kernels == "triton" and engine.health()["kernel_preference"] == "triton"
    assert {v["preference"] for v in engine.registry.choices().values()} == {"triton"}
    assert {reg.preference(op) for op in model_ops} == {KernelPreference.TRITON}
    asyncio.run(engine.aclose())

    async def body(engine):
        tokens, _ = await collect(engine, prompt(0, 7), max_new_tokens=3)
        return engine, tokens

    engine, tokens = run(engine_config(kernels="auto"), body)  # QwenEngineConfig's default
    assert QwenEngineConfig().kernels == "auto" and len(tokens) == 3
    assert engine.kernels == "reference" and engine.health()["kernel_preference"] == "reference"
    assert {v["preference"] for v in engine.registry.choices().values()} == {"reference"}
    assert {reg.preference(op) for op in model_ops} == {KernelPreference.REFERENCE}
    ran = engine.health()["kernels"]  # the runner's ops this engine called: the references only
    assert ran and set(ran.values()) == {"reference"}, ran
    assert tokens == reference_greedy(engine, prompt(0, 7), 3)

    # the rule itself: a pure function of the preference and the device's type (no GPU needed)
    auto, ref, triton = KernelPreference.AUTO, KernelPreference.REFERENCE, KernelPreference.TRITON
    for device in ("cpu", torch.device("cpu")):
        assert resolve_preference("auto", device) is ref
        assert resolve_preference(auto, device) is ref
        assert resolve_preference("triton", device) is triton
        assert resolve_preference("reference", device) is ref
        assert resolve_preference("torch", device) is KernelPreference.TORCH
    for device in ("cuda", "cuda:1", torch.device("cuda"), torch.device("cuda", 0), "meta"):
        assert resolve_preference("auto", device) is auto, device
        assert resolve_preference("triton", device) is triton, device
        assert resolve_preference("reference", device) is ref, device
    with pytest.raises(ValueError, match="unknown kernel preference"):
        resolve_preference("fast", "cpu")
