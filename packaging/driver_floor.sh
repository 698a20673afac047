#!/usr/bin/env bash
# Which driver the static CUDA runtime of a toolkit accepts, measured without a GPU: a stand-in
# libcuda.so.1 reports each CUDA version in turn, and a program linked with that toolkit's
# libcudart_static.a says what cudaGetDeviceCount returns.  cudaErrorInsufficientDriver: the
# runtime refuses the driver; cudaErrorNoDevice: it accepted the driver and found no device (the
# stand-in has none).  docs/architecture.md, *Release wheels*, has the result.
#   packaging/driver_floor.sh CUDA_HOME [VERSION...]   e.g. build/cuda-12.4 11080 12000 12040
set -euo pipefail
cuda_home=$(realpath "${1:?usage: driver_floor.sh CUDA_HOME [VERSION...]}")
shift
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(11080 12000 12040 12090 13000)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cat >"$work/libcuda.c" <<'C'
/* The stand-in driver: cuDriverGetVersion says $DRIVER_FLOOR_VERSION, cuInit succeeds, every
 * other entry point the runtime fetches through cuGetProcAddress answers CUDA_ERROR_NO_DEVICE. */
#include <stdlib.h>
#include <string.h>
typedef int CUresult;
static CUresult
driver_get_version(int *v)
{
    *v = atoi(getenv("DRIVER_FLOOR_VERSION"));
    return 0;
}
static CUresult
init(unsigned flags)
{
    (void)flags;
    return 0;
}
static CUresult
no_device(void)
{
    return 100;
}
CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
static void *
entry_point(const char *name, int version)
{
    if (strcmp(name, "cuGetProcAddress") == 0) {
        return version >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
    }
    if (strcmp(name, "cuDriverGetVersion") == 0) {
        return (void *)driver_get_version;
    }
    if (strcmp(name, "cuInit") == 0) {
        return (void *)init;
    }
    return (void *)no_device;
}
CUresult
cuDriverGetVersion(int *v)
{
    return driver_get_version(v);
}
CUresult
cuGetProcAddress(const char *name, void **fn, int version, unsigned long long flags)
{
    (void)flags;
    *fn = entry_point(name, version);
    return 0;
}
CUresult
cuGetProcAddress_v2(const char *name, void **fn, int version, unsigned long long flags, int *found)
{
    (void)flags;
    *fn = entry_point(name, version);
    if (found) {
        *found = 0;
    }
    return 0;
}
C
cat >"$work/probe.c" <<'C'
#include <cuda_runtime.h>
#include <stdio.h>
int
main(void)
{
    int runtime = 0, count = 0;
    cudaRuntimeGetVersion(&runtime);
    printf("runtime %d: cudaGetDeviceCount -> %s\n", runtime, cudaGetErrorName(cudaGetDeviceCount(&count)));
    return 0;
}
C
gcc -shared -fPIC -o "$work/libcuda.so.1" "$work/libcuda.c"
g++ -o "$work/probe" "$work/probe.c" -I"$cuda_home/include" -L"$cuda_home/lib64" -lcudart_static -lpthread -ldl -lrt
for version in "${versions[@]}"; do
    echo "driver reporting CUDA $version, $(DRIVER_FLOOR_VERSION=$version LD_LIBRARY_PATH="$work" "$work/probe")"
done
