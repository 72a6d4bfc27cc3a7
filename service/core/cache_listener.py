"""What the prefix cache tells the parts that watch it (KV events, lower tiers).

A listener sees a page when it enters the prefix index and when it leaves it. Calls happen on the
thread that changes the allocator (the event loop), inside the allocator's call: a listener must
not call back into the allocator, and must be quick (queue the work, do not perform it).
"""

from typing import Protocol

import numpy as np

# Where committed pages come from (CacheListener.stored's `origin`): computed by a sequence's writes,
# or restored from a tier below the device (service/tiers/cache.py), which need not be written down again.
COMPUTED, RESTORED = "computed", "restored"


class CacheListener(Protocol):
    def stored(
        self, pages: np.ndarray, hashes: np.ndarray, parent: bytes, token_bytes: bytes, at_root: bool, origin: str
    ) -> None:
        """`pages` (int64 [n], consecutive pages of one sequence, in order) were registered under
        `hashes` (uint8 [n, 32]); the first one's parent hash is `parent`; `token_bytes` holds their
        token ids, little-endian int64, n * page_size of them. `at_root`: the first one is its
        sequence's first page, so `parent` is the chain's root (service.core.hashing.root_hash of
        the tenant and cache salt), not the hash of a page. `origin`: COMPUTED or RESTORED."""

    def removed(self, pages: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        """`pages` (int64 [n]) left the prefix index (evicted, or dropped by a reset) and may be
        reused once the call returns; their K/V is still in place until then. `hashes` (uint8 [n, 32])
        are their hashes, `keys` (uint8 [n, 32 + page_nbytes]) each one's parent hash || token bytes."""

    def cleared(self) -> None:
        """Every page left the prefix index at once (a reset that found no used page registered):
        told instead of removed(); the pages it dropped may be reused once the call returns."""
