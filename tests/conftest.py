"""Test configuration: Triton kernels run under the CPU interpreter when there is no GPU."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import tpo_kernels  # noqa: E402
from _backends import HAS_GPU  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
