"""Build the model with packed NVFP4 / FP8 weights, without dequantising: `load_quantized`.

    model = load_quantized("/path/to/Qwen3.6-35B-A3B-NVFP4", device="cuda")        # checkpoint directory
    model = load_quantized(tensors, cfg, device="cuda")                            # packed tensors (random_weights)

Which layer gets which format is decided by the checkpoint's `quantization_config.quantized_layers`
(`checkpoint.QuantTable`, through `load_checkpoint(packed=True)`), or for a tensor dict by the value types:
`NVFP4Tensor` -> `NVFP4Linear` / `NVFP4Experts` / `NVFP4SwiGLU`, `FP8Tensor` -> `FP8Linear`, a plain tensor -> the
reference model's parameter in `dtype`. The reference model is first built on the meta device (no memory), its
quantised submodules are replaced by packed ones holding the given tensors, and the remaining (BF16) parameters are
assigned, so the full-size model never exists dequantised: ~20.8 GB on the GPU instead of ~70 GB in bf16.

Full size (computed from the shapes, design doc 5): routed experts 32.21 B params x 0.5625 B = 18.1 GB (+ 0.13 GB of
per-row fp32 global scales); FP8 GDN / attention projections 1.28 GB; lm_head 0.29 GB; shared experts 0.07 GB; BF16
embeddings 1.02 GB, routers 0.04 GB, the rest < 0.02 GB.

W4A4 `NVFP4` layers (activation scales present; the checkpoint's `quantized_layers` say `NVFP4`, not `W4A16_NVFP4`):
the dense ones (lm_head, shared expert, any other linear) get their `input_scale` and the `w4a4` switch: "auto" runs
native W4A4 where the registry picks `nvfp4_w4a4_linear`'s fast path (Blackwell, compute capability >= 10) and W4A16
elsewhere, "off" always W4A16, "emulate" the W4A4 reference numerics on any device (`model/quantized.py`). Routed
experts exported as W4A4 run as W4A16 (no grouped W4A4 GEMM). What runs is logged at load.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

import torch
from torch import nn

from kernels.nvfp4 import FP8Tensor, NVFP4Tensor

from .checkpoint import NVFP4, CheckpointError, LoadedCheckpoint, load_checkpoint
from .config import QwenConfig
from .model import QwenForCausalLM
from .model.moe import Experts, SwiGLU
from .model.quantized import FP8Linear, NVFP4Experts, NVFP4Linear, NVFP4SwiGLU, check_w4a4_mode

log = logging.getLogger(__name__)

Packed = torch.Tensor | NVFP4Tensor | FP8Tensor


# "dual" layouts: the swap-AB kernel's layout plus a checkpoint-layout copy for the decode GEMV's small batches
# (`NVFP4Experts.repack_dual`); "dual_frag" has the fragment-ordered split halves (`kernels.w4a16_swapped.split_frag`)
# as its large layout
DUAL_LAYOUTS = {"dual": "split_halves", "dual_frag": "split_frag"}


def check_expert_layout(expert_layout: str) -> None:
    """"auto", a name of `kernels.w4a16_gemm.EXPERT_LAYOUTS`, "dual" or "dual_frag"; else ValueError naming them."""
    from kernels.w4a16_gemm import EXPERT_LAYOUTS

    choices = ("auto", *EXPERT_LAYOUTS, *DUAL_LAYOUTS)
    if expert_layout not in choices:
        raise ValueError(f"expert_layout must be one of {' | '.join(choices)}, got {expert_layout!r}")


def resolve_expert_layout(expert_layout: str, device: torch.device | str) -> str:
    """"auto" -> the layout the loader stores on `device`: "dual_frag" on Hopper (split halves in wgmma fragment order
    for the swap-AB kernel plus a checkpoint-layout copy that decode batches of <= 4 tokens read with the GEMV,
    `kernels/w4a16_gemv.py`; H200, one model side by side: run 15, with a tile-major copy for the grouped kernel, lone
    decode 213.6 -> 238.8 tok/s, 32 streams 2,101 / 2,098 tok/s and TTFT 44.7 / 44.4 ms, for +16 GB of weights; run
    16, the GEMV: 235.0 -> 283.5 tok/s; run 21, fragment order against plain split halves: 32 streams 2,283.1 ->
    2,625.2 tok/s, TTFT 44.5 -> 39.4 ms, lone decode equal); otherwise
    `kernels.w4a16_gemm.default_expert_layout`'s (tile-major on other GPUs, the checkpoint's on the CPU). Any other
    name is returned as given."""
    from kernels.w4a16_gemm import LAYOUT_NAMES, default_expert_layout

    check_expert_layout(expert_layout)
    if expert_layout != "auto":
        return expert_layout
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return "dual_frag"
    return LAYOUT_NAMES[default_expert_layout(device)]


def check_shared_expert_in_moe(value: bool | str) -> bool | str:
    """True, False or "auto" (the engine config, the loader and `set_shared_expert_in_moe` all take these)."""
    if not isinstance(value, bool) and value != "auto":
        raise ValueError(f"shared_expert_in_moe must be true, false or 'auto', got {value!r}")
    return value


def resolve_shared_expert_in_moe(shared_expert_in_moe: bool | str, expert_layout: str,
                                 device: torch.device | str) -> bool:
    """"auto" -> whether the loader stacks each shared expert with the routed experts: where the experts take the
    dual_frag layout (`resolve_expert_layout`: Hopper), the only place it was measured to pay (H200, the shared expert
    as a 9th pair in the swap-AB launches of 5-113 tokens, the decode GEMV's <= 4 tokens keeping the dense one: Qwen
    run 27, 32 streams 2,623.9 -> 2,703.9 tok/s, lone decode 312.3 / 313.0 tok/s, TTFT 39.9 / 39.6 ms; runs 19, 23:
    +2.7%, +3.9% at 32 streams). True / False as given."""
    if isinstance(check_shared_expert_in_moe(shared_expert_in_moe), bool):
        return shared_expert_in_moe
    return resolve_expert_layout(expert_layout, device) == "dual_frag"


def apply_expert_layout(experts: NVFP4Experts, expert_layout: str, device: torch.device | str) -> bool:
    """Repack `experts` for `expert_layout`: "auto" (`resolve_expert_layout`: dual_frag on Hopper, tile-major on other
    GPUs, the checkpoint's on the CPU), a name of `EXPERT_LAYOUTS`, or "dual" (split halves plus a checkpoint-layout
    copy for small decode batches, `NVFP4Experts.repack_dual`; "dual_frag": the same with split halves in fragment
    order). False: the shapes do not split into its tiles (unchanged)."""
    from kernels.w4a16_gemm import EXPERT_LAYOUTS

    expert_layout = resolve_expert_layout(expert_layout, device)
    if expert_layout in DUAL_LAYOUTS:
        return experts.repack_dual(large_layout=EXPERT_LAYOUTS[DUAL_LAYOUTS[expert_layout]])
    return experts.repack(EXPERT_LAYOUTS[expert_layout])


def load_quantized(
    source: str | os.PathLike | LoadedCheckpoint | Mapping[str, Packed],
    cfg: QwenConfig | None = None,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    quantize_activations: bool = True,
    fuse_shared_expert: bool = True,
    gdn_chunk_size: int = 64,
    registry=None,
    w4a4: str = "auto",
    expert_layout: str = "auto",
    shared_expert_in_moe: bool | str = "auto",
) -> QwenForCausalLM:
    """A `QwenForCausalLM` whose quantised layers are packed modules (see the module docstring).

    source: a checkpoint directory, a `LoadedCheckpoint` from `load_checkpoint(packed=True)`, or a mapping of our
    parameter names to tensors / NVFP4Tensor / FP8Tensor (then `cfg` is required). dtype: the activation and BF16
    parameter dtype. quantize_activations=False runs the FP8 layers weight-only (oracle isolation, `quantized.py`).
    fuse_shared_expert: one [2I, H] NVFP4 GEMM for the shared expert's gate and up when both are NVFP4.
    w4a4: "auto" | "off" | "emulate", for the dense layers the checkpoint exports as W4A4 (module docstring); layers
    without an activation scale (this project's W4A16 checkpoint, tensor mappings) are W4A16 whatever it says.
    expert_layout: the routed experts' byte layout (`apply_expert_layout`; same values): "checkpoint", "tile_major",
    "split_halves", "split_frag" (split halves in wgmma fragment order), "dual" (split halves + a checkpoint-layout
    copy for decode batches of <= 4 tokens, the GEMV's: +1 packed copy of the experts), "dual_frag" (the same on
    split_frag) or "auto" (`resolve_expert_layout`): dual_frag on Hopper, tile-major on other GPUs, the checkpoint's
    on the CPU.
    shared_expert_in_moe: also stack each layer's shared expert after its routed experts (True; "auto": where the
    experts take the dual_frag layout, `resolve_shared_expert_in_moe`; `NVFP4Experts(shared=)`, +1.7 MB per layer
    and expert copy at full size, dual_frag keeping two) where both are NVFP4 W4A16 of the same width, so that
    `SparseMoE` can run it inside the grouped launches (it does when `SparseMoE.shared_in_experts` is set; the dense module stays for the
    other calls). The stacking copies every layer's expert stacks while the source tensors are alive, so the
    load-time peak holds a second copy of all experts until this function returns (~15 GB at full size).
    Raises `CheckpointError` naming every missing, unexpected or mis-shaped tensor.
    """
    check_expert_layout(expert_layout)
    check_w4a4_mode(w4a4)
    shared_auto = shared_expert_in_moe == "auto"
    shared_expert_in_moe = resolve_shared_expert_in_moe(shared_expert_in_moe, expert_layout, device)
    algos: dict[str, str] = {}
    input_scales: Mapping[str, torch.Tensor] = {}
    if isinstance(source, (str, os.PathLike)):
        source = load_checkpoint(source, packed=True, dtype=dtype, device=device)
    if isinstance(source, LoadedCheckpoint):
        if cfg is not None and cfg != source.config:
            raise CheckpointError(f"checkpoint is for {source.config}, asked for {cfg}")
        cfg, algos, tensors, input_scales = source.config, source.algos, source.tensors, source.input_scales
    else:
        if cfg is None:
            raise ValueError("load_quantized(tensors, cfg): a tensor mapping needs its QwenConfig")
        tensors = source
    # W4A4 exports: our parameter name -> static activation scale (the checkpoint requires one for `NVFP4` layers)
    act_scales = {k: input_scales[k] for k, a in algos.items() if a == NVFP4 and k in input_scales}
    _log_w4a4(act_scales, tensors, w4a4)

    device = torch.device(device)
    with torch.device("meta"):
        model = QwenForCausalLM(cfg, gdn_chunk_size=gdn_chunk_size)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"{k}: unexpected tensor (the model has no such parameter)" for k in tensors if k not in shapes]
    problems += [f"{k}: missing" for k in shapes if k not in tensors]
    problems += [f"{k}: shape {tuple(v.shape)}, expected {shapes[k]}" for k, v in tensors.items()
                 if k in shapes and tuple(v.shape) != shapes[k]]
    if problems:
        raise CheckpointError(f"load_quantized: {len(problems)} problem(s)\n  " + "\n  ".join(problems[:40]))

    packed = {k: v for k, v in tensors.items() if isinstance(v, (NVFP4Tensor, FP8Tensor))}
    to_dev = lambda t: type(t)(*(None if x is None else x.to(device) for x in t))  # noqa: E731
    done: set[str] = set()
    for name, mod in list(model.named_modules()):
        prefix = name + "." if name else ""
        if isinstance(mod, Experts):
            gu, dn = packed.get(prefix + "gate_up_proj"), packed.get(prefix + "down_proj")
            if gu is None and dn is None:
                continue
            if not (isinstance(gu, NVFP4Tensor) and isinstance(dn, NVFP4Tensor)):
                raise CheckpointError(f"{name}: routed experts must be both NVFP4 or both dense, got "
                                      f"{type(gu).__name__} gate_up and {type(dn).__name__} down")
            experts = NVFP4Experts(to_dev(gu), to_dev(dn), registry)  # repacked below, after the shared expert
            _replace(model, name, experts)
            done |= {prefix + "gate_up_proj", prefix + "down_proj"}
        elif isinstance(mod, SwiGLU) and fuse_shared_expert:
            ws = [packed.get(f"{prefix}{p}_proj.weight") for p in ("gate", "up", "down")]
            if all(isinstance(w, NVFP4Tensor) for w in ws):
                s_gate, s_up, s_down = (act_scales.get(f"{prefix}{p}_proj.weight") for p in ("gate", "up", "down"))
                # gate and up read the same input: ModelOpt's two amaxes agree; the max saturates neither. W4A4 for
                # the fused GEMM only if both halves were exported W4A4.
                s_gate_up = None if s_gate is None or s_up is None else torch.maximum(s_gate, s_up).to(device)
                _replace(model, name, NVFP4SwiGLU(*(to_dev(w) for w in ws), registry=registry,
                                                  gate_up_input_scale=s_gate_up,
                                                  down_input_scale=None if s_down is None else s_down.to(device),
                                                  w4a4=w4a4))
                done |= {f"{prefix}{p}_proj.weight" for p in ("gate", "up", "down")}
    for key, value in packed.items():
        if key in done:
            continue
        module_name, _, leaf = key.rpartition(".")
        mod = model.get_submodule(module_name) if module_name else model
        if leaf != "weight" or not isinstance(mod, nn.Linear):
            raise CheckpointError(f"{key}: packed {type(value).__name__} for a parameter that is not an nn.Linear "
                                  "weight; no packed module implements it")
        s_in = act_scales.get(key)
        new = (NVFP4Linear(to_dev(value), registry, None if s_in is None else s_in.to(device), w4a4)
               if isinstance(value, NVFP4Tensor) else FP8Linear(to_dev(value), quantize_activations, registry))
        _replace(model, module_name, new)

    for name, mod in model.named_modules():
        experts = getattr(mod, "experts", None)
        if not isinstance(experts, NVFP4Experts):
            continue
        shared = getattr(mod, "shared_expert", None)
        routed_only = experts
        if shared_expert_in_moe and isinstance(shared, NVFP4SwiGLU) and not (
                shared.gate_up_proj.w4a4_export or shared.down_proj.w4a4_export):
            try:
                experts = NVFP4Experts(experts.gate_up_nvfp4, experts.down_nvfp4, registry,
                                       shared=(shared.gate_up_proj.weight_nvfp4, shared.down_proj.weight_nvfp4))
            except ValueError as exc:  # other widths: the dense shared expert only
                log.warning("%s: shared expert not stacked with the routed experts: %s", name, exc)
            else:
                mod.experts = experts
        if not apply_expert_layout(experts, expert_layout, device):
            if shared_auto and experts is not routed_only:  # "auto" stacks only where the layout applies
                mod.experts = experts = routed_only
            log.warning("%s.experts: expert shapes do not split into the %s layout's tiles; checkpoint layout kept",
                        name, expert_layout)

    # the BF16 rest: assign real tensors in place of the meta parameters
    for name, p in list(model.named_parameters()):
        value = tensors[name]
        module_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(module_name) if module_name else model
        mod._parameters[leaf] = nn.Parameter(value.detach().to(device=device, dtype=dtype), requires_grad=False)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"load_quantized: tensors left unassigned: {left[:8]}")
    return model.eval()


def _log_w4a4(act_scales: Mapping[str, torch.Tensor], tensors: Mapping[str, Packed], mode: str) -> None:
    """Say once, at load, how the checkpoint's W4A4 layers will run."""
    experts = sorted(k for k in act_scales if isinstance(tensors.get(k), NVFP4Tensor) and tensors[k].packed.dim() == 3)
    dense = sorted(k for k in act_scales if k not in experts)
    if experts:
        log.warning("%d NVFP4 (W4A4) routed-expert stacks run as W4A16 (bf16 activations; no grouped W4A4 GEMM), "
                    "e.g. %s", len(experts), experts[0])
    if dense:
        how = {"auto": "native W4A4 where the registry chooses nvfp4_w4a4_linear's fast path (compute capability "
                       ">= 10), W4A16 elsewhere",
               "off": "W4A16 (bf16 activations)",
               "emulate": "emulated W4A4 (reference numerics, slow)"}[mode]
        log.warning("%d NVFP4 (W4A4) dense layers, w4a4=%s: %s; e.g. %s", len(dense), mode, how, dense[0])


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def model_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters and buffers by storage dtype (what the model holds, for the memory report)."""
    out: dict[str, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        key = str(t.dtype).replace("torch.", "")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out
