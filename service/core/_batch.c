/* The per-sequence loops of a step, compiled: splitting the appends into columns and finding each
 * sequence's row, and a decode step's block-table updates (one token for each sequence).
 * service/core/batching.py holds the Python definitions, which the tests hold these to. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_ROW (1 << 24) /* rows of a block table; beyond, unzip_appends leaves the work to Python */

/* unzip_appends(seqs, appends) -> (ids, counts, token_lists, rows, distinct) | None
 *
 * appends: a list of (seq_id, num_tokens, token_ids) tuples; seqs: seq_id -> an object with an int
 * attribute `row`. Returns the three columns as lists, the rows as native int64 bytes, and whether
 * no row repeats. None when an append is not such a tuple, an id is unknown or a row is not an int
 * in [0, 2**24): the caller's Python path then raises the right error. */
static PyObject *py_unzip_appends(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *seqs, *appends;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &seqs, &PyList_Type, &appends))
        return NULL;
    static PyObject *row_name = NULL;
    if (row_name == NULL && (row_name = PyUnicode_InternFromString("row")) == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(appends);
    PyObject *ids = PyList_New(n), *counts = PyList_New(n), *tokens = PyList_New(n);
    PyObject *rows = PyBytes_FromStringAndSize(NULL, n * 8), *result = NULL;
    uint8_t *seen = NULL;
    if (ids == NULL || counts == NULL || tokens == NULL || rows == NULL)
        goto done;
    int64_t *row_of = (int64_t *)PyBytes_AS_STRING(rows), most = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *append = PyList_GET_ITEM(appends, i);
        if (!PyTuple_CheckExact(append) || PyTuple_GET_SIZE(append) != 3)
            goto unusual;
        PyObject *seq_id = PyTuple_GET_ITEM(append, 0);
        PyObject *seq = PyDict_GetItemWithError(seqs, seq_id); /* borrowed */
        if (seq == NULL) {
            if (PyErr_Occurred())
                goto done;
            goto unusual;
        }
        PyObject *row = PyObject_GetAttr(seq, row_name);
        if (row == NULL)
            goto done;
        long long value = PyLong_CheckExact(row) ? PyLong_AsLongLong(row) : -1;
        Py_DECREF(row);
        if (value < 0 || value >= MAX_ROW) {
            if (PyErr_Occurred())
                goto done;
            goto unusual;
        }
        row_of[i] = value;
        most = value > most ? value : most;
        PyList_SET_ITEM(ids, i, Py_NewRef(seq_id));
        PyList_SET_ITEM(counts, i, Py_NewRef(PyTuple_GET_ITEM(append, 1)));
        PyList_SET_ITEM(tokens, i, Py_NewRef(PyTuple_GET_ITEM(append, 2)));
    }
    /* Whether any row repeats (ids are distinct exactly when their rows are): a byte per row. */
    if ((seen = PyMem_Calloc((size_t)most + 1, 1)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int distinct = 1;
    for (Py_ssize_t i = 0; i < n && distinct; i++)
        distinct = !seen[row_of[i]]++;
    result = Py_BuildValue("OOOOO", ids, counts, tokens, rows, distinct ? Py_True : Py_False);
    goto done;
unusual:
    result = Py_NewRef(Py_None);
done: /* lists whose tail is still NULL are freed safely: list_dealloc skips NULL items */
    Py_XDECREF(ids);
    Py_XDECREF(counts);
    Py_XDECREF(tokens);
    PyMem_Free(seen);
    Py_XDECREF(rows);
    return result;
}

/* A C-contiguous buffer of `len` items of `itemsize` bytes (writable if asked), or -1 with an error. */
static int get_array(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s: not an array of %zd-byte items", what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

typedef struct {
    Py_buffer tables, lengths, rows;
    Py_ssize_t width, num_rows;
} Rows;

/* tables: uint32 [num_rows, width]; lengths: int64 [num_rows]; rows: int64 row ids, all checked. */
static int get_rows(Rows *r, PyObject *tables, Py_ssize_t width, PyObject *lengths, PyObject *rows, int writable) {
    memset(r, 0, sizeof *r);
    if (width <= 0) {
        PyErr_SetString(PyExc_ValueError, "width must be > 0");
        return -1;
    }
    r->width = width;
    if (get_array(tables, &r->tables, 4, writable, "tables") < 0)
        return -1;
    if (get_array(lengths, &r->lengths, 8, writable, "lengths") < 0)
        goto fail;
    if (get_array(rows, &r->rows, 8, 0, "rows") < 0)
        goto fail;
    r->num_rows = r->lengths.len / 8;
    if (r->tables.len / 4 != r->num_rows * width) {
        PyErr_SetString(PyExc_ValueError, "tables and lengths disagree on the number of rows");
        goto fail;
    }
    const int64_t *ids = r->rows.buf;
    for (Py_ssize_t i = 0; i < r->rows.len / 8; i++)
        if (ids[i] < 0 || ids[i] >= r->num_rows) {
            PyErr_SetString(PyExc_IndexError, "row out of range");
            goto fail;
        }
    return 0;
fail:
    if (r->rows.obj != NULL)
        PyBuffer_Release(&r->rows);
    if (r->lengths.obj != NULL)
        PyBuffer_Release(&r->lengths);
    PyBuffer_Release(&r->tables);
    return -1;
}

static void release_rows(Rows *r) {
    PyBuffer_Release(&r->rows);
    PyBuffer_Release(&r->lengths);
    PyBuffer_Release(&r->tables);
}

/* decode_plan(tables, width, lengths, ref_count, rows, page_size) -> (pages to open, most pages) | None
 *
 * For one more token in each of `rows`: how many need a new page (their length is a multiple of
 * page_size) and the largest page count after the step. None when a row's partial last page is
 * shared (ref_count > 1): it needs copy-on-write, which the general path does. Changes nothing. */
static PyObject *py_decode_plan(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *tables, *lengths, *ref_count_obj, *rows_obj;
    Py_ssize_t width, page_size;
    if (!PyArg_ParseTuple(args, "OnOOOn", &tables, &width, &lengths, &ref_count_obj, &rows_obj, &page_size))
        return NULL;
    if (page_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "page_size must be > 0");
        return NULL;
    }
    Rows r;
    Py_buffer ref_count;
    if (get_rows(&r, tables, width, lengths, rows_obj, 0) < 0)
        return NULL;
    if (get_array(ref_count_obj, &ref_count, 4, 0, "ref_count") < 0) {
        release_rows(&r);
        return NULL;
    }
    const int64_t *ids = r.rows.buf, *len = r.lengths.buf;
    const uint32_t *table = r.tables.buf;
    const int32_t *refs = ref_count.buf;
    Py_ssize_t opening = 0, most = 0, num_pages = ref_count.len / 4;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < r.rows.len / 8; i++) {
        int64_t length = len[ids[i]], col = length / page_size;
        if (col >= width) {
            PyErr_SetString(PyExc_ValueError, "a block table is narrower than its length");
            goto done;
        }
        if (length % page_size == 0) {
            opening++;
        } else {
            uint32_t page = table[ids[i] * width + col];
            if (page >= num_pages) {
                PyErr_SetString(PyExc_ValueError, "a partial page is missing from its block table");
                goto done;
            }
            if (refs[page] > 1) {
                result = Py_NewRef(Py_None);
                goto done;
            }
        }
        if (col + 1 > most)
            most = col + 1;
    }
    result = Py_BuildValue("nn", opening, most);
done:
    PyBuffer_Release(&ref_count);
    release_rows(&r);
    return result;
}

/* decode_apply(tables, width, lengths, num_pages, rows, new_pages, page_size, slots) -> None
 *
 * Appends one token to each of `rows` (distinct): a row whose length is a multiple of page_size
 * takes the next of `new_pages` (in row order, as decode_plan counted them) into its table; every
 * row's length grows by one and its page count becomes length / page_size + 1 (the old length's);
 * slots[i] = page * page_size + offset of the new token of rows[i]. */
static PyObject *py_decode_apply(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *tables, *lengths, *num_pages_obj, *rows_obj, *new_pages_obj, *slots_obj;
    Py_ssize_t width, page_size;
    if (!PyArg_ParseTuple(args, "OnOOOOnO", &tables, &width, &lengths, &num_pages_obj, &rows_obj, &new_pages_obj,
                          &page_size, &slots_obj))
        return NULL;
    if (page_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "page_size must be > 0");
        return NULL;
    }
    Rows r;
    Py_buffer num_pages = {0}, new_pages = {0}, slots = {0};
    PyObject *result = NULL;
    if (get_rows(&r, tables, width, lengths, rows_obj, 1) < 0)
        return NULL;
    if (get_array(num_pages_obj, &num_pages, 8, 1, "num_pages") < 0 ||
        get_array(new_pages_obj, &new_pages, 8, 0, "new_pages") < 0 || get_array(slots_obj, &slots, 8, 1, "slots") < 0)
        goto done;
    Py_ssize_t n = r.rows.len / 8, opening = 0;
    if (num_pages.len / 8 != r.num_rows || slots.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "num_pages or slots has the wrong length");
        goto done;
    }
    const int64_t *ids = r.rows.buf, *fresh = new_pages.buf;
    int64_t *len = r.lengths.buf, *pages_of = num_pages.buf, *out = slots.buf;
    uint32_t *table = r.tables.buf;
    for (Py_ssize_t i = 0; i < n; i++)  /* check first: a failure changes nothing */
        if (len[ids[i]] / page_size >= width) {
            PyErr_SetString(PyExc_ValueError, "a block table is narrower than its length");
            goto done;
        } else if (len[ids[i]] % page_size == 0) {
            opening++;
        }
    if (opening != new_pages.len / 8) {
        PyErr_Format(PyExc_ValueError, "%zd rows open a page, %zd new pages given", opening, new_pages.len / 8);
        goto done;
    }
    for (Py_ssize_t i = 0, k = 0; i < n; i++) {
        int64_t row = ids[i], length = len[row], col = length / page_size, offset = length % page_size;
        uint32_t *entry = &table[row * width + col];
        if (offset == 0)
            *entry = (uint32_t)fresh[k++];
        out[i] = (int64_t)*entry * page_size + offset;
        len[row] = length + 1;
        pages_of[row] = col + 1;
    }
    result = Py_NewRef(Py_None);
done:
    if (num_pages.obj != NULL)
        PyBuffer_Release(&num_pages);
    if (new_pages.obj != NULL)
        PyBuffer_Release(&new_pages);
    if (slots.obj != NULL)
        PyBuffer_Release(&slots);
    release_rows(&r);
    return result;
}

static PyMethodDef methods[] = {
    {"unzip_appends", py_unzip_appends, METH_VARARGS,
     "unzip_appends(seqs, appends) -> (ids, counts, token_lists, rows as int64 bytes, distinct) or None."},
    {"decode_plan", py_decode_plan, METH_VARARGS,
     "decode_plan(tables, width, lengths, ref_count, rows, page_size) -> (pages to open, most pages) or None."},
    {"decode_apply", py_decode_apply, METH_VARARGS,
     "decode_apply(tables, width, lengths, num_pages, rows, new_pages, page_size, slots): one token each."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_batch", "Compiled per-sequence loops of a step.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__batch(void) { return PyModule_Create(&module); }
