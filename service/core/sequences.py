"""Sequences and their block tables, on top of the page allocator.

Block tables live in one uint32 matrix `tables[row, col]` (one row per live sequence), filled with
the sentinel past each sequence's last page, so a lookup table for a batch is a single gather of
rows. Lengths, page counts and hashing progress are numpy arrays indexed by row, so a decode step
over hundreds of sequences costs a handful of vector operations, not a Python loop per page.

Every public operation checks everything first and changes nothing when a check fails.
"""

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from service.core.allocator import PageAllocator
from service.core.errors import InvalidRequest, OutOfPages, QuotaExceeded, SequenceExists, SequenceNotFound
from service.core.hashing import page_hash, root_hash, token_bytes
from service.core.layout import lut_columns
from service.core.lut import lookup_table, token_slots


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    tenant: str
    row: int
    tokens: list[int] | None  # None once an append came without token ids: no more hashing
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


class SequenceTable:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_pages_per_tenant: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.allocator = allocator
        self.clock = clock  # leases: expires_at is on this clock
        self.page_size = page_size
        self.sentinel = allocator.num_pages
        self.max_pages_per_tenant = max_pages_per_tenant
        self.stats = Stats()
        self._seqs: dict[tuple[str, str], Sequence] = {}
        self._tenant_pages: dict[str, int] = {}
        self._roots: dict[str, bytes] = {}
        cap, width = 16, lut_columns(16)
        self._free_rows: list[int] = list(range(cap - 1, -1, -1))
        self.tables = np.full((cap, width), self.sentinel, dtype=np.uint32)
        self.lengths = np.zeros(cap, dtype=np.int64)
        self.num_pages = np.zeros(cap, dtype=np.int64)
        self.num_hashed = np.zeros(cap, dtype=np.int64)
        self.tokens_known = np.zeros(cap, dtype=np.bool_)

    # -- lookups ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._seqs)

    def get(self, seq_id: str, tenant: str = "") -> Sequence:
        try:
            seq = self._seqs[(tenant, seq_id)]
        except KeyError:
            raise SequenceNotFound(seq_id) from None
        if seq.ttl_s:  # every call naming a sequence renews its lease (see expire())
            seq.expires_at = self.clock() + seq.ttl_s
        return seq

    def sequences(self) -> list[Sequence]:
        return list(self._seqs.values())

    def length(self, seq: Sequence) -> int:
        return int(self.lengths[seq.row])

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.row, : self.num_pages[seq.row]].tolist()

    def tenant_pages(self, tenant: str) -> int:
        return self._tenant_pages.get(tenant, 0)

    def tokens_stored(self) -> int:
        rows = [s.row for s in self._seqs.values()]
        return int(self.lengths[rows].sum()) if rows else 0

    # -- create / fork / free -----------------------------------------------------------------
    def create(
        self, seq_id: str | None = None, token_ids: list[int] | None = None, tenant: str = "", ttl_s: float = 0.0
    ) -> Sequence:
        """A new sequence; with token_ids, it starts on the longest cached run of full pages.

        ttl_s > 0 gives it a lease: expire() frees it once ttl_s seconds pass without a call naming it.
        """
        if not (math.isfinite(ttl_s) and ttl_s >= 0):
            raise InvalidRequest(f"ttl_s must be a finite number >= 0, not {ttl_s}")
        if seq_id is None:
            seq_id = uuid.uuid4().hex
        elif (tenant, seq_id) in self._seqs:
            raise SequenceExists(seq_id)
        hits, last_hash = self._lookup_prefix(token_ids or [], tenant)
        self._check_quota(tenant, len(hits))
        row = self._take_row()
        self.allocator.acquire_cached(hits)
        num_cached = len(hits) * self.page_size
        self.tables[row, : len(hits)] = hits
        self.lengths[row] = num_cached
        self.num_pages[row] = len(hits)
        self.num_hashed[row] = len(hits)
        self.tokens_known[row] = True
        seq = Sequence(seq_id, tenant, row, list(token_ids[:num_cached]) if token_ids else [], last_hash, num_cached)
        seq.ttl_s, seq.expires_at = ttl_s, self.clock() + ttl_s
        self._seqs[(tenant, seq_id)] = seq
        self._add_tenant_pages(tenant, len(hits))
        if token_ids:
            self.stats.prefix_query_tokens += len(token_ids)
            self.stats.prefix_hit_tokens += num_cached
        return seq

    def _lookup_prefix(self, token_ids: list[int], tenant: str) -> tuple[list[int], bytes]:
        root = self._root(tenant)
        max_hits = (len(token_ids) - 1) // self.page_size  # never cover the last prompt token
        if not self.allocator.enable_prefix_caching or max_hits <= 0:
            return [], root
        data = token_bytes(token_ids[: max_hits * self.page_size])
        step = self.page_size * 8
        hits: list[int] = []
        parent = root
        lookup = self.allocator.lookup
        for start in range(0, len(data), step):
            chunk = data[start : start + step]
            h = page_hash(parent, chunk)
            page = lookup(h, chunk)
            if page is None:
                break
            hits.append(page)
            parent = h
        return hits, parent

    def fork(self, parent_id: str, child_id: str | None = None, tenant: str = "") -> Sequence:
        """A new sequence sharing every page of the parent (copy-on-write of a partial last page)."""
        parent = self.get(parent_id, tenant)
        if child_id is None:
            child_id = uuid.uuid4().hex
        elif (tenant, child_id) in self._seqs:
            raise SequenceExists(child_id)
        num = int(self.num_pages[parent.row])
        self._check_quota(tenant, num)
        row = self._take_row()
        src = parent.row
        self.tables[row] = self.tables[src]
        for arr in (self.lengths, self.num_pages, self.num_hashed, self.tokens_known):
            arr[row] = arr[src]
        self.allocator.retain(self.tables[row, :num].astype(np.int64))
        tokens = list(parent.tokens) if parent.tokens is not None else None
        child = Sequence(child_id, tenant, row, tokens, parent.last_hash, parent.cached_tokens)
        child.ttl_s, child.expires_at = parent.ttl_s, parent.expires_at  # the lease is inherited, just renewed
        self._seqs[(tenant, child_id)] = child
        self._add_tenant_pages(tenant, num)
        return child

    def free(self, seq_id: str, tenant: str = "") -> int:
        """Release a sequence; returns how many of its pages became unreferenced."""
        seq = self.get(seq_id, tenant)
        row = seq.row
        self._commit_upto(seq, int(self.lengths[row]) // self.page_size)
        num = int(self.num_pages[row])
        pages = self.tables[row, :num][::-1].astype(np.int64)  # tail first: evicted first
        freed = self.allocator.release(pages)
        self.tables[row, :num] = self.sentinel
        self.lengths[row] = self.num_pages[row] = self.num_hashed[row] = 0
        self._free_rows.append(row)
        del self._seqs[(tenant, seq_id)]
        self._add_tenant_pages(tenant, -num)
        return freed

    # -- append / step ------------------------------------------------------------------------
    def append(
        self,
        seq_id: str,
        num_tokens: int,
        token_ids: list[int] | None = None,
        data_written: bool = False,
        tenant: str = "",
    ) -> tuple[Sequence, Extension]:
        seq = self.get(seq_id, tenant)
        ext = self._extend([seq], [num_tokens], [token_ids], tenant, data_written)
        return seq, ext

    def step(
        self,
        appends: list[tuple[str, int, list[int] | None]],
        seq_ids: list[str] | None = None,
        tenant: str = "",
    ) -> StepResult:
        """All appends or none, then the lookup table of `seq_ids` (default: the appended ones)."""
        seqs = [self.get(a[0], tenant) for a in appends]
        if len({id(s) for s in seqs}) != len(seqs):
            raise InvalidRequest("a sequence may appear only once in the appends of a step")
        if seq_ids is None:
            listed = seqs
        else:
            listed = [self.get(s, tenant) for s in seq_ids]
        rows = np.fromiter((s.row for s in listed), dtype=np.int64, count=len(listed))
        before = self.lengths[rows]
        ext = self._extend(seqs, [a[1] for a in appends], [a[2] for a in appends], tenant)
        if seq_ids is None:
            input_lengths = [a[1] for a in appends]
            flat = ext.slots.tolist()
            offs = ext.offsets
            slots = [flat[offs[i] : offs[i + 1]] for i in range(len(seqs))]
        else:
            self._commit_pending(rows, self.lengths[rows], listed)
            index = {id(s): i for i, s in enumerate(seqs)}
            flat = ext.slots.tolist()
            input_lengths, slots = [], []
            for s in listed:
                i = index.get(id(s))
                if i is None:
                    input_lengths.append(0)
                    slots.append([])
                else:
                    input_lengths.append(appends[i][1])
                    slots.append(flat[ext.offsets[i] : ext.offsets[i + 1]])
        return StepResult(
            seq_ids=[s.seq_id for s in listed],
            lookup_table=self.lookup_table(rows),
            cache_lengths=before.astype(np.uint32),
            input_lengths=input_lengths,
            slots=slots,
            copies=ext.copies,
        )

    def lookup_table(self, rows: np.ndarray) -> np.ndarray:
        return lookup_table(self.tables, self.num_pages, rows)

    def attention_batch(
        self, seq_ids: list[str], q_lens: list[int], tenant: str = ""
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For queries at the last q_lens positions of each sequence: (lookup table, cache lengths,
        slots of the query positions)."""
        seqs = [self.get(s, tenant) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequest("seq_ids must be distinct")
        rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=len(seqs))
        lens = self.lengths[rows]
        counts = np.asarray(q_lens, dtype=np.int64)
        too_long = np.nonzero(counts > lens)[0]
        if len(too_long):
            i = int(too_long[0])
            raise InvalidRequest(f"q_len {int(counts[i])} exceeds the length {int(lens[i])} of sequence {seq_ids[i]!r}")
        cache_lengths = lens - counts
        slots = token_slots(self.tables, rows, cache_lengths, counts, self.page_size)
        return self.lookup_table(rows), cache_lengths, slots

    def _extend(
        self,
        seqs: list[Sequence],
        num_tokens: list[int],
        token_lists: list[list[int] | None],
        tenant: str,
        data_written: bool = False,
    ) -> Extension:
        n, size = len(seqs), self.page_size
        nt = np.asarray(num_tokens, dtype=np.int64).reshape(n)
        if n and nt.min() < 1:
            raise InvalidRequest("num_tokens must be >= 1")
        for count, toks in zip(num_tokens, token_lists):
            if toks is not None and len(toks) != count:
                raise InvalidRequest(f"token_ids has {len(toks)} ids for num_tokens={count}")
        rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=n)
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
        self._commit_pending(rows, old_len, seqs)
        pages = self.allocator.allocate(needed)
        copies: list[tuple[int, int]] = []
        if cow:
            cow_idx = np.asarray(cow, dtype=np.int64)
            cols = old_np[cow_idx] - 1
            src = self.tables[rows[cow_idx], cols].astype(np.int64)
            self.tables[rows[cow_idx], cols] = pages[: len(cow)]
            for s, d in zip(src.tolist(), pages[: len(cow)].tolist()):
                copies.append((s, d))
                self.allocator.release(np.array([s], dtype=np.int64))
        if num_grow:
            g_idx = np.nonzero(grow)[0]
            g_cnt = grow[g_idx]
            seq_of = np.repeat(g_idx, g_cnt)
            within = np.arange(num_grow) - np.repeat(np.cumsum(g_cnt) - g_cnt, g_cnt)
            self.tables[rows[seq_of], old_np[seq_of] + within] = pages[len(cow) :]
        self.lengths[rows] = new_len
        self.num_pages[rows] = new_np
        self._add_tenant_pages(tenant, num_grow)
        self.stats.tokens_appended += int(nt.sum())
        slots = token_slots(self.tables, rows, old_len, nt, size)
        self._record_tokens(seqs, rows, token_lists)
        if data_written:
            self._commit_pending(rows, new_len, seqs)
        return Extension(slots=slots, offsets=[0, *np.cumsum(nt).tolist()], copies=copies)

    def _plan_copy_on_write(self, rows: np.ndarray, old_len: np.ndarray, old_np: np.ndarray) -> list[int]:
        """Indices of the sequences whose partial last page is shared and must be copied first.

        When every holder of a shared page appends in the same step, the last one keeps it.
        """
        partial = np.nonzero(old_len % self.page_size != 0)[0]
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
    def _record_tokens(self, seqs: list[Sequence], rows: np.ndarray, token_lists: list[list[int] | None]) -> None:
        for seq, toks in zip(seqs, token_lists):
            if toks is None:
                seq.tokens = None
            elif seq.tokens is not None:
                seq.tokens.extend(toks)
        if any(t is None for t in token_lists):
            self.tokens_known[rows] = np.fromiter((s.tokens is not None for s in seqs), np.bool_, len(seqs))

    def _commit_pending(self, rows: np.ndarray, written: np.ndarray, seqs: list[Sequence]) -> None:
        """Enter into the prefix cache every full page below `written` tokens not yet hashed."""
        if not self.allocator.enable_prefix_caching or len(rows) == 0:
            return
        full = written // self.page_size
        todo = np.nonzero(self.tokens_known[rows] & (full > self.num_hashed[rows]))[0]
        for i in todo.tolist():
            self._commit_upto(seqs[i], int(full[i]))

    def _commit_upto(self, seq: Sequence, num_full: int) -> None:
        row = seq.row
        start = int(self.num_hashed[row])
        if not self.allocator.enable_prefix_caching or seq.tokens is None or num_full <= start:
            return
        size = self.page_size
        data = token_bytes(seq.tokens[start * size : num_full * size])
        pages = self.tables[row, start:num_full].tolist()
        step = size * 8
        h = seq.last_hash
        for i, page in enumerate(pages):
            chunk = data[i * step : (i + 1) * step]
            h = page_hash(h, chunk)
            self.allocator.commit(page, h, chunk)
        seq.last_hash = h
        self.num_hashed[row] = num_full

    def _root(self, tenant: str) -> bytes:
        root = self._roots.get(tenant)
        if root is None:
            root = self._roots[tenant] = root_hash(tenant)
        return root

    # -- storage of rows ----------------------------------------------------------------------
    def _take_row(self) -> int:
        if not self._free_rows:
            old = len(self.lengths)
            self.tables = np.concatenate([self.tables, np.full_like(self.tables, self.sentinel)])
            for name in ("lengths", "num_pages", "num_hashed", "tokens_known"):
                arr = getattr(self, name)
                setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))
            self._free_rows.extend(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _ensure_width(self, max_pages: int) -> None:
        need = lut_columns(max_pages)
        width = self.tables.shape[1]
        if need <= width:
            return
        new_width = max(need, lut_columns(2 * (width - 16)))
        grown = np.full((self.tables.shape[0], new_width), self.sentinel, dtype=np.uint32)
        grown[:, :width] = self.tables
        self.tables = grown

    def _check_quota(self, tenant: str, more: int) -> None:
        limit = self.max_pages_per_tenant
        if limit and more > 0 and self._tenant_pages.get(tenant, 0) + more > limit:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {self._tenant_pages.get(tenant, 0)} pages; "
                f"{more} more would pass its quota of {limit}"
            )

    def _add_tenant_pages(self, tenant: str, delta: int) -> None:
        self._tenant_pages[tenant] = self._tenant_pages.get(tenant, 0) + delta

    # -- leases -------------------------------------------------------------------------------
    def expire(self, now: float) -> list[tuple[str, str]]:
        """Free, through free(), every leased sequence whose lease ran out by `now` (on self.clock);
        returns their (tenant, seq_id) in no particular order.

        Renewal is one clock read and one float store in get() (~0.3 µs a sequence, so ~80 µs on a
        256-sequence step), and only for leased sequences; finding the expired ones is a scan here
        instead, one comparison per live sequence, run by the sweeper about once a second (~60 µs
        per 1,000 sequences, measured). A heap would make every renewal a push (O(log n), and stale
        entries to skip) on the hot path to speed up the once-a-second path.
        """
        expired = [s for s in self._seqs.values() if s.ttl_s and s.expires_at <= now]
        for seq in expired:
            self.free(seq.seq_id, seq.tenant)
        self.stats.sequences_expired += len(expired)
        return [(s.tenant, s.seq_id) for s in expired]

    def expires_in(self, seq: Sequence, now: float) -> float | None:
        """Seconds left on the lease of `seq` at `now` (None: no lease)."""
        return max(0.0, seq.expires_at - now) if seq.ttl_s else None
