"""The CUDA RNG rule, with a fabricated CUDA on the CPU (S2, S7; issue 16 item 9).

Rule: a rank captures the generator state of the one device it trains on (its current
device) and a restore puts it on the device the restoring process uses, however many
devices either host has. So a checkpoint written on a host with 8 visible GPUs
resumes on a host with 1. A fake ``torch.cuda`` stands in for the devices: each has a
distinct state, and every ``set_rng_state`` is recorded.
"""

from __future__ import annotations

import io

import pytest
import torch

from exactstep.errors import CheckpointError
from exactstep.state import rng


class FakeCuda:
    """``count`` visible devices, ``current`` in use; device i's state is bytes of i."""

    def __init__(self, monkeypatch, count: int, current: int) -> None:
        self.count, self.current, self.restored = count, current, []
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(cuda, "is_initialized", lambda: count > 0)
        monkeypatch.setattr(cuda, "device_count", lambda: count)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(cuda, "get_rng_state_all",
                            lambda: [self.get_rng_state(i) for i in range(count)])
        monkeypatch.setattr(cuda, "set_rng_state", self.set_rng_state)

    def get_rng_state(self, device: int = 0) -> torch.Tensor:
        assert 0 <= device < self.count, f"device {device} is not visible"
        return torch.full((16,), 10 + device, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: int = 0) -> None:
        assert 0 <= device < self.count, f"device {device} is not visible"
        self.restored.append((device, state.clone()))


def through_disk(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_rank_captures_only_its_own_device(monkeypatch):
    FakeCuda(monkeypatch, count=8, current=3)
    state = rng.capture_rng()
    assert state["cuda_devices"] == [3]
    assert len(state["cuda"]) == 1
    assert torch.equal(state["cuda"][0], torch.full((16,), 13, dtype=torch.uint8))


def test_checkpoint_from_8_visible_gpus_resumes_on_a_host_with_1(monkeypatch):
    FakeCuda(monkeypatch, count=8, current=0)  # a single process on an 8-GPU host
    saved = through_disk(rng.capture_rng())
    one = FakeCuda(monkeypatch, count=1, current=0)
    rng.restore_rng(saved)
    assert [d for d, _ in one.restored] == [0]
    assert torch.equal(one.restored[0][1], torch.full((16,), 10, dtype=torch.uint8))


def test_the_state_goes_to_the_device_in_use_now(monkeypatch):
    FakeCuda(monkeypatch, count=8, current=5)  # local rank 5
    saved = rng.capture_rng()
    other = FakeCuda(monkeypatch, count=2, current=1)  # resumed as local rank 1 elsewhere
    rng.restore_rng(saved)
    assert [d for d, _ in other.restored] == [1]
    assert torch.equal(other.restored[0][1], torch.full((16,), 15, dtype=torch.uint8))


def test_negative_control_capturing_every_visible_device_fails_on_fewer(monkeypatch):
    """The old rule (every visible device's state) cannot resume on a 1-GPU host."""
    FakeCuda(monkeypatch, count=8, current=0)
    monkeypatch.setattr(rng, "cuda_devices_in_use", lambda: list(range(8)))
    saved = rng.capture_rng()
    FakeCuda(monkeypatch, count=1, current=0)
    with pytest.raises(CheckpointError, match="holds 8 CUDA states"):
        rng.restore_rng(saved)


def test_cuda_state_without_a_visible_device_is_refused(monkeypatch):
    FakeCuda(monkeypatch, count=2, current=0)
    saved = rng.capture_rng()
    FakeCuda(monkeypatch, count=0, current=0)
    with pytest.raises(CheckpointError, match="no CUDA device is visible"):
        rng.restore_rng(saved)


def test_a_cpu_state_restores_anywhere(monkeypatch):
    FakeCuda(monkeypatch, count=0, current=0)
    saved = rng.capture_rng()
    assert saved["cuda"] == [] and saved["cuda_devices"] == []
    gpus = FakeCuda(monkeypatch, count=4, current=2)
    rng.restore_rng(saved)
    assert gpus.restored == []  # nothing to restore on the device


def test_format_1_states_restore_the_entry_of_the_current_device(monkeypatch):
    FakeCuda(monkeypatch, count=8, current=0)
    legacy = {**rng.capture_rng(), "format": 1,
              "cuda": [torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(8)]}
    legacy.pop("cuda_devices")
    now = FakeCuda(monkeypatch, count=1, current=0)
    rng.restore_rng(legacy)
    assert torch.equal(now.restored[0][1], torch.full((16,), 10, dtype=torch.uint8))
    two = FakeCuda(monkeypatch, count=8, current=6)
    rng.restore_rng(legacy)
    assert two.restored[0][0] == 6 and int(two.restored[0][1][0]) == 16


def test_isolated_rng_round_trips_the_device_state(monkeypatch):
    fake = FakeCuda(monkeypatch, count=8, current=4)
    with rng.isolated_rng():
        pass
    assert [(d, int(s[0])) for d, s in fake.restored] == [(4, 14)]
