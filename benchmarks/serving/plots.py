"""The results as PNGs (matplotlib, headless): TTFT p50/p99 against the request rate, per configuration;
the cached-token fraction and kvpool's hit rate, per configuration."""

from pathlib import Path
from typing import Any

import matplotlib

from benchmarks.serving.targets import connector_hit_rate

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def ttft_plot(runs: list[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    configs = sorted({r["config"] for r in runs if r["client"] == "vllm bench serve" and not r["unloaded"]})
    for config in configs:
        mine = sorted(
            (r for r in runs if r["config"] == config and r["client"] == "vllm bench serve" and not r["unloaded"]),
            key=lambda r: r["rate"],
        )
        rates = [r["rate"] for r in mine]
        for ax, key in zip(axes, ("ttft_p50_ms", "ttft_p99_ms")):
            ax.plot(rates, [r[key] for r in mine], marker="o", label=config)
    for ax, title in zip(axes, ("TTFT p50", "TTFT p99")):
        ax.set_title(f"{title} (vllm bench serve, prefix_repetition)")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def hit_plot(runs: list[dict[str, Any]], path: Path) -> None:
    configs = sorted({r["config"] for r in runs if not r["unloaded"]})
    clients = sorted({r["client"] for r in runs})
    fig, axes = plt.subplots(1, len(clients), figsize=(5.5 * len(clients), 4.2), squeeze=False)
    for ax, client in zip(axes[0], clients):
        cached, pool = [], []
        for config in configs:
            mine = [r for r in runs if r["config"] == config and r["client"] == client and not r["unloaded"]]
            prompt = sum(r["server"]["prompt_tokens"] for r in mine)
            hit = sum(r["server"]["cached_tokens_vllm"] + r["server"]["cached_tokens_kvpool"] for r in mine)
            cached.append(hit / prompt if prompt else 0.0)
            pool.append(connector_hit_rate(mine))
        x = range(len(configs))
        ax.bar([i - 0.2 for i in x], cached, 0.4, label="prompt tokens served from cache (vLLM + kvpool)")
        ax.bar([i + 0.2 for i in x], pool, 0.4, label="kvpool's hit rate: of the prompt tokens vLLM lacked")
        ax.set_xticks(list(x), configs, fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_title(client)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
