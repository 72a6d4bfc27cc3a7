"""The two HTTP clients `kvpool bench http` can drive the server with.

Client and server share the machine's cores, so every microsecond the client spends is taken from
the server. httpx costs about as much CPU per request as the server's handling; the default "raw"
client, a keep-alive HTTP/1.1 connection over asyncio streams, costs a tenth of that, so the figures
measure the server rather than the load generator (docs/benchmarks.md, "Figures behind the code").
"""

import asyncio
from typing import Protocol
from urllib.parse import urlsplit

import httpx
import orjson


class Transport(Protocol):
    async def send(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        """(status, body) of one request with a JSON body (None: no body)."""
        ...

    async def close(self) -> None: ...


class TransportError(Exception):
    """The request could not be sent or its response not read."""


class RawTransport:
    """One keep-alive HTTP/1.1 connection; requests on it go one at a time."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the raw client speaks plain http://host:port only, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def send(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        data = b"" if body is None else orjson.dumps(body)
        head = f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-length: {len(data)}\r\n"
        if body is not None:
            head += "content-type: application/json\r\n"
        try:
            if self._writer is None:
                self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            assert self._reader is not None
            self._writer.write(head.encode("ascii") + b"\r\n" + data)
            status, headers = self._parse_head(await self._reader.readuntil(b"\r\n\r\n"))
            if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                payload = await self._read_chunked(self._reader)
            else:
                payload = await self._reader.readexactly(int(headers.get(b"content-length", b"0")))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            await self.close()
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        if headers.get(b"connection", b"").lower() == b"close":
            await self.close()
        return status, payload

    @staticmethod
    def _parse_head(raw: bytes) -> tuple[int, dict[bytes, bytes]]:
        lines = raw[:-4].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    @staticmethod
    async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                return b"".join(parts)
            parts.append(chunk[:-2])

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass


class HttpxTransport:
    """httpx.AsyncClient with one connection, for comparison with the raw client."""

    def __init__(self, url: str) -> None:
        self._client = httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1))

    async def send(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        content = None if body is None else orjson.dumps(body)
        headers = {"content-type": "application/json"} if body is not None else None
        try:
            response = await self._client.request(method, path, content=content, headers=headers)
        except httpx.TransportError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        return response.status_code, response.content

    async def close(self) -> None:
        await self._client.aclose()


def make_transport(kind: str, url: str) -> Transport:
    return RawTransport(url) if kind == "raw" else HttpxTransport(url)
