"""Helpers shared by the tests that run ``exactstep`` through its command line on
several processes (D1, S5, S7, S10, X4): the ``sitecustomize`` hook that reaches
the workers, the launcher-free environment that carries it on ``PYTHONPATH``, the
tiny run's ``--set`` overrides, and the run root (hook directory and corpus).

A hook fires in the worker whose ``RANK`` and window the test names in an
environment variable, so it is the same window on every machine.
"""

from __future__ import annotations

import os
from pathlib import Path

from text_corpus import write_corpus

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def rank_window_hook(variable: str, *action: str, imports: str = "signal") -> str:
    """``sitecustomize`` text: when ``variable`` is ``RANK:WINDOW``, that rank runs
    ``action`` (lines of Python) as it starts that window, then the window itself."""
    body = "\n".join(" " * 12 + line for line in action)
    return f'''
import os
_at = os.environ.get("{variable}")
if _at:
    import {imports}
    from exactstep.update.window import UpdateEngine
    _rank, _window = (int(x) for x in _at.split(":"))
    _run_window = UpdateEngine.run_window
    def _probed(self, batches, window, *args, **kwargs):
        if window == _window and int(os.environ.get("RANK", "-1")) == _rank:
{body}
        return _run_window(self, batches, window, *args, **kwargs)
    UpdateEngine.run_window = _probed
'''


KILL_HOOK = rank_window_hook("EXACTSTEP_TEST_KILL_AT", "os.kill(os.getpid(), signal.SIGKILL)")

# ``EXACTSTEP_TEST_KILL_ONCE=RANK:WINDOW:MARKER``: that rank SIGKILLs itself as it starts
# that window, once (the marker file records that it fired), so a restarted or rerun
# command with the same environment goes on
KILL_ONCE_HOOK = r"""
import os
_kill = os.environ.get("EXACTSTEP_TEST_KILL_ONCE")
if _kill:
    import signal
    from exactstep.update.window import UpdateEngine
    _rank, _window, _marker = _kill.split(":", 2)
    _run_window = UpdateEngine.run_window
    def _probed(self, batches, window, *args, **kwargs):
        if (window == int(_window) and int(os.environ.get("RANK", "0")) == int(_rank)
                and not os.path.exists(_marker)):
            open(_marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return _run_window(self, batches, window, *args, **kwargs)
    UpdateEngine.run_window = _probed
"""

TINY_MODEL = {"model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32}


def tiny_overrides(corpus: Path, *, windows: int, every: int, seed: int = 3, keep: int = 3,
                   model: dict | None = None, extra: dict | None = None) -> list[str]:
    """``--set key=value`` pairs of a tiny CPU run of ``windows`` windows with a
    checkpoint every ``every``; ``model`` replaces the tiny decoder's keys, ``extra``
    adds keys (or changes them)."""
    pairs = {
        "seed": seed, "data.source": str(corpus), "data.val_fraction": 0.2,
        "batch.seq_len": 32, "batch.rows": 2, **(TINY_MODEL if model is None else model),
        "update.accum": 2, "update.warmup": 2,
        "train.steps": windows, "train.eval_tokens": 64, "train.threads": 1,
        "train.device": "cpu",  # gloo on CPU: a GPU host has one device (or NCCL) otherwise
        "checkpoint.every": every, "checkpoint.keep": keep, **(extra or {}),
    }
    return [arg for k, v in pairs.items() for arg in ("--set", f"{k}={v}")]


def worker_env(hook: Path, *, drop_prefix: str = "", **extra: str) -> dict[str, str]:
    """This process's environment without a launcher's variables (and those starting
    with ``drop_prefix``, when given), ``hook`` first on ``PYTHONPATH``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not (drop_prefix and k.startswith(drop_prefix))}
    env["PYTHONPATH"] = os.pathsep.join([str(hook), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def write_hook(root: Path, text: str) -> Path:
    """``root/hook/sitecustomize.py`` holding ``text``; the hook directory."""
    hook = root / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(text)
    return hook


class CliRoot:
    """A run root: the hook directory (``hook``) and a written corpus (``corpus``)."""

    def __init__(self, root: Path, hook: str) -> None:
        self.root = root
        self.hook = write_hook(root, hook)
        self.corpus = root / "corpus.jsonl"
        write_corpus(self.corpus)

    def env(self, **extra: str) -> dict[str, str]:
        return worker_env(self.hook, **extra)
