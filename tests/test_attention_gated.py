"""kernels/paged_attention.py's "paged_decode_attention_gated_fp8": the decode attention with its output gate and
o_proj's e4m3 codes in the combine's launch -- bit for bit what the attention op followed by
"attn_output_gate_fp8" gives (split heads: the gate in the combine; unsplit: the gate op itself), and within the
reference's bound; on CPU through Triton's interpreter (tests/conftest.py), on a GPU compiled. The engine option that
takes it (`QwenEngineConfig.attn_gate_in_combine`) keeps the greedy tokens."""

import pytest
import torch

from kernels import paged_attention as pa
from kernels.attn_prep import attn_output_gate_fp8_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(ctx, heads=8, kv_heads=2, dh=32, bs=4, seed=0):
    args = pa.random_inputs(ctx, heads, kv_heads, dh, bs, dtype=torch.bfloat16, seed=seed, device=DEVICE)
    gen = torch.Generator().manual_seed(seed + 1)
    # the gate as the model has it: a strided half of the fused q / gate projection
    qg = (2 * torch.randn(len(ctx), heads, 2 * dh, generator=gen)).to(torch.bfloat16).to(DEVICE)
    return args, qg[..., dh:], torch.tensor(0.004, device=DEVICE)


def _runs_here() -> bool:
    args, gate, s = _inputs([3])
    return pa.supports_gated(**pa.describe_gated(*args, gate, s))


pytestmark = pytest.mark.skipif(not _runs_here(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")


@pytest.mark.parametrize("ctx,splits", [([1, 8, 21], 4), ([5, 40], 3), ([9], 1), ([17, 2, 30], None)])
def test_gated_equals_attention_then_gate(ctx, splits):
    """Outputs and codes equal to the two ops' bit for bit (the same attention kernel, then the gate's operations on
    its rounded output), with 1 split (the gate op after the kernel) and several (the gate in the combine)."""
    args, gate, s = _inputs(ctx, seed=len(ctx))
    o = pa.paged_decode_attention_launch(*args, num_splits=splits)
    want = attn_output_gate_fp8_triton(o, gate, s)
    got = pa.paged_decode_attention_launch(*args, num_splits=splits, gate=gate, input_scale=s)
    assert got[0].shape == (len(ctx), 8 * 32) and got[1].dtype == torch.float8_e4m3fn
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))


def test_gated_op_against_reference_and_registry():
    """The registered op within its reference's bound (the registry's self-check on its sample), and a gate of the
    wrong shape or a missing scale refused by `supports_gated`."""
    from engine_core.registry import Registry

    args, gate, s = _inputs([6, 13])
    got = pa.paged_decode_attention_gated_fp8_triton(*args, gate, s)
    assert pa.compare_gated(got, pa.paged_decode_attention_gated_fp8_reference(*args, gate, s)) is None
    reg = Registry()
    pa.register(reg)
    assert reg.self_check(torch.device(DEVICE), ops=[pa.GATED_NAME])[pa.GATED_NAME].startswith("triton passed")
    assert not pa.supports_gated(**pa.describe_gated(*args, gate[:, :4], s))
    assert not pa.supports_gated(**pa.describe_gated(*args, gate, None))


def test_packed_decode_steps_take_it_and_change_nothing(monkeypatch):
    """Packed tiny model (FP8 attention projections, o_proj codes from the producers), the runner's decode steps with
    the fused glue: with GATE_IN_COMBINE every step's logits are bit-identical to the steps without it, and the
    attention layers' decode calls went through the gated op's Triton implementation."""
    from engine_core.registry import default_registry
    from qwen_engine.model import attention, quantized
    from tests.test_gdn_fused_glue import _drive, _packed_model

    monkeypatch.setattr(quantized, "QUANT_IN_PRODUCERS", True)
    monkeypatch.setattr(attention, "GATE_IN_COMBINE", False)
    reg = default_registry()  # its preferences as a fresh process has them: an engine built by an earlier test had
    #                            set them process-wide (tests/conftest.py process_registry_preferences puts them back)
    off, tokens = _drive(_packed_model(), True, monkeypatch)
    before = reg.choices().get(pa.GATED_NAME, {}).get("calls", {}).get("triton", 0)
    monkeypatch.setattr(attention, "GATE_IN_COMBINE", True)
    on, _ = _drive(_packed_model(), True, monkeypatch, tokens)
    assert len(on) == len(off) and any(decode for decode, _ in on)
    for (decode, a), (_, b) in zip(off, on):
        assert torch.equal(a, b), "decode" if decode else "prefill"
    assert reg.choices()[pa.GATED_NAME]["calls"].get("triton", 0) > before, reg.choices()[pa.GATED_NAME]


def test_engine_option_keeps_tokens(monkeypatch):
    """`attn_gate_in_combine` (on by default: H200 variants run 1) routes the decode attention layers through the
    gated op: the same greedy tokens as without it (tiny fp32 model, FP8 codes off there: the plain gate path
    stays)."""
    from qwen_engine.engine import QwenEngineConfig
    from qwen_engine.model import attention
    from tests.test_qwen_engine import CPU_TRITON, collect, engine_config, run

    assert QwenEngineConfig().attn_gate_in_combine is True
    monkeypatch.setattr(attention, "GATE_IN_COMBINE", attention.GATE_IN_COMBINE)  # restored after the test

    async def body(engine):
        tokens, _ = await collect(engine, [5, 9, 2, 7, 11], max_new_tokens=4)
        return attention.GATE_IN_COMBINE, tokens

    # the Triton kernels where they run on the engine's CPU tensors (the interpreter, asked for as "triton": "auto"
    # on a CPU device applies the references); "auto" (the references) on a GPU host
    on, tokens_on = run(engine_config(attn_gate_in_combine=True, kernels=CPU_TRITON), body)
    off, tokens_off = run(engine_config(attn_gate_in_combine=False, kernels=CPU_TRITON), body)
    assert on is True and off is False and tokens_on == tokens_off and len(tokens_on) == 4


def test_capture_blocker_when_the_gated_op_runs_its_reference(monkeypatch):
    """With attn_gate_in_combine, a gated op that chose its reference (a host loop over the context lengths) blocks
    the decode graphs' capture up front for a model whose attention layers hand o_proj FP8 codes (the packed model),
    as the plain attention's reference does; without the option it does not, nor for a model without those codes (the
    choice is process-wide: another model's calls must not block this one)."""
    from engine_core.registry import default_registry
    from qwen_engine.model import attention, quantized
    from qwen_engine.runner import ModelRunner, gdn_registry
    from tests.test_gdn_fused_glue import _packed_model
    from tests.test_qwen_engine import engine_config, run

    async def body(engine):
        return engine.model

    plain = run(engine_config(), body)  # fp32, no FP8 projections
    monkeypatch.setattr(quantized, "QUANT_IN_PRODUCERS", True)
    reg = default_registry()
    before = reg.preference(pa.GATED_NAME)
    try:
        reg.set_preference("reference", pa.GATED_NAME)
        args, gate, s = _inputs([3])
        reg.call(pa.GATED_NAME, *args, gate, s)  # its choice recorded: the reference
        runners = [ModelRunner(m, m.config, str(next(m.parameters()).device), 8, 4, 2, registry=gdn_registry("auto"),
                               max_model_len=32, decode_buckets=(1, 2), decode_graphs="static")
                   for m in (_packed_model(), plain)]
        monkeypatch.setattr(attention, "GATE_IN_COMBINE", True)
        assert any(f.startswith(pa.GATED_NAME) for f in runners[0].capture_blockers())
        assert not any(f.startswith(pa.GATED_NAME) for f in runners[1].capture_blockers())
        monkeypatch.setattr(attention, "GATE_IN_COMBINE", False)
        assert not any(f.startswith(pa.GATED_NAME) for f in runners[0].capture_blockers())
    finally:
        reg.set_preference(before, pa.GATED_NAME)
