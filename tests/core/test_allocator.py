"""PageAllocator on tiny pools: exact page ids, reference counts, prefix cache, LRU eviction."""

import copy
import hashlib

import numpy as np
import pytest

from service.core.allocator import PageAllocator
from service.core.errors import OutOfPages
from service.core.hashing import page_hash, root_hash, token_bytes
from tests.core.helpers import future_pages


def pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def counts(a: PageAllocator) -> tuple[int, int, int]:
    return a.num_used, a.num_cached, a.num_free


ROOT = root_hash("")


def commit_tokens(a: PageAllocator, page: int, tokens: list[int], parent: bytes = ROOT) -> bytes:
    """Commit one full page holding `tokens`; returns its chained hash."""
    return a.commit([page], parent, token_bytes(tokens), 8 * len(tokens))


def find(a: PageAllocator, pages_of_tokens: list[list[int]], parent: bytes = ROOT) -> list[int]:
    """The committed pages matching the leading pages of a prompt."""
    data = token_bytes([t for page in pages_of_tokens for t in page])
    return a.match(parent, data, 8 * len(pages_of_tokens[0]))[0]


def test_fresh_pool_hands_out_pages_in_order() -> None:
    a = PageAllocator(8)
    assert counts(a) == (0, 0, 8)
    assert a.allocate(3).tolist() == [0, 1, 2]
    assert a.allocate(2).tolist() == [3, 4]
    assert a.allocate(0).tolist() == []
    assert a.ref_count.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert counts(a) == (5, 0, 3)
    assert a.can_allocate(3) and not a.can_allocate(4)


def test_rejects_an_empty_pool() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0)


def test_out_of_pages_changes_nothing() -> None:
    a = PageAllocator(8)
    a.allocate(5)
    h = commit_tokens(a, 4, [1, 2, 3, 4])
    a.release(pages(4))
    before = (a.ref_count.tolist(), counts(a), a.cached_pages(), future_pages(a))
    with pytest.raises(OutOfPages) as err:
        a.allocate(5)  # 3 free + 1 cached = 4 available
    assert (err.value.needed, err.value.available, err.value.code) == (5, 4, "out_of_pages")
    assert (a.ref_count.tolist(), counts(a), a.cached_pages(), future_pages(a)) == before
    assert a.page_name(4) == h and a.num_evictions == 0


def test_released_pages_come_back_first_given_first() -> None:
    a = PageAllocator(8)
    a.allocate(4)
    # A freed block table [0, 1, 2] is released tail first.
    assert a.release(pages(2, 1, 0)) == 3
    assert counts(a) == (1, 0, 7)
    assert a.allocate(4).tolist() == [2, 1, 0, 4]
    assert a.allocate(3).tolist() == [5, 6, 7]


def test_shared_pages_stay_used_until_the_last_reference() -> None:
    a = PageAllocator(4)
    a.allocate(2)
    a.retain(pages(0, 1))
    assert a.ref_count.tolist() == [2, 2, 0, 0]
    assert a.release(pages(1, 0)) == 0
    assert a.ref_count.tolist() == [1, 1, 0, 0] and counts(a) == (2, 0, 2)
    assert a.release(pages(1, 0)) == 2
    assert counts(a) == (0, 0, 4)


def test_committed_pages_become_cached_on_release_and_are_found_by_their_tokens() -> None:
    a = PageAllocator(4, content_names=True)
    a.allocate(2)
    h0 = commit_tokens(a, 0, [7, 8])
    h1 = commit_tokens(a, 1, [9, 10], parent=h0)
    assert h0 == page_hash(ROOT, token_bytes([7, 8])) and h1 == page_hash(h0, token_bytes([9, 10]))
    assert a.page_name(0) == h0 and a.page_name(1) == h1 and a.page_name(2) is None
    assert counts(a) == (2, 0, 2)  # committed pages in use are still used
    assert a.release(pages(1, 0)) == 2
    assert counts(a) == (0, 2, 2)
    assert a.cached_pages() == [1, 0]  # tail first: evicted first
    assert a.match(ROOT, token_bytes([7, 8, 9, 10, 11, 12]), 16) == ([0, 1], h1)
    assert find(a, [[7, 8], [9, 0]]) == [0]
    assert find(a, [[9, 10]]) == []  # the right tokens under the wrong parent
    assert find(a, [[7, 8]], parent=root_hash("other")) == []
    a.acquire_cached([0, 1])
    assert counts(a) == (2, 0, 2) and a.ref_count.tolist() == [1, 1, 0, 0]
    a.acquire_cached([0])  # a hit on a page in use only takes a reference
    assert a.ref_count.tolist() == [2, 1, 0, 0] and a.cached_pages() == []


@pytest.mark.usefixtures("colliding_digests")
def test_a_digest_collision_is_no_hit_unless_the_tokens_are_equal() -> None:
    a = PageAllocator(4, content_names=True)
    a.allocate(3)
    h = commit_tokens(a, 0, [1, 2])
    assert commit_tokens(a, 1, [3, 4], parent=h) == h  # a different page under the same hash
    a.release(pages(1, 0))
    assert find(a, [[1, 2], [5, 6]]) == [0]
    assert find(a, [[1, 2], [3, 4]]) == [0, 1]
    assert find(a, [[3, 4]]) == []


def serial(count: int) -> bytes:
    """The serial name given by an allocator's count-th registration."""
    return b"kvpool serial page name\x00" + count.to_bytes(8, "little")


@pytest.mark.parametrize("content_names", [False, True])
def test_a_parent_evicted_and_registered_again_reaches_its_children_only_by_content(content_names: bool) -> None:
    a = PageAllocator(3, content_names=content_names)
    a.allocate(3)
    h0 = commit_tokens(a, 0, [7, 8])
    h1 = commit_tokens(a, 1, [9, 10], parent=h0)
    if not content_names:
        assert (h0, h1) == (serial(1), serial(2))
    assert [a.page_name(p) for p in range(3)] == [h0, h1, None]
    assert commit_tokens(a, 2, [9, 10], parent=h0) == h1  # a key already registered: its name, page 2 unnamed
    assert find(a, [[7, 8], [9, 10], [1, 1]]) == [0, 1] and find(a, [[9, 10]]) == []
    a.release(pages(0))
    a.release(pages(1))  # the parent released first: evicted first
    a.release(pages(2))  # never registered: freed
    assert a.cached_pages() == [0, 1] and a.allocate(2).tolist() == [0, 2]  # page 0 evicted
    assert find(a, [[7, 8], [9, 10]]) == []
    h0_again = commit_tokens(a, 0, [7, 8])
    assert a.cached_pages() == [1]
    if content_names:  # the same content, the same name: page 1 is reachable again
        assert h0_again == h0 and find(a, [[7, 8], [9, 10]]) == [0, 1]
    else:  # a name is never given twice: page 1's key names a registration that is gone
        assert h0_again == serial(3) and find(a, [[7, 8], [9, 10]]) == [0]


def test_a_listener_needs_content_names() -> None:
    class Silent:
        def stored(self, *args: object) -> None: ...
        def removed(self, *args: object) -> None: ...
        def cleared(self) -> None: ...

    with pytest.raises(ValueError, match="content_names"):
        PageAllocator(4).add_listener(Silent())
    named = PageAllocator(4, content_names=True)
    named.add_listener(Silent())
    assert len(named.listeners) == 1


def test_commit_keeps_the_first_page_of_some_content_and_the_first_entry_of_a_page() -> None:
    a = PageAllocator(4)
    a.allocate(2)
    h = commit_tokens(a, 0, [1, 2])
    assert commit_tokens(a, 1, [1, 2]) == h  # same content on another page: page 0 stays the one found
    assert find(a, [[1, 2]]) == [0] and a.page_name(1) is None
    commit_tokens(a, 0, [5, 6])  # page 0 is already committed: its entry stays
    assert a.page_name(0) == h and find(a, [[5, 6]]) == []
    assert a.release(pages(1, 0)) == 2
    assert counts(a) == (0, 1, 3) and a.cached_pages() == [0]


def test_eviction_waits_until_no_free_page_is_left_and_takes_the_least_recently_released() -> None:
    a = PageAllocator(6)
    a.allocate(6)
    hs = {p: commit_tokens(a, p, [p, p]) for p in range(4)}
    a.release(pages(2))
    a.release(pages(0))
    a.release(pages(3))
    a.release(pages(1))
    a.release(pages(5, 4))  # unhashed: free
    assert a.cached_pages() == [2, 0, 3, 1] and counts(a) == (0, 4, 2)
    assert a.allocate(2).tolist() == [5, 4]  # free pages first, no eviction
    assert a.num_evictions == 0 and a.cached_pages() == [2, 0, 3, 1]
    assert a.allocate(1).tolist() == [2]
    assert a.num_evictions == 1 and a.cached_pages() == [0, 3, 1]
    assert a.page_name(2) is None and find(a, [[2, 2]]) == []
    assert find(a, [[0, 0]]) == [0] and a.page_name(0) == hs[0]
    # Evicting several pages at once hands them out in an exact (deterministic) order.
    assert a.allocate(2).tolist() == [3, 0]
    assert a.num_evictions == 3 and a.cached_pages() == [1]
    assert counts(a) == (5, 1, 0)


def test_a_hit_and_a_second_release_move_a_page_to_the_back_of_the_lru_order() -> None:
    a = PageAllocator(3)
    a.allocate(3)
    for p in range(3):
        commit_tokens(a, p, [p])
    a.release(pages(0, 1, 2))
    assert a.cached_pages() == [0, 1, 2]
    a.acquire_cached([0])
    a.release(pages(0))
    assert a.cached_pages() == [1, 2, 0]
    assert a.allocate(1).tolist() == [1]
    assert a.page_name(1) is None and a.page_name(0) is not None and a.page_name(2) is not None


def test_mixed_eviction_and_free_pages_and_out_of_pages_with_cached_pages() -> None:
    a = PageAllocator(4)
    a.allocate(4)
    for p in range(3):
        commit_tokens(a, p, [p])
    a.release(pages(2, 1, 0, 3))
    assert a.cached_pages() == [2, 1, 0] and counts(a) == (0, 3, 1)
    assert future_pages(a) == [0, 1, 2, 3]
    assert a.allocate(3).tolist() == [1, 2, 3]
    assert a.cached_pages() == [0] and a.num_evictions == 2
    with pytest.raises(OutOfPages):
        a.allocate(2)
    assert a.cached_pages() == [0] and counts(a) == (3, 1, 0)


def test_allocate_into_a_block_table_row_and_release_it_tail_first() -> None:
    a = PageAllocator(6)
    row = np.full(8, 6, dtype=np.uint32)  # a block-table row: the sentinel past its pages
    a.allocate_into(row[2:5])
    assert row.tolist() == [6, 6, 0, 1, 2, 6, 6, 6] and a.ref_count.tolist() == [1, 1, 1, 0, 0, 0]
    assert a.release(row[2:5][::-1]) == 3  # tail first, as free() does: page 2 is popped next
    assert counts(a) == (0, 0, 6) and a.allocate(4).tolist() == [2, 1, 0, 3]


@pytest.mark.parametrize(
    "bad",
    [np.empty(4, dtype=np.int64)[::2], np.empty(2, dtype=np.int32), np.empty((2, 1), dtype=np.int64)],
    ids=["strided", "int32", "2-D"],
)
def test_allocate_into_a_bad_array_evicts_nothing(bad: np.ndarray) -> None:
    a = PageAllocator(2)
    a.allocate(2)
    commit_tokens(a, 0, [1])
    commit_tokens(a, 1, [2])
    a.release(pages(0, 1))
    before = (a.ref_count.tolist(), counts(a), a.cached_pages(), future_pages(a), a.num_evictions)
    with pytest.raises(ValueError):
        a.allocate_into(bad)  # both pages would have to be evicted first
    assert (a.ref_count.tolist(), counts(a), a.cached_pages(), future_pages(a), a.num_evictions) == before


def test_hashes_chain_the_parent_hash_and_the_tenant_salt() -> None:
    root = hashlib.sha256(b"kvpool-prefix-v1\x00tenant-a").digest()
    assert root_hash("tenant-a") == root and root_hash("tenant-b") != root
    data = np.array([1, 2**40, 3], dtype="<i8").tobytes()
    assert token_bytes([1, 2**40, 3]) == data
    assert page_hash(root, data) == hashlib.sha256(root + data).digest()


def test_a_deep_copy_works_on_its_own_arrays() -> None:
    # The compiled holders of the arrays (FreeStack, IndexArrays) are copied onto the copy's arrays.
    a = PageAllocator(8)
    a.allocate(2)
    commit_tokens(a, 0, [1, 2])
    twin = copy.deepcopy(a)
    assert twin.allocate(3).tolist() == [2, 3, 4] and counts(twin) == (5, 0, 3)
    commit_tokens(twin, 2, [3, 4])
    twin.release(pages(1, 0))
    assert counts(a) == (2, 0, 6) and a.allocate(1).tolist() == [2]
    assert find(a, [[1, 2]]) == [0] and find(a, [[3, 4]]) == [] and find(twin, [[3, 4]]) == [2]
    assert twin.cached_pages() == [0] and a.cached_pages() == []
