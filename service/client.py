"""KVPoolClient (sync) and AsyncKVPoolClient on httpx: one method per endpoint, torch tensors in and out.

Errors come back as the core's typed exceptions (OutOfPages, SequenceNotFound, ...), chosen by the
envelope's `code`; an unknown code becomes a plain KVPoolError carrying it. `attach()` maps the pool
itself (see service/attach.py) so K/V never has to travel as JSON.

    with KVPoolClient("http://127.0.0.1:8000") as client, client.attach() as pool:
        client.create_sequence("s1")
        step = client.step([("s1", 5)])
        pool.write(k, v, step.slots[0])          # k, v: [num_layers, 5, num_kv_heads, head_dim]
        out = client.attend(0, ["s1"], q, q_lens=[5])
"""

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
import torch

from service.attach import AttachedPool, PoolLost
from service.core import errors
from service.tensors import decode, encode

__all__ = ["AppendResult", "AsyncKVPoolClient", "AttachedPool", "KVPoolClient", "PoolLost", "SequenceInfo"]

ERROR_CLASSES: dict[str, type[errors.KVPoolError]] = {
    cls.code: cls
    for cls in (
        errors.InvalidRequest,
        errors.SequenceNotFound,
        errors.SequenceExists,
        errors.OutOfPages,
        errors.QuotaExceeded,
        errors.Unauthorized,
        errors.Forbidden,
        errors.PayloadTooLarge,
        PoolLost,
    )
}
_SEQ_ID = re.compile(r"sequence '([^']*)'")
_PAGES = re.compile(r"need (\d+) pages, only (\d+)")


def error_from_envelope(status: int, code: str, message: str) -> errors.KVPoolError:
    """The typed exception of an error envelope; `status` is kept as `exc.status`."""
    cls = ERROR_CLASSES.get(code, errors.KVPoolError)
    exc = cls.__new__(cls)
    errors.KVPoolError.__init__(exc, message)  # the subclasses' own __init__ take parsed fields, not a message
    if cls is errors.KVPoolError:
        exc.code = code
    if isinstance(exc, errors.SequenceNotFound | errors.SequenceExists):
        match = _SEQ_ID.search(message)
        exc.seq_id = match.group(1) if match else ""
    if isinstance(exc, errors.OutOfPages):
        match = _PAGES.search(message)
        exc.needed, exc.available = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    exc.status = status  # type: ignore[attr-defined]
    return exc


def _check(response: httpx.Response) -> Any:
    if response.is_success:
        return response.json()
    try:
        error = response.json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = f"http_{response.status_code}", response.text[:500]
    raise error_from_envelope(response.status_code, code, message)


@dataclass
class SequenceInfo:
    seq_id: str
    length: int
    block_table: list[int]
    cached_tokens: int


@dataclass
class AppendResult(SequenceInfo):
    slots: list[int]


@dataclass
class StepResult:
    lookup_table: torch.Tensor  # uint32 [batch, cols], sentinel-filled past each row's pages
    cache_lengths: torch.Tensor  # uint32 [batch]: tokens cached before this step
    input_lengths: list[int]
    max_prompt_length: int
    max_cache_length: int
    sentinel: int
    slots: list[list[int]]  # per sequence, the slots of its appended tokens


def _step_result(body: dict[str, Any]) -> StepResult:
    lut, lens = body["lookup_table"], body["cache_lengths"]
    return StepResult(
        lookup_table=decode("lookup_table", lut["dtype"], lut["shape"], lut["data"]),
        cache_lengths=decode("cache_lengths", lens["dtype"], lens["shape"], lens["data"]),
        input_lengths=body["input_lengths"],
        max_prompt_length=body["max_prompt_length"],
        max_cache_length=body["max_cache_length"],
        sentinel=body["sentinel"],
        slots=body["slots"],
    )


def _attend_out(body: dict[str, Any]) -> torch.Tensor:
    out = body["out"]
    return decode("out", out["dtype"], out["shape"], out["data"])


T = TypeVar("T")


@dataclass
class Call(Generic[T]):
    """One HTTP request and how to turn its JSON body into the method's result."""

    method: str
    path: str
    parse: Callable[[Any], T]
    json: Any = None


def _identity(body: Any) -> Any:
    return body


StepAppend = tuple[str, int] | tuple[str, int, Sequence[int] | None]


class _Calls:
    """The requests of API v1, shared by the sync and async clients."""

    @staticmethod
    def create_sequence(seq_id: str | None, token_ids: Sequence[int] | None) -> Call[SequenceInfo]:
        body = {k: v for k, v in (("seq_id", seq_id), ("token_ids", token_ids)) if v is not None}
        return Call("POST", "/v1/sequences", lambda b: SequenceInfo(**b), body)

    @staticmethod
    def append(
        seq_id: str,
        num_tokens: int | None,
        token_ids: Sequence[int] | None,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> Call[AppendResult]:
        if num_tokens is None:
            if token_ids is None:
                raise ValueError("give num_tokens or token_ids")
            num_tokens = len(token_ids)
        body: dict[str, Any] = {"num_tokens": num_tokens}
        if token_ids is not None:
            body["token_ids"] = list(token_ids)
        if k is not None or v is not None:
            if k is None or v is None:
                raise ValueError("k and v come together")
            body["k"], body["v"] = encode(k), encode(v)
        return Call("POST", f"/v1/sequences/{seq_id}/append", lambda b: AppendResult(**b), body)

    @staticmethod
    def step(appends: Sequence[StepAppend], seq_ids: Sequence[str] | None) -> Call[StepResult]:
        items = []
        for a in appends:
            item: dict[str, Any] = {"seq_id": a[0], "num_tokens": a[1]}
            if len(a) > 2 and a[2] is not None:
                item["token_ids"] = list(a[2])
            items.append(item)
        body: dict[str, Any] = {"appends": items}
        if seq_ids is not None:
            body["seq_ids"] = list(seq_ids)
        return Call("POST", "/v1/step", _step_result, body)

    @staticmethod
    def attend(
        layer: int,
        seq_ids: Sequence[str],
        q: torch.Tensor,
        q_lens: Sequence[int] | None,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float | None,
        sliding_window: int | None,
        softcap: float | None,
    ) -> Call[torch.Tensor]:
        body: dict[str, Any] = {"layer": layer, "seq_ids": list(seq_ids), "q": encode(q)}
        optional = {"q_lens": list(q_lens) if q_lens is not None else None, "scale": scale}
        optional |= {"sliding_window": sliding_window, "softcap": softcap}
        body |= {name: value for name, value in optional.items() if value is not None}
        if k is not None or v is not None:
            if k is None or v is None:
                raise ValueError("k and v come together")
            body["k"], body["v"] = encode(k), encode(v)
        return Call("POST", "/v1/attend", _attend_out, body)


class _Base:
    def __init__(self, base_url: str, api_key: str | None) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}


class KVPoolClient(_Base):
    """Blocking client; a context manager that closes its connection pool."""

    def __init__(
        self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 30.0
    ) -> None:
        super().__init__(base_url, api_key)
        self.http = httpx.Client(base_url=base_url, headers=self.headers, timeout=timeout)

    def _run(self, call: Call[T]) -> T:
        return call.parse(_check(self.http.request(call.method, call.path, json=call.json)))

    def create_sequence(self, seq_id: str | None = None, token_ids: Sequence[int] | None = None) -> SequenceInfo:
        return self._run(_Calls.create_sequence(seq_id, token_ids))

    def get_sequence(self, seq_id: str) -> SequenceInfo:
        return self._run(Call("GET", f"/v1/sequences/{seq_id}", lambda b: SequenceInfo(**b)))

    def append(
        self,
        seq_id: str,
        num_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> AppendResult:
        return self._run(_Calls.append(seq_id, num_tokens, token_ids, k, v))

    def fork(self, seq_id: str, child_id: str | None = None) -> SequenceInfo:
        body = {"seq_id": child_id} if child_id else None
        return self._run(Call("POST", f"/v1/sequences/{seq_id}/fork", lambda b: SequenceInfo(**b), body))

    def free(self, seq_id: str) -> int:
        """Free a sequence; returns how many of its pages lost their last reference."""
        return self._run(Call("DELETE", f"/v1/sequences/{seq_id}", lambda b: int(b["freed_pages"])))

    def step(self, appends: Sequence[StepAppend], seq_ids: Sequence[str] | None = None) -> StepResult:
        return self._run(_Calls.step(appends, seq_ids))

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
        return self._run(_Calls.attend(layer, seq_ids, q, q_lens, k, v, scale, sliding_window, softcap))

    def pool(self) -> dict[str, Any]:
        return self._run(Call("GET", "/v1/pool", _identity))

    def ipc(self) -> dict[str, Any]:
        return self._run(Call("GET", "/v1/ipc", _identity))

    def healthz(self) -> dict[str, Any]:
        return self._run(Call("GET", "/healthz", _identity))

    def readyz(self) -> dict[str, Any]:
        return self._run(Call("GET", "/readyz", _identity))

    def attach(self) -> AttachedPool:
        """Map the pool into this process (shared memory, or a CUDA IPC handle on a GPU)."""
        return AttachedPool(self.ipc())

    def check_attached(self, pool: AttachedPool) -> None:
        """Raise PoolLost if the server no longer serves the pool `pool` mapped."""
        pool.check(self.readyz()["instance_id"])

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
        return call.parse(_check(await self.http.request(call.method, call.path, json=call.json)))

    async def create_sequence(self, seq_id: str | None = None, token_ids: Sequence[int] | None = None) -> SequenceInfo:
        return await self._run(_Calls.create_sequence(seq_id, token_ids))

    async def get_sequence(self, seq_id: str) -> SequenceInfo:
        return await self._run(Call("GET", f"/v1/sequences/{seq_id}", lambda b: SequenceInfo(**b)))

    async def append(
        self,
        seq_id: str,
        num_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> AppendResult:
        return await self._run(_Calls.append(seq_id, num_tokens, token_ids, k, v))

    async def fork(self, seq_id: str, child_id: str | None = None) -> SequenceInfo:
        body = {"seq_id": child_id} if child_id else None
        return await self._run(Call("POST", f"/v1/sequences/{seq_id}/fork", lambda b: SequenceInfo(**b), body))

    async def free(self, seq_id: str) -> int:
        """Free a sequence; returns how many of its pages lost their last reference."""
        return await self._run(Call("DELETE", f"/v1/sequences/{seq_id}", lambda b: int(b["freed_pages"])))

    async def step(self, appends: Sequence[StepAppend], seq_ids: Sequence[str] | None = None) -> StepResult:
        return await self._run(_Calls.step(appends, seq_ids))

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
        return await self._run(_Calls.attend(layer, seq_ids, q, q_lens, k, v, scale, sliding_window, softcap))

    async def pool(self) -> dict[str, Any]:
        return await self._run(Call("GET", "/v1/pool", _identity))

    async def ipc(self) -> dict[str, Any]:
        return await self._run(Call("GET", "/v1/ipc", _identity))

    async def healthz(self) -> dict[str, Any]:
        return await self._run(Call("GET", "/healthz", _identity))

    async def readyz(self) -> dict[str, Any]:
        return await self._run(Call("GET", "/readyz", _identity))

    async def attach(self) -> AttachedPool:
        """Map the pool into this process (shared memory, or a CUDA IPC handle on a GPU)."""
        return AttachedPool(await self.ipc())

    async def check_attached(self, pool: AttachedPool) -> None:
        """Raise PoolLost if the server no longer serves the pool `pool` mapped."""
        pool.check((await self.readyz())["instance_id"])

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncKVPoolClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
