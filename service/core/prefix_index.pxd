# Declarations for the compiled build of prefix_index.py: OpenSSL's SHA-256 without the per-call
# EVP context allocations that hashlib pays (API deprecated in OpenSSL 3.0, still shipped in 3.x).
cdef extern from "openssl/sha.h":
    ctypedef struct SHA256_CTX:
        pass
    int SHA256_Init(SHA256_CTX *c) nogil
    int SHA256_Update(SHA256_CTX *c, const void *data, size_t len) nogil
    int SHA256_Final(unsigned char *md, SHA256_CTX *c) nogil

from libc.string cimport memcmp, memcpy
