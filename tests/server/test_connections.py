"""The connection guard around uvicorn's own protocols, httptools and h11 (service/server/connections.py).

In process: uvicorn.Server in a thread on a free port, the app of create_app(), the guard with short deadlines.
tests/chaos/test_connections.py checks the same against `kvpool serve` at scale.
"""

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.config import Settings
from service.server.app import create_app
from service.server.connections import RESERVED_FDS, ConnectionLimits, connection_cap, guarded_protocol, open_fds
from tests.conftest import free_port

GEOMETRY = dict(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8, device="cpu")
HEAD_S = 0.3
PROTOCOLS = {"httptools": HttpToolsProtocol, "h11": H11Protocol}


@contextmanager
def serving(
    protocol: str, max_connections: int = 100, body_timeout_s: float = 0.6
) -> Iterator[tuple[int, ConnectionLimits]]:
    app = create_app(Settings(request_body_timeout_s=body_timeout_s, **GEOMETRY))
    limits = ConnectionLimits(max_connections, HEAD_S)
    port = free_port()
    config = uvicorn.Config(
        app,
        port=port,
        http=guarded_protocol(limits, PROTOCOLS[protocol]),
        timeout_keep_alive=60,  # so that only the guard's deadline closes idle connections here
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield port, limits
    finally:
        server.should_exit = True
        thread.join(30)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes `sock` (reads until EOF, discarding what comes)."""
    started = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - started


def answer(sock: socket.socket) -> bytes:
    """One whole answer (head and Content-Length body) on a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_late_head_is_closed_and_a_request_in_flight_is_not(protocol: str) -> None:
    with serving(protocol) as (port, limits):
        with connect(port) as silent, connect(port) as half:
            half.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            assert HEAD_S * 0.8 < closed_after(silent) < HEAD_S + 1
            assert closed_after(half) < HEAD_S + 1
        assert limits.head_timeouts == 2
        # Kept alive: after each answer the next head has HEAD_S again, so the connection lives on while used.
        with connect(port) as sock:
            for _ in range(3):
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert answer(sock).startswith(b"HTTP/1.1 200 ")
                time.sleep(HEAD_S / 2)
            assert [c.in_flight for c in limits.open] == [0]
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # half of the next head
            assert closed_after(sock) < HEAD_S + 1
        # A body that is on its way (deadline 0.6 s) outlives the head deadline (0.3 s).
        with connect(port) as sock:
            body = b'{"seq_id": "b"}'
            sock.sendall(b"POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
            time.sleep(HEAD_S * 1.5)
            sock.sendall(body[5:])
            assert answer(sock).startswith(b"HTTP/1.1 201 ")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_late_body_is_answered_408_and_closed(protocol: str) -> None:
    with serving(protocol) as (port, _), connect(port) as sock:
        sock.sendall(b"POST /v1/sequences HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        sock.sendall(b"Content-Length: 100\r\n\r\n{")
        started = time.monotonic()
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        assert 0.5 < time.monotonic() - started < 2
        assert data.startswith(b"HTTP/1.1 408 ") and b"connection: close" in data.lower()
        assert data.endswith(
            b'"code":"request_timeout","message":"the request body did not arrive within '
            b'KVPOOL_REQUEST_BODY_TIMEOUT_S=0.6 seconds"}}'
        )


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_over_the_cap_the_oldest_idle_connection_makes_room(protocol: str) -> None:
    with serving(protocol, max_connections=3) as (port, limits):
        with connect(port) as first, connect(port) as second, connect(port) as third:
            deadline = time.monotonic() + 5  # (all three accepted, in order: under load it can take a while)
            while len(limits.open) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            with connect(port) as new:
                new.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert answer(new).startswith(b"HTTP/1.1 200 ")
                assert closed_after(first) < 0.2  # the oldest idle one
                assert limits.shed == 1 and limits.refused == 0 and len(limits.open) == 3
            del second, third


def test_the_cap_leaves_room_below_the_open_file_limit() -> None:
    assert connection_cap(4096, 1_000_000) == 4096
    assert connection_cap(4096, 1024) == 1024 - open_fds() - RESERVED_FDS
    assert connection_cap(4096, 10) == 1
