"""service/core/layout.py (the LUT column rule) and service/core/lut.py (vectorised gathers)."""

import math

import numpy as np
import pytest

from service.core.layout import LUT_COLUMN_ALIGN, LUT_COLUMN_PAD, lut_columns, pages_for
from service.core.lut import lookup_table, token_slots

SENTINEL = 9


def test_columns_are_rounded_up_to_eight_then_padded_by_sixteen() -> None:
    assert (LUT_COLUMN_ALIGN, LUT_COLUMN_PAD) == (8, 16)
    assert [lut_columns(n) for n in (0, 1, 7, 8, 9, 16, 17, 100)] == [16, 24, 24, 24, 32, 32, 40, 120]
    for n in range(300):
        assert lut_columns(n) == 8 * math.ceil(n / 8) + 16


@pytest.mark.parametrize(
    ("num_tokens", "page_size", "expected"), [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (17, 16, 2), (7, 1, 7)]
)
def test_pages_for_rounds_up(num_tokens: int, page_size: int, expected: int) -> None:
    assert pages_for(num_tokens, page_size) == expected


def tables_of(rows: list[list[int]], width: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """A sentinel-filled uint32 table matrix holding `rows`, and their page counts."""
    tables = np.full((len(rows), width), SENTINEL, dtype=np.uint32)
    for i, pages in enumerate(rows):
        tables[i, : len(pages)] = pages
    return tables, np.array([len(r) for r in rows], dtype=np.int64)


def test_lookup_table_gathers_rows_in_the_order_asked_and_keeps_the_padding() -> None:
    tables, num_pages = tables_of([[3, 1], [0, 2, 4, 5, 6, 7, 8, 1, 3], [], [5]])
    lut = lookup_table(tables, num_pages, np.array([3, 0, 2]))
    assert lut.dtype == np.uint32 and lut.shape == (3, 24)  # the longest asked row has 2 pages
    expected = np.full((3, 24), SENTINEL, dtype=np.uint32)
    expected[0, 0] = 5
    expected[1, :2] = [3, 1]
    np.testing.assert_array_equal(lut, expected)
    lut = lookup_table(tables, num_pages, np.array([1, 1]))
    assert lut.shape == (2, 32)
    assert lut[0, :9].tolist() == [0, 2, 4, 5, 6, 7, 8, 1, 3] and (lut[:, 9:] == SENTINEL).all()
    lut[0, 0] = 77  # a copy: the caller may keep or change it
    assert tables[1, 0] == 0


def test_lookup_table_of_no_rows_or_only_empty_rows() -> None:
    tables, num_pages = tables_of([[], [1]])
    assert lookup_table(tables, num_pages, np.array([], dtype=np.int64)).shape == (0, 16)
    lut = lookup_table(tables, num_pages, np.array([0]))
    assert lut.shape == (1, 16) and (lut == SENTINEL).all()


def test_token_slots_map_positions_through_the_block_tables() -> None:
    tables, _ = tables_of([[3, 1, 6], [0, 2], [8]])
    page_size = 4
    rows = np.array([1, 0, 2])
    starts = np.array([3, 5, 0])
    counts = np.array([3, 4, 0])
    slots = token_slots(tables, rows, starts, counts, page_size)
    assert slots.dtype == np.int64
    # row 1: positions 3, 4, 5 -> page 0 offset 3, page 2 offsets 0, 1; row 0: positions 5..8 of [3, 1, 6].
    assert slots.tolist() == [3, 8, 9, 5, 6, 7, 24]
    assert token_slots(tables, rows, starts, np.zeros(3, dtype=np.int64), page_size).tolist() == []
