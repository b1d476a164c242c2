"""Fixtures shared by the stack tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread in this process for a module's tests: CPU steps of the tiny models
    are dominated by thread hand-offs, and on a shared machine two OpenMP threads make each step
    ten times slower. The in-process engines and the executors served in this process share it."""
    import torch  # here, not at the top: collecting the torch-free stack tests stays torch-free

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
