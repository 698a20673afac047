/*
 * tensor.c -- torch tensor (a PyObject) -> borrowed dk_tensor view, with no libtorch link.
 *
 * Fast path: the DLPack 1.3 C exchange API that torch publishes on its tensor type
 * (`__dlpack_c_exchange_api__`, a capsule named "dlpack_exchange_api"; the older spelling
 * `__c_dlpack_exchange_api__` is an int).  It is looked up once per tensor type and cached;
 * per call it fills a DLTensor without any Python call.  Fallback (torch without the API):
 * torch.utils.dlpack.to_dlpack, whose capsule is read and released at once.  The current CUDA
 * stream comes from the same API, else from torch._C._cuda_getCurrentRawStream.
 *
 * Entry points: dk_bridge_tensor, dk_bridge_tensor_layout, dk_bridge_optional_tensor,
 * dk_bridge_stream, dk_bridge_cpu_threads, dk_bridge_uses_exchange, dk_bridge_clear.
 */
#include "bridge.h"

#include <string.h>

#define DLPACK_CODE_INT 0
#define DLPACK_CODE_UINT 1
#define DLPACK_CODE_FLOAT 2
#define DLPACK_CODE_BFLOAT 4
#define DLPACK_CODE_BOOL 6
#define DLPACK_CODE_FLOAT8_E4M3FN 10 /* DLPack 1.1 */

void
dk_bridge_clear(dk_bridge *b)
{
    Py_CLEAR(b->to_dlpack);
    Py_CLEAR(b->stream_getter);
    Py_CLEAR(b->num_threads);
    Py_CLEAR(b->is_neg_name);
    for (int i = 0; i < b->num_types; i++) {
        Py_CLEAR(b->types[i]);
        b->apis[i] = NULL;
    }
    b->num_types = 0;
}

/* The exchange API published on `type`, or NULL (no API, wrong version, missing functions).
 * Never leaves an exception set. */
static const DLPackExchangeAPI *
probe_exchange_api(PyObject *type)
{
    const DLPackExchangeAPI *api = NULL;
    PyObject *attr = PyObject_GetAttrString(type, "__dlpack_c_exchange_api__");
    if (attr != NULL && PyCapsule_IsValid(attr, "dlpack_exchange_api")) {
        api = (const DLPackExchangeAPI *)PyCapsule_GetPointer(attr, "dlpack_exchange_api");
    }
    Py_XDECREF(attr);
    PyErr_Clear();
    if (api == NULL) {
        attr = PyObject_GetAttrString(type, "__c_dlpack_exchange_api__");
        if (attr != NULL && PyLong_Check(attr)) {
            api = (const DLPackExchangeAPI *)PyLong_AsVoidPtr(attr);
        }
        Py_XDECREF(attr);
        PyErr_Clear();
    }
    if (api == NULL || api->header.version.major != 1 ||
        api->dltensor_from_py_object_no_sync == NULL || api->current_work_stream == NULL) {
        return NULL;
    }
    return api;
}

/* Index of `type` in the cache, adding it when there is room; -1 when the cache is full
 * (then *api_out still holds the probed API). */
static int
lookup_type(dk_bridge *b, PyObject *type, const DLPackExchangeAPI **api_out)
{
    for (int i = 0; i < b->num_types; i++) {
        if (b->types[i] == type) {
            *api_out = b->apis[i];
            return i;
        }
    }
    const DLPackExchangeAPI *api = probe_exchange_api(type);
    *api_out = api;
    if (b->num_types < DK_BRIDGE_TYPE_CACHE) {
        Py_INCREF(type);
        b->types[b->num_types] = type;
        b->apis[b->num_types] = api;
        return b->num_types++;
    }
    return -1;
}

/* 1 when obj exports DLPack (torch.Tensor and its subclasses).  Cannot fail. */
static int
is_tensor_like(PyObject *obj)
{
    /* Everything torch exports (Tensor and its subclasses) has __dlpack__. */
    return PyObject_HasAttrString(obj, "__dlpack__");
}

/* A DLTensor (CPU or CUDA, at most DK_MAX_DIMS dims) into *out, its strides made explicit;
 * dtypes DLPack names that diffkv does not use become DK_OTHER: 0, or -1 with the error. */
static int
convert_dltensor(const DLTensor *src, const char *op, const char *arg, dk_tensor *out)
{
    if (src->device.device_type != DK_CPU && src->device.device_type != DK_CUDA) {
        PyErr_Format(PyExc_TypeError,
                     "%s(): %s must be a CPU or CUDA tensor, got DLPack device type %d", op, arg,
                     (int)src->device.device_type);
        return -1;
    }
    if (src->ndim < 0 || src->ndim > DK_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must have at most %d dimensions, got %d", op, arg,
                     DK_MAX_DIMS, (int)src->ndim);
        return -1;
    }
    dk_dtype dtype = DK_OTHER;
    if (src->dtype.lanes == 1) {
        switch (src->dtype.code) {
        case DLPACK_CODE_FLOAT:
            dtype = src->dtype.bits == 32   ? DK_F32
                    : src->dtype.bits == 16 ? DK_F16
                    : src->dtype.bits == 64 ? DK_F64
                                            : DK_OTHER;
            break;
        case DLPACK_CODE_BFLOAT:
            dtype = src->dtype.bits == 16 ? DK_BF16 : DK_OTHER;
            break;
        case DLPACK_CODE_INT:
            dtype = src->dtype.bits == 32   ? DK_I32
                    : src->dtype.bits == 64 ? DK_I64
                    : src->dtype.bits == 8  ? DK_I8
                    : src->dtype.bits == 16 ? DK_I16
                                            : DK_OTHER;
            break;
        case DLPACK_CODE_UINT:
            dtype = src->dtype.bits == 8 ? DK_U8 : DK_OTHER;
            break;
        case DLPACK_CODE_BOOL:
            dtype = DK_BOOL;
            break;
        case DLPACK_CODE_FLOAT8_E4M3FN:
            dtype = src->dtype.bits == 8 ? DK_F8E4M3 : DK_OTHER;
            break;
        default:
            break;
        }
    }
    out->dtype = dtype;
    out->device_type = src->device.device_type;
    out->device_id = src->device.device_type == DK_CUDA ? src->device.device_id : 0;
    out->ndim = src->ndim;
    out->data = src->data == NULL ? NULL : (void *)((char *)src->data + src->byte_offset);
    int64_t running = 1;
    for (int32_t i = src->ndim - 1; i >= 0; i--) {
        out->shape[i] = src->shape[i];
        out->strides[i] = src->strides != NULL ? src->strides[i] : running;
        running *= src->shape[i];
    }
    return 0;
}

/* The fallback path: *out from torch.utils.dlpack.to_dlpack(obj), the capsule read and released
 * at once (both capsule names): 0, or -1 with the error. */
static int
read_capsule(dk_bridge *b, PyObject *obj, const char *op, const char *arg, dk_tensor *out)
{
    if (b->to_dlpack == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s(): the DLPack fallback is not configured; import diffkv (not diffkv._C)",
                     op);
        return -1;
    }
    PyObject *capsule = PyObject_CallFunctionObjArgs(b->to_dlpack, obj, NULL);
    if (capsule == NULL) {
        return -1;
    }
    int rc = -1;
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *m = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
        rc = m == NULL ? -1 : convert_dltensor(&m->dl_tensor, op, arg, out);
    }
    else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *m =
            (DLManagedTensorVersioned *)PyCapsule_GetPointer(capsule, "dltensor_versioned");
        rc = m == NULL ? -1 : convert_dltensor(&m->dl_tensor, op, arg, out);
    }
    else {
        PyErr_Format(PyExc_TypeError, "%s(): %s gave a DLPack capsule of an unknown kind", op, arg);
    }
    /* The capsule was not renamed "used_...", so its destructor calls the producer's deleter;
     * obj keeps the storage alive for the rest of the call. */
    Py_DECREF(capsule);
    return rc;
}

/*
 * DLPack has no negative bit: a torch view with one set (x.conj().imag, torch._neg_view) would
 * be read un-negated, a silent wrong answer.  Float tensors are asked once per argument.
 * Returns 0, or -1 with ValueError set.
 */
static int
reject_negative_view(dk_bridge *b, PyObject *obj, const char *op, const char *arg)
{
    if (b->is_neg_name == NULL) {
        b->is_neg_name = PyUnicode_InternFromString("is_neg");
        if (b->is_neg_name == NULL) {
            return -1;
        }
    }
    PyObject *res = PyObject_CallMethodObjArgs(obj, b->is_neg_name, NULL);
    if (res == NULL) {
        PyErr_Clear(); /* not a torch tensor: nothing to resolve */
        return 0;
    }
    int neg = PyObject_IsTrue(res);
    Py_DECREF(res);
    if (neg < 0) {
        return -1;
    }
    if (neg) {
        PyErr_Format(
            PyExc_ValueError,
            "%s(): %s must not be a negative-bit view (DLPack cannot express it), got one; "
            "pass %s.resolve_neg()",
            op, arg, arg);
        return -1;
    }
    return 0;
}

/* After a bridge read with result rc: floating views that DLPack could not express (negative
 * bit) are refused (reject_negative_view).  Returns rc, or -1 with the error. */
static int
checked_float_view(dk_bridge *b, PyObject *obj, const char *op, const char *arg, int rc,
                   const dk_tensor *out)
{
    if (rc != 0) {
        return rc;
    }
    if (out->dtype == DK_F32 || out->dtype == DK_F16 || out->dtype == DK_BF16 ||
        out->dtype == DK_F64) {
        return reject_negative_view(b, obj, op, arg);
    }
    return 0;
}

/* dk_bridge_tensor and dk_bridge_tensor_layout; check_neg: ask is_neg() of a float tensor. */
static int
bridge_read(dk_bridge *b, PyObject *obj, const char *op, const char *arg, dk_tensor *out,
            int check_neg)
{
    PyObject *type = (PyObject *)Py_TYPE(obj);
    const DLPackExchangeAPI *api = NULL;
    int cached = -1;
    for (int i = 0; i < b->num_types; i++) {
        if (b->types[i] == type) {
            cached = i;
            api = b->apis[i];
            break;
        }
    }
    if (cached < 0) {
        if (!is_tensor_like(obj)) {
            PyObject *name = PyObject_GetAttrString(type, "__name__");
            if (name == NULL) {
                return -1;
            }
            PyErr_Format(PyExc_TypeError, "%s(): %s must be a torch.Tensor, got %U", op, arg, name);
            Py_DECREF(name);
            return -1;
        }
        lookup_type(b, type, &api);
    }
    if (api != NULL && !b->force_capsule) {
        DLTensor view;
        if (api->dltensor_from_py_object_no_sync((void *)obj, &view) != 0) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_TypeError, "%s(): %s could not be read through DLPack", op, arg);
            }
            return -1;
        }
        int rc = convert_dltensor(&view, op, arg, out);
        return check_neg ? checked_float_view(b, obj, op, arg, rc, out) : rc;
    }
    int rc = read_capsule(b, obj, op, arg, out);
    return check_neg ? checked_float_view(b, obj, op, arg, rc, out) : rc;
}

int
dk_bridge_tensor(dk_bridge *b, PyObject *obj, const char *op, const char *arg, dk_tensor *out)
{
    return bridge_read(b, obj, op, arg, out, 1);
}

int
dk_bridge_tensor_layout(dk_bridge *b, PyObject *obj, const char *op, const char *arg,
                        dk_tensor *out)
{
    return bridge_read(b, obj, op, arg, out, 0);
}

int
dk_bridge_optional_tensor(dk_bridge *b, PyObject *obj, const char *op, const char *arg,
                          dk_tensor *out)
{
    if (obj == Py_None) {
        memset(out, 0, sizeof(*out));
        out->ndim = -1;
        return 0;
    }
    return dk_bridge_tensor(b, obj, op, arg, out);
}

int
dk_bridge_stream(dk_bridge *b, PyObject *tensor_obj, int32_t device_id, void **stream)
{
    const DLPackExchangeAPI *api = NULL;
    lookup_type(b, (PyObject *)Py_TYPE(tensor_obj), &api);
    if (api != NULL && !b->force_capsule) {
        if (api->current_work_stream(DK_CUDA, device_id, stream) != 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_RuntimeError, "could not get torch's current CUDA stream");
            }
            return -1;
        }
        return 0;
    }
    if (b->stream_getter == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "torch has neither the DLPack exchange API nor "
                        "torch._C._cuda_getCurrentRawStream: cannot find the current CUDA stream");
        return -1;
    }
    PyObject *idx = PyLong_FromLong(device_id);
    if (idx == NULL) {
        return -1;
    }
    PyObject *res = PyObject_CallFunctionObjArgs(b->stream_getter, idx, NULL);
    Py_DECREF(idx);
    if (res == NULL) {
        return -1;
    }
    void *s = PyLong_AsVoidPtr(res);
    Py_DECREF(res);
    if (s == NULL && PyErr_Occurred()) {
        return -1;
    }
    *stream = s;
    return 0;
}

int
dk_bridge_cpu_threads(dk_bridge *b)
{
    if (b->num_threads == NULL) {
        return 1;
    }
    PyObject *res = PyObject_CallNoArgs(b->num_threads);
    if (res == NULL) {
        return -1;
    }
    if (!PyLong_Check(res)) {
        PyErr_Format(PyExc_TypeError,
                     "configure()'s num_threads must return an int (torch.get_num_threads), "
                     "got %R",
                     res);
        Py_DECREF(res);
        return -1;
    }
    int overflow = 0;
    const long n = PyLong_AsLongAndOverflow(res, &overflow);
    Py_DECREF(res);
    if (overflow > 0 || n > DK_REF_MAX_THREADS) {
        return DK_REF_MAX_THREADS;
    }
    if (overflow < 0 || n < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "configure()'s num_threads must return a positive number of threads "
                        "(torch.get_num_threads)");
        return -1;
    }
    return (int)n;
}

int
dk_bridge_uses_exchange(dk_bridge *b, PyObject *obj)
{
    const DLPackExchangeAPI *api = NULL;
    if (!is_tensor_like(obj)) {
        PyErr_SetString(PyExc_TypeError, "bridge_path(): tensor must be a torch.Tensor");
        return -1;
    }
    lookup_type(b, (PyObject *)Py_TYPE(obj), &api);
    return api != NULL && !b->force_capsule;
}
