"""A decode step's whole MoE expert work in one Triton launch: for each of T <= 4 tokens, its top-k routed experts and
the shared expert, gate_up + SwiGLU + down, on CUDA cores, as fp32 partial outputs that `kernels/moe_combine.py`
sums (with the shared expert's sigmoid gate and the residual) in the next launch.

Why. A lone request's decode step spends ~1.1 ms of its ~2.7 ms in the W4A16 GEMV (H200, Qwen profile run 17): four
launches per MoE layer (routed gate_up, routed down, shared gate_up, shared down), ~5.6 us each for 0.6-9 MB, about
0.7 TB/s: each launch waits for its predecessor's last program and ramps up its own, and the down launches cannot
start reading their weights before the gate_up launches end. Here one program owns a slice of BLOCK_I intermediate
columns of one (token, expert) pair: it issues its down-projection tile's loads first (the expert id is known), then
walks its gate and up rows over the whole K = H (`w4a16_gemv._gemv_rows`), applies SwiGLU to its slice and
multiplies the slice by its [H, BLOCK_I] block of the down weight. So the MoE's weights are read by one launch of
(I / BLOCK_I) x T (k + 1) programs in one DRAM round trip per program, and a layer's MoE is three launches (router,
this, combine) instead of six.

Outcome (H200, 2026-12-02, benchmarks/RESULTS.md "the decode MoE in one launch"; results/moe_decode_bench_run{1,2,3}):
per layer with moe_combine, at one token 26.6 us against 29.9 for the unfused path (four GEMV launches and
moe_combine; -11%, one run, once the combine over partial rows was retiled: 15.5 -> 3.3 us), at four tokens 75.9
against 58.8. So the model sends it one-token calls only (MODEL_MAX_TOKENS), and the engine keeps it off
(QwenEngineConfig.moe_fused_decode) until an engine run measures it; timed apart, this launch (26.7 us) and the
combine (5.4) sum to more than the unfused path, so the 26.6 relies on the two overlapping under PDL, or on noise.
This launch alone: 26.7-51.3 us by config at one token, ~0.5-0.6 TB/s for the 15.9 MB of packed weights and block
scales. A program's work is a chain of dependent tile loads (gate / up over K, then down), and the configs trade its
length against registers
(results/moe_decode_bench_run2/sm90_registers.txt): BLOCK_K 128 holds 64 registers a thread but walks 16 K tiles at a
prefetch depth of one; BLOCK_K 512-1024 walks 2-4 at 184-245 registers (the double-buffered tiles, DEQ_WIDE's eight
fp32 values per word, the prefetched down tile), one or two CTAs per SM. The bits are right (GPU tests; at full size
the per-pair sums within 1e-4 x max |ref| of the reference).

Arithmetic (the decode GEMV's): weights built exactly (`w4a16_gemm._dequant_groups` / DEQ_WIDE's PTX), products
with the activations in fp32, per-16-group sums first; SwiGLU in fp32 on the gate and up rows' sums times their
global scales. The intermediate stays fp32 (the two-launch GEMV rounds it to the model dtype in between; the
reference `moe_experts_w4a16_reference` does not). Each program writes its slice's contribution to all H outputs,
times the routing weight (1 for the shared expert, whose gate `moe_combine` applies), in fp32: the sum over slices
and experts happens in `moe_combine` (fp32, then one rounding per term). Against `moe_decode_reference` (the routed
reference plus the shared expert as one more pair, per-pair fp32 outputs) only fp32 summation order differs:
tolerance 1e-4 x max |ref| on the sum over slices.

Scratch: the SwiGLU slice goes through a per-pair fp32 row of `hidden` [P, I] (global memory, this program's own
columns, L1-resident) between the two phases, behind a CTA barrier: the down phase reads it in the GEMV's K order.

Layout: the checkpoint's (the experts' `repack_dual` small-batch copy), gate_up [E, 2I, H/2] (rows :I gate, I: up),
down [E, H, I/2]; the shared expert as its fused [2I, H/2] / [H, I/2] (`NVFP4SwiGLU`), the same row strides.

Registry op "w4a16_moe_decode" (`qwen_engine/model/moe.py` `SparseMoE.fused_decode`, off by default): implementation
"triton" for T <= GEMV_MAX_TOKENS; the reference elsewhere (CPU without the interpreter; larger calls are not routed
here).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import pdl, tolerance
from kernels.nvfp4 import NVFP4Tensor
from kernels.w4a16_gemm import (
    ACT_DTYPES,
    _device_ok,
    _global_1d,
    _global_2d,
    _interpreted,
    _weight_ok,
    moe_experts_w4a16_reference,
    w4a16_linear_reference,
)
from kernels.w4a16_gemv import GEMV_MAX_TOKENS, resolve_deq

try:
    import triton
    import triton.language as tl

    from kernels.pdl import enter as pdl_enter
    from kernels.w4a16_gemm import _dequant_gain
    from kernels.w4a16_gemv import _gemv_fma, _gemv_fma_words, _gemv_rows, _gemv_tiles, _gemv_x
except ImportError:  # CPU-only installs without triton: the reference works, supports() says no
    triton = None

NAME = "w4a16_moe_decode"
AUTOTUNED_BLOCK_I = 16  # the intermediate slice of every autotuned config (the H200's pick; see _CONFIGS)
# the model sends it calls of at most this many tokens (`NVFP4Experts.fused_decode_ok`); the kernel takes up to
# GEMV_MAX_TOKENS. H200 (results/moe_decode_bench_run3): per layer with moe_combine, 26.6 us against 29.9 for the
# unfused path at one token, 75.9 against 58.8 at four
MODEL_MAX_TOKENS = 1
TOLERANCE = 1e-4  # x max |ref| of the per-pair sums: fp32 everywhere, only summation order differs (docstring)


def moe_decode_reference(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, idx: torch.Tensor, weights: torch.Tensor,
                         shared13: NVFP4Tensor, shared2: NVFP4Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H], w2 [E, H, I] (checkpoint layout); idx, weights [T, k]; the shared expert's fused
    gate_up [2I, H] and down [H, I] -> [T, k + 1, S, H] fp32 (S = 1 here; the kernel's S slices sum to the same):
    slot j < k the routed expert idx[:, j]'s output times weights[:, j], slot k the shared expert's output
    (unscaled), each in fp32 with no rounding."""
    routed = moe_experts_w4a16_reference(x.float(), w13, w2, idx, weights.float(), reduce=False)  # [T, k, H] fp32
    h = w4a16_linear_reference(x.float(), shared13)  # [T, 2I] fp32
    i = h.shape[-1] // 2
    shared = w4a16_linear_reference(torch.nn.functional.silu(h[:, :i]) * h[:, i:], shared2)  # [T, H] fp32
    return torch.cat((routed, shared[:, None]), 1)[:, :, None]


if triton is not None:
    # (BLOCK_K, BLOCK_H, warps) at BLOCK_I = AUTOTUNED_BLOCK_I: a program's gate / up K tile and its down chunk of
    # output rows for a slice of 16 intermediate columns; at T = 1 the grid is I / 16 x 9 = 288 programs (I = 512; 132
    # SMs on an H200). Offline sm_90: 64-245 registers a thread, no stack (results/moe_decode_bench_run2/
    # sm90_registers.txt; (1024, 1024, 4) reached 255 and a 208-byte stack, left out). H200 at one token (that run,
    # pinned): (128, 256, 4) 27.0 us, (256, 512, 4) 27.1, (256, 256, 2) 31.1, (1024, 1024, 4) 31.4, (512, 2048, 8)
    # 32.0, (512, 512, 4) 32.1; BLOCK_I 32 / 64 ran 32.3-51.3, and the tuner picked BLOCK_I 16 at 1, 2 and 4 tokens.
    # One BLOCK_I keeps the output's slice count S = cdiv(I, 16) independent of the pick.
    _CONFIGS = [triton.Config(dict(BLOCK_I=AUTOTUNED_BLOCK_I, BLOCK_K=bk, BLOCK_H=bh), num_warps=w, num_stages=1)
                for bk, bh, w in [(128, 256, 4), (256, 512, 4), (512, 1024, 4), (256, 256, 2), (512, 2048, 8),
                                  (1024, 2048, 8)]]

    @triton.jit
    def _moe_decode_kernel(x, idx, rw, w13, s13, g13, w2, s2, g2, sw13, ss13, sg13, sw2, ss2, sg2, hidden, parts,
                           H, INTER, TOP_K, P_BUCKET, s_xm, s_we13, s_se13, s_ge13, s_gn13, s_we2, s_se2, s_ge2, s_gn2,
                           s_sgn13, s_sgn2, s_wn13, s_sn13, s_wn2, s_sn2,
                           DEQ: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_I: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
        # grid (S = cdiv(INTER, BI), T (k + 1)): program (sl, p) is intermediate slice sl of pair p = t (k + 1) + j,
        # slot j < k routed (expert idx[t, j], weight rw[t, j]), j = k the shared expert. INTER: the intermediate
        # width I; hidden [P, INTER] fp32 scratch; parts [P, S, H] fp32. P_BUCKET (next power of two of P) is only an
        # autotune key.
        pdl_enter(USE_PDL)  # kernels/pdl.py: a no-op unless launched with PDL
        sl, p = tl.program_id(0), tl.program_id(1)
        t = p // (TOP_K + 1)
        j = p % (TOP_K + 1)
        shared = j == TOP_K
        jr = tl.minimum(j, TOP_K - 1)  # the shared pair reads a routed slot's id and ignores it
        e = tl.load(idx + t * TOP_K + jr).to(tl.int64)
        wt = tl.where(shared, 1.0, tl.load(rw + t * TOP_K + jr).to(tl.float32))
        if shared:
            wgu, sgu, ggu, gn13 = sw13, ss13, sg13, s_sgn13
            wdn, sdn, gdn, gn2 = sw2, ss2, sg2, s_sgn2
        else:
            wgu, sgu, ggu, gn13 = w13 + e * s_we13, s13 + e * s_se13, g13 + e * s_ge13, s_gn13
            wdn, sdn, gdn, gn2 = w2 + e * s_we2, s2 + e * s_se2, g2 + e * s_ge2, s_gn2
        DT: tl.constexpr = x.dtype.element_ty
        gain = _dequant_gain(DT, DEQ)
        # the down projection's first chunk of output rows, K tile sl (this slice's columns): issued before the
        # gate / up loads, so both phases' weights are in flight at once
        hrows = tl.arange(0, BLOCK_H)
        pd, sd = _gemv_tiles(wdn, sdn, hrows, hrows < H, sl, INTER, s_wn2, s_sn2, BLOCK_I, DEQ)
        # phase 1: gate and up rows of the slice over the whole K = H, SwiGLU in fp32
        irows = sl * BLOCK_I + tl.arange(0, BLOCK_I)
        iok = irows < INTER
        acc, acc_up = _gemv_rows(wgu, sgu, x + t.to(tl.int64) * s_xm, irows, iok, INTER, H, s_wn13, s_sn13, True, DT,
                                 DEQ, INTERPRET, BLOCK_I, BLOCK_K)
        gate = tl.sum(acc, axis=1) * (tl.load(ggu + irows * gn13, mask=iok, other=0.0) * gain)
        up = tl.sum(acc_up, axis=1) * (tl.load(ggu + (irows + INTER) * gn13, mask=iok, other=0.0) * gain)
        hrow = hidden + p.to(tl.int64) * INTER
        tl.store(hrow + irows, gate / (1.0 + tl.exp(-gate)) * up, mask=iok)
        tl.debug_barrier()  # the slice, written by some threads, is read back by others below
        # phase 2: this slice's [H, BI] block of down, chunk by chunk of BLOCK_H output rows
        out = parts + (p.to(tl.int64) * tl.num_programs(0) + sl) * H
        for c in range(0, tl.cdiv(H, BLOCK_H)):
            nrows = (c + 1) * BLOCK_H + tl.arange(0, BLOCK_H)
            pd_n, sd_n = _gemv_tiles(wdn, sdn, nrows, nrows < H, sl, INTER, s_wn2, s_sn2, BLOCK_I, DEQ)
            zero = tl.zeros((BLOCK_H, BLOCK_I // 16), dtype=tl.float32)
            if DEQ == 3:
                acc2 = _gemv_fma_words(zero, pd, sd, hrow, sl, INTER, BLOCK_I)
            else:
                he, ho = _gemv_x(hrow, sl, INTER, BLOCK_I)
                acc2 = _gemv_fma(zero, pd, sd, he, ho, DT, DEQ, INTERPRET)
            rows = c * BLOCK_H + hrows
            ok = rows < H
            y = tl.sum(acc2, axis=1) * (tl.load(gdn + rows * gn2, mask=ok, other=0.0) * gain) * wt
            tl.store(out + rows, y, mask=ok)
            pd, sd = pd_n, sd_n

    _moe_decode_autotuned = triton.autotune(configs=_CONFIGS, key=["H", "INTER", "TOP_K", "P_BUCKET", "DEQ"])(
        _moe_decode_kernel)

# The interpreter cannot benchmark configs; it runs this one (tests pin others: masked slices, several K tiles and
# down chunks)
INTERPRETER_CONFIG = dict(BLOCK_I=16, BLOCK_K=32, BLOCK_H=32)


def moe_decode_triton(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, idx: torch.Tensor, weights: torch.Tensor,
                      shared13: NVFP4Tensor, shared2: NVFP4Tensor, *, config: dict | None = None,
                      deq: int | None = None) -> torch.Tensor:
    """Same contract as `moe_decode_reference`, with S = cdiv(I, BLOCK_I) slices: [T, k + 1, S, H] fp32 (autotuned:
    BLOCK_I = AUTOTUNED_BLOCK_I). `config` pins BLOCK_K / BLOCK_H / num_warps and optionally BLOCK_I (tests,
    benchmarks); `deq`: the GEMV's dequantiser mode (`w4a16_gemv.resolve_deq`: None is DEQ_WIDE for bf16 on a GPU,
    mode 2 on rows it cannot read in words). One launch, no host syncs (CUDA-graph capturable)."""
    info = describe(x, w13, w2, idx, weights, shared13, shared2)
    if not info["shapes_ok"]:
        raise ValueError(f"w4a16_moe_decode: shapes do not fit (x {tuple(x.shape)}, gate_up {tuple(w13.shape)}, down "
                         f"{tuple(w2.shape)}, idx {tuple(idx.shape)}, shared {tuple(shared13.shape)} / "
                         f"{tuple(shared2.shape)}; same row strides, <= {GEMV_MAX_TOKENS} tokens)")
    t, k = idx.shape
    e, n13, h = w13.shape
    i = n13 // 2
    g13, s_ge13, s_gn13 = _global_2d(w13.global_scale, e, n13)
    g2, s_ge2, s_gn2 = _global_2d(w2.global_scale, e, h)
    sg13, s_sgn13 = _global_1d(shared13.global_scale, n13)
    sg2, s_sgn2 = _global_1d(shared2.global_scale, h)
    interp = _interpreted()
    deq = resolve_deq(deq, x.dtype, interp, info["words_ok"], NAME)  # the GEMV's rule (its K loop runs here)
    cfg = dict(INTERPRETER_CONFIG) if interp else {}
    cfg.update(config or {})
    pairs = t * (k + 1)
    x = x if x.stride(-1) == 1 else x.contiguous()
    hidden = torch.empty((pairs, i), dtype=torch.float32, device=x.device)
    args = (x, idx.contiguous(), weights.contiguous(), w13.packed, w13.scales.view(torch.uint8), g13, w2.packed,
            w2.scales.view(torch.uint8), g2, shared13.packed, shared13.scales.view(torch.uint8), sg13, shared2.packed,
            shared2.scales.view(torch.uint8), sg2, hidden)
    strides = (h, i, k, triton.next_power_of_2(pairs), x.stride(0), w13.packed.stride(0), w13.scales.stride(0),
               s_ge13, s_gn13, w2.packed.stride(0), w2.scales.stride(0), s_ge2, s_gn2, s_sgn13, s_sgn2,
               w13.packed.stride(1), w13.scales.stride(1), w2.packed.stride(1), w2.scales.stride(1))
    meta = dict(DEQ=deq, INTERPRET=interp)
    warps = cfg.pop("num_warps", 4)
    if cfg:
        cfg.setdefault("BLOCK_I", AUTOTUNED_BLOCK_I)
    s = triton.cdiv(i, cfg.get("BLOCK_I", AUTOTUNED_BLOCK_I))  # the autotuned configs all slice by 16
    parts = torch.empty((t, k + 1, s, h), dtype=torch.float32, device=x.device)
    if cfg:
        _moe_decode_kernel[(s, pairs)](*args, parts, *strides, **meta, **cfg, num_warps=warps,
                                       **pdl.launch_options())
    else:
        _moe_decode_autotuned[(s, pairs)](*args, parts, *strides, **meta, **pdl.launch_options())
    return parts


# ---- guard, registry entry ------------------------------------------------------------------------------------------
def describe(x: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, idx: torch.Tensor, weights: torch.Tensor,
             shared13: NVFP4Tensor, shared2: NVFP4Tensor) -> dict[str, Any]:
    stacked = _weight_ok(w13, True) and _weight_ok(w2, True)
    dense = _weight_ok(shared13, False) and _weight_ok(shared2, False)
    shapes_ok = False
    words_ok = False
    if stacked and dense and x.dim() == 2 and idx.dim() == 2:
        e, n13, h = w13.shape
        i = n13 // 2
        shapes_ok = (n13 % 2 == 0 and tuple(w2.shape) == (e, h, i) and x.shape[1] == h and h % 16 == 0
                     and i % 16 == 0 and tuple(shared13.shape) == (n13, h) and tuple(shared2.shape) == (h, i)
                     and idx.shape == weights.shape and idx.shape[0] == x.shape[0]
                     and 0 < x.shape[0] <= GEMV_MAX_TOKENS and idx.shape[1] >= 1
                     # the kernel takes one row stride per projection for the routed and the shared weights
                     and shared13.packed.stride(0) == w13.packed.stride(1)
                     and shared13.scales.stride(0) == w13.scales.stride(1)
                     and shared2.packed.stride(0) == w2.packed.stride(1)
                     and shared2.scales.stride(0) == w2.scales.stride(1)
                     and tuple(w13.global_scale.shape) in ((), (e,), (e, n13))
                     and tuple(w2.global_scale.shape) in ((), (e,), (e, h))
                     and tuple(shared13.global_scale.shape) in ((), (n13,))
                     and tuple(shared2.global_scale.shape) in ((), (h,)))
        # DEQ_WIDE reads the packed rows as int32 words, and the activations as the GEMV's DEQ_WIDE does
        words_ok = all(t.data_ptr() % 4 == 0 for t in (w13.packed, w2.packed, shared13.packed, shared2.packed)) and \
            all(s % 4 == 0 for s in (w13.packed.stride(0), w13.packed.stride(1), w2.packed.stride(0),
                                     w2.packed.stride(1))) and x.data_ptr() % 4 == 0 and x.stride(0) % 2 == 0
    return dict(device=x.device.type, capability=torch.cuda.get_device_capability(x.device) if x.is_cuda else None,
                dtype=x.dtype, shapes_ok=shapes_ok, words_ok=words_ok,
                same_device=len({t.device for t in (x, idx, weights, w13.packed, w2.packed, shared13.packed,
                                                    shared2.packed)}) == 1,
                tokens=x.shape[0] if x.dim() == 2 else -1)


def supports(*, device: str, capability, dtype: torch.dtype, shapes_ok: bool, same_device: bool, **_: Any) -> bool:
    """Triton able to run on `device` (cuda >= sm_80, or the interpreter on CPU); bf16 / fp16 activations; 1 to
    GEMV_MAX_TOKENS tokens; checkpoint-layout stacks and a shared expert of the same shapes and row strides."""
    return triton is not None and _device_ok(device, capability) and dtype in ACT_DTYPES and shapes_ok and same_device


def compare(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> str | None:
    """The per-pair outputs (the sum over slices) against the reference's, TOLERANCE x max |ref|."""
    if out.dim() != 4 or ref.dim() != 4 or out.shape[:2] != ref.shape[:2] or out.shape[3] != ref.shape[3]:
        return f"shape {tuple(out.shape)} does not match the reference's {tuple(ref.shape)} but for the slices"
    return tolerance.compare(out.sum(2), ref.sum(2), TOLERANCE if tol is None else tol)


def random_inputs(t: int = 2, k: int = 3, e: int = 6, h: int = 64, i: int = 48, dtype=torch.bfloat16, seed: int = 0,
                  device="cpu") -> tuple:
    """Model-like decode inputs: x ~N(0, 1), experts and shared expert ~N(0, 0.05) quantised with per-expert global
    scales, distinct top-k ids per token (expert e - 1 never picked), softmax routing weights."""
    from kernels.nvfp4 import quantize_nvfp4

    g = torch.Generator().manual_seed(seed)
    w13 = quantize_nvfp4(torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.rand(e, generator=g) * 1e-4 + 1e-5)
    w2 = quantize_nvfp4(torch.randn(e, h, i, generator=g) * 0.05, torch.rand(e, generator=g) * 1e-4 + 1e-5)
    s13 = quantize_nvfp4(torch.randn(2 * i, h, generator=g) * 0.05)
    s2 = quantize_nvfp4(torch.randn(h, i, generator=g) * 0.05)
    x = torch.randn(t, h, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype)
    mv = lambda w: NVFP4Tensor(*(u.to(device) for u in w))  # noqa: E731
    return x.to(device), mv(w13), mv(w2), idx.to(device), weights.to(device), mv(s13), mv(s2)


def _sample(device) -> tuple[tuple, dict]:
    return random_inputs(device=device), {}


def register(registry) -> None:
    registry.add_op(NAME, moe_decode_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="max |diff| <= 1e-4 x max |ref| of the per-pair sums over slices (exact weights, "
                              "fp32 products and sums, no rounding: only the summation order differs)")
    registry.add_implementation(NAME, "triton", moe_decode_triton, supports)
