"""The blocking client's transport (service/client/http1.py): kept-alive connections, dropped ones, failures."""

import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest

from service.client import KVPoolClient, StepResult
from service.client.calls import Calls
from service.client.http1 import Answer, KeptConnection
from service.core.errors import SequenceNotFound
from tests.conftest import SMALL_POOL, Server, free_port


def test_a_connection_the_server_dropped_while_idle_is_replaced() -> None:
    """uvicorn closes an idle keep-alive connection after KVPOOL_KEEP_ALIVE_TIMEOUT_S: the next call opens
    a new one instead of failing, and the calls before it shared one connection."""
    server = Server({**SMALL_POOL, "KVPOOL_KEEP_ALIVE_TIMEOUT_S": "1"})
    try:
        with KVPoolClient(server.url) as client:
            client.create_sequence("kept")
            first = client.http._conn
            assert first is not None and first.sock is not None
            local = first.sock.getsockname()
            client.get_sequence("kept")
            assert client.http._conn is first and first.sock.getsockname() == local  # kept alive
            time.sleep(2.5)  # past the server's keep-alive timeout: it closes its end
            assert client.get_sequence("kept").seq_id == "kept"
            assert client.http._conn is not first
            assert client.free("kept") == 0
    finally:
        server.stop()


class Recorder(BaseHTTPRequestHandler):
    """A plain HTTP/1.1 server whose behaviour per path the test sets: `/ok` answers, `/echo` answers the
    body it read, `/slow` answers after a second, `/hangup` reads the request and closes without an answer.
    Records the requests it read."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append(f"{self.path} {body.decode()} {self.headers.get('Authorization')}")
        if self.path.endswith("/hangup"):
            self.close_connection = True
            return
        if self.path.endswith("/slow"):
            time.sleep(1.0)
        answer = body if self.path.endswith("/echo") else b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[str]]]:
    Recorder.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", Recorder.seen
    httpd.shutdown()
    httpd.server_close()


def call(conn: KeptConnection, path: str) -> Callable[[], object]:
    return lambda: conn.request("POST", path, b"{}", {"Content-Type": "application/json"})


def test_requests_carry_the_prefix_and_headers_and_are_never_sent_twice(recorder: tuple[str, list[str]]) -> None:
    url, seen = recorder
    conn = KeptConnection(url + "/base/", {"Authorization": "Bearer k"}, timeout=5)
    answer = conn.request("POST", "/ok", b'{"a": 1}', {"Content-Type": "application/json"})
    assert (answer.status_code, answer.content, answer.is_success) == (200, b'{"ok": true}', True)
    assert seen == ['/base/ok {"a": 1} Bearer k']
    # The server reads the request and hangs up: an error, the request not retried, the next one fine.
    with pytest.raises(httpx.RemoteProtocolError, match="/hangup"):
        call(conn, "/hangup")()
    assert seen[1:] == ["/base/hangup {} Bearer k"]
    assert call(conn, "/ok")().status_code == 200  # type: ignore[attr-defined]
    assert len(seen) == 3
    conn.close()


def test_a_slow_answer_times_out_and_the_next_call_opens_a_new_connection(recorder: tuple[str, list[str]]) -> None:
    url, seen = recorder
    conn = KeptConnection(url, {}, timeout=0.3)
    with pytest.raises(httpx.ReadTimeout):
        call(conn, "/slow")()
    assert conn._conn is None  # the late answer must not be read as the next call's
    time.sleep(1.0)
    assert call(conn, "/ok")().content == b'{"ok": true}'  # type: ignore[attr-defined]
    assert [s.split()[0] for s in seen] == ["/slow", "/ok"]
    conn.close()


def test_no_server_is_a_connect_error_and_bad_urls_are_refused() -> None:
    with socket.socket() as held:  # a port nothing listens on
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
    conn = KeptConnection(f"http://127.0.0.1:{port}", {}, timeout=2)
    with pytest.raises(httpx.ConnectError, match=str(port)):
        conn.request("GET", "/healthz")
    with pytest.raises(ValueError, match="not an http"):
        KeptConnection("unix:///tmp/kvpool.sock", {}, timeout=1)


def test_threads_sharing_a_connection_take_turns(recorder: tuple[str, list[str]]) -> None:
    """A client shared by threads (as httpx's was) gets each answer to its own request, never another's."""
    url, seen = recorder
    conn = KeptConnection(url, {}, timeout=5)
    wrong: list[tuple[bytes, bytes]] = []

    def caller(name: str) -> None:
        for i in range(40):
            body = f"{name}-{i}".encode() * 50
            got = conn.request("POST", "/echo", body).content
            if got != body:
                wrong.append((body[:10], got[:10]))

    threads = [threading.Thread(target=caller, args=(f"t{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.close()
    assert wrong == [] and len(seen) == 160


def test_a_request_sent_unanswered_goes_out_at_once_and_its_answer_comes_with_the_next_call(
    recorder: tuple[str, list[str]],
) -> None:
    """The server reads it before the caller's next call; its answer is handed over at that call, with the
    connection free again (what gets it may call too), and is never taken for the next call's answer."""
    url, seen = recorder
    conn = KeptConnection(url, {}, timeout=5)
    got: list[object] = []

    def answered(answer: object) -> None:
        got.append(answer)
        got.append(conn.request("POST", "/echo", b"from-the-handler").content)

    conn.send_unanswered("POST", "/echo", b"first", answered=answered)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s.split()[:2] for s in seen] == [["/echo", "first"]] and got == []  # sent, not read yet
    assert conn.request("POST", "/echo", b"second").content == b"second"
    first = got[0]
    assert isinstance(first, Answer) and (first.status_code, first.content) == (200, b"first")
    assert got[1:] == [b"from-the-handler"]
    assert [s.split()[1] for s in seen] == ["first", "second", "from-the-handler"]
    # settle() reads a pending answer without another request; close() too.
    conn.send_unanswered("POST", "/echo", b"third", answered=got.append)
    conn.settle()
    assert isinstance(got[-1], Answer) and got[-1].content == b"third"
    conn.send_unanswered("POST", "/hangup", b"fourth", answered=got.append)
    conn.close()
    assert isinstance(got[-1], httpx.RemoteProtocolError) and "/hangup" in str(got[-1])
    assert conn._conn is None and len(got) == 4


def test_an_unanswered_request_whose_connection_the_server_then_closed_is_still_answered() -> None:
    """uvicorn answers, then closes the idle connection after its keep-alive timeout: the answer waiting in
    the socket is read, and the next request goes on a new connection."""
    server = Server({**SMALL_POOL, "KVPOOL_KEEP_ALIVE_TIMEOUT_S": "1"})
    outcomes: list[object] = []
    try:
        with KVPoolClient(server.url) as client:
            client.create_sequence("a", token_ids=list(range(40)))
            client.create_sequence("b")
            first = client.http._conn
            client.send_unanswered(Calls.step([], None, False, ["a", "b"]), outcomes.append)
            time.sleep(2.5)  # the server answered, then closed its end
            with pytest.raises(SequenceNotFound):
                client.get_sequence("a")  # freed before the answer was read
            assert isinstance(outcomes[0], StepResult) and client.http._conn is not first
            # Refused whole (a sequence unknown): the error, typed; nothing of it freed.
            client.create_sequence("c")
            client.send_unanswered(Calls.step([], None, False, ["c", "gone"]), outcomes.append)
            assert client.get_sequence("c").seq_id == "c"
            assert isinstance(outcomes[-1], SequenceNotFound) and "gone" in str(outcomes[-1])
            assert client.free("c") == 0
    finally:
        server.stop()
