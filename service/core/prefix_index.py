"""The per-page loops of the prefix cache: commit (chained SHA-256 + registration), match, evict,
and the int64 conversion of token ids.

The compiled module service/core/_prefix.c runs them (setup.py builds it at install); the Python
functions below are the definitions, the fallback when it is not built, and the tests' oracle.

entries:     key -> page, where key = parent hash || the page's token bytes (the SHA-256 preimage
             of the page's hash), so a probe compares the token ids exactly;
key_of_page: per page, its key in entries, or None when the page is not registered;
hashes:      per page, its hash (32 bytes at 32 * page), valid while the page is registered;
is_hashed:   per page, 1 while it is registered (numpy bool, for the allocator's vector paths);
lru:         registered pages nobody holds (cached), in a linked list, oldest release first (the
             eviction order): new_lru() below.
Entries hold no tuples and hashes live in one preallocated buffer: a commit allocates one bytes
object per page, and nothing the garbage collector has to track.
"""

import hashlib
import struct
from types import ModuleType

import numpy as np


def commit_py(
    entries: dict[bytes, int],
    key_of_page: list[bytes | None],
    hashes: bytearray,
    is_hashed: np.ndarray,
    pages: list[int],
    parent: bytes,
    data: bytes | memoryview,
    page_nbytes: int,
) -> bytes:
    """Hash pages[i] (token bytes data[i*page_nbytes:(i+1)*page_nbytes]) after its predecessor and
    register it unless it is registered already or its key is taken (the first committer keeps a
    key). Returns the hash of the last page."""
    _check(parent, data, page_nbytes)
    if len(pages) > len(data) // page_nbytes:
        raise ValueError("more pages than data")
    for page, start in zip(pages, range(0, len(data), page_nbytes)):
        key = parent + data[start : start + page_nbytes]
        parent = hashlib.sha256(key).digest()
        if key_of_page[page] is None and entries.setdefault(key, page) is page:
            key_of_page[page] = key
            hashes[32 * page : 32 * page + 32] = parent
            is_hashed[page] = True
    return parent


def match_py(
    entries: dict[bytes, int], hashes: bytearray, parent: bytes, data: bytes | memoryview, page_nbytes: int
) -> tuple[list[int], bytes]:
    """Registered pages matching the leading pages of `data`, chained from `parent`; stops at the
    first miss. Returns (pages, hash of the last matched page, or `parent`)."""
    _check(parent, data, page_nbytes)
    pages = []
    for start in range(0, len(data), page_nbytes):
        page = entries.get(parent + data[start : start + page_nbytes])
        if page is None:
            break
        pages.append(page)
        parent = bytes(hashes[32 * page : 32 * page + 32])
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


def evict_py(
    lru: np.ndarray, entries: dict[bytes, int], key_of_page: list[bytes | None], is_hashed: np.ndarray, num: int
) -> list[int]:
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
        del entries[key_of_page[page]]  # type: ignore[arg-type]
        lru_remove_py(lru, np.array([page], dtype=np.int64))
        key_of_page[page] = None
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
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:  # the compiled version's error
        raise OverflowError(str(exc)) from None


def _check(parent: bytes, data: bytes | memoryview, page_nbytes: int) -> None:
    if len(parent) != 32:
        raise ValueError("parent must be a 32-byte hash")
    if page_nbytes <= 0 or len(data) % page_nbytes:
        raise ValueError("data must be whole pages of page_nbytes > 0 bytes")


native: ModuleType | None
try:
    from service.core import _prefix as native
except ImportError:  # not built: the definitions above do the work
    native = None

commit = commit_py if native is None else native.commit
match = match_py if native is None else native.match
evict = evict_py if native is None else native.evict
lru_push = lru_push_py if native is None else native.lru_push
lru_remove = lru_remove_py if native is None else native.lru_remove
int64_bytes = int64_bytes_py if native is None else native.int64_bytes
SHA256_IMPL = "hashlib" if native is None else native.SHA256_IMPL
