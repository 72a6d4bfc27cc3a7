"""The step loops (service/core/batching.py, compiled) against plain statements of what they do."""

from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from service.core import batching


@dataclass
class Seq:
    row: Any


ids = st.sampled_from(["a", "b", "c", "d", "gone"])
appends = st.lists(
    st.one_of(
        st.tuples(ids, st.integers(1, 5), st.none() | st.lists(st.integers(0, 9), max_size=3)),
        st.lists(ids, min_size=3, max_size=3),  # not a tuple
        st.tuples(ids, st.integers(1, 5)),  # too short
    ),
    max_size=6,
)
rows = st.one_of(st.integers(0, 3), st.integers(0, 2**24 + 1), st.just(-1), st.just("3"), st.just(2.0))


@given(appends, st.fixed_dictionaries({"a": rows, "b": rows, "c": rows, "d": rows}))
def test_unzip_appends_splits_the_appends_into_columns(appends: list[Any], row_of: dict[str, Any]) -> None:
    seqs = {seq_id: Seq(row) for seq_id, row in row_of.items()}
    got = batching.unzip_appends(seqs, appends)
    usual = all(
        type(a) is tuple
        and len(a) == 3
        and a[0] in seqs
        and type(seqs[a[0]].row) is int
        and 0 <= seqs[a[0]].row < batching.MAX_ROW
        for a in appends
    )
    if not usual:
        assert got is None
        return
    rows = [seqs[a[0]].row for a in appends]
    columns = [[a[i] for a in appends] for i in range(3)]
    assert got == (*columns, np.array(rows, dtype=np.int64).tobytes(), len(set(rows)) == len(rows))


def test_unzip_appends_of_a_decode_step() -> None:
    seqs = {f"s{i}": Seq(i * 3) for i in range(5)}
    got = batching.unzip_appends(seqs, [("s4", 1, None), ("s0", 2, [7, 8])])
    assert got == (["s4", "s0"], [1, 2], [None, [7, 8]], (12).to_bytes(8, "little") + bytes(8), True)
    assert batching.unzip_appends(seqs, [("s1", 1, None), ("s1", 1, None)])[4] is False  # type: ignore[index]
    assert batching.unzip_appends(seqs, [("s1", 1, None), ("nope", 1, None)]) is None
    assert batching.unzip_appends(seqs, []) == ([], [], [], b"", True)


@st.composite
def decode_batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Block tables consistent with their lengths (pages 0..11, shared ones with ref_count 2), and
    distinct rows to append one token to."""
    page_size, width, num_rows, num_pages = draw(st.sampled_from([1, 2, 4])), 6, 5, 12
    lengths = np.array(draw(st.lists(st.integers(0, (width - 1) * page_size), min_size=num_rows, max_size=num_rows)))
    tables = np.full((num_rows, width), num_pages, dtype=np.uint32)
    ref_count = np.array(draw(st.lists(st.integers(1, 2), min_size=num_pages, max_size=num_pages)), dtype=np.int32)
    for row, length in enumerate(lengths):
        used = -(-int(length) // page_size)
        tables[row, :used] = draw(st.lists(st.integers(0, num_pages - 1), min_size=used, max_size=used))
    num_pages_of = -(-lengths // page_size)
    rows = np.array(draw(st.permutations(range(num_rows)))[: draw(st.integers(0, num_rows))], dtype=np.int64)
    return tables, lengths.astype(np.int64), num_pages_of.astype(np.int64), ref_count, rows, page_size


@given(decode_batches(), st.integers(100, 200))
def test_decode_plan_and_apply_add_one_token_to_each_row(batch: Any, first_new_page: int) -> None:
    tables, lengths, num_pages, ref_count, rows, page_size = batch
    width = tables.shape[1]
    col, offset = lengths[rows] // page_size, lengths[rows] % page_size
    opening = int((offset == 0).sum())
    partial_pages = tables[rows[offset != 0], col[offset != 0]]
    shared = bool((ref_count[partial_pages] > 1).any())
    plan = batching.decode_plan(tables, width, lengths, ref_count, rows, page_size)
    assert plan == (None if shared else (opening, int(col.max()) + 1 if len(rows) else 0))
    new_pages = np.arange(first_new_page, first_new_page + opening, dtype=np.int64)
    expected = tables.copy()
    expected[rows[offset == 0], col[offset == 0]] = new_pages  # in row order, as decode_plan counted them
    t, ln, npg = (a.copy() for a in (tables, lengths, num_pages))
    slots = np.full(len(rows), -1, dtype=np.int64)
    batching.decode_apply(t, width, ln, npg, rows, new_pages, page_size, slots)
    assert np.array_equal(t, expected)
    assert ln.tolist() == [n + (r in rows) for r, n in enumerate(lengths.tolist())]
    assert npg[rows].tolist() == (col + 1).tolist()
    for i, row in enumerate(rows.tolist()):  # each new slot is the new position's page and offset
        pos = int(ln[row]) - 1
        assert slots[i] == int(t[row, pos // page_size]) * page_size + pos % page_size


def test_decode_apply_checks_before_it_changes_anything() -> None:
    tables = np.array([[3, 9, 9], [4, 9, 9]], dtype=np.uint32)
    lengths, num_pages, rows = np.array([2, 1], dtype=np.int64), np.array([1, 1], dtype=np.int64), np.array([0, 1])
    slots = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match="1 rows open a page, 0 new pages given"):
        batching.decode_apply(tables, 3, lengths, num_pages, rows, np.empty(0, dtype=np.int64), 2, slots)
    assert tables.tolist() == [[3, 9, 9], [4, 9, 9]] and lengths.tolist() == [2, 1]
    assert num_pages.tolist() == [1, 1] and slots.tolist() == [0, 0]
    assert batching.decode_plan(tables, 3, lengths, np.array([1, 1, 1, 1, 2], dtype=np.int32), rows, 2) is None
