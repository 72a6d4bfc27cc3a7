"""The prefix-index loops (service/core/prefix_index.py): their errors, and a random program run on
the compiled build and on the same file run as plain Python, which must agree byte for byte."""

import hashlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from service.core import lru, probe_hash
from service.core import prefix_index as pi
from service.core.hashing import root_hash
from tests.core.conftest import load_source

source = load_source("prefix_index")
SOURCES = {pi: source, lru: load_source("lru")}


def test_bad_arguments_raise_and_register_nothing() -> None:
    table, key_hash, hashes, is_hashed = pi.new_index(4)
    keys = np.zeros((4, 32 + 16), dtype=np.uint8)
    seed = probe_hash.new_seed(32 + 16)
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
    for commit in (pi.commit, source.commit):  # a namer that is not new_namer()'s
        with pytest.raises(ValueError, match="namer"):
            commit(
                table,
                keys,
                key_hash,
                hashes,
                is_hashed,
                seed,
                np.array([0]),
                root,
                bytes(16),
                16,
                np.zeros(31, np.uint8),
            )
    assert not is_hashed.any() and (table == -1).all()
    links = lru.new_lru(4)
    for evict in (pi.evict, source.evict):
        with pytest.raises(ValueError, match="fewer cached pages"):
            evict(links, table, key_hash, is_hashed, 1)
        with pytest.raises(ValueError):
            evict(links, table, key_hash, is_hashed, -1)


NUM_PAGES, PAGE_TOKENS = 6, 2
PAGE_NBYTES = 8 * PAGE_TOKENS
pages_data = st.lists(st.lists(st.integers(0, 1), min_size=PAGE_TOKENS, max_size=PAGE_TOKENS), min_size=1, max_size=3)


class Twins(RuleBasedStateMachine):
    """The same random program on two copies of the index arrays, one run by the compiled build, the
    other by the source run as plain Python; pages named by content (SHA-256).

    A tiny vocabulary and pool make keys repeat (taken keys), collide in the 16-slot table (long
    probe runs) and get evicted from the middle of runs (backward shifts)."""

    serial_names = False

    def __init__(self) -> None:
        super().__init__()
        table, key_hash, hashes, is_hashed = pi.new_index(NUM_PAGES)
        keys = np.zeros((NUM_PAGES, 32 + PAGE_NBYTES), dtype=np.uint8)
        seed = probe_hash.new_seed(32 + PAGE_NBYTES)
        namer = pi.new_namer() if self.serial_names else None
        self.arrays = {"c": [table, keys, key_hash, hashes, is_hashed, lru.new_lru(NUM_PAGES), seed, namer]}
        self.arrays["py"] = [None if a is None else a.copy() for a in self.arrays["c"]]
        self.parents = [root_hash(""), root_hash("t")]
        self.in_lru: list[int] = []

    def run(self, fn: str, pick: list[int], *rest: object, after: tuple[int, ...] = ()) -> object:
        """Call fn on each copy with the arrays at positions `pick` first, then `rest`, then the arrays
        at positions `after`; results must agree."""
        out = [
            getattr(impl, name)(*[self.arrays[side][i] for i in pick], *rest, *[self.arrays[side][i] for i in after])
            for side, impl, name in self.impls(fn)
        ]
        assert out[0] == out[1]
        return out[0]

    @staticmethod
    def impls(fn: str) -> list[tuple[str, object, str]]:
        module = lru if fn.startswith("lru_") else pi
        return [("c", module, fn), ("py", SOURCES[module], fn)]

    @rule(parent=st.integers(0, 63), chosen=st.permutations(range(NUM_PAGES)), data=pages_data)
    def commit(self, parent: int, chosen: list[int], data: list[list[int]]) -> None:
        pages = np.array(chosen[: len(data)], dtype=np.int64)
        raw = np.array(data, dtype="<i8").tobytes()
        parent_name = self.parents[parent % len(self.parents)]
        last = self.run("commit", [0, 1, 2, 3, 4, 6], pages, parent_name, raw, PAGE_NBYTES, after=(7,))
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
        oldest_first = lru.lru_pages(self.arrays["c"][5])
        assert self.run("evict", [5, 0, 2, 4], num) == oldest_first[:num]
        self.in_lru = oldest_first[num:]

    def cacheable(self) -> list[int]:
        return [p for p in range(NUM_PAGES) if self.arrays["c"][4][p] and p not in self.in_lru]

    @invariant()
    def the_arrays_are_identical(self) -> None:
        for c, py in zip(self.arrays["c"], self.arrays["py"]):
            assert (c is None and py is None) or c.tobytes() == py.tobytes()

    @invariant()
    def every_registered_page_is_found_by_its_key(self) -> None:
        table, keys, key_hash, hashes, is_hashed, links, seed, namer = self.arrays["c"]
        assert sorted(int(p) for p in table if p >= 0) == np.nonzero(is_hashed)[0].tolist()
        for page in np.nonzero(is_hashed)[0].tolist():
            key = keys[page].tobytes()
            parent, tokens = key[:32], key[32:]
            assert key_hash[page] == probe_hash.probe_hash(seed, parent, tokens)
            name = hashes[page].tobytes()
            assert pi.match(table, keys, key_hash, hashes, seed, key[:32], key[32:], PAGE_NBYTES) == ([page], name)
            if namer is None:
                assert name == hashlib.sha256(key).digest()
            else:  # the tag, then a count of names given so far
                assert name[:24] == pi.SERIAL_TAG and 0 < int.from_bytes(name[24:], "little") <= self.names_given()
        assert sorted(lru.lru_pages(links)) == sorted(self.in_lru)

    def names_given(self) -> int:
        return int.from_bytes(self.arrays["c"][7][24:].tobytes(), "little")

    @invariant()
    def serial_names_are_unique(self) -> None:
        hashes, is_hashed = self.arrays["c"][3], self.arrays["c"][4]
        names = [hashes[p].tobytes() for p in np.nonzero(is_hashed)[0].tolist()]
        assert len(set(names)) == len(names)


class SerialTwins(Twins):
    """Twins with pages named serially (new_namer()): the compiled and source counts stay equal."""

    serial_names = True


TWIN_SETTINGS = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestTwins = Twins.TestCase
TestTwins.settings = TWIN_SETTINGS
TestSerialTwins = SerialTwins.TestCase
TestSerialTwins.settings = TWIN_SETTINGS
