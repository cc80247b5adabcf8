"""Packed NVFP4 / FP8 model (`qwen_engine/model/quantized.py`, `load_packed.py`, `random_weights.py`) against the
reference model holding the dequantised weights, at the tiny config on CPU.

Tolerances, and why:
* fp32, FP8 layers weight-only: every packed module dequantises exactly (E2M1 x e4m3 x global, the order of
  `kernels/nvfp4.py`) and multiplies in fp32, like `nn.Linear` on the dequantised weight; only fp32 summation order
  may differ -> logits max |diff| <= 1e-5 x max |logit| (measured: 0).
* fp32 with the checkpoint's W8A8 (static e4m3 activations): a real numerical change of ~2^-5 per activation; the
  model is held to <= 0.2 of max |logit| and must differ (> 1e-4), and each FP8Linear equals
  `fp8_linear_reference` exactly.
* bf16, Triton interpreter vs the registry's references: the kernels' own bound (tests/test_kernel_w4a16.py,
  `kernels.tolerance.compare`: 1e-2 of max |ref| per op); through 4 layers the logits are held to 2e-2 (measured
  5.6e-3). FP8 layers run weight-only there: with static e4m3 activations a one-ulp bf16 difference upstream can move
  an activation a whole e4m3 step (2^-4), which measured 3.4e-2 and would hide a kernel error.
* W4A4 exports (`w4a4=`): "emulate" is `w4a4_linear_reference` bit for bit; "auto" on a machine without the native
  path (CPU here) and "off" are the W4A16 module bit for bit (unchanged behaviour).
"""

import logging

import pytest
import torch
import torch.nn.functional as F

from engine_core.registry import Registry
from kernels import fp8_linear, nvfp4, w4a16_gemm
from kernels.nvfp4 import W4A4_OP, FP8Tensor, NVFP4Tensor, fp8_linear_reference, quantize_nvfp4, w4a4_linear_reference
from kernels.tolerance import compare
from qwen_engine.checkpoint import NVFP4, CheckpointError, LoadedCheckpoint, load_into, save_checkpoint
from qwen_engine.config import QwenConfig
from qwen_engine.load_packed import load_quantized, model_bytes
from qwen_engine.model import QwenForCausalLM, QwenState
from qwen_engine.model.moe import experts_loop
from qwen_engine.model.quantized import (
    FP8Linear,
    NVFP4Experts,
    NVFP4Linear,
    NVFP4SwiGLU,
    dequantized_state_dict,
    packed_modules,
)
from qwen_engine.random_weights import calibrate_fp8_input_scales, random_packed_tensors, to_transformers

CFG = QwenConfig.tiny()


def rel_err(a, ref):
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


def registry(preference="auto") -> Registry:
    reg = Registry(preference)
    w4a16_gemm.register(reg)
    fp8_linear.register(reg)
    nvfp4.register(reg)
    return reg


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tensors():
    return random_packed_tensors(CFG, "cpu", seed=0)


def new_state(model, batch, max_len) -> QwenState:
    """`QwenForCausalLM.new_state` reads lm_head.weight's dtype, which a packed lm_head does not have."""
    p = model.embed_tokens.weight
    return QwenState.empty(model.config, batch, max_len, dtype=p.dtype, device=p.device)


def reference_of(model) -> QwenForCausalLM:
    ref = QwenForCausalLM(CFG, gdn_chunk_size=16).eval()
    ref.load_state_dict(dequantized_state_dict(model), strict=True)
    return ref


@torch.no_grad()
def test_packed_model_equals_dequantised_reference_fp32(tensors):
    model = load_quantized(tensors, CFG, "cpu", torch.float32, quantize_activations=False, gdn_chunk_size=16,
                           registry=registry())
    kinds = packed_modules(model)
    assert isinstance(model.lm_head, NVFP4Linear)
    assert isinstance(model.layers[0].mlp.experts, NVFP4Experts)
    assert isinstance(model.layers[0].mlp.shared_expert, NVFP4SwiGLU)
    assert isinstance(model.layers[0].linear_attn.in_proj_qkv, FP8Linear)
    assert isinstance(model.layers[3].self_attn.q_proj, FP8Linear)
    assert type(model.layers[0].linear_attn.in_proj_a) is torch.nn.Linear  # BF16 in the checkpoint
    assert type(model.layers[0].mlp.gate.weight) is torch.nn.Parameter
    assert sum(v == "FP8" for v in kinds.values()) == 3 * 3 + 4  # 3 GDN layers x 3 + one attention layer x 4
    # no dense copy of a quantised weight: uint8 / e4m3 hold the expert and lm_head weights
    assert model_bytes(model)["uint8"] == sum(t.packed.numel() for t in tensors.values() if isinstance(t, NVFP4Tensor))

    ref = reference_of(model)
    ids = torch.randint(0, CFG.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    got, want = model(ids), ref(ids)
    assert rel_err(got, want) <= 1e-5
    assert want.std() > 0.05  # not a degenerate model
    # incremental decode of the packed model equals its full forward
    state = new_state(model, 2, 40)
    inc = torch.cat([model(ids[:, :30], state)] + [model(ids[:, i:i + 1], state) for i in range(30, 37)], dim=1)
    assert rel_err(inc, got) <= 1e-5


@torch.no_grad()
def test_w8a8_fp8_layers(tensors):
    model = load_quantized(tensors, CFG, "cpu", torch.float32, gdn_chunk_size=16, registry=registry())
    lin = model.layers[0].linear_attn.in_proj_qkv
    x = torch.randn(5, CFG.hidden_size, generator=torch.Generator().manual_seed(2)) * 3
    w = FP8Tensor(lin.weight, lin.weight_scale, lin.input_scale)
    assert torch.equal(lin(x), fp8_linear_reference(x, w))
    ids = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    err = rel_err(model(ids), reference_of(model)(ids))
    assert 1e-4 < err <= 0.2, err


@torch.no_grad()
def test_fp8_kernel_choice_follows_activation_quantisation():
    """The cached kernel choice is per variant: a weight-only call (calibration, the oracle) falls back to the
    reference, and the W8A8 call after it must still get the fast path (a stand-in that, like `_scaled_mm`, needs
    the input scale). The 2026-11-30 H200 runs measured the reference in every FP8 layer because of this."""
    g = torch.Generator().manual_seed(4)
    data, scale = nvfp4.quantize_fp8(torch.randn(32, 64, generator=g) * 0.02)
    lin = FP8Linear(FP8Tensor(data, scale, torch.tensor(0.01)), registry=(reg := registry()))
    calls = []

    def fast(x, w, *rest):
        calls.append(w.input_scale is not None)
        return fp8_linear_reference(x, w, *rest)

    reg.add_implementation("fp8_linear", "fake_fast", fast, lambda **info: info["has_input_scale"], kind="torch")
    x = torch.randn(3, 64, generator=g)
    lin.quantize_activations = False
    lin(x)
    assert calls == [] and lin.implementation == "reference"
    lin.quantize_activations = True
    lin(x)
    assert calls == [True] and lin.implementation == "fake_fast"


@torch.no_grad()
def test_fused_fp8_projections(monkeypatch):
    """`fused_fp8_projections` (decode steps: attention q/k/v, GDN in_proj_qkv/z as one FP8 call): its column slices
    equal each projection's own output (CPU reference: the same codes, products and fp32 sums -- bit for bit); the
    projections become views of the one concatenated weight (no second copy), so in-place weight writes reach it and
    in-place scale writes are copied into it without a new allocation; a replaced buffer means a rebuild; `.to()`
    drops it; it declines different input scales, weight-only layers, calls neither the GEMV nor the few-row GEMM
    would take, calls the registry would give neither, and the switch; `forget_kernel_choices` reaches its cached
    choices. On the CPU the registry runs the reference for every FP8 call, so "reference" counts as one of
    FUSED_IMPLS here (the choice rule itself is checked at the end and in tests/test_kernel_fp8_gemv.py /
    test_kernel_fp8_swapped.py)."""
    from kernels import fp8_gemv
    from qwen_engine.model import quantized
    from qwen_engine.model.attention import GatedAttention

    monkeypatch.setattr(quantized, "FUSED_IMPLS", ("reference", *quantized.FUSED_IMPLS))
    g = torch.Generator().manual_seed(12)
    reg = registry()

    def fp8(n, s_in=0.02):
        data, scale = nvfp4.quantize_fp8(torch.randn(n, CFG.hidden_size, generator=g) * 0.05)
        return FP8Linear(FP8Tensor(data, scale, torch.tensor(s_in)), registry=reg)

    attn = GatedAttention(CFG)
    nq, nkv = attn.q_proj.out_features, attn.k_proj.out_features
    attn.q_proj, attn.k_proj, attn.v_proj = fp8(nq), fp8(nkv), fp8(nkv)
    names = ("q_proj", "k_proj", "v_proj")
    x = torch.randn(3, CFG.hidden_size, generator=g)

    def check(fused):
        for got, n in zip(fused(x).split((nq, nkv, nkv), dim=-1), names):
            assert torch.equal(got, getattr(attn, n)(x)), n

    fused = quantized.fused_fp8_projections(attn, names, x)
    assert fused is not None and fused.weight.shape == (nq + 2 * nkv, CFG.hidden_size)
    assert fused.weight_scale.shape == (nq + 2 * nkv,)
    check(fused)
    base = fused.weight.untyped_storage().data_ptr()
    assert all(getattr(attn, n).weight.untyped_storage().data_ptr() == base for n in names)  # views: one copy
    assert quantized.fused_fp8_projections(attn, names, x[:1]) is fused  # cached
    attn.k_proj.weight.copy_(attn.v_proj.weight)  # in-place writes (a reload by copy_) reach the fused weight...
    attn.k_proj.weight_scale.mul_(2.0)  # ...and in-place scale writes are copied into its buffers
    assert quantized.fused_fp8_projections(attn, names, x) is fused and fused.weight.data_ptr() == base
    check(fused)
    attn.v_proj.weight_scale = attn.v_proj.weight_scale * 0.5  # a replaced buffer: rebuilt
    rebuilt = quantized.fused_fp8_projections(attn, names, x)
    assert rebuilt is not fused
    fused = rebuilt
    check(fused)
    fused(x)
    entry = attn.__dict__[quantized.FUSED_CACHE][names]
    assert fused._impl and entry.impl_choice
    quantized.forget_kernel_choices(attn)
    assert not fused._impl and not entry.impl_choice
    attn.to(torch.float64).to(torch.float32)  # `.to()`: the fused copy is dropped (freed), rebuilt on the next call
    assert quantized.FUSED_CACHE not in attn.__dict__
    assert quantized.fused_fp8_projections(attn, names, x) is not fused
    assert quantized.fused_fp8_projections(attn, names, torch.zeros(5, CFG.hidden_size)) is not None  # few-row GEMM
    assert quantized.fused_fp8_projections(attn, names, torch.zeros(65, CFG.hidden_size)) is None  # 65 rows: cuBLASLt
    monkeypatch.setattr(fp8_gemv, "GEMV_MAX_REPEAT_BYTES", 2 * CFG.hidden_size * (nq + 2 * nkv) - 1)
    assert quantized.fused_fp8_projections(attn, names, x[:2]) is None  # 2 rows x the fused weight: too large
    assert quantized.fused_fp8_projections(attn, names, x[:1]) is not None  # 1 row: always
    monkeypatch.setattr(quantized, "FUSE_DECODE_PROJECTIONS", False)
    assert quantized.fused_fp8_projections(attn, names, x) is None
    monkeypatch.setattr(quantized, "FUSE_DECODE_PROJECTIONS", True)
    attn.v_proj.input_scale.fill_(0.03)  # one input, now two calibrations: the codes would differ
    assert quantized.fused_fp8_projections(attn, names, x) is None
    other = GatedAttention(CFG)
    other.q_proj, other.k_proj, other.v_proj = fp8(nq), fp8(nkv), fp8(nkv)
    other.v_proj.quantize_activations = False  # weight-only
    assert quantized.fused_fp8_projections(other, names, x) is None
    assert quantized.fused_fp8_projections(GatedAttention(CFG), names, x) is None  # nn.Linear projections
    monkeypatch.setattr(quantized, "FUSED_IMPLS", ("triton_quant+gemv", "triton_gemv", "triton_quant+swapped"))
    other.v_proj.quantize_activations = True
    assert quantized.fused_fp8_projections(other, names, x) is None  # the registry's choice here: the reference


@torch.no_grad()
def test_nvfp4_modules_vs_dense(tensors):
    reg = registry()
    lm = NVFP4Linear(tensors["lm_head.weight"], reg)
    x = torch.randn(3, CFG.hidden_size, generator=torch.Generator().manual_seed(4))
    assert rel_err(lm(x), F.linear(x, lm.dequantized())) <= 1e-6
    ex = NVFP4Experts(tensors["layers.1.mlp.experts.gate_up_proj"], tensors["layers.1.mlp.experts.down_proj"], reg)
    idx = torch.stack([torch.randperm(CFG.num_experts)[:2] for _ in range(3)])
    wts = torch.softmax(torch.randn(3, 2), -1)
    d = ex.dequantized()
    assert rel_err(ex(x, idx, wts), experts_loop(x, d["gate_up_proj"], d["down_proj"], idx, wts)) <= 1e-5
    # gate and up of one expert share ModelOpt's synced global scale (random_weights) and it survives fusion
    g = ex.gate_up_global
    assert torch.equal(g[:, :1].expand_as(g), g)
    # a dtype cast of the model leaves the storage formats alone
    ex.to(torch.bfloat16)
    assert ex.gate_up_scales.dtype == torch.float8_e4m3fn and ex.gate_up_global.dtype == torch.float32


@torch.no_grad()
@pytest.mark.parametrize("layout", ["tile_major", "split_halves", "split_frag"])
def test_experts_repacked_layout(tensors, caplog, layout):
    """`NVFP4Experts.repack` (split halves: the loader's default on CUDA): same dequantised weights, same forward to
    bf16 rounding (the repacked launch runs other tiles or another kernel), unsummed rows too; repacking from one
    kernel layout to the other directly is the same as from the checkpoint's; the tiny config's shapes do not split
    into the tiles, so the loader keeps the checkpoint layout there and says so; unknown layout names are refused."""
    from kernels.w4a16_gemm import CHECKPOINT, EXPERT_LAYOUTS

    code = EXPERT_LAYOUTS[layout]
    other = EXPERT_LAYOUTS["tile_major" if layout != "tile_major" else "split_frag"]
    reg = registry("auto")
    g = torch.Generator().manual_seed(7)
    e, h, i = 4, 256, 256
    gu = quantize_nvfp4(torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.rand(e, generator=g) * 1e-3 + 1e-4)
    dn = quantize_nvfp4(torch.randn(e, h, i, generator=g) * 0.05, torch.rand(e, generator=g) * 1e-3 + 1e-4)
    plain, packed, via = NVFP4Experts(gu, dn, reg), NVFP4Experts(gu, dn, reg), NVFP4Experts(gu, dn, reg)
    assert packed.repack(code) and packed.layout == code and plain.layout == CHECKPOINT
    assert via.repack(other) and via.repack(code) and torch.equal(via.gate_up_packed, packed.gate_up_packed)
    assert torch.equal(via.down_packed, packed.down_packed)
    assert not torch.equal(packed.gate_up_packed, plain.gate_up_packed)
    for k, v in plain.dequantized().items():
        assert torch.equal(packed.dequantized()[k], v), k
    with pytest.raises(RuntimeError, match="repacked"):  # the layout is not in the state: loads are refused
        packed.load_state_dict(plain.state_dict())
    x = torch.randn(3, h, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(3)])
    wts = torch.softmax(torch.randn(3, 2, generator=g), -1)
    want = plain(x, idx, wts)
    assert rel_err(packed(x, idx, wts), want) <= 1e-2
    assert rel_err(packed(x, idx, wts, reduce=False).float().sum(1), want) <= 1e-2
    if w4a16_gemm._interpreted():
        assert reg.choices()["w4a16_moe"]["last"] == "triton"  # the repacked launch ran, not a fallback
    with caplog.at_level(logging.WARNING, logger="qwen_engine.load_packed"):
        model = load_quantized(tensors, CFG, "cpu", torch.bfloat16, quantize_activations=False, registry=reg,
                               expert_layout=layout)
    assert model.layers[0].mlp.experts.layout == CHECKPOINT and "checkpoint layout kept" in caplog.text
    with pytest.raises(ValueError, match="expert_layout"):
        load_quantized(tensors, CFG, "cpu", torch.bfloat16, registry=reg, expert_layout="tiled")


@torch.no_grad()
@pytest.mark.parametrize("small_layout", ["checkpoint", "tile_major"])
def test_experts_dual_layout(tensors, caplog, small_layout):
    """`NVFP4Experts.repack_dual` (expert_layout "dual"): split halves for every call plus a copy in `small_layout`
    (default the checkpoint's: the decode GEMV's) that calls of at most `small_tokens` tokens read. Both paths equal
    the checkpoint-layout forward to bf16 rounding; each path reads its own copy (spoiling one copy changes only its
    calls); the state_dict holds one copy; `repack` drops the second; "dual_frag"'s large copy in fragment order gives
    the same numbers; shapes that do not split keep the checkpoint layout in the loader, which says so."""
    from kernels.w4a16_gemm import CHECKPOINT, EXPERT_LAYOUTS, SPLIT_HALVES, TILE_MAJOR

    reg = registry("auto")
    g = torch.Generator().manual_seed(8)
    e, h, i = 4, 256, 256
    gu = quantize_nvfp4(torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.rand(e, generator=g) * 1e-3 + 1e-4)
    dn = quantize_nvfp4(torch.randn(e, h, i, generator=g) * 0.05, torch.rand(e, generator=g) * 1e-3 + 1e-4)
    own = lambda w: NVFP4Tensor(*(t.clone() for t in w))  # noqa: E731 - the checkpoint-layout copy keeps the storage
    plain, dual = NVFP4Experts(gu, dn, reg), NVFP4Experts(own(gu), own(dn), reg)
    layout = EXPERT_LAYOUTS[small_layout]
    assert dual.repack_dual(small_tokens=2, small_layout=None if layout == CHECKPOINT else layout)
    assert dual.layout == SPLIT_HALVES and dual.small_tokens == 2 and dual.small_layout == layout
    assert set(dual.state_dict()) == set(plain.state_dict())  # the copy is derived: not persistent
    calls = {}
    for t in (1, 2, 5):
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
        wts = torch.softmax(torch.randn(t, 2, generator=g), -1)
        calls[t] = (x, idx, wts, plain(x, idx, wts))
        assert rel_err(dual(x, idx, wts), calls[t][3]) <= 1e-2, t
    small = dual.small_gate_up_packed.clone()
    dual.small_gate_up_packed.zero_()  # only the small calls read the small-batch copy
    assert rel_err(dual(*calls[1][:3]), calls[1][3]) > 0.5 and rel_err(dual(*calls[5][:3]), calls[5][3]) <= 1e-2
    dual.small_gate_up_packed.copy_(small)
    dual.gate_up_packed.zero_()  # ... and only the larger ones the split halves
    assert rel_err(dual(*calls[2][:3]), calls[2][3]) <= 1e-2 and rel_err(dual(*calls[5][:3]), calls[5][3]) > 0.5
    again = NVFP4Experts(gu, dn, reg)
    assert again.repack_dual() and again.repack(TILE_MAJOR) and again.small_tokens == 0
    assert not hasattr(again, "small_gate_up_packed") and again.layout == TILE_MAJOR
    if layout == CHECKPOINT:  # "dual_frag": the large copy in fragment order, the same numbers (once: interpreted)
        check_dual_frag(gu, dn, reg, calls)
    with caplog.at_level(logging.WARNING, logger="qwen_engine.load_packed"):
        model = load_quantized(tensors, CFG, "cpu", torch.bfloat16, quantize_activations=False, registry=reg,
                               expert_layout="dual")
    experts = model.layers[0].mlp.experts
    assert experts.layout == CHECKPOINT and experts.small_tokens == 0 and "checkpoint layout kept" in caplog.text


def check_dual_frag(gu, dn, reg, calls):
    """`repack_dual(large_layout=SPLIT_FRAG)` (expert_layout "dual_frag"): both paths equal the checkpoint-layout
    forward (`calls`: token count -> (x, idx, weights, expected)); other large layouts are refused."""
    from kernels.w4a16_gemm import SPLIT_FRAG, TILE_MAJOR

    frag = NVFP4Experts(NVFP4Tensor(*(t.clone() for t in gu)), NVFP4Tensor(*(t.clone() for t in dn)), reg)
    assert frag.repack_dual(small_tokens=2, large_layout=SPLIT_FRAG) and frag.layout == SPLIT_FRAG
    assert rel_err(frag(*calls[5][:3]), calls[5][3]) <= 1e-2 and rel_err(frag(*calls[1][:3]), calls[1][3]) <= 1e-2
    with pytest.raises(ValueError, match="large layout"):
        frag.repack_dual(large_layout=TILE_MAJOR)


@torch.no_grad()
def test_engine_checks_the_expert_layouts_its_model_uses(monkeypatch):
    """`qwen_engine.engine.check_expert_layouts`: the registry's self-check sample covers the device's default layout
    only, so the engine also checks every other kernel layout its experts use (tile-major and split halves here, on
    the CPU where the default is the checkpoint's; dual's checkpoint-layout copy -- the decode GEMV -- where the
    default is another), through the registry's choice; a wrong kernel is disabled and the next choice checked."""
    from kernels.w4a16_gemm import MOE, SPLIT_HALVES, TILE_MAJOR
    from qwen_engine.engine import check_expert_layouts

    g = torch.Generator().manual_seed(9)
    e, h, i = 4, 256, 256
    gu = quantize_nvfp4(torch.randn(e, 2 * i, h, generator=g) * 0.05)
    dn = quantize_nvfp4(torch.randn(e, h, i, generator=g) * 0.05)
    reg = registry("auto")
    model = torch.nn.ModuleList([NVFP4Experts(gu, dn, reg), NVFP4Experts(gu, dn, reg)])
    assert check_expert_layouts(model, torch.device("cpu"), reg) == {}  # checkpoint layout: the registry's sample
    assert model[0].repack(TILE_MAJOR) and model[1].repack_dual()
    out = check_expert_layouts(model, torch.device("cpu"), reg)
    assert out == {"w4a16_moe[tile_major]": "triton passed", "w4a16_moe[split_halves]": "triton passed"}, out
    with monkeypatch.context() as m:  # a GPU's view: split halves is the sample's layout, dual's copy is not
        m.setattr(w4a16_gemm, "default_expert_layout", lambda device: SPLIT_HALVES)
        out = check_expert_layouts(model, torch.device("cpu"), reg)
    assert out == {"w4a16_moe[checkpoint]": "triton_gemv passed", "w4a16_moe[tile_major]": "triton passed"}, out
    monkeypatch.setattr(w4a16_gemm, "moe_experts_w4a16_triton", lambda *a: torch.zeros_like(a[0]))
    bad = registry("auto")  # registers the broken tensor-core kernel
    out = check_expert_layouts(model, torch.device("cpu"), bad)
    first = out["w4a16_moe[tile_major]"]  # checked first (layout codes in order)
    assert first.startswith("triton FAILED") and first.endswith("disabled; the reference runs"), out
    assert out["w4a16_moe[split_halves]"] == "the reference runs", out  # "triton" stays disabled
    assert bad.preference(MOE).value == "auto"  # only the failing implementation is out, not the GEMV


@torch.no_grad()
def test_moe_fused_tail_with_unsummed_experts(tensors):
    """`SparseMoE` on its fused path (`fused = True`; the default on CUDA): the packed experts hand over their k
    weighted outputs unsummed ([N, k, H], `reduce=False`), "moe_combine" sums them with the gated shared expert and
    the residual in one launch, and the shared expert's gate/up GEMM applies SiLU x up in its epilogue
    ("w4a16_swiglu"). Against the plain torch tail: bf16 rounding level (the fused path rounds less often)."""
    reg = registry("auto")
    model = load_quantized(tensors, CFG, "cpu", torch.bfloat16, quantize_activations=False, registry=reg)
    moe = model.layers[0].mlp
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, CFG.hidden_size, generator=g).to(torch.bfloat16)
    residual = torch.zeros_like(x)  # the MoE part alone, so the tolerance below is on it
    _, wts, idx = moe.gate(x)
    rows = moe.experts(x, idx, wts, reduce=False)
    assert rows.shape == (5, CFG.num_experts_per_tok, CFG.hidden_size)
    assert torch.equal(rows.sum(1, dtype=torch.float32).to(x.dtype), moe.experts(x, idx, wts))
    try:
        moe.fused = False
        plain = moe(x, residual=residual)
        moe.fused = True
        fused = moe(x, residual=residual)
    finally:
        moe.fused = None
    err = rel_err(fused, plain)
    print(f"fused MoE tail vs plain: rel err {err:.2e}")
    assert err <= 2e-2
    if w4a16_gemm._interpreted():
        assert reg.choices()["w4a16_swiglu"]["last"] == "triton", reg.choices()  # 5 rows: not the GEMV's


@torch.no_grad()
def test_shared_expert_inside_the_grouped_launches(tensors, monkeypatch):
    """`load_quantized(shared_expert_in_moe=True)` stacks each shared expert after the routed experts (expert E);
    with `shared_in_experts` the fused MoE path runs it as one more pair per token inside the grouped launches (the
    dense module is not called), and gives the dense path's output to bf16 rounding level; batches whose pairs exceed
    the one-program alignment (MAX_PAIRS), or that the experts' small-batch copy serves, keep the dense shared
    expert; `dequantized` returns the routed experts
    only, so the dequantised model is unchanged."""
    from kernels.moe_align import MAX_PAIRS

    reg = registry("auto")
    model = load_quantized(tensors, CFG, "cpu", torch.bfloat16, quantize_activations=False, registry=reg,
                           shared_expert_in_moe=True)
    plain = load_quantized(tensors, CFG, "cpu", torch.bfloat16, quantize_activations=False, registry=reg)
    moe = model.layers[0].mlp
    e = CFG.num_experts
    assert moe.experts.shared_index == e and moe.experts.gate_up_packed.shape[0] == e + 1
    assert getattr(plain.layers[0].mlp.experts, "shared_index", None) is None
    for name, w in moe.experts.dequantized().items():  # the routed experts, as without the stacked shared one
        assert torch.equal(w, plain.layers[0].mlp.experts.dequantized()[name])
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, CFG.hidden_size, generator=g).to(torch.bfloat16)
    residual = torch.zeros_like(x)
    calls = []
    dense_forward = type(moe.shared_expert).forward
    from kernels import moe_router
    from qwen_engine.model.moe import TopKRouter

    monkeypatch.setattr(TopKRouter, "parts", False)  # F.linear + router_topk above MAX_ROWS: its launches counted
    router_launches = []  # (rows, extra) of each router_topk kernel launch
    launch = moe_router._launch
    monkeypatch.setattr(moe_router, "_launch", lambda logits, k, block_r=None, extra=-1: (
        router_launches.append((logits.shape[0], extra)) or launch(logits, k, block_r, extra)))
    from engine_core.registry import default_registry

    # the router calls the process-wide registry, whose preference an earlier engine may have set ("reference")
    router_preference = default_registry().preference(moe_router.NAME)
    default_registry().set_preference("auto", moe_router.NAME)

    def counting(self, h):
        calls.append(h.shape[0])
        return dense_forward(self, h)

    try:
        type(moe.shared_expert).forward = counting
        moe.fused = moe.gate.fused = True  # the router's fused ops too (on the CPU: the Triton interpreter)
        dense = moe(x, residual=residual)
        moe.shared_in_experts = True
        inside = moe(x, residual=residual)  # 5 tokens: router_topk writes the shared pair's column itself
        moe.gate.extra_in_kernel = False
        inside_cat = moe(x, residual=residual)  # the same column by torch.cat after it
        moe.gate.extra_in_kernel = True
        big = MAX_PAIRS // (CFG.num_experts_per_tok + 1) + 1  # too many pairs for the one-program alignment
        moe(torch.randn(big, CFG.hidden_size, generator=g).to(torch.bfloat16),
            residual=torch.zeros(big, CFG.hidden_size, dtype=torch.bfloat16))
    finally:
        type(moe.shared_expert).forward = dense_forward
        moe.fused, moe.shared_in_experts, moe.gate.extra_in_kernel, moe.gate.fused = None, False, True, None
        default_registry().set_preference(router_preference, moe_router.NAME)
    assert calls == [5, big]  # the dense module ran for the first and the large call, not inside the experts
    # the kernel wrote the shared pair's column for `inside` only (`inside_cat` appended it with torch.cat)
    assert router_launches == [(5, -1), (5, e), (5, -1), (big, -1)]
    err = rel_err(inside, dense)
    print(f"shared expert inside the grouped launches vs dense: rel err {err:.2e}")
    # same roundings, and at these shapes (one K tile) the same fp32 sums: equal bit for bit (the swapped-scale and
    # 2%-off-scale mistakes a review tried gave 6.9e-3 and 1.8e-2: a tolerance would hide them)
    assert torch.equal(inside, dense) and torch.equal(inside_cat, dense)
    # experts with a small-batch copy (`repack_dual`: the decode GEMV's <= 4 tokens) keep the dense shared expert
    # for the calls that copy serves
    k = CFG.num_experts_per_tok
    moe.shared_in_experts = True
    try:
        assert moe.experts.small_tokens == 0 and moe._shared_as_pair(1, k)
        moe.experts.small_tokens = 4
        assert [moe._shared_as_pair(n, k) for n in (1, 4, 5, big)] == [
            False, False, True, False]
    finally:
        moe.experts.small_tokens, moe.shared_in_experts = 0, False
    g_last = moe.experts.gate_up_global[-1].clone()
    try:  # the shared slot's gate and up scales swapped: the output must change
        i = moe.experts.intermediate
        moe.experts.gate_up_global[-1] = torch.cat((g_last[i:], g_last[:i]))
        moe.fused, moe.shared_in_experts = True, True
        assert not torch.equal(moe(x, residual=residual), dense)
    finally:
        moe.experts.gate_up_global[-1] = g_last
        moe.fused, moe.shared_in_experts = None, False


@pytest.mark.parametrize("parts", [True, False])
def test_aligned_routing_thresholds(monkeypatch, parts):
    """`SparseMoE._aligned_routing`'s rows: never at <= MAX_ROWS tokens; with the router GEMM in Triton
    (`TopKRouter.parts`) the fold over its partials from PARTS_MIN_PAIRS pairs (29 tokens with the shared pair, 33
    without) up to PARTS_MAX_ROWS tokens; after F.linear from MAX_ROWS + 1 tokens at any count."""
    from kernels import moe_router, router_align
    from qwen_engine.model.moe import SparseMoE, TopKRouter

    class Experts(torch.nn.Module):  # the packed experts' one method the decision asks
        def routing_shape(self, n, pairs, with_shared):
            return (CFG.num_experts + with_shared, 8)

    monkeypatch.setattr(TopKRouter, "parts", parts)
    moe = SparseMoE(CFG)
    moe.experts, moe.router_align, moe.gate.fused = Experts(), True, True
    assert router_align.PARTS_MIN_PAIRS == 257 and moe_router.PARTS_MAX_ROWS == 64 and moe_router.MAX_ROWS == 4
    taken = {(n, k1): moe._aligned_routing(n, k1, k1 == 9, False) is not None
             for n, k1 in ((4, 9), (5, 9), (28, 9), (29, 9), (32, 8), (33, 8), (64, 9), (65, 9), (128, 9))}
    if parts:
        assert [key for key, on in taken.items() if on] == [(29, 9), (33, 8), (64, 9)], taken
    else:
        assert [key for key, on in taken.items() if not on] == [(4, 9)], taken
    moe.router_align = False
    assert moe._aligned_routing(32, 9, True, False) is None


@torch.no_grad()
@pytest.mark.parametrize("shared_in_experts", [True, False])
@pytest.mark.parametrize("parts", [True, False])
def test_router_align_builds_the_experts_routing(tensors, monkeypatch, shared_in_experts, parts):
    """`SparseMoE.router_align`: the router's launch builds the alignment the experts' kernels would have built
    (`NVFP4Experts.routing_shape`), so they launch no alignment of their own, and the layer's output is the same bit
    for bit; at <= MAX_ROWS tokens the router keeps its fused GEMV + top-k and the experts their own routing. With and
    without the shared expert as a (k+1)-th pair; after the router GEMM in Triton (`TopKRouter.parts`: the kernel over
    its partials, "router_linear_topk_align") and after F.linear ("router_topk_align")."""
    from engine_core.registry import default_registry
    from kernels import moe_align, moe_router, router_align
    from qwen_engine.model.moe import TopKRouter

    monkeypatch.setattr(TopKRouter, "parts", parts)
    # with the router GEMM in Triton the fold runs from PARTS_MIN_PAIRS pairs (6 tokens here have fewer): below, the
    # separate launches -- the last call below checks that; lowered here so that 6 tokens take it
    min_pairs = router_align.PARTS_MIN_PAIRS
    monkeypatch.setattr(router_align, "PARTS_MIN_PAIRS", 1)

    reg = registry("auto")
    model = load_quantized(tensors, CFG, "cpu", torch.bfloat16, quantize_activations=False, registry=reg,
                           shared_expert_in_moe=shared_in_experts)
    moe = model.layers[0].mlp
    k = CFG.num_experts_per_tok
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, CFG.hidden_size, generator=g).to(torch.bfloat16)
    residual = torch.randn(6, CFG.hidden_size, generator=g).to(torch.bfloat16)
    aligns, routers = [], []
    align_launch, router_launch = moe_align.moe_align_triton, router_align._align_launch
    monkeypatch.setattr(moe_align, "moe_align_triton", lambda idx, e, bm, **kw: (
        aligns.append((idx.numel(), e, bm)) or align_launch(idx, e, bm, **kw)))
    monkeypatch.setattr(router_align, "_align_launch", lambda src, n, ne, k, extra, e, bm, *a, **kw: (
        routers.append((n, extra, e, bm, kw.get("parts") is not None)) or router_launch(src, n, ne, k, extra, e, bm,
                                                                                       *a, **kw)))
    ops = (moe_router.NAME, moe_router.LINEAR_NAME, router_align.NAME, router_align.LINEAR_NAME)
    before = {op: default_registry().preference(op) for op in ops}
    for op in ops:  # the process-wide registry, whose preference an earlier engine may have set
        default_registry().set_preference("auto", op)
    try:
        moe.fused = moe.gate.fused = True  # the fused path, as on CUDA (on the CPU: the Triton interpreter)
        moe.shared_in_experts = shared_in_experts
        plain = moe(x, residual=residual)
        plain_aligns = list(aligns)  # (moe_align_fast's first use also aligns a probe routing of the same size)
        moe.router_align = True
        aligned = moe(x, residual=residual)
        aligned_aligns = aligns[len(plain_aligns):]
        lone = moe(x[:moe_router.MAX_ROWS], residual=residual[:moe_router.MAX_ROWS])
        monkeypatch.setattr(router_align, "PARTS_MIN_PAIRS", min_pairs)  # 6 tokens: the fold only without parts
        n_routers = len(routers)
        assert torch.equal(moe(x, residual=residual), plain) and len(routers) == n_routers + (not parts)
        del routers[n_routers:]
        moe.gate.fused = False  # the router on its torch path (torch.topk's tie order): no aligned routing either
        assert torch.equal(moe(x, residual=residual), plain)
    finally:
        moe.fused = moe.gate.fused = None
        moe.shared_in_experts = moe.router_align = False
        for op, pref in before.items():
            default_registry().set_preference(pref, op)
    pairs = 6 * (k + shared_in_experts)
    experts = CFG.num_experts + shared_in_experts
    shape = (experts, w4a16_gemm.moe_block_m(pairs, experts))
    assert moe.experts.routing_shape(6, pairs, shared_in_experts) == shape
    assert plain_aligns and set(plain_aligns) == {(pairs, *shape)}  # without the option: the experts' own launch
    assert aligned_aligns == []  # with it: none of their own ...
    # ... the router's launch built it; the MAX_ROWS-token call (`lone`) and the torch router launched none
    assert routers == [(6, CFG.num_experts if shared_in_experts else -1, *shape, parts)]
    assert torch.equal(aligned, plain)
    assert lone.shape == (moe_router.MAX_ROWS, CFG.hidden_size)
    # a routing that does not fit the call (another block size, another expert count, short buffers) is not used:
    # the experts align their own (counted), and the output is the same
    w, idx = moe_router.router_topk_reference(x.float() @ moe.gate.weight.float().t(), k,
                                              CFG.num_experts if shared_in_experts else -1)
    want = moe.experts(x, idx, w, reduce=False, with_shared=shared_in_experts)
    good = w4a16_gemm.moe_align(idx, experts, shape[1])
    for bad in (w4a16_gemm.moe_align(idx, experts, shape[1] * 2), good._replace(num_experts=experts + 1),
                good._replace(sorted_pairs=good.sorted_pairs[:-shape[1]])):
        before, n_aligns = w4a16_gemm.ROUTING_REBUILT[0], len(aligns)
        got = moe.experts(x, idx, w, reduce=False, with_shared=shared_in_experts, routing=bad)
        assert w4a16_gemm.ROUTING_REBUILT[0] == before + 1 and len(aligns) == n_aligns + 1 and torch.equal(got, want)
    before, n_aligns = w4a16_gemm.ROUTING_REBUILT[0], len(aligns)
    assert torch.equal(moe.experts(x, idx, w, reduce=False, with_shared=shared_in_experts, routing=good), want)
    assert (w4a16_gemm.ROUTING_REBUILT[0], len(aligns)) == (before, n_aligns)  # the fitting one: used as it is


@torch.no_grad()
@pytest.mark.parametrize("layout", ["tile_major", "split_halves"])
def test_shared_expert_slot_with_repacked_experts(layout):
    """NVFP4Experts(shared=) repacked for a kernel (experts of H = I = 256: two K tiles per projection, the shapes the
    tiles need): the shared slot's rows equal the dense shared expert's output (NVFP4SwiGLU on the same NVFP4
    weights, to the W4A16 tolerance: other tiles, other fp32 summation order), and routed-only calls see the E routed
    experts."""
    from qwen_engine.model.quantized import NVFP4Experts, NVFP4SwiGLU

    e, h, i, k, t = 3, 256, 256, 2, 5
    g = torch.Generator().manual_seed(12)
    q = lambda *shape: NVFP4Tensor(*quantize_nvfp4(torch.randn(*shape, generator=g) * 0.05))  # noqa: E731
    gu, dn = q(e, 2 * i, h), q(e, h, i)
    s_gate, s_up, s_down = q(i, h), q(i, h), q(h, i)
    dense = NVFP4SwiGLU(s_gate, s_up, s_down, registry=registry())
    experts = NVFP4Experts(gu, dn, registry(), shared=(dense.gate_up_proj.weight_nvfp4,
                                                       dense.down_proj.weight_nvfp4))
    from kernels.w4a16_gemm import EXPERT_LAYOUTS

    assert experts.repack(EXPERT_LAYOUTS[layout]) and experts.shared_index == e
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, generator=g), -1).to(torch.bfloat16)
    rows = experts(x, torch.cat((idx, torch.full((t, 1), e)), 1), torch.cat((wts, torch.ones(t, 1)), 1),
                   reduce=False, with_shared=True)
    assert compare(rows[:, k], dense(x)) is None, compare(rows[:, k], dense(x))
    routed_only = experts(x, idx, wts, reduce=False)
    assert torch.equal(routed_only, rows[:, :k])


@torch.no_grad()
def test_bf16_triton_interpreter_matches_references(tensors):
    """The packed model in bf16 through the W4A16 Triton kernels (interpreter on CPU, compiled on a GPU) vs the same
    model forced onto the registry's references."""
    fast_reg, ref_reg = registry("auto"), registry("reference")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    fast = load_quantized(tensors, CFG, dev, torch.bfloat16, quantize_activations=False, registry=fast_reg)
    slow = load_quantized(tensors, CFG, "cpu", torch.bfloat16, quantize_activations=False, registry=ref_reg)
    ids = torch.randint(0, CFG.vocab_size, (1, 6), generator=torch.Generator().manual_seed(5))
    got, want = fast(ids.to(dev)).float().cpu(), slow(ids).float()
    if not torch.cuda.is_available() and w4a16_gemm._interpreted():
        ch = fast_reg.choices()
        assert ch["w4a16_linear"]["last"] == "triton" and ch["w4a16_moe"]["last"] == "triton", ch  # 6 rows
    print("bf16 triton vs reference logits rel err", rel_err(got, want))
    assert rel_err(got, want) <= 2e-2


@torch.no_grad()
def test_synthetic_modelopt_checkpoint_loads_packed(tmp_path, tensors):
    """Dense source -> ModelOpt export on disk -> load_quantized (packed, no dequantisation) == load_into (the
    dequantising loader) into the reference model."""
    src = dequantized_state_dict(load_quantized(tensors, CFG, "cpu", torch.float32, quantize_activations=False))
    save_checkpoint(tmp_path, CFG, src, return_weights=False)
    model = load_quantized(tmp_path, device="cpu", dtype=torch.float32, quantize_activations=False,
                           gdn_chunk_size=16, registry=registry())
    assert isinstance(model.layers[2].mlp.experts, NVFP4Experts)
    ref = QwenForCausalLM(CFG, gdn_chunk_size=16).eval()
    load_into(ref, tmp_path)
    ids = torch.randint(0, CFG.vocab_size, (2, 25), generator=torch.Generator().manual_seed(6))
    assert rel_err(model(ids), ref(ids)) <= 1e-5


def _expect(tensors, message, **kw):
    with pytest.raises((CheckpointError, ValueError), match=message):
        load_quantized(tensors, CFG, "cpu", torch.float32, **kw)


def test_loading_errors_are_clear(tensors):
    t = dict(tensors)
    del t["layers.0.mlp.gate.weight"]
    _expect(t, r"layers\.0\.mlp\.gate\.weight: missing")
    _expect({**tensors, "layers.9.foo": torch.zeros(1)}, r"layers\.9\.foo: unexpected")
    _expect({**tensors, "norm.weight": torch.zeros(3)}, r"norm\.weight: shape \(3,\), expected \(64,\)")
    mixed = {**tensors, "layers.0.mlp.experts.down_proj": torch.zeros(CFG.num_experts, 64, 32)}
    _expect(mixed, r"routed experts must be both NVFP4 or both dense")
    conv = tensors["layers.0.linear_attn.conv1d.weight"]
    fake = FP8Tensor(conv.float().to(torch.float8_e4m3fn), torch.tensor(1.0), torch.tensor(1.0))
    _expect({**tensors, "layers.0.linear_attn.conv1d.weight": fake}, r"not an nn\.Linear weight")
    no_scale = tensors["layers.0.linear_attn.out_proj.weight"]._replace(input_scale=None)
    _expect({**tensors, "layers.0.linear_attn.out_proj.weight": no_scale}, r"needs the checkpoint's static input_scale")
    with pytest.raises(ValueError, match="needs its QwenConfig"):
        load_quantized(tensors, None, "cpu")


def test_random_weights_are_seeded_and_in_the_checkpoint_formats(tensors):
    again = random_packed_tensors(CFG, "cpu", seed=0)
    other = random_packed_tensors(CFG, "cpu", seed=1)
    for name, v in tensors.items():
        parts = (v,) if isinstance(v, torch.Tensor) else tuple(v)
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                   for a, b in zip(parts, (again[name],) if isinstance(v, torch.Tensor) else again[name]))
    assert not torch.equal(tensors["lm_head.weight"].packed, other["lm_head.weight"].packed)
    lm = tensors["lm_head.weight"]
    assert lm.packed.dtype == torch.uint8 and lm.scales.dtype == torch.float8_e4m3fn
    assert lm.packed.shape == (CFG.vocab_size, CFG.hidden_size // 2) and lm.global_scale.shape == (CFG.vocab_size,)
    fp8 = tensors["layers.3.self_attn.o_proj.weight"]
    assert isinstance(fp8, FP8Tensor) and fp8.data.dtype == torch.float8_e4m3fn and fp8.scale.dim() == 0
    assert tensors["embed_tokens.weight"].dtype == torch.bfloat16
    # magnitudes: the dequantised expert weights keep the N(0, 0.02) they were drawn from (NVFP4 error ~10 %)
    ex = NVFP4Experts(tensors["layers.0.mlp.experts.gate_up_proj"], tensors["layers.0.mlp.experts.down_proj"])
    std = float(ex.dequantized()["gate_up_proj"].std())
    assert 0.017 < std < 0.023, std


@torch.no_grad()
def test_calibration_and_transformers_copy(tensors, caplog):
    from transformers import Qwen3_5MoeForCausalLM

    from tests.test_qwen_model import hf_config

    reg = registry("auto")
    model = load_quantized(tensors, CFG, "cpu", torch.float32, gdn_chunk_size=16, registry=reg)
    ids = torch.randint(0, CFG.vocab_size, (2, 30), generator=torch.Generator().manual_seed(7))
    with caplog.at_level(logging.WARNING, logger="engine_core.registry"):
        amax = calibrate_fp8_input_scales(model, ids)
    assert len(amax) == 13 and all(a > 0 for a in amax.values())
    # the weight-only pass ran the FP8 reference by name (no fallback warning) and left the preference as it was
    assert "fp8_linear: falling back" not in caplog.text
    assert reg.preference("fp8_linear").value == "auto" and reg.choices()["fp8_linear"]["calls"].get("reference")
    lin = model.layers[0].linear_attn.in_proj_qkv
    want = amax["layers.0.linear_attn.in_proj_qkv"] / 448
    assert lin.quantize_activations and float(lin.input_scale) == pytest.approx(want)

    hf = Qwen3_5MoeForCausalLM(hf_config(CFG)).eval()
    assert to_transformers(model, hf) == len(dict(hf.named_parameters()))
    ref = reference_of(model)
    assert rel_err(hf(ids).logits, ref(ids)) <= 1e-4  # the reference model's own bound vs transformers


@torch.no_grad()
def test_transformers_filled_from_meta(tensors, monkeypatch):
    """benchmarks/qwen_gpu.py's transformers model for the oracle: built on the meta device, given empty storage
    (`empty_transformers`: no random init of 35B parameters; on the CPU when the GPU cannot hold it beside ours,
    `transformers_stage`), its rotary buffers rebuilt, then filled by `to_transformers` -- the same logits, bit for
    bit, and the same buffers as a model built the usual way and filled alike. A model with buffers it does not know
    is refused."""
    from transformers import Qwen3_5MoeForCausalLM

    from benchmarks.qwen_gpu import empty_transformers, transformers_stage
    from tests.test_qwen_model import hf_config

    model = load_quantized(tensors, CFG, "cpu", torch.float32, gdn_chunk_size=16, registry=registry("reference"))
    usual = Qwen3_5MoeForCausalLM(hf_config(CFG)).eval()
    to_transformers(model, usual)
    with torch.device("meta"):
        meta = Qwen3_5MoeForCausalLM(hf_config(CFG)).eval()
    assert transformers_stage("auto", meta, torch.device("cpu")) == "device"  # "auto" stages only a short GPU
    assert transformers_stage("cpu", meta, torch.device("cpu")) == "cpu"
    need = sum(p.numel() * p.element_size() for p in meta.parameters()) + (8 << 30)
    for free, where in ((need - 1, "cpu"), (need, "device")):  # a CUDA device with that much free memory
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 80 << 30))
        assert transformers_stage("auto", meta, torch.device("cuda")) == where, free
    filled = empty_transformers(meta, torch.device("cpu"))
    assert to_transformers(model, filled) == len(dict(filled.named_parameters()))
    buffers = dict(filled.named_buffers())
    assert buffers.keys() == dict(usual.named_buffers()).keys()
    for name, a in usual.named_buffers():
        assert torch.equal(a, buffers[name]), name
    ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    assert torch.equal(usual(ids).logits, filled(ids).logits)
    with torch.device("meta"):
        odd = Qwen3_5MoeForCausalLM(hf_config(CFG)).eval()
    odd.model.register_buffer("extra", torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="rotary"):
        empty_transformers(odd, torch.device("cpu"))


def test_block_gdn_kernels_makes_fla_unimportable(tmp_path):
    """`benchmarks/qwen_gpu.block_gdn_kernels` (transformers' GDN on its fp32 torch code for the oracle): with a
    stand-in `fla` and `causal_conv1d` on the path, both import before it and raise ImportError after it; and it says
    when transformers' Qwen3.5 module was already imported (too late to change its kernels). In a subprocess: it
    mutates sys.modules."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    for name in ("fla", "causal_conv1d"):  # importable packages, as on the GPU machine
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    root = Path(__file__).resolve().parents[1]
    code = ("import importlib, sys\n"
            "from benchmarks.qwen_gpu import block_gdn_kernels, HF_MODULE\n"
            "for m in ('fla', 'causal_conv1d'):\n"
            "    importlib.import_module(m)\n"
            "    del sys.modules[m]\n"
            "assert block_gdn_kernels() is None\n"
            "for m in ('fla', 'causal_conv1d'):\n"
            "    try:\n        importlib.import_module(m)\n    except ImportError:\n        pass\n"
            "    else:\n        raise SystemExit(m + ' still imports')\n"
            "importlib.import_module(HF_MODULE)\n"
            "assert 'imported before fla was blocked' in block_gdn_kernels()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tmp_path), str(root),
                                                                     os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


# ---- W4A4 exports ----------------------------------------------------------------------------------------------------
def _w4a4_layer(seed=10, n=48, k=64):
    """A synthetic W4A4 export: NVFP4 weight with per-row global (as the loader hands it) + a static input scale."""
    g = torch.Generator().manual_seed(seed)
    w = quantize_nvfp4(torch.randn(n, k, generator=g) * 0.05)
    w = w._replace(global_scale=w.global_scale.expand(n).clone())
    x = torch.randn(5, 3, k, generator=g)
    input_scale = x.abs().amax() / 2688.0 * 0.8  # calibrated a little below this batch's amax: some saturation
    return w, x, input_scale


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_linear_w4a4_modes(dtype):
    w, x, s_in = _w4a4_layer()
    x = x.to(dtype)
    reg = registry()
    w4a16 = NVFP4Linear(w, reg)(x)  # the layer without its activation scale: today's path
    emulated = NVFP4Linear(w, reg, s_in, w4a4="emulate")
    want = w4a4_linear_reference(x, w, s_in, dtype)
    assert torch.equal(emulated(x), want) and emulated.runs == "W4A4 emulated"
    err = rel_err(want, w4a16)
    assert 1e-3 < err < 0.3, err  # activations really were quantised to NVFP4 (~2^-3 per element)
    for mode in ("auto", "off"):
        lin = NVFP4Linear(w, reg, s_in, w4a4=mode)
        assert torch.equal(lin(x), w4a16), mode  # CPU: no native W4A4 -> W4A16, bit for bit
        assert lin.runs == "W4A16"
    if not torch.cuda.is_available():
        ch = reg.choices()[W4A4_OP]  # "auto" asked the registry, which recorded why the native path did not run
        assert ch["last"] == "reference" and "scaled_mm does not support" in ch["fallback"]
    with pytest.raises(ValueError, match="unknown w4a4 mode 'on'"):
        NVFP4Linear(w, reg, s_in, w4a4="on")
    with pytest.raises(ValueError, match="finite and positive"):
        NVFP4Linear(w, reg, torch.tensor(0.0))


@torch.no_grad()
def test_nvfp4_linear_w4a4_auto_follows_the_registry_choice():
    """'auto' runs W4A4 exactly when the registry's choice for nvfp4_w4a4_linear is a "torch"-kind (native)
    implementation; here a stand-in native path that records its calls (this CPU cannot run `_scaled_mm` fp4)."""
    w, x, s_in = _w4a4_layer(seed=11)
    calls = []

    def native(*args):
        calls.append(args[1:])
        return w4a4_linear_reference(*args)

    reg = registry()
    reg.add_implementation(W4A4_OP, "fake_native", native, lambda **info: info["device"] == "cpu", kind="torch")
    lin = NVFP4Linear(w, reg, s_in)
    assert torch.equal(lin(x), w4a4_linear_reference(x, w, s_in, x.dtype))
    assert len(calls) == 1 and lin.runs == "W4A4 native (fake_native)"
    lin(x)  # the choice is cached per (device, dtype, preference); the registry counted one choice
    assert len(calls) == 2 and reg.choices()[W4A4_OP]["calls"] == {"fake_native": 1}
    w4a16 = NVFP4Linear(w, reg)(x)
    for pref in ("reference", "triton"):  # preferences that cannot pick the native path: W4A16, no error
        reg.set_preference(pref, W4A4_OP)
        assert torch.equal(lin(x), w4a16), pref
    assert len(calls) == 2
    reg.set_preference("auto", W4A4_OP)
    assert torch.equal(NVFP4Linear(w, reg, s_in, w4a4="off")(x), w4a16)
    # a registry without the op (kernels.nvfp4 not registered): W4A16, not an error
    bare = Registry()
    w4a16_gemm.register(bare)
    assert torch.equal(NVFP4Linear(w, bare, s_in)(x), w4a16)


def _w4a4_checkpoint(tensors) -> LoadedCheckpoint:
    """The tiny random model as if exported with lm_head, the shared experts and layer 0's routed experts W4A4."""
    algos, scales = {}, {}
    amax = 4.0  # the tiny model's hidden states are O(1): a static scale that quantises without heavy saturation
    for name in tensors:
        if name == "lm_head.weight" or ".shared_expert." in name:
            algos[name] = NVFP4
            scales[name] = torch.tensor(amax / 2688.0 * (1.25 if "up_proj" in name else 1.0))
        elif name.startswith("layers.0.mlp.experts."):
            algos[name] = NVFP4
            scales[name] = torch.full((CFG.num_experts,), amax / 2688.0)
    return LoadedCheckpoint(CFG, dict(tensors), algos, scales)


@torch.no_grad()
def test_load_quantized_w4a4_switch(tensors, caplog):
    ckpt = _w4a4_checkpoint(tensors)
    kw = dict(device="cpu", dtype=torch.float32, quantize_activations=False, gdn_chunk_size=16)
    ids = torch.randint(0, CFG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(13))
    plain = load_quantized(tensors, CFG, registry=registry(), **kw)  # no activation scales: W4A16 everywhere
    with caplog.at_level(logging.WARNING, logger="qwen_engine.load_packed"):
        auto = load_quantized(ckpt, registry=registry(), **kw)
    assert "routed-expert stacks run as W4A16" in caplog.text and "dense layers, w4a4=auto" in caplog.text
    assert auto.lm_head.w4a4_export and auto.lm_head.w4a4 == "auto"
    se = auto.layers[1].mlp.shared_expert
    assert isinstance(se, NVFP4SwiGLU) and se.down_proj.w4a4_export
    # gate and up fused: one input, the larger of the two scales
    assert float(se.gate_up_proj.input_scale) == pytest.approx(4.0 / 2688.0 * 1.25)
    assert isinstance(auto.layers[0].mlp.experts, NVFP4Experts)  # MoE experts: W4A16 whatever the switch
    assert packed_modules(auto)["lm_head"] == "NVFP4 W4A4 export (w4a4=auto)"
    want = plain(ids)
    assert torch.equal(auto(ids), want)  # "auto" without a native W4A4 path: unchanged behaviour
    assert auto.lm_head.runs == "W4A16"
    off = load_quantized(ckpt, registry=registry(), w4a4="off", **kw)
    assert torch.equal(off(ids), want)
    emu = load_quantized(ckpt, registry=registry(), w4a4="emulate", **kw)
    got = emu(ids)
    err = rel_err(got, want)
    print("w4a4 emulated vs W4A16 logits rel err", err)
    assert 1e-4 < err <= 0.3, err  # the W4A4 numerics: activation quantisation in 1 + 3 x 4 GEMMs
    h = torch.randn(4, CFG.hidden_size, generator=torch.Generator().manual_seed(14))
    lm = emu.lm_head
    assert torch.equal(lm(h), w4a4_linear_reference(h, lm.weight_nvfp4, lm.input_scale, h.dtype))
    with pytest.raises(ValueError, match="unknown w4a4 mode"):
        load_quantized(ckpt, w4a4="native", **kw)


def test_shared_expert_in_moe_auto(tensors, monkeypatch, caplog):
    """"auto" stacks the shared expert only where the experts resolve to dual_frag (Hopper: the one place it was
    measured); True / False as given; anything else refused. `set_shared_expert_in_moe("auto")` turns it on where the
    loader stacked it, with no warning where it did not (True warns there)."""
    from qwen_engine.engine import QwenEngineConfig, set_shared_expert_in_moe
    from qwen_engine.load_packed import resolve_shared_expert_in_moe

    assert resolve_shared_expert_in_moe(True, "checkpoint", "cpu") is True
    assert resolve_shared_expert_in_moe(False, "dual_frag", "cpu") is False
    assert resolve_shared_expert_in_moe("auto", "auto", "cpu") is False  # the CPU keeps the checkpoint layout
    assert resolve_shared_expert_in_moe("auto", "tile_major", "cpu") is False
    assert resolve_shared_expert_in_moe("auto", "dual_frag", "cpu") is True
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_shared_expert_in_moe("auto", "auto", "cuda") is True  # Hopper: dual_frag
    with pytest.raises(ValueError, match="auto"):
        resolve_shared_expert_in_moe("yes", "auto", "cpu")
    with pytest.raises(ValueError, match="auto"):
        QwenEngineConfig(config="tiny", shared_expert_in_moe="yes")

    stacked = load_quantized(tensors, CFG, "cpu", torch.bfloat16, quantize_activations=False, registry=registry(),
                             shared_expert_in_moe=True, expert_layout="dual_frag")
    # "auto" with dual_frag asked for, on experts too small for its tiles (checkpoint layout kept): not stacked
    unsplit = load_quantized(tensors, CFG, "cpu", torch.bfloat16, quantize_activations=False, registry=registry(),
                             shared_expert_in_moe="auto", expert_layout="dual_frag")
    assert all(getattr(layer.mlp.experts, "shared_index", None) is None for layer in unsplit.layers)
    plain = load_quantized(tensors, CFG, "cpu", torch.bfloat16, quantize_activations=False, registry=registry())
    caplog.clear()  # (the tiny experts do not split into dual_frag's tiles: the loader said so)
    with caplog.at_level(logging.WARNING, logger="qwen_engine.engine"):
        assert set_shared_expert_in_moe(stacked, "auto") == CFG.num_hidden_layers
        assert set_shared_expert_in_moe(plain, "auto") == 0
        assert not caplog.records
        assert set_shared_expert_in_moe(plain, True) == 0
        assert "no MoE layer" in caplog.text
    with pytest.raises(ValueError, match="auto"):
        set_shared_expert_in_moe(plain, "on")


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_linear_repack_frag(dtype):
    """`NVFP4Linear.repack_frag` (lm_head on Hopper): the bytes go to fragment order in place and forward runs op
    "w4a16_linear_frag"; fp32 on the CPU takes its reference (bit for bit the checkpoint-layout module's output),
    bf16 the swap-AB kernel under the interpreter (the kernel's bound, `compare`); `dequantized` is unchanged;
    `repack_checkpoint` restores the bytes exactly; a W4A4 export and a shape no tile divides are refused."""
    g = torch.Generator().manual_seed(5)
    w = quantize_nvfp4(torch.randn(128, 256, generator=g) * 0.02)
    x = torch.randn(3, 256, generator=g).to(dtype)
    reg = registry()
    plain = NVFP4Linear(w, reg)
    lin = NVFP4Linear(w, reg)
    want, dense = plain(x), plain.dequantized()
    assert lin.repack_frag() and lin.layout == "split_frag" and lin.op == "w4a16_linear_frag"
    assert not torch.equal(lin.packed, plain.packed) and lin.repack_frag()  # a second call changes nothing
    got = lin(x)
    if dtype == torch.float32:
        assert torch.equal(got, want) and lin.implementation == "reference"
    else:
        assert compare(got, w4a16_gemm.w4a16_linear_reference(x.float(), w).to(dtype)) is None
        assert lin.implementation == "triton"
    assert torch.equal(lin.dequantized(), dense)
    lin.repack_checkpoint()
    assert lin.layout == "checkpoint" and torch.equal(lin.packed, plain.packed) and torch.equal(lin(x), want)
    w4a4 = NVFP4Linear(w, reg, torch.tensor(0.01))
    assert not w4a4.repack_frag() and w4a4.layout == "checkpoint"
    odd = NVFP4Linear(quantize_nvfp4(torch.randn(96, 256, generator=g)), reg)
    assert not odd.repack_frag() and odd.layout == "checkpoint"


@torch.no_grad()
def test_nvfp4_linear_repack_dual(monkeypatch):
    """`NVFP4Linear.repack_dual` (lm_head_layout dual_frag): fragment-order bytes plus the checkpoint's as a second
    buffer; calls of <= DUAL_ROWS rows run op "w4a16_linear" on the checkpoint copy, larger ones "w4a16_linear_frag"
    on the fragment-order bytes, both the checkpoint module's output (fp32: references, bit for bit); `repack_frag`
    drops the copy, `repack_checkpoint` restores the single checkpoint buffer; refused where repack_frag is."""
    from qwen_engine.model.quantized import DUAL_ROWS

    g = torch.Generator().manual_seed(6)
    w = quantize_nvfp4(torch.randn(128, 256, generator=g) * 0.02)
    reg = registry()
    plain, lin = NVFP4Linear(w, reg), NVFP4Linear(w, reg)
    assert lin.repack_dual() and lin.layout == "dual_frag" and lin.repack_dual()
    assert torch.equal(lin.packed_small, plain.packed) and not torch.equal(lin.packed, plain.packed)
    assert torch.equal(lin.weight_checkpoint.packed, plain.packed)
    assert torch.equal(lin.dequantized(), plain.dequantized())
    ops = []
    real = type(lin)._call
    monkeypatch.setattr(type(lin), "_call", lambda self, *a, op=None, **k: ops.append(op or self.op) or real(
        self, *a, op=op, **k))
    for rows in (1, DUAL_ROWS, DUAL_ROWS + 1):
        x = torch.randn(rows, 256, generator=g)
        ops.clear()
        assert torch.equal(lin(x), plain(x)), rows
        assert ops[0] == ("w4a16_linear" if rows <= DUAL_ROWS else "w4a16_linear_frag"), (rows, ops)
    assert "packed_small" in dict(lin.named_buffers())  # moves with the module (.to)
    assert lin.repack_frag() and lin.layout == "split_frag" and lin.packed_small is None
    assert lin.repack_dual() and lin.layout == "dual_frag"
    lin.repack_checkpoint()
    assert lin.layout == "checkpoint" and lin.packed_small is None and torch.equal(lin.packed, plain.packed)
    odd = NVFP4Linear(quantize_nvfp4(torch.randn(96, 256, generator=g)), reg)
    assert not odd.repack_dual() and odd.layout == "checkpoint" and odd.packed_small is None
