"""Shared fixtures: one suite, two backends (cpu everywhere, cuda under the gpu marker)."""

import pytest
import torch

from diffkv import _C


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The device a test runs on: 'cpu' always, 'cuda' on a GPU machine (-m gpu)."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def attention_kernel():
    """_C.set_attention_kernel for one test: the choice starts at 'auto' and is restored after."""
    previous = _C.set_attention_kernel("auto")
    yield _C.set_attention_kernel
    _C.set_attention_kernel(previous)
