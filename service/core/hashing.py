"""Chained, tenant-salted SHA-256 hashes of full pages of token ids.

hash(page i) = sha256(hash(page i-1) || token ids of page i as little-endian int64);
hash(page -1) = sha256(b"kvpool-prefix-v1" || tenant). Different tenants therefore never share
a hash, and a page's hash names its whole prefix, not only its own tokens.
"""

import hashlib

import numpy as np

_ROOT_DOMAIN = b"kvpool-prefix-v1\x00"


def root_hash(tenant: str) -> bytes:
    return hashlib.sha256(_ROOT_DOMAIN + tenant.encode()).digest()


def token_bytes(token_ids: list[int]) -> bytes:
    return np.fromiter(token_ids, dtype="<i8", count=len(token_ids)).tobytes()


def page_hash(parent: bytes, page_tokens: bytes) -> bytes:
    return hashlib.sha256(parent + page_tokens).digest()
