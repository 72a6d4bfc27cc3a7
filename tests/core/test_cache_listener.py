"""PageAllocator.listeners: told of each page entering and leaving the prefix index, exactly."""

import numpy as np

from service.core.allocator import PageAllocator
from service.core.cache_listener import COMPUTED, RESTORED
from service.core.hashing import page_hash, root_hash, token_bytes

ROOT = root_hash("")
PAGE = 2  # tokens per page


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.origins: list[str] = []

    def stored(
        self, pages: np.ndarray, hashes: np.ndarray, parent: bytes, tokens: bytes, at_root: bool, origin: str
    ) -> None:
        self.calls.append(("stored", pages.tolist(), [h.tobytes() for h in hashes], parent, tokens, at_root))
        self.origins.append(origin)

    def removed(self, pages: np.ndarray, hashes: np.ndarray, keys: np.ndarray) -> None:
        self.calls.append(("removed", pages.tolist(), [h.tobytes() for h in hashes], [k.tobytes() for k in keys]))

    def cleared(self) -> None:
        self.calls.append(("cleared",))


def chain(parent: bytes, pages_of_tokens: list[list[int]]) -> list[bytes]:
    out = []
    for tokens in pages_of_tokens:
        parent = page_hash(parent, token_bytes(tokens))
        out.append(parent)
    return out


def test_commit_reports_new_pages_in_runs_and_eviction_reports_keys() -> None:
    a = PageAllocator(6, content_names=True)
    rec = Recorder()
    a.add_listener(rec)
    tokens = [[11, 12], [13, 14], [15, 16]]
    h = chain(ROOT, tokens)
    # Page 1 already holds the second page's key: pages 0 and 2 are two runs, 1 is never registered.
    a.allocate(4)
    a.commit([1], h[0], token_bytes(tokens[1]), 8 * PAGE)
    assert rec.calls == [("stored", [1], [h[1]], h[0], token_bytes(tokens[1]), False)]
    rec.calls.clear()
    data = token_bytes([t for page in tokens for t in page])
    assert a.commit([0, 3, 2], ROOT, data, 8 * PAGE, at_root=True, origin=RESTORED) == h[2]
    assert rec.calls == [
        ("stored", [0], [h[0]], ROOT, token_bytes(tokens[0]), True),
        ("stored", [2], [h[2]], h[1], token_bytes(tokens[2]), False),  # a later run: never at the root
    ]
    assert rec.origins == [COMPUTED, RESTORED, RESTORED]  # each commit says where its pages come from
    rec.calls.clear()
    # Release 2 then 0 (tail first) and exhaust the free pages: the oldest release goes first.
    a.release(np.array([2, 0], dtype=np.int64))
    assert a.allocate(3).tolist() == [2, 4, 5]  # the evicted page first, as allocate_into pops it
    assert rec.calls == [("removed", [2], [h[2]], [h[1] + token_bytes(tokens[2])])]


def test_no_listener_no_calls_and_same_results() -> None:
    plain, watched = PageAllocator(4, content_names=True), PageAllocator(4, content_names=True)
    rec = Recorder()
    watched.add_listener(rec)
    data = token_bytes([1, 2, 3, 4])
    for a in (plain, watched):
        a.allocate(2)
        assert a.commit([0, 1], ROOT, data, 8 * PAGE) == chain(ROOT, [[1, 2], [3, 4]])[1]
    assert [c[0] for c in rec.calls] == ["stored"]
    assert plain.cached_pages() == watched.cached_pages()


def test_reset_drops_cached_pages_only_and_clears_when_nothing_is_left() -> None:
    a = PageAllocator(6, content_names=True)
    rec = Recorder()
    a.add_listener(rec)
    h = chain(ROOT, [[1, 2], [3, 4], [5, 6]])
    a.allocate(3)
    a.commit([0, 1, 2], ROOT, token_bytes([1, 2, 3, 4, 5, 6]), 8 * PAGE, at_root=True)
    a.release(np.array([2, 1], dtype=np.int64))  # page 0 stays used (and registered)
    rec.calls.clear()
    assert a.reset_cache() == 2
    assert (a.num_used, a.num_cached, a.num_free) == (1, 0, 5)
    assert a.num_evictions == 0  # a reset is not an eviction
    assert rec.calls == [
        ("removed", [2, 1], [h[2], h[1]], [h[1] + token_bytes([5, 6]), h[0] + token_bytes([3, 4])])
    ]  # in LRU order: the tail was released first
    assert a.page_name(0) == h[0] and a.page_name(1) is None
    assert a.match(ROOT, token_bytes([1, 2, 3, 4]), 8 * PAGE) == ([0], h[0])
    rec.calls.clear()
    assert a.reset_cache() == 0 and rec.calls == []
    a.release(np.array([0], dtype=np.int64))
    assert a.reset_cache() == 1 and rec.calls == [("cleared",)]
    assert (a.num_used, a.num_cached, a.num_free) == (0, 0, 6)
    assert a.match(ROOT, token_bytes([1, 2]), 8 * PAGE) == ([], ROOT)
