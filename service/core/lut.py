"""Vectorised lookups on block tables: lookup tables for a batch, and slots of token positions."""

import numpy as np

from service.core.layout import lut_columns


def lookup_table(tables: np.ndarray, num_pages: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """uint32 [len(rows), lut_columns(max pages)]; `tables` rows are sentinel-filled past their pages."""
    max_pages = int(num_pages[rows].max()) if len(rows) else 0
    return tables[rows, : lut_columns(max_pages)]


def token_slots(
    tables: np.ndarray, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, page_size: int
) -> np.ndarray:
    """int64 slots of positions [starts[i], starts[i] + counts[i]) of each row, concatenated."""
    total = int(counts.sum())
    seq_of = np.repeat(np.arange(len(rows)), counts)
    pos = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts) + starts[seq_of]
    return tables[rows[seq_of], pos // page_size].astype(np.int64) * page_size + pos % page_size
