"""Chained, tenant-salted SHA-256 hashes of full pages of token ids.

hash(page i) = sha256(hash(page i-1) || token ids of page i as little-endian int64);
hash(page -1) = sha256(b"kvpool-prefix-v1" || tenant [|| 0x00 || cache salt]). Different tenants (or
cache salts) therefore never share a hash, and a page's hash names its whole prefix, not only its own
tokens. Tenant names never contain 0x00, so (tenant, salt) pairs cannot collide.
"""

import hashlib
import sys

import numpy as np

from service.core import token_ids as _token_ids

# Sequences keep their token ids in array("q") (native int64) and hash their raw bytes, which equal
# the little-endian bytes above only on a little-endian machine (x86-64, arm64: every GPU host).
if sys.byteorder != "little":
    raise ImportError("kvpool's prefix hashing assumes a little-endian machine")

_ROOT_DOMAIN = b"kvpool-prefix-v1\x00"


def root_hash(tenant: str, cache_salt: str = "") -> bytes:
    salt = b"\x00" + cache_salt.encode() if cache_salt else b""
    return hashlib.sha256(_ROOT_DOMAIN + tenant.encode() + salt).digest()


def token_bytes(token_ids: list[int] | np.ndarray, start: int = 0, stop: int = -1) -> bytes:
    """token_ids[start:stop] (stop -1: to the end) as little-endian int64 bytes (what page hashes
    and the prefix index are over); OverflowError for an id outside int64."""
    return _token_ids.int64_bytes(token_ids, start, stop)  # compiled: faster than struct.pack or numpy


def page_hash(parent: bytes, page_tokens: bytes) -> bytes:
    """The hash of a page (the definition; the prefix index's commit computes it in its own loop)."""
    return hashlib.sha256(parent + page_tokens).digest()
