"""Hostile and slow clients for the chaos checks: raw sockets that hold connections, and timed fresh requests."""

import json
import math
import os
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.conftest import SMALL_POOL, Server

# Heads that never finish, and a body that comes a byte at a time.
HALF_HEAD = b"GET /healthz HTTP/1.1\r\nHost: kvpool\r\nUser-Agent: slow"
SLOW_BODY_HEAD = (
    b"POST /v1/sequences HTTP/1.1\r\nHost: kvpool\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
)


def raise_own_fd_limit(needed: int) -> None:
    """The test process holds thousands of sockets too: its soft open-file limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < needed:
        import pytest

        pytest.skip(f"the test needs {needed} descriptors, the hard open-file limit is {soft}")


def nofile_limit(soft: int, hard: int | None = None) -> Callable[[], None]:
    """preexec_fn for the server: its open-file limit as a container with `ulimit -n <soft>` would start it."""

    def apply() -> None:
        _, current_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, current_hard if hard is None else hard))

    return apply


def start(env: dict[str, str] | None = None, **popen: Any) -> Server:
    pool = {**SMALL_POOL, "KVPOOL_NUM_PAGES": "1024"}  # room for a step per measurement
    return Server({**pool, **(env or {})}, **popen)


def server_fds(server: Server) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def wait_for_fds(server: Server, at_least: int, timeout: float = 20) -> int:
    """Until the server has accepted that many connections (its accept queue drained): its descriptor count."""
    deadline = time.monotonic() + timeout
    while (count := server_fds(server)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection. A slow client that keeps sending after the server
    closed gets a reset: what it had read by then is the answer."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        if not data:
            raise
    return data


class Holder:
    """Connections held open on purpose: silent, half a head, or a body trickled a byte at a time."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sockets: dict[str, list[socket.socket]] = {"silent": [], "half_head": [], "slow_body": []}
        self.stop = threading.Event()
        self.trickler = threading.Thread(target=self._trickle, daemon=True)

    def open(self, kind: str, count: int) -> None:
        for _ in range(count):
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            if kind == "half_head":
                sock.sendall(HALF_HEAD)
            elif kind == "slow_body":
                sock.sendall(SLOW_BODY_HEAD + b"{")
            self.sockets[kind].append(sock)

    def start_trickle(self) -> None:
        self.trickler.start()

    def _trickle(self) -> None:
        while not self.stop.wait(0.5):
            for sock in self.sockets["slow_body"]:
                try:
                    sock.send(b" ")
                except OSError:
                    pass

    def still_open(self) -> dict[str, int]:
        """Per kind, how many the server has not closed (a closed one reads as EOF or a reset)."""
        counts = {}
        for kind, socks in self.sockets.items():
            alive = 0
            for sock in socks:
                sock.setblocking(False)
                try:
                    alive += sock.recv(1, socket.MSG_PEEK) != b""
                except BlockingIOError:
                    alive += 1
                except OSError:
                    pass
            counts[kind] = alive
        return counts

    def close(self) -> None:
        self.stop.set()
        if self.trickler.is_alive():
            self.trickler.join()
        for socks in self.sockets.values():
            for sock in socks:
                sock.close()


@contextmanager
def holding(port: int, **counts: int) -> Iterator[Holder]:
    holder = Holder(port)
    try:
        for kind, count in counts.items():
            holder.open(kind, count)
        holder.start_trickle()
        yield holder
    finally:
        holder.close()


def request(port: int, method: str, path: str, body: Any = None, timeout: float = 10) -> tuple[float, int, bytes]:
    """One request on a fresh connection, as a new client makes it: (seconds to the whole answer, status, body)."""
    payload = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: kvpool\r\nConnection: close\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n" + payload)
        data = read_all(sock)
    elapsed = time.perf_counter() - started
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return elapsed, status, data.split(b"\r\n\r\n", 1)[-1]


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: p99 of 100 values is the 99th smallest."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def report(name: str, figures: dict[str, Any]) -> None:
    """One line the reliability page (docs/reliability.md) quotes (run with -s)."""
    print(f"\n[chaos] {name}: " + json.dumps(figures))


def latencies(times: dict[str, list[float]]) -> dict[str, float]:
    """p50 and p99 in ms of each kind measure() timed: healthz_p50_ms, ..., step_p99_ms."""
    return {
        f"{kind}_{q}_ms": round(percentile(values, p) * 1e3, 2)
        for kind, values in times.items()
        for q, p in (("p50", 0.5), ("p99", 0.99))
    }
