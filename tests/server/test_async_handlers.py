"""Every endpoint and dependency is `async def`.

FastAPI runs a plain `def` endpoint or dependency in its thread pool: a thread hop per request.
Under `kvpool bench http` on 2 cores that hop cost more than the handlers (one sync dependency made
POST /v1/attend wait 4-6x longer than every other route), so none may creep back in.
"""

import inspect
from collections.abc import Iterator
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from service.config import Settings
from service.server.app import create_app


def api_routes(routes: list[Any]) -> Iterator[APIRoute]:
    """The app's APIRoutes (registered flat: no included routers to walk)."""
    return (route for route in routes if isinstance(route, APIRoute))


def sync_calls(dependant: Dependant) -> Iterator[str]:
    for dep in dependant.dependencies:
        if dep.call is not None and not inspect.iscoroutinefunction(dep.call):
            yield getattr(dep.call, "__qualname__", repr(dep.call))
        yield from sync_calls(dep)


def test_no_endpoint_or_dependency_runs_in_the_thread_pool() -> None:
    settings = Settings(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8, device="cpu")
    app = create_app(settings)
    routes = list(api_routes(app.router.routes))
    found = {(r.path, m) for r in routes for m in r.methods}
    # The walk must reach the routes, or this test would pass on nothing.
    assert {("/v1/step", "POST"), ("/v1/attend", "POST"), ("/v1/sequences/{seq_id}", "DELETE")} <= found
    offenders = []
    for route in routes:
        names = list(sync_calls(route.dependant))
        if not inspect.iscoroutinefunction(route.endpoint):
            names.append(route.endpoint.__name__)
        offenders += [f"{sorted(route.methods)} {route.path}: {name}" for name in names]
    assert offenders == []
