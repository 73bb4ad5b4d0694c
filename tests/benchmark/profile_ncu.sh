#!/usr/bin/env bash
# Hardware-counter profiles (Nsight Compute) of the forward pass: this project's kernels and
# mamba_ssm's Triton kernels at the same shapes, one warm call each (tests/benchmark/profile_forward.py).
#
#   tests/benchmark/profile_ncu.sh                      # the default shapes below, reports in $OUT
#   SHAPES="64K:256 256K:128" IMPLS=cutile tests/benchmark/profile_ncu.sh
#
# For each implementation and shape: $OUT/ncu_<impl>_<L>_<dstate>.csv (ncu's raw page: one row per
# kernel, one column per metric: duration, compute and memory throughput against peak, achieved
# occupancy, registers, the warp stall reasons), the run's log beside it, the full report under
# $NCU_REPORTS (default /tmp/ncu_reports), and a few lines per kernel on stdout (ncu_summary.py). The clocks are left as they
# are (--clock-control none), so durations match the benchmark's timings. Set MAMBA2_CUTILE_AUTOTUNE_CACHE
# to the benchmark's cache so that the profiled cutile kernels are the tuned ones.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/bench_out}
SHAPES=${SHAPES:-"64K:256 256K:128"}
IMPLS=${IMPLS:-"cutile triton"}
NCU=${NCU:-ncu}
mkdir -p "$OUT"
for shape in $SHAPES; do
    L=${shape%%:*}; n=${shape##*:}
    for impl in $IMPLS; do
        csv="$OUT/ncu_${impl}_${L}_${n}.csv"
        echo "=== $impl L=$L dstate=$n -> $csv"
        rep="${NCU_REPORTS:-/tmp/ncu_reports}/ncu_${impl}_${L}_${n}"
        mkdir -p "$(dirname "$rep")"
        "$NCU" --clock-control none --nvtx --nvtx-include "profile/" -f -o "$rep" \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            --section MemoryWorkloadAnalysis \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
            python -m tests.benchmark.profile_forward --impl "$impl" --seqlen "$L" --dstate "$n" --reps 1 \
            > "$OUT/ncu_${impl}_${L}_${n}.log" 2>&1 || { echo "  ncu failed: see the .log"; tail -5 "$OUT/ncu_${impl}_${L}_${n}.log"; continue; }
        "$NCU" --import "$rep.ncu-rep" --csv --page raw > "$csv" || { echo "  import failed"; continue; }
        python -m ops.results.ncu_summary "$csv" || true
    done
done
