"""KVPOOL_MAX_REQUEST_BYTES: larger request bodies get 413 `payload_too_large` before they are read in full."""

from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.server.errors import error_response
from service.wire.errors import status_of


class BodyTooLarge(HTTPException):
    """Raised from receive() mid-body. An HTTPException, so the endpoint reading the body
    (service/server/bodies.py) passes it on to the error handlers, which answer 413 `payload_too_large`."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return f"the request body is larger than KVPOOL_MAX_REQUEST_BYTES={limit} bytes"


def too_large(limit: int) -> Response:
    return error_response(status_of("payload_too_large"), "payload_too_large", too_large_message(limit))


class BodySizeLimit:
    """Pure ASGI middleware: rejects on Content-Length up front, and counts the bytes of a body that
    comes without one (chunked) as they arrive, stopping at the first chunk past the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                await too_large(limit)(scope, receive, send)
                return
            if b"transfer-encoding" not in (k for k, _ in scope["headers"]):
                # The server reads exactly Content-Length bytes of body: nothing to count.
                await self.app(scope, receive, send)
                return

        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            # Only when the body was read outside FastAPI's error handling (e.g. by another middleware).
            if started:
                raise
            await too_large(limit)(scope, receive, send)
