"""A Unix-socket server for one-line requests, under the same rules as the HTTP side (issue 24).

One thread runs one `selectors` loop for every connection (no thread per connection, so a slow peer holds a
descriptor and a few hundred bytes, not a thread):

- a cap on open connections (`max_connections`, kept below the open-file limit by the caller): a new
  connection over it closes the oldest one (which is answered `too_many_connections`), as HTTP sheds its
  oldest idle connection; on EMFILE the loop stops accepting for a moment instead of spinning;
- a deadline for the whole line (`line_timeout_s` from the accept, not per recv: a peer that trickles a
  byte at a time is cut off as surely as a silent one), answered `request_timeout`;
- a line longer than `max_line` bytes is answered `invalid_request` without reading more.

Every connection gets exactly one reply line before it is closed; `answer(line)` builds it (and may attach
descriptors). The socket file is created by `bind` with mode 0600 and removed by the owner.
"""

import logging
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import orjson

log = logging.getLogger("kvpool.ipc")

Reply = tuple[bytes, list[int]]  # one line (ending in b"\n") and the descriptors to attach to it
ACCEPT_PAUSE_S = 0.1  # after EMFILE / ENFILE: what the loop waits before accepting again
ACCEPT_BATCH = 64  # connections accepted per turn of the loop, so that reads and deadlines get their turn too


def error_line(code: str, message: str) -> bytes:
    """The error envelope as one reply line."""
    return orjson.dumps({"error": {"code": code, "message": message}}) + b"\n"


class _Peer:
    __slots__ = ("buffer", "deadline")

    def __init__(self, deadline: float) -> None:
        self.buffer = b""
        self.deadline = deadline


class LineServer:
    """Serves `path` on a thread of its own until close(): each connection's first line -> answer(line)."""

    def __init__(
        self,
        path: str,
        answer: Callable[[bytes], Reply],
        max_connections: int,
        line_timeout_s: float,
        max_line: int,
    ) -> None:
        self.answer, self.max_connections = answer, max_connections
        self.line_timeout_s, self.max_line = line_timeout_s, max_line
        self.peers: OrderedDict[socket.socket, _Peer] = OrderedDict()  # oldest first = earliest deadline first
        self.counts = {"served": 0, "shed": 0, "timed_out": 0, "too_long": 0, "accept_failed": 0}
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            self.listener.bind(path)
            os.chmod(path, 0o600)
            self.listener.listen(socket.SOMAXCONN)
            self.listener.setblocking(False)
            self.selector.register(self.listener, selectors.EVENT_READ)
            self.selector.register(self._wake_r, selectors.EVENT_READ)
        except BaseException:
            self._close_sockets()
            raise
        self._accept_paused_until = 0.0
        self._at_limit = False
        self._stop = False
        self.thread = threading.Thread(target=self._serve, name="kvpool-ipc-socket", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop the loop, close every connection and the listener (idempotent)."""
        if self.thread.is_alive():
            self._stop = True
            self._wake_w.send(b"x")
            self.thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for conn in list(self.peers):
            self._drop(conn)
        for sock in (self.listener, self._wake_r, self._wake_w):
            sock.close()
        self.selector.close()

    # -- the loop ------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop:
            now = time.monotonic()
            timeout = None
            if self.peers:
                timeout = max(0.0, next(iter(self.peers.values())).deadline - now)
            if self._accept_paused_until:
                timeout = min(timeout if timeout is not None else ACCEPT_PAUSE_S, ACCEPT_PAUSE_S)
            for key, _ in self.selector.select(timeout):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is not self._wake_r:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            self._expire(time.monotonic())

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:  # the backlog is drained: an incident at the open-file limit is over
                self._at_limit = False
                return
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: stop accepting a moment rather than spin
                self.counts["accept_failed"] += 1
                if not self._at_limit:  # logged once per incident
                    log.warning("the IPC socket cannot accept connections for now: %s", exc)
                self._at_limit = True
                self.selector.unregister(self.listener)
                self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S
                return
            if len(self.peers) >= self.max_connections:
                oldest = next(iter(self.peers))
                self.counts["shed"] += 1
                self._finish(oldest, error_line("too_many_connections", "too many connections to the IPC socket"))
            conn.setblocking(False)
            self.peers[conn] = _Peer(time.monotonic() + self.line_timeout_s)
            self.selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        peer = self.peers.get(conn)
        if peer is None:
            return
        try:
            chunk = conn.recv(self.max_line + 1 - len(peer.buffer))
        except BlockingIOError:
            return
        except OSError:  # a reset: nobody to answer
            self._drop(conn)
            return
        peer.buffer += chunk
        end = peer.buffer.find(b"\n")
        if end >= 0 or not chunk:  # a whole line, or the peer's EOF ends it
            line = peer.buffer if end < 0 else peer.buffer[:end]
            if len(line) <= self.max_line:
                self.counts["served"] += 1
                self._finish(conn, *self._answer(line))
                return
        if len(peer.buffer) > self.max_line:
            self.counts["too_long"] += 1
            self._finish(conn, error_line("invalid_request", f"the request is longer than {self.max_line} bytes"))

    def _answer(self, line: bytes) -> Reply:
        try:
            return self.answer(line)
        except Exception as exc:  # a bug: answered, logged, and the loop goes on
            log.exception("the IPC socket's answer failed")
            return error_line("internal_error", f"{type(exc).__name__}: {exc}"), []

    def _expire(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self.selector.register(self.listener, selectors.EVENT_READ)
        while self.peers:
            conn, peer = next(iter(self.peers.items()))
            if peer.deadline > now:
                return
            self.counts["timed_out"] += 1
            message = f"the request line did not arrive within {self.line_timeout_s:g} seconds"
            self._finish(conn, error_line("request_timeout", message))

    def _finish(self, conn: socket.socket, reply: bytes, fds: list[int] | None = None) -> None:
        """Send the one reply line (a small one: it fits the socket's empty send buffer) and close."""
        try:
            if fds:
                socket.send_fds(conn, [reply], fds)
            else:
                conn.send(reply)
        except OSError:  # the peer left first: no one to tell
            pass
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self.peers.pop(conn, None)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
