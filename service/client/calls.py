"""API v1 on the wire, for the clients: request bodies, results parsed with the wire models, errors.

Results are the server's own response models (service/wire/models.py), which ignore fields they do
not know, so a newer server's additions never break an older client. Errors are rebuilt from the
envelope's code and details by the wire's table of error codes.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import orjson
import torch
from pydantic import ValidationError

from service.wire.errors import error_from_envelope
from service.wire.models import AppendOut, AttendOut, ErrorOut, FreeOut, SequenceOut, StepOut, TensorOut
from service.wire.tensors import decode, encode

SequenceInfo = SequenceOut  # .seq_id .length .block_table .cached_tokens, and .ttl_s .expires_in_s on leases
AppendResult = AppendOut  # a SequenceInfo, plus the .slots of the appended tokens


@dataclass
class StepResult:
    """StepOut as the client hands it out: the MAX fields, with the two tensors decoded (CPU torch)."""

    lookup_table: torch.Tensor  # uint32 [batch, cols], sentinel-filled past each row's pages
    cache_lengths: torch.Tensor  # uint32 [batch]: tokens cached before this step
    input_lengths: list[int]
    max_prompt_length: int
    max_cache_length: int
    sentinel: int
    slots: list[list[int]]  # per sequence, the slots of its appended tokens
    instance_id: str | None = None  # the server's instance, when asked (instance=True)

    @classmethod
    def from_wire(cls, out: StepOut) -> "StepResult":
        return cls(
            lookup_table=_tensor("lookup_table", out.lookup_table),
            cache_lengths=_tensor("cache_lengths", out.cache_lengths),
            input_lengths=out.input_lengths,
            max_prompt_length=out.max_prompt_length,
            max_cache_length=out.max_cache_length,
            sentinel=out.sentinel,
            slots=out.slots,
            instance_id=out.instance_id,
        )


def _tensor(name: str, tensor: TensorOut) -> torch.Tensor:
    return decode(name, tensor.dtype, tensor.shape, tensor.data)


class Response(Protocol):
    """What check_response reads of an answer: httpx.Response (the async client) or http1.Answer (the sync one)."""

    @property
    def status_code(self) -> int: ...
    @property
    def content(self) -> bytes: ...
    @property
    def is_success(self) -> bool: ...
    @property
    def text(self) -> str: ...


def check_response(response: Response) -> bytes:
    """The body of a successful answer; otherwise raise its error envelope as the typed exception."""
    if response.is_success:
        return response.content
    try:
        error = ErrorOut.model_validate_json(response.content).error
    except ValidationError:  # not kvpool's envelope (e.g. a proxy's page)
        raise error_from_envelope(response.status_code, f"http_{response.status_code}", response.text[:500]) from None
    raise error_from_envelope(response.status_code, error.code, error.message, error.details)


T = TypeVar("T")


@dataclass
class Call(Generic[T]):
    """One HTTP request and how to turn its body (the bytes of a successful answer) into the method's result."""

    method: str
    path: str
    parse: Callable[[bytes], T]
    json: Any = None


def _step_result(body: bytes) -> StepResult:
    return StepResult.from_wire(StepOut.model_validate_json(body))


def _attend_out(body: bytes) -> torch.Tensor:
    return _tensor("out", AttendOut.model_validate_json(body).out)


def _freed_pages(body: bytes) -> int:
    return FreeOut.model_validate_json(body).freed_pages


def json_object(body: bytes) -> dict[str, Any]:
    result: dict[str, Any] = orjson.loads(body)
    return result


StepAppend = tuple[str, int] | tuple[str, int, Sequence[int] | None]


def _with_kv(body: dict[str, Any], k: torch.Tensor | None, v: torch.Tensor | None) -> dict[str, Any]:
    """k and v, or k alone (an MLA pool's latent); the server checks them against its pool."""
    if v is not None and k is None:
        raise ValueError("v needs k")
    if k is not None:
        body["k"] = encode(k)
    if v is not None:
        body["v"] = encode(v)
    return body


class Calls:
    """The requests of API v1, shared by the sync and async clients."""

    @staticmethod
    def create_sequence(
        seq_id: str | None,
        token_ids: Sequence[int] | None,
        ttl_s: float | None = None,
        cache_salt: str | None = None,
        instance: bool = False,
        reserve_to: int | None = None,
    ) -> Call[SequenceInfo]:
        fields: dict[str, Any] = {"seq_id": seq_id, "token_ids": None if token_ids is None else list(token_ids)}
        fields |= {"ttl_s": ttl_s, "cache_salt": cache_salt, "reserve_to": reserve_to}
        body = {name: value for name, value in fields.items() if value is not None}
        path = f"/v1/sequences{'?instance=true' if instance else ''}"
        return Call("POST", path, SequenceInfo.model_validate_json, body)

    @staticmethod
    def get_sequence(seq_id: str, instance: bool = False) -> Call[SequenceInfo]:
        query = "?instance=true" if instance else ""
        return Call("GET", f"/v1/sequences/{seq_id}{query}", SequenceInfo.model_validate_json)

    @staticmethod
    def append(
        seq_id: str,
        num_tokens: int | None,
        token_ids: Sequence[int] | None,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        instance: bool = False,
    ) -> Call[AppendResult]:
        if num_tokens is None:
            if token_ids is None:
                raise ValueError("give num_tokens or token_ids")
            num_tokens = len(token_ids)
        body: dict[str, Any] = {"num_tokens": num_tokens}
        if token_ids is not None:
            body["token_ids"] = list(token_ids)
        path = f"/v1/sequences/{seq_id}/append{'?instance=true' if instance else ''}"
        return Call("POST", path, AppendResult.model_validate_json, _with_kv(body, k, v))

    @staticmethod
    def fork(seq_id: str, child_id: str | None) -> Call[SequenceInfo]:
        body = {"seq_id": child_id} if child_id else None
        return Call("POST", f"/v1/sequences/{seq_id}/fork", SequenceInfo.model_validate_json, body)

    @staticmethod
    def free(seq_id: str, commit: bool = True) -> Call[int]:
        query = "" if commit else "?commit=false"
        return Call("DELETE", f"/v1/sequences/{seq_id}{query}", _freed_pages)

    @staticmethod
    def step(
        appends: Sequence[StepAppend], seq_ids: Sequence[str] | None, instance: bool = False, free: Sequence[str] = ()
    ) -> Call[StepResult]:
        items = []
        for a in appends:
            item: dict[str, Any] = {"seq_id": a[0], "num_tokens": a[1]}
            if len(a) > 2 and a[2] is not None:
                item["token_ids"] = list(a[2])
            items.append(item)
        body: dict[str, Any] = {"appends": items}
        if seq_ids is not None:
            body["seq_ids"] = list(seq_ids)
        if free:
            body["free"] = list(free)
        return Call("POST", f"/v1/step{'?instance=true' if instance else ''}", _step_result, body)

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
        return Call("POST", "/v1/attend", _attend_out, _with_kv(body, k, v))

    @staticmethod
    def get(path: str) -> Call[dict[str, Any]]:
        """GET a JSON object as a dict (the pool, IPC and probe endpoints)."""
        return Call("GET", path, json_object)
