"""KVPoolClient (blocking, on http.client: service/client/http1.py) and AsyncKVPoolClient (on httpx): one
method per endpoint, torch tensors in and out.

Results are the wire's response models (StepResult: its tensors decoded). Errors come back as the
core's typed exceptions (OutOfPages, SequenceNotFound, ...), chosen by the envelope's `code`, their
fields from its `details`; an unknown code becomes a plain KVPoolError carrying it. The request
building and parsing live in `Calls`, so the two clients differ only in how they send. `attach()` maps the pool
itself (see service/ipc/attach.py) so K/V never has to travel as JSON.

    with KVPoolClient("http://127.0.0.1:8000") as client, client.attach() as pool:
        client.create_sequence("s1")
        step = client.step([("s1", 5)])
        pool.write(k, v, step.slots[0])          # k, v: [num_layers, 5, num_kv_heads, head_dim]
        out = client.attend(0, ["s1"], q, q_lens=[5])
"""

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import orjson
import torch

from service.client.calls import AppendResult, Call, Calls, SequenceInfo, StepAppend, StepResult, T, check_response
from service.client.http1 import Answer, KeptConnection
from service.core.errors import KVPoolError
from service.ipc.attach import AttachedPool

JSON_HEADERS = {"Content-Type": "application/json"}


class _Base:
    def __init__(self, base_url: str, api_key: str | None) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _body(call: Call[Any]) -> dict[str, Any]:
    """The request's body as the transports' arguments: JSON encoded by orjson (a 2,048-token list in ~20 us, the
    standard library's json, which httpx's json= uses, in ~180 us: the vLLM connector sends one per lookup)."""
    return {} if call.json is None else {"content": orjson.dumps(call.json), "headers": JSON_HEADERS}


class KVPoolClient(_Base):
    """Blocking client, one request at a time (one kept-alive connection); a context manager that closes it."""

    def __init__(
        self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 30.0
    ) -> None:
        super().__init__(base_url, api_key)
        self.http = KeptConnection(base_url, self.headers, timeout)

    def _run(self, call: Call[T]) -> T:
        return call.parse(check_response(self.http.request(call.method, call.path, **_body(call))))

    def create_sequence(
        self,
        seq_id: str | None = None,
        token_ids: Sequence[int] | None = None,
        ttl_s: float | None = None,
        cache_salt: str | None = None,
        instance: bool = False,
        reserve_to: int | None = None,
    ) -> SequenceInfo:
        """ttl_s: the sequence's lease (default KVPOOL_DEFAULT_TTL_S; 0: none), renewed by every call naming it.
        cache_salt: prefixes are shared only between sequences with the same salt (and tenant).
        instance: the answer's .instance_id names the server's instance (whose pool holds the pages).
        reserve_to: the token ids past the cached prefix up to this many also appended (for K/V written
        through the pool's mapping), where pages allow: the answer's .length says whether they were."""
        return self._run(Calls.create_sequence(seq_id, token_ids, ttl_s, cache_salt, instance, reserve_to))

    def get_sequence(self, seq_id: str, instance: bool = False) -> SequenceInfo:
        """instance: the answer's .instance_id names the server's instance."""
        return self._run(Calls.get_sequence(seq_id, instance))

    def append(
        self,
        seq_id: str,
        num_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        instance: bool = False,
    ) -> AppendResult:
        return self._run(Calls.append(seq_id, num_tokens, token_ids, k, v, instance))

    def fork(self, seq_id: str, child_id: str | None = None) -> SequenceInfo:
        return self._run(Calls.fork(seq_id, child_id))

    def free(self, seq_id: str, commit: bool = True) -> int:
        """Free a sequence; returns how many of its pages lost their last reference. commit=False: its pages
        not committed yet are released uncommitted (no prefix hits them)."""
        return self._run(Calls.free(seq_id, commit))

    def step(
        self,
        appends: Sequence[StepAppend],
        seq_ids: Sequence[str] | None = None,
        instance: bool = False,
        free: Sequence[str] = (),
    ) -> StepResult:
        """All appends or none, then the lookup table of `seq_ids` (default: the appended ones), then the
        sequences `free` freed (committing, as free()); instance: the result's .instance_id names the
        server's instance."""
        return self._run(Calls.step(appends, seq_ids, instance, free))

    def send_unanswered(self, call: Call[T], answered: Callable[[T | KVPoolError | httpx.HTTPError], None]) -> None:
        """Make a call (`Calls.step(...)`, `Calls.append(...)`, ...) without waiting for kvpool's answer: the request
        is written now, and its answer read before this client's next request (or at settle() or close()), when
        `answered` gets the call's result, or the error (KVPoolError: refused, nothing of it applied; httpx's: it
        may have run). A write that fails raises httpx's error here (the request may have gone out in part)."""

        def read(answer: Answer | httpx.HTTPError) -> None:
            if isinstance(answer, httpx.HTTPError):
                answered(answer)
                return
            try:
                result = call.parse(check_response(answer))
            except KVPoolError as exc:
                answered(exc)
                return
            answered(result)

        self.http.send_unanswered(call.method, call.path, answered=read, **_body(call))

    def settle(self) -> None:
        """Read the answer of a call sent unanswered (send_unanswered), if one is left, and hand it over."""
        self.http.settle()

    def attend(
        self,
        layer: int,
        seq_ids: Sequence[str],
        q: torch.Tensor,
        q_lens: Sequence[int] | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return self._run(Calls.attend(layer, seq_ids, q, q_lens, k, v, scale, sliding_window, softcap))

    def pool(self) -> dict[str, Any]:
        return self._run(Calls.get("/v1/pool"))

    def ipc(self) -> dict[str, Any]:
        return self._run(Calls.get("/v1/ipc"))

    def healthz(self) -> dict[str, Any]:
        return self._run(Calls.get("/healthz"))

    def readyz(self) -> dict[str, Any]:
        return self._run(Calls.get("/readyz"))

    def attach(self) -> AttachedPool:
        """Map the pool into this process (a sealed memfd or shared memory, or a CUDA IPC handle on a GPU)."""
        return AttachedPool(self.ipc(), self.api_key)

    def check_attached(self, pool: AttachedPool) -> None:
        """Raise PoolLost if the server no longer serves the pool `pool` mapped."""
        pool.check(self.pool()["instance_id"])  # (/readyz answers 503 while the server drains)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "KVPoolClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKVPoolClient(_Base):
    """The same methods as KVPoolClient, awaitable."""

    def __init__(
        self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 30.0
    ) -> None:
        super().__init__(base_url, api_key)
        self.http = httpx.AsyncClient(base_url=base_url, headers=self.headers, timeout=timeout)

    async def _run(self, call: Call[T]) -> T:
        return call.parse(check_response(await self.http.request(call.method, call.path, **_body(call))))

    async def create_sequence(
        self,
        seq_id: str | None = None,
        token_ids: Sequence[int] | None = None,
        ttl_s: float | None = None,
        cache_salt: str | None = None,
        instance: bool = False,
        reserve_to: int | None = None,
    ) -> SequenceInfo:
        """ttl_s: the sequence's lease (default KVPOOL_DEFAULT_TTL_S; 0: none), renewed by every call naming it.
        cache_salt: prefixes are shared only between sequences with the same salt (and tenant).
        instance: the answer's .instance_id names the server's instance (whose pool holds the pages).
        reserve_to: the token ids past the cached prefix up to this many also appended (for K/V written
        through the pool's mapping), where pages allow: the answer's .length says whether they were."""
        return await self._run(Calls.create_sequence(seq_id, token_ids, ttl_s, cache_salt, instance, reserve_to))

    async def get_sequence(self, seq_id: str, instance: bool = False) -> SequenceInfo:
        """instance: the answer's .instance_id names the server's instance."""
        return await self._run(Calls.get_sequence(seq_id, instance))

    async def append(
        self,
        seq_id: str,
        num_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        instance: bool = False,
    ) -> AppendResult:
        return await self._run(Calls.append(seq_id, num_tokens, token_ids, k, v, instance))

    async def fork(self, seq_id: str, child_id: str | None = None) -> SequenceInfo:
        return await self._run(Calls.fork(seq_id, child_id))

    async def free(self, seq_id: str, commit: bool = True) -> int:
        """Free a sequence; returns how many of its pages lost their last reference (commit: as free())."""
        return await self._run(Calls.free(seq_id, commit))

    async def step(
        self,
        appends: Sequence[StepAppend],
        seq_ids: Sequence[str] | None = None,
        instance: bool = False,
        free: Sequence[str] = (),
    ) -> StepResult:
        return await self._run(Calls.step(appends, seq_ids, instance, free))

    async def attend(
        self,
        layer: int,
        seq_ids: Sequence[str],
        q: torch.Tensor,
        q_lens: Sequence[int] | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return await self._run(Calls.attend(layer, seq_ids, q, q_lens, k, v, scale, sliding_window, softcap))

    async def pool(self) -> dict[str, Any]:
        return await self._run(Calls.get("/v1/pool"))

    async def ipc(self) -> dict[str, Any]:
        return await self._run(Calls.get("/v1/ipc"))

    async def healthz(self) -> dict[str, Any]:
        return await self._run(Calls.get("/healthz"))

    async def readyz(self) -> dict[str, Any]:
        return await self._run(Calls.get("/readyz"))

    async def attach(self) -> AttachedPool:
        """Map the pool into this process (a sealed memfd or shared memory, or a CUDA IPC handle on a GPU)."""
        description = await self.ipc()
        # The memfd's descriptors come over a local socket: quick, but blocking.
        return await asyncio.to_thread(AttachedPool, description, self.api_key)

    async def check_attached(self, pool: AttachedPool) -> None:
        """Raise PoolLost if the server no longer serves the pool `pool` mapped."""
        pool.check((await self.pool())["instance_id"])  # (/readyz answers 503 while the server drains)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncKVPoolClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
