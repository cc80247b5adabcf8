"""The shared expert on a second stream (`SparseMoE.shared_stream`, the engine's `shared_expert_stream`): the MoE layer's
fused path with the dense shared expert forked onto `moe.side_stream` and joined before moe_combine.

Tolerance: none -- the same kernels on the same inputs, so the output is compared bit for bit with the one-stream path,
eagerly and replayed from a CUDA graph (where the fork is a parallel branch). The stream path needs CUDA; on the CPU
the flag must leave the one-stream path in charge (and the setter / config are checked).
"""

import pytest
import torch

from engine_core.registry import Registry
from kernels import fp8_linear, nvfp4, w4a16_gemm
from qwen_engine.config import QwenConfig
from qwen_engine.engine import QwenEngineConfig, set_shared_expert_stream
from qwen_engine.load_packed import load_quantized
from qwen_engine.model import moe as moe_mod
from qwen_engine.random_weights import random_packed_tensors

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
    assert QwenEngineConfig().shared_expert_stream is False  # off until measured in the engine
    with pytest.raises((TypeError, ValueError)):
        QwenEngineConfig(shared_expert_stream="yes")
    assert set_shared_expert_stream(model, True) == CFG.num_hidden_layers
    assert all(layer.mlp.shared_stream for layer in model.layers)
    assert set_shared_expert_stream(model, False) == 0
    assert not any(layer.mlp.shared_stream for layer in model.layers)


@torch.no_grad()
def test_cpu_keeps_one_stream(monkeypatch):
    """On the CPU the flag changes nothing: no side stream is asked for, the output is the one-stream path's."""
    model = packed_model("cpu")
    moe = model.layers[0].mlp
    monkeypatch.setattr(moe_mod, "side_stream", lambda device: pytest.fail("side stream asked for on the CPU"))
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
    kernel's): the side-stream path equals the one-stream path bit for bit, eagerly and replayed from a captured graph
    with new inputs copied in; the side stream is used on every call with the flag and on none without."""
    model = packed_model("cuda")
    moe = model.layers[0].mlp
    asked = []
    real = moe_mod.side_stream
    monkeypatch.setattr(moe_mod, "side_stream", lambda device: asked.append(device) or real(device))
    g = torch.Generator().manual_seed(2)
    try:
        moe.fused = True
        for n in (1, 4, 5):
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
        moe.fused, moe.shared_stream = None, False
