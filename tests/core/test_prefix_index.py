"""The prefix-index loops (service/core/prefix_index.py): their errors, and a random program run on
the compiled build and on the same file run as plain Python, which must agree byte for byte."""

import hashlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from service.core import prefix_index as pi
from service.core.hashing import root_hash
from tests.core.conftest import load_source

source = load_source("prefix_index")


@given(st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 2**63 - 1, -(2**63)]))))
def test_int64_bytes_are_little_endian_int64(ids: list[int]) -> None:
    assert pi.int64_bytes(ids) == source.int64_bytes(ids) == np.array(ids, dtype="<i8").tobytes()


@pytest.mark.parametrize(
    ("ids", "error"), [([1, 2**63], OverflowError), ([-(2**63) - 1], OverflowError), ([1, 2.0], TypeError)]
)
def test_int64_bytes_rejects_what_does_not_fit(ids: list[object], error: type[Exception]) -> None:
    for convert in (pi.int64_bytes, source.int64_bytes):
        with pytest.raises(error):
            convert(ids)


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12), st.integers(-1, 14), st.integers(-1, 14))
def test_int64_bytes_of_a_range_is_that_of_the_slice(ids: list[int], start: int, stop: int) -> None:
    expected = np.array(ids[max(start, 0) : len(ids) if stop < 0 else stop], dtype="<i8").tobytes()
    for convert in (pi.int64_bytes, source.int64_bytes):
        assert convert(ids, start, stop) == convert(tuple(ids), start, stop) == expected


@given(st.binary(min_size=32, max_size=32), st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=40))
def test_probe_hash_compiled_is_the_source(parent: bytes, ids: list[int]) -> None:
    page = np.array(ids, dtype="<i8").tobytes()
    seed = pi.new_seed(32 + len(page))
    h = pi.probe_hash(seed, parent, page)
    assert h == source.probe_hash(seed, parent, page)
    assert h != pi.probe_hash(pi.new_seed(32 + len(page)), parent, page)  # (fails with odds 2**-64)
    with pytest.raises(ValueError):
        pi.probe_hash(seed[:-1], parent, page)


def test_bad_arguments_raise_and_register_nothing() -> None:
    table, key_hash, hashes, is_hashed = pi.new_index(4)
    keys = np.zeros((4, 32 + 16), dtype=np.uint8)
    seed = pi.new_seed(32 + 16)
    root = root_hash("")
    cases = [
        ((np.array([0]), root[:31], bytes(16), 16), ValueError),  # parent is not a hash
        ((np.array([0]), root, bytes(24), 16), ValueError),  # data is not whole pages
        ((np.array([0, 1]), root, bytes(16), 16), ValueError),  # more pages than data
        ((np.array([0]), root, bytes(32), 32), ValueError),  # keys of another page size
        ((np.array([4]), root, bytes(16), 16), IndexError),  # no such page
        ((np.array([-1]), root, bytes(16), 16), IndexError),
    ]
    for args, error in cases:
        for commit in (pi.commit, source.commit):
            with pytest.raises(error):
                commit(table, keys, key_hash, hashes, is_hashed, seed, *args)
    for commit in (pi.commit, source.commit):  # a seed too short for the keys
        with pytest.raises(ValueError, match="seed"):
            commit(table, keys, key_hash, hashes, is_hashed, seed[:-1], np.array([0]), root, bytes(16), 16)
    assert not is_hashed.any() and (table == -1).all()  # nothing was registered
    lru = pi.new_lru(4)
    for evict in (pi.evict, source.evict):
        with pytest.raises(ValueError, match="fewer cached pages"):
            evict(lru, table, key_hash, is_hashed, 1)
        with pytest.raises(ValueError):
            evict(lru, table, key_hash, is_hashed, -1)


NUM_PAGES, PAGE_TOKENS = 6, 2
PAGE_NBYTES = 8 * PAGE_TOKENS
pages_data = st.lists(st.lists(st.integers(0, 1), min_size=PAGE_TOKENS, max_size=PAGE_TOKENS), min_size=1, max_size=3)


class Twins(RuleBasedStateMachine):
    """The same random program on two copies of the index arrays, one run by the compiled build, the
    other by the source run as plain Python.

    A tiny vocabulary and pool make keys repeat (taken keys), collide in the 16-slot table (long
    probe runs) and get evicted from the middle of runs (backward shifts)."""

    def __init__(self) -> None:
        super().__init__()
        table, key_hash, hashes, is_hashed = pi.new_index(NUM_PAGES)
        keys = np.zeros((NUM_PAGES, 32 + PAGE_NBYTES), dtype=np.uint8)
        seed = pi.new_seed(32 + PAGE_NBYTES)
        self.arrays = {"c": [table, keys, key_hash, hashes, is_hashed, pi.new_lru(NUM_PAGES), seed]}
        self.arrays["py"] = [a.copy() for a in self.arrays["c"]]
        self.parents = [root_hash(""), root_hash("t")]
        self.in_lru: list[int] = []

    def run(self, fn: str, pick: list[int], *rest: object) -> object:
        """Call fn on each copy with the arrays at positions `pick` first; results must agree."""
        out = [getattr(impl, name)(*[self.arrays[side][i] for i in pick], *rest) for side, impl, name in self.impls(fn)]
        assert out[0] == out[1]
        return out[0]

    @staticmethod
    def impls(fn: str) -> list[tuple[str, object, str]]:
        return [("c", pi, fn), ("py", source, fn)]

    @rule(parent=st.integers(0, 63), chosen=st.permutations(range(NUM_PAGES)), data=pages_data)
    def commit(self, parent: int, chosen: list[int], data: list[list[int]]) -> None:
        pages = np.array(chosen[: len(data)], dtype=np.int64)
        raw = np.array(data, dtype="<i8").tobytes()
        last = self.run("commit", [0, 1, 2, 3, 4, 6], pages, self.parents[parent % len(self.parents)], raw, PAGE_NBYTES)
        self.parents.append(last)  # type: ignore[arg-type]

    @rule(parent=st.integers(0, 63), data=pages_data)
    def match(self, parent: int, data: list[list[int]]) -> None:
        raw = np.array(data, dtype="<i8").tobytes()
        found = self.run("match", [0, 1, 2, 3, 6], self.parents[parent % len(self.parents)], raw, PAGE_NBYTES)
        self.parents.append(found[1])  # type: ignore[index]

    @precondition(lambda self: bool(self.cacheable()))
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.cacheable()), min_size=1, unique=True))
        self.run("lru_push", [5], np.array(chosen, dtype=np.int64))
        self.in_lru += chosen

    @precondition(lambda self: bool(self.in_lru))
    @rule(data=st.data())
    def uncache(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.in_lru), min_size=1, unique=True))
        self.run("lru_remove", [5], np.array(chosen, dtype=np.int64))
        self.in_lru = [p for p in self.in_lru if p not in chosen]

    @precondition(lambda self: bool(self.in_lru))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        num = data.draw(st.integers(0, len(self.in_lru)))
        oldest_first = pi.lru_pages(self.arrays["c"][5])
        assert self.run("evict", [5, 0, 2, 4], num) == oldest_first[:num]
        self.in_lru = oldest_first[num:]

    def cacheable(self) -> list[int]:
        return [p for p in range(NUM_PAGES) if self.arrays["c"][4][p] and p not in self.in_lru]

    @invariant()
    def the_arrays_are_identical(self) -> None:
        for c, py in zip(self.arrays["c"], self.arrays["py"]):
            assert c.tobytes() == py.tobytes()

    @invariant()
    def every_registered_page_is_found_by_its_key(self) -> None:
        table, keys, key_hash, hashes, is_hashed, lru, seed = self.arrays["c"]
        assert sorted(int(p) for p in table if p >= 0) == np.nonzero(is_hashed)[0].tolist()
        for page in np.nonzero(is_hashed)[0].tolist():
            key = keys[page].tobytes()
            parent, tokens = key[:32], key[32:]
            assert key_hash[page] == pi.probe_hash(seed, parent, tokens) == source.probe_hash(seed, parent, tokens)
            assert pi.match(table, keys, key_hash, hashes, seed, key[:32], key[32:], PAGE_NBYTES) == (
                [page],
                hashlib.sha256(key).digest(),
            )
        assert sorted(pi.lru_pages(lru)) == sorted(self.in_lru)


TestTwins = Twins.TestCase
TestTwins.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.uint64])
def test_int64_bytes_of_an_array_is_that_of_its_list(dtype: type) -> None:
    ids = [0, 1, 7, 100, 255]
    for convert in (pi.int64_bytes, source.int64_bytes):
        assert convert(np.array(ids, dtype=dtype), 1, 4) == convert(ids, 1, 4) == np.array(ids[1:4], "<i8").tobytes()
