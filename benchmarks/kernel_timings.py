"""First GPU timings of the Triton kernels against their references (issues 4 and 5).

    python benchmarks/kernel_timings.py            # on the GPU machine; prints markdown tables

Each section is independent (an error is printed and the next section runs). Times are medians of
`triton.testing.do_bench` (CUDA events), inputs random (speed does not depend on the values).
"""

from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F
import triton

DEV = "cuda"


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def section(fn):
    try:
        fn()
    except Exception:  # report and go on: one broken section must not hide the others
        traceback.print_exc()


def sammie_kernels():
    from kernels.mask_post import mask_post_packed, sigmoid_cut, unpack_columns
    from kernels.preprocess import normalise_lut, pack_images, preprocess_packed, preprocess_reference

    S, H, W = 1008, 480, 640
    g = torch.Generator().manual_seed(0)
    imgs = [torch.randint(0, 256, (H, W, 3), dtype=torch.uint8, generator=g).to(DEV) for _ in range(8)]
    print("\n| preprocess 640x480 -> 1008 bf16 | kernel us | torchvision us | speed-up | TB/s |\n|---|---|---|---|---|")
    for B in (1, 8):
        ims = imgs[:B]
        packed, meta = pack_images(ims)
        lut = normalise_lut((0.5,) * 3, (0.5,) * 3, torch.bfloat16, DEV)
        tk = ms(lambda: preprocess_packed(packed, meta, lut, S, torch.bfloat16))
        tr = ms(lambda: preprocess_reference(ims, S, torch.bfloat16))
        gb = B * (H * W * 3 + 3 * S * S * 2) / 1e9
        print(f"| batch {B} | {tk * 1e3:.1f} | {tr * 1e3:.1f} | {tr / tk:.1f}x | {gb / tk:.2f} |")
    print("\n| mask post 288^2 -> 480x640, K masks | kernel us (+D2H) | F.interpolate+sigmoid us (+D2H) | pixels differing |\n|---|---|---|---|")
    for K in (1, 8, 32):
        x = torch.randn(K, 288, 288, generator=g).mul_(4).to(DEV)
        cut = sigmoid_cut(0.5, DEV)
        ref = lambda: F.interpolate(x[:, None], (H, W), mode="bilinear", align_corners=False).sigmoid() > 0.5
        tk, tk_h = ms(lambda: mask_post_packed(x, H, W, cut)), ms(lambda: mask_post_packed(x, H, W, cut).cpu())
        tr, tr_h = ms(ref), ms(lambda: ref().cpu())
        bits = int((torch.from_numpy(unpack_columns(mask_post_packed(x, H, W, cut), H).copy()) != ref()[:, 0].cpu()).sum())
        print(f"| K={K} | {tk * 1e3:.1f} ({tk_h * 1e3:.1f}) | {tr * 1e3:.1f} ({tr_h * 1e3:.1f}) | {bits} of {K * H * W} |")


def qwen_kernels():
    from kernels.fp8_linear import fp8_linear_scaled_mm
    from kernels.gdn_decode import gdn_decode_, gdn_decode_reference, random_inputs
    from kernels.nvfp4 import FP8Tensor, NVFP4Tensor, dequantize_nvfp4, quantize_fp8, quantize_nvfp4
    from kernels.w4a16_gemm import moe_experts_w4a16_reference, moe_experts_w4a16_triton, w4a16_linear_triton

    torch.manual_seed(0)
    H, I, E, TOPK = 2048, 512, 256, 8

    def nvfp4(*shape):
        w = quantize_nvfp4(torch.randn(*shape, device=DEV) * 0.02)
        return NVFP4Tensor(w.packed, w.scales, w.global_scale * (0.5 + torch.rand(shape[:-1], device=DEV)))

    print("\n| W4A16 dense | kernel us | TB/s (weights) | torch dequant+mm us | bf16 mm us |\n|---|---|---|---|---|")
    for n, k in ((2 * I, H), (H, I), (248320, H)):
        w = nvfp4(n, k)
        w_bf16 = dequantize_nvfp4(*w, dtype=torch.bfloat16)
        for m in (1, 8, 32) if n < 100000 else (1, 32):
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            us = ms(lambda: w4a16_linear_triton(x, w)) * 1e3
            print(f"| M={m} N={n} K={k} | {us:.1f} | {n * k * 0.5625 / us / 1e6:.2f} | "
                  f"{ms(lambda: x @ dequantize_nvfp4(*w, dtype=torch.bfloat16).T) * 1e3:.1f} | {ms(lambda: x @ w_bf16.T) * 1e3:.1f} |")
        del w, w_bf16
    print("\n| W4A16 routed experts (256 x top-8), one layer | kernel us | reference us |\n|---|---|---|")
    w13, w2 = nvfp4(E, 2 * I, H), nvfp4(E, H, I)
    for t in (1, 8, 32):
        x = torch.randn(t, H, device=DEV).to(torch.bfloat16)
        idx = torch.rand(t, E, device=DEV).topk(TOPK, dim=-1).indices
        wts = torch.softmax(torch.randn(t, TOPK, device=DEV), -1).to(torch.bfloat16)
        print(f"| T={t} | {ms(lambda: moe_experts_w4a16_triton(x, w13, w2, idx, wts)) * 1e3:.1f} | "
              f"{ms(lambda: moe_experts_w4a16_reference(x, w13, w2, idx, wts)) * 1e3:.1f} |")
    print("\n| FP8 static linear | scaled_mm us | bf16 mm us |\n|---|---|---|")
    for n, k in ((8192, H), (H, 4096)):
        data, s = quantize_fp8(torch.randn(n, k, device=DEV) * 0.02)
        w_bf16 = (data.float() * s).to(torch.bfloat16)
        for m in (1, 32, 1024):
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            w = FP8Tensor(data, s, x.float().abs().amax() / 448)
            print(f"| M={m} N={n} K={k} | {ms(lambda: fp8_linear_scaled_mm(x, w)) * 1e3:.1f} | {ms(lambda: x @ w_bf16.T) * 1e3:.1f} |")
    print("\n| GDN decode step, one layer | kernel us | reference us |\n|---|---|---|")
    for b in (1, 8, 32):
        q, k, v, g, beta, state = random_inputs(b, 32, 128, 128, device=DEV)
        st = state.clone()
        print(f"| B={b} | {ms(lambda: gdn_decode_(q, k, v, g, beta, st)) * 1e3:.1f} | "
              f"{ms(lambda: gdn_decode_reference(q, k, v, g, beta, state)) * 1e3:.1f} |")


if __name__ == "__main__":
    print(f"# Kernel timings on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    section(sammie_kernels)
    section(qwen_kernels)
