"""Test-wide setup: run Triton kernels through the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton decorates any kernel (it is read at ``@triton.jit`` time), so it
is set here, before any test module imports distattn's Triton backend.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    from slow_tests import mark_slow  # the slow tier, measured (tests/slow_tests.py)

    mark_slow(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
