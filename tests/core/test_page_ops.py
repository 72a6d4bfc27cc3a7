"""The allocation loops (service/core/page_ops.py, compiled) against plain statements of what they do:
the results, the arrays afterwards, and an error with nothing changed on bad input."""

import sys
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from service.core import page_ops

NUM_PAGES = 12


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except (ValueError, IndexError) as exc:
        return type(exc).__name__, None


def run(arrays: list[np.ndarray], call: Callable[[list[np.ndarray]], Any]) -> Any:
    """call(copies of arrays); a failed call must leave every array as it was. Returns the outcome
    with the arrays afterwards."""
    copies = [a.copy() for a in arrays]
    result = outcome(call, copies)
    if result[0] != "ok":
        for after, before in zip(copies, arrays):
            assert np.array_equal(after, before), "a failed call changed an array"
    return result, copies


@st.composite
def stacks(draw: st.DrawFn) -> tuple[np.ndarray, int, np.ndarray]:
    """A free stack (some pages of 0..11, the rest of the array garbage) and ref counts."""
    free_pages = draw(st.permutations(range(NUM_PAGES)))[: draw(st.integers(0, NUM_PAGES))]
    free = np.array(free_pages + [draw(st.integers(-3, 20)) for _ in range(NUM_PAGES - len(free_pages))])
    ref_count = np.array(draw(st.lists(st.integers(0, 3), min_size=NUM_PAGES, max_size=NUM_PAGES)), dtype=np.int32)
    return free.astype(np.int64), len(free_pages), ref_count


@given(stacks(), st.integers(0, NUM_PAGES + 1), st.sampled_from([np.int64, np.uint32]), st.integers(-1, 2))
def test_pop_takes_the_top_of_the_stack(stack: Any, num: int, dtype: Any, top_shift: int) -> None:
    free, top, ref_count = stack
    top = top + top_shift  # also a top past the pages (garbage ids) or past the array
    out = np.full(num, 99, dtype=dtype)
    result, (_, ref_after, out_after) = run([free, ref_count, out], lambda a: page_ops.pop(a[0], top, a[1], a[2]))
    taken = free[max(top - num, 0) : top][::-1].tolist()
    valid = 0 <= num <= top <= len(free) and all(0 <= p < NUM_PAGES for p in taken)
    assert result[0] == ("ok" if valid else "ValueError" if not 0 <= num <= top <= len(free) else "IndexError")
    if valid:
        assert out_after.tolist() == taken
        assert ref_after.tolist() == [1 if p in taken else n for p, n in enumerate(ref_count.tolist())]


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
def test_release_drops_one_reference_and_frees_or_caches_the_unreferenced(r: dict[str, Any]) -> None:
    refs, hashed, ids, num = r["refs"], r["hashed"], r["ids"], len(r["ids"])
    table = np.array([[*ids, 7, 7]], dtype=np.uint32)  # a block-table row, as free() passes it
    pages = {
        "int64": np.array(ids, dtype=np.int64),
        "uint32 view": table[0, :num],
        "reversed": table[0, :num][::-1],
        "strided int64": np.array([x for p in ids for x in (p, -9)], dtype=np.int64)[::2],
    }[r["kind"]]
    caching = r["caching"] == "on"

    def call(a: list[np.ndarray]) -> Any:
        hashed_arg = a[2] if r["caching"] != "off" else None  # without cached_out: no caching
        return page_ops.release(a[0], r["top"], a[1], hashed_arg, pages, a[3] if caching else None)

    cached_out = np.full(r["cached_len"], -5, dtype=np.int64)
    arrays = [r["free"], np.array(refs, dtype=np.int32), np.array(hashed, dtype=np.bool_), cached_out]
    result, (free_after, ref_after, _, cached_after) = run(arrays, call)
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
    refs = ref_count.copy()
    with pytest.raises(ValueError, match="no reference"):
        page_ops.release(free, 1, refs, None, np.array([0, 2], dtype=np.int64), None)
    assert refs.tolist() == [1, 1, 0]


@pytest.mark.parametrize("count", [1, 2])
def test_release_rejects_a_page_given_twice_and_writes_nowhere(count: int) -> None:
    """A page twice in `pages` would reach zero references twice: the free stack must not move."""
    big = np.array([111, -1, -1, -1, -1], dtype=np.int64)  # free = big[1:], top 0
    refs = np.array([count, 0, 0], dtype=np.int32)
    cached = np.full(2, -5, dtype=np.int64)
    with pytest.raises(ValueError, match="twice"):
        page_ops.release(big[1:], 0, refs, np.ones(3, dtype=np.bool_), np.array([0, 0], dtype=np.int64), cached)
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
def test_page_slots_numbers_consecutive_positions(
    page_ids: list[int], dtype: Any, size: int, offset: int, count: int, reverse: bool
) -> None:
    pages = np.array(page_ids, dtype=dtype)
    if reverse:
        pages = pages[::-1]
    out = np.full(count, -7, dtype=np.int64)
    result, (out_after,) = run([out], lambda a: page_ops.page_slots(pages, offset, size, a[0]))
    valid = offset >= 0 and (count == 0 or (offset + count - 1) // size < len(pages))
    assert result[0] == ("ok" if valid else "ValueError")
    if valid:
        ids = [int(p) for p in pages]
        assert out_after.tolist() == [ids[(offset + i) // size] * size + (offset + i) % size for i in range(count)]


def test_page_slots_of_a_long_prompt_across_partial_pages() -> None:
    pages = np.array([9, 3, 7, 1], dtype=np.uint32)
    out = np.full(9, -1, dtype=np.int64)
    page_ops.page_slots(pages, 3, 4, out)  # positions 3..11 of pages of 4: the tail of 9, all of 3, of 7
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
    if not page_ops.COMPILED:
        pytest.skip("the typed arguments of the compiled build check this; plain Python does not")
    free, ref_count = np.arange(6, dtype=np.int64), np.zeros(6, dtype=np.int32)
    with pytest.raises(ValueError):
        page_ops.pop(free, 6, ref_count, bad)
    with pytest.raises(ValueError):
        page_ops.page_slots(np.arange(4, dtype=np.uint32), 0, 2, bad)
    read_only = np.zeros(4, dtype=np.int64)
    read_only.flags.writeable = False
    with pytest.raises(ValueError):
        page_ops.pop(free, 6, ref_count, read_only)
    assert ref_count.tolist() == [0] * 6 and free.tolist() == list(range(6))


@pytest.mark.parametrize("offset", [sys.maxsize, sys.maxsize - 1, sys.maxsize // 2])
def test_page_slots_rejects_positions_past_the_pages_without_overflowing(offset: int) -> None:
    out = np.full(3, -1, dtype=np.int64)
    with pytest.raises(ValueError, match="run past"):
        page_ops.page_slots(np.array([1, 2], dtype=np.uint32), offset, 3, out)
    assert out.tolist() == [-1, -1, -1]


@pytest.mark.parametrize("size", [0, -4])
def test_page_slots_rejects_a_page_size_below_one(size: int) -> None:
    with pytest.raises(ValueError):
        page_ops.page_slots(np.array([1, 2], dtype=np.uint32), 0, size, np.empty(2, dtype=np.int64))
