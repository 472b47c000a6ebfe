"""Test-suite root: puts ``tests/`` on ``sys.path`` so shared helpers (``text_corpus``)
import from any test directory, and keeps the tracking libraries' own caches (W&B's
service logs, its settings) in a temporary directory instead of the user's home.
``one_thread``: one intra-op thread for a test (tiny shapes whose tolerances were
measured so), the caller's count given back after."""

import os
import tempfile

import pytest
import torch

_TRACKING_HOME = tempfile.mkdtemp(prefix="exactstep-tests-tracking-")
for _name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    os.environ.setdefault(_name, os.path.join(_TRACKING_HOME, _name.lower()))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
