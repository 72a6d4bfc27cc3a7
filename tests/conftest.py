"""Shared fixtures: a real `kvpool serve` subprocess on a free loopback port, tensor helpers.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection,
on machines without CUDA.
"""

import base64
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import httpx
import numpy as np
import torch

from benchmarks.processes import stop
from service.cli import free_port

__all__ = ["free_port"]  # re-exported: tests import it from here

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # (keywords hold directory names too: a checkout in gpu/)
            item.add_marker(skip)


class Server:
    """A `kvpool serve` subprocess (the same entry point as the console script) and an httpx client."""

    def __init__(self, env: dict[str, str], args: list[str] | None = None, **popen: Any) -> None:
        """`popen`: more subprocess.Popen arguments (e.g. start_new_session, preexec_fn)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
        cmd = [sys.executable, "-m", "service", "serve", "--port", str(self.port), "--log-level", "warning"]
        self.proc = subprocess.Popen(
            [*cmd, *(args or [])], env=full_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen
        )
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.output = ""
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode() if self.proc.stdout else ""
                self.stop()  # closes the pipe and the client
                raise RuntimeError(f"kvpool serve exited with {self.proc.returncode}:\n{out}")
            try:
                if self.client.get("/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvpool serve did not become ready in 60 s")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        self.client.close()
        stop(self.proc, sig, timeout)
        if self.proc.stdout and not self.proc.stdout.closed:
            self.output = self.proc.stdout.read().decode(errors="replace")  # what it printed, for tests
            self.proc.stdout.close()
        return int(self.proc.returncode)


SMALL_POOL = {
    "KVPOOL_NUM_LAYERS": "2",
    "KVPOOL_NUM_KV_HEADS": "2",
    "KVPOOL_HEAD_DIM": "16",
    "KVPOOL_PAGE_SIZE": "4",
    "KVPOOL_NUM_PAGES": "16",
    "KVPOOL_DTYPE": "float32",
    "KVPOOL_DEVICE": "cpu",
}


@pytest.fixture
def start_server() -> Iterator[Any]:
    """Factory: start_server(**env) -> Server; every server started is stopped at teardown."""
    servers: list[Server] = []

    def start(env: dict[str, str] | None = None, args: list[str] | None = None) -> Server:
        server = Server({**SMALL_POOL, **(env or {})}, args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(start_server: Any) -> Server:
    """A server on the small pool (2 layers, 2 KV heads, head_dim 16, page 4, 16 pages)."""
    result: Server = start_server()
    return result


def enc(t: torch.Tensor) -> dict[str, Any]:
    from service.wire.tensors import encode

    return encode(t)


def dec(obj: dict[str, Any]) -> torch.Tensor:
    from service.wire.tensors import decode

    return decode("tensor", obj["dtype"], obj["shape"], obj["data"])


def kvpool_script() -> str | None:
    return shutil.which("kvpool")


def b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode()
