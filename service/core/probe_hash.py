"""The probe hash of the prefix index's keys (parent name || a page's token bytes): NH, UMAC's
universal hash, under a secret seed per index, then murmur3's 64-bit finaliser. Keys are compared in
full on every probe, so the hash only places them in the table; its seed keeps crafted prompts from
piling into one probe run. Computed straight from the token bytes: a probe builds no key object, and
over 2 KiB keys it costs a quarter of CPython's SipHash.

One definition, compiled by setup.py with Cython (pure-Python mode) and run unchanged as plain
Python where it is not built; probe_hash.pxd declares what prefix_index.py calls from C.
"""

import os

import cython
import numpy as np

COMPILED: bool = cython.compiled  # True in the build setup.py compiles, False run as plain Python

DIGEST = cython.declare(cython.Py_ssize_t, 32)  # bytes of a parent name
# murmur3's 64-bit finaliser constants (probe_hash)
MIX1 = cython.declare(cython.ulonglong, 0xFF51AFD7ED558CCD)
MIX2 = cython.declare(cython.ulonglong, 0xC4CEB9FE1A85EC53)


def new_seed(key_len: int) -> np.ndarray:
    """A random key for probe_hash() over keys of key_len bytes (a multiple of 8, at least 40):
    uint32 [key_len // 4 + 2], from os.urandom. Each index draws its own."""
    if key_len < DIGEST + 8 or key_len % 8:
        raise ValueError("key_len must be a multiple of 8, at least 40")
    return np.frombuffer(os.urandom(key_len + 8), dtype=np.uint32).copy()


@cython.boundscheck(False)  # the seed is checked to cover the key (check_seed)
@cython.wraparound(False)
def probe_hash(seed: cython.const_uint[::1], parent: bytes, page: bytes) -> cython.longlong:
    """The probe hash of the key parent || page (32 + len(page) bytes): NH (UMAC's universal hash:
    the sum over 32-bit word pairs of (w[2j] + s[2j]) * (w[2j+1] + s[2j+1]), mod 2**64) under the
    secret seed, then murmur3's 64-bit finaliser. Keys are compared in full on every probe, so the
    hash only places them; its seed keeps crafted prompts from piling into one probe run."""
    check_seed(seed, DIGEST + len(page))
    if len(parent) != DIGEST or len(page) % 8:
        raise ValueError("parent must be a 32-byte hash, page whole int64 token ids")
    if cython.compiled:
        pp: cython.p_const_uchar = parent
        dp: cython.p_const_uchar = page
        return nh(cython.address(seed[0]), pp, dp, len(page))
    words = np.frombuffer(parent + page, dtype="<u4").astype(np.uint64)
    x = (words + seed[: len(words)]) & 0xFFFFFFFF
    acc = int((x[0::2] * x[1::2]).sum(dtype=np.uint64))  # (numpy sums unsigned ints modulo 2**64)
    acc ^= int(seed[len(words)]) | int(seed[len(words) + 1]) << 32
    for mul in (MIX1, MIX2):
        acc = ((acc ^ (acc >> 33)) * mul) & 0xFFFFFFFFFFFFFFFF
    acc ^= acc >> 33
    return acc - (1 << 64) if acc >> 63 else acc  # as an int64


@cython.cfunc
@cython.boundscheck(False)  # callers check that the seed covers 32 + n bytes, n a multiple of 8
@cython.wraparound(False)
def nh(
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


@cython.ccall
def check_seed(seed: cython.const_uint[::1], key_len: cython.Py_ssize_t) -> None:
    if len(seed) < key_len // 4 + 2:
        raise ValueError("the seed is too short for these keys")
