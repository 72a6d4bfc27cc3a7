"""The remote tier's count (pipelined EXISTS) on the event loop, over asyncio streams.

Why on the loop: a restore's count is a few hundred bytes each way and the loop waits for it. On the
read thread it cost three wake-ups (the thread gets the job, its blocking recv returns, the loop gets
the result back), each a wait for a core when the machine is busy (~1.3 ms each, profiled with two
vLLM engines on 2 cores); on the loop it costs the one wake-up of the reply. The page reads
(RemoteStore.get_into) stay on the read thread: they receive megabytes straight into pool pages with
a blocking recv_into, which streams cannot do without a copy.

A connection is opened as RespConnection opens its socket, from its settings (host and port or a unix
path, its TLS context, its greeting: AUTH and SELECT), and sends what it sends (resp.encode); replies are
parsed by resp.parse_int. Each connect and each round trip is bounded by the connection's timeout
(KVPOOL_REMOTE_TIMEOUT_S). Any failure (refused, a timeout, a reply that is no integer, the stream cut,
a cancelled caller) closes that connection and raises: the next call opens a new one.

A few connections rather than one behind a lock: restores run concurrently (one per POST /v1/sequences
in flight), and behind a lock each count would wait for the round trips of those before it, where on
their own connections the round trips overlap (the store answers each in microseconds; the time is in
the trip, and under load in the wait for a core, which several replies share; measured, 8 restores of
60 pages in flight on 2 cores: 0.6 ms each on 4 connections, 1.0 ms on one, 1.9 and 3 ms with six busy
processes beside). At most MAX_CONNECTIONS are open, each kept when its count is done (a count that
finds them all busy waits for one): a connection costs the store a client slot and a little memory, and
a burst of restores should not open one each.
"""

import asyncio
import sys
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from service.tiers.resp import LINE_BUF, RespConnection, RespError, check_ok, encode, parse_int

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
        """Close it, from any thread: transports are closed on their loop's thread. A closed loop can
        run nothing: its transports are left to the collector (which closes their sockets)."""
        if self.loop.is_closed():
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.writer.close()
        else:
            self.loop.call_soon_threadsafe(self.writer.close)


class LoopReader:
    """EXISTS on the running loop over up to MAX_CONNECTIONS connections opened like `like`'s."""

    def __init__(self, like: RespConnection) -> None:
        self.like, self.timeout = like, like.timeout
        self._idle: list[LoopConnection] = []
        self._open: set[LoopConnection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None

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
        return self._slots

    def close(self) -> None:
        """Close every connection (those in a round trip too: it fails); the next call opens anew."""
        conns, self._open, self._idle = self._open, set(), []
        for conn in conns:
            conn.close()
