"""What notebook 06 says about the committed H200 measurements, one test per statement.

The numbers come from files measured on an NVIDIA H200 and committed under
``tests/benchmark/results/``: ``autotune_h200.json.gz`` (the tuner's cache, with the time of every
candidate config at every benchmark shape, read with ``ops.results.tuning_report``),
``grid_chunk256_h200.csv`` (the forward pass tuned and untuned) and ``first_timing_h200.csv``
(the kernels as first written, against mamba_ssm's Triton kernels). Nothing here needs a GPU:
if a new measurement is committed, these tests say which sentences of the notebook it changes.

Conventions, as in the notebook: a knob's effect at a shape is the best speedup over the default
config among the candidates that change only that knob (and occupancy, which goes with it),
``tuning_report.best_single_knob``; 16K tokens and up (shorter runs are close to the launch
overhead); at 256K tokens x dstate 512 the entry states have 2**31 elements or more, so every
config runs the 64-bit kernel there and that shape is left out of the statements about 64-bit
indexing.
"""
import csv

import pytest

from ops.kernels import compute_out as out_mod
from ops.results import RESULTS, report, tuning_report

LONG = 16384                      # the statements hold from 16K tokens on
ALL_INT64 = (262144, 512)         # the one shape where every config is 64-bit indexed
LAYER = dict(batch=1, nheads=80, headdim=64, ngroups=1, chunk_size=256)   # the benchmark layer


@pytest.fixture(scope="module")
def entries():
    return tuning_report.load(RESULTS / "autotune_h200.json.gz")


def effect(entries, kernel, knob, dstates=None, int32_only=False):
    """The knob's best single-change speedups at the shapes of 16K tokens and up (optionally only
    some dstates, or only the shapes where the 32-bit kernel may run)."""
    by_shape = tuning_report.best_single_knob(entries, kernel, knob)
    values = [v for (seqlen, n), v in by_shape.items()
              if seqlen >= LONG and (dstates is None or n in dstates)
              and not (int32_only and (seqlen, n) == ALL_INT64)]
    assert values, (kernel, knob, dstates)
    return values


def long_entries(entries, kernel):
    return [e for e in entries if e["kernel"] == kernel and e["shape"]["seqlen"] >= LONG]


def candidates(entry):
    """(ms, changes from the default, config) of every candidate timed for ``entry``."""
    return [(ms, tuning_report.changes(cfg, entry["default"]), cfg) for ms, cfg in entry["timings"]]


# Where the numbers come from --------------------------------------------------------------------

def test_measurements_come_from_one_h200(entries):
    assert {e["device"] for e in entries} == {"NVIDIA H200"}
    seqlens = {e["shape"]["seqlen"] for e in entries}
    dstates = {e["shape"]["dstate"] for e in entries}
    assert {16384, 65536, 262144} <= seqlens and dstates == {64, 128, 256, 512}


def test_the_first_kernels_ran_at_0_70_to_0_97_of_tritons_speed():
    with open(RESULTS / "first_timing_h200.csv") as f:
        rows = list(csv.DictReader(f))
    ms = {(r["impl"], int(r["seqlen"]), int(r["dstate"])): float(r["ms"]) for r in rows}
    speed = [ms[("triton", L, n)] / ms[("cutile", L, n)]
             for (impl, L, n) in ms if impl == "cutile"]
    assert {int(r["seqlen"]) for r in rows} == {16384, 65536}
    assert round(min(speed), 2) == 0.70 and round(max(speed), 2) == 0.97


def test_every_config_runs_64_bit_indices_only_at_256k_tokens_dstate_512():
    for L in (16384, 65536, 262144):
        for n in (64, 128, 256, 512):
            shape = dict(LAYER, seqlen=L, dstate=n)
            assert out_mod.needs_int64(**shape) == ((L, n) == ALL_INT64), (L, n)


# 32-bit indexing ---------------------------------------------------------------------------------

def test_64_bit_indexing_makes_compute_out_1_1_to_1_9_times_slower(entries):
    slowdown = [1 / v for v in effect(entries, "compute_out", "INDEX64", int32_only=True)]
    assert 1.1 <= min(slowdown) and max(slowdown) < 1.9


def test_64_bit_indexing_makes_fwd_pass_state_1_1_to_1_25_times_slower(entries):
    slowdown = [1 / v for v in effect(entries, "fwd_pass_state", "INDEX64", int32_only=True)]
    assert 1.1 <= min(slowdown) and max(slowdown) < 1.25


# compute_out: heads per block, C B^T from memory, occupancy, the rest -----------------------------

def test_two_heads_per_block_win_for_compute_out_at_every_shape(entries):
    gains = effect(entries, "compute_out", "HEADS_PER_BLOCK")
    assert min(gains) > 1.0 and max(gains) < 1.25


def test_four_heads_per_block_lose_badly(entries):
    for e in long_entries(entries, "compute_out"):
        four = [e["default_ms"] / ms for ms, _, cfg in candidates(e) if cfg["HEADS_PER_BLOCK"] == 4]
        assert four and max(four) < 0.6, e["shape"]


def test_scores_in_memory_give_1_4_to_2_5x_at_dstate_256_and_512(entries):
    gains = effect(entries, "compute_out", "SCORES_IN_MEMORY", dstates=(256, 512))
    assert min(gains) > 1.4 and max(gains) < 2.5


def test_scores_in_memory_cost_4_to_7_percent_at_dstate_64_and_128(entries):
    gains = effect(entries, "compute_out", "SCORES_IN_MEMORY", dstates=(64, 128))
    assert 0.925 < min(gains) and max(gains) < 0.965


def test_occupancy_3_is_best_at_dstate_128_4_is_1_1x_faster_at_64_others_cost_at_256(entries):
    assert max(effect(entries, "compute_out", "occupancy", dstates=(128,))) <= 1.0
    assert min(effect(entries, "compute_out", "occupancy", dstates=(64,))) > 1.05
    for e in long_entries(entries, "compute_out"):
        if e["shape"]["dstate"] == 64:           # ... and the best occupancy there is 4
            best = min((ms, cfg["occupancy"]) for ms, d, cfg in candidates(e)
                       if set(d) == {"occupancy"})
            assert best[1] == 4, e["shape"]
    assert max(effect(entries, "compute_out", "occupancy", dstates=(256,))) < 0.95


def test_the_latency_hint_moves_compute_out_by_at_most_2_percent(entries):
    gains = effect(entries, "compute_out", "LOAD_LAT")
    assert 0.98 <= min(gains) and max(gains) <= 1.02


def test_operand_order_alone_never_helps_on_hopper(entries):
    for kernel in ("compute_out", "fwd_pass_state"):
        gains = effect(entries, kernel, "SWAP")
        assert min(gains) > 0.55 and max(gains) < 0.98, kernel


def test_persistent_blocks_alone_gain_at_most_2_percent(entries):
    assert max(effect(entries, "compute_out", "PERSISTENT")) < 1.03


def test_eight_worker_warps_alone_never_help(entries):
    assert max(effect(entries, "compute_out", "num_worker_warps")) < 1.0


def test_persistent_blocks_with_two_heads_are_the_pick_at_three_shapes(entries):
    """... 4-6% ahead of two heads per block alone: the knobs interact."""
    picks = 0
    for e in long_entries(entries, "compute_out"):
        if e["config"]["PERSISTENT"]:
            assert e["config"]["HEADS_PER_BLOCK"] == 2, e["shape"]
            two_heads = min(ms for ms, d, _ in candidates(e)
                            if set(d) == {"HEADS_PER_BLOCK", "occupancy"}
                            and d["HEADS_PER_BLOCK"] == 2)
            assert 1.04 < two_heads / e["ms"] < 1.065, e["shape"]
            picks += 1
    assert picks == 3


def test_best_and_worst_compute_out_configs_differ_9_to_14_times_at_64k(entries):
    spread = []
    for n in (64, 128, 256, 512):
        ms = [t for t, _ in tuning_report.find(entries, "compute_out", 65536, n)["timings"]]
        spread.append(max(ms) / min(ms))
    assert 8.5 < min(spread) and max(spread) < 14.5


# fwd_pass_state: the latency hint, smaller state tiles, two chunks per iteration -----------------

def test_the_latency_hint_gives_fwd_pass_state_1_3_to_1_4x_from_dstate_128(entries):
    gains = effect(entries, "fwd_pass_state", "LOAD_LAT", dstates=(128, 256, 512), int32_only=True)
    assert min(gains) > 1.3 and max(gains) < 1.45
    assert max(effect(entries, "fwd_pass_state", "LOAD_LAT", dstates=(64,))) < 1.02


def test_smaller_state_tiles_give_fwd_pass_state_up_to_1_7x(entries):
    gains = effect(entries, "fwd_pass_state", "BLOCK_N")
    assert 1.6 < max(gains) < 1.75


def test_tiles_and_latency_hint_together_are_the_pick_and_add_up_to_5_percent(entries):
    """At every dstate from 128 up, except the 64-bit shape: BLOCK_N=64 with LOAD_LAT=8 at two
    blocks per multiprocessor is the tuner's pick, at most ~5% ahead of the better of the two alone;
    the occupancy that puts every block in one wave (3 or 4) is slower."""
    checked = 0
    for e in long_entries(entries, "fwd_pass_state"):
        if e["shape"]["dstate"] < 128 or (e["shape"]["seqlen"], e["shape"]["dstate"]) == ALL_INT64:
            continue
        timed = candidates(e)
        both = min(ms for ms, d, _ in timed
                   if d.get("LOAD_LAT") == 8 and d.get("occupancy") == 2 and "BLOCK_N" in d)
        alone = min(ms for ms, d, _ in timed
                    if d in ({"LOAD_LAT": 8}, {"BLOCK_N": 64, "occupancy": 2}))
        one_wave = min(ms for ms, d, _ in timed if (d.get("occupancy") or 0) > 2)
        # the pick's time is stored rounded, the candidates' not
        assert abs(e["ms"] / both - 1) < 1e-3, e["shape"]
        assert both <= alone < 1.06 * both and one_wave > both, e["shape"]
        checked += 1
    assert checked == 8


def test_two_chunks_per_iteration_are_never_the_pick(entries):
    """Against the same config with one chunk per iteration it ranges from 0.5x to 1.25x, but
    some other config is always faster."""
    ratios = []
    for e in long_entries(entries, "fwd_pass_state"):
        assert e["config"]["CHUNKS_PER_ITER"] == 1, e["shape"]
        by_config = {tuple(sorted(cfg.items())): ms for ms, cfg in e["timings"]}
        for ms, _, cfg in candidates(e):
            if cfg["CHUNKS_PER_ITER"] == 2:
                one = by_config.get(tuple(sorted({**cfg, "CHUNKS_PER_ITER": 1}.items())))
                if one is not None:
                    ratios.append(one / ms)
    assert 0.45 < min(ratios) < 0.55 and 1.2 < max(ratios) < 1.25


# The whole forward pass -------------------------------------------------------------------------

def test_tuned_forward_pass_beats_the_defaults_at_every_shape_from_16k():
    rows = report.load(RESULTS / "grid_chunk256_h200.csv")
    ms = {(r["impl"], r["seqlen"], r["dstate"]): r["ms"] for r in rows if report.is_ok(r)}
    speedups = [ms[("cutile_default", L, n)] / ms[("cutile", L, n)]
                for L in (16384, 65536, 262144) for n in (64, 128, 256, 512)]
    assert min(speedups) > 1.05 and 2.0 < max(speedups) < 2.2


def test_below_16k_a_pass_takes_0_1_to_0_5_ms_and_tuning_wins_or_loses_from_run_to_run():
    """Below 16K tokens whether the tuned configs beat the defaults changes from run to run: the
    grid run against the rerun of the short sequences on an otherwise idle H200."""
    faster = []
    for name in ("grid_chunk256_h200.csv", "grid_1k_4k_rerun_h200.csv"):
        rows = [r for r in report.load(RESULTS / name) if report.is_ok(r) and r["seqlen"] < LONG
                and r["chunk"] == 256 and r["impl"] in ("cutile", "cutile_default")]
        ms = {(r["impl"], r["seqlen"], r["dstate"]): r["ms"] for r in rows}
        assert 0.1 < min(ms.values()) and max(ms.values()) < 0.55, name
        faster.append({(L, n): ms[("cutile", L, n)] < ms[("cutile_default", L, n)]
                       for impl, L, n in ms if impl == "cutile"})
    grid, rerun = faster
    assert len(grid) == 8 and grid.keys() == rerun.keys()
    assert any(grid[k] != rerun[k] for k in grid)
