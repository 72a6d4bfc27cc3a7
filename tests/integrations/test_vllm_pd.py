"""Prefill/decode split through kvpool: two vLLM OpenAI servers (kv_producer, kv_consumer), one `kvpool serve`,
and the proxy of benchmarks/pd_proxy.py in front, all real processes on loopback.

Each request goes to the producer with max_tokens=1 (it computes the prompt; its saves land after its
answer) and then, with the producer's kv_transfer_params, to the consumer, which must load every token of
the prompt but the last from kvpool in every request (a consumer that asked before the saves landed would
recompute): 20 requests in a row, each answered as soon as the one before. The tokens equal one engine
alone's (tests/integrations/test_vllm.py's harness).
"""

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm")

from benchmarks.vllm_formats import Server
from tests.conftest import REPO, free_port
from tests.integrations.test_vllm import KVPool, alone_tokens, model_dir, tokens

__all__ = ["model_dir"]  # the tiny Llama fixture of test_vllm.py, shared
NUM_REQUESTS = 20
NEW_TOKENS = 8


@pytest.fixture
def pd(model_dir: str, tmp_path: Path) -> Iterator[tuple[KVPool, str]]:
    """kvpool, a producer, a consumer and the proxy in front of them (its URL)."""
    pool = KVPool(model_dir, 16)
    servers: list[Server] = []
    proxy = None
    try:
        for role in ("kv_producer", "kv_consumer"):
            log = tmp_path / f"{role}.log"
            servers.append(Server(model_dir, pool.url, role, "float32", free_port(), log, 1024, 64 << 20, wait=False))
        for server in servers:  # both start side by side
            server.wait_ready()
        port = free_port()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.pd_proxy", "--producer", servers[0].url, "--consumer", servers[1].url,
             "--port", str(port)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/docs", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield pool, f"http://127.0.0.1:{port}"
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)
        for server in servers:
            server.close()
        pool.stop()


def completion(client: httpx.Client, url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    answer = client.post(f"{url}/v1/completions", json={**body, "return_token_ids": True})
    answer.raise_for_status()
    return dict(answer.json())


def test_consumer_loads_every_prompt_the_producer_just_computed(
    model_dir: str, pd: tuple[KVPool, str], tmp_path: Path
) -> None:
    pool, proxy = pd
    # Prompts of 100..290 tokens, none sharing a page with another (each a miss at the producer).
    prompts = [tokens(100 + i, 100 + 10 * i) for i in range(NUM_REQUESTS)]
    reference = list(alone_tokens(model_dir, dict(enumerate(prompts)), tmp_path / "alone.log").values())
    with httpx.Client(timeout=120) as client:
        answers = [completion(client, proxy, p) for p in prompts]
    for prompt, answer, expected in zip(prompts, answers, reference, strict=True):
        assert answer["choices"][0]["token_ids"] == expected
        # Every full page of the prompt, up to its last token, was loaded: the producer's saves had landed.
        full = len(prompt) // 16 * 16
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == min(full, len(prompt) - 1), len(prompt)
    info = pool.pool()
    assert (info["pages_used"], info["num_sequences"]) == (0, 0)
