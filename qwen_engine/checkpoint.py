"""Checkpoint loading: NVIDIA's ModelOpt mixed-precision export (`nvidia/Qwen3.6-35B-A3B-NVFP4`) and the original BF16
layout, into our parameter names (`model/names.py`), as dequantised dense weights (reference path) or packed tensors
(kernels). `save_checkpoint` writes either layout, for tests and for full-size random-weight benchmarks.

Layout (`../shared/design/qwen3.6-nvfp4.md` sections 2.1-2.3; ModelOpt 0.37 export, header of the real shards):
  - `config.json` (multimodal wrapper, numbers under `text_config`) with `quantization_config`:
    `quant_method: modelopt`, `quant_algo: MIXED_PRECISION`, `quantized_layers: {module: {quant_algo, group_size}}`,
    `ignore: [mtp*]`. Precision is driven by `quantized_layers` only (its `config_groups` mislabel the W4A16 layers
    as 4-bit activations). A `hf_quant_config.json` (`{"quantization": {quant_algo, quantized_layers, ...}}`) is
    read when `config.json` has no `quantization_config`.
  - `model.safetensors.index.json` + shards (or one `model.safetensors`); tensors `model.language_model.layers.L.*`,
    `lm_head.*`, `mtp.*` (skipped), `model.visual.*` (skipped). Text-only exports (`Qwen3_5MoeForCausalLM`) use
    `model.layers.L.*`; both are accepted.
  - W4A16_NVFP4 (routed experts `mlp.experts.E.{gate,up,down}_proj`, shared expert, lm_head): `weight` uint8 [N, K/2],
    `weight_scale` e4m3 [N, K/16], `weight_scale_2` fp32 [], optional `input_scale` fp32 [] (vestigial: W4A16 does
    not quantise activations; kept in `input_scales`). NVFP4 (W4A4 exports): the same, `input_scale` required.
  - FP8 (GDN `in_proj_qkv/in_proj_z/out_proj`, attention `q/k/v/o_proj`): `weight` e4m3 [N, K], `weight_scale` fp32
    [] = amax/448, `input_scale` fp32 [] (static activation scale).
  - everything else BF16 (embeddings, norms, router, shared-expert gate, GDN `in_proj_a/b`, conv, `A_log`, `dt_bias`).

Routed experts are stored one tensor per expert; they are stacked here into our `experts.gate_up_proj [E, 2I, H]`
(gate rows then up rows) and `experts.down_proj [E, H, I]`. In packed form every NVFP4 weight carries its global
scale per output row (`[..., N]`), so gate and up of one expert keep their own ModelOpt `weight_scale_2` exactly.
Anything unexpected (unknown or missing tensors, wrong dtypes or shapes, unsupported algorithms, scales that are not
positive and finite) raises `CheckpointError` listing every problem. Nothing here touches the network.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.nvfp4 import (
    BLOCK,
    FP8Tensor,
    NVFP4Tensor,
    dequantize_fp8,
    dequantize_nvfp4,
    nvfp4_global_scale,
    quantize_fp8,
    quantize_nvfp4,
)

from .config import QwenConfig
from .model.names import PARAM_NAMES, MappedName, map_checkpoint_name

log = logging.getLogger(__name__)

BF16 = "BF16"  # not listed in quantized_layers
FP8 = "FP8"
W4A16_NVFP4 = "W4A16_NVFP4"
NVFP4 = "NVFP4"
NVFP4_ALGOS = (W4A16_NVFP4, NVFP4)
# tensors each precision stores next to (or instead of) `weight`: (required, optional)
_SIBLINGS: dict[str, tuple[frozenset, frozenset]] = {
    BF16: (frozenset({"weight"}), frozenset()),
    FP8: (frozenset({"weight", "weight_scale", "input_scale"}), frozenset()),
    W4A16_NVFP4: (frozenset({"weight", "weight_scale", "weight_scale_2"}), frozenset({"input_scale"})),
    NVFP4: (frozenset({"weight", "weight_scale", "weight_scale_2", "input_scale"}), frozenset()),
}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# NVIDIA's recipe for Qwen3.6-35B-A3B-NVFP4 (design doc 2.2): checkpoint module name pattern -> quant_algo.
MODELOPT_RECIPE: dict[str, str] = {
    r"\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$": FP8,
    r"\.self_attn\.[qkvo]_proj$": FP8,
    r"\.mlp\.experts$": W4A16_NVFP4,
    r"\.mlp\.shared_expert\.(gate|up|down)_proj$": W4A16_NVFP4,
    r"^lm_head$": W4A16_NVFP4,
}

_HUB = "model.language_model."  # the hub layout's text-model prefix (what names.py maps)
_FUSED_EXPERTS = re.compile(r"model\.language_model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model or the format; the message lists every problem found."""


def _fail(problems: list[str], what: str) -> None:
    if problems:
        shown = "\n  ".join(problems[:40])
        more = f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
        raise CheckpointError(f"{what}: {len(problems)} problem(s)\n  {shown}{more}")


# ---- the quantisation table ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantTable:
    """`quantized_layers` of a ModelOpt MIXED_PRECISION export: checkpoint module name -> quant_algo."""

    layers: dict[str, str]

    @classmethod
    def from_config(cls, qc: Mapping | None) -> "QuantTable":
        if qc is None:
            return cls({})
        qc = dict(qc.get("quantization", qc))  # hf_quant_config.json nests the same keys under "quantization"
        problems = []
        method = qc.get("quant_method", "modelopt")
        if method != "modelopt":
            problems.append(f"quant_method {method!r}: only ModelOpt exports are supported")
        algo = qc.get("quant_algo")
        layers = qc.get("quantized_layers")
        if algo != "MIXED_PRECISION" or not isinstance(layers, dict):
            problems.append(
                f"quant_algo {algo!r} with quantized_layers {'present' if isinstance(layers, dict) else 'absent'}: "
                "only MIXED_PRECISION with a per-layer quantized_layers table is supported"
            )
            _fail(problems, "unsupported quantization_config")
        table = {}
        for name, entry in layers.items():
            a = entry.get("quant_algo") if isinstance(entry, dict) else None
            if a not in (FP8, *NVFP4_ALGOS):
                problems.append(f"{name}: quant_algo {a!r} (supported: FP8, W4A16_NVFP4, NVFP4)")
            elif a in NVFP4_ALGOS and entry.get("group_size", BLOCK) != BLOCK:
                problems.append(f"{name}: {a} group_size {entry.get('group_size')} (NVFP4 blocks are {BLOCK})")
            table[_canonical(name)] = a
        _fail(problems, "unsupported quantization_config")
        return cls(table)

    def algo(self, module: str) -> str:
        """Precision of a checkpoint module: its own entry, or an ancestor's (`mlp.experts` covers every expert)."""
        parts = module.split(".")
        for i in range(len(parts), 0, -1):
            a = self.layers.get(".".join(parts[:i]))
            if a is not None:
                return a
        return BF16


def _canonical(name: str) -> str:
    """Text-only exports name the text model `model.`; the hub layout (and names.py) `model.language_model.`."""
    if name.startswith("model.") and not name.startswith((_HUB, "model.visual.")):
        return _HUB + name[len("model."):]
    return name


# ---- reading ------------------------------------------------------------------------------------------------------
def _shard_map(path: Path) -> dict[str, Path]:
    """tensor name -> shard file, from the index (checked against the shards' own headers) or a single file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = sorted(set(weight_map.values()))
        problems = [f"shard {f} listed in the index does not exist" for f in files if not (path / f).exists()]
        _fail(problems, f"checkpoint {path}")
        for f in files:
            with safe_open(path / f, framework="pt") as h:
                keys = set(h.keys())
            listed = {k for k, v in weight_map.items() if v == f}
            problems += [f"{k}: listed in the index under {f} but absent from it" for k in sorted(listed - keys)]
            problems += [f"{k}: in {f} but not in the index" for k in sorted(keys - listed)]
        _fail(problems, f"checkpoint {path}: index and shards disagree")
        return {k: path / v for k, v in weight_map.items()}
    single = path / "model.safetensors"
    if single.exists():
        with safe_open(single, framework="pt") as h:
            return {k: single for k in h.keys()}
    raise CheckpointError(f"{path}: neither model.safetensors.index.json nor model.safetensors")


def read_config(path: str | os.PathLike) -> QwenConfig:
    """config.json (+ hf_quant_config.json when config.json has no quantization_config). Where both exist, the
    second's `kv_cache_quant_algo` is added to the first's block when that names none: NVIDIA's Qwen3.6 export
    declares its FP8 KV cache only there (`QwenConfig.kv_cache_quant_algo`)."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    cfg = QwenConfig.from_json(raw)
    hf_quant = path / "hf_quant_config.json"
    if not hf_quant.exists():
        return cfg
    sidecar = json.loads(hf_quant.read_text())
    if cfg.quantization_config is None:
        return cfg.replace(quantization_config=sidecar)
    kv_algo = (sidecar.get("quantization") or {}).get("kv_cache_quant_algo")
    if kv_algo is not None and cfg.kv_cache_quant_algo is None:
        qc = dict(cfg.quantization_config)
        if isinstance(qc.get("quantization"), dict):  # a block nesting its keys as the sidecar does
            qc["quantization"] = {**qc["quantization"], "kv_cache_quant_algo": kv_algo}
        else:
            qc["kv_cache_quant_algo"] = kv_algo
        cfg = cfg.replace(quantization_config=qc)
    return cfg


@dataclass
class LoadedCheckpoint:
    config: QwenConfig
    # our parameter name -> dense tensor (dequantised, or BF16 as stored, in the requested dtype), or with
    # packed=True an NVFP4Tensor (global scale per output row) / FP8Tensor for the quantised layers
    tensors: dict[str, torch.Tensor | NVFP4Tensor | FP8Tensor]
    algos: dict[str, str]  # our parameter name -> BF16 | FP8 | W4A16_NVFP4 | NVFP4
    # static activation scales where the checkpoint has them: [] per linear; [E] per expert stack (max over gate/up)
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()  # checkpoint tensors deliberately not loaded (MTP head, vision tower)


@dataclass
class _Group:
    """The tensors of one checkpoint module (weight + quantisation siblings) and where they go."""

    target: MappedName
    module: str  # checkpoint module name (tensor name minus `.weight` / sibling suffix)
    members: dict[str, str] = field(default_factory=dict)  # role ("weight", "weight_scale", ... or None) -> name


def _expected_shapes(cfg: QwenConfig) -> dict[str, tuple[int, ...]]:
    from .model import QwenForCausalLM

    with torch.device("meta"):
        model = QwenForCausalLM(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def load_checkpoint(
    path: str | os.PathLike,
    packed: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoadedCheckpoint:
    """Load a ModelOpt mixed-precision or BF16 checkpoint directory into our parameter names.

    packed=False: every parameter dense in `dtype` (NVFP4 / FP8 dequantised exactly as `kernels/nvfp4.py` defines).
    packed=True: NVFP4 weights as `NVFP4Tensor` (uint8 / e4m3 / fp32 per-row global), FP8 as `FP8Tensor`, the rest
    dense in `dtype`.
    """
    path = Path(path)
    cfg = read_config(path)
    table = QuantTable.from_config(cfg.quantization_config)
    shapes = _expected_shapes(cfg)
    shard_of = _shard_map(path)

    # group checkpoint tensors by module
    problems: list[str] = []
    groups: dict[tuple, _Group] = {}
    ignored = []
    for name in shard_of:
        canon = _canonical(name)
        fused = _FUSED_EXPERTS.match(canon)
        try:
            target = (MappedName(f"layers.{fused[1]}.mlp.experts.{fused[2]}", suffix=None) if fused
                      else map_checkpoint_name(canon))
        except KeyError:
            problems.append(f"{name}: unknown tensor (not part of the Qwen3.5/3.6-MoE text model)")
            continue
        if target is None:
            ignored.append(name)
            continue
        role = target.suffix
        module = canon if role is None else canon[: -len(role) - 1]
        key = (target.ours, target.expert, target.half)
        g = groups.setdefault(key, _Group(MappedName(target.ours, target.expert, target.half, "weight"), module))
        if role in g.members:
            problems.append(f"{name}: duplicate of {g.members[role]}")
        g.members[role] = name
    prefixes = {".".join(p[:i]) for p in (g.module.split(".") for g in groups.values()) for i in range(1, len(p) + 1)}
    problems += [f"quantized_layers lists {entry!r}, which matches no tensor of the checkpoint"
                 for entry in table.layers if entry not in prefixes]
    _fail(problems, f"checkpoint {path}")

    handles = {f: safe_open(f, framework="pt", device="cpu") for f in sorted(set(shard_of.values()))}
    out = _Assembler(cfg, shapes, packed, dtype, device)
    for key in sorted(groups, key=lambda k: (k[0], -1 if k[1] is None else k[1], k[2] or "")):
        g = groups[key]
        if g.target.ours not in shapes:
            problems.append(f"{g.module}: maps to {g.target.ours!r}, which this config's model does not have "
                            f"({cfg.num_hidden_layers} layers, types {cfg.layer_types})")
            continue
        algo = table.algo(g.module)
        # validate and dequantise on the target device (a GPU does the NVFP4 decode of 32 B weights far faster)
        tensors = {role: handles[shard_of[n]].get_tensor(n).to(out.device) for role, n in g.members.items()}
        try:
            out.add(g, algo, tensors)
        except CheckpointError as e:
            problems.append(str(e))
            out.failed.add(g.target.ours)
    problems += out.missing()
    _fail(problems, f"checkpoint {path}")
    if ignored:
        log.info("skipped %d checkpoint tensors (MTP head / vision tower), e.g. %s", len(ignored), ignored[0])
    return LoadedCheckpoint(cfg, out.tensors, out.algos, out.input_scales, tuple(sorted(ignored)))


def load_into(model: torch.nn.Module, path: str | os.PathLike) -> LoadedCheckpoint:
    """Dequantised load straight into a `QwenForCausalLM` (dtype and device of its parameters); strict."""
    p = next(model.parameters())
    ck = load_checkpoint(path, packed=False, dtype=p.dtype, device=p.device)
    if ck.config != model.config:
        raise CheckpointError(f"checkpoint {path} is for {ck.config}, the model is {model.config}")
    model.load_state_dict(ck.tensors, strict=True)
    return ck


def _scalar(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.float32 or t.numel() != 1:
        raise CheckpointError(f"{what}: expected a float32 scalar, got {t.dtype} {tuple(t.shape)}")
    t = t.reshape(())
    if not (torch.isfinite(t) and t > 0):
        raise CheckpointError(f"{what}: scale {t.item()} is not positive and finite")
    return t


class _Assembler:
    """Validates each module's tensors against its precision and the model's shapes, and writes them into place."""

    def __init__(self, cfg, shapes, packed, dtype, device):
        self.cfg, self.shapes, self.packed, self.dtype, self.device = cfg, shapes, packed, dtype, torch.device(device)
        self.tensors: dict = {}
        self.algos: dict[str, str] = {}
        self.input_scales: dict[str, torch.Tensor] = {}
        self.filled: dict[str, set] = defaultdict(set)  # stacked expert params: {(expert, half)} received
        self.failed: set[str] = set()  # params with a reported problem (not reported again as missing)

    def add(self, g: _Group, algo: str, t: dict[str | None, torch.Tensor]) -> None:
        ours, expert, half = g.target.ours, g.target.expert, g.target.half
        required, optional = _SIBLINGS[algo]
        roles = set(t)
        if None in roles:  # a bare parameter (A_log, dt_bias) or transformers' fused expert stack
            if algo != BF16 or roles != {None}:
                raise CheckpointError(f"{g.module}: {algo} listed for a tensor without a `.weight`")
            t = {"weight": t[None]}
            roles = {"weight"}
        if roles - required - optional or required - roles:
            extra, miss = sorted(roles - required - optional), sorted(required - roles)
            hint = " (is it missing from quantized_layers?)" if algo == BF16 else ""
            raise CheckpointError(f"{g.module}: {algo} expects {sorted(required)} (+ optional {sorted(optional)}); "
                                  f"unexpected {extra}, missing {miss}{hint}")
        full = self.shapes[ours]
        if expert is None:
            shape = full
        else:
            if not 0 <= expert < self.cfg.num_experts:
                raise CheckpointError(f"{g.module}: expert {expert} outside 0..{self.cfg.num_experts - 1}")
            shape = (full[1] // 2, full[2]) if half else full[1:]
        w = t["weight"]

        if algo == BF16:
            if w.dtype not in _FLOAT_DTYPES:
                raise CheckpointError(f"{g.module}.weight: dtype {w.dtype} in a module not listed in "
                                      f"quantized_layers (expected bf16/fp16/fp32)")
            self._check_shape(g, "weight", w, shape)
            self._put(ours, expert, half, algo, w.to(self.dtype), None)
        elif algo == FP8:
            if w.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{g.module}.weight: FP8 layer stored as {w.dtype}, expected float8_e4m3fn")
            self._check_shape(g, "weight", w, shape)
            s = _scalar(t["weight_scale"], f"{g.module}.weight_scale")
            si = _scalar(t["input_scale"], f"{g.module}.input_scale")
            value = FP8Tensor(w, s, si) if self.packed else dequantize_fp8(w, s, self.dtype)
            self._put(ours, expert, half, algo, value, si)
        else:  # NVFP4 / W4A16_NVFP4
            if w.dtype != torch.uint8:
                raise CheckpointError(f"{g.module}.weight: {algo} layer stored as {w.dtype}, expected uint8 "
                                      "(two E2M1 codes per byte)")
            n, k = shape
            if k % BLOCK:
                raise CheckpointError(f"{g.module}: K = {k} is not a multiple of the NVFP4 block {BLOCK}")
            self._check_shape(g, "weight", w, (n, k // 2))
            s = t["weight_scale"]
            if s.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"{g.module}.weight_scale: {s.dtype}, expected float8_e4m3fn")
            self._check_shape(g, "weight_scale", s, (n, k // BLOCK))
            sf = s.float()
            if not (torch.isfinite(sf).all() and (sf >= 0).all()):
                raise CheckpointError(f"{g.module}.weight_scale: negative or NaN block scales")
            g2 = _scalar(t["weight_scale_2"], f"{g.module}.weight_scale_2")
            si = _scalar(t["input_scale"], f"{g.module}.input_scale") if "input_scale" in t else None
            if self.packed:
                value = NVFP4Tensor(w, s, g2.expand(n).clone())
            else:
                value = dequantize_nvfp4(w, s, g2, self.dtype)
            self._put(ours, expert, half, algo, value, si)

    @staticmethod
    def _check_shape(g: _Group, role: str, t: torch.Tensor, shape) -> None:
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{g.module}.{role}: shape {tuple(t.shape)}, expected {tuple(shape)}")

    def _put(self, ours, expert, half, algo, value, input_scale) -> None:
        prev = self.algos.setdefault(ours, algo)
        if prev != algo:
            raise CheckpointError(f"{ours}: experts stored in different precisions ({prev} and {algo})")
        if expert is None:
            if ours in self.tensors:
                raise CheckpointError(f"{ours}: given twice (fused and per-expert, or under two names)")
            self.tensors[ours] = _to(value, self.device)
            if input_scale is not None:
                self.input_scales[ours] = input_scale.to(self.device)
            return
        if isinstance(value, FP8Tensor):
            raise CheckpointError(f"{ours}: FP8 routed experts cannot be packed (the grouped GEMM is NVFP4 or dense)")
        full = self.shapes[ours]
        n = full[1] // 2
        rows = slice(None) if half is None else (slice(0, n) if half == "gate" else slice(n, None))
        if ours in self.tensors and ours not in self.filled:
            raise CheckpointError(f"{ours}: given twice (fused and per-expert)")
        if (expert, half) in self.filled[ours]:
            raise CheckpointError(f"{ours}: expert {expert} {half or ''} given twice")
        self.filled[ours].add((expert, half))
        if ours not in self.tensors:
            self.tensors[ours] = self._empty_stack(full, value)
        dst = self.tensors[ours]
        if isinstance(value, NVFP4Tensor):
            for d, v in zip(dst, value):
                d[expert, rows] = v
        else:
            dst[expert, rows] = value
        if input_scale is not None:
            s = self.input_scales.setdefault(ours, torch.zeros(full[0], device=self.device))
            s[expert] = torch.maximum(s[expert], input_scale.to(self.device))

    def _empty_stack(self, full, value):
        e, n, k = full
        if isinstance(value, NVFP4Tensor):
            return NVFP4Tensor(
                torch.zeros(e, n, k // 2, dtype=torch.uint8, device=self.device),
                torch.zeros(e, n, k // BLOCK, dtype=torch.float8_e4m3fn, device=self.device),
                torch.zeros(e, n, dtype=torch.float32, device=self.device),
            )
        return torch.zeros(full, dtype=self.dtype, device=self.device)

    def missing(self) -> list[str]:
        problems = []
        for name, shape in self.shapes.items():
            if name in self.failed:
                continue
            if name not in self.tensors:
                problems.append(f"{name}: missing from the checkpoint")
            elif name in self.filled:
                halves = ("gate", "up") if name.endswith("gate_up_proj") else (None,)
                absent = [f"{e}{'.' + h if h else ''}" for e in range(shape[0]) for h in halves
                          if (e, h) not in self.filled[name]]
                if absent:
                    problems.append(f"{name}: experts missing from the checkpoint: {', '.join(absent[:16])}"
                                    + (" ..." if len(absent) > 16 else ""))
        return problems


def _to(value, device):
    if isinstance(value, tuple):  # NVFP4Tensor / FP8Tensor
        return type(value)(*(None if v is None else v.to(device) for v in value))
    return value.to(device)


# ---- writing ------------------------------------------------------------------------------------------------------
def hf_text_config(cfg: QwenConfig) -> dict:
    """`text_config` in the checkpoint's (transformers') key names."""
    return {
        "model_type": "qwen3_5_moe_text", "dtype": "bfloat16",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "layer_types": list(cfg.layer_types), "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "attn_output_gate": True,
        "attention_bias": False, "hidden_act": "silu", "partial_rotary_factor": cfg.partial_rotary_factor,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor, "mrope_interleaved": True,
                            "mrope_section": list(cfg.mrope_section)},
        "max_position_embeddings": cfg.max_position_embeddings,
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim, "mamba_ssm_dtype": "float32",
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size, "router_aux_loss_coef": 0.001,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "mtp_num_hidden_layers": cfg.mtp_num_hidden_layers, "mtp_use_dedicated_embeddings": False,
    }


_OURS_TO_CK = [
    (re.compile(re.escape(ours).replace(r"\{L\}", r"(?P<L>\d+)") + "$"), ck, place)
    for ours, ck, _, place in PARAM_NAMES
]


def checkpoint_names(ours: str, num_experts: int) -> list[tuple[str, int | None, str | None]]:
    """Our parameter -> [(checkpoint tensor name, expert, half)]: one entry, or one per expert (and gate/up half)."""
    found = []
    for rx, ck, place in _OURS_TO_CK:
        m = rx.match(ours)
        if not m:
            continue
        name = ck.replace("{L}", m["L"]) if "L" in m.groupdict() else ck
        if "{E}" not in name:
            return [(name, None, None)]
        half = place.rsplit(" ", 1)[-1] if place.endswith(("gate", "up")) else None
        found += [(name.replace("{E}", str(e)), e, half) for e in range(num_experts)]
    if not found:
        raise KeyError(f"{ours!r} has no checkpoint name in PARAM_NAMES")
    return found


def _module_of(ck: str, expert: int | None) -> tuple[str, str]:
    """(checkpoint module of a tensor, the module quantized_layers names: `...mlp.experts` for every expert)."""
    module = ck[: -len(".weight")] if ck.endswith(".weight") else ck
    return module, (module.rsplit(".", 2)[0] if expert is not None else module)


def recipe_layers(cfg: QwenConfig, recipe: Mapping[str, str]) -> dict[str, dict]:
    """The `quantized_layers` table a recipe (checkpoint module regex -> quant_algo) gives for this config."""
    rules = [(re.compile(p), a) for p, a in recipe.items()]
    table: dict[str, dict] = {}
    for ours in _expected_shapes(cfg):
        for ck, expert, _ in checkpoint_names(ours, cfg.num_experts)[:1]:
            module = _module_of(ck, expert)[1]
            hits = {a for rx, a in rules if rx.search(module)}
            if len(hits) > 1:
                raise ValueError(f"recipe gives {module} several algorithms {hits}")
            if hits:
                algo = hits.pop()
                if algo not in (FP8, *NVFP4_ALGOS):
                    raise ValueError(f"recipe algorithm {algo!r} for {module}")
                table[module] = {"quant_algo": algo, **({"group_size": BLOCK} if algo in NVFP4_ALGOS else {})}
    return table


def save_checkpoint(
    path: str | os.PathLike,
    cfg: QwenConfig,
    state_dict: Mapping[str, torch.Tensor],
    recipe: Mapping[str, str] | None = MODELOPT_RECIPE,
    max_shard_bytes: int = 5 * 2**30,
    sync_gate_up: bool = True,
    input_amax: Mapping[str, float] | float = 8.0,
    nvfp4_input_scale: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    return_weights: bool = True,
    kv_cache_quant_algo: str | None = "FP8",
) -> dict[str, torch.Tensor] | None:
    """Write our dense `state_dict` as a ModelOpt mixed-precision export (recipe: checkpoint module regex ->
    quant_algo; default NVIDIA's) or, with recipe=None, as the original BF16 hub layout. Returns the weights the
    written checkpoint dequantises to, in our names (fp32, on the CPU), unless `return_weights=False`.

    Quantisation mirrors ModelOpt: NVFP4 global scale amax/2688 per tensor, shared by an expert's gate and up
    (`sync_gate_up`, ModelOpt's `sync_moe_gate_up_amax`); FP8 scale amax/448. Activation scales cannot be calibrated
    here: `input_scale = input_amax / 448` (FP8) or `/ 2688` (NVFP4, written as the real checkpoint does although
    W4A16 ignores it), with `input_amax` per checkpoint module name or one value for all.

    A ModelOpt export also gets ModelOpt's `hf_quant_config.json` sidecar, naming `kv_cache_quant_algo` (NVIDIA's:
    "FP8"; None: no KV cache declaration).

    Quantisation runs on each tensor's device and shards are streamed to disk, so a full-size random checkpoint can be
    written from a lazy Mapping that creates each parameter on the GPU when asked (return_weights=False).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    missing = set(_expected_shapes(cfg)) - set(state_dict)
    if missing:
        raise ValueError(f"state_dict lacks {len(missing)} parameters of the model, e.g. {sorted(missing)[:3]}")
    table = recipe_layers(cfg, recipe or {})

    def amax_of(module: str) -> float:
        return input_amax.get(module, 8.0) if isinstance(input_amax, Mapping) else float(input_amax)

    written: dict[str, torch.Tensor] = {}
    writer = _ShardWriter(path, max_shard_bytes)
    for ours, value in state_dict.items():
        value = value.detach()
        dq = torch.empty(value.shape, dtype=torch.float32) if return_weights else None
        for ck, expert, half in checkpoint_names(ours, cfg.num_experts):
            module, table_module = _module_of(ck, expert)
            part, rows = value, slice(None)
            if expert is not None:
                n = value.shape[1] // 2 if half else value.shape[1]
                rows = slice(0, n) if half != "up" else slice(n, 2 * n)
                part = value[expert, rows]
            algo = table.get(table_module, {}).get("quant_algo", BF16)
            w = part.float()
            if algo == BF16:
                writer.add(ck, w.to(dtype))
                deq = w.to(dtype) if return_weights else None
            elif algo == FP8:
                q, s = quantize_fp8(w)
                writer.add(ck, q)
                writer.add(module + ".weight_scale", s)
                writer.add(module + ".input_scale", torch.tensor(amax_of(module) / 448.0))
                deq = dequantize_fp8(q, s) if return_weights else None
            else:  # NVFP4 / W4A16_NVFP4
                g = None
                if sync_gate_up and half is not None:  # one global scale for the expert's gate and up
                    g = nvfp4_global_scale(value[expert].float())
                q = quantize_nvfp4(w, g)
                writer.add(ck, q.packed)
                writer.add(module + ".weight_scale", q.scales)
                writer.add(module + ".weight_scale_2", q.global_scale.reshape(()))
                if nvfp4_input_scale or algo == NVFP4:
                    writer.add(module + ".input_scale", torch.tensor(amax_of(module) / 2688.0))
                deq = dequantize_nvfp4(*q) if return_weights else None
            if return_weights and expert is None:
                dq = deq.float().cpu().reshape(value.shape)
            elif return_weights:
                dq[expert, rows] = deq.float().cpu()
        if return_weights:
            written[ours] = dq
    writer.close()

    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": hf_text_config(cfg), "tie_word_embeddings": cfg.tie_word_embeddings,
        "transformers_version": "5.7.0.dev0",
    }
    if recipe is not None:
        config["quantization_config"] = _modelopt_quantization_config(table)
        # the sidecar ModelOpt writes beside it; NVIDIA's Qwen3.6 export declares its FP8 KV cache only here (no
        # k / v scales in the shards)
        sidecar = {"producer": config["quantization_config"]["producer"], "quantization": {
            "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": kv_cache_quant_algo, "quantized_layers": table}}
        (path / "hf_quant_config.json").write_text(json.dumps(sidecar, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return written if return_weights else None


def _modelopt_quantization_config(quantized: dict[str, dict]) -> dict:
    """The `quantization_config` block as ModelOpt 0.37 writes it (group_1's 4-bit activations mislabel included)."""
    fp8 = sorted(m for m, e in quantized.items() if e["quant_algo"] == FP8)
    fp4 = sorted(m for m, e in quantized.items() if e["quant_algo"] != FP8)
    f8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    f4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK}
    groups = {}
    if fp8:
        groups[f"group_{len(groups)}"] = {"input_activations": f8, "weights": f8, "targets": fp8}
    if fp4:
        groups[f"group_{len(groups)}"] = {"input_activations": f4, "weights": f4, "targets": fp4}
    return {
        "config_groups": groups, "quantized_layers": quantized, "ignore": ["mtp.layers.0*", "mtp*"],
        "quant_algo": "MIXED_PRECISION", "producer": {"name": "modelopt", "version": "0.37.0"},
        "quant_method": "modelopt",
    }


class _ShardWriter:
    """Streams tensors into `model-0000i-of-0000n.safetensors` shards of at most `max_bytes`, then writes the index."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.size + n > self.max_bytes:
            self._flush()
        self.pending[name] = t.detach().contiguous().cpu()
        self.size += n
        self.total += n

    def _flush(self) -> None:
        save_file(self.pending, self.path / f"part-{len(self.shards)}.tmp", metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.shards)
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.path / f"part-{i}.tmp", self.path / final)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
