"""Figures drawn from the benchmarks' JSON (benchmarks/report.py): one drawing per kind of result.

    python -m benchmarks.plots RESULT.json OUT.png    # redraw a saved result

Each figure carries its command, date and machine underneath, so a picture never travels without them.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

Result = dict[str, Any]
KVPOOL, PEER, CEILING, OTHER = "#1f77b4", "#ff7f0e", "#7f7f7f", "#2ca02c"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _label_bars(ax: Any, bars: Any, texts: list[str], tops: list[float] | None = None) -> None:
    """Each bar's text just above it (or above `tops`, e.g. its error bar)."""
    for i, (bar, text) in enumerate(zip(bars, texts)):
        ax.annotate(
            text,
            (bar.get_x() + bar.get_width() / 2, bar.get_height() if tops is None else tops[i]),
            ha="center",
            va="bottom",
            fontsize=7,
            xytext=(0, 2),
            textcoords="offset points",
        )


def alloc_peers(result: Result, plt: Any) -> Any:
    """kvpool/vLLM per figure, one bar per page size, against each page size's target."""
    pools = result["pools"]
    labels = [row["label"] for row in pools[0]["rows"]]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(pools)
    colors = [KVPOOL, PEER, OTHER]
    for i, pool in enumerate(pools):
        xs = [j + (i - (len(pools) - 1) / 2) * width for j in range(len(labels))]
        ratios = [row["ratio"] for row in pool["rows"]]
        color = colors[i % len(colors)]
        bars = ax.bar(xs, ratios, width, color=color, label=f"page {pool['page_size']}")
        for bar, row in zip(bars, pool["rows"]):
            if not row["judged"]:
                bar.set_hatch("//")
                bar.set_alpha(0.6)
        _label_bars(ax, bars, [f"{r:.1f}x" for r in ratios])
        ax.axhline(pool["target"], color=color, linestyle="--", linewidth=1, label=f"target page {pool['page_size']}")
    ax.axhline(1, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.set_ylabel(f"kvpool / {result.get('peer', 'vLLM')} (log)")
    ax.set_xticks(range(len(labels)), [textwrap.fill(label, 16) for label in labels], fontsize=7)
    ax.set_title("Allocator against vLLM's KVCacheManager, by page size (higher is better; hatched: no target)")
    ax.legend(fontsize=7, ncol=2)
    return fig


def _seconds(value: float) -> str:
    return f"{value * 1e6:.1f} us" if value < 1e-3 else f"{value * 1e3:.2f} ms"


def alloc(result: Result, plt: Any) -> Any:
    """Each figure as a multiple of its target (1 = on the target; right of it is better)."""
    rows = result["figures"]
    shares = [r["value"] / r["target"] if r["higher_is_better"] else r["target"] / r["value"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bars = ax.barh([r["label"] for r in rows], shares, color=[KVPOOL if s >= 1 else PEER for s in shares])
    for bar, r in zip(bars, rows):
        value = f"{r['value'] / 1e6:.2f} M pages/s" if r["unit"] == "pages/s" else _seconds(r["value"])
        ax.annotate(value, (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=7)
    ax.axvline(1, color="black", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.invert_yaxis()
    ax.set_xlabel("multiple of the target (log)")
    ax.set_title("kvpool bench alloc: each figure against its target")
    return fig


def http(result: Result, plt: Any) -> Any:
    """p50 and p99 latency (all routes) and requests/s against the number of concurrent clients."""
    runs = sorted(result["runs"], key=lambda r: r["clients"])
    clients = [r["clients"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(clients, [r["p50_ms"] for r in runs], "o-", color=KVPOOL, label="p50")
    ax.plot(clients, [r["p99_ms"] for r in runs], "s-", color=PEER, label="p99")
    target = result.get("targets", {}).get("p99_ms")
    if target:
        ax.axhline(target, color=PEER, linestyle="--", linewidth=1, label=f"p99 target {target:g} ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.set_xlabel("concurrent clients (one keep-alive connection each)")
    ax.set_ylabel("latency, ms (log)")
    rate = ax.twinx()
    rate.plot(clients, [r["requests_per_s"] for r in runs], "^:", color=OTHER, label="requests/s")
    rate.set_ylabel("requests/s")
    rate.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = rate.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="upper left")
    ax.set_title("kvpool bench http: latency and throughput against load")
    return fig


def tiers(result: Result, plt: Any) -> Any:
    """Each tier's restore rate beside its ceiling (and redis-benchmark for the remote tier); hit rates."""
    rows = result["tiers"]
    with_hits = bool(result.get("hit_rate"))
    fig, axes = plt.subplots(1, 2 if with_hits else 1, figsize=(10 if with_hits else 7, 4), squeeze=False)
    ax = axes[0][0]
    names = [r["name"] for r in rows]
    xs = range(len(rows))
    restore = ax.bar(
        [x - 0.2 for x in xs],
        [r["restore_gbs"] for r in rows],
        0.4,
        color=KVPOOL,
        label="restore (mean; %: median restore/ceiling pair)",
    )
    ceilings = [r.get("reference_gbs", r["ceiling_gbs"]) for r in rows]
    ceiling = ax.bar([x + 0.2 for x in xs], ceilings, 0.4, color=CEILING, label="ceiling")
    shares = [r.get("of_reference", r["of_ceiling"]) for r in rows]
    _label_bars(ax, restore, [f"{s:.0%}\n{r['vs_recompute']:.0f}x recompute" for s, r in zip(shares, rows)])
    kinds = {"host": "memcpy", "disk": "cached-file read"}
    _label_bars(
        ax,
        ceiling,
        [kinds.get(n, "redis-benchmark" if "reference_gbs" in r else "redis-py") for n, r in zip(names, rows)],
    )
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("GB/s")
    ax.set_ylim(top=max([*ceilings, *(r["restore_gbs"] for r in rows)]) * 1.3)
    mib = result["prefix_bytes"] / 2**20
    ax.set_title(f"Restore of a {result['prefix_tokens']}-token prefix ({mib:.0f} MiB) against its ceiling", fontsize=9)
    ax.legend(fontsize=7)
    if with_hits:
        hits = result["hit_rate"]
        bars = axes[0][1].bar(
            list(hits), [100 * v for v in hits.values()], color=[CEILING, *[KVPOOL] * (len(hits) - 1)]
        )
        _label_bars(axes[0][1], bars, [f"{100 * v:.1f} %" for v in hits.values()])
        axes[0][1].set_ylabel("prompt tokens found, %")
        axes[0][1].set_ylim(0, 115)
        axes[0][1].set_title(
            f"Hit rate, working set {result.get('working_set_ratio', 4):.1f}x the device pool", fontsize=9
        )
    return fig


def vllm_connector(result: Result, plt: Any) -> Any:
    """Time to first token per system: medians, with the min-max of the rounds as error bars."""
    rows = [r for r in result["figures"] if r["label"].startswith("TTFT")]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [textwrap.fill(r["label"].removeprefix("TTFT, "), 22) for r in rows]
    medians = [r["median_ms"] for r in rows]
    lows, highs = [r.get("min_ms", r["median_ms"]) for r in rows], [r.get("max_ms", r["median_ms"]) for r in rows]
    errors = [[m - low for m, low in zip(medians, lows)], [high - m for m, high in zip(medians, highs)]]
    colors = [CEILING, PEER, OTHER, KVPOOL][: len(rows)]
    bars = ax.bar(labels, medians, yerr=errors, capsize=3, color=colors)
    _label_bars(ax, bars, [f"{m:.1f} ms" for m in medians], tops=highs)
    model = result.get("model", {})
    ax.set_ylabel("TTFT, ms")
    ax.set_title(f"vLLM with kvpool's connector: TTFT of a {model.get('prompt', '?')}-token prompt", fontsize=10)
    return fig


DRAWERS: dict[str, Callable[[Result, Any], Any]] = {
    "alloc": alloc,
    "alloc-peers": alloc_peers,
    "http": http,
    "tiers": tiers,
    "vllm-connector": vllm_connector,
}


def caption(result: Result) -> str:
    m = result.get("machine", {})
    load = m.get("load_average")
    where = f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores" + (f", load {load[0]:.1f}" if load else "")
    origin = "" if result.get("source", "measured") == "measured" else f" · {result['source']}"
    return textwrap.fill(f"{result['command']} · {result['date']} · {where}{origin}", 140)


def draw(result: Result, path: str | Path) -> None:
    """Draw `result` into `path` (the format from its suffix)."""
    if result["kind"] not in DRAWERS:
        raise SystemExit(f"no drawing for results of kind {result['kind']!r} (known: {', '.join(DRAWERS)})")
    plt = _pyplot()
    fig = DRAWERS[result["kind"]](result, plt)
    fig.text(0.01, 0.005, caption(result), fontsize=6, color="#555555", va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    # No timestamp in the file: redrawing the same result gives the same bytes.
    fig.savefig(path, dpi=110, metadata={"Software": None} if str(path).endswith(".png") else None)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Redraw a benchmark's saved JSON result.")
    parser.add_argument("result", help="a JSON file written by a benchmark's --json")
    parser.add_argument("out", help="the image to write (.png, .svg)")
    args = parser.parse_args(argv)
    draw(json.loads(Path(args.result).read_text()), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
