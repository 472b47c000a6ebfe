"""Capture and restore every random stream a run draws from (S2).

Streams: Python ``random``, NumPy's legacy global generator, torch CPU, and every
CUDA device when CUDA is initialised. The captured state holds only values that
``torch.load(..., weights_only=True)`` accepts (tensors, ints, floats, bools,
strings, lists, dicts): the NumPy key array is stored as an int64 tensor.

Invariant: ``restore_rng(capture_rng())`` followed by any draw gives the same number
as that draw right after the capture, for every stream. ``isolated_rng()`` applies
that around a block (evaluation, E1): whatever the block draws, every stream reads
afterwards as if it had never run.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from exactstep.errors import CheckpointError

RNG_FORMAT = 1


def seed_rng(seed: int) -> None:
    """Seed every stream from the run's seed: Python, NumPy's global generator,
    torch CPU and all CUDA devices (S2, S5).

    A new run must call this before anything draws: Python's and NumPy's streams
    otherwise start from OS entropy, so two runs of one manifest would differ in
    their RNG state even though every update agrees.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def capture_rng() -> dict[str, Any]:
    """Snapshot every RNG stream as weights-only-loadable plain data and tensors."""
    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),  # [624]
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state().clone(),  # uint8 [5056]
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put every stream back where ``capture_rng`` found it.

    Raises ``CheckpointError`` when the state is malformed or records CUDA streams
    for more devices than are visible now (resuming on fewer devices is a migration,
    S7, not a silent partial restore).
    """
    try:
        if state.get("format") != RNG_FORMAT:
            raise CheckpointError(
                f"rng state has format {state.get('format')!r}, expected {RNG_FORMAT}; "
                "the checkpoint was written by an incompatible version"
            )
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        npy = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": npy["bit_generator"],
                "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
                "has_gauss": npy["has_gauss"],
                "gauss": npy["gauss"],
            },
        )
        torch.set_rng_state(state["torch"].cpu())
        cuda = state["cuda"]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(
            f"rng state is malformed ({exc!r}); the checkpoint's rng part is damaged"
        ) from None
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise CheckpointError(
                f"the checkpoint holds CUDA rng state for {len(cuda)} device(s) but {visible} "
                "are visible; resume on the same devices"
            )
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Run a block without consuming any stream ``capture_rng`` captures (E1).

    Every stream is captured on entry and restored on exit, also when the block
    raises, so a training run's draws after the block are the draws it would have
    made without it. Unlike ``torch.random.fork_rng`` this covers Python's and
    NumPy's global streams too.
    """
    saved = capture_rng()
    try:
        yield
    finally:
        restore_rng(saved)
