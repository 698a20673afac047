"""Times the dense forward over fp8 K/V (``DiffKVAttentionImpl.forward`` with
``extra["kv_cache_dtype"] = "fp8"``: the rounding of K/V and the attention) on a few shapes,
printing each one's median of 15 calls, its TFLOP/s and the attention kernel that ran.  For
A/Bs of builds with dev/ab.sh or by hand (session 45, docs/fp8-log.md):

    PYTHONPATH=python python3 dev/dense_fp8.py
    PYTHONPATH=devrun/NAME/python python3 dev/dense_fp8.py

The shapes (B x H x S x D): Wan 2.1's 1x40x32760x128 without and with a causal mask (32,760
keys: 8-key blocks before session 45), HunyuanImage-3.0's 2x32x4097x128 (an odd key count:
one-key blocks before), 1x24x16384x64, packed documents (``cu_seqlens``) of 4,096 and 4,100
keys, four of each in one row of 24 heads x 128 (and the 4,096-key ones with their offsets on
the device), a key-padded 2x32x4097x128 (every tenth key masked out), and joint tokens (4,096
image tokens after 512 text tokens, batch 1, and after 333, batch 2; 24 heads x 128).  CUDA
only; no L2 flush (an A/B, not a table).
"""

import statistics

import torch

from diffkv import _C
from diffkv.backends.abstract import AttentionMetadata
from diffkv.backends.diffkv import DiffKVAttentionImpl

SHAPES = (
    (1, 40, 32760, 128, False),
    (1, 40, 32760, 128, True),
    (2, 32, 4097, 128, False),
    (1, 24, 16384, 64, False),
)
DOCS = ((4, 24, 4096, 128), (4, 24, 4100, 128))  # documents x heads x keys each x head size
# joint tokens: batch x heads x image tokens x text tokens x head size (Flux-like: 512 text
# tokens; SD3-like: 333, CFG's batch of 2)
JOINT = ((1, 24, 4096, 512, 128), (2, 24, 4096, 333, 128))


def _time(impl, q, k, v, meta) -> tuple[float, str]:
    """Median µs of 15 calls after 3, and the attention kernel that ran."""
    for _ in range(3):
        impl.forward(q, k, v, meta)
    kernel = _C.last_attention_kernel()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        impl.forward(q, k, v, meta)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times), kernel


def main() -> None:
    meta = AttentionMetadata(extra={"kv_cache_dtype": "fp8"})
    for b, h, s, d, causal in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(b, s, h, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3)
        )
        impl = DiffKVAttentionImpl(
            num_heads=h, head_size=d, softmax_scale=d**-0.5, causal=causal, num_kv_heads=h
        )
        us, kernel = _time(impl, q, k, v, meta)
        pairs = s * s / (2 if causal else 1)
        tflops = 4 * b * h * d * pairs / us / 1e6
        print(f"{b}x{h}x{s}x{d} causal={causal}: {us:.1f} us, {tflops:.1f} TFLOP/s, kernel {kernel}")
    for (n, h, s, d), where in [(shape, "host") for shape in DOCS] + [(DOCS[0], "cuda")]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(1, n * s, h, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3)
        )
        cu = torch.arange(n + 1, dtype=torch.int32, device="cuda" if where == "cuda" else "cpu") * s
        extra = {
            "kv_cache_dtype": "fp8",
            "cu_seqlens_q": cu,
            "cu_seqlens_k": cu,
            "max_seqlen_q": s,
            "max_seqlen_k": s,
        }
        impl = DiffKVAttentionImpl(num_heads=h, head_size=d, softmax_scale=d**-0.5, num_kv_heads=h)
        us, kernel = _time(impl, q, k, v, AttentionMetadata(extra=extra))
        tflops = 4 * n * h * d * s * s / us / 1e6
        print(
            f"{n} documents x{h}x{s}x{d} ({where} offsets): {us:.1f} us, {tflops:.1f} TFLOP/s, "
            f"kernel {kernel}"
        )
    # key padding: 2x32x4097x128 with every tenth key of each row masked out (attn_mask)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 4097, 32, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3)
    )
    keep = torch.ones(2, 4097, dtype=torch.bool, device="cuda")
    keep[:, ::10] = False
    impl = DiffKVAttentionImpl(num_heads=32, head_size=128, softmax_scale=128**-0.5, num_kv_heads=32)
    us, kernel = _time(impl, q, k, v, AttentionMetadata(attn_mask=keep, extra={"kv_cache_dtype": "fp8"}))
    tflops = 4 * 2 * 32 * 128 * 4097 * int(keep[0].sum()) / us / 1e6
    print(f"2x32x4097x128 attn_mask (90 % kept): {us:.1f} us, {tflops:.1f} TFLOP/s, kernel {kernel}")
    for b, h, s, j, d in JOINT:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(b, s, h, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3)
        )
        jq, jk, jv = (
            torch.randn(b, j, h, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3)
        )
        meta = AttentionMetadata(
            joint_query=jq, joint_key=jk, joint_value=jv, extra={"kv_cache_dtype": "fp8"}
        )
        impl = DiffKVAttentionImpl(num_heads=h, head_size=d, softmax_scale=d**-0.5, num_kv_heads=h)
        us, kernel = _time(impl, q, k, v, meta)
        tflops = 4 * b * h * d * (s + j) ** 2 / us / 1e6
        print(f"joint {b}x{h}x({s}+{j})x{d}: {us:.1f} us, {tflops:.1f} TFLOP/s, kernel {kernel}")


if __name__ == "__main__":
    main()
