"""The fp8 dense forward's rounding of its keys and values, ``_C.quantize_kv``: the scales are
``amax / 448`` over key and joint key and over value and joint value (1 where that is not > 0),
the correctly rounded fp32 division on every device, and every byte is torch's
``(x.float() / scale).clamp(-448, 448).to(float8_e4m3fn)`` -- on the CPU reference and on the
CUDA kernels (the amax kernel's 16-byte and single-element paths, the fp8 write's wide, vec and
strided ones), checked on every finite 16-bit value, on strided and misaligned views, on NaN,
infinity, zeros and subnormals, and the CUDA bytes against the CPU's.  Its refusals are in
error_cases.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from diffkv import _C

F8 = torch.float8_e4m3fn


def _torch_scale(*xs: torch.Tensor | None) -> torch.Tensor:
    """The scale over the given tensors (None: absent), float32 [1], by torch.  The divisor is a
    tensor: on CUDA torch divides by a Python number as a product with its rounded reciprocal
    (``amax * RN(1 / 448)``, one ulp off the quotient for about half of all amax values), on
    the CPU it divides; diffkv's scale is the quotient on both."""
    amax = torch.stack(
        [x.abs().amax().float() for x in xs if x is not None and x.numel() > 0]
        or [torch.zeros((), device=xs[0].device)]
    ).amax()
    return torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax)).reshape(1)


def _torch_bytes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(F8).view(torch.uint8)


def _quantize(k, v, jk=None, jv=None):
    """_C.quantize_kv into fresh outputs: (outputs as bytes, scales)."""
    outs = [
        torch.full(x.shape, 0x55, dtype=torch.uint8, device=x.device).view(F8)
        for x in (k, v, jk, jv)
        if x is not None
    ]
    scales = torch.full((2,), -7.0, device=k.device)
    joint = outs[2:] if jk is not None else [None, None]
    _C.quantize_kv(k, v, outs[0], outs[1], scales, jk, jv, *joint)
    return [o.view(torch.uint8) for o in outs], scales


def _check(k, v, jk=None, jv=None):
    outs, scales = _quantize(k, v, jk, jv)
    ks, vs = _torch_scale(k, jk), _torch_scale(v, jv)
    assert torch.equal(scales.cpu().view(torch.int32), torch.cat([ks, vs]).cpu().view(torch.int32))
    want = [_torch_bytes(k, ks), _torch_bytes(v, vs)]
    if jk is not None:
        want += [_torch_bytes(jk, ks), _torch_bytes(jv, vs)]
    for got, exp in zip(outs, want, strict=True):
        assert torch.equal(got, exp)
    return outs, scales


def _finite_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every finite bit pattern of a 16-bit dtype (subnormals, +-0), padded by repeating, as
    [N, 2, 64]."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.isfinite(x)]
    n = -(-x.numel() // 128) * 128
    return torch.cat([x, x[: n - x.numel()]]).reshape(-1, 2, 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_finite_16_bit_value_rounds_as_torch_does(device, dtype):
    x = _finite_patterns(dtype).to(device)
    # keys: every value (the scale from the largest); values: every value scaled down, so that
    # their scale is another power and subnormals of the quotient occur
    _check(x, x * 0.001)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "heads_major", "dim_strided", "misaligned"])
def test_layouts_and_joint_pairs(device, dtype, layout):
    g = torch.Generator().manual_seed(7)

    def make(n, scale):
        x = (torch.randn(n, 4, 48, generator=g) * scale).to(dtype)
        if layout == "heads_major":  # heads before tokens in memory
            x = x.transpose(0, 1).contiguous().transpose(0, 1)
        elif layout == "dim_strided":  # every other element of a wider row
            x = torch.stack([x, -x], dim=-1).reshape(n, 4, 96)[:, :, ::2]
        elif layout == "misaligned":  # one element off 16-byte alignment
            x = torch.cat([torch.zeros(1, dtype=dtype), x.reshape(-1)])[1:].view(n, 4, 48)
        return x.to(device)

    k, v = make(131, 3.0), make(131, 0.02)
    _check(k, v)
    # the joint pair holds the keys' largest magnitude, the main pair the values'
    jk, jv = make(9, 40.0), make(9, 1e-4)
    _check(k, v, jk, jv)
    # no main tokens, only joint ones
    _check(k[:0], v[:0], jk, jv)


@pytest.mark.parametrize("strategy", ["front", "rear"])
@pytest.mark.parametrize(("batch", "s", "j"), [(3, 37, 11), (2, 256, 77), (1, 5, 0), (2, 0, 9)])
def test_joint_rows_of_one_buffer(device, strategy, batch, s, j):
    """4-d outputs ``[B, S, Hkv, D]``: the main and joint pairs written into their rows of one
    ``[2, B, J + S, Hkv, D]`` buffer (the dense fp8 forward's joint layout), their rows
    interleaving batch row by batch row -- every byte torch's, no byte outside the views
    touched (the buffer's extra row keeps its fill)."""
    g = torch.Generator().manual_seed(11)
    k, v = (torch.randn(batch, s, 4, 64, generator=g) * c for c in (2.0, 0.5))
    jk, jv = (torch.randn(batch, j, 4, 64, generator=g) * c for c in (9.0, 0.1))
    k, v, jk, jv = (x.to(torch.bfloat16).to(device) for x in (k, v, jk, jv))
    n = s + j
    buf = torch.full((2, batch, n + 1, 4, 64), 0x55, dtype=torch.uint8, device=device).view(F8)
    main, joint = (slice(j, n), slice(0, j)) if strategy == "front" else (slice(0, s), slice(s, n))
    scales = torch.empty(2, device=device)
    flat = [x.reshape(-1, 4, 64) for x in (k, v, jk, jv)]
    _C.quantize_kv(
        flat[0], flat[1], buf[0, :, main], buf[1, :, main], scales,
        flat[2], flat[3], buf[0, :, joint], buf[1, :, joint],
    )  # fmt: skip
    ks, vs = _torch_scale(k, jk), _torch_scale(v, jv)
    assert torch.equal(scales.cpu().view(torch.int32), torch.cat([ks, vs]).cpu().view(torch.int32))
    got = buf.view(torch.uint8)
    for i, (x, xj, sc) in enumerate(((k, jk, ks), (v, jv, vs))):
        assert torch.equal(got[i, :, main], _torch_bytes(x, sc))
        assert torch.equal(got[i, :, joint], _torch_bytes(xj, sc))
        assert bool((got[i, :, n] == 0x55).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nan_inf_zeros_and_subnormals(device, dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(17, 2, 32, generator=g).to(dtype)
    tiny = torch.finfo(dtype).smallest_normal / 8  # subnormal
    cases = {
        "nan": base.clone().index_put_(
            (torch.tensor([5]), torch.tensor([1]), torch.tensor([3])), torch.tensor(float("nan"), dtype=dtype)
        ),
        "inf": base.clone().index_put_(
            (torch.tensor([2]), torch.tensor([0]), torch.tensor([9])),
            torch.tensor(float("-inf"), dtype=dtype),
        ),
        "zeros": torch.zeros_like(base),
        "subnormal": torch.full_like(base, tiny) * torch.sign(base),
    }
    for (name, x), strided in itertools.product(cases.items(), (False, True)):
        if strided:  # a dim stride of 2: the single-element paths on CUDA
            x = torch.stack([x, x], dim=-1).flatten(-2)[..., ::2]
        x = x.to(device)
        outs, scales = _check(x, base.to(device))
        s = float(scales[0])
        if name in ("nan", "zeros"):
            assert s == 1.0, name
        elif name == "inf":
            assert s == float("inf")
        else:
            assert 0 < s < 1e-7, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_bytes_equal_the_cpu_reference(dtype):
    g = torch.Generator().manual_seed(3)
    k = (torch.randn(2000, 8, 128, generator=g) * 5).to(dtype)
    v = torch.randn(2000, 8, 128, generator=g).to(dtype)
    jk = torch.randn(333, 8, 128, generator=g).to(dtype)
    jv = (torch.randn(333, 8, 128, generator=g) * 9).to(dtype)
    cpu, cpu_scales = _quantize(k, v, jk, jv)
    gpu, gpu_scales = _quantize(*(x.cuda() for x in (k, v, jk, jv)))
    assert torch.equal(gpu_scales.cpu(), cpu_scales)
    for a, b in zip(gpu, cpu, strict=True):
        assert torch.equal(a.cpu(), b)


@pytest.mark.gpu
def test_cuda_graph_replay_takes_new_inputs():
    """Captured, the call reads its inputs at each replay: the scales and bytes follow them
    (nothing was computed on the host)."""
    k = torch.randn(256, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ko, vo = torch.empty_like(k, dtype=F8), torch.empty_like(v, dtype=F8)
    scales = torch.empty(2, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _C.quantize_kv(k, v, ko, vo, scales, None, None, None, None)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            _C.quantize_kv(k, v, ko, vo, scales, None, None, None, None)
    k.mul_(3.5)
    v.copy_(torch.randn_like(v) * 0.01)
    graph.replay()
    torch.cuda.synchronize()
    ks, vs = _torch_scale(k), _torch_scale(v)
    assert torch.equal(scales, torch.cat([ks, vs]))
    assert torch.equal(ko.view(torch.uint8), _torch_bytes(k, ks))
    assert torch.equal(vo.view(torch.uint8), _torch_bytes(v, vs))
