/*
 * args.c -- argument conversion and the tensor checks every binding shares.
 *
 * Ints with Python's semantics (exact ints, saturation, sequences of ints), tensors through the
 * DLPack bridge (tensor.c) and the checks of a tensor argument (dtype, rank, device, contiguity,
 * length, no aliasing between an output and an input), each raising the message
 * "<op>(): <arg> must <expectation>, got <actual>".  Declared in binding.h.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

PyObject *
dkpy_raise_status(PyObject *module, dk_status status, const dk_error *err)
{
    PyObject *type;
    switch (status) {
    case DK_ERR_TYPE:
        type = PyExc_TypeError;
        break;
    case DK_ERR_CUDA:
        type = state_of(module)->cuda_error;
        break;
    case DK_ERR_NO_CUDA:
    case DK_ERR_RUNTIME:
        type = PyExc_RuntimeError;
        break;
    case DK_ERR_NOMEM:
        type = PyExc_MemoryError;
        break;
    case DK_ERR_NOT_IMPLEMENTED:
        type = PyExc_NotImplementedError;
        break;
    default:
        type = PyExc_ValueError;
        break;
    }
    PyErr_SetString(type, err->msg);
    return NULL;
}

int
dkpy_check_nargs(const char *op, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, got %zd", op, expected, nargs);
        return -1;
    }
    return 0;
}

int
dkpy_check_nargs_either(const char *op, Py_ssize_t nargs, Py_ssize_t fewer, Py_ssize_t more)
{
    if (nargs != fewer && nargs != more) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd or %zd arguments, got %zd", op, fewer, more,
                     nargs);
        return -1;
    }
    return 0;
}

/* An int argument of an internal call (bool is refused). */
int
dkpy_get_i64(PyObject *obj, const char *op, const char *arg, int64_t *out)
{
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be an int, got %R", op, arg, obj);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must fit in int64, got %R", op, arg, obj);
        return -1;
    }
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* Python truth of `type(obj) is int`. */
int
dkpy_is_exact_int(PyObject *obj)
{
    return PyLong_CheckExact(obj);
}

/* For an exact int: -1, 0 or 1 as its sign.  Cannot fail. */
int
dkpy_int_sign(PyObject *obj)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0) {
        return overflow;
    }
    PyErr_Clear();
    return v < 0 ? -1 : (v > 0 ? 1 : 0);
}

/* Clamped int64 value of an exact int (huge values saturate).  Cannot fail. */
int64_t
dkpy_int_saturated(PyObject *obj)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow > 0) {
        return INT64_MAX;
    }
    if (overflow < 0) {
        return INT64_MIN;
    }
    PyErr_Clear();
    return (int64_t)v;
}

PyObject *
dkpy_get_attr(PyObject *obj, const char *name)
{
    return PyObject_GetAttrString(obj, name);
}

/* An int64 attribute of a row (already validated by check_row). */
int
dkpy_row_i64(PyObject *row, const char *name, int64_t *out)
{
    PyObject *v = dkpy_get_attr(row, name);
    if (v == NULL) {
        return -1;
    }
    int rc = dkpy_get_i64(v, "diffkv", name, out);
    Py_DECREF(v);
    return rc;
}

PyObject *
dkpy_as_tuple(PyObject *seq, const char *op, const char *arg)
{
    /* A list or tuple is materialized already; anything else (a tensor, a range, an array) is
     * measured first: iterating a zero-stride expanded tensor of 2^40 elements, or range(2^62),
     * would exhaust the memory long before an error could name it. */
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        const Py_ssize_t n = PyObject_Length(seq);
        if (n < 0 && PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s(): %s must have at most %lld entries, got more", op,
                         arg, (long long)DKPY_MAX_LAZY_SEQUENCE);
            return NULL;
        }
        if (n < 0) {
            PyErr_Clear(); /* no length: PySequence_Tuple below says what it is */
        }
        else if (n > DKPY_MAX_LAZY_SEQUENCE) {
            PyErr_Format(PyExc_ValueError, "%s(): %s must have at most %lld entries, got %lld", op,
                         arg, (long long)DKPY_MAX_LAZY_SEQUENCE, (long long)n);
            return NULL;
        }
    }
    PyObject *t = PySequence_Tuple(seq);
    if (t == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s(): %s must be a sequence, got %R", op, arg, seq);
    }
    return t;
}

/* ------------------------------------------------------------------------------------------ */
/* Tensor argument checks                                                                      */
/* ------------------------------------------------------------------------------------------ */

int
dkpy_tensor_arg(PyObject *module, PyObject *obj, const char *op, const char *arg, dk_tensor *t)
{
    return dk_bridge_tensor(&state_of(module)->bridge, obj, op, arg, t);
}

int
dkpy_want_dtype(const dk_tensor *t, dk_dtype dtype, const char *op, const char *arg)
{
    if (t->dtype != dtype) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be %s, got %s", op, arg, dk_dtype_name(dtype),
                     dk_dtype_name(t->dtype));
        return -1;
    }
    return 0;
}

int
dkpy_want_float(const dk_tensor *t, const char *op, const char *arg)
{
    if (t->dtype != DK_F32 && t->dtype != DK_F16 && t->dtype != DK_BF16) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be float32, float16 or bfloat16, got %s", op,
                     arg, dk_dtype_name(t->dtype));
        return -1;
    }
    return 0;
}

int
dkpy_want_ndim(const dk_tensor *t, int ndim, const char *op, const char *arg)
{
    if (t->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must have %d dimensions, got %d", op, arg, ndim,
                     (int)t->ndim);
        return -1;
    }
    return 0;
}

int
dkpy_want_cpu(const dk_tensor *t, const char *op, const char *arg)
{
    if (t->device_type != DK_CPU) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be a CPU tensor, got cuda:%d", op, arg,
                     (int)t->device_id);
        return -1;
    }
    return 0;
}

int
dkpy_same_device(const dk_tensor *ref, const dk_tensor *t, const char *op, const char *arg)
{
    if (t->device_type != ref->device_type || t->device_id != ref->device_id) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): %s must be on the same device as the other tensors (%s:%d), got %s:%d",
                     op, arg, ref->device_type == DK_CUDA ? "cuda" : "cpu", (int)ref->device_id,
                     t->device_type == DK_CUDA ? "cuda" : "cpu", (int)t->device_id);
        return -1;
    }
    return 0;
}

/* 1-D with unit stride (dkpy_want's DKPY_VECTOR): 0, or -1 with ValueError. */
static int
want_vector(const dk_tensor *t, const char *op, const char *arg)
{
    if (t->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must be 1-D, got %d dimensions", op, arg,
                     (int)t->ndim);
        return -1;
    }
    if (t->shape[0] > 1 && t->strides[0] != 1) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must be contiguous, got stride %lld", op, arg,
                     (long long)t->strides[0]);
        return -1;
    }
    return 0;
}

int
dkpy_want_min_len(const dk_tensor *t, int64_t n, const char *op, const char *arg)
{
    if (t->shape[0] < n) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must have at least %lld entries, got %lld", op,
                     arg, (long long)n, (long long)t->shape[0]);
        return -1;
    }
    return 0;
}

const dk_tensor dkpy_host; /* DKPY_HOST: only its address is used */

int
dkpy_tensor(PyObject *module, PyObject *obj, const char *op, const dkpy_want *want, dk_tensor *t)
{
    if (dkpy_tensor_arg(module, obj, op, want->arg, t) != 0) {
        return -1;
    }
    return dkpy_check(t, op, want);
}

int
dkpy_check(const dk_tensor *t, const char *op, const dkpy_want *want)
{
    const char *arg = want->arg;
    if ((want->device == DKPY_HOST && dkpy_want_cpu(t, op, arg)) ||
        (want->dtype == DKPY_FLOAT       ? dkpy_want_float(t, op, arg)
         : want->dtype == DKPY_ANY_DTYPE ? 0
                                         : dkpy_want_dtype(t, (dk_dtype)want->dtype, op, arg)) ||
        (want->ndim == DKPY_VECTOR     ? want_vector(t, op, arg)
         : want->ndim == DKPY_ANY_NDIM ? 0
                                       : dkpy_want_ndim(t, want->ndim, op, arg)) ||
        (want->device != NULL && want->device != DKPY_HOST &&
         dkpy_same_device(want->device, t, op, arg)) ||
        (want->min_len > 0 && dkpy_want_min_len(t, want->min_len, op, arg))) {
        return -1;
    }
    return 0;
}

/* [*lo, *hi): the bytes a view can touch, from its shape and strides; 0 when it is empty. */
static int
byte_range(const dk_tensor *t, uintptr_t *lo, uintptr_t *hi)
{
    uint64_t es = (uint64_t)dk_dtype_size(t->dtype);
    uint64_t below = 0, above = 0; /* elements reachable before / after the first one */
    if (t->data == NULL) {
        return 0;
    }
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] == 0) {
            return 0;
        }
    }
    for (int i = 0; i < t->ndim; i++) {
        int64_t s = t->strides[i];
        uint64_t reach = (uint64_t)(t->shape[i] - 1) * (uint64_t)(s < 0 ? -s : s);
        if (s < 0) {
            below += reach;
        }
        else {
            above += reach;
        }
    }
    es = es == 0 ? 1 : es; /* unknown dtypes: at least one byte per element */
    *lo = (uintptr_t)t->data - (uintptr_t)(below * es);
    *hi = (uintptr_t)t->data + (uintptr_t)(above * es + es);
    return 1;
}

/* ValueError when `out` and `in` (same device) share any byte: an output written while an
 * input is still being read gives a wrong answer, so aliasing is refused before any write. */
int
dkpy_no_overlap(const dk_tensor *out, const char *out_name, const dk_tensor *in,
                const char *in_name, const char *op)
{
    uintptr_t a_lo, a_hi, b_lo, b_hi;
    if (in->ndim < 0 || out->device_type != in->device_type || out->device_id != in->device_id ||
        !byte_range(out, &a_lo, &a_hi) || !byte_range(in, &b_lo, &b_hi)) {
        return 0;
    }
    if (a_lo < b_hi && b_lo < a_hi) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): %s must not overlap %s in memory, got views sharing bytes", op,
                     out_name, in_name);
        return -1;
    }
    return 0;
}
void
dkpy_format_dims(char *buf, size_t size, const int64_t *v, int n)
{
    size_t used = 0;
    for (int i = 0; i < n && used < size; i++) {
        int w = snprintf(buf + used, size - used, "%s%lld", i ? ", " : "[", (long long)v[i]);
        used += w > 0 ? (size_t)w : 0;
    }
    if (used < size) {
        snprintf(buf + used, size - used, n ? "]" : "[]");
    }
}

/* 1 when a and b (4 dimensions, the same positive strides s, elements of es bytes) are row
 * ranges of one layout that share no byte: each row (dimensions 2 and 3) lies within s[1]
 * elements, s[0] is a whole number R of rows, b's first row is k rows from a's, and the rows
 * [0, a's S) and [k, k + b's S) neither meet nor span more than R rows (so entry i's rows of one
 * never reach entry j's of the other). */
static int
rows_disjoint(const dk_tensor *a, const dk_tensor *b)
{
    if (a->ndim != 4 || b->ndim != 4 || a->dtype != b->dtype) {
        return 0;
    }
    for (int d = 0; d < 4; d++) {
        if (a->strides[d] <= 0 || a->strides[d] != b->strides[d]) {
            return 0;
        }
    }
    const int64_t *s = a->strides;
    for (int i = 0; i < 2; i++) {
        const dk_tensor *t = i ? b : a;
        if ((t->shape[2] - 1) * s[2] + (t->shape[3] - 1) * s[3] + 1 > s[1]) {
            return 0;
        }
    }
    const int64_t es = (int64_t)dk_dtype_size(a->dtype);
    const int64_t row = s[1] * (es > 0 ? es : 1);
    const int64_t diff = (int64_t)((uintptr_t)b->data - (uintptr_t)a->data);
    if (s[0] % s[1] != 0 || diff % row != 0) {
        return 0;
    }
    const int64_t k = diff / row, rows = s[0] / s[1];
    const int64_t lo = k < 0 ? k : 0;
    const int64_t hi = k + b->shape[1] > a->shape[1] ? k + b->shape[1] : a->shape[1];
    const int64_t apart = k >= a->shape[1] || k + b->shape[1] <= 0;
    return apart && hi - lo <= rows;
}

int
dkpy_no_overlap_rows(const dk_tensor *a, const char *a_name, const dk_tensor *b, const char *b_name,
                     const char *op)
{
    uintptr_t a_lo, a_hi, b_lo, b_hi;
    if (b->ndim < 0 || a->device_type != b->device_type || a->device_id != b->device_id ||
        !byte_range(a, &a_lo, &a_hi) || !byte_range(b, &b_lo, &b_hi) ||
        !(a_lo < b_hi && b_lo < a_hi) || rows_disjoint(a, b)) {
        return 0;
    }
    PyErr_Format(PyExc_ValueError,
                 "%s(): %s must not overlap %s in memory, got views sharing bytes", op, a_name,
                 b_name);
    return -1;
}

PyObject *
dkpy_int_tuple(const int64_t *v, int n)
{
    PyObject *t = PyTuple_New(n);
    if (t == NULL) {
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong((long long)v[i]);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SetItem(t, i, x);
    }
    return t;
}

int
dkpy_i64_list(PyObject *seq, const char *op, const char *arg, int64_t **out, Py_ssize_t *n)
{
    PyObject *t = dkpy_as_tuple(seq, op, arg);
    if (t == NULL) {
        return -1;
    }
    *n = PyTuple_Size(t);
    *out = (int64_t *)calloc((size_t)(*n > 0 ? *n : 1), sizeof(int64_t));
    if (*out == NULL) {
        Py_DECREF(t);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *item = PyTuple_GetItem(t, i);
        if (!PyLong_Check(item)) {
            /* vLLM's block_sizes can be numpy ints: take anything with __index__. */
            PyObject *idx = PyNumber_Index(item);
            if (idx == NULL) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "%s(): %s must be a sequence of ints, got %R", op,
                             arg, item);
                Py_DECREF(t);
                free(*out);
                *out = NULL;
                return -1;
            }
            int rc = dkpy_get_i64(idx, op, arg, &(*out)[i]);
            Py_DECREF(idx);
            if (rc != 0) {
                Py_DECREF(t);
                free(*out);
                *out = NULL;
                return -1;
            }
            continue;
        }
        if (dkpy_get_i64(item, op, arg, &(*out)[i]) != 0) {
            Py_DECREF(t);
            free(*out);
            *out = NULL;
            return -1;
        }
    }
    Py_DECREF(t);
    return 0;
}
