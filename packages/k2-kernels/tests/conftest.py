"""Shared fixtures of the k2-kernels tests."""

import pytest
import torch


@pytest.fixture(params=[1, 2, 3], ids=lambda t: f"threads{t}")
def threads(request):
    """torch's thread count for the test (the CPU kernels follow it): 1, 2 and 3 (more than this
    2-core machine has, so uneven splits are exercised too)."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)
