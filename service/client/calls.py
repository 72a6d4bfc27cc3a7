"""API v1 on the wire, for the clients: request bodies, typed results, error envelopes -> exceptions."""

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
import torch

from service.core import errors
from service.ipc.attach import PoolLost
from service.wire.tensors import decode, encode

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


def check_response(response: httpx.Response) -> Any:
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


def identity(body: Any) -> Any:
    return body


StepAppend = tuple[str, int] | tuple[str, int, Sequence[int] | None]


class Calls:
    """The requests of API v1, shared by the sync and async clients."""

    @staticmethod
    def create_sequence(
        seq_id: str | None,
        token_ids: Sequence[int] | None,
        ttl_s: float | None = None,
        cache_salt: str | None = None,
    ) -> Call[SequenceInfo]:
        fields: dict[str, Any] = {"seq_id": seq_id, "token_ids": None if token_ids is None else list(token_ids)}
        fields |= {"ttl_s": ttl_s, "cache_salt": cache_salt}
        body = {k: v for k, v in fields.items() if v is not None}
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
