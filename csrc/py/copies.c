/*
 * copies.c -- the KV cache write and row gather/scatter.
 *
 * Entry points: kv_write (key/value into the cache at each token's slot), rows_gather,
 * rows_scatter (the padded-row layout's moves).  dkpy_parse_kv_write and dkpy_run_kv_write are
 * shared with the layer call (layer.c).
 */
#include "binding.h"

#include <math.h>

#include <stdlib.h>
#include <string.h>

static dk_status
launch_kv_write(const void *a, void *stream, dk_error *err)
{
    return dk_cuda_kv_write((const dk_kv_write_args *)a, stream, err);
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

/* Reads key/value/kv_cache/slot_mapping into a kv-write argument block; views[0..3] receive
 * the four tensors' views. */
int
dkpy_parse_kv_write(PyObject *module, PyObject *const *args, const char *op, dk_kv_write_args *a,
                    dk_tensor *views)
{
    dk_tensor k, v, c, sm;
    if (dkpy_tensor(module, args[0], op, &(dkpy_want){.arg = "key", .dtype = DKPY_FLOAT, .ndim = 3},
                    &k) ||
        dkpy_tensor(module, args[1], op,
                    &(dkpy_want){.arg = "value", .dtype = k.dtype, .ndim = 3, .device = &k}, &v) ||
        dkpy_tensor(
            module, args[2], op,
            &(dkpy_want){.arg = "kv_cache", .dtype = DKPY_ANY_DTYPE, .ndim = 5, .device = &k},
            &c) ||
        dkpy_tensor(module, args[3], op,
                    &(dkpy_want){.arg = "slot_mapping", .dtype = DK_I64, .ndim = 1, .device = &k},
                    &sm)) {
        return -1;
    }
    if (c.dtype != k.dtype && c.dtype != DK_F8E4M3) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): kv_cache must be %s (the key's dtype) or float8_e4m3fn, got %s", op,
                     dk_dtype_name(k.dtype), dk_dtype_name(c.dtype));
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
    if (dkpy_want_min_len(&sm, k.shape[0], op, "slot_mapping") != 0 ||
        dkpy_no_overlap(&c, "kv_cache", &k, "key", op) ||
        dkpy_no_overlap(&c, "kv_cache", &v, "value", op) ||
        dkpy_no_overlap(&c, "kv_cache", &sm, "slot_mapping", op)) {
        return -1;
    }
    size_t es = dk_dtype_size(c.dtype); /* the cache's element */
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
    a->cache_dtype = c.dtype;
    views[0] = k;
    views[1] = v;
    views[2] = c;
    views[3] = sm;
    return 0;
}

int
dkpy_parse_scales(PyObject *module, PyObject *k_obj, PyObject *v_obj, const char *op, int fp8,
                  int64_t num_kv_heads, const dk_tensor *device, const dk_tensor *cache,
                  dk_tensor *scales, const float **k_scale, const float **v_scale, int64_t *stride)
{
    if (!fp8) {
        if (k_obj != Py_None || v_obj != Py_None) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): k_scale and v_scale apply to a float8_e4m3fn kv_cache only; "
                         "kv_cache is %s",
                         op, dk_dtype_name(cache->dtype));
            return -1;
        }
        return 0;
    }
    if (k_obj == Py_None || v_obj == Py_None) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): a float8_e4m3fn kv_cache needs k_scale and v_scale (float32 tensors of "
                     "1 or num_kv_heads = %lld entries), got %s",
                     op, (long long)num_kv_heads,
                     k_obj == Py_None && v_obj == Py_None ? "neither"
                     : k_obj == Py_None                   ? "no k_scale"
                                                          : "no v_scale");
        return -1;
    }
    if (dkpy_tensor(
            module, k_obj, op,
            &(dkpy_want){.arg = "k_scale", .dtype = DK_F32, .ndim = DKPY_VECTOR, .device = device},
            &scales[0]) ||
        dkpy_tensor(
            module, v_obj, op,
            &(dkpy_want){.arg = "v_scale", .dtype = DK_F32, .ndim = DKPY_VECTOR, .device = device},
            &scales[1])) {
        return -1;
    }
    for (int i = 0; i < 2; i++) {
        int64_t n = scales[i].shape[0];
        if (n != 1 && n != num_kv_heads) {
            PyErr_Format(PyExc_ValueError,
                         "%s(): %s must have 1 (per tensor) or num_kv_heads = %lld (per KV head) "
                         "entries, got %lld",
                         op, i == 0 ? "k_scale" : "v_scale", (long long)num_kv_heads, (long long)n);
            return -1;
        }
    }
    if (dkpy_no_overlap(cache, "kv_cache", &scales[0], "k_scale", op) ||
        dkpy_no_overlap(cache, "kv_cache", &scales[1], "v_scale", op)) {
        return -1;
    }
    if (scales[0].shape[0] != scales[1].shape[0]) {
        PyErr_Format(PyExc_ValueError,
                     "%s(): k_scale and v_scale must have as many entries, got %lld and %lld", op,
                     (long long)scales[0].shape[0], (long long)scales[1].shape[0]);
        return -1;
    }
    *k_scale = (const float *)scales[0].data;
    *v_scale = (const float *)scales[1].data;
    *stride = scales[0].shape[0] == 1 ? 0 : 1;
    return 0;
}

int
dkpy_check_scale_values(const float *k_scale, const float *v_scale, int64_t n, const char *op)
{
    for (int i = 0; i < 2; i++) {
        const float *s = i == 0 ? k_scale : v_scale;
        for (int64_t h = 0; h < n; h++) {
            if (!(s[h] > 0.0f) || isinf(s[h])) {
                PyObject *value = PyFloat_FromDouble((double)s[h]);
                if (value != NULL) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s(): %s must be finite and positive, got %s[%lld] = %R", op,
                                 i == 0 ? "k_scale" : "v_scale", i == 0 ? "k_scale" : "v_scale",
                                 (long long)h, value);
                    Py_DECREF(value);
                }
                return -1;
            }
        }
    }
    return 0;
}

/*
 * Scale tensors whose device values were checked, and in which state: the tensor (a weak
 * reference: a dead entry matches nothing, so a new tensor at a recycled address is checked
 * again), its data pointer and torch's version counter (bumped by every in-place write, as
 * calculate_kv_scales's copy_ does).  A ring of DKPY_CHECKED_SCALES: a model's layers each
 * keep their own pair.  Touched with the GIL held.
 */
#define DKPY_CHECKED_SCALES 128
static struct {
    PyObject *ref;
    const float *ptr;
    long long version;
} checked_scales[DKPY_CHECKED_SCALES];
static int checked_next;

/* torch's version counter of obj, or -1 when it has none (never remembered then). */
static long long
scale_version(PyObject *obj)
{
    PyObject *v = PyObject_GetAttrString(obj, "_version");
    long long version = v != NULL && PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
    Py_XDECREF(v);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        version = -1;
    }
    return version;
}

/* Whether checked_scales holds obj (still alive) at data pointer ptr and version counter
 * version, i.e. its values were checked and not written since: 1 yes, 0 no (always 0 for a
 * version < 0).  Cannot fail; never raises. */
static int
scale_checked(PyObject *obj, const float *ptr, long long version)
{
    for (int i = 0; version >= 0 && i < DKPY_CHECKED_SCALES; i++) {
        if (checked_scales[i].ref != NULL && checked_scales[i].ptr == ptr &&
            checked_scales[i].version == version &&
            PyWeakref_GetObject(checked_scales[i].ref) == obj) {
            return 1;
        }
    }
    return 0;
}

/* Records obj (a weak reference), ptr and version in checked_scales' next ring entry, after
 * its values passed dkpy_check_scale_values, dropping the oldest entry's reference.  Nothing
 * is recorded for a version < 0 or an object that takes no weak reference (checked again
 * next time).  Cannot fail: any error is cleared. */
static void
scale_remember(PyObject *obj, const float *ptr, long long version)
{
    if (version < 0) {
        return;
    }
    PyObject *ref = PyWeakref_NewRef(obj, NULL);
    if (ref == NULL) {
        PyErr_Clear(); /* not weak-referenceable: checked again next time */
        return;
    }
    Py_XDECREF(checked_scales[checked_next].ref);
    checked_scales[checked_next].ref = ref;
    checked_scales[checked_next].ptr = ptr;
    checked_scales[checked_next].version = version;
    checked_next = (checked_next + 1) % DKPY_CHECKED_SCALES;
}

int
dkpy_check_scales(PyObject *module, PyObject *const *scale_objs, PyObject *q_obj,
                  const dk_tensor *q, const float *k_scale, const float *v_scale, int64_t n,
                  const char *op)
{
    if (q->device_type == DK_CPU) {
        return dkpy_check_scale_values(k_scale, v_scale, n, op);
    }
    const long long kv = scale_version(scale_objs[0]), vv = scale_version(scale_objs[1]);
    if (scale_checked(scale_objs[0], k_scale, kv) && scale_checked(scale_objs[1], v_scale, vv)) {
        return 0;
    }
    void *stream = NULL;
    if (dk_bridge_stream(&state_of(module)->bridge, q_obj, q->device_id, &stream) != 0) {
        return -1;
    }
    if (dk_cuda_stream_capturing(stream)) {
        return 0; /* a graph reads them at each replay: see dkpy_check_scales's contract */
    }
    float *host = (float *)malloc((size_t)(2 * n) * sizeof(float));
    if (host == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int32_t prev = 0;
    dk_error err = {{0}};
    dk_status s = dk_cuda_device_enter(q->device_id, &prev, &err);
    if (s == DK_OK) {
        s = dk_cuda_copy_to_host(host, k_scale, (size_t)n * sizeof(float), stream, &err);
        if (s == DK_OK) {
            s = dk_cuda_copy_to_host(host + n, v_scale, (size_t)n * sizeof(float), stream, &err);
        }
        dk_cuda_device_exit(prev);
    }
    if (s != DK_OK) {
        free(host);
        dkpy_raise_status(module, s, &err);
        return -1;
    }
    const int bad = dkpy_check_scale_values(host, host + n, n, op);
    free(host);
    if (bad != 0) {
        return -1;
    }
    scale_remember(scale_objs[0], k_scale, kv);
    scale_remember(scale_objs[1], v_scale, vv);
    return 0;
}

int
dkpy_run_kv_write(PyObject *module, PyObject *key_obj, const dk_tensor *k,
                  const dk_kv_write_args *a)
{
    if (a->num_tokens == 0) {
        return 0;
    }
    if (k->device_type == DK_CUDA) {
        return dkpy_run_cuda(module, key_obj, k->device_id, launch_kv_write, a);
    }
    dk_error err = {{0}};
    dk_status s;
    Py_BEGIN_ALLOW_THREADS s = dk_ref_kv_write(a, &err);
    Py_END_ALLOW_THREADS if (s != DK_OK)
    {
        dkpy_raise_status(module, s, &err);
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
    if (a->num_tokens == 0 && a->k_scale == NULL) {
        return 0;
    }
    if (!dk_cuda_compiled()) {
        return dkpy_run_cuda(module, key_obj, k->device_id, launch_kv_write, a);
    }
    /* the slots, then (quantizing) the two scales' 1 or num_kv_heads floats */
    const int64_t n_scales = a->k_scale == NULL ? 0 : (a->scale_stride_head ? a->num_kv_heads : 1);
    int64_t *host = (int64_t *)malloc((size_t)(a->num_tokens + n_scales + 1) * sizeof(int64_t));
    if (host == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    float *host_scales = (float *)(host + a->num_tokens);
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
    if (s == DK_OK && n_scales > 0) {
        s = dk_cuda_copy_to_host(host_scales, a->k_scale, (size_t)n_scales * sizeof(float), stream,
                                 &err);
        if (s == DK_OK) {
            s = dk_cuda_copy_to_host(host_scales + n_scales, a->v_scale,
                                     (size_t)n_scales * sizeof(float), stream, &err);
        }
    }
    if (s == DK_OK) {
        dk_cuda_device_exit(prev);
    }
    if (s == DK_OK && n_scales > 0 &&
        dkpy_check_scale_values(host_scales, host_scales + n_scales, n_scales, "kv_write") != 0) {
        free(host);
        return -1;
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
        dkpy_raise_status(module, s, &err);
        return -1;
    }
    return 0;
}

/* kv_write(key, value, kv_cache, slot_mapping[, k_scale, v_scale]) */
static PyObject *
py_kv_write(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dkpy_check_nargs_either("kv_write", nargs, 4, 6) != 0) {
        return NULL;
    }
    dk_kv_write_args a;
    dk_tensor views[4], scales[2];
    const dk_tensor *k = &views[0];
    if (dkpy_parse_kv_write(module, args, "kv_write", &a, views) != 0 ||
        dkpy_parse_scales(module, nargs == 6 ? args[4] : Py_None, nargs == 6 ? args[5] : Py_None,
                          "kv_write", a.cache_dtype == DK_F8E4M3, a.num_kv_heads, k, &views[2],
                          scales, &a.k_scale, &a.v_scale, &a.scale_stride_head) != 0) {
        return NULL;
    }
    if (k->device_type == DK_CPU && a.k_scale != NULL &&
        dkpy_check_scale_values(a.k_scale, a.v_scale, a.scale_stride_head ? a.num_kv_heads : 1,
                                "kv_write") != 0) {
        return NULL;
    }
    if (k->device_type == DK_CUDA && check_device_slots(module, args[0], k, &a) != 0) {
        return NULL;
    }
    if (dkpy_run_kv_write(module, args[0], k, &a) != 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* rows_gather/rows_scatter's arguments (src, index, dst) into *a; *src_out = src's view.  With
 * scatter, index has one entry per src row, else one per dst row: 0 or -1. */
static int
parse_rows(PyObject *module, PyObject *const *args, const char *op, dk_rows_args *a,
           dk_tensor *src_out, int scatter)
{
    dk_tensor s, ix, d;
    if (dkpy_tensor(module, args[0], op, &(dkpy_want){.arg = "src", .dtype = DKPY_FLOAT, .ndim = 3},
                    &s) ||
        dkpy_tensor(
            module, args[1], op,
            &(dkpy_want){.arg = "index", .dtype = DK_I64, .ndim = DKPY_VECTOR, .device = &s},
            &ix) ||
        dkpy_tensor(module, args[2], op,
                    &(dkpy_want){.arg = "dst", .dtype = s.dtype, .ndim = 3, .device = &s}, &d)) {
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
    if (dkpy_no_overlap(&d, "dst", &s, "src", op) || dkpy_no_overlap(&d, "dst", &ix, "index", op)) {
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

/* rows_gather (scatter 0) or rows_scatter (1): checks, then the CPU reference or the CUDA
 * launcher.  None, or NULL with the error. */
static PyObject *
rows_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int scatter)
{
    const char *op = scatter ? "rows_scatter" : "rows_gather";
    if (dkpy_check_nargs(op, nargs, 3) != 0) {
        return NULL;
    }
    dk_rows_args a;
    dk_tensor s;
    if (parse_rows(module, args, op, &a, &s, scatter) != 0) {
        return NULL;
    }
    if (s.device_type == DK_CUDA) {
        if (dkpy_run_cuda(module, args[0], s.device_id,
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
        return dkpy_raise_status(module, st, &err);
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

PyMethodDef dkpy_copies_methods[] = {
    FAST(kv_write, "KV cache write (CPU or CUDA)."),
    FAST(rows_gather, "dst[n] = src[index[n]]."),
    FAST(rows_scatter, "dst[index[n]] = src[n]; other rows zeroed."),
    {NULL, NULL, 0, NULL},
};
