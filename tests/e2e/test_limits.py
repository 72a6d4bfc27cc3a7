"""KVPOOL_MAX_REQUEST_BYTES against a real server: 413 `payload_too_large` before the body is read in full.

Raw sockets show the "before": the server answers while the client still holds most of the body back.
"""

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import torch

from tests.conftest import Server, enc

LIMIT = 4096


def padded(body: dict[str, Any], size: int) -> bytes:
    """`body` as JSON with trailing spaces up to exactly `size` bytes (still valid JSON)."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return int(lines[0].split()[1]), json.loads(rest[:length])


def request_head(server: Server, path: str, extra: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n{extra}\r\n"
    ).encode()


def test_request_bodies_over_the_limit_get_413(start_server: Any) -> None:
    server: Server = start_server({"KVPOOL_MAX_REQUEST_BYTES": str(LIMIT)})
    c = server.client
    c.post("/v1/sequences", json={"seq_id": "s"})
    torch.manual_seed(2)
    # 1 token of k/v in 2 layers is 2 × 2 × 16 float32 = 256 bytes each, ~700 bytes of JSON for both.
    body = {"num_tokens": 1, "k": enc(torch.randn(2, 1, 2, 16)), "v": enc(torch.randn(2, 1, 2, 16))}
    headers = {"Content-Type": "application/json"}

    # Exactly at the limit is accepted; one byte more is not, and changes nothing.
    r = c.post("/v1/sequences/s/append", content=padded(body, LIMIT), headers=headers)
    assert r.status_code == 200 and r.json()["length"] == 1
    r = c.post("/v1/sequences/s/append", content=padded(body, LIMIT + 1), headers=headers)
    assert r.status_code == 413
    assert r.json() == {
        "error": {
            "code": "payload_too_large",
            "message": f"the request body is larger than KVPOOL_MAX_REQUEST_BYTES={LIMIT} bytes",
        }
    }
    assert c.get("/v1/sequences/s").json()["length"] == 1

    # The same for a chunked body (no Content-Length): counted as it streams in.
    def chunks(size: int) -> Iterator[bytes]:
        data = padded(body, size)
        yield from (data[i : i + 1000] for i in range(0, len(data), 1000))

    r = httpx.post(f"{server.url}/v1/sequences/s/append", content=chunks(LIMIT), headers=headers)
    assert "content-length" not in r.request.headers and r.status_code == 200 and r.json()["length"] == 2
    r = httpx.post(f"{server.url}/v1/sequences/s/append", content=chunks(LIMIT + 1), headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert c.get("/v1/sequences/s").json()["length"] == 2

    # A declared length over the limit is refused from the headers alone: no body byte is ever sent.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request_head(server, "/v1/sequences/s/append", f"Content-Length: {10**12}\r\n"))
        status, answer = read_response(sock)
    assert status == 413 and answer["error"]["code"] == "payload_too_large"

    # A chunked body is cut off at the first chunk past the limit, the rest never sent.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request_head(server, "/v1/sequences/s/append", "Transfer-Encoding: chunked\r\n"))
        for _ in range(3):  # 3 × 1500 bytes > 4096
            sock.sendall(b"5dc\r\n" + b"[" * 1500 + b"\r\n")
        status, answer = read_response(sock)
    assert status == 413 and answer["error"]["code"] == "payload_too_large"

    assert c.get("/v1/sequences/s").json()["length"] == 2
    assert c.get("/readyz").status_code == 200
