"""Sequences and their block tables, on top of the page allocator.

Lengths, page counts and hashing progress are numpy arrays indexed by row (service.core.block_tables),
so a decode step over hundreds of sequences costs a handful of vector operations and one dict probe
per sequence, not a Python loop per page.

Every public operation checks everything first and changes nothing when a check fails.
"""

import math
import time
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from service.core.allocator import PageAllocator
from service.core.block_tables import BlockTables
from service.core.errors import InvalidRequest, OutOfPages, QuotaExceeded, SequenceExists, SequenceNotFound
from service.core.hashing import int64_bytes, root_hash, token_bytes


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    tenant: str
    row: int
    # Token ids so far as int64 (converted once, on arrival); None once an append came without
    # token ids: the sequence's later pages are never hashed.
    tokens: "array[int] | None"
    last_hash: bytes  # hash of the last hashed page (the tenant root before the first)
    cached_tokens: int = 0
    ttl_s: float = 0.0
    expires_at: float = 0.0


@dataclass(slots=True)
class Extension:
    """What one append (or the appends of one step) changed on the device side."""

    slots: np.ndarray  # int64 [total new tokens], sequences in order
    offsets: list[int]  # slots[offsets[i]:offsets[i+1]] belong to the i-th sequence
    copies: list[tuple[int, int]]  # (src page, dst page) copy-on-write copies to do before writing


@dataclass(slots=True)
class StepResult:
    seq_ids: list[str]
    lookup_table: np.ndarray  # uint32 [batch, lut_columns(max pages)]
    cache_lengths: np.ndarray  # uint32 [batch], lengths before this step's appends
    input_lengths: list[int]
    slots: list[list[int]]
    copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class Stats:
    tokens_appended: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    allocation_failures: int = 0
    sequences_expired: int = 0


Append = tuple[str, int, "list[int] | None"]  # (seq_id, num_tokens, token_ids)


class SequenceTable(BlockTables):
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_pages_per_tenant: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(allocator.num_pages, page_size)
        self.allocator = allocator
        self.clock = clock  # leases: expires_at is on this clock
        self._num_leased = 0
        self.max_pages_per_tenant = max_pages_per_tenant
        self.stats = Stats()
        self._by_tenant: dict[str, dict[str, Sequence]] = {}
        self._num_seqs = 0
        self._seq_of_row: list[Sequence | None] = [None] * len(self.lengths)
        self._tenant_pages: dict[str, int] = {}
        self._roots: dict[str, bytes] = {}

    # -- lookups ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._num_seqs

    def get(self, seq_id: str, tenant: str = "") -> Sequence:
        seq = self._by_tenant.get(tenant, {}).get(seq_id)
        if seq is None:
            raise SequenceNotFound(seq_id)
        if seq.ttl_s:  # every call naming a sequence renews its lease (see expire())
            seq.expires_at = self.clock() + seq.ttl_s
        return seq

    def _rows(self, seq_ids: list[str], tenant: str) -> np.ndarray:
        """Rows of `seq_ids` (one dict probe each), or SequenceNotFound for the first unknown one."""
        seqs = self._by_tenant.get(tenant, {})
        try:
            if not self._num_leased:
                return np.array([seqs[s].row for s in seq_ids], dtype=np.int64)
            found = [seqs[s] for s in seq_ids]
        except KeyError as exc:
            raise SequenceNotFound(str(exc.args[0])) from None
        now = self.clock()
        for seq in found:  # renew leases, as get() does
            if seq.ttl_s:
                seq.expires_at = now + seq.ttl_s
        return np.array([seq.row for seq in found], dtype=np.int64)

    def sequences(self) -> list[Sequence]:
        return [s for seqs in self._by_tenant.values() for s in seqs.values()]

    def length(self, seq: Sequence) -> int:
        return int(self.lengths[seq.row])

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.row, : self.num_pages[seq.row]].tolist()

    def tenant_pages(self, tenant: str) -> int:
        return self._tenant_pages.get(tenant, 0)

    def tokens_in_used_pages(self) -> int:
        """Token slots filled in the used pages, each physical page counted once.

        Every page of a block table is full except the last; a shared page has the same fill in
        every table holding it (an append copies a shared partial page first), so the filled slots
        are all used pages full minus the empty tail of each distinct partial last page. Unlike a
        sum of sequence lengths, this counts pages shared by forks or prefix hits once.
        """
        size = self.page_size
        rows = np.array([s.row for s in self.sequences()], dtype=np.int64)
        lengths = self.lengths[rows]
        partial = np.nonzero(lengths % size)[0]
        tails = self.tables[rows[partial], self.num_pages[rows[partial]] - 1].astype(np.int64)
        _, first = np.unique(tails, return_index=True)
        empty_slots = int((size - lengths[partial][first] % size).sum())
        return self.allocator.num_used * size - empty_slots

    # -- create / fork / free -----------------------------------------------------------------
    def create(
        self, seq_id: str | None = None, token_ids: list[int] | None = None, tenant: str = "", ttl_s: float = 0.0
    ) -> Sequence:
        """A new sequence; with token_ids, it starts on the longest cached run of full pages.

        ttl_s > 0 gives it a lease: expire() frees it once ttl_s seconds pass without a call naming it.
        """
        if not (math.isfinite(ttl_s) and ttl_s >= 0):
            raise InvalidRequest(f"ttl_s must be a finite number >= 0, not {ttl_s}")
        seq_id = self._new_id(seq_id, tenant)
        hits, last_hash, data = self._match_prefix(token_ids or [], tenant)
        self._check_quota(tenant, len(hits))
        row = self._take_row()
        if hits:
            self.allocator.acquire_cached(hits)
        num_cached = len(hits) * self.page_size
        self.tables[row, : len(hits)] = hits
        self.lengths[row] = num_cached
        self.num_pages[row] = self.num_hashed[row] = len(hits)
        self.tokens_known[row] = True
        tokens = array("q")
        tokens.frombytes(data[: num_cached * 8])  # little-endian int64, as array("q") is here
        seq = Sequence(seq_id, tenant, row, tokens, last_hash, num_cached, ttl_s, self.clock() + ttl_s)
        self._add(seq, len(hits))
        if token_ids:
            self.stats.prefix_query_tokens += len(token_ids)
            self.stats.prefix_hit_tokens += num_cached
        return seq

    def _match_prefix(self, token_ids: list[int], tenant: str) -> tuple[list[int], bytes, bytes]:
        """(cached pages starting the prompt, hash of the last one, the token bytes of at least those)."""
        root = self._roots.get(tenant) or self._roots.setdefault(tenant, root_hash(tenant))
        max_hits = (len(token_ids) - 1) // self.page_size  # never cover the last prompt token
        if not self.allocator.enable_prefix_caching or max_hits <= 0:
            return [], root, b""
        # Convert the first page alone: most prompts miss there, and then the rest needs no bytes.
        size, nbytes = self.page_size, self.page_size * 8
        data = token_bytes(token_ids[:size])
        pages, last = self.allocator.match(root, data, nbytes)
        if pages and max_hits > 1:
            rest = token_bytes(token_ids[size : max_hits * size])
            more, last = self.allocator.match(last, rest, nbytes)
            pages += more
            data += rest
        return pages, last, data

    def fork(self, parent_id: str, child_id: str | None = None, tenant: str = "") -> Sequence:
        """A new sequence sharing every page of the parent (copy-on-write of a partial last page)."""
        parent = self.get(parent_id, tenant)
        child_id = self._new_id(child_id, tenant)
        src = parent.row
        num = int(self.num_pages[src])
        self._check_quota(tenant, num)
        row = self._take_row()
        self.tables[row] = self.tables[src]
        for arr in (self.lengths, self.num_pages, self.num_hashed, self.tokens_known):
            arr[row] = arr[src]
        self.allocator.retain(self.tables[row, :num].astype(np.int64))
        tokens = parent.tokens[:] if parent.tokens is not None else None
        # The lease is inherited (get() above just renewed the parent's).
        child = Sequence(
            child_id, tenant, row, tokens, parent.last_hash, parent.cached_tokens, parent.ttl_s, parent.expires_at
        )
        self._add(child, num)
        return child

    def free(self, seq_id: str, tenant: str = "") -> int:
        """Release a sequence; returns how many of its pages became unreferenced."""
        seq = self.get(seq_id, tenant)
        row = seq.row
        self._commit_upto(seq, int(self.lengths[row]) // self.page_size)
        num = int(self.num_pages[row])
        freed = self.allocator.release(self.tables[row, :num][::-1].astype(np.int64))  # tail first
        self._release_row(row)
        self._seq_of_row[row] = None
        del self._by_tenant[tenant][seq_id]
        self._num_seqs -= 1
        self._num_leased -= bool(seq.ttl_s)
        self._tenant_pages[tenant] -= num
        return freed

    def _new_id(self, seq_id: str | None, tenant: str) -> str:
        if seq_id is None:
            return uuid.uuid4().hex
        if seq_id in self._by_tenant.get(tenant, {}):
            raise SequenceExists(seq_id)
        return seq_id

    def _add(self, seq: Sequence, num_pages: int) -> None:
        self._by_tenant.setdefault(seq.tenant, {})[seq.seq_id] = seq
        if len(self._seq_of_row) < len(self.lengths):
            self._seq_of_row.extend([None] * (len(self.lengths) - len(self._seq_of_row)))
        self._seq_of_row[seq.row] = seq
        self._num_seqs += 1
        self._num_leased += bool(seq.ttl_s)
        self._tenant_pages[seq.tenant] = self._tenant_pages.get(seq.tenant, 0) + num_pages

    # -- append / step ------------------------------------------------------------------------
    def append(
        self,
        seq_id: str,
        num_tokens: int,
        token_ids: list[int] | None = None,
        data_written: bool = False,
        tenant: str = "",
    ) -> tuple[Sequence, Extension]:
        """Slots for num_tokens more tokens. data_written: their K/V is in the pool already."""
        seq = self.get(seq_id, tenant)
        return seq, self._extend_one(seq, num_tokens, token_ids, tenant, data_written)

    def step(self, appends: list[Append], seq_ids: list[str] | None = None, tenant: str = "") -> StepResult:
        """All appends or none, then the lookup table of `seq_ids` (default: the appended ones)."""
        ids, counts, token_lists = (list(c) for c in zip(*appends)) if appends else ([], [], [])
        rows = self._rows(ids, tenant)
        if len(set(ids)) != len(ids):
            raise InvalidRequest("a sequence may appear only once in the appends of a step")
        listed = rows if seq_ids is None else self._rows(seq_ids, tenant)
        before = self.lengths[listed].astype(np.uint32)
        ext = self._extend(rows, counts, token_lists, tenant)
        flat = ext.slots.tolist()
        if seq_ids is None:
            input_lengths = counts
            if len(flat) == len(ids):  # one token each
                slots = [[s] for s in flat]
            else:
                offs = ext.offsets
                slots = [flat[offs[i] : offs[i + 1]] for i in range(len(ids))]
        else:
            # Pages written before this step only: the data of the pages appended now comes after it.
            self._commit_pending(listed, before)
            index = {seq_id: i for i, seq_id in enumerate(ids)}
            input_lengths, slots = [], []
            for seq_id in seq_ids:
                i = index.get(seq_id)
                input_lengths.append(0 if i is None else counts[i])
                slots.append([] if i is None else flat[ext.offsets[i] : ext.offsets[i + 1]])
        return StepResult(
            seq_ids=ids if seq_ids is None else list(seq_ids),
            lookup_table=self.lookup_table(listed),
            cache_lengths=before,
            input_lengths=input_lengths,
            slots=slots,
            copies=ext.copies,
        )

    def attention_batch(
        self, seq_ids: list[str], q_lens: list[int], tenant: str = ""
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For queries at the last q_lens positions of each sequence: (lookup table, cache lengths,
        slots of the query positions)."""
        rows = self._rows(seq_ids, tenant)
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequest("seq_ids must be distinct")
        lens = self.lengths[rows]
        counts = np.asarray(q_lens, dtype=np.int64)
        too_long = np.nonzero(counts > lens)[0]
        if len(too_long):
            i = int(too_long[0])
            raise InvalidRequest(f"q_len {int(counts[i])} exceeds the length {int(lens[i])} of sequence {seq_ids[i]!r}")
        cache_lengths = lens - counts
        return self.lookup_table(rows), cache_lengths, self.slots_of(rows, cache_lengths, counts)

    def _extend(
        self,
        rows: np.ndarray,
        num_tokens: list[int],
        token_lists: list[list[int] | None],
        tenant: str,
        data_written: bool = False,
    ) -> Extension:
        size, n = self.page_size, len(rows)
        nt = np.array(num_tokens, dtype=np.int64)
        self._check_token_ids(num_tokens, token_lists)
        old_len = self.lengths[rows]
        new_len = old_len + nt
        old_np = self.num_pages[rows]
        new_np = -(-new_len // size)
        grow = new_np - old_np
        cow = self._plan_copy_on_write(rows, old_len, old_np)
        num_grow = int(grow.sum())
        self._check_quota(tenant, num_grow)
        needed = num_grow + len(cow)
        if needed > self.allocator.num_available:
            self.stats.allocation_failures += 1
            raise OutOfPages(needed, self.allocator.num_available)
        if n:
            self._ensure_width(int(new_np.max()))
        # All checks passed: from here on nothing can fail.
        self._commit_pending(rows, old_len)  # earlier appends are written by now
        pages = self.allocator.allocate(needed)
        copies: list[tuple[int, int]] = []
        if cow:
            cow_rows, cols = rows[cow], old_np[cow] - 1
            src = self.tables[cow_rows, cols].astype(np.int64)
            self.tables[cow_rows, cols] = pages[: len(cow)]
            copies = list(zip(src.tolist(), pages[: len(cow)].tolist()))
            for page in src.tolist():  # one by one: two sequences may drop the same page
                self.allocator.release(np.array([page], dtype=np.int64))
        if num_grow:
            new_pages = pages[len(cow) :]
            if n == 1:
                self.tables[rows[0], old_np[0] : new_np[0]] = new_pages
            else:
                g_idx = np.nonzero(grow)[0]
                g_cnt = grow[g_idx]
                seq_of = np.repeat(g_idx, g_cnt)
                within = np.arange(num_grow) - np.repeat(np.cumsum(g_cnt) - g_cnt, g_cnt)
                self.tables[rows[seq_of], old_np[seq_of] + within] = new_pages
        self.lengths[rows] = new_len
        self.num_pages[rows] = new_np
        self._tenant_pages[tenant] = self._tenant_pages.get(tenant, 0) + num_grow
        self.stats.tokens_appended += int(nt.sum())
        slots = self.slots_of(rows, old_len, nt)
        # (list.count runs in C: a decode step of hundreds of sequences mostly carries no token ids.)
        if token_lists.count(None) != n or self.tokens_known[rows].any():
            self._record_tokens(rows.tolist(), token_lists)
        if data_written:
            self._commit_pending(rows, new_len)
        return Extension(slots=slots, offsets=[0, *np.cumsum(nt).tolist()], copies=copies)

    def _extend_one(
        self, seq: Sequence, count: int, toks: list[int] | None, tenant: str, data_written: bool
    ) -> Extension:
        """_extend() for one sequence in scalar arithmetic: numpy calls on 1-element arrays cost
        about as much as the whole of a prompt's append, so the common case skips them."""
        self._check_token_ids([count], [toks])
        row, size, alloc = seq.row, self.page_size, self.allocator
        old_len, old_np = int(self.lengths[row]), int(self.num_pages[row])
        new_len = old_len + count
        new_np = -(-new_len // size)
        grow = new_np - old_np
        cow = old_len % size != 0 and bool(alloc.ref_count[self.tables[row, old_np - 1]] > 1)
        self._check_quota(tenant, grow)
        if grow + cow > alloc.num_available:
            self.stats.allocation_failures += 1
            raise OutOfPages(grow + cow, alloc.num_available)
        self._ensure_width(new_np)
        # All checks passed: from here on nothing can fail.
        if alloc.enable_prefix_caching and old_len >= (int(self.num_hashed[row]) + 1) * size:
            self._commit_upto(seq, old_len // size)  # earlier appends are written by now
        pages = alloc.allocate(grow + cow)
        copies = []
        if cow:
            src = int(self.tables[row, old_np - 1])
            self.tables[row, old_np - 1] = pages[0]
            copies.append((src, int(pages[0])))
            alloc.release(np.array([src], dtype=np.int64))
        if grow:
            self.tables[row, old_np:new_np] = pages[int(cow) :]
        self.lengths[row], self.num_pages[row] = new_len, new_np
        self._tenant_pages[tenant] = self._tenant_pages.get(tenant, 0) + grow
        self.stats.tokens_appended += count
        first = old_len // size
        span = self.tables[row, first:new_np].astype(np.int64) * size
        offset = old_len - first * size
        slots = (span[:, None] + self._page_offsets).reshape(-1)[offset : offset + count]
        self._record_tokens([row], [toks])
        if data_written:
            self._commit_upto(seq, new_len // size)
        return Extension(slots=slots, offsets=[0, count], copies=copies)

    def _plan_copy_on_write(self, rows: np.ndarray, old_len: np.ndarray, old_np: np.ndarray) -> list[int]:
        """Indices of the sequences whose partial last page is shared and must be copied first.

        When every holder of a shared page appends in the same step, the last one keeps it.
        """
        partial = np.nonzero(old_len % self.page_size)[0]
        if len(partial) == 0:
            return []
        last = self.tables[rows[partial], old_np[partial] - 1].astype(np.int64)
        shared = self.allocator.ref_count[last] > 1
        if not shared.any():
            return []
        copies_left: dict[int, int] = {}
        cow: list[int] = []
        for i, page in zip(partial[shared].tolist(), last[shared].tolist()):
            left = copies_left.setdefault(page, int(self.allocator.ref_count[page]))
            if left > 1:
                cow.append(i)
                copies_left[page] = left - 1
        return cow

    # -- prefix hashing -----------------------------------------------------------------------
    @staticmethod
    def _check_token_ids(num_tokens: list[int], token_lists: list[list[int] | None]) -> None:
        if num_tokens and min(num_tokens) < 1:
            raise InvalidRequest("num_tokens must be >= 1")
        if token_lists.count(None) == len(token_lists):
            return
        for count, toks in zip(num_tokens, token_lists):
            if toks is not None and len(toks) != count:
                raise InvalidRequest(f"token_ids has {len(toks)} ids for num_tokens={count}")

    def _record_tokens(self, rows: list[int], token_lists: list[list[int] | None]) -> None:
        for row, toks in zip(rows, token_lists):
            seq = self._seq_of_row[row]
            assert seq is not None
            if toks is None:
                self.tokens_known[row] = False
                seq.tokens = None
            elif seq.tokens is not None:
                seq.tokens.frombytes(token_bytes(toks))  # 4x faster than extend() on a list

    def _commit_pending(self, rows: np.ndarray, written: np.ndarray) -> None:
        """Enter into the prefix cache every full page below `written` tokens not yet hashed."""
        if not self.allocator.enable_prefix_caching or len(rows) == 0:
            return
        full = written // self.page_size
        todo = np.nonzero(self.tokens_known[rows] & (full > self.num_hashed[rows]))[0]
        for i in todo.tolist():
            self._commit_upto(self._seq_of_row[int(rows[i])], int(full[i]))  # type: ignore[arg-type]

    def _commit_upto(self, seq: Sequence, num_full: int) -> None:
        row = seq.row
        start = int(self.num_hashed[row])
        if not self.allocator.enable_prefix_caching or seq.tokens is None or num_full <= start:
            return
        size = self.page_size
        data = int64_bytes(seq.tokens[start * size : num_full * size])
        pages = self.tables[row, start:num_full].tolist()
        seq.last_hash = self.allocator.commit(pages, seq.last_hash, data, size * 8)
        self.num_hashed[row] = num_full

    def _check_quota(self, tenant: str, more: int) -> None:
        limit, held = self.max_pages_per_tenant, self._tenant_pages.get(tenant, 0)
        if limit and more > 0 and held + more > limit:
            raise QuotaExceeded(f"tenant {tenant!r} holds {held} pages; {more} more would pass its quota of {limit}")

    # -- leases -------------------------------------------------------------------------------
    def expire(self, now: float) -> list[tuple[str, str]]:
        """Free, through free(), every leased sequence whose lease ran out by `now` (on self.clock);
        returns their (tenant, seq_id) in no particular order.

        Renewal is one clock read and one float store per leased sequence named by a call (none at
        all while no sequence has a lease); finding the expired ones is a scan here instead, one
        comparison per live sequence, run by the sweeper about once a second (~60 µs per 1,000
        sequences, measured). A heap would make every renewal a push on the hot path to speed up
        the once-a-second path.
        """
        if not self._num_leased:
            return []
        expired = [s for s in self.sequences() if s.ttl_s and s.expires_at <= now]
        for seq in expired:
            self.free(seq.seq_id, seq.tenant)
        self.stats.sequences_expired += len(expired)
        return [(s.tenant, s.seq_id) for s in expired]

    def expires_in(self, seq: Sequence, now: float) -> float | None:
        """Seconds left on the lease of `seq` at `now` (None: no lease)."""
        return max(0.0, seq.expires_at - now) if seq.ttl_s else None
