"""The remote tier's reads and writes over RESP connections of its own. Reads: pipelined GETEX over a plain
socket, each value received straight where it is to stay (recv_into: a row of an array, or the parts of a pool
page with the value's header and checksum in small buffers beside), no copy in between. redis-py's Python
parser copies every value 3-4 times through a BytesIO, which capped restores well below what the store can
send (docs/benchmarks.md, "Figures behind the code").
EXISTS (read_int) counts what a restore will read before it allocates pages for it (on a cluster; one
node's count runs on the event loop, service.tiers.resp_async, with this module's encode, greeting and
parse_int).

One parser, two drivers: RespParser reads replies sans I/O (each reading a generator that yields the
memoryview to receive into next and is sent the byte count), driven here by RespConnection's blocking
sock.recv_into (the read thread: TLS, a cluster's nodes) and by resp_async.LoopSocket's
loop.sock_recv_into on a non-blocking socket (the event loop: one node over plain TCP or a unix socket).

GETEX key EX ttl rather than MGET: it refreshes the entry's TTL in the same round trip (a hot prefix
never ages out), it needs no two keys in one hash slot (Redis Cluster, service.tiers.cluster), and for
pages of 100 KiB and more it is as fast as MGET (measured: docs/benchmarks.md, "Figures behind the code").
Redis >= 6.2 or any Valkey. One batch of keys is one sendall; several batches may be in flight.

Writes (send_parts): pipelined SETs whose values go out from where they lie, a page's header, bytes and tag
as separate buffers of one sendmsg (joined only for TLS, whose sockets have no sendmsg), each answered +OK
(read_status). redis-py's pipeline built each value, then packed each command: ~1.4x the CPU per page
(docs/benchmarks.md, "Figures behind the code").

Values of one expected size only (others are read into a scratch buffer and reported by their size).
Connection: host/port or a unix path, TLS (rediss://: the ssl_* URL options redis-py takes for the CA,
client certificate and checks; its defaults, so reads and writes agree), AUTH (user, password) and
SELECT (db). Any failure (refused,
timeout, a protocol or server error) closes the socket and raises: the stream is never reused in an
unknown state, and the next call reconnects. A -MOVED/-ASK answer (Redis Cluster: the slot is
elsewhere now) is no failure of the stream: it is reported as REDIRECTED for that key.
"""

import inspect
import select
import socket
import ssl
from collections.abc import Generator, Mapping, Sequence
from typing import Any, TypeVar

from redis.connection import SSLConnection, parse_url

from service.remote_url import TLS_OPTIONS

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview
# A reading of RespParser: yields where to receive next, is sent how many bytes came, returns what it read.
Receive = Generator[memoryview, int, T]

LINE_BUF = 1 << 16
RECV_BUF = 8 << 20
# Sizes read_value returns besides a value's length: no such key; the key's slot is on another node
# (-MOVED/-ASK); the key holds another type (-WRONGTYPE: a list, say): a bad entry, not a failed store.
MISSING, REDIRECTED, WRONG_TYPE = -1, -2, -3
# An argument's part this large goes out from where it lies (send_parts); smaller ones are copied into the
# command's other bytes. IOV_MAX: buffers per sendmsg (Linux's UIO_MAXIOV).
BIG_PART, IOV_MAX = 1 << 12, 1024


_SSL_DEFAULTS = inspect.signature(SSLConnection.__init__).parameters


def tls_context(options: Mapping[str, Any]) -> ssl.SSLContext:
    """The TLS context redis-py would use for these ssl_* options (URL query), with its defaults."""

    def option(name: str) -> Any:
        return options.get(name, _SSL_DEFAULTS[name].default if name in _SSL_DEFAULTS else None)

    reqs = str(option("ssl_cert_reqs") or "required").lower()
    modes = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
    if reqs not in modes:
        raise ValueError(f"ssl_cert_reqs={reqs}: none, optional or required")
    ctx = ssl.create_default_context(cafile=option("ssl_ca_certs"), capath=option("ssl_ca_path"))
    ctx.check_hostname = reqs != "none" and str(option("ssl_check_hostname")).lower() in ("true", "1", "yes")
    ctx.verify_mode = modes[reqs]
    if option("ssl_certfile"):
        ctx.load_cert_chain(option("ssl_certfile"), option("ssl_keyfile"))
    return ctx


class RespError(Exception):
    """The server answered with an error, or with something other than what was asked for."""


def encode(commands: Sequence[Sequence[bytes]]) -> bytes:
    """Commands as RESP arrays of bulk strings, in one buffer (one write); the blocking and the asyncio
    connections (service.tiers.resp_async) send the same bytes."""
    parts = []
    for args in commands:
        parts.append(b"*%d\r\n" % len(args))
        for a in args:
            parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(parts)


def encode_parts(commands: Sequence[Sequence[Sequence[Buffer]]]) -> list[Buffer]:
    """encode()'s bytes as buffers for one sendmsg, each argument given as the buffers it is made of (a
    value's header, page and tag): parts of BIG_PART bytes and more stay where they lie, the rest is joined."""
    out: list[Buffer] = []
    small: list[bytes] = []
    for args in commands:
        small.append(b"*%d\r\n" % len(args))
        for arg in args:
            views = [memoryview(part).cast("B") for part in arg]
            small.append(b"$%d\r\n" % sum(view.nbytes for view in views))
            for view in views:
                if view.nbytes < BIG_PART:
                    small.append(bytes(view))
                    continue
                out.append(b"".join(small))
                out.append(view)
                small = []
            small.append(b"\r\n")
    out.append(b"".join(small))
    return out


def send_buffers(sock: socket.socket, buffers: Sequence[Buffer]) -> None:
    """All of `buffers`, in turn, through sendmsg (IOV_MAX at a time; a partial send goes on from where it
    stopped); blocking, bounded by the socket's timeout."""
    views = [view for view in (memoryview(b).cast("B") for b in buffers) if view.nbytes]
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first : first + IOV_MAX])
        while sent and first < len(views):
            if sent >= len(views[first]):
                sent -= len(views[first])
                first += 1
            else:
                views[first] = views[first][sent:]
                sent = 0


def check_ok(args: Sequence[bytes], line: bytes) -> None:
    """The reply line to `args` (AUTH, SELECT) is +OK, or RespError."""
    if not line.startswith(b"+"):
        raise RespError(f"{args[0].decode()}: {line[:200]!r}")


def parse_int(line: bytes) -> int:
    """An integer reply line (EXISTS) as its value, or REDIRECTED (-MOVED/-ASK); RespError otherwise."""
    if line[:1] == b":":
        return int(line[1:])
    if line.startswith((b"-MOVED ", b"-ASK ")):
        return REDIRECTED
    raise RespError(f"expected an integer: {line[:200]!r}")


class RespConnection:
    def __init__(
        self,
        host: str = "localhost",
        port: int = 6379,
        *,
        path: str | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        tls: ssl.SSLContext | None = None,
        timeout: float,
    ) -> None:
        self.host, self.port, self.path, self.tls = host, port, path, tls
        self.username, self.password, self.db = username, password, db
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.parser = RespParser()

    @classmethod
    def from_url(cls, url: str, timeout: float) -> "RespConnection":
        """redis[s]://[user:password@]host:port/db[?ssl_...] or unix:///path?db=N&password=..., as redis-py
        parses them."""
        kw = parse_url(url)
        return cls(
            kw.get("host", "localhost"),
            int(kw.get("port", 6379)),
            path=kw.get("path"),
            username=kw.get("username"),
            password=kw.get("password"),
            db=int(kw.get("db", 0) or 0),
            tls=tls_context(kw) if url.startswith("rediss://") else None,
            timeout=timeout,
        )

    @staticmethod
    def supports(url: str) -> bool:
        """Whether this reader can: redis://, unix://, and rediss:// with no TLS option but TLS_OPTIONS
        (others, e.g. OCSP, leave the reads to redis-py)."""
        if url.startswith("rediss://"):
            known = {"username", "password", "host", "port", "db", "connection_class", *TLS_OPTIONS}
            return set(parse_url(url)) <= known
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
            if self.tls is not None:
                try:
                    sock = self.tls.wrap_socket(sock, server_hostname=self.host)
                except BaseException:
                    sock.close()
                    raise
        # Room for the replies sent ahead while the current ones are checked (capped by net.core.rmem_max).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUF)
        self.sock = sock
        self.parser.reset()
        try:
            for args in self.greeting():
                self._expect_ok(args)
        except BaseException:
            self.close()
            raise
        return sock

    def greeting(self) -> list[list[bytes]]:
        """What a fresh connection sends first, each answered +OK (check_ok): AUTH (user, password) and
        SELECT (db), as the URL asks."""
        commands = []
        if self.password:
            auth = [self.username, self.password] if self.username else [self.password]
            commands.append([b"AUTH", *(a.encode() for a in auth)])
        if self.db:
            commands.append([b"SELECT", str(self.db).encode()])
        return commands

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def drop_if_closed(self) -> None:
        """Between exchanges (no reply due): close the idle connection if the store has closed it (a
        restart, its idle timeout) or it holds bytes nobody asked for, so that the next send connects
        afresh rather than failing (as redis-py checks a connection it takes from its pool)."""
        if self.sock is not None and select.select([self.sock], [], [], 0)[0]:
            self.close()

    def send(self, commands: Sequence[Sequence[bytes]]) -> None:
        """Send the commands in one write (their replies read in order; several sends may be in flight)."""
        self._write([encode(commands)])

    def send_parts(self, commands: Sequence[Sequence[Sequence[Buffer]]]) -> None:
        """send(), each argument given as the buffers it is made of (encode_parts): the large ones are sent
        from where they lie, in one sendmsg (over TLS joined first: an SSL socket has no sendmsg)."""
        self._write(encode_parts(commands))

    def _write(self, buffers: Sequence[Buffer]) -> None:
        """`buffers` in turn, connecting first if need be; any failure closes the connection and raises."""
        if self.sock is None:
            self._connect()
        assert self.sock is not None
        try:
            if len(buffers) == 1 or isinstance(self.sock, ssl.SSLSocket):
                self.sock.sendall(buffers[0] if len(buffers) == 1 else b"".join(buffers))
            else:
                send_buffers(self.sock, buffers)
        except BaseException:
            self.close()
            raise

    def send_keyed(self, command: bytes, keys: Sequence[bytes], *tail: bytes) -> None:
        """`command key *tail` for each key, in one write (one reply each)."""
        self.send([(command, key, *tail) for key in keys])

    def send_getex(self, keys: Sequence[bytes], ttl_s: int) -> None:
        """GETEX key EX ttl_s for each key (each reply read by read_value)."""
        self.send_keyed(b"GETEX", keys, b"EX", str(ttl_s).encode())

    def _expect_ok(self, args: Sequence[bytes]) -> None:
        self.send([args])
        check_ok(args, self._line())

    def _receive(self, gen: "Receive[T]") -> T:
        """Drive the parser's reading `gen` with blocking recv_into (bounded by the socket's timeout)."""
        assert self.sock is not None
        recv_into = self.sock.recv_into
        try:
            want = next(gen)
            while True:
                want = gen.send(recv_into(want))
        except StopIteration as done:
            return done.value

    def _line(self) -> bytes:
        return self._receive(self.parser.line())

    # -- reading ----------------------------------------------------------------------------------
    def read_value(self, into: Sequence[memoryview]) -> int:
        """The next reply, a value (RespParser.value): straight into the writable buffers `into`, filled
        in turn, when its size is what they hold together. Returns its size, or MISSING, REDIRECTED or
        WRONG_TYPE; any failure closes the connection and raises."""
        try:
            return self._receive(self.parser.value(into))
        except BaseException:
            self.close()
            raise

    def read_int(self) -> int:
        """The next reply, an integer (EXISTS), or REDIRECTED (-MOVED/-ASK)."""
        try:
            return parse_int(self._line())
        except BaseException:
            self.close()
            raise

    def read_status(self) -> bytes | None:
        """The next reply, a status (SET): None for +OK, the line of an error reply (-OOM, say: the stream
        goes on); anything else closes the connection and raises RespError."""
        try:
            line = self._line()
        except BaseException:
            self.close()
            raise
        if line == b"+OK":
            return None
        if line[:1] == b"-":
            return line
        self.close()
        raise RespError(f"expected a status: {line[:200]!r}")

    def command(self, *args: bytes) -> Any:
        """One command and its whole reply (nested lists, ints, bytes), for small control replies
        (CLUSTER SLOTS); raises RespError on an error reply."""
        self.send([args])
        try:
            return self._receive(self.parser.reply())
        except BaseException:
            self.close()
            raise


class RespParser:
    """The reading of RESP replies, sans I/O, for both connections: the blocking RespConnection (each
    receive a recv_into on its socket) and the event loop's LoopSocket (service.tiers.resp_async:
    loop.sock_recv_into on a non-blocking socket). Each reading is a generator that yields the
    memoryview to receive into next (the line buffer, or straight the caller's buffer: no copy) and is
    sent how many bytes came (0: the store closed the stream); it returns what it read. Lines come
    through a buffer of LINE_BUF bytes; values of the expected size go past it, straight where they
    are to stay."""

    def __init__(self) -> None:
        self.buf = bytearray(LINE_BUF)
        self.view = memoryview(self.buf)
        self.start = self.end = 0

    def reset(self) -> None:
        """Nothing buffered (a fresh connection)."""
        self.start = self.end = 0

    def _fill(self) -> "Receive[None]":
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):  # compact: the line so far to the front
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start : self.end]
            self.start, self.end = 0, n
            if n == len(self.buf):
                raise RespError("reply line too long")
        got = yield self.view[self.end :]
        if not got:
            raise ConnectionError("the store closed the connection")
        self.end += got

    def line(self) -> "Receive[bytes]":
        """The next line, without its CRLF."""
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.buf[self.start : i])
                self.start = i + 2
                return line
            yield from self._fill()

    def read_into(self, out: memoryview) -> "Receive[None]":
        """len(out) bytes of the stream into out: what is buffered, then straight from the socket."""
        n = min(len(out), self.end - self.start)
        out[:n] = self.view[self.start : self.start + n]
        self.start += n
        while n < len(out):
            got = yield out[n:]
            if not got:
                raise ConnectionError("the store closed the connection")
            n += got

    def _bulk_end(self) -> "Receive[None]":
        if (yield from self.line()) != b"":
            raise RespError("a value did not end where its length said")

    def value(self, into: Sequence[memoryview]) -> "Receive[int]":
        """The next reply, a value: straight into the writable buffers `into`, filled in turn, when its
        size is what they hold together (a value of another size, empty included, is read off into a
        scratch buffer). Returns its size, or MISSING (no such key), REDIRECTED (-MOVED/-ASK: the key's
        slot is on another node) or WRONG_TYPE (-WRONGTYPE: the key is no string); the stream stays
        usable after each of these (not after an exception: the caller closes it)."""
        line = yield from self.line()
        if line[:1] != b"$":
            if line.startswith((b"-MOVED ", b"-ASK ")):
                return REDIRECTED
            if line.startswith(b"-WRONGTYPE"):
                return WRONG_TYPE
            raise RespError(f"GETEX: {line[:200]!r}")
        size = int(line[1:])
        if size < 0:
            return MISSING
        if size == sum(len(part) for part in into):
            for part in into:
                yield from self.read_into(part)
        else:
            scratch = memoryview(bytearray(max(1, min(size, LINE_BUF))))
            for start in range(0, size, len(scratch)):
                yield from self.read_into(scratch[: min(len(scratch), size - start)])
        yield from self._bulk_end()
        return size

    def reply(self) -> "Receive[Any]":
        """The next whole reply (nested lists, ints, bytes); raises RespError on an error reply."""
        line = yield from self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            raise RespError(rest[:200].decode(errors="replace"))
        if kind == b"*":
            if int(rest) < 0:
                return None
            items = []
            for _ in range(int(rest)):
                items.append((yield from self.reply()))
            return items
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            out = bytearray(size)
            yield from self.read_into(memoryview(out))
            yield from self._bulk_end()
            return bytes(out)
        raise RespError(f"unexpected reply: {line[:200]!r}")
