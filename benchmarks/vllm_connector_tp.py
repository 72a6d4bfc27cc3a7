"""The tensor parallel mode of benchmarks.vllm_connector (`--tp 2`): TTFT of a TP engine cold and hitting kvpool
in a fresh process, and the share of a prompt cached across tensor parallel degrees.

    python -m benchmarks.vllm_connector --tp 2 [--layers 8 --hidden 512 --prompt 2048 --rounds 5]

One engine process at a time (each TP engine is an engine core and one worker process per rank, every worker
bound to a core of its own: VLLM_CPU_OMP_THREADS_BIND, the same in every TP engine timed, so that the compared
TTFTs come from engines with the same thread settings), one after the other on the same `kvpool serve`:
1. vLLM alone at TP (its prefix cache off): cold TTFT of fresh prompts;
2. vLLM at TP with the connector: the same prompts again (a miss that saves), each saved;
3. vLLM at TP=1 with the connector: prompts sharing all but their last 64 tokens with those (saved at TP),
   whose cached share is the cross-TP figure TP -> 1; and fresh prompts of its own, saved at TP=1;
4. a fresh vLLM at TP with the connector (its prefix cache off: every hit is kvpool's): TTFT of the prompts
   sharing all but their last 64 tokens with step 2's (the fresh-process hit), each followed by a fresh prompt
   (a miss, timed in the same process: the ratio per pair does not move with the machine's load between the
   engines' phases), and the share cached of step 3's own prompts repeated (cross-TP 1 -> TP).
"""

import argparse
from pathlib import Path
from typing import Any

from benchmarks.processes import stop
from benchmarks.vllm_connector import SUFFIX, cpu_pressure, make_model, ms, prompts, start_kvpool, token_bytes
from benchmarks.vllm_timed_engine import Engine


def run_tp(args: argparse.Namespace, tmp: str) -> None:
    model = str(Path(tmp) / "model")
    make_model(Path(model), args.layers, args.hidden, args.dtype)
    server, url = start_kvpool(model, 4 * args.rounds * args.prompt // 16 + 64)  # every prompt saved stays cached
    tb, r, fixed = token_bytes(args), range(args.rounds), args.malloc == "fixed"

    def engine(kvpool: str | None, tp: int) -> Engine:
        return Engine(model, kvpool, False, args.prompt, tb, fixed, args.dtype, tp=tp)

    results: dict[str, list[dict[str, Any]]] = {}
    pressure: dict[str, float] = {}
    try:
        saved = [prompts(10 + i, args.prompt) for i in r]  # (saved at TP, the hit sharing all but SUFFIX)
        # Loaded at TP=1: a third prompt sharing all but SUFFIX with the one saved at TP (not the hit's, which a
        # save at TP=1 would then hold whole).
        crossing = [p[0][:-SUFFIX] + prompts(90 + i, args.prompt)[0][-SUFFIX:] for i, p in enumerate(saved)]
        own = [prompts(50 + i, args.prompt)[0] for i in r]  # saved at TP=1
        misses = [prompts(70 + i, args.prompt)[0] for i in r]  # new to kvpool when the fresh engine runs them
        phases = (
            ("alone", None, args.tp, [(p[0], "cold") for p in saved]),
            ("saving", url, args.tp, [(p[0], "miss") for p in saved]),
            ("tp1", url, 1, [(p, "cross") for p in crossing] + [(p, "miss") for p in own]),
            # Its hits alternate with fresh prompts (misses) timed in the same process: the machine's drift
            # falls on both alike.
            (
                "fresh",
                url,
                args.tp,
                [run for p, m in zip(saved, misses) for run in ((p[1], "hit"), (m, "miss"))]
                + [(p, "cross") for p in own],
            ),
        )
        for name, kvpool, tp, runs in phases:
            current = engine(kvpool, tp)
            try:
                pressure[name] = cpu_pressure()
                results[name] = [{**current.run(prompt, 1), "kind": kind} for prompt, kind in runs]
                results[name].append(current.finish([]))
            finally:
                current.close()
    finally:
        stop(server)
    report_tp(args, results, pressure)


def report_tp(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], pressure: dict[str, float]) -> None:
    def of(phase: str, kind: str) -> list[dict[str, Any]]:
        return [run for run in results[phase][:-1] if run["kind"] == kind]

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    kv_heads = max(1, args.hidden // 128)
    print(f"model: Llama, {args.layers} layers, hidden {args.hidden}, {args.hidden // 64} query / {kv_heads} KV heads "
          f"of 64, {args.dtype}; prompt {args.prompt} tokens; vLLM block 32, kvpool page 16; TP={args.tp} engines with "
          f"one OpenMP thread per worker, each bound to its own core (VLLM_CPU_OMP_THREADS_BIND), the TP=1 engine "
          f"with vLLM's default threads; one engine at a time; {args.rounds} prompts each, medians "
          f"(min–max)")  # fmt: skip
    print("  /proc/pressure/cpu some avg10 at each engine's start: "
          + ", ".join(f"{k} {v:.1f}" for k, v in pressure.items()))  # fmt: skip
    cold, hit = [x["s"] for x in of("alone", "cold")], [x["s"] for x in of("fresh", "hit")]
    beside = [x["s"] for x in of("fresh", "miss")]
    for label, values in (
        (f"TTFT, vLLM alone TP={args.tp}, cold (miss)", cold),
        (f"TTFT, TP={args.tp} miss with the connector (saving)", [x["s"] for x in of("saving", "miss")]),
        (f"TTFT, fresh TP={args.tp} process, kvpool hit", hit),
        ("TTFT, the same process, misses between its hits", beside),
    ):
        print(f"  {label:52s} {ms(values)}")
    shared = args.prompt - SUFFIX
    per_pair = sorted(h / m for h, m in zip(hit, beside))
    print(f"  kvpool hit / cold TTFT at TP={args.tp} (target <= 0.25): {median(hit) / median(cold):.3f} against vLLM "
          f"alone; per pair with the misses between the hits (same process): {median(per_pair):.3f} "
          f"({per_pair[0]:.3f}–{per_pair[-1]:.3f}); cached {sorted({x['cached'] for x in of('fresh', 'hit')})} "
          f"of the {shared} shared tokens")  # fmt: skip
    for label, runs, prefix in (
        (f"saved at TP={args.tp}, loaded at TP=1", of("tp1", "cross"), shared),
        (f"saved at TP=1, loaded at TP={args.tp}", of("fresh", "cross"), args.prompt),
    ):
        cached = [x["cached"] for x in runs]
        print(f"  cross-TP, {label}: cached {sorted(set(cached))} of the {prefix} shared tokens, the least "
              f"{min(cached) / prefix:.1%} (target >= 95%)")  # fmt: skip
    for phase in ("saving", "tp1", "fresh"):
        stats = results[phase][-1]["stats"]
        requests = len(results[phase])  # its runs and its warm-up (the last entry is finish()'s)
        counts = {k: v for k, v in stats.items() if not k.endswith("_ns")}
        times = ", ".join(f"{k[:-3]} {v / 1e6 / requests:.2f}" for k, v in stats.items() if k.endswith("_ns"))
        print(f"  the {phase} engine's connector (the scheduler's, its workers' summed): {counts}; ms per request "
              f"(the ranks' summed): {times}")  # fmt: skip
