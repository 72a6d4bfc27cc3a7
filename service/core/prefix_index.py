# mypy: disable-error-code="valid-type,index"
# (mypy reads page_t, a Cython fused type, as a variable, not a type.)
"""The per-page loops of the prefix cache: commit (chained SHA-256 + registration), match, evict,
the LRU list, and the int64 conversion of token ids.

This file is the one definition: setup.py compiles it with Cython (pure-Python mode), and it runs
unchanged as plain Python where it is not built. SHA-256 is OpenSSL's (called directly when
compiled, through hashlib otherwise); the probe hash is probe_hash() below, a keyed NH hash.

The index is an open-addressing hash table of page ids, keyed by each registered page's SHA-256
preimage, parent hash || the page's token bytes, so a probe compares the token ids exactly and a
hit computes no SHA-256. Its arrays (new_index() below):
  table     int32 [capacity]: page id or -1; capacity a power of two >= 2 * num_pages; linear
            probing, deletion by backward shift;
  keys      uint8 [num_pages, 32 + page_nbytes]: each registered page's key (None until the first
            commit fixes page_nbytes);
  key_hash  int64 [num_pages]: probe_hash(seed, key): NH under a secret per-index seed (new_seed),
            so crafted prompts cannot be made to share a probe run; a quarter of the cost of
            CPython's SipHash over 2 KiB keys, and computed straight from the token bytes: a
            probe builds no key object;
  hashes    uint8 [num_pages, 32]: each registered page's hash, sha256(key);
  is_hashed bool [num_pages]: the page is registered.
The LRU of cached pages (registered, unreferenced) is a linked list in an array (new_lru()).
Nothing here keeps Python objects per page, and nothing is for the garbage collector to track.
"""

import hashlib
import os
from collections.abc import Sequence
from typing import Optional

import cython
import numpy as np

COMPILED: bool = cython.compiled  # True in the build setup.py compiles, False run as plain Python

DIGEST = cython.declare(cython.Py_ssize_t, 32)  # bytes of a SHA-256 digest
# A page id as a block table holds it (uint32) or as the allocator hands it out (int64): commit()
# takes either, picking the specialisation by itemsize (as page_ops does).
page_t = cython.fused_type(cython.uint, cython.longlong)
# murmur3's 64-bit finaliser constants (probe_hash)
MIX1 = cython.declare(cython.ulonglong, 0xFF51AFD7ED558CCD)
MIX2 = cython.declare(cython.ulonglong, 0xC4CEB9FE1A85EC53)
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


def new_seed(key_len: int) -> np.ndarray:
    """A random key for probe_hash() over keys of key_len bytes (a multiple of 8, at least 40):
    uint32 [key_len // 4 + 2], from os.urandom. Each index draws its own."""
    if key_len < DIGEST + 8 or key_len % 8:
        raise ValueError("key_len must be a multiple of 8, at least 40")
    return np.frombuffer(os.urandom(key_len + 8), dtype=np.uint32).copy()


@cython.boundscheck(False)  # the seed is checked to cover the key (_check_seed)
@cython.wraparound(False)
def probe_hash(seed: cython.const_uint[::1], parent: bytes, page: bytes) -> cython.longlong:
    """The probe hash of the key parent || page (32 + len(page) bytes): NH (UMAC's universal hash:
    the sum over 32-bit word pairs of (w[2j] + s[2j]) * (w[2j+1] + s[2j+1]), mod 2**64) under the
    secret seed, then murmur3's 64-bit finaliser. Keys are compared in full on every probe, so the
    hash only places them; its seed keeps crafted prompts from piling into one probe run."""
    _check_seed(seed, DIGEST + len(page))
    if len(parent) != DIGEST or len(page) % 8:
        raise ValueError("parent must be a 32-byte hash, page whole int64 token ids")
    if cython.compiled:
        pp: cython.p_const_uchar = parent
        dp: cython.p_const_uchar = page
        return _nh(cython.address(seed[0]), pp, dp, len(page))
    words = np.frombuffer(parent + page, dtype="<u4").astype(np.uint64)
    x = (words + seed[: len(words)]) & 0xFFFFFFFF
    acc = int((x[0::2] * x[1::2]).sum(dtype=np.uint64))  # (numpy sums unsigned ints modulo 2**64)
    acc ^= int(seed[len(words)]) | int(seed[len(words) + 1]) << 32
    for mul in (MIX1, MIX2):
        acc = ((acc ^ (acc >> 33)) * mul) & 0xFFFFFFFFFFFFFFFF
    acc ^= acc >> 33
    return acc - (1 << 64) if acc >> 63 else acc  # as an int64


@cython.cfunc
@cython.inline
@cython.boundscheck(False)  # callers check that the seed covers 32 + n bytes, n a multiple of 8
@cython.wraparound(False)
def _nh(
    seed: cython.p_const_uint, parent: cython.p_const_uchar, page: cython.p_const_uchar, n: cython.Py_ssize_t
) -> cython.longlong:
    """probe_hash() of parent || page[:n], compiled (the loops vectorise)."""
    acc: cython.ulonglong = 0
    w: cython.p_const_uint = cython.cast(cython.p_const_uint, parent)
    j: cython.Py_ssize_t
    for j in range(0, DIGEST // 4, 2):
        acc += cython.cast(cython.ulonglong, cython.cast(cython.uint, w[j] + seed[j])) * cython.cast(
            cython.uint, w[j + 1] + seed[j + 1]
        )
    w = cython.cast(cython.p_const_uint, page)
    s: cython.p_const_uint = seed + DIGEST // 4
    for j in range(0, n // 4, 2):
        acc += cython.cast(cython.ulonglong, cython.cast(cython.uint, w[j] + s[j])) * cython.cast(
            cython.uint, w[j + 1] + s[j + 1]
        )
    s = s + n // 4
    acc ^= cython.cast(cython.ulonglong, s[0]) | (cython.cast(cython.ulonglong, s[1]) << 32)
    acc = (acc ^ (acc >> 33)) * MIX1
    acc = (acc ^ (acc >> 33)) * MIX2
    return cython.cast(cython.longlong, acc ^ (acc >> 33))


@cython.cfunc
@cython.boundscheck(False)  # slots are masked into the table, pages in it are < len(key_hash) == len(keys)
@cython.wraparound(False)
def _find(
    table: cython.int[::1],
    keys: cython.uchar[:, ::1],
    key_hash: cython.longlong[::1],
    parent: bytes,
    data: bytes,
    offset: cython.Py_ssize_t,
    h: cython.longlong,
) -> cython.Py_ssize_t:
    """The slot holding the page whose key is parent || data[offset:offset + page bytes], or the
    empty slot that ends its probe run."""
    mask: cython.Py_ssize_t = len(table) - 1
    i: cython.Py_ssize_t = h & mask
    n: cython.Py_ssize_t = keys.shape[1] - DIGEST
    page: cython.int
    while table[i] >= 0:
        page = table[i]
        if key_hash[page] == h and _same_key(keys, page, parent, data, offset, n):
            break
        i = (i + 1) & mask
    return i


@cython.cfunc
@cython.inline
@cython.boundscheck(False)
@cython.wraparound(False)
def _same_key(
    keys: cython.uchar[:, ::1],
    page: cython.int,
    parent: bytes,
    data: bytes,
    offset: cython.Py_ssize_t,
    n: cython.Py_ssize_t,
) -> cython.bint:
    """keys[page] == parent || data[offset:offset + n]."""
    if cython.compiled:
        pp: cython.p_const_uchar = parent
        dp: cython.p_const_uchar = data
        kp: cython.p_uchar = cython.address(keys[page, 0])
        return memcmp(kp, pp, DIGEST) == 0 and memcmp(kp + DIGEST, dp + offset, n) == 0  # type: ignore[name-defined]  # noqa: F821
    return bytes(keys[page]) == parent + data[offset : offset + n]


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
def _check_index(
    table: cython.int[::1], keys: cython.uchar[:, ::1], key_hash: cython.longlong[::1], hashes: cython.uchar[:, ::1]
) -> None:
    num_pages: cython.Py_ssize_t = len(key_hash)
    if len(table) <= num_pages or len(table) & (len(table) - 1):
        raise ValueError("table must be a power-of-two int32 array larger than num_pages")
    if keys.shape[0] != num_pages or hashes.shape[0] != num_pages or hashes.shape[1] != DIGEST:
        raise ValueError("keys, key_hash and hashes disagree on the number of pages")


@cython.cfunc
def _check_seed(seed: cython.const_uint[::1], key_len: cython.Py_ssize_t) -> None:
    if len(seed) < key_len // 4 + 2:
        raise ValueError("the seed is too short for these keys")


@cython.ccall
@cython.boundscheck(False)
@cython.wraparound(False)
def commit(
    table: cython.int[::1],
    keys: cython.uchar[:, ::1],
    key_hash: cython.longlong[::1],
    hashes: cython.uchar[:, ::1],
    is_hashed: cython.uchar[::1],
    seed: cython.const_uint[::1],
    pages: np.ndarray,
    parent: bytes,
    data: bytes | memoryview,
    page_nbytes: cython.Py_ssize_t,
) -> bytes:
    """Hash pages[i] (token bytes data[i*page_nbytes:(i+1)*page_nbytes]) after its predecessor and
    register it unless it is registered already or another page holds its key (the first committer
    keeps a key). Returns the hash of the last page. A key found registered computes no SHA-256: its
    page's stored hash is the same digest (a prompt that hit the cache commits its last page so).
    pages: C-contiguous int64, or uint32 (a slice of a block-table row)."""
    raw: bytes = _check(parent, data, page_nbytes)
    _check_index(table, keys, key_hash, hashes)
    if keys.shape[1] != DIGEST + page_nbytes or len(is_hashed) != len(key_hash):
        raise ValueError("keys or is_hashed do not fit the pages")
    _check_seed(seed, keys.shape[1])
    if len(pages) > len(raw) // page_nbytes:
        raise ValueError("more pages than data")
    if pages.itemsize == 4:
        pages32: cython.uint[::1] = pages
        return _commit(table, keys, key_hash, hashes, is_hashed, seed, pages32, parent, raw, page_nbytes)
    pages64: cython.longlong[::1] = pages
    return _commit(table, keys, key_hash, hashes, is_hashed, seed, pages64, parent, raw, page_nbytes)


@cython.cfunc
@cython.boundscheck(False)  # commit() checked the arrays and the data, the pages are checked here
@cython.wraparound(False)
def _commit(
    table: cython.int[::1],
    keys: cython.uchar[:, ::1],
    key_hash: cython.longlong[::1],
    hashes: cython.uchar[:, ::1],
    is_hashed: cython.uchar[::1],
    seed: cython.const_uint[::1],
    pages: page_t[::1],
    parent: bytes,
    raw: bytes,
    page_nbytes: cython.Py_ssize_t,
) -> bytes:
    i: cython.Py_ssize_t
    for i in range(len(pages)):
        if not 0 <= pages[i] < len(key_hash):
            raise IndexError("page out of range")
    h: cython.longlong
    page: cython.longlong
    slot: cython.Py_ssize_t
    for i in range(len(pages)):
        page = pages[i]
        h = _key_hash(seed, parent, raw, i * page_nbytes, page_nbytes)
        slot = _find(table, keys, key_hash, parent, raw, i * page_nbytes, h)
        if table[slot] >= 0:  # the key is registered (a taken key stays with its page): its hash is known
            parent = _row_bytes(hashes, table[slot])
            continue
        digest = _sha256(parent, raw, i * page_nbytes, page_nbytes)
        if not is_hashed[page]:
            table[slot] = page
            _store(keys, hashes, page, parent, digest, raw, i * page_nbytes, page_nbytes)
            key_hash[page] = h
            is_hashed[page] = True
        parent = digest
    return parent


@cython.ccall
@cython.boundscheck(False)  # as commit: the arrays are checked first, pages come from the table
@cython.wraparound(False)
def match(
    table: cython.int[::1],
    keys: Optional[cython.uchar[:, ::1]],  # noqa: UP045 (cython types have no `|` in plain Python)
    key_hash: cython.longlong[::1],
    hashes: cython.uchar[:, ::1],
    seed: Optional[cython.const_uint[::1]],  # noqa: UP045 (as keys: None before the first commit)
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
    _check_seed(seed, keys.shape[1])
    i: cython.Py_ssize_t
    h: cython.longlong
    page: cython.int
    for i in range(len(raw) // page_nbytes):
        h = _key_hash(seed, parent, raw, i * page_nbytes, page_nbytes)
        page = table[_find(table, keys, key_hash, parent, raw, i * page_nbytes, h)]
        if page < 0:
            break
        pages.append(page)
        parent = _row_bytes(hashes, page)  # the next parent: the matched page's hash
    return pages, parent


@cython.cfunc
@cython.inline
def _key_hash(
    seed: cython.const_uint[::1], parent: bytes, data: bytes, offset: cython.Py_ssize_t, n: cython.Py_ssize_t
) -> cython.longlong:
    """probe_hash(seed, parent, data[offset:offset + n]), without the slice when compiled."""
    if cython.compiled:
        pp: cython.p_const_uchar = parent
        dp: cython.p_const_uchar = data
        return _nh(cython.address(seed[0]), pp, dp + offset, n)
    return probe_hash(seed, parent, data[offset : offset + n])


@cython.cfunc
@cython.inline
@cython.boundscheck(False)
@cython.wraparound(False)
def _row_bytes(rows: cython.uchar[:, ::1], i: cython.Py_ssize_t) -> bytes:
    """rows[i] as bytes."""
    if cython.compiled:
        p: cython.p_char = cython.cast(cython.p_char, cython.address(rows[i, 0]))
        return p[: rows.shape[1]]
    return bytes(rows[i])


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _store(
    keys: cython.uchar[:, ::1],
    hashes: cython.uchar[:, ::1],
    page: cython.longlong,
    parent: bytes,
    digest: bytes,
    data: bytes,
    offset: cython.Py_ssize_t,
    n: cython.Py_ssize_t,
) -> None:
    """keys[page] = parent || data[offset:offset + n]; hashes[page] = digest."""
    if cython.compiled:
        pp: cython.p_const_uchar = parent
        dp: cython.p_const_uchar = data
        hp: cython.p_const_uchar = digest
        memcpy(cython.address(keys[page, 0]), pp, DIGEST)  # type: ignore[name-defined]  # noqa: F821
        memcpy(cython.address(keys[page, DIGEST]), dp + offset, n)  # type: ignore[name-defined]  # noqa: F821
        memcpy(cython.address(hashes[page, 0]), hp, DIGEST)  # type: ignore[name-defined]  # noqa: F821
        return
    keys[page] = np.frombuffer(parent + data[offset : offset + n], dtype=np.uint8)
    hashes[page] = np.frombuffer(digest, dtype=np.uint8)


@cython.cclass
class IndexArrays:
    """An allocator's index (new_index, with keys and seed once the first commit fixes the key
    length), LRU (new_lru) and reference counts, held as typed memoryviews: compiled, each call
    acquires only the buffers of its own arguments, not five or six of these as well. Acquiring a
    buffer costs about 0.1 us; a 4,096-token prompt that hits the cache at page 256 made some twenty
    such acquisitions. The allocator keeps the arrays (never replaced) and makes a new IndexArrays
    when it makes the keys."""

    table: cython.int[::1]
    keys: cython.uchar[:, ::1]  # None before the first commit
    key_hash: cython.longlong[::1]
    hashes: cython.uchar[:, ::1]
    is_hashed: cython.uchar[::1]
    seed: cython.const_uint[::1]  # None with keys
    lru: cython.int[:, ::1]
    ref_count: cython.int[::1]
    _arrays: tuple  # as given

    def __init__(
        self,
        table: np.ndarray,
        key_hash: np.ndarray,
        hashes: np.ndarray,
        is_hashed: np.ndarray,
        lru: np.ndarray,
        ref_count: np.ndarray,
        keys: Optional[np.ndarray],  # noqa: UP045
        seed: Optional[np.ndarray],  # noqa: UP045
    ) -> None:
        self.table, self.key_hash, self.hashes, self.is_hashed = table, key_hash, hashes, is_hashed
        self.lru, self.ref_count, self.keys, self.seed = lru, ref_count, keys, seed
        self._arrays = (table, key_hash, hashes, is_hashed, lru, ref_count, keys, seed)

    def __reduce__(self) -> tuple:
        # copy.deepcopy of an allocator: the copy's IndexArrays views the copy's arrays (deepcopy's memo).
        return (IndexArrays, self._arrays)

    def match(self, parent: bytes, data: bytes | memoryview, page_nbytes: cython.Py_ssize_t) -> tuple[list[int], bytes]:
        """match() over these arrays."""
        return match(self.table, self.keys, self.key_hash, self.hashes, self.seed, parent, data, page_nbytes)

    def commit(
        self, pages: np.ndarray, parent: bytes, data: bytes | memoryview, page_nbytes: cython.Py_ssize_t
    ) -> bytes:
        """commit() over these arrays."""
        t = self
        return commit(t.table, t.keys, t.key_hash, t.hashes, t.is_hashed, t.seed, pages, parent, data, page_nbytes)

    def acquire(self, pages: list, out: Optional[cython.uint[::1]]) -> cython.Py_ssize_t:  # noqa: UP045
        """acquire() over these arrays."""
        return acquire(self.lru, self.ref_count, pages, out)

    def lru_push(self, pages: cython.const_longlong[::1]) -> None:
        """lru_push() over these arrays."""
        lru_push(self.lru, pages)

    def evict(self, num: cython.Py_ssize_t) -> list[int]:
        """evict() over these arrays."""
        return evict(self.lru, self.table, self.key_hash, self.is_hashed, num)


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
    head: cython.Py_ssize_t = _check_lru(lru)
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


@cython.cfunc
def _check(parent: bytes, data: bytes | memoryview, page_nbytes: cython.Py_ssize_t) -> bytes:
    """data as bytes, after checking the arguments that commit and match share."""
    if len(parent) != DIGEST:
        raise ValueError("parent must be a 32-byte hash")
    if page_nbytes <= 0 or len(data) % page_nbytes:
        raise ValueError("data must be whole pages of page_nbytes > 0 bytes")
    return data if type(data) is bytes else bytes(data)


@cython.cfunc
def _sha256(parent: bytes, data: bytes, offset: cython.Py_ssize_t, n: cython.Py_ssize_t) -> bytes:
    """sha256(parent || data[offset:offset + n]): compiled, by OpenSSL's SHA256_* functions (declared
    in prefix_index.pxd, the library hashlib wraps) without the context allocation and copy that
    hashlib pays per call; uncompiled, by hashlib."""
    if cython.compiled:
        md = cython.declare(cython.uchar[32])
        ctx = cython.declare(SHA256_CTX)  # type: ignore[name-defined]  # noqa: F821
        pp: cython.p_const_uchar = parent
        dp: cython.p_const_uchar = data
        SHA256_Init(cython.address(ctx))  # type: ignore[name-defined]  # noqa: F821
        SHA256_Update(cython.address(ctx), pp, DIGEST)  # type: ignore[name-defined]  # noqa: F821
        SHA256_Update(cython.address(ctx), dp + offset, n)  # type: ignore[name-defined]  # noqa: F821
        SHA256_Final(md, cython.address(ctx))  # type: ignore[name-defined]  # noqa: F821
        return md[:32]
    return hashlib.sha256(parent + data[offset : offset + n]).digest()
