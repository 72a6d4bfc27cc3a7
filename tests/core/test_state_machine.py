"""Random create/append/fork/free/step sequences on a tiny pool, against a shadow of the device.

The shadow device holds, per page and offset, a marker of the token written there. A token whose
whole prefix is known is marked by (tenant, its prefix): exactly what a prefix-cache hit promises;
any other token gets a unique marker. Each slot the core returns is written with its marker
(copy-on-write copies first), like a real writer would; appends without data are written late,
just before that sequence's next operation, so a page cached before its data arrives is caught.
After every rule, every live sequence must read back exactly its own tokens through its block
table. A twin table receives only the operations that succeeded: failures must leave no trace.
The table checks each plan it applies against what applying it did (PlanCheckingTable).
"""

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from service.core.allocator import PageAllocator
from service.core.errors import InvalidRequest, KVPoolError, OutOfPages, QuotaExceeded, SequenceNotFound
from service.core.layout import lut_columns
from service.core.plan import Decode, NewRow, OneRow, Plan, Rows
from service.core.records import Extension
from service.core.sequences import SequenceTable
from tests.core.conftest import use_source_build
from tests.core.helpers import ref_counts_from_tables, snapshot

TENANTS = ("", "t")
MAX_SEQUENCES = 8
token_lists = st.lists(st.integers(0, 1), max_size=9)  # a tiny vocabulary: prefixes repeat often
mostly_true = st.sampled_from([True, True, True, False])  # token ids known: pages get hashed


def plan_kind(plan: Plan) -> str:
    change = plan.change
    if isinstance(change, NewRow):
        if not change.from_cache:
            return "fork"
        return "create with a hit" if len(change.pages) else "create"
    kind = {OneRow: "one row", Decode: "decode step", Rows: "rows"}[type(change)]
    return kind + (" with copies" if plan.copy_sources else "") + (" evicting" if plan.num_evictions else "")


class PlanCheckingTable(SequenceTable):
    """A SequenceTable that checks every plan it applies against what applying it did: the pages
    handed out (each unreferenced before, now held once), the cached ones among them (evictions),
    the copy sources, the tenant's pages and the tokens; and counts the kinds of plans it saw
    checked, applied and refused (kinds: a class-level Counter, for the coverage test)."""

    kinds: ClassVar[Counter[str]] = Counter()

    def check(self, plan: Plan) -> Plan:
        try:
            checked = super().check(plan)
        except KVPoolError as exc:
            self.kinds[f"{plan_kind(plan)}: {exc.code}"] += 1
            raise
        self.kinds[plan_kind(checked)] += 1
        return checked

    def apply(self, plan: Plan, data_written: bool = False) -> Extension:
        a, change = self.allocator, plan.change
        rows = [] if isinstance(change, NewRow) else [change.row] if isinstance(change, OneRow) else change.rows
        old_tables = {row: self.tables[row, : self.num_pages[row]].tolist() for row in rows}
        refs, cached = a.ref_count.copy(), set(a.cached_pages())
        evictions, held = a.num_evictions, self.tenant_pages(plan.tenant)
        tokens = self.stats.tokens_appended
        ext = super().apply(plan, data_written)
        handed_out = [dst for _, dst in ext.copies]
        for row, old in old_tables.items():
            handed_out += self.tables[row, len(old) : self.num_pages[row]].tolist()
        assert len(handed_out) == len(set(handed_out)) == plan.num_new
        assert all(refs[p] == 0 and a.ref_count[p] == 1 for p in handed_out)
        assert sum(p in cached for p in handed_out) == plan.num_evictions == a.num_evictions - evictions
        assert [src for src, _ in ext.copies] == plan.copy_sources
        assert self.tenant_pages(plan.tenant) - held == plan.num_held
        assert self.stats.tokens_appended - tokens == plan.num_tokens == len(ext.slots)
        if isinstance(change, NewRow):
            assert self.block_table(change.seq) == np.asarray(change.pages).tolist() and plan.num_held == len(
                change.pages
            )
        return ext


def make_table(num_pages: int, page_size: int, prefix_caching: bool, quota: int, content_names: bool) -> SequenceTable:
    return PlanCheckingTable(PageAllocator(num_pages, prefix_caching, content_names), page_size, quota)


@dataclass
class SeqModel:
    tenant: str
    markers: list[Any]  # what the device must hold at each position
    tokens: list[int] | None  # the known token ids, None once an append came without them
    pending: list[tuple[int, Any]] = field(default_factory=list)  # (slot, marker) not written yet
    pending_from: int = -1  # first position whose data has not been written


class PoolMachine(RuleBasedStateMachine):
    num_pages = 10
    page_size = 2
    prefix_caching = True
    quota = 0
    content_names = False  # pages named serially, as a server without events or tiers names them

    def __init__(self) -> None:
        super().__init__()
        args = (self.num_pages, self.page_size, self.prefix_caching, self.quota, self.content_names)
        self.table = make_table(*args)
        self.twin = make_table(*args)
        self.sentinel = self.num_pages
        self.device: list[list[Any]] = [[None] * self.page_size for _ in range(self.num_pages + 1)]
        self.seqs: dict[str, SeqModel] = {}
        self.next_id = 0
        self.next_marker = 0

    # -- helpers ----------------------------------------------------------------------------------
    def pick(self, index: int) -> str:
        return sorted(self.seqs)[index % len(self.seqs)]

    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def both(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call on the table; on success replay on the twin, whose result must be the same."""
        before = snapshot(self.table, TENANTS)
        try:
            result = getattr(self.table, method)(*args, **kwargs)
        except (OutOfPages, QuotaExceeded):
            assert snapshot(self.table, TENANTS) == before, f"a failed {method} changed the state"
            return None
        twin_result = getattr(self.twin, method)(*args, **kwargs)
        assert describe(result, self.table) == describe(twin_result, self.twin)
        return result

    def flush(self, seq_id: str) -> None:
        """The writer fills the slots of earlier appends without data."""
        m = self.seqs[seq_id]
        for slot, marker in m.pending:
            self.write(slot, marker)
        m.pending, m.pending_from = [], -1

    def write(self, slot: int, marker: Any) -> None:
        page, offset = divmod(slot, self.page_size)
        assert 0 <= page < self.sentinel, f"slot {slot} is on the null page or outside the pool"
        assert self.table.allocator.ref_count[page] > 0, f"write into page {page} that nobody holds"
        self.device[page][offset] = marker

    def apply_copies(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            assert src != dst and dst != self.sentinel and src != self.sentinel
            self.device[dst] = list(self.device[src])

    def new_markers(self, m: SeqModel, token_ids: list[int] | None, n: int) -> list[Any]:
        if token_ids is None:
            m.tokens = None
        out: list[Any] = []
        for i in range(n):
            if m.tokens is not None and token_ids is not None:
                m.tokens.append(token_ids[i])
                out.append(("token", m.tenant, tuple(m.tokens)))
            else:
                self.next_marker += 1
                out.append(("unique", self.next_marker))
        return out

    def record(self, seq_id: str, slots: list[int], token_ids: list[int] | None, written: bool) -> None:
        """Check the new slots against the block table and write (or queue) their markers."""
        m = self.seqs[seq_id]
        start = len(m.markers)
        table = self.table.block_table(self.table.get(seq_id, m.tenant))
        size = self.page_size
        assert slots == [table[p // size] * size + p % size for p in range(start, start + len(slots))]
        markers = self.new_markers(m, token_ids, len(slots))
        m.markers.extend(markers)
        if written:
            for slot, marker in zip(slots, markers):
                self.write(slot, marker)
        else:
            if m.pending_from < 0:
                m.pending_from = start
            m.pending.extend(zip(slots, markers))

    # -- rules ----------------------------------------------------------------------------------
    @precondition(lambda self: len(self.seqs) < MAX_SEQUENCES)
    @rule(
        tenant=st.sampled_from(TENANTS),
        prompt=st.none() | token_lists,
        like=st.none() | st.integers(0, 99),
        keep=st.integers(0, 9),
        aim_at_unwritten=st.booleans(),
    )
    def create(
        self, tenant: str, prompt: list[int] | None, like: int | None, keep: int, aim_at_unwritten: bool
    ) -> None:
        """With `like`, the prompt starts with the known tokens of a live sequence: this aims at
        prefix hits, and at pages whose data is not written yet (which must not be hit)."""
        if like is not None and self.seqs:
            waiting = sorted(s for s, m in self.seqs.items() if m.pending and m.tokens)
            if aim_at_unwritten and waiting:
                target = self.seqs[waiting[like % len(waiting)]]
                tenant, prompt = target.tenant, [*(target.tokens or []), *(prompt or [0])]
            else:
                prompt = (self.seqs[self.pick(like)].tokens or [])[:keep] + (prompt or [])
        seq_id = self.new_id()
        seq = self.both("create", seq_id, prompt, tenant)
        if seq is None:
            return
        cached = seq.cached_tokens
        assert self.table.length(seq) == cached and cached % self.page_size == 0
        if not prompt or not self.prefix_caching:
            assert cached == 0
        else:
            assert cached <= len(prompt) - 1
        prompt = prompt or []
        markers = [("token", tenant, tuple(prompt[: p + 1])) for p in range(cached)]
        self.seqs[seq_id] = SeqModel(tenant, markers, list(prompt[:cached]))

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99), n=st.integers(1, 5), with_ids=mostly_true, data=st.data())
    def append(self, index: int, n: int, with_ids: bool, data: st.DataObject) -> None:
        seq_id = self.pick(index)
        m = self.seqs[seq_id]
        self.flush(seq_id)
        token_ids = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) if with_ids else None
        written = data.draw(st.booleans(), label="data written")
        old_table = self.table.block_table(self.table.get(seq_id, m.tenant))
        result = self.both("append", seq_id, n, token_ids, written, m.tenant)
        if result is None:
            return
        _, ext = result
        new_table = self.table.block_table(self.table.get(seq_id, m.tenant))
        self.check_append_only(old_table, new_table, ext.copies)
        self.apply_copies(ext.copies)
        self.record(seq_id, ext.slots.tolist(), token_ids, written)

    @precondition(lambda self: self.seqs)
    @rule(
        picks=st.lists(st.tuples(st.integers(0, 99), st.integers(1, 3), mostly_true), max_size=4),
        listed=st.none() | st.lists(st.integers(0, 99), max_size=4),
        write_now=st.booleans(),
        data=st.data(),
    )
    def step(
        self,
        picks: list[tuple[int, int, bool]],
        listed: list[int] | None,
        write_now: bool,
        data: st.DataObject,
    ) -> None:
        tenant = self.seqs[self.pick(picks[0][0] if picks else 0)].tenant
        appends: list[tuple[str, int, list[int] | None]] = []
        for index, n, with_ids in picks:
            seq_id = self.pick(index)
            if self.seqs[seq_id].tenant != tenant or any(a[0] == seq_id for a in appends):
                continue
            ids = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) if with_ids else None
            appends.append((seq_id, n, ids))
        seq_ids = None
        if listed is not None:
            # Every appended sequence is listed too: a writer needs the slots of what it appended.
            chosen = [s for s in map(self.pick, listed) if self.seqs[s].tenant == tenant]
            seq_ids = list(dict.fromkeys(chosen[:1] + [a[0] for a in appends] + chosen[1:]))
        self.run_step(appends, seq_ids, tenant, write_now)

    def run_step(
        self, appends: list[tuple[str, int, list[int] | None]], seq_ids: list[str] | None, tenant: str, write_now: bool
    ) -> None:
        rows = [a[0] for a in appends] if seq_ids is None else seq_ids
        for seq_id in {*rows, *(a[0] for a in appends)}:
            self.flush(seq_id)
        tables = {s: self.table.block_table(self.table.get(s, tenant)) for s in {*rows, *(a[0] for a in appends)}}
        lengths = {s: len(self.seqs[s].markers) for s in rows}
        result = self.both("step", appends, seq_ids, tenant)
        if result is None:
            return
        for seq_id, old in tables.items():
            self.check_append_only(old, self.table.block_table(self.table.get(seq_id, tenant)), result.copies)
        self.apply_copies(result.copies)
        appended = {a[0]: a for a in appends}
        assert result.seq_ids == rows
        assert result.cache_lengths.dtype.name == "uint32"
        assert result.cache_lengths.tolist() == [lengths[s] for s in rows]
        assert result.input_lengths == [appended[s][1] if s in appended else 0 for s in rows]
        for seq_id, slots in zip(rows, result.slots):
            if seq_id in appended:
                self.record(seq_id, slots, appended[seq_id][2], write_now)
            else:
                assert slots == []
        self.check_lookup_table(rows, result.lookup_table)

    @precondition(lambda self: len(self.seqs) >= 2)
    @rule(index=st.integers(0, 99), with_ids=st.booleans(), data=st.data())
    def decode_step(self, index: int, with_ids: bool, data: st.DataObject) -> None:
        """One token for every live sequence of a tenant (the decode step's own plan), with token ids
        or without, all written at once."""
        tenant = self.seqs[self.pick(index)].tenant
        appends: list[tuple[str, int, list[int] | None]] = [
            (s, 1, [data.draw(st.integers(0, 1))] if with_ids else None)
            for s, m in sorted(self.seqs.items())
            if m.tenant == tenant
        ]
        self.run_step(appends, None, tenant, write_now=True)

    @precondition(lambda self: self.seqs and len(self.seqs) < MAX_SEQUENCES)
    @rule(index=st.integers(0, 99))
    def fork(self, index: int) -> None:
        parent_id = self.pick(index)
        parent = self.seqs[parent_id]
        self.flush(parent_id)
        child_id = self.new_id()
        child = self.both("fork", parent_id, child_id, parent.tenant)
        if child is None:
            return
        assert self.table.block_table(child) == self.table.block_table(self.table.get(parent_id, parent.tenant))
        tokens = None if parent.tokens is None else list(parent.tokens)
        self.seqs[child_id] = SeqModel(parent.tenant, list(parent.markers), tokens)

    @precondition(lambda self: self.seqs and len(self.seqs) < MAX_SEQUENCES)
    @rule(index=st.integers(0, 99), parent_too=st.booleans(), write_now=st.booleans())
    def fork_then_step(self, index: int, parent_too: bool, write_now: bool) -> None:
        """Aims at copy-on-write: a fork, then a step appending to it (and to its parent: the one
        listed last keeps the shared partial page)."""
        parent_id = self.pick(index)
        before = len(self.seqs)
        self.fork(index)
        if len(self.seqs) == before:
            return
        child_id = f"s{self.next_id}"
        appends: list[tuple[str, int, list[int] | None]] = [(child_id, 1, [1])]
        if parent_too:
            appends.insert(0, (parent_id, 1, [0]))
        self.run_step(appends, None, self.seqs[parent_id].tenant, write_now)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99))
    def free(self, index: int) -> None:
        seq_id = self.pick(index)
        m = self.seqs[seq_id]
        self.flush(seq_id)
        pages = self.table.block_table(self.table.get(seq_id, m.tenant))
        sole = sum(int(self.table.allocator.ref_count[p]) == 1 for p in pages)
        assert self.both("free", seq_id, m.tenant) == sole
        del self.seqs[seq_id]

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99))
    def write_pending(self, index: int) -> None:
        self.flush(self.pick(index))

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99), kind=st.sampled_from(["duplicate", "token_ids", "unknown", "zero"]))
    def invalid_step(self, index: int, kind: str) -> None:
        seq_id = self.pick(index)
        tenant = self.seqs[seq_id].tenant
        cases: dict[str, list[tuple[str, int, list[int] | None]]] = {
            "duplicate": [(seq_id, 1, None), (seq_id, 1, None)],
            "token_ids": [(seq_id, 2, [0])],
            "unknown": [(seq_id, 1, None), ("missing", 1, None)],
            "zero": [(seq_id, 0, None)],
        }
        appends = cases[kind]
        before = snapshot(self.table, TENANTS)
        try:
            self.table.step(appends, None, tenant)
        except (InvalidRequest, SequenceNotFound):
            pass
        else:
            raise AssertionError(f"a step with a {kind} append was accepted")
        assert snapshot(self.table, TENANTS) == before

    # -- checks -----------------------------------------------------------------------------------
    def check_append_only(self, old: list[int], new: list[int], copies: list[tuple[int, int]]) -> None:
        """Block tables only grow, except that a shared partial last page may be swapped for its copy."""
        assert len(new) >= len(old)
        if old:
            assert new[: len(old) - 1] == old[:-1]
            if new[len(old) - 1] != old[-1]:
                assert (old[-1], new[len(old) - 1]) in copies

    def check_lookup_table(self, rows: list[str], lut: Any) -> None:
        tables = [self.table.block_table(self.table.get(s, self.seqs[s].tenant)) for s in rows]
        num = max((len(t) for t in tables), default=0)
        assert lut.dtype.name == "uint32" and lut.shape == (len(rows), lut_columns(num))
        for row, t in zip(lut.tolist(), tables):
            assert row == t + [self.sentinel] * (len(row) - len(t))

    @invariant()
    def pages_add_up(self) -> None:
        a = self.table.allocator
        assert a.num_used + a.num_cached + a.num_free == self.num_pages
        assert min(a.num_used, a.num_cached, a.num_free) >= 0
        refs = ref_counts_from_tables(self.table)
        assert a.ref_count.tolist() == refs.tolist()
        assert a.num_used == int((refs > 0).sum())
        cached = a.cached_pages()
        assert len(set(cached)) == len(cached) and all(refs[p] == 0 and a.page_name(p) for p in cached)
        for page in range(self.num_pages):  # a page neither used nor cached is free and forgotten
            if refs[page] == 0 and page not in cached:
                assert a.page_name(page) is None
        if not self.prefix_caching:
            assert a.num_cached == 0

    @invariant()
    def tables_are_well_formed(self) -> None:
        t: SequenceTable = self.table
        assert len(t) == len(self.seqs)
        for tenant in TENANTS:
            held = sum(len(t.block_table(s)) for s in t.sequences() if s.tenant == tenant)
            assert t.tenant_pages(tenant) == held
            if self.quota:
                assert held <= self.quota
        for seq in t.sequences():
            pages = t.block_table(seq)
            length = t.length(seq)
            assert length == len(self.seqs[seq.seq_id].markers)
            assert len(pages) == -(-length // self.page_size)
            assert self.sentinel not in pages and len(set(pages)) == len(pages)
            row = t.tables[seq.row].tolist()
            assert row[: len(pages)] == pages and set(row[len(pages) :]) == {self.sentinel}
        filled: dict[int, int] = {}  # page -> token slots filled, a shared page counted once
        for seq in t.sequences():
            for i, page in enumerate(t.block_table(seq)):
                filled[page] = min(self.page_size, t.length(seq) - i * self.page_size)
        assert t.tokens_in_used_pages() == sum(filled.values())

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        assert self.device[self.sentinel] == [None] * self.page_size  # the null page is never written
        for seq_id, m in self.seqs.items():
            pages = self.table.block_table(self.table.get(seq_id, m.tenant))
            written = len(m.markers) if m.pending_from < 0 else m.pending_from
            got = [self.device[pages[p // self.page_size]][p % self.page_size] for p in range(written)]
            assert got == m.markers[:written], f"{seq_id} reads other tokens"

    @invariant()
    def pages_waiting_for_data_are_not_cached(self) -> None:
        """A page enters the prefix cache only once its data is written."""
        for m in self.seqs.values():
            for slot, _ in m.pending:
                assert self.table.allocator.page_name(slot // self.page_size) is None

    @invariant()
    def twin_agrees(self) -> None:
        assert snapshot(self.table, TENANTS) == snapshot(self.twin, TENANTS)


def describe(result: Any, table: SequenceTable) -> Any:
    """A comparable summary of what a core call returned."""
    if isinstance(result, tuple):  # append: (sequence, extension)
        return describe(result[0], table), result[1].slots.tolist(), result[1].copies
    if hasattr(result, "row"):
        return result.seq_id, table.length(result), table.block_table(result), result.cached_tokens
    if hasattr(result, "lookup_table"):
        return (
            result.seq_ids,
            result.lookup_table.tolist(),
            result.cache_lengths.tolist(),
            result.input_lengths,
            result.slots,
            result.copies,
        )
    return result


class PoolMachineWithoutPrefixCaching(PoolMachine):
    prefix_caching = False


class PoolMachineWithQuota(PoolMachine):
    quota = 6  # pages per tenant, of 10: both QuotaExceeded and OutOfPages happen


class PoolMachineWithContentNames(PoolMachine):
    content_names = True  # pages named by their chained SHA-256 hash, as with KV events or tiers on


# About 10 s in all on this 2-core machine when idle (the prefix-caching pool has more to explore).
TestPoolWithPrefixCaching = PoolMachine.TestCase
TestPoolWithPrefixCaching.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class TestPoolOnTheSourceBuild(PoolMachine.TestCase):  # type: ignore[misc,name-defined]
    """The prefix-caching pool again, with the compiled core modules run from their source."""

    settings = settings(
        max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )

    def setUp(self) -> None:
        self.undo = use_source_build()

    def tearDown(self) -> None:
        self.undo()


TestPoolWithoutPrefixCaching = PoolMachineWithoutPrefixCaching.TestCase
TestPoolWithoutPrefixCaching.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPoolWithContentNames = PoolMachineWithContentNames.TestCase
TestPoolWithContentNames.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPoolWithQuota = PoolMachineWithQuota.TestCase
TestPoolWithQuota.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_the_machine_plans_every_kind_of_change_and_failure() -> None:
    """The machines above would pass vacuously if they never reached a kind of plan: run them on
    a fresh count and require every kind to have been checked, applied and refused for lack of pages."""
    PlanCheckingTable.kinds.clear()
    quick = settings(
        max_examples=30,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same runs every time: a kind reached once is reached always
    )
    run_state_machine_as_test(PoolMachine, settings=quick)
    run_state_machine_as_test(PoolMachineWithQuota, settings=quick)
    seen = PlanCheckingTable.kinds
    expected = [
        "create",
        "create with a hit",
        "fork",
        "one row",
        "one row with copies",
        "one row evicting",
        "decode step",
        "decode step evicting",
        "rows",
        "rows with copies",
        "one row: out_of_pages",
        "one row: quota_exceeded",
        "decode step: out_of_pages",
        "rows: out_of_pages",
        "rows with copies: out_of_pages",
        "fork: quota_exceeded",
    ]  # (a prefix hit over the quota is rare here: test_sequences pins it)
    assert [k for k in expected if not seen[k]] == [], dict(seen)
