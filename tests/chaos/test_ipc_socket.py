"""The pool's Unix socket under slow and malformed clients, against a real `kvpool serve` (issue 24, items 1, 7).

Before: one thread per connection and a 5 s timeout per recv (not per line), no connection limit. 1,013
connections that each sent `{` and then a byte every 3 s took the server to its 1,024 open files: every
/healthz and create failed and a client with a valid key was refused; 3,000 `[` got no answer at all (a
RecursionError in the server's log). Now one selector loop serves the socket, with a connection cap (the oldest
is closed first), a deadline for the whole line, and one reply line to every connection.
"""

import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from service.ipc.fd_socket import MAX_CONNECTIONS, MAX_LINE, receive_fds
from tests.chaos.conn_helpers import nofile_limit, percentile, raise_own_fd_limit, request
from tests.chaos.tally import TALLY
from tests.conftest import SMALL_POOL, Server

KEY = "ipc-chaos-key-5d1e7a90c3b2"
LINE_TIMEOUT_S = 2.0
SLOW = 1100
ENV = {
    **SMALL_POOL,
    "KVPOOL_API_KEYS": f"front:{KEY}",
    "KVPOOL_IPC_TENANTS": "front",
    "KVPOOL_REQUEST_HEAD_TIMEOUT_S": str(LINE_TIMEOUT_S),  # the socket's line deadline too
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """Open files 1,024, soft and hard: the server cannot raise them, as in a container with `ulimit -n 1024`."""
    raise_own_fd_limit(SLOW + 512)
    server = Server(ENV, preexec_fn=nofile_limit(1024, 1024))
    yield server
    server.stop()


def socket_path(server: Server) -> str:
    """On a fresh connection: the server closes idle ones after the 2 s head deadline, which a kept-alive client
    could race."""
    r = httpx.get(f"{server.url}/v1/ipc", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    path: str = r.json()["socket"]
    return path


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def reply_of(sock: socket.socket) -> bytes:
    """Everything until the server closes (a reset after its reply, when it left the client's bytes unread)."""
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        return data + b"<no close>"
    return data


def error_code(reply: bytes) -> str:
    """The code of a reply that is exactly one error line; `<...>` for anything else."""
    if not reply or reply.endswith(b"<no close>"):
        return "<no reply>" if not reply.strip(b"<no close>") else "<not closed>"
    if reply.count(b"\n") != 1 or not reply.endswith(b"\n"):
        return "<not one line>"
    try:
        code: str = json.loads(reply)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return "<not an error envelope>"
    return code


class Trickler:
    """Connections that each send `{` and then one byte every `every_s` seconds, never a whole line."""

    def __init__(self, path: str, count: int, every_s: float) -> None:
        self.sockets, self.refused = [], 0  # refused: connections the server did not take (a full backlog)
        for _ in range(count):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            try:
                sock.connect(path)
                sock.send(b"{")
            except OSError:
                sock.close()
                self.refused += 1
                continue
            self.sockets.append(sock)
        self.every_s, self.stop = every_s, threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self) -> None:
        while not self.stop.wait(self.every_s):
            for sock in self.sockets:
                try:
                    sock.send(b" ")
                except OSError:  # the server closed it (after its reply)
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for sock in self.sockets:
            sock.close()


def test_healthz_and_a_valid_client_are_served_during_1100_slow_socket_connections(server: Server) -> None:
    path, pid = socket_path(server), server.proc.pid
    threads_before = threads_of(pid)
    started = time.monotonic()
    slow = Trickler(path, SLOW, every_s=1.0)
    try:
        opened_s = time.monotonic() - started
        fds, threads = [], []
        healthz: list[float] = []
        exchanges: list[float] = []
        statuses: Counter[int] = Counter()
        served = 0
        for i in range(100):
            try:
                elapsed, status, _ = request(server.port, "GET", "/healthz", timeout=2)
            except OSError:
                elapsed, status = 2.0, 0
            healthz.append(elapsed)
            statuses[status] += 1
            if i % 5 == 0:  # a frontend with a valid key, 20 times: served each time
                t0 = time.perf_counter()
                try:
                    answer, received = receive_fds(path, KEY, timeout=2)
                except OSError:
                    answer, received = {}, []
                exchanges.append(time.perf_counter() - t0)
                served += len(received) == 1 and answer["keys"] == ["blocks"]
                for fd in received:
                    os.close(fd)
            fds.append(len(os.listdir(f"/proc/{pid}/fd")))
            threads.append(threads_of(pid))
        auth = {"Authorization": f"Bearer {KEY}"}
        try:
            created = httpx.post(
                f"{server.url}/v1/sequences", json={"seq_id": "during"}, headers=auth, timeout=2
            ).status_code
        except httpx.TransportError:
            created = 0
        # Every slow connection is answered once: shed (over the cap) or past the line's deadline.
        time.sleep(max(0.0, started + opened_s + LINE_TIMEOUT_S + 1.5 - time.monotonic()))
        codes = Counter(error_code(reply_of(sock)) for sock in slow.sockets)
    finally:
        slow.close()
    healthz_over = sum(t >= 0.1 for t in healthz)
    failures = (100 - statuses[200]) + (percentile(healthz, 0.99) >= 0.1) + (20 - served) + (created != 201)
    failures += slow.refused + SLOW - sum(codes.values())
    TALLY.record(
        "IPC socket",
        requests=len(healthz) + len(exchanges) + 1,
        faults=SLOW,
        failures=failures,
        held=f"{SLOW} slow connections (`{{` then a byte a second), open files 1,024: /healthz p50 "
        f"{percentile(healthz, 0.5) * 1e3:.2f} ms, p99 {percentile(healthz, 0.99) * 1e3:.2f} ms "
        f"({healthz_over} over 100 ms); "
        f"{served} of {len(exchanges)} valid clients served (p99 {percentile(exchanges, 0.99) * 1e3:.2f} ms); "
        f"server fds at most {max(fds)}, threads {threads_before} -> at most {max(threads)}; "
        f"slow ones answered: {dict(codes)}",
    )
    assert statuses == Counter({200: 100}) and percentile(healthz, 0.99) < 0.1, (statuses, healthz_over)
    assert served == 20 and created == 201
    assert slow.refused == 0 and max(fds) < 1024 - 32 and max(threads) <= threads_before + 1
    assert sum(codes.values()) == SLOW and set(codes) == {"too_many_connections", "request_timeout"}
    assert codes["request_timeout"] <= MAX_CONNECTIONS


def test_a_line_trickled_a_byte_at_a_time_meets_one_deadline(server: Server) -> None:
    """The deadline is for the whole line: bytes every 0.2 s do not extend it (before: 5 s per recv)."""
    started = time.monotonic()
    slow = Trickler(socket_path(server), 10, every_s=0.2)
    try:
        codes = Counter(error_code(reply_of(sock)) for sock in slow.sockets)
        waited = time.monotonic() - started
    finally:
        slow.close()
    TALLY.record(
        "IPC socket",
        faults=10,
        failures=int(codes != {"request_timeout": 10}),
        held=f"10 lines trickled a byte per 0.2 s: answered request_timeout after {waited:.2f} s "
        f"(deadline {LINE_TIMEOUT_S:g} s)",
    )
    assert codes == {"request_timeout": 10}
    assert LINE_TIMEOUT_S - 0.1 < waited < LINE_TIMEOUT_S + 1.5


MALFORMED = [
    b"[" * 3000 + b"\n",  # deeper than any parser should recurse (before: RecursionError, no reply)
    b"{" * 1200 + b"\n",
    b"[" * 4000 + b"]" * 40 + b"\n",
    b"x" * (MAX_LINE + 1),  # too long, without a newline: answered without waiting for one
    b'{"api_key": "' + b"k" * MAX_LINE + b'"}\n',
    b"\xff\xfe{}\n",  # not UTF-8
    b'{"api_key": NaN}\n',
    b"[]\n",
    b'"api_key"\n',
    b'{"api_key": 5}\n',
    b'{"api_key": ["' + KEY.encode() + b'"]}\n',
    b'{"api_key": {"$ne": null}}\n',
    b"not json\n",
    b"{\n",
]


def test_every_malformed_line_gets_one_reply_line(server: Server) -> None:
    path = socket_path(server)
    codes = []
    for line in MALFORMED:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            try:
                sock.sendall(line)
            except BrokenPipeError:  # the server answered the first MAX_LINE bytes and closed
                pass
            codes.append(error_code(reply_of(sock)))
    alive = server.proc.poll() is None and request(server.port, "GET", "/healthz")[1] == 200
    _, fds = receive_fds(path, KEY)
    for fd in fds:
        os.close(fd)
    TALLY.record(
        "IPC socket",
        requests=1,
        malformed=len(MALFORMED),
        failures=sum(code != "invalid_request" for code in codes) + (not alive),
        held=f"{len(MALFORMED)} malformed lines (3,000 `[`, over {MAX_LINE} bytes, not UTF-8, NaN, wrong types): "
        f"one reply line each {dict(Counter(codes))}",
    )
    assert codes == ["invalid_request"] * len(MALFORMED)
    assert alive and len(fds) == 1
