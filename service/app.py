"""create_app(settings): builds the pool state once, mounts the routes and the error handlers."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service import __version__
from service.config import Settings
from service.http_errors import install_error_handlers
from service.routes import attend, ipc, pool, sequences, step
from service.state import PoolState


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    state = PoolState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            state.close()

    app = FastAPI(
        title="kvpool",
        version=__version__,
        summary="A standalone paged KV-cache manager for LLM serving",
        lifespan=lifespan,
    )
    app.state.pool = state
    install_error_handlers(app)
    for module in (sequences, step, attend, pool, ipc):
        app.include_router(module.router)
    return app
