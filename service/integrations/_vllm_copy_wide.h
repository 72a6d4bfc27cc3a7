/* The wide builds of _vllm_copy.c's per-run copies (included there once, after the narrow build, whose
 * run_k_uint32_t the AVX2 saves reuse): run_k_<isa> / run_v_<isa> with the narrow build's signature,
 * cpu_wide() and BUILD_NAMES. */
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
