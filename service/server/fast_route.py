"""A fast path for valid requests to FastAPI routes: FastAPI's own validation, without its per-request machinery.

Under `kvpool bench http` FastAPI's request handler (content-type parsing through `email.message`,
`solve_dependencies`, the dependency cache keys, telemetry hooks) cost more server CPU than most
handlers. For a route whose parameters are simple (path parameters, at most one JSON body model,
`async def` dependencies that take only the request and other such dependencies), `FastPath` does
what FastAPI would do on a valid request: parse the body with orjson, validate it and the path
parameters with the same pydantic `ModelField.validate` calls, solve the dependencies once each
(FastAPI's per-request cache), and await the endpoint, which must return a `Response`.

Anything else goes to FastAPI's handler, with the body already read handed over: a body that is
not `application/json`, empty, not JSON or not valid; a path parameter that fails validation;
dependency overrides; telemetry. FastAPI then answers exactly as it always did (the 422 envelope
and its message come from the same code). A request takes the fast path only when FastAPI would
have called the endpoint with the same arguments.
"""

import inspect
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import params
from fastapi.dependencies.models import Dependant
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response


def _no_telemetry() -> None:
    return None


try:  # newer FastAPI traces requests with OpenTelemetry: a traced request takes FastAPI's path
    import fastapi.telemetry

    get_telemetry_data: Callable[[], object] = fastapi.telemetry.get_telemetry_data
except ImportError:  # older FastAPI has no telemetry
    get_telemetry_data = _no_telemetry


Handler = Callable[[Request], Coroutine[Any, Any, Response]]
JSON_TYPES = frozenset({b"application/json"})


@dataclass
class Dependency:
    """An `async def` dependency taking only the request (optionally) and other such dependencies."""

    call: Callable[..., Awaitable[Any]]
    subs: list[tuple[str | None, "Dependency"]] = field(default_factory=list)
    request_param: str | None = None

    async def solve(self, request: Request, cache: dict[Any, Any]) -> Any:
        if self.call in cache:  # FastAPI solves a dependency once per request (use_cache)
            return cache[self.call]
        kwargs: dict[str, Any] = {}
        for name, sub in self.subs:
            value = await sub.solve(request, cache)
            if name is not None:
                kwargs[name] = value
        if self.request_param is not None:
            kwargs[self.request_param] = request
        value = cache[self.call] = await self.call(**kwargs)
        return value


def _has_only_dependencies(d: Dependant) -> bool:
    return not (
        d.path_params
        or d.query_params
        or d.header_params
        or d.cookie_params
        or d.body_params
        or d.websocket_param_name
        or d.http_connection_param_name
        or d.response_param_name
        or d.background_tasks_param_name
        or d.security_scopes_param_name
        or d.own_oauth_scopes
        or d.parent_oauth_scopes
        or getattr(d, "concurrency", None) is not None
    )


def _dependency(d: Dependant) -> Dependency | None:
    if d.call is None or not inspect.iscoroutinefunction(d.call) or not d.use_cache or not _has_only_dependencies(d):
        return None
    subs = _dependencies(d)
    return None if subs is None else Dependency(d.call, subs, d.request_param_name)


def _dependencies(d: Dependant) -> list[tuple[str | None, Dependency]] | None:
    subs = []
    for sub in d.dependencies:
        dep = _dependency(sub)
        if dep is None:
            return None
        subs.append((sub.name, dep))
    return subs


@dataclass
class FastPath:
    endpoint: Callable[..., Awaitable[Any]]
    dependencies: list[tuple[str | None, Dependency]]
    path_fields: list[tuple[str, str, Any]]  # (parameter name, path key, ModelField)
    body_field: Any  # ModelField | None: one JSON body model, not embedded
    request_param: str | None
    overrides_provider: Any

    @classmethod
    def of(cls, route: Any) -> "FastPath | None":
        """The fast path of an APIRoute (or FastAPI's effective route context), None when it has none."""
        d: Dependant = route.dependant
        endpoint = d.call
        if endpoint is None or not inspect.iscoroutinefunction(endpoint):
            return None
        returns = inspect.signature(endpoint).return_annotation
        if not (inspect.isclass(returns) and issubclass(returns, Response)):
            return None  # FastAPI would serialize the result through the response model
        if d.query_params or d.header_params or d.cookie_params or len(d.body_params) > 1:
            return None
        if d.websocket_param_name or d.http_connection_param_name or d.response_param_name:
            return None
        if d.background_tasks_param_name or d.security_scopes_param_name or d.own_oauth_scopes:
            return None
        body_field = d.body_params[0] if d.body_params else None
        if body_field is not None and (
            getattr(route, "_embed_body_fields", True) or isinstance(body_field.field_info, (params.Form, params.File))
        ):
            return None
        path_fields = []
        for f in d.path_params:
            if not isinstance(f.field_info, params.Path) or f.field_info.alias not in (None, f.name):
                return None
            path_fields.append((f.name, f.alias or f.name, f))
        deps = _dependencies(d)
        if deps is None:
            return None
        provider = getattr(route, "dependency_overrides_provider", None)
        return cls(endpoint, deps, path_fields, body_field, d.request_param_name, provider)

    def handler(self, slow: Handler) -> Handler:
        """The route's request handler: this fast path, or `slow` (FastAPI's) where it does not apply."""
        body_field, path_fields, deps = self.body_field, self.path_fields, self.dependencies
        endpoint, request_param, provider = self.endpoint, self.request_param, self.overrides_provider

        async def fast_handler(request: Request) -> Response:
            if get_telemetry_data() is not None or getattr(provider, "dependency_overrides", None):
                return await slow(request)
            values: dict[str, Any] = {}
            path_params = request.path_params
            for name, key, f in path_fields:
                if key not in path_params:
                    return await slow(request)
                value, errors = f.validate(path_params[key], values, loc=("path", key))
                if errors:
                    return await slow(request)
                values[name] = value
            if body_field is not None:
                try:
                    raw = await read_body(request)  # cached on the request: FastAPI's handler reads it again
                except ClientDisconnect:
                    return await slow(request)  # which answers a disconnect mid-body as it always did
                if not raw or _content_type(request) not in JSON_TYPES:
                    return await slow(request)
                try:
                    data = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    return await slow(request)
                value, errors = body_field.validate(data, values, loc=("body",))
                if errors:
                    return await slow(request)
                values[body_field.name] = value
            cache: dict[Any, Any] = {}
            for dep_name, dep in deps:
                solved = await dep.solve(request, cache)
                if dep_name is not None:
                    values[dep_name] = solved
            if request_param is not None:
                values[request_param] = request
            response = await endpoint(**values)
            if not isinstance(response, Response):
                raise TypeError(f"{endpoint.__qualname__} returned {type(response).__name__}, not a Response")
            return response

        return fast_handler


async def read_body(request: Request) -> bytes:
    """Request.body() without its async generator (a few µs a request): the same bytes, cached on the
    request the same way, and the same ClientDisconnect when the client goes away mid-body."""
    if hasattr(request, "_body"):
        return request._body
    chunks = []
    while True:
        message = await request.receive()
        if message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        elif message["type"] == "http.disconnect":
            request._is_disconnected = True
            raise ClientDisconnect()
    request._stream_consumed = True
    body = request._body = b"".join(chunks)
    return body


def _content_type(request: Request) -> bytes | None:
    for key, value in request.scope["headers"]:
        if key == b"content-type":
            return value.lower()
    return None
