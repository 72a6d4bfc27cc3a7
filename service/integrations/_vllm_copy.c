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

/* The wide builds, AVX-512F or else AVX2, each compiled for its own functions only and taken where the CPU
 * has it (checked once at import), for 4-byte items with head_dim and block_size multiples of 16 (2-byte
 * items, AVX2 only: of 32), g a multiple of 16 and every buffer 64-byte aligned (then every row and run
 * starts on a line, or half a line for 2-byte runs). A K run goes by tiles of 16
 * tokens x 16 of head_dim: 16 lines read, transposed in registers, 16 whole lines streamed (an AVX2 line:
 * two 32-byte stores back to back, which the write-combining buffer joins). */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_WIDE 1
#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2")))
enum { NARROW, WIDE_AVX2, WIDE_AVX512 };

/* Saves read K from a block head by head, [head_dim, block_size] each (4-8 KB apart for the shapes measured):
 * the hardware's prefetchers do not cross 4 KB pages, so each tile asks for the next head's rows of the same
 * tile first. Measured (Zen 5, one thread, cold): bf16 saves 56-63 % -> 72-75 % of a torch copy, float32
 * (AVX-512) 80-94 % -> 92-110 %. */
static inline void prefetch_rows(const void *first, Py_ssize_t stride_bytes, int n) {
    for (int i = 0; i < n; i++)
        _mm_prefetch((const char *)first + i * stride_bytes, _MM_HINT_T0);
}

/* r[0..15], 16 rows of 16 floats -> the transpose (r[j][i] = the old r[i][j]): pairs unpacked, then 4 x 4
 * blocks within 128-bit lanes, then lanes exchanged in two rounds. */
AVX512 static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    }
}

/* dst[j * ds + i] = src[i * ss + j] for i, j < 16: a 16 x 16 tile, its lines streamed. */
AVX512 static inline void tile_avx512(const float *src, Py_ssize_t ss, float *dst, Py_ssize_t ds) {
    __m512 r[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_load_ps(src + i * ss);
    transpose16(r);
    for (int i = 0; i < 16; i++)
        _mm512_stream_ps(dst + i * ds, r[i]);
}

/* r[0..7], 8 rows of 8 floats -> the transpose. */
AVX2 static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

/* tile_avx512 with AVX2: four 8 x 8 blocks; each line of dst written by its two halves back to back. */
AVX2 static inline void tile_avx2(const float *src, Py_ssize_t ss, float *dst, Py_ssize_t ds) {
    __m256 q[2][2][8]; /* q[a][b]: rows 8a.. and columns 8b.. of src, then transposed */
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) {
            for (int i = 0; i < 8; i++)
                q[a][b][i] = _mm256_load_ps(src + (8 * a + i) * ss + 8 * b);
            transpose8(q[a][b]);
        }
    for (int b = 0; b < 2; b++)
        for (int j = 0; j < 8; j++) {
            _mm256_stream_ps(dst + (8 * b + j) * ds, q[0][b][j]);
            _mm256_stream_ps(dst + (8 * b + j) * ds + 8, q[1][b][j]);
        }
}

/* run_v / run_k of the narrow build, for 4-byte items: the same runs, the same order of V rows. AVX2 saves
 * K with the narrow build's transposes: measured (Zen 5, 33 MB, one thread), its tiles saved at 59-73 % of
 * a torch copy, the narrow K beside AVX2's V at 76-94 % (AVX-512's tiles: 80-101 %). */
#define RUN_WIDE(ISA, ATTR, LOAD, STREAM, LANES, SAVE_TILES)                                                     \
    ATTR static void run_v_##ISA(uint32_t *restrict page_v, uint32_t *restrict block, Py_ssize_t off,        \
                                 Py_ssize_t g, Py_ssize_t H, Py_ssize_t D, Py_ssize_t bs, int to_pool) {     \
        const Py_ssize_t row = H * D, hs = bs * 2 * D;                                                       \
        for (Py_ssize_t t = 0; t < g; t++)                                                                   \
            for (Py_ssize_t h = 0; h < H; h++) {                                                             \
                float *v = (float *)(block + h * hs + bs * D + (off + t) * D);                               \
                float *pv = (float *)(page_v + t * row + h * D);                                             \
                float *dst = to_pool ? pv : v, *src = to_pool ? v : pv;                                      \
                for (Py_ssize_t d = 0; d < D; d += LANES)                                                    \
                    STREAM(dst + d, LOAD(src + d));                                                          \
            }                                                                                                \
    }                                                                                                        \
    ATTR static void run_k_##ISA(uint32_t *restrict page_k, uint32_t *restrict block, Py_ssize_t off,        \
                                 Py_ssize_t g, Py_ssize_t H, Py_ssize_t D, Py_ssize_t bs, int to_pool) {     \
        const Py_ssize_t row = H * D, hs = bs * 2 * D;                                                       \
        if (to_pool && !SAVE_TILES) {                                                                        \
            run_k_uint32_t(page_k, block, off, g, H, D, bs, to_pool);                                        \
            return;                                                                                          \
        }                                                                                                    \
        for (Py_ssize_t t0 = 0; t0 < g; t0 += 16)                                                            \
            for (Py_ssize_t h = 0; h < H; h++)                                                               \
                for (Py_ssize_t d0 = 0; d0 < D; d0 += 16) {                                                  \
                    /* pk: [16 tokens][row] from (t0, h, d0); k: [16 of head_dim][bs] from (d0, off + t0) */ \
                    float *pk = (float *)(page_k + t0 * row + h * D + d0);                                   \
                    float *k = (float *)(block + h * hs + d0 * bs + off + t0);                               \
                    if (to_pool && h + 1 < H) /* see prefetch_rows */                                        \
                        prefetch_rows(k + hs, bs * sizeof(float), 16);                                       \
                    if (to_pool)                                                                             \
                        tile_##ISA(k, bs, pk, row);                                                          \
                    else                                                                                     \
                        tile_##ISA(pk, row, k, bs);                                                          \
                }                                                                                            \
    }
RUN_WIDE(avx512, AVX512, _mm512_load_ps, _mm512_stream_ps, 16, 1)
RUN_WIDE(avx2, AVX2, _mm256_load_ps, _mm256_stream_ps, 8, 0)

/* 2-byte items (bf16, fp16), AVX2 only: tiles of 16 x 16 items, each row 32 bytes (half a line).
 * r[0..15], 16 rows of 16 items -> the transpose: 16-, 32-, 64-bit interleaves, then 128-bit lanes. */
AVX2 static inline void transpose16_epi16(__m256i r[16]) {
    __m256i a[16], b[16], c[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        b[4 * i] = _mm256_unpacklo_epi32(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm256_unpackhi_epi32(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm256_unpacklo_epi32(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm256_unpackhi_epi32(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            c[8 * i + 2 * j] = _mm256_unpacklo_epi64(b[8 * i + j], b[8 * i + 4 + j]);
            c[8 * i + 2 * j + 1] = _mm256_unpackhi_epi64(b[8 * i + j], b[8 * i + 4 + j]);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm256_permute2x128_si256(c[j], c[8 + j], 0x20);
        r[j + 8] = _mm256_permute2x128_si256(c[j], c[8 + j], 0x31);
    }
}

/* r = the transpose of the 16 x 16 tile at src (rows ss items apart). */
AVX2 static inline void tile_epi16(const uint16_t *src, Py_ssize_t ss, __m256i r[16]) {
    for (int i = 0; i < 16; i++)
        r[i] = _mm256_load_si256((const __m256i *)(src + i * ss));
    transpose16_epi16(r);
}

AVX2 static void run_v_avx2_16(uint16_t *restrict page_v, uint16_t *restrict block, Py_ssize_t off, Py_ssize_t g,
                               Py_ssize_t H, Py_ssize_t D, Py_ssize_t bs, int to_pool) {
    const Py_ssize_t row = H * D, hs = bs * 2 * D;
    for (Py_ssize_t t = 0; t < g; t++)
        for (Py_ssize_t h = 0; h < H; h++) {
            uint16_t *v = block + h * hs + bs * D + (off + t) * D, *pv = page_v + t * row + h * D;
            uint16_t *dst = to_pool ? pv : v, *src = to_pool ? v : pv;
            for (Py_ssize_t d = 0; d < D; d += 16)
                _mm256_stream_si256((__m256i *)(dst + d), _mm256_load_si256((const __m256i *)(src + d)));
        }
}

/* K: a line holds 32 items. Saves pair the tiles of d0 and d0 + 16 (a pool row's line); loads pair the
 * tiles of t0 and t0 + 16 where both lie in this run, else write half a line with an ordinary store (its
 * other half comes from the next run, usually while the line is still cached), not a streamed one. */
AVX2 static void run_k_avx2_16(uint16_t *restrict page_k, uint16_t *restrict block, Py_ssize_t off, Py_ssize_t g,
                               Py_ssize_t H, Py_ssize_t D, Py_ssize_t bs, int to_pool) {
    const Py_ssize_t row = H * D, hs = bs * 2 * D;
    __m256i a[16], b[16];
    if (to_pool) {
        for (Py_ssize_t t0 = 0; t0 < g; t0 += 16)
            for (Py_ssize_t h = 0; h < H; h++)
                for (Py_ssize_t d0 = 0; d0 < D; d0 += 32) {
                    const uint16_t *k = block + h * hs + d0 * bs + off + t0;
                    uint16_t *pk = page_k + t0 * row + h * D + d0;
                    if (h + 1 < H)
                        prefetch_rows(k + hs, bs * sizeof(uint16_t), 32);
                    tile_epi16(k, bs, a);
                    tile_epi16(k + 16 * bs, bs, b);
                    for (int j = 0; j < 16; j++) {
                        _mm256_stream_si256((__m256i *)(pk + j * row), a[j]);
                        _mm256_stream_si256((__m256i *)(pk + j * row + 16), b[j]);
                    }
                }
        return;
    }
    for (Py_ssize_t t0 = 0; t0 < g;) {
        const int pair = (off + t0) % 32 == 0 && t0 + 32 <= g;
        for (Py_ssize_t h = 0; h < H; h++)
            for (Py_ssize_t d0 = 0; d0 < D; d0 += 16) {
                const uint16_t *pk = page_k + t0 * row + h * D + d0;
                uint16_t *k = block + h * hs + d0 * bs + off + t0;
                tile_epi16(pk, row, a);
                if (pair) {
                    tile_epi16(pk + 16 * row, row, b);
                    for (int j = 0; j < 16; j++) {
                        _mm256_stream_si256((__m256i *)(k + j * bs), a[j]);
                        _mm256_stream_si256((__m256i *)(k + j * bs + 16), b[j]);
                    }
                } else {
                    for (int j = 0; j < 16; j++)
                        _mm256_store_si256((__m256i *)(k + j * bs), a[j]);
                }
            }
        t0 += pair ? 32 : 16;
    }
}

/* A load's K of two runs of 16 tokens that fill one block's line (offsets off and off + 16, off a multiple
 * of 32; their pages apart): the two tiles of each (h, d0) make whole lines, streamed. */
AVX2 static void load_k_pair_avx2_16(const uint16_t *page_a, const uint16_t *page_b, uint16_t *restrict block,
                                     Py_ssize_t off, Py_ssize_t H, Py_ssize_t D, Py_ssize_t bs) {
    const Py_ssize_t row = H * D, hs = bs * 2 * D;
    __m256i a[16], b[16];
    for (Py_ssize_t h = 0; h < H; h++)
        for (Py_ssize_t d0 = 0; d0 < D; d0 += 16) {
            uint16_t *k = block + h * hs + d0 * bs + off;
            tile_epi16(page_a + h * D + d0, row, a);
            tile_epi16(page_b + h * D + d0, row, b);
            for (int j = 0; j < 16; j++) {
                _mm256_stream_si256((__m256i *)(k + j * bs), a[j]);
                _mm256_stream_si256((__m256i *)(k + j * bs + 16), b[j]);
            }
        }
}

static int cpu_wide(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? WIDE_AVX512 : __builtin_cpu_supports("avx2") ? WIDE_AVX2 : NARROW;
}
#else
#define HAVE_WIDE 0
enum { NARROW, WIDE_AVX2, WIDE_AVX512 };
static int cpu_wide(void) { return NARROW; }
#endif
static const char *const BUILD_NAMES[] = {"narrow", "avx2", "avx512"};
static int cpu_build; /* the widest build this CPU runs, set at import */

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
