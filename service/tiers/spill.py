"""The spill tier (KVPOOL_SPILL): evicted device pages copied down to host memory (HostTier, here) or a
file on a local disk (DiskTier, service/tiers/disk.py), and read back by a restore.

Both keep a TierIndex (service/core/tier_index.py) of slots of one page each; SpillTier does the
bookkeeping and the events, its subclasses the copies (`_copy_down`, `_read`). Ordering (why a read
never sees the wrong data):
- A page is evicted inside the allocator's call, before it is reused: evicted() reserves its slot
  and SUBMITS the copy to the engine at once. Whoever got the page writes it later through the same
  engine, which runs jobs in submission order, so the copy reads the old K/V before any new write
  lands (tests/tiers/test_ordering.py: evict, overwrite, restore, compare).
- An entry becomes visible to lookups only when its copy has landed (TierIndex.ready); a restore
  submits its read before any later reservation of the slot can submit an overwrite.

KV events: the tier tells its sink (`events`) of an entry when its copy has landed and when a ready
entry leaves (evicted, or discarded as bad); a pending entry that goes was never told of.
"""

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from service.core.tier_index import TierIndex
from service.engine.engine import DeviceEngine
from service.tiers.pages import PageCodec, paired_runs
from service.tiers.stats import Incident, TierStats
from service.tiers.tier import Found, PromptChain, TierEvents

log = logging.getLogger("kvpool.tiers")


class TierDataError(Exception):
    """A tier returned data that is not the page asked for (its slot names another page)."""


class SpillTier:
    name = ""
    medium = ""  # the KV events' medium of its entries
    entry_nbytes = 0  # bytes a slot takes (a page, and a disk slot's header)

    def __init__(self, codec: PageCodec, engine: DeviceEngine, nbytes: int, events: TierEvents | None) -> None:
        self.codec, self.engine, self.events = codec, engine, events
        self.page_nbytes = codec.page_nbytes
        self.index = TierIndex(nbytes // self.entry_nbytes)
        self.capacity_bytes = self.index.num_slots * self.entry_nbytes
        self.stats = TierStats()
        self.incident = Incident(self.name, log)

    # -- what the subclasses do -------------------------------------------------------------------
    def _copy_down(self, pages: list[int], slots: list[int], hashes: list[bytes]) -> None:
        """Submit the copy of `pages` into `slots`; `_landed` hears of it (on the loop) when it is done."""
        raise NotImplementedError

    async def _read(self, slots: list[int], hashes: list[bytes], pages: list[int]) -> None:
        """Slots into pool pages; raises the tier's errors (TierDataError: a slot holds another page)."""
        raise NotImplementedError

    # -- what the device's prefix index tells (on the loop, inside the allocator's calls) ----------
    def evicted(self, pages: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        try:  # (an exception would leave the allocator half-changed: none escapes)
            asyncio.get_running_loop()  # (raises before any slot is reserved: no loop, no copy)
            if not self.incident.usable():
                self.stats.skipped += len(pages)
                return
            todo: list[tuple[int, int, bytes]] = []
            dropped: list[bytes] | None = [] if self.events is not None else None
            for page, page_hash, key in zip(pages.tolist(), hashes, keys):
                reserved = self.index.reserve(page_hash.tobytes(), key.tobytes(), dropped)
                if reserved is not None:
                    todo.append((page, reserved[0], page_hash.tobytes()))
            if dropped and self.events is not None:
                self.events.tier_removed(self.medium, dropped)
            if todo:
                self._copy_down([t[0] for t in todo], [t[1] for t in todo], [t[2] for t in todo])
        except Exception as exc:  # no running loop (a tool driving the core), or the engine closed
            self.incident.failed(self.stats, exc)

    def committed(self, pages: np.ndarray, hashes: np.ndarray, token_bytes: bytes) -> None:
        """(A committed page reaches this tier when it is evicted.)"""

    def _landed(self, slots: list[int], hashes: list[bytes], error: BaseException | None) -> None:
        landed: list[bytes] = []
        for page_hash, slot in zip(hashes, slots):
            if (self.index.discard if error else self.index.ready)(page_hash, slot) and not error:
                landed.append(page_hash)
        if landed and self.events is not None:  # (entries evicted while pending were never told of)
            keys = [self.index.entry(h).key for h in landed]  # type: ignore[union-attr]
            self.events.tier_stored(self.medium, landed, keys)
        if error is not None:
            self.incident.failed(self.stats, error)
            return
        self.incident.succeeded()
        self.stats.bytes_out += len(slots) * self.page_nbytes

    # -- lookups and restores ---------------------------------------------------------------------
    def peek(self, chain: PromptChain, start: int, limit: int) -> int:
        found = self.index.match(chain.parent(start), chain.after(start), chain.page_nbytes, limit - start, False)
        return len(found)

    async def lookup(self, chain: PromptChain, start: int, limit: int) -> Found:
        # (An incident, a full disk typically, stops the spills, not the reads.)
        found = self.index.match(chain.parent(start), chain.after(start), chain.page_nbytes, limit - start)
        if not found:
            self.stats.misses += 1
        return list(found)

    async def load_into(self, found: Found, pages: list[int]) -> int:
        """Entries evicted since the lookup (by the restore's own allocation, say) cut the run."""
        num = 0
        for page_hash, slot in found[: len(pages)]:
            entry = self.index.entry(page_hash)
            if entry is None or entry.slot != slot or entry.pending:
                break
            num += 1
        if not num:
            return 0
        slots, hashes = [slot for _, slot in found[:num]], [h for h, _ in found[:num]]
        try:
            await self._read(slots, hashes, pages[:num])
        except Exception as exc:
            if isinstance(exc, TierDataError):
                gone = [h for h, slot in found[:num] if self.index.discard(h, slot)]  # never read again
                if gone and self.events is not None:
                    self.events.tier_removed(self.medium, gone)
            self.incident.failed(self.stats, exc)
            return 0
        self.stats.hits += num
        self.stats.bytes_in += num * self.page_nbytes
        return num

    def report(self) -> dict[str, Any]:
        index = self.index
        row: dict[str, Any] = {"tier": self.name, **dataclasses.asdict(self.stats)}
        row |= {"capacity_bytes": self.capacity_bytes, "entries": len(index), "evictions": index.num_evictions}
        row |= {"used_bytes": len(index) * (self.capacity_bytes // max(index.num_slots, 1))}
        return row | {"capacity_entries": index.num_slots, "up": not self.incident.down, "queued_pages": 0}

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass


class HostTier(SpillTier):
    """Slots in host memory (pinned on a CUDA pool), only read and written by engine jobs (spill: pool
    -> slots, restore: slots -> pool), so the engine's order is the tier's."""

    name = "host"

    def __init__(self, codec: PageCodec, engine: DeviceEngine, nbytes: int, events: TierEvents | None) -> None:
        # The KV events' medium: vLLM's "CPU", below a pool on any device (whose own events say "GPU").
        self.medium = "CPU"
        self.entry_nbytes = codec.page_nbytes
        super().__init__(codec, engine, nbytes, events)
        pinned = codec.device.type == "cuda"
        self.store = torch.empty((self.index.num_slots, self.page_nbytes), dtype=torch.uint8, pin_memory=pinned)
        # On a CPU pool the copies go through numpy views (a microsecond a run); on CUDA through torch
        # (DMA from the pinned rows).
        self.rows: torch.Tensor | np.ndarray = self.store.numpy() if codec.device.type == "cpu" else self.store

    def copy_down_job(self, pages: list[int], slots: list[int]) -> Callable[[], None]:
        """The engine job copying `pages` into `slots`: one copy per run consecutive on both sides."""

        def job() -> None:
            for _, first, slot, count in paired_runs(pages, slots):
                self.codec.read_run(first, count, self.rows[slot : slot + count])
            self.codec.settle()  # the rows are read on the host (the disk tier, a later restore's source)

        return job

    def read_job(self, slots: list[int], pages: list[int]) -> Callable[[], None]:
        """The engine job copying `slots` into `pages`."""

        def job() -> None:
            for _, slot, first, count in paired_runs(slots, pages):
                self.codec.write_run(first, count, self.rows[slot : slot + count])
            self.codec.settle()  # the slots may be reused once the job returns

        return job

    def _copy_down(self, pages: list[int], slots: list[int], hashes: list[bytes]) -> None:
        inline = self.engine.fits_inline(nbytes=len(pages) * self.page_nbytes)
        done = self.engine.submit(catching(self.copy_down_job(pages, slots)), inline)
        done.add_done_callback(lambda f: self._landed(slots, hashes, f.result()))

    async def _read(self, slots: list[int], hashes: list[bytes], pages: list[int]) -> None:
        await self.engine.submit(self.read_job(slots, pages))


def catching(job: Callable[[], None]) -> Callable[[], BaseException | None]:
    """An engine job that returns its exception instead of raising it (nobody awaits a spill)."""

    def run() -> BaseException | None:
        try:
            job()
        except Exception as exc:
            return exc
        return None

    return run
