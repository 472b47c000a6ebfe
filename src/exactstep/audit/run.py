"""Resolve an audit target and run the probes against it (A1).

Targets: ``exactstep`` (``audit.engine``), ``python:MODULE:FUNCTION`` (``FUNCTION()``
returns a ``TrainingStep``; the current directory is importable, as with ``python -m``),
``hf-trainer[:COLLATOR]`` (``audit.hf_trainer``) and ``trl-sft[:VARIANT]``
(``audit.trl_sft``). An unresolvable target is a ``ConfigError`` (one ``error:`` line,
exit 2); a target that fails while probed is that probe's ``ERROR``.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from exactstep.errors import ConfigError

TARGETS = ("exactstep", "python:MODULE:FUNCTION", "hf-trainer", "hf-trainer:flattening",
           "hf-trainer:lora", "trl-sft", "trl-sft:assistant_only_loss", "trl-sft:padding_free", "trl-sft:packing")
METHODS = ("build", "logits", "train", "evaluate", "save", "load")


@dataclass
class AuditReport:
    target: str
    results: list = field(default_factory=list)  # probes.Result, in probe order
    seconds: float = 0.0

    @property
    def counts(self) -> dict[str, int]:
        from exactstep.audit.probes import ERROR, FAIL, NA, PASS

        return {s: sum(r.status == s for r in self.results) for s in (PASS, FAIL, NA, ERROR)}

    @property
    def ok(self) -> bool:
        """Every applicable probe passed (N/A is not a failure; ERROR is)."""
        counts = self.counts
        return counts["FAIL"] == 0 and counts["ERROR"] == 0

    def to_dict(self) -> dict:
        return {"target": self.target, "ok": self.ok, "seconds": round(self.seconds, 3),
                "counts": self.counts, "probes": [r.to_dict() for r in self.results]}


def resolve_target(target: str) -> object:
    """The ``TrainingStep`` named by ``target``; ``ConfigError`` when it cannot be had."""
    if target == "exactstep":
        from exactstep.audit.engine import make

        return make()
    if target.startswith("python:"):
        return python_target(target)
    if target == "hf-trainer" or target.startswith("hf-trainer:"):
        return hf_trainer_target(target)
    if target == "trl-sft" or target.startswith("trl-sft:"):
        return trl_sft_target(target)
    raise ConfigError(f"unknown audit target {target!r}; use one of: {', '.join(TARGETS)}")


def hf_trainer_target(target: str) -> object:
    """``hf-trainer[:padding|flattening|lora]``; needs the ``hf`` extra."""
    collator = target.partition(":")[2] or "padding"
    packages = ("transformers", "accelerate") + (("peft",) if collator == "lora" else ())
    for package in packages:  # Trainer needs the first two
        try:
            importlib.import_module(package)
        except ImportError:
            raise ConfigError(f"--target hf-trainer needs {package}: pip install "
                              "'exactstep[hf]'") from None
    from exactstep.audit.hf_trainer import make

    return make(collator)


def trl_sft_target(target: str) -> object:
    """``trl-sft[:VARIANT]`` (``exactstep.audit.trl_sft``); needs trl and the ``hf`` extra."""
    variant = target.partition(":")[2] or "completion_only_loss"
    for package in ("transformers", "accelerate", "datasets", "trl"):
        try:
            importlib.import_module(package)
        except ImportError:
            raise ConfigError(f"--target trl-sft needs {package}: pip install "
                              "'exactstep[hf]'") from None
    from exactstep.audit.trl_sft import make

    return make(variant)


def python_target(target: str) -> object:
    spec = target[len("python:"):]
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function:
        raise ConfigError(f"audit target {target!r} must read python:MODULE:FUNCTION "
                          "(e.g. python:my_loop:make)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the target's, reported in one line
        raise ConfigError(f"audit target module {module_name!r} does not import: "
                          f"{type(exc).__name__}: {exc}") from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ConfigError(f"module {module_name!r} has no function {function!r}; the target "
                          "names a function returning a TrainingStep")
    try:
        step = factory()
    except Exception as exc:
        raise ConfigError(f"{module_name}:{function}() raised {type(exc).__name__}: {exc}"
                          ) from None
    missing = [m for m in METHODS if not callable(getattr(step, m, None))]
    if missing:
        raise ConfigError(f"{module_name}:{function}() returned a {type(step).__name__} "
                          f"without {', '.join(missing)}; see exactstep.audit.TrainingStep")
    return step


def select_probes(names: Sequence[str] | None) -> list:
    from exactstep.audit.probes import PROBES

    if not names:
        return list(PROBES)
    known = {p.name: p for p in PROBES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown probe {unknown[0]!r}; available: {', '.join(known)}")
    return [known[n] for n in names]


def run_audit(step: object, *, target: str = "python", probes: Sequence[str] | None = None
              ) -> AuditReport:
    """Run the probes (all, or those named) against ``step``; the caller's RNG streams
    and PyTorch's thread count are left as they were.

    The probes' shapes are tiny, so they run on one intra-op thread: on a shared machine
    more threads only wait for each other (twenty times slower on two busy cores).
    """
    import torch

    from exactstep.audit.probes import run_probe
    from exactstep.state.rng import isolated_rng

    selected = select_probes(probes)
    report = AuditReport(target)
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with isolated_rng():
            for probe in selected:
                report.results.append(run_probe(probe, step))
    finally:
        torch.set_num_threads(threads)
    report.seconds = time.perf_counter() - started
    return report


def audit(target: str, probes: Sequence[str] | None = None) -> AuditReport:
    """``resolve_target`` then ``run_audit``."""
    names = list(probes) if probes else None
    step = resolve_target(target)
    select_probes(names)  # a bad probe name is refused before anything is built
    return run_audit(step, target=target, probes=names)
