"""The remote tier's count (pipelined EXISTS) and page reads (pipelined GETEX) on the event loop.

Why on the loop: a restore's count is a few hundred bytes each way and the loop waits for it. On the
read thread it cost three wake-ups (the thread gets the job, its blocking recv returns, the loop gets
the result back), each a wait for a core when the machine is busy (~1.3 ms each, profiled with two
vLLM engines on 2 cores); on the loop it costs the one wake-up of the reply. The page reads hop the
same way, so on one node over plain TCP or a unix socket they run here too (RemoteStore.get_into_on_loop),
with no copy: LoopSocket receives each value straight into its page, with recv_into on a non-blocking
socket when the bytes are there and loop.sock_recv_into when they are not (asyncio streams would copy
every byte through their buffer), its replies parsed by resp.RespParser, the parser the blocking
RespConnection drives. The price: those receives and the checks of what arrives (the entries' checksum
or MAC) take the loop's thread, a few hundred microseconds per MiB. Over TLS (an SSL socket cannot be
read so) and on a cluster the page reads stay on the read thread (RemoteStore.get_into).

The count's connections are asyncio streams (plain, unix or TLS); the reads' are sockets of their own,
never shared with the read thread's RespConnection. Both are opened as RespConnection opens its socket,
from its settings (host and port or a unix path, its TLS context, its greeting: AUTH and SELECT), and
send what it sends (resp.encode); integer replies are parsed by resp.parse_int. Each connect and each
round trip of a count, and each send or receive of a read that has to wait, is bounded by the
connection's timeout (KVPOOL_REMOTE_TIMEOUT_S). Any failure (refused, a timeout, a reply that is no
integer, the stream cut, a cancelled caller) closes that connection and raises: the next call opens a
new one, and no late reply to a failed call is ever read as the answer to another.

A few connections rather than one behind a lock: restores run concurrently (one per POST /v1/sequences
in flight), and behind a lock each count would wait for the round trips of those before it, where on
their own connections the round trips overlap (the store answers each in microseconds; the time is in
the trip, and under load in the wait for a core, which several replies share; measured, 8 restores of
60 pages in flight on 2 cores: 0.6 ms each on 4 connections, 1.0 ms on one, 1.9 and 3 ms with six busy
processes beside). At most MAX_CONNECTIONS of each kind are open, each kept when its call is done (a
call that finds them all busy waits for one): a connection costs the store a client slot and a little
memory, and a burst of restores should not open one each.
"""

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from service.tiers.resp import (
    LINE_BUF,
    RECV_BUF,
    Receive,
    RespConnection,
    RespError,
    RespParser,
    check_ok,
    encode,
    parse_int,
)

MAX_CONNECTIONS = 4
T = TypeVar("T")


async def bounded(aw: Awaitable[T], timeout: float) -> T:
    """`aw`, or TimeoutError after `timeout` s: asyncio.timeout where there is one (3.11), which makes no
    task of its own as wait_for does (a turn of the loop more per round trip)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)


class LoopConnection:
    """One stream to the store, used by one caller at a time (LoopReader sees to it)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.loop = asyncio.get_running_loop()

    @classmethod
    async def open(cls, like: RespConnection) -> "LoopConnection":
        """Connected and greeted as `like` connects (the same address, TLS and AUTH/SELECT)."""
        if like.path is not None:
            reader, writer = await asyncio.open_unix_connection(like.path)
        else:  # (asyncio sets TCP_NODELAY on TCP streams, as RespConnection does)
            tls = like.tls
            host = like.host if tls is not None else None  # the name TLS checks, as RespConnection's wrap
            reader, writer = await asyncio.open_connection(like.host, like.port, ssl=tls, server_hostname=host)
        conn = cls(reader, writer)
        try:
            greeting = like.greeting()
            if greeting:  # (pipelined: a refused AUTH is seen first; the SELECT after it is not used)
                writer.write(encode(greeting))
                for args in greeting:
                    check_ok(args, await conn.line())
        except BaseException:
            conn.close()
            raise
        return conn

    async def exists(self, keys: Sequence[bytes]) -> list[int]:
        """EXISTS key for each key, in one write; the replies (1, 0, or resp.REDIRECTED) in order."""
        self.writer.write(encode([(b"EXISTS", key) for key in keys]))
        await self.writer.drain()
        # Each reply is one line: read them in the chunks they come in and split them at once (an await
        # per line cost the loop 0.75 us each, 45 us for a prompt of 60 pages).
        data = b""
        while data.count(b"\r\n") < len(keys):
            chunk = await self.reader.read(LINE_BUF)
            if not chunk:
                raise ConnectionError("the store closed the connection")
            data += chunk
        lines = data.split(b"\r\n")
        if len(lines) != len(keys) + 1 or lines[-1]:
            raise RespError(f"{len(lines) - 1} replies to {len(keys)} commands")
        return [parse_int(line) for line in lines[:-1]]

    async def line(self) -> bytes:
        return (await self.reader.readuntil(b"\r\n"))[:-2]

    def close(self) -> None:
        """Drop it, from any thread: transports are closed on their loop's thread. Aborted, not closed:
        nothing unsent is worth waiting for, and a graceful TLS close waits for the store's close_notify,
        which a loop that stops soon after (a server shutting down, asyncio.run returning) never reads,
        leaving the socket open. A closed loop can run nothing: its transports are left to the collector
        (which closes their sockets)."""
        if self.loop.is_closed():
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.writer.transport.abort()
        else:
            self.loop.call_soon_threadsafe(self.writer.transport.abort)


class LoopSocket:
    """One non-blocking socket to the store for the page reads (GETEX), used by one caller at a time
    (LoopReader.socket sees to it) on the loop that opened it, never by the read thread: replies are
    parsed by resp.RespParser, each receive a recv_into straight into the caller's buffer when the
    bytes are there, else loop.sock_recv_into (bounded by the timeout). Plain TCP or a unix socket
    (no TLS: an SSL socket cannot be read so)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock, self.timeout = sock, timeout
        self.loop = asyncio.get_running_loop()
        self.parser = RespParser()
        self.waited_s = 0.0  # time its receives waited for bytes not there yet (the store, or the loop, busy)

    @classmethod
    async def open(cls, like: RespConnection) -> "LoopSocket":
        """Connected and greeted as `like` connects (the same address, socket options and AUTH/SELECT)."""
        assert like.tls is None, "TLS reads stay on the read thread"
        loop = asyncio.get_running_loop()
        if like.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, like.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = await _connect_tcp(loop, like.host, like.port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUF)
        conn = cls(sock, like.timeout)
        try:
            greeting = like.greeting()
            if greeting:  # (pipelined: a refused AUTH is seen first; the SELECT after it is not used)
                await conn.send(encode(greeting))
                for args in greeting:
                    check_ok(args, await conn.receive(conn.parser.line()))
        except BaseException:
            conn.close()
            raise
        return conn

    async def send(self, data: bytes) -> None:
        """All of `data`: at once if the socket takes it, else on the loop, bounded by the timeout."""
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            await bounded(self.loop.sock_sendall(self.sock, memoryview(data)[sent:]), self.timeout)

    async def send_getex(self, keys: Sequence[bytes], ttl_s: int) -> None:
        """GETEX key EX ttl_s for each key, in one write (each reply read by read_value)."""
        ttl = str(ttl_s).encode()
        await self.send(encode([(b"GETEX", key, b"EX", ttl) for key in keys]))

    async def read_value(self, into: Sequence[memoryview]) -> int:
        """The next reply, a value, as RespConnection.read_value (resp.RespParser.value)."""
        return await self.receive(self.parser.value(into))

    async def receive(self, gen: Receive[T]) -> T:
        """Drive the parser's reading `gen`: each receive at once when the bytes are there (no turn of
        the loop, no timer), else awaited with loop.sock_recv_into, bounded by the timeout."""
        sock, loop, timeout = self.sock, self.loop, self.timeout
        try:
            want = next(gen)
            while True:
                try:
                    got = sock.recv_into(want)
                except BlockingIOError:
                    began = time.perf_counter()
                    try:
                        got = await bounded(loop.sock_recv_into(sock, want), timeout)
                    finally:
                        self.waited_s += time.perf_counter() - began
                want = gen.send(got)
        except StopIteration as done:
            return done.value

    def shutdown(self) -> None:
        """Cut the stream (from any thread): a read in progress on it ends, and its caller closes it."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the socket: by the caller that uses it, or when no read is in progress on it (an fd
        closed under a registered reader could be reused by the next socket)."""
        self.sock.close()


async def _connect_tcp(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket connected to the first address of host:port that accepts, with
    TCP_NODELAY (as RespConnection's)."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error or OSError(f"no address for {host}:{port}")


class LoopReader:
    """EXISTS on the running loop over up to MAX_CONNECTIONS streams opened like `like`'s, and (plain
    TCP or unix: reads_on_loop) the page reads over up to MAX_CONNECTIONS non-blocking sockets of
    their own (socket())."""

    def __init__(self, like: RespConnection) -> None:
        self.like, self.timeout = like, like.timeout
        self._idle: list[LoopConnection] = []
        self._open: set[LoopConnection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        self._idle_socks: list[LoopSocket] = []
        self._open_socks: set[LoopSocket] = set()
        self._sock_slots: asyncio.Semaphore | None = None

    @property
    def reads_on_loop(self) -> bool:
        """Whether socket() can serve the page reads: not over TLS (they stay on the read thread)."""
        return self.like.tls is None

    @contextlib.asynccontextmanager
    async def socket(self) -> AsyncIterator[LoopSocket]:
        """A socket for one caller's reads (opened, bounded by the timeout, or an idle one), kept when
        the caller is done; closed if anything is raised (a timeout, the store's error, a cancelled
        caller): its stream may hold replies no one will read."""
        self._bind()
        assert self._sock_slots is not None
        async with self._sock_slots:
            conn = self._idle_socks.pop() if self._idle_socks else None
            try:
                if conn is None:
                    conn = await bounded(LoopSocket.open(self.like), self.timeout)
                    self._open_socks.add(conn)
                yield conn
            except BaseException:
                if conn is not None:
                    self._open_socks.discard(conn)
                    conn.close()
                raise
            if conn in self._open_socks:
                self._idle_socks.append(conn)
            else:  # close() was called meanwhile: it only cut the stream
                conn.close()

    async def exists(self, keys: Sequence[bytes]) -> list[int]:
        """The replies to EXISTS key for each key; raises what the store or the stream raises (the
        connection then closed)."""
        async with self._bind():
            conn = self._idle.pop() if self._idle else None
            try:
                if conn is None:
                    conn = await bounded(LoopConnection.open(self.like), self.timeout)
                    self._open.add(conn)
                replies = await bounded(conn.exists(keys), self.timeout)
            except BaseException:
                if conn is not None:
                    self._open.discard(conn)
                    conn.close()
                raise
            if conn in self._open:  # (not if close() was called meanwhile: it closed it)
                self._idle.append(conn)
            return replies

    def _bind(self) -> asyncio.Semaphore:
        """The slots on the running loop; a first call, or a call on another loop than the last (a
        new asyncio.run), starts afresh: streams belong to the loop that opened them."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:
            self.close()
            self._loop, self._slots = loop, asyncio.Semaphore(MAX_CONNECTIONS)
            self._sock_slots = asyncio.Semaphore(MAX_CONNECTIONS)
        return self._slots

    def close(self) -> None:
        """Close every connection (those in a round trip too: it fails); the next call opens anew. A
        socket in a read is only cut (its reader closes it); idle ones are closed."""
        conns, self._open, self._idle = self._open, set(), []
        for conn in conns:
            conn.close()
        socks, idle, self._open_socks, self._idle_socks = self._open_socks, self._idle_socks, set(), []
        for sock in socks:
            if sock in idle:
                sock.close()
            else:
                sock.shutdown()
