"""Page allocator: a free stack, reference counts, and a prefix cache with LRU eviction.

Every page is in exactly one of three states:
  used   ref_count > 0 (held by at least one block table)
  cached ref_count == 0, registered in the prefix index, reusable on a hit, evictable (LRU order)
  free   ref_count == 0, empty
Allocation takes free pages first and evicts the least recently released cached pages only when
no free page is left. All bulk paths are numpy operations; the per-page loops of the prefix cache
(commit, lookup, eviction, the LRU list) are in service/core/prefix_index.py, compiled by Cython,
each in O(1) per page.

Prefix index: a committed page is keyed by its parent's name ‖ its token ids, so a lookup walks a
prompt's pages with exact probes: a hit computes no hash of its own (the matched page's stored name
is the next probe's parent) and can never be fooled by a collision, since the full token ids are
part of the key. A page's name is, with content_names, its chained SHA-256 hash
(service.core.hashing: the same in every process, what KV events and the tiers publish and look up
by; SHA-256 runs once per page, at commit), else a serial name unique for the pool's life (no
hashing at all; prefix_index.py says what that changes). Listeners need content names.
"""

import numpy as np

from service.core import lru, page_ops, prefix_index, probe_hash
from service.core.cache_listener import COMPUTED, CacheListener
from service.core.errors import OutOfPages


class PageAllocator:
    def __init__(self, num_pages: int, enable_prefix_caching: bool = True, content_names: bool = False) -> None:
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = np.zeros(num_pages, dtype=np.int32)
        # Free stack: the top is the end; reversed so that a fresh pool hands out 0, 1, 2, ...
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = num_pages
        self._stack = page_ops.FreeStack(self._free, self.ref_count)  # pop() and release() on those two
        # Unreferenced registered pages, oldest release first (the eviction order): a
        # linked list in an array (service/core/lru.py), O(1) per page, no Python objects.
        self._lru = lru.new_lru(num_pages)
        self._num_cached = 0
        # The prefix index (prefix_index.py): pages keyed by parent name ‖ token bytes; the keys
        # array comes with the first commit.
        self._table, self._key_hash, self._hashes, self._is_hashed = prefix_index.new_index(num_pages)
        self._keys: np.ndarray | None = None
        self._seed: np.ndarray | None = None  # the probe hash's secret key (probe_hash.new_seed)
        self._namer = None if content_names else prefix_index.new_namer()  # (serial names' state)
        self._index = self._index_arrays()  # the compiled calls over all of these
        self.num_evictions = 0
        # Watchers of the prefix cache (KV events, lower tiers; add_listener): told of every page that
        # enters or leaves the index. Empty by default, and then it costs one truth test per commit/eviction.
        self.listeners: list[CacheListener] = []

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free - self._num_cached

    @property
    def num_available(self) -> int:
        """Pages an allocation can obtain: free ones plus evictable cached ones."""
        return self._num_free + self._num_cached

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_available

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, num: int) -> np.ndarray:
        """`num` pages with ref_count 1, in a deterministic order; all or nothing."""
        num = int(num)  # counters stay Python ints (a numpy scalar would leak into JSON)
        if num > self._num_free + self._num_cached:
            raise OutOfPages(num, self.num_available)
        pages = np.empty(max(num, 0), dtype=np.int64)
        self.allocate_into(pages)
        return pages

    def allocate_into(self, out: np.ndarray) -> None:
        """allocate(len(out)) written into `out` (1-D, C-contiguous, int64 or uint32: e.g. a slice of a
        block-table row)."""
        num = len(out)
        if num > self._num_free + self._num_cached:
            raise OutOfPages(num, self.num_available)
        if num == 0:
            return
        if num > self._num_free:
            # page_ops.pop checks `out` too, but eviction comes first: reject a bad one before it.
            if out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError("out must be a writable, C-contiguous 1-D array")
            if out.dtype not in (np.int64, np.uint32):
                raise ValueError(f"out must be int64 or uint32, not {out.dtype}")
            self._evict(num - self._num_free)
        self._stack.pop(self._num_free, out)
        self._num_free -= num

    def _index_arrays(self) -> prefix_index.IndexArrays:
        arrays = (self._table, self._key_hash, self._hashes, self._is_hashed, self._lru, self.ref_count)
        return prefix_index.IndexArrays(*arrays, self._keys, self._seed, self._namer)

    def _evict(self, num: int) -> None:
        evicted = np.asarray(self._index.evict(num), dtype=np.int64)
        self._num_cached -= num
        if self.listeners:
            self._tell_removed(evicted)
        self._push_free(evicted[::-1])
        self.num_evictions += num

    def _tell_removed(self, pages: np.ndarray) -> None:
        # An evicted page's name and key stay in their arrays until the page is committed again.
        hashes, keys = self._hashes[pages], self._keys[pages]  # type: ignore[index]
        for listener in self.listeners:
            listener.removed(pages, hashes, keys)

    def _push_free(self, pages: np.ndarray) -> None:
        """Push so that the first of `pages` is the next one popped."""
        top = self._num_free
        self._free[top : top + len(pages)] = pages[::-1]
        self._num_free = top + len(pages)

    def retain(self, pages: np.ndarray) -> None:
        """One more reference to each of `pages` (all currently used), e.g. for a fork."""
        self.ref_count[pages] += 1

    def release(self, pages: np.ndarray) -> int:
        """Drop one reference to each of `pages` (distinct ids; a 1-D uint32 or int64 array or view).

        Pages left unreferenced become cached (if hashed), in the order given, or free.
        Callers release block tables tail first, so tails are evicted before their prefixes.
        Returns how many pages became unreferenced.
        """
        if len(pages) == 0:
            return 0
        caching = self.enable_prefix_caching and self._keys is not None  # no page is hashed before a commit
        cached = np.empty(len(pages), dtype=np.int64) if caching else None
        hashed = self._is_hashed if caching else None
        released, freed = self._stack.release(self._num_free, hashed, pages, cached)
        self._num_free += freed
        if released > freed:
            self._index.lru_push(cached[: released - freed])  # type: ignore[index]
            self._num_cached += released - freed
        return released

    # -- prefix cache -------------------------------------------------------------------------
    def match(self, parent: bytes, data: bytes, page_nbytes: int) -> tuple[list[int], bytes]:
        """Committed pages matching the leading full pages of `data` (token bytes), chained from
        `parent`; stops at the first miss. Returns (pages, name of the last matched page or parent)."""
        return self._index.match(parent, data, page_nbytes)

    def acquire_cached(self, pages: list[int], out: np.ndarray | None = None) -> None:
        """Take a reference to each of `pages` (distinct), all returned by match(); with `out` (a
        uint32 block-table row), also write them to out[:len(pages)]."""
        self._num_cached -= self._index.acquire(pages, out)

    def reserve_keys(self, page_nbytes: int) -> None:
        """Make the index's key array for pages of page_nbytes token bytes (else the first commit
        does), and touch all of it now: otherwise the first commit into each 4 KiB of it faults the
        memory in, a microsecond every two keys of 2 KiB on the commit path."""
        if self._keys is not None:
            if self._keys.shape[1] != 32 + page_nbytes:
                raise ValueError(f"pages of {page_nbytes} token bytes; this allocator has {self._keys.shape[1] - 32}")
            return
        self._keys = np.empty((self.num_pages, 32 + page_nbytes), dtype=np.uint8)
        self._keys.fill(0)
        self._seed = probe_hash.new_seed(32 + page_nbytes)
        self._index = self._index_arrays()

    def commit(
        self,
        pages: np.ndarray | list[int],
        parent: bytes,
        data: bytes | memoryview,
        page_nbytes: int,
        at_root: bool = False,
        origin: str = COMPUTED,
    ) -> bytes:
        """Register full, written pages (whose token bytes are `data`), each keyed by its parent's name.

        A key already present keeps its page (another sequence committed the same content first);
        a page already registered keeps its entry. Returns the name of the last page. at_root:
        pages[0] is its sequence's first page (`parent` is a chain root), for the listeners, as is
        `origin` (where the pages' K/V comes from: service.core.cache_listener).
        """
        if self._keys is None:
            self.reserve_keys(page_nbytes)
        elif self._keys.shape[1] != 32 + page_nbytes:
            raise ValueError(f"pages of {page_nbytes} token bytes; this allocator has {self._keys.shape[1] - 32}")
        if type(pages) is np.ndarray and pages.dtype == np.uint32 and pages.flags.c_contiguous:
            ids = pages  # a block-table slice goes as it is; a list or another array as int64
        else:
            ids = np.ascontiguousarray(pages, dtype=np.int64)
        if not self.listeners:
            return self._index.commit(ids, parent, data, page_nbytes)
        before = self._is_hashed[ids]
        last = self._index.commit(ids, parent, data, page_nbytes)
        self._tell_stored(ids.astype(np.int64), before, parent, bytes(data), page_nbytes, at_root, origin)
        return last

    def _tell_stored(
        self,
        ids: np.ndarray,
        before: np.ndarray,
        parent: bytes,
        data: bytes,
        page_nbytes: int,
        at_root: bool,
        origin: str,
    ) -> None:
        """Tell listeners of the pages this commit registered, one call per run of consecutive ones
        (a page already registered, or whose key another page holds, ends a run)."""
        new = self._is_hashed[ids] & ~before
        i, n = 0, len(ids)
        while i < n:
            if not new[i]:
                i += 1
                continue
            j = i
            while j < n and new[j]:
                j += 1
            run_parent = parent if i == 0 else self._keys[ids[i], :32].tobytes()  # type: ignore[index]
            tokens = data[i * page_nbytes : j * page_nbytes]
            hashes = self._hashes[ids[i:j]]
            for listener in self.listeners:
                listener.stored(ids[i:j], hashes, run_parent, tokens, at_root and i == 0, origin)
            i = j

    def reset_cache(self) -> int:
        """Drop every cached page (registered, unreferenced) from the prefix index and free it; used
        pages stay registered. Returns how many were dropped; O(cached pages), and with listeners one
        vectorised pass over all pages: they hear cleared() when no registered page is left, else
        removed() of the dropped pages."""
        num = self._num_cached
        if num == 0:
            return 0
        dropped = np.asarray(self._index.evict(num), dtype=np.int64)
        self._num_cached = 0
        if self.listeners:
            if self.has_registered_pages():
                self._tell_removed(dropped)
            else:
                for listener in self.listeners:
                    listener.cleared()
        self._push_free(dropped[::-1])
        return num

    def has_registered_pages(self) -> bool:
        """Some page (cached or used) is in the prefix index. O(num_pages), vectorised."""
        return bool(self._is_hashed.any())

    def cached_pages(self) -> list[int]:
        """Cached pages, next to be evicted first."""
        return lru.lru_pages(self._lru)

    def page_name(self, page: int) -> bytes | None:
        """The name a committed page is registered under (None if it is not): with content_names, its
        chained SHA-256 hash."""
        return self._hashes[page].tobytes() if self._is_hashed[page] else None

    @property
    def content_names(self) -> bool:
        """Pages are named by their chained SHA-256 hash (else serially)."""
        return self._namer is None

    def add_listener(self, listener: CacheListener) -> None:
        """Tell `listener` of every page entering and leaving the index from now on. Listeners get
        pages by their hashes, so the allocator must have been made with content_names."""
        if not self.content_names:
            raise ValueError("cache listeners need an allocator with content_names=True (pages named by their hash)")
        self.listeners.append(listener)
