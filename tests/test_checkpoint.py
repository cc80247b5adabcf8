"""Checkpoint loading in the three official layouts, on synthetic files written in exactly those
layouts from Meta's reference model (tiny config): `sam3.pt`, `sam3.1_multiplex.pt` and the
transformers `model.safetensors` (written by transformers' own `Sam3Model`). Each must load with
zero missing/unexpected keys and reproduce Meta's outputs; at full size the key names and
shapes must match Meta's and transformers' models (built on the meta device)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from sammie.checkpoint import CheckpointError, load_checkpoint, resolve, to_hf_layout
from sammie.config import Sam3Config
from sammie.model.detector import Sam3Detector
from sammie.reference import build_reference_model, cpu_safe, on_meta_device, randomize_
from sammie.tokenizer import ClipTokenizer
from tests.parity import assert_rel_close

CFG = Sam3Config.tiny()
PROMPTS = ["a dog", "the red umbrella"]


def hf_config(cfg: Sam3Config):
    """transformers' Sam3Config with the same numbers as ours (full size: its defaults)."""
    from transformers import Sam3Config as HFConfig

    v, t = cfg.vision, cfg.text
    g = cfg.feat_size
    d = cfg.d_model
    layers = dict(hidden_size=d, num_attention_heads=cfg.heads, intermediate_size=cfg.ffn_dim)
    return HFConfig(
        vision_config=dict(
            backbone_config=dict(
                model_type="sam3_vit_model", hidden_size=v.width, intermediate_size=v.mlp_dim,
                num_hidden_layers=v.depth, num_attention_heads=v.heads, image_size=v.image_size,
                patch_size=v.patch_size, window_size=v.window_size, global_attn_indexes=list(v.global_blocks),
                pretrain_image_size=v.pretrain_image_size,
            ),
            fpn_hidden_size=d, backbone_feature_sizes=[[4 * g, 4 * g], [2 * g, 2 * g], [g, g]],
        ),
        text_config=dict(hidden_size=t.width, intermediate_size=4 * t.width, num_hidden_layers=t.depth,
                         num_attention_heads=t.heads, max_position_embeddings=t.context_length, projection_dim=512),
        geometry_encoder_config=dict(num_layers=cfg.geometry_layers, **layers),
        detr_encoder_config=dict(num_layers=cfg.encoder_layers, **layers),
        detr_decoder_config=dict(num_layers=cfg.decoder_layers, num_queries=cfg.num_queries, **layers),
        mask_decoder_config=dict(hidden_size=d, num_attention_heads=cfg.heads),
    )


@pytest.fixture(scope="module")
def meta():
    return randomize_(build_reference_model(CFG), seed=11).eval()


@pytest.fixture(scope="module")
def reference_outputs(meta):
    """Meta's raw grounding outputs for 2 images x 2 prompts."""
    from sam3.model.data_misc import FindStage

    torch.manual_seed(0)
    pixels = torch.rand(2, 3, CFG.image_size, CFG.image_size) * 2 - 1
    img = torch.tensor([0, 0, 1, 1])
    txt = torch.tensor([0, 1, 0, 1])
    with torch.inference_mode(), cpu_safe("cpu"):
        out = meta.backbone.forward_image(pixels)
        out.update(meta.backbone.forward_text(PROMPTS, device="cpu"))
        find = FindStage(img_ids=img, text_ids=txt, input_boxes=None, input_boxes_mask=None,
                         input_boxes_label=None, input_points=None, input_points_mask=None)
        ref = meta.forward_grounding(backbone_out=out, find_input=find, find_target=None,
                                     geometric_prompt=meta._get_dummy_prompt(num_prompts=4))
    return pixels, img, txt, ref


def assert_reproduces(model: Sam3Detector, reference_outputs):
    pixels, img, txt, ref = reference_outputs
    with torch.inference_mode():
        out = model.ground(model.encode_images(pixels), model.encode_prompts(ClipTokenizer()(PROMPTS)), img, txt)
    assert_rel_close(out.logits, ref["pred_logits"][..., 0], what="logits")
    assert_rel_close(out.presence_logits, ref["presence_logit_dec"][:, 0], what="presence")
    assert_rel_close(out.boxes, ref["pred_boxes"], what="boxes")
    assert_rel_close(out.mask_logits, ref["pred_masks"], what="masks")


def _tracker_keys():
    return {"tracker.maskmem_backbone.mask_downsampler.encoder.0.weight": torch.randn(4, 1, 3, 3),
            "tracker.transformer.encoder.layers.0.norm1.weight": torch.ones(8)}


def test_meta_sam3_pt(tmp_path, meta, reference_outputs):
    state = {"detector." + k: v for k, v in meta.state_dict().items()}
    state.update(_tracker_keys())
    path = tmp_path / "sam3.pt"
    torch.save({"model": state}, path)  # Meta nests the state dict under "model"
    model = Sam3Detector(CFG).eval()
    report = load_checkpoint(model, path)
    assert report.layout == "meta" and not report.optional_missing
    assert report.rope_tables_checked == CFG.vision.depth
    assert sum(report.ignored.values()) == 2  # the tracker keys
    assert report.loaded == len(model.state_dict())
    assert_reproduces(model, reference_outputs)


def _tri_neck_extras(detector_state):
    """SAM 3.1's Sam3TriViTDetNeck: two clones of the neck levels 0-2 (18 tensors each)."""
    extras = {}
    for k, v in detector_state.items():
        if k.startswith("backbone.vision_backbone.convs.") and not k.startswith("backbone.vision_backbone.convs.3."):
            for name in ("interactive_convs", "propagation_convs"):
                extras["detector." + k.replace(".convs.", f".{name}.")] = v.clone()
    return extras


def test_sam31_multiplex_pt(tmp_path, meta, reference_outputs):
    base = meta.state_dict()
    state = {"detector." + k: v for k, v in base.items() if not k.startswith("backbone.vision_backbone.convs.3.")}
    extras = _tri_neck_extras(base)
    assert len(extras) == 36  # 18 + 18, as counted in Meta's SAM 3.1 builder
    state.update(extras)
    state.update(_tracker_keys())
    path = tmp_path / "sam3.1_multiplex.pt"
    torch.save(state, path)  # not nested
    model = Sam3Detector(CFG).eval()
    report = load_checkpoint(model, path)
    assert sorted(report.optional_missing) == sorted(k for k in base if k.startswith("backbone.vision_backbone.convs.3."))
    assert sum(report.ignored.values()) == 36 + 2
    assert_reproduces(model, reference_outputs)


def test_transformers_safetensors(tmp_path, meta, reference_outputs):
    from transformers import Sam3Model

    hf = Sam3Model(hf_config(CFG)).eval()
    converted = to_hf_layout(meta.state_dict(), prefix="")
    result = hf.load_state_dict(converted, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result  # exactly transformers' layout
    # what transformers itself writes, under the sam3_video checkpoint's `detector_model.` prefix
    state = {"detector_model." + k: v.contiguous() for k, v in hf.state_dict().items()}
    state["tracker_model.memory_encoder.fuser.layers.0.weight"] = torch.randn(4)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    save_file(state, snapshot / "model.safetensors")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "sam3_video"}))
    src = resolve(snapshot)
    assert src.layout == "hf" and src.path.name == "model.safetensors"
    model = Sam3Detector(CFG).eval()
    report = load_checkpoint(model, snapshot)
    # transformers has no point-prompt weights; they stay unused
    assert all(k.startswith("geometry_encoder.points_") for k in report.optional_missing)
    assert_reproduces(model, reference_outputs)


def test_snapshot_directory_and_cache_layout(tmp_path, meta):
    rev = tmp_path / "models--facebook--sam3" / "snapshots" / "abc123"
    rev.mkdir(parents=True)
    torch.save({"detector." + k: v for k, v in meta.state_dict().items()}, rev / "sam3.pt")
    (rev / "tokenizer.json").write_text("{}")
    src = resolve(tmp_path / "models--facebook--sam3")
    assert src.layout == "meta" and src.path == rev / "sam3.pt" and src.tokenizer_json == rev / "tokenizer.json"


def test_load_in_bf16(tmp_path, meta):
    path = tmp_path / "sam3.pt"
    torch.save({"detector." + k: v for k, v in meta.state_dict().items()}, path)
    model = Sam3Detector(CFG).to(torch.bfloat16)
    load_checkpoint(model, path, dtype=torch.bfloat16)
    w = model.transformer.decoder.query_embed.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, meta.transformer.decoder.query_embed.weight.to(torch.bfloat16))


def test_errors_list_every_bad_key(tmp_path, meta):
    state = {"detector." + k: v for k, v in meta.state_dict().items()}
    state.pop("detector.transformer.decoder.query_embed.weight")
    state["detector.transformer.decoder.mystery.weight"] = torch.zeros(1)
    state["detector.dot_prod_scoring.hs_proj.weight"] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(Sam3Detector(CFG), tmp_path / "bad.pt")
    msg = str(err.value)
    assert "1 missing" in msg and "transformer.decoder.query_embed.weight" in msg
    assert "1 unexpected" in msg and "transformer.decoder.mystery.weight" in msg
    assert "1 wrong shape" in msg and "dot_prod_scoring.hs_proj.weight" in msg


def test_errors_for_wrong_config_and_files(tmp_path, meta):
    state = {"detector." + k: v for k, v in meta.state_dict().items()}
    torch.save(state, tmp_path / "sam3.pt")
    wrong = CFG.with_(vision=CFG.vision.__class__(**{**CFG.vision.__dict__, "rope_theta": 500.0}))
    with pytest.raises(CheckpointError, match="RoPE table"):
        load_checkpoint(Sam3Detector(wrong), tmp_path / "sam3.pt")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(Sam3Detector(CFG), tmp_path / "nope.pt")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="not a state dict"):
        load_checkpoint(Sam3Detector(CFG), tmp_path / "list.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds none of"):
        resolve(tmp_path / "empty")
    (tmp_path / "weights.onnx").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unknown checkpoint type"):
        resolve(tmp_path / "weights.onnx")


def test_full_size_keys_and_shapes_match_meta_and_transformers():
    from transformers import Sam3Model

    cfg = Sam3Config()
    with on_meta_device():
        ref = build_reference_model(cfg, device="meta", seed=None).state_dict()
    with torch.device("meta"):
        ours = Sam3Detector(cfg).state_dict()
        hf = Sam3Model(hf_config(cfg)).state_dict()
    assert all(v.is_meta for v in ours.values()) and all(v.is_meta for v in hf.values())
    rope = {k for k in ref if k.endswith("attn.freqs_cis")}
    assert len(rope) == 32 and len(ref) == 1134  # Meta's image model: 1134 state-dict entries
    assert set(ours) == set(ref) - rope
    assert all(ours[k].shape == ref[k].shape for k in ours)
    assert sum(v.numel() for v in ours.values()) == 840_509_750  # Meta's image model, same count
    converted = to_hf_layout(ref, prefix="")
    assert set(converted) == set(hf)
    assert all(converted[k].shape == hf[k].shape for k in hf)
