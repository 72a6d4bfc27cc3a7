"""service/ipc/line_server.py on its own: what the chaos suite cannot reach through a server (a failing answer,
the open-file limit reached) and the rules it does reach, each in isolation."""

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.ipc.line_server import LineServer, Reply
from tests.conftest import REPO


def echo(line: bytes) -> Reply:
    if line == b"boom":
        raise RuntimeError("a bug in answer()")
    return json.dumps({"line": line.decode(errors="replace")}).encode() + b"\n", []


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LineServer]:
    server = LineServer(str(tmp_path / "s.sock"), echo, max_connections=3, line_timeout_s=0.5, max_line=64)
    yield server
    server.close()


def exchange(path: str, data: bytes, shut: bool = False) -> bytes:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(data)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
        return reply


def test_one_reply_line_per_connection(server: LineServer, tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert exchange(path, b"hello\nignored after the line") == b'{"line": "hello"}\n'
    assert exchange(path, b"no newline, then EOF", shut=True) == b'{"line": "no newline, then EOF"}\n'
    too_long = json.loads(exchange(path, b"x" * 65))
    assert too_long["error"]["code"] == "invalid_request" and "64 bytes" in too_long["error"]["message"]
    failed = json.loads(exchange(path, b"boom\n"))  # logged; the loop goes on
    assert failed["error"] == {"code": "internal_error", "message": "RuntimeError: a bug in answer()"}
    assert exchange(path, b"still serving\n") == b'{"line": "still serving"}\n'
    assert server.counts == {"served": 4, "shed": 0, "timed_out": 0, "too_long": 1, "accept_failed": 0}


def test_over_the_cap_the_oldest_is_told_and_closed(server: LineServer, tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    held = []
    for _ in range(4):
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(5)
        sock.connect(path)
        held.append(sock)
    first = held[0].recv(4096)
    assert json.loads(first)["error"]["code"] == "too_many_connections" and held[0].recv(1) == b""
    held[3].sendall(b"newest\n")
    assert held[3].recv(4096) == b'{"line": "newest"}\n'
    started = time.monotonic()
    late = [json.loads(sock.recv(4096))["error"]["code"] for sock in held[1:3]]  # the deadline, 0.5 s
    assert late == ["request_timeout"] * 2 and time.monotonic() - started < 1.5
    for sock in held:
        sock.close()
    assert server.counts == {"served": 1, "shed": 1, "timed_out": 2, "too_long": 0, "accept_failed": 0}


# The server in a process whose open files run out after a few connections: it must stop accepting for a moment
# (not retry at once on a listener that stays readable: thousands of failed accepts a second), and serve again
# once descriptors are free.
AT_THE_LIMIT = """
import json, os, resource, sys, time
from service.ipc.line_server import LineServer
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))  # 4 left for clients
server = LineServer(sys.argv[1], lambda line: (line + b"\\n", []), max_connections=100, line_timeout_s=30, max_line=64)
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
server.close()
print(json.dumps(server.counts), flush=True)
"""


def test_at_the_open_file_limit_the_loop_pauses_instead_of_spinning(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", AT_THE_LIMIT, path, "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        clients = []
        for _ in range(20):  # more than the server's free descriptors: the rest wait in the backlog
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(5)
            sock.connect(path)
            clients.append(sock)
        time.sleep(1.0)  # at the limit: a failed accept every ACCEPT_PAUSE_S (0.1 s)
        for sock in clients:  # every one is served, those accepted late too
            sock.sendall(b"hi\n")
        replies = [sock.recv(64) for sock in clients]
        for sock in clients:
            sock.close()
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    counts = json.loads(stdout)
    assert replies == [b"hi\n"] * 20 and counts["served"] == 20
    assert 5 <= counts["accept_failed"] <= 40, counts
    assert stderr.count(b"cannot accept connections for now") == 1  # once per incident
