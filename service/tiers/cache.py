"""The prefix cache as one object: the device's prefix index, then an ordered list of tiers below it
(service/tiers/tier.py: the spill tier, then the remote one), matched and restored as one.

Built from what it uses: the allocator (whose listener it is: it hands the tiers what the device's
index evicts and commits), the device's prefix match, the page size, and the tiers, each built with
its own dependencies (the engine, the page codec, an event sink; service/pool.py builds them).

Restore (restore(), awaited by PoolState.create_sequence before the core's create): match the device,
then ask each tier in order for the pages after those found so far (lookup); take fresh device pages
for what the tiers hold, load each tier's into its share of them, in order, and only when the loads
are in commit the pages into the prefix index, up to the first that did not come in intact (a tier
that loads fewer than it found ends the run: the pages after it could not chain). The fresh pages
after the last good one are freed uncommitted, so the hit is the shorter one. The commit says where
its pages come from (`RESTORED`): the tiers are not handed back what they gave. Evictions the
allocation made stay made, as for any allocation (the evicted pages were spilled first, if a spill
tier is on). The device hits are held meanwhile, so nothing this call allocates can evict them; the
create that follows, with no await in between, finds all the pages in the device's index and counts
them in cached_tokens.
"""

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from service.core.allocator import PageAllocator
from service.core.cache_listener import COMPUTED, RESTORED
from service.core.plan import checked_token_bytes
from service.tiers.tier import Found, PromptChain, Tier

# The device's prefix match: (token ids, tenant, cache salt) -> (hit pages, the last one's hash, ...).
DeviceMatch = Callable[[list[int], str, str], tuple[list[int], bytes, Any]]


class PrefixCache:
    def __init__(self, allocator: PageAllocator, device_match: DeviceMatch, page_size: int, tiers: list[Tier]) -> None:
        self.allocator, self.device_match, self.tiers = allocator, device_match, tiers
        self.page_size, self.token_nbytes = page_size, page_size * 8  # (token ids as int64)
        if tiers:
            allocator.add_listener(self)

    def _chain(self, token_ids: list[int], hits: list[int], last: bytes) -> PromptChain | None:
        """The prompt's full pages after the device's hits, up to the one before its last token (a hit
        never covers it), or None if there are none."""
        max_hits = (len(token_ids) - 1) // self.page_size
        if len(hits) >= max_hits:
            return None
        rest = checked_token_bytes(token_ids[len(hits) * self.page_size : max_hits * self.page_size])
        return PromptChain(last, rest, self.token_nbytes)

    # -- the allocator's listener (on the loop, inside its calls: quick; the tiers never raise) ----
    def removed(self, pages: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        for tier in self.tiers:
            tier.evicted(pages, hashes, keys)

    def stored(
        self, pages: np.ndarray, hashes: np.ndarray, parent: bytes, token_bytes: bytes, at_root: bool, origin: str
    ) -> None:
        if origin == COMPUTED:
            for tier in self.tiers:
                tier.committed(pages, hashes, token_bytes)

    def cleared(self) -> None:
        """A prefix-cache reset that left nothing registered: the tiers keep what they hold (the remote
        one is shared with other nodes), and the dropped device pages are not copied down."""

    # -- lookups ----------------------------------------------------------------------------------
    def match(self, token_ids: list[int], tenant: str, cache_salt: str) -> tuple[int, int]:
        """(device pages, tier pages) of the prompt's prefix a create would start on now (POST
        /v1/prefix/match): the device's hits, then what the tiers would restore, each peeked (nothing
        moves in the device or a tier; a tier that needs a round trip counts none), capped by what an
        allocation can get."""
        hits, last, _ = self.device_match(token_ids, tenant, cache_salt)
        if not self.tiers or not self.allocator.enable_prefix_caching:
            return len(hits), 0
        chain = self._chain(token_ids, hits, last)
        if chain is None:
            return len(hits), 0
        found = 0
        for tier in self.tiers:
            found += tier.peek(chain, found, len(chain))
        if not found:
            return len(hits), 0
        # restore() holds the device hits first: the cached ones among them are not there to allocate.
        held = int(np.count_nonzero(self.allocator.ref_count[hits] == 0)) if hits else 0
        return len(hits), max(0, min(found, self.allocator.num_available - held))

    async def restore(self, token_ids: list[int], tenant: str, cache_salt: str) -> None:
        """Bring back the pages of the prompt that the device lacks and the tiers hold (see the module
        docstring); never raises for a tier's failure (the hit is then shorter).

        Shielded: a caller cancelled meanwhile (a client gone) leaves the restore to finish, so fresh
        pages are never freed while a load into them may still run (on an IO thread, say)."""
        if self.tiers and self.allocator.enable_prefix_caching:
            await asyncio.shield(self._restore(token_ids, tenant, cache_salt))

    async def _restore(self, token_ids: list[int], tenant: str, cache_salt: str) -> None:
        hits, last, _ = self.device_match(token_ids, tenant, cache_salt)
        chain = self._chain(token_ids, hits, last)
        if chain is None:
            return
        founds: list[Found] = []
        num = 0
        for tier in self.tiers:
            began = time.perf_counter()
            founds.append(await tier.lookup(chain, num, len(chain)))
            tier.stats.lookup_seconds += time.perf_counter() - began
            num += len(founds[-1])
        if not num:
            return
        if hits:
            self.allocator.acquire_cached(hits)
        try:
            num = min(num, self.allocator.num_available)
            if num > 0:
                await self._load(chain, founds, self.allocator.allocate(num).tolist(), not hits)
        finally:
            if hits:
                self.allocator.release(np.array(hits[::-1], dtype=np.int64))

    async def _load(self, chain: PromptChain, founds: list[Found], fresh: list[int], at_root: bool) -> None:
        """Each tier's pages into its share of `fresh`, in order, then the leading run that came in
        committed; the rest freed."""
        try:
            got = 0
            for tier, found in zip(self.tiers, founds):
                want = min(len(found), len(fresh) - got)
                if want <= 0:
                    break
                began = time.perf_counter()
                loaded = await tier.load_into(found[:want], fresh[got : got + want])
                tier.stats.load_seconds += time.perf_counter() - began
                got += loaded
                if loaded < want:
                    break
            if got:  # all loads in: commit what came back, chained after the device hits
                size = self.token_nbytes
                self.allocator.commit(fresh[:got], chain.last, chain.rest[: got * size], size, at_root, RESTORED)
        finally:  # cached if committed, free if not
            self.allocator.release(np.array(fresh[::-1], dtype=np.int64))

    # -- reports and shutdown ---------------------------------------------------------------------
    def report(self) -> list[dict[str, Any]]:
        """Each tier's size, use and counts: GET /v1/pool shows them, the metrics export them."""
        return [tier.report() for tier in self.tiers]

    def tier(self, name: str) -> Tier | None:
        return next((tier for tier in self.tiers if tier.name == name), None)

    def stop(self) -> None:
        """No more writes to the tiers (before the engine closes)."""
        for tier in self.tiers:
            tier.stop()

    def close(self) -> None:
        """After the engine closed: no job can reach the tiers any more."""
        for tier in self.tiers:
            tier.close()
