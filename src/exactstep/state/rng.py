"""Capture and restore every random stream a run draws from (S2).

Python, NumPy's global generator, torch CPU and this process's CUDA device are
captured as weights-only-loadable data for checkpoints (S2, S7), restored for a
bitwise resume (S5), and isolated around evaluation and sampling (``isolated_rng``;
``isolated`` adds eval mode and no gradients: the one E1 isolation).
Design and derivations: docs/design/state.md#staterngpy (S2, S5, S7, E1).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from exactstep.errors import CheckpointError

RNG_FORMAT = 2
LEGACY_FORMATS = (1,)  # format 1: "cuda" listed every visible device, by index


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
    """Snapshot every RNG stream as weights-only-loadable plain data and tensors.

    Python, NumPy (its key array as an int64 tensor), torch CPU, and the CUDA state of
    this process's current device only (``cuda``, one entry or none when CUDA is not
    initialised; ``cuda_devices`` records its index). Restoring it and drawing gives
    the draw that would have followed the capture, for every stream.
    """
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
    }
    devices = cuda_devices_in_use()
    state["cuda"] = [torch.cuda.get_rng_state(i).clone() for i in devices]  # uint8 each
    state["cuda_devices"] = devices
    return state


def cuda_devices_in_use() -> list[int]:
    """The CUDA devices whose generator this process draws from: its current device
    when CUDA is initialised (a rank trains on ``cuda:LOCAL_RANK`` only), else none."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def restore_rng(state: dict[str, Any]) -> None:
    """Put every stream back where ``capture_rng`` found it.

    Raises ``CheckpointError`` when the state is malformed, or holds a CUDA state and
    no CUDA device is visible (the run would continue on other hardware).
    """
    try:
        fmt = state.get("format")
        if fmt != RNG_FORMAT and fmt not in LEGACY_FORMATS:
            raise CheckpointError(
                f"rng state has format {fmt!r}, expected {RNG_FORMAT}; "
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
        cuda = list(state["cuda"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(
            f"rng state is malformed ({exc!r}); the checkpoint's rng part is damaged"
        ) from None
    restore_cuda_rng(cuda, legacy=fmt in LEGACY_FORMATS)


def restore_cuda_rng(cuda: list[torch.Tensor], *, legacy: bool = False) -> None:
    """Put a captured CUDA state on the device this process uses now (S2, S7).

    Whatever that device's index and however many devices are visible: a checkpoint
    written on a host with 8 GPUs resumes on a host with 1.

    ``legacy`` (format 1): ``cuda`` lists every device visible at capture time, by
    index; the entry of the current device index is restored.
    """
    if not cuda:
        return
    if not torch.cuda.is_available():
        raise CheckpointError(
            "the checkpoint holds the CUDA rng state of the device its rank trained on, "
            "but no CUDA device is visible; resume on a CUDA device (train.device = "
            "'cuda' or 'auto')"
        )
    device = torch.cuda.current_device()
    if legacy:
        if device >= len(cuda):
            raise CheckpointError(
                f"the checkpoint (rng format 1) holds CUDA rng states for devices 0..{len(cuda) - 1} "
                f"but this process uses cuda:{device}; resume with the same local ranks"
            )
        cuda = [cuda[device]]
    if len(cuda) != 1:
        raise CheckpointError(
            f"rng state holds {len(cuda)} CUDA states; a rank captures exactly one (its "
            "device's); the checkpoint's rng part is damaged"
        )
    torch.cuda.set_rng_state(cuda[0].cpu(), device)


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


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every module in eval mode inside; each module's own prior mode restored after
    (E1: a submodule frozen in eval mode inside a training model stays so)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def isolated(model: torch.nn.Module) -> Iterator[None]:
    """The E1 isolation every held-out figure and every rollout runs under: eval mode
    (each module's prior mode restored after), no gradients, every RNG stream restored
    after."""
    with eval_mode(model), isolated_rng(), torch.no_grad():
        yield
