"""Row storage of block tables: one uint32 matrix and per-row arrays, grown by doubling.

`tables[row, col]` holds a sequence's pages and the sentinel everywhere past them, so the lookup
table of a batch is one gather of rows and never needs a fill. The width is kept at
lut_columns(longest table) or more, so every LUT slice fits.
"""

import numpy as np

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
        self._page_offsets = np.empty(0, dtype=np.int64)  # grown by _offsets_of()

    def _take_row(self) -> int:
        if not self._free_rows:
            old = len(self.lengths)
            self.tables = np.concatenate([self.tables, np.full_like(self.tables, self.sentinel)])
            for name in ("lengths", "num_pages", "num_hashed", "tokens_known"):
                arr = getattr(self, name)
                setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))
            self._free_rows.extend(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _release_row(self, row: int) -> None:
        self.tables[row, : self.num_pages[row]] = self.sentinel
        self.lengths[row] = self.num_pages[row] = self.num_hashed[row] = 0
        self._free_rows.append(row)

    def _ensure_width(self, max_pages: int) -> None:
        need = lut_columns(max_pages)
        width = self.tables.shape[1]
        if need <= width:
            return
        grown = np.full((self.tables.shape[0], max(need, 2 * width)), self.sentinel, dtype=np.uint32)
        grown[:, :width] = self.tables
        self.tables = grown

    def lookup_table(self, rows: np.ndarray) -> np.ndarray:
        """uint32 [len(rows), lut_columns(max pages)]: pages, then the sentinel everywhere else."""
        return lookup_table(self.tables, self.num_pages, rows)

    def row_slots(self, row: int, start: int, count: int) -> np.ndarray:
        """slots_of() for one row (a prompt): a broadcast over the pages it spans, no per-token gather."""
        size = self.page_size
        first = start // size
        span = self.tables[row, first : -(-(start + count) // size)]
        return self.page_slots(span, start - first * size, count)

    def page_slots(self, pages: np.ndarray, offset: int, count: int) -> np.ndarray:
        """int64 slots of `count` consecutive positions starting at `offset` in pages[0], running on
        through the following pages."""
        size = self.page_size
        slots = np.repeat(pages.astype(np.int64, copy=False), size)  # in place from here: faster than
        slots *= size  # a broadcast over rows of `size`
        slots += self._offsets_of(len(pages))
        return slots[offset : offset + count]

    def _offsets_of(self, num_pages: int) -> np.ndarray:
        """0, 1, .., page_size - 1 repeated num_pages times (a view of a cached array)."""
        need = num_pages * self.page_size
        if len(self._page_offsets) < need:
            self._page_offsets = np.tile(np.arange(self.page_size, dtype=np.int64), max(num_pages, 256))
        return self._page_offsets[:need]

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
