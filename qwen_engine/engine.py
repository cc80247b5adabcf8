"""QwenEngine: Qwen3.6-35B-A3B text generation on one device behind `engine_core`'s continuous scheduler.

Request path (one `generate` call)::

    prompt token ids --(validate: BadRequest / NotReady / Overloaded at once)--> ContinuousScheduler.add
    step loop (one asyncio task; the blocking forward runs on one worker thread, like `AsyncBatchLoop`):
        plan = scheduler.step()  -> runner.execute(plan) (forward over paged state + sampling, 1 D2H copy)
        -> scheduler.finish(plan, out) -> TokenDeltas fanned out to per-request asyncio queues
        -> scheduler.pop_answers() -> the one terminal message per request
    -> GenerationChunk per sampled token (the last one carries finish_reason)

Every scheduler call happens on the event-loop thread (the scheduler is not thread-safe); only
`ModelRunner.execute` runs on the worker thread, and only one plan is ever in flight. When nothing is waiting or
running the loop sleeps on an `asyncio.Event` (poked by `generate`) with a timeout at the earliest deadline.

The engine is Ray-free and HTTP-free: `tests/test_qwen_engine.py` drives it with plain asyncio. Errors are typed:
`BadRequest` (the client's fault; `.code` names the problem), `NotReady`, and engine_core's `Overloaded`,
`DeadlineExceeded`, `RunFailed` (see `engine_core/request.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import operator
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_core.continuous import (
    Completion,
    ContinuousConfig,
    ContinuousScheduler,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    StepFailed,
    TokenDelta,
    TokenLogprobs,
)
from engine_core.config_args import check_field_types, from_args
from engine_core.registry import resolve_preference
from engine_core.request import BadRequest, NotReady, client_timeout  # noqa: F401 - re-exported for callers
from engine_core.request import Answer, Cancelled, DeadlineExceeded, Overloaded, RequestId, RequestTimings
from kernels.paged_attention import GATED_NAME as GATED_ATTN_OP

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GDN_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # QwenEngineConfig.gdn_state_dtype
KV_CACHE_DTYPES = ("model", "fp8", "auto")  # QwenEngineConfig.kv_cache_dtype
PRESETS = ("tiny", "qwen3.6-35b-a3b")  # QwenConfig.tiny() | QwenConfig() (the checkpoint's numbers)

__all__ = [
    "QwenEngineConfig", "QwenEngine", "GenerationChunk", "BadRequest", "NotReady", "SamplingParams",
    "Overloaded", "DeadlineExceeded",
]


# --------------------------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class QwenEngineConfig:
    """Everything a Qwen replica is configured with; `serve_configs/*.yaml` `args:` map 1:1 onto these fields."""

    # -- model
    checkpoint: str | None = None  # checkpoint directory (BF16 or ModelOpt NVFP4/FP8, loaded dequantised); None ->
    #                                seeded random weights (loudly labelled in logs and health())
    config: str = "qwen3.6-35b-a3b"  # a PRESETS name: qwen3.6-35b-a3b | tiny (tests); ignored with a checkpoint
    #                                  (its config.json wins)
    device: str | None = None  # torch device string; None -> cuda if available else cpu
    dtype: str = "auto"  # auto | fp32 | bf16; auto -> bf16 on cuda, fp32 on cpu
    seed: int = 0  # torch seed of the random weights (every replica the same model)
    sampling_seed: int | None = None  # seeds the seeds drawn for requests that name none; None: OS entropy, so
    #                                   replicas and restarts sample differently (as OpenAI's unseeded requests);
    #                                   an int makes a process's sequence of unseeded samples reproducible
    kernels: str = "auto"  # engine_core.registry KernelPreference: auto | reference | triton, for the runner's ops
    #                        and the process-wide registry's model ops (MODEL_OPS: packed linears, experts, norms);
    #                        "auto" on a CPU device applies "reference" (engine_core.registry.resolve_preference:
    #                        Triton runs there only interpreted); "triton" is kept. QwenEngine.kernels / health()
    #                        "kernel_preference": the value applied
    kernel_self_check: bool = True  # at start, every kernel the engine may choose vs its reference on sample inputs
    #                                 on this device; a failure is logged at ERROR and disables that kernel (the
    #                                 reference runs instead); outcomes in health()["kernel_checks"]
    # -- scheduling (engine_core.continuous.ContinuousConfig)
    max_num_seqs: int = 32  # resident sequences = GDN state slots = largest decode batch
    max_num_batched_tokens: int = 2048  # tokens per forward step (decode tokens + prefill chunks)
    block_size: int = 16  # token slots per KV block
    num_kv_blocks: int | None = None  # KV pool size in blocks; None -> kv_cache_memory_fraction of free device
    #                                   memory after loading (cuda), or max_num_seqs full-length sequences (cpu)
    kv_cache_memory_fraction: float = 0.5  # of free device memory after the weights, when num_kv_blocks is None
    kv_cache_dtype: str = "model"  # the full-attention layers' KV pools: "model" (the activation dtype, bf16 on a
    #                                GPU: what transformers attends to), "fp8" (e4m3 codes at scale 1.0: half the
    #                                bytes a token, so twice the tokens in the same memory and half the decode
    #                                attention's reads; keys / values rounded to e4m3, so outputs differ from the
    #                                reference's), "auto" (what the checkpoint declares: NVIDIA's NVFP4 export says
    #                                kv_cache_quant_algo FP8 in hf_quant_config.json and ships no KV scales -> "fp8";
    #                                no declaration -> "model"). k / v scales are not read: the loader refuses a
    #                                checkpoint that has them (as any tensor it does not know). e4m3 pools need sm_89+
    #                                for their Triton kernels (else the references run them)
    max_model_len: int = 8192  # prompt + generated tokens per sequence
    max_queued: int = 256  # unanswered requests (waiting + running); more -> Overloaded (503 + Retry-After)
    request_timeout_s: float | None = 600.0  # default deadline per request, s from arrival (None: none) -> 504
    warmup: bool = True  # run one prefill and one decode step of every decode bucket before reporting ready
    warmup_burst: bool = False  # the warm-up also feeds a burst of three prompts on a GPU (multi-prompt and mixed
    #                             steps: `QwenEngine.warmup`); off until its gain is measured (H200 run 34, prefill
    #                             attention then on cuDNN: start-up 30.6 -> 39.5 s, the first 32-prompt burst 17.8 ->
    #                             17.2 s to its last first token)
    decode_graphs: str = "auto"  # auto | capture | static | off (qwen_engine/decode_graphs.py): CUDA graphs of
    #                              decode-only steps, one per decode bucket, captured at start (auto: capture on
    #                              cuda, off on cpu; static: the graphs' static-buffer path run eagerly)
    decode_buckets: tuple = ()  # decode batch sizes (ascending, last = max_num_seqs); () = 1, 2, 4, 8, 16, 32, ...
    async_decode: bool = True  # overlap decode steps: launch step N+1 (its inputs = N's sampled ids, on the device)
    #                            before N's tokens reach the host, so scheduling and streaming N run while the device
    #                            computes N+1 (engine_core/continuous.py: step_ahead). A request arriving meanwhile
    #                            waits for N+1 (up to one step more to its first token); a sequence that stops at N
    #                            costs one wasted row in N+1. H200 (RESULTS.md, Qwen run 12): lone decode 202 -> 233
    #                            tok/s, 32 streams 1,626 -> 1,842 tok/s
    shared_expert_in_moe: bool | str = "auto"  # packed models: each MoE layer's shared expert runs as one more
    #                                     (token, expert) pair inside the routed experts' grouped launches (calls of
    #                                     5-113 tokens, prefill chunks too; 2 dense GEMM launches per layer fewer; the
    #                                     decode GEMV's <= 4 tokens keep the dense shared expert). auto: on where the
    #                                     experts take the dual_frag layout (Hopper), off elsewhere (not measured
    #                                     there). H200, Qwen run 27: 32 streams 2,623.9 -> 2,703.9 tok/s (+3.0%;
    #                                     runs 19, 23: +2.7%, +3.9%), lone decode and TTFT equal; +3.4 MB per layer
    expert_layout: str = "auto"  # packed models: the routed experts' byte layout (qwen_engine/load_packed.py):
    #                              auto (dual_frag on Hopper; tile_major on other GPUs; the checkpoint's on CPU) |
    #                              dual_frag (split halves in wgmma fragment order for the swap-AB kernel,
    #                              kernels/w4a16_swapped.py, plus a checkpoint-layout copy that decode batches of
    #                              <= 4 tokens read with the GEMV, kernels/w4a16_gemv.py: +16 GB at full size) |
    #                              dual (the same with plain split halves) |
    #                              split_halves | split_frag | tile_major | checkpoint. H200, Qwen run 13: split
    #                              halves TTFT 65 -> 54 ms, 32 streams +15%, lone decode -11% against
    #                              tile_major; run 15: dual (then with a tile-major copy) lone decode 214 -> 239
    #                              tok/s against split halves, the rest equal; run 16: the GEMV on the checkpoint
    #                              copy 235 -> 284; run 21: dual_frag against dual, 32 streams 2,283 -> 2,625
    #                              tok/s (+15%), TTFT 44.5 -> 39.4 ms, lone decode equal
    prefill_graphs: str = "auto"  # auto | capture | static | off (qwen_engine/prefill_graphs.py): CUDA graphs of a
    #                               lone request's prefill from position 0 (the time to first token of a request
    #                               arriving while nothing else runs), one per prefill bucket, captured at start
    lone_prefill: bool | str = "auto"  # the scheduler's lone-prefill rule (engine_core/continuous.py): a waiting
    #                                  prompt that fits the largest prefill bucket is prefilled in a step of its own
    #                                  -- the runner replays that as a CUDA graph -- alternating with decode-only
    #                                  (graphed) steps, instead of riding with other prompts' chunks and the decode
    #                                  rows in a mixed step, which runs eagerly (host-bound: ~3.4x the graph's time
    #                                  a 1k-token prompt on an H100, RESULTS.md). auto: on where prefill graphs run
    #                                  (captured on CUDA, or "static"), off where they do not or failed to capture;
    #                                  true / false: as asked. The same tokens, in another step order
    lone_prefill_min_tokens: int = 0  # the lone-prefill rule takes only prompts of at least this many tokens
    #                                   (shorter ones ride in mixed steps, where one eager step holds many of them)
    prefill_buckets: tuple = ()  # prefill token buckets (a chunk runs padded to the next one; each costs start-up
    #                              time: ~87 s for the first on an H200, compile + autotune, ~1-1.5 s each after it);
    #                              () = 256, 1024, 2048, 4096, 8192 up to min(max_num_batched_tokens, max_model_len)
    autotune_table: str = "auto"  # auto | off | a JSON path (kernels/autotune_table.py): autotune picks loaded before
    #                               the warm-up, so that only the picked configuration of each known key compiles
    #                               and none is timed (a fresh H200 took > 560 s to start without them, 42-44 s
    #                               with Triton's cache warm: RESULTS.md runs 21-23); auto: kernels/tuned/<GPU
    #                               model>.json when it exists. Unknown keys are tuned as before
    programmatic_launch: bool | str = "auto"  # the decode step's Triton kernels launched with programmatic
    #                                    dependent launch (kernels/pdl.py: each may be scheduled before its
    #                                    predecessor ends and waits in-kernel for its outputs), in CUDA graphs too;
    #                                    process-wide. auto: on for Hopper (sm_9x; H200, 2026-12-01, runs 28-30: lone
    #                                    decode +11-12% in three runs, 32 streams +0.4-1.5%); true: also on sm_10x
    #                                    (untested on hardware); on CPUs and other GPUs it stays off (`pdl.wanted`)
    gdn_state_dtype: str = "float32"  # the GDN recurrent state pool's dtype (2 MiB a sequence and layer in fp32, the
    #                                   reference's): "bfloat16" halves what a decode step reads and writes of it (the
    #                                   GDN step was 1.02 of 8.53 ms of a 32-stream step's kernels, at ~3.9 TB/s) at
    #                                   a precision cost: the state is rounded to bf16 after every token (vLLM's
    #                                   default for this state is the model dtype). Every step still computes in fp32.
    gdn_decode_norm: bool = False  # packed models' decode-only steps: each GDN layer's recurrent step and its
    #                                output's gated RMS norm + out_proj's FP8 codes in one launch (the last program
    #                                of a head norms it: kernels/gdn_decode.py "gdn_decode_rows_norm_fp8";
    #                                GatedDeltaNet.decode_norm): 30 launches fewer a step, the same operations.
    #                                H200, Qwen run 55: lone decode 433.5 against 433.0 / 431.5 tok/s, 32 streams
    #                                3,333.3 against 3,365.1 / 3,363.3 (-0.9%: each head's last program norms it
    #                                alone), and 7 of 32 streams' greedy tokens diverge late (the norm's sum in
    #                                another fp32 order); no gain, so off. H100, fifty-first session (after its
    #                                triton 3.6 compile fix): 464.0 / 3,630.8 against 465.1 / 3,650.9 (-0.55%)
    weight_prefetch: str = "off"  # with programmatic_launch (kernels/pdl.py set_prefetch; process-wide): "own" --
    #                               the decode kernels of static weights (FP8 projections, the router, the dense
    #                               W4A16 shared expert, the GDN prep's b / a rows) prefetch their programs' weight
    #                               bytes into L2 before waiting for their predecessor, so those DRAM reads overlap
    #                               its tail; "next" -- only the MoE gate_up launch (CUDA-core or tensor-core
    #                               GEMV) prefetching the down projection's bytes of its experts after its wait;
    #                               "all" -- both; "off". The same bits. H200, Qwen run 54: lone decode
    #                               428.0 / 430.1 (off) against 432.2 (own) and 428.2 (all) tok/s, 32 streams
    #                               3,346.1 / 3,353.2 against 3,336.1 and 3,351.7: no gain beyond the run's spread,
    #                               so off (the step waits on the kernel chain, not on first weight reads); run 66:
    #                               "next" 460.8 against 469.2 / 469.4 lone (-1.8%), the same tokens
    router_parts: bool = True  # CUDA decode steps of more than kernels.moe_router.MAX_ROWS tokens: each MoE layer's
    #                             router GEMM in Triton (128 programs of one 256-wide H tile and 16 experts, on the
    #                             tensor cores; it takes part in PDL and, with early_loads, reads its weight tile
    #                             before its wait), then the top-k over its fp32 partials: registry op
    #                             "router_linear_topk" (kernels/moe_router.py; TopKRouter.parts, process-wide)
    #                             instead of F.linear (cuBLAS: no PDL) + router_topk (with router_align, from
    #                             257 pairs, the top-k + alignment over the partials). Logits within an ulp of
    #                             F.linear's (another fp32 order), so greedy tokens can part from an F.linear
    #                             engine's at a near-tie (random weights: 30 of 32 streams after 14-32 tokens).
    #                             H100, fifty-second session (two machines, one process each): 32 streams +1.5-1.7%
    #                             alone, +3.2-3.5% with early_loads; per call at 32 rows 5.5 (4.3 with early loads)
    #                             against 9.2 us for F.linear + router_topk (benchmarks/RESULTS.md)
    early_loads: bool = True  # with programmatic_launch (kernels/pdl.py set_early; process-wide): the decode
    #                            kernels whose predecessor does not write some of their inputs read those before
    #                            their PDL wait, so the reads overlap the predecessor's tail -- the GDN step its
    #                            recurrent state slices (kernels/gdn_decode.py EARLY), the GDN prep its conv
    #                            windows, conv weights and b / a dot products (kernels/gdn_prep.py EARLY), the
    #                            experts' down projection its routing and first weight tiles (kernels/w4a16_regs.py
    #                            EARLY), the router GEMM of router_parts its weight tile. The same operations (the
    #                            same bits, but for the sign of an exact zero conv weight). H100, fifty-second
    #                            session (two machines, one process each): 32 streams +1.2-1.4%, lone +1.2-2.8%,
    #                            the same greedy tokens (benchmarks/RESULTS.md)
    argmax_kernel: bool = True  # CUDA: greedy ids by kernels/argmax_rows.py (one launch over the GPU; torch.argmax's
    #                             contract exactly) instead of torch.argmax (one block a row: 8.7 us of kernel and
    #                             12.9 us on a lone step's chain, profile run 23); a plain launch after the graph's
    #                             replay. H200 (variants runs 1 / 2, the same greedy tokens): alone lone decode
    #                             476.4 / 476.6 -> 477.1 tok/s; with attn_gate_in_combine 484.9 / 485.8 -> 488.0.
    #                             Other devices keep torch.argmax (the CPU's Triton is the tests' interpreter)
    quant_in_producers: bool = True  # packed models' decode steps: the op that produces an FP8 projection's input
    #                                  (the mixers' input norm, the GDN gated norm, the attention output gate)
    #                                  writes the e4m3 codes beside its output, the same bits, so the projections
    #                                  launch no quantiser (qwen_engine/model/quantized.py: QUANT_IN_PRODUCERS);
    #                                  process-wide. H200, Qwen run 33: lone decode 369.3 -> 373.7 tok/s, 32 streams
    #                                  2,829.5 -> 2,926.7 (+3.4%), the same greedy tokens (one run)
    moe_fused_decode: bool = False  # packed models' one-token decode steps (a lone request): each MoE layer's routed
    #                                 experts and shared expert in one launch (kernels/moe_decode.py, fp32 partial
    #                                 rows summed by moe_combine: 3 launches per layer instead of 6), where the
    #                                 experts keep a checkpoint-layout copy (dual_frag, dual, checkpoint). H200
    #                                 2026-12-02, per layer: 26.6 us against 29.9 (-11%, one run; slower at 4
    #                                 tokens, so 1-token calls only). Off until measured in the engine (RESULTS.md)
    shared_expert_stream: bool = True  # CUDA: the MoE layers' calls that run the dense shared expert (decode steps of
    #                                    <= 4 tokens, where the GEMV keeps it out of the grouped launches; prefill
    #                                    chunks of > 113 tokens) run it on a second stream, a parallel branch of the
    #                                    CUDA graphs beside the router and the routed experts
    #                                    (qwen_engine/model/streams.py, SparseMoE.shared_stream); the same bits. H200,
    #                                    Qwen run 48: lone decode 383.3 / 383.8 -> 414.4 tok/s (+8%), TTFT 37.8 / 38.0
    #                                    -> 36.2 ms, 32 streams equal (3,346.4 / 3,341.9 -> 3,346.7), the same greedy
    #                                    tokens; a no-op on CPUs
    shared_expert_after_router: bool = True  # with shared_expert_stream: the shared expert's fork waits for the
    #                                          router as well (SparseMoE.shared_after_router), so the side stream's
    #                                          two GEMVs overlap the routed experts' only, not the router's split-K
    #                                          GEMV + top-k (profile run 21: 15.5 us a call beside them, 6.0 alone in
    #                                          run 17). The same bits. H200 Qwen run 51: lone decode 418.3 against
    #                                          412.5 / 413.6 tok/s, 32 streams equal, the same greedy tokens
    gdn_z_stream: bool = False  # CUDA decode-only steps: each GDN layer's in_proj_z on the second stream beside
    #                             in_proj_qkv -> conv / gates -> recurrent step (GatedDeltaNet.z_stream), two FP8 GEMV
    #                             calls instead of one fused. H200 run 49: +0.7% lone, -0.4% at 32 streams, the same
    #                             greedy tokens -- no clear win, so off
    combine_next_norm: bool = True  # CUDA: each decoder layer's MoE combine also writes the next layer's input norm
    #                                 (with its FP8 codes) or the final norm, in the same launch
    #                                 (kernels/moe_combine.py "moe_combine_norm[_fp8]", QwenForCausalLM
    #                                 .combine_next_norm): 40 launches fewer per decode step. H200, Qwen run 50:
    #                                 lone decode 415.3 against 412.1 / 414.0 tok/s, 32 streams 3,342.9 against
    #                                 3,334.1 / 3,330.9, the same greedy tokens (small: PDL already hid most of the
    #                                 norm launches' cost)
    gdn_prep_ba_step: int = 2048  # hidden elements per step of the GDN decode prep's b / a dot products
    #                               (kernels/gdn_prep.py BA_BLOCK_H; a power of two; process-wide like
    #                               programmatic_launch). H200: 2,048 (one step at Qwen3.6's hidden size) 4.12 us a
    #                               call against 5.33 at 512 (gdn_prep_bench run 2); Qwen run 51, lone decode 424.3
    #                               against 412.5 / 413.6 tok/s. Another fp32 summation order than 512's (the
    #                               previous default): 8 of 32 random-weight streams' greedy tokens diverged late
    attn_gate_in_combine: bool = True  # packed models' decode steps: the attention output gate and o_proj's FP8
    #                                    codes in the decode attention's combine launch (kernels/paged_attention.py
    #                                    "paged_decode_attention_gated_fp8"; the same bits; model/attention.py
    #                                    GATE_IN_COMBINE, process-wide): 10 launches fewer a lone step. H200 (variants
    #                                    run 1, the same greedy tokens): lone decode 476.4 / 476.6 -> 477.8 tok/s
    gdn_prep_split_v_rows: int = 4  # decode calls of at most this many rows run the GDN prep over 1 + R programs a
    #                                 k-head instead of one (its q / k channels, then each value head alone:
    #                                 kernels/gdn_prep.py SPLIT_V_ROWS; the same bits; process-wide like
    #                                 gdn_prep_ba_step); 0: never. It pays while the split grid (48 programs a row)
    #                                 about fits one wave of SMs: H200 (variants run 2) us per call split / whole at
    #                                 1-4 rows 3.67-3.92 / 4.02-4.08, at 8 rows 6.07 / 4.19; lone decode 478.1 ->
    #                                 484.9 / 485.8 tok/s (split at 32 rows would cost 3,455 -> 3,368 at 32 streams)
    small_batch_tokens: int | None = None  # dual expert layouts (dual_frag: Hopper's default): calls of at most this
    #                               many tokens read the checkpoint-layout copy (NVFP4Experts.small_tokens) | None:
    #                               the loader's, 4 (the decode GEMV's). Up to kernels.w4a16_mma.SORTED_MAX_TOKENS:
    #                               past 4 the tensor-core decode GEMV takes them with the pairs grouped by expert
    #                               (and the shared expert runs dense, not as a 9th pair). H200 run 58, 32 streams:
    #                               3,004.8 at 32 against 3,370.9 tok/s at 4 (the swap-AB kernel): so None
    expert_regs: bool | str = "auto"  # packed models: a third copy of the routed experts in thread order
    #                             (NVFP4Experts.repack_regs, +16 GB at full size) for the decode-sized calls the
    #                             swap-AB kernel runs in 16-row blocks (5 to ~500 tokens), on kernels/w4a16_regs.py
    #                             (Gluon: each weight word loaded straight into the wgmma A fragment). auto: on
    #                             where that kernel runs (sm_90 with Gluon), quietly off elsewhere; true: on, with a
    #                             warning where it cannot run. H200, 2026-12-05 (qwen_regs runs 1 and default 1,
    #                             two processes, w4a16_regs.ENGINE_BUILDS): 32 streams 4,270.5-4,285.4 against
    #                             3,591.2-3,601.8 tok/s (+18.9-19.1%), lone and TTFT unchanged, the same tokens; the
    #                             start-up self-check compares it with the reference (check_expert_layouts)
    router_align: bool | str = "auto"  # packed models' decode steps of more than kernels.moe_router.MAX_ROWS tokens:
    #                             each MoE layer's top-k and routing alignment in one launch (kernels/router_align.py:
    #                             the top-k's last program builds the alignment from bitmasks, no sort;
    #                             SparseMoE.router_align) instead of the top-k and the experts' own moe_align launch:
    #                             one launch fewer a layer (40 a step), the same bits. With router_parts (5-64 rows)
    #                             it sums the router GEMM's partials itself ("router_linear_topk_align", 4 warps: the
    #                             GEMM, then the top-k + alignment) from kernels.router_align.PARTS_MIN_PAIRS (257)
    #                             pairs to 64 tokens: H100, fifty-third session (three processes): 32 streams
    #                             +0.2-0.5%, the same greedy tokens once the top-k's denominator was summed in pick
    #                             order (runs 2-3); per call at 32 rows 7.98 against 9.22 us (at 8-24 rows, below
    #                             that threshold, 7.50-8.13 against 6.64-7.29: the separate launches run there).
    #                             Without router_parts, after F.linear ("router_topk_align", 1 warp: H200
    #                             2026-12-05, one process, 32 streams 4,238.8 against 4,288.4 / 4,287.0 tok/s, -1.2%).
    #                             "auto" (default): on with router_parts (packed models), off without; true / false:
    #                             as asked. The start-up self-check covers both ops where it is on
    router_align_gather: bool = False  # with router_align: the alignment's last program reads every member word
    #                             and pair id in one round trip and takes member[e_p] / start[e_p] by register gathers
    #                             instead of reading them back (kernels/router_align.py GATHER, process-wide; the same
    #                             integers). Sixty-seventh session, H100, per call at 32 tokens (PDL, early loads):
    #                             7.90 against 8.15 us (router_align_gather run in results/h100_67_run1); not yet
    #                             in the engine (gpu_next.sh step 200), so off
    lm_head_layout: str = "auto"  # packed models: lm_head's byte layout (qwen_engine/model/quantized.py:
    #                               NVFP4Linear.repack_frag). split_frag: wgmma fragment order, computed by the swap-AB
    #                               kernel as a one-expert launch at every row count (kernels/w4a16_swapped.py,
    #                               registry op "w4a16_linear_frag"; converted in place, no second copy) | checkpoint
    #                               (one row: the tensor-core decode GEMV, "triton_mma_wide"; more: the dense
    #                               tensor-core kernel) | auto: split_frag on Hopper until 2026-12-04, dual_frag since
    #                               (resolve_lm_head_layout). H200 run 42 (2026-12-03), split_frag against checkpoint
    #                               before and after it: lone decode 377.7 vs 370.5 / 370.2 tok/s, 32 streams 3,005.6
    #                               vs 2,941.2 / 2,937.2, TTFT equal, greedy tokens equal on all 33 streams; the op's
    #                               builds repeated 120,000 times bit for bit (benchmarks/swapped_race.py). Per call
    #                               (benchmarks/lm_head_bench.py): 1 row 142 against 198 us, 32 rows 165 against 390.
    #                               Runs 39-41 found a race in its 32-row-block build, run 45's change one in its
    #                               16-row build: ptxas < 13.3's register-input wgmma hazard, fixed by the kernel's
    #                               SETTLE (kernels/w4a16_swapped.py, the comment above FRAG_STAGES) | dual_frag:
    #                               split_frag plus a checkpoint-layout copy (NVFP4Linear.repack_dual, +254 MB) for
    #                               calls of <= 4 rows, which the tensor-core decode GEMV takes (registry
    #                               "triton_mma_wide"). H200 2026-12-03: per call 100.2 against 121.3 us at one row
    #                               (lm_head_bench run 2); the checkpoint layout alone in the engine: lone decode
    #                               442.6 against 437.8 / 440.3 tok/s, 32 streams 3,270.5 against 3,364.3 / 3,368.4
    #                               (its 32 rows on the dense kernel), Qwen run 59. dual_frag keeps the 32-row calls
    #                               on the swap-AB kernel. Its first engine run (run 61: 428.7 against 430.4 / 430.1)
    #                               had tuned the one-row key in-process; with that key's pick in the shipped table
    #                               (dual_copy run 1, 2026-12-04, one process): lone decode 504.6 / 503.3 against
    #                               499.4 / 498.7 (+0.9%), 32 streams 3,450.6 / 3,459.8 against 3,456.5 / 3,450.3,
    #                               TTFT 36.2 / 36.6 against 36.8 / 36.7, the same greedy tokens: auto is dual_frag
    weights: str = "auto"  # packed | dequantized | auto. packed: NVFP4 layers stay 4-bit (W4A16 kernels on Hopper),
    #                        FP8 layers stay e4m3 (~21 GB for the full model); dequantized: every weight in `dtype`
    #                        (the reference numerics, ~70 GB full size). auto: packed for a quantised checkpoint and
    #                        for full-size random weights (drawn in the ModelOpt checkpoint's exact formats),
    #                        dequantized otherwise (BF16 checkpoints, the tiny test model)

    def __post_init__(self):
        for name in ("decode_buckets", "prefill_buckets"):
            if isinstance(getattr(self, name), list):  # YAML gives a list
                object.__setattr__(self, name, tuple(getattr(self, name)))
        check_field_types(self)
        if self.config not in PRESETS:
            raise ValueError(f"config must be one of {list(PRESETS)}, got {self.config!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {self.dtype!r}")
        if self.weights not in ("auto", "packed", "dequantized"):
            raise ValueError(f"weights must be auto | packed | dequantized, got {self.weights!r}")
        if self.lone_prefill not in (True, False, "auto"):
            raise ValueError(f"lone_prefill must be true, false or auto, got {self.lone_prefill!r}")
        if self.lone_prefill_min_tokens < 0:  # (an int, not a bool: check_field_types above)
            raise ValueError(f"lone_prefill_min_tokens must be a token count >= 0, "
                             f"got {self.lone_prefill_min_tokens!r}")
        for name in ("decode_graphs", "prefill_graphs"):
            if getattr(self, name) not in ("auto", "capture", "static", "off"):
                raise ValueError(f"{name} must be auto | capture | static | off, got {getattr(self, name)!r}")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.prefill_buckets):
            raise ValueError(f"prefill_buckets must be positive token counts, got {self.prefill_buckets!r}")
        limit = min(self.max_num_batched_tokens, self.max_model_len)
        if any(b > limit for b in self.prefill_buckets):  # never used, yet each costs a capture and pool memory
            raise ValueError(f"prefill_buckets {self.prefill_buckets} exceed the largest prefill chunk a step can "
                             f"hold, min(max_num_batched_tokens, max_model_len) = {limit}")
        from .load_packed import check_expert_layout, check_shared_expert_in_moe

        check_expert_layout(self.expert_layout)
        check_shared_expert_in_moe(self.shared_expert_in_moe)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.gdn_state_dtype not in GDN_STATE_DTYPES:
            raise ValueError(f"gdn_state_dtype must be one of {list(GDN_STATE_DTYPES)}, got {self.gdn_state_dtype!r}")
        if not (isinstance(self.expert_regs, bool) or self.expert_regs == "auto"):
            raise ValueError(f"expert_regs must be true, false or 'auto', got {self.expert_regs!r}")
        if not (isinstance(self.programmatic_launch, bool) or self.programmatic_launch == "auto"):
            raise ValueError(f"programmatic_launch must be true, false or 'auto', got {self.programmatic_launch!r}")
        if not isinstance(self.early_loads, bool):
            raise ValueError(f"early_loads must be true or false, got {self.early_loads!r}")
        if not isinstance(self.router_parts, bool):
            raise ValueError(f"router_parts must be true or false, got {self.router_parts!r}")
        if not (isinstance(self.router_align, bool) or self.router_align == "auto"):
            raise ValueError(f"router_align must be true, false or 'auto', got {self.router_align!r}")
        from kernels.w4a16_mma import SORTED_MAX_TOKENS

        if self.small_batch_tokens is not None and not (
                type(self.small_batch_tokens) is int and 1 <= self.small_batch_tokens <= SORTED_MAX_TOKENS):
            raise ValueError(f"small_batch_tokens must be None or an int in 1..{SORTED_MAX_TOKENS}, got "
                             f"{self.small_batch_tokens!r}")
        if self.lm_head_layout not in LM_HEAD_LAYOUTS:
            raise ValueError(f"lm_head_layout must be one of {' | '.join(LM_HEAD_LAYOUTS)}, got "
                             f"{self.lm_head_layout!r}")
        from kernels.pdl import PREFETCH_MODES

        if self.weight_prefetch not in PREFETCH_MODES:
            raise ValueError(f"weight_prefetch must be one of {' | '.join(PREFETCH_MODES)}, got "
                             f"{self.weight_prefetch!r}")
        if not (isinstance(self.gdn_prep_ba_step, int) and 16 <= self.gdn_prep_ba_step <= 8192
                and self.gdn_prep_ba_step & (self.gdn_prep_ba_step - 1) == 0):
            raise ValueError(f"gdn_prep_ba_step must be a power of two in 16..8192, got {self.gdn_prep_ba_step!r}")
        if not (isinstance(self.gdn_prep_split_v_rows, int) and not isinstance(self.gdn_prep_split_v_rows, bool)
                and self.gdn_prep_split_v_rows >= 0):
            raise ValueError(f"gdn_prep_split_v_rows must be an int >= 0 (0: never split), got "
                             f"{self.gdn_prep_split_v_rows!r}")
        if self.kernels not in ("auto", "reference", "triton"):
            raise ValueError(f"kernels must be auto | reference | triton, got {self.kernels!r}")
        if self.autotune_table not in ("auto", "off") and not Path(self.autotune_table).is_file():
            raise ValueError(f"autotune_table must be auto | off | an existing JSON file, got {self.autotune_table!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if self.num_kv_blocks is not None and self.num_kv_blocks * self.block_size < self.max_model_len:
            # (the automatic size refuses the same in _auto_num_blocks) a request of max_model_len tokens, which
            # /v1/models advertises, could never fit: chat requests without max_tokens would all be refused
            raise ValueError(f"num_kv_blocks {self.num_kv_blocks} x block_size {self.block_size} = "
                             f"{self.num_kv_blocks * self.block_size} tokens hold less than one max_model_len "
                             f"({self.max_model_len}) sequence: raise num_kv_blocks or lower max_model_len")
        if not 0.0 < self.kv_cache_memory_fraction < 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {self.request_timeout_s}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every resident sequence's decode token must fit in a step")

    @classmethod
    def from_dict(cls, args: Mapping[str, Any] | None) -> QwenEngineConfig:
        """Build from a plain mapping (YAML `args:`); unknown keys raise, listing the valid ones."""
        return from_args(cls, args)

    def scheduler_config(self, num_kv_blocks: int) -> ContinuousConfig:
        return ContinuousConfig(
            num_kv_blocks=num_kv_blocks, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            max_waiting=self.max_queued, seed=self.sampling_seed, decode_buckets=self.decode_buckets,
            lone_prefill_min_tokens=self.lone_prefill_min_tokens)


# --------------------------------------------------------------------------------------------------------------
# Results and errors


LM_HEAD_LAYOUTS = ("auto", "checkpoint", "split_frag", "dual_frag")  # QwenEngineConfig.lm_head_layout
MOE_DECODE_OP = "w4a16_moe_decode"  # self-checked only with moe_fused_decode on (`QwenEngine._self_check`)
ROUTER_ALIGN_OPS = ("router_topk_align", "router_linear_topk_align")  # self-checked only with router_align on
# GATED_ATTN_OP (kernels.paged_attention GATED_NAME): self-checked only with attn_gate_in_combine on
# registry ops the model itself dispatches through the process-wide registry (packed linears / experts, norms)
MODEL_OPS = ("w4a16_linear", "w4a16_swiglu", "w4a16_moe", "fp8_linear", "nvfp4_w4a4_linear", "rms_norm_zc",
             "rms_norm_gated", "add_rms_norm_zc", "moe_combine", "router_topk", "router_gemv_topk",
             "router_linear_topk",
             "attn_decode_prep", "attn_output_gate", "rms_norm_zc_fp8", "rms_norm_gated_fp8", "attn_output_gate_fp8",
             "w4a16_linear_frag", "moe_combine_norm", "moe_combine_norm_fp8", MOE_DECODE_OP, GATED_ATTN_OP,
             *ROUTER_ALIGN_OPS)
_MODEL_OPS_CHECKED: dict[tuple, dict[str, str]] = {}  # (device, (op, preference) pairs) -> outcomes, once a process

# `BadRequest.code` values this engine raises (the server maps every one to a 4xx with that code)
BAD_REQUEST_CODES = (
    "empty_prompt", "invalid_token_id", "prompt_too_long", "invalid_max_new_tokens", "invalid_sampling",
    "invalid_stop", "invalid_timeout", "request_too_large",
)


@dataclass(frozen=True)
class GenerationChunk:
    """One streamed piece of a generation: the tokens sampled since the previous chunk (usually one)."""

    new_token_ids: tuple[int, ...]  # includes a terminating eos / stop-sequence token (the server strips it)
    finish_reason: str | None  # None while generating; "stop" (eos or stop sequence) | "length" at the end
    prompt_tokens: int
    completion_tokens: int  # sampled so far, including new_token_ids
    matched_stop: tuple[int, ...] | None = None  # on the last chunk: the eos id (1-tuple) / stop sequence that ended it
    # one per new token id when the request's sampling asked for log-probabilities (`SamplingParams.logprobs`)
    new_logprobs: tuple[TokenLogprobs, ...] | None = None
    # on the first chunk when the request asked for prompt log-probabilities (`SamplingParams.prompt_logprobs`): one
    # per prompt token after the first (`TokenLogprobs.logprob` is that prompt token's)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


_FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def _aligned(lps: list[TokenLogprobs] | None, tokens: list[int]) -> tuple[TokenLogprobs, ...] | None:
    """A chunk's log-probabilities, one per token (None: not asked). A runner that left them out while the request
    asked is a bug, not something to stream silently misaligned."""
    if lps is None:
        return None
    if len(lps) != len(tokens):
        raise RuntimeError(f"{len(lps)} log-probabilities for {len(tokens)} tokens")
    return tuple(lps)


# --------------------------------------------------------------------------------------------------------------
# The engine


class QwenEngine:
    """Owns the model, the paged state (`ModelRunner`), the scheduler and the step loop. Construct (blocking: loads
    weights, allocates the KV pool), then `await start()` on the serving event loop, then `generate(...)`."""

    def __init__(self, cfg: QwenEngineConfig, model: torch.nn.Module | None = None):
        """`model`: an already-built `QwenForCausalLM` on `cfg.device` to serve instead of building one from
        `cfg.checkpoint` / `cfg.config` (benchmarks share one full-size model between phases); the caller says
        whether its weights are random through `cfg.checkpoint` (None = random, as for a built model)."""
        from .prefill_graphs import default_buckets as default_prefill_buckets
        from .runner import ModelRunner, gdn_registry

        self.cfg = cfg
        self.device = torch.device(cfg.device) if cfg.device else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = DTYPES[cfg.dtype] if cfg.dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.checkpoint = cfg.checkpoint
        # the preference applied (engine_core.registry.resolve_preference): "auto" on a CPU device is "reference"
        # (Triton there runs only through its interpreter, ~100x slower); "triton" is kept (tests)
        self.kernels = resolve_preference(cfg.kernels, self.device).value
        if self.kernels == "reference" and cfg.expert_layout not in ("auto", "checkpoint"):
            log.warning("expert_layout %r with kernels 'reference': no kernel reads the repacked experts, and the "
                        "reference unpacks them on every call (slow; 'dual' / 'dual_frag' also hold an unused second "
                        "copy)", cfg.expert_layout)
        if model is None and cfg.checkpoint and cfg.kv_cache_dtype == "auto":
            # a KV cache declaration this engine does not implement is refused before the weights load (minutes at
            # full size), not after: the config files alone decide it
            from .checkpoint import read_config

            resolve_kv_cache_dtype("auto", read_config(cfg.checkpoint), self.dtype)
        t0 = time.perf_counter()
        self.model = model if model is not None else build_model(
            cfg.checkpoint, cfg.config, self.device, self.dtype, cfg.seed, cfg.weights, cfg.shared_expert_in_moe,
            # kernels "reference": no kernel reads a repacked layout, and the reference would undo it on every call
            "checkpoint" if self.kernels == "reference" and cfg.expert_layout == "auto" else cfg.expert_layout)
        self.shared_expert_in_moe = set_shared_expert_in_moe(self.model, cfg.shared_expert_in_moe)
        self.moe_fused_decode = set_moe_fused_decode(self.model, cfg.moe_fused_decode)
        self.shared_expert_stream = set_shared_expert_stream(self.model, cfg.shared_expert_stream)
        self.gdn_z_stream = set_gdn_z_stream(self.model, cfg.gdn_z_stream)
        self.gdn_decode_norm = set_gdn_decode_norm(self.model, cfg.gdn_decode_norm)
        self.shared_expert_after_router = set_shared_expert_after_router(self.model, cfg.shared_expert_after_router)
        self.combine_next_norm = set_combine_next_norm(self.model, cfg.combine_next_norm)
        self.lm_head_layout = set_lm_head_layout(self.model, resolve_lm_head_layout(cfg, self.device, self.kernels))
        self.small_batch_tokens = set_small_batch_tokens(self.model, cfg.small_batch_tokens)
        self.expert_regs = set_expert_regs(self.model, cfg.expert_regs, self.device, self.dtype)
        self.router_align = set_router_align(self.model, router_align_on(cfg), warn=cfg.router_align is True)
        self.model_config = self.model.config
        self.kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, self.model_config, self.dtype)
        declared = self.model_config.kv_cache_quant_algo
        log.info("KV cache %s (kv_cache_dtype %r; the checkpoint declares kv_cache_quant_algo %s)",
                 str(self.kv_dtype).removeprefix("torch."), cfg.kv_cache_dtype, declared)
        self.random_weights = cfg.checkpoint is None
        self.load_s = time.perf_counter() - t0
        self.registry = gdn_registry(self.kernels)  # the engine's own: its preference does not leak into others
        # the model's ops dispatch through the process-wide registry: the engine's preference is set there too (the
        # last engine built in a process wins; one engine per replica process is the deployment)
        from engine_core.registry import default_registry

        for op in MODEL_OPS:
            if op in default_registry().ops():
                default_registry().set_preference(self.kernels, op)
        from kernels import autotune_table

        self.autotune_picks = autotune_table.load_setting(cfg.autotune_table, self.device)
        from kernels import pdl  # before the self-checks, warm-up and graph captures: they launch with the setting

        self.programmatic_launch = pdl.set_enabled(pdl.wanted(cfg.programmatic_launch, self.device))
        pdl.set_prefetch(cfg.weight_prefetch)
        self.weight_prefetch = pdl.prefetch_mode()  # "off" without PDL
        pdl.set_early(cfg.early_loads)
        self.early_loads = pdl.early()  # False without PDL
        if cfg.programmatic_launch is True and not self.programmatic_launch:
            log.warning("programmatic_launch: needs compiled Triton kernels on an NVIDIA GPU of compute capability 9.x "
                        "or 10.x; off")
        from .model import quantized

        # process-wide too (the model's modules read the module flag; one engine per replica process is the
        # deployment, so the last engine built in a process sets it), before the self-checks and the warm-up
        quantized.QUANT_IN_PRODUCERS = cfg.quant_in_producers
        from .model.moe import TopKRouter

        TopKRouter.parts = cfg.router_parts
        from kernels import gdn_prep

        gdn_prep.BA_BLOCK_H = cfg.gdn_prep_ba_step
        gdn_prep.SPLIT_V_ROWS = cfg.gdn_prep_split_v_rows
        from .model import attention

        attention.GATE_IN_COMBINE = cfg.attn_gate_in_combine
        from kernels import router_align

        router_align.GATHER = cfg.router_align_gather
        from kernels import fp8_quant

        fp8_quant.E4M3_POOL_SAMPLES = self.kv_dtype == torch.float8_e4m3fn  # the self-check's e4m3-pool samples
        self.kernel_checks = self._self_check() if cfg.kernel_self_check else None
        num_blocks = cfg.num_kv_blocks or self._auto_num_blocks()
        self.scheduler = ContinuousScheduler(cfg.scheduler_config(num_blocks))
        # the runner's prefill graph buckets; the largest is also the lone-prefill rule's limit (_set_lone_prefill)
        self.prefill_buckets = cfg.prefill_buckets or default_prefill_buckets(cfg.max_num_batched_tokens,
                                                                              cfg.max_model_len)
        self.runner = ModelRunner(self.model, self.model_config, self.device, num_blocks, cfg.block_size,
                                  cfg.max_num_seqs, registry=self.registry, max_model_len=cfg.max_model_len,
                                  decode_buckets=self.scheduler.config.decode_buckets,
                                  decode_graphs=cfg.decode_graphs, prefill_graphs=cfg.prefill_graphs,
                                  prefill_buckets=self.prefill_buckets,
                                  state_dtype=GDN_STATE_DTYPES[cfg.gdn_state_dtype], kv_dtype=self.kv_dtype)
        self._set_lone_prefill()
        # CUDA only: elsewhere Triton runs interpreted (tests), far slower than torch.argmax
        self.runner.argmax_kernel = cfg.argmax_kernel and self.device.type == "cuda"
        eos = self.model_config.eos_token_id
        self.default_eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        # one worker thread: the forward pass blocks (CPU) or syncs once (CUDA) off the event loop
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qwen-step")
        self._streams: dict[RequestId, asyncio.Queue] = {}  # live generate() calls: TokenDelta / error Answer
        self._completions: dict[RequestId, Completion] = {}  # ok answers, read by the finishing chunk (matched_stop)
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._closing = False
        self._ready = False
        self.rejected = 0
        self.warmup_s: float | None = None
        log.info("Qwen engine: %s on %s/%s, %d KV blocks of %d, %s, loaded in %.1f s",
                 self.model_config.num_hidden_layers, self.device, str(self.dtype).removeprefix("torch."),
                 num_blocks, cfg.block_size,
                 "RANDOM WEIGHTS (no checkpoint)" if self.random_weights else self.checkpoint, self.load_s)

    # ---- lifecycle

    async def start(self) -> None:
        """Start the step loop on the running event loop and, if configured, warm up; then report ready."""
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._closing = False
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop(), name="qwen-step-loop")
        runner = self.runner
        await self._capture("decode", runner.graphs, runner.capture_decode_graphs, runner.disable_graphs)
        await self._capture("prefill", runner.prefill_graphs, runner.capture_prefill_graphs,
                            runner.disable_prefill_graphs)
        self._set_lone_prefill()  # off again where the prefill graphs failed to capture (auto)
        if self.cfg.warmup and self.warmup_s is None:
            await self.warmup()
        self._ready = True

    def _set_lone_prefill(self) -> None:
        """The scheduler's lone-prefill limit from `lone_prefill` (config comment): the largest prefill bucket, or 0."""
        want = self.cfg.lone_prefill
        on = want is True or (want == "auto" and self.runner.prefill_graphs is not None)
        self.scheduler.lone_prefill_tokens = max(self.prefill_buckets) if on and self.prefill_buckets else 0

    async def _capture(self, kind: str, graphs, capture, disable) -> None:
        """Capture the runner's `kind` ("decode" / "prefill") graphs if configured and not yet captured. On a
        CaptureError: with `{kind}_graphs: auto` that kind runs eagerly (slower, not wrong; health says why), with an
        explicit "capture" the engine closes and start() fails with a clear error."""
        if graphs is None or graphs.mode != "capture" or graphs.captured:
            return
        from .decode_graphs import CaptureError

        try:  # blocking (kernel warm-up + capture, seconds): on the step worker, which is idle before ready
            await asyncio.get_running_loop().run_in_executor(self._worker, capture)
        except CaptureError as exc:
            if getattr(self.cfg, f"{kind}_graphs") == "auto":
                log.warning("%s; %s runs eagerly (%s_graphs: auto)", exc, kind, kind)
                disable(str(exc))
            else:
                await self.aclose()
                raise RuntimeError(f"{exc}; set {kind}_graphs: auto or off to run {kind} eagerly") from exc

    async def aclose(self) -> None:
        """Stop admitting, finish the step in flight, end every unanswered request's stream with NotReady, stop."""
        self._ready = False
        if self._loop_task is not None:
            self._closing = True
            self._wake.set()
            try:
                await self._loop_task
            except Exception:  # noqa: BLE001 - a dead loop was logged (CRITICAL) when it died; closing goes on
                pass
            finally:
                self._loop_task = None
        for rid in list(self._streams):
            self.scheduler.cancel(rid)
        self._dispatch_answers()
        self._worker.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        return self._ready and self.alive

    @property
    def alive(self) -> bool:
        """False once the step loop task has died (a bug): the replica should be restarted."""
        return self._loop_task is not None and not self._loop_task.done()

    async def warmup(self) -> float:
        """One prefill, a full decode batch and (`warmup_burst`, on a GPU) a burst, so lazy allocations, kernel
        compilation and autotuning happen before traffic; then forget the warm-up's statistics. Returns seconds taken.

        The burst: three concurrent prompts of 3/4 of the token budget each, so the steps hold two prompts' chunks
        at once, a chunk that continues its prompt and decode rows beside chunks -- the kinds of step a burst of
        requests makes, which the lone prefill and the decode batch never do. H200, Qwen runs 33-34 (the prefill
        attention then on cuDNN, whose per-shape plans were a large part of the first burst's cost: `attention.
        PREFILL_BACKENDS`): start-up 30.6 -> 39.5 s (different machines), a process's first 32-prompt burst 17.8 ->
        17.2 s to its last first token. Whether it pays with the attention on flash (run 35's first burst: 12.7 s;
        run 33's second engine, the same shapes planned: 4.7 s) is `gpu_next.sh` step 49's question."""
        from engine_core.continuous import ContinuousStats

        t0 = time.perf_counter()
        cfg = self.cfg
        n = max(1, min(cfg.max_num_batched_tokens, cfg.max_model_len - 3, 512))
        vocab = self.model_config.vocab_size

        async def one(prompt: list[int]) -> None:
            async for _ in self._generate(prompt, 2, SamplingParams(), (), ()):
                pass

        # the lone-prefill rule is off meanwhile: it would admit the decode batch's prompts (and the burst's) one by
        # one, so neither the full decode batch nor the burst's mixed steps would form
        lone, self.scheduler.lone_prefill_tokens = self.scheduler.lone_prefill_tokens, 0
        try:
            await one([i % vocab for i in range(n)])
            await asyncio.gather(*(one([(7 * i + 1) % vocab]) for i in range(cfg.max_num_seqs)))
            if cfg.warmup_burst and self.device.type == "cuda":  # nothing compiles or tunes lazily on a CPU
                await asyncio.gather(*(one(prompt) for prompt in warmup_burst(cfg, vocab)))
        finally:
            self.scheduler.lone_prefill_tokens = lone
        self.warmup_s = time.perf_counter() - t0
        self.scheduler.stats = ContinuousStats()
        log.info("warm-up done in %.2f s", self.warmup_s)
        return self.warmup_s

    # ---- requests

    async def generate(self, prompt_token_ids: Sequence[int], *, max_new_tokens: int,
                       sampling: SamplingParams | None = None, stop_token_ids: Sequence[int | Sequence[int]] = (),
                       eos_token_ids: Sequence[int] | None = None,
                       timeout_s: float | None = None) -> AsyncIterator[GenerationChunk]:
        """Stream the completion of one prompt: a `GenerationChunk` per step that sampled tokens for it (several
        tokens coalesced if the consumer fell behind); the last one has `finish_reason` set.

        `stop_token_ids`: single ids or id sequences; the output ending with one stops it ("stop"). `eos_token_ids`:
        None -> the model config's eos ids. `timeout_s`: None -> `request_timeout_s`.
        Raises (before the first chunk) BadRequest, NotReady, Overloaded; (later) DeadlineExceeded or RunFailed.
        Cancelling the consuming task (client disconnect) or closing the iterator cancels the sequence and frees its
        KV blocks and state slot at once. An engine shutdown ends the stream with NotReady (after the tokens already
        sampled): the request did not finish, so no finish_reason claims it did.
        """
        if not self.ready:
            raise NotReady("the engine is not ready (loading, warming up or shutting down)")
        # aclosing: closing this iterator (or cancelling its consumer) closes the inner one at once, whose
        # `finally` cancels the sequence; a bare `async for` would leave that to the garbage collector
        async with contextlib.aclosing(self._generate(prompt_token_ids, max_new_tokens, sampling, stop_token_ids,
                                                      eos_token_ids, timeout_s)) as chunks:
            async for chunk in chunks:
                yield chunk

    def health(self) -> dict[str, Any]:
        s, b = self.scheduler, self.scheduler.blocks
        return {
            "ready": self.ready,
            "alive": self.alive,
            "random_weights": self.random_weights,
            "checkpoint": self.checkpoint,
            "config": self.cfg.config if self.checkpoint is None else "checkpoint",
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "load_s": round(self.load_s, 3),
            "warmup_s": None if self.warmup_s is None else round(self.warmup_s, 3),
            "queue": {"unanswered": s.num_unfinished, "waiting": s.num_waiting, "running": s.num_running,
                      "max_queued": self.cfg.max_queued, "max_num_seqs": self.cfg.max_num_seqs},
            "kv_blocks": {"total": b.num_blocks, "used": b.num_used_blocks, "block_size": b.block_size,
                          "usage": round(b.usage, 4), "dtype": str(self.kv_dtype).removeprefix("torch.")},
            "rejected": self.rejected,
            "async_decode": self.cfg.async_decode,
            "lone_prefill_tokens": s.lone_prefill_tokens,  # the scheduler's lone-prefill limit in force (0: off)
            "shared_expert_in_moe_layers": self.shared_expert_in_moe,
            "moe_fused_decode_layers": self.moe_fused_decode,
            "shared_expert_stream_layers": self.shared_expert_stream,
            "gdn_z_stream_layers": self.gdn_z_stream,
            "gdn_decode_norm_layers": self.gdn_decode_norm,
            "shared_expert_after_router_layers": self.shared_expert_after_router,
            "combine_next_norm": self.combine_next_norm,
            "small_batch_tokens": self.small_batch_tokens,
            "lm_head_layout": self.lm_head_layout,
            "expert_regs": self.expert_regs,
            "router_align_layers": self.router_align,
            "expert_layouts": expert_layouts(self.model),
            "runner": self.runner.stats(),
            "kernel_preference": self.kernels,  # cfg.kernels as applied on this device (resolve_preference)
            "kernels": {k: v["last"] for k, v in self.registry.choices().items() if v["calls"]},
            "kernel_checks": self.kernel_checks,
            "autotune_table_picks": self.autotune_picks,
            "programmatic_launch": self.programmatic_launch,
            "weight_prefetch": self.weight_prefetch,  # the mode in force ("off" without PDL)
            "early_loads": self.early_loads,  # in force (False without PDL)
            "router_parts": _router_parts(),  # process-wide: the last engine built set it
            "weight_prefetch_launches": _prefetch_launches(),  # process-wide counts (kernels/pdl.py)
            "quant_in_producers": _quant_in_producers(),  # process-wide: the last engine built set it
            "stats": s.stats.snapshot(),
        }

    # ---- internals

    def _request(self, prompt_token_ids, max_new_tokens, sampling, stop_token_ids, eos_token_ids,
                 timeout_s) -> GenerateRequest:
        """Validate one request's arguments into a GenerateRequest (BadRequest with a code otherwise)."""
        try:
            prompt = tuple(operator.index(t) for t in prompt_token_ids)
        except TypeError:
            raise BadRequest("invalid_token_id", "prompt_token_ids must be integers") from None
        vocab = self.model_config.vocab_size
        if not prompt:
            raise BadRequest("empty_prompt", "the prompt has no tokens")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise BadRequest("invalid_token_id", f"token ids must be in [0, {vocab})")
        if len(prompt) >= self.cfg.max_model_len:
            raise BadRequest("prompt_too_long", f"the prompt has {len(prompt)} tokens; max_model_len is "
                                                f"{self.cfg.max_model_len} (prompt + completion)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise BadRequest("invalid_max_new_tokens", f"max_new_tokens must be an integer >= 1, got "
                                                       f"{max_new_tokens!r}")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise BadRequest("invalid_sampling", f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if sampling.logit_bias and sampling.logit_bias[-1][0] >= vocab:  # sorted by id: the last is the largest
            raise BadRequest("invalid_token_id", f"logit_bias token ids must be in [0, {vocab}), got "
                                                 f"{sampling.logit_bias[-1][0]}")
        try:
            stops = tuple((operator.index(s),) if not isinstance(s, (list, tuple)) else
                          tuple(operator.index(t) for t in s) for s in stop_token_ids)
            eos = self.default_eos if eos_token_ids is None else tuple(operator.index(t) for t in eos_token_ids)
        except TypeError:
            raise BadRequest("invalid_stop", "stop_token_ids / eos_token_ids must be token ids") from None
        if any(not s for s in stops):
            raise BadRequest("invalid_stop", "stop token sequences must be non-empty")
        timeout_s = client_timeout(timeout_s, self.cfg.request_timeout_s)  # may shorten the deadline, not extend
        deadline = None if timeout_s is None else self.scheduler.clock.now() + timeout_s
        return GenerateRequest(prompt, max_new_tokens, sampling, eos, stops, deadline)

    async def _generate(self, prompt_token_ids, max_new_tokens, sampling, stop_token_ids, eos_token_ids,
                        timeout_s=None) -> AsyncIterator[GenerationChunk]:
        if self._loop_task is None or self._closing:
            raise NotReady("the engine was not started (await engine.start()) or is shutting down")
        request = self._request(prompt_token_ids, max_new_tokens, sampling, stop_token_ids, eos_token_ids,
                                timeout_s)
        if len(self._streams) >= self.cfg.max_queued:
            self.rejected += 1
            raise Overloaded(self.scheduler.retry_after_s(), len(self._streams), self.cfg.max_queued)
        try:
            rid = self.scheduler.add(request)
        except Overloaded:
            self.rejected += 1
            raise
        except ValueError as exc:  # could never fit the KV pool (prompt length was checked above)
            raise BadRequest("request_too_large", str(exc)) from None
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        self._dispatch_answers()  # expired on arrival
        self._wake.set()
        n_prompt, n_out = len(request.prompt_token_ids), 0
        wants_logprobs = request.sampling.logprobs is not None
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                tokens: list[int] = []
                lps: list[TokenLogprobs] | None = [] if wants_logprobs else None
                prompt = None  # the first delta's prompt log-probabilities, when asked
                for item in items:
                    if isinstance(item, TokenDelta):
                        tokens.extend(item.token_ids)
                        if lps is not None:
                            lps.extend(item.logprobs or ())
                        if item.prompt_logprobs is not None:
                            prompt = item.prompt_logprobs
                        if item.finish_reason is not None:
                            n_out += len(tokens)
                            completion: Completion | None = self._completions.pop(rid, None)
                            yield GenerationChunk(tuple(tokens), _FINISH[item.finish_reason], n_prompt, n_out,
                                                  None if completion is None else completion.matched_stop,
                                                  _aligned(lps, tokens), prompt)
                            return
                    else:  # an Answer with an error (ok answers follow the finishing delta, never read)
                        answer: Answer = item
                        if tokens:
                            n_out += len(tokens)
                            yield GenerationChunk(tuple(tokens), None, n_prompt, n_out, None, _aligned(lps, tokens),
                                                  prompt)
                        if isinstance(answer.error, Cancelled):  # the engine aborted it (shutdown)
                            raise NotReady("the engine shut down before this request finished; send it again")
                        raise answer.error
                n_out += len(tokens)
                yield GenerationChunk(tuple(tokens), None, n_prompt, n_out, None, _aligned(lps, tokens), prompt)
        finally:
            # consumer gone (task cancelled, iterator closed) or stream ended: free the sequence if still live
            self._streams.pop(rid, None)
            self.scheduler.cancel(rid)
            self._completions.pop(rid, None)

    def _deliver(self, delta: TokenDelta) -> None:
        queue = self._streams.get(delta.request_id)
        if queue is not None:
            queue.put_nowait(delta)

    def _dispatch_answers(self) -> None:
        for answer in self.scheduler.pop_answers():
            if answer.error is None:
                if answer.request_id in self._streams:
                    self._completions[answer.request_id] = answer.outputs[0]
                continue
            queue = self._streams.get(answer.request_id)
            if queue is not None:
                queue.put_nowait(answer)

    async def _step_loop(self) -> None:
        """Runs `_steps`; if the loop itself dies (a scheduler bug, not a failed model step, which `_steps` turns
        into StepFailed for that step's sequences), every open stream gets StepFailed at once instead of waiting
        forever, `alive` turns False and the replica's health check fails."""
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._ready = False
            log.critical("Qwen step loop died; failing %d open streams: %r", len(self._streams), exc, exc_info=True)
            now = self.scheduler.clock.now()
            for rid, queue in list(self._streams.items()):
                queue.put_nowait(Answer(rid, None, StepFailed(rid, -1, exc), RequestTimings(now, now)))
            raise

    async def _steps(self) -> None:
        """schedule -> execute (worker thread) -> finish, back to back while there is work; sleeps when idle.
        Consumers (the streams' generators, the server's SSE writers) run while the next step executes: finishing a
        step only queues its deltas, and the loop goes straight on to schedule and launch the next one, so their work
        is off the GPU's critical path (the event loop is free whenever it awaits the worker)."""
        loop, sched = asyncio.get_running_loop(), self.scheduler
        while not self._closing:
            plan = sched.step()
            self._dispatch_answers()  # expired while waiting
            if plan is None:
                self._wake.clear()
                wake = sched.next_wakeup()
                timeout = None if wake is None else max(0.0, wake - sched.clock.now())
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
                continue
            if self.cfg.async_decode:
                await self._overlapped(plan)
                continue
            try:
                out = await loop.run_in_executor(self._worker, self.runner.execute, plan)
            except Exception as exc:  # every live sequence of the plan gets StepFailed; the loop goes on
                log.exception("step %d failed", plan.step_id)
                sched.fail(plan, exc)
            else:
                self._finish(plan, out)
            self._dispatch_answers()

    def _finish(self, plan, out) -> None:
        # answers (ok completions) first, so the finishing delta can report its matched stop
        deltas = self.scheduler.finish(plan, out)
        self._dispatch_answers()
        for delta in deltas:
            self._deliver(delta)

    async def _overlapped(self, plan) -> None:
        """`async_decode`: run `plan` and, while decode steps can be formed ahead (`step_ahead`), keep one step
        queued behind the one whose tokens are being read: launch N, then per step one worker call that launches
        N+1 (fed N's sampled ids on the device) and waits for N's ids; N is finished (streams, stops) while the
        device computes N+1. A failed launch or wait fails that step and the one ahead of it."""
        loop, sched, runner = asyncio.get_running_loop(), self.scheduler, self.runner
        try:
            pending = await loop.run_in_executor(self._worker, runner.launch, plan)
        except Exception as exc:
            log.exception("step %d failed", plan.step_id)
            sched.fail(plan, exc)
            self._dispatch_answers()
            return
        while True:
            ahead = None if self._closing else sched.step_ahead(plan)

            def launch_and_wait(ahead=ahead, pending=pending):
                nxt = err = None
                if ahead is not None:
                    try:
                        nxt = runner.launch(ahead, pending)
                    except Exception as exc:  # noqa: BLE001 - N's tokens are still good; N+1 fails below
                        err = exc
                try:
                    return nxt, err, runner.result(pending)
                except Exception:
                    if err is not None:  # both failed: N's error propagates, N+1's is logged here
                        log.error("step %d failed at launch", ahead.step_id, exc_info=err)
                    raise

            try:
                nxt, ahead_err, out = await loop.run_in_executor(self._worker, launch_and_wait)
            except Exception as exc:  # N failed (so does the step fed from it)
                log.exception("step %d failed", plan.step_id)
                sched.fail(plan, exc)
                if ahead is not None:
                    sched.fail(ahead, exc)
                self._dispatch_answers()
                return
            self._finish(plan, out)
            self._dispatch_answers()
            if ahead is None:
                return
            if ahead_err is not None:
                log.error("step %d failed at launch", ahead.step_id, exc_info=ahead_err)
                sched.fail(ahead, ahead_err)
                self._dispatch_answers()
                return
            plan, pending = ahead, nxt

    def _self_check(self) -> dict[str, str]:
        """The runner's ops (own registry) and the model's ops (the process-wide registry the packed modules and
        norms dispatch through; checked once per process and device, since a disabled kernel stays disabled there).
        A model passed in already built may have cached its choices before this check (benchmarks only)."""
        from engine_core.registry import default_registry

        out = self.registry.self_check(self.device)
        reg = default_registry()
        # the decode MoE's op only when the engine may run it (its kernel autotunes 6 configs on a GPU)
        ops = [op for op in MODEL_OPS if op in reg.ops() and (op != MOE_DECODE_OP or self.cfg.moe_fused_decode)
               and (op != GATED_ATTN_OP or self.cfg.attn_gate_in_combine)
               and (op not in ROUTER_ALIGN_OPS or self.router_align > 0 or self.cfg.router_align is True)]
        # re-check when the ops or their preferences change (the ops differ with the options that add one)
        from kernels import fp8_quant, pdl  # the EARLY builds run in the samples when early loads are on, the
        #                                       e4m3-pool samples with e4m3 pools: both part of the key

        key = (str(self.device), tuple((op, reg.preference(op).value) for op in ops), pdl.early(),
               fp8_quant.E4M3_POOL_SAMPLES)
        if key not in _MODEL_OPS_CHECKED:
            _MODEL_OPS_CHECKED[key] = reg.self_check(self.device, ops=ops)
        return {**out, **_MODEL_OPS_CHECKED[key], **check_expert_layouts(self.model, self.device, reg)}

    def _auto_num_blocks(self) -> int:
        """KV pool size when `num_kv_blocks` is None (see the config field)."""
        c, cfg = self.model_config, self.cfg
        per_seq = math.ceil(cfg.max_model_len / cfg.block_size)
        if self.device.type != "cuda":
            return cfg.max_num_seqs * per_seq
        from .runner import gdn_state_bytes, kv_block_bytes

        free, _ = torch.cuda.mem_get_info(self.device)
        budget = free * cfg.kv_cache_memory_fraction - gdn_state_bytes(c, cfg.max_num_seqs + 1, self.dtype,
                                                                      GDN_STATE_DTYPES[cfg.gdn_state_dtype])
        blocks = int(budget // kv_block_bytes(c, cfg.block_size, self.kv_dtype))
        if blocks < per_seq:
            raise RuntimeError(f"only {blocks} KV blocks fit in {cfg.kv_cache_memory_fraction:.0%} of the "
                               f"{free / 2**30:.1f} GiB free; one {cfg.max_model_len}-token sequence needs "
                               f"{per_seq}. Lower max_model_len / max_num_seqs or raise kv_cache_memory_fraction")
        return blocks


# --------------------------------------------------------------------------------------------------------------
# Model construction


def _router_parts() -> bool:
    """The router GEMM in Triton above MAX_ROWS rows (`QwenEngineConfig.router_parts`: process-wide)."""
    from .model.moe import TopKRouter

    return TopKRouter.parts


def _quant_in_producers() -> bool:
    """The FP8 quantiser-in-producers switch in force (`QwenEngineConfig.quant_in_producers`: process-wide)."""
    from .model import quantized

    return quantized.QUANT_IN_PRODUCERS


def warmup_burst(cfg: QwenEngineConfig, vocab: int) -> list[list[int]]:
    """The warm-up's burst (`QwenEngine.warmup`): up to three prompts of 3/4 of the token budget each (at most
    max_model_len - 3 tokens: each generates 2), fed concurrently. With a budget B the steps hold the first prompt
    and a quarter-budget chunk of the second, then the first's decode row, the second's continuation and a chunk of
    the third, and so on. None without room for two sequences."""
    if cfg.max_num_seqs < 2:
        return []
    n = max(1, min(cfg.max_model_len - 3, 3 * cfg.max_num_batched_tokens // 4))
    return [[(13 * i + j) % vocab for i in range(n)] for j in range(min(3, cfg.max_num_seqs))]


def set_shared_expert_in_moe(model: torch.nn.Module, on: bool | str) -> int:
    """Set `SparseMoE.shared_in_experts` on every MoE layer whose experts hold the shared expert (the others keep
    the dense shared expert); returns how many layers run it inside the grouped launches. "auto": on wherever the
    loader stacked it (`load_packed.resolve_shared_expert_in_moe`), without the warning True gives where none is."""
    from .load_packed import check_shared_expert_in_moe
    from .model.moe import SparseMoE

    check_shared_expert_in_moe(on)

    n = 0
    for mod in model.modules():
        if isinstance(mod, SparseMoE):
            mod.shared_in_experts = bool(on) and getattr(mod.experts, "shared_index", None) is not None
            n += mod.shared_in_experts
    if on is True and n == 0:
        log.warning("shared_expert_in_moe: no MoE layer holds its shared expert with the routed experts (a dense or "
                    "W4A4 model, or a model built without it); the dense shared expert runs")
    return n


def set_moe_fused_decode(model: torch.nn.Module, on: bool) -> int:
    """Set `SparseMoE.fused_decode` on every MoE layer (off everywhere for False); returns how many layers' experts
    can take it for a one-token call (`NVFP4Experts.fused_decode_ok`: packed experts with a checkpoint-layout copy and
    a W4A16 shared expert); True with none logs a warning."""
    from .model.moe import SparseMoE

    n = 0
    for mod in model.modules():
        if isinstance(mod, SparseMoE):
            mod.fused_decode = bool(on)
            ok = getattr(mod.experts, "fused_decode_ok", None)
            n += bool(on) and ok is not None and ok(1, mod.shared_expert)
    if on and n == 0:
        log.warning("moe_fused_decode: no MoE layer holds packed experts with a checkpoint-layout copy and a W4A16 "
                    "shared expert (a dense or W4A4 model, or tile-major / split-halves experts); the unfused "
                    "decode path runs")
    return n


def router_align_on(cfg: QwenEngineConfig) -> bool:
    """`QwenEngineConfig.router_align` resolved: "auto" follows `router_parts` (the top-k + alignment over the router
    GEMM's partials gained; after F.linear it lost)."""
    return cfg.router_parts if cfg.router_align == "auto" else bool(cfg.router_align)


def set_router_align(model: torch.nn.Module, on: bool, warn: bool = True) -> int:
    """Set `SparseMoE.router_align` on every MoE layer whose experts can take a routing built by the router
    (`NVFP4Experts.routing_shape`: packed experts); returns how many layers took it. On with none logs a warning
    where `warn` (an explicit true; "auto" on a dense model is quietly off)."""
    from .model.moe import SparseMoE

    n = 0
    for mod in model.modules():
        if isinstance(mod, SparseMoE):
            mod.router_align = bool(on) and hasattr(mod.experts, "routing_shape")
            n += mod.router_align
    if on and warn and n == 0:
        log.warning("router_align: no MoE layer holds packed experts (a dense model); the experts align their own "
                    "routing")
    return n


def _set_on_every(model: torch.nn.Module, kind: type, flag: str, on: bool) -> int:
    """Set attribute `flag` to `on` on every `kind` module of `model`; returns how many now have it on."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, kind):
            setattr(mod, flag, bool(on))
            n += bool(on)
    return n


def set_shared_expert_stream(model: torch.nn.Module, on: bool) -> int:
    """Set `SparseMoE.shared_stream` on every MoE layer (off everywhere for False); returns how many layers took it.
    It acts only on CUDA calls of the fused path that run the dense shared expert."""
    from .model.moe import SparseMoE

    return _set_on_every(model, SparseMoE, "shared_stream", on)


def set_combine_next_norm(model: torch.nn.Module, on: bool) -> bool:
    """Set `QwenForCausalLM.combine_next_norm` on the model (each layer's MoE combine writes the next norm); returns
    whether it is on. It acts where the fused combine runs its one-row kernel and the norms go through the registry
    (CUDA, or modules set `fused`)."""
    from .model.causal_lm import QwenForCausalLM

    return _set_on_every(model, QwenForCausalLM, "combine_next_norm", on) > 0


def set_small_batch_tokens(model: torch.nn.Module, tokens: int | None) -> int:
    """Set `NVFP4Experts.small_tokens` (the calls that read the checkpoint-layout copy) on every routed-expert stack
    with a dual copy, unless `tokens` is None, and hand the calls past 4 tokens to the tensor-core decode GEMV's
    sorted path (`kernels.w4a16_mma.set_sorted_tokens`, process-wide; off at <= 4); returns the value the stacks hold
    (0: no dual copy, which a set `tokens` warns about)."""
    from kernels.w4a16_mma import MMA_MAX_TOKENS, set_sorted_tokens

    from .model.quantized import NVFP4Experts

    held = 0
    for mod in model.modules():
        if isinstance(mod, NVFP4Experts) and mod.small_tokens:
            if tokens is not None:
                mod.small_tokens = tokens
            held = mod.small_tokens
    if tokens is not None and not held:
        log.warning("small_batch_tokens %d: no routed-expert stack has a dual copy (expert_layout dual / dual_frag); "
                    "ignored", tokens)
    set_sorted_tokens(held if held > MMA_MAX_TOKENS else 0)
    return held


def set_expert_regs(model: torch.nn.Module, on: bool | str, device: torch.device, dtype: torch.dtype) -> int:
    """Give every routed-expert stack a thread-order copy (`NVFP4Experts.repack_regs`) when `on` (True or "auto")
    and `kernels/w4a16_regs.py` can run here (`regs_ok`: sm_90, Gluon, bf16, the model's K; True warns where it
    cannot, "auto" does not), else drop any such copy (a model shared between engines: the next engine's setting
    holds); returns how many stacks hold one."""
    from kernels.w4a16_regs import regs_ok

    from .model.quantized import NVFP4Experts

    stacks = [m for m in model.modules() if isinstance(m, NVFP4Experts)]
    if on and stacks:
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        k, k_down = stacks[0].gate_up_packed.shape[-1] * 2, stacks[0].down_packed.shape[-1] * 2
        if not regs_ok(device.type, cap, dtype, k, k_down):
            if on is True:
                log.warning("expert_regs: kernels/w4a16_regs.py does not run here (it needs Triton with Gluon, "
                            "compiled, an sm_90 GPU, bf16 and K 128 x a power of two up to 2048; device %s %s, dtype "
                            "%s, K %d / %d); no copy held", device, cap, dtype, k, k_down)
            on = False
    held = 0
    for m in stacks:
        if on and m.repack_regs():
            held += 1
        elif not on:
            m._drop_regs_copy()
    if on and held < len(stacks):
        log.warning("expert_regs: %d of %d expert stacks do not split into 64 x 128 tiles; they keep the swap-AB "
                    "kernel", len(stacks) - held, len(stacks))
    return held


def set_shared_expert_after_router(model: torch.nn.Module, on: bool) -> int:
    """Set `SparseMoE.shared_after_router` on every MoE layer; returns how many layers took it. It acts only where
    `shared_stream` forks the shared expert."""
    from .model.moe import SparseMoE

    return _set_on_every(model, SparseMoE, "shared_after_router", on)


def _prefetch_launches() -> dict:
    from kernels import pdl

    return dict(pdl.PREFETCH_LAUNCHES)


def set_gdn_decode_norm(model: torch.nn.Module, on: bool) -> int:
    """Set `GatedDeltaNet.decode_norm` on every GDN layer; returns how many layers took it. It acts on decode-only
    steps whose out_proj reads FP8 codes (packed models) with the runner's step op."""
    from .model.gdn import GatedDeltaNet

    return _set_on_every(model, GatedDeltaNet, "decode_norm", on)


def set_gdn_z_stream(model: torch.nn.Module, on: bool) -> int:
    """Set `GatedDeltaNet.z_stream` on every GDN layer (off everywhere for False); returns how many layers took it.
    It acts only on CUDA decode-only steps."""
    from .model.gdn import GatedDeltaNet

    return _set_on_every(model, GatedDeltaNet, "z_stream", on)


def resolve_lm_head_layout(cfg: QwenEngineConfig, device: torch.device, kernels: str | None = None) -> str:
    """`QwenEngineConfig.lm_head_layout` on `device`: "auto" -> "dual_frag" on Hopper (compute capability 9.x, where
    it was measured) unless the kernels are the references (which would undo the order on every call), else
    "checkpoint"; the others as given. `kernels`: the resolved preference (`QwenEngine.kernels`); None resolves
    `cfg.kernels` on `device` (engine_core.registry.resolve_preference)."""
    if cfg.lm_head_layout != "auto":
        return cfg.lm_head_layout
    if kernels is None:
        kernels = resolve_preference(cfg.kernels, device).value
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return "dual_frag" if hopper and kernels != "reference" else "checkpoint"


def set_lm_head_layout(model: torch.nn.Module, layout: str) -> str:
    """Store a packed lm_head (`NVFP4Linear`) in `layout` ("split_frag": `NVFP4Linear.repack_frag`; "dual_frag":
    `repack_dual`; "checkpoint": `repack_checkpoint`, for a model shared between engines) -> the layout it has
    ("dense" for an lm_head that is not packed). A W4A4 export or a shape no tile divides keeps the checkpoint's
    (split_frag / dual_frag asked for: a warning)."""
    from .model.quantized import NVFP4Linear

    head = getattr(model, "lm_head", None)
    if not isinstance(head, NVFP4Linear):
        if layout in ("split_frag", "dual_frag"):
            log.warning("lm_head_layout %s: the lm_head is not a packed NVFP4 module (dequantized weights); "
                        "unchanged", layout)
        return "dense"
    if layout == "checkpoint":
        head.repack_checkpoint()
    elif not (head.repack_dual() if layout == "dual_frag" else head.repack_frag()):
        log.warning("lm_head_layout %s: lm_head [%d, %d] is a W4A4 export or splits into no stored tile; "
                    "checkpoint layout kept", layout, head.out_features, head.in_features)
    return head.layout


def check_expert_layouts(model: torch.nn.Module, device: torch.device, registry) -> dict[str, str]:
    """The routed-expert op on the device at every kernel layout the model's experts use that the registry's
    self-check sample (`w4a16_gemm._sample_moe`: the device's default layout) does not cover, e.g. tile_major, or
    dual's small-batch copy (the checkpoint layout, 3 tokens: the decode GEMV; with small_batch_tokens past 4 also
    min(small_batch_tokens, 16) tokens: the tensor-core decode GEMV's sorted path), through the implementation the
    registry chooses for it. A failing implementation is disabled (as the registry's own self-check does) and the
    next choice is checked, down to the reference. -> {"w4a16_moe[<layout>]": outcomes, "; "-joined}."""
    from kernels import w4a16_gemm as w

    from .model.quantized import SMALL_ROWS, NVFP4Experts, forget_kernel_choices

    used = set()
    for mod in model.modules():
        if isinstance(mod, NVFP4Experts):
            used |= {(mod.layout, 3)} | ({(mod.small_layout, 3)} if mod.small_tokens else set())
            if mod.regs_copy:  # `repack_regs`: the thread-order copy's kernel, checked against the reference
                used.add((w.THREAD_ORDER, 3))
            if mod.small_tokens > SMALL_ROWS:  # small_batch_tokens: more tokens on the copy (another kernel path)
                used.add((mod.small_layout, min(mod.small_tokens, 16)))
    out = {}
    for layout, tokens in sorted(used - {(w.default_expert_layout(device), 3)}):
        name = f"{w.MOE}[{w.LAYOUT_NAMES[layout]}]" + (f"[{tokens} tokens]" if tokens != 3 else "")
        if registry.preference(w.MOE).value == "reference":
            out[name] = "skipped (the reference runs)"
            continue
        args, _ = w._sample_moe(device, layout=layout, tokens=tokens)
        said = []
        while True:
            impl = registry.choose(w.MOE, **registry.spec(w.MOE).describe(*args))
            if impl.name == "reference":
                said.append("the reference runs")
                break
            try:
                err = w.compare(impl.fn(*args), w.moe_experts_w4a16_reference(*args))
            except Exception as exc:  # noqa: BLE001 - reported; the next implementation is checked
                err = repr(exc)
            if err is None:
                said.append(f"{impl.name} passed")
                break
            said.append(f"{impl.name} FAILED ({err}); disabled")
            registry.disable(w.MOE, impl.name, f"self-check on {w.LAYOUT_NAMES[layout]} experts failed: {err}")
            forget_kernel_choices(model)
            log.error("kernel self-check %s: %s failed: %s; disabled", name, impl.name, err)
        out[name] = "; ".join(said)
    return out


def expert_layouts(model: torch.nn.Module) -> dict[str, int]:
    """The routed experts' byte layouts, by name (`kernels.w4a16_gemm.EXPERT_LAYOUTS`, with a `repack_dual` copy
    named) -> number of MoE layers (empty for a dequantized model)."""
    from kernels.w4a16_gemm import LAYOUT_NAMES

    from .model.quantized import NVFP4Experts

    out: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, NVFP4Experts):
            dual = (f" + {LAYOUT_NAMES[mod.small_layout]} for <= {mod.small_tokens} tokens" if mod.small_tokens
                    else "")
            regs = " + thread_order for <= 16 pairs an expert" if mod.regs_copy else ""
            name = LAYOUT_NAMES[mod.layout] + dual + regs
            out[name] = out.get(name, 0) + 1
    return out


def resolve_kv_cache_dtype(choice: str, model_cfg, dtype: torch.dtype) -> torch.dtype:
    """The KV pools' dtype for `QwenEngineConfig.kv_cache_dtype` (`choice`) on a model of `model_cfg` whose
    activations are `dtype`."""
    if choice == "model":
        return dtype
    if choice == "fp8":
        return torch.float8_e4m3fn
    declared = model_cfg.kv_cache_quant_algo
    if declared is None:
        return dtype
    if str(declared).upper() == "FP8":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype 'auto': the checkpoint declares kv_cache_quant_algo {declared!r}, which this "
                     f"engine does not implement (FP8 or none); set kv_cache_dtype to 'model' or 'fp8'")


def build_model(checkpoint: str | None, preset: str, device: torch.device, dtype: torch.dtype, seed: int,
                weights: str = "auto", shared_expert_in_moe: bool | str = "auto", expert_layout: str = "auto"):
    """A `QwenForCausalLM` in eval mode on `device`, activations in `dtype`.

    Packed (`qwen_engine/load_packed.py`): the checkpoint's NVFP4 / FP8 layers as packed modules, BF16 elsewhere; with
    no checkpoint, seeded random weights drawn in exactly those formats (`qwen_engine/random_weights.py`).
    Dequantized: every weight dequantised into `dtype`; with no checkpoint, seeded random dense weights (every
    parameter drawn at a scale that keeps activations O(1), as tests/test_qwen_model.py does).
    `shared_expert_in_moe`: packed models stack each shared expert with the routed experts; `expert_layout`: their
    byte layout (both `load_quantized`)."""
    from .config import QwenConfig
    from .model import QwenForCausalLM

    if checkpoint is not None:
        from .checkpoint import load_into, read_config

        model_cfg = read_config(checkpoint)
    else:
        model_cfg = QwenConfig.tiny() if preset == "tiny" else QwenConfig()
    packed = weights == "packed" or (weights == "auto" and (
        model_cfg.quantization_config is not None if checkpoint is not None else preset != "tiny"))
    if checkpoint is None:
        log.warning("NO CHECKPOINT: the Qwen model has RANDOM WEIGHTS (seed %d%s); its outputs are meaningless", seed,
                    ", packed NVFP4/FP8 formats" if packed else "")
    if packed:
        from .load_packed import load_quantized

        if checkpoint is not None:
            return load_quantized(checkpoint, device=device, dtype=dtype, shared_expert_in_moe=shared_expert_in_moe,
                                  expert_layout=expert_layout).eval()
        from .random_weights import random_packed_tensors

        tensors = random_packed_tensors(model_cfg, device, seed, dtype=dtype)
        return load_quantized(tensors, model_cfg, device=device, dtype=dtype,
                              shared_expert_in_moe=shared_expert_in_moe, expert_layout=expert_layout).eval()
    with torch.device("meta"):
        model = QwenForCausalLM(model_cfg)
    model = model.to(dtype).to_empty(device=device).eval()
    if checkpoint is not None:
        load_into(model, checkpoint)
    else:
        randomise(model, seed)
    return model


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights drawn on the parameters' device (a CPU draw of 35B values would take minutes), so the
    values depend on the seed and the device type."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):  # gated norm: plain w (init 1)
            p.normal_(1.0, 0.2, generator=gen)
        elif "norm" in name:  # zero-centred norms: w in (1 + w)
            p.normal_(0.0, 0.3, generator=gen)
        elif name.endswith("A_log"):  # decay rate A = exp(A_log) in (0.05, 3)
            p.copy_(torch.empty(p.shape, device=device).uniform_(0.05, 3.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.normal_(0.0, 0.5, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            p.normal_(0.0, 1.0, generator=gen)
        else:  # linears, stacked experts [E, out, in], conv [C, 1, K], router
            p.normal_(0.0, 1 / math.sqrt(p.shape[-1]), generator=gen)
