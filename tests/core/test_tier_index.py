"""TierIndex: slots of a lower tier, LRU, pending entries, exact keys; random operations keep every
slot in exactly one place."""

import hashlib

import hypothesis.strategies as st
from hypothesis import given

from service.core.hashing import root_hash, token_bytes
from service.core.tier_index import TierIndex, chain_hashes

ROOT = root_hash("")
NB = 16  # token bytes per page: 2 tokens


def page(parent: bytes, tokens: list[int]) -> tuple[bytes, bytes]:
    key = parent + token_bytes(tokens)
    return hashlib.sha256(key).digest(), key


def test_reserve_evicts_the_least_recently_used_and_match_skips_pending() -> None:
    t = TierIndex(2)
    h0, k0 = page(ROOT, [1, 2])
    h1, k1 = page(h0, [3, 4])
    h2, k2 = page(ROOT, [9, 9])
    assert t.reserve(h1, k1) == (1, [])  # slots from the top: a tail-first eviction fills them upwards
    assert t.reserve(h0, k0) == (0, [])
    data = token_bytes([1, 2, 3, 4])
    assert t.match(ROOT, data, NB) == []  # pending: not visible yet
    assert t.ready(h0, 0) and t.ready(h1, 1)
    assert t.match(ROOT, data, NB) == [(h0, 0), (h1, 1)]
    assert t.reserve(h1, k1) is None  # already here: now the most recent
    assert t.reserve(h2, k2) == (0, [h0])  # h0 was the least recently used
    assert t.match(ROOT, data, NB) == []  # the chain starts with h0, gone
    assert not t.ready(h0, 0)  # a late write for an evicted entry changes nothing
    assert t.discard(h2, 0) and t.num_free == 1
    t.check()


def test_a_key_that_does_not_match_is_a_miss() -> None:
    t = TierIndex(1)
    h0, _ = page(ROOT, [1, 2])
    t.reserve(h0, ROOT + token_bytes([5, 6]))  # the hash of one page under another page's key
    t.ready(h0, 0)
    assert t.match(ROOT, token_bytes([1, 2]), NB) == []


def test_chain_hashes_is_the_prefix_index_chain() -> None:
    h0, _ = page(ROOT, [1, 2])
    h1, _ = page(h0, [3, 4])
    assert chain_hashes(ROOT, token_bytes([1, 2, 3, 4, 5]), NB) == [h0, h1]
    assert chain_hashes(ROOT, token_bytes([1, 2, 3, 4]), NB, limit=1) == [h0]


ops = st.lists(st.tuples(st.sampled_from(["reserve", "ready", "discard", "match"]), st.integers(0, 7)), max_size=60)


@given(ops, st.integers(0, 4))
def test_random_operations_keep_every_slot_in_one_place(operations: list[tuple[str, int]], num_slots: int) -> None:
    t = TierIndex(num_slots)
    pages = [page(ROOT, [i, i]) for i in range(8)]
    model: dict[bytes, bool] = {}  # hash -> ready, for the entries that should be there
    for op, i in operations:
        h, key = pages[i]
        entry = t.entry(h)
        if op == "reserve":
            got = t.reserve(h, key)
            if h in model or num_slots == 0:
                assert got is None
            else:
                assert got is not None
                for old in got[1]:
                    del model[old]
                model[h] = False
        elif op == "ready" and entry is not None:
            assert t.ready(h, entry.slot)
            model[h] = True
        elif op == "discard" and entry is not None:
            assert t.discard(h)
            del model[h]
        elif op == "match":
            found = t.match(ROOT, token_bytes([i, i]), NB)
            assert found == ([(h, entry.slot)] if entry is not None and model[h] else [])
        t.check()
        assert len(t) == len(model) <= num_slots and set(t.slots()) == set(model)
        assert t.num_free + len(t) == num_slots


def test_a_peek_moves_nothing_and_evictions_name_the_entries_that_were_ready() -> None:
    t = TierIndex(2)
    h0, k0 = page(ROOT, [1, 2])
    h1, k1 = page(h0, [3, 4])
    h2, k2 = page(ROOT, [9, 9])
    t.reserve(h0, k0)
    t.reserve(h1, k1)
    t.ready(h0, 1)
    t.ready(h1, 0)
    data = token_bytes([1, 2, 3, 4])
    assert t.match(ROOT, data, NB, touch=False) == [(h0, 1), (h1, 0)]
    assert list(t.slots()) == [h0, h1]  # h0 still the least recently used
    ready: list[bytes] = []
    assert t.reserve(h2, k2, ready) == (1, [h0]) and ready == [h0]
    h3, k3 = page(ROOT, [8, 8])
    ready.clear()
    assert t.reserve(h3, k3, ready) == (0, [h1]) and ready == [h1]
    assert t.reserve(h0, k0, ready) == (1, [h2]) and ready == [h1]  # h2 was pending: never seen
    t.check()
