"""S4 resume classification, S6 fallback choice, and the stop-signal flag."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from exactstep.errors import CheckpointError, ResumeError
from exactstep.state.manifest import REQUIRED_SECTIONS, build_manifest
from exactstep.state.resume import (
    StopRequest,
    check_progress_digest,
    choose_resume_point,
    require_same_manifest,
)
from exactstep.state.safetensors_format import publish_checkpoint


def manifest(**update):
    sections = {name: {} for name in REQUIRED_SECTIONS}
    sections["update"] = {"lr": 3e-4, "accum": 4, **update}
    return build_manifest(sections)


def test_same_digest_is_exact() -> None:
    assert require_same_manifest(manifest(), manifest()) is None


def test_different_digest_refused_naming_fields() -> None:
    with pytest.raises(ResumeError, match=r"update\.accum, update\.lr"):
        require_same_manifest(manifest(), manifest(lr=1e-3, accum=8))


def test_progress_digest_must_match_run() -> None:
    m = manifest()
    check_progress_digest({"manifest_digest": m.digest}, m, "ckpt")
    with pytest.raises(ResumeError, match="written under manifest"):
        check_progress_digest({"manifest_digest": manifest(lr=1.0).digest}, m, "ckpt")


def publish(root, name):
    return publish_checkpoint(
        root, name, {"w": torch.arange(4.0)}, {"progress": {"window": name}}, keep=5
    )


def test_resume_point_follows_latest_and_verifies(tmp_path) -> None:
    publish(tmp_path, "a")
    b = publish(tmp_path, "b")
    assert choose_resume_point(tmp_path).path == b
    (b / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"model.safetensors is corrupted.*--from .*/a"):
        choose_resume_point(tmp_path)
    assert choose_resume_point(tmp_path, tmp_path / "a").path == tmp_path / "a"


def test_nothing_published_starts_again_from_window_zero(tmp_path) -> None:
    point = choose_resume_point(tmp_path / "absent")
    assert point.path is None and "window 0" in point.note
    (tmp_path / ".tmp-window-00000005-1").mkdir()  # a publication that never finished
    assert choose_resume_point(tmp_path).path is None


def test_only_checkpoint_damaged_is_refused_not_restarted(tmp_path) -> None:
    only = publish(tmp_path, "a")
    (only / "progress.json").unlink()
    with pytest.raises(CheckpointError, match="progress.json is missing.*start a new run"):
        choose_resume_point(tmp_path)
    (tmp_path / "LATEST").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint in .* verifies"):
        choose_resume_point(tmp_path)


@pytest.mark.parametrize("latest", [None, "garbage\x00\n", "c\n"])
def test_missing_garbage_or_dangling_latest_recovers_newest_verified(tmp_path, latest) -> None:
    a = publish(tmp_path, "a")
    b = publish(tmp_path, "b")
    (b / "manifest.json").write_text("{")  # the newest is damaged too
    if latest is None:
        (tmp_path / "LATEST").unlink()
    else:
        (tmp_path / "LATEST").write_text(latest)
    point = choose_resume_point(tmp_path)
    assert point.path == a
    assert "newest checkpoint that verifies" in point.note and "LATEST" in point.note


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_request_turns_signal_into_flag(sig) -> None:
    before = signal.getsignal(sig)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), sig)
        assert stop.requested and stop.signal_name == signal.Signals(sig).name
    assert signal.getsignal(sig) is before


@pytest.fixture
def python_sigint():
    """SIGINT as Python installs it in an interactive process (``KeyboardInterrupt``),
    whatever this process inherited: a shell starts a background job with SIGINT
    ignored, and the handler is restored afterwards."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_second_sigint_interrupts_at_once(python_sigint) -> None:
    with pytest.raises(KeyboardInterrupt), StopRequest():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_stop_request_sigint_interrupts(python_sigint) -> None:
    """Negative control: the flag check above is meaningful only with the handler."""
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
