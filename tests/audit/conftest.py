"""The audit's tests run tiny shapes: one intra-op thread each, as ``run_audit`` does
(on a shared machine more threads only wait for each other)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
