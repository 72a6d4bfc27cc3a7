"""The per-page loops of the prefix cache: commit (chained SHA-256 + registration), match, evict,
the LRU list, and the int64 conversion of token ids.

The compiled module service/core/_prefix.c runs them (setup.py builds it at install); the Python
functions below are the definitions, the fallback when it is not built, and the tests' oracle: both
work on the same numpy arrays and must leave them byte for byte the same.

The index is an open-addressing hash table of page ids, keyed by each registered page's SHA-256
preimage, parent hash || the page's token bytes, so a probe compares the token ids exactly and a
hit computes no SHA-256. Its arrays (new_index() below):
  table     int32 [capacity]: page id or -1; capacity a power of two >= 2 * num_pages; linear
            probing, deletion by backward shift;
  keys      uint8 [num_pages, 32 + page_nbytes]: each registered page's key (None until the first
            commit fixes page_nbytes);
  key_hash  int64 [num_pages]: hash(key) as CPython hashes bytes (SipHash, seeded per process, so
            crafted prompts cannot be made to share a probe run);
  hashes    uint8 [num_pages, 32]: each registered page's hash, sha256(key);
  is_hashed bool [num_pages]: the page is registered.
The LRU of cached pages (registered, unreferenced) is a linked list in an array (new_lru()).
Nothing here allocates Python objects per page, and nothing is for the garbage collector to track.
"""

import hashlib
import importlib
import struct
from types import ModuleType

import numpy as np

DIGEST = 32


def new_index(num_pages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(table, key_hash, hashes, is_hashed) of an empty index; keys come with the first commit."""
    capacity = 1 << max(3, (2 * num_pages - 1).bit_length())
    return (
        np.full(capacity, -1, dtype=np.int32),
        np.zeros(num_pages, dtype=np.int64),
        np.zeros((num_pages, DIGEST), dtype=np.uint8),
        np.zeros(num_pages, dtype=np.bool_),
    )


def _find(table: np.ndarray, keys: np.ndarray, key_hash: np.ndarray, key: bytes, h: int) -> int:
    """The slot holding the page whose key is `key`, or the empty slot that ends its probe run."""
    mask = len(table) - 1
    i = h & mask
    while (page := int(table[i])) >= 0:
        if int(key_hash[page]) == h and keys[page].tobytes() == key:
            break
        i = (i + 1) & mask
    return i


def _delete(table: np.ndarray, key_hash: np.ndarray, i: int) -> None:
    """Empty slot i, shifting later entries of its probe run back (Knuth's algorithm R)."""
    mask = len(table) - 1
    j = i
    while True:
        j = (j + 1) & mask
        page = int(table[j])
        if page < 0:
            break
        home = int(key_hash[page]) & mask
        if (i < home <= j) if i <= j else (i < home or home <= j):
            continue  # its home lies cyclically in (i, j]: it stays
        table[i] = page
        i = j
    table[i] = -1


def commit_py(
    table: np.ndarray,
    keys: np.ndarray,
    key_hash: np.ndarray,
    hashes: np.ndarray,
    is_hashed: np.ndarray,
    pages: np.ndarray,
    parent: bytes,
    data: bytes | memoryview,
    page_nbytes: int,
) -> bytes:
    """Hash pages[i] (token bytes data[i*page_nbytes:(i+1)*page_nbytes]) after its predecessor and
    register it unless it is registered already or another page holds its key (the first committer
    keeps a key). Returns the hash of the last page."""
    _check(parent, data, page_nbytes)
    ids = _page_ids(pages, len(key_hash))
    if len(ids) > len(data) // page_nbytes:
        raise ValueError("more pages than data")
    for page, start in zip(ids, range(0, len(data), page_nbytes)):
        key = parent + bytes(data[start : start + page_nbytes])
        parent = hashlib.sha256(key).digest()
        if is_hashed[page]:
            continue
        h = hash(key)
        slot = _find(table, keys, key_hash, key, h)
        if table[slot] >= 0:
            continue  # the key is taken
        table[slot] = page
        keys[page] = np.frombuffer(key, dtype=np.uint8)
        key_hash[page] = h
        hashes[page] = np.frombuffer(parent, dtype=np.uint8)
        is_hashed[page] = True
    return parent


def match_py(
    table: np.ndarray,
    keys: np.ndarray | None,
    key_hash: np.ndarray,
    hashes: np.ndarray,
    parent: bytes,
    data: bytes | memoryview,
    page_nbytes: int,
) -> tuple[list[int], bytes]:
    """Registered pages matching the leading pages of `data`, chained from `parent`; stops at the
    first miss. Returns (pages, hash of the last matched page, or `parent`)."""
    _check(parent, data, page_nbytes)
    pages: list[int] = []
    if keys is None:
        return pages, parent
    for start in range(0, len(data), page_nbytes):
        key = parent + bytes(data[start : start + page_nbytes])
        page = int(table[_find(table, keys, key_hash, key, hash(key))])
        if page < 0:
            break
        pages.append(page)
        parent = hashes[page].tobytes()
    return pages, parent


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


def lru_push_py(lru: np.ndarray, pages: np.ndarray) -> None:
    """Append `pages` (not in the list) as the newest, in order."""
    head = len(lru) - 1
    for page in _page_ids(pages, head):
        newest = lru[head, 0]
        lru[newest, 1] = page
        lru[page] = newest, head
        lru[head, 0] = page


def lru_remove_py(lru: np.ndarray, pages: np.ndarray) -> None:
    """Unlink `pages` (all in the list)."""
    for page in _page_ids(pages, len(lru) - 1):
        before, after = lru[page]
        lru[before, 1] = after
        lru[after, 0] = before


def evict_py(lru: np.ndarray, table: np.ndarray, key_hash: np.ndarray, is_hashed: np.ndarray, num: int) -> list[int]:
    """Unlink the `num` oldest pages of the LRU and take them out of the index; returns them,
    oldest first. The caller checks that `num` pages are cached."""
    if num < 0:
        raise ValueError("num must be >= 0")
    head = len(lru) - 1
    pages = []
    for _ in range(num):
        page = int(lru[head, 1])
        if page == head:
            raise ValueError("fewer cached pages than asked to evict")
        mask = len(table) - 1
        slot = int(key_hash[page]) & mask
        while table[slot] != page:
            slot = (slot + 1) & mask
        _delete(table, key_hash, slot)
        lru_remove_py(lru, np.array([page], dtype=np.int64))
        is_hashed[page] = False
        pages.append(page)
    return pages


def _page_ids(pages: np.ndarray, num_pages: int) -> list[int]:
    ids = pages.tolist()
    if any(not 0 <= page < num_pages for page in ids):
        raise IndexError("page out of range")
    return ids


def int64_bytes_py(token_ids: list[int]) -> bytes:
    """Token ids as little-endian int64 bytes (what page hashes and the prefix index are over)."""
    for token in token_ids:  # the compiled version's errors: TypeError, then OverflowError
        if not isinstance(token, int):
            raise TypeError(f"token ids must be ints, not {type(token).__name__}")
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise OverflowError(str(exc)) from None


def _check(parent: bytes, data: bytes | memoryview, page_nbytes: int) -> None:
    if len(parent) != DIGEST:
        raise ValueError("parent must be a 32-byte hash")
    if page_nbytes <= 0 or len(data) % page_nbytes:
        raise ValueError("data must be whole pages of page_nbytes > 0 bytes")


native: ModuleType | None
try:
    native = importlib.import_module("service.core._prefix")
except ImportError:  # not built: the definitions above do the work
    native = None

commit = commit_py if native is None else native.commit
match = match_py if native is None else native.match
evict = evict_py if native is None else native.evict
lru_push = lru_push_py if native is None else native.lru_push
lru_remove = lru_remove_py if native is None else native.lru_remove
int64_bytes = int64_bytes_py if native is None else native.int64_bytes
SHA256_IMPL = "hashlib" if native is None else native.SHA256_IMPL
