"""Sparse MoE (every layer): softmax router, top-k renormalised, SwiGLU experts, plus a sigmoid-gated shared expert.

Mirrors `Qwen3_5MoeSparseMoeBlock` / `Qwen3_5MoeTopKRouter` / `Qwen3_5MoeExperts` / `Qwen3_5MoeMLP` in transformers
5.24 `modeling_qwen3_5_moe.py`. Expert weights are held fused and stacked as in transformers' in-memory layout:
`gate_up_proj [E, 2I, H]` (rows 0..I-1 = gate, I..2I-1 = up) and `down_proj [E, H, I]`; the ModelOpt checkpoint's
per-expert `experts.E.{gate,up,down}_proj` tensors are stacked into them at load (see `names.py`).

Dispatch: `SparseMoE` calls `self.experts(x, idx, weights, reduce=)` and `self.shared_expert(x)`; the dense modules
here are the reference (and the transformers-oracle path). `quantized.py` provides drop-in replacements with the same
signatures that hold packed NVFP4 weights (`NVFP4Experts`: grouped W4A16 kernel; `NVFP4SwiGLU`: fused gate/up),
swapped in by `load_packed.load_quantized`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.moe_router import with_extra

from ..config import QwenConfig
from . import streams
from .norm import ZeroCentredRMSNorm, _registry


class TopKRouter(nn.Module):
    """Softmax router, top-k renormalised. On CUDA (or `fused = True`) the registry's fused kernels run: at decode
    sizes (N <= `kernels.moe_router.MAX_ROWS` rows) the GEMV and the top-k in one launch ("router_gemv_topk": logits
    within an ulp of F.linear's, fp32 summation order), above it F.linear then everything after the GEMM in one
    launch ("router_topk": ~7 kernels -> 1). Both break ties by the lowest expert index, where torch.topk leaves the
    order open. `fused = False` never."""

    fused: bool | None = None
    # the fused router_topk writes `extra`'s column itself (kernels/moe_router.py HAS_EXTRA); False: torch.cat + fill
    # after it (two of each per MoE layer: 160 launches of a 32-stream decode step; side-by-side benchmarks)
    extra_in_kernel: bool = True
    # above MAX_ROWS rows: the GEMM and the top-k as registry op "router_linear_topk" (kernels/moe_router.py: a
    # Triton split-H tensor-core GEMM taking part in PDL, then the top-k over its partials) instead of F.linear
    # (cuBLAS) + router_topk; process-wide, set by the Qwen engine (`QwenEngineConfig.router_parts`)
    parts: bool = True

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor, extra: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> (logits [N, E] model dtype, weights [N, k] model dtype summing to 1, expert ids [N, k]).
        `extra` >= 0: weights and ids get one more column, (1, `extra`) -- the shared expert as a (k+1)-th pair."""
        if self.fused if self.fused is not None else x.is_cuda:
            from engine_core.registry import default_registry
            from kernels.moe_router import MAX_ROWS

            if x.shape[0] <= MAX_ROWS:
                logits, top, idx = default_registry().call("router_gemv_topk", x, self.weight, self.top_k)
            elif TopKRouter.parts:
                inside = extra if self.extra_in_kernel else -1
                logits, top, idx = default_registry().call("router_linear_topk", x, self.weight, self.top_k, inside)
                if inside >= 0 or extra < 0:
                    return logits, top, idx
            else:
                logits = F.linear(x, self.weight)
                if extra >= 0 and self.extra_in_kernel:
                    top, idx = default_registry().call("router_topk", logits, self.top_k, extra)
                    return logits, top, idx
                top, idx = default_registry().call("router_topk", logits, self.top_k)
            return (logits, *with_extra(top, idx, extra))
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # fp32 island
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)  # renormalise the top-k (always, no norm_topk_prob switch)
        return (logits, *with_extra(top.to(logits.dtype), idx, extra))

    def route_aligned(self, x: torch.Tensor, extra: int, num_experts: int, block_m: int):
        """`forward(x, extra)`'s (weights, ids) and their routing alignment (`w4a16_gemm.MoeRouting` over
        `num_experts` experts at `block_m`-row blocks) on the fused path, the top-k and the alignment in one launch
        (`kernels/router_align.py`) instead of the top-k + the experts' own alignment launch: with `parts` after the
        router GEMM in Triton, summing its partials (registry op "router_linear_topk_align": the same logits, weights
        and ids as `forward`'s "router_linear_topk"), else after F.linear ("router_topk_align"); where a kernel cannot
        run, its ops' separate launches. Its caller (`SparseMoE._aligned_routing`) asks for it above
        `kernels.moe_router.MAX_ROWS` rows only: below, `forward`'s fused GEMV + top-k is the faster router."""
        from engine_core.registry import default_registry
        from kernels.w4a16_gemm import MoeRouting

        if TopKRouter.parts:
            _, top, idx, sorted_pairs, block_expert = default_registry().call(
                "router_linear_topk_align", x, self.weight, self.top_k, extra, num_experts, block_m)
        else:
            top, idx, sorted_pairs, block_expert = default_registry().call(
                "router_topk_align", F.linear(x, self.weight), self.top_k, extra, num_experts, block_m)
        return top, idx, MoeRouting(sorted_pairs, block_expert, idx.numel(), block_m, num_experts)


class Experts(nn.Module):
    def __init__(self, cfg: QwenConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.intermediate = e, i
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """x [N, H]; idx, weights [N, k] -> sum_j weights[:, j] * expert_{idx[:, j]}(x)  [N, H]. `reduce=False` asks
        for the k terms unsummed, [N, k', H], for a consumer that sums over dim 1 itself (`moe_combine`); this dense
        reference hands over the sum as its single term (k' = 1), the packed experts the k terms."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():  # the loop's host sync cannot be captured
            out = experts_gathered(x, self.gate_up_proj, self.down_proj, idx, weights)
        else:
            out = experts_loop(x, self.gate_up_proj, self.down_proj, idx, weights)
        return out if reduce else out[:, None]


def experts_loop(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, idx: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """The routed experts with dense weights, in the model dtype, as transformers computes them: a loop over the
    experts that received tokens (one host sync for the counts). x [N, H]; gate_up_proj [E, 2I, H]; down_proj
    [E, H, I]; idx, weights [N, k] -> [N, H].

    This is the reference the packed path (`quantized.NVFP4Experts`: the grouped W4A16 Triton kernel behind the
    registry op "w4a16_moe") is tested against, on the dequantised weights.
    """
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up_proj.shape[0]).tolist()
    w_flat = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tok = pairs // k
        gate, up = F.linear(x[tok], gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[e]) * w_flat[pairs, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def experts_gathered(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, idx: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
    """The same routed experts without a host sync, for dense weights under CUDA-graph capture (decode batches;
    `qwen_engine/decode_graphs.py`): each (token, slot) pair gathers its expert's matrices and two batched
    matrix-vector products run. Temporaries P x 3 x I x H (P = N k): 1.6 GB at full size in bf16 for 32 tokens, so
    only for decode-sized N. Same maths as `experts_loop`; the sum over the k slots runs in another order (fp32
    rounding). x [N, H]; gate_up_proj [E, 2I, H]; down_proj [E, H, I]; idx, weights [N, k] -> [N, H]."""
    n, k = idx.shape
    flat = idx.reshape(-1)  # [P]
    h = torch.bmm(gate_up_proj[flat], x.repeat_interleave(k, 0)[:, :, None])[:, :, 0]  # [P, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(down_proj[flat], (F.silu(gate) * up)[:, :, None])[:, :, 0]  # [P, H]
    return (y * weights.reshape(-1, 1)).view(n, k, -1).sum(1).to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Routed experts + gated shared expert; with `residual`, also the decoder layer's residual add. On CUDA (or
    `fused = True`) the tail -- the sum over the top-k experts' outputs, shared-expert gate, gating, sum and
    residual -- is one launch of the registry op "moe_combine" (`kernels/moe_combine.py`: 7 kernels -> 1, the same
    roundings); `fused = False` never."""

    fused: bool | None = None
    # run the shared expert as one more (token, expert) pair per token inside the routed experts' grouped launches,
    # where the experts hold it (`quantized.NVFP4Experts(shared=...)`, `load_quantized(shared_expert_in_moe=True)`):
    # on the fused path, above the experts' small-batch copy's tokens (the GEMV's <= 4) and while tokens x (top_k + 1)
    # pairs fit the one-program routing alignment
    # (kernels/moe_align.py MAX_PAIRS: calls of up to 113 tokens at top-8, prefill chunks included; 33-113 tokens
    # have not run on a GPU). Same maths as the dense shared
    # expert (fp32 SwiGLU epilogue, bf16 roundings of its intermediate and output); other summation order.
    shared_in_experts: bool = False
    # one-token calls (kernels.moe_decode.MODEL_MAX_TOKENS: a lone request's decode steps) on the fused path run the
    # routed experts and the shared expert in one launch of the registry op "w4a16_moe_decode"
    # (kernels/moe_decode.py), whose fp32 partial rows moe_combine sums (three launches per layer instead of six),
    # where the experts allow it (`NVFP4Experts.fused_decode_ok`: a checkpoint-layout copy, a W4A16 shared expert
    # of the same width). Set by the engine (QwenEngineConfig.moe_fused_decode; off until measured in the engine). Same
    # maths as the unfused path without its bf16 roundings of the SwiGLU intermediate and of each expert's output
    # (fp32 until moe_combine's sums).
    fused_decode: bool = False
    # CUDA calls that run the dense shared expert (the decode GEMV's <= 4 tokens, prefill chunks past the alignment's
    # MAX_PAIRS) run it on a second stream (`streams.py`), forked once the input is ready and joined before
    # moe_combine, so its two launches overlap the router's and the routed experts' (a parallel branch of the CUDA
    # graphs). Same kernels on the same inputs: the same bits. Set by the engine (QwenEngineConfig.shared_expert_stream;
    # H200, Qwen run 48: lone decode 383.3 -> 414.4 tok/s, TTFT 37.8 -> 36.2 ms, 32 streams equal)
    shared_stream: bool = False
    # with shared_stream: fork the shared expert once the router has run (beside the routed experts' GEMVs only)
    # instead of once the input is ready (beside the router too). Set by the engine
    # (QwenEngineConfig.shared_expert_after_router). The same kernels on the same inputs: the same bits
    shared_after_router: bool = False
    # on the fused path, calls whose experts build a routing alignment (`NVFP4Experts.routing_shape`: above the
    # decode GEMV's tokens) get it from the router's launch instead ("router_topk_align", `TopKRouter.route_aligned`:
    # F.linear, then the top-k and the alignment in one launch, one launch fewer a layer). The same alignment, so the
    # same bits. Set by the engine (QwenEngineConfig.router_align; off: -1.2% at 32 streams on the H200)
    router_align: bool = False

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.gate = TopKRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)  # scalar sigmoid gate per token

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; with `residual` (x's shape): residual + the MoE output."""
        return self.forward_and_norm(x, residual)[0]

    def forward_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                         norm: ZeroCentredRMSNorm | None = None, input_scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, tuple | None]:
        """(`forward(x, residual)`, (norm(out), its e4m3 codes with `input_scale` or None)): the next decoder layer's
        input norm (or the final norm) of this layer's output in the combine's launch ("moe_combine_norm[_fp8]",
        `kernels/moe_combine.py`), where the fused combine runs its one-row kernel and the norm would itself go
        through the registry; else (`forward(x, residual)`, None) and the next layer norms its input itself. Either
        way the norm of the stored row and its codes by the same quantiser: bit for bit under the interpreter,
        compiled within rms_norm_zc's tolerance (the sum of squares may reduce in another order)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        fused = residual is not None and (self.fused if self.fused is not None else x.is_cuda)
        routed, shared = self._outputs(x, fused)
        if not fused:
            out = (routed + torch.sigmoid(self.shared_expert_gate(x)) * shared).reshape(shape)
            return (out if residual is None else residual + out), None
        args = (x, self.shared_expert_gate.weight, shared, routed, residual.reshape(-1, shape[-1]))
        # no norm asked for; the decode MoE's partial rows (the column-block kernel); an unfused norm
        if norm is None or shared.dim() != 2 or not norm.through_registry(x):
            return _registry().call("moe_combine", *args).reshape(shape), None
        if input_scale is None:
            out, normed = _registry().call("moe_combine_norm", *args, norm.weight, norm.eps)
            return out.reshape(shape), (normed.reshape(shape), None)
        out, normed, codes = _registry().call("moe_combine_norm_fp8", *args, norm.weight, norm.eps, input_scale)
        return out.reshape(shape), (normed.reshape(shape), codes.reshape(shape))

    def _outputs(self, x: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed, shared) for x [N, H]: on the fused path in the forms moe_combine reads (routed [N, k, H] unsummed
        or [N, k S, H] partial rows; shared [N, H] or [N, S, H]), else both [N, H]."""
        k = self.gate.top_k
        if fused and self.fused_decode and getattr(self.experts, "fused_decode_ok", None) is not None and \
                self.experts.fused_decode_ok(x.shape[0], self.shared_expert):
            _, weights, idx = self.gate(x)
            parts = self.experts.decode_with_shared(x, idx, weights, self.shared_expert)  # [N, k + 1, S, H] fp32
            return parts[:, :k].flatten(1, 2), parts[:, k]  # [N, k S, H], [N, S, H]: summed in moe_combine
        if fused and self._shared_as_pair(x.shape[0], k):
            # [N, k + 1]: the shared expert's pair last, weight 1 (its output unscaled: gated in moe_combine)
            extra = self.experts.shared_index
            shape = self._aligned_routing(x.shape[0], k + 1, True, x.is_cuda)
            if shape is not None:
                weights, idx, routing = self.gate.route_aligned(x, extra, *shape)
                rows = self.experts(x, idx, weights, reduce=False, with_shared=True, routing=routing)
            else:
                _, weights, idx = self.gate(x, extra=extra)
                rows = self.experts(x, idx, weights, reduce=False, with_shared=True)  # [N, k + 1, H]
            return rows[:, :k], rows[:, k]
        if fused and self.shared_stream and streams.forkable(x):
            routing = self.gate(x) if self.shared_after_router else None  # then the fork waits for the router too
            with streams.branch(x.device) as side:  # x is ready; joined before moe_combine reads `shared`
                with streams.on_side(side):
                    shared = self.shared_expert(x)
                _, weights, idx = routing or self.gate(x)
                routed = self.experts(x, idx, weights, reduce=False)  # [N, k, H], summed inside moe_combine
            return routed, shared
        shape = self._aligned_routing(x.shape[0], k, False, x.is_cuda) if fused else None
        if shape is not None:
            weights, idx, routing = self.gate.route_aligned(x, -1, *shape)
            return self.experts(x, idx, weights, reduce=False, routing=routing), self.shared_expert(x)
        _, weights, idx = self.gate(x)
        routed = self.experts(x, idx, weights, reduce=not fused)  # fused: [N, k, H], summed inside moe_combine
        return routed, self.shared_expert(x)

    def _aligned_routing(self, n: int, pairs_per_token: int, with_shared: bool,
                         is_cuda: bool) -> tuple[int, int] | None:
        """(experts, rows per block) of the alignment the router's launch builds for this call (`router_align`), or
        None: the option off, experts that build none for n tokens (`NVFP4Experts.routing_shape`), a router that
        keeps its own path (the fused GEMV + top-k at <= MAX_ROWS rows; a router_topk without the extra column in its
        kernel; a router on its plain torch path), or, with `TopKRouter.parts`, fewer than
        `kernels.router_align.PARTS_MIN_PAIRS` pairs (there the separate launches were faster per call) or more than
        `kernels.moe_router.PARTS_MAX_ROWS` tokens (the router GEMM is F.linear there: the separate launches, as
        without router_align)."""
        if not self.router_align or not hasattr(self.experts, "routing_shape") or not self.gate.extra_in_kernel:
            return None
        if not (self.gate.fused if self.gate.fused is not None else is_cuda):  # the router's plain (torch) path:
            return None  # its top-k is torch.topk's, which may order ties otherwise
        from kernels.moe_router import MAX_ROWS, PARTS_MAX_ROWS
        from kernels.router_align import PARTS_MIN_PAIRS

        if n <= MAX_ROWS:
            return None
        # with the router GEMM in Triton: the fold over its partials from PARTS_MIN_PAIRS pairs (below, the separate
        # launches are faster) up to its PARTS_MAX_ROWS rows (above, the GEMM is F.linear and the routing its own)
        if TopKRouter.parts and not (PARTS_MIN_PAIRS <= n * pairs_per_token and n <= PARTS_MAX_ROWS):
            return None
        return self.experts.routing_shape(n, n * pairs_per_token, with_shared)

    def _shared_as_pair(self, n: int, top_k: int) -> bool:
        """Whether this call runs the shared expert inside the experts' launches (`shared_in_experts`): not for the
        calls that the experts' small-batch copy serves (`NVFP4Experts.repack_dual`: the decode GEMV at <= 4 tokens),
        which keep the dense shared expert's own GEMV (H200, Qwen run 23: the 9th pair in the lone request's GEMV
        launches measured 314.5 -> 295.3 tok/s; run 19 +1.0%), nor past the one-program alignment's MAX_PAIRS."""
        if not self.shared_in_experts or getattr(self.experts, "shared_index", None) is None:
            return False
        from kernels.moe_align import MAX_PAIRS

        return getattr(self.experts, "small_tokens", 0) < n and n * (top_k + 1) <= MAX_PAIRS
