"""Meta's SAM 3 image model (PyPI `sam3==0.1.4`) built at any `Sam3Config`, on any device.

Test and benchmark only: this is the ground truth the oracle compares Sammie against.
It mirrors `sam3.model_builder.build_sam3_image_model` stage by stage, with the numbers
taken from our config instead of hard-coded, so the tiny test config builds too.

Meta's constructors and forward pass assume CUDA in three places
(`../shared/design/sam3-reference.md` section 11, rows 4, 5, 7); `cpu_safe()` redirects
those calls while constructing and running, without touching their code.
"""

from __future__ import annotations

import contextlib
import importlib
import functools
import os

import torch
from torch import nn

from sammie.config import Sam3Config


def bpe_vocab_path() -> str:
    """CLIP's BPE vocabulary; the `sam3` wheel does not ship it, `open_clip_torch` does."""
    import open_clip

    path = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"CLIP BPE vocabulary not found at {path}; install open_clip_torch")
    return path


@contextlib.contextmanager
def cpu_safe(device: torch.device | str):
    """Map Meta's hard-coded device="cuda" onto `device` and make pin_memory a no-op
    when CUDA is absent. Patches are undone on exit."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        yield
        return

    def redirect(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = device
            return fn(*args, **kwargs)

        return wrapper

    # Caches that remember torch's factory functions must be filled with the real ones before we
    # patch them: dynamo's skip lists (else it refuses to trace the real torch.zeros later), and
    # `torch.device(...)`'s constructor set (else every later `with torch.device("meta")` in the
    # process silently stops applying, and meta-device builds allocate real memory).
    importlib.import_module("torch._dynamo")
    importlib.import_module("torch.utils._device")._device_constructors()

    saved = {name: getattr(torch, name) for name in ("zeros", "arange", "tensor", "ones", "empty")}
    saved_pin = torch.Tensor.pin_memory
    try:
        for name, fn in saved.items():
            setattr(torch, name, redirect(fn))
        torch.Tensor.pin_memory = lambda self, *a, **k: self
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)
        torch.Tensor.pin_memory = saved_pin


# --- one builder per stage (names follow sam3.model_builder) -------------------------


def build_position_encoding(cfg: Sam3Config):
    from sam3.model.position_encoding import PositionEmbeddingSine

    return PositionEmbeddingSine(
        num_pos_feats=cfg.d_model, normalize=True, scale=None, temperature=10000,
        precompute_resolution=cfg.image_size,
    )


def build_vit(cfg: Sam3Config):
    from sam3.model.vitdet import ViT

    v = cfg.vision
    mlp_ratio = v.mlp_dim / v.width
    assert int(v.width * mlp_ratio) == v.mlp_dim, "mlp_dim must be reachable as int(width * ratio)"
    return ViT(
        img_size=v.image_size, pretrain_img_size=v.pretrain_image_size, patch_size=v.patch_size,
        embed_dim=v.width, depth=v.depth, num_heads=v.heads, mlp_ratio=mlp_ratio,
        norm_layer="LayerNorm", drop_path_rate=0.1, qkv_bias=True, use_abs_pos=True,
        tile_abs_pos=True, global_att_blocks=v.global_blocks, rel_pos_blocks=(), use_rope=True,
        use_interp_rope=True, window_size=v.window_size, pretrain_use_cls_token=True,
        retain_cls_token=False, ln_pre=True, ln_post=False, return_interm_layers=False,
        bias_patch_embed=False, compile_mode=None,
    )


def build_vision_backbone(cfg: Sam3Config):
    """ViT trunk + dual ViTDet neck (the `backbone.vision_backbone.*` keys)."""
    from sam3.model.necks import Sam3DualViTDetNeck

    return Sam3DualViTDetNeck(
        position_encoding=build_position_encoding(cfg), d_model=cfg.d_model,
        scale_factors=[4.0, 2.0, 1.0, 0.5], trunk=build_vit(cfg), add_sam2_neck=False,
    )


def build_text_encoder(cfg: Sam3Config):
    from sam3.model.text_encoder_ve import VETextEncoder
    from sam3.model.tokenizer_ve import SimpleTokenizer

    t = cfg.text
    return VETextEncoder(
        tokenizer=SimpleTokenizer(bpe_path=bpe_vocab_path()), d_model=cfg.d_model,
        width=t.width, heads=t.heads, layers=t.depth, context_length=t.context_length,
        vocab_size=t.vocab_size,
    )


def _mha(cfg: Sam3Config, dropout: float = 0.1, batch_first: bool | None = None):
    from sam3.model.model_misc import MultiheadAttentionWrapper

    kwargs = {} if batch_first is None else {"batch_first": batch_first}
    return MultiheadAttentionWrapper(num_heads=cfg.heads, dropout=dropout, embed_dim=cfg.d_model, **kwargs)


def build_fusion_encoder(cfg: Sam3Config):
    from sam3.model.encoder import TransformerEncoderFusion, TransformerEncoderLayer

    layer = TransformerEncoderLayer(
        activation="relu", d_model=cfg.d_model, dim_feedforward=cfg.ffn_dim, dropout=0.1,
        pos_enc_at_attn=True, pos_enc_at_cross_attn_keys=False,
        pos_enc_at_cross_attn_queries=False, pre_norm=True,
        self_attention=_mha(cfg, batch_first=True), cross_attention=_mha(cfg, batch_first=True),
    )
    return TransformerEncoderFusion(
        layer=layer, num_layers=cfg.encoder_layers, d_model=cfg.d_model, num_feature_levels=1,
        frozen=False, use_act_checkpoint=True, add_pooled_text_to_img_feat=False,
        pool_text_with_mask=True,
    )


def build_decoder(cfg: Sam3Config):
    from sam3.model.decoder import TransformerDecoder, TransformerDecoderLayer

    layer = TransformerDecoderLayer(
        activation="relu", d_model=cfg.d_model, dim_feedforward=cfg.ffn_dim, dropout=0.1,
        cross_attention=_mha(cfg), n_heads=cfg.heads, use_text_cross_attention=True,
    )
    return TransformerDecoder(
        layer=layer, num_layers=cfg.decoder_layers, num_queries=cfg.num_queries,
        return_intermediate=True, box_refine=True, num_o2m_queries=0, dac=True, boxRPB="log",
        d_model=cfg.d_model, frozen=False, interaction_layer=None, dac_use_selfatt_ln=True,
        resolution=cfg.image_size, stride=cfg.vision.patch_size, use_act_checkpoint=True,
        presence_token=cfg.presence_token,
    )


def build_transformer(cfg: Sam3Config):
    from sam3.model.model_misc import TransformerWrapper

    return TransformerWrapper(encoder=build_fusion_encoder(cfg), decoder=build_decoder(cfg), d_model=cfg.d_model)


def build_dot_product_scoring(cfg: Sam3Config):
    from sam3.model.model_misc import MLP, DotProductScoring

    prompt_mlp = MLP(
        input_dim=cfg.d_model, hidden_dim=cfg.ffn_dim, output_dim=cfg.d_model, num_layers=2,
        dropout=0.1, residual=True, out_norm=nn.LayerNorm(cfg.d_model),
    )
    return DotProductScoring(d_model=cfg.d_model, d_proj=cfg.d_model, prompt_mlp=prompt_mlp)


def build_segmentation_head(cfg: Sam3Config):
    from sam3.model.maskformer_segmentation import PixelDecoder, UniversalSegmentationHead

    pixel_decoder = PixelDecoder(
        num_upsampling_stages=3, interpolation_mode="nearest", hidden_dim=cfg.d_model, compile_mode=None,
    )
    return UniversalSegmentationHead(
        hidden_dim=cfg.d_model, upsampling_stages=3, aux_masks=False, presence_head=False,
        dot_product_scorer=None, act_ckpt=True, cross_attend_prompt=_mha(cfg, dropout=0),
        pixel_decoder=pixel_decoder,
    )


def build_geometry_encoder(cfg: Sam3Config):
    from sam3.model.encoder import TransformerEncoderLayer
    from sam3.model.geometry_encoders import SequenceGeometryEncoder

    layer = TransformerEncoderLayer(
        activation="relu", d_model=cfg.d_model, dim_feedforward=cfg.ffn_dim, dropout=0.1,
        pos_enc_at_attn=False, pre_norm=True, self_attention=_mha(cfg, batch_first=False),
        pos_enc_at_cross_attn_queries=False, pos_enc_at_cross_attn_keys=True,
        cross_attention=_mha(cfg, batch_first=False),
    )
    return SequenceGeometryEncoder(
        pos_enc=build_position_encoding(cfg).__class__(
            num_pos_feats=cfg.d_model, normalize=True, scale=None, temperature=10000
        ),
        encode_boxes_as_points=False, points_direct_project=True, points_pool=True,
        points_pos_enc=True, boxes_direct_project=True, boxes_pool=True, boxes_pos_enc=True,
        d_model=cfg.d_model, num_layers=cfg.geometry_layers, layer=layer, use_act_ckpt=True,
        add_cls=True, add_post_encode_proj=True,
    )


def build_reference_model(cfg: Sam3Config, device: torch.device | str = "cpu", seed: int | None = 0):
    """Meta's `Sam3Image` (eval mode, fp32) at `cfg`, random weights from `seed`."""
    from sam3.model.sam3_image import Sam3Image
    from sam3.model.vl_combiner import SAM3VLBackbone

    if seed is not None:
        torch.manual_seed(seed)
    with cpu_safe(device), torch.device(device):
        backbone = SAM3VLBackbone(visual=build_vision_backbone(cfg), text=build_text_encoder(cfg), scalp=1)
        model = Sam3Image(
            backbone=backbone, transformer=build_transformer(cfg),
            input_geometry_encoder=build_geometry_encoder(cfg),
            segmentation_head=build_segmentation_head(cfg), num_feature_levels=1,
            o2m_mask_predict=True, dot_prod_scoring=build_dot_product_scoring(cfg),
            use_instance_query=False, multimask_output=True, inst_interactive_predictor=None,
            matcher=None,
        )
    return model.to(device).eval()


@torch.inference_mode()
def reference_segment(model, cfg: Sam3Config, image, prompt: str, threshold: float,
                      device: torch.device | str = "cpu"):
    """Meta's `Sam3Processor` on one image and prompt -> (instances sorted by score as
    `sammie.segmenter.Instance`, mask probabilities [K, H, W] in the same order). Gray and RGBA
    images are converted to RGB first: Meta's processor fails on them."""
    from sammie.segmenter import Instance

    if getattr(image, "mode", "RGB") != "RGB":
        image = image.convert("RGB")
    proc = reference_processor(model, cfg, device, threshold=threshold)
    with cpu_safe(device):
        state = proc.set_text_prompt(prompt=prompt, state=proc.set_image(image))
    order = torch.argsort(state["scores"].float(), descending=True, stable=True)
    instances = [
        Instance(float(state["scores"][k]), tuple(state["boxes"][k].float().tolist()),
                 state["masks"][k, 0].cpu().numpy())
        for k in order.tolist()
    ]
    return instances, state["masks_logits"][order, 0].float().cpu().numpy()


@contextlib.contextmanager
def on_meta_device():
    """Build Meta's modules on the `meta` device (no memory: full-size key/shape checks).
    Meta's ViT reads its drop-path rates with `.item()`, so that one linspace stays on the CPU."""
    linspace = torch.linspace
    torch.linspace = lambda *a, **k: linspace(*a, **{**k, "device": "cpu"})
    try:
        with torch.device("meta"), cpu_safe("meta"):
            yield
    finally:
        torch.linspace = linspace


def randomize_(model: nn.Module, seed: int = 0, std: float | None = None) -> nn.Module:
    """Give every parameter non-trivial random values so parity tests exercise every term.

    std=None (default): weight matrices and conv kernels N(0, 1/fan_in) (unit-variance
    activations: attention far from uniform, every branch moves the output), embedding tables
    and the ViT's abs-pos table N(0, 0.5^2), norm scales N(1, 0.1^2), biases N(0, 0.1^2).
    A float `std`: N(0, std^2) for everything but norm scales. Buffers are left as computed.
    """
    gen = torch.Generator().manual_seed(seed)
    norms = (nn.LayerNorm, nn.GroupNorm)
    with torch.no_grad():
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                noise = torch.randn(p.shape, generator=gen).to(p.dtype)
                if isinstance(module, norms) and name == "weight":
                    p.copy_(1.0 + 0.1 * noise)
                elif std is not None:
                    p.copy_(noise * std)
                elif isinstance(module, nn.Embedding) or p.ndim >= 3 and not isinstance(module, nn.modules.conv._ConvNd):
                    p.copy_(0.5 * noise)
                elif p.ndim >= 2:
                    p.copy_(noise / p[0].numel() ** 0.5)
                else:
                    p.copy_(0.1 * noise)
    return model


def reference_processor(model, cfg: Sam3Config, device: torch.device | str = "cpu", threshold: float | None = None):
    """Meta's `Sam3Processor` at our resolution; use its calls inside `cpu_safe(device)`."""
    from sam3.model.sam3_image_processor import Sam3Processor

    return Sam3Processor(
        model, resolution=cfg.image_size, device=str(device),
        confidence_threshold=cfg.score_threshold if threshold is None else threshold,
    )
