"""The engine of the vLLM connector benchmarks (benchmarks.vllm_connector and its modes): one vLLM engine in a
process of its own (benchmarks.vllm_engine's build_llm and EngineProcess) that times requests one at a time.

    python -m benchmarks.vllm_timed_engine CONFIG    (started by Engine)

CONFIG: build_llm's keys (max_model_len 4096 and a KV cache of 1 GiB / tensor parallel size here), with
"warmup_tokens" (the length of its warm-up prompt, and of the copies timed at the end) and "token_bytes"
(the K and V of one token, every layer). How the copies and their ceilings are timed: benchmarks.vllm_connector.
"""

import faulthandler
import json
import resource
import signal
import sys
import time
from typing import Any

from benchmarks.vllm_engine import EngineProcess, build_llm, engine_env, settle

FLUSH_BYTES = 128 << 20  # written between cold copies: larger than the last-level cache


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
        super().__init__(["benchmarks.vllm_timed_engine"], config, None, engine_env(tp, fixed_malloc))
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


if __name__ == "__main__":
    engine_main(json.loads(sys.argv[1]))
