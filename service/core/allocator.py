"""Page allocator: a free stack, reference counts, and a prefix cache with LRU eviction.

Every page is in exactly one of three states:
  used   ref_count > 0 (held by at least one block table)
  cached ref_count == 0, holds a committed prefix hash, reusable on a hit, evictable (LRU order)
  free   ref_count == 0, empty
Allocation takes free pages first and evicts the least recently released cached pages only when
no free page is left. All bulk paths are numpy operations; only prefix-cache hits, commits and
evictions touch pages one by one, each in O(1).
"""

from collections import OrderedDict

import numpy as np

from service.core.errors import OutOfPages


class PageAllocator:
    def __init__(self, num_pages: int, enable_prefix_caching: bool = True) -> None:
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = np.zeros(num_pages, dtype=np.int32)
        # Free stack: the top is the end; reversed so that a fresh pool hands out 0, 1, 2, ...
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = num_pages
        # Unreferenced pages with a committed hash, oldest release first (the eviction order).
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._is_hashed = np.zeros(num_pages, dtype=np.bool_)
        self._hash_of_page: dict[int, bytes] = {}
        self._page_of_hash: dict[bytes, int] = {}
        self._tokens_of_page: dict[int, bytes] = {}
        self.num_evictions = 0

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free - len(self._cached)

    @property
    def num_available(self) -> int:
        """Pages an allocation can obtain: free ones plus evictable cached ones."""
        return self._num_free + len(self._cached)

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_available

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, num: int) -> np.ndarray:
        """`num` pages with ref_count 1, in a deterministic order; all or nothing."""
        if num > self.num_available:
            raise OutOfPages(num, self.num_available)
        if num <= 0:
            return np.empty(0, dtype=np.int64)
        if num > self._num_free:
            self._evict(num - self._num_free)
        top = self._num_free
        pages = self._free[top - num : top][::-1].copy()
        self._num_free = top - num
        self.ref_count[pages] = 1
        return pages

    def _evict(self, num: int) -> None:
        evicted = np.empty(num, dtype=np.int64)
        for i in range(num):
            page, _ = self._cached.popitem(last=False)
            self._drop_hash(page)
            evicted[i] = page
        self._push_free(evicted[::-1])
        self.num_evictions += num

    def _push_free(self, pages: np.ndarray) -> None:
        """Push so that the first of `pages` is the next one popped."""
        top = self._num_free
        self._free[top : top + len(pages)] = pages[::-1]
        self._num_free = top + len(pages)

    def retain(self, pages: np.ndarray) -> None:
        """One more reference to each of `pages` (all currently used), e.g. for a fork."""
        self.ref_count[pages] += 1

    def release(self, pages: np.ndarray) -> int:
        """Drop one reference to each of `pages` (distinct ids).

        Pages left unreferenced become cached (if hashed), in the order given, or free.
        Callers pass block tables tail first, so tails are evicted before their prefixes.
        Returns how many pages became unreferenced.
        """
        if len(pages) == 0:
            return 0
        self.ref_count[pages] -= 1
        zero = pages[self.ref_count[pages] == 0]
        if len(zero) == 0:
            return 0
        hashed = self._is_hashed[zero]
        if hashed.any():
            for page in zero[hashed].tolist():
                self._cached[page] = None
            zero = zero[~hashed]
        if len(zero):
            self._push_free(zero)
        return int(len(zero) + hashed.sum())

    # -- prefix cache -------------------------------------------------------------------------
    def lookup(self, page_hash: bytes, page_tokens: bytes) -> int | None:
        """The page committed under `page_hash` whose token ids equal `page_tokens`, if any."""
        page = self._page_of_hash.get(page_hash)
        if page is None or self._tokens_of_page[page] != page_tokens:
            return None
        return page

    def acquire_cached(self, pages: list[int]) -> None:
        """Take a reference to each of `pages`, all returned by lookup()."""
        for page in pages:
            if self.ref_count[page] == 0:
                del self._cached[page]
        self.ref_count[pages] += 1

    def commit(self, page: int, page_hash: bytes, page_tokens: bytes) -> None:
        """Register a full, written page under its hash. A hash already present keeps its page."""
        if page_hash in self._page_of_hash or page in self._hash_of_page:
            return
        self._page_of_hash[page_hash] = page
        self._hash_of_page[page] = page_hash
        self._tokens_of_page[page] = page_tokens
        self._is_hashed[page] = True

    def _drop_hash(self, page: int) -> None:
        del self._page_of_hash[self._hash_of_page.pop(page)]
        del self._tokens_of_page[page]
        self._is_hashed[page] = False

    def cached_pages(self) -> list[int]:
        """Cached pages, next to be evicted first."""
        return list(self._cached)

    def page_hash(self, page: int) -> bytes | None:
        return self._hash_of_page.get(page)
