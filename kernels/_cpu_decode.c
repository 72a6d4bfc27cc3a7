/* Paged decode attention on the CPU, compiled: one query per sequence, float32 pool. The wrapper and
 * its torch definition are in kernels/cpu_decode.py; the tests hold this to kernels/reference.py.
 *
 * Each query reads only the K/V rows it attends to, straight out of the pool through the lookup
 * table: no gather into a padded batch, no permuted copies (the torch path's cost on small batches).
 * Every input is checked before anything is computed, so a failure writes nothing. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* A C-contiguous buffer of `ndim` dimensions whose item format (after a byte-order prefix) is one of
 * `formats`: 'f' float32, 'l'/'q' int64, 'I' uint32; -1 with a ValueError otherwise. */
static int get_array(PyObject *obj, Py_buffer *view, int writable, int ndim, const char *formats, const char *what) {
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *f = view->format;
    if (f != NULL && (f[0] == '@' || f[0] == '=' || f[0] == '<'))
        f++;
    int ok = f != NULL && f[0] != '\0' && f[1] == '\0' && strchr(formats, f[0]) != NULL && view->ndim == ndim;
    if (ok)
        ok = view->itemsize == (f[0] == 'l' || f[0] == 'q' ? 8 : 4);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: not a C-contiguous %d-D array of the expected type", what, ndim);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

#define CHUNK 32 /* output channels summed at once: 8 SSE registers */

static inline float dot(const float *restrict a, const float *restrict b, Py_ssize_t n) {
    /* Sixteen independent sums: four vector registers, so the adds do not wait on each other. */
    float s[16] = {0};
    Py_ssize_t d = 0;
    for (; d + 16 <= n; d += 16)
        for (int j = 0; j < 16; j++)
            s[j] += a[d + j] * b[d + j];
    for (int j = 0; j < 8; j++)
        s[j] += s[j + 8];
    float total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; d < n; d++)
        total += a[d] * b[d];
    return total;
}

/* Entry [b, col] of a [B, cols] table of int64 or uint32 page ids. */
static inline int64_t page_at(const Py_buffer *lut, Py_ssize_t b, int64_t col) {
    const Py_ssize_t i = b * lut->shape[1] + col;
    return lut->itemsize == 8 ? ((const int64_t *)lut->buf)[i] : (int64_t)((const uint32_t *)lut->buf)[i];
}

/* Attention of the `group` query heads that read K/V head h (q rows qv, out rows o) at position p over
 * keys first..p of sequence b: each K and V row is loaded once for the whole group. On x86-64 Linux
 * it is compiled twice, for AVX2 + FMA and for the baseline, and the loader picks the one the CPU runs. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
__attribute__((target_clones("avx2,fma", "default")))
#endif
static void attend_group(const float *pool, const Py_buffer *lut, Py_ssize_t b, Py_ssize_t h, int64_t p, int64_t first,
                         const float *qv, float *o, float *scores, Py_ssize_t group, Py_ssize_t head_dim,
                         Py_ssize_t row, Py_ssize_t kv_stride, Py_ssize_t num_layers, Py_ssize_t layer,
                         Py_ssize_t page_size, float scale, float softcap) {
    const Py_ssize_t n = (Py_ssize_t)(p + 1 - first); /* keys seen, scores[g * n + t - first] */
    for (int64_t t = first; t <= p;) { /* page by page: one division and one table read a page */
        const int64_t col = t / page_size, end = (col + 1) * page_size < p + 1 ? (col + 1) * page_size : p + 1;
        const float *k = pool + (page_at(lut, b, col) * 2 * num_layers + layer) * page_size * row +
                         (t - col * page_size) * row + h * head_dim;
        for (; t < end; t++, k += row)
            for (Py_ssize_t g = 0; g < group; g++) {
                float sc = dot(qv + g * head_dim, k, head_dim) * scale;
                scores[g * n + t - first] = softcap > 0 ? softcap * tanhf(sc / softcap) : sc;
            }
    }
    for (Py_ssize_t g = 0; g < group; g++) { /* softmax of each query head's row, normalised */
        float *row_g = scores + g * n, top = -INFINITY, total = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            top = row_g[i] > top ? row_g[i] : top;
        for (Py_ssize_t i = 0; i < n; i++)
            total += row_g[i] = expf(row_g[i] - top);
        for (Py_ssize_t i = 0; i < n; i++)
            row_g[i] /= total;
    }
    /* out = weights . V, CHUNK channels at a time, summed over every key in registers: a sum kept
     * in `o` across keys would wait on its own store at every key. */
    for (Py_ssize_t d0 = 0; d0 < head_dim; d0 += CHUNK)
        for (Py_ssize_t g = 0; g < group; g++) {
            const Py_ssize_t width = head_dim - d0 < CHUNK ? head_dim - d0 : CHUNK;
            float acc[CHUNK] = {0};
            const float *w = scores + g * n - first;
            for (int64_t t = first; t <= p;) {
                const int64_t col = t / page_size,
                              end = (col + 1) * page_size < p + 1 ? (col + 1) * page_size : p + 1;
                const float *v = pool + (page_at(lut, b, col) * 2 * num_layers + layer) * page_size * row +
                                 kv_stride + (t - col * page_size) * row + h * head_dim + d0;
                if (width == CHUNK)
                    for (; t < end; t++, v += row)
                        for (int d = 0; d < CHUNK; d++)
                            acc[d] += w[t] * v[d];
                else
                    for (; t < end; t++, v += row)
                        for (Py_ssize_t d = 0; d < width; d++)
                            acc[d] += w[t] * v[d];
            }
            memcpy(o + g * head_dim + d0, acc, (size_t)width * sizeof(float));
        }
}

/* decode(q, blocks, layer, lut, positions, scale, window, softcap, out) -> None
 *
 * q, out: float32 [B, Hq, D]; blocks: float32 [N + 1, 2, L, P, H, D]; lut: int64 or uint32 [B, cols];
 * positions: int64 [B], the query's position, which sees keys max(0, position - window + 1) ..
 * position (window 0: from 0). Scores are q.k * scale, then softcap * tanh(s / softcap) when
 * softcap > 0. Query head hq reads K/V head hq / (Hq / H). */
static PyObject *py_decode(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *q_obj, *blocks_obj, *lut_obj, *pos_obj, *out_obj;
    Py_ssize_t layer, window;
    double scale, softcap;
    if (!PyArg_ParseTuple(args, "OOnOOdndO", &q_obj, &blocks_obj, &layer, &lut_obj, &pos_obj, &scale, &window,
                          &softcap, &out_obj))
        return NULL;
    Py_buffer q = {0}, blocks = {0}, lut = {0}, pos = {0}, out = {0};
    Py_buffer *views[] = {&q, &blocks, &lut, &pos, &out};
    PyObject *result = NULL;
    float *scores = NULL;
    if (get_array(q_obj, &q, 0, 3, "f", "q") < 0 || get_array(blocks_obj, &blocks, 0, 6, "f", "blocks") < 0 ||
        get_array(lut_obj, &lut, 0, 2, "lqI", "lut (int64 or uint32)") < 0 ||
        get_array(pos_obj, &pos, 0, 1, "lq", "positions") < 0 || get_array(out_obj, &out, 1, 3, "f", "out") < 0)
        goto done;
    const Py_ssize_t batch = q.shape[0], num_q_heads = q.shape[1], head_dim = q.shape[2];
    const Py_ssize_t num_blocks = blocks.shape[0], num_layers = blocks.shape[2], page_size = blocks.shape[3];
    const Py_ssize_t num_kv_heads = blocks.shape[4], cols = lut.shape[1];
    if (blocks.shape[1] != 2 || blocks.shape[5] != head_dim || num_kv_heads < 1 || num_q_heads < 1 ||
        num_q_heads % num_kv_heads ||
        lut.shape[0] != batch || pos.shape[0] != batch || memcmp(out.shape, q.shape, 3 * sizeof(Py_ssize_t)) != 0) {
        PyErr_SetString(PyExc_ValueError, "q, blocks, lut, positions and out disagree in shape");
        goto done;
    }
    if (layer < 0 || layer >= num_layers || window < 0 || page_size < 1 || head_dim < 1) {
        PyErr_SetString(PyExc_ValueError, "layer, window, page size or head_dim out of range");
        goto done;
    }
    const int64_t *positions = pos.buf;
    Py_ssize_t longest = 0;
    for (Py_ssize_t b = 0; b < batch; b++) {
        int64_t p = positions[b];
        if (p < 0 || p == INT64_MAX || p / page_size >= cols) {
            PyErr_Format(PyExc_ValueError, "position %lld of query %zd is outside its lookup table row", (long long)p, b);
            goto done;
        }
        for (int64_t col = 0; col <= p / page_size; col++) {
            int64_t page = page_at(&lut, b, col);
            if (page < 0 || page >= num_blocks) {
                PyErr_Format(PyExc_IndexError, "page %lld of query %zd is out of range", (long long)page, b);
                goto done;
            }
        }
        longest = p + 1 > longest ? p + 1 : longest;
    }
    const Py_ssize_t group = num_q_heads / num_kv_heads;
    /* One query sees at most `span` keys; group rows of scores, sized without overflow. */
    const int64_t span = window > 0 && window < longest ? window : (longest > 0 ? longest : 1);
    if (span > (int64_t)(PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(float) / group) ||
        (scores = PyMem_Malloc((size_t)group * (size_t)span * sizeof(float))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const Py_ssize_t row = num_kv_heads * head_dim;            /* one token's K (or V) of one layer */
    const Py_ssize_t kv_stride = num_layers * page_size * row; /* K to V within a page */
    const float *pool = blocks.buf;
    /* The buffers stay exported (torch refuses to resize a tensor with a live numpy view) and the
     * engine's lock serialises every pool write and attention, so the GIL can go. */
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t b = 0; b < batch; b++) {
        const int64_t p = positions[b], first = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
        for (Py_ssize_t h = 0; h < num_kv_heads; h++)
            attend_group(pool, &lut, b, h, p, first, (const float *)q.buf + (b * num_q_heads + h * group) * head_dim,
                         (float *)out.buf + (b * num_q_heads + h * group) * head_dim, scores, group, head_dim, row,
                         kv_stride, num_layers, layer, page_size, (float)scale, (float)softcap);
    }
    Py_END_ALLOW_THREADS;
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(scores);
    for (size_t i = 0; i < sizeof(views) / sizeof(views[0]); i++)
        if (views[i]->obj != NULL)
            PyBuffer_Release(views[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS, "Paged decode attention of float32 queries over a float32 pool."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_decode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_decode(void) { return PyModule_Create(&module); }
