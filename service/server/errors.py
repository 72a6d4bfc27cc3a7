"""The one place where errors become HTTP responses: {"error": {"code", "message", "details"?}}.

Statuses come from the wire's table of error codes (service/wire/errors.py), which the client reads too.
"""

from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from service.core.errors import KVPoolError
from service.server.route_match import match_path
from service.wire.errors import ERROR_CODES, status_of

# The codes of the statuses Starlette and FastAPI raise HTTPException with (from the wire's table);
# any other status is "http_error".
HTTP_CODES = {
    ERROR_CODES[code].status: code
    for code in ("not_found", "method_not_allowed", "payload_too_large", "request_timeout")
}


def error_response(
    status: int,
    code: str,
    message: str,
    headers: Mapping[str, str] | None = None,
    details: dict[str, Any] | None = None,
) -> Response:
    """The error envelope; `details` (the error's fields as data) only where there are some."""
    error: dict[str, Any] = {"code": code, "message": message}
    if details:
        error["details"] = details
    return Response(orjson.dumps({"error": error}), status_code=status, media_type="application/json", headers=headers)


def _describe_validation(errors: Any) -> str:
    parts = []
    for err in errors:
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})")
            continue
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


async def _kvpool_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, KVPoolError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.code == "unauthorized" else None
    return error_response(status_of(exc.code), exc.code, exc.message, headers, exc.details)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return error_response(status_of("invalid_request"), "invalid_request", _describe_validation(exc.errors()))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 400:
        # FastAPI's answer to a body it cannot decode (e.g. not UTF-8): bad input like any other, so 422.
        message = f"the request body cannot be read: {exc.detail}"
        return error_response(status_of("invalid_request"), "invalid_request", message)
    code = HTTP_CODES.get(exc.status_code, "http_error")
    headers = exc.headers
    if exc.status_code == 405:
        # Starlette names the methods of one route only; GET and DELETE /v1/sequences/{seq_id} are two.
        allowed = _documented_methods(request)
        if allowed:
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
    return error_response(exc.status_code, code, str(exc.detail), headers)


def _documented_methods(request: Request) -> list[str]:
    """The methods the OpenAPI schema documents for the request's path (RFC 9110: 405 lists them all)."""
    return match_path(request.app.router.routes, request.scope).allowed_methods


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    return error_response(status_of("internal_error"), "internal_error", f"{type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(KVPoolError, _kvpool_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
