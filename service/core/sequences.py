"""Sequences and their block tables, on top of the page allocator.

Every operation that takes pages (create with a prefix hit, fork, append, step) is planned, then
applied: a plan (service.core.plan) works out everything the operation takes, check() holds it
against the tenant's quota and the pages available, raising before anything changes, and apply()
carries it out and cannot fail. The quota, the failure count, the tenant's page count and the token
count therefore each happen in one place; pages are committed to the prefix cache by apply(), and
by free() and a step's listed rows, which hold written pages without appending.

Prefix-cache commits happen when a page's K/V is known to be written: at an append with
data_written, at the next append or step naming the sequence, or at free. Leases renew on every
call naming a sequence (service.core.registry). Lengths, page counts and hashing progress live in
numpy arrays indexed by row (service.core.block_tables), so a decode step over hundreds of
sequences costs a handful of vector operations and one dict probe per sequence.
"""

import math
import time
from collections.abc import Callable

import numpy as np

from service.core import batching
from service.core.allocator import PageAllocator
from service.core.block_tables import BlockTables
from service.core.errors import AttendTooLarge, InvalidRequest, OutOfPages, QuotaExceeded
from service.core.plan import (
    NewRow,
    Plan,
    checked_data,
    checked_token_data,
    plan_new,
    plan_one,
    plan_rows,
)
from service.core.prefixes import Prefixes
from service.core.records import Append, Extension, Sequence, Stats, StepResult, TokenIds
from service.core.registry import Registry, check_distinct

__all__ = ["Sequence", "SequenceTable", "Stats", "StepResult"]


class SequenceTable:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_pages_per_tenant: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.sentinel = allocator.num_pages
        self.blocks = BlockTables(self.sentinel, page_size)
        if allocator.enable_prefix_caching:
            allocator.reserve_keys(page_size * 8)
        self.clock = clock  # leases: expires_at is on this clock
        self.registry = Registry(clock)
        self.prefixes = Prefixes(allocator, self.blocks, self.registry.of_row)
        self.max_pages_per_tenant = max_pages_per_tenant
        self.stats = Stats()
        self._tenant_pages: dict[str, int] = {}
        self._generation = 0  # changes applied: a plan is made on one state and applied to it

    # -- lookups ------------------------------------------------------------------------------
    @property
    def tables(self) -> np.ndarray:
        """uint32 [rows, width]: each row's pages, then the sentinel."""
        return self.blocks.tables

    @property
    def lengths(self) -> np.ndarray:
        return self.blocks.lengths

    @property
    def num_pages(self) -> np.ndarray:
        return self.blocks.num_pages

    def __len__(self) -> int:
        return len(self.registry)

    def get(self, seq_id: str, tenant: str = "") -> Sequence:
        """The sequence `seq_id` of `tenant` (SequenceNotFound if none), its lease renewed."""
        return self.registry.get(seq_id, tenant)

    def sequences(self) -> list[Sequence]:
        return self.registry.all()

    def length(self, seq: Sequence) -> int:
        return int(self.blocks.lengths[seq.row])

    def block_table(self, seq: Sequence) -> list[int]:
        return self.blocks.tables[seq.row, : self.blocks.num_pages[seq.row]].tolist()

    def lookup_table(self, rows: np.ndarray) -> np.ndarray:
        """uint32 [len(rows), lut_columns(max pages)]: pages, then the sentinel everywhere else."""
        return self.blocks.lookup_table(rows)

    def tenant_pages(self, tenant: str) -> int:
        return self._tenant_pages.get(tenant, 0)

    def tokens_in_used_pages(self) -> int:
        """Token slots filled in the used pages, each physical page counted once.

        Every page of a block table is full except the last; a shared page has the same fill in
        every table holding it (an append copies a shared partial page first), so the filled slots
        are all used pages full minus the empty tail of each distinct partial last page. Unlike a
        sum of sequence lengths, this counts pages shared by forks or prefix hits once.
        """
        size, b = self.page_size, self.blocks
        rows = np.array([s.row for s in self.sequences()], dtype=np.int64)
        lengths = b.lengths[rows]
        partial = np.nonzero(lengths % size)[0]
        tails = b.tables[rows[partial], b.num_pages[rows[partial]] - 1].astype(np.int64)
        _, first = np.unique(tails, return_index=True)
        empty_slots = int((size - lengths[partial][first] % size).sum())
        return self.allocator.num_used * size - empty_slots

    # -- operations: plan, check, apply -------------------------------------------------------
    def create(
        self,
        seq_id: str | None = None,
        token_ids: TokenIds | None = None,
        tenant: str = "",
        ttl_s: float = 0.0,
        cache_salt: str = "",
        reserve_to: int | None = None,
    ) -> Sequence:
        """A new sequence; with token_ids, it starts on the longest cached run of full pages.
        Token ids (here and in append) are a list of ints or a 1-D numpy integer array (no per-id
        conversion: what an engine holding them in numpy passes).

        ttl_s > 0 gives it a lease: expire() frees it once ttl_s seconds pass without a call naming it.
        cache_salt (e.g. vLLM's per-request cache_salt) salts the sequence's prefix hashes like the
        tenant does: sequences with different salts never share pages.
        reserve_to: the token ids from the end of the cached prefix up to `reserve_to` also appended (slots
        whose K/V the client writes, as append() without data gives), where the pages and the tenant's quota
        allow; where they do not, the sequence holds the cached prefix only (its length says which). An engine
        that will save the prompt it looks up asks for both in one call.
        """
        if not (math.isfinite(ttl_s) and ttl_s >= 0):
            raise InvalidRequest(f"ttl_s must be a finite number >= 0, not {ttl_s}")
        num_ids = 0 if token_ids is None else len(token_ids)
        if reserve_to is not None and not 0 <= reserve_to <= num_ids:
            raise InvalidRequest(f"reserve_to must be within the {num_ids} token ids given, not {reserve_to}")
        seq_id = self.registry.new_id(seq_id, tenant)
        hits, last_name, tokens = self.prefixes.match([] if token_ids is None else token_ids, tenant, cache_salt)
        num_cached = len(hits) * self.page_size
        seq = Sequence(seq_id, tenant, -1, tokens, last_name, num_cached, ttl_s, self.clock() + ttl_s)
        self.apply(self.check(plan_new(NewRow(seq, hits, True, num_cached, len(hits), True))))
        if token_ids is not None and len(token_ids):
            self.stats.prefix_query_tokens += len(token_ids)
            self.stats.prefix_hit_tokens += num_cached
        if token_ids is not None and reserve_to is not None and reserve_to > num_cached:
            try:  # (the cached prefix is whole pages: the reservation starts a page, no copy-on-write)
                self.append(seq_id, reserve_to - num_cached, token_ids[num_cached:reserve_to], False, tenant)
            except (OutOfPages, QuotaExceeded):  # refused whole: nothing appended, the create stands
                pass
        return seq

    def fork(self, parent_id: str, child_id: str | None = None, tenant: str = "") -> Sequence:
        """A new sequence sharing every page of the parent (copy-on-write of a partial last page)."""
        parent = self.registry.get(parent_id, tenant)
        child_id = self.registry.new_id(child_id, tenant)
        src, b = parent.row, self.blocks
        num = int(b.num_pages[src])
        tokens = parent.tokens[:] if parent.tokens is not None else None
        # The lease is inherited (get() above just renewed the parent's).
        child = Sequence(
            child_id, tenant, -1, tokens, parent.last_name, parent.cached_tokens, parent.ttl_s, parent.expires_at
        )
        pages = b.tables[src, :num].astype(np.int64)
        change = NewRow(child, pages, False, int(b.lengths[src]), int(b.num_hashed[src]), bool(b.tokens_known[src]))
        self.apply(self.check(plan_new(change)))
        return child

    def append(
        self,
        seq_id: str,
        num_tokens: int,
        token_ids: TokenIds | None = None,
        data_written: bool = False,
        tenant: str = "",
    ) -> tuple[Sequence, Extension]:
        """Slots for num_tokens more tokens. data_written: their K/V is in the pool already."""
        seq = self.registry.get(seq_id, tenant)
        data = checked_data(num_tokens, token_ids)
        plan = plan_one(self.blocks, self.allocator, seq.row, num_tokens, data, tenant)
        return seq, self.apply(self.check(plan), data_written)

    def step(
        self, appends: list[Append], seq_ids: list[str] | None = None, tenant: str = "", free: list[str] | None = None
    ) -> StepResult:
        """All appends or none, then the lookup table of `seq_ids` (default: the appended ones), then the
        sequences `free` freed, their full pages committed (as free() does): a client's finished requests
        ride on its next step instead of a call each. Refused whole, with nothing changed, if any named
        sequence is missing, or a freed one is also appended or listed.

        Leases renew on every call naming a sequence, refused or not: rows() renews them on the way;
        a refusal renews every sequence the step names that exists."""
        free = free or []
        try:
            result = self._step(appends, seq_ids, tenant, free)
        except Exception:
            if self.registry.num_leased:
                self.renew([a[0] for a in appends], tenant)
                self.renew([*(seq_ids or []), *free], tenant)
            raise
        for seq_id in free:  # checked by _step: they exist, once each, and the step left them as they were
            self.free(seq_id, tenant)
        return result

    def _step(self, appends: list[Append], seq_ids: list[str] | None, tenant: str, free: list[str]) -> StepResult:
        # Without leases, the appends' columns come from one C pass.
        reg = self.registry
        columns = None if reg.num_leased else batching.unzip_appends(reg.by_tenant.get(tenant, {}), appends)
        if columns is None:
            ids, counts, token_lists = (list(c) for c in zip(*appends)) if appends else ([], [], [])
            rows, distinct = reg.rows(ids, tenant), len(set(ids)) == len(ids)
        else:
            ids, counts, token_lists, raw_rows, distinct = columns
            rows = np.frombuffer(raw_rows, dtype=np.int64)
        if not distinct:
            raise InvalidRequest("a sequence may appear only once in the appends of a step")
        if seq_ids is not None:
            check_distinct(seq_ids)
        if free:
            check_distinct(free)
            reg.rows(free, tenant)  # SequenceNotFound before anything changes
            if not set(free).isdisjoint([*ids, *(seq_ids or ())]):
                raise InvalidRequest("a sequence freed by a step may not also be appended or listed in it")
        listed = rows if seq_ids is None else reg.rows(seq_ids, tenant)
        before = self.blocks.lengths[listed].astype(np.uint32)
        token_data = checked_token_data(counts, token_lists)
        ext = self.apply(self.check(plan_rows(self.blocks, self.allocator, rows, counts, token_data, tenant)))
        if seq_ids is None:
            input_lengths, new_slots = counts, ext.slots
        else:
            # Pages written before this step only: the data of the pages appended now comes after it.
            self.prefixes.commit_rows(listed, before)
            index = {seq_id: i for i, seq_id in enumerate(ids)}
            offs, parts, input_lengths = ext.offsets, [], []
            for seq_id in seq_ids:
                i = index.get(seq_id)
                input_lengths.append(0 if i is None else counts[i])
                if i is not None:
                    parts.append(ext.slots[offs[i] : offs[i + 1]])
            new_slots = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return StepResult(
            seq_ids=ids if seq_ids is None else list(seq_ids),
            lookup_table=self.blocks.lookup_table(listed),
            cache_lengths=before,
            input_lengths=input_lengths,
            new_slots=new_slots,
            copies=ext.copies,
        )

    def check(self, plan: Plan) -> Plan:
        """`plan`, if the tenant's quota and the pages available allow it; otherwise QuotaExceeded or
        OutOfPages (counted in stats.allocation_failures), and nothing changed."""
        limit, more = self.max_pages_per_tenant, plan.num_held
        if limit and more > 0 and (held := self._tenant_pages.get(plan.tenant, 0)) + more > limit:
            raise QuotaExceeded(
                f"tenant {plan.tenant!r} holds {held} pages; {more} more would pass its quota of {limit}"
            )
        if num_new := plan.num_new:  # (a new sequence on shared pages takes none)
            alloc = self.allocator
            if num_new > (available := alloc.num_available):
                self.stats.allocation_failures += 1
                raise OutOfPages(num_new, available)
            if num_new > alloc.num_free:
                plan.num_evictions = num_new - alloc.num_free
        plan.generation = self._generation
        return plan

    def apply(self, plan: Plan, data_written: bool = False) -> Extension:
        """Carry out a checked plan on the state it was made on; nothing here can fail.
        data_written: the appended tokens' K/V is in the pool already, so their full pages are committed."""
        assert plan.generation == self._generation, "a plan applies only to the state it was checked on"
        self._generation += 1
        change = plan.change
        self._tenant_pages[plan.tenant] = self._tenant_pages.get(plan.tenant, 0) + plan.num_held
        # (A prefix hit's pages need not have sat in a row here: a tier restored them.)
        self.blocks.ensure_width(plan.most_pages)
        if isinstance(change, NewRow):  # a fork or a prefix hit: nothing appended, nothing to commit
            ext = change.place(plan.num_new, self.blocks, self.allocator)
            self.registry.add(change.seq)
            return ext
        self.prefixes.commit_changed(change)  # the pages of earlier appends are written by now
        ext = change.place(plan.num_new, self.blocks, self.allocator)
        self.stats.tokens_appended += plan.num_tokens
        self.prefixes.record(change)
        if data_written:
            self.prefixes.commit_changed(change)
        return ext

    def free(self, seq_id: str, tenant: str = "", commit: bool = True) -> int:
        """Release a sequence; returns how many of its pages became unreferenced.
        commit=False: its pages not committed yet are released uncommitted (their writer could not write
        them all: a vLLM connector whose rank failed), so that no prefix ever hits them."""
        seq = self.registry.get(seq_id, tenant)
        row, b = seq.row, self.blocks
        if commit and seq.tokens is not None:  # its pages are written by now
            self.prefixes.commit_upto(seq, b.lengths.item(row) // self.page_size)
        num = b.num_pages.item(row)
        freed = self.allocator.release(b.tables[row, :num][::-1])  # tail first
        b.release_row(row, num)
        self.registry.remove(seq)
        self._tenant_pages[tenant] -= num
        self._generation += 1
        return freed

    # -- attention and leases -----------------------------------------------------------------
    def attention_batch(
        self, seq_ids: list[str], q_lens: list[int], tenant: str = "", max_tokens: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For queries at the last q_lens positions of each sequence: (lookup table, cache lengths,
        slots of the query positions).

        max_tokens > 0 caps the attention work: the sum over the sequences of q_len x length (the
        (query, context token) pairs, the causal mask not subtracted), refused with AttendTooLarge
        before the lookup table is built."""
        rows = self.registry.rows(seq_ids, tenant)
        check_distinct(seq_ids)
        lens = self.blocks.lengths[rows]
        counts = np.asarray(q_lens, dtype=np.int64)
        too_long = np.nonzero(counts > lens)[0]
        if len(too_long):
            i = int(too_long[0])
            raise InvalidRequest(f"q_len {int(counts[i])} exceeds the length {int(lens[i])} of sequence {seq_ids[i]!r}")
        if max_tokens and (tokens := int((counts * lens).sum())) > max_tokens:
            raise AttendTooLarge(tokens, max_tokens)
        cache_lengths = lens - counts
        return self.blocks.lookup_table(rows), cache_lengths, self.blocks.slots_of(rows, cache_lengths, counts)

    def renew(self, seq_ids: list[str], tenant: str = "") -> None:
        """Renew the leases of those of `seq_ids` that exist: a call naming them was refused."""
        self.registry.renew(seq_ids, tenant)

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Free, through free(), every leased sequence whose lease ran out by `now` (on self.clock);
        returns their (tenant, seq_id) in no particular order."""
        expired = self.registry.expired(now)
        for seq in expired:
            self.free(seq.seq_id, seq.tenant)
        self.stats.sequences_expired += len(expired)
        return [(s.tenant, s.seq_id) for s in expired]

    def expires_in(self, seq: Sequence, now: float) -> float | None:
        """Seconds left on the lease of `seq` at `now` (None: no lease)."""
        return max(0.0, seq.expires_at - now) if seq.ttl_s else None
