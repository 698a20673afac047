/*
 * launch.cu -- one submission for a layer call's two kernels: the KV write and the attention
 * that reads what it writes.
 *
 * A kernel launch costs the host several microseconds of CPU time, which made the two launches
 * half of a small layer call's host time; a CUDA graph of the two kernels, its parameters
 * updated in place (cudaGraphExecKernelNodeSetParams) and launched with cudaGraphLaunch,
 * submits both for about a third of that (the measurements: docs/host-overhead.md).
 * The executable graphs are cached per thread, keyed by (device, stream, KV kernel, attention
 * kernel): a kernel node's function cannot change, its geometry and arguments can, and a
 * graph's launches are ordered behind each other even across streams, so each stream gets its
 * own.  Updating a graph's parameters does not touch launches already enqueued.
 *
 * Plain launches instead: while the stream is being captured into the caller's own graph
 * (whose nodes then are the two kernels, as before), with DIFFKV_LAUNCH_GRAPH=0 in the
 * environment (read once), or when a graph call fails (its error is cleared and the entry
 * dropped).  Either way the KV write is submitted before the attention on the same stream.
 *
 * Entry points: dk_launch_after, dk_cuda_launch_pending (cuda_common.cuh), dk_cuda_layer
 * (diffkv.h).
 */
#include "diffkv.h"

#include "cuda_common.cuh"

#include <cuda_runtime.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Executable graphs kept per thread (the least recently used one makes room). */
#define LAYER_GRAPHS 8

namespace {

struct layer_graph {
    const void *kv_func;   /* the KV-write kernel (a free entry: exec NULL) */
    const void *attn_func; /* the attention kernel */
    int device;
    cudaStream_t stream;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaGraphNode_t kv_node, attn_node;
    uint64_t used;
};

/* Per thread: a thread's graphs are updated and launched by that thread alone, so no lock.
 * A thread's graphs are not destroyed when it ends (a few small objects; at process exit the
 * driver releases them with the context). */
thread_local layer_graph graphs[LAYER_GRAPHS];
thread_local uint64_t graph_clock;

bool
graphs_from_env(void)
{
    const char *v = getenv("DIFFKV_LAUNCH_GRAPH");
    return v == NULL || strcmp(v, "0") != 0;
}

bool
graphs_enabled(void)
{
    static const bool enabled = graphs_from_env();
    return enabled;
}

void
drop(layer_graph *g)
{
    if (g->exec != NULL) {
        (void)cudaGraphExecDestroy(g->exec);
    }
    if (g->graph != NULL) {
        (void)cudaGraphDestroy(g->graph);
    }
    memset(g, 0, sizeof(*g));
}

/* A new graph of the two nodes (kv, then attn) in *g; false (error cleared, *g free) when a
 * graph call fails. */
bool
build(layer_graph *g, const cudaKernelNodeParams *kv, const cudaKernelNodeParams *attn)
{
    bool ok =
        cudaGraphCreate(&g->graph, 0) == cudaSuccess &&
        cudaGraphAddKernelNode(&g->kv_node, g->graph, NULL, 0, kv) == cudaSuccess &&
        cudaGraphAddKernelNode(&g->attn_node, g->graph, &g->kv_node, 1, attn) == cudaSuccess &&
        cudaGraphInstantiate(&g->exec, g->graph, 0) == cudaSuccess;
    if (!ok) {
        (void)cudaGetLastError();
        drop(g);
    }
    return ok;
}

/* The two kernels as one graph launch; false (nothing launched, error cleared) when a graph
 * call failed before the launch. */
bool
launch_graph(const cudaKernelNodeParams *kv, const cudaKernelNodeParams *attn, cudaStream_t s,
             cudaError_t *launched)
{
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    layer_graph *hit = NULL, *slot = &graphs[0];
    for (int i = 0; i < LAYER_GRAPHS; i++) {
        layer_graph *g = &graphs[i];
        if (g->kv_func == kv->func && g->attn_func == attn->func && g->device == device &&
            g->stream == s && g->exec != NULL) {
            hit = g;
            break;
        }
        if (g->exec == NULL || (slot->exec != NULL && g->used < slot->used)) {
            slot = g; /* a free entry, else the least recently used */
        }
    }
    if (hit != NULL) {
        if (cudaGraphExecKernelNodeSetParams(hit->exec, hit->kv_node, kv) != cudaSuccess ||
            cudaGraphExecKernelNodeSetParams(hit->exec, hit->attn_node, attn) != cudaSuccess) {
            (void)cudaGetLastError();
            drop(hit);
            return false;
        }
    }
    else {
        drop(slot);
        if (!build(slot, kv, attn)) {
            return false;
        }
        slot->kv_func = kv->func;
        slot->attn_func = attn->func;
        slot->device = device;
        slot->stream = s;
        hit = slot;
    }
    hit->used = ++graph_clock;
    *launched = cudaGraphLaunch(hit->exec, s);
    return true;
}

/* The pending KV write's launch, taken from *p (which it then leaves empty): its kernel,
 * geometry and parameters -- pointers into *p, which outlives the launch or graph update. */
struct kv_launch {
    const void *func;
    dim3 grid, block;
    void *args[4];
};

kv_launch
take(dk_pending_launch *p)
{
    kv_launch k;
    k.func = p->func;
    k.grid = dim3(p->grid[0], p->grid[1], p->grid[2]);
    k.block = dim3(p->block[0], p->block[1], p->block[2]);
    k.args[0] = &p->kv; /* the kv_write kernels' parameters, in order */
    k.args[1] = &p->elem_size;
    k.args[2] = &p->units_per_head;
    k.args[3] = &p->elems_per_unit;
    p->func = NULL;
    return k;
}

cudaKernelNodeParams
node(const void *func, dim3 grid, dim3 block, size_t smem, void **args)
{
    cudaKernelNodeParams k = {};
    k.func = (void *)func;
    k.gridDim = grid;
    k.blockDim = block;
    k.sharedMemBytes = (unsigned)smem;
    k.kernelParams = args;
    k.extra = NULL;
    return k;
}

} // namespace

cudaError_t
dk_launch_after(dk_pending_launch *p, const void *func, dim3 grid, dim3 block, size_t smem,
                cudaStream_t s, void **args)
{
    if (p == NULL || p->func == NULL) {
        return cudaLaunchKernel(func, grid, block, args, smem, s);
    }
    kv_launch k = take(p); /* consumed, whatever follows */
    const cudaKernelNodeParams kv = node(k.func, k.grid, k.block, 0, k.args);
    const cudaKernelNodeParams attn = node(func, grid, block, smem, args);
    cudaError_t e = cudaSuccess;
    if (graphs_enabled() && !dk_cuda_stream_capturing(s) && launch_graph(&kv, &attn, s, &e)) {
        return e;
    }
    e = cudaLaunchKernel(k.func, k.grid, k.block, k.args, 0, s);
    if (e != cudaSuccess) {
        return e;
    }
    return cudaLaunchKernel(func, grid, block, args, smem, s);
}

dk_status
dk_cuda_launch_pending(dk_pending_launch *p, void *stream, dk_error *err)
{
    if (p->func == NULL) {
        return DK_OK;
    }
    kv_launch k = take(p);
    (void)cudaLaunchKernel(k.func, k.grid, k.block, k.args, 0, (cudaStream_t)stream);
    return dk_cuda_after_launch("kv_write()", stream, err);
}

extern "C" dk_status
dk_cuda_layer(const dk_kv_write_args *w, const dk_attention_args *a, void *stream, dk_error *err)
{
    dk_pending_launch p;
    dk_status s = dk_cuda_kv_write_prepare(w, &p, err);
    if (s != DK_OK) {
        return s;
    }
    if (a->num_tokens > 0) {
        dk_attention_args with = *a;
        with.pending = &p;
        s = dk_cuda_attention(&with, stream, err);
        if (s != DK_OK) {
            return s;
        }
    }
    /* an attention that launched nothing (no query token) leaves the write pending */
    return dk_cuda_launch_pending(&p, stream, err);
}
