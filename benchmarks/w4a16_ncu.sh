#!/usr/bin/env bash
# Nsight Compute on the grouped W4A16 kernel at 32 decode tokens (issue 5): why it reads expert weights at ~0.9 TB/s
# of the H200's 4.8 (benchmarks/RESULTS.md, "The grouped W4A16 kernel"). Written 2026-11-30 after the last GPU call:
# NOT RUN YET. ncu reads hardware counters only on the Firecracker machines (/work/.library/device/KINDS.md); the
# first command checks that and stops with a note otherwise. Clocks are left alone (--clock-control none, METHOD.md).
#
#   eval "$(bash .devbundle/install.sh)" && bash benchmarks/w4a16_ncu.sh        # ~4 min; $OUT/ncu.tgz
#
# Sections: speed of light (DRAM / SM throughput), memory workload (sectors per request, L2 hit rate), warp state
# (what the warps wait on: long scoreboard = global loads, barrier, ...), occupancy, launch stats (registers, smem).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/out/ncu}
R=$(mktemp -d /tmp/ncu.XXXXXX)
mkdir -p "$OUT"
trap 'tar czf "$OUT/ncu.tgz" -C "$R" .' EXIT
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then echo "w4a16_ncu: no ncu on this machine" | tee "$R/skipped.txt"; exit 0; fi
"$NCU" --version > "$R/ncu_version.txt" 2>&1
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
--section LaunchStats --section SchedulerStats"
# the bench's launch order at 32 tokens with one tile and --once: gate_up 4 launches (one checked call, three
# untimed), then down 4: skip 2 / 6 to profile each projection's last two
for mode in "0:0" "2:1" "2:1:1"; do  # before; the engine's gate_up mode; the same on tile-major weights
  for case in "gate_up 2" "down 6"; do
    set -- $case
    tag="${mode//:/_}_$1"
    timeout 240 "$NCU" --clock-control none --kernel-name regex:_w4a16_grouped --launch-skip "$2" --launch-count 2 \
      $SECTIONS --csv --page details \
      python benchmarks/w4a16_bench.py --skip-dense --once --tokens 32 --tiles "32,128,4,4" --modes "$mode" \
      --out "$R/run_$tag" > "$R/ncu_$tag.csv" 2> "$R/ncu_$tag.err"
    echo "mode $mode $1: ncu exit $?, $(wc -l < "$R/ncu_$tag.csv") csv lines"
    if grep -q "LibraryNotLoaded\|ERR_NVGPUCTRPERM\|Failed to initialize" "$R/ncu_$tag.err"; then
      echo "w4a16_ncu: ncu cannot read the counters here (see ncu_$tag.err)" | tee "$R/skipped.txt"; exit 0
    fi
  done
done
