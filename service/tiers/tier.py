"""What every tier below the device is to the prefix cache (service/tiers/cache.py): one interface.

The cache asks its tiers in order (the spill tier, then the remote one), each for the pages of the
prompt after those the device and the tiers before it hold, the way SGLang's HiCache asks
`batch_exists` (how many consecutive keys from the start) and then `batch_get_v1` (straight into host
slots), and vLLM's OffloadingManager `lookup` / `prepare_load` / `complete_load`:

- `lookup(chain, start, limit)`: the entries of pages start.. of the chain the tier holds now, in
  order, from the first, at most `limit - start` (a tier's own reasons to say none: it is failing, it
  is never asked by a restore). What the cache allocates fresh device pages for.
- `load_into(found, pages)`: those entries' K/V into `pages` (fresh, uncommitted pool pages, this
  restore's alone); returns how many came in intact, from the first. Never raises for the tier's
  failure: a failure is counted, and loads 0.
- `peek(chain, start, limit)`: how many pages lookup would find, moving nothing (POST /v1/prefix/match
  asks on every call: a tier that needs a round trip answers 0).
- `evicted(...)` and `committed(...)`: what the device's prefix index tells (quick, on the loop,
  inside the allocator's call: queue or submit the work, never raise). The spill tier copies evicted
  pages down; the remote tier writes committed ones (computed here, not restored: it has those).
- `report()`: the tier's row of GET /v1/pool and the metrics; `stop()` before the engine closes,
  `close()` after.

A new tier (object storage, another node's memory) is a new class with these methods, given to the
cache in its place in the order.
"""

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from service.core.tier_index import chain_hashes
from service.tiers.stats import TierStats

# Each page a tier found: its hash, and what the tier needs to read it (a slot, the page's token bytes).
Found = list[tuple[bytes, Any]]


@dataclass
class PromptChain:
    """The pages a restore looks for: the prompt's full pages after the device's hits, as token bytes
    (`rest`, `page_nbytes` per page) chained after the page hashed `last`."""

    last: bytes
    rest: bytes
    page_nbytes: int
    _hashes: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rest) // self.page_nbytes

    def hashes(self, stop: int) -> list[bytes]:
        """The chained hashes of pages 0..stop-1 (computed once, as far as asked)."""
        if stop > len(self._hashes):
            parent = self._hashes[-1] if self._hashes else self.last
            start = len(self._hashes)
            more = self.rest[start * self.page_nbytes : stop * self.page_nbytes]
            self._hashes += chain_hashes(parent, more, self.page_nbytes)
        return self._hashes[:stop]

    def parent(self, page: int) -> bytes:
        """The hash page `page` chains from."""
        return self.last if page == 0 else self.hashes(page)[page - 1]

    def tokens(self, page: int) -> bytes:
        return self.rest[page * self.page_nbytes : (page + 1) * self.page_nbytes]

    def after(self, page: int) -> bytes:
        """The token bytes of pages page.. (the whole rest uncopied from page 0: the usual case)."""
        return self.rest if page == 0 else self.rest[page * self.page_nbytes :]


class TierEvents(Protocol):
    """Where a tier tells what it holds (KV events: service/events/listener.EventListener)."""

    def tier_stored(self, medium: str, hashes: list[bytes], keys: list[bytes]) -> None: ...

    def tier_removed(self, medium: str, hashes: list[bytes]) -> None: ...


class Tier(Protocol):
    name: str
    stats: TierStats  # its counts (PrefixCache adds the restores' time on it)

    async def lookup(self, chain: PromptChain, start: int, limit: int) -> Found: ...

    async def load_into(self, found: Found, pages: list[int]) -> int: ...

    def peek(self, chain: PromptChain, start: int, limit: int) -> int: ...

    def evicted(self, pages: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None: ...

    def committed(self, pages: np.ndarray, hashes: np.ndarray, token_bytes: bytes) -> None: ...

    def report(self) -> dict[str, Any]: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...
