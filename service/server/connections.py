"""Connection limits: slow or idle clients must not hold the server's descriptors forever.

uvicorn (0.30-0.54) offers `timeout_keep_alive` (an idle connection after an answer) and `limit_concurrency`,
but nothing bounds the time to send a request's head: a connection that sends nothing, or half a head, is held
forever, and `limit_concurrency` counts those idle connections too, answering 503 to every new client once
they fill it. So kvpool adds, through public API only (uvicorn's `http=` setting takes a protocol class; this
one wraps uvicorn's own, it does not subclass it):

- `GuardedConnection`, the protocol uvicorn runs: a head deadline (KVPOOL_REQUEST_HEAD_TIMEOUT_S) from the
  connection's start or its previous answer to the next request's start, then the connection is closed; and a
  cap on open connections (KVPOOL_MAX_CONNECTIONS, below the open-file limit): a new connection over it closes
  the oldest connection with no request in flight, or, when every one is busy, is answered 503
  `too_many_connections` at once and closed.
- `RequestDeadline` (service/server/deadlines.py), a pure ASGI middleware: the body must arrive within
  KVPOOL_REQUEST_BODY_TIMEOUT_S of the head, or 408 `request_timeout`; it also tells the connection when a
  request starts and ends (current_connection(): a context variable set while uvicorn parses the connection's
  bytes, inherited by the task uvicorn starts for the request).
"""

import asyncio
import contextvars
import os
import resource
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, cast

import orjson

from service.ipc.fd_socket import MAX_CONNECTIONS as MAX_IPC_CONNECTIONS
from service.wire.errors import status_of

_CURRENT: contextvars.ContextVar["GuardedConnection | None"] = contextvars.ContextVar("kvpool_conn", default=None)


def current_connection() -> "GuardedConnection | None":
    """The guarded connection whose bytes started the running request (None outside the guard)."""
    return _CURRENT.get()


# Descriptors kept free beyond those open at start: the pool's IPC socket and its clients (at most
# fd_socket.MAX_CONNECTIONS), log files, a little slack.
RESERVED_FDS = 32 + MAX_IPC_CONNECTIONS


def raise_open_file_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20  # macOS reports infinity but refuses it; a million is plenty
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft if soft != resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    except (ValueError, OSError):
        return soft


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 32


def connection_cap(max_connections: int, fd_limit: int) -> int:
    """KVPOOL_MAX_CONNECTIONS, lowered to what the open-file limit leaves free (at least 1)."""
    return max(1, min(max_connections, fd_limit - open_fds() - RESERVED_FDS))


def _refusal() -> bytes:
    body = orjson.dumps(
        {"error": {"code": "too_many_connections", "message": "every connection is busy: retry in a moment"}}
    )
    head = (
        f"HTTP/1.1 {status_of('too_many_connections')} Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


REFUSAL = _refusal()
REFUSAL_LINGER_S = 1.0


def sweep_interval(timeout_s: float) -> float:
    """How often deadlines are checked: a deadline is enforced between timeout_s and timeout_s + this."""
    return min(timeout_s / 4, 1.0)


class ConnectionLimits:
    """The open connections of one server, oldest first, and what the guard did (counts).

    Head deadlines are checked by one sweep every sweep_interval() while connections are open, rather than by a
    timer per connection: re-arming a timer after every answer cost ~3.5 us per request with uvloop.
    """

    def __init__(self, max_connections: int, head_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.head_timeout_s = head_timeout_s
        self.interval = sweep_interval(head_timeout_s)
        self.open: OrderedDict[GuardedConnection, None] = OrderedDict()
        self.shed = self.refused = self.head_timeouts = 0
        self._sweep: asyncio.TimerHandle | None = None

    def admit(self, conn: "GuardedConnection") -> bool:
        if len(self.open) >= self.max_connections:
            victim = next((c for c in self.open if c.in_flight == 0), None)
            if victim is None:
                self.refused += 1
                return False
            self.shed += 1
            self.discard(victim)
            victim.close()
        self.open[conn] = None
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.interval, self.sweep)
        return True

    def discard(self, conn: "GuardedConnection") -> None:
        self.open.pop(conn, None)

    def sweep(self) -> None:
        """Close the connections past their head deadline; again in `interval` while any is open."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        late = [c for c in self.open if c.in_flight == 0 and c.deadline <= now]
        for conn in late:
            self.head_timeouts += 1
            self.discard(conn)
            conn.close()
        self._sweep = loop.call_later(self.interval, self.sweep) if self.open else None


class GuardedConnection(asyncio.Protocol):
    """uvicorn's HTTP protocol (`inner`), with a head deadline and a place under the connection cap."""

    limits: ConnectionLimits
    inner_class: Callable[..., asyncio.Protocol]

    def __init__(self, **kwargs: Any) -> None:
        self.inner: Any = self.inner_class(**kwargs)
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self.deadline = 0.0  # loop time by which the next request must start (while none is in flight)
        self.in_flight = 0
        self.admitted = False

    # -- asyncio.Protocol, forwarded to uvicorn's protocol -----------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop's transports do not subclass asyncio's)
        self.transport = transport
        self.deadline = self.loop.time() + self.limits.head_timeout_s
        if not self.limits.admit(self):
            # Answer at once, then half-close; closing with the request still unread would make the kernel
            # reset the connection, and the client could lose the answer. Closed when the client closes, or
            # after REFUSAL_LINGER_S at most.
            transport.write(REFUSAL)
            if transport.can_write_eof():
                transport.write_eof()
            self.loop.call_later(REFUSAL_LINGER_S, self.close)
            return
        self.admitted = True
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        token = _CURRENT.set(self)  # the request task uvicorn starts in here inherits it
        try:
            self.inner.data_received(data)
        finally:
            _CURRENT.reset(token)

    def eof_received(self) -> bool | None:
        if not self.admitted:
            self.close()
            return None
        result: bool | None = self.inner.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        self.limits.discard(self)
        if self.admitted:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # -- the head deadline (checked by ConnectionLimits.sweep) -------------------------------------
    def request_started(self) -> None:
        self.in_flight += 1

    def request_finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            # The next request's head (uvicorn's keep-alive timeout may close the connection sooner).
            self.deadline = self.loop.time() + self.limits.head_timeout_s


def guarded_protocol(limits: ConnectionLimits, inner: Callable[..., asyncio.Protocol]) -> type[asyncio.Protocol]:
    """The protocol class for uvicorn.Config(http=...): `inner` (uvicorn's own) under `limits`."""
    return type("GuardedHTTP", (GuardedConnection,), {"limits": limits, "inner_class": inner})
