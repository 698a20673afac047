/*
 * rules.c -- vLLM-Omni's adapter's rules on rows, batch metadata, steps and layer heads.
 *
 * They judge Python objects ("is this exactly an int", any int however large, reprs of row
 * identities), so they run here on the objects, with vLLM-Omni's messages to the letter.
 * Entry points: check_row, check_metadata, check_step, check_layer_heads, check_head_sizes.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

PyObject *
dkpy_value_error(const char *msg)
{
    PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
}

static PyObject *
py_check_row(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (dkpy_check_nargs("check_row", nargs, 6) != 0) {
        return NULL;
    }
    PyObject *request_id = args[0], *query_len = args[1], *seq_len = args[2];
    PyObject *kv_start_pos = args[3], *sequence_id = args[4], *context_id = args[5];

    if (!PyUnicode_CheckExact(request_id) || PyUnicode_GetLength(request_id) == 0) {
        return dkpy_value_error("Paged attention request_id must be a non-empty string");
    }
    if ((sequence_id == Py_None) == (context_id == Py_None)) {
        return dkpy_value_error(
            "Paged attention row requires exactly one of sequence_id or context_id");
    }
    if (sequence_id != Py_None &&
        (!dkpy_is_exact_int(sequence_id) || dkpy_int_sign(sequence_id) < 0)) {
        return dkpy_value_error("Paged attention sequence_id must be a non-negative integer");
    }
    if (context_id != Py_None &&
        (!PyUnicode_CheckExact(context_id) || PyUnicode_GetLength(context_id) == 0)) {
        return dkpy_value_error("Paged attention context_id must be a non-empty string");
    }
    if (!dkpy_is_exact_int(query_len) || dkpy_int_sign(query_len) <= 0) {
        return dkpy_value_error("Paged attention query_len must be a positive integer");
    }
    if (!dkpy_is_exact_int(seq_len) || dkpy_int_sign(seq_len) <= 0) {
        return dkpy_value_error("Paged attention seq_len must be a positive integer");
    }
    if (!dkpy_is_exact_int(kv_start_pos) || dkpy_int_sign(kv_start_pos) < 0) {
        return dkpy_value_error("Paged attention kv_start_pos must be a non-negative integer");
    }
    /* Exact Python arithmetic: vLLM-Omni's adapter accepts any int, however large. */
    PyObject *end = PyNumber_Add(kv_start_pos, query_len);
    if (end == NULL) {
        return NULL;
    }
    int over = PyObject_RichCompareBool(end, seq_len, Py_GT);
    Py_DECREF(end);
    if (over < 0) {
        return NULL;
    }
    if (over) {
        PyErr_Format(PyExc_ValueError,
                     "Paged attention write span exceeds seq_len: start=%S, query_len=%S, "
                     "seq_len=%S",
                     kv_start_pos, query_len, seq_len);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* tuple(row.identity for row in rows) */
PyObject *
dkpy_identities_of(PyObject *rows)
{
    PyObject *t = dkpy_as_tuple(rows, "diffkv", "rows");
    if (t == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_Size(t);
    PyObject *ids = PyTuple_New(n);
    if (ids == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = dkpy_get_attr(PyTuple_GetItem(t, i), "identity");
        if (id == NULL) {
            Py_DECREF(t);
            Py_DECREF(ids);
            return NULL;
        }
        PyTuple_SetItem(ids, i, id);
    }
    Py_DECREF(t);
    return ids;
}

static PyObject *
py_check_metadata(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (dkpy_check_nargs("check_metadata", nargs, 2) != 0) {
        return NULL;
    }
    int a = PyObject_IsTrue(args[0]);
    int b = a < 0 ? -1 : PyObject_IsTrue(args[1]);
    if (a < 0 || b < 0) {
        return NULL;
    }
    if (!a || !b) {
        return dkpy_value_error("Paged attention metadata requires both prefill and denoise rows");
    }
    PyObject *pre = dkpy_identities_of(args[0]);
    PyObject *den = pre == NULL ? NULL : dkpy_identities_of(args[1]);
    if (den == NULL) {
        Py_XDECREF(pre);
        return NULL;
    }
    int differ = PyObject_RichCompareBool(pre, den, Py_NE);
    if (differ > 0) {
        PyErr_Format(PyExc_ValueError,
                     "Paged attention prefill and denoise rows must use the same ordered "
                     "identities: prefill=%R, denoise=%R",
                     pre, den);
    }
    Py_DECREF(pre);
    Py_DECREF(den);
    if (differ != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
py_check_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (dkpy_check_nargs("check_step", nargs, 1) != 0) {
        return NULL;
    }
    if (!dkpy_is_exact_int(args[0]) || dkpy_int_sign(args[0]) < 0) {
        PyErr_Format(PyExc_ValueError,
                     "Paged attention requires a non-negative denoise step index, got %R", args[0]);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* 1 when a % b != 0 (Python semantics), -1 on error. */
static int
py_not_divisible(PyObject *a, PyObject *b)
{
    PyObject *r = PyNumber_Remainder(a, b);
    if (r == NULL) {
        return -1;
    }
    int nz = PyObject_IsTrue(r);
    Py_DECREF(r);
    return nz;
}

static PyObject *
py_check_layer_heads(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (dkpy_check_nargs("check_layer_heads", nargs, 3) != 0) {
        return NULL;
    }
    PyObject *u = args[0], *h = args[1], *hkv = args[2];
    if (!dkpy_is_exact_int(u) || dkpy_int_sign(u) <= 0) {
        PyErr_Format(PyExc_ValueError, "ulysses_degree must be a positive integer, got %R", u);
        return NULL;
    }
    if (!PyLong_Check(h) || !PyLong_Check(hkv)) {
        PyErr_SetString(PyExc_TypeError,
                        "check_layer_heads(): num_heads and num_kv_heads must be ints");
        return NULL;
    }
    int bad = dkpy_int_sign(h) <= 0 || dkpy_int_sign(hkv) <= 0;
    if (!bad) {
        bad = py_not_divisible(h, hkv);
        if (bad < 0) {
            return NULL;
        }
    }
    if (bad) {
        PyErr_Format(PyExc_ValueError,
                     "Paged attention requires positive Q/KV heads with num_heads divisible by "
                     "num_kv_heads: num_heads=%S, num_kv_heads=%S",
                     h, hkv);
        return NULL;
    }
    int bad_h = py_not_divisible(h, u);
    int bad_kv = bad_h < 0 ? -1 : py_not_divisible(hkv, u);
    if (bad_h < 0 || bad_kv < 0) {
        return NULL;
    }
    if (bad_h || bad_kv) {
        PyErr_Format(PyExc_ValueError,
                     "Paged attention requires Q/KV heads divisible by ulysses_degree: "
                     "num_heads=%S, num_kv_heads=%S, ulysses_degree=%S",
                     h, hkv, u);
        return NULL;
    }
    PyObject *lh = PyNumber_FloorDivide(h, u);
    PyObject *lkv = lh == NULL ? NULL : PyNumber_FloorDivide(hkv, u);
    if (lkv == NULL) {
        Py_XDECREF(lh);
        return NULL;
    }
    return Py_BuildValue("(NN)", lh, lkv);
}

static PyObject *
py_check_head_sizes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (dkpy_check_nargs("check_head_sizes", nargs, 2) != 0) {
        return NULL;
    }
    int ne = PyObject_RichCompareBool(args[1], args[0], Py_NE);
    if (ne < 0) {
        return NULL;
    }
    if (ne) {
        PyErr_Format(PyExc_ValueError,
                     "Diffusion native paged attention requires equal key/value head sizes; got "
                     "head_size=%S, head_size_v=%S",
                     args[0], args[1]);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyMethodDef dkpy_rules_methods[] = {
    FAST(check_row, "DiffusionPagedAttentionRow's rules (ids, lengths, write span)."),
    FAST(check_metadata,
         "DiffusionPagedAttentionMetadata's rules (both row lists, same identities)."),
    FAST(check_step, "rows_for_step's rule (a non-negative step)."),
    FAST(check_layer_heads,
         "The layer's head rules (ulysses_degree, GQA divisibility); returns rank-local heads."),
    FAST(check_head_sizes, "The layer's head-size rule (equal key/value head sizes)."),
    {NULL, NULL, 0, NULL},
};
