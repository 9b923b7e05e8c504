"""Test-wide settings: Triton's CPU interpreter when there is no GPU, and the `gpu` marker."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before the first `import triton` anywhere in the test session.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
