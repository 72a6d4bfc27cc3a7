"""The compiled allocation loops (service/core/_pages.c) against their Python definitions (page_ops.py):
the same results, the same arrays afterwards, and the same error (with nothing changed) on bad input."""

import sys
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


@st.composite
def releases(draw: st.DrawFn) -> dict[str, Any]:
    """A release call: ref counts, hashed flags, the free stack of the unreferenced pages, and pages to
    release (page 12 is out of range; a page may come twice), sometimes with a wrong top, a free stack
    with no room or a short cached_out."""
    refs = draw(st.lists(st.integers(0, 3), min_size=NUM_PAGES, max_size=NUM_PAGES))
    unreferenced = [p for p in range(NUM_PAGES) if refs[p] == 0]
    ids = draw(st.permutations(range(NUM_PAGES + 1)))[: draw(st.integers(0, NUM_PAGES))]
    if ids and draw(st.booleans()):
        ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from(ids)))
    room = draw(st.sampled_from([NUM_PAGES, len(unreferenced)]))  # the second: a full stack
    return {
        "refs": refs,
        "hashed": draw(st.lists(st.booleans(), min_size=NUM_PAGES, max_size=NUM_PAGES)),
        "unreferenced": unreferenced,
        "free": np.array(unreferenced + [-1] * (room - len(unreferenced)), dtype=np.int64),
        "top": len(unreferenced) + draw(st.sampled_from([0, 0, 0, -1 - len(unreferenced), NUM_PAGES])),
        "ids": ids,
        "cached_len": draw(st.sampled_from([len(ids), max(len(ids) - 1, 0)])),
        "caching": draw(st.sampled_from(["on", "off", "is_hashed only"])),
        "kind": draw(st.sampled_from(["int64", "uint32 view", "reversed", "strided int64"])),
    }


@given(releases())
def test_release_equals_the_definition(r: dict[str, Any]) -> None:
    refs, hashed, ids, num = r["refs"], r["hashed"], r["ids"], len(r["ids"])
    table = np.array([[*ids, 7, 7]], dtype=np.uint32)  # a block-table row, as free() passes it
    pages = {
        "int64": np.array(ids, dtype=np.int64),
        "uint32 view": table[0, :num],
        "reversed": table[0, :num][::-1],
        "strided int64": np.array([x for p in ids for x in (p, -9)], dtype=np.int64)[::2],
    }[r["kind"]]
    caching = r["caching"] == "on"

    def call(fn: Callable[..., Any], a: list[np.ndarray]) -> Any:
        hashed_arg = a[2] if r["caching"] != "off" else None  # without cached_out: no caching
        return fn(a[0], r["top"], a[1], hashed_arg, pages, a[3] if caching else None)

    cached_out = np.full(r["cached_len"], -5, dtype=np.int64)
    arrays = [r["free"], np.array(refs, dtype=np.int32), np.array(hashed, dtype=np.bool_), cached_out]
    result, (free_after, ref_after, _, cached_after) = run_both("release", arrays, call)
    given_order = [int(p) for p in pages]
    released_now = [p for p in given_order if p < NUM_PAGES and refs[p] == 1]
    to_cache = [p for p in released_now if caching and hashed[p]]
    to_free = [p for p in released_now if p not in to_cache]
    valid = (
        0 <= r["top"] <= len(r["free"])  # the call cannot know the true top, only its bounds
        and NUM_PAGES not in given_order
        and len(set(given_order)) == num
        and all(refs[p] for p in given_order)
        and r["top"] + len(to_free) <= len(r["free"])
        and len(to_cache) <= r["cached_len"]
    )
    assert (result[0] == "ok") == valid
    if not valid:
        return
    assert result[1] == (len(released_now), len(to_free))
    assert cached_after[: len(to_cache)].tolist() == to_cache
    top = r["top"] + len(to_free)
    assert free_after[r["top"] : top][::-1].tolist() == to_free  # the first released on top
    assert ref_after.tolist() == [n - (p in given_order) for p, n in enumerate(refs)]


def test_release_rejects_a_page_without_references_and_changes_nothing() -> None:
    free = np.array([5, -1, -1], dtype=np.int64)
    ref_count = np.array([1, 1, 0], dtype=np.int32)
    for fn in (native.release, page_ops.release_py):
        refs = ref_count.copy()
        with pytest.raises(ValueError, match="no reference"):
            fn(free, 1, refs, None, np.array([0, 2], dtype=np.int64), None)
        assert refs.tolist() == [1, 1, 0]


@pytest.mark.parametrize("count", [1, 2])
def test_release_rejects_a_page_given_twice_and_writes_nowhere(count: int) -> None:
    """A page twice in `pages` would reach zero references twice: the free stack must not move."""
    for fn in (native.release, page_ops.release_py):
        big = np.array([111, -1, -1, -1, -1], dtype=np.int64)  # free = big[1:], top 0
        refs = np.array([count, 0, 0], dtype=np.int32)
        cached = np.full(2, -5, dtype=np.int64)
        with pytest.raises(ValueError, match="twice"):
            fn(big[1:], 0, refs, np.ones(3, dtype=np.bool_), np.array([0, 0], dtype=np.int64), cached)
        assert big.tolist() == [111, -1, -1, -1, -1] and refs.tolist() == [count, 0, 0]
        assert cached.tolist() == [-5, -5]


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


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((2, 2), dtype=np.int64),  # 2-D
        np.zeros(4, dtype=np.int32),  # not int64 / uint32
        np.zeros(4, dtype=np.float64),
        np.zeros(8, dtype=np.int64)[::2],  # not contiguous
    ],
)
def test_the_compiled_loops_reject_arrays_of_the_wrong_kind_and_change_nothing(bad: np.ndarray) -> None:
    free, ref_count = np.arange(6, dtype=np.int64), np.zeros(6, dtype=np.int32)
    with pytest.raises(ValueError):
        native.pop(free, 6, ref_count, bad)
    with pytest.raises(ValueError):
        native.page_slots(np.arange(4, dtype=np.uint32), 0, 2, bad)
    read_only = np.zeros(4, dtype=np.int64)
    read_only.flags.writeable = False
    with pytest.raises(ValueError):
        native.pop(free, 6, ref_count, read_only)
    assert ref_count.tolist() == [0] * 6 and free.tolist() == list(range(6))


@pytest.mark.parametrize("offset", [sys.maxsize, sys.maxsize - 1, sys.maxsize // 2])
def test_page_slots_rejects_positions_past_the_pages_without_overflowing(offset: int) -> None:
    for fn in (native.page_slots, page_ops.page_slots_py):
        out = np.full(3, -1, dtype=np.int64)
        with pytest.raises(ValueError, match="run past"):
            fn(np.array([1, 2], dtype=np.uint32), offset, 3, out)
        assert out.tolist() == [-1, -1, -1]


@pytest.mark.parametrize("size", [0, -4])
def test_page_slots_rejects_a_page_size_below_one(size: int) -> None:
    for fn in (native.page_slots, page_ops.page_slots_py):
        with pytest.raises(ValueError):
            fn(np.array([1, 2], dtype=np.uint32), 0, size, np.empty(2, dtype=np.int64))
