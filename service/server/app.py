"""create_app(settings): builds the pool state once, mounts the routes and the error handlers."""

import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

import service.core
from service import __version__
from service.config import Settings
from service.pool import PoolState
from service.server.auth import BearerAuth, ipc_authorizer
from service.server.deadlines import RequestDeadline
from service.server.errors import install_error_handlers
from service.server.leases import start_lease_sweeper, stop_lease_sweeper
from service.server.limits import BodySizeLimit
from service.server.metrics import Metrics, RequestMetricsMiddleware
from service.server.routes import attend, ipc, pool, prefix, sequences, step
from service.server.routes import metrics as metrics_route
from service.server.routes.table import document_request_bodies

log = logging.getLogger("kvpool.server")


def without_opentelemetry() -> dict[str, Any]:
    """FastAPI(**this): no OpenTelemetry spans, metrics or logs, on FastAPI versions that have them.

    kvpool's telemetry is its Prometheus registry. FastAPI >= 0.165 otherwise asks OpenTelemetry's
    global providers on every request whether one was configured (~2 % of the server's CPU under
    `kvpool bench http`), though nothing in the server can configure one.
    """
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    state = PoolState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log_start(state)
        state.open_ipc_socket(ipc_authorizer(settings))
        sweeper = start_lease_sweeper(state)
        try:
            yield
        finally:
            await stop_lease_sweeper(sweeper)
            state.close()

    app = FastAPI(
        title="kvpool",
        version=__version__,
        summary="A standalone paged KV-cache manager for LLM serving",
        lifespan=lifespan,
        **without_opentelemetry(),
    )
    app.state.pool = state
    install_error_handlers(app)
    app.state.metrics = Metrics(state)  # a registry per app
    tables = [module.routes for module in (sequences, step, attend, pool, prefix, ipc, metrics_route)]
    for table in tables:
        table.add_to(app)  # flat: each route straight into the app's table
    document_request_bodies(app, [model for table in tables for model in table.body_models])
    # The last added runs first: the body deadline (and the connection guard's request count), request
    # timing (sees every answer, 401 and 413 included), then auth (401 before anything is read), then the
    # body size limit.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    if settings.api_key_tenants:
        app.add_middleware(BearerAuth, keys=settings.api_key_tenants)
    app.add_middleware(RequestMetricsMiddleware, metrics=app.state.metrics, routes=app.router.routes)
    app.add_middleware(RequestDeadline, body_timeout_s=settings.request_body_timeout_s)
    return app


def log_start(state: PoolState) -> None:
    """One line naming what this process runs: the pool, the attention backend, the core's build."""
    s = state.settings
    log.info(
        "kvpool %s: %d pages of %d tokens, %s on %s, attention backend %s, core compiled: %s",
        __version__,
        s.num_pages,
        s.page_size,
        s.dtype,
        state.storage.device,
        state.engine.backend,
        service.core.is_compiled(),
    )
    if not service.core.is_compiled():
        log.warning("the core runs from its Python source, 10-200x slower: %s", service.core.compiled_modules())
