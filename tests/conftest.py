"""Test-suite root: puts ``tests/`` on ``sys.path`` so shared helpers (``text_corpus``)
import from any test directory, and keeps the tracking libraries' own caches (W&B's
service logs, its settings) in a temporary directory instead of the user's home.
``one_thread``: one intra-op thread for a test (tiny shapes whose tolerances were
measured so), the caller's count given back after; every test gets the process's
thread count and denormal setting back (``numerics_as_the_process_started``).

Idle OpenMP threads wait passively here (``OMP_WAIT_POLICY=PASSIVE`` unless the caller
set it; read once, when torch loads its OpenMP runtime, so it is set before the import
and inherited by every run a test starts). Two test workers each running a two-thread
run on two cores leave threads spinning for cores the other process needs: two such
10-window runs side by side took 23-26 s each spinning, 14 s passive. How a thread
waits changes no value, only who gets the core.

Each process that runs tests starts its process server (``process_server``) at once,
in the background, after the settings above: the commands the tests start are forks
of it, which imported torch and exactstep once, instead of fresh interpreters."""

import os
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import process_server  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

_TRACKING_HOME = tempfile.mkdtemp(prefix="exactstep-tests-tracking-")
for _name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    os.environ.setdefault(_name, os.path.join(_TRACKING_HOME, _name.lower()))


_BASELINE_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def numerics_as_the_process_started():
    """Each test starts and ends with the thread count and denormal setting this process
    started with: a run built in this process sets both (S9), a module-scoped fixture
    that builds one leaves them so, and flushed denormals reach Python's and NumPy's
    floats too (hypothesis refuses to draw subnormal floats under them)."""
    from exactstep.state import denormals

    def baseline() -> None:
        if torch.get_num_threads() != _BASELINE_THREADS:
            torch.set_num_threads(_BASELINE_THREADS)
        if denormals.flushed_here() or denormals.flushed():
            denormals.set_flush_denormal(False)

    baseline()
    yield
    baseline()


def pytest_configure(config):
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        process_server.start_server()  # a process that runs tests (not xdist's controller)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
