"""The lease sweeper: a task on the event loop that frees sequences whose lease ran out.

It runs on the loop, between requests, so it never races a request on the core's tables.
"""

import asyncio
import logging

from service.server.state import PoolState

log = logging.getLogger("kvpool.leases")


def expire_leases(state: PoolState) -> list[tuple[str, str]]:
    expired = state.sequences.expire(state.sequences.clock())
    for tenant, seq_id in expired:
        log.info("lease expired: freed sequence %r of tenant %r", seq_id, tenant)
    return expired


async def sweep_leases(state: PoolState, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            expire_leases(state)
        except Exception:  # a bug here must not stop the sweeper for good; it is logged
            log.exception("lease sweep failed")


def start_lease_sweeper(state: PoolState) -> "asyncio.Task[None]":
    return asyncio.get_running_loop().create_task(
        sweep_leases(state, state.settings.lease_sweep_interval_s), name="kvpool-lease-sweeper"
    )


async def stop_lease_sweeper(task: "asyncio.Task[None]") -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
