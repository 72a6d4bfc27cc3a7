"""The error codes of API v1, in one table: code -> HTTP status and the typed exception.

The server's exception handlers answer with these statuses; the client raises the row's exception
again from an envelope's code and details; the error table of docs/http-api.md documents the same rows (a test
holds the two equal). Codes without a core class are answered by the HTTP edge itself; a client
raises them as a plain KVPoolError that keeps the code.
"""

from dataclasses import dataclass
from typing import Any

from service.core.errors import (
    AttendTooLarge,
    Forbidden,
    InvalidRequest,
    KVPoolError,
    OutOfPages,
    PayloadTooLarge,
    QuotaExceeded,
    SequenceExists,
    SequenceNotFound,
    Unauthorized,
)


@dataclass(frozen=True)
class ErrorCode:
    code: str
    status: int
    error: type[KVPoolError] | None = None  # the core's class for this code, if it has one


def _typed(cls: type[KVPoolError], status: int) -> ErrorCode:
    return ErrorCode(cls.code, status, cls)


ERROR_CODES: dict[str, ErrorCode] = {
    row.code: row
    for row in (
        _typed(InvalidRequest, 422),
        _typed(AttendTooLarge, 422),
        _typed(SequenceNotFound, 404),
        _typed(SequenceExists, 409),
        _typed(OutOfPages, 507),
        _typed(QuotaExceeded, 429),
        _typed(Unauthorized, 401),
        _typed(Forbidden, 403),
        _typed(PayloadTooLarge, 413),
        ErrorCode("not_ready", 503),  # GET /readyz while shutting down
        ErrorCode("request_timeout", 408),  # a body slower than KVPOOL_REQUEST_BODY_TIMEOUT_S
        ErrorCode("too_many_connections", 503),  # a new connection over KVPOOL_MAX_CONNECTIONS, all busy
        ErrorCode("not_found", 404),  # no route at the path
        ErrorCode("method_not_allowed", 405),
        ErrorCode("internal_error", 500),  # a bug: the message names the exception
    )
}


def status_of(code: str) -> int:
    """The HTTP status of an error code; 500 for one the table lacks."""
    row = ERROR_CODES.get(code)
    return 500 if row is None else row.status


def error_from_envelope(status: int, code: str, message: str, details: dict[str, Any] | None = None) -> KVPoolError:
    """The typed exception of an error envelope, its fields from `details`; `status` is kept as `exc.status`."""
    row = ERROR_CODES.get(code)
    if row is None or row.error is None:
        exc = KVPoolError(message)
        exc.code = code
    else:
        exc = row.error.rebuild(message, details or {})
    exc.status = status  # type: ignore[attr-defined]
    return exc
