/*
 * module.c -- diffkv._C: the CPython binding (limited API, multi-phase init, module state).
 *
 * The only place that raises Python exceptions: every C routine returns a dk_status and a
 * message, and the seed's validation rules are checked here (they judge Python objects: "is
 * this exactly an int", reprs of identities) with the seed's exact texts.  Tensor arguments
 * come in through the DLPack bridge (tensor.c); CPU tensors go to the C reference, CUDA tensors
 * to the dk_cuda_* launchers on torch's current stream.
 *
 * Entry points: PyInit__C and the functions listed in `module_methods` (contract: _C.pyi).
 */
#include "bridge.h"

#include <stdlib.h>
#include <string.h>

#ifndef DIFFKV_CUDA_ARCHS
#define DIFFKV_CUDA_ARCHS ""
#endif

/* The per-call context's attribute names forward_context reads (interned once). */
enum {
    CTX_LAYER,
    CTX_KV_CACHE,
    CTX_IMPL,
    CTX_NATIVE_METADATA,
    CTX_PIECEWISE_PLAN,
    CTX_KEY_LIMITS,
    CTX_CAUSAL,
    CTX_QUERY,
    CTX_KEY_WRITE,
    CTX_VALUE_WRITE,
    CTX_SLOT_MAPPING,
    CTX_BLOCK_TABLE,
    CTX_QUERY_START_LOC,
    CTX_SEQ_LENS,
    CTX_SOFTMAX_SCALE,
    CTX_BLOCK_TABLE_CPU,
    CTX_QUERY_START_LOC_CPU,
    CTX_SEQ_LENS_CPU,
    CTX_RESTORE_OUTPUT,
    CTX_OUTPUT_SCATTER_INDICES,
    CTX_QUERY_HAS_HEAD_DIMS,
    CTX_QUERY_TOKEN_SHAPE,
    CTX_NUM_HEADS,
    CTX_HEAD_SIZE_V,
    CTX_NEW_EMPTY,
    CTX_NAMES
};

static const char *const ctx_name_text[CTX_NAMES] = {
    "layer",
    "kv_cache",
    "impl",
    "native_metadata",
    "piecewise_plan",
    "key_limits",
    "causal",
    "query",
    "key_write",
    "value_write",
    "slot_mapping",
    "block_table",
    "query_start_loc",
    "seq_lens",
    "softmax_scale",
    "block_table_cpu",
    "query_start_loc_cpu",
    "seq_lens_cpu",
    "restore_output",
    "output_scatter_indices",
    "query_has_head_dims",
    "query_token_shape",
    "num_heads",
    "head_size_v",
    "new_empty",
};

typedef struct {
    dk_bridge bridge;
    PyObject *cuda_error;           /* diffkv.CudaError */
    PyObject *empty_like;           /* torch.empty_like (forward_context's first call), or NULL */
    PyObject *context_type;         /* diffkv.DiffusionPagedAttentionContext (ditto), or NULL */
    PyObject *ctx_names[CTX_NAMES]; /* interned attribute names */
} module_state;

static module_state *
state_of(PyObject *module)
{
    return (module_state *)PyModule_GetState(module);
}

/* ------------------------------------------------------------------------------------------ */
/* Small helpers                                                                               */
/* ------------------------------------------------------------------------------------------ */

static PyObject *
raise_status(PyObject *module, dk_status status, const dk_error *err)
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
    default:
        type = PyExc_ValueError;
        break;
    }
    PyErr_SetString(type, err->msg);
    return NULL;
}

static int
check_nargs(const char *op, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, got %zd", op, expected, nargs);
        return -1;
    }
    return 0;
}

/* An int argument of an internal call (bool is refused). */
static int
get_i64(PyObject *obj, const char *op, const char *arg, int64_t *out)
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
static int
is_exact_int(PyObject *obj)
{
    return PyLong_CheckExact(obj);
}

/* For an exact int: -1, 0 or 1 as its sign.  Cannot fail. */
static int
int_sign(PyObject *obj)
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
static int64_t
int_saturated(PyObject *obj)
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

static PyObject *
get_attr(PyObject *obj, const char *name)
{
    return PyObject_GetAttrString(obj, name);
}

/* An int64 attribute of a row (already validated by check_row). */
static int
row_i64(PyObject *row, const char *name, int64_t *out)
{
    PyObject *v = get_attr(row, name);
    if (v == NULL) {
        return -1;
    }
    int rc = get_i64(v, "diffkv", name, out);
    Py_DECREF(v);
    return rc;
}

static PyObject *
as_tuple(PyObject *seq, const char *op, const char *arg)
{
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

static int
tensor_arg(PyObject *module, PyObject *obj, const char *op, const char *arg, dk_tensor *t)
{
    return dk_bridge_tensor(&state_of(module)->bridge, obj, op, arg, t);
}

static int
want_dtype(const dk_tensor *t, dk_dtype dtype, const char *op, const char *arg)
{
    if (t->dtype != dtype) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be %s, got %s", op, arg, dk_dtype_name(dtype),
                     dk_dtype_name(t->dtype));
        return -1;
    }
    return 0;
}

static int
want_float(const dk_tensor *t, const char *op, const char *arg)
{
    if (t->dtype != DK_F32 && t->dtype != DK_F16 && t->dtype != DK_BF16) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be float32, float16 or bfloat16, got %s", op,
                     arg, dk_dtype_name(t->dtype));
        return -1;
    }
    return 0;
}

static int
want_ndim(const dk_tensor *t, int ndim, const char *op, const char *arg)
{
    if (t->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must have %d dimensions, got %d", op, arg, ndim,
                     (int)t->ndim);
        return -1;
    }
    return 0;
}

static int
want_cpu(const dk_tensor *t, const char *op, const char *arg)
{
    if (t->device_type != DK_CPU) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be a CPU tensor, got cuda:%d", op, arg,
                     (int)t->device_id);
        return -1;
    }
    return 0;
}

static int
same_device(const dk_tensor *ref, const dk_tensor *t, const char *op, const char *arg)
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

static int
want_contiguous_1d(const dk_tensor *t, const char *op, const char *arg)
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

static int
want_min_len(const dk_tensor *t, int64_t n, const char *op, const char *arg)
{
    if (t->shape[0] < n) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must have at least %lld entries, got %lld", op,
                     arg, (long long)n, (long long)t->shape[0]);
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
static int
no_overlap(const dk_tensor *out, const char *out_name, const dk_tensor *in, const char *in_name,
           const char *op)
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

/* Runs a launcher with the tensor's device current and torch's current stream. */
typedef dk_status (*cuda_launcher)(const void *args, void *stream, dk_error *err);

static int
run_cuda(PyObject *module, PyObject *tensor_obj, int32_t device, cuda_launcher launch,
         const void *args)
{
    dk_error err = {{0}};
    if (!dk_cuda_compiled()) {
        dk_status s = launch(args, NULL, &err); /* the CPU-only stub explains how to rebuild */
        raise_status(module, s, &err);
        return -1;
    }
    void *stream = NULL;
    if (dk_bridge_stream(&state_of(module)->bridge, tensor_obj, device, &stream) != 0) {
        return -1;
    }
    int32_t prev = 0;
    dk_status s = dk_cuda_device_enter(device, &prev, &err);
    if (s == DK_OK) {
        s = launch(args, stream, &err);
        dk_cuda_device_exit(prev);
    }
    if (s != DK_OK) {
        raise_status(module, s, &err);
        return -1;
    }
    return 0;
}

static dk_status
launch_slots(const void *a, void *stream, dk_error *err)
{
    return dk_cuda_slots((const dk_slots_args *)a, stream, err);
}

static dk_status
launch_kv_write(const void *a, void *stream, dk_error *err)
{
    return dk_cuda_kv_write((const dk_kv_write_args *)a, stream, err);
}

static dk_status
launch_attention(const void *a, void *stream, dk_error *err)
{
    return dk_cuda_attention((const dk_attention_args *)a, stream, err);
}

/* forward_paged's two steps on the GPU: the KV write, then the attention over it. */
typedef struct layer_launch {
    const dk_kv_write_args *w;
    const dk_attention_args *a;
} layer_launch;

static dk_status
launch_layer(const void *l, void *stream, dk_error *err)
{
    const layer_launch *x = (const layer_launch *)l;
    return dk_cuda_layer(x->w, x->a, stream, err);
}

static dk_status
launch_rows_gather(const void *a, void *stream, dk_error *err)
{
    return dk_cuda_rows_gather((const dk_rows_args *)a, stream, err);
}

static dk_status
launch_rows_scatter(const void *a, void *stream, dk_error *err)
{
    return dk_cuda_rows_scatter((const dk_rows_args *)a, stream, err);
}

/* ------------------------------------------------------------------------------------------ */
/* Module / bridge functions                                                                   */
/* ------------------------------------------------------------------------------------------ */

static PyObject *
py_configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("configure", nargs, 2) != 0) {
        return NULL;
    }
    module_state *st = state_of(module);
    Py_CLEAR(st->bridge.to_dlpack);
    Py_CLEAR(st->bridge.stream_getter);
    st->bridge.to_dlpack = args[0] == Py_None ? NULL : Py_NewRef(args[0]);
    st->bridge.stream_getter = args[1] == Py_None ? NULL : Py_NewRef(args[1]);
    Py_RETURN_NONE;
}

static PyObject *
py_set_bridge_path(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("set_bridge_path", nargs, 1) != 0) {
        return NULL;
    }
    const char *path = PyUnicode_Check(args[0]) ? PyUnicode_AsUTF8AndSize(args[0], NULL) : NULL;
    if (path == NULL || (strcmp(path, "auto") != 0 && strcmp(path, "capsule") != 0)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError,
                     "set_bridge_path(): path must be 'auto' or 'capsule', got %R", args[0]);
        return NULL;
    }
    state_of(module)->bridge.force_capsule = strcmp(path, "capsule") == 0;
    Py_RETURN_NONE;
}

static PyObject *
py_bridge_path(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("bridge_path", nargs, 1) != 0) {
        return NULL;
    }
    int rc = dk_bridge_uses_exchange(&state_of(module)->bridge, args[0]);
    if (rc < 0) {
        return NULL;
    }
    return PyUnicode_FromString(rc ? "exchange" : "capsule");
}

static PyObject *
int_tuple(const int64_t *v, int n)
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

static PyObject *
py_tensor_info(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("tensor_info", nargs, 1) != 0) {
        return NULL;
    }
    dk_tensor t;
    if (tensor_arg(module, args[0], "tensor_info", "tensor", &t) != 0) {
        return NULL;
    }
    int exchange = dk_bridge_uses_exchange(&state_of(module)->bridge, args[0]);
    if (exchange < 0) {
        return NULL;
    }
    PyObject *shape = int_tuple(t.shape, t.ndim);
    PyObject *strides = shape == NULL ? NULL : int_tuple(t.strides, t.ndim);
    if (strides == NULL) {
        Py_XDECREF(shape);
        return NULL;
    }
    return Py_BuildValue("{s:K,s:s,s:s,s:i,s:N,s:N,s:s}", "data_ptr",
                         (unsigned long long)(uintptr_t)t.data, "dtype", dk_dtype_name(t.dtype),
                         "device_type", t.device_type == DK_CUDA ? "cuda" : "cpu", "device_id",
                         (int)t.device_id, "shape", shape, "strides", strides, "path",
                         exchange ? "exchange" : "capsule");
}

static PyObject *
py_bridge_noop4(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("bridge_noop4", nargs, 4) != 0) {
        return NULL;
    }
    static const char *names[4] = {"a", "b", "c", "d"};
    dk_tensor t[4];
    for (int i = 0; i < 4; i++) {
        if (tensor_arg(module, args[i], "bridge_noop4", names[i], &t[i]) != 0) {
            return NULL;
        }
    }
    if (t[0].device_type == DK_CUDA) {
        void *stream = NULL;
        if (dk_bridge_stream(&state_of(module)->bridge, args[0], t[0].device_id, &stream) != 0) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *
py_cuda_compiled(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    (void)args;
    if (check_nargs("cuda_compiled", nargs, 0) != 0) {
        return NULL;
    }
    return PyBool_FromLong(dk_cuda_compiled());
}

static PyObject *
py_build_info(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    (void)args;
    if (check_nargs("build_info", nargs, 0) != 0) {
        return NULL;
    }
    int compiled = dk_cuda_compiled();
    int devices = compiled ? dk_cuda_device_count() : 0;
    return Py_BuildValue("{s:O,s:i,s:i,s:s,s:s,s:s}", "cuda_compiled",
                         compiled ? Py_True : Py_False, "cuda_runtime_version",
                         dk_cuda_runtime_version(), "device_count", devices, "archs",
                         DIFFKV_CUDA_ARCHS, "limited_api", "cp310-abi3", "attention_kernel",
                         devices > 0 ? dk_cuda_attention_kernel() : "none");
}

static PyObject *
py_last_attention_kernel(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    (void)args;
    if (check_nargs("last_attention_kernel", nargs, 0) != 0) {
        return NULL;
    }
    return PyUnicode_FromString(dk_cuda_last_attention_kernel());
}

static PyObject *
py_set_attention_kernel(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_nargs("set_attention_kernel", nargs, 1) != 0) {
        return NULL;
    }
    /* indexed by dk_kernel_choice (DK_KERNEL_AUTO, _SM90, _SM80) */
    static const char *const names[] = {"auto", "sm90", "sm80"};
    const char *name = PyUnicode_Check(args[0]) ? PyUnicode_AsUTF8AndSize(args[0], NULL) : NULL;
    for (int i = 0; name != NULL && i < (int)(sizeof(names) / sizeof(names[0])); i++) {
        if (strcmp(name, names[i]) == 0) {
            return PyUnicode_FromString(names[dk_set_attention_kernel((dk_kernel_choice)i)]);
        }
    }
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError,
                 "set_attention_kernel(): kernel must be 'auto', 'sm90' or 'sm80', got %R",
                 args[0]);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Rows, metadata, layer heads (the seed's rules R*, M*, L*)                                   */
/* ------------------------------------------------------------------------------------------ */

static PyObject *
value_error(const char *msg)
{
    PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
}

static PyObject *
py_check_row(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_nargs("check_row", nargs, 6) != 0) {
        return NULL;
    }
    PyObject *request_id = args[0], *query_len = args[1], *seq_len = args[2];
    PyObject *kv_start_pos = args[3], *sequence_id = args[4], *context_id = args[5];

    if (!PyUnicode_CheckExact(request_id) || PyUnicode_GetLength(request_id) == 0) {
        return value_error("Paged attention request_id must be a non-empty string");
    }
    if ((sequence_id == Py_None) == (context_id == Py_None)) {
        return value_error("Paged attention row requires exactly one of sequence_id or context_id");
    }
    if (sequence_id != Py_None && (!is_exact_int(sequence_id) || int_sign(sequence_id) < 0)) {
        return value_error("Paged attention sequence_id must be a non-negative integer");
    }
    if (context_id != Py_None &&
        (!PyUnicode_CheckExact(context_id) || PyUnicode_GetLength(context_id) == 0)) {
        return value_error("Paged attention context_id must be a non-empty string");
    }
    if (!is_exact_int(query_len) || int_sign(query_len) <= 0) {
        return value_error("Paged attention query_len must be a positive integer");
    }
    if (!is_exact_int(seq_len) || int_sign(seq_len) <= 0) {
        return value_error("Paged attention seq_len must be a positive integer");
    }
    if (!is_exact_int(kv_start_pos) || int_sign(kv_start_pos) < 0) {
        return value_error("Paged attention kv_start_pos must be a non-negative integer");
    }
    /* Exact Python arithmetic: the seed accepts any int, however large. */
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
static PyObject *
identities_of(PyObject *rows)
{
    PyObject *t = as_tuple(rows, "diffkv", "rows");
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
        PyObject *id = get_attr(PyTuple_GetItem(t, i), "identity");
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
    if (check_nargs("check_metadata", nargs, 2) != 0) {
        return NULL;
    }
    int a = PyObject_IsTrue(args[0]);
    int b = a < 0 ? -1 : PyObject_IsTrue(args[1]);
    if (a < 0 || b < 0) {
        return NULL;
    }
    if (!a || !b) {
        return value_error("Paged attention metadata requires both prefill and denoise rows");
    }
    PyObject *pre = identities_of(args[0]);
    PyObject *den = pre == NULL ? NULL : identities_of(args[1]);
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
    if (check_nargs("check_step", nargs, 1) != 0) {
        return NULL;
    }
    if (!is_exact_int(args[0]) || int_sign(args[0]) < 0) {
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
    if (check_nargs("check_layer_heads", nargs, 3) != 0) {
        return NULL;
    }
    PyObject *u = args[0], *h = args[1], *hkv = args[2];
    if (!is_exact_int(u) || int_sign(u) <= 0) {
        PyErr_Format(PyExc_ValueError, "ulysses_degree must be a positive integer, got %R", u);
        return NULL;
    }
    if (!PyLong_Check(h) || !PyLong_Check(hkv)) {
        PyErr_SetString(PyExc_TypeError,
                        "check_layer_heads(): num_heads and num_kv_heads must be ints");
        return NULL;
    }
    int bad = int_sign(h) <= 0 || int_sign(hkv) <= 0;
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
    if (check_nargs("check_head_sizes", nargs, 2) != 0) {
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

/* ------------------------------------------------------------------------------------------ */
/* prepare_layer_context (C4..C14)                                                             */
/* ------------------------------------------------------------------------------------------ */

/* The seed's _flatten_tensor decision: *tok_ndim leading dims are tokens; C4 otherwise. */
static int
flatten_layout(const dk_tensor *t, int64_t heads, int64_t size, const char *name, int *has_heads,
               int *tok_ndim)
{
    int nd = t->ndim;
    if (nd >= 3 && t->shape[nd - 2] == heads && t->shape[nd - 1] == size) {
        *has_heads = 1;
        *tok_ndim = nd - 2;
        return 0;
    }
    if (nd >= 1 && t->shape[nd - 1] == heads * size) {
        *has_heads = 0;
        *tok_ndim = nd - 1;
        return 0;
    }
    PyObject *shape = int_tuple(t->shape, nd);
    if (shape != NULL) {
        PyErr_Format(PyExc_ValueError,
                     "Paged attention %s must end in (%lld, %lld) or (%lld,); got shape=%R", name,
                     (long long)heads, (long long)size, (long long)(heads * size), shape);
        Py_DECREF(shape);
    }
    return -1;
}

static int
same_token_shape(const dk_tensor *a, int an, const dk_tensor *b, int bn)
{
    if (an != bn) {
        return 0;
    }
    for (int i = 0; i < an; i++) {
        if (a->shape[i] != b->shape[i]) {
            return 0;
        }
    }
    return 1;
}

/* C5..C8 for key ("key") or value ("value"). */
static int
token_shape_mismatch(const dk_tensor *q, int qn, const dk_tensor *t, int tn, const char *name)
{
    PyObject *qs = int_tuple(q->shape, qn);
    PyObject *ts = qs == NULL ? NULL : int_tuple(t->shape, tn);
    if (ts != NULL) {
        if (tn == 1) {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention %s token count must match the query layout: query=%R, "
                         "%s=%R",
                         name, qs, name, ts);
        }
        else {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention batched %s layout must match prepared rows and the query "
                         "layout: query=%R, %s=%R",
                         name, qs, name, ts);
        }
    }
    Py_XDECREF(qs);
    Py_XDECREF(ts);
    return -1;
}

static const char *
torch_dtype_name(dk_dtype dtype)
{
    switch (dtype) {
    case DK_F32:
        return "torch.float32";
    case DK_F16:
        return "torch.float16";
    case DK_BF16:
        return "torch.bfloat16";
    case DK_F64:
        return "torch.float64";
    default:
        return NULL;
    }
}

/* Compares dtypes exactly; for dtypes DLPack cannot name, asks the tensors themselves. */
static int
dtypes_differ(PyObject *a, const dk_tensor *ta, PyObject *b, const dk_tensor *tb)
{
    if (ta->dtype != DK_OTHER && tb->dtype != DK_OTHER) {
        return ta->dtype != tb->dtype;
    }
    PyObject *da = PyObject_GetAttrString(a, "dtype");
    PyObject *db = da == NULL ? NULL : PyObject_GetAttrString(b, "dtype");
    int ne = db == NULL ? -1 : PyObject_RichCompareBool(da, db, Py_NE);
    Py_XDECREF(da);
    Py_XDECREF(db);
    return ne;
}

/*
 * Describes a tensor DLPack cannot export (a "meta" tensor, another backend's device) from its
 * Python attributes, so the seed's device check can name it: shape from .shape, device type 0
 * (matches no adapter device) unless .device is cpu/cuda, dtype DK_OTHER (compared through
 * the tensors' own .dtype).  Returns 0, or -1 with the original export error restored.
 */
static int
describe_unexported(PyObject *obj, dk_tensor *t)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *shape = PyObject_GetAttrString(obj, "shape");
    PyObject *dims = shape == NULL ? NULL : PySequence_Tuple(shape);
    PyObject *device = PyObject_GetAttrString(obj, "device");
    PyObject *dtype_name = device == NULL ? NULL : PyObject_GetAttrString(device, "type");
    int ok = dims != NULL && dtype_name != NULL && PyTuple_Size(dims) <= DK_MAX_DIMS;
    if (ok) {
        memset(t, 0, sizeof(*t));
        t->ndim = (int32_t)PyTuple_Size(dims);
        for (int32_t i = 0; ok && i < t->ndim; i++) {
            t->shape[i] = int_saturated(PyTuple_GetItem(dims, i));
        }
        const char *dev =
            PyUnicode_Check(dtype_name) ? PyUnicode_AsUTF8AndSize(dtype_name, NULL) : "";
        t->device_type = dev != NULL && strcmp(dev, "cpu") == 0 ? DK_CPU : 0;
        t->device_id = -1;
        t->dtype = DK_OTHER;
    }
    Py_XDECREF(shape);
    Py_XDECREF(dims);
    Py_XDECREF(device);
    Py_XDECREF(dtype_name);
    if (!ok) {
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
        return -1;
    }
    PyErr_Clear();
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return 0;
}

/* The layout of a Q/K/V tensor (these checks never read the data, so a negative-bit view is
 * left to the binding that reads it), or the attribute description above when DLPack cannot
 * export the tensor. */
static int
layer_tensor(PyObject *module, PyObject *obj, const char *arg, dk_tensor *t)
{
    if (dk_bridge_tensor_layout(&state_of(module)->bridge, obj, "prepare_layer_context", arg, t) ==
        0) {
        return 0;
    }
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
        return -1; /* not a tensor at all */
    }
    return describe_unexported(obj, t);
}

/* The seed's K/V normalisation rule on the flattened [N, heads, size] view: dims dense and
 * heads `size` apart (one head: any head stride).  A tensor DLPack could not export counts as
 * not dense.  Cannot fail. */
static int
dense_heads(const dk_tensor *t, int has_heads, int64_t heads, int64_t size)
{
    if (t->device_type == 0 || t->ndim < 1) {
        return 0;
    }
    int nd = t->ndim;
    if (t->shape[nd - 1] > 1 && t->strides[nd - 1] != 1) {
        return 0;
    }
    if (has_heads && heads > 1 && t->strides[nd - 2] != size) {
        return 0;
    }
    return 1;
}

static PyObject *
py_check_layer_qkv(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "prepare_layer_context";
    if (check_nargs("check_layer_qkv", nargs, 14) != 0) {
        return NULL;
    }
    /* query, key, value, num_heads, num_kv_heads, head_size, head_size_v, device_type,
     * device_index, device, expected_dtype_code, expected_dtype, num_tokens, query_lens */
    PyObject *qo = args[0], *ko = args[1], *vo = args[2];
    int64_t h = 0, hkv = 0, d = 0, dv = 0, dev_type = 0, dev_index = 0, want_code = 0, n = 0;
    if (get_i64(args[3], op, "num_heads", &h) || get_i64(args[4], op, "num_kv_heads", &hkv) ||
        get_i64(args[5], op, "head_size", &d) || get_i64(args[6], op, "head_size_v", &dv) ||
        get_i64(args[7], op, "device_type", &dev_type) ||
        get_i64(args[8], op, "device_index", &dev_index) ||
        get_i64(args[10], op, "expected_dtype_code", &want_code) ||
        get_i64(args[12], op, "num_tokens", &n)) {
        return NULL;
    }
    dk_tensor q, k, v;
    int q_heads = 0, k_heads = 0, v_heads = 0, qn = 0, kn = 0, vn = 0;
    if (layer_tensor(module, qo, "query", &q) || flatten_layout(&q, h, d, "query", &q_heads, &qn) ||
        layer_tensor(module, ko, "key", &k) || flatten_layout(&k, hkv, d, "key", &k_heads, &kn) ||
        layer_tensor(module, vo, "value", &v) ||
        flatten_layout(&v, hkv, dv, "value", &v_heads, &vn)) {
        return NULL;
    }
    if (!same_token_shape(&q, qn, &k, kn)) {
        token_shape_mismatch(&q, qn, &k, kn, "key");
        return NULL;
    }
    if (!same_token_shape(&q, qn, &v, vn)) {
        token_shape_mismatch(&q, qn, &v, vn, "value");
        return NULL;
    }
    /* C9..C11: the seed's _token_packing_indices decision. */
    int needs_packing = 0;
    if (qn == 1) {
        if (q.shape[0] != n) {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention Q/K/V token count must match the prepared write batch: "
                         "tokens=%lld, prepared=%lld",
                         (long long)q.shape[0], (long long)n);
            return NULL;
        }
    }
    else if (qn == 2) {
        PyObject *lens = as_tuple(args[13], op, "query_lens");
        if (lens == NULL) {
            return NULL;
        }
        Py_ssize_t rows = PyTuple_Size(lens);
        int bad = q.shape[0] != rows, all_full = 1;
        for (Py_ssize_t i = 0; i < rows && !bad; i++) {
            int64_t ql = int_saturated(PyTuple_GetItem(lens, i));
            bad = ql > q.shape[1];
            all_full = all_full && ql == q.shape[1];
        }
        if (bad) {
            PyObject *shape = int_tuple(q.shape, 2);
            if (shape != NULL) {
                PyErr_Format(
                    PyExc_ValueError,
                    "Paged attention batched Q/K/V layout must match prepared rows for the "
                    "current write: shape=%R, row_query_lens=%R",
                    shape, lens);
                Py_DECREF(shape);
            }
            Py_DECREF(lens);
            return NULL;
        }
        Py_DECREF(lens);
        needs_packing = !all_full;
    }
    else {
        PyObject *shape = int_tuple(q.shape, qn);
        if (shape != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention Q/K/V supports packed [T, ...] or uniform batched [B, T, "
                         "...] token layouts; got token shape=%R",
                         shape);
            Py_DECREF(shape);
        }
        return NULL;
    }
    /* C12: devices after normalisation ("cuda" = the current device, resolved by the caller). */
    const dk_tensor *ts[3] = {&q, &k, &v};
    for (int i = 0; i < 3; i++) {
        if (ts[i]->device_type != dev_type ||
            (dev_type == DK_CUDA && ts[i]->device_id != dev_index)) {
            PyObject *qd = PyObject_GetAttrString(qo, "device");
            PyObject *kd = qd == NULL ? NULL : PyObject_GetAttrString(ko, "device");
            PyObject *vd = kd == NULL ? NULL : PyObject_GetAttrString(vo, "device");
            if (vd != NULL) {
                PyErr_Format(PyExc_ValueError,
                             "Paged attention Q/K/V must be on %S; got query=%S, key=%S, value=%S",
                             args[9], qd, kd, vd);
            }
            Py_XDECREF(qd);
            Py_XDECREF(kd);
            Py_XDECREF(vd);
            return NULL;
        }
    }
    /* C13, C14. */
    int ne_k = dtypes_differ(qo, &q, ko, &k);
    int ne_v = ne_k < 0 ? -1 : dtypes_differ(qo, &q, vo, &v);
    if (ne_k < 0 || ne_v < 0) {
        return NULL;
    }
    if (ne_k || ne_v) {
        PyObject *qd = PyObject_GetAttrString(qo, "dtype");
        PyObject *kd = qd == NULL ? NULL : PyObject_GetAttrString(ko, "dtype");
        PyObject *vd = kd == NULL ? NULL : PyObject_GetAttrString(vo, "dtype");
        if (vd != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention Q/K/V dtypes must match; got %S, %S, %S", qd, kd, vd);
        }
        Py_XDECREF(qd);
        Py_XDECREF(kd);
        Py_XDECREF(vd);
        return NULL;
    }
    int wrong = 0;
    if (want_code >= 0 && q.dtype != DK_OTHER) {
        wrong = (int64_t)q.dtype != want_code;
    }
    else {
        PyObject *qd = PyObject_GetAttrString(qo, "dtype");
        wrong = qd == NULL ? -1 : PyObject_RichCompareBool(qd, args[11], Py_NE);
        Py_XDECREF(qd);
        if (wrong < 0) {
            return NULL;
        }
    }
    if (wrong) {
        const char *name = torch_dtype_name(q.dtype);
        PyObject *qd =
            name != NULL ? PyUnicode_FromString(name) : PyObject_GetAttrString(qo, "dtype");
        if (qd != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "Paged attention Q/K/V dtype must match model activation dtype %S; got %S",
                         args[11], qd);
            Py_DECREF(qd);
        }
        return NULL;
    }
    PyObject *tok = int_tuple(q.shape, qn);
    if (tok == NULL) {
        return NULL;
    }
    /* Layout facts the caller would otherwise read back from torch, one bit each:
     * 1 rows need packing; 2/4/8 query/key/value already [N, heads, size] (no reshape);
     * 16/32 key/value need .contiguous() (the writer reads heads and dims densely). */
    long flags = needs_packing ? 1 : 0;
    flags |= (q.ndim == 3 && q_heads) ? 2 : 0;
    flags |= (k.ndim == 3 && k_heads) ? 4 : 0;
    flags |= (v.ndim == 3 && v_heads) ? 8 : 0;
    if (!needs_packing) {
        flags |= dense_heads(&k, k_heads, hkv, d) ? 0 : 16;
        flags |= dense_heads(&v, v_heads, hkv, dv) ? 0 : 32;
    }
    return Py_BuildValue("(NOl)", tok, q_heads ? Py_True : Py_False, flags);
}

/* ------------------------------------------------------------------------------------------ */
/* prepare_batch (P1..P11)                                                                     */
/* ------------------------------------------------------------------------------------------ */

static PyObject *
py_check_batch_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_nargs("check_batch_rows", nargs, 3) != 0) {
        return NULL;
    }
    PyObject *rows = args[0];
    Py_ssize_t n = PyObject_Length(rows);
    if (n < 0) {
        return NULL;
    }
    if (n == 0) {
        return value_error("Paged attention batch must contain at least one row");
    }
    int active = PyObject_IsTrue(args[1]);
    if (active < 0) {
        return NULL;
    }
    if (active) {
        PyErr_SetString(PyExc_RuntimeError,
                        "Cannot prepare paged attention metadata during an active forward");
        return NULL;
    }
    PyObject *nlen = PyLong_FromSsize_t(n);
    if (nlen == NULL) {
        return NULL;
    }
    int over = PyObject_RichCompareBool(nlen, args[2], Py_GT);
    Py_DECREF(nlen);
    if (over < 0) {
        return NULL;
    }
    if (over) {
        PyErr_Format(PyExc_ValueError, "Paged attention batch has %zd rows; Worker capacity is %S",
                     n, args[2]);
        return NULL;
    }
    PyObject *ids = identities_of(rows);
    if (ids == NULL) {
        return NULL;
    }
    PyObject *set = PySet_New(ids);
    Py_ssize_t unique = set == NULL ? -1 : PySet_Size(set);
    Py_XDECREF(set);
    Py_DECREF(ids);
    if (unique < 0) {
        return NULL;
    }
    if (unique != n) {
        return value_error("Paged attention batch contains duplicate row identities");
    }
    Py_RETURN_NONE;
}

static int
i64_list(PyObject *seq, const char *op, const char *arg, int64_t **out, Py_ssize_t *n)
{
    PyObject *t = as_tuple(seq, op, arg);
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
            int rc = get_i64(idx, op, arg, &(*out)[i]);
            Py_DECREF(idx);
            if (rc != 0) {
                Py_DECREF(t);
                free(*out);
                *out = NULL;
                return -1;
            }
            continue;
        }
        if (get_i64(item, op, arg, &(*out)[i]) != 0) {
            Py_DECREF(t);
            free(*out);
            *out = NULL;
            return -1;
        }
    }
    Py_DECREF(t);
    return 0;
}

static PyObject *
py_check_batch_bindings(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "check_batch_bindings";
    if (check_nargs(op, nargs, 10) != 0) {
        return NULL;
    }
    PyObject *rows = NULL, *bindings = NULL, *row_index_objs = NULL, *capacity_objs = NULL;
    PyObject *result = NULL;
    int64_t *query_lens = NULL, *seq_lens = NULL, *row_indices = NULL, *capacities = NULL;
    uint8_t *row_is_int = NULL, *cap_is_int = NULL;
    int64_t *block_sizes = NULL, *multipliers = NULL;
    Py_ssize_t num_groups = 0, num_mult = 0;

    rows = as_tuple(args[0], op, "rows");
    bindings = rows == NULL ? NULL : as_tuple(args[1], op, "bindings");
    if (bindings == NULL) {
        goto done;
    }
    Py_ssize_t n = PyTuple_Size(rows);
    if (PyTuple_Size(bindings) != n) {
        PyErr_Format(PyExc_ValueError, "%s(): bindings must have one entry per row (%zd), got %zd",
                     op, n, PyTuple_Size(bindings));
        goto done;
    }
    row_index_objs = PyTuple_New(n);
    capacity_objs = row_index_objs == NULL ? NULL : PyTuple_New(n);
    size_t cnt = (size_t)(n > 0 ? n : 1);
    query_lens = (int64_t *)calloc(cnt, sizeof(int64_t));
    seq_lens = (int64_t *)calloc(cnt, sizeof(int64_t));
    row_indices = (int64_t *)calloc(cnt, sizeof(int64_t));
    capacities = (int64_t *)calloc(cnt, sizeof(int64_t));
    row_is_int = (uint8_t *)calloc(cnt, 1);
    cap_is_int = (uint8_t *)calloc(cnt, 1);
    if (capacity_objs == NULL || !query_lens || !seq_lens || !row_indices || !capacities ||
        !row_is_int || !cap_is_int) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_GetItem(rows, i);
        PyObject *binding = PyTuple_GetItem(bindings, i);
        if (row_i64(row, "query_len", &query_lens[i]) != 0 ||
            row_i64(row, "seq_len", &seq_lens[i]) != 0) {
            goto done;
        }
        PyObject *ri = get_attr(binding, "row_index");
        if (ri == NULL) {
            goto done;
        }
        PyTuple_SetItem(row_index_objs, i, ri);
        row_is_int[i] = (uint8_t)is_exact_int(ri);
        row_indices[i] = row_is_int[i] ? int_saturated(ri) : -1;
        PyObject *cap = get_attr(binding, "max_seq_len");
        if (cap == NULL) {
            goto done;
        }
        PyTuple_SetItem(capacity_objs, i, cap);
        cap_is_int[i] = (uint8_t)is_exact_int(cap);
        capacities[i] = cap_is_int[i] ? int_saturated(cap) : -1;
    }
    /* P5: Python set semantics over whatever the resolver returned. */
    {
        PyObject *set = PySet_New(row_index_objs);
        if (set == NULL) {
            goto done;
        }
        Py_ssize_t unique = PySet_Size(set);
        Py_DECREF(set);
        if (unique != n) {
            value_error("Paged attention batch resolves multiple inputs to the same Worker row");
            goto done;
        }
    }
    int64_t threshold = -1, max_reqs = 0, max_tokens = 0, cp_size = 0;
    int has_threshold = args[2] != Py_None;
    if (has_threshold && get_i64(args[2], op, "reorder_threshold", &threshold) != 0) {
        goto done;
    }
    int any_causal = PyObject_IsTrue(args[3]);
    if (any_causal < 0 || get_i64(args[4], op, "max_num_reqs", &max_reqs) != 0 ||
        get_i64(args[5], op, "max_num_batched_tokens", &max_tokens) != 0 ||
        i64_list(args[6], op, "block_sizes", &block_sizes, &num_groups) != 0 ||
        i64_list(args[7], op, "blocks_per_kv_block", &multipliers, &num_mult) != 0 ||
        get_i64(args[8], op, "cp_size", &cp_size) != 0) {
        goto done;
    }
    if (num_mult != num_groups) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): blocks_per_kv_block must have one entry per cache group (%zd), got %zd",
                     op, num_groups, num_mult);
        goto done;
    }
    for (Py_ssize_t g = 0; g < num_groups; g++) {
        if (block_sizes[g] <= 0 || multipliers[g] <= 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): block sizes and blocks_per_kv_block must be positive, got %lld and "
                         "%lld for group %zd",
                         op, (long long)block_sizes[g], (long long)multipliers[g], g);
            goto done;
        }
    }
    if (cp_size <= 0) {
        PyErr_Format(PyExc_ValueError, "%s(): cp_size must be positive, got %lld", op,
                     (long long)cp_size);
        goto done;
    }
    if (has_threshold && threshold < 0) {
        /* A negative threshold makes every row "long": no ordering can be violated. */
        has_threshold = 0;
    }
    dk_tensor nb;
    if (tensor_arg(module, args[9], op, "num_blocks", &nb) != 0 ||
        want_cpu(&nb, op, "num_blocks") != 0 || want_ndim(&nb, 2, op, "num_blocks") != 0) {
        goto done;
    }
    if (nb.dtype != DK_I32 && nb.dtype != DK_I64) {
        PyErr_Format(PyExc_TypeError, "%s(): num_blocks must be int32 or int64, got %s", op,
                     dk_dtype_name(nb.dtype));
        goto done;
    }
    if (nb.shape[0] < num_groups || nb.shape[1] < max_reqs) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): num_blocks must have shape [>= %zd groups, >= %lld rows], got [%lld, "
                     "%lld]",
                     op, num_groups, (long long)max_reqs, (long long)nb.shape[0],
                     (long long)nb.shape[1]);
        goto done;
    }
    dk_batch_check_args ca = {
        .num_rows = n,
        .query_lens = query_lens,
        .seq_lens = seq_lens,
        .row_indices = row_indices,
        .row_index_is_int = row_is_int,
        .capacities = capacities,
        .capacity_is_int = cap_is_int,
        .reorder_threshold = has_threshold ? threshold : -1,
        .any_causal = any_causal,
        .max_num_reqs = max_reqs,
        .max_num_batched_tokens = max_tokens,
        .num_groups = num_groups,
        .block_sizes = block_sizes,
        .blocks_per_kv_block = multipliers,
        .cp_size = cp_size,
        .num_blocks = nb.data,
        .num_blocks_dtype = nb.dtype,
        .num_blocks_stride_group = nb.strides[0],
        .num_blocks_stride_row = nb.strides[1],
    };
    dk_batch_fault fault;
    memset(&fault, 0, sizeof(fault));
    dk_error err = {{0}};
    dk_status s = dk_batch_check(&ca, &fault, &err);
    if (s == DK_OK && fault.rule == DK_BATCH_OK) {
        result = PyLong_FromLongLong((long long)fault.num_tokens);
        goto done;
    }
    PyObject *row = fault.row >= 0 && fault.row < n ? PyTuple_GetItem(rows, fault.row) : NULL;
    PyObject *identity = row == NULL ? NULL : get_attr(row, "identity");
    if (row != NULL && identity == NULL) {
        goto done;
    }
    switch (fault.rule) {
    case DK_BATCH_P5_DUP_WORKER_ROW:
        value_error("Paged attention batch resolves multiple inputs to the same Worker row");
        break;
    case DK_BATCH_P6_BAD_CAPACITY:
        PyErr_Format(PyExc_ValueError,
                     "Paged attention row %R resolved to invalid logical capacity %R", identity,
                     PyTuple_GetItem(capacity_objs, fault.row));
        break;
    case DK_BATCH_P7_SEQ_LEN_OVER_CAPACITY:
        PyErr_Format(PyExc_ValueError,
                     "Paged attention row %R uses seq_len=%lld, but its installed allocation has "
                     "logical length %S",
                     identity, (long long)seq_lens[fault.row],
                     PyTuple_GetItem(capacity_objs, fault.row));
        break;
    case DK_BATCH_P8_ORDER:
        PyErr_Format(PyExc_ValueError,
                     "Causal paged attention rows must place native decode/short-query rows "
                     "before prefill/long-query rows (decode threshold=%S)",
                     args[2]);
        break;
    case DK_BATCH_P9_BAD_WORKER_ROW:
        PyErr_Format(PyExc_ValueError, "Paged attention row %R resolved to invalid Worker row %R",
                     identity, PyTuple_GetItem(row_index_objs, fault.row));
        break;
    case DK_BATCH_P10_TOO_FEW_BLOCKS:
        PyErr_Format(PyExc_ValueError,
                     "Paged attention row %R requires %lld blocks in cache group %lld for "
                     "seq_len=%lld, but its installed Worker row contains only %lld blocks",
                     identity, (long long)fault.required_blocks, (long long)fault.group,
                     (long long)seq_lens[fault.row], (long long)fault.installed_blocks);
        break;
    case DK_BATCH_P11_TOO_MANY_TOKENS:
        PyErr_Format(PyExc_ValueError,
                     "Paged attention batch has %lld tokens; Worker capacity is %S",
                     (long long)fault.num_tokens, args[5]);
        break;
    default:
        raise_status(module, s == DK_OK ? DK_ERR_VALUE : s, &err);
        break;
    }
    Py_XDECREF(identity);

done:
    Py_XDECREF(rows);
    Py_XDECREF(bindings);
    Py_XDECREF(row_index_objs);
    Py_XDECREF(capacity_objs);
    free(query_lens);
    free(seq_lens);
    free(row_indices);
    free(capacities);
    free(row_is_int);
    free(cap_is_int);
    free(block_sizes);
    free(multipliers);
    return result;
}

static int
cpu_i32_1d(PyObject *module, PyObject *obj, const char *op, const char *arg, int64_t n,
           dk_tensor *t)
{
    if (tensor_arg(module, obj, op, arg, t) != 0 || want_cpu(t, op, arg) != 0 ||
        want_dtype(t, DK_I32, op, arg) != 0 || want_contiguous_1d(t, op, arg) != 0 ||
        want_min_len(t, n, op, arg) != 0) {
        return -1;
    }
    return 0;
}

static PyObject *
py_build_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "build_batch";
    if (check_nargs(op, nargs, 6) != 0) {
        return NULL;
    }
    PyObject *rows = as_tuple(args[0], op, "rows");
    if (rows == NULL) {
        return NULL;
    }
    PyObject *result = NULL;
    int64_t *kv_start = NULL, *ri = NULL;
    Py_ssize_t n = PyTuple_Size(rows), nri = 0;
    if (i64_list(args[1], op, "row_indices", &ri, &nri) != 0) {
        goto done;
    }
    if (nri != n) {
        PyErr_Format(PyExc_ValueError, "%s(): row_indices must have %zd entries, got %zd", op, n,
                     nri);
        goto done;
    }
    dk_tensor t_ri, t_qsl, t_sl, t_pos;
    if (cpu_i32_1d(module, args[2], op, "row_indices_out", n, &t_ri) != 0 ||
        cpu_i32_1d(module, args[3], op, "query_start_loc_out", n + 1, &t_qsl) != 0 ||
        cpu_i32_1d(module, args[4], op, "seq_lens_out", n, &t_sl) != 0 ||
        no_overlap(&t_qsl, "query_start_loc_out", &t_ri, "row_indices_out", op) ||
        no_overlap(&t_qsl, "query_start_loc_out", &t_sl, "seq_lens_out", op) ||
        no_overlap(&t_sl, "seq_lens_out", &t_ri, "row_indices_out", op)) {
        goto done;
    }
    kv_start = (int64_t *)calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
    if (kv_start == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int32_t *qsl = (int32_t *)t_qsl.data;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyTuple_GetItem(rows, i);
        int64_t q = 0, s = 0;
        if (row_i64(row, "query_len", &q) != 0 || row_i64(row, "seq_len", &s) != 0 ||
            row_i64(row, "kv_start_pos", &kv_start[i]) != 0) {
            goto done;
        }
        /* Negative lengths would send the positions loop below index 0. */
        if (q < 0 || s < 0 || kv_start[i] < 0 || kv_start[i] > INT64_MAX - q) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): rows[%zd] must have query_len, seq_len, kv_start_pos >= 0 and "
                         "kv_start_pos + query_len within int64, got %lld, %lld, %lld",
                         op, i, (long long)q, (long long)s, (long long)kv_start[i]);
            goto done;
        }
        if (s > INT32_MAX || total + q > INT32_MAX || ri[i] < INT32_MIN || ri[i] > INT32_MAX) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): row %zd must fit int32 metadata (seq_len %lld, tokens so far "
                         "%lld, row index %lld)",
                         op, i, (long long)s, (long long)total, (long long)ri[i]);
            goto done;
        }
        qsl[i] = (int32_t)total;
        total += q;
        ((int32_t *)t_sl.data)[i] = (int32_t)s;
        ((int32_t *)t_ri.data)[i] = (int32_t)ri[i];
    }
    qsl[n] = (int32_t)total;
    if (tensor_arg(module, args[5], op, "positions_out", &t_pos) != 0 ||
        want_cpu(&t_pos, op, "positions_out") != 0 ||
        want_dtype(&t_pos, DK_I64, op, "positions_out") != 0 ||
        want_contiguous_1d(&t_pos, op, "positions_out") != 0 ||
        want_min_len(&t_pos, total, op, "positions_out") != 0 ||
        no_overlap(&t_pos, "positions_out", &t_qsl, "query_start_loc_out", op) ||
        no_overlap(&t_pos, "positions_out", &t_ri, "row_indices_out", op) ||
        no_overlap(&t_pos, "positions_out", &t_sl, "seq_lens_out", op)) {
        goto done;
    }
    dk_positions_build(kv_start, qsl, n, (int64_t *)t_pos.data);
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(rows);
    free(kv_start);
    free(ri);
    return result;
}

static PyObject *
py_dcp_local_seq_lens(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "dcp_local_seq_lens";
    if (check_nargs(op, nargs, 5) != 0) {
        return NULL;
    }
    dk_tensor sl, out;
    int64_t c = 0, r = 0, il = 0;
    if (tensor_arg(module, args[0], op, "seq_lens", &sl) != 0 || want_cpu(&sl, op, "seq_lens") ||
        want_dtype(&sl, DK_I32, op, "seq_lens") || want_contiguous_1d(&sl, op, "seq_lens") ||
        cpu_i32_1d(module, args[1], op, "out", sl.shape[0], &out) != 0 ||
        get_i64(args[2], op, "cp_size", &c) || get_i64(args[3], op, "cp_rank", &r) ||
        get_i64(args[4], op, "cp_interleave", &il)) {
        return NULL;
    }
    if (c < 1 || r < 0 || r >= c || il < 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): cp_size must be >= 1, cp_rank in [0, cp_size) and cp_interleave >= 1, "
                     "got %lld, %lld, %lld",
                     op, (long long)c, (long long)r, (long long)il);
        return NULL;
    }
    if (c > INT64_MAX / il) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): cp_size * cp_interleave must fit in int64, got %lld * %lld", op,
                     (long long)c, (long long)il);
        return NULL;
    }
    if (no_overlap(&out, "out", &sl, "seq_lens", op) != 0) {
        return NULL;
    }
    dk_dcp_local_seq_lens((const int32_t *)sl.data, sl.shape[0], c, r, il, (int32_t *)out.data);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* Block tables and the pool                                                                   */
/* ------------------------------------------------------------------------------------------ */

static int
cpu_i32_2d(PyObject *module, PyObject *obj, const char *op, const char *arg, dk_tensor *t)
{
    if (tensor_arg(module, obj, op, arg, t) != 0 || want_cpu(t, op, arg) != 0 ||
        want_dtype(t, DK_I32, op, arg) != 0 || want_ndim(t, 2, op, arg) != 0) {
        return -1;
    }
    if (t->shape[1] > 1 && t->strides[1] != 1) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must have unit column stride, got %lld", op, arg,
                     (long long)t->strides[1]);
        return -1;
    }
    return 0;
}

static PyObject *
py_table_append(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "BlockTables.append_block_ids";
    if (check_nargs(op, nargs, 7) != 0) {
        return NULL;
    }
    dk_tensor table, counts;
    int64_t row = 0, k = 0, nk = 0;
    if (cpu_i32_2d(module, args[0], op, "table", &table) != 0 ||
        tensor_arg(module, args[1], op, "counts", &counts) != 0 ||
        want_cpu(&counts, op, "counts") || want_dtype(&counts, DK_I32, op, "counts") ||
        want_ndim(&counts, 1, op, "counts") ||
        want_min_len(&counts, table.shape[0], op, "counts") || get_i64(args[2], op, "row", &row) ||
        get_i64(args[4], op, "blocks_per_kv_block", &k) ||
        get_i64(args[5], op, "num_kernel_blocks", &nk)) {
        return NULL;
    }
    if (no_overlap(&counts, "counts", &table, "table", op) != 0) {
        return NULL;
    }
    int overwrite = PyObject_IsTrue(args[6]);
    if (overwrite < 0) {
        return NULL;
    }
    int64_t *ids = NULL;
    Py_ssize_t n = 0;
    if (i64_list(args[3], op, "block_ids", &ids, &n) != 0) {
        return NULL;
    }
    dk_table_append_args a = {
        .table = (int32_t *)table.data,
        .table_stride_row = table.strides[0],
        .table_rows = table.shape[0],
        .table_cols = table.shape[1],
        .counts = (int32_t *)counts.data,
        .counts_stride = counts.strides[0],
        .row = row,
        .block_ids = ids,
        .n = n,
        .blocks_per_kv_block = k,
        .num_kernel_blocks = nk,
        .overwrite = overwrite,
    };
    dk_error err = {{0}};
    dk_status s = dk_table_append(&a, &err);
    free(ids);
    if (s != DK_OK) {
        return raise_status(module, s, &err);
    }
    Py_RETURN_NONE;
}

static PyObject *
py_gather_block_tables(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "BlockTables.gather_block_tables";
    if (check_nargs(op, nargs, 5) != 0) {
        return NULL;
    }
    dk_tensor table, counts, ri, out;
    int64_t padded = 0;
    if (cpu_i32_2d(module, args[0], op, "table", &table) != 0 ||
        tensor_arg(module, args[1], op, "counts", &counts) != 0 ||
        want_cpu(&counts, op, "counts") || want_dtype(&counts, DK_I32, op, "counts") ||
        want_ndim(&counts, 1, op, "counts") ||
        want_min_len(&counts, table.shape[0], op, "counts") ||
        tensor_arg(module, args[2], op, "row_indices", &ri) != 0 ||
        want_cpu(&ri, op, "row_indices") || want_dtype(&ri, DK_I32, op, "row_indices") ||
        want_contiguous_1d(&ri, op, "row_indices") ||
        cpu_i32_2d(module, args[3], op, "out", &out) != 0 ||
        get_i64(args[4], op, "num_reqs_padded", &padded)) {
        return NULL;
    }
    if (out.shape[1] != table.shape[1]) {
        PyErr_Format(PyExc_ValueError, "%s(): out must have %lld columns, got %lld", op,
                     (long long)table.shape[1], (long long)out.shape[1]);
        return NULL;
    }
    if (no_overlap(&out, "out", &table, "table", op) ||
        no_overlap(&out, "out", &counts, "counts", op) ||
        no_overlap(&out, "out", &ri, "row_indices", op)) {
        return NULL;
    }
    dk_gather_args a = {
        .table = (const int32_t *)table.data,
        .table_stride_row = table.strides[0],
        .table_rows = table.shape[0],
        .table_cols = table.shape[1],
        .counts = (const int32_t *)counts.data,
        .counts_stride = counts.strides[0],
        .row_indices = (const int32_t *)ri.data,
        .num_rows = ri.shape[0],
        .out = (int32_t *)out.data,
        .out_stride_row = out.strides[0],
        .out_rows = out.shape[0],
        .num_reqs_padded = padded,
    };
    dk_error err = {{0}};
    dk_status s = dk_ref_gather_block_tables(&a, &err);
    if (s != DK_OK) {
        return raise_status(module, s, &err);
    }
    Py_RETURN_NONE;
}

static PyObject *
py_compute_slot_mappings(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "BlockTables.compute_slot_mappings";
    if (check_nargs(op, nargs, 11) != 0) {
        return NULL;
    }
    dk_tensor table, ri, qsl, pos, out;
    int64_t num_tokens = 0, padded = 0, bs = 0, c = 0, r = 0, il = 0;
    if (tensor_arg(module, args[0], op, "table", &table) != 0 ||
        want_dtype(&table, DK_I32, op, "table") || want_ndim(&table, 2, op, "table") ||
        tensor_arg(module, args[1], op, "row_indices", &ri) != 0 ||
        want_dtype(&ri, DK_I32, op, "row_indices") || want_contiguous_1d(&ri, op, "row_indices") ||
        same_device(&table, &ri, op, "row_indices") ||
        tensor_arg(module, args[2], op, "query_start_loc", &qsl) != 0 ||
        want_dtype(&qsl, DK_I32, op, "query_start_loc") ||
        want_contiguous_1d(&qsl, op, "query_start_loc") ||
        want_min_len(&qsl, ri.shape[0] + 1, op, "query_start_loc") ||
        same_device(&table, &qsl, op, "query_start_loc") ||
        tensor_arg(module, args[3], op, "positions", &pos) != 0 ||
        want_dtype(&pos, DK_I64, op, "positions") || want_contiguous_1d(&pos, op, "positions") ||
        same_device(&table, &pos, op, "positions") ||
        tensor_arg(module, args[4], op, "out", &out) != 0 || want_dtype(&out, DK_I64, op, "out") ||
        want_ndim(&out, 1, op, "out") || same_device(&table, &out, op, "out") ||
        get_i64(args[5], op, "num_tokens", &num_tokens) ||
        get_i64(args[6], op, "num_tokens_padded", &padded) ||
        get_i64(args[7], op, "block_size", &bs) || get_i64(args[8], op, "cp_size", &c) ||
        get_i64(args[9], op, "cp_rank", &r) || get_i64(args[10], op, "cp_interleave", &il)) {
        return NULL;
    }
    if (table.shape[1] > 1 && table.strides[1] != 1) {
        PyErr_Format(PyExc_ValueError, "%s(): table must have unit column stride", op);
        return NULL;
    }
    if (no_overlap(&out, "out", &table, "table", op) ||
        no_overlap(&out, "out", &ri, "row_indices", op) ||
        no_overlap(&out, "out", &qsl, "query_start_loc", op) ||
        no_overlap(&out, "out", &pos, "positions", op)) {
        return NULL;
    }
    if (num_tokens < 0 || padded < num_tokens || pos.shape[0] < num_tokens ||
        out.shape[0] < padded) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): need 0 <= num_tokens (%lld) <= num_tokens_padded (%lld), positions "
                     "with >= num_tokens entries (%lld) and out with >= num_tokens_padded entries "
                     "(%lld)",
                     op, (long long)num_tokens, (long long)padded, (long long)pos.shape[0],
                     (long long)out.shape[0]);
        return NULL;
    }
    if (bs < 1 || c < 1 || r < 0 || r >= c || il < 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): block_size >= 1, cp_size >= 1, cp_rank in [0, cp_size) and "
                     "cp_interleave >= 1 required, got %lld, %lld, %lld, %lld",
                     op, (long long)bs, (long long)c, (long long)r, (long long)il);
        return NULL;
    }
    if (c > 1 && bs % il != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): cp_interleave must divide block_size under context parallelism, got "
                     "cp_interleave=%lld, block_size=%lld",
                     op, (long long)il, (long long)bs);
        return NULL;
    }
    dk_slots_args a = {
        .block_table = (const int32_t *)table.data,
        .bt_stride_row = table.strides[0],
        .table_rows = table.shape[0],
        .table_cols = table.shape[1],
        .row_indices = (const int32_t *)ri.data,
        .query_start_loc = (const int32_t *)qsl.data,
        .positions = (const int64_t *)pos.data,
        .slot_mapping = (int64_t *)out.data,
        .slot_stride = out.strides[0],
        .num_rows = ri.shape[0],
        .num_tokens = num_tokens,
        .num_tokens_padded = padded,
        .block_size = bs,
        .cp_size = c,
        .cp_rank = r,
        .cp_interleave = il,
    };
    if (table.device_type == DK_CUDA) {
        if (run_cuda(module, args[0], table.device_id, launch_slots, &a) != 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    const int32_t *q = (const int32_t *)qsl.data;
    if (q[ri.shape[0]] != num_tokens) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): query_start_loc must end at num_tokens (%lld), got %d", op,
                     (long long)num_tokens, (int)q[ri.shape[0]]);
        return NULL;
    }
    dk_error err = {{0}};
    dk_status s = dk_ref_slots(&a, &err);
    if (s != DK_OK) {
        return raise_status(module, s, &err);
    }
    Py_RETURN_NONE;
}

static int
pool_args(PyObject *module, PyObject *const *args, const char *op, dk_pool *pool, int64_t **state)
{
    dk_tensor st, fs, iu;
    if (tensor_arg(module, args[0], op, "state", &st) != 0 || want_cpu(&st, op, "state") ||
        want_dtype(&st, DK_I64, op, "state") || want_contiguous_1d(&st, op, "state") ||
        want_min_len(&st, 1, op, "state") ||
        tensor_arg(module, args[1], op, "free_stack", &fs) != 0 ||
        want_cpu(&fs, op, "free_stack") || want_dtype(&fs, DK_I32, op, "free_stack") ||
        want_contiguous_1d(&fs, op, "free_stack") ||
        tensor_arg(module, args[2], op, "in_use", &iu) != 0 || want_cpu(&iu, op, "in_use") ||
        want_dtype(&iu, DK_U8, op, "in_use") || want_contiguous_1d(&iu, op, "in_use")) {
        return -1;
    }
    if (iu.shape[0] != fs.shape[0]) {
        PyErr_Format(PyExc_ValueError, "%s(): in_use must have %lld entries, got %lld", op,
                     (long long)fs.shape[0], (long long)iu.shape[0]);
        return -1;
    }
    if (no_overlap(&fs, "free_stack", &st, "state", op) ||
        no_overlap(&iu, "in_use", &st, "state", op) ||
        no_overlap(&iu, "in_use", &fs, "free_stack", op)) {
        return -1;
    }
    *state = (int64_t *)st.data;
    pool->free_stack = (int32_t *)fs.data;
    pool->in_use = (uint8_t *)iu.data;
    pool->num_blocks = fs.shape[0];
    pool->num_free = **state;
    if (pool->num_free < 0 || pool->num_free > pool->num_blocks) {
        PyErr_Format(PyExc_ValueError, "%s(): state holds %lld free blocks of %lld", op,
                     (long long)pool->num_free, (long long)pool->num_blocks);
        return -1;
    }
    return 0;
}

static PyObject *
py_pool_init(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("pool_init", nargs, 3) != 0) {
        return NULL;
    }
    dk_pool pool;
    int64_t *state = NULL;
    dk_tensor st;
    if (tensor_arg(module, args[0], "BlockPool", "state", &st) != 0 ||
        want_cpu(&st, "BlockPool", "state") || want_dtype(&st, DK_I64, "BlockPool", "state") ||
        want_contiguous_1d(&st, "BlockPool", "state") ||
        want_min_len(&st, 1, "BlockPool", "state")) {
        return NULL;
    }
    /* pool_args range-checks the stored free count: start from 0, put it back on failure. */
    int64_t before = *(int64_t *)st.data;
    *(int64_t *)st.data = 0;
    if (pool_args(module, args, "BlockPool", &pool, &state) != 0) {
        *(int64_t *)st.data = before;
        return NULL;
    }
    dk_pool_init(&pool);
    *state = pool.num_free;
    Py_RETURN_NONE;
}

static PyObject *
py_pool_allocate(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "BlockPool.allocate";
    if (check_nargs(op, nargs, 4) != 0) {
        return NULL;
    }
    dk_pool pool;
    int64_t *state = NULL, n = 0;
    if (pool_args(module, args, op, &pool, &state) != 0) {
        return NULL;
    }
    if (!PyLong_Check(args[3]) || PyBool_Check(args[3])) {
        PyErr_Format(PyExc_TypeError, "%s(): n must be an int, got %R", op, args[3]);
        return NULL;
    }
    int overflow = 0;
    n = PyLong_AsLongLongAndOverflow(args[3], &overflow);
    if (overflow > 0) {
        n = INT64_MAX;
    }
    else if (overflow < 0) {
        n = -1;
    }
    int32_t *ids =
        (int32_t *)malloc((size_t)(n > 0 && n <= pool.num_free ? n : 1) * sizeof(int32_t));
    if (ids == NULL) {
        return PyErr_NoMemory();
    }
    dk_error err = {{0}};
    dk_status s = dk_pool_allocate(&pool, n, ids, &err);
    if (s != DK_OK) {
        free(ids);
        return raise_status(module, s, &err);
    }
    *state = pool.num_free;
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (int64_t i = 0; list != NULL && i < n; i++) {
        PyObject *x = PyLong_FromLong(ids[i]);
        if (x == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SetItem(list, (Py_ssize_t)i, x);
    }
    free(ids);
    return list;
}

static PyObject *
py_pool_free(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "BlockPool.free";
    if (check_nargs(op, nargs, 4) != 0) {
        return NULL;
    }
    dk_pool pool;
    int64_t *state = NULL, *ids = NULL;
    Py_ssize_t n = 0;
    if (pool_args(module, args, op, &pool, &state) != 0 ||
        i64_list(args[3], op, "block_ids", &ids, &n) != 0) {
        return NULL;
    }
    dk_error err = {{0}};
    dk_status s = dk_pool_free(&pool, ids, n, &err);
    free(ids);
    if (s != DK_OK) {
        return raise_status(module, s, &err);
    }
    *state = pool.num_free;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* Piecewise plan                                                                              */
/* ------------------------------------------------------------------------------------------ */

static PyObject *
plan_error(const char *msg)
{
    PyErr_SetString(PyExc_ValueError, msg);
    return NULL;
}

static PyObject *
py_build_plan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "build_paged_piecewise_plan";
    if (check_nargs(op, nargs, 6) != 0) {
        return NULL;
    }
    PyObject *spans_rows = NULL, *norm = NULL, *result = NULL, *segs_py = NULL;
    int64_t *offsets = NULL, *qlens = NULL, *slens = NULL, *span_off = NULL, *spans = NULL;
    int32_t *limits = NULL;
    dk_segment *segs = NULL;
    Py_ssize_t n = 0, n_off = 0, n_ql = 0, n_sl = 0;

    spans_rows = as_tuple(args[0], op, "full_attn_spans");
    if (spans_rows == NULL || i64_list(args[1], op, "query_offsets", &offsets, &n_off) != 0 ||
        i64_list(args[2], op, "query_lens", &qlens, &n_ql) != 0 ||
        i64_list(args[3], op, "seq_lens", &slens, &n_sl) != 0) {
        goto done;
    }
    n = PyTuple_Size(spans_rows);
    if (n == 0 || n_off != n || n_ql != n || n_sl != n) {
        plan_error("Paged piecewise inputs must have one entry per row");
        goto done;
    }
    /* Normalise: tuple(tuple((int(start), int(end)) ...) ...). */
    norm = PyTuple_New(n);
    span_off = (int64_t *)calloc((size_t)n + 1, sizeof(int64_t));
    if (norm == NULL || span_off == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    Py_ssize_t total_spans = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        PyObject *row = as_tuple(PyTuple_GetItem(spans_rows, r), op, "full_attn_spans row");
        if (row == NULL) {
            goto done;
        }
        Py_ssize_t m = PyTuple_Size(row);
        PyObject *nrow = PyTuple_New(m);
        if (nrow == NULL) {
            Py_DECREF(row);
            goto done;
        }
        PyTuple_SetItem(norm, r, nrow);
        for (Py_ssize_t i = 0; i < m; i++) {
            PyObject *pair = as_tuple(PyTuple_GetItem(row, i), op, "span");
            if (pair == NULL) {
                Py_DECREF(row);
                goto done;
            }
            if (PyTuple_Size(pair) != 2) {
                PyErr_Format(PyExc_ValueError,
                             "%s(): each span must be a (start, end) pair, got %R", op, pair);
                Py_DECREF(pair);
                Py_DECREF(row);
                goto done;
            }
            PyObject *a = PyNumber_Long(PyTuple_GetItem(pair, 0));
            PyObject *b = a == NULL ? NULL : PyNumber_Long(PyTuple_GetItem(pair, 1));
            Py_DECREF(pair);
            if (b == NULL) {
                Py_XDECREF(a);
                Py_DECREF(row);
                goto done;
            }
            PyObject *np = PyTuple_Pack(2, a, b);
            Py_DECREF(a);
            Py_DECREF(b);
            if (np == NULL) {
                Py_DECREF(row);
                goto done;
            }
            PyTuple_SetItem(nrow, i, np);
        }
        Py_DECREF(row);
        total_spans += m;
        span_off[r + 1] = total_spans;
    }
    spans = (int64_t *)calloc((size_t)(total_spans > 0 ? 2 * total_spans : 1), sizeof(int64_t));
    if (spans == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0, k = 0; r < n; r++) {
        PyObject *nrow = PyTuple_GetItem(norm, r);
        for (Py_ssize_t i = 0; i < PyTuple_Size(nrow); i++, k++) {
            PyObject *pair = PyTuple_GetItem(nrow, i);
            /* Huge values saturate: they fail the "within the sequence" rule like the seed. */
            spans[2 * k] = int_saturated(PyTuple_GetItem(pair, 0));
            spans[2 * k + 1] = int_saturated(PyTuple_GetItem(pair, 1));
        }
    }
    dk_plan_args pa = {
        .num_rows = n,
        .span_offsets = span_off,
        .spans = spans,
        .query_offsets = offsets,
        .query_lens = qlens,
        .seq_lens = slens,
    };
    int64_t total_q = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (qlens[r] > 0) {
            /* Saturate: a wrapped total would let the outputs below look big enough. */
            total_q = qlens[r] > INT64_MAX - total_q ? INT64_MAX : total_q + qlens[r];
        }
    }
    dk_tensor kl, qi;
    if (dk_bridge_optional_tensor(&state_of(module)->bridge, args[4], op, "key_limits_out", &kl) ||
        dk_bridge_optional_tensor(&state_of(module)->bridge, args[5], op, "query_indices_out",
                                  &qi)) {
        goto done;
    }
    if (kl.ndim >= 0 &&
        (want_cpu(&kl, op, "key_limits_out") || want_dtype(&kl, DK_I32, op, "key_limits_out") ||
         want_contiguous_1d(&kl, op, "key_limits_out") ||
         want_min_len(&kl, total_q, op, "key_limits_out"))) {
        goto done;
    }
    if (qi.ndim >= 0 && (want_cpu(&qi, op, "query_indices_out") ||
                         want_dtype(&qi, DK_I64, op, "query_indices_out") ||
                         want_contiguous_1d(&qi, op, "query_indices_out") ||
                         want_min_len(&qi, total_q, op, "query_indices_out"))) {
        goto done;
    }
    if (kl.ndim >= 0 && qi.ndim >= 0 &&
        no_overlap(&qi, "query_indices_out", &kl, "key_limits_out", op) != 0) {
        goto done;
    }
    int64_t cap = dk_plan_segment_capacity(&pa);
    segs = (dk_segment *)calloc((size_t)(cap > 0 ? cap : 1), sizeof(dk_segment));
    if (kl.ndim >= 0) {
        limits = (int32_t *)calloc((size_t)(total_q > 0 ? total_q : 1), sizeof(int32_t));
    }
    if (segs == NULL || (kl.ndim >= 0 && limits == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t num_segments = 0;
    dk_plan_rule rule = DK_PLAN_OK;
    dk_error err = {{0}};
    dk_status s = dk_plan_build(&pa, segs, cap, &num_segments, limits, &rule, &err);
    if (s != DK_OK) {
        raise_status(module, s, &err);
        goto done;
    }
    if (kl.ndim >= 0 && total_q > 0) {
        memcpy(kl.data, limits, (size_t)total_q * sizeof(int32_t));
    }
    if (qi.ndim >= 0) {
        int64_t *dst = (int64_t *)qi.data, w = 0;
        for (int64_t k = 0; k < num_segments; k++) {
            int64_t packed = 0;
            for (Py_ssize_t r = 0; r < n; r++) {
                const dk_segment *sg = &segs[k * n + r];
                for (int64_t p = sg->q_start; p < sg->q_end; p++) {
                    dst[w++] = packed + (p - offsets[r]);
                }
                packed += qlens[r];
            }
        }
    }
    segs_py = PyTuple_New((Py_ssize_t)num_segments);
    if (segs_py == NULL) {
        goto done;
    }
    for (int64_t k = 0; k < num_segments; k++) {
        PyObject *rowsegs = PyTuple_New(n);
        if (rowsegs == NULL) {
            goto done;
        }
        PyTuple_SetItem(segs_py, (Py_ssize_t)k, rowsegs);
        for (Py_ssize_t r = 0; r < n; r++) {
            const dk_segment *sg = &segs[k * n + r];
            PyObject *t =
                Py_BuildValue("(LLLs)", (long long)sg->q_start, (long long)sg->q_end,
                              (long long)sg->kv_end, sg->mode == DK_MODE_FULL ? "full" : "causal");
            if (t == NULL) {
                goto done;
            }
            PyTuple_SetItem(rowsegs, r, t);
        }
    }
    result = PyTuple_Pack(2, norm, segs_py);
done:
    Py_XDECREF(spans_rows);
    Py_XDECREF(norm);
    Py_XDECREF(segs_py);
    free(offsets);
    free(qlens);
    free(slens);
    free(span_off);
    free(spans);
    free(limits);
    free(segs);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* KV write, attention, row copies                                                             */
/* ------------------------------------------------------------------------------------------ */

/* Reads key/value/kv_cache/slot_mapping into a kv-write argument block; views[0..3] receive
 * the four tensors' views. */
static int
parse_kv_write(PyObject *module, PyObject *const *args, const char *op, dk_kv_write_args *a,
               dk_tensor *views)
{
    dk_tensor k, v, c, sm;
    if (tensor_arg(module, args[0], op, "key", &k) != 0 || want_float(&k, op, "key") ||
        want_ndim(&k, 3, op, "key") || tensor_arg(module, args[1], op, "value", &v) != 0 ||
        want_dtype(&v, k.dtype, op, "value") || want_ndim(&v, 3, op, "value") ||
        same_device(&k, &v, op, "value") || tensor_arg(module, args[2], op, "kv_cache", &c) != 0 ||
        want_dtype(&c, k.dtype, op, "kv_cache") || want_ndim(&c, 5, op, "kv_cache") ||
        same_device(&k, &c, op, "kv_cache") ||
        tensor_arg(module, args[3], op, "slot_mapping", &sm) != 0 ||
        want_dtype(&sm, DK_I64, op, "slot_mapping") || want_ndim(&sm, 1, op, "slot_mapping") ||
        same_device(&k, &sm, op, "slot_mapping")) {
        return -1;
    }
    if (v.shape[0] != k.shape[0] || v.shape[1] != k.shape[1] || v.shape[2] != k.shape[2]) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): value must have the shape of key [%lld, %lld, %lld], "
                     "got [%lld, %lld, %lld]",
                     op, (long long)k.shape[0], (long long)k.shape[1], (long long)k.shape[2],
                     (long long)v.shape[0], (long long)v.shape[1], (long long)v.shape[2]);
        return -1;
    }
    if (c.shape[0] != 2 || c.shape[3] != k.shape[1] || c.shape[4] != k.shape[2]) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): kv_cache must have shape [2, num_blocks, block_size, %lld, %lld], got "
                     "[%lld, %lld, %lld, %lld, %lld]",
                     op, (long long)k.shape[1], (long long)k.shape[2], (long long)c.shape[0],
                     (long long)c.shape[1], (long long)c.shape[2], (long long)c.shape[3],
                     (long long)c.shape[4]);
        return -1;
    }
    if (want_min_len(&sm, k.shape[0], op, "slot_mapping") != 0 ||
        no_overlap(&c, "kv_cache", &k, "key", op) || no_overlap(&c, "kv_cache", &v, "value", op) ||
        no_overlap(&c, "kv_cache", &sm, "slot_mapping", op)) {
        return -1;
    }
    size_t es = dk_dtype_size(k.dtype);
    memset(a, 0, sizeof(*a));
    a->key = k.data;
    a->value = v.data;
    a->key_stride_token = k.strides[0];
    a->key_stride_head = k.strides[1];
    a->key_stride_dim = k.strides[2];
    a->value_stride_token = v.strides[0];
    a->value_stride_head = v.strides[1];
    a->value_stride_dim = v.strides[2];
    a->key_cache = c.data;
    a->value_cache = c.data == NULL ? NULL : (void *)((char *)c.data + (size_t)c.strides[0] * es);
    a->cache_stride_block = c.strides[1];
    a->cache_stride_token = c.strides[2];
    a->cache_stride_head = c.strides[3];
    a->cache_stride_dim = c.strides[4];
    a->slot_mapping = (const int64_t *)sm.data;
    a->slot_stride = sm.strides[0];
    a->num_tokens = k.shape[0];
    a->num_kv_heads = k.shape[1];
    a->head_size = k.shape[2];
    a->block_size = c.shape[2];
    a->num_blocks = c.shape[1];
    a->dtype = k.dtype;
    views[0] = k;
    views[1] = v;
    views[2] = c;
    views[3] = sm;
    return 0;
}

static int
run_kv_write(PyObject *module, PyObject *key_obj, const dk_tensor *k, const dk_kv_write_args *a)
{
    if (a->num_tokens == 0) {
        return 0;
    }
    if (k->device_type == DK_CUDA) {
        return run_cuda(module, key_obj, k->device_id, launch_kv_write, a);
    }
    dk_error err = {{0}};
    dk_status s;
    Py_BEGIN_ALLOW_THREADS s = dk_ref_kv_write(a, &err);
    Py_END_ALLOW_THREADS if (s != DK_OK)
    {
        raise_status(module, s, &err);
        return -1;
    }
    return 0;
}

/*
 * The standalone kv_write on CUDA copies the slot mapping to the host and range-checks it
 * before launching (one synchronisation; forward_paged does not do this: its slots come from
 * block tables whose entries were checked on the host, and the kernel skips any slot outside
 * the cache rather than writing there).
 */
static int
check_device_slots(PyObject *module, PyObject *key_obj, const dk_tensor *k,
                   const dk_kv_write_args *a)
{
    if (a->num_tokens == 0) {
        return 0;
    }
    if (!dk_cuda_compiled()) {
        return run_cuda(module, key_obj, k->device_id, launch_kv_write, a);
    }
    int64_t *host = (int64_t *)malloc((size_t)a->num_tokens * sizeof(int64_t));
    if (host == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    void *stream = NULL;
    int32_t prev = 0;
    dk_error err = {{0}};
    if (dk_bridge_stream(&state_of(module)->bridge, key_obj, k->device_id, &stream) != 0) {
        free(host);
        return -1;
    }
    dk_status s = dk_cuda_device_enter(k->device_id, &prev, &err);
    for (int64_t t = 0; s == DK_OK && t < a->num_tokens; t++) {
        /* Strided mappings are rare; copy entry by entry only then. */
        if (a->slot_stride == 1) {
            s = dk_cuda_copy_to_host(host, a->slot_mapping, (size_t)a->num_tokens * sizeof(int64_t),
                                     stream, &err);
            break;
        }
        s = dk_cuda_copy_to_host(&host[t], a->slot_mapping + t * a->slot_stride, sizeof(int64_t),
                                 stream, &err);
    }
    if (s == DK_OK) {
        dk_cuda_device_exit(prev);
    }
    int64_t capacity = a->num_blocks * a->block_size;
    for (int64_t t = 0; s == DK_OK && t < a->num_tokens; t++) {
        if (host[t] >= capacity) {
            s = dk_fail(&err, DK_ERR_VALUE,
                        "kv_write(): slot_mapping[%lld] must be < num_blocks * block_size = %lld "
                        "(or < 0 to skip), got %lld",
                        (long long)t, (long long)capacity, (long long)host[t]);
        }
    }
    free(host);
    if (s != DK_OK) {
        raise_status(module, s, &err);
        return -1;
    }
    return 0;
}

static PyObject *
py_kv_write(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("kv_write", nargs, 4) != 0) {
        return NULL;
    }
    dk_kv_write_args a;
    dk_tensor views[4];
    const dk_tensor *k = &views[0];
    if (parse_kv_write(module, args, "kv_write", &a, views) != 0) {
        return NULL;
    }
    if (k->device_type == DK_CUDA && check_device_slots(module, args[0], k, &a) != 0) {
        return NULL;
    }
    if (run_kv_write(module, args[0], k, &a) != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* A 2-D o of num_heads * head_size columns (query q's [N, H, D]) becomes its [N, H, D] view:
 * 1, else 0 (o unchanged). */
static int
heads_of_flat(dk_tensor *o, const dk_tensor *q)
{
    if (o->ndim != 2 || q->ndim != 3 || q->shape[1] <= 0 || q->shape[2] <= 0 ||
        o->shape[1] != q->shape[1] * q->shape[2]) {
        return 0;
    }
    const int64_t n = o->shape[0], ts = o->strides[0], ds = o->strides[1];
    o->ndim = 3;
    o->shape[0] = n;
    o->shape[1] = q->shape[1];
    o->shape[2] = q->shape[2];
    o->strides[0] = ts;
    o->strides[1] = q->shape[2] * ds;
    o->strides[2] = ds;
    return 1;
}

/*
 * Parses the attention arguments starting at args[0] = query:
 * query, kv_cache, block_table, query_start_loc, seq_lens, key_limits, mask, scale, out,
 * host_block_table, host_query_start_loc, host_seq_lens (all three may be None, see below).
 * Fills `a` and runs dk_attention_check on the host copies (on CPU on the very tensors the
 * reference then reads, so host_* that differ from them cannot smuggle in an unchecked block
 * id).  `written` (or NULL) is the kv_cache a KV write fills before the attention reads its
 * inputs: none of them may share bytes with it.  *q_out and *o_out receive the query and out
 * views.  dense_kv (dense_attention, else NULL): key, value, joint_key, joint_value (the last
 * two ndim -1 when absent; checked by the caller); key_block: keys per block of key_index
 * (dividing num_keys, 1 with joint keys; checked by the caller).  out_flat (forward_context
 * only): out may also be [num_tokens, num_heads * head_size], read as the [N, H, D] view of it.
 */
static int
parse_attention(PyObject *module, PyObject *const *args, const char *op, dk_attention_args *a,
                const dk_tensor *written, dk_tensor *q_out, dk_tensor *o_out,
                const dk_tensor *dense_kv, int64_t key_block, int out_flat)
{
    dk_tensor q, c, bt, qsl, sl, kl, o, hbt, hqsl, hsl;
    int64_t mask = 0;
    /* the block table is dense_attention's key_index */
    const char *bt_name = dense_kv != NULL ? "key_index" : "block_table";
    const char *hbt_name = dense_kv != NULL ? "host_key_index" : "host_block_table";
    if (written != NULL) {
        /* forward_paged: the cache its KV write parsed is this call's kv_cache (the same
         * argument), not parsed a second time */
        c = *written;
    }
    else if (dense_kv != NULL) {
        /* key/value [num_keys, num_kv_heads, head_size] with one stride set (checked by the
         * caller): a cache of num_keys blocks of one token whose V half starts at value. */
        c = dense_kv[0];
        c.ndim = 5;
        c.shape[0] = 2;
        c.shape[1] = dense_kv[0].shape[0] / key_block;
        c.shape[2] = key_block;
        c.shape[3] = dense_kv[0].shape[1];
        c.shape[4] = dense_kv[0].shape[2];
        c.strides[0] = 0;
        c.strides[1] = dense_kv[0].strides[0] * key_block;
        c.strides[2] = key_block > 1 ? dense_kv[0].strides[0] : 0;
        c.strides[3] = dense_kv[0].strides[1];
        c.strides[4] = dense_kv[0].strides[2];
    }
    if (tensor_arg(module, args[0], op, "query", &q) != 0 || want_float(&q, op, "query") ||
        want_ndim(&q, 3, op, "query") ||
        (dense_kv == NULL &&
         ((written == NULL && tensor_arg(module, args[1], op, "kv_cache", &c) != 0) ||
          want_dtype(&c, q.dtype, op, "kv_cache") || want_ndim(&c, 5, op, "kv_cache"))) ||
        (dense_kv != NULL && want_dtype(&c, q.dtype, op, "key")) ||
        same_device(&q, &c, op, dense_kv != NULL ? "key" : "kv_cache") ||
        tensor_arg(module, args[2], op, bt_name, &bt) != 0 ||
        want_dtype(&bt, DK_I32, op, bt_name) || want_ndim(&bt, 2, op, bt_name) ||
        same_device(&q, &bt, op, bt_name) ||
        tensor_arg(module, args[3], op, "query_start_loc", &qsl) != 0 ||
        want_dtype(&qsl, DK_I32, op, "query_start_loc") ||
        want_contiguous_1d(&qsl, op, "query_start_loc") ||
        same_device(&q, &qsl, op, "query_start_loc") ||
        tensor_arg(module, args[4], op, "seq_lens", &sl) != 0 ||
        want_dtype(&sl, DK_I32, op, "seq_lens") || want_contiguous_1d(&sl, op, "seq_lens") ||
        same_device(&q, &sl, op, "seq_lens") ||
        dk_bridge_optional_tensor(&state_of(module)->bridge, args[5], op, "key_limits", &kl) ||
        get_i64(args[6], op, "mask", &mask) || tensor_arg(module, args[8], op, "out", &o) != 0 ||
        want_dtype(&o, q.dtype, op, "out") ||
        (!(out_flat && heads_of_flat(&o, &q)) && want_ndim(&o, 3, op, "out")) ||
        same_device(&q, &o, op, "out")) {
        return -1;
    }
    /* The host copies are all given (checked here) or all None: then CPU tensors are checked
     * themselves, and on CUDA the caller vouches for the device metadata (diffkv.ops, whose
     * batches were checked when prepared) while the kernels clamp every index they read. */
    int n_none = (args[9] == Py_None) + (args[10] == Py_None) + (args[11] == Py_None);
    const int trusted = n_none == 3;
    if (n_none != 0 && !trusted) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): %s, host_query_start_loc and host_seq_lens must all be tensors or all "
                     "be None, got %d None",
                     op, hbt_name, n_none);
        return -1;
    }
    if (trusted) {
        hbt = bt;
        hqsl = qsl;
        hsl = sl;
    }
    else if (tensor_arg(module, args[9], op, hbt_name, &hbt) != 0 || want_cpu(&hbt, op, hbt_name) ||
             want_dtype(&hbt, DK_I32, op, hbt_name) || want_ndim(&hbt, 2, op, hbt_name) ||
             tensor_arg(module, args[10], op, "host_query_start_loc", &hqsl) != 0 ||
             want_cpu(&hqsl, op, "host_query_start_loc") ||
             want_dtype(&hqsl, DK_I32, op, "host_query_start_loc") ||
             want_contiguous_1d(&hqsl, op, "host_query_start_loc") ||
             tensor_arg(module, args[11], op, "host_seq_lens", &hsl) != 0 ||
             want_cpu(&hsl, op, "host_seq_lens") || want_dtype(&hsl, DK_I32, op, "host_seq_lens") ||
             want_contiguous_1d(&hsl, op, "host_seq_lens")) {
        return -1;
    }
    double scale = PyFloat_AsDouble(args[7]);
    if (scale == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    if (!(scale > 0.0) || scale > 1e30) {
        PyErr_Format(PyExc_ValueError, "%s(): scale must be a positive finite float, got %R", op,
                     args[7]);
        return -1;
    }
    if (mask < DK_MASK_NONE || mask > DK_MASK_LIMITS) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): mask must be 0 (none), 1 (causal) or 2 (limits), got %lld", op,
                     (long long)mask);
        return -1;
    }
    int64_t n = q.shape[0], h = q.shape[1], d = q.shape[2], r = sl.shape[0];
    if (dense_kv != NULL && (c.shape[4] != d || c.shape[3] <= 0 || h % c.shape[3] != 0)) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): key must have shape [num_keys, num_kv_heads, %lld] with num_heads "
                     "(%lld) divisible by num_kv_heads, got [%lld, %lld, %lld]",
                     op, (long long)d, (long long)h, (long long)c.shape[1], (long long)c.shape[3],
                     (long long)c.shape[4]);
        return -1;
    }
    if (c.shape[0] != 2 || c.shape[4] != d || c.shape[3] <= 0 || h % c.shape[3] != 0) {
        PyErr_Format(
            PyExc_ValueError,
            "%s(): kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, %lld] "
            "with num_heads (%lld) divisible by num_kv_heads, got [%lld, %lld, %lld, %lld, "
            "%lld]",
            op, (long long)d, (long long)h, (long long)c.shape[0], (long long)c.shape[1],
            (long long)c.shape[2], (long long)c.shape[3], (long long)c.shape[4]);
        return -1;
    }
    if (o.shape[0] != n || o.shape[1] != h || o.shape[2] != d) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): out must have shape [%lld, %lld, %lld], got [%lld, "
                     "%lld, %lld]",
                     op, (long long)n, (long long)h, (long long)d, (long long)o.shape[0],
                     (long long)o.shape[1], (long long)o.shape[2]);
        return -1;
    }
    if (qsl.shape[0] != r + 1 || bt.shape[0] < r || hqsl.shape[0] != r + 1 || hsl.shape[0] != r ||
        hbt.shape[0] != bt.shape[0] || hbt.shape[1] != bt.shape[1]) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): query_start_loc must have num_rows + 1 = %lld entries, %s at least "
                     "num_rows rows, and the host_* copies the shapes of their device tensors",
                     op, (long long)(r + 1), bt_name);
        return -1;
    }
    if ((bt.shape[1] > 1 && bt.strides[1] != 1) || (hbt.shape[1] > 1 && hbt.strides[1] != 1)) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must have unit column stride", op, bt_name);
        return -1;
    }
    if (mask == DK_MASK_LIMITS) {
        if (kl.ndim < 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): key_limits must be a tensor when mask is 2 (limits)", op);
            return -1;
        }
        if (want_dtype(&kl, DK_I32, op, "key_limits") ||
            want_contiguous_1d(&kl, op, "key_limits") || same_device(&q, &kl, op, "key_limits") ||
            want_min_len(&kl, n, op, "key_limits")) {
            return -1;
        }
    }
    const int joint = dense_kv != NULL && dense_kv[2].ndim == 3;
    if (no_overlap(&o, "out", &q, "query", op) ||
        no_overlap(&o, "out", &c, dense_kv != NULL ? "key" : "kv_cache", op) ||
        (dense_kv != NULL && no_overlap(&o, "out", &dense_kv[1], "value", op)) ||
        (joint && (no_overlap(&o, "out", &dense_kv[2], "joint_key", op) ||
                   no_overlap(&o, "out", &dense_kv[3], "joint_value", op))) ||
        no_overlap(&o, "out", &bt, bt_name, op) ||
        no_overlap(&o, "out", &qsl, "query_start_loc", op) ||
        no_overlap(&o, "out", &sl, "seq_lens", op) ||
        (mask == DK_MASK_LIMITS && no_overlap(&o, "out", &kl, "key_limits", op)) ||
        no_overlap(&o, "out", &hbt, hbt_name, op) ||
        no_overlap(&o, "out", &hqsl, "host_query_start_loc", op) ||
        no_overlap(&o, "out", &hsl, "host_seq_lens", op)) {
        return -1;
    }
    if (written != NULL &&
        (no_overlap(written, "kv_cache", &q, "query", op) ||
         no_overlap(written, "kv_cache", &bt, "block_table", op) ||
         no_overlap(written, "kv_cache", &qsl, "query_start_loc", op) ||
         no_overlap(written, "kv_cache", &sl, "seq_lens", op) ||
         (mask == DK_MASK_LIMITS && no_overlap(written, "kv_cache", &kl, "key_limits", op)) ||
         no_overlap(written, "kv_cache", &hbt, "host_block_table", op) ||
         no_overlap(written, "kv_cache", &hqsl, "host_query_start_loc", op) ||
         no_overlap(written, "kv_cache", &hsl, "host_seq_lens", op))) {
        return -1;
    }
    if (q.device_type == DK_CPU) {
        hbt = bt;
        hqsl = qsl;
        hsl = sl;
    }
    memset(a, 0, sizeof(*a));
    size_t es = dk_dtype_size(q.dtype);
    a->query = q.data;
    a->q_stride_token = q.strides[0];
    a->q_stride_head = q.strides[1];
    a->q_stride_dim = q.strides[2];
    a->key_cache = c.data;
    a->value_cache = dense_kv != NULL ? dense_kv[1].data
                     : c.data == NULL
                         ? NULL
                         : (const void *)((const char *)c.data + (size_t)c.strides[0] * es);
    a->cache_stride_block = c.strides[1];
    a->cache_stride_token = c.strides[2];
    a->cache_stride_head = c.strides[3];
    a->cache_stride_dim = c.strides[4];
    a->out = o.data;
    a->o_stride_token = o.strides[0];
    a->o_stride_head = o.strides[1];
    a->o_stride_dim = o.strides[2];
    a->block_table = (const int32_t *)hbt.data;
    a->bt_stride_row = hbt.strides[0];
    a->bt_cols = hbt.shape[1];
    a->query_start_loc = (const int32_t *)hqsl.data;
    a->seq_lens = (const int32_t *)hsl.data;
    a->key_limits = mask == DK_MASK_LIMITS ? (const int32_t *)kl.data : NULL;
    a->mask = (int32_t)mask;
    a->num_rows = r;
    a->num_tokens = n;
    a->num_heads = h;
    a->num_kv_heads = c.shape[3];
    a->head_size = d;
    a->block_size = c.shape[2];
    a->num_blocks = c.shape[1];
    a->scale = (float)scale;
    a->dtype = q.dtype;
    a->dense = dense_kv == NULL ? 0 : key_block > 1 ? 2 : 1;
    if (joint) {
        /* key indices num_keys .. num_keys + joint tokens - 1 read joint_key / joint_value */
        a->key_cache2 = dense_kv[2].data;
        a->value_cache2 = dense_kv[3].data;
        a->blocks2 = c.shape[1];
        a->num_blocks = c.shape[1] + dense_kv[2].shape[0];
    }
    if (trusted && q.device_type == DK_CUDA) {
        /* Device metadata cannot be read here: launch for the bounds (tiles past a row's end
         * exit at once) and skip the host check. */
        a->max_query_len = n;
        a->max_seq_len = a->bt_cols > 0 && a->block_size > INT64_MAX / a->bt_cols
                             ? INT64_MAX
                             : a->bt_cols * a->block_size;
        a->block_table = (const int32_t *)bt.data;
        a->query_start_loc = (const int32_t *)qsl.data;
        a->seq_lens = (const int32_t *)sl.data;
        *q_out = q;
        *o_out = o;
        return 0;
    }
    int64_t maxq = 0, maxs = 0;
    for (int64_t i = 0; i < r; i++) {
        int64_t ql = (int64_t)a->query_start_loc[i + 1] - a->query_start_loc[i];
        maxq = ql > maxq ? ql : maxq;
        maxs = a->seq_lens[i] > maxs ? a->seq_lens[i] : maxs;
    }
    a->max_query_len = maxq;
    a->max_seq_len = maxs;
    /* The host check reads key limits only on CPU (on CUDA they live on the device). */
    const int32_t *kl_dev = a->key_limits;
    if (q.device_type == DK_CUDA) {
        a->key_limits = NULL;
        if (mask == DK_MASK_LIMITS) {
            a->mask = DK_MASK_CAUSAL; /* the check's rules for LIMITS and CAUSAL are the same */
        }
    }
    dk_error err = {{0}};
    dk_status s = dk_attention_check(a, &err);
    a->key_limits = kl_dev;
    a->mask = (int32_t)mask;
    if (s != DK_OK) {
        raise_status(module, s, &err);
        return -1;
    }
    if (q.device_type == DK_CUDA && a->block_size < 32 &&
        (a->block_size & (a->block_size - 1)) == 0 && (a->head_size != 64 || a->block_size < 16) &&
        dk_attention_chunk_layout(a) == 0) {
        /* blocks under 32 keys: the sm90 kernel's TMA boxes pay only when enough tiles are
         * runs of consecutive blocks (all of them for blocks under 4 / 8 keys); head 64 takes
         * 16-key blocks through cp.async whatever their order, and caches of 16-key chunks at
         * head 128 the per-chunk boxes (attention_sm90.cu): no count for those */
        a->table_runs = dk_attention_table_runs(a, 128);
    }
    /* From here on the kernels use the tensors on the query's device. */
    a->block_table = (const int32_t *)bt.data;
    a->bt_stride_row = bt.strides[0];
    a->query_start_loc = (const int32_t *)qsl.data;
    a->seq_lens = (const int32_t *)sl.data;
    *q_out = q;
    *o_out = o;
    return 0;
}

static int
run_attention(PyObject *module, PyObject *query_obj, const dk_tensor *q, const dk_attention_args *a)
{
    if (a->num_tokens == 0) {
        return 0;
    }
    if (q->device_type == DK_CUDA) {
        return run_cuda(module, query_obj, q->device_id, launch_attention, a);
    }
    dk_error err = {{0}};
    dk_status s;
    Py_BEGIN_ALLOW_THREADS s = dk_ref_attention(a, &err);
    Py_END_ALLOW_THREADS if (s != DK_OK)
    {
        raise_status(module, s, &err);
        return -1;
    }
    return 0;
}

static PyObject *
py_paged_attention(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("paged_attention", nargs, 12) != 0) {
        return NULL;
    }
    dk_attention_args a;
    dk_tensor q, o;
    if (parse_attention(module, args, "paged_attention", &a, NULL, &q, &o, NULL, 1, 0) != 0 ||
        run_attention(module, args[0], &q, &a) != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/*
 * paged_attention_lse and dense_attention allow rows with fewer keys than queries in every mask
 * mode (a context-parallel rank's share of the keys, a key-padding mask), so they run
 * parse_attention with MASK_NONE, whose host check has no bottom-right rule, reading the real
 * mask before (short_rows_mask) and attaching it, with its key_limits checked, after
 * (short_rows_set_mask).  Both return 0, or -1 with an exception set.
 */
static int
short_rows_mask(PyObject *obj, const char *op, int64_t *mask)
{
    if (get_i64(obj, op, "mask", mask) != 0) {
        return -1;
    }
    if (*mask < DK_MASK_NONE || *mask > DK_MASK_LIMITS) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): mask must be 0 (none), 1 (causal) or 2 (limits), got %lld", op,
                     (long long)*mask);
        return -1;
    }
    return 0;
}

static int
short_rows_set_mask(PyObject *module, PyObject *key_limits, const char *op, int64_t mask,
                    const dk_tensor *q, const dk_tensor *o, dk_attention_args *a)
{
    if (mask == DK_MASK_LIMITS) {
        dk_tensor kl;
        if (dk_bridge_optional_tensor(&state_of(module)->bridge, key_limits, op, "key_limits",
                                      &kl)) {
            return -1;
        }
        if (kl.ndim < 0) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): key_limits must be a tensor when mask is 2 (limits), got None", op);
            return -1;
        }
        if (want_dtype(&kl, DK_I32, op, "key_limits") ||
            want_contiguous_1d(&kl, op, "key_limits") || same_device(q, &kl, op, "key_limits") ||
            want_min_len(&kl, a->num_tokens, op, "key_limits") ||
            no_overlap(o, "out", &kl, "key_limits", op)) {
            return -1;
        }
        a->key_limits = (const int32_t *)kl.data;
    }
    a->mask = (int32_t)mask;
    return 0;
}

/*
 * paged_attention_lse: paged_attention that also fills lse_out[t, h], the log-sum-exp of every
 * (token, head), on the CPU and on CUDA (the same kernels, which then also write the LSE).
 * Unlike paged_attention, a row's seq_len may be below its query length
 * in every mask mode: a context-parallel rank holds a share of each row's keys, so its local
 * key count is usually below the query length; a token then sees fewer keys, possibly none
 * (zeros in out, -inf in lse): see short_rows_mask.
 * args: query, kv_cache, block_table, query_start_loc, seq_lens, key_limits, mask, scale, out,
 *       lse_out, host_block_table, host_query_start_loc, host_seq_lens
 */
static PyObject *
py_paged_attention_lse(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "paged_attention_lse";
    /* The tensor arguments lse_out must not share bytes with (it is written last of all, but
     * a failed call must leave every input as it was and a finished one must not have
     * rewritten an input that is read during the call). */
    static const int inputs[] = {0, 1, 2, 3, 4, 5, 8, 10, 11, 12};
    static const char *input_names[] = {
        "query",      "kv_cache", "block_table",      "query_start_loc",      "seq_lens",
        "key_limits", "out",      "host_block_table", "host_query_start_loc", "host_seq_lens"};
    if (check_nargs(op, nargs, 13) != 0) {
        return NULL;
    }
    int64_t mask = 0;
    if (short_rows_mask(args[6], op, &mask) != 0) {
        return NULL;
    }
    PyObject *none_mask = PyLong_FromLong(DK_MASK_NONE);
    if (none_mask == NULL) {
        return NULL;
    }
    PyObject *attn_args[12] = {args[0],   args[1], args[2], args[3],  args[4],  args[5],
                               none_mask, args[7], args[8], args[10], args[11], args[12]};
    PyObject *result = NULL;
    dk_attention_args a;
    dk_tensor q, o, lse, in;
    if (parse_attention(module, attn_args, op, &a, NULL, &q, &o, NULL, 1, 0) != 0 ||
        short_rows_set_mask(module, args[5], op, mask, &q, &o, &a) != 0) {
        goto done;
    }
    if (tensor_arg(module, args[9], op, "lse_out", &lse) != 0 ||
        want_dtype(&lse, DK_F32, op, "lse_out") || want_ndim(&lse, 2, op, "lse_out") ||
        same_device(&q, &lse, op, "lse_out")) {
        goto done;
    }
    if (lse.shape[0] != a.num_tokens || lse.shape[1] != a.num_heads) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): lse_out must have shape [%lld, %lld], got [%lld, %lld]", op,
                     (long long)a.num_tokens, (long long)a.num_heads, (long long)lse.shape[0],
                     (long long)lse.shape[1]);
        goto done;
    }
    for (size_t i = 0; i < sizeof(inputs) / sizeof(inputs[0]); i++) {
        if (inputs[i] == 5 && mask != DK_MASK_LIMITS) {
            continue; /* key_limits is not read in this mode */
        }
        if (dk_bridge_optional_tensor(&state_of(module)->bridge, args[inputs[i]], op,
                                      input_names[i], &in) ||
            no_overlap(&lse, "lse_out", &in, input_names[i], op)) {
            goto done;
        }
    }
    a.lse = (float *)lse.data;
    a.lse_stride_token = lse.strides[0];
    a.lse_stride_head = lse.strides[1];
    if (run_attention(module, args[0], &q, &a) != 0) {
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(none_mask);
    return result;
}

/*
 * dense_attention: attention over keys and values held in two plain tensors
 * key/value [num_keys, num_kv_heads, head_size] (one stride set), addressed per row through
 * key_index [num_rows, cols] int32: key j of row r is key token key_index[r, j] (a block table
 * over blocks of one token).  Serves DiffKVAttentionImpl.forward: dense, key-padded and
 * packed varlen batches all become rows of key indices, so the paged kernels run them with
 * no copy of K or V.  A row may have fewer keys than queries in every mask mode (a key-padding
 * mask leaves fewer keys; a token that sees none gets zeros): see short_rows_mask.
 * args: query, key, value, key_index, query_start_loc, seq_lens, key_limits, mask, scale, out,
 *       host_key_index, host_query_start_loc, host_seq_lens, max_query_len
 * max_query_len (> 0) sizes the launch when the host copies are None (CUDA, trusted metadata:
 * the caller vouches that no row has more queries); 0 = up to every query token, as in
 * paged_attention.  With host copies it is ignored (the checked copies give the exact max).
 * Then joint_key, joint_value, key_block (blocks of that many consecutive key tokens) and
 * consecutive, bits the caller vouches for (the kernels' TMA producers rely on them): 1 every
 * row's keys are runs of consecutive rows whose 128-key tiles each lie in one source; 2 every
 * 16 keys of a row (0-15, 16-31, ..) are 16 consecutive rows of one source starting at a
 * multiple of 8 (the row's last 16 may run past its keys).
 */
/*
 * dense_attention's optional second K/V source: args[0] = joint_key, args[1] = joint_value
 * (both tensors or both None) into kv[2], kv[3] (ndim -1 when None): [num_joint, num_kv_heads,
 * head_size] with the key's dtype, device, trailing shape and strides (the kernels address
 * both sources with one stride set), at most INT32_MAX keys in all.  0, or -1 with an
 * exception set.
 */
static int
joint_kv(PyObject *module, PyObject *const *args, const char *op, dk_tensor *kv)
{
    static const char *names[2] = {"joint_key", "joint_value"};
    if ((args[0] == Py_None) != (args[1] == Py_None)) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): joint_key and joint_value must both be tensors or "
                     "both be None",
                     op);
        return -1;
    }
    if (args[0] == Py_None) {
        kv[2].ndim = -1;
        kv[3].ndim = -1;
        return 0;
    }
    for (int i = 0; i < 2; i++) {
        dk_tensor *t = &kv[2 + i];
        if (tensor_arg(module, args[i], op, names[i], t) != 0 ||
            want_dtype(t, kv[0].dtype, op, names[i]) || want_ndim(t, 3, op, names[i]) ||
            same_device(&kv[0], t, op, names[i])) {
            return -1;
        }
        int ok = t->shape[0] == kv[2].shape[0];
        for (int d = 1; d < 3; d++) {
            ok = ok && t->shape[d] == kv[0].shape[d] &&
                 (t->shape[d] <= 1 || t->strides[d] == kv[0].strides[d]);
        }
        ok = ok && (t->shape[0] <= 1 || t->strides[0] == kv[0].strides[0]);
        if (!ok) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): %s must have shape [num_joint, %lld, %lld] (joint_value: "
                         "joint_key's) and the key's strides [%lld, %lld, %lld], got shape [%lld, "
                         "%lld, %lld] strides [%lld, %lld, %lld]",
                         op, names[i], (long long)kv[0].shape[1], (long long)kv[0].shape[2],
                         (long long)kv[0].strides[0], (long long)kv[0].strides[1],
                         (long long)kv[0].strides[2], (long long)t->shape[0],
                         (long long)t->shape[1], (long long)t->shape[2], (long long)t->strides[0],
                         (long long)t->strides[1], (long long)t->strides[2]);
            return -1;
        }
    }
    if (kv[2].shape[0] > INT32_MAX - kv[0].shape[0]) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): key and joint_key must have at most %d tokens together, got %lld", op,
                     INT32_MAX, (long long)(kv[0].shape[0] + kv[2].shape[0]));
        return -1;
    }
    return 0;
}

static PyObject *
py_dense_attention(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "dense_attention";
    if (check_nargs(op, nargs, 18) != 0) {
        return NULL;
    }
    int64_t max_query_len = 0, key_block = 0, consecutive = 0;
    if (get_i64(args[13], op, "max_query_len", &max_query_len) != 0) {
        return NULL;
    }
    if (max_query_len < 0) {
        PyErr_Format(PyExc_ValueError, "%s(): max_query_len must be >= 0, got %lld", op,
                     (long long)max_query_len);
        return NULL;
    }
    dk_tensor kv[4], q, o;
    if (tensor_arg(module, args[1], op, "key", &kv[0]) != 0 || want_float(&kv[0], op, "key") ||
        want_ndim(&kv[0], 3, op, "key") || tensor_arg(module, args[2], op, "value", &kv[1]) != 0 ||
        want_dtype(&kv[1], kv[0].dtype, op, "value") || want_ndim(&kv[1], 3, op, "value") ||
        same_device(&kv[0], &kv[1], op, "value")) {
        return NULL;
    }
    for (int i = 0; i < 3; i++) {
        if (kv[1].shape[i] != kv[0].shape[i] ||
            (kv[0].shape[i] > 1 && kv[1].strides[i] != kv[0].strides[i])) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): value must have the key's shape and strides, got shape [%lld, "
                         "%lld, %lld] strides [%lld, %lld, %lld] for key shape [%lld, %lld, %lld] "
                         "strides [%lld, %lld, %lld]",
                         op, (long long)kv[1].shape[0], (long long)kv[1].shape[1],
                         (long long)kv[1].shape[2], (long long)kv[1].strides[0],
                         (long long)kv[1].strides[1], (long long)kv[1].strides[2],
                         (long long)kv[0].shape[0], (long long)kv[0].shape[1],
                         (long long)kv[0].shape[2], (long long)kv[0].strides[0],
                         (long long)kv[0].strides[1], (long long)kv[0].strides[2]);
            return NULL;
        }
    }
    if (kv[0].shape[0] > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s(): key must have at most %d tokens, got %lld", op,
                     INT32_MAX, (long long)kv[0].shape[0]);
        return NULL;
    }
    if (joint_kv(module, args + 14, op, kv) != 0 ||
        get_i64(args[16], op, "key_block", &key_block)) {
        return NULL;
    }
    if (key_block < 1 || (kv[0].shape[0] % key_block) != 0 || (key_block > 1 && kv[2].ndim == 3)) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): key_block must be >= 1 and divide the %lld key tokens (1 with "
                     "joint_key), got %lld",
                     op, (long long)kv[0].shape[0], (long long)key_block);
        return NULL;
    }
    if (get_i64(args[17], op, "consecutive", &consecutive) != 0) {
        return NULL;
    }
    if (consecutive < 0 || consecutive > 3) {
        PyErr_Format(PyExc_ValueError, "%s(): consecutive must be 0 to 3 (bits 1 and 2), got %lld",
                     op, (long long)consecutive);
        return NULL;
    }
    int64_t mask = 0;
    if (short_rows_mask(args[7], op, &mask) != 0) {
        return NULL;
    }
    /* parse_attention's argument order (kv_cache slot unused), mask replaced by MASK_NONE */
    PyObject *none_mask = PyLong_FromLong(DK_MASK_NONE);
    if (none_mask == NULL) {
        return NULL;
    }
    PyObject *attn_args[12] = {args[0],   Py_None, args[3], args[4],  args[5],  args[6],
                               none_mask, args[8], args[9], args[10], args[11], args[12]};
    dk_attention_args a;
    int rc = parse_attention(module, attn_args, op, &a, NULL, &q, &o, kv, key_block, 0);
    Py_DECREF(none_mask);
    if (rc != 0) {
        return NULL;
    }
    if (consecutive & 1) {
        a.table_runs = 1000; /* the caller vouches: every tile is one run */
        a.keys_consecutive = a.key_cache2 == NULL;
    }
    a.keys_consecutive |= (int32_t)(consecutive & 2); /* and 16-key chunks */
    if (no_overlap(&o, "out", &kv[0], "key", op) || no_overlap(&o, "out", &kv[1], "value", op) ||
        short_rows_set_mask(module, args[6], op, mask, &q, &o, &a) != 0) {
        return NULL;
    }
    if (q.device_type == DK_CUDA && args[10] == Py_None && max_query_len > 0 &&
        max_query_len < a.max_query_len) {
        a.max_query_len = max_query_len;
    }
    if (run_attention(module, args[0], &q, &a) != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* forward_paged's work (args as there); out_flat: out may be [N, H * D] (parse_attention). */
static PyObject *
forward_paged_impl(PyObject *module, PyObject *const *args, int out_flat)
{
    static const char *op = "forward_paged";
    /* args: query, key, value, kv_cache, slot_mapping, block_table, query_start_loc, seq_lens,
     *       key_limits, mask, scale, out, host_block_table, host_query_start_loc, host_seq_lens */
    PyObject *kv_args[4] = {args[1], args[2], args[3], args[4]};
    PyObject *attn_args[12] = {args[0], args[3],  args[5],  args[6],  args[7],  args[8],
                               args[9], args[10], args[11], args[12], args[13], args[14]};
    dk_kv_write_args w;
    dk_attention_args a;
    dk_tensor kv[4], q, o;
    const dk_tensor *k = &kv[0];
    if (parse_kv_write(module, kv_args, op, &w, kv) != 0 ||
        parse_attention(module, attn_args, op, &a, &kv[2], &q, &o, NULL, 1, out_flat) != 0) {
        return NULL;
    }
    if (no_overlap(&o, "out", &kv[0], "key", op) || no_overlap(&o, "out", &kv[1], "value", op) ||
        no_overlap(&o, "out", &kv[3], "slot_mapping", op)) {
        return NULL;
    }
    if (k->device_type != q.device_type || k->device_id != q.device_id) {
        PyErr_Format(PyExc_TypeError, "%s(): key must be on the query's device", op);
        return NULL;
    }
    if (w.num_kv_heads != a.num_kv_heads || w.head_size != a.head_size) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): key must have [%lld, %lld] heads x head_size, got "
                     "[%lld, %lld]",
                     op, (long long)a.num_kv_heads, (long long)a.head_size,
                     (long long)w.num_kv_heads, (long long)w.head_size);
        return NULL;
    }
    if (w.num_tokens != a.num_tokens) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): key must have one token per query token (%lld), got "
                     "%lld",
                     op, (long long)a.num_tokens, (long long)w.num_tokens);
        return NULL;
    }
    if (q.device_type == DK_CPU && a.num_tokens > 0) {
        /* The reference's own dtype and head_size limits, before the write changes the cache:
         * with no rows it checks them and touches nothing. */
        dk_attention_args dry = a;
        dk_error err = {{0}};
        dry.num_rows = 0;
        dk_status s = dk_ref_attention(&dry, &err);
        if (s != DK_OK) {
            return raise_status(module, s, &err);
        }
    }
    if (q.device_type == DK_CUDA) {
        /* one submission for both kernels (dk_cuda_layer), on the query's stream as before */
        const layer_launch l = {&w, &a};
        if (run_cuda(module, args[0], q.device_id, launch_layer, &l) != 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    if (run_kv_write(module, args[1], k, &w) != 0 || run_attention(module, args[0], &q, &a) != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
py_forward_paged(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("forward_paged", nargs, 15) != 0) {
        return NULL;
    }
    return forward_paged_impl(module, args, 0);
}

static int
parse_rows(PyObject *module, PyObject *const *args, const char *op, dk_rows_args *a,
           dk_tensor *src_out, int scatter)
{
    dk_tensor s, ix, d;
    if (tensor_arg(module, args[0], op, "src", &s) != 0 || want_float(&s, op, "src") ||
        want_ndim(&s, 3, op, "src") || tensor_arg(module, args[1], op, "index", &ix) != 0 ||
        want_dtype(&ix, DK_I64, op, "index") || want_contiguous_1d(&ix, op, "index") ||
        same_device(&s, &ix, op, "index") || tensor_arg(module, args[2], op, "dst", &d) != 0 ||
        want_dtype(&d, s.dtype, op, "dst") || want_ndim(&d, 3, op, "dst") ||
        same_device(&s, &d, op, "dst")) {
        return -1;
    }
    if (d.shape[1] != s.shape[1] || d.shape[2] != s.shape[2]) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): dst must have [%lld, %lld] trailing dims, got [%lld, %lld]", op,
                     (long long)s.shape[1], (long long)s.shape[2], (long long)d.shape[1],
                     (long long)d.shape[2]);
        return -1;
    }
    int64_t need = scatter ? s.shape[0] : d.shape[0];
    if (ix.shape[0] != need) {
        PyErr_Format(PyExc_ValueError, "%s(): index must have %lld entries, got %lld", op,
                     (long long)need, (long long)ix.shape[0]);
        return -1;
    }
    if (no_overlap(&d, "dst", &s, "src", op) || no_overlap(&d, "dst", &ix, "index", op)) {
        return -1;
    }
    memset(a, 0, sizeof(*a));
    a->src = s.data;
    a->src_stride_token = s.strides[0];
    a->src_stride_head = s.strides[1];
    a->src_stride_dim = s.strides[2];
    a->dst = d.data;
    a->dst_stride_token = d.strides[0];
    a->dst_stride_head = d.strides[1];
    a->dst_stride_dim = d.strides[2];
    a->index = (const int64_t *)ix.data;
    a->num_index = ix.shape[0];
    a->src_tokens = s.shape[0];
    a->dst_tokens = d.shape[0];
    a->num_heads = s.shape[1];
    a->head_size = s.shape[2];
    a->dtype = s.dtype;
    *src_out = s;
    return 0;
}

static PyObject *
rows_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int scatter)
{
    const char *op = scatter ? "rows_scatter" : "rows_gather";
    if (check_nargs(op, nargs, 3) != 0) {
        return NULL;
    }
    dk_rows_args a;
    dk_tensor s;
    if (parse_rows(module, args, op, &a, &s, scatter) != 0) {
        return NULL;
    }
    if (s.device_type == DK_CUDA) {
        if (run_cuda(module, args[0], s.device_id,
                     scatter ? launch_rows_scatter : launch_rows_gather, &a) != 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    dk_error err = {{0}};
    dk_status st;
    Py_BEGIN_ALLOW_THREADS st =
        scatter ? dk_ref_rows_scatter(&a, &err) : dk_ref_rows_gather(&a, &err);
    Py_END_ALLOW_THREADS if (st != DK_OK)
    {
        return raise_status(module, st, &err);
    }
    Py_RETURN_NONE;
}

static PyObject *
py_rows_gather(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return rows_op(module, args, nargs, 0);
}

static PyObject *
py_rows_scatter(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return rows_op(module, args, nargs, 1);
}

/* ------------------------------------------------------------------------------------------ */
/* Per-call objects                                                                            */
/* ------------------------------------------------------------------------------------------ */

/* *slot = module.name, looked up on the first call and kept (a new reference owned by the
 * module state): 0, or -1 with the import's or getattr's error.  The import may release the
 * GIL, so another thread may have set *slot meanwhile: the first one stays. */
static int
cached_attr(PyObject **slot, const char *module, const char *name)
{
    if (*slot != NULL) {
        return 0;
    }
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL) {
        return -1;
    }
    PyObject *v = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    if (v == NULL) {
        return -1;
    }
    if (*slot == NULL) {
        *slot = v;
    }
    else {
        Py_DECREF(v);
    }
    return 0;
}

/* ctx's attribute `name` as a new reference; *plain = 0 (and no error) when it is missing
 * (AttributeError) or None -- getattr(ctx, name, None) is None in Python; NULL with the error set
 * for anything else getattr raised. */
static PyObject *
ctx_required(PyObject *obj, PyObject *name, int *plain)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            *plain = 0;
        }
        return NULL;
    }
    if (v == Py_None) {
        Py_DECREF(v);
        *plain = 0;
        return NULL;
    }
    return v;
}

/* An int attribute of obj into *v: 1, or 0 when it is not an int (no error), -1 on error. */
static int
ctx_int(PyObject *obj, PyObject *name, long long *v)
{
    PyObject *x = PyObject_GetAttr(obj, name);
    if (x == NULL) {
        return -1;
    }
    int ok = PyLong_Check(x);
    if (ok) {
        *v = PyLong_AsLongLong(x);
        if (*v == -1 && PyErr_Occurred()) {
            PyErr_Clear(); /* beyond int64: not the identity case */
            ok = 0;
        }
    }
    Py_DECREF(x);
    return ok;
}

/* What DiffusionPagedAttentionContext.restore_output does to the attention output. */
enum {
    OUT_RESTORE = 0,  /* something else: call the method */
    OUT_IDENTITY = 1, /* out [N, H, Dv] itself (the caller's query was [N, H, D]) */
    OUT_FLAT = 2      /* out.reshape(N, H * Dv) (the caller's query was [N, H * D]): allocated
                         that way, the kernels write its [N, H, Dv] view, nothing to restore */
};

/*
 * Which OUT_* restore_output(out) amounts to for this context, from the context (no scatter,
 * query_token_shape a 1-tuple (N,), query_has_head_dims) and the query q the output will be
 * like ([N, H, Dv] with H = num_heads, Dv = head_size_v) -- decided before the output is
 * allocated; *flat_shape receives (N, H * Dv).  -1 with an error set where reading an
 * attribute raised.
 */
static int
output_kind(PyObject *module, PyObject *ctx, PyObject *layer, PyObject *q_obj,
            long long flat_shape[2])
{
    PyObject *const *nm = state_of(module)->ctx_names;
    PyObject *x = PyObject_GetAttr(ctx, nm[CTX_OUTPUT_SCATTER_INDICES]);
    if (x == NULL) {
        return -1;
    }
    int none = x == Py_None;
    Py_DECREF(x);
    if (!none) {
        return OUT_RESTORE;
    }
    if ((x = PyObject_GetAttr(ctx, nm[CTX_QUERY_HAS_HEAD_DIMS])) == NULL) {
        return -1;
    }
    int heads = PyObject_IsTrue(x);
    Py_DECREF(x);
    if (heads < 0) {
        return -1;
    }
    if ((x = PyObject_GetAttr(ctx, nm[CTX_QUERY_TOKEN_SHAPE])) == NULL) {
        return -1;
    }
    long long n = -1;
    if (PyTuple_Check(x) && PyTuple_Size(x) == 1 && PyLong_Check(PyTuple_GetItem(x, 0))) {
        n = PyLong_AsLongLong(PyTuple_GetItem(x, 0));
        if (n == -1 && PyErr_Occurred()) {
            PyErr_Clear();
        }
    }
    Py_DECREF(x);
    if (n < 0) {
        return OUT_RESTORE;
    }
    long long h = -1, dv = -1;
    int rc = ctx_int(layer, nm[CTX_NUM_HEADS], &h);
    if (rc > 0) {
        rc = ctx_int(layer, nm[CTX_HEAD_SIZE_V], &dv);
    }
    if (rc <= 0) {
        return rc < 0 ? -1 : OUT_RESTORE;
    }
    dk_tensor q;
    if (dk_bridge_tensor_layout(&state_of(module)->bridge, q_obj, "forward_context", "query", &q) !=
        0) {
        PyErr_Clear(); /* not a tensor: forward_paged reports it in its own words */
        return OUT_RESTORE;
    }
    if (q.ndim != 3 || q.shape[0] != n || q.shape[1] != h || q.shape[2] != dv) {
        return OUT_RESTORE;
    }
    flat_shape[0] = n;
    flat_shape[1] = h * dv;
    return heads ? OUT_IDENTITY : OUT_FLAT;
}

/*
 * forward_context(ctx): DiffKVAttentionImpl.forward_paged of a per-call context
 * (adapter.prepare_layer_context) in one call, for eager execution -- what
 * backends.diffkv.run_forward_paged does in Python (the context's mask, the output from
 * torch.empty_like(query), forward_paged with the batch's host tables, ctx.restore_output), with
 * the same attribute reads in the same order and the same errors, minus the interpreter's ~1 us
 * (~3 us on the H200 hosts) per layer call.  Returns None, having read only ctx.layer and its
 * kv_cache and impl and done nothing, when one of those is missing or None: the Python path then
 * raises the contract's errors.
 */
static PyObject *
py_forward_context(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *op = "forward_context";
    if (check_nargs(op, nargs, 1) != 0) {
        return NULL;
    }
    module_state *st = state_of(module);
    PyObject *const *nm = st->ctx_names;
    if (cached_attr(&st->empty_like, "torch", "empty_like") != 0) { /* no libtorch link */
        return NULL;
    }
    PyObject *ctx = args[0];
    /* owned references, released at the end */
    PyObject *layer = NULL, *kv_cache = NULL, *impl = NULL, *meta = NULL, *plan = NULL;
    PyObject *key_limits = NULL, *mask = NULL, *scale = NULL, *out = NULL, *result = NULL;
    PyObject *t[7] = {NULL}; /* query, key_write, value_write, slot_mapping, block_table,
                                query_start_loc, seq_lens */
    PyObject *host[3] = {NULL, NULL, NULL};
    int plain = 1;
    layer = ctx_required(ctx, nm[CTX_LAYER], &plain);
    if (layer != NULL) {
        kv_cache = ctx_required(layer, nm[CTX_KV_CACHE], &plain);
    }
    if (kv_cache != NULL) {
        impl = ctx_required(layer, nm[CTX_IMPL], &plain);
    }
    if (impl == NULL) {
        if (!plain) {
            result = Py_NewRef(Py_None); /* not the plain kind: the Python path decides */
        }
        goto done;
    }
    if ((meta = PyObject_GetAttr(ctx, nm[CTX_NATIVE_METADATA])) == NULL ||
        (plan = PyObject_GetAttr(ctx, nm[CTX_PIECEWISE_PLAN])) == NULL) {
        goto done;
    }
    if (plan != Py_None) { /* ops.context_mask */
        mask = PyLong_FromLong(DK_MASK_LIMITS);
        key_limits = PyObject_GetAttr(plan, nm[CTX_KEY_LIMITS]);
    }
    else {
        PyObject *causal = PyObject_GetAttr(meta, nm[CTX_CAUSAL]);
        int c = causal == NULL ? -1 : PyObject_IsTrue(causal);
        Py_XDECREF(causal);
        if (c >= 0) {
            mask = PyLong_FromLong(c ? DK_MASK_CAUSAL : DK_MASK_NONE);
            key_limits = Py_NewRef(Py_None);
        }
    }
    if (mask == NULL || key_limits == NULL) {
        goto done;
    }
    static const int ctx_field[4] = {CTX_QUERY, CTX_KEY_WRITE, CTX_VALUE_WRITE, CTX_SLOT_MAPPING};
    static const int meta_field[3] = {CTX_BLOCK_TABLE, CTX_QUERY_START_LOC, CTX_SEQ_LENS};
    for (int i = 0; i < 4; i++) {
        if ((t[i] = PyObject_GetAttr(ctx, nm[ctx_field[i]])) == NULL) {
            goto done;
        }
    }
    for (int i = 0; i < 3; i++) {
        if ((t[4 + i] = PyObject_GetAttr(meta, nm[meta_field[i]])) == NULL) {
            goto done;
        }
    }
    PyObject *raw_scale = PyObject_GetAttr(layer, nm[CTX_SOFTMAX_SCALE]);
    if (raw_scale == NULL) {
        goto done;
    }
    scale = PyNumber_Float(raw_scale);
    Py_DECREF(raw_scale);
    if (scale == NULL ||
        cached_attr(&st->context_type, "diffkv.adapter", "DiffusionPagedAttentionContext") != 0) {
        goto done;
    }
    /* ctx.restore_output(out): for diffkv's own context without scattered rows, out itself
     * ([N, H, D] queries) or out.reshape(N, H * Dv) ([N, H * D] queries) -- then out is
     * allocated [N, H * Dv] and the kernels write its [N, H, Dv] view: a Python method call and
     * a view less (~2.5 us on the H200 hosts) */
    long long flat_shape[2] = {0, 0};
    const int kind = (PyObject *)Py_TYPE(ctx) == st->context_type
                         ? output_kind(module, ctx, layer, t[0], flat_shape)
                         : OUT_RESTORE;
    if (kind < 0) {
        goto done;
    }
    if (kind == OUT_FLAT) {
        PyObject *size = Py_BuildValue("(LL)", flat_shape[0], flat_shape[1]);
        if (size == NULL) {
            goto done;
        }
        out = PyObject_CallMethodObjArgs(t[0], nm[CTX_NEW_EMPTY], size, NULL);
        Py_DECREF(size);
    }
    else {
        out = PyObject_CallFunctionObjArgs(st->empty_like, t[0], NULL);
    }
    if (out == NULL) {
        goto done;
    }
    static const int host_field[3] = {CTX_BLOCK_TABLE_CPU, CTX_QUERY_START_LOC_CPU,
                                      CTX_SEQ_LENS_CPU};
    for (int i = 0; i < 3; i++) {
        if ((host[i] = PyObject_GetAttr(meta, nm[host_field[i]])) == NULL) {
            goto done;
        }
    }
    PyObject *fp_args[15] = {t[0],       t[1], t[2],  kv_cache, t[3],    t[4],    t[5],   t[6],
                             key_limits, mask, scale, out,      host[0], host[1], host[2]};
    PyObject *r = forward_paged_impl(module, fp_args, kind == OUT_FLAT);
    if (r == NULL) {
        goto done;
    }
    Py_DECREF(r);
    result = kind != OUT_RESTORE
                 ? Py_NewRef(out)
                 : PyObject_CallMethodObjArgs(ctx, nm[CTX_RESTORE_OUTPUT], out, NULL);
done:
    Py_XDECREF(layer);
    Py_XDECREF(kv_cache);
    Py_XDECREF(impl);
    Py_XDECREF(meta);
    Py_XDECREF(plan);
    Py_XDECREF(key_limits);
    Py_XDECREF(mask);
    Py_XDECREF(scale);
    Py_XDECREF(out);
    for (int i = 0; i < 7; i++) {
        Py_XDECREF(t[i]);
    }
    for (int i = 0; i < 3; i++) {
        Py_XDECREF(host[i]);
    }
    return result;
}

/*
 * new_with_slots(cls, descriptors, *values): object.__new__(cls) -- cls a Python class whose
 * instances object.__new__ creates (a heap type with object's tp_new, not abstract) -- with
 * descriptors[i] (a slot's member descriptor, or any data descriptor) set to values[i] through
 * its __set__, and no __init__.  The frozen dataclass __init__ of the per-call context does the
 * same through object.__setattr__, several times slower.  Returns a new reference, or NULL with
 * TypeError for wrong arguments, or whatever object.__new__ or a __set__ raised.
 */
static PyObject *
py_new_with_slots(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 2 || !PyTuple_Check(args[1]) || PyTuple_Size(args[1]) != nargs - 2) {
        PyErr_Format(PyExc_TypeError,
                     "new_with_slots(): arguments must be a class, a tuple of n descriptors and n "
                     "values, got %zd arguments",
                     nargs);
        return NULL;
    }
    newfunc object_new = (newfunc)PyType_GetSlot(&PyBaseObject_Type, Py_tp_new);
    if (!PyType_Check(args[0]) ||
        (PyType_GetFlags((PyTypeObject *)args[0]) &
         (Py_TPFLAGS_HEAPTYPE | Py_TPFLAGS_IS_ABSTRACT)) != Py_TPFLAGS_HEAPTYPE ||
        (newfunc)PyType_GetSlot((PyTypeObject *)args[0], Py_tp_new) != object_new) {
        PyErr_Format(PyExc_TypeError,
                     "new_with_slots(): cls must be a Python class that object.__new__ creates, "
                     "got %R",
                     args[0]);
        return NULL;
    }
    PyObject *no_args = PyTuple_New(0);
    if (no_args == NULL) {
        return NULL;
    }
    PyObject *obj = object_new((PyTypeObject *)args[0], no_args, NULL);
    Py_DECREF(no_args);
    if (obj == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs - 2; i++) {
        PyObject *descr = PyTuple_GetItem(args[1], i);
        descrsetfunc set = (descrsetfunc)PyType_GetSlot(Py_TYPE(descr), Py_tp_descr_set);
        if (set == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "new_with_slots(): descriptors[%zd] must be a data descriptor, got %R", i,
                         descr);
            Py_DECREF(obj);
            return NULL;
        }
        if (set(descr, obj, args[i + 2]) != 0) {
            Py_DECREF(obj);
            return NULL;
        }
    }
    return obj;
}

/* ------------------------------------------------------------------------------------------ */
/* Module definition                                                                           */
/* ------------------------------------------------------------------------------------------ */

#define FAST(name, doc)                                                                            \
    {                                                                                              \
#name, (PyCFunction)(void (*)(void))py_##name, METH_FASTCALL, doc                          \
    }

static PyMethodDef module_methods[] = {
    FAST(configure, "configure(to_dlpack, raw_stream_getter): the DLPack fallback path."),
    FAST(set_bridge_path, "set_bridge_path('auto' | 'capsule')."),
    FAST(bridge_path, "bridge_path(tensor) -> 'exchange' | 'capsule'."),
    FAST(tensor_info, "tensor_info(tensor) -> dict of what C sees."),
    FAST(bridge_noop4, "bridge_noop4(a, b, c, d): reads four tensors (benchmark)."),
    FAST(cuda_compiled, "cuda_compiled() -> bool."),
    FAST(build_info, "build_info() -> dict."),
    FAST(last_attention_kernel,
         "last_attention_kernel() -> str: the kernel the last CUDA attention call launched."),
    FAST(set_attention_kernel,
         "set_attention_kernel('auto' | 'sm90' | 'sm80') -> the previous choice: the tensor-core "
         "attention kernels CUDA calls may take, for this process (overrides "
         "DIFFKV_ATTENTION_KERNEL)."),
    FAST(check_row, "Row rules R1..R8."),
    FAST(check_metadata, "Metadata rules M1, M2."),
    FAST(check_step, "rows_for_step rule M3."),
    FAST(check_layer_heads, "Layer rules L1..L3; returns rank-local heads."),
    FAST(check_head_sizes, "Layer rule L5."),
    FAST(check_layer_qkv, "prepare_layer_context rules C4..C14; returns (token shape, has head "
                          "dims, layout flags)."),
    FAST(check_batch_rows, "prepare_batch rules P1..P4."),
    FAST(check_batch_bindings, "prepare_batch rules P5..P11; returns num_tokens."),
    FAST(build_batch, "Fills row_indices, query_start_loc, seq_lens, positions (CPU)."),
    FAST(dcp_local_seq_lens, "Context-parallel local sequence lengths (CPU)."),
    FAST(table_append, "BlockTables.append_block_ids on a host table."),
    FAST(gather_block_tables, "BlockTables.gather_block_tables on host tables."),
    FAST(compute_slot_mappings, "Slot mapping (CPU or CUDA)."),
    FAST(pool_init, "BlockPool state init."),
    FAST(pool_allocate, "BlockPool.allocate."),
    FAST(pool_free, "BlockPool.free."),
    FAST(build_plan, "Piecewise plan (the seed's build_paged_piecewise_plan)."),
    FAST(kv_write, "KV cache write (CPU or CUDA)."),
    FAST(paged_attention, "Paged attention (CPU or CUDA)."),
    FAST(paged_attention_lse, "Paged attention + log-sum-exp per (token, head)."),
    FAST(dense_attention, "Attention over key/value tensors addressed per row by key indices."),
    FAST(forward_paged, "KV write + paged attention in one call."),
    FAST(rows_gather, "dst[n] = src[index[n]]."),
    FAST(rows_scatter, "dst[index[n]] = src[n]; other rows zeroed."),
    FAST(new_with_slots, "new_with_slots(cls, descriptors, *values): cls's instance, no __init__."),
    FAST(forward_context, "forward_context(ctx): a per-call context's forward_paged in one call "
                          "(None when ctx is not the plain kind)."),
    {NULL, NULL, 0, NULL},
};

static int
module_exec(PyObject *module)
{
    module_state *st = state_of(module);
    memset(&st->bridge, 0, sizeof(st->bridge));
    st->cuda_error = PyErr_NewExceptionWithDoc(
        "diffkv.CudaError",
        "A CUDA runtime failure inside diffkv; the message names the operation.",
        PyExc_RuntimeError, NULL);
    if (st->cuda_error == NULL || PyModule_AddObjectRef(module, "CudaError", st->cuda_error) < 0) {
        return -1;
    }
    for (int i = 0; i < CTX_NAMES; i++) {
        if ((st->ctx_names[i] = PyUnicode_InternFromString(ctx_name_text[i])) == NULL) {
            return -1;
        }
    }
    if (PyModule_AddIntConstant(module, "DTYPE_FLOAT32", DK_F32) < 0 ||
        PyModule_AddIntConstant(module, "DTYPE_FLOAT16", DK_F16) < 0 ||
        PyModule_AddIntConstant(module, "DTYPE_BFLOAT16", DK_BF16) < 0 ||
        PyModule_AddIntConstant(module, "DTYPE_FLOAT64", DK_F64) < 0 ||
        PyModule_AddIntConstant(module, "MASK_NONE", DK_MASK_NONE) < 0 ||
        PyModule_AddIntConstant(module, "MASK_CAUSAL", DK_MASK_CAUSAL) < 0 ||
        PyModule_AddIntConstant(module, "MASK_LIMITS", DK_MASK_LIMITS) < 0) {
        return -1;
    }
    return 0;
}

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    module_state *st = state_of(module);
    if (st == NULL) {
        return 0;
    }
    Py_VISIT(st->cuda_error);
    Py_VISIT(st->empty_like);
    Py_VISIT(st->context_type);
    Py_VISIT(st->bridge.to_dlpack);
    Py_VISIT(st->bridge.stream_getter);
    for (int i = 0; i < st->bridge.num_types; i++) {
        Py_VISIT(st->bridge.types[i]);
    }
    return 0;
}

static int
module_clear(PyObject *module)
{
    module_state *st = state_of(module);
    if (st == NULL) {
        return 0;
    }
    Py_CLEAR(st->cuda_error);
    Py_CLEAR(st->empty_like);
    Py_CLEAR(st->context_type);
    for (int i = 0; i < CTX_NAMES; i++) {
        Py_CLEAR(st->ctx_names[i]);
    }
    dk_bridge_clear(&st->bridge);
    return 0;
}

static void
module_free(void *module)
{
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, (void *)module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "diffkv._C",
    .m_doc = "diffkv's C core: DLPack tensor bridge, the seed's validation rules, batch "
             "preparation, piecewise plans, KV write and paged attention (CPU reference and CUDA).",
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__C(void)
{
    return PyModuleDef_Init(&module_def);
}
