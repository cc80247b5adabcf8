"""Qwen3.6-35B-A3B (`qwen3_5_moe_text`) configuration: the text model's numbers in one place.

Values are the `text_config` of `nvidia/Qwen3.6-35B-A3B-NVFP4` (`../shared/design/qwen3.6-nvfp4.md` section 1.1); the
transformers 5.24 `Qwen3_5MoeTextConfig` defaults agree on every architectural value. `QwenConfig.from_json` reads a
checkpoint's `config.json` (the multimodal wrapper with a nested `text_config`, or a flat text config as written by
`Qwen3_5MoeTextConfig.save_pretrained`) and keeps its `quantization_config` as a plain dict for the loader.
`QwenConfig.tiny()` is the random-weight preset of the tests (design doc section 1.7): every structural feature is
kept (3 GDN layers + 1 full-attention layer, GQA, partial RoPE, more GDN value heads than key heads, top-k of
many experts).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet mixer
FULL_ATTENTION = "full_attention"  # gated softmax attention with a KV cache
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)


def default_layer_types(num_layers: int, full_attention_interval: int = 4) -> tuple[str, ...]:
    """transformers' rule when `layer_types` is absent: every `interval`-th layer (3, 7, 11, ...) is full attention."""
    return tuple(
        FULL_ATTENTION if (i + 1) % full_attention_interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
    )


@dataclass(frozen=True)
class QwenConfig:
    # sizes
    vocab_size: int = 248320  # 248,044 BPE + 33 added tokens, padded
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: tuple[str, ...] = default_layer_types(40)  # [linear x3, full] x 10
    # gated full attention (10 layers)
    num_attention_heads: int = 16
    num_key_value_heads: int = 2  # GQA 8:1
    head_dim: int = 256  # q_proj emits 2 x head_dim per head: query then output gate
    partial_rotary_factor: float = 0.25  # RoPE on the first 64 of 256 dims of each head
    rope_theta: float = 1e7
    mrope_section: tuple[int, ...] = (11, 11, 10)  # text-only: the 3 position rows are equal -> plain 1-D RoPE
    max_position_embeddings: int = 262144
    # Gated DeltaNet (30 layers)
    linear_num_key_heads: int = 16  # q and k heads
    linear_num_value_heads: int = 32  # v heads; each q/k head serves 2 consecutive v heads
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4  # causal depthwise conv over [q | k | v]; decode keeps the last 3 inputs
    # MoE (every layer)
    num_experts: int = 256
    num_experts_per_tok: int = 8  # top-8 of the softmax, renormalised to sum 1
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512  # one shared expert behind a sigmoid gate
    # norms, embeddings, tokens
    rms_norm_eps: float = 1e-6  # zero-centred RMSNorm everywhere except the GDN output norm (same eps)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 248044
    eos_token_id: int | tuple[int, ...] | None = 248044
    pad_token_id: int | None = None
    # multi-token prediction head (not in the transformers reference; kept for the loader)
    mtp_num_hidden_layers: int = 1
    # checkpoint's `quantization_config` (ModelOpt MIXED_PRECISION), verbatim; None for a BF16 checkpoint
    quantization_config: dict[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self):
        def positive(*names):
            for n in names:
                if not isinstance(getattr(self, n), int) or getattr(self, n) <= 0:
                    raise ValueError(f"{n} must be a positive int, got {getattr(self, n)!r}")

        positive("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "shared_expert_intermediate_size", "max_position_embeddings")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unknown layer types {bad}; expected {LAYER_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads} query heads do not group over {self.num_key_value_heads} kv heads"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"GDN: {self.linear_num_value_heads} value heads are not a multiple of "
                f"{self.linear_num_key_heads} key heads"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} outside (0, 1]")
        rd = self.head_dim * self.partial_rotary_factor
        if rd != int(rd) or int(rd) % 2:
            raise ValueError(f"rotary dim head_dim * partial_rotary_factor = {rd} must be an even integer")
        if self.mrope_section and sum(self.mrope_section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to rotary_dim / 2 = {self.rotary_dim // 2}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} outside 1..{self.num_experts}")
        if self.linear_conv_kernel_dim < 2:
            raise ValueError("linear_conv_kernel_dim must be >= 2 (the conv state holds kernel - 1 inputs)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.quantization_config is not None and not isinstance(self.quantization_config, dict):
            raise ValueError("quantization_config must be a dict or None")

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def kv_cache_quant_algo(self) -> str | None:
        """The KV cache precision the checkpoint declares (`quantization_config`, or hf_quant_config.json's
        "quantization" block: NVIDIA's Qwen3.6 NVFP4 export says "FP8"), None where it declares none. Read by
        `QwenEngineConfig.kv_cache_dtype` "auto"; the model's maths does not depend on it."""
        qc = self.quantization_config or {}
        qc = qc.get("quantization", qc)
        return qc.get("kv_cache_quant_algo") if isinstance(qc, dict) else None

    @property
    def rotary_dim(self) -> int:  # 64: leading dims of each head that rotate
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_kv_groups(self) -> int:  # 8 query heads share one kv head
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def linear_key_dim(self) -> int:  # 2048 = 16 x 128 (q and k each)
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # 4096 = 32 x 128
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:  # 8192 conv channels: [q 2048 | k 2048 | v 4096]
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:  # (3, 7, ..., 39)
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    # ---- presets and I/O ---------------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides) -> "QwenConfig":
        """Random-weight test preset (design doc 1.7): 4 layers, hidden 64, 8 experts top-2, vocab 512."""
        base = dict(
            vocab_size=512, hidden_size=64, num_hidden_layers=4, layer_types=default_layer_types(4),
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25,
            rope_theta=1e7, mrope_section=(1, 1, 2), max_position_embeddings=4096,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, bos_token_id=None, eos_token_id=None, mtp_num_hidden_layers=0,
        )
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> "QwenConfig":
        return replace(self, **changes)

    @classmethod
    def from_json(cls, source: str | os.PathLike | dict) -> "QwenConfig":
        """Read a checkpoint's `config.json` (path to the file or its directory, or the parsed dict).

        Accepts the multimodal wrapper (`model_type: qwen3_5_moe`, text numbers under `text_config`, the
        `quantization_config` at the top level) or a flat `qwen3_5_moe_text` config. Keys that change the maths to
        something this engine does not implement raise `ValueError`; HF plumbing keys are ignored.
        """
        if isinstance(source, dict):
            raw = source
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                raw = json.load(f)
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise ValueError(f"text_config must be a JSON object, got {type(text).__name__}")
        model_type = text.get("model_type")
        if model_type not in (None, "qwen3_5_moe_text", "qwen3_5_moe"):
            raise ValueError(f"model_type {model_type!r} is not qwen3_5_moe_text")

        _check_supported(text)
        rope = dict(text.get("rope_parameters") or {})
        kw: dict[str, Any] = {}
        names = {f.name for f in fields(cls)} - {"layer_types", "quantization_config", "rope_theta",
                                                 "partial_rotary_factor", "mrope_section"}
        for name in names:
            if name in text:
                kw[name] = text[name]
        missing = [k for k in _REQUIRED_KEYS if k not in text]
        if missing:
            raise ValueError(f"config is missing required keys {missing}")
        n = text["num_hidden_layers"]
        interval = text.get("full_attention_interval", 4)
        kw["layer_types"] = tuple(text.get("layer_types") or default_layer_types(n, interval))
        # transformers 5 nests rope settings in rope_parameters; older exports keep them at the top level
        kw["rope_theta"] = float(rope.get("rope_theta", text.get("rope_theta", cls.rope_theta)))
        kw["partial_rotary_factor"] = float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", cls.partial_rotary_factor))
        )
        kw["mrope_section"] = tuple(rope.get("mrope_section", ()))
        kw["mtp_num_hidden_layers"] = int(text.get("mtp_num_hidden_layers", 0))
        quant = raw.get("quantization_config", text.get("quantization_config"))
        kw["quantization_config"] = dict(quant) if quant is not None else None
        return cls(**kw)


_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
)


def _check_supported(text: dict) -> None:
    """Refuse config values that select maths this engine does not implement (rather than silently ignoring them)."""
    rope = text.get("rope_parameters") or {}
    problems = []
    if text.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {text['hidden_act']!r} (only silu)")
    if text.get("attn_output_gate", True) is not True:
        problems.append("attn_output_gate false (only the gated attention of Qwen3.5/3.6)")
    if text.get("attention_bias", False):
        problems.append("attention_bias true")
    if rope.get("rope_type", "default") != "default" or text.get("rope_scaling"):
        problems.append(f"rope_type {rope.get('rope_type')!r} / rope_scaling (only default RoPE)")
    if text.get("norm_topk_prob", True) is not True:
        problems.append("norm_topk_prob false (Qwen3.5-MoE always renormalises the top-k)")
    if text.get("mamba_ssm_dtype", "float32") != "float32":
        problems.append(f"mamba_ssm_dtype {text['mamba_ssm_dtype']!r} (GDN state is fp32)")
    if text.get("mtp_use_dedicated_embeddings", False):
        problems.append("mtp_use_dedicated_embeddings true")
    if text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1:
        problems.append("dense-MLP layers (mlp_only_layers / decoder_sparse_step)")
    if problems:
        raise ValueError("unsupported Qwen3.5-MoE config: " + "; ".join(problems))
