"""The LRU list of cached pages (registered in the prefix index, unreferenced): a doubly linked list
in an int32 array [num_pages + 1, 2] of (previous, next) links, O(1) per page, no Python objects.
Row num_pages is the head: its next is the oldest page, its previous the newest.

One definition, compiled by setup.py with Cython (pure-Python mode) and run unchanged as plain
Python where it is not built; lru.pxd declares what prefix_index.py calls from C.
"""

from typing import Optional

import cython
import numpy as np

COMPILED: bool = cython.compiled  # True in the build setup.py compiles, False run as plain Python


def new_lru(num_pages: int) -> np.ndarray:
    """An empty LRU list: int32 [num_pages + 1, 2] of (previous, next) links; row num_pages is the
    head, whose next is the oldest page and whose previous is the newest."""
    lru = np.zeros((num_pages + 1, 2), dtype=np.int32)
    lru[num_pages] = num_pages
    return lru


def lru_pages(lru: np.ndarray) -> list[int]:
    """The pages in the list, oldest first."""
    head = len(lru) - 1
    pages, page = [], int(lru[head, 1])
    while page != head:
        pages.append(page)
        page = int(lru[page, 1])
    return pages


@cython.ccall
@cython.boundscheck(False)  # the pages are checked to be < head, and every link in the list is
@cython.wraparound(False)
def lru_push(lru: cython.int[:, ::1], pages: cython.const_longlong[::1]) -> None:
    """Append `pages` (not in the list) as the newest, in order."""
    head: cython.Py_ssize_t = check_lru(lru)
    _check_pages(pages, head)
    i: cython.Py_ssize_t
    newest: cython.int
    for i in range(len(pages)):
        newest = lru[head, 0]
        lru[newest, 1] = pages[i]
        lru[pages[i], 0] = newest
        lru[pages[i], 1] = head
        lru[head, 0] = pages[i]


@cython.boundscheck(False)
@cython.wraparound(False)
def lru_remove(lru: cython.int[:, ::1], pages: cython.const_longlong[::1]) -> None:
    """Unlink `pages` (all in the list)."""
    _check_pages(pages, check_lru(lru))
    i: cython.Py_ssize_t
    before: cython.int
    after: cython.int
    for i in range(len(pages)):
        before, after = lru[pages[i], 0], lru[pages[i], 1]
        lru[before, 1] = after
        lru[after, 0] = before


@cython.ccall
@cython.boundscheck(False)  # every page is checked against the list's head and ref_count
@cython.wraparound(False)
def acquire(
    lru: cython.int[:, ::1],
    ref_count: cython.int[::1],
    pages: list,
    out: Optional[cython.uint[::1]],  # noqa: UP045 (cython types have no `|` in plain Python)
) -> cython.Py_ssize_t:
    """One more reference to each of `pages` (distinct, registered), and the cached ones (no
    reference before) unlinked from the LRU; with `out`, also written to out[:len(pages)] (a
    block-table row). Returns how many were cached."""
    head: cython.Py_ssize_t = check_lru(lru)
    n: cython.Py_ssize_t = len(pages)
    if out is not None and len(out) < n:
        raise ValueError("out is shorter than pages")
    i: cython.Py_ssize_t
    page: cython.Py_ssize_t
    for i in range(n):
        page = pages[i]
        if not (0 <= page < head and page < len(ref_count)):
            raise IndexError("page out of range")
    num: cython.Py_ssize_t = 0
    before: cython.int
    after: cython.int
    for i in range(n):
        page = pages[i]
        if ref_count[page] == 0:
            before, after = lru[page, 0], lru[page, 1]
            lru[before, 1] = after
            lru[after, 0] = before
            num += 1
        ref_count[page] += 1
        if out is not None:
            out[i] = page
    return num


@cython.ccall
def check_lru(lru: cython.int[:, ::1]) -> cython.Py_ssize_t:
    """The head of the list: its last row."""
    if lru.shape[0] < 1 or lru.shape[1] != 2:
        raise ValueError("lru must be an int32 array of shape [num_pages + 1, 2]")
    return lru.shape[0] - 1


@cython.cfunc
def _check_pages(pages: cython.const_longlong[::1], num_pages: cython.Py_ssize_t) -> None:
    i: cython.Py_ssize_t
    for i in range(len(pages)):
        if not 0 <= pages[i] < num_pages:
            raise IndexError("page out of range")
