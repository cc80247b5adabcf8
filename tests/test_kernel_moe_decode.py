"""The decode MoE in one launch (`kernels/moe_decode.py`) against its reference, the combine over its partial rows
(`kernels/moe_combine.py`), and the model's fused decode path (`SparseMoE.fused_decode`) against the unfused one.
On the CPU the kernels run under the Triton interpreter (tests/conftest.py); on a GPU compiled.

Tolerances: the kernel differs from `moe_decode_reference` by fp32 summation order only (exact weights, fp32
products, no rounding): the per-pair sums over slices within 1e-4 x max |ref| (`moe_decode.TOLERANCE`). The model
path with and without the fused decode: bf16 roundings (the unfused path rounds the SwiGLU intermediate and each
expert's output; the fused one does not), 2e-2 x max |ref| as the other fused-MoE tests (tests/test_qwen_quantized.py).
"""

import pytest
import torch

from engine_core.registry import Registry
from kernels import moe_combine, moe_decode
from kernels.nvfp4 import NVFP4Tensor

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(moe_decode.triton is None, reason="needs triton (compiled or interpreted)")


def _per_row_globals(w13: NVFP4Tensor, w2: NVFP4Tensor, s13: NVFP4Tensor, s2: NVFP4Tensor, seed: int = 3):
    """The engine's global scales: per expert and output row ([E, 2I], [E, H]; the shared expert's [2I], [H])."""
    g = torch.Generator().manual_seed(seed)

    def rows(w, shape):
        base = w.global_scale.float().cpu()
        base = base.reshape(*base.shape, *([1] * (len(shape) - base.dim())))
        return (base * (0.5 + torch.rand(shape, generator=g))).to(w.packed.device)

    e, n13, h = w13.shape
    return (NVFP4Tensor(w13.packed, w13.scales, rows(w13, (e, n13))),
            NVFP4Tensor(w2.packed, w2.scales, rows(w2, (e, h))),
            NVFP4Tensor(s13.packed, s13.scales, rows(s13, (n13,))),
            NVFP4Tensor(s2.packed, s2.scales, rows(s2, (h,))))


@needs_kernel
@pytest.mark.parametrize("t, k, e, h, i, config", [
    (1, 8, 12, 64, 32, None),  # the decode shape's top-8 at one token, the default tiles
    (2, 3, 6, 80, 48, dict(BLOCK_I=32, BLOCK_K=32, BLOCK_H=32)),  # a masked slice (48 = 32 + 16), 3 K tiles, 3 chunks
    (4, 2, 5, 48, 16, dict(BLOCK_I=16, BLOCK_K=16, BLOCK_H=64)),  # 4 tokens, one slice, a masked down chunk
    (3, 1, 4, 32, 64, dict(BLOCK_I=64, BLOCK_K=32, BLOCK_H=16)),  # top-1: the shared pair reads slot 0's id
])
def test_kernel_matches_reference(t, k, e, h, i, config):
    x, w13, w2, idx, wts, s13, s2 = moe_decode.random_inputs(t, k, e, h, i, seed=t + k, device=DEVICE)
    w13, w2, s13, s2 = _per_row_globals(w13, w2, s13, s2)
    out = moe_decode.moe_decode_triton(x, w13, w2, idx, wts, s13, s2, config=config)
    ref = moe_decode.moe_decode_reference(x, w13, w2, idx, wts, s13, s2)
    bi = (config or moe_decode.INTERPRETER_CONFIG if moe_decode._interpreted() else config or {}).get("BLOCK_I")
    assert out.dtype == torch.float32 and out.shape[:2] == (t, k + 1) and out.shape[3] == h
    if bi is not None:
        assert out.shape[2] == -(-i // bi)  # one partial row per intermediate slice
    assert moe_decode.compare(out, ref) is None, moe_decode.compare(out, ref)
    # every slot matters: the routing weights scale slots :k, the shared expert is slot k (unscaled)
    wrong = moe_decode.moe_decode_reference(x, w13, w2, idx, wts.flip(-1), s13, s2) if k > 1 else ref * 1.01
    assert moe_decode.compare(out, wrong) is not None
    assert moe_decode.compare(out, torch.cat((ref[:, :k], 0 * ref[:, k:]), 1)) is not None


@needs_kernel
def test_kernel_scalar_global_scales_and_fp16():
    """The checkpoint's per-tensor globals ([] / [E]) and fp16 activations (the byte path's mode 0)."""
    x, w13, w2, idx, wts, s13, s2 = moe_decode.random_inputs(2, 2, 5, 32, 32, dtype=torch.float16, device=DEVICE)
    s13 = NVFP4Tensor(s13.packed, s13.scales, torch.tensor(3e-5, device=DEVICE))
    assert w13.global_scale.shape == (5,)
    out = moe_decode.moe_decode_triton(x, w13, w2, idx, wts, s13, s2)
    ref = moe_decode.moe_decode_reference(x, w13, w2, idx, wts, s13, s2)
    assert moe_decode.compare(out, ref) is None, moe_decode.compare(out, ref)


def test_guard_and_errors():
    args = moe_decode.random_inputs(2, 2, 5, 32, 32)
    info = moe_decode.describe(*args)
    assert info["shapes_ok"] and info["words_ok"] and info["tokens"] == 2
    x, w13, w2, idx, wts, s13, s2 = args
    five = moe_decode.random_inputs(5, 2, 5, 32, 32)  # past the GEMV's 4 tokens
    assert not moe_decode.describe(*five)["shapes_ok"]
    narrow = moe_decode.random_inputs(2, 2, 5, 32, 16)  # a shared expert of another width
    assert not moe_decode.describe(x, w13, w2, idx, wts, narrow[5], narrow[6])["shapes_ok"]
    assert not moe_decode.supports(**moe_decode.describe(x.float(), w13, w2, idx, wts, s13, s2))  # fp32: no
    if moe_decode.triton is not None and moe_decode._interpreted():
        assert moe_decode.supports(**info)
        with pytest.raises(ValueError, match="shapes do not fit"):
            moe_decode.moe_decode_triton(*five)
        with pytest.raises(ValueError, match="deq must be"):
            moe_decode.moe_decode_triton(*args, deq=7)
    ref = moe_decode.moe_decode_reference(*args)
    assert "does not match" in moe_decode.compare(ref[:, :2], ref)


@needs_kernel
def test_combine_over_partial_rows():
    """`moe_combine` with the decode kernel's fp32 partial rows ([N, k S, H] routed, [N, S, H] shared) equals its
    reference (each group summed in fp32 and rounded once, then the tail's roundings), and the same numbers handed
    over pre-summed in bf16 through the one-program kernel give the same output."""
    t, k, h, s = 3, 4, 200, 5  # H not a multiple of the column blocks (PARTS_BLOCK_C); k S = 20 rows
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w = (torch.randn(1, h, generator=g) * 0.05).to(torch.bfloat16)
    routed = torch.randn(t, k * s, h, generator=g) * 0.05
    shared = torch.randn(t, s, h, generator=g) * 0.05
    residual = torch.randn(t, h, generator=g).to(torch.bfloat16)
    dev = lambda *ts: [u.to(DEVICE) for u in ts]  # noqa: E731
    x, w, routed, shared, residual = dev(x, w, routed, shared, residual)
    out = moe_combine.moe_combine_triton(x, w, shared, routed, residual)
    ref = moe_combine.moe_combine_reference(x, w, shared, routed, residual)
    assert moe_combine.compare(out, ref) is None
    err = float((out.float() - ref.float()).abs().max())
    assert err <= 2 ** -7 * float(ref.float().abs().max()), err  # a couple of bf16 ulps: only fp32 sum order differs
    # several loads per program (the default tiles take these 20 rows in one): the loop over row tiles
    saved = moe_combine.PARTS_BLOCK_C, moe_combine.PARTS_BLOCK_S
    try:
        moe_combine.PARTS_BLOCK_C, moe_combine.PARTS_BLOCK_S = 32, 8
        looped = moe_combine.moe_combine_triton(x, w, shared, routed, residual)
    finally:
        moe_combine.PARTS_BLOCK_C, moe_combine.PARTS_BLOCK_S = saved
    assert moe_combine.compare(looped, ref) is None
    assert float((looped.float() - ref.float()).abs().max()) <= 2 ** -7 * float(ref.float().abs().max())
    summed = moe_combine.moe_combine_triton(x, w, shared.sum(1).to(x.dtype), routed.sum(1).to(x.dtype), residual)
    assert float((out.float() - summed.float()).abs().max()) <= 2 ** -7 * float(ref.float().abs().max())
    # a kernel that dropped the shared rows, or the routed ones, would fail the check
    assert moe_combine.compare(out, moe_combine.moe_combine_reference(x, w, 0 * shared, routed, residual)) is not None
    assert moe_combine.compare(out, moe_combine.moe_combine_reference(x, w, shared, 0 * routed, residual)) is not None
    info = moe_combine.describe(x, w, shared, routed, residual)
    assert info["shapes_ok"] and info["dtypes"] == {torch.bfloat16}
    assert not moe_combine.describe(x, w, shared[:, :, :-1], routed, residual)["shapes_ok"]


@needs_kernel
def test_registry_self_check_passes_and_catches_a_broken_kernel(monkeypatch):
    reg = Registry("auto")
    moe_decode.register(reg)
    assert reg.self_check(DEVICE, [moe_decode.NAME])[moe_decode.NAME].startswith("triton passed")
    good = moe_decode.moe_decode_triton
    monkeypatch.setattr(moe_decode, "moe_decode_triton", lambda *a, **kw: good(*a, **kw) * 1.001)
    broken = Registry("auto")
    moe_decode.register(broken)  # registers the broken launcher
    bad = broken.self_check(DEVICE, [moe_decode.NAME])[moe_decode.NAME]
    assert "FAILED" in bad, bad


@needs_kernel
@torch.no_grad()
def test_model_fused_decode_path():
    """A packed tiny model's MoE layer on its fused path: one-token calls (`moe_decode.MODEL_MAX_TOKENS`) with
    `fused_decode` run the registry's "w4a16_moe_decode" (routed + shared experts, one launch) and moe_combine over
    its partial rows, within bf16 rounding of the unfused path; 2, 4 and 5 tokens and `fused_decode` off keep the
    unfused path; the engine's setter counts the layers that can take it."""
    from engine_core.registry import default_registry
    from kernels import fp8_linear, nvfp4, w4a16_gemm
    from qwen_engine.config import QwenConfig
    from qwen_engine.engine import set_moe_fused_decode
    from qwen_engine.load_packed import load_quantized
    from qwen_engine.random_weights import random_packed_tensors

    cfg = QwenConfig.tiny()
    reg = Registry("auto")
    for mod in (w4a16_gemm, fp8_linear, nvfp4, moe_decode):
        mod.register(reg)
    model = load_quantized(random_packed_tensors(cfg, "cpu", seed=0), cfg, DEVICE, torch.bfloat16,
                           quantize_activations=False, registry=reg)
    assert set_moe_fused_decode(model, True) == cfg.num_hidden_layers
    moe = model.layers[0].mlp
    combine_pref = default_registry().preference(moe_combine.NAME)
    default_registry().set_preference("auto", moe_combine.NAME)  # an earlier engine may have left "reference"
    g = torch.Generator().manual_seed(4)
    try:
        moe.fused = True
        for n in (1, 2, 4, 5):
            x = torch.randn(n, cfg.hidden_size, generator=g).to(torch.bfloat16).to(DEVICE)
            residual = torch.zeros_like(x)  # the MoE part alone, so the tolerance is on it
            before = reg.choices()[moe_decode.NAME]["calls"].get("triton", 0)
            moe.fused_decode = True
            fused = moe(x, residual=residual)
            after = reg.choices()[moe_decode.NAME]["calls"].get("triton", 0)
            moe.fused_decode = False
            plain = moe(x, residual=residual)
            assert after - before == (1 if n <= moe_decode.MODEL_MAX_TOKENS else 0), (n, before, after)
            err = float((fused.float() - plain.float()).abs().max() / plain.float().abs().max())
            print(f"{n} tokens: fused decode vs unfused, rel err {err:.2e}")
            assert err <= 2e-2
            if n <= moe_decode.MODEL_MAX_TOKENS:  # the fused path rounds less: not the same bits
                assert not torch.equal(fused, plain)
            else:  # the unfused path both times
                assert torch.equal(fused, plain)
    finally:
        moe.fused, moe.fused_decode = None, False
        default_registry().set_preference(combine_pref, moe_combine.NAME)
    assert set_moe_fused_decode(model, False) == 0 and not any(
        m.mlp.fused_decode for m in model.layers if hasattr(m.mlp, "fused_decode"))
