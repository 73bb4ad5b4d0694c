#!/usr/bin/env bash
# Hardware-counter profiles (Nsight Compute) of the forward pass: this project's kernels and
# mamba_ssm's Triton kernels at the same shapes, one warm call each (tests/benchmark/profile_forward.py).
# PASS=fwd_bwd profiles one training step instead (forward and backward, tests/benchmark/profile_fwd_bwd.py
# --ncu), at SHAPES given as batch x seqlen x nheads x ngroups : dstate, TileGym possible among IMPLS.
#
#   tests/benchmark/profile_ncu.sh                      # the default shapes below, reports in $OUT
#   SHAPES="64K:256 256K:128" IMPLS=cutile tests/benchmark/profile_ncu.sh
#   PASS=fwd_bwd SHAPES="8x2048x80x1:128 1x65536x80x1:256" IMPLS="cutile triton" CHUNK=128 \
#       tests/benchmark/profile_ncu.sh
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
PASS=${PASS:-forward}
NCU=${NCU:-ncu}
mkdir -p "$OUT"
for shape in $SHAPES; do
    L=${shape%%:*}; n=${shape##*:}
    for impl in $IMPLS; do
        if [ "$PASS" = fwd_bwd ]; then
            chunk=${CHUNK:-128}; [ "$impl" = triton ] && chunk=256; [ "$impl" = tilegym ] && chunk=${TILEGYM_CHUNK:-64}
            run=(python -m tests.benchmark.profile_fwd_bwd --ncu --impl "$impl" --shape "$L"
                 --dstate "$n" --chunks "$chunk")
            tag="fwdbwd_$L"
            select=(--profile-from-start off)
        else
            run=(python -m tests.benchmark.profile_forward --impl "$impl" --seqlen "$L" --dstate "$n" --reps 1)
            tag=$L
            select=(--nvtx --nvtx-include "profile/")
        fi
        csv="$OUT/ncu_${impl}_${tag}_${n}.csv"
        echo "=== $impl $tag dstate=$n -> $csv"
        rep="${NCU_REPORTS:-/tmp/ncu_reports}/ncu_${impl}_${tag}_${n}"
        mkdir -p "$(dirname "$rep")"
        "$NCU" --clock-control none "${select[@]}" -f -o "$rep" \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            --section MemoryWorkloadAnalysis \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
            "${run[@]}" > "$OUT/ncu_${impl}_${tag}_${n}.log" 2>&1 || { echo "  ncu failed: see the .log"; tail -5 "$OUT/ncu_${impl}_${tag}_${n}.log"; continue; }
        "$NCU" --import "$rep.ncu-rep" --csv --page raw > "$csv" || { echo "  import failed"; continue; }
        python -m ops.results.ncu_summary "$csv" || true
    done
done
