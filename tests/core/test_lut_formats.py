"""FlashInfer CSR and flash_attn block tables built from MAX-style lookup tables: exact values."""

import numpy as np
import pytest

from service.core.layout import lut_columns
from service.core.lut_formats import flash_attn_tables, flashinfer_tables, pages_per_row

S = 99  # sentinel of a 99-page pool


def lut(rows: list[list[int]]) -> np.ndarray:
    """A sentinel-filled uint32 LUT as the core builds it."""
    out = np.full((len(rows), lut_columns(max(map(len, rows), default=0))), S, dtype=np.uint32)
    for i, pages in enumerate(rows):
        out[i, : len(pages)] = pages
    return out


def test_pages_per_row() -> None:
    assert pages_per_row(np.array([0, 1, 4, 5, 8, 9]), 4).tolist() == [0, 1, 1, 2, 2, 3]


def test_flashinfer_csr_exact() -> None:
    # page size 4; lengths 6 (pages 7, 2), 4 (page 5: full last page), 9 (pages 3, 0, 11), 1 (page 42)
    table = lut([[7, 2], [5], [3, 0, 11], [42]])
    indptr, indices, last = flashinfer_tables(table, np.array([6, 4, 9, 1], dtype=np.uint32), 4)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    assert indptr.tolist() == [0, 2, 3, 6, 7]
    assert indices.tolist() == [7, 2, 5, 3, 0, 11, 42]
    assert last.tolist() == [2, 4, 1, 1]


def test_flashinfer_empty_sequence_gets_no_pages_and_zero_last_len() -> None:
    table = lut([[4], [], [8, 9]])
    indptr, indices, last = flashinfer_tables(table, np.array([3, 0, 5]), 4)
    assert indptr.tolist() == [0, 1, 1, 3]
    assert indices.tolist() == [4, 8, 9]
    assert last.tolist() == [3, 0, 1]


def test_flashinfer_empty_batch() -> None:
    indptr, indices, last = flashinfer_tables(lut([]), np.array([], dtype=np.int64), 4)
    assert indptr.tolist() == [0] and indices.tolist() == [] and last.tolist() == []


def test_flashinfer_last_page_len_is_in_range_for_every_length() -> None:
    lengths = np.arange(1, 50)
    rows = [list(range(p)) for p in pages_per_row(lengths, 8)]
    indptr, indices, last = flashinfer_tables(lut(rows), lengths, 8)
    assert ((last >= 1) & (last <= 8)).all()
    # FlashInfer's length rule recovers every length.
    assert ((np.diff(indptr) - 1) * 8 + last).tolist() == lengths.tolist()
    assert len(indices) == indptr[-1]


def test_flash_attn_block_table_exact() -> None:
    table = lut([[7, 2], [5], [3, 0, 11], []])
    block_table, seqlens = flash_attn_tables(table, np.array([6, 4, 9, 0], dtype=np.uint32), 4)
    assert block_table.dtype == seqlens.dtype == np.int32
    assert block_table.tolist() == [[7, 2, S], [5, S, S], [3, 0, 11], [S, S, S]]
    assert seqlens.tolist() == [6, 4, 9, 0]
    assert block_table.flags.c_contiguous


def test_flash_attn_all_empty_keeps_one_column() -> None:
    block_table, seqlens = flash_attn_tables(lut([[], []]), np.array([0, 0]), 4)
    assert block_table.tolist() == [[S], [S]] and seqlens.tolist() == [0, 0]


@pytest.mark.parametrize("fn", [flashinfer_tables, flash_attn_tables])
def test_length_beyond_the_table_is_refused(fn) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="more pages"):
        fn(np.full((1, 2), S, dtype=np.uint32), np.array([9]), 4)
