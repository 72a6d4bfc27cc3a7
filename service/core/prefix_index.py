"""The per-page loops of the prefix cache: commit (chained SHA-256 + registration), match, evict,
the LRU list, and the int64 conversion of token ids.

This file is the one definition: setup.py compiles it with Cython (pure-Python mode), and it runs
unchanged as plain Python where it is not built. SHA-256 is OpenSSL's (called directly when
compiled, through hashlib otherwise); the probe hash is Python's own hash() of the key bytes.

The index is an open-addressing hash table of page ids, keyed by each registered page's SHA-256
preimage, parent hash || the page's token bytes, so a probe compares the token ids exactly and a
hit computes no SHA-256. Its arrays (new_index() below):
  table     int32 [capacity]: page id or -1; capacity a power of two >= 2 * num_pages; linear
            probing, deletion by backward shift;
  keys      uint8 [num_pages, 32 + page_nbytes]: each registered page's key (None until the first
            commit fixes page_nbytes);
  key_hash  int64 [num_pages]: hash(key), CPython's hash of bytes (SipHash, seeded per process, so
            crafted prompts cannot be made to share a probe run);
  hashes    uint8 [num_pages, 32]: each registered page's hash, sha256(key);
  is_hashed bool [num_pages]: the page is registered.
The LRU of cached pages (registered, unreferenced) is a linked list in an array (new_lru()).
Nothing here keeps Python objects per page, and nothing is for the garbage collector to track.
"""

import hashlib
from collections.abc import Sequence
from typing import Optional

import cython
import numpy as np

COMPILED: bool = cython.compiled  # True in the build setup.py compiles, False run as plain Python

DIGEST = cython.declare(cython.Py_ssize_t, 32)  # bytes of a SHA-256 digest
SHA256_IMPL = "openssl" if cython.compiled else "hashlib"  # both are OpenSSL's SHA-256


def new_index(num_pages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(table, key_hash, hashes, is_hashed) of an empty index; keys come with the first commit."""
    capacity = 1 << max(3, (2 * num_pages - 1).bit_length())
    return (
        np.full(capacity, -1, dtype=np.int32),
        np.zeros(num_pages, dtype=np.int64),
        np.zeros((num_pages, DIGEST), dtype=np.uint8),
        np.zeros(num_pages, dtype=np.bool_),
    )


@cython.cfunc
@cython.boundscheck(False)  # slots are masked into the table, pages in it are < len(key_hash) == len(keys)
@cython.wraparound(False)
def _find(
    table: cython.int[::1], keys: cython.uchar[:, ::1], key_hash: cython.longlong[::1], key: bytes, h: cython.Py_hash_t
) -> cython.Py_ssize_t:
    """The slot holding the page whose key is `key`, or the empty slot that ends its probe run."""
    mask: cython.Py_ssize_t = len(table) - 1
    i: cython.Py_ssize_t = h & mask
    k: cython.Py_ssize_t
    differ: cython.uchar
    page: cython.int
    kp: cython.p_const_uchar = key
    while table[i] >= 0:
        page = table[i]
        if key_hash[page] == h:
            differ = 0
            for k in range(keys.shape[1]):  # no early exit: the compiler vectorises it
                differ |= keys[page, k] ^ kp[k]
            if differ == 0:
                break
        i = (i + 1) & mask
    return i


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _delete(table: cython.int[::1], key_hash: cython.longlong[::1], i: cython.Py_ssize_t) -> None:
    """Empty slot i, shifting later entries of its probe run back (Knuth's algorithm R)."""
    mask: cython.Py_ssize_t = len(table) - 1
    j: cython.Py_ssize_t = i
    home: cython.Py_ssize_t
    page: cython.int
    while True:
        j = (j + 1) & mask
        page = table[j]
        if page < 0:
            break
        home = key_hash[page] & mask
        if (i < home <= j) if i <= j else (i < home or home <= j):
            continue  # its home lies cyclically in (i, j]: it stays
        table[i] = page
        i = j
    table[i] = -1


@cython.cfunc
@cython.inline
def _bytes_of(buf: bytearray) -> bytes:
    """A copy of buf as bytes (a probe needs a hashable key)."""
    if not cython.compiled:
        return bytes(buf)
    p: cython.p_char = buf
    return p[: len(buf)]  # one allocation and copy, no Python objects between


@cython.cfunc
def _check_index(
    table: cython.int[::1], keys: cython.uchar[:, ::1], key_hash: cython.longlong[::1], hashes: cython.uchar[:, ::1]
) -> None:
    num_pages: cython.Py_ssize_t = len(key_hash)
    if len(table) <= num_pages or len(table) & (len(table) - 1):
        raise ValueError("table must be a power-of-two int32 array larger than num_pages")
    if keys.shape[0] != num_pages or hashes.shape[0] != num_pages or hashes.shape[1] != DIGEST:
        raise ValueError("keys, key_hash and hashes disagree on the number of pages")


@cython.boundscheck(False)  # the pages are checked, the data split into whole pages, the arrays by _check_index
@cython.wraparound(False)
def commit(
    table: cython.int[::1],
    keys: cython.uchar[:, ::1],
    key_hash: cython.longlong[::1],
    hashes: cython.uchar[:, ::1],
    is_hashed: cython.uchar[::1],
    pages: cython.const_longlong[::1],
    parent: bytes,
    data: bytes | memoryview,
    page_nbytes: cython.Py_ssize_t,
) -> bytes:
    """Hash pages[i] (token bytes data[i*page_nbytes:(i+1)*page_nbytes]) after its predecessor and
    register it unless it is registered already or another page holds its key (the first committer
    keeps a key). Returns the hash of the last page."""
    raw: bytes = _check(parent, data, page_nbytes)
    _check_index(table, keys, key_hash, hashes)
    if keys.shape[1] != DIGEST + page_nbytes or len(is_hashed) != len(key_hash):
        raise ValueError("keys or is_hashed do not fit the pages")
    _check_pages(pages, len(key_hash))
    if len(pages) > len(raw) // page_nbytes:
        raise ValueError("more pages than data")
    key_len: cython.Py_ssize_t = DIGEST + page_nbytes
    buf = bytearray(key_len)  # the key of the current page: parent hash || its token bytes
    bp: cython.p_uchar = buf
    rp: cython.p_const_uchar = raw
    hp: cython.p_const_uchar
    i: cython.Py_ssize_t
    k: cython.Py_ssize_t
    h: cython.Py_hash_t
    page: cython.longlong
    slot: cython.Py_ssize_t
    for i in range(len(pages)):
        hp = parent
        for k in range(DIGEST):
            bp[k] = hp[k]
        for k in range(page_nbytes):
            bp[DIGEST + k] = rp[i * page_nbytes + k]
        key = _bytes_of(buf)
        parent = _sha256(key)
        page = pages[i]
        if is_hashed[page]:
            continue
        h = hash(key)
        slot = _find(table, keys, key_hash, key, h)
        if table[slot] >= 0:
            continue  # the key is taken
        table[slot] = page
        for k in range(key_len):
            keys[page, k] = bp[k]
        hp = parent
        for k in range(DIGEST):
            hashes[page, k] = hp[k]
        key_hash[page] = h
        is_hashed[page] = True
    return parent


@cython.boundscheck(False)  # as commit: the arrays are checked first, pages come from the table
@cython.wraparound(False)
def match(
    table: cython.int[::1],
    keys: Optional[cython.uchar[:, ::1]],  # noqa: UP045 (cython types have no `|` in plain Python)
    key_hash: cython.longlong[::1],
    hashes: cython.uchar[:, ::1],
    parent: bytes,
    data: bytes | memoryview,
    page_nbytes: cython.Py_ssize_t,
) -> tuple[list[int], bytes]:
    """Registered pages matching the leading pages of `data`, chained from `parent`; stops at the
    first miss. Returns (pages, hash of the last matched page, or `parent`)."""
    raw: bytes = _check(parent, data, page_nbytes)
    pages: list = []
    if keys is None:
        return pages, parent
    _check_index(table, keys, key_hash, hashes)
    if keys.shape[1] != DIGEST + page_nbytes:
        raise ValueError("keys do not fit the pages")
    buf = bytearray(DIGEST + page_nbytes)  # the key of the current page: parent hash || its token bytes
    buf[:DIGEST] = parent
    bp: cython.p_uchar = buf
    rp: cython.p_const_uchar = raw
    i: cython.Py_ssize_t
    k: cython.Py_ssize_t
    page: cython.int
    for i in range(len(raw) // page_nbytes):
        for k in range(page_nbytes):
            bp[DIGEST + k] = rp[i * page_nbytes + k]
        key = _bytes_of(buf)
        page = table[_find(table, keys, key_hash, key, hash(key))]
        if page < 0:
            break
        pages.append(page)
        for k in range(DIGEST):  # the next parent: the matched page's hash
            bp[k] = hashes[page, k]
    return pages, bytes(buf[:DIGEST])


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


@cython.boundscheck(False)  # the pages are checked to be < head, and every link in the list is
@cython.wraparound(False)
def lru_push(lru: cython.int[:, ::1], pages: cython.const_longlong[::1]) -> None:
    """Append `pages` (not in the list) as the newest, in order."""
    head: cython.Py_ssize_t = _check_lru(lru)
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
    _check_pages(pages, _check_lru(lru))
    i: cython.Py_ssize_t
    before: cython.int
    after: cython.int
    for i in range(len(pages)):
        before, after = lru[pages[i], 0], lru[pages[i], 1]
        lru[before, 1] = after
        lru[after, 0] = before


@cython.boundscheck(False)
@cython.wraparound(False)
def evict(
    lru: cython.int[:, ::1],
    table: cython.int[::1],
    key_hash: cython.longlong[::1],
    is_hashed: cython.uchar[::1],
    num: cython.Py_ssize_t,
) -> list[int]:
    """Unlink the `num` oldest pages of the LRU and take them out of the index; returns them,
    oldest first. The caller checks that `num` pages are cached."""
    if num < 0:
        raise ValueError("num must be >= 0")
    head: cython.Py_ssize_t = _check_lru(lru)
    if len(key_hash) != head or len(is_hashed) != head or len(table) <= head or len(table) & (len(table) - 1):
        raise ValueError("lru, table, key_hash and is_hashed disagree on the number of pages")
    mask: cython.Py_ssize_t = len(table) - 1
    slot: cython.Py_ssize_t
    page: cython.int
    before: cython.int
    after: cython.int
    pages: list = []
    for _ in range(num):
        page = lru[head, 1]
        if page == head:  # a caller's bug: the pages evicted so far stay evicted
            raise ValueError("fewer cached pages than asked to evict")
        slot = key_hash[page] & mask
        while table[slot] != page:  # a registered page is in its key's probe run
            slot = (slot + 1) & mask
        _delete(table, key_hash, slot)
        before, after = lru[page, 0], lru[page, 1]
        lru[before, 1] = after
        lru[after, 0] = before
        is_hashed[page] = False
        pages.append(page)
    return pages


@cython.cfunc
def _check_lru(lru: cython.int[:, ::1]) -> cython.Py_ssize_t:
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


@cython.boundscheck(False)  # i < n == len(out)
@cython.wraparound(False)
def int64_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes (what page hashes and the prefix index are over):
    TypeError for an id that is not an int, OverflowError for one outside int64."""
    n: cython.Py_ssize_t = len(token_ids)
    out = np.empty(n, dtype=np.int64)
    view: cython.longlong[::1] = out
    i: cython.Py_ssize_t
    for i in range(n):
        token = token_ids[i]
        if not isinstance(token, int):
            raise TypeError(f"token ids must be ints, not {type(token).__name__}")
        view[i] = token  # OverflowError outside int64
    return out.tobytes()


@cython.cfunc
def _check(parent: bytes, data: bytes | memoryview, page_nbytes: cython.Py_ssize_t) -> bytes:
    """data as bytes, after checking the arguments that commit and match share."""
    if len(parent) != DIGEST:
        raise ValueError("parent must be a 32-byte hash")
    if page_nbytes <= 0 or len(data) % page_nbytes:
        raise ValueError("data must be whole pages of page_nbytes > 0 bytes")
    return data if type(data) is bytes else bytes(data)


@cython.cfunc
def _sha256(key: bytes) -> bytes:
    """sha256(key): compiled, by OpenSSL's SHA256_* functions (declared in prefix_index.pxd, the library
    hashlib wraps) without the context allocation and copy that hashlib pays per call (half the cost
    of a miss); uncompiled, by hashlib."""
    if cython.compiled:
        md = cython.declare(cython.uchar[32])
        ctx = cython.declare(SHA256_CTX)  # type: ignore[name-defined]  # noqa: F821
        kp: cython.p_const_uchar = key
        SHA256_Init(cython.address(ctx))  # type: ignore[name-defined]  # noqa: F821
        SHA256_Update(cython.address(ctx), kp, len(key))  # type: ignore[name-defined]  # noqa: F821
        SHA256_Final(md, cython.address(ctx))  # type: ignore[name-defined]  # noqa: F821
        return md[:32]
    return hashlib.sha256(key).digest()
