"""Issue 23's targets, judged on one run's results (ratios within the run), printed with PASS/MISS."""

from typing import Any

import numpy as np

BENCH = "vllm bench serve"
# Resamples of the bootstrap interval printed beside "f beats e on p50 TTFT": with 64 or 50 requests a run, the
# p50 sits where hits and misses meet, and the interval says how far a few requests could move the difference.
INTERVAL_RESAMPLES = 2000


def _runs(runs: list[dict[str, Any]], config: str, client: str = BENCH) -> list[dict[str, Any]]:
    return sorted(
        (r for r in runs if r["config"] == config and r["client"] == client and not r["unloaded"]),
        key=lambda r: r["rate"],
    )


def _cached(runs: list[dict[str, Any]]) -> float:
    prompt = sum(r["server"]["prompt_tokens"] for r in runs)
    return (
        sum(r["server"]["cached_tokens_vllm"] + r["server"]["cached_tokens_kvpool"] for r in runs) / prompt
        if prompt
        else 0.0
    )


def connector_hit_rate(runs: list[dict[str, Any]]) -> float:
    """kvpool's hit rate as the engines saw it: of the prompt tokens vLLM's own cache lacked, the share the
    connector found in kvpool (vLLM's external_prefix_cache_hits / queries). kvpool's own counters
    (kvpool_prefix_cache_*) count the saves' lookups too."""
    queries = sum(r["server"]["external_queries"] for r in runs)
    return sum(r["server"]["external_hits"] for r in runs) / queries if queries else 0.0


def rank(n: int, q: float) -> int:
    """The index, in `n` sorted values, of their `q`th percentile by nearest rank (the runs' p50/p90/p99)."""
    return min(n - 1, max(0, round(q / 100 * (n - 1))))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return sorted(values)[rank(len(values), q)]


def p50_difference_interval(
    mine: list[float], base: list[float], resamples: int = INTERVAL_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """The 90 % bootstrap interval of p50(mine) - p50(base), each p50 as the runs' (`percentile`): each run's
    requests resampled with replacement, `resamples` times (a fixed seed: a report printed again says the same)."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(mine, dtype=float), np.asarray(base, dtype=float)
    resampled_a = np.sort(a[rng.integers(0, len(a), size=(resamples, len(a)))], axis=1)
    resampled_b = np.sort(b[rng.integers(0, len(b), size=(resamples, len(b)))], axis=1)
    diffs = resampled_a[:, rank(len(a), 50)] - resampled_b[:, rank(len(b), 50)]
    low, high = np.percentile(diffs, [5, 95])
    return float(low), float(high)


def p50_interval(mine: dict[str, Any], base: dict[str, Any]) -> str:
    """' [LOW..HIGH]', the 90 % interval of the p50s' difference from two runs' per-request TTFTs; '' where a run
    has none (runs recorded before session 22)."""
    if not mine.get("ttft_ms") or not base.get("ttft_ms"):
        return ""
    low, high = p50_difference_interval(mine["ttft_ms"], base["ttft_ms"])
    return f" [{low:+.0f}..{high:+.0f}]"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def check_targets(runs: list[dict[str, Any]]) -> dict[str, Any]:
    lines: list[str] = []
    checks: dict[str, bool] = {}

    def judge(name: str, ok: bool, text: str) -> None:
        checks[name] = ok
        lines.append(f"{_verdict(ok)}  {text}")

    def at_least(name: str, what: str, mine: float, base: float, factor: float) -> None:
        ratio = mine / max(base, 1e-9)
        judge(name, mine >= factor * base, f"{what} {mine:.2f} / {base:.2f} = {ratio:.2f}x (>= {factor:g}x)")

    unloaded = [r for r in runs if r["unloaded"]]
    a, b = _runs(runs, "a"), _runs(runs, "b")
    if unloaded and a and b:
        idle = unloaded[0]["ttft_p50_ms"]
        loaded = [r for r in a if r["ttft_p50_ms"] >= 3 * idle]
        at = loaded[0] if loaded else a[-1]
        other = next((r for r in b if r["rate"] == at["rate"]), None)
        if other is not None:
            lines.append(
                f"      a unloaded TTFT p50 {idle:.1f} ms; judged at {at['rate']:g} req/s, where a's p50 is "
                f"{at['ttft_p50_ms']:.1f} ms ({at['ttft_p50_ms'] / idle:.1f}x unloaded{'' if loaded else ': never 3x'})"
            )
            ratio = at["ttft_mean_ms"] / other["ttft_mean_ms"]
            judge("b_ttft", bool(loaded) and ratio >= 3, f"b vs a mean TTFT lowered {ratio:.2f}x (>= 3x)")
            fa, fb = at["server"]["cached_fraction"], other["server"]["cached_fraction"]
            at_least("b_cached", "b vs a cached-token fraction", fb, fa, 3)
    for client in sorted({r["client"] for r in runs}):
        c, d, e = _runs(runs, "c", client), _runs(runs, "d", client), _runs(runs, "e", client)
        tag = "bench" if client == BENCH else "qa"
        if c and d:
            at_least(f"d_cached_{tag}", f"[{client}] d vs c cached fraction", _cached(d), _cached(c), 1.8)
        if d and e:
            at_least(
                f"e_hits_{tag}", f"[{client}] kvpool hit rate, e / d", connector_hit_rate(e), connector_hit_rate(d), 0.8
            )
        for f_name in ("f", "f-match"):
            f = _runs(runs, f_name, client)
            if f and e:
                wins = [fr["ttft_p50_ms"] < er["ttft_p50_ms"] for fr, er in zip(f, e)]
                intervals = [p50_interval(fr, er) for fr, er in zip(f, e)]
                pairs = ", ".join(
                    f"{fr['ttft_p50_ms']:.0f} vs {er['ttft_p50_ms']:.0f}{i}" for fr, er, i in zip(f, e, intervals)
                )
                note = "; in brackets f - e, 90 % bootstrap interval" if any(intervals) else ""
                judge(
                    f"{f_name}_ttft_{tag}",
                    all(wins),
                    f"[{client}] {f_name} beats e on p50 TTFT at every rate (ms: {pairs}{note})",
                )
    failed = sum(r["failed"] for r in runs)
    judge("no_failures", failed == 0, f"failed requests, all runs: {failed} (0)")
    left = sum(r["kvpool_pages_used_after"] for r in runs)
    judge("pins_released", left == 0, f"kvpool pages still used after the runs: {left} (0)")
    with_pool = [r for r in runs if "kvpool_bookkeeping_fraction" in r]
    if with_pool:
        worst = max(with_pool, key=lambda r: r["kvpool_bookkeeping_fraction"])
        judge(
            "bookkeeping", worst["kvpool_bookkeeping_fraction"] < 0.05,
            f"kvpool's bookkeeping per request / mean TTFT, worst run ({worst['label']}): connector "
            f"{worst['connector_ms_per_request']:.2f} ms, server HTTP {worst['kvpool_http_ms_per_request']:.2f} ms "
            f"/ {worst['ttft_mean_ms']:.1f} ms = {worst['kvpool_bookkeeping_fraction']:.1%} (< 5%)",
        )  # fmt: skip
    replays = sum(r.get("replays", 0) for r in runs)
    same = sum(r.get("replays_identical", 0) for r in runs)
    judge(
        "replays", replays > 0 and same == replays, f"replays one at a time identical to vLLM alone: {same}/{replays}"
    )
    return {"lines": lines, "checks": checks}


def results_table(runs: list[dict[str, Any]]) -> list[str]:
    """Every run as a row of a Markdown table (docs/fleet.md shows the last full run's)."""
    lines = [
        "| config | client | rate | requests | TTFT p50 / p90 / p99 / mean (ms) | ITL p50 (ms) | out tok/s | cached "
        "(vLLM + kvpool) | kvpool hit rate | connector ms/req | kvpool HTTP ms/req | remote tier ms/req (asking + "
        "reading, of which waiting for bytes) | kvpool CPU ms/req (waiting for a core) | routing ms/req |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        s = r["server"]
        client = "bench" if r["client"] == BENCH else "QA"
        rate = "1 at a time" if r["unloaded"] else f"{r['rate']:g}"
        ttft = " / ".join(f"{r[f'ttft_{k}_ms']:.0f}" for k in ("p50", "p90", "p99", "mean"))
        with_pool = "connector_ms_per_request" in r
        hits = f"{connector_hit_rate([r]):.2f}" if with_pool else "–"
        conn = f"{r['connector_ms_per_request']:.1f}" if with_pool else "–"
        http = f"{r['kvpool_http_ms_per_request']:.1f}" if with_pool else "–"
        restores = "–"
        if r.get("kvpool_tier_lookup_ms_per_request"):  # (runs before session 16 have none; d and b no tier)
            restores = f"{r['kvpool_tier_lookup_ms_per_request']:.1f} + {r['kvpool_restore_ms_per_request']:.1f}"
            if "kvpool_restore_wait_ms_per_request" in r:  # (since session 26)
                restores += f" ({r['kvpool_restore_wait_ms_per_request']:.1f})"
        cpu = "–"
        if "kvpool_cpu_ms_per_request" in r:  # (runs before session 13 have none)
            cpu = f"{r['kvpool_cpu_ms_per_request']:.1f} ({r['kvpool_cpu_wait_ms_per_request']:.1f})"
        route = r.get("router", {}).get("route_ms_per_request") or 0
        lines.append(
            f"| {r['config']} | {client} | {rate} | {r['completed']}/{r['requests']} | {ttft} | "
            f"{r['itl_p50_ms']:.1f} | {r['output_tok_s']:.1f} | {s['cached_fraction']:.2f} | {hits} | {conn} | "
            f"{http} | {restores} | {cpu} | {f'{route:.1f}' if route else '–'} |"
        )
    return lines
