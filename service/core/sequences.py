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

import numpy as np

from service.core import batching
from service.core.allocator import PageAllocator
from service.core.appends import AppendingTables, checked_token_bytes
from service.core.errors import InvalidRequest, SequenceExists, SequenceNotFound
from service.core.hashing import root_hash
from service.core.records import Append, Extension, Sequence, Stats, StepResult

__all__ = ["Sequence", "SequenceTable", "Stats", "StepResult"]


class SequenceTable(AppendingTables):
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
        self,
        seq_id: str | None = None,
        token_ids: list[int] | None = None,
        tenant: str = "",
        ttl_s: float = 0.0,
        cache_salt: str = "",
    ) -> Sequence:
        """A new sequence; with token_ids, it starts on the longest cached run of full pages.

        ttl_s > 0 gives it a lease: expire() frees it once ttl_s seconds pass without a call naming it.
        cache_salt (e.g. vLLM's per-request cache_salt) salts the sequence's prefix hashes like the
        tenant does: sequences with different salts never share pages.
        """
        if not (math.isfinite(ttl_s) and ttl_s >= 0):
            raise InvalidRequest(f"ttl_s must be a finite number >= 0, not {ttl_s}")
        seq_id = self._new_id(seq_id, tenant)
        hits, last_hash, data = self._match_prefix(token_ids or [], tenant, cache_salt)
        self._check_quota(tenant, len(hits))
        row = self._take_row()  # no pages, length 0
        num_cached = len(hits) * self.page_size
        tokens = array("q")
        if hits:
            self.allocator.acquire_cached(hits)
            self.tables[row, : len(hits)] = hits
            self.lengths[row] = num_cached
            self.num_pages[row] = self.num_hashed[row] = len(hits)
            tokens.frombytes(data[: num_cached * 8])  # little-endian int64, as array("q") is here
        self.tokens_known[row] = True
        seq = Sequence(seq_id, tenant, row, tokens, last_hash, num_cached, ttl_s, self.clock() + ttl_s)
        self._add(seq, len(hits))
        if token_ids:
            self.stats.prefix_query_tokens += len(token_ids)
            self.stats.prefix_hit_tokens += num_cached
        return seq

    def _match_prefix(self, token_ids: list[int], tenant: str, cache_salt: str = "") -> tuple[list[int], bytes, bytes]:
        """(cached pages starting the prompt, hash of the last one, the token bytes of at least those)."""
        if cache_salt:  # not memoised: salts are per request, the memo would grow without bound
            root = root_hash(tenant, cache_salt)
        else:
            root = self._roots.get(tenant) or self._roots.setdefault(tenant, root_hash(tenant))
        max_hits = (len(token_ids) - 1) // self.page_size  # never cover the last prompt token
        if not self.allocator.enable_prefix_caching or max_hits <= 0:
            return [], root, b""
        # Convert the first page alone: most prompts miss there, and then the rest needs no bytes.
        size, nbytes = self.page_size, self.page_size * 8
        data = checked_token_bytes(token_ids[:size])
        pages, last = self.allocator.match(root, data, nbytes)
        if pages and max_hits > 1:
            rest = checked_token_bytes(token_ids[size : max_hits * size])
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
        if seq.tokens is not None and self.allocator.enable_prefix_caching:
            self._commit_upto(seq, int(self.lengths[row]) // self.page_size)
        num = int(self.num_pages[row])
        freed = self.allocator.release(self.tables[row, :num][::-1])  # tail first
        self._release_row(row, num)
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
        # Leases renew on every call naming a sequence: _rows() does that; without any, one C pass.
        columns = None if self._num_leased else batching.unzip_appends(self._by_tenant.get(tenant, {}), appends)
        if columns is None:
            ids, counts, token_lists = (list(c) for c in zip(*appends)) if appends else ([], [], [])
            rows, distinct = self._rows(ids, tenant), len(set(ids)) == len(ids)
        else:
            ids, counts, token_lists, raw_rows, distinct = columns
            rows = np.frombuffer(raw_rows, dtype=np.int64)
        if not distinct:
            raise InvalidRequest("a sequence may appear only once in the appends of a step")
        listed = rows if seq_ids is None else self._rows(seq_ids, tenant)
        before = self.lengths[listed].astype(np.uint32)
        ext = self._extend(rows, counts, token_lists, tenant)
        if seq_ids is None:
            input_lengths, new_slots = counts, ext.slots
        else:
            # Pages written before this step only: the data of the pages appended now comes after it.
            self._commit_pending(listed, before)
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
            lookup_table=self.lookup_table(listed),
            cache_lengths=before,
            input_lengths=input_lengths,
            new_slots=new_slots,
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
