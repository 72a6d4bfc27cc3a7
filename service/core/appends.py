"""Growing block tables: the appends of one or many sequences, copy-on-write of shared partial
pages, and committing full written pages to the prefix cache.

SequenceTable builds on this; the checks come first in every path, so a failure changes nothing.
"""

import numpy as np

from service.core import batching
from service.core.allocator import PageAllocator
from service.core.block_tables import BlockTables
from service.core.errors import InvalidRequest, OutOfPages, QuotaExceeded
from service.core.hashing import token_bytes
from service.core.records import Extension, Sequence, Stats


def checked_token_bytes(token_ids: list[int]) -> bytes:
    """token_bytes(), with InvalidRequest for an id that is no int64."""
    try:
        return token_bytes(token_ids)
    except (OverflowError, TypeError) as exc:
        raise InvalidRequest(f"token ids must be int64 integers: {exc}") from None


class AppendingTables(BlockTables):
    # Set by SequenceTable.__init__.
    allocator: PageAllocator
    stats: Stats
    max_pages_per_tenant: int
    _tenant_pages: dict[str, int]
    _seq_of_row: list[Sequence | None]

    def _extend(
        self,
        rows: np.ndarray,
        num_tokens: list[int],
        token_lists: list[list[int] | None],
        tenant: str,
        data_written: bool = False,
    ) -> Extension:
        size, n = self.page_size, len(rows)
        token_data = self._token_data(num_tokens, token_lists)
        if n > 1 and num_tokens.count(1) == n:  # a decode step
            ext = self._extend_decode(rows, token_data, tenant, data_written)
            if ext is not None:
                return ext
        nt = np.array(num_tokens, dtype=np.int64)
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
        if token_data.count(None) != n or self.tokens_known[rows].any():
            self._record_tokens(rows.tolist(), token_data)
        if data_written:
            self._commit_pending(rows, new_len)
        return Extension(slots=slots, offsets=[0, *np.cumsum(nt).tolist()], copies=copies)

    def _extend_decode(
        self, rows: np.ndarray, token_data: list[bytes | None], tenant: str, data_written: bool
    ) -> Extension | None:
        """_extend() of one token for each of many sequences in a third of the vector operations:
        the new position's page is known up front. None, having changed nothing, when a sequence's
        partial last page is shared (copy-on-write): the general path handles that."""
        size, alloc, n, width = self.page_size, self.allocator, len(rows), self.tables.shape[1]
        plan = batching.decode_plan(self.tables, width, self.lengths, alloc.ref_count, rows, size)
        if plan is None:
            return None
        num_grow, most_pages = plan
        self._check_quota(tenant, num_grow)
        if num_grow > alloc.num_available:
            self.stats.allocation_failures += 1
            raise OutOfPages(num_grow, alloc.num_available)
        self._ensure_width(most_pages)
        # All checks passed: from here on nothing can fail.
        known = self.tokens_known[rows]  # before this append: a decode step without ids has none
        if known.any():
            self._commit_pending(rows, self.lengths[rows])  # earlier appends are written by now
        new_pages = alloc.allocate(num_grow)
        slots = np.empty(n, dtype=np.int64)
        batching.decode_apply(  # tables.shape[1] again: _ensure_width may have widened the table
            self.tables, self.tables.shape[1], self.lengths, self.num_pages, rows, new_pages, size, slots
        )
        self._tenant_pages[tenant] = self._tenant_pages.get(tenant, 0) + num_grow
        self.stats.tokens_appended += n
        if token_data.count(None) != n or known.any():
            self._record_tokens(rows.tolist(), token_data)
        if data_written:
            self._commit_pending(rows, self.lengths[rows])
        return Extension(slots=slots, offsets=range(n + 1), copies=[])

    def _extend_one(
        self, seq: Sequence, count: int, toks: list[int] | None, tenant: str, data_written: bool
    ) -> Extension:
        """_extend() for one sequence in scalar arithmetic: numpy calls on 1-element arrays cost
        about as much as the whole of a prompt's append, so the common case skips them."""
        data = self._checked_data(count, toks)
        row, size, alloc = seq.row, self.page_size, self.allocator
        old_len, old_np = int(self.lengths[row]), int(self.num_pages[row])
        new_len = old_len + count
        new_np = -(-new_len // size)
        grow = new_np - old_np
        cow = old_len % size != 0 and bool(alloc.ref_count[self.tables[row, old_np - 1]] > 1)
        self._check_quota(tenant, grow)
        if grow + cow > alloc.num_free + alloc.num_cached:
            self.stats.allocation_failures += 1
            raise OutOfPages(grow + cow, alloc.num_available)
        self._ensure_width(new_np)
        # All checks passed: from here on nothing can fail.
        if alloc.enable_prefix_caching and old_len >= (int(self.num_hashed[row]) + 1) * size:
            self._commit_upto(seq, old_len // size)  # earlier appends are written by now
        copies = []
        if cow:
            pages = alloc.allocate(grow + 1)
            src = int(self.tables[row, old_np - 1])
            self.tables[row, old_np - 1] = pages[0]
            copies.append((src, int(pages[0])))
            alloc.release(np.array([src], dtype=np.int64))
            self.tables[row, old_np:new_np] = pages[1:]
        else:  # straight into the block table
            alloc.allocate_into(self.tables[row, old_np:new_np])
        self.lengths[row], self.num_pages[row] = new_len, new_np
        self._tenant_pages[tenant] = self._tenant_pages.get(tenant, 0) + grow
        self.stats.tokens_appended += count
        slots = self.row_slots(row, old_len, count)
        self._record_one(seq, data)
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
    def _token_data(num_tokens: list[int], token_lists: list[list[int] | None]) -> list[bytes | None]:
        """Each append's token ids as int64 bytes (None where it has none), after checking them:
        converted before anything changes, so a bad id fails the whole call."""
        if token_lists.count(None) == len(token_lists):  # (list.count runs in C)
            if num_tokens:
                AppendingTables._check_count(min(num_tokens))
            return list(token_lists)  # type: ignore[arg-type]  # all None
        return [AppendingTables._checked_data(count, toks) for count, toks in zip(num_tokens, token_lists)]

    @staticmethod
    def _check_count(count: int) -> None:
        if count < 1:
            raise InvalidRequest("num_tokens must be >= 1")

    @staticmethod
    def _checked_data(count: int, toks: list[int] | None) -> bytes | None:
        """One append's token ids as int64 bytes (None if it has none), or InvalidRequest."""
        AppendingTables._check_count(count)
        if toks is None:
            return None
        if len(toks) != count:
            raise InvalidRequest(f"token_ids has {len(toks)} ids for num_tokens={count}")
        return checked_token_bytes(toks)

    def _record_tokens(self, rows: list[int], token_data: list[bytes | None]) -> None:
        for row, data in zip(rows, token_data):
            seq = self._seq_of_row[row]
            assert seq is not None
            self._record_one(seq, data)

    def _record_one(self, seq: Sequence, data: bytes | None) -> None:
        """Keep the appended token ids (int64 bytes); None: they are unknown from now on."""
        if data is None:
            self.tokens_known[seq.row] = False
            seq.tokens = None
        elif seq.tokens is not None:
            seq.tokens.frombytes(data)

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
        pages = self.tables[row, start:num_full].astype(np.int64)
        # A view, not a copy; released at once, since an array exporting a buffer cannot grow.
        with memoryview(seq.tokens) as ids, ids.cast("B") as data:
            seq.last_hash = self.allocator.commit(
                pages, seq.last_hash, data[start * size * 8 : num_full * size * 8], size * 8
            )
        self.num_hashed[row] = num_full

    def _check_quota(self, tenant: str, more: int) -> None:
        limit, held = self.max_pages_per_tenant, self._tenant_pages.get(tenant, 0)
        if limit and more > 0 and held + more > limit:
            raise QuotaExceeded(f"tenant {tenant!r} holds {held} pages; {more} more would pass its quota of {limit}")
