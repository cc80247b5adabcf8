"""Parity of the prompt side before decoding (geometry encoder, fusion encoder, attention helper)
against Meta's `sam3` modules at identical random weights (tiny config, CPU, fp32)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo  # noqa: F401  (see below)

from sammie.config import Sam3Config
from sammie.model.attention import MultiheadAttention
from sammie.model.fusion_encoder import FusionEncoder
from sammie.model.geometry import GeometryEncoder
from sammie.reference import (
    build_fusion_encoder,
    build_geometry_encoder,
    build_reference_model,
    cpu_safe,
    randomize_,
)
from tests.parity import assert_rel_close, rel_error

# `cpu_safe` swaps torch.zeros/arange/... for wrappers; if torch._dynamo is first imported while they
# are swapped (sam3's imports pull it in), dynamo later refuses to trace the real torch.zeros
# ("Attempted to call function marked as skipped"). Importing it above, before any cpu_safe, avoids it.
CFG = Sam3Config.tiny()
# std 0.1 instead of randomize_'s 0.02: at d_model 32 this makes every attention/FFN branch move the
# residual stream by O(1), so a wrong branch cannot hide under the residual.
WEIGHT_STD = 0.1


def _dummy_prompt(n: int):
    """`Sam3Image._get_dummy_prompt`: the geometric prompt `Sam3Processor` sends with a text prompt."""
    from sam3.model.geometry_encoders import Prompt

    return Prompt(box_embeddings=torch.zeros(0, n, 4), box_mask=torch.zeros(n, 0, dtype=torch.bool))


def _seq_first(x: torch.Tensor) -> torch.Tensor:  # [N, d, H, W] -> [HW, N, d], as `_get_img_feats`
    return x.flatten(2).permute(2, 0, 1)


def _tokens(x: torch.Tensor) -> torch.Tensor:  # [N, d, H, W] -> [N, HW, d]
    return x.flatten(2).transpose(1, 2)


def _image(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    d, g = CFG.d_model, CFG.feat_size
    return torch.randn(n, d, g, g, generator=gen), torch.randn(1, d, g, g, generator=gen)


def _prompt(n: int, seed: int, text_lengths: list[int]):
    """Text tokens (right-padded, True = pad) followed by one always-valid geometry token."""
    gen = torch.Generator().manual_seed(seed)
    ctx = CFG.text.context_length
    prompt = torch.randn(n, ctx + 1, CFG.d_model, generator=gen)
    padding = torch.arange(ctx + 1)[None] >= torch.tensor(text_lengths)[:, None]
    padding[:, ctx] = False  # geometry token
    return prompt, padding


@pytest.fixture(scope="module")
def geometry():
    with cpu_safe("cpu"):
        ref = build_geometry_encoder(CFG)
    ref = randomize_(ref, seed=1, std=WEIGHT_STD).eval()
    ours = GeometryEncoder(CFG).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


@pytest.fixture(scope="module")
def fusion():
    with cpu_safe("cpu"):
        ref = build_fusion_encoder(CFG)
    ref = randomize_(ref, seed=2, std=WEIGHT_STD).eval()
    ours = FusionEncoder(CFG).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def test_geometry_text_only_matches_meta(geometry):
    ours, ref = geometry
    n = 3
    feats, pos = _image(n, seed=10)
    g = CFG.feat_size
    with torch.inference_mode(), cpu_safe("cpu"):
        ref_tokens, ref_mask = ref(
            geo_prompt=_dummy_prompt(n), img_feats=[_seq_first(feats)], img_sizes=[(g, g)],
            img_pos_embeds=[_seq_first(pos.expand(n, -1, -1, -1))],
        )
        tokens, padding = ours(feats, pos)  # pos broadcast over the batch
        tokens_flat, _ = ours(_tokens(feats), _tokens(pos))  # flattened layout, same maths
    assert ref_tokens.shape == (1, n, CFG.d_model)
    assert_rel_close(tokens, ref_tokens.transpose(0, 1), what="geometry tokens")
    assert torch.equal(tokens_flat, tokens)
    assert padding.dtype == torch.bool and torch.equal(padding, ref_mask)
    assert not padding.any()


def test_fusion_encoder_matches_meta(fusion):
    ours, ref = fusion
    n, g = 3, CFG.feat_size
    feats, pos = _image(n, seed=20)
    # row 2: every text token padded, only the geometry token valid
    prompt, padding = _prompt(n, seed=21, text_lengths=[5, 32, 0])
    with torch.inference_mode(), cpu_safe("cpu"):
        src, src_pos = _seq_first(feats), _seq_first(pos.expand(n, -1, -1, -1))
        prompt_sf = prompt.transpose(0, 1)
        out = ref(  # exactly the kwargs of `Sam3Image._run_encoder`
            src=[src], src_key_padding_mask=None, src_pos=[src_pos], prompt=prompt_sf,
            prompt_pos=torch.zeros_like(prompt_sf), prompt_key_padding_mask=padding,
            feat_sizes=[(g, g)],
        )
        memory = ours(_tokens(feats), _tokens(pos), prompt, padding)
    ref_memory = out["memory"].transpose(0, 1)  # Meta returns sequence-first [HW, N, d]
    assert out["padding_mask"] is None and out["memory_text"] is prompt_sf
    assert_rel_close(memory, ref_memory, what="fusion memory")
    # the residual stream carries the input through: check the encoder's update on its own too
    assert_rel_close(memory - _tokens(feats), ref_memory - _tokens(feats), what="fusion update")


def test_prompt_path_matches_sam3image():
    """Meta's own assembly: `Sam3Image._encode_prompt` (dummy geometric prompt) + `_run_encoder`,
    vs ours with the geometry token computed once per image and gathered per (image, prompt)."""
    model = randomize_(build_reference_model(CFG), seed=3, std=WEIGHT_STD).eval()
    geometry = GeometryEncoder(CFG).eval()
    geometry.load_state_dict(model.geometry_encoder.state_dict(), strict=True)
    fusion = FusionEncoder(CFG).eval()
    fusion.load_state_dict(model.transformer.encoder.state_dict(), strict=True)

    gen = torch.Generator().manual_seed(30)
    d, g, ctx = CFG.d_model, CFG.feat_size, CFG.text.context_length
    num_images, num_texts = 2, 3
    levels = [torch.randn(num_images, d, g * s, g * s, generator=gen) for s in (4, 2, 1)]  # neck, scalp=1
    level_pos = [torch.randn(num_images, d, g * s, g * s, generator=gen) for s in (4, 2, 1)]
    text = torch.randn(ctx, num_texts, d, generator=gen)  # `language_features` is sequence-first
    text_padding = torch.arange(ctx)[None] >= torch.tensor([4, 32, 9])[:, None]  # True = pad
    backbone_out = {
        "backbone_fpn": levels, "vision_pos_enc": level_pos,
        "language_features": text, "language_mask": text_padding,
    }
    img_ids, text_ids = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 2, 0])
    find_input = SimpleNamespace(img_ids=img_ids, text_ids=text_ids)

    with torch.inference_mode(), cpu_safe("cpu"):
        prompt_ref, mask_ref, _ = model._encode_prompt(backbone_out, find_input, model._get_dummy_prompt(len(img_ids)))
        _, enc_out, _ = model._run_encoder(backbone_out, find_input, prompt_ref, mask_ref)

        geo, geo_padding = geometry(levels[-1], level_pos[-1])  # [num_images, 1, d]: per image
        prompt = torch.cat([text.transpose(0, 1)[text_ids], geo[img_ids]], dim=1)  # [N, 33, d]
        padding = torch.cat([text_padding[text_ids], geo_padding[img_ids]], dim=1)  # [N, 33]
        memory = fusion(_tokens(levels[-1])[img_ids], _tokens(level_pos[-1])[img_ids], prompt, padding)

    assert prompt_ref.shape == (ctx + 1, len(img_ids), d)
    assert torch.equal(padding, mask_ref)
    assert_rel_close(prompt, prompt_ref.transpose(0, 1), what="assembled prompt")
    assert_rel_close(memory, enc_out["encoder_hidden_states"].transpose(0, 1), what="encoder memory")


def test_state_dict_keys_full_size():
    """Full-size key names and shapes equal Meta's (both built on the meta device)."""
    cfg = Sam3Config()
    with torch.device("meta"), cpu_safe("meta"):
        pairs = [(GeometryEncoder(cfg), build_geometry_encoder(cfg)), (FusionEncoder(cfg), build_fusion_encoder(cfg))]
    for ours, ref in pairs:
        got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
        want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
        assert got == want
    assert sum(p.numel() for p in pairs[0][0].parameters()) == 8_215_808
    assert sum(p.numel() for p in pairs[1][0].parameters()) == 9_472_512


def _ours_end_to_end(geometry, fusion, feats, pos, prompt, padding):
    geo, geo_padding = geometry(feats, pos)
    prompt = torch.cat([prompt[:, :-1], geo], dim=1)
    padding = torch.cat([padding[:, :-1], geo_padding], dim=1)
    return geo, fusion(_tokens(feats), _tokens(pos), prompt, padding)


def test_bf16_runs(geometry, fusion):
    feats, pos = _image(2, seed=40)
    prompt, padding = _prompt(2, seed=41, text_lengths=[6, 0])
    with torch.inference_mode():
        want = _ours_end_to_end(geometry[0], fusion[0], feats, pos, prompt, padding)
        geo16, fus16 = GeometryEncoder(CFG).eval(), FusionEncoder(CFG).eval()
        geo16.load_state_dict(geometry[0].state_dict())
        fus16.load_state_dict(fusion[0].state_dict())
        geo16.to(torch.bfloat16), fus16.to(torch.bfloat16)
        args = [t.to(torch.bfloat16) for t in (feats, pos, prompt)]
        got = _ours_end_to_end(geo16, fus16, *args[:2], args[2], padding)
    for name, a, b in zip(("geometry", "memory"), got, want):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all()
        # bf16 keeps 8 mantissa bits (2^-9 ~ 2e-3 relative per rounding); through 1 + 2 layers of
        # LayerNorm/attention/FFN the measured error is 4.7e-3 (7.6e-3 at full size on an H200),
        # so 5e-2 flags only real breakage (a wrong branch gives O(1)).
        assert rel_error(a.float(), b) < 5e-2, f"bf16 {name}: {rel_error(a.float(), b):.3e}"


def _compile_check(geometry, fusion, backend: str | None, tol: float):
    feats, pos = _image(2, seed=50)
    prompt, padding = _prompt(2, seed=51, text_lengths=[3, 20])
    run = lambda *a: _ours_end_to_end(geometry, fusion, *a)  # noqa: E731
    torch._dynamo.reset()
    kwargs = {} if backend is None else {"backend": backend}
    compiled = torch.compile(run, fullgraph=True, **kwargs)
    start = time.perf_counter()
    with torch.inference_mode():
        want = run(feats, pos, prompt, padding)
        got = compiled(feats, pos, prompt, padding)
    print(f"compile ({backend or 'inductor'}) + first run {time.perf_counter() - start:.1f} s")
    for name, a, b in zip(("geometry", "memory"), got, want):
        assert_rel_close(a, b, tol=tol, what=f"compiled {name}")


def test_compile_fullgraph_trace(geometry, fusion):
    """fullgraph=True through dynamo + AOTAutograd (no graph breaks, no host syncs); a few seconds."""
    _compile_check(geometry[0], fusion[0], backend="aot_eager", tol=1e-6)


# Inductor's C++ codegen for geometry + fusion takes 60-120 s cold (~25 s with a warm cache) on the
# 2-core CI box, over the 30 s budget: opt in. (Measured passing: 64 s.)
@pytest.mark.skipif(
    not os.environ.get("SAMMIE_TEST_INDUCTOR"), reason="slow (60-120 s CPU codegen); set SAMMIE_TEST_INDUCTOR=1"
)
def test_compile_fullgraph_inductor(geometry, fusion):
    # inductor fuses/reorders LayerNorm and softmax reductions: fp32 rounding-level differences
    _compile_check(geometry[0], fusion[0], backend=None, tol=1e-5)


# --- attention helper vs nn.MultiheadAttention (what Meta's MultiheadAttentionWrapper is) ---


@pytest.fixture(scope="module")
def attention_pair():
    torch.manual_seed(60)
    ref = torch.nn.MultiheadAttention(CFG.d_model, CFG.heads, batch_first=True).eval()
    randomize_(ref, seed=61, std=WEIGHT_STD)
    ours = MultiheadAttention(CFG.d_model, CFG.heads).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


@pytest.mark.parametrize("kind", ["self", "self_pos", "kv_shared", "cross"])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_matches_nn_mha(attention_pair, kind, masked):
    ours, ref = attention_pair
    gen = torch.Generator().manual_seed(62)
    b, lq, lk, d = 3, 5, 7, CFG.d_model
    x = torch.randn(b, lq, d, generator=gen)
    y, z = torch.randn(b, lk, d, generator=gen), torch.randn(b, lk, d, generator=gen)
    if kind == "self":
        q = k = v = x
    elif kind == "self_pos":  # q = k = x + pos, v = x: the encoders' self-attention
        q = k = x + 1.0
        v = x
    elif kind == "kv_shared":
        q, k, v = x, y, y
    else:
        q, k, v = x, y, z
    mask = None
    if masked:
        mask = torch.zeros(b, k.shape[1], dtype=torch.bool)
        mask[0, 2:] = True
        mask[2, :1] = True
    with torch.inference_mode():
        want = ref(q, k, v, key_padding_mask=mask, need_weights=False)[0]
        got = ours(q, k, v, key_padding_mask=mask)
    assert_rel_close(got, want, what=f"attention {kind} masked={masked}")


def test_attention_bias_matches_nn_mha(attention_pair):
    """Additive per-head float bias (the decoder's box relative-position bias), with padding."""
    ours, ref = attention_pair
    gen = torch.Generator().manual_seed(63)
    b, h, lq, lk, d = 2, CFG.heads, 4, 6, CFG.d_model
    x, y = torch.randn(b, lq, d, generator=gen), torch.randn(b, lk, d, generator=gen)
    bias = torch.randn(b, h, lq, lk, generator=gen) * 3
    mask = torch.zeros(b, lk, dtype=torch.bool)
    mask[1, 4:] = True
    with torch.inference_mode():
        float_mask = torch.zeros(b, lk).masked_fill(mask, float("-inf"))  # nn.MHA wants one mask type
        want = ref(x, y, y, attn_mask=bias.flatten(0, 1), key_padding_mask=float_mask, need_weights=False)[0]
        got = ours(x, y, y, key_padding_mask=mask, attn_bias=bias)
        want_nomask = ref(x, y, y, attn_mask=bias.flatten(0, 1), need_weights=False)[0]
        got_nomask = ours(x, y, y, attn_bias=bias)
    assert_rel_close(got, want, what="attention with bias + padding")
    assert_rel_close(got_nomask, want_nomask, what="attention with bias")


def test_attention_all_padded_row(attention_pair):
    """A fully padded key row: zero attention output (SDPA safe softmax), so out_proj.bias, as
    nn.MultiheadAttention gives on this torch; never NaN. The text path never produces such a row
    (the geometry token is always valid); this pins the behaviour if a caller ever does."""
    ours, ref = attention_pair
    x, y = torch.randn(2, 3, CFG.d_model), torch.randn(2, 4, CFG.d_model)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1] = True
    with torch.inference_mode():
        got = ours(x, y, y, key_padding_mask=mask)
        want = ref(x, y, y, key_padding_mask=mask, need_weights=False)[0]
    assert torch.isfinite(got).all()
    assert torch.allclose(got[1], ours.out_proj.bias.expand(3, -1))
    assert_rel_close(got, want, what="attention with an all-padded row")
