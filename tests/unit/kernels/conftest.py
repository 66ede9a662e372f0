"""Kernel tests run Triton under its interpreter on CPU-only machines.

TRITON_INTERPRET must be set before triton is imported anywhere, hence at the very top of this conftest
(tests/conftest.py does the same; this is belt and braces for running this folder on its own).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _single_thread_torch():
    """Small tensors on a shared 2-core machine: intra-op threads only add contention (10-100x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
