"""NVIDIA Dynamo's standalone KV indexer (`pip install ai-dynamo-runtime`, `python -m dynamo.indexer`),
run in a network namespace of the test's own.

The indexer's HTTP server binds every interface (0.0.0.0), so it must never share the machine's
network: the test body runs on a thread that has unshared its network namespace (Linux keeps one per
thread; root or CAP_SYS_ADMIN needed), where loopback is the only interface. Every process that
thread starts (the kvpool servers, the indexer) inherits that namespace, and every socket it opens
is in it: nothing outside the namespace can reach them, and they reach nothing outside it.
"""

import ctypes
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from benchmarks.processes import stop
from service.cli import free_port

T = TypeVar("T")
CLONE_NEWNET = 0x40000000


def available() -> str:
    """Why the indexer cannot run here ("" when it can)."""
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.indexer") is None:
        return "ai-dynamo-runtime is not installed (pip install -e '.[test]')"
    if os.geteuid() != 0:
        return "a network namespace of the test's own needs root (CAP_SYS_ADMIN)"
    return ""


def in_private_network(body: Callable[[], T], timeout: float = 300.0) -> T:
    """body() on a new thread in a new network namespace with only loopback, up; its result or error."""
    result: list[Any] = []

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
            result.append(("ok", body()))
        except BaseException as exc:  # handed to the caller's thread
            result.append(("error", exc))

    thread = threading.Thread(target=run, name="private-network")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the test's body did not end in {timeout:.0f} s")
    kind, value = result[0]
    if kind == "error":
        raise value
    return value  # type: ignore[no-any-return]


class Indexer:
    """`python -m dynamo.indexer` on a free port of the namespace it is started in; its HTTP API."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self._log = log.open("wb")
        cmd = [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"the indexer exited with {self.proc.returncode}: see {log}"
            try:
                self.client.post("/query", json={"token_ids": [1], "model_name": "-"})
                return
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the indexer did not listen in 30 s"
                time.sleep(0.1)

    def register(self, instance_id: int, events: dict[str, str], model: str, block_size: int) -> None:
        local = {k: v.replace("*", "127.0.0.1") for k, v in events.items()}
        body = {
            "instance_id": instance_id,
            "endpoint": local["KVPOOL_KV_EVENTS_ENDPOINT"],
            "replay_endpoint": local["KVPOOL_KV_EVENTS_REPLAY_ENDPOINT"],
            "model_name": model,
            "block_size": block_size,
        }
        r = self.client.post("/register", json=body)
        assert r.is_success and r.json() == {"status": "ok"}, r.text

    def query(self, token_ids: list[int], model: str) -> dict[str, Any]:
        """{instance id: its entry}: longest_matched, and the tokens matched per medium (gpu, cpu, disk)."""
        r = self.client.post("/query", json={"token_ids": token_ids, "model_name": model})
        assert r.status_code == 200, r.text
        instances: dict[str, Any] = r.json()["instances"]
        return instances

    def stop(self) -> None:
        self.client.close()
        stop(self.proc, timeout=10, close=[self._log])
