"""The per-page loops of allocation: popping pages off the free stack, releasing references, and
numbering the slots of consecutive positions.

service/core/_pages.c runs them (setup.py builds it at install); the *_py functions below are their
definitions, the fallback when it is not built, and the tests' oracle. A 4,096-token prompt is 256
pages and 4,096 slots: a few numpy calls each, which cost more than the loops themselves.

Arrays: free int64 [num_pages] (a stack, the top at free[top - 1]); ref_count int32 [num_pages];
is_hashed bool [num_pages]; pages uint32 (a block-table row) or int64, 1-D, any stride.
"""

import importlib
from types import ModuleType

import numpy as np


def pop_py(free: np.ndarray, top: int, ref_count: np.ndarray, out: np.ndarray) -> None:
    """Pop len(out) pages off the stack of `top` pages into out (C-contiguous int64 or uint32), the
    top first, each with ref_count 1. The caller lowers its top by len(out)."""
    num = len(out)
    if not 0 <= num <= top <= len(free):
        raise ValueError(f"cannot pop {num} of {top} free pages")
    pages = free[top - num : top][::-1]
    if ((pages < 0) | (pages >= len(ref_count))).any():
        raise IndexError("page out of range")
    out[:] = pages
    ref_count[pages] = 1


def release_py(
    free: np.ndarray,
    top: int,
    ref_count: np.ndarray,
    is_hashed: np.ndarray | None,
    pages: np.ndarray,
    cached_out: np.ndarray | None,
) -> tuple[int, int]:
    """Drop one reference to each of `pages` (distinct, each referenced), in order; changes nothing
    on a bad page. Pages left unreferenced go, in that order, to
    cached_out when is_hashed (given with cached_out) marks them, else onto the free stack above
    `top`, pushed so that the first of them is popped next. Returns (unreferenced, pushed free);
    the caller raises its top by the second and links cached_out[:first - second] into its LRU."""
    caching = is_hashed is not None and cached_out is not None
    if not 0 <= top <= len(free) or (caching and len(is_hashed) != len(ref_count)):  # type: ignore[arg-type]
        raise ValueError("free, top, ref_count and is_hashed disagree")
    ids = np.asarray(pages, dtype=np.int64)
    if ((ids < 0) | (ids >= len(ref_count))).any():
        raise IndexError("page out of range")
    if len(np.unique(ids)) != len(ids):
        raise ValueError("a page is given twice")
    counts = ref_count[ids] - 1
    if (counts < 0).any():
        raise ValueError("releasing a page that has no reference")
    zero = ids[counts == 0]
    hashed = is_hashed[zero] if caching else np.zeros(len(zero), dtype=np.bool_)  # type: ignore[index]
    cached, freed = zero[hashed], zero[~hashed]
    if top + len(freed) > len(free) or (caching and len(cached) > len(cached_out)):  # type: ignore[arg-type]
        raise ValueError("no room for the released pages")
    ref_count[ids] = counts
    if caching:
        cached_out[: len(cached)] = cached  # type: ignore[index]
    free[top : top + len(freed)] = freed[::-1]
    return len(zero), len(freed)


def page_slots_py(pages: np.ndarray, offset: int, page_size: int, out: np.ndarray) -> None:
    """out[i] = the slot (page * page_size + offset within it) of position offset + i, counted from
    the start of pages[0] and running on through the following pages."""
    if page_size <= 0 or offset < 0 or (len(out) and (offset + len(out) - 1) // page_size >= len(pages)):
        raise ValueError("the positions run past the pages given")
    pos = np.arange(offset, offset + len(out), dtype=np.int64)
    out[:] = np.asarray(pages, dtype=np.int64)[pos // page_size] * page_size + pos % page_size


native: ModuleType | None
try:
    native = importlib.import_module("service.core._pages")
except ImportError:  # not built: the definitions above do the work
    native = None

pop = pop_py if native is None else native.pop
release = release_py if native is None else native.release
page_slots = page_slots_py if native is None else native.page_slots
