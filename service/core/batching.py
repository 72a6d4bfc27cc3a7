"""The per-sequence loops of a step: the appends split into columns with each sequence's row, and a
decode step's block-table updates (one token for each sequence).

service/core/_batch.c runs them (setup.py builds it at install); the *_py functions below are their
definitions, the fallback when it is not built, and the tests' oracle.
"""

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

Columns = tuple[list[str], list[int], list[Any], bytes, bool]
MAX_ROW = 1 << 24  # rows of a block table; beyond, unzip_appends leaves the work to the caller


def unzip_appends_py(seqs: Mapping[str, Any], appends: list[Any]) -> Columns | None:
    """(ids, counts, token_lists, rows as native int64 bytes, whether no row repeats) of `appends`, a
    list of (seq_id, num_tokens, token_ids) tuples, with rows read from seqs[seq_id].row; ids are
    distinct exactly when their rows are (one sequence per row). None when an append is not such a
    tuple, an id is unknown or a row is not an int in [0, 2**24): the caller's general path then
    raises the right error."""
    if any(type(a) is not tuple or len(a) != 3 for a in appends):
        return None
    ids, counts, token_lists = (list(c) for c in zip(*appends)) if appends else ([], [], [])
    if any(s not in seqs for s in ids):
        return None
    rows = [seqs[s].row for s in ids]
    if any(type(r) is not int or not 0 <= r < MAX_ROW for r in rows):
        return None
    return ids, counts, token_lists, np.array(rows, dtype=np.int64).tobytes(), len(set(rows)) == len(rows)


def decode_plan_py(
    tables: np.ndarray, width: int, lengths: np.ndarray, ref_count: np.ndarray, rows: np.ndarray, page_size: int
) -> tuple[int, int] | None:
    """For one more token in each of `rows`: (how many open a new page, the most pages a row has
    after), or None when a row's partial last page is shared (it needs copy-on-write: the general
    path's work). tables: uint32 [num_rows, width]. Changes nothing."""
    col, offset = np.divmod(lengths[rows], page_size)
    if len(rows) and int(col.max()) >= width:
        raise ValueError("a block table is narrower than its length")
    opens = offset == 0
    partial = tables[rows[~opens], col[~opens]].astype(np.int64)
    if (partial >= len(ref_count)).any():
        raise ValueError("a partial page is missing from its block table")
    if (ref_count[partial] > 1).any():
        return None
    return int(opens.sum()), int(col.max()) + 1 if len(rows) else 0


def decode_apply_py(
    tables: np.ndarray,
    width: int,
    lengths: np.ndarray,
    num_pages: np.ndarray,
    rows: np.ndarray,
    new_pages: np.ndarray,
    page_size: int,
    slots: np.ndarray,
) -> None:
    """One more token in each of `rows` (distinct): rows whose length is a multiple of page_size take
    the next of `new_pages` into their table; lengths grow by one, page counts follow; slots[i] is the
    new token's slot of rows[i]."""
    col, offset = np.divmod(lengths[rows], page_size)
    if len(rows) and int(col.max()) >= width:
        raise ValueError("a block table is narrower than its length")
    grow = np.flatnonzero(offset == 0)
    if len(grow) != len(new_pages):
        raise ValueError(f"{len(grow)} rows open a page, {len(new_pages)} new pages given")
    tables[rows[grow], col[grow]] = new_pages
    slots[:] = tables[rows, col].astype(np.int64) * page_size + offset
    lengths[rows] += 1
    num_pages[rows] = col + 1


native: ModuleType | None
try:
    native = importlib.import_module("service.core._batch")
except ImportError:  # not built: the definition above does the work
    native = None

unzip_appends = unzip_appends_py if native is None else native.unzip_appends
decode_plan = decode_plan_py if native is None else native.decode_plan
decode_apply = decode_apply_py if native is None else native.decode_apply
