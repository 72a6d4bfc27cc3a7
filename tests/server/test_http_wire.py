"""HTTP/1.1 on the wire, against a real `kvpool serve` over raw sockets: every answer complete and in order.

Keep-alive, pipelining, an error answer and a chunked request body on one connection, `Connection: close`,
and uvicorn's own 400 for a malformed request.
"""

import socket

import orjson

from tests.conftest import Server


def read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[bytes, bytes], bytes]:
    """One HTTP/1.1 response with a Content-Length from `sock` (bytes already read sit in `buffer`)."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-head: {bytes(buffer)!r}"
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    length = int(headers[b"content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    buffer[:] = rest[length:]
    return status, headers, rest[:length]


def request(method: str, path: str, body: object = None, extra: str = "") -> bytes:
    data = b"" if body is None else orjson.dumps(body)
    head = f"{method} {path} HTTP/1.1\r\nhost: kvpool\r\ncontent-length: {len(data)}\r\n{extra}"
    if body is not None:
        head += "content-type: application/json\r\n"
    return head.encode() + b"\r\n" + data


def test_keep_alive_pipelining_close_and_malformed_requests(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        buffer = bytearray()
        # Three requests in one write: three answers, in order, on the one connection.
        sock.sendall(
            request("POST", "/v1/sequences", {"seq_id": "p"})
            + request("POST", "/v1/sequences/p/append", {"num_tokens": 5})
            + request("GET", "/v1/sequences/p")
        )
        created = read_response(sock, buffer)
        appended = read_response(sock, buffer)
        got = read_response(sock, buffer)
        assert created[0] == 201 and orjson.loads(created[2])["block_table"] == []
        assert appended[0] == 200 and orjson.loads(appended[2])["slots"] == [0, 1, 2, 3, 4]
        assert got[0] == 200 and orjson.loads(got[2]) == {
            "seq_id": "p",
            "length": 5,
            "block_table": [0, 1],
            "cached_tokens": 0,
        }
        assert got[1][b"content-type"] == b"application/json" and b"date" in got[1] and b"server" in got[1]
        # An error answer and a chunked request body on the same connection.
        sock.sendall(request("POST", "/v1/sequences/nope/append", {"num_tokens": 1}))
        missing = read_response(sock, buffer)
        assert missing[0] == 404 and orjson.loads(missing[2])["error"]["code"] == "sequence_not_found"
        body = orjson.dumps({"seq_id": "p"})
        chunked = b"DELETE /v1/sequences/p HTTP/1.1\r\nhost: kvpool\r\ntransfer-encoding: chunked\r\n\r\n"
        sock.sendall(chunked + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        freed = read_response(sock, buffer)
        assert freed[0] == 200 and orjson.loads(freed[2]) == {"seq_id": "p", "freed_pages": 2}
        # Connection: close: the whole answer arrives, then the server closes.
        sock.sendall(request("GET", "/healthz", extra="connection: close\r\n"))
        status, headers, payload = read_response(sock, buffer)
        assert (status, headers[b"connection"], orjson.loads(payload)) == (200, b"close", {"status": "ok"})
        assert sock.recv(1) == b"" and buffer == b""

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")  # uvicorn answers 400 itself, then closes
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        assert received.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert received.endswith(b"Invalid HTTP request received.")
    assert server.client.get("/v1/pool").json()["pages_used"] == 0
