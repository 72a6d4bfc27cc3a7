/* The per-page loops of allocation, compiled: popping pages off the free stack, releasing
 * references, and numbering the slots of consecutive positions. service/core/page_ops.py holds the
 * Python definitions, which the tests hold these to. Every function checks all of its input before
 * it writes anything, so a failure changes nothing. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A 1-D buffer of one of the item types in `types`: "i" int32, "u" uint32, "8" int64, "1" bool (as
 * numpy exports them, native byte order), writable if asked; C-contiguous, or any stride when `types`
 * has "s"; -1 with an error otherwise. */
static int get_ints(PyObject *obj, Py_buffer *view, int writable, const char *types, const char *what) {
    int strided = strchr(types, 's') != NULL;
    int flags = PyBUF_FORMAT | (strided ? PyBUF_STRIDES : PyBUF_C_CONTIGUOUS) | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s: not a 1-D array", what);
        PyBuffer_Release(view);
        return -1;
    }
    const char *f = view->format;
    if (f != NULL && (f[0] == '@' || f[0] == '=' || f[0] == '<'))
        f++;
    int ok = f != NULL && f[0] != '\0' && f[1] == '\0';
    if (ok && view->itemsize == 4)
        ok = (strchr(types, 'i') != NULL && f[0] == 'i') || (strchr(types, 'u') != NULL && f[0] == 'I');
    else if (ok && view->itemsize == 8)
        ok = strchr(types, '8') != NULL && (f[0] == 'l' || f[0] == 'q');
    else if (ok && view->itemsize == 1)
        ok = strchr(types, '1') != NULL && f[0] == '?';
    else
        ok = 0;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: not an array of the expected integer type", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release_all(Py_buffer **views, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (views[i]->obj != NULL)
            PyBuffer_Release(views[i]);
}

/* Item i of a 1-D view (any stride) of 4-byte unsigned or 8-byte signed page ids. */
static inline int64_t page_at(const Py_buffer *v, Py_ssize_t i) {
    const char *item = (const char *)v->buf + i * v->strides[0];
    return v->itemsize == 4 ? (int64_t) * (const uint32_t *)item : *(const int64_t *)item;
}

/* dst[j * size + k] = pages[first + j] * size + k for j < num, k < size: the slots of whole pages, in
 * a loop the compiler vectorises. */
static void fill_pages(int64_t *restrict dst, const Py_buffer *pages, Py_ssize_t first, Py_ssize_t num,
                       Py_ssize_t size) {
    for (Py_ssize_t j = 0; j < num; j++) {
        int64_t base = page_at(pages, first + j) * size, *restrict row = dst + j * size;
        for (Py_ssize_t k = 0; k < size; k++)
            row[k] = base + k;
    }
}

/* pop(free, top, ref_count, out) -> None
 *
 * out[i] = free[top - 1 - i] for each of its len(out) items (int64 or uint32), each page's ref_count
 * set to 1. */
static PyObject *py_pop(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *free_obj, *ref_obj, *out_obj;
    Py_ssize_t top;
    if (!PyArg_ParseTuple(args, "OnOO", &free_obj, &top, &ref_obj, &out_obj))
        return NULL;
    Py_buffer free = {0}, ref = {0}, out = {0};
    Py_buffer *views[] = {&free, &ref, &out};
    PyObject *result = NULL;
    if (get_ints(free_obj, &free, 0, "8", "free") < 0 || get_ints(ref_obj, &ref, 1, "i", "ref_count") < 0 ||
        get_ints(out_obj, &out, 1, "u8", "out") < 0)
        goto done;
    Py_ssize_t num = out.len / out.itemsize, num_pages = ref.len / 4;
    if (!(0 <= num && num <= top && top <= free.len / 8)) {
        PyErr_Format(PyExc_ValueError, "cannot pop %zd of %zd free pages", num, top);
        goto done;
    }
    const int64_t *stack = free.buf;
    for (Py_ssize_t i = 0; i < num; i++)
        if (stack[top - 1 - i] < 0 || stack[top - 1 - i] >= num_pages) {
            PyErr_SetString(PyExc_IndexError, "page out of range");
            goto done;
        }
    int32_t *refs = ref.buf;
    for (Py_ssize_t i = 0; i < num; i++) {
        int64_t page = stack[top - 1 - i];
        if (out.itemsize == 8)
            ((int64_t *)out.buf)[i] = page;
        else
            ((uint32_t *)out.buf)[i] = (uint32_t)page;
        refs[page] = 1;
    }
    result = Py_NewRef(Py_None);
done:
    release_all(views, 3);
    return result;
}

/* release(free, top, ref_count, is_hashed, pages, cached_out) -> (unreferenced, pushed)
 *
 * Drops one reference to each of `pages` (distinct, each referenced; a 1-D uint32 or int64 view), in
 * order. Pages left unreferenced go, in that order, to cached_out (int64) when
 * is_hashed (bool, or None) marks them, else onto the free stack above `top`, pushed so that the
 * first of them is popped next. */
static PyObject *py_release(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *free_obj, *ref_obj, *hashed_obj, *pages_obj, *cached_obj;
    Py_ssize_t top;
    if (!PyArg_ParseTuple(args, "OnOOOO", &free_obj, &top, &ref_obj, &hashed_obj, &pages_obj, &cached_obj))
        return NULL;
    Py_buffer free = {0}, ref = {0}, hashed = {0}, pages = {0}, cached = {0};
    Py_buffer *views[] = {&free, &ref, &hashed, &pages, &cached};
    PyObject *result = NULL;
    int caching = hashed_obj != Py_None && cached_obj != Py_None;
    if (get_ints(free_obj, &free, 1, "8", "free") < 0 || get_ints(ref_obj, &ref, 1, "i", "ref_count") < 0 ||
        get_ints(pages_obj, &pages, 0, "u8s", "pages") < 0 ||
        (caching && (get_ints(hashed_obj, &hashed, 0, "1", "is_hashed") < 0 ||
                     get_ints(cached_obj, &cached, 1, "8", "cached_out") < 0)))
        goto done;
    Py_ssize_t n = pages.len / pages.itemsize, num_pages = ref.len / 4, to_free = 0, to_cache = 0;
    if (top < 0 || top > free.len / 8 || (caching && hashed.len != num_pages)) {
        PyErr_SetString(PyExc_ValueError, "free, top, ref_count and is_hashed disagree");
        goto done;
    }
    int32_t *refs = ref.buf;
    const uint8_t *is_hashed = caching ? hashed.buf : NULL;
    for (Py_ssize_t i = 0; i < n; i++) /* check first: a failure changes nothing */
        if (page_at(&pages, i) < 0 || page_at(&pages, i) >= num_pages) {
            PyErr_SetString(PyExc_IndexError, "page out of range");
            goto done;
        }
    /* Each page's count is negated while it is checked, so a page given twice shows up as a negative
     * count; the counts are restored before anything else happens. */
    Py_ssize_t checked = 0;
    const char *problem = NULL;
    for (; checked < n && problem == NULL; checked++) {
        int64_t page = page_at(&pages, checked);
        if (refs[page] < 0)
            problem = "a page is given twice";
        else if (refs[page] == 0)
            problem = "releasing a page that has no reference";
        else if (refs[page] == 1 && caching && is_hashed[page])
            to_cache++;
        else if (refs[page] == 1)
            to_free++;
        if (problem == NULL)
            refs[page] = -refs[page];
    }
    for (Py_ssize_t i = 0; i < checked; i++) /* the pages negated above are distinct */
        if (refs[page_at(&pages, i)] < 0)
            refs[page_at(&pages, i)] = -refs[page_at(&pages, i)];
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        goto done;
    }
    if (top + to_free > free.len / 8 || (caching && to_cache > cached.len / 8)) {
        PyErr_SetString(PyExc_ValueError, "no room for the released pages");
        goto done;
    }
    int64_t *stack = free.buf, *cache = caching ? cached.buf : NULL;
    /* The k-th page freed (in release order) lands at stack[top + to_free - 1 - k]: the first on top. */
    Py_ssize_t k_free = 0, k_cache = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t page = page_at(&pages, j);
        if (--refs[page] != 0)
            continue;
        if (caching && is_hashed[page])
            cache[k_cache++] = page;
        else
            stack[top + to_free - 1 - k_free++] = page;
    }
    result = Py_BuildValue("nn", to_free + to_cache, to_free);
done:
    release_all(views, 5);
    return result;
}

/* page_slots(pages, offset, page_size, out) -> None
 *
 * out[i] = pages[(offset + i) / page_size] * page_size + (offset + i) % page_size. */
static PyObject *py_page_slots(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *pages_obj, *out_obj;
    Py_ssize_t offset, size;
    if (!PyArg_ParseTuple(args, "OnnO", &pages_obj, &offset, &size, &out_obj))
        return NULL;
    Py_buffer pages = {0}, out = {0};
    Py_buffer *views[] = {&pages, &out};
    PyObject *result = NULL;
    if (get_ints(pages_obj, &pages, 0, "u8s", "pages") < 0 || get_ints(out_obj, &out, 1, "8", "out") < 0)
        goto done;
    Py_ssize_t count = out.len / 8, num = pages.len / pages.itemsize;
    /* The last position's page, offset / size + (offset % size + count - 1) / size, without overflow. */
    if (size <= 0 || offset < 0 ||
        (count && (size_t)(offset / size) + ((size_t)(offset % size) + (size_t)(count - 1)) / (size_t)size >=
                      (size_t)num)) {
        PyErr_SetString(PyExc_ValueError, "the positions run past the pages given");
        goto done;
    }
    int64_t *dst = out.buf;
    Py_ssize_t p = offset / size, o = offset % size, i = 0;
    for (; i < count && o != 0; p += (++o == size), o %= size) /* a partial first page */
        dst[i++] = page_at(&pages, p) * size + o;
    Py_ssize_t whole = (count - i) / size;
    fill_pages(dst + i, &pages, p, whole, size);
    i += whole * size;
    p += whole;
    for (Py_ssize_t k = 0; i < count; k++) /* a partial last page */
        dst[i++] = page_at(&pages, p) * size + k;
    result = Py_NewRef(Py_None);
done:
    release_all(views, 2);
    return result;
}

static PyMethodDef methods[] = {
    {"pop", py_pop, METH_VARARGS, "pop(free, top, ref_count, out): the top len(out) pages, each with ref_count 1."},
    {"release", py_release, METH_VARARGS,
     "release(free, top, ref_count, is_hashed, pages, cached_out) -> (unreferenced, pushed free)."},
    {"page_slots", py_page_slots, METH_VARARGS,
     "page_slots(pages, offset, page_size, out): slots of consecutive positions."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pages", "Compiled per-page loops of allocation.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pages(void) { return PyModule_Create(&module); }
