"""The tiers below the device: spill on eviction, write to the shared store on commit, restore on a hit.

Spill (the node's tier): Tiers is a CacheListener of the allocator. removed() runs on the loop inside
allocate(), before the evicted pages are reused; it reserves tier slots and SUBMITS the copy to the
engine at once. Whoever got those pages writes them later through the same engine, and the engine
runs jobs in submission order, so the spill copy reads the old K/V before any new write lands
(tests/tiers/test_ordering.py: evict, overwrite, restore, compare).

Shared tier: stored() hands newly committed pages to the background writer (service/tiers/shared.py).
The remote tier is written at commit, not at eviction: a prefix computed here is of use to the other
nodes at once.

Restore (restore(), awaited by POST /v1/sequences before the core's create): match the device, then
the local tier, then ask the remote store which of the pages after those it holds (EXISTS); take
fresh device pages for what the tiers hold, copy it in (the remote's values are received straight
into their pages and checked as they arrive), and only when the copies are in commit the pages into
the prefix index, up to the first that did not come in intact; a failed read frees the fresh pages
after the last good one uncommitted (the hit is then the shorter one: the device's, or the device's
and the local tier's when the remote read fails). Evictions the allocation made stay made, as for any
allocation (the evicted pages were spilled first, if a local tier is on). The device hits are held
meanwhile, so nothing this call allocates can evict them; the create that follows, with no await in
between, finds all the pages in the device's index and counts them in cached_tokens.
"""

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from service.core.plan import checked_token_bytes
from service.tiers.entries import EntryFormat, seal_for
from service.tiers.local import DiskTier, HostTier, TierDataError
from service.tiers.pages import PageCodec
from service.tiers.remote import Chain, RemoteStore
from service.tiers.shared import SharedTier

if TYPE_CHECKING:
    from service.server.state import PoolState

log = logging.getLogger("kvpool.tiers")


class Tiers:
    def __init__(self, state: "PoolState") -> None:
        s = state.settings
        self.state, self.engine, self.allocator = state, state.engine, state.allocator
        self.page_size, self.token_nbytes = s.page_size, s.page_size * 8
        self.codec = PageCodec(state.storage)
        self.local: HostTier | DiskTier | None = None
        if s.spill == "host":
            self.local = HostTier(self.codec, s.spill_bytes, pinned=state.storage.device.type == "cuda")
        elif s.spill == "disk":
            self.local = DiskTier(self.codec, s.spill_bytes, s.spill_path, state.instance_id)
        self.remote: SharedTier | None = None
        if s.remote_url:
            entries = EntryFormat(s.geometry_tag, seal_for(s.remote_secret.get_secret_value()))
            store = RemoteStore(s.remote_url, s.remote_timeout_s, s.remote_ttl_s, entries, self.codec.page_nbytes)
            self.remote = SharedTier(store, self.engine, self.allocator, self.codec, s.remote_queue_pages)
        self._quiet = False  # committing restored pages: the store has them already
        # KV events (service/events/listener.EventListener, set by PoolState when they are on): the
        # node's tier tells what lands in it and what it drops. The remote tier tells nothing: it is
        # shared by the nodes, so no node's stream can say what it holds.
        self.events: Any = None
        self.allocator.add_listener(self)

    def report(self) -> list[dict[str, Any]]:
        """Each tier's size, use and counts: GET /v1/pool shows them, the metrics export them."""
        out = []
        if self.local is not None:
            tier, index = self.local, self.local.index
            row: dict[str, Any] = {"tier": tier.name, **dataclasses.asdict(tier.stats)}
            row |= {"capacity_bytes": tier.capacity_bytes, "entries": len(index), "evictions": index.num_evictions}
            row |= {"used_bytes": len(index) * (tier.capacity_bytes // max(index.num_slots, 1))}
            out.append(row | {"capacity_entries": index.num_slots, "up": not tier.incident.down, "queued_pages": 0})
        if self.remote is not None:
            out.append(self.remote.report())
        return out

    # -- the allocator's listener (on the loop, inside its calls: quick) ------------------------
    # Both run inside the allocator's calls: an exception would leave it half-changed, so none escapes.
    def removed(self, pages: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        try:
            self._removed(pages, hashes, keys)
        except Exception as exc:  # no running loop (a tool driving the core), or the engine closed
            if self.local is not None:
                self.local.incident.failed(self.local.stats, exc)

    def cleared(self) -> None:
        """A prefix-cache reset that left nothing registered: the tiers keep what they hold (the remote
        one is shared with other nodes), and the dropped device pages are not copied down."""

    def stored(self, pages: np.ndarray, hashes: np.ndarray, parent: bytes, token_bytes: bytes, at_root: bool) -> None:
        try:
            self._stored(pages, hashes, token_bytes)
        except Exception as exc:
            if self.remote is not None:
                self.remote.incident.failed(self.remote.stats, exc)

    def _removed(self, pages: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        asyncio.get_running_loop()  # (raises before any slot is reserved)
        tier = self.local
        if tier is None or (not tier.incident.usable()):
            if tier is not None:
                tier.stats.skipped += len(pages)
            return
        todo: list[tuple[int, int, bytes]] = []
        dropped: list[bytes] | None = [] if self.events is not None else None
        for page, page_hash, key in zip(pages.tolist(), hashes, keys):
            reserved = tier.index.reserve(page_hash.tobytes(), key.tobytes(), dropped)
            if reserved is not None:
                todo.append((page, reserved[0], page_hash.tobytes()))
        if dropped:
            self.events.tier_removed(tier.medium, dropped)
        if todo:
            self._spill(tier, todo)

    def _spill(self, tier: HostTier | DiskTier, todo: list[tuple[int, int, bytes]]) -> None:
        pages, slots, hashes = [t[0] for t in todo], [t[1] for t in todo], [t[2] for t in todo]
        loop = asyncio.get_running_loop()
        if isinstance(tier, HostTier):
            job = tier.spill_job(pages, slots)
        else:
            disk = tier

            def job() -> None:  # on the engine: gather; the IO thread writes, then the loop hears of it
                data = self.codec.gather(pages).numpy()
                disk.write(slots, hashes, data).add_done_callback(
                    lambda f: loop.call_soon_threadsafe(self._spilled, disk, slots, hashes, f.exception())
                )

        inline = self.engine.fits_inline(nbytes=len(pages) * tier.page_nbytes)
        done = self.engine.submit(_catching(job), inline)

        def settle(f: "asyncio.Future[BaseException | None]") -> None:
            # Host: the copy is done. Disk: only a failed gather ends here; the IO thread reports the rest.
            if isinstance(tier, HostTier) or f.result() is not None:
                self._spilled(tier, slots, hashes, f.result())

        done.add_done_callback(settle)

    def _spilled(
        self, tier: HostTier | DiskTier, slots: list[int], hashes: list[bytes], error: BaseException | None
    ) -> None:
        landed: list[bytes] = []
        for page_hash, slot in zip(hashes, slots):
            if (tier.index.discard if error else tier.index.ready)(page_hash, slot) and not error:
                landed.append(page_hash)
        if landed and self.events is not None:  # (entries evicted while pending were never told of)
            self.events.tier_stored(tier.medium, landed, [tier.index.entry(h).key for h in landed])  # type: ignore[union-attr]
        if error is not None:
            tier.incident.failed(tier.stats, error)
            return
        tier.incident.succeeded()
        tier.stats.bytes_out += len(slots) * tier.page_nbytes

    def _stored(self, pages: np.ndarray, hashes: np.ndarray, token_bytes: bytes) -> None:
        if self.remote is not None and not self._quiet:
            self.remote.queue(pages, hashes, token_bytes, self.token_nbytes)

    # -- restore --------------------------------------------------------------------------------
    def num_restorable(self, token_ids: list[int], hits: list[int], last: bytes) -> int:
        """How many pages after the device's `hits` (the last one hashed `last`) a restore would bring
        back from the node's tier now (POST /v1/prefix/match): its ready entries continuing the chain,
        up to the prompt's last full page before its last token and to what an allocation can get.
        A peek: nothing moves in the device or the tier. The remote tier is not asked (a round trip
        to the store per call, where the route costs microseconds)."""
        if self.local is None or not self.allocator.enable_prefix_caching:
            return 0
        max_hits = (len(token_ids) - 1) // self.page_size
        if len(hits) >= max_hits:
            return 0
        rest = checked_token_bytes(token_ids[len(hits) * self.page_size : max_hits * self.page_size])
        found = len(self.local.index.match(last, rest, self.token_nbytes, touch=False))
        if not found:
            return 0
        # restore() holds the device hits first: the cached ones among them are not there to allocate.
        held = int(np.count_nonzero(self.allocator.ref_count[hits] == 0)) if hits else 0
        return max(0, min(found, self.allocator.num_available - held))

    async def restore(self, token_ids: list[int], tenant: str, cache_salt: str) -> None:
        """Bring back the pages of the prompt that the device lacks and the tiers hold (see the module
        docstring); never raises for a tier's failure (the hit is then shorter).

        Shielded: a caller cancelled meanwhile (a client gone) leaves the restore to finish, so fresh
        pages are never freed while a copy into them may still run (on the IO thread, say)."""
        if not self.allocator.enable_prefix_caching:
            return
        await asyncio.shield(self._restore(token_ids, tenant, cache_salt))

    async def _restore(self, token_ids: list[int], tenant: str, cache_salt: str) -> None:
        hits, last, _ = self.state.sequences.prefixes.match(token_ids, tenant, cache_salt)
        max_hits = (len(token_ids) - 1) // self.page_size
        if len(hits) >= max_hits:
            return
        size = self.token_nbytes
        rest = checked_token_bytes(token_ids[len(hits) * self.page_size : max_hits * self.page_size])
        # (A local tier's incident, a full disk typically, stops its spills, not its reads.)
        local = self.local.index.match(last, rest, size) if self.local else []
        if self.local is not None and not local:
            self.local.stats.misses += 1
        limit = max_hits - len(hits)
        remote = await self.remote.count(last, rest, size, len(local), limit) if self.remote else ([], [])
        await self._restore_found(hits, last, rest, local, remote)

    async def _restore_found(
        self, hits: list[int], last: bytes, rest: bytes, local: list[tuple[bytes, int]], remote: Chain
    ) -> None:
        size = self.token_nbytes
        if not local and not remote[0]:
            return
        if hits:
            self.allocator.acquire_cached(hits)
        try:
            num = min(len(local) + len(remote[0]), self.allocator.num_available)
            if num <= 0:
                return
            fresh = self.allocator.allocate(num).tolist()
            try:
                num = await self._copy_in(fresh, local, remote)
                if num:  # all copies in: commit what came back, chained after the device hits
                    self._quiet = True
                    try:
                        self.allocator.commit(fresh[:num], last, rest[: num * size], size, not hits)
                    finally:
                        self._quiet = False
            finally:  # cached if committed, free if not
                self.allocator.release(np.array(fresh[::-1], dtype=np.int64))
        finally:
            if hits:
                self.allocator.release(np.array(hits[::-1], dtype=np.int64))

    async def _copy_in(self, fresh: list[int], local: list[tuple[bytes, int]], remote: Chain) -> int:
        """Copy into `fresh` what the tiers hold, local entries first; returns how many pages came in,
        from the first (0 on a local failure; the local ones on a remote failure). Local entries
        evicted meanwhile (by this very allocation) cut the run."""
        tier, num = self.local, len(fresh)
        num_local = 0
        for page_hash, slot in local[:num]:
            entry = tier.index.entry(page_hash) if tier else None
            if entry is None or entry.slot != slot or entry.pending:
                break
            num_local += 1
        if num_local < len(local):
            num = num_local  # the chain broke: the remote pages after it cannot be used
        if num_local:
            assert tier is not None
            try:
                slots, hashes = [s for _, s in local[:num_local]], [h for h, _ in local[:num_local]]
                if isinstance(tier, HostTier):
                    await self.engine.submit(tier.read_job(slots, fresh[:num_local]))
                else:
                    await self._read_disk(tier, slots, hashes, fresh[:num_local])
            except Exception as exc:
                if isinstance(exc, TierDataError):
                    gone = [h for h, slot in local[:num_local] if tier.index.discard(h, slot)]  # never read again
                    if gone and self.events is not None:
                        self.events.tier_removed(tier.medium, gone)
                tier.incident.failed(tier.stats, exc)
                return 0
            tier.stats.hits += num_local
            tier.stats.bytes_in += num_local * self.codec.page_nbytes
        if num > num_local and self.remote is not None:
            hashes, tokens = remote[0][: num - num_local], remote[1][: num - num_local]
            num = num_local + await self.remote.read_into(hashes, tokens, fresh[num_local:num])
        return num

    async def _read_disk(self, tier: DiskTier, slots: list[int], hashes: list[bytes], pages: list[int]) -> None:
        """Read into `pages`: on a CPU pool straight into the pool (the pages are this restore's alone,
        uncommitted), once every job submitted before (the spills of their old content) has run;
        elsewhere through a host buffer and an engine copy."""
        if not tier.direct:
            staging = np.empty((len(pages), self.codec.page_nbytes), dtype=np.uint8)
            await asyncio.wrap_future(tier.read(slots, hashes, list(staging)))
            await self.engine.submit(lambda: self.codec.scatter(pages, torch.from_numpy(staging)))
            return
        await self.engine.submit(lambda: None)
        await asyncio.wrap_future(tier.read(slots, hashes, [self.codec.host_page(p) for p in pages]))

    def stop(self) -> None:
        """No more remote writes (before the engine closes)."""
        if self.remote is not None:
            self.remote.stop()

    def close(self) -> None:
        """After the engine closed: no job can reach the tiers any more."""
        for tier in (self.local, self.remote):
            if tier is not None:
                tier.close()


def _catching(job: Callable[[], None]) -> Callable[[], BaseException | None]:
    """An engine job that returns its exception instead of raising it (nobody awaits a spill)."""

    def run() -> BaseException | None:
        try:
            job()
        except Exception as exc:
            return exc
        return None

    return run
