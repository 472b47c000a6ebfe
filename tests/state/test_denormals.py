"""S9: denormals are flushed on every thread that computes, and the run records it.

The threads are set in this process (two, whatever the machine's default). Independent
expectation: IEEE arithmetic, written out. A float32 denormal times 1.0 is itself when
denormals are computed on, and 0 when they are flushed (denormals-are-zero); a chunk of
an element-wise op computed by a thread left unset keeps its denormals. Negative
controls: the setting off (every element survives), and PyTorch's own
``torch.set_flush_denormal``, which sets the calling thread only (the worker's chunk
survives: the defect this module exists for).
"""

from __future__ import annotations

import json

import pytest
import torch
from run_support import TINY, set_args
from text_corpus import write_corpus

from exactstep.cli import main
from exactstep.state import denormals, environment

pytestmark = pytest.mark.skipif(not denormals.supported(),
                                reason="this CPU cannot flush denormals")


@pytest.fixture
def two_threads():
    """Two intra-op threads in this process, and the process's settings back after."""
    with environment.numerics_restored():
        torch.set_num_threads(2)
        yield


def surviving_per_half(n: int = 1 << 18) -> list[int]:
    """How many of ``n`` denormals survive ``x * 1.0`` in each half of the op: with two
    threads and ATen's static split, the first half is the calling thread's chunk and
    the second the worker's."""
    bits = 0x00400000  # exponent field 0, fraction non-zero: a denormal (2**-127)
    assert (bits >> 23) & 0xFF == 0 and bits & 0x7FFFFF != 0
    x = torch.full((n,), bits, dtype=torch.int32).view(torch.float32)  # no arithmetic
    y = x.mul(1.0).view(torch.int32)  # read as bits: a float comparison would flush too
    return [int((y[: n // 2] != 0).sum()), int((y[n // 2:] != 0).sum())]


def test_every_thread_flushes_when_set_and_none_when_not(two_threads):
    n = 1 << 18
    assert denormals.set_flush_denormal(False) is False
    assert surviving_per_half(n) == [n // 2, n // 2]  # computed on: x * 1.0 == x
    assert not denormals.flushed_here() and not denormals.flushed()

    assert denormals.set_flush_denormal(True) is True
    assert surviving_per_half(n) == [0, 0]  # the worker's chunk flushed too
    assert denormals.flushed_here() and denormals.flushed()

    # negative control: PyTorch's own switch, with the worker already started unset,
    # flushes the calling thread's chunk only; flushed() sees it
    denormals.set_flush_denormal(False)
    torch.set_flush_denormal(True)
    assert surviving_per_half(n) == [0, n // 2]
    assert denormals.flushed_here() and not denormals.flushed()


def test_a_thread_woken_later_by_a_larger_count_flushes_too(two_threads):
    """Threads the pool keeps idle keep their register: set while the run used one
    thread, a second thread woken later must flush as well."""
    denormals.set_flush_denormal(False)
    assert surviving_per_half() != [0, 0]  # the worker exists, unset
    torch.set_num_threads(1)
    denormals.set_flush_denormal(True)
    torch.set_num_threads(2)
    assert surviving_per_half() == [0, 0]


def test_numerics_restored_gives_a_library_caller_its_setting_back():
    with environment.numerics_restored():
        denormals.set_flush_denormal(False)
        with environment.numerics_restored():
            assert denormals.set_flush_denormal(True)
        assert not denormals.flushed_here() and not denormals.flushed()


def ledger_events(run_dir) -> list[dict]:
    lines = (run_dir / "ledger.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "event" in r]


def test_the_run_records_the_setting_and_a_resume_restores_or_declares_it(tmp_path, capsys):
    """The default flushes and the manifest's environment says so (the config keeps no
    copy: it asks, the environment records what was got); ``false`` is recorded as
    false; a plain resume restores the recorded setting (no CONTINUATION line); a
    resume given the other setting is a declared, non-bitwise continuation."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus)
    pairs = {**TINY, "data.source": corpus, "train.steps": 4, "checkpoint.every": 2,
             "train.threads": 1, "train.eval_tokens": 32}
    runs = {}
    with environment.numerics_restored():
        denormals.set_flush_denormal(False)  # the caller's setting, kept after the runs
        for name, extra in {"default": {}, "off": {"numerics.flush_denormal": "false"}}.items():
            runs[name] = tmp_path / name
            argv = ["train", "--no-progress", "--out", str(runs[name]),
                    *set_args({**pairs, **extra})]
            assert main(argv) == 0
            assert not denormals.flushed_here()  # the process's own setting back
    for name, expected in {"default": True, "off": False}.items():
        manifest = json.loads((runs[name] / "manifest.json").read_text())["manifest"]
        assert manifest["environment"]["flush_denormal"] is expected
        assert "flush_denormal" not in manifest["config"]["numerics"]

    # a plain resume from the window-2 checkpoint restores what was recorded
    def resume(name: str, *extra: str) -> str:
        capsys.readouterr()
        assert main(["resume", "--no-progress", str(runs[name]), "--from",
                     str(runs[name] / "checkpoints" / "window-00000002"), *extra]) == 0
        said = capsys.readouterr()
        return said.out + said.err

    for name in runs:
        assert "non-bitwise" not in resume(name)
        assert ledger_events(runs[name]) == []
    # negative control: the other setting, asked for explicitly, is declared
    said = [line for line in resume("off", "--set", "numerics.flush_denormal=true").splitlines()
            if "non-bitwise" in line]
    assert len(said) == 1 and "flush_denormal False -> True" in said[0]
    (event,) = ledger_events(runs["off"])
    assert event["differs"] == ["flush_denormal False -> True"] and event["next_window"] == 2
