"""kernels/l2_prefetch.py (L2 prefetch of weights ahead of their use) and its engine wiring, the Qwen engine's
`weight_prefetch_ahead`: the MoE's side stream, at decode sizes, prefetches the next decoder layer's projections.

The kernel is inline PTX (`cp.async.bulk.prefetch.L2`, sm_90+): here, the range arithmetic, that it is a no-op
where it cannot run (the CPU, the interpreter), and the wiring with the side-stream window stubbed on the CPU
(tests/test_qwen_shared_stream.py's way); tests/sm90_compile.py compiles it for sm_90 and checks the instruction. It
changes no result: a prefetch reads nothing into registers, so the outputs are compared bit for bit.
"""

import pytest
import torch

from kernels import l2_prefetch as lp
from qwen_engine.engine import PREFETCH_AHEAD_MODES, QwenEngineConfig, set_weight_prefetch_ahead
from qwen_engine.model import moe as moe_mod
from qwen_engine.model import streams
from tests.test_qwen_shared_stream import CFG, packed_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def test_pieces_cover_the_range():
    """PROGRAMS programs x pieces_per_program(n) pieces of PIECE bytes cover n (a power of two of pieces)."""
    for n in (1, lp.PIECE, lp.PROGRAMS * lp.PIECE, lp.PROGRAMS * lp.PIECE + 1, 25 * 2**20, 286 * 2**20):
        pieces = lp.pieces_per_program(n)
        assert pieces & (pieces - 1) == 0
        assert lp.PROGRAMS * pieces * lp.PIECE >= n
        assert pieces == 1 or lp.PROGRAMS * (pieces // 2) * lp.PIECE < n  # not one power of two more than needed
    assert lp.pieces_per_program(25 * 2**20) == 4  # the GDN in_proj: 200 KB a program, four 64 KB pieces


def test_ranges_skip_what_cannot_be_prefetched():
    base = torch.empty(1024, dtype=torch.uint8)
    whole, tail = base[:1000], base[1:17]  # 1,000 B (rounded down to 992); an odd start
    gappy = torch.empty(8, 8, dtype=torch.uint8)[:, :4]  # rows with gaps
    got = lp.ranges_of([whole, tail, gappy, None, base[:8]])
    assert got == [(whole.data_ptr(), 992)], got  # base[:8]: under 16 bytes, nothing


def test_no_launch_off_hopper():
    """The CPU (and the interpreter, CI's mode) never launches: 0 launches, nothing raised."""
    assert not lp.can_launch(torch.device("cpu"))
    assert lp.l2_prefetch([torch.empty(4096, dtype=torch.uint8)]) == 0
    assert lp.l2_prefetch([]) == 0


def test_engine_option_and_setter():
    assert QwenEngineConfig().weight_prefetch_ahead == "off"  # not yet measured in the engine
    with pytest.raises(ValueError, match="weight_prefetch_ahead"):
        QwenEngineConfig(weight_prefetch_ahead="all")
    model = packed_model("cpu")
    layers = model.layers
    assert set_weight_prefetch_ahead(model, "off") == 0 and all(m.mlp.prefetch_ahead is None for m in layers)
    for mode in PREFETCH_AHEAD_MODES[1:]:
        assert set_weight_prefetch_ahead(model, mode) == CFG.num_hidden_layers - 1
        assert layers[-1].mlp.prefetch_ahead is None  # the last layer: no next layer's mixer
        for layer, nxt in zip(layers, layers[1:]):
            gdn = hasattr(nxt, "linear_attn")
            mixer = nxt.linear_attn if gdn else nxt.self_attn
            names = ["in_proj_qkv", "in_proj_z"] if gdn else ["q_proj", "k_proj", "v_proj"]
            names += (["out_proj"] if gdn else ["o_proj"]) if mode == "mixer" else []
            got = layer.mlp.prefetch_ahead()
            assert [t.data_ptr() for t in got] == [getattr(mixer, n).weight.data_ptr() for n in names], (mode, names)
    old = layers[1].linear_attn.in_proj_z if hasattr(layers[1], "linear_attn") else layers[1].self_attn.k_proj
    old.weight = torch.nn.Parameter(old.weight.detach().clone()) if isinstance(old.weight, torch.nn.Parameter) \
        else old.weight.clone()  # a replaced buffer (as the fused projections do): the callable sees the new one
    assert any(t.data_ptr() == old.weight.data_ptr() for t in layers[0].mlp.prefetch_ahead())
    assert set_weight_prefetch_ahead(model, "off") == 0 and layers[0].mlp.prefetch_ahead is None


@torch.no_grad()
def test_side_stream_prefetches_first_at_decode_sizes(monkeypatch):
    """The window stubbed on the CPU: at <= PREFETCH_MAX_ROWS rows the side stream's first work is the prefetch of the
    next layer's weights, then the shared expert; the output bit-equal to the run without it; above, no prefetch."""
    model = packed_model("cpu")
    set_weight_prefetch_ahead(model, "mixer")
    moe = model.layers[0].mlp
    order = []
    monkeypatch.setattr(streams, "forkable", lambda x: True)
    monkeypatch.setattr(streams, "fork", lambda device: ("main", None))
    monkeypatch.setattr(streams, "join", lambda main, side: order.append("join"))
    monkeypatch.setattr(moe_mod, "l2_prefetch", lambda ts: order.append(("prefetch", [t.data_ptr() for t in ts])))
    real_shared = type(moe.shared_expert).forward
    monkeypatch.setattr(type(moe.shared_expert), "forward",
                        lambda self, x: order.append("shared") or real_shared(self, x))
    want = [t.data_ptr() for t in moe.prefetch_ahead()]
    g = torch.Generator().manual_seed(8)
    try:
        moe.fused, moe.shared_stream = True, True
        for n in (1, moe_mod.PREFETCH_MAX_ROWS, moe_mod.PREFETCH_MAX_ROWS + 1):
            x = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16)
            r = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16)
            order.clear()
            got = moe(x, residual=r)
            expect = ([("prefetch", want)] if n <= moe_mod.PREFETCH_MAX_ROWS else []) + ["shared", "join"]
            assert order == expect, (n, order)
            saved, moe.prefetch_ahead = moe.prefetch_ahead, None
            assert torch.equal(moe(x, residual=r), got), n
            moe.prefetch_ahead = saved
    finally:
        moe.fused, moe.shared_stream = None, False
        set_weight_prefetch_ahead(model, "off")
