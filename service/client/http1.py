"""The blocking client's transport: one kept-alive HTTP/1.1 connection on the standard library's http.client.

Why not httpx here: the vLLM connector makes its calls from threads that share the GIL with the engine's
forward, so each call's Python time is time the forward or the call waits for. A call through httpx's
Client costs ~0.48 ms of CPU on the client's side, through http.client ~0.12 ms (a step call against a
local `kvpool serve`; 0.66 against 0.19 ms with a torch loop in another thread: docs/vllm.md, "The
client's own time"). The async client keeps httpx.

Failures are raised as httpx's exceptions (ConnectError, ReadTimeout, RemoteProtocolError, ...), the
types both clients have always raised, so a caller's `except httpx.HTTPError` is unchanged. A
connection the server closed while idle (uvicorn drops idle ones after a few seconds) is found before
the next request is written, as urllib3 and httpcore do, and replaced; a request is never sent twice.

A request may also be sent without waiting for its answer (`send_unanswered`): the caller pays for the
write, not for the round trip, and the answer is read when the connection is next used (by then it has
usually arrived), before the next request goes out. The vLLM connector frees a finished request's
sequences so: the engine never needs their answer, and under load each round trip waited for a core.
"""

import http.client
import select
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from urllib.parse import urlsplit

import httpx


@dataclass
class Answer:
    """What the clients read of a response (the attributes httpx.Response has under the same names)."""

    status_code: int
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


Answered = Callable[[Answer | httpx.HTTPError], None]  # gets the answer of a request sent unanswered


class KeptConnection:
    """Requests one at a time on one connection to `base_url` (http or https, with an optional path
    prefix), each with `headers`; `timeout` bounds the connect and every read and write, in seconds.
    Threads sharing it take turns (a lock), as a client shared by threads expects; a thread that wants
    its calls to run beside another's uses a client of its own."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout: float) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.headers = headers
        self.prefix = url.path.rstrip("/")
        self._host, self._timeout = url.hostname, timeout
        tls = url.scheme == "https"
        self._port = url.port or (443 if tls else 80)
        # (made once: loading the CA certificates costs milliseconds, a reconnect should not pay it again)
        self._context = ssl.create_default_context() if tls else None
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        # A request sent unanswered: its connection (its answer comes on that one), and what gets the answer.
        self._unanswered: tuple[http.client.HTTPConnection, str, str, Answered] | None = None

    def _connection(self) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is not None and (conn.sock is None or _dropped(conn.sock)):
            self._drop()  # closed by the server while idle (or after a Connection: close answer)
            conn = None
        if conn is None:
            if self._context is not None:
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout, context=self._context)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            try:
                conn.connect()
            except TimeoutError as exc:
                raise httpx.ConnectTimeout(f"connecting to {self._host}:{self._port}: {exc}") from exc
            except OSError as exc:
                raise httpx.ConnectError(f"connecting to {self._host}:{self._port}: {exc}") from exc
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conn = conn
        return conn

    def request(
        self, method: str, path: str, content: bytes | None = None, headers: dict[str, str] | None = None
    ) -> Answer:
        answer = self._call(method, path, content, headers, None)
        assert answer is not None
        return answer

    def send_unanswered(
        self,
        method: str,
        path: str,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        *,
        answered: Answered,
    ) -> None:
        """Write a request now and read its answer when the connection is next used (the next request, or
        settle() or close()): then `answered` gets the Answer, or the httpx error that reading it raised, on
        that caller's thread once the connection is free again. A write that fails raises here (the request
        may have gone out in part: the caller decides what that means) and leaves nothing to read."""
        self._call(method, path, content, headers, answered)

    def _call(
        self,
        method: str,
        path: str,
        content: bytes | None,
        headers: dict[str, str] | None,
        answered: Answered | None,
    ) -> Answer | None:
        """The request written, after the answer of the one sent unanswered before it is read; then its own
        answer read, or (`answered`) left for later."""
        earlier = None
        try:
            with self._lock:
                earlier = self._read_unanswered()
                conn = self._connection()
                self._send(conn, method, path, content, headers)
                if answered is not None:
                    self._unanswered = (conn, method, path, answered)
                    return None
                return self._receive(conn, method, path)
        finally:
            if earlier is not None:
                earlier()  # (with the connection free again: it may make requests of its own)

    def settle(self) -> None:
        """Read the answer of a request sent unanswered, if one is left, and hand it over."""
        with self._lock:
            answered = self._read_unanswered()
        if answered is not None:
            answered()

    def _read_unanswered(self) -> Callable[[], None] | None:
        if self._unanswered is None:
            return None
        conn, method, path, answered = self._unanswered
        self._unanswered = None
        outcome: Answer | httpx.HTTPError
        try:
            outcome = self._receive(conn, method, path)
        except httpx.HTTPError as exc:
            outcome = exc
        return partial(answered, outcome)

    def _send(
        self,
        conn: http.client.HTTPConnection,
        method: str,
        path: str,
        content: bytes | None,
        headers: dict[str, str] | None,
    ) -> None:
        try:
            try:
                conn.request(method, self.prefix + path, body=content, headers={**self.headers, **(headers or {})})
            except TimeoutError as exc:
                raise httpx.WriteTimeout(f"{method} {path}: {exc}") from exc
            except (OSError, http.client.HTTPException) as exc:
                raise httpx.WriteError(f"{method} {path}: {exc!r}") from exc
        except BaseException:  # (an error, or an interrupt mid-write)
            self._drop()  # the connection's state is unknown: the next request opens a new one
            raise

    def _receive(self, conn: http.client.HTTPConnection, method: str, path: str) -> Answer:
        try:
            try:
                response = conn.getresponse()
                return Answer(response.status, response.read())
            except TimeoutError as exc:
                raise httpx.ReadTimeout(f"{method} {path}: no answer in {self._timeout} s") from exc
            except (http.client.HTTPException, ConnectionResetError) as exc:
                # RemoteDisconnected, a bad status line, a body cut short: the server broke the exchange.
                raise httpx.RemoteProtocolError(f"{method} {path}: {exc!r}") from exc
            except OSError as exc:
                raise httpx.ReadError(f"{method} {path}: {exc}") from exc
        except BaseException:  # (an error, or an interrupt mid-read)
            self._drop()  # the connection's state is unknown: the next request opens a new one
            raise

    def close(self) -> None:
        """Close the connection, first reading the answer of a request sent unanswered, if one is left."""
        self.settle()
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _dropped(sock: socket.socket) -> bool:
    """A kept-alive socket with something to read before a request is sent: the server's EOF (or bytes
    it had no business sending); either way the connection is not fit for the next request."""
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True
