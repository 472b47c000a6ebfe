"""Resolve an audit target and run the probes against it (A1).

Targets: ``exactstep`` (``audit.engine``), ``exactstep-policy[:BASELINE[:NORMALIZER]]``
(``audit.engine_policy``), ``python:MODULE:FUNCTION`` (``FUNCTION()``
returns a ``TrainingStep``; the current directory is importable, as with ``python -m``),
``hf-trainer[:COLLATOR]`` (``audit.hf_trainer``), ``trl-sft[:VARIANT]``
(``audit.trl_sft``) and ``trl-grpo[:LOSS_TYPE[:SCALE_REWARDS]]`` (``audit.trl_grpo``). A
``TrainingStep`` meets the probes of ``audit.probes``; a ``PolicyStep`` (a policy loop)
those of ``audit.policy_probes``. An unresolvable target is a ``ConfigError`` (one ``error:`` line,
exit 2); a target that fails while probed is that probe's ``ERROR``: an exception,
``SystemExit``, a ``KeyboardInterrupt`` of its own (not the user's Ctrl-C) or a probe
past ``probe_timeout`` seconds. ``target_stdout_to_stderr`` keeps stdout for the result.

Design and derivations: docs/design/audit.md#harness
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from exactstep.errors import ConfigError

TARGETS = ("exactstep", "exactstep-policy", "python:MODULE:FUNCTION", "hf-trainer", "hf-trainer:flattening",
           "hf-trainer:lora", "trl-sft", "trl-sft:assistant_only_loss", "trl-sft:padding_free",
           "trl-sft:packing", "trl-grpo", "trl-grpo:bnpo", "trl-grpo:grpo",
           "trl-grpo:dr_grpo", "trl-grpo:dapo:none")
METHODS = ("build", "logits", "train", "evaluate", "save", "load")
POLICY_METHODS = ("build", "logits", "gradient")
# The slowest probe took 1.5 s (--target exactstep) and 3.3 s (hf-trainer) on a loaded
# 2-core machine; 300 s leaves two orders of magnitude for slower machines and lies above
# the DDP probe's own 60 s deadline, whose message is the more precise one
# (docs/design/audit.md#harness).
PROBE_TIMEOUT_S = 300.0


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
    if target == "exactstep-policy" or target.startswith("exactstep-policy:"):
        from exactstep.audit.engine_policy import make as make_policy

        return make_policy(target.partition(":")[2])
    if target == "trl-grpo" or target.startswith("trl-grpo:"):
        return trl_grpo_target(target)
    raise ConfigError(f"unknown audit target {target!r}; use one of: {', '.join(TARGETS)}")


def hf_trainer_target(target: str) -> object:
    """``hf-trainer[:padding|flattening|lora]``; needs the ``hf`` extra."""
    collator = target.partition(":")[2] or "padding"
    packages = ("transformers", "accelerate") + (("peft",) if collator == "lora" else ())
    require("hf-trainer", packages)  # Trainer needs the first two
    from exactstep.audit.hf_trainer import make

    return make(collator)


def trl_sft_target(target: str) -> object:
    """``trl-sft[:VARIANT]`` (``exactstep.audit.trl_sft``); needs trl and the ``hf`` extra."""
    variant = target.partition(":")[2] or "completion_only_loss"
    require("trl-sft", ("transformers", "accelerate", "datasets", "trl"))
    from exactstep.audit.trl_sft import make

    return make(variant)


def trl_grpo_target(target: str) -> object:
    """``trl-grpo[:LOSS_TYPE[:SCALE_REWARDS]]`` (``exactstep.audit.trl_grpo``)."""
    require("trl-grpo", ("transformers", "accelerate", "datasets", "trl"))
    from exactstep.audit.trl_grpo import make

    return make(target.partition(":")[2])


def require(target: str, packages: Sequence[str]) -> None:
    """``ConfigError`` naming the first of ``packages`` that does not import."""
    for package in packages:
        try:
            importlib.import_module(package)
        except ImportError:
            raise ConfigError(f"--target {target} needs {package}: pip install "
                              "'exactstep[hf]'") from None


def is_policy(step: object) -> bool:
    """A ``PolicyStep`` (``gradient``), not a ``TrainingStep`` (``train``)."""
    return callable(getattr(step, "gradient", None)) and not callable(getattr(step, "train",
                                                                              None))


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
    methods, kind = ((POLICY_METHODS, "PolicyStep") if is_policy(step)
                     else (METHODS, "TrainingStep"))
    missing = [m for m in methods if not callable(getattr(step, m, None))]
    if missing:
        raise ConfigError(f"{module_name}:{function}() returned a {type(step).__name__} "
                          f"without {', '.join(missing)}; see exactstep.audit.{kind}")
    return step


def select_probes(names: Sequence[str] | None, policy: bool = False) -> list:
    """The probes named (all when none) from the catalogue of the step's kind."""
    if policy:
        from exactstep.audit.policy_probes import POLICY_PROBES as PROBES
    else:
        from exactstep.audit.probes import PROBES

    if not names:
        return list(PROBES)
    known = {p.name: p for p in PROBES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown probe {unknown[0]!r}; available: {', '.join(known)}")
    return [known[n] for n in names]


class ProbeTimeout(BaseException):
    """A probe ran past its time; a ``BaseException`` so a target's ``except Exception``
    does not swallow it."""


class Guard:
    """The main thread's SIGINT and SIGALRM handlers while the probes run.

    SIGINT records that the user pressed Ctrl-C before raising ``KeyboardInterrupt``, so
    a ``KeyboardInterrupt`` with no recorded SIGINT is the target's own. SIGALRM (an
    ``ITIMER_REAL`` timer armed per probe) raises ``ProbeTimeout`` in the main thread:
    it interrupts Python code and blocking calls that return to the interpreter on a
    signal (``time.sleep``, socket and pipe reads), not a C call that never does.
    Off the main thread (signals cannot be handled there) nothing is installed: a
    ``KeyboardInterrupt`` then stops the audit and no probe is timed out.
    """

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout if timeout and math.isfinite(timeout) else None
        self.interrupted = False
        self.active = threading.current_thread() is threading.main_thread()
        self.saved: dict[int, object] = {}

    def __enter__(self) -> Guard:
        if self.active:
            self.saved[signal.SIGINT] = signal.signal(signal.SIGINT, self.on_sigint)
            if self.timeout is not None:
                self.saved[signal.SIGALRM] = signal.signal(signal.SIGALRM, self.on_alarm)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
            for signum, handler in self.saved.items():
                signal.signal(signum, handler)

    def on_sigint(self, signum: int, frame: object) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    def on_alarm(self, signum: int, frame: object) -> None:
        raise ProbeTimeout

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        armed = self.active and self.timeout is not None
        if armed:
            signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            yield
        finally:
            if armed:
                signal.setitimer(signal.ITIMER_REAL, 0.0)


def seconds_text(seconds: float) -> str:
    return f"{seconds:g}"


def guarded_probe(probe: object, step: object, guard: Guard) -> object:
    """``run_probe``, with what ``run_probe`` lets through (``BaseException``) made this
    probe's ``ERROR``: ``SystemExit``, the target's own ``KeyboardInterrupt`` and a
    timeout. The user's Ctrl-C is re-raised: it stops the audit."""
    from exactstep.audit.probes import ERROR, Result, run_probe

    started = time.perf_counter()
    try:
        with guard.timed():
            return run_probe(probe, step)
    except ProbeTimeout:
        observed = f"did not finish in {seconds_text(guard.timeout)} s"
    except SystemExit as exc:
        code = "" if exc.code is None else repr(exc.code)
        observed = f"the target raised SystemExit({code})"
    except KeyboardInterrupt:
        if guard.interrupted or not guard.active:
            raise
        observed = "the target raised KeyboardInterrupt"
    return Result(probe.name, probe.contract, ERROR, "-", observed,
                  seconds=round(time.perf_counter() - started, 3))


@contextlib.contextmanager
def target_stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout meanwhile to stderr: ``sys.stdout`` and file
    descriptor 1 (``os.write(1, ...)``, C extensions, forked children), so that the
    audit's own output alone reaches stdout. Restored, flushed, on the way out."""
    sys.stdout.flush()
    saved_fd = os.dup(1)
    saved_stdout = sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        for stream in {id(s): s for s in (sys.stdout, saved_stdout, sys.__stdout__)
                       if s is not None}.values():
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout = saved_stdout
        os.dup2(saved_fd, 1)
        os.close(saved_fd)


def run_audit(step: object, *, target: str = "python", probes: Sequence[str] | None = None,
              probe_timeout: float | None = PROBE_TIMEOUT_S) -> AuditReport:
    """Run the probes (all, or those named) against ``step``; the caller's RNG streams
    and PyTorch's thread count are left as they were. A probe past ``probe_timeout``
    seconds (``None``: no limit) is its ``ERROR``; the next probe builds afresh.

    The probes' shapes are tiny, so they run on one intra-op thread: on a shared machine
    more threads only wait for each other (twenty times slower on two busy cores).
    """
    import torch

    from exactstep.state.rng import isolated_rng

    selected = select_probes(probes, is_policy(step))
    report = AuditReport(target)
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with isolated_rng(), Guard(probe_timeout) as guard:
            for probe in selected:
                report.results.append(guarded_probe(probe, step, guard))
    finally:
        torch.set_num_threads(threads)
    report.seconds = time.perf_counter() - started
    return report


def audit(target: str, probes: Sequence[str] | None = None, *,
          probe_timeout: float | None = PROBE_TIMEOUT_S) -> AuditReport:
    """``resolve_target`` then ``run_audit``."""
    names = list(probes) if probes else None
    step = resolve_target(target)
    select_probes(names, is_policy(step))  # a bad name is refused before anything runs
    return run_audit(step, target=target, probes=names, probe_timeout=probe_timeout)
