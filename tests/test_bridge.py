"""The tensor bridge: what C sees of a torch tensor, through both DLPack paths."""

import re

import pytest
import torch

from diffkv import _C


@pytest.fixture(params=["auto", "capsule"])
def bridge_path(request):
    _C.set_bridge_path(request.param)
    yield request.param
    _C.set_bridge_path("auto")


def test_paths_available():
    t = torch.zeros(3)
    expected = "exchange" if hasattr(type(t), "__dlpack_c_exchange_api__") else "capsule"
    assert _C.bridge_path(t) == expected
    _C.set_bridge_path("capsule")
    try:
        assert _C.bridge_path(t) == "capsule"
    finally:
        _C.set_bridge_path("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64])
def test_tensor_info_matches_torch(device, bridge_path, dtype):
    base = torch.zeros(6, 5, 4, dtype=dtype, device=device)
    view = base.permute(2, 0, 1)[1:, :, 2:]
    info = _C.tensor_info(view)
    assert info["data_ptr"] == view.data_ptr()
    assert info["dtype"] == str(dtype).replace("torch.", "")
    assert info["device_type"] == device.type
    assert info["shape"] == tuple(view.shape)
    assert info["strides"] == view.stride()
    assert info["path"] == ("capsule" if bridge_path == "capsule" else _C.bridge_path(view))


def test_requires_grad_and_parameter(bridge_path):
    p = torch.nn.Parameter(torch.ones(2, 3))
    info = _C.tensor_info(p)
    assert info["shape"] == (2, 3) and info["data_ptr"] == p.data_ptr()


def test_not_a_tensor():
    with pytest.raises(TypeError, match=re.escape("tensor_info(): tensor must be a torch.Tensor, got list")):
        _C.tensor_info([1, 2, 3])


def test_bad_path_name():
    with pytest.raises(
        ValueError, match=re.escape("set_bridge_path(): path must be 'auto' or 'capsule', got 'fast'")
    ):
        _C.set_bridge_path("fast")


def test_noop4(device, bridge_path):
    tensors = [torch.zeros(4, device=device) for _ in range(4)]
    assert _C.bridge_noop4(*tensors) is None
    with pytest.raises(TypeError, match=re.escape("bridge_noop4(): c must be a torch.Tensor, got int")):
        _C.bridge_noop4(tensors[0], tensors[1], 3, tensors[3])


def test_both_paths_give_the_same_attention(device):
    """The same kv_write through either path writes identical bytes."""
    key = torch.randn(5, 2, 8, device=device)
    value = torch.randn(5, 2, 8, device=device)
    slots = torch.tensor([3, 0, -1, 7, 2], dtype=torch.int64, device=device)
    caches = []
    for path in ("auto", "capsule"):
        _C.set_bridge_path(path)
        try:
            cache = torch.zeros(2, 2, 4, 2, 8, device=device)
            _C.kv_write(key, value, cache, slots)
            caches.append(cache)
        finally:
            _C.set_bridge_path("auto")
    assert torch.equal(caches[0], caches[1])
    assert torch.equal(caches[0][0].reshape(-1, 2, 8)[3], key[0])
