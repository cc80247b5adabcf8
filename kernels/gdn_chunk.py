"""Gated DeltaNet prefill (the chunked rule) for every prefill sequence of a step in one call, through
flash-linear-attention's Triton kernels (PyPI `fla-core`, `fla.ops.gated_delta_rule.chunk_gated_delta_rule`; the
same library transformers' `Qwen3_5MoeGatedDeltaNet` uses when it is installed).

Reference: `qwen_engine.model.gdn.gated_delta_rule_chunked` per sequence (torch; a Python loop over chunks of 64
tokens: ~170 kernel launches per layer and 1k-token sequence, ~5,000 of a 1k prefill's ~12,000 on the H200,
benchmarks/RESULTS.md). Contract, flat over the sequences of the step (T tokens, N sequences):
    q, k [T, H, Dk] (L2-normalised, q scaled by Dk^-1/2, repeated to the H value heads, as `GatedDeltaNet._heads`
    gives them); v [T, H, Dv]; g (log decay <= 0), beta [T, H]; states [N, H, Dk, Dv] entering each sequence;
    cu_seqlens int64 [N + 1] (sequence i is tokens cu[i]:cu[i+1]), or None for one sequence of all T tokens (N = 1;
    fla's fixed-length path, which reads nothing on the host: CUDA-graph capturable); cu_seqlens_cpu: the same
    offsets on the host, or None (then read from the device: a sync); all fp32 but the offsets
    -> (o [T, H, Dv], final states [N, H, Dk, Dv]), fp32; nothing is modified in place.

Numerics: the same recurrence in another blocking; fla's kernels run their in-chunk products on tensor cores (TF32
for fp32 operands on Hopper: ~2^-11 relative per product), so the tolerance is 2e-3 of max |ref| on o and the
states (`compare`), checked on the GPU (`tests/test_kernel_gdn_chunk.py`; fla needs a GPU driver even under the
Triton interpreter, so CI on the CPU runs the reference only). Where fla is not installed, or the device is not
CUDA, the registry falls back to the reference (logged).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kernels import tolerance

NAME = "gdn_chunk_prefill"
TOLERANCE = 2e-3  # x max |ref|: TF32 products inside fla's chunk kernels (module docstring)
MAX_HEAD_DIM = 256  # fla's chunk kernels


def gdn_chunk_reference(q, k, v, g, beta, states, cu_seqlens, cu_seqlens_cpu=None, chunk_size: int = 64):
    """The contract above with `gated_delta_rule_chunked` per sequence (the host offsets, else one read of the
    device's)."""
    from qwen_engine.model.gdn import gated_delta_rule_chunked

    offsets = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    bounds = [0, q.shape[0]] if cu_seqlens is None else offsets.tolist()
    o = torch.empty_like(v)
    finals = torch.empty_like(states)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        oi, fi = gated_delta_rule_chunked(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
                                          states[i:i + 1], chunk_size)
        o[s:e], finals[i] = oi[0], fi[0]
    return o, finals


@functools.lru_cache(maxsize=1)
def _fla():
    """fla's chunk_gated_delta_rule, or None when fla-core is not installed or cannot load here (it needs a GPU
    driver at import on some versions)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - any import failure means "not available"; supports() says no
        return None
    return chunk_gated_delta_rule


def gdn_chunk_fla(q, k, v, g, beta, states, cu_seqlens, cu_seqlens_cpu=None):
    """Same contract as `gdn_chunk_reference`, in fla's kernels (one varlen call, or fixed-length for one sequence;
    scale 1: q comes scaled). fla builds its chunk indices from the host offsets when given (no device sync) and
    caches them by the offsets tensors' identity: the engine hands every GDN layer of a step the same pair."""
    o, finals = _fla()(q[None], k[None], v[None], g[None], beta[None], scale=1.0, initial_state=states,
                       output_final_state=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    return o[0].to(v.dtype), finals.to(states.dtype)


def describe(q, k, v, g, beta, states, cu_seqlens, cu_seqlens_cpu=None) -> dict[str, Any]:
    shapes_ok = (q.dim() == 3 and q.shape == k.shape and v.dim() == 3 and v.shape[:2] == q.shape[:2]
                 and g.shape == beta.shape == q.shape[:2] and states.dim() == 4
                 and states.shape[1:] == (q.shape[1], q.shape[2], v.shape[2])
                 and (states.shape[0] == 1 if cu_seqlens is None else
                      cu_seqlens.dim() == 1 and cu_seqlens.numel() == states.shape[0] + 1))
    return dict(device=q.device.type, dtypes={t.dtype for t in (q, k, v, g, beta, states)}, shapes_ok=shapes_ok,
                head_dims=(q.shape[-1], v.shape[-1]) if shapes_ok else (),
                seqlens_ok=cu_seqlens is None or (cu_seqlens.dtype == torch.int64 and cu_seqlens.device == q.device
                                                  and (cu_seqlens_cpu is None or (
                                                      cu_seqlens_cpu.device.type == "cpu"
                                                      and cu_seqlens_cpu.dtype == torch.int64
                                                      and cu_seqlens_cpu.shape == cu_seqlens.shape))))


def supports(*, device: str, dtypes: set, shapes_ok: bool, head_dims: tuple, seqlens_ok: bool, **_: Any) -> bool:
    """fla importable, CUDA tensors, fp32 with the contract's shapes, int64 cu_seqlens on the same device (or None;
    its host copy int64 of the same shape, or None), head dims <= MAX_HEAD_DIM."""
    return (device == "cuda" and _fla() is not None and dtypes == {torch.float32} and shapes_ok and seqlens_ok
            and all(1 <= d <= MAX_HEAD_DIM for d in head_dims))


def compare(out, ref, tol: float = TOLERANCE) -> str | None:
    for name, a, b in zip(("o", "states"), out, ref):
        problem = tolerance.compare(a, b, tol)
        if problem:
            return f"{name}: {problem}"
    return None


def random_inputs(lengths: tuple[int, ...], heads: int, dk: int, dv: int, seed: int = 0, device="cpu"):
    """Model-like prefill inputs for sequences of `lengths`: unit-norm q (scaled) and k, g = -A softplus(.) <= 0,
    beta in (0, 1), O(1) entering states."""
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lengths), len(lengths)
    q = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, heads, dk, generator=gen), dim=-1)
    v = torch.randn(t, heads, dv, generator=gen)
    g = -torch.rand(heads, generator=gen).exp() * torch.nn.functional.softplus(torch.randn(t, heads, generator=gen))
    beta = torch.rand(t, heads, generator=gen)
    states = torch.randn(n, heads, dk, dv, generator=gen) * 0.5
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return tuple(x.to(device) for x in (q, k, v, g, beta, states, cu))


def _sample(device) -> tuple[tuple, dict]:
    args = random_inputs((70, 5, 130), 2, 32, 32, device=device)
    return (*args, args[-1].cpu()), {}  # the offsets on the host too, as the engine hands them


def register(registry) -> None:
    registry.add_op(NAME, gdn_chunk_reference, sample=_sample, compare=compare, describe=describe,
                    tolerance=f"o and final states within {TOLERANCE} x max |ref| (TF32 products in fla's kernels)")
    registry.add_implementation(NAME, "fla", gdn_chunk_fla, supports)
