"""Checkpoint loading (`qwen_engine/checkpoint.py`) on synthetic checkpoints at the tiny config:

- the ModelOpt mixed-precision layout (sharded safetensors + index + config.json with `quantization_config`), written
  from random dense weights; its keys, dtypes, shapes and bytes are checked here against the design doc (section 2)
  and against `kernels/nvfp4.py` applied independently, so writer and loader cannot agree on a wrong layout;
- loading it dequantised (bit-exact against quantise -> dequantise of the source) and packed (bytes and scales);
- the BF16 layouts: the hub layout and transformers' own `save_pretrained` of `Qwen3_5MoeForCausalLM`;
- every kind of malformed checkpoint raises `CheckpointError` naming the problem;
- the loaded weights drive our model and transformers' to the same logits.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.nvfp4 import (
    FP8Tensor,
    NVFP4Tensor,
    dequantize_fp8,
    dequantize_nvfp4,
    quantize_fp8,
    quantize_nvfp4,
)
from qwen_engine.checkpoint import (
    MODELOPT_RECIPE,
    CheckpointError,
    checkpoint_names,
    hf_text_config,
    load_checkpoint,
    load_into,
    read_config,
    recipe_layers,
    save_checkpoint,
)
from qwen_engine.config import QwenConfig
from qwen_engine.model import QwenForCausalLM, transformers_to_ours

CFG = QwenConfig.tiny()
E, I, H = CFG.num_experts, CFG.moe_intermediate_size, CFG.hidden_size
CK = "model.language_model.layers"
FP8_MODULES = {  # design doc 2.2: FP8 W8A8 static per-tensor
    **{f"{CK}.{L}.linear_attn.{p}": L
       for L in CFG.linear_attention_layers for p in ("in_proj_qkv", "in_proj_z", "out_proj")},
    **{f"{CK}.{L}.self_attn.{p}_proj": L for L in CFG.full_attention_layers for p in "qkvo"},
}
NVFP4_MODULES = {  # W4A16_NVFP4: routed experts (per expert), shared expert, lm_head
    "lm_head", *(f"{CK}.{L}.mlp.shared_expert.{p}_proj" for L in range(4) for p in ("gate", "up", "down")),
    *(f"{CK}.{L}.mlp.experts.{e}.{p}_proj" for L in range(4) for e in range(E) for p in ("gate", "up", "down")),
}


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def ours_to_hub(name: str) -> str:
    return name if name == "lm_head.weight" else "model.language_model." + name


@pytest.fixture(scope="module")
def source() -> dict[str, torch.Tensor]:
    """Random dense fp32 weights in our names; norms randomised so that `1 + w` is exercised."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in QwenForCausalLM(CFG).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, shape in shapes.items():
        std = 0.1 if ("norm" in k or "A_log" in k or "dt_bias" in k) else 0.08
        sd[k] = torch.randn(shape, generator=g) * std
    return sd


@pytest.fixture(scope="module")
def modelopt_dir(tmp_path_factory, source) -> Path:
    path = tmp_path_factory.mktemp("modelopt")
    save_checkpoint(path, CFG, source, max_shard_bytes=64 * 1024)  # ~6 shards at the tiny size
    return path


def read_all(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for f in sorted(set(index.values())):
        with safe_open(path / f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def rewrite(src: Path, dst: Path, tensors: dict, config_edit=None, index_edit=None) -> Path:
    """Write `tensors` as two shards + index next to src's (optionally edited) config.json."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        f = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, dst / f, metadata={"format": "pt"})
        weight_map.update({k: f for k in part})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    if index_edit:
        index_edit(index)
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def expected_dequant(source) -> dict[str, torch.Tensor]:
    """The weights the ModelOpt checkpoint must dequantise to, computed with kernels/nvfp4.py directly."""
    out = {}
    for k, w in source.items():
        module = ours_to_hub(k).removesuffix(".weight")
        if module in FP8_MODULES:
            out[k] = dequantize_fp8(*quantize_fp8(w))
        elif module in NVFP4_MODULES:
            out[k] = dequantize_nvfp4(*quantize_nvfp4(w))
        elif k.endswith("experts.gate_up_proj"):  # per expert; gate and up share ModelOpt's synced global scale
            out[k] = torch.stack([dequantize_nvfp4(*quantize_nvfp4(w[e].view(2, I, H), w[e].abs().amax() / 2688))
                                  .view(2 * I, H) for e in range(E)])
        elif k.endswith("experts.down_proj"):
            out[k] = torch.stack([dequantize_nvfp4(*quantize_nvfp4(w[e])) for e in range(E)])
        else:
            out[k] = w.to(torch.bfloat16).float()
    return out


# ---- the written layout is ModelOpt's ------------------------------------------------------------------------------
def test_written_checkpoint_has_the_modelopt_layout(modelopt_dir, source):
    files = sorted(p.name for p in modelopt_dir.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "model.safetensors.index.json" in files and "config.json" in files
    t = read_all(modelopt_dir)
    index = json.loads((modelopt_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(t)

    expect = {}  # name -> (dtype, shape), from design doc 2.3 at the tiny sizes
    for m in NVFP4_MODULES:
        n, k = (H, I) if m.endswith("down_proj") else (I, H)
        if m == "lm_head":
            n, k = CFG.vocab_size, H
        expect |= {f"{m}.weight": (torch.uint8, (n, k // 2)), f"{m}.weight_scale": (torch.float8_e4m3fn, (n, k // 16)),
                   f"{m}.weight_scale_2": (torch.float32, ()), f"{m}.input_scale": (torch.float32, ())}
    for m in FP8_MODULES:
        shape = tuple(source[m.removeprefix("model.language_model.") + ".weight"].shape)
        expect |= {f"{m}.weight": (torch.float8_e4m3fn, shape), f"{m}.weight_scale": (torch.float32, ()),
                   f"{m}.input_scale": (torch.float32, ())}
    for k, w in source.items():
        if "experts." not in k and ours_to_hub(k).removesuffix(".weight") not in {*FP8_MODULES, *NVFP4_MODULES}:
            expect[ours_to_hub(k)] = (torch.bfloat16, tuple(w.shape))
    assert set(t) == set(expect), (sorted(set(t) - set(expect))[:5], sorted(set(expect) - set(t))[:5])
    for k, (dtype, shape) in expect.items():
        assert (t[k].dtype, tuple(t[k].shape)) == (dtype, shape), k

    # bytes: each expert quantised on its own, gate/up sharing the global scale amax(gate, up) / 2688
    for L in range(4):
        gu, dn = source[f"layers.{L}.mlp.experts.gate_up_proj"], source[f"layers.{L}.mlp.experts.down_proj"]
        for e in range(E):
            g = gu[e].abs().amax() / 2688
            for half, rows in (("gate", slice(0, I)), ("up", slice(I, 2 * I))):
                p, s, g2 = quantize_nvfp4(gu[e, rows], g)
                m = f"{CK}.{L}.mlp.experts.{e}.{half}_proj"
                assert torch.equal(t[m + ".weight"], p) and torch.equal(bits(t[m + ".weight_scale"]), bits(s))
                assert bits(t[m + ".weight_scale_2"]) == bits(g2)
            p, s, g2 = quantize_nvfp4(dn[e])
            m = f"{CK}.{L}.mlp.experts.{e}.down_proj"
            assert torch.equal(t[m + ".weight"], p) and bits(t[m + ".weight_scale_2"]) == bits(g2)
    q, s = quantize_fp8(source["layers.3.self_attn.q_proj.weight"])
    assert torch.equal(bits(t[f"{CK}.3.self_attn.q_proj.weight"]), bits(q))
    assert bits(t[f"{CK}.3.self_attn.q_proj.weight_scale"]) == bits(s)

    cfg = json.loads((modelopt_dir / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["producer"]["name"]) == ("modelopt", "MIXED_PRECISION", "modelopt")
    layers = qc["quantized_layers"]
    assert {m for m, e in layers.items() if e == {"quant_algo": "FP8"}} == set(FP8_MODULES)
    w4 = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert {m for m, e in layers.items() if e == w4} == {
        "lm_head", *(f"{CK}.{L}.mlp.experts" for L in range(4)),
        *(f"{CK}.{L}.mlp.shared_expert.{p}_proj" for L in range(4) for p in ("gate", "up", "down"))}
    assert len(layers) == len(FP8_MODULES) + 1 + 4 + 12
    assert cfg["text_config"]["model_type"] == "qwen3_5_moe_text" and read_config(modelopt_dir) == CFG


# ---- loading it -----------------------------------------------------------------------------------------------------
def test_dequantised_load_is_bit_exact(modelopt_dir, source):
    ck = load_checkpoint(modelopt_dir)
    expect = expected_dequant(source)
    assert set(ck.tensors) == set(source)
    for k, w in expect.items():
        assert ck.tensors[k].dtype == torch.float32 and torch.equal(bits(ck.tensors[k]), bits(w)), k
    assert ck.algos["layers.0.mlp.experts.gate_up_proj"] == "W4A16_NVFP4"
    assert ck.algos["layers.3.self_attn.k_proj.weight"] == "FP8"
    assert ck.algos["lm_head.weight"] == "W4A16_NVFP4" and ck.algos["layers.0.mlp.gate.weight"] == "BF16"
    assert bits(ck.input_scales["layers.0.linear_attn.in_proj_z.weight"]) == bits(torch.tensor(8.0 / 448))
    assert ck.input_scales["layers.1.mlp.experts.down_proj"].shape == (E,)
    assert ck.ignored == ()
    bf = load_checkpoint(modelopt_dir, dtype=torch.bfloat16)
    for k, w in expect.items():
        assert torch.equal(bits(bf.tensors[k]), bits(w.to(torch.bfloat16))), k


def test_packed_load_matches_the_dequantised_one(modelopt_dir, source):
    pk = load_checkpoint(modelopt_dir, packed=True, dtype=torch.bfloat16)
    dq = load_checkpoint(modelopt_dir)
    for k, v in pk.tensors.items():
        if isinstance(v, NVFP4Tensor):
            assert v.packed.dtype == torch.uint8 and v.scales.dtype == torch.float8_e4m3fn
            assert v.global_scale.dtype == torch.float32 and v.global_scale.shape == v.packed.shape[:-1]  # per row
            assert v.shape == source[k].shape
            assert torch.equal(bits(dequantize_nvfp4(*v)), bits(dq.tensors[k])), k
        elif isinstance(v, FP8Tensor):
            assert v.data.dtype == torch.float8_e4m3fn and v.scale.shape == () and v.input_scale.shape == ()
            assert torch.equal(bits(dequantize_fp8(v.data, v.scale)), bits(dq.tensors[k])), k
        else:
            assert v.dtype == torch.bfloat16 and torch.equal(bits(v), bits(dq.tensors[k].to(torch.bfloat16))), k
    assert sum(isinstance(v, NVFP4Tensor) for v in pk.tensors.values()) == 1 + 4 * 3 + 4 * 2
    assert sum(isinstance(v, FP8Tensor) for v in pk.tensors.values()) == len(FP8_MODULES)
    # expert stacks: bytes of expert e are the bytes of its own tensor; gate rows then up rows
    gu = pk.tensors["layers.2.mlp.experts.gate_up_proj"]
    src = source["layers.2.mlp.experts.gate_up_proj"]
    for e in (0, E - 1):
        p, s, g = quantize_nvfp4(src[e, I:], src[e].abs().amax() / 2688)
        assert torch.equal(gu.packed[e, I:], p) and torch.equal(bits(gu.scales[e, I:]), bits(s))
        assert (gu.global_scale[e] == g).all()


def test_unsynced_gate_up_scales_stay_exact(tmp_path, source):
    """ModelOpt normally shares one global scale between gate and up; if not, per-row global scales keep it exact."""
    save_checkpoint(tmp_path, CFG, source, sync_gate_up=False)
    pk = load_checkpoint(tmp_path, packed=True)
    gu = pk.tensors["layers.0.mlp.experts.gate_up_proj"]
    src = source["layers.0.mlp.experts.gate_up_proj"][1]
    assert gu.global_scale[1, 0] == src[:I].abs().amax() / 2688 and gu.global_scale[1, I] == src[I:].abs().amax() / 2688
    assert gu.global_scale[1, 0] != gu.global_scale[1, I]
    expect = torch.cat([dequantize_nvfp4(*quantize_nvfp4(src[:I])), dequantize_nvfp4(*quantize_nvfp4(src[I:]))])
    dq = load_checkpoint(tmp_path).tensors["layers.0.mlp.experts.gate_up_proj"][1]
    assert torch.equal(bits(dq), bits(expect)) and torch.equal(bits(dequantize_nvfp4(*gu)[1]), bits(expect))


def test_hf_quant_config_json_and_skipped_mtp_vision(tmp_path, modelopt_dir):
    """hf_quant_config.json instead of config.json's block; MTP and vision tensors are skipped and reported."""
    t = read_all(modelopt_dir)
    qc = json.loads((modelopt_dir / "config.json").read_text())["quantization_config"]
    t["mtp.fc.weight"] = torch.zeros(H, 2 * H, dtype=torch.bfloat16)
    t["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(I, H, dtype=torch.bfloat16)
    t["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
    dst = rewrite(modelopt_dir, tmp_path / "ck", t, config_edit=lambda c: c.pop("quantization_config"))
    hf_quant = {"producer": qc["producer"], "quantization": {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "quantized_layers": qc["quantized_layers"],
        "exclude_modules": ["mtp*", "model.visual*"]}}
    (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    ck = load_checkpoint(dst)
    ref = load_checkpoint(modelopt_dir)
    assert all(torch.equal(bits(ck.tensors[k]), bits(v)) for k, v in ref.tensors.items())
    assert len(ck.ignored) == 3 and ck.algos == ref.algos


# ---- BF16 layouts ---------------------------------------------------------------------------------------------------
def test_bf16_hub_layout_round_trip(tmp_path, source):
    written = save_checkpoint(tmp_path, CFG, source, recipe=None, max_shard_bytes=128 * 1024)
    t = read_all(tmp_path)
    assert all(v.dtype == torch.bfloat16 for v in t.values())
    assert f"{CK}.1.mlp.experts.7.up_proj.weight" in t and "quantization_config" not in json.loads(
        (tmp_path / "config.json").read_text())
    assert torch.equal(t[f"{CK}.1.mlp.experts.7.up_proj.weight"],
                       source["layers.1.mlp.experts.gate_up_proj"][7, I:].to(torch.bfloat16))
    ck = load_checkpoint(tmp_path)
    for k, w in source.items():
        assert torch.equal(ck.tensors[k], w.to(torch.bfloat16).float()) and torch.equal(ck.tensors[k], written[k]), k
    assert set(ck.algos.values()) == {"BF16"}
    pk = load_checkpoint(tmp_path, packed=True)
    assert all(isinstance(v, torch.Tensor) for v in pk.tensors.values())
    # transformers' in-memory layout stores the routed experts fused and stacked; accepted too
    t = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    for L in range(4):
        for p in ("gate_up_proj", "down_proj"):
            t[f"{CK}.{L}.mlp.experts.{p}"] = source[f"layers.{L}.mlp.experts.{p}"].to(torch.bfloat16)
    fused = load_checkpoint(rewrite(tmp_path, tmp_path / "fused", t))
    assert all(torch.equal(fused.tensors[k], v) for k, v in ck.tensors.items())


@pytest.fixture(scope="module")
def hf_model(source):
    transformers = pytest.importorskip("transformers")
    text = hf_text_config(CFG)
    hf_cfg = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k != "dtype"})
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(hf_cfg).eval()
    model.load_state_dict({("model." + k if k != "lm_head.weight" else k): v for k, v in source.items()})
    return model


def test_transformers_save_pretrained_layout_loads(tmp_path, hf_model):
    """transformers' own writer (text-only `model.layers.*` prefix, per-expert tensors, fp32)."""
    hf_model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2
    ck = load_checkpoint(tmp_path)
    assert ck.config == CFG
    expect = transformers_to_ours(hf_model.state_dict())
    assert set(ck.tensors) == set(expect)
    for k, v in expect.items():
        assert torch.equal(ck.tensors[k], v), k


# ---- the loaded weights run -----------------------------------------------------------------------------------------
def test_loaded_checkpoint_runs_like_its_dequantised_source(modelopt_dir, source, hf_model):
    ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = QwenForCausalLM(CFG).eval()
    ck = load_into(ours, modelopt_dir)
    ref = QwenForCausalLM(CFG).eval()
    ref.load_state_dict(expected_dequant(source))
    with torch.no_grad():
        logits = ours(ids)
        assert torch.equal(logits, ref(ids))  # identical weights, identical logits
        # transformers on the same dequantised weights (the fp32 oracle of the quantised model)
        hf_model.load_state_dict({("model." + k if k != "lm_head.weight" else k): v for k, v in ck.tensors.items()})
        hf_logits = hf_model(ids).logits
        assert float((logits - hf_logits).norm() / hf_logits.norm()) < 1e-4
        # and the quantised model is a perturbation of the unquantised one, not garbage: NVFP4 is ~10 % error per
        # weight, and this random 4-layer net amplifies weight noise (10 % Gaussian noise on every matrix: 0.70)
        full = QwenForCausalLM(CFG).eval()
        full.load_state_dict(source)
        rel = float((logits - full(ids)).norm() / full(ids).norm())
    assert 0 < rel < 0.5, rel


# ---- malformed checkpoints ------------------------------------------------------------------------------------------
def _mutated(tmp_path, modelopt_dir, edit=None, config_edit=None, index_edit=None):
    t = read_all(modelopt_dir)
    if edit:
        edit(t)
    return rewrite(modelopt_dir, tmp_path / "bad", t, config_edit, index_edit)


def _layers(c):
    return c["quantization_config"]["quantized_layers"]


EXP = f"{CK}.1.mlp.experts"
CASES = {
    "unknown tensor": (dict(edit=lambda t: t.update({f"{CK}.0.mlp.foo.weight": torch.zeros(2)})), "unknown tensor"),
    "missing block scale": (dict(edit=lambda t: t.pop(f"{EXP}.3.up_proj.weight_scale")), r"missing \['weight_scale'\]"),
    "missing global scale": (dict(edit=lambda t: t.pop("lm_head.weight_scale_2")), r"missing \['weight_scale_2'\]"),
    "missing fp8 input scale": (dict(edit=lambda t: t.pop(f"{CK}.3.self_attn.v_proj.input_scale")),
                                r"missing \['input_scale'\]"),
    "missing expert": (dict(edit=lambda t: [t.pop(k) for k in list(t) if k.startswith(f"{EXP}.5.down_proj.")]),
                       "experts missing from the checkpoint: 5"),
    "missing bf16 tensor": (dict(edit=lambda t: t.pop(f"{CK}.2.linear_attn.A_log")), "A_log: missing"),
    "nvfp4 weight wrong dtype": (dict(edit=lambda t: t.update({f"{EXP}.0.gate_proj.weight":
                                                               t[f"{EXP}.0.gate_proj.weight"].to(torch.int8)})),
                                 "expected uint8"),
    "fp8 weight wrong dtype": (dict(edit=lambda t: t.update({f"{CK}.0.linear_attn.out_proj.weight":
                                                             t[f"{CK}.0.linear_attn.out_proj.weight"].bfloat16()})),
                               "expected float8_e4m3fn"),
    "block scales wrong shape": (dict(edit=lambda t: t.update({f"{EXP}.2.down_proj.weight_scale":
                                                               t[f"{EXP}.2.down_proj.weight_scale"][:, :1]})),
                                 r"weight_scale: shape \(64, 1\), expected \(64, 2\)"),
    "scale not scalar": (dict(edit=lambda t: t.update({"lm_head.weight_scale_2": torch.ones(2)})), "float32 scalar"),
    "zero global scale": (dict(edit=lambda t: t.update({"lm_head.weight_scale_2": torch.tensor(0.0)})),
                          "not positive and finite"),
    "unsupported algo": (dict(config_edit=lambda c: _layers(c).update({"lm_head": {"quant_algo": "INT4_AWQ"}})),
                         "quant_algo 'INT4_AWQ'"),
    "nvfp4 group size": (dict(config_edit=lambda c: _layers(c).update(
        {"lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 32}})), "group_size 32"),
    "not mixed precision": (dict(config_edit=lambda c: c["quantization_config"].update({"quant_algo": "NVFP4"})),
                            "only MIXED_PRECISION"),
    "other quant method": (dict(config_edit=lambda c: c["quantization_config"].update({"quant_method": "gptq"})),
                           "quant_method 'gptq'"),
    "quantized but not listed": (dict(config_edit=lambda c: _layers(c).pop("lm_head")),
                                 "missing from quantized_layers"),
    "listed but absent": (dict(config_edit=lambda c: _layers(c).update(
        {f"{CK}.9.self_attn.q_proj": {"quant_algo": "FP8"}})), "matches no tensor"),
    "w4a4 without input scale": (dict(edit=lambda t: t.pop("lm_head.input_scale"), config_edit=lambda c: _layers(c)
                                      .update({"lm_head": {"quant_algo": "NVFP4", "group_size": 16}})),
                                 r"missing \['input_scale'\]"),
    "index lists an absent tensor": (dict(index_edit=lambda ix: ix["weight_map"].update(
        {"lm_head.bias": "model-00001-of-00002.safetensors"})), "absent from it"),
    "shard holds an unindexed tensor": (dict(index_edit=lambda ix: ix["weight_map"].pop("lm_head.weight_scale")),
                                        "not in the index"),
    "layer beyond the config": (dict(config_edit=lambda c: c["text_config"].update(
        {"num_hidden_layers": 3, "layer_types": c["text_config"]["layer_types"][:3]})),
                                "which this config's model does not have"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_checkpoints_raise(case, tmp_path, modelopt_dir):
    kwargs, message = CASES[case]
    bad = _mutated(tmp_path, modelopt_dir, **kwargs)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(bad)


def test_missing_files(tmp_path, modelopt_dir):
    shutil.copytree(modelopt_dir, tmp_path / "ck")
    next((tmp_path / "ck").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "ck")
    (tmp_path / "empty").mkdir()
    shutil.copy(modelopt_dir / "config.json", tmp_path / "empty")
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_checkpoint(tmp_path / "empty")


def test_full_size_names_and_quantized_layers():
    """At full size (no weights): NVIDIA's recipe gives the real checkpoint's table -- 130 FP8 modules (30 GDN x 3 +
    10 attention x 4) and 161 W4A16_NVFP4 entries (40 x (experts + 3 shared-expert projections) + lm_head), design
    doc 2.2 -- and every parameter has checkpoint names of the hub layout."""
    full = QwenConfig()
    layers = recipe_layers(full, MODELOPT_RECIPE)
    algos = [e["quant_algo"] for e in layers.values()]
    assert algos.count("FP8") == 130 and algos.count("W4A16_NVFP4") == 161 and len(layers) == 291
    assert layers["model.language_model.layers.39.self_attn.q_proj"] == {"quant_algo": "FP8"}
    assert layers["model.language_model.layers.0.mlp.experts"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert "model.language_model.layers.0.linear_attn.in_proj_a" not in layers  # BF16 (design doc 2.2)
    names = checkpoint_names("layers.7.mlp.experts.gate_up_proj", full.num_experts)
    assert len(names) == 512 and names[0] == ("model.language_model.layers.7.mlp.experts.0.gate_proj.weight", 0, "gate")
    assert ("model.language_model.layers.7.mlp.experts.255.up_proj.weight", 255, "up") in names
    assert checkpoint_names("lm_head.weight", 256) == [("lm_head.weight", None, None)]
