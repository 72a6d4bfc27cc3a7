"""SequenceTable on tiny pools (8 pages of 4 tokens unless said): exact page ids, all-or-nothing."""

import dataclasses
import re
from collections.abc import Callable

import numpy as np
import pytest

from service.core import batching
from service.core.cache_listener import RESTORED
from service.core.errors import (
    AttendTooLarge,
    InvalidRequest,
    OutOfPages,
    QuotaExceeded,
    SequenceExists,
    SequenceNotFound,
)
from service.core.hashing import root_hash, token_bytes
from service.core.plan import Decode, OneRow, Plan, Rows, plan_rows
from service.core.sequences import SequenceTable
from tests.core.helpers import make_table, prefix_hashes, snapshot

P10 = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]  # two full pages of 4 and a partial one


def fill(t: SequenceTable, seq_id: str, n: int, tokens: list[int] | None = None, data: bool = True) -> list[int]:
    """Create `seq_id` if needed, append n tokens; returns the new slots."""
    try:
        t.get(seq_id)
    except SequenceNotFound:
        t.create(seq_id)
    _, ext = t.append(seq_id, n, tokens, data_written=data)
    return ext.slots.tolist()


def table_of(t: SequenceTable, seq_id: str, tenant: str = "") -> list[int]:
    return t.block_table(t.get(seq_id, tenant))


def counts(t: SequenceTable) -> tuple[int, int, int]:
    a = t.allocator
    return a.num_used, a.num_cached, a.num_free


# -- allocation order and ids --------------------------------------------------------------------
def test_fresh_sequences_get_pages_zero_one_two() -> None:
    t = make_table()
    seq = t.create("a")
    assert (seq.seq_id, t.length(seq), t.block_table(seq), seq.cached_tokens) == ("a", 0, [], 0)
    assert fill(t, "a", 6) == [0, 1, 2, 3, 4, 5]
    assert fill(t, "b", 3) == [8, 9, 10]
    assert fill(t, "a", 3) == [6, 7, 12]
    assert table_of(t, "a") == [0, 1, 3] and table_of(t, "b") == [2]
    assert t.length(t.get("a")) == 9 and t.length(t.get("b")) == 3
    assert counts(t) == (4, 0, 4)
    assert t.allocator.ref_count.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


def test_generated_ids_duplicates_and_unknown_ids() -> None:
    t = make_table()
    x, y = t.create(), t.create()
    assert re.fullmatch(r"[0-9a-f]{32}", x.seq_id) and x.seq_id != y.seq_id
    z = t.fork(x.seq_id)
    assert re.fullmatch(r"[0-9a-f]{32}", z.seq_id) and len(t) == 3
    t.create("s")
    before = snapshot(t)
    with pytest.raises(SequenceExists):
        t.create("s", [1, 2, 3, 4, 5])
    with pytest.raises(SequenceExists):
        t.fork(x.seq_id, "s")
    for call in (
        lambda: t.get("nope"),
        lambda: t.append("nope", 1),
        lambda: t.free("nope"),
        lambda: t.fork("nope"),
        lambda: t.step([("nope", 1, None)]),
        lambda: t.step([], ["s", "nope"]),
        lambda: t.attention_batch(["nope"], [1]),
    ):
        with pytest.raises(SequenceNotFound):
            call()
    assert snapshot(t) == before
    # Sequence ids are per tenant.
    t.create("s", tenant="other")
    with pytest.raises(SequenceNotFound):
        t.get("s", "third")


def test_token_ids_outside_int64_are_rejected_before_anything_changes() -> None:
    t = make_table()
    fill(t, "a", 6, list(range(6)), data=False)  # page 0 waits for its data: the next append commits it
    t.create("b")
    before = snapshot(t)
    for call in (
        lambda: t.append("a", 2, [1, 2**63]),
        lambda: t.append("a", 1, [-(2**63) - 1], data_written=True),
        lambda: t.step([("b", 1, [0]), ("a", 3, [1, 2, 2**64])]),
        lambda: t.create("c", [1, 2**63, *range(8)]),
    ):
        with pytest.raises(InvalidRequest, match="int64"):
            call()
        assert snapshot(t) == before
    assert t.allocator.page_name(0) is None  # the failed appends committed nothing


# -- out of pages: nothing changes ----------------------------------------------------------------
def test_out_of_pages_on_append_changes_nothing() -> None:
    t = make_table()
    fill(t, "a", 20)
    fill(t, "b", 12, list(range(12)), data=False)  # pages of b wait for their data: not hashed yet
    assert counts(t) == (8, 0, 0)
    before = snapshot(t)
    with pytest.raises(OutOfPages) as err:
        t.append("b", 1, [99])
    assert (err.value.needed, err.value.available) == (1, 0)
    assert snapshot(t) == before
    assert t.allocator.page_name(5) is None  # the failed append committed nothing
    assert t.stats.allocation_failures == 1
    with pytest.raises(OutOfPages):
        t.append("a", 5, data_written=True)
    assert snapshot(t) == before


def test_create_with_prefix_reuses_cached_pages_when_none_is_free_then_runs_out_cleanly() -> None:
    t = make_table()
    fill(t, "a", 9, P10[:9])
    assert t.free("a") == 3
    assert t.allocator.cached_pages() == [1, 0] and counts(t) == (0, 2, 6)
    assert fill(t, "c", 24)[::4] == [8, 12, 16, 20, 24, 28]  # pages 2..7: every free page
    assert table_of(t, "c") == [2, 3, 4, 5, 6, 7] and counts(t) == (6, 2, 0)
    b = t.create("b", P10[:9])
    assert (b.cached_tokens, t.length(b), t.block_table(b)) == (8, 8, [0, 1])
    assert counts(t) == (8, 0, 0)
    before = snapshot(t)
    with pytest.raises(OutOfPages):
        t.append("b", 1, [32])
    with pytest.raises(OutOfPages):
        t.step([("b", 1, [32])])
    assert snapshot(t) == before


def test_out_of_pages_in_a_step_where_one_sequence_fails_changes_nothing() -> None:
    t = make_table()
    fill(t, "a", 7)  # [0, 1]: one more token fits in page 1
    fill(t, "b", 4)  # [2]: full, the next token needs a page
    fill(t, "c", 16)  # [3, 4, 5, 6]
    assert counts(t) == (7, 0, 1)
    before = snapshot(t)
    with pytest.raises(OutOfPages) as err:
        t.step([("a", 1, None), ("b", 1, None), ("c", 1, None)], ["a", "b", "c"])
    assert (err.value.needed, err.value.available) == (2, 1)
    assert snapshot(t) == before
    result = t.step([("a", 1, None), ("b", 1, None)])
    assert result.slots == [[7], [28]]
    assert table_of(t, "a") == [0, 1] and table_of(t, "b") == [2, 7]


def test_out_of_pages_for_the_copy_on_write_of_a_fork_changes_nothing() -> None:
    t = make_table()
    fill(t, "a", 6)  # [0, 1], page 1 half full
    fill(t, "filler", 24)  # [2..7]
    c = t.fork("a", "c")  # a fork takes no page: it succeeds on a full pool
    assert t.block_table(c) == [0, 1] and t.length(c) == 6
    assert t.allocator.ref_count.tolist()[:2] == [2, 2]
    before = snapshot(t)
    with pytest.raises(OutOfPages):
        t.append("c", 1)  # needs a copy of page 1
    with pytest.raises(OutOfPages):
        t.step([("a", 1, None), ("c", 1, None)])
    assert snapshot(t) == before
    t.free("filler")
    _, ext = t.append("c", 1)
    assert ext.copies == [(1, 7)] and table_of(t, "c") == [0, 7]  # the filler's tail came back first


# -- plan, then apply --------------------------------------------------------------------------------
def test_a_plan_changes_nothing_and_applying_it_does_what_it_said() -> None:
    t = make_table()
    fill(t, "x", 8, P10[:8])
    t.free("x")  # pages 1, 0 cached, in that order of eviction
    fill(t, "a", 6)  # [2, 3]: page 3 half full
    t.fork("a", "c")  # shares it
    fill(t, "f", 16)  # [4, 5, 6, 7]: no free page left
    rows = np.array([t.get("a").row, t.get("c").row])
    before = snapshot(t)
    plan = t.check(plan_rows(t.blocks, t.allocator, rows, [3, 1], [None, None], ""))
    assert snapshot(t) == before
    # a opens a page and copies the shared one (c, its last holder appending, keeps it): two
    # pages, both evicted from the prefix cache; the tenant holds one page more.
    assert isinstance(plan.change, Rows) and plan.change.copies == [0]
    assert (plan.num_new, plan.num_evictions, plan.copy_sources) == (2, 2, [3])
    assert (plan.num_held, plan.num_tokens, plan.most_pages) == (1, 4, 3)
    ext = t.apply(plan)
    assert ext.copies == [(3, 0)] and ext.slots.tolist() == [2, 3, 4, 14]
    assert table_of(t, "a") == [2, 0, 1] and table_of(t, "c") == [2, 3]
    assert t.allocator.num_evictions == 2 and t.tenant_pages("") == 9 and t.stats.tokens_appended == 34


def test_each_kind_of_append_plans_its_own_shape() -> None:
    t = make_table(16, 4)
    fill(t, "a", 5)
    fill(t, "b", 4)
    fill(t, "d", 2)
    t.fork("a", "c")  # a's partial page 1 is shared from here on

    def planned(appends: list[tuple[str, int, list[int] | None]]) -> Plan:
        rows = np.array([t.get(s).row for s, _, _ in appends], dtype=np.int64)
        counts, tokens = [n for _, n, _ in appends], [ids for _, _, ids in appends]
        return plan_rows(t.blocks, t.allocator, rows, counts, tokens, "")  # type: ignore[arg-type]

    one = planned([("a", 3, None)])  # a step of one sequence: the scalar plan
    assert isinstance(one.change, OneRow) and one.change.copy and (one.num_new, one.num_held) == (1, 0)
    decode = planned([("b", 1, None), ("d", 1, None)])  # b opens a page, d fills its own
    assert isinstance(decode.change, Decode) and (decode.num_new, decode.num_tokens) == (1, 2)
    copying = planned([("a", 1, None), ("b", 1, None), ("c", 1, None)])  # a copies page 1, c keeps it
    assert isinstance(copying.change, Rows) and copying.copy_sources == [1]
    assert (copying.num_new, copying.num_held) == (2, 1)


def test_a_plan_applies_only_to_the_state_it_was_checked_on() -> None:
    t = make_table()
    fill(t, "a", 3)
    plan = t.check(plan_rows(t.blocks, t.allocator, np.array([t.get("a").row]), [2], [None], ""))
    fill(t, "b", 1)
    before = snapshot(t)
    with pytest.raises(AssertionError, match="checked on"):
        t.apply(plan)
    assert snapshot(t) == before


# -- fork and copy-on-write -----------------------------------------------------------------------
def test_fork_shares_pages_and_copy_on_write_keeps_parent_and_child_apart() -> None:
    t = make_table()
    fill(t, "a", 6, [1, 2, 3, 4, 5, 6])
    c = t.fork("a", "c")
    assert (t.length(c), t.block_table(c), c.cached_tokens) == (6, [0, 1], 0)
    assert t.allocator.ref_count.tolist()[:3] == [2, 2, 0]
    assert t.tenant_pages("") == 4 and counts(t) == (2, 0, 6)
    _, ext = t.append("c", 1, [7])
    assert ext.copies == [(1, 2)] and ext.slots.tolist() == [10]
    assert table_of(t, "c") == [0, 2] and table_of(t, "a") == [0, 1]
    assert t.allocator.ref_count.tolist()[:3] == [2, 1, 1]
    _, ext = t.append("a", 3, [8, 9, 10])  # page 1 is a's alone now: no copy
    assert ext.copies == [] and ext.slots.tolist() == [6, 7, 12]
    _, ext = t.append("c", 2, [7, 8])
    assert ext.copies == [] and ext.slots.tolist() == [11, 16]
    assert table_of(t, "a") == [0, 1, 3] and table_of(t, "c") == [0, 2, 4]
    assert t.allocator.ref_count.tolist() == [2, 1, 1, 1, 1, 0, 0, 0]
    assert t.free("a") == 2 and t.free("c") == 3
    assert t.allocator.cached_pages() == [1, 2, 0]  # the full pages of both, tails first
    assert counts(t) == (0, 3, 5)


def test_when_every_holder_of_a_shared_partial_page_appends_in_one_step_the_last_keeps_it() -> None:
    t = make_table()
    fill(t, "a", 6)
    t.fork("a", "c")
    result = t.step([("a", 1, None), ("c", 1, None)])
    assert result.copies == [(1, 2)]
    assert table_of(t, "a") == [0, 2] and table_of(t, "c") == [0, 1]
    assert result.slots == [[10], [6]]
    assert t.allocator.ref_count.tolist()[:3] == [2, 1, 1]


def test_three_holders_two_appending_both_copy_and_the_third_keeps_the_page() -> None:
    t = make_table()
    fill(t, "a", 6)
    t.fork("a", "c")
    t.fork("a", "d")
    result = t.step([("c", 1, None), ("d", 1, None)])
    assert result.copies == [(1, 2), (1, 3)]
    assert [table_of(t, s) for s in "acd"] == [[0, 1], [0, 2], [0, 3]]
    assert t.allocator.ref_count.tolist()[:4] == [3, 1, 1, 1]
    t.fork("a", "e")
    result = t.step([("a", 2, None), ("e", 1, None)])  # both holders of page 1: e keeps it
    assert result.copies == [(1, 4)] and table_of(t, "a") == [0, 4] and table_of(t, "e") == [0, 1]


def test_fork_of_a_full_last_page_copies_nothing() -> None:
    t = make_table()
    fill(t, "a", 8)
    t.fork("a", "c")
    _, ext = t.append("c", 1)
    assert ext.copies == [] and table_of(t, "c") == [0, 1, 2]
    assert t.free("a") == 0 and t.free("c") == 3


# -- prefix cache -----------------------------------------------------------------------------------
def test_prefix_hit_after_a_free_reuses_the_full_pages() -> None:
    t = make_table()
    a = t.create("a", P10)
    assert (a.cached_tokens, t.length(a)) == (0, 0)
    assert fill(t, "a", 10, P10) == list(range(10))
    assert [t.allocator.page_name(p) for p in range(3)] == [*prefix_hashes(P10, 4), None]
    assert t.free("a") == 3
    assert t.allocator.cached_pages() == [1, 0] and counts(t) == (0, 2, 6)
    b = t.create("b", P10)
    assert (b.cached_tokens, t.length(b), t.block_table(b)) == (8, 8, [0, 1])
    assert counts(t) == (2, 0, 6) and t.allocator.ref_count.tolist()[:2] == [1, 1]
    assert t.stats.prefix_query_tokens == 20 and t.stats.prefix_hit_tokens == 8
    assert fill(t, "b", 2, P10[8:]) == [8, 9]
    assert table_of(t, "b") == [0, 1, 2]


def test_a_create_reserving_appends_the_rest_of_its_token_ids_uncommitted() -> None:
    t = make_table()
    fill(t, "a", 10, P10)
    t.free("a")  # pages 0 and 1 cached (P10's two full pages), 2 freed
    ids = [*P10[:8], 41, 42, 43, 44, 51, 52]  # the cached two pages, then a page and a half of new tokens
    b = t.create("b", ids, reserve_to=12)
    assert (b.cached_tokens, t.length(b), t.block_table(b)) == (8, 12, [0, 1, 2])
    assert t.allocator.page_name(2) is None  # its K/V not written: committed by a later call naming it
    assert counts(t) == (3, 0, 5) and t.stats.prefix_query_tokens == 14 and t.stats.prefix_hit_tokens == 8
    t.free("b")  # (a free commits the written pages: here it says the client wrote them)
    assert t.allocator.page_name(2) == prefix_hashes(ids[:12], 4)[2]
    c = t.create("c", ids, reserve_to=8)  # nothing beyond the cached prefix to reserve
    assert (c.cached_tokens, t.length(c), t.block_table(c)) == (12, 12, [0, 1, 2])


@pytest.mark.parametrize("limit", ["pages", "quota"])
def test_a_reservation_kvpool_cannot_make_leaves_the_create_on_its_cached_prefix(limit: str) -> None:
    def table() -> SequenceTable:  # two pages of P10 cached; the pool (or the tenant's quota) has 3 more at most
        t = make_table(num_pages=5 if limit == "pages" else 8, max_pages_per_tenant=0 if limit == "pages" else 5)
        fill(t, "a", 8, P10[:8])
        t.free("a")
        return t

    ids = [*P10[:8], *range(100, 116)]  # four new pages to reserve: one too many
    t, plain = table(), table()
    b = t.create("b", ids, reserve_to=24)
    assert (b.cached_tokens, t.length(b), t.block_table(b)) == (8, 8, [0, 1])
    plain.create("b", ids)
    assert snapshot(t) == snapshot(plain)  # exactly a create without the reservation
    assert t.stats.allocation_failures == (1 if limit == "pages" else 0)  # (a quota is not the pool running out)
    t.free("b")
    assert t.create("c", ids, reserve_to=20).cached_tokens == 8 and table_of(t, "c") == [0, 1, 2, 3, 4]


def test_a_reservation_beyond_the_token_ids_is_refused_before_anything_changes() -> None:
    t = make_table()
    before = snapshot(t)
    with pytest.raises(InvalidRequest, match="reserve_to"):
        t.create("a", P10, reserve_to=11)
    with pytest.raises(InvalidRequest, match="reserve_to"):
        t.create("a", None, reserve_to=1)
    assert snapshot(t) == before
    assert t.length(t.create("a", P10, reserve_to=10)) == 10


def test_a_hit_on_pages_no_row_held_widens_the_tables() -> None:
    """Pages a tier restored (committed straight into the prefix index, as service/tiers/cache.py does)
    never sat in a block table: a first create hitting more of them than a row holds widens the tables
    rather than failing."""
    t = make_table(num_pages=48)
    width = t.blocks.tables.shape[1]
    prompt = list(range(1, (width + 4) * 4 + 2))  # more full pages than a row holds, and one token
    pages = t.allocator.allocate(width + 4).tolist()
    data = token_bytes(prompt[: len(pages) * 4])
    t.allocator.commit(pages, root_hash(""), data, 8 * 4, at_root=True, origin=RESTORED)
    t.allocator.release(np.array(pages[::-1], dtype=np.int64))
    seq = t.create("restored", prompt)
    assert (seq.cached_tokens, t.block_table(seq)) == (len(pages) * 4, pages)
    lut = t.lookup_table(np.array([seq.row]))[0]
    assert lut[: len(pages) + 1].tolist() == [*pages, t.sentinel]


def test_a_hit_never_covers_the_last_prompt_token() -> None:
    t = make_table()
    fill(t, "a", 8, P10[:8])
    t.free("a")
    hits = {n: t.create(f"p{n}", P10[:n]).cached_tokens for n in (3, 4, 5, 8, 9, 10)}
    assert hits == {3: 0, 4: 0, 5: 4, 8: 4, 9: 8, 10: 8}
    assert table_of(t, "p8") == [0] and table_of(t, "p9") == [0, 1]
    assert t.allocator.ref_count.tolist()[:2] == [4, 2]


def test_a_prefix_hit_stops_at_the_first_different_page_and_shares_live_pages() -> None:
    t = make_table()
    fill(t, "a", 10, P10)
    b = t.create("b", [*P10[:4], 0, 0, 0, 0, 5])
    assert (b.cached_tokens, t.block_table(b)) == (4, [0])
    c = t.create("c", P10)
    assert (c.cached_tokens, t.block_table(c)) == (8, [0, 1])
    assert t.allocator.ref_count.tolist()[:3] == [3, 2, 1] and counts(t) == (3, 0, 5)


def test_without_prefix_caching_nothing_is_hashed_or_cached() -> None:
    t = make_table(prefix_caching=False)
    fill(t, "a", 10, P10)
    assert t.allocator.page_name(0) is None
    assert t.free("a") == 3 and counts(t) == (0, 0, 8)
    assert t.create("b", P10).cached_tokens == 0


def test_pages_appended_without_data_are_cached_at_the_next_append() -> None:
    t = make_table()
    fill(t, "a", 8, P10[:8], data=False)
    assert [t.allocator.page_name(p) for p in (0, 1)] == [None, None]
    assert t.create("probe", P10).cached_tokens == 0
    fill(t, "a", 1, [P10[8]], data=False)
    assert [t.allocator.page_name(p) for p in (0, 1)] == prefix_hashes(P10, 4)
    assert t.create("probe2", P10).cached_tokens == 8


def test_pages_appended_without_data_are_cached_at_the_next_step_listing_them() -> None:
    t = make_table()
    fill(t, "a", 8, P10[:8], data=False)
    t.step([], ["a"])
    assert [t.allocator.page_name(p) for p in (0, 1)] == prefix_hashes(P10, 4)


def test_a_step_caches_pages_written_before_it_not_the_pages_it_appends() -> None:
    t = make_table()
    fill(t, "a", 4, P10[:4], data=False)
    fill(t, "b", 4, P10[:4], data=False)
    # a's page 0 was filled before the step; page 1 is filled by the step, its data comes after.
    t.step([("a", 4, P10[4:8])])
    t.step([("b", 4, P10[4:8])], ["b"])
    hashes = prefix_hashes(P10, 4)
    assert [t.allocator.page_name(p) for p in range(4)] == [hashes[0], None, None, None]
    assert t.create("probe", P10).cached_tokens == 4
    t.free("probe")
    t.step([], ["a", "b"])  # the next step: both pages are written now
    assert t.allocator.page_name(2) == hashes[1]
    assert t.create("probe", P10).cached_tokens == 8


def test_pages_appended_without_data_are_cached_when_freed() -> None:
    t = make_table()
    fill(t, "a", 10, P10, data=False)
    assert t.free("a") == 3
    assert t.allocator.cached_pages() == [1, 0] and counts(t) == (0, 2, 6)
    assert [t.allocator.page_name(p) for p in (0, 1)] == prefix_hashes(P10, 4)


def test_a_free_without_commit_releases_the_unwritten_pages_uncommitted() -> None:
    t = make_table()
    fill(t, "a", 4, P10[:4])  # page 0 committed (its K/V written with the append)
    t.free("a")
    assert t.create("b", P10).cached_tokens == 4  # on page 0
    fill(t, "b", 6, P10[4:], data=False)  # pages 1 and 2: K/V not written yet
    assert t.free("b", commit=False) == 3
    # Page 0 stays cached (committed before); pages 1 and 2 went back uncommitted: nothing hits them.
    assert t.allocator.cached_pages() == [0] and counts(t) == (0, 1, 7)
    assert [t.allocator.page_name(p) for p in (1, 2)] == [None, None]
    assert t.create("c", P10).cached_tokens == 4


def test_appends_without_token_ids_stop_hashing() -> None:
    t = make_table()
    fill(t, "a", 4, P10[:4])
    fill(t, "a", 4)  # token ids unknown from here on
    fill(t, "a", 4, [1, 2, 3, 4])
    assert t.allocator.page_name(0) == prefix_hashes(P10, 4)[0]
    assert [t.allocator.page_name(p) for p in (1, 2)] == [None, None]
    assert t.free("a") == 3
    assert t.allocator.cached_pages() == [0] and counts(t) == (0, 1, 7)
    # A fork of such a sequence does not hash either.
    fill(t, "b", 2)
    t.fork("b", "c")
    fill(t, "c", 6, [1, 2, 3, 4, 5, 6])
    assert t.free("c") == 2 and t.allocator.cached_pages() == [0]


def test_lru_evicts_the_least_recently_freed_first_and_a_tail_before_its_prefix() -> None:
    t = make_table()
    a_tokens, b_tokens = P10[:8], [5, 6, 7, 8, 9, 10, 11, 12]
    fill(t, "a", 8, a_tokens)  # [0, 1]
    fill(t, "b", 8, b_tokens)  # [2, 3]
    t.free("a")
    t.free("b")
    assert t.allocator.cached_pages() == [1, 0, 3, 2] and counts(t) == (0, 4, 4)
    fill(t, "c", 20)  # 4 free pages, then a's tail (page 1) is evicted
    assert table_of(t, "c") == [1, 4, 5, 6, 7]
    assert t.allocator.cached_pages() == [0, 3, 2] and t.allocator.num_evictions == 1
    assert t.create("pa", [*a_tokens, 0]).cached_tokens == 4  # a's prefix page survived
    t.free("pa")
    assert t.allocator.cached_pages() == [3, 2, 0]  # the hit made page 0 the most recent
    fill(t, "c", 8)
    assert table_of(t, "c") == [1, 4, 5, 6, 7, 2, 3]
    assert t.allocator.cached_pages() == [0] and t.allocator.num_evictions == 3
    assert t.create("pb", [*b_tokens, 0]).cached_tokens == 0


@pytest.mark.usefixtures("colliding_digests")
def test_a_hash_collision_is_caught_by_comparing_tokens() -> None:
    t = make_table()
    a = t.allocator
    taken = a.allocate(2)
    # Page 0 holds the prompt's first page; page 1 other tokens under the hash its second page has.
    h0 = a.commit([0], root_hash(""), token_bytes(P10[:4]), 32)
    assert a.commit([1], h0, token_bytes([0, 0, 0, 0]), 32) == h0
    a.release(taken[::-1])
    b = t.create("b", P10)
    assert (b.cached_tokens, t.block_table(b)) == (4, [0])
    assert t.create("c", [*P10[:4], 0, 0, 0, 0, 1]).cached_tokens == 8


def test_the_tenant_salt_keeps_prefixes_apart() -> None:
    t = make_table()
    fill_seq = t.create("a", tenant="x")
    t.append("a", 10, P10, data_written=True, tenant="x")
    t.free(fill_seq.seq_id, "x")
    assert [t.allocator.page_name(p) for p in (0, 1)] == prefix_hashes(P10, 4, "x")
    assert t.create("a", P10, tenant="y").cached_tokens == 0
    assert t.create("a", P10, tenant="").cached_tokens == 0
    assert t.create("a", P10, tenant="x").cached_tokens == 8
    assert (t.tenant_pages("x"), t.tenant_pages("y"), t.tenant_pages("")) == (2, 0, 0)


def test_quota_exceeded_changes_nothing() -> None:
    t = make_table(16, 4, max_pages_per_tenant=3)
    tenants = ("x", "y")
    t.create("a", tenant="x")
    t.append("a", 12, [*P10, 41, 42], data_written=True, tenant="x")
    assert t.tenant_pages("x") == 3
    before = snapshot(t, tenants)
    with pytest.raises(QuotaExceeded) as err:
        t.append("a", 1, tenant="x")
    assert err.value.code == "quota_exceeded"
    with pytest.raises(QuotaExceeded):
        t.fork("a", "c", tenant="x")
    with pytest.raises(QuotaExceeded):
        t.create("c", [*P10, 41, 42, 0], tenant="x")  # a 3-page prefix hit would pass the quota
    with pytest.raises(QuotaExceeded):
        t.step([("a", 1, None)], tenant="x")
    assert snapshot(t, tenants) == before
    t.create("a", tenant="y")
    t.append("a", 12, tenant="y")  # another tenant has its own quota
    t.free("a", "x")
    c = t.create("c", [*P10, 41, 42, 0], tenant="x")
    assert (c.cached_tokens, t.tenant_pages("x"), t.tenant_pages("y")) == (12, 3, 3)


# -- step -----------------------------------------------------------------------------------------
def test_step_validation_changes_nothing() -> None:
    t = make_table()
    fill(t, "a", 3, [1, 2, 3], data=False)
    fill(t, "b", 5)
    before = snapshot(t)
    with pytest.raises(InvalidRequest, match="only once"):
        t.step([("a", 1, None), ("b", 1, None), ("a", 1, None)])
    with pytest.raises(InvalidRequest, match="token_ids"):
        t.step([("a", 2, [4, 5]), ("b", 2, [1])])
    with pytest.raises(InvalidRequest):
        t.step([("a", 1, None), ("b", 0, None)])
    with pytest.raises(SequenceNotFound):
        t.step([("a", 2, None), ("zz", 1, None)])
    with pytest.raises(SequenceNotFound):
        t.step([("a", 2, None)], ["a", "zz"])
    with pytest.raises(InvalidRequest, match="token_ids"):
        t.append("a", 2, [1])
    assert snapshot(t) == before


def test_step_returns_the_lookup_table_of_the_listed_sequences() -> None:
    t = make_table(64, 4)
    fill(t, "a", 10)  # [0, 1, 2]
    fill(t, "b", 3)  # [3]
    t.create("c")
    r = t.step([("b", 2, None), ("a", 7, None)], ["a", "b", "c"])
    assert r.seq_ids == ["a", "b", "c"]
    assert table_of(t, "a") == [0, 1, 2, 5, 6] and table_of(t, "b") == [3, 4]
    assert r.lookup_table.dtype == np.uint32 and r.lookup_table.shape == (3, 24)
    expected = np.full((3, 24), 64, dtype=np.uint32)
    expected[0, :5] = [0, 1, 2, 5, 6]
    expected[1, :2] = [3, 4]
    np.testing.assert_array_equal(r.lookup_table, expected)
    assert r.cache_lengths.dtype == np.uint32 and r.cache_lengths.tolist() == [10, 3, 0]
    assert r.input_lengths == [7, 2, 0]
    assert r.slots == [[10, 11, 20, 21, 22, 23, 24], [15, 16], []]
    assert r.copies == []
    # Default rows: the appended sequences, in order.
    r = t.step([("c", 1, None), ("b", 1, None)])
    assert r.seq_ids == ["c", "b"] and r.input_lengths == [1, 1]
    assert r.cache_lengths.tolist() == [0, 5] and r.slots == [[28], [17]]
    np.testing.assert_array_equal(r.lookup_table[:, :2], [[7, 64], [3, 4]])
    assert r.lookup_table.shape == (2, 24) and (r.lookup_table[:, 2:] == 64).all()
    empty = t.step([])
    assert empty.lookup_table.shape == (0, 16) and empty.cache_lengths.shape == (0,)


def test_lookup_tables_grow_past_the_initial_rows_and_columns() -> None:
    t = make_table(64, 1)
    for i in range(20):
        t.create(f"s{i}")
    r = t.step([(f"s{i}", 1 if i else 17, None) for i in range(20)])
    assert r.lookup_table.shape == (20, 40)  # 17 pages: 8 * ceil(17 / 8) + 16
    assert r.lookup_table[0, :17].tolist() == list(range(17))
    assert (r.lookup_table[0, 17:] == 64).all()
    assert r.lookup_table[1:, 0].tolist() == list(range(17, 36))
    assert (r.lookup_table[1:, 1:] == 64).all()
    assert r.slots[0] == list(range(17)) and r.slots[19] == [35]
    r = t.step([], ["s3", "s0"])
    assert r.lookup_table.shape == (2, 40) and r.cache_lengths.tolist() == [1, 17]


def test_attention_batch_covers_the_last_q_len_positions() -> None:
    t = make_table()
    fill(t, "a", 10)
    fill(t, "b", 2)
    lut, cache_lengths, slots = t.attention_batch(["a", "b"], [3, 2])
    assert lut.shape == (2, 24) and lut[0, :3].tolist() == [0, 1, 2] and lut[1, :1].tolist() == [3]
    assert (lut[0, 3:] == 8).all() and (lut[1, 1:] == 8).all()
    assert cache_lengths.tolist() == [7, 0]
    assert slots.tolist() == [7, 8, 9, 12, 13]
    with pytest.raises(InvalidRequest, match="exceeds"):
        t.attention_batch(["a", "b"], [1, 3])
    with pytest.raises(InvalidRequest, match="distinct"):
        t.attention_batch(["a", "a"], [1, 1])


def test_attention_batch_caps_queries_times_context_tokens() -> None:
    t = make_table()
    fill(t, "a", 10)
    fill(t, "b", 2)
    # 3 x 10 + 2 x 2 = 34 (query, context token) pairs
    assert t.attention_batch(["a", "b"], [3, 2], max_tokens=34)[1].tolist() == [7, 0]
    with pytest.raises(AttendTooLarge) as refused:
        t.attention_batch(["a", "b"], [3, 2], max_tokens=33)
    assert isinstance(refused.value, InvalidRequest) and refused.value.details == {"tokens": 34, "limit": 33}
    assert t.attention_batch(["a"], [10], max_tokens=0)[1].tolist() == [0]  # 0: no cap


def test_a_step_refuses_a_repeated_listed_id_before_appending() -> None:
    t = make_table()
    fill(t, "a", 3)
    with pytest.raises(InvalidRequest, match="'a' is named more than once"):
        t.step([("a", 1, None)], seq_ids=["a", "a"])
    assert t.length(t.get("a")) == 3 and t.allocator.num_used == 1


def test_a_step_frees_the_named_sequences_after_its_appends_committing_their_pages() -> None:
    t = make_table()
    fill(t, "a", 9, P10[:9])  # [0, 1, 2]: pages 0 and 1 full and written, not committed before a free
    fill(t, "b", 3, [5, 6, 7])  # [3]
    fill(t, "c", 2, [8, 9])  # [4]
    r = t.step([("b", 2, [1, 2])], free=["a", "c"])
    # The table is built before the frees: only b's row; then a's full pages cached, its partial one and c's free.
    assert r.seq_ids == ["b"] and r.lookup_table[0, :2].tolist() == [3, 5] and r.slots == [[15, 20]]
    assert len(t) == 1 and table_of(t, "b") == [3, 5]
    assert counts(t) == (2, 2, 4)
    assert t.create("d", [*P10[:8], 0]).cached_tokens == 8  # a's two full pages hit
    assert t.block_table(t.get("d")) == [0, 1]


def test_a_step_that_cannot_free_what_it_names_changes_nothing() -> None:
    t = make_table()
    fill(t, "a", 5, [1, 2, 3, 4, 5])
    fill(t, "b", 3)
    before = snapshot(t)
    with pytest.raises(SequenceNotFound):
        t.step([("a", 1, [6])], free=["b", "zz"])
    with pytest.raises(InvalidRequest, match="freed by a step"):
        t.step([("a", 1, [6])], free=["a"])
    with pytest.raises(InvalidRequest, match="freed by a step"):
        t.step([("a", 1, [6])], seq_ids=["a", "b"], free=["b"])
    with pytest.raises(InvalidRequest, match="'b' is named more than once"):
        t.step([("a", 1, [6])], free=["b", "b"])
    assert snapshot(t) == before
    t.step([], [], free=["b", "a"])  # a step of frees alone
    assert len(t) == 0 and counts(t)[0] == 0


def test_free_returns_the_pages_whose_last_reference_it_dropped() -> None:
    t = make_table()
    fill(t, "a", 9, P10[:9])
    t.fork("a", "c")
    b = t.create("b", P10[:9])
    assert t.block_table(b) == [0, 1]
    assert t.free("a") == 0
    assert t.free("c") == 1  # page 2; pages 0 and 1 are still b's
    assert counts(t) == (2, 0, 6)
    assert t.free("b") == 2 and counts(t) == (0, 2, 6)
    assert t.tenant_pages("") == 0 and len(t) == 0


def test_counters_stay_python_ints_through_copy_on_write() -> None:
    """The HTTP layer serializes these counts with orjson, which refuses numpy scalars."""
    t = make_table()
    fill(t, "a", 6, [1, 2, 3, 4, 5, 6])
    t.fork("a", "c")
    t.append("c", 1, [7])  # copy-on-write of the shared partial page
    t.step([("a", 3, None), ("c", 1, None)])
    t.free("a")
    a = t.allocator
    values = [a.num_free, a.num_cached, a.num_used, a.num_available, a.num_evictions, t.tenant_pages(""), len(t)]
    assert all(type(v) is int for v in values), [type(v) for v in values]
    assert all(type(getattr(t.stats, f.name)) is int for f in dataclasses.fields(t.stats))


@pytest.mark.parametrize("seed", range(6))
def test_the_decode_step_path_equals_the_general_one(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random decode steps (one token each, with and without token ids, forks sharing partial pages,
    frees, a pool that fills up) on two tables; the second has the decode fast path turned off."""
    rng = np.random.default_rng(seed)
    fast, general = make_table(24, 4, max_pages_per_tenant=20), make_table(24, 4, max_pages_per_tenant=20)
    live: list[str] = []

    def both(call: Callable[..., object], *args: object) -> bool:
        """call(table, *args) on each table: the same outcome, or the same error; True when it succeeded."""
        outcomes = []
        for t in (fast, general):
            try:
                with monkeypatch.context() as m:
                    if t is general:  # no decode plan: every step takes the general one
                        m.setattr(batching, "decode_plan", lambda *args: None)
                    outcomes.append(call(t, *args))
            except (OutOfPages, QuotaExceeded, SequenceNotFound) as exc:
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1]
        return not isinstance(outcomes[0], type)

    def create(t: SequenceTable, seq_id: str, prompt: list[int]) -> int:
        t.create(seq_id, prompt)
        return int(t.append(seq_id, len(prompt), prompt, data_written=True)[1].slots.sum())

    def fork(t: SequenceTable, parent: str, seq_id: str) -> list[int]:
        return t.block_table(t.fork(parent, seq_id))

    def step(t: SequenceTable, appends: list[tuple[str, int, list[int] | None]]) -> object:
        r = t.step(appends)
        return r.lookup_table.tolist(), r.cache_lengths.tolist(), r.slots, r.copies

    steps = 0
    for i in range(80):
        op = rng.integers(0, 10)
        if op < 2 and len(live) < 8:
            prompt = rng.integers(0, 3, int(rng.integers(1, 9))).tolist()
            if both(create, f"s{i}", prompt):
                live.append(f"s{i}")
            else:  # out of pages or quota in create or append: drop the sequence if it was made
                both(SequenceTable.free, f"s{i}")
        elif op < 3 and live:
            parent = live[int(rng.integers(0, len(live)))]
            if both(fork, parent, f"s{i}"):
                live.append(f"s{i}")
        elif op < 4 and live:
            gone = live.pop(int(rng.integers(0, len(live))))
            both(SequenceTable.free, gone)
        elif len(live) >= 2:
            chosen = rng.permutation(live)[: int(rng.integers(2, len(live) + 1))].tolist()
            appends = [(s, 1, [int(rng.integers(0, 3))] if rng.random() < 0.5 else None) for s in chosen]
            steps += both(step, appends)
        assert snapshot(fast) == snapshot(general)
    assert steps >= 10


# -- token ids as numpy arrays ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.uint64])
def test_token_id_arrays_do_what_lists_do(dtype: type) -> None:
    lists, arrays = make_table(), make_table()
    for t, ids in ((lists, P10), (arrays, np.array(P10, dtype=dtype))):
        t.create("a", ids[:4])
        t.append("a", 10, ids, data_written=True)  # (the sequence starts empty: all ten appended)
        t.free("a")
        seq = t.create("b", ids)  # hits the two full pages
        assert seq.cached_tokens == 8
        t.append("b", 2, ids[8:], data_written=True)
    assert snapshot(lists) == snapshot(arrays)
    assert [lists.allocator.page_name(p) for p in (0, 1)] == prefix_hashes(P10, 4)


@pytest.mark.parametrize(
    "ids",
    [
        np.array([1.0, 2.0, 3.0, 4.0, 5.0]),  # not integers
        np.arange(5).reshape(5, 1),  # not 1-D
        np.array([2**63, 1, 2, 3, 4], dtype=np.uint64),  # outside int64
    ],
)
def test_bad_token_id_arrays_are_invalid_and_change_nothing(ids: np.ndarray) -> None:
    t = make_table()
    fill(t, "a", 5, P10[:5])
    t.create("b")
    before = snapshot(t)
    with pytest.raises(InvalidRequest, match="token ids"):
        t.create("c", ids)
    with pytest.raises(InvalidRequest, match="token ids"):
        t.append("b", len(ids), ids)
    assert snapshot(t) == before


def test_slots_read_later_are_those_of_the_append() -> None:
    # A one-row append numbers its slots when they are first read, from the pages its tokens landed
    # on then: a later copy-on-write of its partial last page, or freeing the sequence, changes nothing.
    t = make_table(num_pages=8, page_size=4)
    t.create("a")
    _, first = t.append("a", 6)  # pages 0, 1
    t.fork("a", "b")
    _, second = t.append("a", 1)  # "a" copies the shared page 1 to page 2 first
    t.free("a")
    t.free("b")
    assert first.slots.tolist() == [0, 1, 2, 3, 4, 5]
    assert second.copies == [(1, 2)] and second.slots.tolist() == [10]
