#!/usr/bin/env bash
# The H200 benchmark: this project's cuTile forward against mamba_ssm's Triton kernels and TileGym.
#
#   tests/benchmark/run_h200.sh              # both parts, in order: grid, then chunks
#   tests/benchmark/run_h200.sh grid         # only the grid at chunk 256
#   tests/benchmark/run_h200.sh chunks       # only the chunk sweep
#   tests/benchmark/run_h200.sh warm grid    # compile everything first (in parallel), then the grid
#   tests/benchmark/run_h200.sh profile      # ncu profiles (profile_ncu.sh) with the tuned configs
#
# Parts (80 heads x headdim 64, 1 group, bf16, batch 1; L 1K..256K; dstate 64..512):
#   warm    warm_compile.py: every search-space config of this project's kernels (called at
#           WARM_CHUNKS, default 256, compiled at the chunk the forward computes with there, and
#           WARM_SEQLENS, default 1024,4096,16384,262144) and, when tilegym is among IMPLS,
#           TileGym's configs, compiled by WARM_PROCS processes into cuTile's disk cache, so the
#           timed parts tune without compiling; with the chunks part too, a second pass for the
#           sweep's SWEEP_CHUNKS, each computed as given
#                                                             -> $OUT/warm.log
#   profile profile_ncu.sh at PROFILE_SHAPES (default 64K:256 256K:128), cutile and triton
#                                                             -> $OUT/ncu_*.csv
#   grid    triton, cutile, tilegym at the caller's chunk 256 (this project's forward may compute
#           at another: ops/tuning/compute_chunk.py; the CSV's compute_chunk column says which)
#                                                             -> $OUT/grid_chunk256.csv (+ .log .png .md)
#   chunks  the same at chunks 64, 128 and 256, each computed at exactly that chunk
#           (MAMBA2_CUTILE_COMPUTE_CHUNK=caller); the grid part's chunk-256 rows computed at 256
#           are taken over, so only the rest run; each implementation's best chunk is marked
#                                                             -> $OUT/grid_chunks.csv (+ .log .png .md)
#
# Every part is bounded by `timeout` (GRID_LIMIT, CHUNKS_LIMIT seconds; by default the two together
# fit in 10 minutes) and resumable: the CSVs live in $BENCH_WORK, every finished point is written at
# once, and running the script again on the same machine continues where it stopped (a part that
# ran out of time says "incomplete"). Outputs for the rel_err comparison are kept there too.
#
# Estimated times on one H200 (measured at commit 07f7ca2; worker start-up, i.e. importing torch
# and the kernels and initialising CUDA, is ~10 s per worker; a timed point is ~1 s once tuned):
#   warm     30 processes compile the 295 chunk-256 variants of 4K-256K (WARM_SEQLENS=16384) in
#            ~75 s; 1K specializes differently (add 1024). Without it, tuning one cutile point
#            compiles up to ~80 configs one at a time: 80-190 s per point instead of 1-17 s.
#            Since the forward computes at 128 for half the grid's points (ops/tuning/compute_chunk.py),
#            the search needs variants at 128 and 256: at commit ac1da97, warming both chunks for
#            1K and 16K was 1364 variants, which 16 processes had not finished in 190 s; the 1K x
#            128 point then ran past its 300 s TASK_TIMEOUT while tuning. warm_compile.py now
#            compiles each (length, dstate) only at the chunk it computes at, once per
#            specialization and index width: 928 variants for the grid's lengths. Still give the
#            warm part a 10-minute run of its own on the machine the grid then runs on, or time
#            the committed table instead (MAMBA2_CUTILE_AUTOTUNE=table: the whole grid in ~80 s).
#   grid (60 points without TileGym)
#     triton   ~1 min: Triton autotunes once per (chunk, dstate) key, 10-30 s each, 4 keys;
#              with TRITON_CACHE_AUTOTUNING=1 (set below) a restarted worker reuses the results
#     cutile   ~2.5 min after warm: autotunes once per power-of-two L bucket and dstate (20 here),
#              cached on disk in $MAMBA2_CUTILE_AUTOTUNE_CACHE, so a second run tunes nothing
#     tilegym  not yet measured: cuda.tile.tune.exhaustive_search over ~115 configs per shape
#              (20 shapes), in memory only; warm its configs first (IMPLS including tilegym)
#   chunks (120 new points): several times the grid; SWEEP_SEQLENS=16K,256K (say) cuts it to 2/5
#   Several GPUs: GPUS=0,1 shares each part's lengths out over them (256K on one, 1K-64K on the
#   other takes about as long); every point's implementations still run side by side on one GPU.
# Without autotuning (MAMBA2_CUTILE_AUTOTUNE=0, TILEGYM_DISABLE_AUTOTUNE=1) each part is ~2-4 min,
# but then the implementations are not at their best; the CSVs record these variables.
#
# Environment: OUT (default ./bench_out), BENCH_WORK (default .cache/bench, ignored by git), GPUS,
# IMPLS, SEQLENS, DSTATES, SWEEP_SEQLENS, SWEEP_CHUNKS, GRID_LIMIT, CHUNKS_LIMIT, TASK_TIMEOUT, and
# EXTRA_ARGS (more bench_forward.py options, e.g. "--device cpu --nheads 2 ..." for a dry run).
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$PWD/bench_out}
WORK=${BENCH_WORK:-$PWD/.cache/bench}
IMPLS=${IMPLS:-triton,cutile,tilegym}
# "cutile" is the autotuned forward: every shape is searched (the library's default path would
# read the committed table instead; ops/tuning/autotune.py).
export MAMBA2_CUTILE_AUTOTUNE=${MAMBA2_CUTILE_AUTOTUNE:-1}
SEQLENS=${SEQLENS:-1K,4K,16K,64K,256K}
DSTATES=${DSTATES:-64,128,256,512}
SWEEP_SEQLENS=${SWEEP_SEQLENS:-$SEQLENS}
SWEEP_CHUNKS=${SWEEP_CHUNKS:-64,128,256}
TASK_TIMEOUT=${TASK_TIMEOUT:-300}       # one point, its autotuning included; longer: recorded as crashed
EXTRA_ARGS=${EXTRA_ARGS:-}
PARTS=${*:-grid chunks}
if [ "$PARTS" = "grid chunks" ]; then
    GRID_LIMIT=${GRID_LIMIT:-320}; CHUNKS_LIMIT=${CHUNKS_LIMIT:-200}
else
    GRID_LIMIT=${GRID_LIMIT:-540}; CHUNKS_LIMIT=${CHUNKS_LIMIT:-540}
fi
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
export MAMBA2_CUTILE_AUTOTUNE_CACHE=${MAMBA2_CUTILE_AUTOTUNE_CACHE:-$WORK/cutile_autotune.json}
mkdir -p "$OUT" "$WORK/slices"

START=$(date +%s)
elapsed() { echo "$(( $(date +%s) - $1 )) s"; }

# bench NAME LIMIT_S DIR LOG BENCH_ARGS...: bench_forward.py under timeout, its rows in DIR/NAME.csv
bench() {
    local name=$1 limit=$2 dir=$3 log=$4; shift 4
    mkdir -p "$dir/slices"
    timeout -k 15 "$limit" python -m tests.benchmark.bench_forward "$@" \
        --csv "$dir/$name.csv" --resume --slices "$dir/slices" --task-timeout "$TASK_TIMEOUT" $EXTRA_ARGS \
        2>&1 | tee -a "$log"
    return "${PIPESTATUS[0]}"
}

# part NAME LIMIT_S SEQLENS BENCH_ARGS...: the points at SEQLENS, on one GPU, or with GPUS=0,1,... the
# lengths shared out over those GPUs (merge_results.py --share), one run each at the same time, each in
# its own folder under $WORK (seeded with the rows there already), then merged; copies the CSV, plot
# and tables to $OUT. The tuner's cache file is shared: it merges what each process writes.
part() {
    local name=$1 limit=$2 seqlens=$3; shift 3
    local t0 rc=0; t0=$(date +%s)
    echo "=== $name: up to ${limit} s (started at $(elapsed "$START") into the script)"
    if [ -z "${GPUS:-}" ]; then
        bench "$name" "$limit" "$WORK" "$OUT/$name.log" --seqlens "$seqlens" "$@" || rc=$?
    else
        local gpu lens pids=() dirs=()
        while read -r gpu lens; do
            local dir="$WORK/gpu$gpu"
            mkdir -p "$dir"
            [ -f "$dir/$name.csv" ] || [ ! -f "$WORK/$name.csv" ] || cp "$WORK/$name.csv" "$dir/$name.csv"
            echo "  GPU $gpu: L = $lens (log: $OUT/$name.gpu$gpu.log)"
            CUDA_VISIBLE_DEVICES=$gpu bench "$name" "$limit" "$dir" "$OUT/$name.gpu$gpu.log" \
                --seqlens "$lens" "$@" > /dev/null &
            pids+=("$!"); dirs+=("$dir/$name.csv")
        done < <(python -m tests.benchmark.merge_results --share "$seqlens" "$GPUS")
        for p in "${pids[@]}"; do wait "$p" || rc=$?; done
        local have=(); for f in "${dirs[@]}"; do [ -f "$f" ] && have+=("$f"); done
        [ "${#have[@]}" -gt 0 ] && python -m tests.benchmark.merge_results "$WORK/$name.csv" "${have[@]}"
        cat "$OUT/$name".gpu*.log >> "$OUT/$name.log" 2>/dev/null || true
    fi
    if [ -f "$WORK/$name.csv" ]; then
        cp "$WORK/$name.csv" "$OUT/"
        python -m ops.results.plot "$OUT/$name.csv" --out "$OUT/$name.png" || true
        python -m ops.results.plot "$OUT/$name.csv" --markdown --summary > "$OUT/$name.md" || true
        cat "$OUT/$name.md"
    fi
    [ -f "$MAMBA2_CUTILE_AUTOTUNE_CACHE" ] && cp "$MAMBA2_CUTILE_AUTOTUNE_CACHE" "$OUT/" || true
    if [ "$rc" -eq 0 ]; then
        echo "=== $name: complete in $(elapsed "$t0")"
    else
        echo "=== $name: incomplete after $(elapsed "$t0") (exit $rc): run the same command again to continue"
    fi
}

for p in $PARTS; do
    case $p in
        warm)
            tg=""; case ",$IMPLS," in *,tilegym,*) tg="--tilegym" ;; esac
            warm_chunks() {     # warm_chunks CHUNKS: compile for calls at CHUNKS
                timeout -k 10 "${WARM_LIMIT:-240}" python -m tests.benchmark.warm_compile \
                    --procs "${WARM_PROCS:-15}" --dstates "$DSTATES" --chunks "$1" \
                    --seqlens "${WARM_SEQLENS:-1024,4096,16384,262144}" $tg 2>&1 \
                    | tee -a "$OUT/warm.log" | tail -8
            }
            echo "=== warm: up to ${WARM_LIMIT:-240} s"
            warm_chunks "${WARM_CHUNKS:-256}"
            case " $PARTS " in *" chunks "*)
                # the sweep computes every chunk as given, where the grid's calls may not
                echo "=== warm for the chunk sweep: up to ${WARM_LIMIT:-240} s"
                MAMBA2_CUTILE_COMPUTE_CHUNK=caller warm_chunks "$SWEEP_CHUNKS" ;;
            esac
            ;;
        profile)
            SHAPES=${PROFILE_SHAPES:-"64K:256 256K:128"} OUT="$OUT" tests/benchmark/profile_ncu.sh ;;
        grid)
            part grid_chunk256 "$GRID_LIMIT" "$SEQLENS" --impls "$IMPLS" --dstates "$DSTATES" --chunks 256 ;;
        chunks)
            # start from the grid part's rows computed at their own chunk (when there are some),
            # then add the others, every chunk computed as given
            if [ ! -f "$WORK/grid_chunks.csv" ] && [ -f "$WORK/grid_chunk256.csv" ]; then
                python - "$WORK/grid_chunk256.csv" "$WORK/grid_chunks.csv" <<'EOF'
import csv, sys
with open(sys.argv[1], newline="") as f:
    reader = csv.DictReader(f)
    rows = [r for r in reader if r.get("compute_chunk") in (None, "", r["chunk"])]
    fields = reader.fieldnames
with open(sys.argv[2], "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
EOF
            fi
            MAMBA2_CUTILE_COMPUTE_CHUNK=caller part grid_chunks "$CHUNKS_LIMIT" "$SWEEP_SEQLENS" \
                --impls "$IMPLS" --dstates "$DSTATES" --chunks "$SWEEP_CHUNKS" ;;
        *)
            echo "unknown part '$p' (parts: warm, grid, chunks, profile)"; exit 2 ;;
    esac
done
echo "=== all done in $(elapsed "$START"); results in $OUT"
