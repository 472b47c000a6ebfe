"""The numerics environment (S9): what a bitwise continuation depends on besides the
state a checkpoint holds.

Thread count, PyTorch build, device, CPU kernel dispatch, the deterministic switch,
whether the model's forward is compiled (``train.compile``) and whether denormals are
flushed (``numerics.flush_denormal``, observed on every intra-op thread) are recorded
in the manifest and with each checkpoint; a resume that would change them is a declared,
non-bitwise continuation, never a silent one.
Design and derivations: docs/design/state.md#stateenvironmentpy (S9).
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from exactstep.state import denormals

#: The fields of a record, in the order they are printed.
FIELDS = ("threads", "torch", "device", "cpu_capability", "cpu", "deterministic",
          "gpu", "cuda", "compile", "flush_denormal")

#: What a field reads as in a record written before it was recorded (a run from
#: before ``numerics.flush_denormal`` computed on denormals).
ABSENT = {"compile": False, "flush_denormal": False}


def capture(device: torch.device | str, *, compiled: bool = False) -> dict[str, Any]:
    """This process's numerics environment as plain data (JSON-ready).

    Call it after the run has set its thread count: ``threads`` is the count PyTorch
    will use, not the one asked for. ``gpu`` and ``cuda`` are ``None`` on the CPU.
    ``compile``: whether the model's forward runs compiled (``train.compile``: other
    kernels, other rounding than eager). ``flush_denormal`` is observed, not asked:
    whether every intra-op thread flushes denormals now (``denormals.flushed``).
    """
    kind = torch.device(device).type
    on_cuda = kind == "cuda"
    return {
        "threads": torch.get_num_threads(),
        "torch": str(torch.__version__),
        "device": kind,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": cpu_model(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "gpu": torch.cuda.get_device_name(torch.device(device)) if on_cuda else None,
        "cuda": str(torch.version.cuda) if on_cuda else None,
        "compile": compiled,
        "flush_denormal": denormals.flushed(),
    }


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def recorded_value(record: Mapping[str, Any], key: str) -> Any:
    """``record[key]``, or what the field reads as in a record that predates it."""
    return record.get(key, ABSENT.get(key))


def differences(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[str]:
    """``field recorded -> current`` for each field that differs; a missing record
    (a run from before S9 was recorded) differs as a whole; a field a record predates
    reads as its ``ABSENT`` value."""
    if recorded is None:
        return ["environment not recorded"]
    before = {key: recorded_value(recorded, key) for key in FIELDS}
    now = {key: recorded_value(current, key) for key in FIELDS}
    return [f"{key} {before[key]!r} -> {now[key]!r}" for key in FIELDS
            if before[key] != now[key]]


def describe(record: Mapping[str, Any] | None) -> str:
    """One line: ``threads=1 torch=2.13.0+cpu device=cpu ...`` (``checkpoint verify``,
    ``eval``)."""
    if record is None:
        return "not recorded"
    return " ".join(f"{key}={record[key]!r}" if isinstance(record[key], str) and " " in
                    record[key] else f"{key}={record[key]}"
                    for key in FIELDS if record.get(key) is not None)


@contextlib.contextmanager
def numerics_restored() -> Iterator[None]:
    """Give the process its intra-op thread count and denormal setting back on exit: a
    run sets its own (``train.threads`` and ``numerics.flush_denormal``, or what its
    checkpoint recorded), a library caller's process keeps the ones it had."""
    previous = torch.get_num_threads()
    try:
        with denormals.denormals_restored():
            yield
    finally:
        torch.set_num_threads(previous)
