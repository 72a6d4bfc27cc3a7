"""Which route a request's path belongs to, asked of the app's routes through Starlette's public `matches`.

The router answers most requests itself; this is for the answers made without it, or about more than
the one route it picked: the metrics label of a request that a middleware answered first (401, 413),
and the `Allow` header of a 405, which names every documented method of the path (RFC 9110), while
Starlette names the methods of one route only (GET and DELETE /v1/sequences/{seq_id} are two routes).
"""

from collections.abc import Iterable
from dataclasses import dataclass

from starlette.routing import BaseRoute, Match
from starlette.types import Scope


@dataclass(frozen=True)
class PathMatch:
    template: str | None  # the route the router would pick: the first full match, else the first partial one
    allowed_methods: list[str]  # every method documented for the path, sorted


def match_path(routes: Iterable[BaseRoute], scope: Scope) -> PathMatch:
    full = partial = None
    allowed: set[str] = set()
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.NONE:
            continue
        template = getattr(route, "path", None)
        if match == Match.FULL and full is None:
            full = template
        elif match == Match.PARTIAL and partial is None:
            partial = template
        methods = getattr(route, "methods", None)
        if methods and getattr(route, "include_in_schema", False):
            allowed |= methods
    return PathMatch(full or partial, sorted(allowed))
