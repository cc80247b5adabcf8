"""The decoder layer's residual add + post-mixer norm inside the MoE router's GEMV + top-k launch (one launch instead
of two on a decode step's chain; the engine's `norm_in_router_rows`, off until measured on the H200).

Reference `add_norm_router_gemv_topk_reference`: exactly the two ops it replaces, in order --
    s, y = rms_norm.add_rms_norm_zc_reference(x, hm, norm_weight, eps)     # x + hm rounded, its zero-centred norm
    logits, weights, idx = moe_router.router_gemv_topk_reference(y, w, k)  # the router on y
    inputs   x [N, H] (the layer's residual), hm [N, H] (the mixer's output), norm_weight [H], eps, w [E, H], k;
             x and hm of one dtype, bf16 (the model's) or fp32
    outputs  (s, y, logits, weights, idx): s, y [N, H] contiguous in x.dtype; logits [N, E]; weights [N, k] in
             x.dtype; idx [N, k] int64.
Kernel: `moe_router._router_gemv_topk_kernel` with ADD_NORM. Every program of a row block computes the row's
1 / rms over the whole row (H = 2,048: 8 KB of bf16 pairs, from L2), then each H tile's y on the fly for its dot
products; the programs of the first expert tile store s and y. So the router no longer waits for a separate add + norm
launch (H200 profile run 23: add + norm 1.42 us a call on the lone step's chain, 40 calls a step).

Numerics: s is one rounding of an exact fp32 add: bit for bit. y: the same fp32 operations as rms_norm's add kernel,
the sum of squares reduced in another order when compiled (one warp here) -> within rms_norm's tolerance
(1e-2 x max |ref| in bf16), usually bit-equal; under the interpreter bit-equal. Logits, weights, idx: exactly
router_gemv_topk's contract on the y this op returns (`moe_router.compare_gemv`). Where y differs from the
two-launch path by an ulp, greedy tokens of random weights may differ (as with `combine_next_norm`).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import moe_router, rms_norm

NAME = "add_norm_router_gemv_topk"


def add_norm_router_gemv_topk_reference(x: torch.Tensor, hm: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                        w: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(s, y, logits, weights, idx); see the module docstring."""
    s, y = rms_norm.add_rms_norm_zc_reference(x, hm, norm_weight, eps)
    return (s, y, *moe_router.router_gemv_topk_reference(y, w, k))


@torch.library.custom_op("qwen::add_norm_router_gemv_topk", mutates_args=())
def add_norm_router_gemv_topk_op(x: torch.Tensor, hm: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                 w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor]:
    """The fused launch; contract: `add_norm_router_gemv_topk_reference` (`compare`)."""
    logits, weights, idx, s, y = moe_router._launch_gemv(x, w, k, add_norm=(hm, norm_weight, eps))
    return s, y, logits, weights, idx


@add_norm_router_gemv_topk_op.register_fake
def _(x, hm, norm_weight, eps, w, k):
    n, e = x.shape[0], w.shape[0]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((n, e)), x.new_empty((n, k)),
            x.new_empty((n, k), dtype=torch.int64))


def add_norm_router_gemv_topk_triton(x, hm, norm_weight, eps, w, k):
    """Same contract as `add_norm_router_gemv_topk_reference`."""
    return add_norm_router_gemv_topk_op(x, hm, norm_weight, eps, w, k)


def supported(x: torch.Tensor, hm: torch.Tensor, norm_weight: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """The router kernel's guard (`moe_router.supported_gemv`: decode sizes, N <= MAX_ROWS) for (x, w, k); hm of x's
    shape, dtype, device and row stride with a unit last stride; x bf16 or fp32 (rms_norm.ADD_DTYPES: the sum's
    rounding); norm_weight [H] on x's device with a unit stride; H <= rms_norm.MAX_DIM (the whole row in one
    register tile)."""
    if not (isinstance(hm, torch.Tensor) and isinstance(norm_weight, torch.Tensor)
            and moe_router.supported_gemv(x, w, k)):
        return False
    h = x.shape[1]
    return (hm.shape == x.shape and hm.dtype == x.dtype and hm.device == x.device and hm.stride() == x.stride()
            and x.dtype in rms_norm.ADD_DTYPES and norm_weight.shape == (h,) and norm_weight.device == x.device
            and norm_weight.stride() == (1,) and h <= rms_norm.MAX_DIM)


def compare(out, ref, w: torch.Tensor | None = None) -> str | None:
    """None if `out` is a correct answer where `ref` is the reference's, else why: s bit for bit and y within
    rms_norm's tolerance (`rms_norm.compare_add`); then the router part by `moe_router.compare_gemv` -- against the
    router reference on OUR y when the router weight `w` is given (the logits' slack then covers the fp32 summation
    order), else against `ref`'s router outputs to one ulp (inputs whose sums are exact: `_sample`)."""
    if len(out) != 5 or len(ref) != 5:
        return f"expected (s, y, logits, weights, idx), got {len(out)} outputs"
    problem = rms_norm.compare_add(out[:2], ref[:2])
    if problem:
        return problem
    if w is None:
        problem = moe_router.compare_gemv(out[2:], ref[2:])
    else:
        problem = moe_router.compare_gemv(out[2:], moe_router.router_gemv_topk_reference(out[1], w, out[3].shape[1]),
                                          out[1], w)
    return None if problem is None else f"router: {problem}"


def random_inputs(n: int, h: int, e: int, seed: int = 0, dtype=torch.bfloat16, device="cpu") -> tuple:
    """(x, hm, norm_weight, eps, w, k) model-like: residual x ~N(0, 1) x 4, mixer output hm ~N(0, 1), the zero-centred
    norm weight ~N(0, 0.3), eps 1e-6, router weight ~N(0, 0.02); k = min(8, e)."""
    gen = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(n, h, generator=gen)
    hm = torch.randn(n, h, generator=gen)
    nw = 0.3 * torch.randn(h, generator=gen)
    w = 0.02 * torch.randn(e, h, generator=gen)
    return (x.to(dtype).to(device), hm.to(dtype).to(device), nw.to(dtype).to(device), 1e-6,
            w.to(dtype).to(device), min(8, e))


# ---- registry entry -------------------------------------------------------------------------------------------------
def describe(x, hm, norm_weight, eps, w, k) -> dict[str, Any]:
    return dict(device=x.device.type, rows=x.shape[0] if x.dim() == 2 else None,
                supported=supported(x, hm, norm_weight, w, k))


def supports(*, supported: bool, **_: Any) -> bool:
    return supported


def _sample(device) -> tuple[tuple, dict]:
    # every row of s = x + hm is +-1 (mean(s^2) = 1), the norm weight in {0, 1, -0.5}: y = +-(1 + nw) exactly in bf16
    # (s / rms = +-(1 - 5e-7) rounds to +-1), so both sides' y are the same bits and the logits sums (small binary
    # fractions, |sum| <= 2 x 2 x 72) are exact: logits equal, top-k router_topk's on them; 3 rows x 60 experts x
    # H = 72 (a masked H tail), bf16, top-8
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (3, 72), generator=gen).float()
    s = torch.randint(0, 2, (3, 72), generator=gen).float() * 2 - 1
    nw = torch.tensor([0.0, 1.0, -0.5])[torch.randint(0, 3, (72,), generator=gen)]
    w = torch.randint(-2, 3, (60, 72), generator=gen).float()
    bf = torch.bfloat16
    return (x.to(bf).to(device), (s - x).to(bf).to(device), nw.to(bf).to(device), 1e-6, w.to(bf).to(device), 8), {}


def register(registry) -> None:
    registry.add_op(NAME, add_norm_router_gemv_topk_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance="s bit for bit; y within rms_norm's tolerance (1e-2 x max |ref| in bf16); logits, "
                              "weights and idx router_gemv_topk's contract on the returned y")
    registry.add_implementation(NAME, "triton", add_norm_router_gemv_topk_triton, supports)
