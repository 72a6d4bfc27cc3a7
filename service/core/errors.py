"""Typed errors of the core; `service.server.app` maps each `code` to its HTTP status in one place."""


class KVPoolError(Exception):
    code = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(KVPoolError):
    code = "invalid_request"


class SequenceNotFound(KVPoolError):
    code = "sequence_not_found"

    def __init__(self, seq_id: str) -> None:
        super().__init__(f"sequence {seq_id!r} does not exist")
        self.seq_id = seq_id


class SequenceExists(KVPoolError):
    code = "sequence_exists"

    def __init__(self, seq_id: str) -> None:
        super().__init__(f"sequence {seq_id!r} already exists")
        self.seq_id = seq_id


class OutOfPages(KVPoolError):
    code = "out_of_pages"

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
