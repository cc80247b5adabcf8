"""The ViT MLP's first half, fc1 + exact GELU, as one Triton GEMM with the GELU in its epilogue (Hopper, bf16).

Reference `linear_gelu_reference(x, w, b) = F.gelu(F.linear(x, w, b))`: torch's exact (erf) GELU of the bf16 linear
output, what the bf16 detector runs (two kernels on CUDA: cuBLAS's GEMM with its bias epilogue, then inductor's or
ATen's GELU pass over the [M, 4,736] activation).

Why: the GELU pass is a read and a write of fc1's output, 0.26-0.32 ms a call at batch 8 (M = 41,472 tokens; H200,
7.7% of the engine's GPU time in waterfall run 14). cuBLASLt's own GELU epilogue (`vit_fused_gelu`) is the tanh
approximation, not Meta's GELU; inductor's max-autotune did not fuse it because its Triton templates lost the bare
GEMM to cuBLAS by 13-17% (waterfall run 9), which the saved pass might have paid back.

MEASURED, and it LOSES, so nothing uses it (H200, linear_gelu_probe run 1, `benchmarks/results/`): at 8 images
(M 41,472) its best launch takes 1.154 ms (349 TFLOP/s) against 0.902 for what the engine runs (cuBLAS + inductor's
GELU) and 0.829 eager (cuBLAS + ATen's GELU); the bare cuBLAS GEMM is 0.575 ms (699 TFLOP/s). At one image 0.244
against 0.217 ms. One output tile per program leaves the erf epilogue serial after each tile's main loop and no
warp specialisation overlaps them. To pay, a fused kernel must run GEMM + epilogue at >= 446 TFLOP/s (64% of
cuBLAS's bare rate; this one: 50%), e.g. persistent with the epilogue overlapped. Written since, NOT YET TIMED: a
persistent variant (`Launch.persistent`: one program per SM walking the tiles, the tile and K loops flattened so the
next tile's loads overlap this tile's epilogue), and `linear_triton`, the same GEMM without the GELU, so the probe
can tell the GEMM's own rate from the epilogue's cost (gpu_next step 64).

Kernel: one [BLOCK_M, BLOCK_N] output tile per program, grouped tile order (GROUP_M row tiles share their weight
tiles in L2), x and w tiles through TMA tensor descriptors (out-of-bounds rows and columns read as zeros, stores
clipped), fp32 accumulation on the tensor cores. Epilogue in torch's order: the bias added to the fp32 accumulator
and the sum rounded to bf16 (what F.linear stores), then GELU in fp32 of that value, 0.5 y (1 + erf(y / sqrt 2)),
rounded to bf16 (what F.gelu stores). Only the GEMM's summation order differs from the reference, so outputs agree to
about an ulp of bf16: tolerance max |diff| <= 1e-2 x max |ref| (tests/test_kernel_linear_gelu.py), and the probe
reports the share of outputs bit-identical to cuBLAS + GELU on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kernels.gelu_fp8_quant import _gelu
    from kernels.rms_norm import _round
    from kernels.w4a16_gemm import _mma  # bf16 dots through fp32 under the interpreter (triton #11584)
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "linear_gelu"
TOLERANCE = 1e-2  # max |diff| / max |ref|, bf16


def linear_gelu_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [..., K], w [N, K], b [N] or None -> gelu(x @ w.T + b) [..., N], torch's exact GELU in x's dtype."""
    return F.gelu(F.linear(x, w, b))


@dataclass(frozen=True)
class Launch:
    """One launch configuration. Defaults: the usual Hopper bf16 tile (128 x 256 x 64, two warp groups).

    persistent: one program per SM walking the output tiles (grid = SM count), the tile loop and the K loop
    flattened into one software-pipelined loop (`flatten`), so the next tile's first loads are in flight during a
    tile's epilogue; not yet timed on a GPU (linear_gelu_probe run 1 timed the one-tile-per-program kernel only)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False
    flatten: bool = True


if triton is not None:

    @triton.jit
    def _tile_origin(tile, tiles_m, tiles_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(row, column) of output tile `tile` in grouped order: GROUP_M row tiles share their weight tiles in L2."""
        per_group = GROUP_M * tiles_n
        first_m = (tile // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (tile % per_group) % group_rows
        tile_n = (tile % per_group) // group_rows
        return tile_m * BLOCK_M, tile_n * BLOCK_N

    @triton.jit
    def _tile_acc(x_desc, w_desc, off_m, off_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
        """fp32 [BM, BN] accumulator of x[off_m:, :] @ w[off_n:, :]^T over all of K (the main loop)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([off_m, k * BLOCK_K])  # [BM, BK]
            b = w_desc.load([off_n, k * BLOCK_K])  # [BN, BK]
            acc = _mma(a, b.T, acc, INTERPRET)
        return acc

    @triton.jit
    def _epilogue(acc, b_ptr, off_n, N, HAS_BIAS: tl.constexpr, APPLY_GELU: tl.constexpr,
                  BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
        """fp32 accumulator [BM, BN] -> the bf16 tile: + bias, rounded as F.linear stores it, then (APPLY_GELU) the
        erf GELU of that value rounded as F.gelu stores it."""
        if HAS_BIAS:
            cols = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y = _round(acc, tl.bfloat16, INTERPRET)  # F.linear's stored value (integer RNE: not contracted away)
        if APPLY_GELU:
            y = _gelu(y, tl.bfloat16, INTERPRET)
        return y.to(tl.bfloat16)

    @triton.jit
    def _linear_gelu_kernel(x_desc, w_desc, b_ptr, o_desc, M, N, K, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, INTERPRET: tl.constexpr, APPLY_GELU: tl.constexpr = True):
        # one output tile per program
        off_m, off_n = _tile_origin(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), BLOCK_M, BLOCK_N,
                                    GROUP_M)
        acc = _tile_acc(x_desc, w_desc, off_m, off_n, K, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
        o_desc.store([off_m, off_n], _epilogue(acc, b_ptr, off_n, N, HAS_BIAS, APPLY_GELU, BLOCK_N, INTERPRET))

    @triton.jit
    def _linear_gelu_persistent_kernel(x_desc, w_desc, b_ptr, o_desc, M, N, K, HAS_BIAS: tl.constexpr,
                                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                       GROUP_M: tl.constexpr, INTERPRET: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                                       FLATTEN: tl.constexpr, APPLY_GELU: tl.constexpr = True):
        # program p computes tiles p, p + NUM_PROGRAMS, ...; with FLATTEN the compiler pipelines the tile and K
        # loops as one, prefetching the next tile's operands while this tile's epilogue runs
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
            off_m, off_n = _tile_origin(tile, tiles_m, tiles_n, BLOCK_M, BLOCK_N, GROUP_M)
            acc = _tile_acc(x_desc, w_desc, off_m, off_n, K, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
            o_desc.store([off_m, off_n], _epilogue(acc, b_ptr, off_n, N, HAS_BIAS, APPLY_GELU, BLOCK_N, INTERPRET))


def supports(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """bf16 on a CUDA device of compute capability >= 9 (TMA), or anywhere under TRITON_INTERPRET=1; K and N
    multiples of 8 (16-byte rows for the descriptors); a bias, if any, of shape [N]."""
    import os

    if triton is None or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return False
    if b is not None and (b.dtype != torch.bfloat16 or tuple(b.shape) != (w.shape[0],)):
        return False
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    on_hopper = x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] >= 9
    return (interpret or on_hopper) and x.shape[-1] % 8 == 0 and w.shape[1] == x.shape[-1] and w.shape[0] % 8 == 0


def linear_gelu_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                       launch: Launch = Launch()) -> torch.Tensor:
    """x [..., K] bf16, w [N, K], b [N] -> gelu(x @ w.T + b) [..., N] bf16 (see the module docstring)."""
    return _launch(x, w, b, launch, apply_gelu=True)


def linear_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, launch: Launch = Launch()) -> torch.Tensor:
    """The same GEMM without the GELU (= F.linear up to summation order): what the probe times to tell the GEMM's
    own rate from its epilogue's cost."""
    return _launch(x, w, b, launch, apply_gelu=False)


def _launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, launch: Launch, apply_gelu: bool) -> torch.Tensor:
    import os

    if not supports(x, w, b):
        raise ValueError(f"linear_gelu_triton: x {list(x.shape)} {x.dtype}, w {list(w.shape)} {w.dtype} on "
                         f"{x.device} not supported (bf16, K and N multiples of 8, CUDA capability >= 9)")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    w = w.contiguous()
    b = b.contiguous() if b is not None else None  # the kernel reads the bias with stride 1
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out.reshape(*lead, n)
    c = launch
    x_desc = TensorDescriptor.from_tensor(x2, [c.block_m, c.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [c.block_n, c.block_k])
    o_desc = TensorDescriptor.from_tensor(out, [c.block_m, c.block_n])
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    args = (x_desc, w_desc, b if b is not None else out, o_desc, m, n, k, b is not None,
            c.block_m, c.block_n, c.block_k, c.group_m, interpret)
    if c.persistent:
        programs = min(tiles, 4 if interpret else torch.cuda.get_device_properties(x.device).multi_processor_count)
        _linear_gelu_persistent_kernel[(programs,)](*args, programs, c.flatten, apply_gelu,
                                                    num_warps=c.num_warps, num_stages=c.num_stages)
    else:
        _linear_gelu_kernel[(tiles,)](*args, apply_gelu, num_warps=c.num_warps, num_stages=c.num_stages)
    return out.reshape(*lead, n)
