"""APIRoute that parses JSON bodies with orjson (several times faster than json.loads on a step)."""

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response


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
            return await handler(ORJSONRequest(request.scope, request.receive))

        return orjson_handler
