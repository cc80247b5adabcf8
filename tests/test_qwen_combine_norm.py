"""The next decoder layer's input norm (with its FP8 codes) or the final norm written by a layer's MoE combine
(`kernels/moe_combine.py` "moe_combine_norm" / "moe_combine_norm_fp8", `SparseMoE.forward_and_norm`,
`QwenForCausalLM.combine_next_norm`, the engine's `combine_next_norm`).

Tolerances: the fused kernel does the combine's and the norm kernel's fp32 operations in the same order on the same
rounded row, so under the interpreter (CPU) it is compared bit for bit with the two launches it replaces
(`moe_combine` then `rms_norm_zc[_fp8]`), and with the references by the ops' own `compare` (1e-2 x max |ref| in
bf16, 1e-5 in fp32; the codes equal wherever the norm is bit-identical). Compiled on a GPU the output is the same
code as moe_combine's (bit for bit in bf16, whose roundings are integer ops; in fp32 the compiler may contract the
sums into other FMAs in each build: within the ops' 1e-5 there; H200 runs 51-52 failed the bit-for-bit form), but
the norm's sum of squares may be reduced in another order than the norm
kernel's, so there the norm is held to `compare` and the engine to the same greedy tokens. The kernel tests run on
DEVICE: the GPU where there is one (compiled), else the CPU (the interpreter, tests/conftest.py).
"""

import pytest
import torch

from engine_core.registry import Registry, default_registry
from kernels import moe_combine as mc
from kernels import rms_norm
from kernels.fp8_quant import quantize_static_reference
from qwen_engine.config import QwenConfig
from qwen_engine.engine import QwenEngineConfig, set_combine_next_norm
from qwen_engine.model.decoder import DecoderLayer
from qwen_engine.model.moe import SparseMoE
from qwen_engine.model.norm import ZeroCentredRMSNorm
from tests.test_qwen_engine import engine_config
from tests.test_qwen_shared_stream import one_by_one as tokens_one_by_one
from tests.test_qwen_shared_stream import packed_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

CFG = QwenConfig.tiny()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.02  # a static FP8 input scale: |normed| of O(1-10) lands on the e4m3 grid's middle, the largest clamp


def inputs(n: int, h: int, k: int, dtype, seed: int = 0) -> tuple:
    """moe_combine's inputs with routed as k unsummed rows [n, k, h], and a zero-centred norm weight ~N(0, 0.3)."""
    x, w, shared, routed, residual = mc.random_inputs(n, h, dtype, seed=seed)
    routed3 = torch.stack([routed * (j + 1) / k for j in range(k)], 1)
    nw = (0.3 * torch.randn(h, generator=torch.Generator().manual_seed(seed + 1))).to(dtype)
    return x, w, shared, routed3, residual, nw


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.skipif(mc.triton is None, reason="needs triton (the interpreter on a CPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,h,k", [(1, 2048, 8), (3, 96, 2), (4, 200, 1)])
def test_kernel_equals_the_two_launches(dtype, n, h, k):
    """The output bit for bit as `moe_combine`'s (the same code); the norm and its codes bit for bit as
    `rms_norm_zc[_fp8]` of that output under the interpreter (the same sums in the same order), within that op's
    `compare` when compiled; within the ops' tolerances of the references; rows of a massive activation included."""
    x, w, shared, routed, residual, nw = (t.to(DEVICE) for t in inputs(n, h, k, dtype))
    scale = torch.tensor(SCALE, device=DEVICE)
    out, normed, codes = mc.moe_combine_norm_fp8_op(x, w, shared, routed, residual, nw, 1e-6, scale)
    out2, normed2 = mc.moe_combine_norm_op(x, w, shared, routed, residual, nw, 1e-6)
    base = mc.moe_combine_op(x, w, shared, routed, residual)
    want, want_codes = rms_norm.rms_norm_zc_fp8_op(base, nw, 1e-6, scale)
    # compiled fp32 (no integer roundings between the ops) may contract the sums into other FMAs in each build (with
    # and without NORM / QUANT): there each pair within the ops' fp32 tolerances instead of bit for bit
    exact = DEVICE == "cpu" or dtype == torch.bfloat16
    for got in (out, out2):
        assert torch.equal(bits(got), bits(base)) if exact else mc.compare(got, base) is None
    assert torch.equal(bits(normed), bits(normed2)) if exact else rms_norm.compare(normed2, normed) is None
    assert torch.equal(bits(codes), bits(  # deterministic
        mc.moe_combine_norm_fp8_op(x, w, shared, routed, residual, nw, 1e-6, scale)[2]))
    if DEVICE == "cpu":
        assert torch.equal(bits(normed), bits(want)) and torch.equal(bits(codes), bits(want_codes))
    else:
        assert rms_norm.compare_fp8((normed, codes), (want, want_codes)) is None
    ref = mc.moe_combine_norm_fp8_reference(x, w, shared, routed, residual, nw, 1e-6, scale)
    assert mc.compare_norm((out, normed, codes), ref) is None
    assert mc.compare_norm((out2, normed2), ref[:2]) is None
    assert normed.abs().max() > 1 and not torch.equal(normed, out)  # a norm, not a copy of the output


@pytest.mark.skipif(mc.triton is None, reason="needs triton (the interpreter on a CPU)")
def test_compare_catches_a_wrong_norm():
    """The ops' `compare` (the registry's start-up check) fails a norm computed with w instead of 1 + w, and an
    output that is the norm rather than the combine's row."""
    x, w, shared, routed, residual, nw = inputs(3, 96, 2, torch.bfloat16)
    ref = mc.moe_combine_norm_reference(x, w, shared, routed, residual, nw, 1e-6)
    wrong = (ref[0], rms_norm.rms_norm_zc_reference(ref[0], nw - 1, 1e-6))  # (1 + w) -> w
    assert "norm" in (mc.compare_norm(wrong, ref) or "")
    assert "output" in (mc.compare_norm((ref[1], ref[1]), ref) or "")


@pytest.mark.skipif(mc.triton is None, reason="needs triton (the interpreter on a CPU)")
def test_guards_and_self_check():
    """The one-row kernel only: 3-D shared rows (the decode MoE's partial rows) are refused, as are a norm weight of
    another width and a scale that is not one fp32 element; the registry's start-up check passes both ops."""
    x, w, shared, routed, residual, nw = (t.to(DEVICE) for t in inputs(2, 96, 2, torch.bfloat16))
    ok = mc.describe_norm(x, w, shared, routed, residual, nw, 1e-6)
    assert mc.supports_norm(**ok)
    scale = torch.tensor(0.1, device=DEVICE)
    assert mc.supports_norm(**mc.describe_norm(x, w, shared, routed, residual, nw, 1e-6, scale))
    assert not mc.supports_norm(**mc.describe_norm(x, w, shared[:, None].float(), routed, residual, nw, 1e-6))
    assert not mc.supports_norm(**mc.describe_norm(x, w, shared, routed, residual, nw[:64], 1e-6))
    assert not mc.supports_norm(**mc.describe_norm(x, w, shared, routed, residual, nw, 1e-6,
                                                   torch.ones(2, device=DEVICE)))
    reg = Registry()  # not the process-wide one: an engine of another test module may have set its preference
    mc.register(reg)
    outcomes = reg.self_check(DEVICE, ops=[mc.NORM_NAME, mc.NORM_FP8_NAME])
    assert outcomes == {mc.NORM_NAME: "triton passed", mc.NORM_FP8_NAME: "triton passed"}, outcomes


@pytest.mark.skipif(mc.triton is None, reason="needs triton (the interpreter on a CPU)")
@torch.no_grad()
@pytest.mark.parametrize("n", [1, 5])
def test_layer_forward_and_norm_same_bits(n):
    """`SparseMoE.forward_and_norm` on the fused path (the interpreter's kernels) gives `forward`'s output and the
    norm module's own output and codes, bit for bit, at 1 token (the decode GEMV) and 5 (the grouped kernel); with
    the norm off the registry (its plain torch code) it hands back None, so the next layer norms its input itself."""
    model = packed_model("cpu")
    moe, norm = model.layers[0].mlp, model.layers[1].input_layernorm
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16)
    r = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16)
    scale = torch.tensor(SCALE)
    try:
        moe.fused = norm.fused = True
        want = moe(x, residual=r)
        want_h, want_codes = norm.forward_fp8(want, scale)
        out, (h, codes) = moe.forward_and_norm(x, r, norm, scale)
        assert torch.equal(bits(out), bits(want)) and torch.equal(bits(h), bits(want_h))
        assert torch.equal(bits(codes), bits(want_codes))
        out, (h, codes) = moe.forward_and_norm(x, r, norm)
        assert torch.equal(bits(h), bits(norm(want))) and codes is None
        norm.fused = False
        out, normed = moe.forward_and_norm(x, r, norm, scale)
        assert normed is None and torch.equal(bits(out), bits(want))
    finally:
        moe.fused = norm.fused = None


def test_setter_and_config():
    model = packed_model("cpu")
    assert QwenEngineConfig().combine_next_norm is True  # H200 Qwen run 50
    with pytest.raises((TypeError, ValueError)):
        QwenEngineConfig(combine_next_norm="yes")
    assert set_combine_next_norm(model, True) is True and model.combine_next_norm
    assert set_combine_next_norm(model, False) is False and not model.combine_next_norm


def calls(op: str) -> int:
    return sum(default_registry().choices()[op]["calls"].values())


def one_by_one(cfg: QwenEngineConfig) -> tuple[dict, list[list[int]], dict]:
    """(health, greedy tokens, registry calls per norm op during the run) of test_qwen_shared_stream's prompts run
    one after the other: prefill steps and one-row decode steps."""
    ops = ("moe_combine", mc.NORM_NAME, mc.NORM_FP8_NAME, rms_norm.ZC, rms_norm.ZC_FP8)
    before = {op: calls(op) for op in ops}
    health, outs = tokens_one_by_one(cfg)
    return health, outs, {op: calls(op) - before[op] for op in ops}


def test_engine_same_tokens_fewer_norm_launches(monkeypatch):
    """Through the engine (the ops' references, the MoE's and norms' fused paths as on a GPU): the same greedy tokens
    with the option as without; with it every layer's combine writes the next norm (the decode steps' with the FP8
    codes their mixers read) and the norm ops run only for the first layer; without it none does. Every norm a layer
    is handed equals its own input norm, and its codes are those of its own mixer's scale (none where that has none):
    the reference FP8 projections would not notice wrong codes, so they are checked where they are handed over."""
    monkeypatch.setattr(SparseMoE, "fused", True)
    monkeypatch.setattr(ZeroCentredRMSNorm, "fused", True)
    handed = []  # every (normed, codes) a layer received from the layer before: its own scale's codes, or none
    real = DecoderLayer.forward_paged

    def checked(self, x, cos, sin, state, batch, normed=None, next_norm=None):
        if normed is not None:
            scale = self.input_scale(x, batch)
            assert (normed[1] is None) == (scale is None)
            norm = self.input_layernorm  # its reference, not the module: the registry's call counts are checked
            assert torch.equal(normed[0], rms_norm.rms_norm_zc_reference(x, norm.weight, norm.eps))
            if scale is not None:
                want = quantize_static_reference(normed[0], scale)
                assert torch.equal(normed[1].view(torch.uint8), want.view(torch.uint8))
            handed.append(scale is not None)
        return real(self, x, cos, sin, state, batch, normed, next_norm)
    monkeypatch.setattr(DecoderLayer, "forward_paged", checked)
    h_off, off, c_off = one_by_one(engine_config(weights="packed", combine_next_norm=False))
    assert not handed
    assert h_off["combine_next_norm"] is False
    assert c_off[mc.NORM_NAME] == c_off[mc.NORM_FP8_NAME] == 0 and c_off["moe_combine"] > 0
    h_on, on, c_on = one_by_one(engine_config(weights="packed", combine_next_norm=True))
    assert h_on["combine_next_norm"] is True
    assert on == off
    layers = CFG.num_hidden_layers
    steps = c_off["moe_combine"] // layers  # forward steps of the run (every layer's combine once a step)
    assert c_on["moe_combine"] == 0  # every combine wrote the next norm
    assert c_on[mc.NORM_NAME] + c_on[mc.NORM_FP8_NAME] == steps * layers, c_on
    assert c_on[mc.NORM_FP8_NAME] > 0  # the decode steps' codes for the FP8 projections
    assert any(handed) and not all(handed)  # checked against each layer's own scale: decode steps and prefill steps
    # the input norms (the first layer's) and the final norm: 40 fewer calls per step at the full model's depth
    norms_off = c_off[rms_norm.ZC] + c_off[rms_norm.ZC_FP8]
    norms_on = c_on[rms_norm.ZC] + c_on[rms_norm.ZC_FP8]
    assert norms_off - norms_on == steps * layers, (c_off, c_on)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel on a GPU")
def test_engine_on_cuda_same_tokens(one_autotune_config):
    """On a GPU, bf16 with the decode graphs captured: the same greedy tokens with the option as without, and the
    fused ops chosen as the Triton kernels."""
    graphed = dict(device="cuda", dtype="bf16", kernels="auto", decode_graphs="capture", autotune_table="off")
    _, off, _ = one_by_one(engine_config(weights="packed", combine_next_norm=False, **graphed))
    health, on, c_on = one_by_one(engine_config(weights="packed", combine_next_norm=True, **graphed))
    assert health["runner"]["graph_steps"] > 0, health["runner"]
    assert c_on[mc.NORM_NAME] + c_on[mc.NORM_FP8_NAME] > 0
    # the model's ops dispatch through the process-wide registry (health()["kernels"] lists the engine's own: GDN,
    # attention; H200 run of 2026-12-03 found it absent there, not another choice)
    from engine_core.registry import default_registry

    choice = default_registry().choices()[mc.NORM_FP8_NAME]
    assert choice["last"] == "triton" and choice["fallback"] is None, choice
    assert on == off


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel on a GPU")
@torch.no_grad()
@pytest.mark.parametrize("n", [1, 4, 32])
def test_layer_on_cuda(n):
    """Compiled: the output bit for bit as `forward`'s (the same code as moe_combine), the norm and codes within the
    ops' `compare` of the norm module's own (the sum of squares may reduce in another order), eagerly."""
    model = packed_model("cuda")
    moe, norm = model.layers[0].mlp, model.layers[1].input_layernorm
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16).cuda()
    r = torch.randn(n, CFG.hidden_size, generator=g).to(torch.bfloat16).cuda()
    scale = torch.tensor(SCALE, device="cuda")
    moe.fused = norm.fused = True
    try:
        want = moe(x, residual=r)
        want_h, want_codes = norm.forward_fp8(want, scale)
        out, (h, codes) = moe.forward_and_norm(x, r, norm, scale)
        assert torch.equal(out, want)
        assert rms_norm.compare_fp8((h, codes), (want_h, want_codes)) is None
    finally:
        moe.fused = norm.fused = None
