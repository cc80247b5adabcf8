"""Work forked onto the decode step's second stream (`qwen_engine/model/streams.py`): the MoE layer's dense shared
expert (`SparseMoE.shared_stream`, the engine's `shared_expert_stream`) and the GDN layers' in_proj_z
(`GatedDeltaNet.z_stream`, `gdn_z_stream`).

Tolerances: the shared expert's fork runs the same kernels on the same inputs, so its output is compared bit for bit
with the one-stream path, eagerly and replayed from a CUDA graph (where the fork is a parallel branch). The z fork
runs in_proj_qkv and in_proj_z as two calls instead of one fused GEMV (the same codes and products, fp32 sums
perhaps tiled differently): held to the same greedy tokens at fp32 through the engine. On the CPU the flags must
leave the one-stream paths in charge; with `streams.forkable` / `fork` / `join` stubbed the forked code paths run
there too (`torch.cuda.stream(None)` is a no-op), so their wiring is checked in CI.
"""

import pytest
import torch

from engine_core.registry import Registry
from kernels import fp8_linear, nvfp4, w4a16_gemm
from qwen_engine.config import QwenConfig
from qwen_engine.engine import (
    QwenEngineConfig,
    set_gdn_z_stream,
    set_shared_expert_after_router,
    set_shared_expert_stream,
)
from qwen_engine.load_packed import load_quantized
from qwen_engine.model import streams
from qwen_engine.model.moe import SparseMoE
from qwen_engine.random_weights import random_packed_tensors
from tests.test_qwen_engine import collect, engine_config, prompt, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

CFG = QwenConfig.tiny()


def packed_model(device: str):
    reg = Registry("auto")
    for mod in (w4a16_gemm, fp8_linear, nvfp4):
        mod.register(reg)
    return load_quantized(random_packed_tensors(CFG, "cpu", seed=0), CFG, device, torch.bfloat16,
                          quantize_activations=False, registry=reg)


def test_setter_and_config():
    model = packed_model("cpu")
    assert QwenEngineConfig().shared_expert_stream is True  # measured: H200 Qwen run 48
    assert QwenEngineConfig().gdn_z_stream is False
    assert QwenEngineConfig().shared_expert_after_router is True  # H200 Qwen run 51
    for name in ("shared_expert_stream", "gdn_z_stream"):
        with pytest.raises((TypeError, ValueError)):
            QwenEngineConfig(**{name: "yes"})
    assert set_shared_expert_stream(model, True) == CFG.num_hidden_layers
    assert all(layer.mlp.shared_stream for layer in model.layers)
    assert set_shared_expert_stream(model, False) == 0
    assert not any(layer.mlp.shared_stream for layer in model.layers)
    gdn = [layer.linear_attn for layer in model.layers if hasattr(layer, "linear_attn")]
    assert gdn and set_gdn_z_stream(model, True) == len(gdn) and all(m.z_stream for m in gdn)
    assert set_gdn_z_stream(model, False) == 0 and not any(m.z_stream for m in gdn)


@torch.no_grad()
def test_cpu_keeps_one_stream(monkeypatch):
    """On the CPU the flag changes nothing: no side stream is asked for, the output is the one-stream path's."""
    model = packed_model("cpu")
    moe = model.layers[0].mlp
    monkeypatch.setattr(streams, "side_stream", lambda device: pytest.fail("side stream asked for on the CPU"))
    x = torch.randn(2, CFG.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    try:
        moe.fused = True
        plain = moe(x, residual=torch.zeros_like(x))
        moe.shared_stream = True
        assert torch.equal(moe(x, residual=torch.zeros_like(x)), plain)
    finally:
        moe.fused, moe.shared_stream = None, False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the second stream is a CUDA stream")
@torch.no_grad()
def test_side_stream_same_bits_eager_and_graphed(monkeypatch):
    """1 and 4 tokens (the decode GEMV's calls, which keep the dense shared expert) and 5 tokens (the grouped
    kernel's), the fork at the input and after the router: the side-stream path equals the one-stream path bit for
    bit, eagerly and replayed from a captured graph with new inputs copied in; the side stream is used on every call
    with the flag and on none without."""
    model = packed_model("cuda")
    moe = model.layers[0].mlp
    asked = []
    real = streams.fork
    monkeypatch.setattr(streams, "fork", lambda device: asked.append(device) or real(device))
    g = torch.Generator().manual_seed(2)
    try:
        moe.fused = True
        for n, after in ((1, False), (4, False), (5, False), (1, True), (4, True)):
            moe.shared_after_router = after  # the fork at the input, or after the router (the engine's default)
            xs = [torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16).cuda() for _ in range(2)]
            res = [torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16).cuda() for _ in range(2)]
            moe.shared_stream = False
            plain = [moe(x, residual=r) for x, r in zip(xs, res)]
            assert not asked
            moe.shared_stream = True
            eager = [moe(x, residual=r) for x, r in zip(xs, res)]
            assert len(asked) == 2, (n, asked)
            for a, b in zip(eager, plain):
                assert torch.equal(a, b), n
            x_in, r_in = xs[0].clone(), res[0].clone()
            moe(x_in, residual=r_in)  # warm on this stream before the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = moe(x_in, residual=r_in)
            for x, r, want in zip(xs[::-1], res[::-1], plain[::-1]):
                x_in.copy_(x)
                r_in.copy_(r)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, want), n
            asked.clear()
    finally:
        moe.fused, moe.shared_stream, moe.shared_after_router = None, False, False


@torch.no_grad()
def test_moe_fork_same_bits_and_on_the_side_on_the_cpu(monkeypatch):
    """The MoE window stubbed on the CPU: the output bit-equal to the one-stream path at 1, 4 and 5 tokens, the shared
    expert issued under the side stream's context (with the side stream's split-K counters), the window joined once;
    an exception inside the window still joins it (a failed capture then reports its own error)."""
    from kernels import split_k

    model = packed_model("cpu")
    moe = model.layers[0].mlp
    side, seen = object(), []
    monkeypatch.setattr(streams, "forkable", lambda x: True)
    monkeypatch.setattr(streams, "fork", lambda device: ("main", side))
    monkeypatch.setattr(streams, "join", lambda main, s: seen.append("join"))
    real_stream = torch.cuda.stream
    monkeypatch.setattr(torch.cuda, "stream", lambda s: seen.append(s is side) or real_stream(None))
    real_shared = type(moe.shared_expert).forward
    monkeypatch.setattr(type(moe.shared_expert), "forward", lambda self, x: seen.append(
        getattr(split_k._ROLE, "name", "")) or real_shared(self, x))
    g = torch.Generator().manual_seed(3)
    try:
        moe.fused = True
        for n in (1, 4, 5):
            x = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16)
            r = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16)
            moe.shared_stream = False
            plain = moe(x, residual=r)
            moe.shared_stream = True
            seen.clear()
            assert torch.equal(moe(x, residual=r), plain), n
            assert seen == [True, "side", "join"], seen
        seen.clear()
        monkeypatch.setattr(type(moe.gate), "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            moe(x, residual=r)
        assert seen[-1] == "join", seen
    finally:
        moe.fused, moe.shared_stream = None, False


@torch.no_grad()
def test_fork_after_the_router_on_the_cpu(monkeypatch):
    """`shared_after_router` (the engine's `shared_expert_after_router`), the window stubbed on the CPU: the router runs
    before the fork instead of inside it, the output bit-equal to the one-stream path and to the fork at the input;
    the setter reaches every MoE layer."""
    model = packed_model("cpu")
    moe = model.layers[0].mlp
    order = []
    monkeypatch.setattr(streams, "forkable", lambda x: True)
    monkeypatch.setattr(streams, "fork", lambda device: order.append("fork") or ("main", None))
    monkeypatch.setattr(streams, "join", lambda main, side: order.append("join"))
    real_gate = type(moe.gate).forward
    monkeypatch.setattr(type(moe.gate), "forward",
                        lambda self, *a, **k: order.append("router") or real_gate(self, *a, **k))
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, CFG.hidden_size, generator=g).to(torch.bfloat16)
    r = torch.randn(2, CFG.hidden_size, generator=g).to(torch.bfloat16)
    try:
        moe.fused = True
        plain = moe(x, residual=r)
        moe.shared_stream = True
        order.clear()
        at_input = moe(x, residual=r)
        assert order == ["fork", "router", "join"], order
        assert set_shared_expert_after_router(model, True) == CFG.num_hidden_layers
        order.clear()
        after = moe(x, residual=r)
        assert order == ["router", "fork", "join"], order
        assert torch.equal(at_input, plain) and torch.equal(after, plain)
    finally:
        moe.fused, moe.shared_stream = None, False
        set_shared_expert_after_router(model, False)


def test_split_k_counters_per_role():
    """Launches on the side stream get arrival counters of their own (kernels/split_k.py `counters_of`): two
    overlapping split-K launches on the two streams never count into one counter."""
    from kernels import split_k

    dev = torch.device("cpu")
    main = split_k.split_counters(dev, 4)
    with split_k.counters_of("side"):
        side = split_k.split_counters(dev, 4)
    assert main is not None and side is not None and main.data_ptr() != side.data_ptr()
    assert split_k.split_counters(dev, 4) is main  # the role is restored on leaving


def one_by_one(cfg: QwenEngineConfig, lengths=(3, 9, 1, 6)) -> tuple[dict, list[list[int]]]:
    """(health, greedy tokens) of prompts run one after the other (decode steps of one row: the paths the flags
    fork), 5 tokens each, through test_qwen_engine's `run` / `collect`."""
    async def body(engine):
        outs = [(await collect(engine, prompt(i, n), max_new_tokens=5))[0] for i, n in enumerate(lengths)]
        return engine.health(), outs
    return run(cfg, body)


def test_forked_paths_on_the_cpu(monkeypatch):
    """Both forks stubbed to run on the CPU's one stream: the engine's greedy tokens equal the engine's with both
    flags off, and every MoE layer's and GDN layer's fork ran on the one-row decode steps."""
    monkeypatch.setattr(SparseMoE, "fused", True)  # the MoE's fused path, as on a GPU
    forks = []
    monkeypatch.setattr(streams, "forkable", lambda x: True)
    monkeypatch.setattr(streams, "fork", lambda device: forks.append(device) or (None, None))
    monkeypatch.setattr(streams, "join", lambda main, side: None)
    h_off, off = one_by_one(engine_config(weights="packed", shared_expert_stream=False, gdn_z_stream=False))
    assert not forks and h_off["shared_expert_stream_layers"] == 0 and h_off["gdn_z_stream_layers"] == 0
    h_on, on = one_by_one(engine_config(weights="packed", shared_expert_stream=True, gdn_z_stream=True))
    assert h_on["shared_expert_stream_layers"] == CFG.num_hidden_layers and h_on["gdn_z_stream_layers"] > 0
    decode_steps = 4 * 4  # 4 prompts x 4 decode steps after the first token
    assert len(forks) >= decode_steps * (CFG.num_hidden_layers + h_on["gdn_z_stream_layers"]), len(forks)
    assert on == off


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the second stream is a CUDA stream")
def test_engine_forks_on_cuda_same_tokens(one_autotune_config):
    """On a GPU: bf16 with the decode graphs captured (fp32 cannot be: its packed MoE runs the reference), the engine
    with the shared expert's fork gives the greedy tokens of the engine without it (the same bits); fp32 and eager,
    GDN's z fork those of the engine without it (fp32, so that a GEMV's other summation tiling cannot flip a token)."""
    graphed = dict(device="cuda", dtype="bf16", kernels="auto", decode_graphs="capture", autotune_table="off")
    _, off = one_by_one(engine_config(weights="packed", shared_expert_stream=False, **graphed))
    health, on = one_by_one(engine_config(weights="packed", shared_expert_stream=True, **graphed))
    assert health["runner"]["graph_steps"] > 0, health["runner"]
    assert health["shared_expert_stream_layers"] == CFG.num_hidden_layers
    assert on == off
    eager = dict(device="cuda", kernels="auto", decode_graphs="off", autotune_table="off")  # fp32: engine_config's
    _, off = one_by_one(engine_config(weights="packed", shared_expert_stream=False, gdn_z_stream=False, **eager))
    health, on = one_by_one(engine_config(weights="packed", shared_expert_stream=False, gdn_z_stream=True, **eager))
    assert health["gdn_z_stream_layers"] > 0
    assert on == off
