"""The shared tier's read path: MGET over a plain socket, each value received straight into its row of
a preallocated array (recv_into), no copy in between. redis-py's Python parser copies every value 3-4
times through a BytesIO, which capped restores at a third of what the store can send (BENCHMARKS.md).

Only MGET, only values of one expected size (others are read into a scratch buffer and reported as
wrong). Connection: redis:// (host, port, user and password for AUTH, database for SELECT) and unix://
(path, password, db), parsed by redis-py's parse_url; rediss:// (TLS) is not supported here (the store
reads through redis-py then). Any failure (refused, timeout, a protocol or server error) closes the
socket and raises: the stream is never reused in an unknown state, and the next call reconnects.
"""

import socket
from collections.abc import Sequence

import numpy as np
from redis.connection import parse_url

LINE_BUF = 1 << 16
RECV_BUF = 8 << 20


class RespError(Exception):
    """The server answered with an error, or with something other than what was asked for."""


class MgetReader:
    def __init__(self, url: str, timeout: float) -> None:
        kw = parse_url(url)
        self.path: str | None = kw.get("path")
        self.host, self.port = kw.get("host", "localhost"), int(kw.get("port", 6379))
        self.username, self.password = kw.get("username"), kw.get("password")
        self.db = int(kw.get("db", 0) or 0)
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.buf = bytearray(LINE_BUF)
        self.view = memoryview(self.buf)
        self.start = self.end = 0

    @staticmethod
    def supports(url: str) -> bool:
        return url.startswith(("redis://", "unix://"))

    # -- connection -------------------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        if self.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            sock.connect(self.path)
        else:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Room for the reply sent ahead while the current one is checked (capped by net.core.rmem_max).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUF)
        self.sock, self.start, self.end = sock, 0, 0
        try:
            if self.password:
                auth = [self.username, self.password] if self.username else [self.password]
                self._simple([b"AUTH", *(a.encode() for a in auth)])
            if self.db:
                self._simple([b"SELECT", str(self.db).encode()])
        except BaseException:
            self.close()
            raise
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _send(self, args: Sequence[bytes]) -> None:
        assert self.sock is not None
        parts = [b"*%d\r\n" % len(args)]
        for a in args:
            parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(parts))

    def _simple(self, args: Sequence[bytes]) -> None:
        self._send(args)
        line = self._line()
        if not line.startswith(b"+"):
            raise RespError(f"{args[0].decode()}: {line[:200]!r}")

    # -- reading ----------------------------------------------------------------------------------
    def _fill(self) -> None:
        assert self.sock is not None
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):  # compact: the line so far to the front
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start : self.end]
            self.start, self.end = 0, n
            if n == len(self.buf):
                raise RespError("reply line too long")
        got = self.sock.recv_into(self.view[self.end :])
        if not got:
            raise ConnectionError("the store closed the connection")
        self.end += got

    def _line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.buf[self.start : i])
                self.start = i + 2
                return line
            self._fill()

    def _read_into(self, out: memoryview) -> None:
        """len(out) bytes of the stream into out: what is buffered, then straight from the socket."""
        assert self.sock is not None
        n = min(len(out), self.end - self.start)
        out[:n] = self.view[self.start : self.start + n]
        self.start += n
        while n < len(out):
            got = self.sock.recv_into(out[n:])
            if not got:
                raise ConnectionError("the store closed the connection")
            n += got

    def _skip(self, count: int) -> None:
        scratch = memoryview(bytearray(min(count, LINE_BUF)))
        while count:
            step = min(count, len(scratch))
            self._read_into(scratch[:step])
            count -= step

    def send_mget(self, keys: Sequence[bytes]) -> None:
        """Send MGET keys (its reply read by read_mget; several may be in flight, read in order)."""
        if self.sock is None:
            self._connect()
        try:
            self._send([b"MGET", *keys])
        except BaseException:
            self.close()
            raise

    def read_mget(self, num: int, rows: np.ndarray) -> list[int]:
        """The reply to the oldest MGET in flight, of `num` keys: value i straight into rows[i] when its
        size is rows.shape[1]. Returns the sizes: -1 for a missing key, another size for a value of the
        wrong size (read and dropped)."""
        value_nbytes = rows.shape[1]
        sizes: list[int] = []
        try:
            head = self._line()
            if head[:1] != b"*" or int(head[1:]) != num:
                raise RespError(f"MGET: {head[:200]!r}")
            for i in range(num):
                line = self._line()
                if line[:1] != b"$":
                    raise RespError(f"MGET: {line[:200]!r}")
                size = int(line[1:])
                sizes.append(size)
                if size < 0:
                    continue
                if size == value_nbytes:
                    self._read_into(memoryview(rows[i]))
                else:
                    self._skip(size)
                if self._line() != b"":
                    raise RespError("MGET: a value did not end where its length said")
        except BaseException:
            self.close()
            raise
        return sizes
