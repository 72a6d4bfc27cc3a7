"""uvicorn's httptools protocol, with each response written to the socket in one send.

uvicorn writes a response's head and its body with two `transport.write` calls. With TCP_NODELAY
(uvicorn sets it) each is its own send(2): two trips through the loopback TCP stack and two wake-ups
of the client for one answer. Under `kvpool bench http` those two sends were a quarter of the
server's CPU. `CoalescingTransport` holds writes back until the response is complete (uvicorn then
calls `on_response_complete`) or, for anything else (a streamed body, uvicorn's own error answers),
until the event loop's next turn, and writes them as one buffer: the same bytes in the same order.
"""

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """An asyncio transport whose writes are joined and sent at the end of the response."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:  # at the latest on the loop's next turn: nothing waits longer than that
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(d) for d in self._pending)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()  # close() sends what was written before it
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()  # abort() discards what is buffered
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

    def on_response_complete(self) -> None:
        self.transport.flush()  # type: ignore[attr-defined]
        super().on_response_complete()
