"""Row storage of block tables: one uint32 matrix and per-row arrays, grown by doubling.

`tables[row, col]` holds a sequence's pages and the sentinel everywhere past them, so the lookup
table of a batch is one gather of rows and never needs a fill. The width is kept at
lut_columns(longest table) or more, so every LUT slice fits. The arrays are replaced when they
grow: hold the BlockTables, not an array read from it.
"""

import numpy as np

from service.core import page_ops
from service.core.layout import lut_columns
from service.core.lut import lookup_table, token_slots


class BlockTables:
    def __init__(self, sentinel: int, page_size: int) -> None:
        self.sentinel = sentinel
        self.page_size = page_size
        cap = 16
        self.tables = np.full((cap, lut_columns(16)), sentinel, dtype=np.uint32)
        self.lengths = np.zeros(cap, dtype=np.int64)  # tokens
        self.num_pages = np.zeros(cap, dtype=np.int64)  # pages in the row
        self.num_hashed = np.zeros(cap, dtype=np.int64)  # leading pages committed to the prefix cache
        self.tokens_known = np.zeros(cap, dtype=np.bool_)  # every token id appended so far is known
        self._free_rows: list[int] = list(range(cap - 1, -1, -1))
        self._fits = 16  # rows of this many pages fit the width (see ensure_width)

    def take_row(self) -> int:
        """An empty row: no pages, length 0, nothing hashed; its tokens_known is the caller's to set."""
        if not self._free_rows:
            old = len(self.lengths)
            self.tables = np.concatenate([self.tables, np.full_like(self.tables, self.sentinel)])
            for name in ("lengths", "num_pages", "num_hashed", "tokens_known"):
                arr = getattr(self, name)
                setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))
            self._free_rows.extend(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def release_row(self, row: int, num_pages: int) -> None:
        """Row `row`, which holds num_pages pages, back to the free rows, emptied."""
        self.tables[row, :num_pages] = self.sentinel
        self.lengths[row] = self.num_pages[row] = self.num_hashed[row] = 0
        self._free_rows.append(row)

    def ensure_width(self, max_pages: int) -> None:
        """Widen the matrix (never narrowed) so that rows of `max_pages` pages and their LUT fit."""
        if max_pages <= self._fits:  # the common case, without computing any width
            return
        need = lut_columns(max_pages)
        width = self.tables.shape[1]
        if need > width:
            grown = np.full((self.tables.shape[0], max(need, 2 * width)), self.sentinel, dtype=np.uint32)
            grown[:, :width] = self.tables
            self.tables = grown
        self._fits = max_pages

    def lookup_table(self, rows: np.ndarray) -> np.ndarray:
        """uint32 [len(rows), lut_columns(max pages)]: pages, then the sentinel everywhere else."""
        return lookup_table(self.tables, self.num_pages, rows)

    def row_slots(self, row: int, start: int, count: int) -> np.ndarray:
        """slots_of() for one row (a prompt): one compiled pass over the pages it spans."""
        slots = np.empty(count, dtype=np.int64)
        page_ops.page_slots(self.tables[row], start, self.page_size, slots)
        return slots

    def slots_of(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """int64 slots (page * page_size + offset) of positions [starts[i], starts[i] + counts[i])
        of each row, concatenated."""
        size = self.page_size
        if len(rows) == 1:
            return self.row_slots(int(rows[0]), int(starts[0]), int(counts[0]))
        total = int(counts.sum())
        if total == len(rows):  # one token each: a decode step
            pos = starts
            return self.tables[rows, pos // size].astype(np.int64) * size + pos % size
        return token_slots(self.tables, rows, starts, counts, size)
