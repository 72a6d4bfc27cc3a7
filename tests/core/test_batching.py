"""The compiled step helper (service/core/_batch.c) against its Python definition (batching.py)."""

from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from service.core import batching

native = batching.native


@dataclass
class Seq:
    row: Any


def test_the_compiled_module_is_built() -> None:
    assert native is not None, "service/core/_batch.c is not built: run `pip install -e .`"


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
def test_unzip_appends_equals_the_definition(appends: list[Any], row_of: dict[str, Any]) -> None:
    seqs = {seq_id: Seq(row) for seq_id, row in row_of.items()}
    expected = batching.unzip_appends_py(seqs, appends)
    assert native.unzip_appends(seqs, appends) == expected
    if expected is not None:
        assert expected[0] == [a[0] for a in appends]


def test_unzip_appends_of_a_decode_step() -> None:
    seqs = {f"s{i}": Seq(i * 3) for i in range(5)}
    got = native.unzip_appends(seqs, [("s4", 1, None), ("s0", 2, [7, 8])])
    assert got == (["s4", "s0"], [1, 2], [None, [7, 8]], (12).to_bytes(8, "little") + bytes(8), True)
    assert native.unzip_appends(seqs, [("s1", 1, None), ("s1", 1, None)])[4] is False  # type: ignore[index]
    assert native.unzip_appends(seqs, [("s1", 1, None), ("nope", 1, None)]) is None
    assert native.unzip_appends(seqs, []) == ([], [], [], b"", True)


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
def test_decode_plan_and_apply_equal_their_definitions(batch: Any, first_new_page: int) -> None:
    tables, lengths, num_pages, ref_count, rows, page_size = batch
    width = tables.shape[1]
    plan = native.decode_plan(tables, width, lengths, ref_count, rows, page_size)
    assert plan == batching.decode_plan_py(tables, width, lengths, ref_count, rows, page_size)
    opening = int((lengths[rows] % page_size == 0).sum())
    new_pages = np.arange(first_new_page, first_new_page + opening, dtype=np.int64)
    arrays = {side: [a.copy() for a in (tables, lengths, num_pages)] for side in ("c", "py")}
    slots = {side: np.full(len(rows), -1, dtype=np.int64) for side in ("c", "py")}
    for side, apply in (("c", native.decode_apply), ("py", batching.decode_apply_py)):
        t, ln, npg = arrays[side]
        apply(t, width, ln, npg, rows, new_pages, page_size, slots[side])
    for c, py in zip(arrays["c"], arrays["py"]):
        assert np.array_equal(c, py)
    assert np.array_equal(slots["c"], slots["py"])
    t, ln, _ = arrays["c"]
    for i, row in enumerate(rows.tolist()):  # each new slot is the new position's page and offset
        pos = int(ln[row]) - 1
        assert slots["c"][i] == int(t[row, pos // page_size]) * page_size + pos % page_size


def test_decode_apply_checks_before_it_changes_anything() -> None:
    tables = np.array([[3, 9, 9], [4, 9, 9]], dtype=np.uint32)
    lengths, num_pages, rows = np.array([2, 1], dtype=np.int64), np.array([1, 1], dtype=np.int64), np.array([0, 1])
    slots = np.zeros(2, dtype=np.int64)
    for apply in (native.decode_apply, batching.decode_apply_py):
        with pytest.raises(ValueError, match="1 rows open a page, 0 new pages given"):
            apply(tables, 3, lengths, num_pages, rows, np.empty(0, dtype=np.int64), 2, slots)
        assert tables.tolist() == [[3, 9, 9], [4, 9, 9]] and lengths.tolist() == [2, 1]
        assert num_pages.tolist() == [1, 1] and slots.tolist() == [0, 0]
    assert native.decode_plan(tables, 3, lengths, np.array([1, 1, 1, 1, 2], dtype=np.int32), rows, 2) is None
