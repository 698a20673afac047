/*
 * module.c -- diffkv._C: module state, multi-phase init (PEP 489), constants, CudaError.
 *
 * Every other file of csrc/py/ binds one concern and hands its method table here (binding.h
 * lists them).  The contract of each _C function is python/diffkv/_C.pyi.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

/* Every file's functions (contract: python/diffkv/_C.pyi). */
static PyMethodDef *const method_tables[] = {
    dkpy_info_methods,   dkpy_rules_methods, dkpy_qkv_methods,    dkpy_batch_methods,
    dkpy_tables_methods, dkpy_plan_methods,  dkpy_copies_methods, dkpy_attention_methods,
    dkpy_dense_methods,  dkpy_layer_methods,
};

/* Py_mod_exec: fills a new module object -- empties its state's DLPack bridge (configure() in
 * info.c sets it later), creates diffkv.CudaError, adds every file's functions
 * (method_tables) and the int constants (DTYPE_*, MASK_*, LAYOUT_*, CONSECUTIVE_*).  0, or -1
 * with the exception set (the import fails; module_free releases what was made). */
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
    for (size_t i = 0; i < sizeof(method_tables) / sizeof(method_tables[0]); i++) {
        if (PyModule_AddFunctions(module, method_tables[i]) < 0) {
            return -1;
        }
    }
    if (PyModule_AddIntConstant(module, "DTYPE_FLOAT32", DK_F32) < 0 ||
        PyModule_AddIntConstant(module, "DTYPE_FLOAT16", DK_F16) < 0 ||
        PyModule_AddIntConstant(module, "DTYPE_BFLOAT16", DK_BF16) < 0 ||
        PyModule_AddIntConstant(module, "DTYPE_FLOAT64", DK_F64) < 0 ||
        PyModule_AddIntConstant(module, "MASK_NONE", DK_MASK_NONE) < 0 ||
        PyModule_AddIntConstant(module, "MASK_CAUSAL", DK_MASK_CAUSAL) < 0 ||
        PyModule_AddIntConstant(module, "MASK_LIMITS", DK_MASK_LIMITS) < 0 ||
        PyModule_AddIntConstant(module, "LAYOUT_PACK_ROWS", LAYOUT_PACK_ROWS) < 0 ||
        PyModule_AddIntConstant(module, "LAYOUT_QUERY_HEADS", LAYOUT_QUERY_HEADS) < 0 ||
        PyModule_AddIntConstant(module, "LAYOUT_KEY_HEADS", LAYOUT_KEY_HEADS) < 0 ||
        PyModule_AddIntConstant(module, "LAYOUT_VALUE_HEADS", LAYOUT_VALUE_HEADS) < 0 ||
        PyModule_AddIntConstant(module, "LAYOUT_KEY_CONTIGUOUS", LAYOUT_KEY_CONTIGUOUS) < 0 ||
        PyModule_AddIntConstant(module, "LAYOUT_VALUE_CONTIGUOUS", LAYOUT_VALUE_CONTIGUOUS) < 0 ||
        PyModule_AddIntConstant(module, "CONSECUTIVE_TILES", DK_CONSECUTIVE_TILES) < 0 ||
        PyModule_AddIntConstant(module, "CONSECUTIVE_CHUNKS", DK_CONSECUTIVE_CHUNKS) < 0 ||
        PyModule_AddIntConstant(module, "CONSECUTIVE_SCALES_FROM_KV",
                                DK_CONSECUTIVE_SCALES_FROM_KV) < 0) {
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
    Py_VISIT(st->bridge.to_dlpack);
    Py_VISIT(st->bridge.stream_getter);
    Py_VISIT(st->bridge.num_threads);
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
    .m_doc = "diffkv's C core: DLPack tensor bridge, vLLM-Omni's adapter's validation rules, batch "
             "preparation, piecewise plans, KV write and paged attention (CPU reference and CUDA).",
    .m_size = sizeof(module_state),
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
