/* The per-sequence loop at the start of a step, compiled: splitting the appends into columns and
 * finding each sequence's row. service/core/batching.py holds the Python definition, which the
 * tests hold this to; a decode step of 256 sequences spends a third of its time here otherwise. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* unzip_appends(seqs, appends) -> (ids, counts, token_lists, rows, distinct) | None
 *
 * appends: a list of (seq_id, num_tokens, token_ids) tuples; seqs: seq_id -> an object with an int
 * attribute `row`. Returns the three columns as lists, the rows as native int64 bytes, and whether
 * the ids are distinct. None when an append is not such a tuple or an id is unknown: the caller's
 * Python path then raises the right error. */
static PyObject *py_unzip_appends(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *seqs, *appends;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &seqs, &PyList_Type, &appends))
        return NULL;
    static PyObject *row_name = NULL;
    if (row_name == NULL && (row_name = PyUnicode_InternFromString("row")) == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(appends);
    PyObject *ids = PyList_New(n), *counts = PyList_New(n), *tokens = PyList_New(n), *seen = PySet_New(NULL);
    PyObject *rows = PyBytes_FromStringAndSize(NULL, n * 8), *result = NULL;
    if (ids == NULL || counts == NULL || tokens == NULL || seen == NULL || rows == NULL)
        goto done;
    int64_t *row_of = (int64_t *)PyBytes_AS_STRING(rows);
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
        if (value < 0) {
            if (PyErr_Occurred())
                goto done;
            goto unusual;
        }
        row_of[i] = value;
        if (PySet_Add(seen, seq_id) < 0)
            goto done;
        PyList_SET_ITEM(ids, i, Py_NewRef(seq_id));
        PyList_SET_ITEM(counts, i, Py_NewRef(PyTuple_GET_ITEM(append, 1)));
        PyList_SET_ITEM(tokens, i, Py_NewRef(PyTuple_GET_ITEM(append, 2)));
    }
    result = Py_BuildValue("OOOOO", ids, counts, tokens, rows, PySet_GET_SIZE(seen) == n ? Py_True : Py_False);
    goto done;
unusual:
    result = Py_NewRef(Py_None);
done: /* lists whose tail is still NULL are freed safely: list_dealloc skips NULL items */
    Py_XDECREF(ids);
    Py_XDECREF(counts);
    Py_XDECREF(tokens);
    Py_XDECREF(seen);
    Py_XDECREF(rows);
    return result;
}

static PyMethodDef methods[] = {
    {"unzip_appends", py_unzip_appends, METH_VARARGS,
     "unzip_appends(seqs, appends) -> (ids, counts, token_lists, rows as int64 bytes, distinct) or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_batch", "Compiled per-sequence loops of a step.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__batch(void) { return PyModule_Create(&module); }
