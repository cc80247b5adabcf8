"""Gated DeltaNet prefill conv in one Triton launch: the depthwise causal conv (+ SiLU) over one sequence's prefill
chunk, read straight from the in_proj_qkv rows and written straight into the conv output rows, and the sequence's
conv state advanced to the chunk's last K-1 real inputs.

Reference `gdn_prefill_conv_reference`: exactly what `GatedDeltaNet.forward_paged` does per prefill chunk with the
torch `causal_conv1d`:
    inputs   x [n, C] (the chunk's in_proj_qkv output rows, model dtype), conv_pool [S, C, K-1] (model dtype), the
             sequence's state row `row` (int), conv weight [C, K] (model dtype), `valid` (int64 [1] on the device or
             None: only the first valid[0] <= n of the n rows are real, the rest padding of a prefill-graph bucket)
    outputs  y [n, C] in the model dtype (conv accumulated in fp32, rounded to the model dtype, SiLU in fp32 on that,
             rounded again: torch's bf16 `F.conv1d` then `F.silu`), and conv_pool itself, whose row `row` now holds
             inputs valid-K+1 .. valid-1 (older ones from the old state when the chunk is shorter), written in place
             (custom op `qwen::gdn_prefill_conv_`, mutates_args=("conv_pool",)).
In place safely: only the programs of the first token block read the state row (a token t reads it for taps
t + j < K-1 only, and the first block holds t < BLOCK_T >= K-1), and each of them writes the new state of its own
channels after a barrier that follows all its reads; no other program touches the row.

Why: the torch path is ~6 kernels per GDN layer and chunk (cat of state and the transposed chunk, the depthwise
`F.conv1d`, SiLU, the tail gather, two strided copies back); the conv alone measured 2.6 ms per 1,024-token prefill
over 30 layers on the H200 (benchmarks/RESULTS.md, "Time to first token, run 12": 87 us per call for 16 MB in and
out). This is one launch per layer, reading and writing each element once (plus the K-1 neighbouring rows, from L2).
Grid (cdiv(n, BLOCK_T), cdiv(C, BLOCK_C)); Qwen3.6: C = 8192, K = 4.

Numerics: the same fp32 products, the K taps summed in tap order (torch's conv may order them otherwise) -> a conv
output on a bf16 rounding boundary can move one ulp; tolerance max |diff| <= 1e-2 x max |ref| for bf16 / fp16, 1e-5
for fp32; the state row bit for bit (copies of inputs). Under the interpreter the roundings use
`kernels.rms_norm._cast` (round to nearest even, as on the GPU).
NOT YET RUN ON A GPU (written 2026-11-30, seventh session, after the device time was spent): tested under the
interpreter and compiled offline for sm_90 (tests/sm90_compile.py); the engine's start-up self-check compares it
with the reference before use and falls back to the reference if it fails.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import tolerance
from kernels.device import triton_device_ok

try:
    import triton
    import triton.language as tl

    from kernels.rms_norm import _cast
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "gdn_prefill_conv"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_T, BLOCK_C = 16, 256  # tokens x channels per program: 8 KB of bf16 per tap, coalesced along C


def gdn_prefill_conv_reference(x: torch.Tensor, conv_pool: torch.Tensor, row: int, conv_w: torch.Tensor,
                               valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [n, C], conv_pool); see the module docstring. conv_pool[row] is advanced in place."""
    from qwen_engine.model.gdn import causal_conv1d

    y, new_conv = causal_conv1d(x.T[None], conv_pool[row:row + 1], conv_w[:, None, :], valid)  # [1, C, n]
    conv_pool[row:row + 1] = new_conv.to(conv_pool.dtype)
    return y[0].T.contiguous(), conv_pool


if triton is not None:

    @triton.jit
    def _tap(x, pool, row, src, ch, ok, s_xt, s_pr, s_pc, KM1: tl.constexpr):
        """Inputs at chunk positions src [BT, 1] (negative: the old state's entry src + K-1) of channels ch [1, BC]."""
        from_x = tl.load(x + src * s_xt + ch, mask=ok & (src >= 0), other=0.0)
        from_state = tl.load(pool + row * s_pr + ch * s_pc + (src + KM1), mask=ok & (src < 0) & (src + KM1 >= 0),
                             other=0.0)
        return tl.where(src >= 0, from_x, from_state)

    # the state row and the chunk length vary per call: not specialised (a 1 or a multiple of 16 would otherwise compile
    # a new variant at request time)
    @triton.jit(do_not_specialize=["row", "n"])
    def _gdn_prefill_conv_kernel(x, pool, w, y, valid, row, n, C, s_xt, s_yt, s_pr, s_pc, s_wc,
                                 HAS_VALID: tl.constexpr, KM1: tl.constexpr, BLOCK_S: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr):
        tl.static_assert(BLOCK_T >= KM1)  # only the first token block reads the state row (the in-place write's rule)
        pid_t, pid_c = tl.program_id(0), tl.program_id(1)
        t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # [BT, 1] chunk positions
        ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]  # [1, BC] channels
        c_ok = ch < C
        ok = (t < n) & c_ok
        dt = x.dtype.element_ty
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(KM1 + 1):  # tap j reads input t + j - (K-1); the taps in order
            v = _tap(x, pool, row, t + j - KM1, ch, ok, s_xt, s_pr, s_pc, KM1).to(tl.float32)
            acc += v * tl.load(w + ch * s_wc + j, mask=c_ok, other=0.0).to(tl.float32)
        out = _cast(acc, dt, INTERPRET).to(tl.float32)  # conv1d output in the model dtype
        out = _cast(out / (1.0 + tl.exp(-out)), dt, INTERPRET)  # SiLU in fp32, rounded
        tl.store(y + t * s_yt + ch, out, mask=ok)
        if pid_t == 0:  # the new state: inputs last - K + 2 .. last of these channels (see the module docstring)
            if HAS_VALID:
                last = tl.minimum(tl.load(valid), n) - 1  # valid <= n (a bucket's real tokens): clamped anyway
            else:
                last = n - 1
            i = tl.arange(0, BLOCK_S)[:, None]  # state slots (K - 1, padded to a power of two)
            i_ok = (i < KM1) & c_ok
            new = _tap(x, pool, row, last - KM1 + 1 + i, ch, i_ok, s_xt, s_pr, s_pc, KM1)
            tl.debug_barrier()  # every read of the old state by this program's warps comes first
            tl.store(pool + row * s_pr + ch * s_pc + i, new, mask=i_ok)


def _interpreted() -> bool:
    return triton is not None and type(_gdn_prefill_conv_kernel).__name__ == "InterpretedFunction"


@torch.library.custom_op("qwen::gdn_prefill_conv_", mutates_args=("conv_pool",))
def gdn_prefill_conv_(x: torch.Tensor, conv_pool: torch.Tensor, row: int, conv_w: torch.Tensor,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
    """y [n, C]; advances conv_pool[row] in place. Guards: `supports` (checked by the registry)."""
    n, c = x.shape
    km1 = conv_pool.shape[-1]
    y = torch.empty_like(x)
    if n == 0:
        return y
    grid = (triton.cdiv(n, BLOCK_T), triton.cdiv(c, BLOCK_C))
    _gdn_prefill_conv_kernel[grid](
        x, conv_pool, conv_w, y, valid if valid is not None else x, row, n, c, x.stride(0), y.stride(0),
        conv_pool.stride(0), conv_pool.stride(1), conv_w.stride(0), HAS_VALID=valid is not None, KM1=km1,
        BLOCK_S=triton.next_power_of_2(km1), BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, INTERPRET=_interpreted(), num_warps=4)
    return y


@gdn_prefill_conv_.register_fake
def _(x, conv_pool, row, conv_w, valid=None):
    return torch.empty_like(x)


def gdn_prefill_conv_triton(x, conv_pool, row, conv_w, valid=None):
    """Same contract as `gdn_prefill_conv_reference`."""
    return gdn_prefill_conv_(x, conv_pool, row, conv_w, valid), conv_pool


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(x, conv_pool, row, conv_w, valid=None) -> dict[str, Any]:
    n, c = x.shape if x.dim() == 2 else (0, 0)
    km1 = conv_pool.shape[-1] if conv_pool.dim() == 3 else 0
    shapes_ok = (x.dim() == 2 and conv_pool.dim() == 3 and conv_pool.shape[1] == c and conv_w.shape == (c, km1 + 1)
                 and 1 <= km1 <= 8 and 0 <= row < conv_pool.shape[0]
                 and max(n * x.stride(0), n * c) < 2**31  # int32 offsets in the kernel
                 and (valid is None or (valid.shape == (1,) and valid.dtype == torch.int64)))
    return dict(device=x.device.type, capability=torch.cuda.get_device_capability(x.device) if x.is_cuda else None,
                dtypes={x.dtype, conv_pool.dtype, conv_w.dtype}, shapes_ok=shapes_ok,
                unit_strides=all(t.stride(-1) == 1 for t in (x, conv_pool, conv_w) if t.dim()),
                same_device=all(t.device == x.device for t in (conv_pool, conv_w, *(() if valid is None else (valid,))))
                )


def supports(*, device: str, capability, dtypes: set, shapes_ok: bool, unit_strides: bool, same_device: bool,
             **_: Any) -> bool:
    """Triton able to run on `device` (cuda >= sm_80, or the interpreter on CPU); one model dtype for the rows, the
    state and the weight; consistent shapes, K - 1 <= 8; unit inner strides; every tensor on x's device."""
    if triton is None:
        return False
    return (triton_device_ok(device, capability, _interpreted()) and len(dtypes) == 1 and next(iter(dtypes)) in DTYPES
            and shapes_ok and unit_strides and same_device)


def compare(out, ref, tol: float | None = None) -> str | None:
    """y within tol x max |ref| (1e-2 for bf16 / fp16, 1e-5 for fp32; see the module docstring); the conv pool
    (the written row: copies of inputs; the rest untouched) bit for bit."""
    if tol is None:
        tol = 1e-5 if ref[0].dtype == torch.float32 else 1e-2
    if out[1].shape != ref[1].shape or out[1].dtype != ref[1].dtype or not torch.equal(out[1], ref[1]):
        return "conv_pool: not bit-identical to the reference's"
    return tolerance.compare(out[0], ref[0], tol)


def _sample(device) -> tuple[tuple, dict]:
    """A chunk of 37 tokens (three token blocks, a ragged last one) over 300 channels (two channel blocks, the
    second ragged), K = 4, bf16, state row 1 of 3, with 29 valid tokens (the padded-bucket case)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g).to(torch.bfloat16)
    pool = torch.randn(3, 300, 3, generator=g).to(torch.bfloat16)
    w = (torch.randn(300, 4, generator=g) * 0.5).to(torch.bfloat16)
    return (x.to(device), pool.to(device), 1, w.to(device), torch.tensor([29], device=device)), {}


def register(registry) -> None:
    registry.add_op(NAME, gdn_prefill_conv_reference, sample=_sample, compare=compare, describe=describe, mutates=True,
                    tolerance="y: max |diff| <= 1e-2 x max |ref| (bf16 / fp16: one ulp of a conv output on a rounding "
                              "boundary), 1e-5 (fp32); the state row bit for bit")
    registry.add_implementation(NAME, "triton", gdn_prefill_conv_triton, supports)
