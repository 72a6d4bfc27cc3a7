/* K/V copies between vLLM's CPU KV blocks and kvpool's page-major pool, all the V then all the K, without
 * the GIL. The Python side (service/integrations/vllm_copy.py) plans the runs; the tests hold this to
 * a token-by-token torch copy.
 *
 * pool:   [P + 1, 2, L, page_size, H, D]   one page of one layer's K (or V): [page_size, H, D]
 * caches: L buffers [blocks, H, block_size, 2 * D]: per block and head, K transposed ([D, block_size])
 *         then V ([block_size, D]), vLLM 0.32's CPU attention layout (checked at start by vllm_layout)
 * runs:   int64 [n, 4]: (block, offset in block, page, offset in page) of each run of `g` tokens
 *
 * Every argument and every run is checked before anything is copied, so a failure writes nothing.
 *
 * Builds of the per-run copies: wide ones (AVX-512, else AVX2, where the CPU has it: K transposed by tiles of
 * 16 x 16 items in registers, stores of whole 64-byte lines) for 4-byte items (AVX2 for 2-byte items) whose
 * shapes and buffers suit them, else a narrow one (SSE2 and scalar: any shape). Measured on an AMD EPYC
 * (Zen 5), one thread, 33 MB: the narrow load's K pass moved its bytes at ~45 % of a plain copy's rate (V
 * ~95 %): its 4 x 4 transposes and staging cost more instructions than the memory takes time; the AVX-512
 * load runs at ~95-110 % of a torch copy. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Stores that bypass the cache (x86-64): a copy of megabytes is bound by memory traffic, and an ordinary
 * store first reads the line it writes (a third stream beside the read and the write). glibc's memcpy
 * streams its large copies the same way, so without this the copy reached half of a torch copy. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <emmintrin.h>
#define HAVE_STREAM 1
static inline int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* memcpy(dst, src, n) with streaming stores where dst and n allow; else memcpy. */
static inline void copy_streaming(void *restrict dst, const void *restrict src, size_t n) {
    if (!aligned16(dst) || n % 16) {
        memcpy(dst, src, n);
        return;
    }
    __m128i *d = (__m128i *)dst;
    const __m128i *s = (const __m128i *)src;
    for (size_t i = 0; i < n / 16; i++)
        _mm_stream_si128(d + i, _mm_loadu_si128(s + i));
}
#define STORE16(dst, v) (aligned16(dst) ? _mm_stream_si128((__m128i *)(dst), (__m128i)(v)) : (void)memcpy((dst), &(v), 16))
#define FENCE() _mm_sfence()
#else
#define copy_streaming memcpy
#define STORE16(dst, v) memcpy((dst), &(v), 16)
#define FENCE() ((void)0)
#endif

/* A C-contiguous, writable buffer of `ndim` dimensions with items of 2 or 4 bytes (int64 for runs). */
static int get_buffer(PyObject *obj, Py_buffer *view, int ndim, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return -1;
    if (view->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous %d-D array", what, ndim);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

/* One run of g tokens of one layer. V: per token, H rows of D, contiguous on vLLM's side per head and
 * one [H * D] row on the pool's. K: per head a transpose, [D, block_size] on vLLM's side and [g, H * D]
 * rows on the pool's; for 4-byte items it goes 4 x 4 at a time through vector registers (GCC's vector
 * extension: SSE on any x86-64), else one item at a time. `row` = H * D, `hs` = the head stride in the cache. */
#if defined(__GNUC__) && !defined(__clang__)
#define HAVE_TRANSPOSE4 1
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

/* dst[j * dstride + i] = src[i * sstride + j] for i, j < 4. */
static inline void transpose4(const uint32_t *src, Py_ssize_t sstride, uint32_t *dst, Py_ssize_t dstride, int stream) {
    v4u a, b, c, d;
    memcpy(&a, src, 16);
    memcpy(&b, src + sstride, 16);
    memcpy(&c, src + 2 * sstride, 16);
    memcpy(&d, src + 3 * sstride, 16);
    const v4u ab0 = __builtin_shuffle(a, b, (v4i){0, 4, 1, 5}), ab1 = __builtin_shuffle(a, b, (v4i){2, 6, 3, 7});
    const v4u cd0 = __builtin_shuffle(c, d, (v4i){0, 4, 1, 5}), cd1 = __builtin_shuffle(c, d, (v4i){2, 6, 3, 7});
    const v4u r0 = __builtin_shuffle(ab0, cd0, (v4i){0, 1, 4, 5}), r1 = __builtin_shuffle(ab0, cd0, (v4i){2, 3, 6, 7});
    const v4u r2 = __builtin_shuffle(ab1, cd1, (v4i){0, 1, 4, 5}), r3 = __builtin_shuffle(ab1, cd1, (v4i){2, 3, 6, 7});
    if (stream) {
        STORE16(dst, r0);
        STORE16(dst + dstride, r1);
        STORE16(dst + 2 * dstride, r2);
        STORE16(dst + 3 * dstride, r3);
        return;
    }
    memcpy(dst, &r0, 16);
    memcpy(dst + dstride, &r1, 16);
    memcpy(dst + 2 * dstride, &r2, 16);
    memcpy(dst + 3 * dstride, &r3, 16);
}
#endif

#define RUN_COPY(T)                                                                                           \
    static void run_v_##T(T *restrict page_v, T *restrict block, Py_ssize_t off, Py_ssize_t g, Py_ssize_t H,   \
                          Py_ssize_t D, Py_ssize_t bs, int to_pool) {                                          \
        const Py_ssize_t row = H * D, hs = bs * 2 * D;                                                         \
        for (Py_ssize_t t = 0; t < g; t++)                                                                     \
            for (Py_ssize_t h = 0; h < H; h++) {                                                               \
                T *v = block + h * hs + bs * D + (off + t) * D, *pv = page_v + t * row + h * D;                \
                if (to_pool)                                                                                   \
                    copy_streaming(pv, v, D * sizeof(T));                                                      \
                else                                                                                           \
                    copy_streaming(v, pv, D * sizeof(T));                                                      \
            }                                                                                                  \
    }                                                                                                          \
    static void run_k_##T(T *restrict page_k, T *restrict block, Py_ssize_t off, Py_ssize_t g, Py_ssize_t H,   \
                          Py_ssize_t D, Py_ssize_t bs, int to_pool) {                                          \
        const Py_ssize_t row = H * D, hs = bs * 2 * D;                                                         \
        if (FAST_##T && !to_pool && g % 16 == 0 && D % 4 == 0 && D <= 256) {                                  \
            /* To vLLM: K's rows in the block get 16 tokens (64 bytes, a whole line) at a time, transposed \
             * into `stage` first, so that each line is streamed whole. */                                     \
            T stage[256 * 16];                                                                                 \
            for (Py_ssize_t h = 0; h < H; h++)                                                                 \
                for (Py_ssize_t t0 = 0; t0 < g; t0 += 16) {                                                    \
                    for (Py_ssize_t t = 0; t < 16; t += 4)                                                     \
                        for (Py_ssize_t d = 0; d < D; d += 4)                                                  \
                            TRANSPOSE_##T(page_k + (t0 + t) * row + h * D + d, row, stage + d * 16 + t, 16, 0); \
                    for (Py_ssize_t d = 0; d < D; d++)                                                         \
                        copy_streaming(block + h * hs + d * bs + off + t0, stage + d * 16, 16 * sizeof(T));     \
                }                                                                                              \
            return;                                                                                            \
        }                                                                                                      \
        if (FAST_##T && g % 4 == 0 && D % 4 == 0) {                                                            \
            for (Py_ssize_t t = 0; t < g; t += 4)                                                              \
                for (Py_ssize_t h = 0; h < H; h++)                                                             \
                    for (Py_ssize_t d = 0; d < D; d += 4) {                                                    \
                        T *k = block + h * hs + d * bs + off + t, *pk = page_k + t * row + h * D + d;          \
                        if (to_pool)                                                                           \
                            TRANSPOSE_##T(k, bs, pk, row, 1);                                                  \
                        else                                                                                   \
                            TRANSPOSE_##T(pk, row, k, bs, 0);                                                  \
                    }                                                                                          \
            return;                                                                                            \
        }                                                                                                      \
        for (Py_ssize_t t = 0; t < g; t++)                                                                     \
            for (Py_ssize_t h = 0; h < H; h++) {                                                               \
                T *k = block + h * hs + off + t, *pk = page_k + t * row + h * D;                               \
                for (Py_ssize_t d = 0; d < D; d++) {                                                           \
                    if (to_pool)                                                                               \
                        pk[d] = k[d * bs];                                                                     \
                    else                                                                                       \
                        k[d * bs] = pk[d];                                                                     \
                }                                                                                              \
            }                                                                                                  \
    }
#ifdef HAVE_TRANSPOSE4
#define FAST_uint32_t 1
#define TRANSPOSE_uint32_t transpose4
#else
#define FAST_uint32_t 0
#define TRANSPOSE_uint32_t(a, b, c, d, e) ((void)(a), (void)(b), (void)(c), (void)(d), (void)(e))
#endif
#define FAST_uint16_t 0
#define TRANSPOSE_uint16_t(a, b, c, d, e) ((void)(a), (void)(b), (void)(c), (void)(d), (void)(e))
RUN_COPY(uint32_t)
RUN_COPY(uint16_t)

#include "_vllm_copy_wide.h"

/* All the V, then all the K (measured: interleaved per run, the two took twice the time they take apart);
 * saves layer by layer (each layer's cache read as one stream), loads page by page. */
#define COPY_ONE(T, RUN_K, RUN_V, part, r, l)                                                                \
    do {                                                                                                     \
        const int64_t *run = runs + 4 * (r);                                                                 \
        T *page = (T *)pool->buf + run[2] * page_stride + (l) * layer_stride + run[3] * H * D;                \
        T *block = (T *)caches[l].buf + run[0] * block_stride;                                               \
        if (part)                                                                                            \
            RUN_K(page, block, run[1], g, H, D, bs, to_pool);                                                \
        else                                                                                                 \
            RUN_V(page + L * layer_stride, block, run[1], g, H, D, bs, to_pool);                             \
    } while (0)
#define COPY_LOOP(T, RUN_K, RUN_V)                                                                           \
    for (int part = 0; part < 2; part++) {                                                                   \
        if (to_pool) {                                                                                       \
            for (Py_ssize_t l = 0; l < L; l++)                                                               \
                for (Py_ssize_t r = 0; r < n_runs; r++)                                                      \
                    COPY_ONE(T, RUN_K, RUN_V, part, r, l);                                                   \
        } else {                                                                                             \
            for (Py_ssize_t r = 0; r < n_runs; r++)                                                          \
                for (Py_ssize_t l = 0; l < L; l++)                                                           \
                    COPY_ONE(T, RUN_K, RUN_V, part, r, l);                                                   \
        }                                                                                                    \
    }

static int aligned64(const void *p) { return ((uintptr_t)p & 63) == 0; }

/* The build that takes this copy: the widest of the CPU's up to `widest`, where the shapes and buffers suit
 * a wide one (see HAVE_WIDE). */
static int build_for(const Py_buffer *pool, const Py_buffer *caches, Py_ssize_t n_caches, Py_ssize_t g, int widest) {
    const Py_ssize_t D = pool->shape[5], bs = caches[0].shape[2];
    const Py_ssize_t line = 64 / pool->itemsize; /* items per line */
    /* 4-byte items: up to AVX-512; 2-byte items: AVX2 (a line of K in a block needs bs a multiple of 32) */
    const int cap = pool->itemsize == 4 ? WIDE_AVX512 : WIDE_AVX2;
    if (D % line || g % 16 || bs % line || !aligned64(pool->buf))
        return NARROW;
    for (Py_ssize_t i = 0; i < n_caches; i++)
        if (!aligned64(caches[i].buf))
            return NARROW;
    const int build = widest < cpu_build ? widest : cpu_build;
    return build < cap ? build : cap;
}

static void copy_runs(const Py_buffer *pool, const Py_buffer *caches, const int64_t *runs, Py_ssize_t n_runs,
                      Py_ssize_t g, int to_pool, int build) {
    const Py_ssize_t L = pool->shape[2], ps = pool->shape[3], H = pool->shape[4], D = pool->shape[5];
    const Py_ssize_t bs = caches[0].shape[2];
    const Py_ssize_t layer_stride = ps * H * D, page_stride = 2 * L * layer_stride;
    const Py_ssize_t block_stride = H * bs * 2 * D;
#if HAVE_WIDE
    if (build == WIDE_AVX512) {
        COPY_LOOP(uint32_t, run_k_avx512, run_v_avx512)
        FENCE();
        return;
    }
    if (build == WIDE_AVX2 && pool->itemsize == 4) {
        COPY_LOOP(uint32_t, run_k_avx2, run_v_avx2)
        FENCE();
        return;
    }
    if (build == WIDE_AVX2 && !to_pool && g == 16) {
        /* 2-byte loads in runs of 16 (half a line of K): the V as usual, then the K of two runs at a time
         * where they fill a line together */
        for (Py_ssize_t r = 0; r < n_runs; r++)
            for (Py_ssize_t l = 0; l < L; l++)
                COPY_ONE(uint16_t, run_k_avx2_16, run_v_avx2_16, 0, r, l);
        for (Py_ssize_t r = 0, step; r < n_runs; r += step) {
            const int64_t *run = runs + 4 * r;
            step = r + 1 < n_runs && run[4] == run[0] && run[5] == run[1] + 16 && run[1] % 32 == 0 ? 2 : 1;
            for (Py_ssize_t l = 0; l < L; l++) {
                if (step == 1) {
                    COPY_ONE(uint16_t, run_k_avx2_16, run_v_avx2_16, 1, r, l);
                    continue;
                }
                const uint16_t *base = (const uint16_t *)pool->buf + l * layer_stride;
                load_k_pair_avx2_16(base + run[2] * page_stride + run[3] * H * D,
                                    base + run[6] * page_stride + run[7] * H * D,
                                    (uint16_t *)caches[l].buf + run[0] * block_stride, run[1], H, D, bs);
            }
        }
        FENCE();
        return;
    }
    if (build == WIDE_AVX2) {
        COPY_LOOP(uint16_t, run_k_avx2_16, run_v_avx2_16)
        FENCE();
        return;
    }
#else
    (void)build;
#endif
    if (pool->itemsize == 4) {
        COPY_LOOP(uint32_t, run_k_uint32_t, run_v_uint32_t)
    } else {
        COPY_LOOP(uint16_t, run_k_uint16_t, run_v_uint16_t)
    }
    FENCE(); /* the streamed stores are visible to other threads (the reader of the pool or the cache) after this */
}

static PyObject *copy(PyObject *self, PyObject *args) {
    PyObject *pool_obj, *caches_obj, *runs_obj;
    Py_ssize_t g;
    int to_pool, widest = WIDE_AVX512;
    const char *widest_name = NULL;
    if (!PyArg_ParseTuple(args, "OOOnp|s", &pool_obj, &caches_obj, &runs_obj, &g, &to_pool, &widest_name))
        return NULL;
    if (widest_name != NULL) {
        for (widest = WIDE_AVX512; widest >= NARROW && strcmp(widest_name, BUILD_NAMES[widest]); widest--)
            ;
        if (widest < NARROW) {
            PyErr_Format(PyExc_ValueError, "widest: expected 'avx512', 'avx2' or 'narrow', not '%s'", widest_name);
            return NULL;
        }
    }
    PyObject *seq = PySequence_Fast(caches_obj, "caches: expected a sequence of arrays");
    if (seq == NULL)
        return NULL;
    Py_buffer pool = {0}, runs = {0};
    Py_ssize_t n_caches = PySequence_Fast_GET_SIZE(seq), got = 0;
    Py_buffer *caches = PyMem_Calloc(n_caches > 0 ? n_caches : 1, sizeof(Py_buffer));
    PyObject *result = NULL;
    if (caches == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (get_buffer(pool_obj, &pool, 6, "pool") < 0 || get_buffer(runs_obj, &runs, 2, "runs") < 0)
        goto done;
    if ((pool.itemsize != 2 && pool.itemsize != 4) || pool.shape[1] != 2 || pool.shape[2] != n_caches ||
        n_caches == 0) {
        PyErr_SetString(PyExc_ValueError, "pool: expected [pages, 2, layers, page_size, H, D] of 2- or 4-byte items, "
                                          "one layer per cache");
        goto done;
    }
    if (runs.itemsize != 8 || runs.shape[1] != 4) {
        PyErr_SetString(PyExc_ValueError, "runs: expected int64 [n, 4]");
        goto done;
    }
    const Py_ssize_t ps = pool.shape[3], H = pool.shape[4], D = pool.shape[5];
    for (; got < n_caches; got++) {
        if (get_buffer(PySequence_Fast_GET_ITEM(seq, got), &caches[got], 4, "cache") < 0)
            goto done;
        const Py_buffer *c = &caches[got];
        if (c->itemsize != pool.itemsize || c->shape[1] != H || c->shape[3] != 2 * D ||
            c->shape[2] != caches[0].shape[2] || c->shape[0] != caches[0].shape[0]) {
            got++;
            PyErr_SetString(PyExc_ValueError, "cache: expected [blocks, H, block_size, 2 * D] like the pool and the "
                                              "other layers");
            goto done;
        }
    }
    const Py_ssize_t blocks = caches[0].shape[0], bs = caches[0].shape[2], n_runs = runs.shape[0];
    const int64_t *r = runs.buf;
    if (g <= 0) {
        PyErr_SetString(PyExc_ValueError, "g: expected a positive run length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_runs; i++, r += 4) {
        if (r[0] < 0 || r[0] >= blocks || r[1] < 0 || r[1] + g > bs || r[2] < 0 || r[2] >= pool.shape[0] ||
            r[3] < 0 || r[3] + g > ps) {
            PyErr_Format(PyExc_ValueError, "run %zd (block %lld + %lld, page %lld + %lld) is outside the cache or "
                         "the pool", i, (long long)r[0], (long long)r[1], (long long)r[2], (long long)r[3]);
            goto done;
        }
    }
    const int build = build_for(&pool, caches, n_caches, g, widest);
    Py_BEGIN_ALLOW_THREADS
    copy_runs(&pool, caches, runs.buf, n_runs, g, to_pool, build);
    Py_END_ALLOW_THREADS
    result = PyUnicode_FromString(BUILD_NAMES[build]);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        if (caches[i].obj != NULL)
            PyBuffer_Release(&caches[i]);
    if (pool.obj != NULL)
        PyBuffer_Release(&pool);
    if (runs.obj != NULL)
        PyBuffer_Release(&runs);
    PyMem_Free(caches);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(pool, caches, runs, g, to_pool, widest='avx512'): copy the runs of g tokens of every layer, vLLM "
     "blocks -> pool pages (to_pool) or back, with the widest build up to `widest` that the CPU, the shapes and "
     "the buffers allow ('avx512', 'avx2', 'narrow'); returns the build's name"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_vllm_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__vllm_copy(void) {
    cpu_build = cpu_wide();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "CPU_BUILD", BUILD_NAMES[cpu_build]) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
