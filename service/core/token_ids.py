"""Token ids as little-endian int64 bytes: what the prefix index's keys and the page hashes are over.

One definition, compiled by setup.py with Cython (pure-Python mode) and run unchanged as plain
Python where it is not built.
"""

from collections.abc import Sequence

import cython
import numpy as np

COMPILED: bool = cython.compiled  # True in the build setup.py compiles, False run as plain Python


@cython.boundscheck(False)  # i < n == len(out)
@cython.wraparound(False)
def int64_bytes(token_ids: Sequence[int], start: cython.Py_ssize_t = 0, stop: cython.Py_ssize_t = -1) -> bytes:
    """token_ids[start:stop] (stop -1: to the end; clipped like a slice) as little-endian int64 bytes
    (what page hashes and the prefix index are over): TypeError for an id that is not an int,
    OverflowError for one outside int64. A list is read in place, without a slice; a 1-D numpy
    integer array (what an engine holding its token ids in numpy passes) is copied as a block."""
    n: cython.Py_ssize_t = len(token_ids)
    stop = n if stop < 0 or stop > n else stop
    start = min(max(start, 0), stop)
    if isinstance(token_ids, np.ndarray):
        return _array_bytes(token_ids[start:stop])
    out = bytes(8 * (stop - start))  # new and unshared: filled here, then handed out
    i: cython.Py_ssize_t
    if not cython.compiled:
        ids = token_ids[start:stop]
        for token in ids:
            if not isinstance(token, int):
                raise TypeError(f"token ids must be ints, not {type(token).__name__}")
        return np.array(ids, dtype=np.int64).tobytes() if ids else out  # OverflowError outside int64
    op: cython.p_longlong = cython.cast(cython.p_longlong, cython.cast(cython.p_char, out))
    if type(token_ids) is list:
        ids_list: list = token_ids
        for i in range(start, stop):
            token = ids_list[i]
            if not isinstance(token, int):
                raise TypeError(f"token ids must be ints, not {type(token).__name__}")
            op[i - start] = token  # OverflowError outside int64
        return out
    for i in range(start, stop):
        token = token_ids[i]
        if not isinstance(token, int):
            raise TypeError(f"token ids must be ints, not {type(token).__name__}")
        op[i - start] = token
    return out


def _array_bytes(ids: np.ndarray) -> bytes:
    """A 1-D integer array as int64 bytes; TypeError for another dtype, OverflowError outside int64."""
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TypeError(f"token ids must be a 1-D integer array, not {ids.ndim}-D {ids.dtype}")
    if ids.dtype.kind == "u" and ids.itemsize == 8 and len(ids) and int(ids.max()) >= 1 << 63:
        raise OverflowError("a token id is outside int64")
    return ids.astype("<i8", copy=False).tobytes()
