"""The compiled allocation loops (service/core/_pages.c) against their Python definitions (page_ops.py):
the same results, the same arrays afterwards, and the same error (with nothing changed) on bad input."""

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from service.core import page_ops

native = page_ops.native
NUM_PAGES = 12


def test_the_compiled_module_is_built() -> None:
    assert native is not None, "service/core/_pages.c is not built: run `pip install -e .`"


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except (ValueError, IndexError) as exc:
        return type(exc).__name__, None


def run_both(name: str, arrays: list[np.ndarray], call: Callable[[Callable[..., Any], list[np.ndarray]], Any]) -> Any:
    """call(fn, copies of arrays) with the compiled and the Python function; asserts that results,
    errors and every array afterwards agree, and returns the result with the arrays afterwards."""
    sides = {}
    for fn in (getattr(native, name), getattr(page_ops, f"{name}_py")):
        copies = [a.copy() for a in arrays]
        sides[fn] = (outcome(call, fn, copies), copies)
    (c_out, c_arrays), (py_out, py_arrays) = sides.values()
    assert c_out == py_out
    for c, py, before in zip(c_arrays, py_arrays, arrays):
        assert c.dtype == py.dtype and np.array_equal(c, py)
        if c_out[0] != "ok":
            assert np.array_equal(c, before), "a failed call changed an array"
    return c_out, c_arrays


@st.composite
def stacks(draw: st.DrawFn) -> tuple[np.ndarray, int, np.ndarray]:
    """A free stack (some pages of 0..11, the rest of the array garbage) and ref counts."""
    free_pages = draw(st.permutations(range(NUM_PAGES)))[: draw(st.integers(0, NUM_PAGES))]
    free = np.array(free_pages + [draw(st.integers(-3, 20)) for _ in range(NUM_PAGES - len(free_pages))])
    ref_count = np.array(draw(st.lists(st.integers(0, 3), min_size=NUM_PAGES, max_size=NUM_PAGES)), dtype=np.int32)
    return free.astype(np.int64), len(free_pages), ref_count


@given(stacks(), st.integers(0, NUM_PAGES + 1), st.sampled_from([np.int64, np.uint32]), st.integers(-1, 2))
def test_pop_equals_the_definition(stack: Any, num: int, dtype: Any, top_shift: int) -> None:
    free, top, ref_count = stack
    top = top + top_shift  # also a top past the pages (garbage ids) or past the array
    out = np.full(num, 99, dtype=dtype)
    result, (_, ref_after, out_after) = run_both("pop", [free, ref_count, out], lambda fn, a: fn(a[0], top, a[1], a[2]))
    if result[0] == "ok":
        assert out_after.tolist() == free[top - num : top][::-1].tolist()
        assert (ref_after[out_after.astype(np.int64)] == 1).all()


@given(
    st.lists(st.integers(0, 3), min_size=NUM_PAGES, max_size=NUM_PAGES),
    st.lists(st.booleans(), min_size=NUM_PAGES, max_size=NUM_PAGES),
    st.permutations(range(NUM_PAGES + 1)),
    st.integers(0, NUM_PAGES),
    st.booleans(),
    st.sampled_from(["int64", "uint32 view", "reversed"]),
)
def test_release_equals_the_definition(
    refs: list[int], hashed: list[bool], order: list[int], num: int, caching: bool, kind: str
) -> None:
    ref_count = np.array(refs, dtype=np.int32)
    # The free stack holds the unreferenced pages; page 12 (out of range) may come up in `pages`.
    unreferenced = [p for p in range(NUM_PAGES) if refs[p] == 0]
    free = np.array(unreferenced + [-1] * (NUM_PAGES - len(unreferenced)), dtype=np.int64)
    is_hashed = np.array(hashed, dtype=np.bool_)
    ids = order[:num]
    table = np.array([[*ids, 7, 7]], dtype=np.uint32)  # a block-table row, as free() passes it
    pages = {
        "int64": np.array(ids, dtype=np.int64),
        "uint32 view": table[0, :num],
        "reversed": table[0, :num][::-1],
    }[kind]
    cached_out = np.full(max(num, 1), -5, dtype=np.int64)
    result, (free_after, ref_after, _, cached_after) = run_both(
        "release",
        [free, ref_count, is_hashed, cached_out],
        lambda fn, a: fn(a[0], len(unreferenced), a[1], a[2] if caching else None, pages, a[3] if caching else None),
    )
    if result[0] != "ok":
        return
    given_order = [int(p) for p in pages]
    released_now = [p for p in given_order if refs[p] == 1]
    to_cache = [p for p in released_now if caching and hashed[p]]
    to_free = [p for p in released_now if p not in to_cache]
    assert result[1] == (len(released_now), len(to_free))
    assert cached_after[: len(to_cache)].tolist() == to_cache
    top = len(unreferenced) + len(to_free)
    assert free_after[len(unreferenced) : top][::-1].tolist() == to_free  # the first released on top
    assert ref_after.tolist() == [r - (p in given_order) for p, r in enumerate(refs)]


def test_release_rejects_a_page_without_references_and_changes_nothing() -> None:
    free = np.array([5, -1, -1], dtype=np.int64)
    ref_count = np.array([1, 1, 0], dtype=np.int32)
    for fn in (native.release, page_ops.release_py):
        refs = ref_count.copy()
        with pytest.raises(ValueError, match="no reference"):
            fn(free, 1, refs, None, np.array([0, 2], dtype=np.int64), None)
        assert refs.tolist() == [1, 1, 0]


@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=6),
    st.sampled_from([np.int64, np.uint32]),
    st.integers(1, 5),
    st.integers(-1, 30),
    st.integers(0, 30),
    st.booleans(),
)
def test_page_slots_equals_the_definition(
    page_ids: list[int], dtype: Any, size: int, offset: int, count: int, reverse: bool
) -> None:
    pages = np.array(page_ids, dtype=dtype)
    if reverse:
        pages = pages[::-1]
    out = np.full(count, -7, dtype=np.int64)
    result, (out_after,) = run_both("page_slots", [out], lambda fn, a: fn(pages, offset, size, a[0]))
    if result[0] == "ok":
        ids = [int(p) for p in pages]
        assert out_after.tolist() == [ids[(offset + i) // size] * size + (offset + i) % size for i in range(count)]


def test_page_slots_of_a_long_prompt_across_partial_pages() -> None:
    pages = np.array([9, 3, 7, 1], dtype=np.uint32)
    out = np.full(9, -1, dtype=np.int64)
    native.page_slots(pages, 3, 4, out)  # positions 3..11 of pages of 4: the tail of 9, all of 3, of 7
    assert out.tolist() == [39, 12, 13, 14, 15, 28, 29, 30, 31]
