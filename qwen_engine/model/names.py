"""Parameter names: ours <- the ModelOpt / HF-hub checkpoint <- transformers' in-memory `Qwen3_5MoeForCausalLM`.

Our module tree uses transformers' attribute names, minus the `model.` level, so the mapping is a prefix change for
every tensor except the routed experts, which the checkpoint stores per expert (design doc section 2.3) and we hold
stacked and gate/up-fused like transformers (`moe.py`). Quantised checkpoints add sibling tensors next to a module's
`weight` (`weight_scale`, `weight_scale_2`, `input_scale`); `map_checkpoint_name` maps those too. The MTP head
(`mtp.*`) and the vision tower (`model.visual.*`) are not part of the text model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_CK = "model.language_model."
_TF = "model."

# (ours, checkpoint tensor, transformers parameter, placement of the checkpoint tensor in ours)
# {L}: layer index, {E}: expert index. Placement "" = as is; "expert E, rows gate|up" = rows [0, I) | [I, 2I) of
# gate_up_proj[E]; "expert E" = down_proj[E].
PARAM_NAMES: tuple[tuple[str, str, str, str], ...] = (
    ("embed_tokens.weight", _CK + "embed_tokens.weight", _TF + "embed_tokens.weight", ""),
    ("norm.weight", _CK + "norm.weight", _TF + "norm.weight", ""),
    ("lm_head.weight", "lm_head.weight", "lm_head.weight", ""),
    # every layer
    *(
        (f"layers.{{L}}.{p}", f"{_CK}layers.{{L}}.{p}", f"{_TF}layers.{{L}}.{p}", "")
        for p in (
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            # Gated DeltaNet layers
            "linear_attn.in_proj_qkv.weight",  # [q | k | v] rows: 2048 + 2048 + 4096
            "linear_attn.in_proj_z.weight",
            "linear_attn.in_proj_b.weight",
            "linear_attn.in_proj_a.weight",
            "linear_attn.conv1d.weight",  # [conv_dim, 1, K]
            "linear_attn.A_log",
            "linear_attn.dt_bias",
            "linear_attn.norm.weight",
            "linear_attn.out_proj.weight",
            # full-attention layers
            "self_attn.q_proj.weight",  # per head: head_dim query rows then head_dim gate rows
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            # MoE
            "mlp.gate.weight",  # router [E, H]
            "mlp.shared_expert.gate_proj.weight",
            "mlp.shared_expert.up_proj.weight",
            "mlp.shared_expert.down_proj.weight",
            "mlp.shared_expert_gate.weight",  # [1, H]
        )
    ),
    ("layers.{L}.mlp.experts.gate_up_proj", _CK + "layers.{L}.mlp.experts.{E}.gate_proj.weight",
     _TF + "layers.{L}.mlp.experts.gate_up_proj", "expert E, rows gate"),
    ("layers.{L}.mlp.experts.gate_up_proj", _CK + "layers.{L}.mlp.experts.{E}.up_proj.weight",
     _TF + "layers.{L}.mlp.experts.gate_up_proj", "expert E, rows up"),
    ("layers.{L}.mlp.experts.down_proj", _CK + "layers.{L}.mlp.experts.{E}.down_proj.weight",
     _TF + "layers.{L}.mlp.experts.down_proj", "expert E"),
)

IGNORED_CHECKPOINT_PREFIXES = ("mtp.", "model.visual.")  # MTP head, vision tower
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")  # siblings of `weight` in ModelOpt exports


@dataclass(frozen=True)
class MappedName:
    ours: str  # our parameter name, e.g. "layers.0.mlp.experts.gate_up_proj"
    expert: int | None = None  # routed experts: which row-block of the stacked parameter
    half: str | None = None  # "gate" | "up" for gate_up_proj (rows [0, I) / [I, 2I) of that expert), else None
    # the checkpoint tensor's role: "weight", a quantisation sibling of that weight ("weight_scale", "weight_scale_2",
    # "input_scale"; `ours` is then the parameter it scales), or None for bare parameters (A_log, dt_bias)
    suffix: str | None = "weight"


def _pattern(template: str) -> re.Pattern:
    rx = re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(rx + "$")


_CHECKPOINT_RULES = [(_pattern(ck), ours, place) for ours, ck, _, place in PARAM_NAMES]


def map_checkpoint_name(name: str) -> MappedName | None:
    """Checkpoint tensor name -> where it goes in our model; None for parts we do not build (MTP, vision).

    Raises KeyError for a name the table does not know.
    """
    if name.startswith(IGNORED_CHECKPOINT_PREFIXES):
        return None
    suffix = "weight" if name.endswith(".weight") else None
    base = name
    for s in QUANT_SUFFIXES:
        if name.endswith("." + s):
            suffix, base = s, name[: -len(s)] + "weight"
            break
    for rx, ours, place in _CHECKPOINT_RULES:
        m = rx.match(base)
        if m:
            layer = m.groupdict().get("L")
            target = ours.replace("{L}", layer) if layer is not None else ours
            expert = int(m["E"]) if "E" in m.groupdict() else None
            half = place.rsplit(" ", 1)[-1] if place.endswith(("gate", "up")) else None
            return MappedName(target, expert, half, suffix)
    raise KeyError(f"checkpoint tensor {name!r} matches no entry of PARAM_NAMES")


def transformers_to_ours(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a transformers `Qwen3_5MoeForCausalLM` state dict to ours (a prefix change; expert layout is the same)."""
    out = {}
    for name, t in state_dict.items():
        if name == "lm_head.weight":
            out[name] = t
        elif name.startswith(_TF):
            out[name[len(_TF):]] = t
        else:
            raise KeyError(f"unexpected transformers parameter {name!r}")
    return out


def checkpoint_to_ours(tensors, num_experts: int) -> dict[str, torch.Tensor]:
    """Dense (BF16 / dequantised) checkpoint tensors by checkpoint name -> our state dict; experts stacked and fused.

    `tensors` maps checkpoint names to tensors (a dict, or anything with `.items()`); MTP / vision tensors are
    skipped. Quantisation siblings are refused: dequantise first (that is the loader's job).
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str | None, torch.Tensor]]] = {}
    for name, t in tensors.items():
        m = map_checkpoint_name(name)
        if m is None:
            continue
        if m.suffix not in ("weight", None):
            raise ValueError(f"{name}: quantised tensor in a dense load; dequantise before mapping")
        if m.expert is None:
            out[m.ours] = t
        else:
            experts.setdefault(m.ours, {}).setdefault(m.expert, {})[m.half] = t
    for ours, per_expert in experts.items():
        missing = sorted(set(range(num_experts)) - set(per_expert))
        if missing:
            raise ValueError(f"{ours}: experts {missing[:8]}{'...' if len(missing) > 8 else ''} missing")
        if ours.endswith("gate_up_proj"):
            halves = [per_expert[e] for e in range(num_experts)]
            incomplete = [e for e, h in enumerate(halves) if set(h) != {"gate", "up"}]
            if incomplete:
                raise ValueError(f"{ours}: experts {incomplete[:8]} lack gate_proj or up_proj")
            out[ours] = torch.stack([torch.cat((h["gate"], h["up"])) for h in halves])
        else:
            out[ours] = torch.stack([per_expert[e][None] for e in range(num_experts)])
    return out
