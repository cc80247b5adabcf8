"""Parity of the vision backbone (ViT trunk + FPN neck + sine positions) with Meta's sam3.

Meta's modules come from `sammie.reference` at the same config and weights. Weights use
std 0.2 rather than `randomize_`'s default 0.02: at the tiny width, std 0.02 leaves attention
nearly uniform, and then dropping RoPE entirely moves the output by only ~1e-4 (measured),
i.e. a position bug would hide under the 1e-4 tolerance. `test_parity_is_sensitive_to_rope`
guards this.
"""

import os

import pytest
import torch

from sammie.config import Sam3Config
from sammie.model.position import sine_position_encoding
from sammie.model.vision import OPTIONAL_REFERENCE_PREFIX, VisionBackbone
from sammie.model.vit import ViT, is_ignored_reference_key, rope_reference_table
from sammie.reference import build_vision_backbone, build_vit, cpu_safe, on_meta_device, randomize_
from tests.parity import assert_rel_close, rel_error

WEIGHT_STD = 0.2
BATCH = 2


def _ours_state(ref: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in ref.state_dict().items() if not is_ignored_reference_key(k)}


def _pixels(cfg: Sam3Config, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 3, cfg.image_size, cfg.image_size, generator=g)


@pytest.fixture(scope="module")
def cfg():
    return Sam3Config.tiny()


@pytest.fixture(scope="module")
def meta_backbone(cfg):
    with cpu_safe("cpu"):
        ref = build_vision_backbone(cfg)
    return randomize_(ref, seed=1, std=WEIGHT_STD).eval()


@pytest.fixture(scope="module")
def backbone(cfg, meta_backbone):
    ours = VisionBackbone(cfg).eval()
    ours.load_state_dict(_ours_state(meta_backbone), strict=True)
    return ours


@pytest.fixture(scope="module")
def fp32_out(backbone, cfg):
    with torch.inference_mode():
        return backbone(_pixels(cfg))


# --- fp32 parity ----------------------------------------------------------------------------


def test_backbone_matches_meta(cfg, meta_backbone, fp32_out):
    features, positions = fp32_out
    with torch.inference_mode(), cpu_safe("cpu"):
        ref_feats, ref_pos, _, _ = meta_backbone(_pixels(cfg))
    assert len(ref_feats) == 4 and len(features) == 3  # Meta's 0.5x level is dropped (scalp=1)
    G, d = cfg.feat_size, cfg.d_model
    for i, (f, p, rf, rp) in enumerate(zip(features, positions, ref_feats, ref_pos)):
        side = G * 4 // 2**i
        assert f.shape == (BATCH, d, side, side) and p.shape == (1, d, side, side)
        assert_rel_close(f, rf, what=f"feature level {i}")
        assert_rel_close(p.expand_as(rp), rp, tol=1e-6, what=f"position level {i}")


def test_trunk_matches_meta(cfg):
    with cpu_safe("cpu"):
        ref = randomize_(build_vit(cfg), seed=2, std=WEIGHT_STD).eval()
    ours = ViT(cfg.vision).eval()
    ours.load_state_dict(_ours_state(ref), strict=True)
    x = _pixels(cfg, seed=3)
    with torch.inference_mode():
        out = ours(x)
        (ref_out,) = ref(x)
    G = cfg.vision.grid_size
    assert out.shape == (BATCH, cfg.vision.width, G, G)
    assert_rel_close(out, ref_out, what="trunk")


def test_parity_is_sensitive_to_rope(cfg, meta_backbone):
    """Removing RoPE from either kind of block must move the trunk far beyond the tolerance."""
    ours = ViT(cfg.vision).eval()
    ours.load_state_dict(_ours_state(meta_backbone.trunk))
    x = _pixels(cfg)
    with torch.inference_mode():
        (ref_out,) = meta_backbone.trunk(x)
        for kind in ("window", "global"):
            cos, sin = getattr(ours, f"rope_{kind}_cos"), getattr(ours, f"rope_{kind}_sin")
            saved = cos.clone(), sin.clone()
            cos.fill_(1.0), sin.zero_()
            err = rel_error(ours(x), ref_out)
            cos.copy_(saved[0]), sin.copy_(saved[1])
            assert err > 1e-2, f"no-RoPE in {kind} blocks only moved the output by {err:.1e}"


def test_position_encoding_matches_meta():
    from sam3.model.position_encoding import PositionEmbeddingSine

    for d_model, (h, w) in ((256, (72, 72)), (256, (36, 144)), (32, (5, 7))):
        ref = PositionEmbeddingSine(num_pos_feats=d_model, normalize=True)(torch.zeros(2, 1, h, w))
        ours = sine_position_encoding(h, w, d_model)
        assert ours.shape == (1, d_model, h, w) and ours.dtype == torch.float32
        assert_rel_close(ours.expand_as(ref), ref, tol=1e-6, what=f"sine pos {d_model}x{h}x{w}")


# --- RoPE tables vs Meta's complex freqs_cis buffers ------------------------------------------


def test_rope_reference_table_matches_meta_buffers(cfg):
    with cpu_safe("cpu"):
        ref = build_vit(cfg)
    ours = ViT(cfg.vision)
    ref_state = ref.state_dict()
    expected = ours.reference_freqs_cis()
    assert set(expected) == {k for k in ref_state if is_ignored_reference_key(k)}
    for key, table in expected.items():
        assert table.dtype == torch.complex64
        assert_rel_close(torch.view_as_real(table), torch.view_as_real(ref_state[key]), tol=1e-6, what=key)


def test_rope_reference_table_full_size_matches_meta():
    """At full size Meta's buffers only exist on the meta device, so compare with the function
    that fills them, called with the arguments Meta's `Attention` derives."""
    from sam3.model.vitdet import compute_axial_cis

    v = Sam3Config().vision
    for global_attention, side, scale in ((False, v.window_size, 1.0), (True, v.grid_size, v.window_size / v.grid_size)):
        ref = compute_axial_cis(dim=v.width // v.heads, end_x=side, end_y=side, theta=v.rope_theta, scale_pos=scale)
        ours = rope_reference_table(v, global_attention)
        assert ours.shape == ref.shape == (side * side, v.width // v.heads // 2)  # [576|5184, 32]
        assert_rel_close(torch.view_as_real(ours), torch.view_as_real(ref), tol=1e-6, what=f"global={global_attention}")


def test_rope_buffers_are_the_reference_table(cfg):
    """Our cos/sin buffers are exactly the real and imaginary parts of Meta's complex table."""
    v = cfg.vision
    ours = ViT(v)
    for kind, table in (("window", rope_reference_table(v, False)), ("global", rope_reference_table(v, True))):
        assert torch.equal(getattr(ours, f"rope_{kind}_cos"), table.real)
        assert torch.equal(getattr(ours, f"rope_{kind}_sin"), table.imag)


# --- full-size key names and shapes -----------------------------------------------------------


def test_full_size_state_dict_matches_meta():
    cfg = Sam3Config()
    with on_meta_device():
        ref = build_vision_backbone(cfg).state_dict()
    with torch.device("meta"):
        ours = VisionBackbone(cfg).state_dict()
    ref_kept = {k: v for k, v in ref.items() if not is_ignored_reference_key(k)}
    assert list(ours) == list(ref_kept)  # same names, same order
    for k, v in ours.items():
        assert v.shape == ref_kept[k].shape and v.dtype == ref_kept[k].dtype, k
    ignored = {k: v for k, v in ref.items() if is_ignored_reference_key(k)}
    assert len(ignored) == cfg.vision.depth
    hd2 = cfg.vision.width // cfg.vision.heads // 2
    for k, v in ignored.items():
        block = int(k.split(".")[2])
        side = cfg.vision.grid_size if block in cfg.vision.global_blocks else cfg.vision.window_size
        assert v.shape == (side * side, hd2) and v.dtype == torch.complex64, k  # [576|5184, 32]
    assert ref["trunk.pos_embed"].shape == (1, 1 + 24 * 24, 1024)  # cls slot + 24x24 pretrain grid
    optional = [k for k in ours if k.startswith(OPTIONAL_REFERENCE_PREFIX)]
    assert len(optional) == 4  # convs.3.{conv_1x1,conv_3x3}.{weight,bias}: absent in SAM 3.1


def test_reset_buffers_after_meta_init(cfg, meta_backbone, fp32_out):
    """Meta-device build + to_empty + reset_buffers + load gives the same model (checkpoint path)."""
    with torch.device("meta"):
        ours = VisionBackbone(cfg)
    ours = ours.to_empty(device="cpu").eval()
    ours.reset_buffers()
    ours.load_state_dict(_ours_state(meta_backbone), strict=True)
    with torch.inference_mode():
        features, positions = ours(_pixels(cfg))
    for a, b in zip(features + positions, fp32_out[0] + fp32_out[1]):
        assert torch.equal(a, b)


# --- bf16 and torch.compile --------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2**-7)])
def test_patch_embed_as_gemm_matches_the_conv(dtype, tol):
    """The GEMM path CUDA takes (unfolded patches @ flattened weight; here on the CPU: it checks the layout, not
    cuBLAS's numerics, which sam_probe checks on the GPU) against Meta's conv on random inputs, full-size patch
    (14 x 14, stride 14, width 64). fp32: the same products summed in another order, rel <= 1e-6 (measured ~1e-7);
    bf16: both accumulate in fp32 and round once, so they differ by at most ~one bf16 ulp, rel <= 2^-7. A patch
    flattened in the wrong order ((kh, kw, c), or rows and columns swapped) gives O(1)."""
    from sammie.config import VisionConfig
    from sammie.model.vit import PatchEmbed

    torch.manual_seed(0)
    vcfg = VisionConfig(image_size=112, patch_size=14, width=64, depth=1, heads=4, mlp_dim=256, window_size=4,
                        global_blocks=(0,), pretrain_image_size=56)
    embed = PatchEmbed(vcfg).to(dtype)
    pixels = torch.randn(2, 3, 112, 112).to(dtype)
    with torch.inference_mode():
        embed.as_gemm = False
        want = embed(pixels)
        embed.as_gemm = True
        got = embed(pixels)
    assert got.shape == want.shape == (2, 8, 8, 64) and got.dtype == dtype
    assert_rel_close(got.float(), want.float(), tol=tol, what=f"patch embed GEMM vs conv, {dtype}")
    assert embed.as_gemm and PatchEmbed(vcfg).as_gemm is None  # None: by device (conv on the CPU)


def test_backbone_with_the_gemm_patch_embed_matches_the_conv_path(cfg, fp32_out, backbone):
    """The whole backbone with the CUDA path forced on the CPU, against the conv path's fp32 output (itself equal to
    Meta's: test_backbone_matches_meta); 1e-5, the parity tests' tolerance."""
    backbone.trunk.patch_embed.as_gemm = True
    try:
        with torch.inference_mode():
            features, _ = backbone(_pixels(cfg))
    finally:
        backbone.trunk.patch_embed.as_gemm = None
    for i, (f, rf) in enumerate(zip(features, fp32_out[0])):
        assert_rel_close(f, rf, tol=1e-5, what=f"feature level {i} with the GEMM patch embed")


def test_mlp_fused_gelu_takes_one_addmm_activation(monkeypatch):
    """`Mlp.fused_gelu`: fc1 + GELU as one `torch._addmm_activation(bias, x, W^T, use_gelu=True)` on the devices of
    FUSED_GELU_DEVICES (CUDA; the CPU stands in here, where that op applies the exact GELU, so the result equals the
    unfused path to fp32 rounding, rel <= 1e-6: this checks the bias, the transpose and the shapes); not taken when
    off, on other devices, or with a non-Linear fc1."""
    import sammie.model.vit as vit

    torch.manual_seed(0)
    mlp = vit.Mlp(16, 40).eval()
    x = torch.randn(2, 3, 5, 16)
    calls = []
    real = torch._addmm_activation

    def spy(bias, mat1, mat2, **kw):
        calls.append((tuple(mat1.shape), tuple(mat2.shape), kw))
        return real(bias, mat1, mat2, **kw)

    monkeypatch.setattr(torch, "_addmm_activation", spy)
    with torch.inference_mode():
        want = mlp(x)
        assert calls == []  # off by default
        mlp.fused_gelu = True
        assert torch.equal(mlp(x), want) and calls == []  # on, but the CPU is not a fused device
        monkeypatch.setattr(vit, "FUSED_GELU_DEVICES", ("cpu",))
        got = mlp(x)
    assert calls == [((30, 16), (16, 40), {"use_gelu": True})]
    assert got.shape == want.shape
    assert_rel_close(got, want, tol=1e-6, what="fused fc1 + GELU vs fc1, F.gelu")
    assert len(vit.set_fused_gelu(torch.nn.Sequential(mlp, vit.Mlp(8, 8)), False)) == 2 and not mlp.fused_gelu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt's GELU epilogue: CUDA only")
def test_mlp_fused_gelu_is_the_tanh_gelu_on_cuda(monkeypatch):
    """On CUDA the fused path runs `torch._addmm_activation` (a spy says so) and its GELU is the tanh approximation:
    with fc1 and fc2 identities in fp32 (TF32 off) the MLP returns GELU(x) itself, for x up to +-4 (the two GELUs
    are 4.7e-4 apart at x ~ 2.7): within 5e-5 of the tanh GELU, at least 3e-4 from the exact one. bf16 at full width
    against the exact-GELU path: 2e-2 relative (bf16 rounding through two GEMMs)."""
    import torch.nn.functional as F

    import sammie.model.vit as vit

    calls = []
    real = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    n = 64
    mlp = vit.Mlp(n, n).cuda().eval()
    with torch.no_grad():
        for fc in (mlp.fc1, mlp.fc2):
            fc.weight.copy_(torch.eye(n))
            fc.bias.zero_()
    x = torch.linspace(-4, 4, 128 * n, device="cuda").view(128, n)
    with torch.inference_mode():
        mlp.fused_gelu = True
        got = mlp(x)
    assert calls == [{"use_gelu": True}]
    assert (got - F.gelu(x, approximate="tanh")).abs().max().item() <= 5e-5  # cuBLASLt's own tanh: some slack
    assert (got - F.gelu(x)).abs().max().item() >= 3e-4  # 4.7e-4 at x ~ 2.7 if it is the tanh GELU

    torch.manual_seed(0)
    mlp = vit.Mlp(1024, 4736).cuda().bfloat16().eval()
    xb = torch.randn(2, 576, 1024, device="cuda").bfloat16()
    with torch.inference_mode():
        exact = mlp(xb)
        mlp.fused_gelu = True
        fused = mlp(xb)
    assert_rel_close(fused.float(), exact.float(), tol=2e-2, what="fused GELU vs the exact-GELU path, bf16")


# bf16 keeps 8 mantissa bits (rel. rounding 2^-9 = 2e-3 per op); through 4 blocks and the neck we
# measured 1.0e-2..1.1e-2 relative error against fp32 at these weights (8e-3 under CPU autocast, where
# the residual stream stays fp32); 3e-2 leaves headroom and still catches a wrong path (O(1) errors).
BF16_REL_TOL = 3e-2


def test_bf16_runs(cfg, backbone, fp32_out):
    ours = VisionBackbone(cfg).eval()
    ours.load_state_dict(backbone.state_dict())
    ours.to(torch.bfloat16)
    with torch.inference_mode():
        features, positions = ours(_pixels(cfg).bfloat16())
    for i, (f, p, rf, rp) in enumerate(zip(features, positions, *fp32_out)):
        assert f.dtype == p.dtype == torch.bfloat16
        assert torch.isfinite(f).all()
        assert_rel_close(f.float(), rf, tol=BF16_REL_TOL, what=f"bf16 feature level {i}")
        assert_rel_close(p.float(), rp, tol=1e-2, what=f"bf16 position level {i}")  # rounding only


def test_compile_fullgraph_capture(backbone, cfg, fp32_out):
    """fullgraph=True fails on any graph break. aot_eager traces through dynamo + AOTAutograd
    (functionalisation, fake tensors) like inductor, but skips C++ codegen, which takes
    95-150 s cold on 2 CPU cores; the inductor run is `test_compile_inductor` (opt-in)."""
    torch._dynamo.reset()
    compiled = torch.compile(backbone, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        features, positions = compiled(_pixels(cfg))
    for a, b in zip(features + positions, fp32_out[0] + fp32_out[1]):
        assert_rel_close(a, b, tol=1e-5, what="compiled (aot_eager) vs eager")


@pytest.mark.skipif(
    os.environ.get("SAMMIE_SLOW_TESTS") != "1",
    reason="inductor C++ codegen takes 95-150 s cold on 2 cores; set SAMMIE_SLOW_TESTS=1",
)
def test_compile_inductor(backbone, cfg, fp32_out):
    torch._dynamo.reset()
    compiled = torch.compile(backbone, fullgraph=True)
    with torch.inference_mode():
        features, positions = compiled(_pixels(cfg))
    for a, b in zip(features + positions, fp32_out[0] + fp32_out[1]):
        assert_rel_close(a, b, tol=1e-5, what="compiled (inductor) vs eager")

