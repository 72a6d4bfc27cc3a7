"""Leases in the core: SequenceTable.expire(now) on a clock the test drives, on an 8-page pool (page 4)."""

import math
from collections.abc import Callable

import numpy as np
import pytest

from service.core.allocator import PageAllocator
from service.core.errors import InvalidRequest, OutOfPages, SequenceNotFound
from service.core.sequences import SequenceTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_table(num_pages: int = 8) -> tuple[SequenceTable, Clock]:
    clock = Clock()
    return SequenceTable(PageAllocator(num_pages), 4, clock=clock), clock


def counts(table: SequenceTable) -> tuple[int, int, int]:
    a = table.allocator
    return a.num_used, a.num_cached, a.num_free


def test_a_lease_runs_out_after_ttl_and_frees_the_pages() -> None:
    table, clock = make_table()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50_000, 10).tolist()
    table.create("a", ttl_s=2.0)
    table.append("a", 10, tokens, data_written=True)  # pages 0, 1 full (hashed), page 2 partial
    table.create("forever")
    assert counts(table) == (3, 0, 5)

    assert table.expire(clock.now + 1.999) == []
    assert table.expire(clock.now + 2.0) == [("", "a")]
    # The normal free path: the two full written pages stay cached for prefix reuse, the partial one is free.
    assert counts(table) == (0, 2, 6)
    assert table.stats.sequences_expired == 1
    assert table.tenant_pages("") == 0
    with pytest.raises(SequenceNotFound):
        table.get("a")
    assert table.get("forever").seq_id == "forever"
    assert table.expire(1e12) == []  # no lease: never expires
    assert table.stats.sequences_expired == 1

    again = table.create("b", [*tokens, 7])
    assert table.block_table(again) == [0, 1] and again.cached_tokens == 8


def renew_by_get(t: SequenceTable) -> None:
    t.get("s")


def renew_by_append(t: SequenceTable) -> None:
    t.append("s", 3)


def renew_by_step_append(t: SequenceTable) -> None:
    t.step([("s", 1, None)])


def renew_by_step_listing(t: SequenceTable) -> None:
    t.step([("other", 1, None)], seq_ids=["other", "s"])


def renew_by_attention(t: SequenceTable) -> None:
    t.attention_batch(["s"], [2])


def renew_by_fork(t: SequenceTable) -> None:
    t.fork("s", "child")


def renew_by_failed_append(t: SequenceTable) -> None:
    with pytest.raises(OutOfPages):
        t.append("s", 1000)


def renew_by_step_with_an_unknown_id(t: SequenceTable) -> None:
    with pytest.raises(SequenceNotFound):  # "s" is listed after the unknown one
        t.step([("ghost", 1, None), ("s", 1, None)], seq_ids=["s"])


def renew_by_step_listing_it_twice(t: SequenceTable) -> None:
    with pytest.raises(InvalidRequest, match="distinct"):
        t.step([("other", 1, None)], seq_ids=["other", "s", "s"])


def renew_by_step_with_bad_token_ids(t: SequenceTable) -> None:
    with pytest.raises(InvalidRequest):
        t.step([("s", 2, [1])])


def renew_by_refusing_it_renew(t: SequenceTable) -> None:
    t.renew(["ghost", "s"])  # what the server calls for a refused request naming "s"


@pytest.mark.parametrize(
    "call",
    [
        renew_by_get,
        renew_by_append,
        renew_by_step_append,
        renew_by_step_listing,
        renew_by_attention,
        renew_by_fork,
        renew_by_failed_append,
        renew_by_step_with_an_unknown_id,
        renew_by_step_listing_it_twice,
        renew_by_step_with_bad_token_ids,
        renew_by_refusing_it_renew,
    ],
)
def test_every_call_naming_a_sequence_renews_its_lease(call: Callable[[SequenceTable], None]) -> None:
    table, clock = make_table()
    start = clock.now
    table.create("s", ttl_s=10.0)
    table.append("s", 5)
    table.create("other")
    clock.now = start + 6.0
    call(table)
    # Without renewal it would expire at start + 10; renewed at start + 6, it lives to start + 16.
    assert table.get("s").expires_at == start + 16.0
    assert ("", "s") not in table.expire(start + 15.9)
    assert ("", "s") in table.expire(start + 16.0)


def test_a_fork_inherits_the_lease_and_expires_on_its_own() -> None:
    table, clock = make_table()
    start = clock.now
    table.create("parent", ttl_s=5.0)
    table.append("parent", 6)  # pages 0, 1 (shared by the fork)
    clock.now = start + 3.0
    child = table.fork("parent", "child")
    assert child.ttl_s == 5.0 and child.expires_at == start + 8.0
    clock.now = start + 7.0
    table.get("child")  # renews the child only: it now lives to start + 12
    assert sorted(table.expire(start + 8.0)) == [("", "parent")]
    assert table.block_table(table.get("child")) == [0, 1]  # still held by the child
    assert counts(table) == (2, 0, 6)
    assert table.expire(start + 12.0) == [("", "child")]
    assert counts(table) == (0, 0, 8)
    assert table.stats.sequences_expired == 2


def test_expiry_is_per_tenant() -> None:
    table, clock = make_table()
    table.create("s", tenant="alpha", ttl_s=1.0)
    table.create("s", tenant="beta", ttl_s=3.0)
    table.append("s", 4, tenant="alpha")
    table.append("s", 8, tenant="beta")
    assert table.expire(clock.now + 1.0) == [("alpha", "s")]
    assert table.tenant_pages("alpha") == 0 and table.tenant_pages("beta") == 2
    with pytest.raises(SequenceNotFound):
        table.get("s", "alpha")
    assert table.length(table.get("s", "beta")) == 8


@pytest.mark.parametrize("ttl_s", [-1.0, math.nan, math.inf])
def test_a_bad_ttl_is_refused_and_changes_nothing(ttl_s: float) -> None:
    table, _ = make_table()
    table.create("x")
    with pytest.raises(InvalidRequest, match="ttl_s"):
        table.create("y", ttl_s=ttl_s)
    assert len(table) == 1 and counts(table) == (0, 0, 8)
    table.create("y")  # the id was not taken
