"""Graceful shutdown around uvicorn.Server.

On SIGTERM: /readyz answers 503 at once (pool.ready = False) while requests are still served for
KVPOOL_SHUTDOWN_GRACE_S, so a load balancer or Kubernetes stops routing here first; then uvicorn
stops listening, lets in-flight requests finish, runs the lifespan shutdown (the lease sweeper
stops, the pool is released), and the process exits 0. A second SIGTERM or a SIGINT cuts the grace
short; a second SIGINT forces the exit, as in plain uvicorn.
"""

import signal
import time
from types import FrameType

import uvicorn

from service.pool import PoolState


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, pool: PoolState, grace_s: float) -> None:
        super().__init__(config)
        self.pool = pool
        self.grace_s = grace_s
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes: only flag changes here, the loop acts on them.
        # Unlike uvicorn's, it does not re-raise the signal after shutdown, so a clean drain exits 0.
        self.pool.ready = False
        if sig == signal.SIGTERM and self.drain_deadline is None and self.grace_s > 0:
            self.drain_deadline = time.monotonic() + self.grace_s
        elif self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
            self.should_exit = True
        return await super().on_tick(counter)


def serve(config: uvicorn.Config, pool: PoolState, grace_s: float) -> None:
    DrainingServer(config, pool, grace_s).run()
