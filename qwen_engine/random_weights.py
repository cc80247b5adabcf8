"""Seeded random weights in the checkpoint's exact formats, generated on the target device (no 20 GB on disk).

    tensors = random_packed_tensors(cfg, device="cuda", seed=0)     # our names -> NVFP4Tensor / FP8Tensor / bf16
    model = load_quantized(tensors, cfg, device="cuda")              # packed model, ~20.8 GB at full size
    for name, w in iter_dequantized(model, torch.bfloat16): ...      # the same weights, dense, one at a time

Each parameter is drawn from its own generator seeded by (seed, crc32(name)), so a parameter's values do not depend
on which others are generated or in what order (on one device type: CPU and CUDA generators differ).

Values (chosen so that 40 random pre-norm layers keep activations O(1), and close to transformers' init):
  - linear and expert weights N(0, 0.02) (`initializer_range` 0.02), quantised with the real quantisers of
    `kernels/nvfp4.py` in the layer's format: NVFP4 = ModelOpt's amax/2688 global (shared by an expert's gate and up,
    as `sync_moe_gate_up_amax`), e4m3 block scales, RNE E2M1 codes; FP8 = amax/448 per tensor;
  - FP8 `input_scale` = ACTIVATION_AMAX[kind] / 448: a fixed static scale per projection kind, from the input
    magnitudes of this random model (normed inputs ~N(0, 1) reach |x| ~ 5 over 1k tokens; the GDN gated-norm output
    times silu(z) and the gated attention output are smaller), or calibrated (`calibrate_fp8_input_scales`: ModelOpt's
    max calibration, amax of the observed inputs / 448);
  - embeddings N(0, 0.02) (a residual stream that starts small: the first norm rescales it);
  - zero-centred RMSNorm weights N(0, 0.1) (so `1 + w` is exercised), GDN gated-norm weight 1 + N(0, 0.1);
  - GDN: A_log = log U(1, 16) and dt_bias = 1 (transformers' init), conv1d U(-0.5, 0.5) (PyTorch's default for
    fan-in 4); router and shared-expert gate N(0, 0.02).
"""

from __future__ import annotations

import re
import zlib
from typing import Mapping

import torch
from torch import nn

from kernels.nvfp4 import FP8Tensor, NVFP4Tensor, nvfp4_global_scale, quantize_fp8, quantize_nvfp4

from .checkpoint import (BF16, FP8, MODELOPT_RECIPE, NVFP4_ALGOS, QuantTable, _module_of, checkpoint_names,
                         recipe_layers)
from .config import QwenConfig
from .model import QwenForCausalLM
from .model.quantized import FP8Linear

WEIGHT_STD = 0.02
# static activation amax per FP8 projection kind (input_scale = amax / 448); see the module docstring
ACTIVATION_AMAX: dict[str, float] = {
    "in_proj_qkv": 8.0, "in_proj_z": 8.0, "q_proj": 8.0, "k_proj": 8.0, "v_proj": 8.0,  # RMSNorm outputs
    "out_proj": 8.0, "o_proj": 8.0,
}
EXPERT_CHUNK = 32  # experts quantised at once: bounds the quantiser's temporaries (~0.6 GB at full size)


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _dense(name: str, shape: tuple[int, ...], g: torch.Generator, device) -> torch.Tensor:
    """fp32 values of a BF16 (or pre-quantisation) parameter, by role."""
    def randn(std):
        return torch.randn(shape, generator=g, device=device) * std

    if name.endswith("linear_attn.norm.weight"):
        return 1 + randn(0.1)
    if "norm" in name:
        return randn(0.1)
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(1, 16, generator=g).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape, device=device)
    if name.endswith("conv1d.weight"):
        return torch.empty(shape, device=device).uniform_(-0.5, 0.5, generator=g)
    return randn(WEIGHT_STD)


def parameter_algos(cfg: QwenConfig, recipe: Mapping[str, str] = MODELOPT_RECIPE) -> dict[str, str]:
    """Our parameter name -> BF16 | FP8 | W4A16_NVFP4 | NVFP4, as the checkpoint a recipe writes would say."""
    with torch.device("meta"):
        shapes = QwenForCausalLM(cfg).state_dict()
    table = QuantTable({m: e["quant_algo"] for m, e in recipe_layers(cfg, recipe).items()})
    out = {}
    for ours in shapes:
        ck, expert, _ = checkpoint_names(ours, cfg.num_experts)[0]
        out[ours] = table.algo(_module_of(ck, expert)[1])
    return out


def random_packed_tensors(cfg: QwenConfig, device: torch.device | str = "cuda", seed: int = 0,
                          dtype: torch.dtype = torch.bfloat16, recipe: Mapping[str, str] = MODELOPT_RECIPE,
                          activation_amax: Mapping[str, float] | None = None) -> dict[str, torch.Tensor | tuple]:
    """Our parameter name -> the value `load_checkpoint(packed=True)` would give for a checkpoint of random weights:
    NVFP4Tensor (global scale per output row) / FP8Tensor / dense `dtype` tensor, all on `device`."""
    device = torch.device(device)
    amax = dict(ACTIVATION_AMAX, **(activation_amax or {}))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in QwenForCausalLM(cfg).state_dict().items()}
    algos = parameter_algos(cfg, recipe)
    out: dict[str, torch.Tensor | tuple] = {}
    for name, shape in shapes.items():
        g = _generator(name, seed, device)
        algo = algos[name]
        if algo == BF16:
            out[name] = _dense(name, shape, g, device).to(dtype)
        elif algo == FP8:
            data, scale = quantize_fp8(_dense(name, shape, g, device))
            kind = re.search(r"\.(\w+)\.weight$", name)[1]
            out[name] = FP8Tensor(data, scale, torch.tensor(amax.get(kind, 8.0) / 448.0, device=device))
        elif algo in NVFP4_ALGOS:
            out[name] = _random_nvfp4(name, shape, g, device)
        else:
            raise ValueError(f"{name}: algorithm {algo!r}")
    return out


def _random_nvfp4(name: str, shape: tuple[int, ...], g: torch.Generator, device) -> NVFP4Tensor:
    if len(shape) == 2:
        q = quantize_nvfp4(_dense(name, shape, g, device))
        return NVFP4Tensor(q.packed, q.scales, q.global_scale.expand(shape[0]).contiguous())
    e, n, k = shape  # stacked experts, quantised EXPERT_CHUNK at a time
    packed = torch.empty(e, n, k // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(e, n, k // 16, dtype=torch.float8_e4m3fn, device=device)
    glob = torch.empty(e, n, dtype=torch.float32, device=device)
    for lo in range(0, e, EXPERT_CHUNK):
        hi = min(lo + EXPERT_CHUNK, e)
        w = _dense(name, (hi - lo, n, k), g, device)
        # one global per expert: for gate_up that is ModelOpt's gate/up-synced scale (both halves' amax)
        gs = torch.stack([nvfp4_global_scale(w[i]) for i in range(hi - lo)])
        q = quantize_nvfp4(w, gs)
        packed[lo:hi], scales[lo:hi] = q.packed, q.scales
        glob[lo:hi] = gs[:, None]
        del w, q
    return NVFP4Tensor(packed, scales, glob)


@torch.no_grad()
def calibrate_fp8_input_scales(model: QwenForCausalLM, input_ids: torch.Tensor,
                               margin: float = 1.0) -> dict[str, float]:
    """ModelOpt-style max calibration of every FP8Linear's static input_scale: run `input_ids` [B, T] with the FP8
    layers weight-only, record each layer's input amax, set input_scale = margin * amax / 448 and switch activation
    quantisation on. Returns module name -> amax."""
    from .model.quantized import FP8_OP, _registry, forget_kernel_choices

    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    amax: dict[str, float] = {}
    hooks = []
    # the weight-only pass runs the FP8 reference on purpose (no fast FP8 kernel takes unquantised activations at
    # these shapes): asked for by name, so the registry does not report it as a fallback
    registries = {id(r): r for r in (_registry(m.registry) for m in layers.values())}
    before = {k: r.preference(FP8_OP) for k, r in registries.items()}
    for r in registries.values():
        r.set_preference("reference", FP8_OP)
    for n, m in layers.items():
        m.quantize_activations = False

        def hook(mod, args, _n=n):
            a = float(args[0].detach().abs().amax())
            amax[_n] = max(amax.get(_n, 0.0), a)

        hooks.append(m.register_forward_pre_hook(hook))
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
        for k, r in registries.items():
            r.set_preference(before[k], FP8_OP)
        forget_kernel_choices(model)  # the calibrated layers choose their kernels afresh
    for n, m in layers.items():
        m.input_scale.fill_(margin * max(amax[n], 1e-6) / 448.0)
        m.quantize_activations = True
    return amax


def to_transformers(model: nn.Module, hf_model: nn.Module) -> int:
    """Copy the dense (dequantised) weights of our packed `model` into transformers' `Qwen3_5MoeForCausalLM`, one
    tensor at a time, in the HF model's dtype and device. Returns the number of tensors copied; raises on any
    name or shape mismatch (e.g. a transformers version with another expert layout)."""
    from .model.quantized import iter_dequantized

    hf_params = dict(hf_model.named_parameters())
    seen = set()
    problems = []
    dtype = next(hf_model.parameters()).dtype
    for ours, value in iter_dequantized(model, dtype):
        name = ours if ours == "lm_head.weight" else "model." + ours
        p = hf_params.get(name)
        if p is None:
            problems.append(f"{name}: not a parameter of {type(hf_model).__name__}")
            continue
        if tuple(p.shape) != tuple(value.shape):
            problems.append(f"{name}: transformers {tuple(p.shape)} vs ours {tuple(value.shape)}")
            continue
        with torch.no_grad():
            p.copy_(value.to(p.device))
        seen.add(name)
        del value
    problems += [f"{n}: not set from our model" for n in hf_params if n not in seen]
    if problems:
        raise ValueError(f"to_transformers: {len(problems)} problem(s)\n  " + "\n  ".join(problems[:20]))
    return len(seen)
