"""Checkpoint loading: Meta's `sam3.pt`, SAM 3.1's `sam3.1_multiplex.pt`, and the transformers
`model.safetensors` layout, into Sammie's detector.

Sammie's module names are Meta's state-dict names with the `detector.` prefix stripped, so a Meta
checkpoint maps 1:1. The transformers layout (`detector_model.*`, split q/k/v, renamed modules) is
mapped back through `HF_RENAMES`, one table used in both directions (`to_hf_layout` writes the
layout for tests and export). Layouts: `../shared/design/sam3-reference.md` section 9.

Nothing here touches the network: a path is a file or a local Hugging Face snapshot directory.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Keys a checkpoint may carry that the text-prompt detector does not use, with the reason.
IGNORED_PREFIXES: dict[str, str] = {
    "tracker.": "SAM 3 video tracker (memory attention, mask memory); not part of image segmentation",
    "tracker_model.": "transformers' video tracker weights; not part of image segmentation",
    "tracker_neck.": "transformers' tracker neck; not part of image segmentation",
    "backbone.vision_backbone.interactive_convs.": (
        "SAM 3.1 tri-neck: the interactive (point/box, SAM-1 task) neck; text prompts use `convs` only"
    ),
    "backbone.vision_backbone.propagation_convs.": (
        "SAM 3.1 tri-neck: the video propagation neck; text prompts use `convs` only"
    ),
    "backbone.vision_backbone.sam2_convs.": "SAM 2 neck for instance interactivity; not used by text prompts",
}

# Keys of Sammie's model that a checkpoint may lack, with the reason. Missing ones are left at
# their initial values, which no text-prompt computation reads.
OPTIONAL_KEYS: dict[str, str] = {
    r"backbone\.vision_backbone\.convs\.3\..*": (
        "0.5x FPN level: dropped before the detector (scalp=1); SAM 3.1 checkpoints omit it"
    ),
    r"geometry_encoder\.(points_.*|mask_encoder\..*)": (
        "point/mask prompt weights: transformers' layout has none; text prompts never read them"
    ),
    r"backbone\.language_backbone\.encoder\.text_projection": (
        "CLIP's pooled-text projection: Sammie uses all token states, never the pooled output"
    ),
}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message lists every offending key."""


# --- transformers layout ----------------------------------------------------------------
# (Sammie/Meta prefix, transformers prefix); `{i}` is a layer index. Ordered: the first rule
# whose pattern matches a key renames it. Derived from transformers'
# `convert_sam3_to_hf.py` (ORIGINAL_TO_CONVERTED_KEY_MAPPING); checked in tests against the keys
# of transformers' own `Sam3Model`.
_VIT = "backbone.vision_backbone.trunk."
_TXT = "backbone.language_backbone.encoder."
HF_RENAMES: list[tuple[str, str]] = [
    (_VIT + "pos_embed", "vision_encoder.backbone.embeddings.position_embeddings"),
    (_VIT + "patch_embed.proj.", "vision_encoder.backbone.embeddings.patch_embeddings.projection."),
    (_VIT + "ln_pre.", "vision_encoder.backbone.layer_norm."),
    (_VIT + "blocks.{i}.norm1.", "vision_encoder.backbone.layers.{i}.layer_norm1."),
    (_VIT + "blocks.{i}.norm2.", "vision_encoder.backbone.layers.{i}.layer_norm2."),
    (_VIT + "blocks.{i}.attn.qkv.", "vision_encoder.backbone.layers.{i}.attention.qkv."),
    (_VIT + "blocks.{i}.attn.proj.", "vision_encoder.backbone.layers.{i}.attention.o_proj."),
    (_VIT + "blocks.{i}.attn.freqs_cis", "vision_encoder.backbone.layers.{i}.rotary_emb.rope_embeddings"),
    (_VIT + "blocks.{i}.mlp.", "vision_encoder.backbone.layers.{i}.mlp."),
    # Level 0 (4x) is two transposed convs around a GELU, level 1 (2x) one; transformers numbers
    # both by position in a Sequential, so the level index disambiguates `scale_layers.0`.
    ("backbone.vision_backbone.convs.0.dconv_2x2_0.", "vision_encoder.neck.fpn_layers.0.scale_layers.0."),
    ("backbone.vision_backbone.convs.0.dconv_2x2_1.", "vision_encoder.neck.fpn_layers.0.scale_layers.2."),
    ("backbone.vision_backbone.convs.1.dconv_2x2.", "vision_encoder.neck.fpn_layers.1.scale_layers.0."),
    ("backbone.vision_backbone.convs.{i}.conv_1x1.", "vision_encoder.neck.fpn_layers.{i}.proj1."),
    ("backbone.vision_backbone.convs.{i}.conv_3x3.", "vision_encoder.neck.fpn_layers.{i}.proj2."),
    (_TXT + "token_embedding.", "text_encoder.text_model.embeddings.token_embedding."),
    (_TXT + "positional_embedding", "text_encoder.text_model.embeddings.position_embedding.weight"),
    (_TXT + "ln_final.", "text_encoder.text_model.final_layer_norm."),
    (_TXT + "text_projection", "text_encoder.text_projection.weight"),
    (_TXT + "transformer.resblocks.{i}.attn.out_proj.", "text_encoder.text_model.encoder.layers.{i}.self_attn.out_proj."),
    (_TXT + "transformer.resblocks.{i}.attn.", "text_encoder.text_model.encoder.layers.{i}.self_attn."),
    (_TXT + "transformer.resblocks.{i}.ln_1.", "text_encoder.text_model.encoder.layers.{i}.layer_norm1."),
    (_TXT + "transformer.resblocks.{i}.ln_2.", "text_encoder.text_model.encoder.layers.{i}.layer_norm2."),
    (_TXT + "transformer.resblocks.{i}.mlp.c_fc.", "text_encoder.text_model.encoder.layers.{i}.mlp.fc1."),
    (_TXT + "transformer.resblocks.{i}.mlp.c_proj.", "text_encoder.text_model.encoder.layers.{i}.mlp.fc2."),
    ("backbone.language_backbone.resizer.", "text_projection."),
    ("geometry_encoder.encode.{i}.cross_attn_image.out_proj.", "geometry_encoder.layers.{i}.cross_attn.o_proj."),
    ("geometry_encoder.encode.{i}.cross_attn_image.", "geometry_encoder.layers.{i}.cross_attn."),
    ("geometry_encoder.encode.{i}.self_attn.out_proj.", "geometry_encoder.layers.{i}.self_attn.o_proj."),
    ("geometry_encoder.encode.{i}.self_attn.", "geometry_encoder.layers.{i}.self_attn."),
    ("geometry_encoder.encode.{i}.linear1.", "geometry_encoder.layers.{i}.mlp.fc1."),
    ("geometry_encoder.encode.{i}.linear2.", "geometry_encoder.layers.{i}.mlp.fc2."),
    ("geometry_encoder.encode.{i}.norm1.", "geometry_encoder.layers.{i}.layer_norm1."),
    ("geometry_encoder.encode.{i}.norm2.", "geometry_encoder.layers.{i}.layer_norm2."),
    ("geometry_encoder.encode.{i}.norm3.", "geometry_encoder.layers.{i}.layer_norm3."),
    ("geometry_encoder.img_pre_norm.", "geometry_encoder.vision_layer_norm."),
    ("geometry_encoder.norm.", "geometry_encoder.prompt_layer_norm."),
    ("geometry_encoder.encode_norm.", "geometry_encoder.output_layer_norm."),
    ("geometry_encoder.", "geometry_encoder."),  # label_embed, cls_embed, boxes_*, final_proj keep their names
    ("transformer.encoder.layers.{i}.cross_attn_image.out_proj.", "detr_encoder.layers.{i}.cross_attn.o_proj."),
    ("transformer.encoder.layers.{i}.cross_attn_image.", "detr_encoder.layers.{i}.cross_attn."),
    ("transformer.encoder.layers.{i}.self_attn.out_proj.", "detr_encoder.layers.{i}.self_attn.o_proj."),
    ("transformer.encoder.layers.{i}.self_attn.", "detr_encoder.layers.{i}.self_attn."),
    ("transformer.encoder.layers.{i}.linear1.", "detr_encoder.layers.{i}.mlp.fc1."),
    ("transformer.encoder.layers.{i}.linear2.", "detr_encoder.layers.{i}.mlp.fc2."),
    ("transformer.encoder.layers.{i}.norm1.", "detr_encoder.layers.{i}.layer_norm1."),
    ("transformer.encoder.layers.{i}.norm2.", "detr_encoder.layers.{i}.layer_norm2."),
    ("transformer.encoder.layers.{i}.norm3.", "detr_encoder.layers.{i}.layer_norm3."),
    ("transformer.decoder.presence_token_head.layers.0.", "detr_decoder.presence_head.layer1."),
    ("transformer.decoder.presence_token_head.layers.1.", "detr_decoder.presence_head.layer2."),
    ("transformer.decoder.presence_token_head.layers.2.", "detr_decoder.presence_head.layer3."),
    ("transformer.decoder.presence_token_out_norm.", "detr_decoder.presence_layer_norm."),
    ("transformer.decoder.norm.", "detr_decoder.output_layer_norm."),
    ("transformer.decoder.bbox_embed.layers.0.", "detr_decoder.box_head.layer1."),
    ("transformer.decoder.bbox_embed.layers.1.", "detr_decoder.box_head.layer2."),
    ("transformer.decoder.bbox_embed.layers.2.", "detr_decoder.box_head.layer3."),
    ("transformer.decoder.instance_bbox_embed.layers.0.", "detr_decoder.instance_box_head.layer1."),
    ("transformer.decoder.instance_bbox_embed.layers.1.", "detr_decoder.instance_box_head.layer2."),
    ("transformer.decoder.instance_bbox_embed.layers.2.", "detr_decoder.instance_box_head.layer3."),
    ("transformer.decoder.ref_point_head.layers.0.", "detr_decoder.ref_point_head.layer1."),
    ("transformer.decoder.ref_point_head.layers.1.", "detr_decoder.ref_point_head.layer2."),
    ("transformer.decoder.boxRPB_embed_x.layers.0.", "detr_decoder.box_rpb_embed_x.layer1."),
    ("transformer.decoder.boxRPB_embed_x.layers.1.", "detr_decoder.box_rpb_embed_x.layer2."),
    ("transformer.decoder.boxRPB_embed_y.layers.0.", "detr_decoder.box_rpb_embed_y.layer1."),
    ("transformer.decoder.boxRPB_embed_y.layers.1.", "detr_decoder.box_rpb_embed_y.layer2."),
    ("transformer.decoder.layers.{i}.self_attn.out_proj.", "detr_decoder.layers.{i}.self_attn.o_proj."),
    ("transformer.decoder.layers.{i}.self_attn.", "detr_decoder.layers.{i}.self_attn."),
    ("transformer.decoder.layers.{i}.ca_text.out_proj.", "detr_decoder.layers.{i}.text_cross_attn.o_proj."),
    ("transformer.decoder.layers.{i}.ca_text.", "detr_decoder.layers.{i}.text_cross_attn."),
    ("transformer.decoder.layers.{i}.cross_attn.out_proj.", "detr_decoder.layers.{i}.vision_cross_attn.o_proj."),
    ("transformer.decoder.layers.{i}.cross_attn.", "detr_decoder.layers.{i}.vision_cross_attn."),
    ("transformer.decoder.layers.{i}.linear1.", "detr_decoder.layers.{i}.mlp.fc1."),
    ("transformer.decoder.layers.{i}.linear2.", "detr_decoder.layers.{i}.mlp.fc2."),
    ("transformer.decoder.layers.{i}.norm1.", "detr_decoder.layers.{i}.vision_cross_attn_layer_norm."),
    ("transformer.decoder.layers.{i}.catext_norm.", "detr_decoder.layers.{i}.text_cross_attn_layer_norm."),
    ("transformer.decoder.layers.{i}.norm2.", "detr_decoder.layers.{i}.self_attn_layer_norm."),
    ("transformer.decoder.layers.{i}.norm3.", "detr_decoder.layers.{i}.mlp_layer_norm."),
    ("transformer.decoder.", "detr_decoder."),  # query_embed, reference_points, presence_token, instance_*
    ("dot_prod_scoring.prompt_mlp.layers.0.", "dot_product_scoring.text_mlp.layer1."),
    ("dot_prod_scoring.prompt_mlp.layers.1.", "dot_product_scoring.text_mlp.layer2."),
    ("dot_prod_scoring.prompt_mlp.out_norm.", "dot_product_scoring.text_mlp_out_norm."),
    ("dot_prod_scoring.prompt_proj.", "dot_product_scoring.text_proj."),
    ("dot_prod_scoring.hs_proj.", "dot_product_scoring.query_proj."),
    ("segmentation_head.pixel_decoder.", "mask_decoder.pixel_decoder."),
    ("segmentation_head.mask_predictor.mask_embed.", "mask_decoder.mask_embedder."),
    ("segmentation_head.instance_seg_head.", "mask_decoder.instance_projection."),
    ("segmentation_head.semantic_seg_head.", "mask_decoder.semantic_projection."),
    ("segmentation_head.cross_attend_prompt.out_proj.", "mask_decoder.prompt_cross_attn.o_proj."),
    ("segmentation_head.cross_attend_prompt.", "mask_decoder.prompt_cross_attn."),
    ("segmentation_head.cross_attn_norm.", "mask_decoder.prompt_cross_attn_norm."),
]


def _compile(prefix: str) -> re.Pattern:
    return re.compile("^" + re.escape(prefix).replace(re.escape("{i}"), r"(?P<i>\d+)"))


_TO_HF = [(_compile(ours), hf) for ours, hf in HF_RENAMES]
_FROM_HF = [(_compile(hf), ours) for ours, hf in HF_RENAMES]


def _rename(key: str, rules) -> str | None:
    for pattern, target in rules:
        m = pattern.match(key)
        if m:
            i = m.groupdict().get("i")
            return (target.replace("{i}", i) if i is not None else target) + key[m.end():]
    return None


_QKV_HF = re.compile(r"^(?P<base>.*\.)(?P<which>[qkv])_proj\.(?P<kind>weight|bias)$")


# Meta weights that transformers' Sam3Model has no place for (it implements box prompts only).
NOT_IN_HF = ("geometry_encoder.points_",)


def to_hf_layout(state: dict[str, torch.Tensor], prefix: str = "detector_model.") -> dict[str, torch.Tensor]:
    """Sammie/Meta names -> transformers `Sam3Model` names (split q/k/v, cls-free abs-pos,
    transposed CLIP projection). Drops the complex RoPE tables (transformers recomputes them)
    and the point-prompt weights (transformers has none)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith(NOT_IN_HF):
            continue
        hf = _rename(key, _TO_HF)
        if hf is None:
            raise CheckpointError(f"no transformers name for {key!r}")
        if hf.endswith("rotary_emb.rope_embeddings"):
            continue
        if hf == "vision_encoder.backbone.embeddings.position_embeddings":
            value = value[:, 1:]  # [1, 1+P*P, C] -> [1, P*P, C]: the cls slot is never used
        elif hf == "text_encoder.text_projection.weight":
            value = value.t()
        if ".attention.qkv." in hf or ".in_proj_" in hf:
            kind = "weight" if hf.endswith("weight") else "bias"
            base = hf.rsplit(".qkv.", 1)[0] + "." if ".qkv." in hf else hf.rsplit("in_proj_", 1)[0]
            for which, part in zip("qkv", value.chunk(3, dim=0)):
                out[prefix + f"{base}{which}_proj.{kind}"] = part.contiguous()
            continue
        out[prefix + hf] = value.contiguous()
    return out


def from_hf_layout(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """transformers names -> Sammie/Meta names. Returns (state, keys it could not place)."""
    out: dict[str, torch.Tensor] = {}
    unplaced: list[str] = []
    qkv_parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith("detector_model."):
            key = key[len("detector_model."):]
        elif key.startswith(tuple(IGNORED_PREFIXES)):
            out[key] = value  # tracker weights: reported as ignored by `load_into`
            continue
        m = _QKV_HF.match(key)
        if m and (".attention." in key or "attn." in key or "_attn." in key):
            qkv_parts.setdefault((m["base"], m["kind"]), {})[m["which"]] = value
            continue
        ours = _rename(key, _FROM_HF)
        if ours is None:
            unplaced.append(key)
            continue
        if ours == _VIT + "pos_embed":
            cls = torch.zeros_like(value[:, :1])  # Meta's cls slot; dropped by tiling, never read
            value = torch.cat([cls, value], dim=1)
        elif ours == _TXT + "text_projection":
            value = value.t()
        out[ours] = value
    for (base, kind), parts in qkv_parts.items():
        if set(parts) != {"q", "k", "v"}:
            unplaced.extend(f"{base}{w}_proj.{kind}" for w in parts)
            continue
        fused = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
        if base.endswith(".attention."):
            hf_key = f"{base}qkv.{kind}"
        else:
            hf_key = f"{base}in_proj_{kind}"
        ours = _rename(hf_key, _FROM_HF)
        if ours is None:
            unplaced.append(hf_key)
        else:
            out[ours] = fused
    return out, unplaced


# --- Meta layout ------------------------------------------------------------------------


def from_meta_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sam3.pt` / `sam3.1_multiplex.pt` -> Sammie names: keep `detector.*`, strip the prefix.
    SAM 3.1's internal `sam3_model.` prefix means the same as `detector.`."""
    out = {}
    for key, value in state.items():
        for prefix in ("detector.", "sam3_model."):
            if key.startswith(prefix):
                out[key[len(prefix):]] = value
                break
        else:
            out[key] = value  # tracker.* etc.: judged by IGNORED_PREFIXES later
    return out


# --- files ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointSource:
    path: Path  # the weights file
    layout: str  # "meta" or "hf"
    tokenizer_json: Path | None = None  # a snapshot's tokenizer.json, if any


_META_NAMES = ("sam3.1_multiplex.pt", "sam3.pt")
_HF_NAMES = ("model.safetensors", "model.safetensors.index.json")


def resolve(path: str | os.PathLike) -> CheckpointSource:
    """A weights file, or a local Hugging Face snapshot directory of facebook/sam3 or
    facebook/sam3.1 (also the `models--facebook--sam3/snapshots/<rev>` cache layout)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if p.is_dir():
        snapshots = p / "snapshots"
        if snapshots.is_dir():  # HF cache root: pick the newest snapshot
            revs = sorted(snapshots.iterdir(), key=lambda d: d.stat().st_mtime)
            if revs:
                p = revs[-1]
        tok = p / "tokenizer.json"
        tok = tok if tok.exists() else None
        for name in _META_NAMES:
            if (p / name).exists():
                return CheckpointSource(p / name, "meta", tok)
        for name in _HF_NAMES:
            if (p / name).exists():
                return CheckpointSource(p / name, "hf", tok)
        raise FileNotFoundError(
            f"{p} holds none of {_META_NAMES + _HF_NAMES}; point --checkpoint at the weights file"
        )
    if p.suffix in (".pt", ".pth", ".bin"):
        return CheckpointSource(p, "meta")
    if p.suffix == ".safetensors" or p.name.endswith(".safetensors.index.json"):
        return CheckpointSource(p, "hf")
    raise CheckpointError(f"unknown checkpoint type {p.name!r}: expected .pt or .safetensors")


def read_state_dict(src: CheckpointSource) -> dict[str, torch.Tensor]:
    """Raw tensors from disk (CPU), in the file's own names."""
    if src.path.name.endswith(".index.json"):
        from safetensors.torch import load_file

        index = json.loads(src.path.read_text())
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            state.update(load_file(src.path.parent / shard))
        return state
    if src.path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(src.path)
    obj = torch.load(src.path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{src.path} is not a state dict of tensors")
    return obj


@dataclass
class LoadReport:
    source: str
    layout: str
    loaded: int = 0
    ignored: dict[str, int] = field(default_factory=dict)  # reason -> count
    optional_missing: list[str] = field(default_factory=list)
    rope_tables_checked: int = 0

    def summary(self) -> str:
        parts = [f"loaded {self.loaded} tensors from {self.source} ({self.layout} layout)"]
        for reason, n in self.ignored.items():
            parts.append(f"ignored {n}: {reason}")
        if self.optional_missing:
            parts.append(f"absent (unused by text prompts): {len(self.optional_missing)}")
        return "; ".join(parts)


def convert_state_dict(raw: dict[str, torch.Tensor], layout: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    if layout == "meta":
        return from_meta_layout(raw), []
    if layout == "hf":
        return from_hf_layout(raw)
    raise CheckpointError(f"unknown layout {layout!r}")


def load_into(model: torch.nn.Module, raw: dict[str, torch.Tensor], layout: str, source: str = "<memory>",
              dtype: torch.dtype | None = None) -> LoadReport:
    """Load a raw state dict of either layout into `model` (strict, with explanations).

    RoPE tables stored in Meta checkpoints (`...attn.freqs_cis`, complex64) are not kept: the
    model computes real cos/sin tables; each stored table is compared with the model's own and a
    mismatch (a different resolution or head dim) is an error.
    """
    state, unplaced = convert_state_dict(raw, layout)
    report = LoadReport(source=source, layout=layout)
    expected = model.state_dict()
    unexpected: list[str] = list(unplaced)
    clean: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        reason = next((r for p, r in IGNORED_PREFIXES.items() if key.startswith(p)), None)
        if reason is not None:
            report.ignored[reason] = report.ignored.get(reason, 0) + 1
            continue
        if key.endswith("attn.freqs_cis"):
            _check_rope_table(model, key, value)
            report.rope_tables_checked += 1
            continue
        if key not in expected:
            unexpected.append(key)
            continue
        clean[key] = value
    missing = [k for k in expected if k not in clean]
    report.optional_missing = [k for k in missing if any(re.fullmatch(p, k) for p in OPTIONAL_KEYS)]
    missing = [k for k in missing if k not in report.optional_missing]
    bad_shape = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in clean.items() if v.shape != expected[k].shape
    ]
    if missing or unexpected or bad_shape:
        lines = [f"checkpoint {source} ({layout} layout) does not match the model:"]
        for title, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", bad_shape)):
            if keys:
                lines.append(f"  {len(keys)} {title}:")
                lines.extend(f"    {k}" for k in sorted(keys))
        raise CheckpointError("\n".join(lines))
    if dtype is not None:
        clean = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in clean.items()}
    model.load_state_dict(clean, strict=False)
    report.loaded = len(clean)
    log.info(report.summary())
    return report


def _check_rope_table(model: torch.nn.Module, key: str, table: torch.Tensor) -> None:
    """Meta's complex RoPE table vs the one the model's cos/sin tables encode."""
    m = re.search(r"trunk\.blocks\.(\d+)\.attn\.freqs_cis$", key)
    trunk = _find_trunk(model)
    if m is None or trunk is None:
        raise CheckpointError(f"unexpected RoPE table {key}")
    ours = trunk.reference_freqs_cis().get(f"blocks.{m.group(1)}.attn.freqs_cis")
    if ours is None:
        raise CheckpointError(f"{key}: the model has no block {m.group(1)}")
    ours, table = ours.cpu().to(torch.complex64), table.cpu().to(torch.complex64)
    if ours.shape != table.shape or not torch.allclose(torch.view_as_real(ours), torch.view_as_real(table), atol=1e-4):
        raise CheckpointError(
            f"{key}: the checkpoint's RoPE table {tuple(table.shape)} differs from the model's "
            f"{tuple(ours.shape)}: image size, window size or head dim do not match the checkpoint"
        )


def _find_trunk(model: torch.nn.Module):
    try:
        return model.get_submodule("backbone.vision_backbone.trunk")
    except AttributeError:
        return None


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike, dtype: torch.dtype | None = None) -> LoadReport:
    """Load `sam3.pt`, `sam3.1_multiplex.pt`, a transformers `model.safetensors`, or a local
    snapshot directory holding one of them, into `model`."""
    src = resolve(path)
    return load_into(model, read_state_dict(src), src.layout, str(src.path), dtype)
