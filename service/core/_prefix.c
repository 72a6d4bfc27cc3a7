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

/* A writable buffer of page hashes, 32 bytes per page. */
static int get_hashes(PyObject *obj, Py_buffer *view, Py_ssize_t num_pages) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0)
        return -1;
    if (view->len < num_pages * DIGEST) {
        PyErr_SetString(PyExc_ValueError, "hashes must hold 32 bytes per page");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A writable buffer of one byte per page (a numpy bool array): the pages registered in the index. */
static int get_flags(PyObject *obj, Py_buffer *view, Py_ssize_t num_pages) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0)
        return -1;
    if (view->len != num_pages) {
        PyErr_SetString(PyExc_ValueError, "is_hashed must hold one byte per page");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* commit(entries, key_of_page, hashes, is_hashed, pages, parent, data, page_nbytes) -> last hash
 *
 * Page i's key is parent_i || chunk_i and its hash parent_{i+1} = sha256(key). A page not yet
 * registered (key_of_page[page] is None) gets entries[key] = page, key_of_page[page] = key, its
 * hash in hashes[32 page : 32 page + 32] and is_hashed[page] = 1, unless the key is taken (the first
 * committer keeps it). */
static PyObject *py_commit(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *entries, *key_of_page, *hashes_obj, *flags_obj, *pages_obj;
    Py_buffer parent, data, hashes = {0}, flags = {0};
    Py_ssize_t page_nbytes;
    if (!PyArg_ParseTuple(args, "O!O!OOOy*y*n", &PyDict_Type, &entries, &PyList_Type, &key_of_page, &hashes_obj,
                          &flags_obj, &pages_obj, &parent, &data, &page_nbytes))
        return NULL;
    PyObject *result = NULL, *pages = NULL;
    Message m = {NULL, 0, 0};
    Py_ssize_t num_pages = PyList_GET_SIZE(key_of_page);
    if (check_chain_args(&parent, &data, page_nbytes) < 0 || get_hashes(hashes_obj, &hashes, num_pages) < 0 ||
        get_flags(flags_obj, &flags, num_pages) < 0)
        goto done;
    pages = PySequence_Fast(pages_obj, "pages must be a sequence");
    if (pages == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(pages);
    if (n > data.len / page_nbytes) {
        PyErr_SetString(PyExc_ValueError, "more pages than data");
        goto done;
    }
    if (message_init(&m, DIGEST + (size_t)page_nbytes) < 0)
        goto done;
    uint8_t hash[DIGEST];
    memcpy(hash, parent.buf, DIGEST);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(m.buf, hash, DIGEST);
        memcpy(m.buf + DIGEST, (const uint8_t *)data.buf + i * page_nbytes, (size_t)page_nbytes);
        message_digest(&m, hash);
        PyObject *page = PySequence_Fast_GET_ITEM(pages, i);
        Py_ssize_t index = PyNumber_AsSsize_t(page, PyExc_IndexError);
        if (index == -1 && PyErr_Occurred())
            goto done;
        if (index < 0 || index >= num_pages) {
            PyErr_SetString(PyExc_IndexError, "page out of range");
            goto done;
        }
        if (PyList_GET_ITEM(key_of_page, index) != Py_None)
            continue;
        PyObject *key = PyBytes_FromStringAndSize((const char *)m.buf, (Py_ssize_t)m.len);
        if (key == NULL)
            goto done;
        PyObject *kept = PyDict_SetDefault(entries, key, page); /* borrowed */
        int ok = kept != NULL;
        if (ok && kept == page) {
            memcpy((uint8_t *)hashes.buf + index * DIGEST, hash, DIGEST);
            ((uint8_t *)flags.buf)[index] = 1;
            PyObject *old = PyList_GET_ITEM(key_of_page, index);
            PyList_SET_ITEM(key_of_page, index, Py_NewRef(key));
            Py_DECREF(old);
        }
        Py_DECREF(key);
        if (!ok)
            goto done;
    }
    result = PyBytes_FromStringAndSize((const char *)hash, DIGEST);
done:
    PyMem_Free(m.buf);
    Py_XDECREF(pages);
    if (hashes.obj != NULL)
        PyBuffer_Release(&hashes);
    if (flags.obj != NULL)
        PyBuffer_Release(&flags);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return result;
}

/* match(entries, hashes, parent, data, page_nbytes) -> (pages, last hash)
 *
 * Walks the leading pages of `data`: probe entries[parent || chunk]; on a hit take the page, and its
 * hash from `hashes` as the next parent; stop at the first miss. No SHA-256 runs here. */
static PyObject *py_match(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *entries, *hashes_obj;
    Py_buffer parent, data, hashes = {0};
    Py_ssize_t page_nbytes;
    if (!PyArg_ParseTuple(args, "O!Oy*y*n", &PyDict_Type, &entries, &hashes_obj, &parent, &data, &page_nbytes))
        return NULL;
    PyObject *result = NULL, *pages = NULL, *key = NULL;
    if (check_chain_args(&parent, &data, page_nbytes) < 0 || get_hashes(hashes_obj, &hashes, 0) < 0)
        goto done;
    if ((pages = PyList_New(0)) == NULL)
        goto done;
    Py_ssize_t num_pages = hashes.len / DIGEST;
    const uint8_t *last = parent.buf;
    for (Py_ssize_t start = 0; start < data.len; start += page_nbytes) {
        key = PyBytes_FromStringAndSize(NULL, DIGEST + page_nbytes);
        if (key == NULL)
            goto done;
        memcpy(PyBytes_AS_STRING(key), last, DIGEST);
        memcpy(PyBytes_AS_STRING(key) + DIGEST, (const char *)data.buf + start, (size_t)page_nbytes);
        PyObject *page = PyDict_GetItemWithError(entries, key); /* borrowed */
        Py_CLEAR(key);
        if (page == NULL) {
            if (PyErr_Occurred())
                goto done;
            break;
        }
        Py_ssize_t index = PyNumber_AsSsize_t(page, PyExc_IndexError);
        if (index == -1 && PyErr_Occurred())
            goto done;
        if (index < 0 || index >= num_pages) {
            PyErr_SetString(PyExc_IndexError, "page out of range");
            goto done;
        }
        if (PyList_Append(pages, page) < 0)
            goto done;
        last = (const uint8_t *)hashes.buf + index * DIGEST;
    }
    result = Py_BuildValue("Oy#", pages, (const char *)last, (Py_ssize_t)DIGEST);
done:
    Py_XDECREF(key);
    Py_XDECREF(pages);
    if (hashes.obj != NULL)
        PyBuffer_Release(&hashes);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return result;
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

/* lru_push(lru, pages): append pages (not in the list) as the newest, in order. */
static PyObject *py_lru_push(PyObject *Py_UNUSED(self), PyObject *args) {
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
        lru_push(lru.l, lru.head, p[i]);
    PyBuffer_Release(&pages);
    PyBuffer_Release(&lru.view);
    Py_RETURN_NONE;
}

/* lru_remove(lru, pages): unlink pages (all in the list). */
static PyObject *py_lru_remove(PyObject *Py_UNUSED(self), PyObject *args) {
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
        lru_unlink(lru.l, p[i]);
    PyBuffer_Release(&pages);
    PyBuffer_Release(&lru.view);
    Py_RETURN_NONE;
}

/* evict(lru, entries, key_of_page, is_hashed, num) -> pages
 *
 * Unlinks the `num` oldest pages of the LRU and takes them out of the index: del
 * entries[key_of_page[page]], key_of_page[page] = None, is_hashed[page] = 0. The caller checks that
 * `num` pages are cached. Returns the pages as a list, oldest first. */
static PyObject *py_evict(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *lru_obj, *entries, *key_of_page, *flags_obj;
    Py_ssize_t num;
    if (!PyArg_ParseTuple(args, "OO!O!On", &lru_obj, &PyDict_Type, &entries, &PyList_Type, &key_of_page, &flags_obj,
                          &num))
        return NULL;
    Lru lru;
    Py_buffer flags = {0};
    PyObject *pages = NULL;
    if (num < 0) {
        PyErr_SetString(PyExc_ValueError, "num must be >= 0");
        return NULL;
    }
    if (get_lru(lru_obj, &lru) < 0)
        return NULL;
    if (PyList_GET_SIZE(key_of_page) != lru.head) {
        PyErr_SetString(PyExc_ValueError, "key_of_page and lru disagree on the number of pages");
        goto done;
    }
    if (get_flags(flags_obj, &flags, lru.head) < 0 || (pages = PyList_New(num)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < num; i++) {
        int32_t page = lru.l[2 * lru.head + 1];
        if (page == lru.head) {
            PyErr_SetString(PyExc_ValueError, "fewer cached pages than asked to evict");
            Py_CLEAR(pages);  /* only on a caller's bug: the pages evicted so far stay evicted */
            goto done;
        }
        PyObject *key = PyList_GET_ITEM(key_of_page, page);
        PyObject *id = PyLong_FromLong(page);
        if (id == NULL || PyDict_DelItem(entries, key) < 0) {
            Py_XDECREF(id);
            Py_CLEAR(pages);
            goto done;
        }
        lru_unlink(lru.l, page);
        PyList_SET_ITEM(pages, i, id);
        PyList_SET_ITEM(key_of_page, page, Py_NewRef(Py_None));
        Py_DECREF(key);
        ((uint8_t *)flags.buf)[page] = 0;
    }
done:
    if (flags.obj != NULL)
        PyBuffer_Release(&flags);
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
     "commit(entries, key_of_page, hashes, is_hashed, pages, parent, data, page_nbytes) -> last hash."},
    {"match", py_match, METH_VARARGS, "match(entries, hashes, parent, data, page_nbytes) -> (pages, last hash)."},
    {"evict", py_evict, METH_VARARGS, "evict(lru, entries, key_of_page, is_hashed, num) -> evicted pages."},
    {"lru_push", py_lru_push, METH_VARARGS, "lru_push(lru, pages): append pages as the newest."},
    {"lru_remove", py_lru_remove, METH_VARARGS, "lru_remove(lru, pages): unlink pages."},
    {"int64_bytes", py_int64_bytes, METH_O, "int64_bytes(token_ids) -> native int64 bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prefix", "Compiled prefix-cache loops.", -1, methods};

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
