"""The per-sequence loops of a step: the appends split into columns with each sequence's row, and a
decode step's block-table updates (one token for each sequence).

This file is the one definition: setup.py compiles it with Cython (pure-Python mode), and it runs
unchanged as plain Python where it is not built. decode_plan changes nothing; decode_apply checks
all of its input before it writes anything.
"""

from typing import Any

import cython
import numpy as np

COMPILED: bool = cython.compiled  # True in the build setup.py compiles, False run as plain Python

Columns = tuple[list[str], list[int], list[Any], bytes, bool]
# Rows of a block table; beyond, unzip_appends leaves the work to the caller.
MAX_ROW = 1 << 24


@cython.boundscheck(False)  # rows are written at i < n, and `seen` indexed by rows in [0, most]
@cython.wraparound(False)
def unzip_appends(seqs: dict, appends: list) -> Columns | None:
    """(ids, counts, token_lists, rows as native int64 bytes, whether no row repeats) of `appends`, a
    list of (seq_id, num_tokens, token_ids) tuples, with rows read from seqs[seq_id].row; ids are
    distinct exactly when their rows are (one sequence per row). None when an append is not such a
    tuple, an id is unknown or a row is not an int in [0, 2**24): the caller's general path then
    raises the right error."""
    n: cython.Py_ssize_t = len(appends)
    ids: list = [None] * n
    counts: list = [None] * n
    token_lists: list = [None] * n
    rows = np.empty(n, dtype=np.int64)
    row_of: cython.longlong[::1] = rows
    most: cython.longlong = -1
    i: cython.Py_ssize_t
    for i in range(n):
        append = appends[i]
        if type(append) is not tuple or len(append) != 3:
            return None
        seq = seqs.get(append[0])
        if seq is None:
            return None
        row = seq.row
        if type(row) is not int or not 0 <= row < MAX_ROW:
            return None
        row_of[i] = row
        most = max(most, row_of[i])
        ids[i], counts[i], token_lists[i] = append
    # Whether a row repeats (ids are distinct exactly when their rows are): a flag per row.
    seen = np.zeros(most + 1, dtype=np.uint8)
    flags: cython.uchar[::1] = seen
    distinct: cython.bint = True
    for i in range(n):
        if flags[row_of[i]]:
            distinct = False
            break
        flags[row_of[i]] = 1
    return ids, counts, token_lists, rows.tobytes(), bool(distinct)


@cython.boundscheck(False)  # rows are checked against lengths, columns against width, pages against ref_count
@cython.wraparound(False)
def decode_plan(
    tables: cython.uint[:, ::1],
    width: cython.Py_ssize_t,
    lengths: cython.longlong[::1],
    ref_count: cython.int[::1],
    rows: cython.const_longlong[::1],
    page_size: cython.Py_ssize_t,
) -> tuple[int, int] | None:
    """For one more token in each of `rows`: (how many open a new page, the most pages a row has
    after), or None when a row's partial last page is shared (it needs copy-on-write: the general
    path's work). tables: uint32 [num_rows, width]. Changes nothing."""
    _check_rows(tables, width, lengths, rows, page_size)
    opening: cython.Py_ssize_t = 0
    most: cython.Py_ssize_t = 0
    i: cython.Py_ssize_t
    col: cython.Py_ssize_t
    page: cython.uint
    for i in range(len(rows)):
        col = lengths[rows[i]] // page_size
        if col >= width:
            raise ValueError("a block table is narrower than its length")
        if lengths[rows[i]] % page_size == 0:
            opening += 1
        else:
            page = tables[rows[i], col]
            if page >= len(ref_count):
                raise ValueError("a partial page is missing from its block table")
            if ref_count[page] > 1:
                return None
        most = max(most, col + 1)
    return opening, most


@cython.boundscheck(False)  # as decode_plan, and new_pages is read at k < its checked length
@cython.wraparound(False)
def decode_apply(
    tables: cython.uint[:, ::1],
    width: cython.Py_ssize_t,
    lengths: cython.longlong[::1],
    num_pages: cython.longlong[::1],
    rows: cython.const_longlong[::1],
    new_pages: cython.const_longlong[::1],
    page_size: cython.Py_ssize_t,
    slots: cython.longlong[::1],
) -> None:
    """One more token in each of `rows` (distinct): rows whose length is a multiple of page_size take
    the next of `new_pages` into their table; lengths grow by one, page counts follow; slots[i] is the
    new token's slot of rows[i]."""
    _check_rows(tables, width, lengths, rows, page_size)
    n: cython.Py_ssize_t = len(rows)
    if len(num_pages) != len(lengths) or len(slots) != n:
        raise ValueError("num_pages or slots has the wrong length")
    opening: cython.Py_ssize_t = 0
    i: cython.Py_ssize_t
    for i in range(n):  # check first: a failure changes nothing
        if lengths[rows[i]] // page_size >= width:
            raise ValueError("a block table is narrower than its length")
        if lengths[rows[i]] % page_size == 0:
            opening += 1
    if opening != len(new_pages):
        raise ValueError(f"{opening} rows open a page, {len(new_pages)} new pages given")
    k: cython.Py_ssize_t = 0
    row: cython.longlong
    col: cython.longlong
    offset: cython.longlong
    for i in range(n):
        row = rows[i]
        col, offset = lengths[row] // page_size, lengths[row] % page_size
        if offset == 0:
            tables[row, col] = new_pages[k]
            k += 1
        slots[i] = cython.cast(cython.longlong, tables[row, col]) * page_size + offset
        lengths[row] += 1
        num_pages[row] = col + 1


@cython.cfunc
def _check_rows(
    tables: cython.uint[:, ::1],
    width: cython.Py_ssize_t,
    lengths: cython.longlong[::1],
    rows: cython.const_longlong[::1],
    page_size: cython.Py_ssize_t,
) -> None:
    """tables: [len(lengths), width]; every row id in range; page_size > 0."""
    if page_size <= 0 or width <= 0:
        raise ValueError("page_size and width must be > 0")
    if tables.shape[0] != len(lengths) or tables.shape[1] != width:
        raise ValueError("tables is not [len(lengths), width]")
    i: cython.Py_ssize_t
    for i in range(len(rows)):
        if not 0 <= rows[i] < len(lengths):
            raise IndexError("row out of range")
