# mypy: disable-error-code="valid-type,index"
# (mypy reads page_t, a Cython fused type, as a variable, not a type.)
"""The per-page loops of the prefix cache: commit (naming + registration), match, evict, the LRU list.

This file is the one definition: setup.py compiles it with Cython (pure-Python mode), and it runs
unchanged as plain Python where it is not built. SHA-256 is OpenSSL's (called directly when
compiled, through hashlib otherwise); the probe hash is service/core/probe_hash.py's keyed NH hash.

The index is an open-addressing hash table of page ids, keyed by parent name || the page's token
bytes, so a probe compares the token ids exactly. A registered page's name (32 bytes) is what its
children's keys start with; a first page's parent name is its chain root (service.core.hashing).
Names are given in one of two ways, fixed for an index's life:
  content  SHA-256 of the key (namer None): the chained page hash of service.core.hashing, the same
           in every process, which KV events and the tiers publish and look up by;
  serial   a fixed 24-byte tag || a 64-bit count of the index's registrations (new_namer()):
           unique for the index's life, so a key still names its whole prefix exactly (a parent's
           name belongs to one registration, never reused), at no hashing cost. A prefix whose parent
           page was evicted becomes unreachable (its key names a registration that is gone), where
           content names would reconnect it when the parent is registered again; callers release
           tails first, so tails are evicted before their parents and this is rare.
A hit computes no SHA-256 either way: a matched page's stored name is the next probe's parent.
Its arrays (new_index() below):
  table     int32 [capacity]: page id or -1; capacity a power of two >= 2 * num_pages; linear
            probing, deletion by backward shift;
  keys      uint8 [num_pages, 32 + page_nbytes]: each registered page's key (None until the first
            commit fixes page_nbytes);
  key_hash  int64 [num_pages]: probe_hash(seed, key): NH under a secret per-index seed (new_seed),
            so crafted prompts cannot be made to share a probe run; a quarter of the cost of
            CPython's SipHash over 2 KiB keys, and computed straight from the token bytes: a
            probe builds no key object;
  hashes    uint8 [num_pages, 32]: each registered page's name (content: sha256(key));
  is_hashed bool [num_pages]: the page is registered.
The LRU of cached pages (registered, unreferenced) is a linked list in an array (service/core/lru.py).
Nothing here keeps Python objects per page, and nothing is for the garbage collector to track.
"""

import hashlib
from typing import Optional

import cython
import numpy as np

if cython.compiled:  # called from C through lru.pxd and probe_hash.pxd
    from cython.cimports.service.core.lru import acquire, check_lru, lru_push
    from cython.cimports.service.core.probe_hash import check_seed, nh
else:
    from service.core.lru import acquire, check_lru, lru_push
    from service.core.probe_hash import check_seed, probe_hash  # (nh: compiled branches only)

COMPILED: bool = cython.compiled  # True in the build setup.py compiles, False run as plain Python

DIGEST = cython.declare(cython.Py_ssize_t, 32)  # bytes of a SHA-256 digest
# A page id as a block table holds it (uint32) or as the allocator hands it out (int64): commit()
# takes either, picking the specialisation by itemsize (as page_ops does).
page_t = cython.fused_type(cython.uint, cython.longlong)
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


SERIAL_TAG = b"kvpool serial page name\x00"  # 24 bytes: no SHA-256 digest (a chain root) starts so


def new_namer() -> np.ndarray:
    """The state of serial names: uint8 [32], SERIAL_TAG then the count of names given (uint64,
    little-endian). Names are deterministic, so two indexes given the same commits name alike."""
    return np.frombuffer(SERIAL_TAG + bytes(8), dtype=np.uint8).copy()


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
    namer: Optional[cython.uchar[::1]] = None,  # noqa: UP045
) -> bytes:
    """Name pages[i] (token bytes data[i*page_nbytes:(i+1)*page_nbytes]) after its predecessor and
    register it unless it is registered already or another page holds its key (the first committer
    keeps a key). Returns the name of the last page. A key found registered names nothing new: its
    page's stored name is the one (a prompt that hit the cache commits its last page so). namer:
    new_namer()'s array for serial names, None for content names (SHA-256 of each key).
    pages: C-contiguous int64, or uint32 (a slice of a block-table row)."""
    raw: bytes = _check(parent, data, page_nbytes)
    _check_index(table, keys, key_hash, hashes)
    if keys.shape[1] != DIGEST + page_nbytes or len(is_hashed) != len(key_hash):
        raise ValueError("keys or is_hashed do not fit the pages")
    check_seed(seed, keys.shape[1])
    if len(pages) > len(raw) // page_nbytes:
        raise ValueError("more pages than data")
    if namer is not None and len(namer) != DIGEST:
        raise ValueError("namer must be new_namer()'s 32 bytes")
    if pages.itemsize == 4:
        pages32: cython.uint[::1] = pages
        return _commit(table, keys, key_hash, hashes, is_hashed, seed, pages32, parent, raw, page_nbytes, namer)
    pages64: cython.longlong[::1] = pages
    return _commit(table, keys, key_hash, hashes, is_hashed, seed, pages64, parent, raw, page_nbytes, namer)


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
    namer: Optional[cython.uchar[::1]],  # noqa: UP045
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
        if table[slot] >= 0:  # the key is registered (a taken key stays with its page): its name is known
            parent = _row_bytes(hashes, table[slot])
            continue
        # (A page registered under another key keeps it; the name made here is then stored nowhere,
        # and with serial names what chains from it is unreachable: never wrong, only not found.)
        name = _sha256(parent, raw, i * page_nbytes, page_nbytes) if namer is None else _next_name(namer)
        if not is_hashed[page]:
            table[slot] = page
            _store(keys, hashes, page, parent, name, raw, i * page_nbytes, page_nbytes)
            key_hash[page] = h
            is_hashed[page] = True
        parent = name
    return parent


@cython.cfunc
@cython.boundscheck(False)  # commit() checked that the namer has 32 bytes
@cython.wraparound(False)
def _next_name(namer: cython.uchar[::1]) -> bytes:
    """The next serial name: count one more in namer[24:] and return all 32 bytes."""
    if cython.compiled:
        count: cython.p_ulonglong = cython.cast(cython.p_ulonglong, cython.address(namer[DIGEST - 8]))
        count[0] += 1  # (x86-64 and arm64 are little-endian, as hashing.py requires)
        return cython.cast(cython.p_char, cython.address(namer[0]))[:DIGEST]
    count_bytes = (int.from_bytes(bytes(namer[DIGEST - 8 :]), "little") + 1).to_bytes(8, "little")
    namer[DIGEST - 8 :] = np.frombuffer(count_bytes, dtype=np.uint8)
    return bytes(namer)


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
    first miss. Returns (pages, name of the last matched page, or `parent`)."""
    raw: bytes = _check(parent, data, page_nbytes)
    pages: list = []
    if keys is None:
        return pages, parent
    _check_index(table, keys, key_hash, hashes)
    if keys.shape[1] != DIGEST + page_nbytes:
        raise ValueError("keys do not fit the pages")
    check_seed(seed, keys.shape[1])
    i: cython.Py_ssize_t
    h: cython.longlong
    page: cython.int
    for i in range(len(raw) // page_nbytes):
        h = _key_hash(seed, parent, raw, i * page_nbytes, page_nbytes)
        page = table[_find(table, keys, key_hash, parent, raw, i * page_nbytes, h)]
        if page < 0:
            break
        pages.append(page)
        parent = _row_bytes(hashes, page)  # the next parent: the matched page's name
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
        return nh(cython.address(seed[0]), pp, dp + offset, n)
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
    name: bytes,
    data: bytes,
    offset: cython.Py_ssize_t,
    n: cython.Py_ssize_t,
) -> None:
    """keys[page] = parent || data[offset:offset + n]; hashes[page] = name."""
    if cython.compiled:
        pp: cython.p_const_uchar = parent
        dp: cython.p_const_uchar = data
        hp: cython.p_const_uchar = name
        memcpy(cython.address(keys[page, 0]), pp, DIGEST)  # type: ignore[name-defined]  # noqa: F821
        memcpy(cython.address(keys[page, DIGEST]), dp + offset, n)  # type: ignore[name-defined]  # noqa: F821
        memcpy(cython.address(hashes[page, 0]), hp, DIGEST)  # type: ignore[name-defined]  # noqa: F821
        return
    keys[page] = np.frombuffer(parent + data[offset : offset + n], dtype=np.uint8)
    hashes[page] = np.frombuffer(name, dtype=np.uint8)


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
    namer: cython.uchar[::1]  # new_namer() for serial names, None for content names
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
        namer: Optional[np.ndarray],  # noqa: UP045
    ) -> None:
        self.table, self.key_hash, self.hashes, self.is_hashed = table, key_hash, hashes, is_hashed
        self.lru, self.ref_count, self.keys, self.seed, self.namer = lru, ref_count, keys, seed, namer
        self._arrays = (table, key_hash, hashes, is_hashed, lru, ref_count, keys, seed, namer)

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
        return commit(
            t.table, t.keys, t.key_hash, t.hashes, t.is_hashed, t.seed, pages, parent, data, page_nbytes, t.namer
        )

    def acquire(self, pages: list, out: Optional[cython.uint[::1]]) -> cython.Py_ssize_t:  # noqa: UP045
        """acquire() over these arrays."""
        return acquire(self.lru, self.ref_count, pages, out)

    def lru_push(self, pages: cython.const_longlong[::1]) -> None:
        """lru_push() over these arrays."""
        lru_push(self.lru, pages)

    def evict(self, num: cython.Py_ssize_t) -> list[int]:
        """evict() over these arrays."""
        return evict(self.lru, self.table, self.key_hash, self.is_hashed, num)


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
    head: cython.Py_ssize_t = check_lru(lru)
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
