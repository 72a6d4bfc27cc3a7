"""JSON request bodies, parsed the way FastAPI documents for speed: the endpoint takes `Request` and
pydantic validates the raw bytes (`Model.model_validate_json`), with no intermediate Python objects.

Every way a body can be wrong ends in the one 422 `invalid_request` envelope (service/server/errors.py
formats `RequestValidationError`), as FastAPI's own body handling would: no body where one is required,
a Content-Type other than JSON (none counts as not JSON, as in FastAPI's strict default), bytes that are
not JSON, JSON that the model refuses. Errors carry FastAPI's location prefix ("body", ...).
"""

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

M = TypeVar("M", bound=BaseModel)


Refused = Callable[[bytes], None]  # told the raw bytes of a body that is refused after it is read


async def read_json(request: Request, model: type[M], refused: Refused | None = None) -> M:
    """The body validated as `model`; a missing body is a 422."""
    body = await parse(request, model, optional=False, refused=refused)
    assert body is not None
    return body


async def read_optional_json(request: Request, model: type[M]) -> M | None:
    """The body validated as `model`, or None for no body or a JSON null (documented as `model | null`)."""
    return await parse(request, model, optional=True)


async def parse(request: Request, model: type[M], optional: bool, refused: Refused | None = None) -> M | None:
    try:
        raw = await request.body()
    except ClientDisconnect:
        # The client left mid-body: nobody reads the answer, but it must not be a 500 in the logs.
        raise HTTPException(400, "the client disconnected before the body arrived") from None
    if not raw:
        if optional:
            return None
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    if not is_json(request.headers.get("content-type")):
        if refused is not None:
            refused(raw)
        error = {"type": "content_type", "loc": ("body",), "input": None}
        raise RequestValidationError([{**error, "msg": "the body must be sent as Content-Type: application/json"}])
    if optional and raw.strip() == b"null":
        return None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if refused is not None:
            refused(raw)
        raise RequestValidationError([body_error(e) for e in exc.errors(include_url=False)]) from None


def is_json(content_type: str | None) -> bool:
    """application/json or application/<anything>+json, parameters (charset) ignored."""
    if not content_type:
        return False
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


def body_error(error: Any) -> Any:
    """A pydantic error located in the body, as FastAPI locates them."""
    return {**error, "loc": ("body", *error["loc"])}
