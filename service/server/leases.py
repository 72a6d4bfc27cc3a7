"""Leases: renewal by refused calls, and the sweeper, a task on the event loop that frees sequences
whose lease ran out.

Every call that names an existing sequence of its tenant renews the sequence's lease, whether it
succeeds or is refused (its holder is alive): a successful call renews on its way through the core;
a refused one renews the sequences it named here, those of its path, and those of its body (attend's
and step's `seq_ids`, step's `appends`) as far as the body is JSON. The sweeper runs on the loop,
between requests, so it never races a request on the core's tables.
"""

import asyncio
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import orjson

from service.pool import PoolState

log = logging.getLogger("kvpool.leases")


@contextmanager
def renewed_if_refused(state: PoolState, tenant: str, seq_ids: Iterable[str]) -> Iterator[None]:
    """Renew the leases of `seq_ids` (those that exist) if the block raises."""
    try:
        yield
    except Exception:
        state.sequences.renew(list(seq_ids), tenant)
        raise


def renew_named_in(state: PoolState, tenant: str, raw: bytes) -> None:
    """Renew the sequences a refused body names, as far as it is JSON of the expected shape."""
    if state.sequences.registry.num_leased:
        state.sequences.renew(named_in(raw), tenant)


def named_in(raw: bytes) -> list[str]:
    """The ids in a body's "seq_ids" and "appends"[i]["seq_id"]; [] where it is not JSON."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return []
    if not isinstance(body, dict):
        return []
    listed, appends = body.get("seq_ids"), body.get("appends")
    ids = [s for s in listed if isinstance(s, str)] if isinstance(listed, list) else []
    if isinstance(appends, list):
        ids += [a["seq_id"] for a in appends if isinstance(a, dict) and isinstance(a.get("seq_id"), str)]
    return ids


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
