"""S4 resume classification, S6 fallback choice, and the stop-signal flag."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from exactstep.errors import CheckpointError, ResumeError
from exactstep.manifest import REQUIRED_SECTIONS, build_manifest
from exactstep.state.checkpoint import publish_checkpoint
from exactstep.state.resume import (
    ResumeKind,
    StopRequest,
    check_progress_digest,
    choose_checkpoint,
    classify_resume,
)


def manifest(**update):
    sections = {name: {} for name in REQUIRED_SECTIONS}
    sections["update"] = {"lr": 3e-4, "accum": 4, **update}
    return build_manifest(sections)


def test_same_digest_is_exact() -> None:
    plan = classify_resume(manifest(), manifest())
    assert plan.kind is ResumeKind.EXACT and plan.exact and plan.differing == []


def test_different_digest_refused_naming_fields() -> None:
    with pytest.raises(ResumeError, match=r"update\.accum, update\.lr"):
        classify_resume(manifest(), manifest(lr=1e-3, accum=8))


def test_warm_start_accepts_difference_and_records_it() -> None:
    plan = classify_resume(manifest(), manifest(lr=1e-3), warm_start=True)
    assert plan.kind is ResumeKind.WARM_START and plan.differing == ["update.lr"]


def test_progress_digest_must_match_run() -> None:
    m = manifest()
    check_progress_digest({"manifest_digest": m.digest}, m, "ckpt")
    with pytest.raises(ResumeError, match="written under manifest"):
        check_progress_digest({"manifest_digest": manifest(lr=1.0).digest}, m, "ckpt")


def publish(root, name):
    return publish_checkpoint(
        root, name, {"w": torch.arange(4.0)}, {"progress": {"window": name}}, keep=5
    )


def test_choose_checkpoint_follows_latest_and_verifies(tmp_path) -> None:
    publish(tmp_path, "a")
    b = publish(tmp_path, "b")
    assert choose_checkpoint(tmp_path) == b
    (b / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"model.safetensors is corrupted.*--from .*/a"):
        choose_checkpoint(tmp_path)
    assert choose_checkpoint(tmp_path, tmp_path / "a") == tmp_path / "a"


def test_choose_checkpoint_without_any(tmp_path) -> None:
    with pytest.raises(ResumeError, match="no published checkpoint"):
        choose_checkpoint(tmp_path)
    only = publish(tmp_path, "a")
    (only / "progress.json").unlink()
    with pytest.raises(CheckpointError, match="progress.json is missing.*start a new run"):
        choose_checkpoint(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_request_turns_signal_into_flag(sig) -> None:
    before = signal.getsignal(sig)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), sig)
        assert stop.requested and stop.signal_name == signal.Signals(sig).name
    assert signal.getsignal(sig) is before


def test_second_sigint_interrupts_at_once() -> None:
    with pytest.raises(KeyboardInterrupt), StopRequest():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_stop_request_sigint_interrupts() -> None:
    """Negative control: the flag check above is meaningful only with the handler."""
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
