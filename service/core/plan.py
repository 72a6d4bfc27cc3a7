"""Plan, then apply: what an append or a new sequence will take, worked out before anything changes.

A plan says which rows grow by how many tokens, how many pages that opens, which shared partial
last pages are copied first (copy-on-write), how many pages the allocator hands out and how many of
those it must evict from the prefix cache, and how many pages the tenant holds more afterwards.
The plan_*() functions read the block tables and the allocator and change nothing;
SequenceTable.check() holds a plan against the quota and the pages available, and
SequenceTable.apply() carries it out, which cannot fail; the page work of apply is the place()
method of each shape of change.

Four shapes of change, so that each common case costs only what it must:
  OneRow   one row grows (a prompt, or one sequence's append): scalar arithmetic, since numpy
           calls on 1-element arrays cost about as much as the whole append;
  Decode   one token on each of several rows, none copying a page: the new position's page is
           known up front (batching.decode_plan / decode_apply), a third of the vector work;
  Rows     several rows grow, any way;
  NewRow   a new row starts on pages it shares with others: its parent's (a fork) or cached
           pages of a prefix hit (a create).
Copy-on-write: when every holder of a shared partial page appends in the same step, the last one
keeps it; the others copy it, in the order of the rows.
"""

from dataclasses import dataclass

import numpy as np

from service.core import batching
from service.core.allocator import PageAllocator
from service.core.block_tables import BlockTables
from service.core.errors import InvalidRequest
from service.core.hashing import token_bytes
from service.core.records import Extension, Sequence, TokenIds

NO_PAGES = np.empty(0, dtype=np.int64)
NOTHING_APPENDED = Extension(NO_PAGES, (0,), [])  # what a NewRow's place() returns (shared: read only)


# Each change's place() allocates its pages into the block tables (copies first) and grows its rows.
# It cannot fail: SequenceTable.check() held the plan against the pages available, and apply()
# made the tables wide enough. It returns the new slots (none for a NewRow).


@dataclass(slots=True, eq=False)
class OneRow:
    row: int
    old_len: int
    count: int
    old_pages: int
    new_pages: int
    copy: bool  # the shared partial last page is copied first
    data: bytes | None  # the token ids as int64 bytes; None: unknown

    def place(self, num_new: int, blocks: BlockTables, alloc: PageAllocator) -> Extension:
        row, old_pages, new_pages = self.row, self.old_pages, self.new_pages
        copies = []
        if self.copy:
            pages = alloc.allocate(num_new)
            src = int(blocks.tables[row, old_pages - 1])
            blocks.tables[row, old_pages - 1] = pages[0]
            copies.append((src, int(pages[0])))
            alloc.release(np.array([src], dtype=np.int64))
            blocks.tables[row, old_pages:new_pages] = pages[1:]
        else:  # straight into the block table
            alloc.allocate_into(blocks.tables[row, old_pages:new_pages])
        blocks.lengths[row], blocks.num_pages[row] = self.old_len + self.count, new_pages
        # The pages the tokens land on as they are now (a later copy-on-write may change the row), as
        # uint32 bytes: cheaper to take than an array copy.
        first = self.old_len // blocks.page_size
        landed = blocks.tables[row, first:new_pages].tobytes()
        return Extension(None, (0, self.count), copies, landed, self.old_len % blocks.page_size, blocks.page_size)


@dataclass(slots=True, eq=False)
class Decode:
    rows: np.ndarray  # int64 [n], distinct
    token_data: list[bytes | None]  # [n]
    known: np.ndarray | None  # bool [n]: the rows whose token ids are known so far; None if none is

    def place(self, num_new: int, blocks: BlockTables, alloc: PageAllocator) -> Extension:
        rows, tables = self.rows, blocks.tables
        slots = np.empty(len(rows), dtype=np.int64)
        new = alloc.allocate(num_new)  # for the rows whose length is a multiple of the page size
        batching.decode_apply(
            tables, tables.shape[1], blocks.lengths, blocks.num_pages, rows, new, blocks.page_size, slots
        )
        return Extension(slots, range(len(rows) + 1), [])


@dataclass(slots=True, eq=False)
class Rows:
    rows: np.ndarray  # int64 [n], distinct
    token_data: list[bytes | None]  # [n]
    known: np.ndarray | None  # bool [n]: the rows whose token ids are known so far; None if none is
    counts: np.ndarray  # int64 [n], tokens appended to each
    old_len: np.ndarray  # int64 [n]
    old_pages: np.ndarray  # int64 [n]
    new_pages: np.ndarray  # int64 [n]
    copies: list[int]  # indices into rows of those that copy their shared partial last page, in order

    def place(self, num_new: int, blocks: BlockTables, alloc: PageAllocator) -> Extension:
        rows, old_pages, cow = self.rows, self.old_pages, self.copies
        pages = alloc.allocate(num_new)  # the copies' pages first, then the grown ones in row order
        copies: list[tuple[int, int]] = []
        if cow:
            cow_rows, cols = rows[cow], old_pages[cow] - 1
            src = blocks.tables[cow_rows, cols].astype(np.int64)
            blocks.tables[cow_rows, cols] = pages[: len(cow)]
            copies = list(zip(src.tolist(), pages[: len(cow)].tolist()))
            for page in src.tolist():  # one by one: two rows may drop the same page
                alloc.release(np.array([page], dtype=np.int64))
        num_grow = num_new - len(cow)
        if num_grow:
            grow = self.new_pages - old_pages
            g_idx = np.nonzero(grow)[0]
            g_cnt = grow[g_idx]
            seq_of = np.repeat(g_idx, g_cnt)
            within = np.arange(num_grow) - np.repeat(np.cumsum(g_cnt) - g_cnt, g_cnt)
            blocks.tables[rows[seq_of], old_pages[seq_of] + within] = pages[len(cow) :]
        blocks.lengths[rows] = self.old_len + self.counts
        blocks.num_pages[rows] = self.new_pages
        slots = blocks.slots_of(rows, self.old_len, self.counts)
        return Extension(slots, [0, *np.cumsum(self.counts).tolist()], copies)


@dataclass(slots=True, eq=False)
class NewRow:
    seq: Sequence  # the new sequence's record; place() gives it its row
    pages: np.ndarray | list[int]  # int64 [k]: the pages it starts on, shared (a list for prefix hits)
    from_cache: bool  # prefix hits: some pages may be cached (unreferenced) rather than used
    length: int
    num_hashed: int
    tokens_known: bool

    def place(self, num_new: int, blocks: BlockTables, alloc: PageAllocator) -> Extension:
        row = self.seq.row = blocks.take_row()
        pages, num = self.pages, len(self.pages)
        if num:  # (a row taken is empty but for tokens_known)
            if self.from_cache:
                alloc.acquire_cached(pages, blocks.tables[row, :num])  # type: ignore[arg-type]  # a list
            else:
                alloc.retain(pages)  # type: ignore[arg-type]  # an array
                blocks.tables[row, :num] = pages
            blocks.lengths[row], blocks.num_pages[row], blocks.num_hashed[row] = self.length, num, self.num_hashed
        blocks.tokens_known[row] = self.tokens_known
        return NOTHING_APPENDED


@dataclass(slots=True, eq=False)
class Plan:
    """Everything an operation takes: made by a plan_*() function, stamped by SequenceTable.check(),
    carried out by SequenceTable.apply()."""

    tenant: str
    change: OneRow | Decode | Rows | NewRow
    num_held: int  # pages the tenant holds more afterwards, grown plus shared: the quota's measure
    num_new: int  # pages the allocator hands out: grown plus copies
    copy_sources: list[int]  # the shared pages copied, in the order of Extension.copies
    num_tokens: int  # tokens appended
    most_pages: int  # pages in the longest block table it grows (the width the tables need)
    # Set by SequenceTable.check(), which holds the plan against the allocator and the quota:
    num_evictions: int = 0  # of the new pages, how many come out of the prefix cache (free ones go first)
    generation: int = -1  # the table's change count then: a plan applies to that state only


def plan_one(blocks: BlockTables, alloc: PageAllocator, row: int, count: int, data: bytes | None, tenant: str) -> Plan:
    """`count` tokens more on `row` (data: their checked int64 bytes, or None)."""
    size = blocks.page_size
    old_len, old_pages = blocks.lengths.item(row), blocks.num_pages.item(row)  # (item(): a Python int at once)
    new_pages = -(-(old_len + count) // size)
    grow = new_pages - old_pages
    copy = old_len % size != 0 and bool(alloc.ref_count[blocks.tables[row, old_pages - 1]] > 1)
    sources = [int(blocks.tables[row, old_pages - 1])] if copy else []
    change = OneRow(row, old_len, count, old_pages, new_pages, copy, data)
    return Plan(tenant, change, grow, grow + copy, sources, count, new_pages)


def plan_rows(
    blocks: BlockTables,
    alloc: PageAllocator,
    rows: np.ndarray,
    num_tokens: list[int],
    token_data: list[bytes | None],
    tenant: str,
) -> Plan:
    """The appends of a step (rows distinct, token data checked); one row takes plan_one()."""
    n, size = len(rows), blocks.page_size
    if n == 1:
        return plan_one(blocks, alloc, int(rows[0]), num_tokens[0], token_data[0], tenant)
    known_rows = blocks.tokens_known[rows]
    known = known_rows if known_rows.any() else None
    if n > 1 and num_tokens.count(1) == n:  # a decode step, unless a row must copy its last page
        tables = blocks.tables
        decode = batching.decode_plan(tables, tables.shape[1], blocks.lengths, alloc.ref_count, rows, size)
        if decode is not None:
            num_grow, most_pages = decode
            return Plan(tenant, Decode(rows, token_data, known), num_grow, num_grow, [], n, most_pages)
    counts = np.array(num_tokens, dtype=np.int64)
    old_len, old_pages = blocks.lengths[rows], blocks.num_pages[rows]
    new_pages = -(-(old_len + counts) // size)
    copies = _copy_on_write(blocks, alloc, rows, old_len, old_pages)
    sources = blocks.tables[rows[copies], old_pages[copies] - 1].astype(np.int64).tolist() if copies else []
    num_grow = int((new_pages - old_pages).sum())
    change = Rows(rows, token_data, known, counts, old_len, old_pages, new_pages, copies)
    most_pages = int(new_pages.max()) if n else 0
    return Plan(tenant, change, num_grow, num_grow + len(copies), sources, int(counts.sum()), most_pages)


def plan_new(change: NewRow) -> Plan:
    """A new sequence on shared pages: the tenant holds them once more; nothing is allocated."""
    num = len(change.pages)
    return Plan(change.seq.tenant, change, num, 0, [], 0, num)


def _copy_on_write(
    blocks: BlockTables, alloc: PageAllocator, rows: np.ndarray, old_len: np.ndarray, old_pages: np.ndarray
) -> list[int]:
    """Indices of the rows whose partial last page is shared and must be copied first: each holder
    appending in this call copies it, except the last when every holder appends."""
    partial = np.nonzero(old_len % blocks.page_size)[0]
    if len(partial) == 0:
        return []
    last = blocks.tables[rows[partial], old_pages[partial] - 1].astype(np.int64)
    shared = alloc.ref_count[last] > 1
    if not shared.any():
        return []
    copies_left: dict[int, int] = {}
    copies: list[int] = []
    for i, page in zip(partial[shared].tolist(), last[shared].tolist()):
        left = copies_left.setdefault(page, int(alloc.ref_count[page]))
        if left > 1:
            copies.append(i)
            copies_left[page] = left - 1
    return copies


# -- token ids: converted and checked while planning, so a bad id fails the whole call ---------------
def checked_token_bytes(token_ids: TokenIds, start: int = 0, stop: int = -1) -> bytes:
    """token_bytes(token_ids[start:stop]) (stop -1: to the end), with InvalidRequest for an id that
    is no int64."""
    try:
        return token_bytes(token_ids, start, stop)
    except (OverflowError, TypeError) as exc:
        raise InvalidRequest(f"token ids must be int64 integers: {exc}") from None


def checked_data(count: int, token_ids: TokenIds | None) -> bytes | None:
    """One append's token ids as int64 bytes (None if it has none), or InvalidRequest."""
    _check_count(count)
    if token_ids is None:
        return None
    if len(token_ids) != count:
        raise InvalidRequest(f"token_ids has {len(token_ids)} ids for num_tokens={count}")
    return checked_token_bytes(token_ids)


def checked_token_data(num_tokens: list[int], token_lists: list[list[int] | None]) -> list[bytes | None]:
    """checked_data() of each append (list.count runs in C: a decode step mostly carries no ids)."""
    if token_lists.count(None) == len(token_lists):
        if num_tokens:
            _check_count(min(num_tokens))
        return list(token_lists)  # type: ignore[arg-type]  # all None
    return [checked_data(count, ids) for count, ids in zip(num_tokens, token_lists)]


def _check_count(count: int) -> None:
    if count < 1:
        raise InvalidRequest("num_tokens must be >= 1")
