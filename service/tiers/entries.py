"""The remote tier's entries: one page per key, and how a reader knows a value is the page it asked for.

Key:   kvpool:v2:<geometry>:<page hash hex> (kvpool:v3m:... for sealed entries, below). The page hash
       chains from the tenant's salted root (service.core.hashing), so tenants never share a key; the
       geometry (layers, kv heads, head_dim, page size, dtype, FP8 scales / MLA) is in the key, so pools
       that differ never mix.
Value: header || page bytes || tag, where header = magic || geometry || page hash || token ids (int64)
       || salt. A lookup knows every part of the header but the salt, so it loads an entry only if the
       header is what it expects and the tag matches; anything else is a rejected entry.

The tag, by trust model:
- Checksum (default): XXH3-64 of header and page, at memory speed. It catches corruption, a truncated
  or misplaced value; it is no defence against whoever can write to the store: they can plant any K/V
  under any tenant's prefix whose tokens they know (the store is trusted like the pool's memory).
- Keyed MAC (KVPOOL_REMOTE_SECRET set): AES-GMAC of the page (pyca/cryptography over OpenSSL: AES-NI and
  carry-less multiply, the fastest keyed MAC at hand: docs/benchmarks.md) under a key used once: BLAKE2b
  keyed with the secret over the entry's header, which ends in a random 16-byte salt, so no GCM nonce is
  ever reused under a key and the header is bound by the key. Then only
  holders of the secret make entries a reader loads; whoever else can write to the store can delete, age
  out, or replace entries with ones that are rejected (a lost hit, counted), but neither forge nor move
  one (the header names the page and its tokens), so no tenant's prefix gets K/V it did not compute. An
  entry may be replayed under its own key only (the same page, as written). Not secret: the pages are
  sent and stored in the clear (use
  rediss:// for the wire).
"""

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence

import numpy as np
import xxhash
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

Buffer = bytes | bytearray | memoryview
CHECKSUM = struct.Struct("<Q")
GCM_NONCE = bytes(12)  # one key per entry (from its salt): the nonce need not vary


class Checksum:
    """XXH3-64 over the header and the page: integrity, no authenticity."""

    magic = b"kvpool-remote-v2"  # v2: XXH3-64 instead of zlib's CRC-32 (a fifth of a restore: docs/benchmarks.md)
    key_prefix = "kvpool:v2"
    salt_nbytes, tag_nbytes = 0, CHECKSUM.size

    def salt(self) -> bytes:
        return b""

    def tag(self, header: Buffer, parts: Sequence[Buffer]) -> bytes:
        digest = xxhash.xxh3_64(header)
        for part in parts:
            digest.update(part)
        return CHECKSUM.pack(digest.intdigest())

    def matches(self, tag: Buffer, header: Buffer, parts: Sequence[Buffer]) -> bool:
        return bytes(tag) == self.tag(header, parts)


class KeyedMac(Checksum):
    """AES-GMAC of the page under a key derived from the secret and the entry's header (salt included):
    integrity and authenticity of both."""

    # m3: the header goes into the key, not the GMAC (m2 MACed header and page under a key from the salt).
    magic = b"kvpool-remote-m3"
    key_prefix = "kvpool:v3m"
    salt_nbytes, tag_nbytes = 16, 16

    def __init__(self, secret: bytes) -> None:
        self._key = hashlib.blake2b(secret, digest_size=32, person=b"kvpool-remote").digest()

    def salt(self) -> bytes:
        return os.urandom(self.salt_nbytes)

    def tag(self, header: Buffer, parts: Sequence[Buffer]) -> bytes:
        # The entry's key: keyed BLAKE2b (a PRF) of its header, which ends in a random salt, so no key (and
        # no GCM nonce under it) serves two entries, and a changed header is a different key. The page then
        # goes through one call of the AEAD API where it is one buffer: a Cipher object costs ~20 us to
        # make, a tenth of a 256 KiB page's GMAC, where AESGCM costs ~3 (docs/benchmarks.md).
        key = hashlib.blake2b(header, key=self._key, digest_size=32).digest()
        if len(parts) == 1:
            return AESGCM(key).encrypt(GCM_NONCE, b"", parts[0])  # empty plaintext: the output is the tag
        mac = Cipher(algorithms.AES(key), modes.GCM(GCM_NONCE)).encryptor()
        for part in parts:  # (an FP8 page: its K/V, then its scales) the same GMAC as over their concatenation
            mac.authenticate_additional_data(part)
        mac.finalize()
        return mac.tag

    def matches(self, tag: Buffer, header: Buffer, parts: Sequence[Buffer]) -> bool:
        return hmac.compare_digest(bytes(tag), self.tag(header, parts))


def seal_for(secret: str) -> Checksum:
    """The entries' tag: a keyed MAC when an operator set a secret, else the checksum."""
    return KeyedMac(secret.encode()) if secret else Checksum()


class EntryFormat:
    """Keys and values of one geometry under one seal."""

    def __init__(self, geometry: str, seal: Checksum | None = None) -> None:
        self.geometry, self.seal = geometry, seal or Checksum()
        self._tag = geometry.encode()

    def key(self, page_hash: bytes) -> str:
        return f"{self.seal.key_prefix}:{self.geometry}:{page_hash.hex()}"

    def expected(self, page_hash: bytes, token_bytes: bytes) -> bytes:
        """The header of the entry of `page_hash` up to its salt: what a reader knows before the value comes."""
        return b"".join(
            (
                self.seal.magic,
                struct.pack("<H", len(self._tag)),
                self._tag,
                page_hash,
                struct.pack("<I", len(token_bytes)),
                token_bytes,
            )
        )

    def header_nbytes(self, page_hash: bytes, token_bytes: bytes) -> int:
        return len(self.expected(page_hash, token_bytes)) + self.seal.salt_nbytes

    def encode(self, page_hash: bytes, token_bytes: bytes, data: Buffer) -> bytes:
        return b"".join(self.parts(page_hash, token_bytes, data))

    def parts(self, page_hash: bytes, token_bytes: bytes, data: Buffer) -> tuple[bytes, Buffer, bytes]:
        """The entry of `page_hash` as the three buffers it is made of, header, `data` (the page, not
        copied) and tag: encode() joins them; a writer sends them as they are."""
        header = self.expected(page_hash, token_bytes) + self.seal.salt()
        return header, data, self.seal.tag(header, [data])

    def intact(
        self, header: Buffer, parts: Sequence[Buffer], tag: Buffer, page_hash: bytes, token_bytes: bytes
    ) -> bool:
        """Whether a value received as header || parts || tag is the entry of `page_hash`, intact."""
        expected = self.expected(page_hash, token_bytes)
        if len(header) != len(expected) + self.seal.salt_nbytes or header[: len(expected)] != expected:
            return False
        return self.seal.matches(tag, header, parts)

    def decode(self, value: bytes | None, page_hash: bytes, token_bytes: bytes, page_nbytes: int) -> np.ndarray | None:
        """The page bytes of `value` if it is the entry of `page_hash`, intact; else None."""
        header_nbytes = self.header_nbytes(page_hash, token_bytes)
        if value is None or len(value) != header_nbytes + page_nbytes + self.seal.tag_nbytes:
            return None
        view = memoryview(value)
        data = view[header_nbytes : header_nbytes + page_nbytes]
        if not self.intact(view[:header_nbytes], [data], view[header_nbytes + page_nbytes :], page_hash, token_bytes):
            return None
        return np.frombuffer(data, dtype=np.uint8)
