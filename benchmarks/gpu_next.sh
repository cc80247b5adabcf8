#!/usr/bin/env bash
# The runs the 2026-11-30 session could not make (its device time ran out), as one device call (< 10 min):
#   1. CUDA tests of the fixes made after the last GPU run (FP8 quantiser reference division, graphs capture) and
#      the nvJPEG divergence printout;
#   2. the Qwen full-size oracle with the kernel bisection (fast kernels vs reference kernels vs transformers);
#   3. HTTP end to end with the real model through direct ingress (serve_configs/local_gpu.yaml: inductor + graphs);
#   4. the null-model ceiling through HAProxy.
# Everything lands in one archive, $OUT/next.tgz (the device tool returns at most 8 files).
#
#   eval "$(bash .devbundle/install.sh)" && STEPS="1 2" bash benchmarks/gpu_next.sh     # ~5 min
#   eval "$(bash .devbundle/install.sh)" && STEPS="3 4" bash benchmarks/gpu_next.sh     # ~7 min (inductor start)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
R=$(mktemp -d /tmp/next.XXXXXX)
OUT=${OUT:-$PWD/out/next}
mkdir -p "$OUT"
say() { echo "[gpu_next $(date +%T)] $*"; }
archive() { tar czf "$OUT/next.tgz" -C "$R" . ; }
trap archive EXIT
STEPS=${STEPS:-"1 2 3 4"}
want() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if want 1; then
say "1. CUDA tests"
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_kernel_fp8.py tests/test_fp8_vit.py > "$R/cuda_tests.log" 2>&1
timeout 60 python -m pytest -q -s -p no:cacheprovider tests/test_graphs.py tests/test_decode.py -k "cuda and not default" \
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
CONFIG=serve_configs/local_gpu.yaml NULL=0 VARIANTS="direct1" USERS=64 STEP_S=30 WARMUP_S=10 PROCS=6 OUT="$R/http" \
  timeout 330 bash benchmarks/serve_ceiling.sh > "$R/http.log" 2>&1
grep -E "ceiling|ready" "$R/http.log" | tail -3
fi

if want 4; then
say "4. null-model ceiling through HAProxy"
VARIANTS="haproxy1" USERS=128 STEP_S=20 WARMUP_S=3 PROCS=8 OUT="$R/haproxy" \
  timeout 120 bash benchmarks/serve_ceiling.sh > "$R/haproxy.log" 2>&1
grep -E "ceiling|skipped" "$R/haproxy.log" | tail -2
fi
say "done"
