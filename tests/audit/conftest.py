"""The audit's tests run tiny shapes: one intra-op thread each, as ``run_audit`` does
(on a shared machine more threads only wait for each other)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py
    yield
