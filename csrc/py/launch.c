/*
 * launch.c -- running a dk_cuda_* launcher for a binding.
 *
 * dkpy_run_cuda makes the tensor's device current, takes torch's current stream on it from the
 * bridge, launches, and turns a failure into diffkv.CudaError; a CPU-only build's launchers
 * (nocuda.c) explain how to rebuild.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

/* Runs a launcher with the tensor's device current and torch's current stream. */
typedef dk_status (*cuda_launcher)(const void *args, void *stream, dk_error *err);

int
dkpy_run_cuda(PyObject *module, PyObject *tensor_obj, int32_t device, cuda_launcher launch,
              const void *args)
{
    dk_error err = {{0}};
    if (!dk_cuda_compiled()) {
        dk_status s = launch(args, NULL, &err); /* the CPU-only stub explains how to rebuild */
        dkpy_raise_status(module, s, &err);
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
        dkpy_raise_status(module, s, &err);
        return -1;
    }
    return 0;
}
