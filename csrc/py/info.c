/*
 * info.c -- the bridge's settings, what the build holds, which attention kernel runs.
 *
 * Entry points: configure, set_bridge_path, bridge_path, tensor_info, bridge_noop4 (the bridge's
 * cost, for benchmarks), cuda_compiled, build_info, driver_check, last_attention_kernel,
 * set_attention_kernel, supported_head_sizes.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

static PyObject *
py_configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dkpy_check_nargs("configure", nargs, 3) != 0) {
        return NULL;
    }
    module_state *st = state_of(module);
    Py_CLEAR(st->bridge.to_dlpack);
    Py_CLEAR(st->bridge.stream_getter);
    Py_CLEAR(st->bridge.num_threads);
    st->bridge.to_dlpack = args[0] == Py_None ? NULL : Py_NewRef(args[0]);
    st->bridge.stream_getter = args[1] == Py_None ? NULL : Py_NewRef(args[1]);
    st->bridge.num_threads = args[2] == Py_None ? NULL : Py_NewRef(args[2]);
    Py_RETURN_NONE;
}

static PyObject *
py_set_bridge_path(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dkpy_check_nargs("set_bridge_path", nargs, 1) != 0) {
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
    if (dkpy_check_nargs("bridge_path", nargs, 1) != 0) {
        return NULL;
    }
    int rc = dk_bridge_uses_exchange(&state_of(module)->bridge, args[0]);
    if (rc < 0) {
        return NULL;
    }
    return PyUnicode_FromString(rc ? "exchange" : "capsule");
}

static PyObject *
py_tensor_info(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (dkpy_check_nargs("tensor_info", nargs, 1) != 0) {
        return NULL;
    }
    dk_tensor t;
    if (dkpy_tensor_arg(module, args[0], "tensor_info", "tensor", &t) != 0) {
        return NULL;
    }
    int exchange = dk_bridge_uses_exchange(&state_of(module)->bridge, args[0]);
    if (exchange < 0) {
        return NULL;
    }
    PyObject *shape = dkpy_int_tuple(t.shape, t.ndim);
    PyObject *strides = shape == NULL ? NULL : dkpy_int_tuple(t.strides, t.ndim);
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
    if (dkpy_check_nargs("bridge_noop4", nargs, 4) != 0) {
        return NULL;
    }
    static const char *names[4] = {"a", "b", "c", "d"};
    dk_tensor t[4];
    for (int i = 0; i < 4; i++) {
        if (dkpy_tensor_arg(module, args[i], "bridge_noop4", names[i], &t[i]) != 0) {
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
    if (dkpy_check_nargs("cuda_compiled", nargs, 0) != 0) {
        return NULL;
    }
    return PyBool_FromLong(dk_cuda_compiled());
}

static PyObject *
py_build_info(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    (void)args;
    if (dkpy_check_nargs("build_info", nargs, 0) != 0) {
        return NULL;
    }
    int compiled = dk_cuda_compiled();
    int devices = compiled ? dk_cuda_device_count() : 0;
    return Py_BuildValue("{s:O,s:i,s:i,s:i,s:s,s:s,s:s}", "cuda_compiled",
                         compiled ? Py_True : Py_False, "cuda_runtime_version",
                         dk_cuda_runtime_version(), "cuda_driver_version",
                         compiled ? dk_cuda_driver_version() : 0, "device_count", devices, "archs",
                         DIFFKV_CUDA_ARCHS, "limited_api", "cp310-abi3", "attention_kernel",
                         devices > 0 ? dk_cuda_attention_kernel() : "none");
}

/* driver_check(driver_version, runtime_version) -> None, or the message a CUDA call would raise
 * with an NVIDIA driver supporting CUDA driver_version for a build with runtime_version (both
 * in CUDA's 1000 major + 10 minor form; python -m diffkv info asks with the real ones). */
static PyObject *
py_driver_check(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    int64_t driver = 0, runtime = 0;
    if (dkpy_check_nargs("driver_check", nargs, 2) != 0 ||
        dkpy_get_i64(args[0], "driver_check", "driver_version", &driver) != 0 ||
        dkpy_get_i64(args[1], "driver_check", "runtime_version", &runtime) != 0) {
        return NULL;
    }
    if (driver < 0 || driver > INT32_MAX || runtime < 0 || runtime > INT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "driver_check(): versions must be in [0, %d], got %lld and %lld", INT32_MAX,
                     (long long)driver, (long long)runtime);
        return NULL;
    }
    dk_error err = {{0}};
    if (dk_driver_check((int)driver, (int)runtime, &err) == DK_OK) {
        Py_RETURN_NONE;
    }
    return PyUnicode_FromString(err.msg);
}

static PyObject *
py_last_attention_kernel(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    (void)args;
    if (dkpy_check_nargs("last_attention_kernel", nargs, 0) != 0) {
        return NULL;
    }
    return PyUnicode_FromString(dk_cuda_last_attention_kernel());
}

static PyObject *
py_set_attention_kernel(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (dkpy_check_nargs("set_attention_kernel", nargs, 1) != 0) {
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

/* supported_head_sizes(device_type, dtype, cache_dtype) -> tuple of the head sizes paged
 * attention takes on 'cpu' or 'cuda' for 'float32', 'float16' or 'bfloat16' queries over a cache
 * of that dtype ('auto') or a 'float8_e4m3fn' one (dk_head_size_supported). */
static PyObject *
py_supported_head_sizes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (dkpy_check_nargs("supported_head_sizes", nargs, 3) != 0) {
        return NULL;
    }
    static const char *const devices[] = {"cpu", "cuda"};
    static const int32_t device_codes[] = {DK_CPU, DK_CUDA};
    static const char *const dtypes[] = {"float32", "float16", "bfloat16"};
    static const dk_dtype dtype_codes[] = {DK_F32, DK_F16, DK_BF16};
    int device = -1, dtype = -1;
    const char *dev = PyUnicode_Check(args[0]) ? PyUnicode_AsUTF8AndSize(args[0], NULL) : NULL;
    for (int i = 0; dev != NULL && i < 2; i++) {
        device = strcmp(dev, devices[i]) == 0 ? i : device;
    }
    const char *dt = PyUnicode_Check(args[1]) ? PyUnicode_AsUTF8AndSize(args[1], NULL) : NULL;
    for (int i = 0; dt != NULL && i < 3; i++) {
        dtype = strcmp(dt, dtypes[i]) == 0 ? i : dtype;
    }
    const char *cd = PyUnicode_Check(args[2]) ? PyUnicode_AsUTF8AndSize(args[2], NULL) : NULL;
    const int kv_fp8 = cd == NULL                         ? -1
                       : strcmp(cd, "auto") == 0          ? 0
                       : strcmp(cd, "float8_e4m3fn") == 0 ? 1
                                                          : -1;
    PyErr_Clear();
    if (device < 0) {
        PyErr_Format(PyExc_ValueError,
                     "supported_head_sizes(): device_type must be 'cpu' or 'cuda', got %R",
                     args[0]);
        return NULL;
    }
    if (dtype < 0) {
        PyErr_Format(PyExc_ValueError,
                     "supported_head_sizes(): dtype must be 'float32', 'float16' or 'bfloat16', "
                     "got %R",
                     args[1]);
        return NULL;
    }
    if (kv_fp8 < 0) {
        PyErr_Format(
            PyExc_ValueError,
            "supported_head_sizes(): cache_dtype must be 'auto' or 'float8_e4m3fn', got %R",
            args[2]);
        return NULL;
    }
    int64_t n = 0;
    for (int64_t d = 1; d <= DK_REF_MAX_HEAD_SIZE; d++) {
        n += dk_head_size_supported(device_codes[device], dtype_codes[dtype], kv_fp8, d);
    }
    PyObject *out = PyTuple_New((Py_ssize_t)n);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t k = 0;
    for (int64_t d = 1; d <= DK_REF_MAX_HEAD_SIZE; d++) {
        if (dk_head_size_supported(device_codes[device], dtype_codes[dtype], kv_fp8, d)) {
            PyObject *v = PyLong_FromLongLong((long long)d);
            if (v == NULL || PyTuple_SetItem(out, k++, v) != 0) {
                Py_DECREF(out);
                return NULL;
            }
        }
    }
    return out;
}

PyMethodDef dkpy_info_methods[] = {
    FAST(configure,
         "configure(to_dlpack, raw_stream_getter, num_threads): the DLPack fallback path "
         "and the CPU reference's thread count."),
    FAST(set_bridge_path, "set_bridge_path('auto' | 'capsule')."),
    FAST(bridge_path, "bridge_path(tensor) -> 'exchange' | 'capsule'."),
    FAST(tensor_info, "tensor_info(tensor) -> dict of what C sees."),
    FAST(bridge_noop4, "bridge_noop4(a, b, c, d): reads four tensors (benchmark)."),
    FAST(cuda_compiled, "cuda_compiled() -> bool."),
    FAST(supported_head_sizes,
         "supported_head_sizes(device_type, dtype, cache_dtype) -> tuple of the head sizes paged "
         "attention takes on 'cpu' or 'cuda' for 'float32', 'float16' or 'bfloat16' queries over "
         "a cache of that dtype ('auto') or a 'float8_e4m3fn' one."),
    FAST(build_info, "build_info() -> dict."),
    FAST(driver_check, "driver_check(driver_version, runtime_version) -> None or the refusal."),
    FAST(last_attention_kernel,
         "last_attention_kernel() -> str: the kernel the last CUDA attention call launched."),
    FAST(set_attention_kernel,
         "set_attention_kernel('auto' | 'sm90' | 'sm80') -> the previous choice: the tensor-core "
         "attention kernels CUDA calls may take, for this process (overrides "
         "DIFFKV_ATTENTION_KERNEL)."),
    {NULL, NULL, 0, NULL},
};
