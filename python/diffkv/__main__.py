"""python -m diffkv demo|info|bench

demo: a HunyuanImage-3.0-shaped denoise loop built only from diffkv's public API: several
causal layers with GQA, two CFG rows with different prefix lengths, a full-attention span over
the image tokens, a prefill step (every token written and attended) then denoise steps (only
the image span rewritten, the prefix pages reused).  Every layer's output is checked against a
dense float32 reference with an explicit mask.  Full size on a GPU, scaled down on the CPU.

info: versions, build flags and the devices diffkv sees.

bench: paged attention throughput on this GPU, swept over sequence length, rows and block size,
against torch SDPA (flash, cuDNN) and FlexAttention; writes a JSON record, prints the table and,
with matplotlib installed (pip install diffkv[bench]), draws a PNG plot (diffkv/_bench_cli.py).
--quick: a tiny diffkv-only sweep that runs on the CPU.  --plot bench.json: the plot of a
record written earlier, nothing run.
"""

import argparse
import sys
import time
from types import SimpleNamespace

import torch

import diffkv as dk
from diffkv import _C


def _cdiv(a, b):
    return -(-a // b)


def _shape(args, device):
    if device.type == "cuda" and not args.small:
        # HunyuanImage-3.0 DiT at 1024x1024: 32 layers, 32/8 heads x 128, 4096 latent tokens
        # + a timestep token; prompts of a few hundred to a few thousand tokens.
        return SimpleNamespace(
            layers=args.layers or 32,
            heads=32,
            kv_heads=8,
            head_size=128,
            prefixes=(500, 3500),
            image_tokens=4097,
            steps=args.steps or 8,
            dtype=torch.bfloat16,
        )
    return SimpleNamespace(
        layers=args.layers or 4,
        heads=8,
        kv_heads=2,
        head_size=64,
        prefixes=(40, 120),
        image_tokens=257,
        steps=args.steps or 3,
        dtype=torch.bfloat16,
    )


def _reference(q, k, v, prefix, scale):
    """Dense float32 attention of one row with the piecewise mask: causal, except the image
    span [prefix, seq_len) which sees the whole span.  q [n, H, D] at positions
    [seq_len - n, seq_len), k/v [seq_len, Hkv, D]."""
    seq_len, n = k.shape[0], q.shape[0]
    groups = q.shape[1] // k.shape[1]
    pos = torch.arange(seq_len - n, seq_len, device=q.device)
    keys = torch.arange(seq_len, device=q.device)
    in_span = pos >= prefix
    limit = torch.where(in_span, torch.full_like(pos, seq_len), pos + 1)
    mask = keys[None, :] < limit[:, None]
    kf = k.float().repeat_interleave(groups, dim=1)
    vf = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.float(), kf) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(-1), vf)


def demo(args):
    device = (
        torch.device(args.device)
        if args.device
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda" and not _C.cuda_compiled():
        print("diffkv was built without CUDA; running the demo on the CPU", file=sys.stderr)
        device = torch.device("cpu")
    fp8 = getattr(args, "kv_cache_dtype", "auto") == "fp8"
    s = _shape(args, device)
    block_size = 16
    cache_dtype = torch.float8_e4m3fn if fp8 else s.dtype
    scale = s.head_size**-0.5
    torch.manual_seed(0)

    seq_lens = [p + s.image_tokens for p in s.prefixes]
    blocks_per_row = [_cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_row) + 8  # a few spare blocks
    layer_names = [f"model.layers.{i}.self_attn" for i in range(s.layers)]

    spec = dk.AttentionSpec(
        block_size=block_size, num_kv_heads=s.kv_heads, head_size=s.head_size, dtype=cache_dtype
    )
    kv_cache_config = dk.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_groups=[dk.KVCacheGroup(layer_names, spec)]
    )
    cache_config = (
        dk.CacheConfig(block_size=block_size, cache_dtype="fp8", calculate_kv_scales=True)
        if fp8
        else dk.CacheConfig(block_size=block_size)
    )
    config = dk.DiffusionConfig(dk.ModelConfig(s.dtype), cache_config)
    block_tables = dk.BlockTables(
        block_sizes=[block_size],
        max_num_reqs=2,
        max_num_batched_tokens=sum(seq_lens),
        max_num_blocks_per_group=[max(blocks_per_row)],
        device=device,
    )
    attention = SimpleNamespace(num_heads=s.heads, softmax_scale=scale)
    layers = {
        name: dk.DiffusionPagedAttentionLayerAdapter(
            layer_name=name, layer=attention, spec=spec, vllm_config=config, device=device
        )
        for name in layer_names
    }
    caches = dk.allocate_kv_caches(kv_cache_config, dtype=cache_dtype, device=device, layers=layers)
    kv_bytes = sum(cache.numel() * cache.element_size() for cache in caches.values())
    activation_bytes = (
        sum(cache.numel() for cache in caches.values()) * torch.empty((), dtype=s.dtype).element_size()
    )

    # The Scheduler's job: blocks from the pool, in a shuffled order, installed per row.
    pool = dk.BlockPool(num_blocks)
    pool.allocate(3)  # blocks other requests hold
    bindings = {}
    prefill_rows, denoise_rows = [], []
    for row, (prefix, seq_len, nblk) in enumerate(zip(s.prefixes, seq_lens, blocks_per_row, strict=True)):
        ids = pool.allocate(nblk)
        ids = [ids[i] for i in torch.randperm(len(ids)).tolist()]
        block_tables.append_block_ids(row, [ids], overwrite=True)
        bindings[("image-0", row, None)] = dk.DiffusionPagedAttentionRowBinding(
            row_index=row, max_seq_len=seq_len
        )
        prefill_rows.append(dk.DiffusionPagedAttentionRow("image-0", seq_len, seq_len, 0, sequence_id=row))
        denoise_rows.append(
            dk.DiffusionPagedAttentionRow("image-0", s.image_tokens, seq_len, prefix, sequence_id=row)
        )
    blocks_used = num_blocks - pool.num_free - 3

    adapter = dk.DiffusionPagedAttentionAdapter(
        vllm_config=config,
        device=device,
        kv_cache_config=kv_cache_config,
        block_tables=block_tables,
        attn_groups=[[dk.AttentionGroup(layer_names)]],
        layers=layers,
        resolve_row=lambda request_id, sequence_id, context_id: bindings[
            (request_id, sequence_id, context_id)
        ],
    )
    metadata = dk.DiffusionPagedAttentionMetadata(
        prefill_rows=tuple(prefill_rows), denoise_rows=tuple(denoise_rows)
    )
    spans = [[(p, p + s.image_tokens)] for p in s.prefixes]
    omni_metadata = dk.AttentionMetadata(full_attn_spans=spans)

    print(
        f"diffkv demo on {device}: {s.layers} layers, heads {s.heads}/{s.kv_heads} x {s.head_size}, "
        f"{str(s.dtype).replace('torch.', '')}, rows with prefixes {list(s.prefixes)} + {s.image_tokens} "
        f"image tokens, block size {block_size}"
    )
    kv_name = str(cache_dtype).replace("torch.", "")
    act_name = str(s.dtype).replace("torch.", "")
    if fp8:
        print(
            f"KV cache: {kv_bytes / 2**20:.1f} MiB of {kv_name} ({act_name} would take "
            f"{activation_bytes / 2**20:.1f} MiB)"
        )
    else:
        print(f"KV cache: {kv_bytes / 2**20:.1f} MiB of {kv_name}")
    print(f"{'step':>4} {'phase':>8} {'tokens':>7} {'ms/step':>9} {'max err':>9} {'KV blocks':>9}")
    runtime = dk.DiffusionPagedAttentionRuntime(adapter, metadata)
    try:
        worst, v_max = _demo_steps(
            s, device, runtime, metadata, layer_names, layers, omni_metadata, scale, blocks_used
        )
    except NotImplementedError as exc:  # e.g. an fp8 cache on a GPU without diffkv's e4m3 kernel
        print(f"diffkv demo: {exc}", file=sys.stderr)
        return 2
    tol = 2e-2 if s.dtype != torch.float32 else 1e-4
    if fp8:
        # K and V are stored rounded to e4m3 (3 mantissa bits: at most 2^-4 relative); an output
        # is a weighted mean of dequantized V rows (a causal row's first token sees one key: its V
        # exactly), so V's rounding bounds the error, plus the reference tolerance for K's.  On
        # CUDA the e4m3 kernel also rounds the weights P (another 2^-4 relative at most) and Q
        # (like K's rounding).
        tol += v_max * 2.0**-4 * (2 if device.type == "cuda" else 1)
    ok = worst <= tol
    print(
        f"max error {worst:.2e} ({'ok' if ok else 'FAILED'}: tolerance {tol:.1e} vs a float32 reference"
        + (" on the unquantized K/V" if fp8 else "")
        + ")"
    )
    return 0 if ok else 1


def _demo_steps(s, device, runtime, metadata, layer_names, layers, omni_metadata, scale, blocks_used):
    """The demo's prefill and denoise steps, each timed and checked against a float32 dense
    reference; prints a line per step and returns (the largest error, the largest |V| written)."""
    # The dense reference keeps its own K/V per layer and row.
    dense_k = {name: [None, None] for name in layer_names}
    dense_v = {name: [None, None] for name in layer_names}
    v_max = 0.0  # max |V| written: the fp8 tolerance's scale
    worst = 0.0
    with runtime.activate():
        for step in range(s.steps + 1):
            active = runtime.ensure_active(step)
            rows = metadata.rows_for_step(step)
            num_tokens = sum(r.query_len for r in rows)
            elapsed = 0.0
            step_err = 0.0
            for name in layer_names:
                if step == 0:
                    # Prefill: rows of different lengths, packed [T, H, D].
                    q = torch.randn(num_tokens, s.heads, s.head_size, device=device, dtype=s.dtype)
                    k = torch.randn(num_tokens, s.kv_heads, s.head_size, device=device, dtype=s.dtype)
                    v = torch.randn(num_tokens, s.kv_heads, s.head_size, device=device, dtype=s.dtype)
                else:
                    # Denoise: equal image spans, batched [B, T, H*D] as a model produces them.
                    shape = (len(rows), s.image_tokens)
                    q = torch.randn(*shape, s.heads * s.head_size, device=device, dtype=s.dtype)
                    k = torch.randn(*shape, s.kv_heads * s.head_size, device=device, dtype=s.dtype)
                    v = torch.randn(*shape, s.kv_heads * s.head_size, device=device, dtype=s.dtype)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                context = active.prepare_layer_context(name, q, k, v, omni_attn_metadata=omni_metadata)
                out = layers[name].impl.forward_paged(context)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed += time.perf_counter() - start

                v_max = max(v_max, v.abs().max().item())
                qf = q.reshape(-1, s.heads, s.head_size)
                kf = k.reshape(-1, s.kv_heads, s.head_size)
                vf = v.reshape(-1, s.kv_heads, s.head_size)
                of = out.reshape(-1, s.heads, s.head_size)
                offset = 0
                for r, row in enumerate(rows):
                    sl = slice(offset, offset + row.query_len)
                    if step == 0:
                        dense_k[name][r], dense_v[name][r] = kf[sl].clone(), vf[sl].clone()
                    else:
                        dense_k[name][r][row.kv_start_pos :] = kf[sl]
                        dense_v[name][r][row.kv_start_pos :] = vf[sl]
                    ref = _reference(qf[sl], dense_k[name][r], dense_v[name][r], s.prefixes[r], scale)
                    step_err = max(step_err, (of[sl].float() - ref).abs().max().item())
                    offset += row.query_len
            worst = max(worst, step_err)
            phase = "prefill" if step == 0 else "denoise"
            ms = elapsed * 1e3
            print(f"{step:>4} {phase:>8} {num_tokens:>7} {ms:>9.2f} {step_err:>9.2e} {blocks_used:>9}")
    return worst, v_max


def _cuda_version(v: int) -> str:
    """CUDA's 1000 major + 10 minor form as "13.0"."""
    return f"{v // 1000}.{v % 1000 // 10}"


def info(args):
    del args
    build = _C.build_info()
    print(f"diffkv {dk.__version__}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {sys.version.split()[0]}")
    print(f"C extension: {build['limited_api']}, CUDA compiled in: {build['cuda_compiled']}")
    if build["cuda_compiled"]:
        runtime, driver = build["cuda_runtime_version"], build["cuda_driver_version"]
        print(f"  built with CUDA {_cuda_version(runtime)}, targets {build['archs']}")
        print(f"  NVIDIA driver: {'CUDA ' + _cuda_version(driver) if driver else 'none found'}")
        refusal = _C.driver_check(driver, runtime)
        if refusal is not None and driver:
            print(f"  {refusal}")
        kernels = {
            "sm90-tma": (
                "sm90-tma (warp-specialized wgmma: at head 128 sm90-tma16 -- one TMA box per 16-key"
                " chunk for K and V -- for blocks of 16 n keys in any order, persistent (sm90-persist)"
                " for short unmasked calls of uniform rows; at 64 and 128 TMA boxes"
                " for power-of-two blocks of 32+ keys and runs of consecutive blocks; sm90-ws,"
                " cp.async, otherwise and at the other head sizes; e4m3 wgmma for fp8 caches at 64 and 128,"
                " mma.sync's e4m3 form at the other sizes)"
            ),
            "sm90": "sm90 (wgmma, Hopper)",
            "sm80": "sm80 (mma.sync)",
            "none": "none (no device)",
        }
        print(f"  fp16/bf16 attention kernel on the current device: {kernels[build['attention_kernel']]}")
    print(f"tensor bridge: {_C.bridge_path(torch.empty(0))} (DLPack C exchange API or to_dlpack capsules)")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            print(f"cuda:{i}: {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    else:
        print("no CUDA device visible")
    return 0


def bench(args, parser):
    from diffkv import _bench_cli

    return _bench_cli.run(args, parser)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m diffkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run the built-in HunyuanImage-3.0-shaped denoise loop")
    p_demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p_demo.add_argument("--layers", type=int, default=None)
    p_demo.add_argument("--steps", type=int, default=None, help="denoise steps after the prefill step")
    p_demo.add_argument("--small", action="store_true", help="the CPU-sized problem even on a GPU")
    p_demo.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="fp8: a float8_e4m3fn KV cache with scales from the first write (CPU, or CUDA on Hopper)",
    )
    sub.add_parser("info", help="versions, build flags, devices")
    p_bench = sub.add_parser(
        "bench",
        help="paged attention TFLOP/s vs torch SDPA/FlexAttention: JSON, table, PNG plot",
        description="Sweeps sequence length x rows x block size on the current GPU, timing diffkv "
        "against torch SDPA (flash, cuDNN) and compiled FlexAttention on the same data; writes "
        "bench.json under --out, prints the table and, with matplotlib installed (pip install "
        "'diffkv[bench]'), draws bench.png.  --plot bench.json draws the plot of a record written "
        "earlier and runs nothing.",
    )
    from diffkv import _bench_cli

    _bench_cli.add_arguments(p_bench)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench(args, p_bench)
    return {"demo": demo, "info": info}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
