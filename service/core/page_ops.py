# mypy: disable-error-code="valid-type,index"
# (mypy reads page_t, a Cython fused type, as a variable, not a type.)
"""The per-page loops of allocation: popping pages off the free stack, releasing references, and
numbering the slots of consecutive positions.

This file is the one definition: setup.py compiles it with Cython (pure-Python mode, so the type
annotations below become C types), and it runs unchanged as plain Python where it is not built.
Every function checks all of its input before it writes anything, so a failure changes nothing.
Compiled, the typed arguments also reject arrays of another dtype, shape or layout (ValueError).

Arrays: free int64 [num_pages] (a stack, the top at free[top - 1]); ref_count int32 [num_pages];
is_hashed bool [num_pages]; pages uint32 (a block-table row) or int64, 1-D, any stride.
"""

from typing import Optional

import cython
import numpy as np

COMPILED: bool = cython.compiled  # True in the build setup.py compiles, False run as plain Python

# A page id as a block table holds it (uint32) or as the allocator hands it out (int64). Public
# functions take such arrays untyped and pick the specialisation by itemsize: a fused `def` would
# dispatch on the dtype at every call, which costs more than popping a prompt's pages.
page_t = cython.fused_type(cython.uint, cython.longlong)


@cython.ccall
@cython.boundscheck(False)  # the pages read are those in [top - len(out), top), checked to lie in free
def pop(free: cython.longlong[::1], top: cython.Py_ssize_t, ref_count: cython.int[::1], out: np.ndarray) -> None:
    """Pop len(out) pages off the stack of `top` pages into out (C-contiguous int64 or uint32), the
    top first, each with ref_count 1. The caller lowers its top by len(out)."""
    num: cython.Py_ssize_t = len(out)
    if not 0 <= num <= top <= len(free):
        raise ValueError(f"cannot pop {num} of {top} free pages")
    i: cython.Py_ssize_t
    for i in range(top - num, top):
        if not 0 <= free[i] < len(ref_count):
            raise IndexError("page out of range")
    if out.itemsize == 4:
        out32: cython.uint[::1] = out
        _pop_into(free, top, ref_count, out32)
    else:
        out64: cython.longlong[::1] = out
        _pop_into(free, top, ref_count, out64)


@cython.cfunc
@cython.boundscheck(False)  # pop() checked top, len(out) and every page
@cython.wraparound(False)
def _pop_into(free: cython.longlong[::1], top: cython.Py_ssize_t, ref_count: cython.int[::1], out: page_t[::1]) -> None:
    i: cython.Py_ssize_t
    page: cython.longlong
    for i in range(len(out)):
        page = free[top - 1 - i]
        out[i] = page
        ref_count[page] = 1


@cython.ccall
def release(
    free: cython.longlong[::1],
    top: cython.Py_ssize_t,
    ref_count: cython.int[::1],
    is_hashed: Optional[cython.uchar[::1]],  # noqa: UP045 (cython types have no `|` in plain Python)
    pages: np.ndarray,
    cached_out: Optional[cython.longlong[::1]],  # noqa: UP045
) -> tuple[int, int]:
    """Drop one reference to each of `pages` (distinct, each referenced), in order; changes nothing
    on a bad page. Pages left unreferenced go, in that order, to cached_out when is_hashed (given
    with cached_out) marks them, else onto the free stack above `top`, pushed so that the first of
    them is popped next. Returns (unreferenced, pushed free); the caller raises its top by the
    second and links cached_out[:first - second] into its LRU."""
    if pages.itemsize == 4:
        pages32: cython.uint[:] = pages
        return _release(free, top, ref_count, is_hashed, pages32, cached_out)
    pages64: cython.longlong[:] = pages
    return _release(free, top, ref_count, is_hashed, pages64, cached_out)


@cython.cfunc
@cython.boundscheck(False)  # every index is checked first: top, the pages, the room for them
@cython.wraparound(False)
def _release(
    free: cython.longlong[::1],
    top: cython.Py_ssize_t,
    ref_count: cython.int[::1],
    is_hashed: Optional[cython.uchar[::1]],  # noqa: UP045 (cython types have no `|` in plain Python)
    pages: page_t[:],
    cached_out: Optional[cython.longlong[::1]],  # noqa: UP045
) -> tuple[int, int]:
    caching: cython.bint = is_hashed is not None and cached_out is not None
    num_pages: cython.Py_ssize_t = len(ref_count)
    if not 0 <= top <= len(free) or (caching and len(is_hashed) != num_pages):  # type: ignore[arg-type]
        raise ValueError("free, top, ref_count and is_hashed disagree")
    n: cython.Py_ssize_t = len(pages)
    i: cython.Py_ssize_t
    page: cython.longlong
    for i in range(n):
        if not 0 <= pages[i] < num_pages:
            raise IndexError("page out of range")
    # Each page's count is negated while it is checked, so that a page given twice shows up as a
    # negative count; the counts are restored before anything else happens.
    to_free: cython.Py_ssize_t = 0
    to_cache: cython.Py_ssize_t = 0
    checked: cython.Py_ssize_t = 0
    problem = ""
    while checked < n and not problem:
        page = pages[checked]
        if ref_count[page] < 0:
            problem = "a page is given twice"
        elif ref_count[page] == 0:
            problem = "releasing a page that has no reference"
        else:
            if ref_count[page] == 1 and caching and is_hashed[page]:
                to_cache += 1
            elif ref_count[page] == 1:
                to_free += 1
            ref_count[page] = -ref_count[page]
            checked += 1
    for i in range(checked):  # the pages negated above are distinct
        ref_count[pages[i]] = -ref_count[pages[i]]
    if problem:
        raise ValueError(problem)
    if top + to_free > len(free) or (caching and to_cache > len(cached_out)):  # type: ignore[arg-type]
        raise ValueError("no room for the released pages")
    # The k-th page freed (in release order) lands at free[top + to_free - 1 - k]: the first on top.
    k_free: cython.Py_ssize_t = 0
    k_cache: cython.Py_ssize_t = 0
    for i in range(n):
        page = pages[i]
        ref_count[page] -= 1
        if ref_count[page] != 0:
            continue
        if caching and is_hashed[page]:
            cached_out[k_cache] = page
            k_cache += 1
        else:
            free[top + to_free - 1 - k_free] = page
            k_free += 1
    return to_free + to_cache, to_free


@cython.cclass
class FreeStack:
    """An allocator's free stack and reference counts (`free` and `ref_count` of pop() and release(),
    arrays the allocator keeps and never replaces), held as typed memoryviews: compiled, each call
    acquires only the buffers of its own arguments. Acquiring a buffer costs about 0.1 us, as much as
    popping or releasing a prompt's 16 pages of 256 tokens."""

    _free: cython.longlong[::1]
    _ref_count: cython.int[::1]
    _arrays: tuple  # (free, ref_count) as given

    def __init__(self, free: np.ndarray, ref_count: np.ndarray) -> None:
        self._free = free
        self._ref_count = ref_count
        self._arrays = (free, ref_count)

    def __reduce__(self) -> tuple:
        # copy.deepcopy of an allocator: the copy's stack views the copy's arrays (deepcopy's memo).
        return (FreeStack, self._arrays)

    def pop(self, top: cython.Py_ssize_t, out: np.ndarray) -> None:
        """pop(free, top, ref_count, out)."""
        pop(self._free, top, self._ref_count, out)

    def release(
        self,
        top: cython.Py_ssize_t,
        is_hashed: Optional[cython.uchar[::1]],  # noqa: UP045
        pages: np.ndarray,
        cached_out: Optional[cython.longlong[::1]],  # noqa: UP045
    ) -> tuple[int, int]:
        """release(free, top, ref_count, is_hashed, pages, cached_out)."""
        return release(self._free, top, self._ref_count, is_hashed, pages, cached_out)


def page_slots(
    pages: np.ndarray, offset: cython.Py_ssize_t, page_size: cython.Py_ssize_t, out: cython.longlong[::1]
) -> None:
    """out[i] = the slot (page * page_size + offset within it) of position offset + i, counted from
    the start of pages[0] and running on through the following pages."""
    count: cython.Py_ssize_t = len(out)
    # The last position's page, offset // page_size + (offset % page_size + count - 1) // page_size,
    # computed so that a huge offset cannot overflow.
    if page_size <= 0 or offset < 0:
        raise ValueError("the positions run past the pages given")
    if count and offset // page_size + (offset % page_size + count - 1) // page_size >= len(pages):
        raise ValueError("the positions run past the pages given")
    if count == 0:
        return
    if pages.itemsize == 4:
        pages32: cython.uint[:] = pages
        _page_slots(pages32, offset, page_size, out)
    else:
        pages64: cython.longlong[:] = pages
        _page_slots(pages64, offset, page_size, out)


@cython.cfunc
@cython.boundscheck(False)  # page_slots() checked that the positions stay within the pages
@cython.wraparound(False)
def _page_slots(
    pages: page_t[:], offset: cython.Py_ssize_t, page_size: cython.Py_ssize_t, out: cython.longlong[::1]
) -> None:
    page: cython.Py_ssize_t = offset // page_size
    within: cython.Py_ssize_t = offset % page_size  # the first position's offset in its page
    i: cython.Py_ssize_t = 0
    k: cython.Py_ssize_t
    on_page: cython.Py_ssize_t
    base: cython.longlong
    while i < len(out):  # a page at a time: the inner loop vectorises
        base = cython.cast(cython.longlong, pages[page]) * page_size + within
        on_page = min(page_size - within, len(out) - i)
        for k in range(on_page):
            out[i + k] = base + k
        i += on_page
        within = 0
        page += 1
