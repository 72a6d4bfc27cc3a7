/* The per-page loops of the prefix cache, compiled: chained SHA-256 over full pages, index
 * registration at commit, and the probe walk of a lookup.
 *
 * service/core/prefix_index.py holds the pure-Python definitions of the same three functions; the
 * tests run both on the same inputs and require identical results and identical dict/list state.
 *
 * A page's key is its SHA-256 preimage, parent hash (32 bytes) || token ids of the page (int64 LE),
 * and its hash is SHA-256(key). SHA-256 uses the x86 SHA extensions when the CPU has them (about
 * 10x the portable code), chosen once at import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_X86 1
#endif

#define DIGEST 32

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H0[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

typedef void (*compress_fn)(uint32_t state[8], const uint8_t *blocks, size_t nblocks);

/* ---- portable compression (FIPS 180-4, section 6.2.2) ---------------------------------------- */
#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void compress_portable(uint32_t state[8], const uint8_t *p, size_t nblocks) {
    for (; nblocks--; p += 64) {
        uint32_t w[64];
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 | (uint32_t)p[4 * t + 2] << 8 | p[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROTR(w[t - 15], 7) ^ ROTR(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROTR(w[t - 2], 17) ^ ROTR(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + K256[t] + w[t];
            uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
        }
        state[0] += a, state[1] += b, state[2] += c, state[3] += d;
        state[4] += e, state[5] += f, state[6] += g, state[7] += h;
    }
}

#ifdef HAVE_X86
/* ---- SHA extensions: sha256rnds2 does two rounds on the state split as (A,B,E,F) / (C,D,G,H) --- */
__attribute__((target("sha,sse4.1,ssse3"))) static void compress_shani(uint32_t state[8], const uint8_t *p,
                                                                        size_t nblocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i dcba = _mm_loadu_si128((const __m128i *)&state[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&state[4]);
    __m128i badc = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(badc, efgh, 8);
    __m128i cdgh = _mm_blend_epi16(efgh, badc, 0xF0);
    for (; nblocks--; p += 64) {
        __m128i save_abef = abef, save_cdgh = cdgh;
        __m128i w[4];  /* the 16 schedule words of the current window, 4 per register */
        for (int i = 0; i < 16; i++) {
            __m128i wi;
            if (i < 4) {
                wi = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
            } else {  /* W[t..t+3] from W[t-16..t-1]: msg1 adds sigma0, msg2 adds sigma1 */
                __m128i x = _mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4));
                wi = _mm_sha256msg2_epu32(x, w[(i + 3) & 3]);
            }
            w[i & 3] = wi;
            __m128i msg = _mm_add_epi32(wi, _mm_loadu_si128((const __m128i *)&K256[4 * i]));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, msg);
            abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(msg, 0x0E));
        }
        abef = _mm_add_epi32(abef, save_abef);
        cdgh = _mm_add_epi32(cdgh, save_cdgh);
    }
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&state[0], _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)&state[4], _mm_alignr_epi8(dchg, feba, 8));
}

static int cpu_has_sha(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3))
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    return (b >> 29) & 1;
}
#endif

static compress_fn compress = compress_portable;

/* A reusable padded message buffer for `len`-byte messages: the padding depends on the length alone,
 * so it is written once and every message only overwrites bytes [0, len). */
typedef struct {
    uint8_t *buf;
    size_t len, nblocks;
} Message;

static int message_init(Message *m, size_t len) {
    m->len = len;
    m->nblocks = (len + 9 + 63) / 64;
    m->buf = PyMem_Calloc(m->nblocks, 64);
    if (m->buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t bits = (uint64_t)len * 8;
    m->buf[len] = 0x80;
    for (int i = 0; i < 8; i++)
        m->buf[m->nblocks * 64 - 1 - i] = (uint8_t)(bits >> (8 * i));
    return 0;
}

static void message_digest(const Message *m, uint8_t out[DIGEST]) {
    uint32_t state[8];
    memcpy(state, H0, sizeof state);
    compress(state, m->buf, m->nblocks);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(state[i] >> 24), out[4 * i + 1] = (uint8_t)(state[i] >> 16);
        out[4 * i + 2] = (uint8_t)(state[i] >> 8), out[4 * i + 3] = (uint8_t)state[i];
    }
}

/* Arguments shared by commit and match: a 32-byte parent hash and page_nbytes-sized chunks. */
static int check_chain_args(Py_buffer *parent, Py_buffer *data, Py_ssize_t page_nbytes) {
    if (parent->len != DIGEST) {
        PyErr_SetString(PyExc_ValueError, "parent must be a 32-byte hash");
        return -1;
    }
    if (page_nbytes <= 0 || data->len % page_nbytes != 0) {
        PyErr_SetString(PyExc_ValueError, "data must be whole pages of page_nbytes > 0 bytes");
        return -1;
    }
    return 0;
}

/* sha256(data) -> bytes: the compression in use, on one message (for tests). */
static PyObject *py_sha256(PyObject *Py_UNUSED(self), PyObject *arg) {
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    Message m;
    uint8_t out[DIGEST];
    if (message_init(&m, (size_t)data.len) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    memcpy(m.buf, data.buf, (size_t)data.len);
    message_digest(&m, out);
    PyMem_Free(m.buf);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, DIGEST);
}

/* ---- the LRU of cached pages: a doubly linked list in an int32 array lru[num_pages + 1][2] ----------
 * lru[p][0] is the page before p (released earlier), lru[p][1] the one after; node num_pages is the
 * head: lru[head][1] is the oldest page, lru[head][0] the newest. Every operation is O(1) per page. */
typedef struct {
    Py_buffer view;
    int32_t *l;
    Py_ssize_t head;
} Lru;

static int get_lru(PyObject *obj, Lru *lru) {
    if (PyObject_GetBuffer(obj, &lru->view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = lru->view.format;
    if (f != NULL && (f[0] == '@' || f[0] == '=' || f[0] == '<'))
        f++;
    if (lru->view.itemsize != 4 || f == NULL || strcmp(f, "i") != 0 ||
        lru->view.len < 8 || lru->view.len % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "lru must be a C-contiguous int32 array of shape [num_pages + 1, 2]");
        PyBuffer_Release(&lru->view);
        return -1;
    }
    lru->l = lru->view.buf;
    lru->head = lru->view.len / 8 - 1;
    return 0;
}

/* Pages as a C-contiguous int64 buffer (a numpy int64 array), each checked to be a page id. */
static int get_pages(PyObject *obj, Py_buffer *view, Py_ssize_t num_pages) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = view->format;
    if (f != NULL && (f[0] == '@' || f[0] == '=' || f[0] == '<'))
        f++;
    if (view->itemsize != 8 || f == NULL || (strcmp(f, "l") != 0 && strcmp(f, "q") != 0)) {
        PyErr_SetString(PyExc_ValueError, "pages must be a C-contiguous int64 array");
        PyBuffer_Release(view);
        return -1;
    }
    const int64_t *p = view->buf;
    for (Py_ssize_t i = 0; i < view->len / 8; i++)
        if (p[i] < 0 || p[i] >= num_pages) {
            PyErr_SetString(PyExc_IndexError, "page out of range");
            PyBuffer_Release(view);
            return -1;
        }
    return 0;
}

static void lru_unlink(int32_t *l, int64_t p) {
    int32_t before = l[2 * p], after = l[2 * p + 1];
    l[2 * before + 1] = after;
    l[2 * after] = before;
}

static void lru_push(int32_t *l, Py_ssize_t head, int64_t p) {
    int32_t newest = l[2 * head];
    l[2 * newest + 1] = (int32_t)p;
    l[2 * p] = newest;
    l[2 * p + 1] = (int32_t)head;
    l[2 * head] = (int32_t)p;
}

/* Applies `link` (lru_push or lru_unlink) to each of `pages` in order: lru_push(lru, pages) appends
 * pages not in the list as the newest, lru_remove(lru, pages) unlinks pages that are in it. */
static PyObject *lru_apply(PyObject *args, void (*link)(int32_t *, Py_ssize_t, int64_t)) {
    PyObject *lru_obj, *pages_obj;
    if (!PyArg_ParseTuple(args, "OO", &lru_obj, &pages_obj))
        return NULL;
    Lru lru;
    Py_buffer pages;
    if (get_lru(lru_obj, &lru) < 0)
        return NULL;
    if (get_pages(pages_obj, &pages, lru.head) < 0) {
        PyBuffer_Release(&lru.view);
        return NULL;
    }
    const int64_t *p = pages.buf;
    for (Py_ssize_t i = 0; i < pages.len / 8; i++)
        link(lru.l, lru.head, p[i]);
    PyBuffer_Release(&pages);
    PyBuffer_Release(&lru.view);
    Py_RETURN_NONE;
}

static void lru_unlink_page(int32_t *l, Py_ssize_t Py_UNUSED(head), int64_t p) { lru_unlink(l, p); }

static PyObject *py_lru_push(PyObject *Py_UNUSED(self), PyObject *args) { return lru_apply(args, lru_push); }

static PyObject *py_lru_remove(PyObject *Py_UNUSED(self), PyObject *args) { return lru_apply(args, lru_unlink_page); }

/* ---- the index: open addressing over page ids ----------------------------------------------------
 * table:    int32 [capacity] (a power of two >= 2 * num_pages): a page id, or -1 for an empty slot;
 *           linear probing, deletion by backward shift (no tombstones);
 * keys:     uint8 [num_pages][32 + page_nbytes]: each registered page's key, parent hash || tokens;
 * key_hash: int64 [num_pages]: the keyed hash of that key (CPython's SipHash of the bytes, seeded
 *           per process, so that crafted prompts cannot pile up in one probe run);
 * hashes:   uint8 [num_pages][32]: each registered page's own hash, sha256(key);
 * is_hashed: bool [num_pages]: 1 while the page is registered. */
typedef struct {
    Py_buffer table, keys, key_hash, hashes, flags;
    int32_t *slots;
    size_t mask;
    Py_ssize_t num_pages, key_len;
} Index;

static void index_release(Index *ix) {
    Py_buffer *views[] = {&ix->table, &ix->keys, &ix->key_hash, &ix->hashes, &ix->flags};
    for (size_t i = 0; i < sizeof views / sizeof *views; i++)
        if (views[i]->obj != NULL)
            PyBuffer_Release(views[i]);
}

static int get_view(PyObject *obj, Py_buffer *view, Py_ssize_t len, const char *what) {
    if (obj == Py_None)
        return 0;  /* an array this call does not need */
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len != len) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %zd", what, view->len, len);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

/* Fills ix from the arrays (None for one a call does not use); num_pages from key_hash. */
static int index_init(Index *ix, PyObject *table, PyObject *keys, PyObject *key_hash, PyObject *hashes, PyObject *flags,
                      Py_ssize_t page_nbytes) {
    memset(ix, 0, sizeof *ix);
    if (PyObject_GetBuffer(key_hash, &ix->key_hash, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    ix->num_pages = ix->key_hash.len / 8;
    ix->key_len = DIGEST + page_nbytes;
    if (PyObject_GetBuffer(table, &ix->table, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto fail;
    size_t capacity = (size_t)ix->table.len / 4;
    if (capacity < (size_t)ix->num_pages + 1 || (capacity & (capacity - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "table must be a power-of-two int32 array larger than num_pages");
        goto fail;
    }
    ix->slots = ix->table.buf;
    ix->mask = capacity - 1;
    if (get_view(keys, &ix->keys, ix->num_pages * ix->key_len, "keys") < 0 ||
        get_view(hashes, &ix->hashes, ix->num_pages * DIGEST, "hashes") < 0 ||
        get_view(flags, &ix->flags, ix->num_pages, "is_hashed") < 0)
        goto fail;
    return 0;
fail:
    index_release(ix);
    return -1;
}

static Py_hash_t key_hash_of(const uint8_t *key, Py_ssize_t len) {
#if PY_VERSION_HEX >= 0x030E0000
    return Py_HashBuffer(key, len);
#else
    return _Py_HashBytes(key, len);
#endif
}

/* The slot holding the page whose key equals `key`, or the empty slot ending its probe run. */
static size_t index_find(const Index *ix, const uint8_t *key, Py_hash_t h) {
    const int64_t *kh = ix->key_hash.buf;
    const uint8_t *keys = ix->keys.buf;
    size_t i = (size_t)h & ix->mask;
    for (int32_t p; (p = ix->slots[i]) >= 0; i = (i + 1) & ix->mask)
        if (kh[p] == h && memcmp(keys + (size_t)p * ix->key_len, key, (size_t)ix->key_len) == 0)
            break;
    return i;
}

/* Removes the page in slot i, shifting later entries of the run back (Knuth's algorithm R). */
static void index_delete(Index *ix, size_t i) {
    const int64_t *kh = ix->key_hash.buf;
    for (size_t j = i;;) {
        j = (j + 1) & ix->mask;
        int32_t p = ix->slots[j];
        if (p < 0)
            break;
        size_t home = (size_t)kh[p] & ix->mask;
        /* p may move to i unless its home lies cyclically in (i, j] */
        if (i <= j ? (i < home && home <= j) : (i < home || home <= j))
            continue;
        ix->slots[i] = p;
        i = j;
    }
    ix->slots[i] = -1;
}

/* commit(table, keys, key_hash, hashes, is_hashed, pages, parent, data, page_nbytes) -> last hash
 *
 * Page i's key is parent_i || chunk_i and its hash parent_{i+1} = sha256(key). A page not yet
 * registered is entered under its key, unless another page holds that key (the first committer
 * keeps it); registered pages keep their entry. */
static PyObject *py_commit(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *table, *keys, *key_hash, *hashes, *flags, *pages_obj;
    Py_buffer parent, data, pages = {0};
    Py_ssize_t page_nbytes;
    if (!PyArg_ParseTuple(args, "OOOOOOy*y*n", &table, &keys, &key_hash, &hashes, &flags, &pages_obj, &parent, &data,
                          &page_nbytes))
        return NULL;
    PyObject *result = NULL;
    Message m = {NULL, 0, 0};
    Index ix;
    int have_index = 0;
    if (check_chain_args(&parent, &data, page_nbytes) < 0 ||
        index_init(&ix, table, keys, key_hash, hashes, flags, page_nbytes) < 0)
        goto done;
    have_index = 1;
    if (ix.keys.obj == NULL || ix.hashes.obj == NULL || ix.flags.obj == NULL) {
        PyErr_SetString(PyExc_ValueError, "commit needs keys, hashes and is_hashed");
        goto done;
    }
    if (get_pages(pages_obj, &pages, ix.num_pages) < 0)
        goto done;
    Py_ssize_t n = pages.len / 8;
    if (n > data.len / page_nbytes) {
        PyErr_SetString(PyExc_ValueError, "more pages than data");
        goto done;
    }
    if (message_init(&m, (size_t)ix.key_len) < 0)
        goto done;
    const int64_t *ids = pages.buf;
    int64_t *kh = ix.key_hash.buf;
    uint8_t *flag = ix.flags.buf, *key = m.buf;
    uint8_t hash[DIGEST];
    memcpy(hash, parent.buf, DIGEST);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(key, hash, DIGEST);
        memcpy(key + DIGEST, (const uint8_t *)data.buf + i * page_nbytes, (size_t)page_nbytes);
        message_digest(&m, hash);  /* reads key[0, key_len) and the fixed padding after it */
        int64_t page = ids[i];
        if (flag[page])
            continue;
        Py_hash_t h = key_hash_of(key, ix.key_len);
        size_t slot = index_find(&ix, key, h);
        if (ix.slots[slot] >= 0)
            continue;  /* the key is taken */
        ix.slots[slot] = (int32_t)page;
        memcpy((uint8_t *)ix.keys.buf + page * ix.key_len, key, (size_t)ix.key_len);
        memcpy((uint8_t *)ix.hashes.buf + page * DIGEST, hash, DIGEST);
        kh[page] = h;
        flag[page] = 1;
    }
    result = PyBytes_FromStringAndSize((const char *)hash, DIGEST);
done:
    PyMem_Free(m.buf);
    if (have_index)
        index_release(&ix);
    if (pages.obj != NULL)
        PyBuffer_Release(&pages);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return result;
}

/* match(table, keys, key_hash, hashes, parent, data, page_nbytes) -> (pages, last hash)
 *
 * Walks the leading pages of `data`: looks up parent || chunk; on a hit takes the page, and its hash
 * as the next parent; stops at the first miss. No SHA-256 runs here. */
static PyObject *py_match(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *table, *keys, *key_hash, *hashes;
    Py_buffer parent, data;
    Py_ssize_t page_nbytes;
    if (!PyArg_ParseTuple(args, "OOOOy*y*n", &table, &keys, &key_hash, &hashes, &parent, &data, &page_nbytes))
        return NULL;
    PyObject *result = NULL, *pages = NULL;
    uint8_t *key = NULL;
    Index ix;
    int have_index = 0;
    if (check_chain_args(&parent, &data, page_nbytes) < 0 ||
        index_init(&ix, table, keys, key_hash, hashes, Py_None, page_nbytes) < 0)
        goto done;
    have_index = 1;
    if ((pages = PyList_New(0)) == NULL)
        goto done;
    const uint8_t *last = parent.buf;
    if (ix.keys.obj != NULL && ix.hashes.obj != NULL) {  /* keys is None before the first commit */
        if ((key = PyMem_Malloc((size_t)ix.key_len)) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t start = 0; start < data.len; start += page_nbytes) {
            memcpy(key, last, DIGEST);
            memcpy(key + DIGEST, (const uint8_t *)data.buf + start, (size_t)page_nbytes);
            int32_t page = ix.slots[index_find(&ix, key, key_hash_of(key, ix.key_len))];
            if (page < 0)
                break;
            PyObject *id = PyLong_FromLong(page);
            int bad = id == NULL || PyList_Append(pages, id) < 0;
            Py_XDECREF(id);
            if (bad)
                goto done;
            last = (const uint8_t *)ix.hashes.buf + (size_t)page * DIGEST;
        }
    }
    result = Py_BuildValue("Oy#", pages, (const char *)last, (Py_ssize_t)DIGEST);
done:
    PyMem_Free(key);
    Py_XDECREF(pages);
    if (have_index)
        index_release(&ix);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return result;
}

/* evict(lru, table, key_hash, is_hashed, num) -> pages
 *
 * Unlinks the `num` oldest pages of the LRU and takes them out of the index (is_hashed[page] = 0).
 * The caller checks that `num` pages are cached. Returns the pages as a list, oldest first. */
static PyObject *py_evict(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *lru_obj, *table, *key_hash, *flags;
    Py_ssize_t num;
    if (!PyArg_ParseTuple(args, "OOOOn", &lru_obj, &table, &key_hash, &flags, &num))
        return NULL;
    if (num < 0) {
        PyErr_SetString(PyExc_ValueError, "num must be >= 0");
        return NULL;
    }
    Lru lru;
    Index ix;
    PyObject *pages = NULL;
    if (get_lru(lru_obj, &lru) < 0)
        return NULL;
    if (index_init(&ix, table, Py_None, key_hash, Py_None, flags, 0) < 0) {
        PyBuffer_Release(&lru.view);
        return NULL;
    }
    if (ix.num_pages != lru.head || ix.flags.obj == NULL) {
        PyErr_SetString(PyExc_ValueError, "lru, key_hash and is_hashed disagree on the number of pages");
        goto done;
    }
    if ((pages = PyList_New(num)) == NULL)
        goto done;
    const int64_t *kh = ix.key_hash.buf;
    uint8_t *flag = ix.flags.buf;
    for (Py_ssize_t i = 0; i < num; i++) {
        int32_t page = lru.l[2 * lru.head + 1];
        PyObject *id = page == lru.head ? NULL : PyLong_FromLong(page);
        if (id == NULL) {
            if (!PyErr_Occurred())  /* a caller's bug: the pages evicted so far stay evicted */
                PyErr_SetString(PyExc_ValueError, "fewer cached pages than asked to evict");
            Py_CLEAR(pages);
            goto done;
        }
        size_t slot = (size_t)kh[page] & ix.mask;
        while (ix.slots[slot] != page)  /* a registered page is in its key's probe run */
            slot = (slot + 1) & ix.mask;
        index_delete(&ix, slot);
        lru_unlink(lru.l, page);
        flag[page] = 0;
        PyList_SET_ITEM(pages, i, id);
    }
done:
    index_release(&ix);
    PyBuffer_Release(&lru.view);
    return pages;
}

/* int64_bytes(token_ids) -> bytes: the ids as native (little-endian) int64; OverflowError when one
 * does not fit, TypeError when one is not an int. */
static PyObject *py_int64_bytes(PyObject *Py_UNUSED(self), PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "token ids must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out != NULL) {
        int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!PyLong_Check(items[i])) {
                PyErr_Format(PyExc_TypeError, "token ids must be ints, not %.100s", Py_TYPE(items[i])->tp_name);
                Py_CLEAR(out);
                break;
            }
            long long v = PyLong_AsLongLong(items[i]);
            if (v == -1 && PyErr_Occurred()) {
                Py_CLEAR(out);
                break;
            }
            dst[i] = (int64_t)v;
        }
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"sha256", py_sha256, METH_O, "sha256(data) -> 32-byte digest, with the compression in use."},
    {"commit", py_commit, METH_VARARGS,
     "commit(table, keys, key_hash, hashes, is_hashed, pages, parent, data, page_nbytes) -> last hash."},
    {"match", py_match, METH_VARARGS,
     "match(table, keys, key_hash, hashes, parent, data, page_nbytes) -> (pages, last hash)."},
    {"evict", py_evict, METH_VARARGS, "evict(lru, table, key_hash, is_hashed, num) -> evicted pages."},
    {"lru_push", py_lru_push, METH_VARARGS, "lru_push(lru, pages): append pages as the newest."},
    {"lru_remove", py_lru_remove, METH_VARARGS, "lru_remove(lru, pages): unlink pages."},
    {"int64_bytes", py_int64_bytes, METH_O, "int64_bytes(token_ids) -> native int64 bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefix", "Compiled prefix-cache loops.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__prefix(void) {
    const char *impl = "portable";
#ifdef HAVE_X86
    const char *force = getenv("KVPOOL_SHA256_PORTABLE");
    if (cpu_has_sha() && !(force && force[0] == '1')) {
        compress = compress_shani;
        impl = "sha-ni";
    }
#endif
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && PyModule_AddStringConstant(mod, "SHA256_IMPL", impl) < 0)
        Py_CLEAR(mod);
    return mod;
}
