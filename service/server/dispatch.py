"""Route selection without FastAPI's walk through included routers, for requests that match an API route.

Newer FastAPI keeps each included router whole: the app's router asks every included router whether it
matches (each asks its routes, juggling scope keys per candidate), then the winner matches again to
dispatch. Under `kvpool bench http` that walk was ~8 % of the server's CPU. `RouteDispatch` sits in
front of the app's router with a flat table of the same routes, in the router's order, and for the
first route that fully matches (path and method) it does what the router would: the same scope
updates, then the route's own app (the one FastAPI built for it, with its handler and body limit).
Everything else goes to the router unchanged: a request that first fully matches a route that is not
an API route (the docs), partial matches only (405), no match (404, the trailing-slash redirect),
dependency overrides, telemetry, websockets, lifespan.

Each table entry also keeps the path regex its route matches with first: a path the regex rejects is
no match at all (`Match.NONE`), so the scan skips that route without calling its `matches` (which
builds a child scope and converts parameters). Routes that do not match by one path regex (mounts,
frontend route groups) are always asked.
"""

from typing import Any

import fastapi.routing
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette._utils import get_route_path
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

_INCLUDED_ROUTER = getattr(fastapi.routing, "_IncludedRouter", None)
_ROUTE_CONTEXT = getattr(fastapi.routing, "_EffectiveRouteContext", None)
_SCOPE_KEY: str = getattr(fastapi.routing, "_FASTAPI_SCOPE_KEY", "")
_CONTEXT_KEY: str = getattr(fastapi.routing, "_FASTAPI_EFFECTIVE_ROUTE_CONTEXT_KEY", "")
_ROUTER_KEY: str = getattr(fastapi.routing, "_FASTAPI_INCLUDED_ROUTER_KEY", "")
# The FastAPI internals this mirrors; with any of them missing, the router does all the routing.
SUPPORTED = bool(_INCLUDED_ROUTER and _ROUTE_CONTEXT and _SCOPE_KEY and _CONTEXT_KEY and _ROUTER_KEY) and hasattr(
    fastapi.routing.APIRouter, "_get_routes_version"
)


def install_route_dispatch(app: FastAPI) -> None:
    """Put a RouteDispatch in front of the app's router (FastAPI versions that nest included routers)."""
    if SUPPORTED and getattr(app.router, "middleware_stack", None) == app.router.app:
        app.router.middleware_stack = RouteDispatch(app, app.router.app)


class RouteDispatch:
    def __init__(self, app: FastAPI, router_app: ASGIApp) -> None:
        self.app = app
        self.router_app = router_app
        # (path regex or None, route context or None, included router or route)
        self._table: list[tuple[Any, Any, Any]] | None = None
        self._version: Any = None

    def table(self) -> list[tuple[Any, Any, Any]]:
        """Every top-level route in the router's order; an included router's routes in its own order."""
        version = self.app.router._get_routes_version()  # changes when any (included) router gains a route
        if self._table is None or version != self._version:
            table: list[tuple[Any, Any, Any]] = []
            for route in self.app.router.routes:
                if _INCLUDED_ROUTER is not None and isinstance(route, _INCLUDED_ROUTER):
                    table += [(_path_regex(context), context, route) for context in route.effective_route_contexts()]
                else:
                    table.append((_path_regex(route), None, route))
            self._table, self._version = table, version
        return self._table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.app.dependency_overrides or "fastapi.telemetry" in scope:
            await self.router_app(scope, receive, send)
            return
        route_path = get_route_path(scope)
        for regex, context, owner in self.table():
            if regex is not None and regex.match(route_path) is None:
                continue  # what matches() would find: Match.NONE
            if context is None or not isinstance(context.original_route, APIRoute) or context.app is None:
                # Not an API route: the first full match wins, so if it matches, the router answers.
                if (context or owner).matches(scope)[0] == Match.FULL:
                    break
                continue
            match, child_scope = context.matches(scope)
            if match != Match.FULL:
                continue  # a partial match (the path without its method) loses to any later full one
            # What the router and the included router do before calling the route's app.
            scope.setdefault("router", self.app.router)
            scope.update(child_scope)
            fastapi_scope = scope.setdefault(_SCOPE_KEY, {})
            fastapi_scope[_ROUTER_KEY] = owner
            fastapi_scope[_CONTEXT_KEY] = context
            scope["route"] = context.original_route
            await context.app(scope, receive, send)
            return
        await self.router_app(scope, receive, send)


def _path_regex(route: Any) -> Any:
    """The regex that `route.matches` tries first and answers Match.NONE without; None when it has none."""
    if isinstance(route, Route):  # a Starlette route or an APIRoute
        return route.path_regex
    if _ROUTE_CONTEXT is not None and isinstance(route, _ROUTE_CONTEXT):
        if isinstance(route.original_route, APIRoute):
            return route.path_regex  # matches() uses the context's own regex (the router's prefix in it)
        if isinstance(route.starlette_route, Route):
            return route.starlette_route.path_regex
    return None
