"""S2: every RNG stream is captured and restored exactly; the state loads weights-only."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from exactstep.state.compare import state_differences, tensors_bitwise_equal
from exactstep.state.rng import capture_rng, restore_rng, seed_rng


def draw_from_every_stream() -> tuple:
    return (
        random.random(),
        random.gauss(0.0, 1.0),
        np.random.standard_normal(3).tolist(),
        np.random.randint(0, 1 << 30),
        torch.rand(4),
        torch.randn(2, generator=None),
        torch.nn.functional.dropout(torch.ones(16), p=0.5, training=True),
    )


def same_draws(x: tuple, y: tuple) -> bool:
    return not state_differences(list(x), list(y))


def test_restore_replays_every_stream() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draw_from_every_stream()  # leave a cached gaussian in Python's and NumPy's streams
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    saved = capture_rng()
    first = draw_from_every_stream()
    restore_rng(saved)
    assert same_draws(draw_from_every_stream(), first)


def test_missing_a_stream_is_detected() -> None:
    """Negative control: restoring all but NumPy's stream gives different draws."""
    saved = capture_rng()
    first = draw_from_every_stream()
    restore_rng(saved)
    np.random.seed(12345)
    assert not same_draws(draw_from_every_stream(), first)


def test_state_survives_weights_only_torch_load() -> None:
    saved = capture_rng()
    first = draw_from_every_stream()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert state_differences(loaded, saved) == []
    restore_rng(loaded)
    assert same_draws(draw_from_every_stream(), first)


def test_state_differences_names_paths() -> None:
    a = {"x": torch.tensor([0.0, 1.0]), "y": [1, 2.0], "z": {"w": "s"}}
    b = {"x": torch.tensor([-0.0, 1.0]), "y": [1, 2], "z": {"w": "s", "v": 1}}
    assert state_differences(a, b) == ["x", "y.1 (type float vs int)", "z.v (missing on one side)"]
    assert state_differences(a, a) == []
    assert not tensors_bitwise_equal(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert tensors_bitwise_equal(torch.tensor([True, False]), torch.tensor([True, False]))
    # torch.equal would call these equal; bitwise they are not
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))


def test_seed_rng_makes_every_stream_reproducible() -> None:
    seed_rng(7)
    first = draw_from_every_stream()
    random.seed(None)  # scramble from OS entropy
    np.random.seed(None)
    seed_rng(7)
    assert same_draws(draw_from_every_stream(), first)


def test_unseeded_python_and_numpy_streams_differ() -> None:
    """Negative control: without seed_rng the Python/NumPy streams come from entropy."""
    torch.manual_seed(7)
    random.seed(None)
    np.random.seed(None)
    first = draw_from_every_stream()
    torch.manual_seed(7)
    random.seed(None)
    np.random.seed(None)
    assert not same_draws(draw_from_every_stream(), first)
