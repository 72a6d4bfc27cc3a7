"""benchmarks/serving/run.py and targets.py: on a fast hour, where a's p50 stays under 3x its unloaded TTFT at
every rate, a and b run once more at 1.5 times the highest rate (at most twice), and the b-vs-a target is judged
at the first rate where a is loaded 3x; the runs' percentiles by nearest rank, and the bootstrap interval of the
difference of two runs' p50s printed beside "f beats e"."""

from typing import Any

import numpy as np

from benchmarks.serving.run import top_up_rate
from benchmarks.serving.targets import BENCH, check_targets, p50_difference_interval, percentile


def run(config: str, rate: float, p50: float, mean: float = 0.0, cached: float = 0.1) -> dict[str, Any]:
    return {
        "config": config, "client": BENCH, "rate": rate, "unloaded": rate == 0, "label": f"{config}-{rate:g}",
        "ttft_p50_ms": p50, "ttft_mean_ms": mean or p50, "failed": 0, "kvpool_pages_used_after": 0,
        "server": {"cached_fraction": cached}, "replays": 1, "replays_identical": 1,
    }  # fmt: skip


def test_a_never_loaded_3x_asks_for_one_and_a_half_times_the_highest_rate() -> None:
    runs = [run("a", 0, 200), run("a", 2, 300), run("b", 2, 60), run("a", 4, 590), run("b", 4, 100)]
    assert top_up_rate(runs) == 6
    runs.append(run("a", 6, 550))  # still short of 3x: the next step (the phase makes two at most)
    assert top_up_rate(runs) == 9
    runs.append(run("a", 9, 650))
    assert top_up_rate(runs) is None


def test_a_loaded_3x_at_some_rate_or_not_run_asks_for_nothing() -> None:
    assert top_up_rate([run("a", 0, 200), run("a", 2, 300), run("a", 4, 600)]) is None  # 3x at 4 req/s
    assert top_up_rate([run("a", 0, 200)]) is None
    assert top_up_rate([run("b", 2, 60), run("b", 4, 100)]) is None


def test_b_vs_a_is_judged_at_the_first_rate_where_a_is_loaded_3x() -> None:
    runs = [run("a", 0, 200), run("a", 2, 300, cached=0.12), run("b", 2, 60, cached=0.7)]
    runs += [run("a", 4, 590, 700, 0.12), run("b", 4, 100, 200, 0.7)]
    lines = "\n".join(check_targets(runs)["lines"])
    assert "judged at 4 req/s" in lines and "never 3x" in lines and "MISS  b vs a mean TTFT lowered 3.50x" in lines
    runs += [run("a", 6, 1200, 1500, 0.12), run("b", 6, 300, 400, 0.7)]  # the top-up
    runs += [run("a", 9, 3000, 3500, 0.12), run("b", 9, 2000, 2100, 0.7)]  # (judged at the first: 6 req/s)
    targets = check_targets(runs)
    assert "judged at 6 req/s, where a's p50 is 1200.0 ms (6.0x unloaded)" in "\n".join(targets["lines"])
    assert targets["checks"]["b_ttft"] and targets["checks"]["b_cached"]


def test_percentiles_are_by_nearest_rank() -> None:
    values = [float(v) for v in np.random.default_rng(3).permutation(64) + 1]  # 1..64, shuffled
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99)) == (33.0, 58.0, 63.0)
    assert percentile([float(v) for v in range(1, 51)], 50) == 25.0  # round(24.5) is 24: the lower middle
    assert np.isnan(percentile([], 50))


def test_the_interval_of_two_p50s_difference_covers_it_and_is_repeatable() -> None:
    rng = np.random.default_rng(7)
    fast, slow = list(rng.normal(100, 10, 64)), list(rng.normal(200, 10, 64))
    low, high = p50_difference_interval(fast, slow)
    assert -125 < low < -100 < high < -75
    assert p50_difference_interval(fast, slow) == (low, high)  # a fixed seed
    # Two samples of one mixture of hits and misses whose p50 falls between the groups: the interval spans both.
    mixture = list(rng.permutation(np.r_[rng.normal(50, 5, 40), rng.normal(300, 30, 24)]))
    other = list(rng.permutation(np.r_[rng.normal(50, 5, 40), rng.normal(300, 30, 24)]))
    low, high = p50_difference_interval(mixture, other)
    assert low < 0 < high


def test_f_against_e_prints_the_interval_where_the_runs_have_their_requests() -> None:
    rng = np.random.default_rng(11)
    e, f = run("e", 2, 120), run("f", 2, 80)
    assert "(ms: 80 vs 120)" in "\n".join(check_targets([e, f])["lines"])  # runs recorded before session 22
    e["ttft_ms"], f["ttft_ms"] = list(rng.normal(120, 5, 64)), list(rng.normal(80, 5, 64))
    line = next(x for x in check_targets([e, f])["lines"] if "f beats e" in x)
    low, high = p50_difference_interval(f["ttft_ms"], e["ttft_ms"])
    assert line.startswith("PASS") and f"80 vs 120 [{low:+.0f}..{high:+.0f}]; in brackets f - e" in line
