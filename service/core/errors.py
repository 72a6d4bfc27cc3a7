"""Typed errors of the core.

Each class names its `code` and the attributes it carries as data (`detail_fields`, set by its
`__init__`). service/wire/errors.py gives every code its HTTP status; the server's handler writes
code, message and `details` into the error envelope, and the client raises the same class again
from them with `rebuild`, so no field is ever parsed back out of a message.
"""

from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

E = TypeVar("E", bound="KVPoolError")


class KVPoolError(Exception):
    code = "internal_error"
    detail_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def details(self) -> dict[str, Any]:
        """The error's fields as data: {name: value} for each of `detail_fields`."""
        return {name: getattr(self, name) for name in self.detail_fields}

    @classmethod
    def rebuild(cls: type[E], message: str, details: Mapping[str, Any]) -> E:
        """The error as another process raised it, from its message and details (a missing field is None)."""
        exc = cls.__new__(cls)
        KVPoolError.__init__(exc, message)  # the subclasses' own __init__ take the fields, not a message
        for name in cls.detail_fields:
            setattr(exc, name, details.get(name))
        return exc


class InvalidRequest(KVPoolError):
    code = "invalid_request"


class AttendTooLarge(InvalidRequest):
    """An attend asking for more attention work than the server's cap (KVPOOL_MAX_ATTEND_TOKENS):
    `tokens` = the sum over its sequences of queries x context tokens. Refused before any work."""

    code = "attend_too_large"
    detail_fields = ("tokens", "limit")

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(
            f"the attend spans {tokens} (query, context token) pairs, more than the server's cap of {limit} "
            "(KVPOOL_MAX_ATTEND_TOKENS): send fewer queries or sequences per call"
        )
        self.tokens = tokens
        self.limit = limit


class NonFiniteOutput(InvalidRequest):
    """An attend whose output is not finite: q . k (times the scale) overflows, or the pool holds values out of
    range at the sequences' positions (written through the mapped pool, or too large for the pool's dtype).
    Refused after the attention, with the attend's own K/V put back as they were: nothing is written."""

    code = "non_finite_output"
    detail_fields = ("layer", "seq_ids")

    def __init__(self, layer: int, seq_ids: list[str], cause: str) -> None:
        super().__init__(
            f"the attention output of layer {layer} is not finite for {', '.join(map(repr, seq_ids))}: {cause}; "
            "nothing was written"
        )
        self.layer = layer
        self.seq_ids = seq_ids


class SequenceNotFound(KVPoolError):
    code = "sequence_not_found"
    detail_fields = ("seq_id",)

    def __init__(self, seq_id: str) -> None:
        super().__init__(f"sequence {seq_id!r} does not exist")
        self.seq_id = seq_id


class SequenceExists(KVPoolError):
    code = "sequence_exists"
    detail_fields = ("seq_id",)

    def __init__(self, seq_id: str) -> None:
        super().__init__(f"sequence {seq_id!r} already exists")
        self.seq_id = seq_id


class OutOfPages(KVPoolError):
    code = "out_of_pages"
    detail_fields = ("needed", "available")

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"need {needed} pages, only {available} can be freed up")
        self.needed = needed
        self.available = available


class QuotaExceeded(KVPoolError):
    code = "quota_exceeded"


class Unauthorized(KVPoolError):
    code = "unauthorized"


class Forbidden(KVPoolError):
    code = "forbidden"


class PayloadTooLarge(KVPoolError):
    code = "payload_too_large"
