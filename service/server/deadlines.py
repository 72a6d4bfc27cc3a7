"""KVPOOL_REQUEST_BODY_TIMEOUT_S: a request's body must arrive within it of the head, or 408 `request_timeout`
and the connection is closed (with the guard of service/server/connections.py, which this middleware tells when
a request starts and ends)."""

import asyncio
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.server.connections import current_connection, sweep_interval
from service.wire.errors import status_of


class BodyTimeout(HTTPException):
    """Raised from receive() when the body is late: the error handlers answer 408 and close the connection."""

    def __init__(self, timeout_s: float) -> None:
        message = f"the request body did not arrive within KVPOOL_REQUEST_BODY_TIMEOUT_S={timeout_s:g} seconds"
        super().__init__(status_of("request_timeout"), message, headers={"Connection": "close"})


class _BodyWait:
    """A request waiting in receive() for its body, and by when it must have it."""

    __slots__ = ("deadline", "expired", "task")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.expired = False
        self.task: asyncio.Task[Any] | None = None


class RequestDeadline:
    """Pure ASGI middleware: the body within `body_timeout_s` of the head; tells the connection's guard when a
    request starts and ends.

    A request waiting for its body is cancelled by a sweep that runs every sweep_interval() while any request
    waits (rather than a timer per request, or asyncio.wait_for, a task per receive: ~4-10 us each), and the
    cancellation becomes the 408.
    """

    def __init__(self, app: ASGIApp, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.interval = sweep_interval(body_timeout_s)
        self.waiting: set[_BodyWait] = set()
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_loop: asyncio.AbstractEventLoop | None = None

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._sweep is None or self._sweep_loop is not loop:  # (an app may serve several loops in turn)
            self._sweep, self._sweep_loop = loop.call_later(self.interval, self.sweep, loop), loop

    def sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweep = None
        now = loop.time()
        for wait in [w for w in self.waiting if w.deadline <= now and not w.expired]:
            wait.expired = True
            if wait.task is not None:
                wait.task.cancel()
        if self.waiting:
            self._schedule(loop)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        guard = current_connection()
        if guard is not None:
            guard.request_started()
        loop = asyncio.get_running_loop()
        wait = _BodyWait(loop.time() + self.body_timeout_s)
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:  # later receives wait for a disconnect: no deadline on those
                return await receive()
            if wait.expired or loop.time() >= wait.deadline:
                raise BodyTimeout(self.body_timeout_s)
            wait.task = asyncio.current_task()
            self.waiting.add(wait)
            self._schedule(loop)
            try:
                message = await receive()
            except asyncio.CancelledError:
                if not wait.expired:
                    raise
                if wait.task is not None and hasattr(wait.task, "uncancel"):
                    wait.task.uncancel()  # (Python >= 3.11) this cancellation is spent: it became the 408
                raise BodyTimeout(self.body_timeout_s) from None
            finally:
                self.waiting.discard(wait)
                wait.task = None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        # The body is read by the endpoints (service/server/bodies.py), inside FastAPI's error handling, which
        # answers BodyTimeout, an HTTPException, with 408 and `Connection: close`.
        try:
            await self.app(scope, timed_receive, send)
        finally:
            if guard is not None:
                guard.request_finished()
