"""APIRoute that parses JSON bodies with orjson (several times faster than json.loads on a step), and
answers valid requests through `FastPath` (service/fast_route.py) rather than FastAPI's request handler."""

from collections.abc import Callable, Coroutine
from typing import Any

import fastapi.routing
import orjson
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from service.server.fast_route import FastPath


class ORJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            # orjson.JSONDecodeError subclasses json.JSONDecodeError, which FastAPI turns into a 422.
            self._json = orjson.loads(await self.body())
        return self._json


class ORJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def orjson_handler(request: Request) -> Response:
            orjson_request = ORJSONRequest(request.scope, request.receive)
            if hasattr(request, "_body"):  # read by the fast path, which handed the request over
                orjson_request._body = request._body
            return await handler(orjson_request)

        fast = FastPath.of(_effective_route(self))
        return orjson_handler if fast is None else fast.handler(orjson_handler)


def _effective_route(route: APIRoute) -> Any:
    """What APIRoute.get_route_handler builds from: newer FastAPI builds an included route's handler from
    an effective route context (the include's prefix, dependencies and overrides merged in)."""
    context_var = getattr(fastapi.routing, "_effective_route_context_var", None)
    context = context_var.get() if context_var is not None else None
    return context if context is not None and getattr(context, "original_route", None) is route else route
