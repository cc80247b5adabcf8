#!/usr/bin/env bash
# One device call for issue 4: the CUDA tests of the new fast paths, then the waterfall (benchmarks/waterfall.py).
# Everything lands in one archive, $OUT/issue4.tgz (the device tool returns at most 8 files).
#
#   eval "$(bash .devbundle/install.sh)" && bash benchmarks/gpu_issue4.sh      # BUDGET (s) caps the waterfall
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
R=$(mktemp -d /tmp/issue4.XXXXXX)
OUT=${OUT:-$PWD/out/issue4}
mkdir -p "$OUT"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
python -c "import torch, triton, sam3, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  > "$R/versions.txt" 2>&1
# CUDA tests of the new paths (the inductor variant of the graphs test is left to the waterfall's inductor rows)
timeout "${TEST_TIMEOUT:-150}" python -m pytest -q -p no:cacheprovider tests/test_kernel_fp8.py tests/test_fp8_vit.py \
  tests/test_engine_fastpath.py > "$R/cuda_tests.log" 2>&1
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_graphs.py -k "cuda and not default" >> "$R/cuda_tests.log" 2>&1
echo "cuda tests rc=$?" >> "$R/cuda_tests.log"
tail -3 "$R/cuda_tests.log"
python benchmarks/waterfall.py --out "$R/waterfall" --budget-s "${BUDGET:-420}" > "$R/waterfall.log" 2>&1
echo "waterfall rc=$?"
tail -40 "$R/waterfall.log"
tar czf "$OUT/issue4.tgz" -C "$R" .
