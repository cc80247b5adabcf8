"""The L2 warm-up on a detached stream: `kernels/l2_warm.py` (the kernel) and `qwen_engine/model/warm_ahead.py` (the
engine's `weight_warm_ahead`).

The kernel computes nothing the model uses, so its test is that it read every word: each program's xor of its words
equals the reference's, bit for bit (xor is order-free), under the interpreter here and compiled on a GPU. The
engine's test is that the warm-ups change no token and warm what they should: with the warm stream's fork stubbed on
the CPU (`torch.cuda.stream(None)` is a no-op), every one-row decode step warms layers 1..L-1's weights outside the
routed experts, once per storage, in layer order, and the greedy tokens equal the engine's without them.
"""

import pytest
import torch

from kernels import l2_warm
from qwen_engine.config import QwenConfig
from qwen_engine.engine import QwenEngineConfig, set_weight_warm_ahead
from qwen_engine.model import streams, warm_ahead
from qwen_engine.model.causal_lm import QwenForCausalLM
from tests.test_qwen_engine import collect, engine_config, prompt, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

CFG = QwenConfig.tiny()
STEP = l2_warm.WORDS_PER_STEP


@pytest.mark.parametrize("n", [1, STEP - 1, STEP, STEP + 1, 3 * STEP * 4 + 17])
@pytest.mark.parametrize("programs", [1, 3, 4])
@pytest.mark.parametrize("mode", ["load", "load_last"])
def test_kernel_reads_every_word(n, programs, mode):
    words = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    out = torch.full((programs,), 7, dtype=torch.int32)
    l2_warm.warm(words, mode, programs, out)
    want = l2_warm.reference(words, programs)
    assert torch.equal(out, want)
    words[n // 2] ^= 1 << 5  # one flipped bit changes one program's xor: the reference is not blind
    assert not torch.equal(l2_warm.reference(words, programs), want)


def test_words_of_a_view_is_its_whole_storage():
    base = torch.arange(10, dtype=torch.uint8)  # 10 bytes: 2 whole words, the 2-byte tail left to its line
    view = base[4:6]
    assert torch.equal(l2_warm.words_of(view), base[:8].view(torch.int32))
    assert l2_warm.words_of(torch.zeros(0)).numel() == 0
    with pytest.raises(ValueError, match="mode"):
        l2_warm.warm(base, "bulk")


def test_layer_weights_skip_routed_experts_and_repeat_no_storage():
    model = QwenForCausalLM(CFG).eval()
    layer = model.layers[1]
    chosen = warm_ahead.layer_weights(layer, min_bytes=0)
    experts = {t.untyped_storage().data_ptr() for t in [*layer.mlp.experts.parameters(), *layer.mlp.experts.buffers()]}
    ptrs = [t.untyped_storage().data_ptr() for t in chosen]
    assert len(ptrs) == len(set(ptrs)) and not experts & set(ptrs)
    assert any(t is layer.mlp.gate.weight for t in chosen)  # the router
    everything = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    assert set(ptrs) == everything - experts
    big = warm_ahead.layer_weights(layer, min_bytes=4096)
    assert big and all(t.untyped_storage().nbytes() >= 4096 for t in big) and len(big) < len(chosen)


def test_config_and_setter():
    assert QwenEngineConfig().weight_warm_ahead == "off"  # not yet measured in the engine
    with pytest.raises(ValueError, match="weight_warm_ahead"):
        QwenEngineConfig(weight_warm_ahead="bulk")
    model = QwenForCausalLM(CFG)
    assert set_weight_warm_ahead(model, "load") == "load" and model.weight_warm_ahead == "load"
    with pytest.raises(ValueError):
        set_weight_warm_ahead(model, "on")


def test_start_only_for_small_cuda_steps(monkeypatch):
    x = torch.zeros(warm_ahead.MAX_ROWS, CFG.hidden_size)
    assert warm_ahead.start(x, "load") is None  # a CPU tensor: no stream to fork
    monkeypatch.setattr(streams, "forkable", lambda t: True)
    assert warm_ahead.start(x, "off") is None
    assert warm_ahead.start(torch.zeros(warm_ahead.MAX_ROWS + 1, CFG.hidden_size), "load") is None
    assert isinstance(warm_ahead.start(x, "load"), warm_ahead.WarmAhead)


def test_engine_same_tokens_and_warms_the_next_layers(monkeypatch):
    """One-row decode steps (prompts of > MAX_ROWS tokens, so their prefills do not warm) with the fork stubbed."""
    lengths = (9, 6, 7)
    monkeypatch.setattr(warm_ahead, "MIN_BYTES", 0)  # the tiny model's weights are all small
    monkeypatch.setattr(streams, "forkable", lambda x: True)
    forks, joins, warmed = [], [], []
    monkeypatch.setattr(streams, "fork_warm", lambda device: forks.append(len(warmed)) or ("main", None))
    monkeypatch.setattr(streams, "join", lambda main, side: joins.append(main))
    monkeypatch.setattr(l2_warm, "warm", lambda t, mode, *a, **k: warmed.append((t.untyped_storage().data_ptr(), mode)))

    def tokens(mode: str) -> tuple[dict, list[list[int]]]:
        async def body(engine):
            outs = [(await collect(engine, prompt(i, n), max_new_tokens=5))[0] for i, n in enumerate(lengths)]
            return engine, engine.health(), outs
        return run(engine_config(weights="packed", weight_warm_ahead=mode), body)

    _, h_off, off = tokens("off")
    assert not forks and not warmed and h_off["weight_warm_ahead"] == "off"
    engine, h_on, on = tokens("load")
    assert h_on["weight_warm_ahead"] == "load"
    assert on == off
    layers = engine.model.layers
    forked = len(layers) - 1  # layers 1..L-1, each forked at its predecessor's start
    steps = len(joins)
    assert joins == ["main"] * steps and len(forks) == steps * forked and steps >= len(lengths) * 4
    per_layer = [[(t.untyped_storage().data_ptr(), "load") for t in warm_ahead.layer_weights(layer)]
                 for layer in layers[1:]]
    bounds = forks + [len(warmed)]
    for step in range(1, steps):  # the first step ran before the FP8 projections' fused buffers replaced theirs
        for i, want in enumerate(per_layer):
            k = step * forked + i
            assert warmed[bounds[k]:bounds[k + 1]] == want, (step, i)
    assert bounds[forked] >= sum(map(len, per_layer))  # the first step: the unfused buffers, one launch each


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled on a GPU")
@pytest.mark.parametrize("mode", l2_warm.MODES)
def test_kernel_on_cuda_in_a_graph_on_a_side_stream(mode):
    """Compiled: the load modes' xor equals the reference's; every mode runs captured on a side stream joined later."""
    words = torch.randint(-2**31, 2**31 - 1, (3 * 2**20 + 5,), dtype=torch.int32, device="cuda")
    out = torch.zeros(l2_warm.PROGRAMS, dtype=torch.int32, device="cuda")
    l2_warm.warm(words, mode, out=out)
    if mode != "prefetch":
        assert torch.equal(out.cpu(), l2_warm.reference(words, l2_warm.PROGRAMS))
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    out.zero_()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            l2_warm.warm(words, mode, out=out)
        main.wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    if mode != "prefetch":
        assert torch.equal(out.cpu(), l2_warm.reference(words, l2_warm.PROGRAMS))
