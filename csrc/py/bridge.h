/*
 * bridge.h -- the Python side of the tensor bridge (tensor.c), for the files of csrc/py/.
 *
 * csrc/py/ is the only folder that includes Python.h (through this header and binding.h);
 * everything outside it sees only diffkv.h.
 *
 * The DLPack ABI structs below are declared from the DLPack 1.3 specification (dlpack.h):
 * DLTensor, the legacy DLManagedTensor, DLManagedTensorVersioned and the C exchange API
 * table that torch publishes as type(t).__dlpack_c_exchange_api__.
 */
#ifndef DIFFKV_BRIDGE_H
#define DIFFKV_BRIDGE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "diffkv.h"

/* ---- DLPack 1.3 ABI ------------------------------------------------------------------------ */

typedef struct {
    int32_t device_type; /* DLDeviceType: kDLCPU = 1, kDLCUDA = 2, ... */
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code; /* kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6 */
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* may be NULL: compact row-major */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
    DLPackExchangeAPIHeader header;
    int (*managed_tensor_allocator)(DLTensor *prototype, DLManagedTensorVersioned **out,
                                    void *error_ctx,
                                    void (*set_error)(void *error_ctx, const char *kind,
                                                      const char *message));
    int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
    int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor, void **out);
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

/* ---- the bridge ---------------------------------------------------------------------------- */

#define DK_BRIDGE_TYPE_CACHE 8

/* Per-module state of the bridge (lives in the module state; see binding.h). */
typedef struct dk_bridge {
    PyObject *to_dlpack;     /* torch.utils.dlpack.to_dlpack (strong ref) or NULL */
    PyObject *stream_getter; /* torch._C._cuda_getCurrentRawStream (strong ref) or NULL */
    PyObject *num_threads;   /* torch.get_num_threads (strong ref) or NULL */
    int force_capsule;       /* 1: ignore the exchange API (tests of the fallback) */
    PyObject *is_neg_name;   /* interned "is_neg" (strong ref), created on first use */
    int num_types;
    PyObject *types[DK_BRIDGE_TYPE_CACHE];               /* strong refs to tensor types seen */
    const DLPackExchangeAPI *apis[DK_BRIDGE_TYPE_CACHE]; /* their API, NULL = capsule path */
} dk_bridge;

/* Releases the references the bridge holds.  Cannot fail. */
void dk_bridge_clear(dk_bridge *b);

/* Reads `obj` into *out.  `op` and `arg` name the call and argument for messages.
 * Returns 0, or -1 with TypeError/ValueError set (not a tensor, unsupported dtype or device,
 * too many dims).  The view borrows obj's storage: valid while the caller holds obj. */
int dk_bridge_tensor(dk_bridge *b, PyObject *obj, const char *op, const char *arg, dk_tensor *out);

/* dk_bridge_tensor for a caller that reads only the shape, strides, dtype and device, never
 * the data: it does not ask is_neg() (~70 ns a tensor), so a negative-bit view is accepted
 * here and refused by whatever binding reads it.  Same returns. */
int dk_bridge_tensor_layout(dk_bridge *b, PyObject *obj, const char *op, const char *arg,
                            dk_tensor *out);

/* Same as dk_bridge_tensor, but None gives 0 with out->data == NULL and out->ndim == -1. */
int dk_bridge_optional_tensor(dk_bridge *b, PyObject *obj, const char *op, const char *arg,
                              dk_tensor *out);

/* torch's current CUDA stream of `device_id` (exchange API, else the raw-stream getter).
 * Returns 0, or -1 with an exception set.  `tensor_type` picks the exchange API. */
int dk_bridge_stream(dk_bridge *b, PyObject *tensor_obj, int32_t device_id, void **stream);

/* torch.get_num_threads() as configure() registered it, capped at DK_REF_MAX_THREADS (1 when
 * none was registered): the threads the CPU reference may use.  Returns it (>= 1), or -1 with
 * an exception set: the callable's own, TypeError (it returned no int) or ValueError (an int
 * below 1). */
int dk_bridge_cpu_threads(dk_bridge *b);

/* "exchange" or "capsule": the path dk_bridge_tensor takes for obj now; -1 on error. */
int dk_bridge_uses_exchange(dk_bridge *b, PyObject *obj);

#endif /* DIFFKV_BRIDGE_H */
