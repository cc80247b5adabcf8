"""Parity of `sammie.model.mask_head.MaskHead` with Meta's `UniversalSegmentationHead` (`segmentation_head.*`).

Meta's head is called exactly as `Sam3Image._run_segmentation_heads` calls it in eval mode: per-image
`backbone_fpn`, all decoder layers' `hs` [layers, N, Q, d] (batch-first), `image_ids`, seq-first
`encoder_hidden_states` [HW, N, d] and `prompt` [L, N, d], `prompt_mask` [N, L] (True = padding).
"""

import os
import time

import pytest
import torch

from sammie.config import Sam3Config
from sammie.model.mask_head import IGNORED_REFERENCE_KEYS, MaskHead
from sammie.reference import build_segmentation_head, cpu_safe, randomize_
from tests.parity import assert_rel_close, rel_error

CFG = Sam3Config.tiny()


def _inputs(num_images: int, image_ids: list[int], seed: int = 1, prompt_len: int = 33):
    gen = torch.Generator().manual_seed(seed)
    d, g, n = CFG.d_model, CFG.feat_size, len(image_ids)
    fpn = [torch.randn(num_images, d, s, s, generator=gen) for s in (4 * g, 2 * g, g)]
    hs = torch.randn(CFG.decoder_layers, n, CFG.num_queries, d, generator=gen)  # [layers, N, Q, d]
    memory = torch.randn(n, g * g, d, generator=gen)  # [N, HW, d]
    prompt = torch.randn(n, prompt_len, d, generator=gen)  # [N, L, d]
    # text tokens padded after a per-pair length, the last (geometry CLS) token always valid, as in Meta
    lengths = torch.tensor([5, 12, 31, 2][:n])
    padding = torch.arange(prompt_len)[None, :] >= lengths[:, None]
    padding[:, -1] = False
    return dict(
        fpn=fpn, image_index=torch.tensor(image_ids), memory=memory, prompt=prompt,
        prompt_padding=padding, hs=hs,
    )


def _run_ours(model, x):
    return model(x["fpn"], x["image_index"], x["memory"], x["prompt"], x["prompt_padding"], x["hs"][-1])


def _run_meta(meta, x):
    out = meta(
        backbone_feats=x["fpn"], obj_queries=x["hs"], image_ids=x["image_index"],
        encoder_hidden_states=x["memory"].transpose(0, 1), act_ckpt_enable=False,
        prompt=x["prompt"].transpose(0, 1), prompt_mask=x["prompt_padding"],
    )
    return out["pred_masks"], out["semantic_seg"]


@pytest.fixture(scope="module")
def models():
    with cpu_safe("cpu"):
        meta = build_segmentation_head(CFG)
    randomize_(meta, seed=0).eval()
    # randomize_'s std 0.02 makes the prompt attention nearly uniform and tiny next to the residual, so a wrong
    # padding mask or head split would hide below 1e-4; Xavier-scale projections give O(1) logits and updates.
    gen = torch.Generator().manual_seed(1)
    attn, d = meta.cross_attend_prompt, CFG.d_model
    with torch.no_grad():
        attn.in_proj_weight.copy_(torch.randn(attn.in_proj_weight.shape, generator=gen) * 2 / d**0.5)
        attn.out_proj.weight.copy_(torch.randn(attn.out_proj.weight.shape, generator=gen) / d**0.5)
    ours = MaskHead(CFG).eval()
    ours.load_state_dict(meta.state_dict(), strict=True)
    return ours, meta


@pytest.mark.parametrize("num_images,image_ids", [(2, [0, 0, 1]), (1, [0, 0])])
def test_parity_fp32(models, num_images, image_ids):
    ours, meta = models
    x = _inputs(num_images, image_ids)
    with torch.inference_mode():
        masks, semantic = _run_ours(ours, x)
        with cpu_safe("cpu"):
            ref_masks, ref_semantic = _run_meta(meta, x)
    g4 = CFG.mask_size
    assert masks.shape == (len(image_ids), CFG.num_queries, g4, g4)
    assert semantic.shape == (len(image_ids), 1, g4, g4)
    assert_rel_close(masks, ref_masks, what="pred_masks")
    assert_rel_close(semantic, ref_semantic, what="semantic_seg")
    print(f"B={num_images} N={len(image_ids)}: rel err masks {rel_error(masks, ref_masks):.2e}, "
          f"semantic {rel_error(semantic, ref_semantic):.2e}")


def test_padding_is_ignored(models):
    ours, _ = models
    x = _inputs(2, [0, 0, 1])
    with torch.inference_mode():
        masks, semantic = _run_ours(ours, x)
        x["prompt"] = torch.where(x["prompt_padding"][..., None], 1e3, x["prompt"])
        masks2, semantic2 = _run_ours(ours, x)
    torch.testing.assert_close(masks2, masks)
    torch.testing.assert_close(semantic2, semantic)


def test_full_size_keys_and_shapes():
    cfg = Sam3Config()
    with torch.device("meta"), cpu_safe("meta"):
        meta = build_segmentation_head(cfg)
        ours = MaskHead(cfg)
    ref = {k: tuple(v.shape) for k, v in meta.state_dict().items() if k not in IGNORED_REFERENCE_KEYS}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == ref
    assert sum(v.numel() for v in ours.state_dict().values()) == 2_298_881  # design doc section 3


def test_bf16(models):
    ours, _ = models
    x = _inputs(2, [0, 0, 1])
    bf16 = MaskHead(CFG).eval()
    bf16.load_state_dict(ours.state_dict())
    bf16.to(torch.bfloat16)
    xb = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in x.items() if k != "fpn"}
    xb["fpn"] = [f.to(torch.bfloat16) for f in x["fpn"]]
    with torch.inference_mode():
        masks, semantic = _run_ours(ours, x)
        masks_b, semantic_b = _run_ours(bf16, xb)
    assert masks_b.dtype == semantic_b.dtype == torch.bfloat16
    assert torch.isfinite(masks_b).all() and torch.isfinite(semantic_b).all()
    # bf16 keeps 8 mantissa bits (~4e-3 per rounding); a few chained convs/norms/matmuls land at ~1e-2.
    err_m, err_s = rel_error(masks_b, masks), rel_error(semantic_b, semantic)
    print(f"bf16 rel err masks {err_m:.2e}, semantic {err_s:.2e}")
    assert err_m < 5e-2 and err_s < 5e-2


def test_compile_fullgraph_trace(models):
    """fullgraph=True through dynamo + AOTAutograd decompositions (no graph breaks, no host syncs), ~6 s."""
    ours, _ = models
    x = _inputs(2, [0, 0, 1])
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        masks, semantic = _run_ours(ours, x)
        masks_c, semantic_c = _run_ours(compiled, x)
    assert_rel_close(masks_c, masks, tol=1e-6, what="aot_eager pred_masks")
    assert_rel_close(semantic_c, semantic, tol=1e-6, what="aot_eager semantic_seg")


# Inductor's C++ codegen for this head takes ~60 s on the 2-core CI box (over the 30 s budget): opt in.
@pytest.mark.skipif(not os.environ.get("SAMMIE_TEST_INDUCTOR"), reason="slow (~60 s CPU codegen); set SAMMIE_TEST_INDUCTOR=1")
def test_compile_fullgraph_inductor(models):
    ours, _ = models
    x = _inputs(2, [0, 0, 1])
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    start = time.perf_counter()
    with torch.inference_mode():
        masks, semantic = _run_ours(ours, x)
        masks_c, semantic_c = _run_ours(compiled, x)
    print(f"compile + first run {time.perf_counter() - start:.1f} s")
    # inductor fuses/reorders reductions (GroupNorm, LayerNorm, softmax): fp32 rounding-level differences.
    assert_rel_close(masks_c, masks, tol=1e-5, what="compiled pred_masks")
    assert_rel_close(semantic_c, semantic, tol=1e-5, what="compiled semantic_seg")
