"""S2, S3, S6: complete checkpoints, atomic publication, corruption detection, pruning."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from exactstep.errors import CheckpointError, StorageError
from exactstep.state import store
from exactstep.state.compare import state_differences
from exactstep.state.rng import capture_rng
from exactstep.state.safetensors_format import load_checkpoint, publish_checkpoint
from exactstep.state.store import (
    clean_uncommitted,
    latest_checkpoint,
    list_checkpoints,
    published_checkpoints,
    verify_checkpoint,
)

# ------------------------------------------------------------ a tiny trained state


class TinyTied(torch.nn.Module):
    """Embedding tied to the output head, like the built-in decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))  # [N, V]


def trained_state(seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    model = TinyTied()
    opt = torch.optim.AdamW(
        [
            {"params": [model.embed.weight], "weight_decay": 0.1},
            {"params": list(model.norm.parameters()), "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    # a live scaler whose state moved: growth every step doubles the scale (1024 -> 4096)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    ids = torch.arange(8) % 11
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(ids), (ids + 1) % 11)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
    parts = {
        "optimizer": opt.state_dict(),
        "schedule": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "progress": {
            "committed": steps,
            "skipped": 0,
            "window": steps,
            "manifest_digest": "ab" * 32,
        },
        "rng": capture_rng(),
        "data": {"epoch": 0, "cursor": 17, "remainder": [[1, 2, 3]]},
    }
    return model, parts


def assert_bitwise_equal(a, b, where: str = "") -> None:
    """Exact structural equality; tensors compared bit for bit (dtype, shape, bytes)."""
    differences = state_differences(a, b, where)
    assert not differences, differences


@pytest.fixture
def state():
    return trained_state()


def publish(root: Path, name: str, state, keep: int = 3) -> Path:
    model, parts = state
    return publish_checkpoint(root, name, model.state_dict(), parts, keep=keep)


# ------------------------------------------------------------ round trip


def test_round_trip_is_bitwise(tmp_path, state) -> None:
    model, parts = state
    root = tmp_path / "checkpoints"
    path = publish(root, "step_2", state)
    assert path == root / "step_2"
    assert latest_checkpoint(root) == path
    model_state, loaded = load_checkpoint(path)
    assert_bitwise_equal({k: v for k, v in model_state.items()}, dict(model.state_dict()), "model")
    assert_bitwise_equal(loaded, parts, "parts")
    # the round trip carried state that had moved away from its initial values
    assert loaded["scaler"]["scale"] == 1024.0 * 2**2
    assert all(int(s["step"]) == 2 for s in loaded["optimizer"]["state"].values())
    assert loaded["schedule"]["last_epoch"] == 2


def test_bitwise_check_catches_a_one_ulp_difference(state) -> None:
    """Negative control for assert_bitwise_equal: a single ulp is a failure."""
    _, parts = state
    twisted = trained_state()[1]
    exp_avg = twisted["optimizer"]["state"][0]["exp_avg"]
    exp_avg.view(torch.int32)[0, 0] += 1
    with pytest.raises(AssertionError):
        assert_bitwise_equal(twisted, parts)


def test_tied_weights_stored_once_and_restored_tied(tmp_path, state) -> None:
    model, _ = state
    path = publish(tmp_path, "step_2", state)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert stored == {"embed.weight", "norm.weight", "norm.bias"}
    model_state, _ = load_checkpoint(path)
    assert model_state["head.weight"] is model_state["embed.weight"]
    fresh = TinyTied()
    fresh.load_state_dict(model_state)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_partial_views_and_noncontiguous_tensors_are_saved(tmp_path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    state = {"whole": base, "row": base[1], "t": base.t(), "empty": torch.zeros(0)}
    path = publish_checkpoint(tmp_path, "a", state, {}, keep=1)
    back, _ = load_checkpoint(path)
    for key, value in state.items():
        assert torch.equal(back[key], value), key


def test_parts_use_json_only_when_lossless(tmp_path, state) -> None:
    path = publish(tmp_path, "step_2", state)
    names = {p.name for p in path.iterdir()}
    # plain JSON-able parts are human readable; int keys / tuples / tensors need torch.save
    assert {"progress.json", "data.json", "schedule.json", "scaler.json"} <= names
    assert {"optimizer.pt", "rng.pt", "model.safetensors", "manifest.json"} <= names
    _, parts = load_checkpoint(path)
    assert isinstance(parts["optimizer"]["param_groups"][0]["betas"], tuple)
    assert 0 in parts["optimizer"]["state"]  # int keys survive


@pytest.mark.parametrize("filename", ["optimizer.pt", "rng.pt"])
def test_pt_parts_load_with_weights_only(tmp_path, state, filename) -> None:
    path = publish(tmp_path, "step_2", state)
    value = torch.load(path / filename, weights_only=True)
    assert isinstance(value, dict)


def test_optimizer_round_trip_continues_identically(tmp_path, state) -> None:
    """Loaded optimizer state drives the next step to the same bits as the original."""
    model, parts = state
    path = publish(tmp_path, "step_2", state)
    model_state, loaded = load_checkpoint(path)
    twin = TinyTied()
    twin.load_state_dict(model_state)
    opt = torch.optim.AdamW(
        [
            {"params": [twin.embed.weight], "weight_decay": 0.1},
            {"params": list(twin.norm.parameters()), "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    opt.load_state_dict(loaded["optimizer"])
    original = torch.optim.AdamW(
        [
            {"params": [model.embed.weight], "weight_decay": 0.1},
            {"params": list(model.norm.parameters()), "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    original.load_state_dict(parts["optimizer"])
    ids = torch.arange(8) % 11
    for m, o in ((model, original), (twin, opt)):
        torch.nn.functional.cross_entropy(m(ids), (ids + 1) % 11).backward()
        o.step()
    assert_bitwise_equal(dict(twin.state_dict()), dict(model.state_dict()))


# ------------------------------------------------------------ atomic publication (S3, S8)


def naive_publish(root: Path, name: str, model_state, parts, *, keep: int) -> Path:
    """Deliberately wrong: points LATEST first, then writes files in place."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "LATEST").write_text(name + "\n")
    final = root / name
    final.mkdir()
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(final / "model.safetensors"))
    raise OSError("simulated crash before the other parts were written")


def fail_rename(monkeypatch) -> None:
    def crashing_rename(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.os, "rename", crashing_rename)


def committed_state_survives(root: Path, expected_parts) -> bool:
    try:
        path = latest_checkpoint(root)
        if path is None or not verify_checkpoint(path).ok:
            return False
        _, parts = load_checkpoint(path)
        assert_bitwise_equal(parts, expected_parts)
        return True
    except (CheckpointError, AssertionError):
        return False


def test_failed_publication_keeps_previous_checkpoint_and_leaves_nothing(
        monkeypatch, tmp_path, state) -> None:
    root = tmp_path / "checkpoints"
    publish(root, "step_1", state)
    fail_rename(monkeypatch)
    with pytest.raises(StorageError, match=r"step_2 .* failed \(No space left on device\); "
                                           r"the previous checkpoint step_1 is intact"):
        publish(root, "step_2", state)
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step_1"]
    assert committed_state_survives(root, state[1])


def test_crash_check_catches_naive_publisher(tmp_path, state) -> None:
    """Negative control: a publisher that moves LATEST first loses the committed state."""
    root = tmp_path / "checkpoints"
    publish(root, "step_1", state)
    with pytest.raises(OSError, match="simulated crash"):
        naive_publish(root, "step_2", state[0].state_dict(), state[1], keep=3)
    assert not committed_state_survives(root, state[1])


def test_clean_uncommitted_removes_only_temporary_names(tmp_path, state) -> None:
    """What a SIGKILL can leave: temporaries of each kind. Only those go (S3, S8)."""
    root = tmp_path / "checkpoints"
    publish(root, "step_1", state)
    shutil.copytree(root / "step_1", root / ".tmp-step_2-999")
    shutil.copytree(root / "step_1", root / ".trash-step_0-999")
    (root / ".LATEST.tmp-999").write_text("step_2\n")
    removed = clean_uncommitted(root)
    assert sorted(p.name for p in removed) == [".LATEST.tmp-999", ".tmp-step_2-999",
                                               ".trash-step_0-999"]
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step_1"]
    assert committed_state_survives(root, state[1])


def crash_after_rename(monkeypatch, root: Path, state) -> None:
    def crash(*args, **kwargs):
        raise OSError("simulated crash before LATEST moved")

    monkeypatch.setattr(store, "point_latest", crash)
    with pytest.raises(StorageError, match="simulated crash"):
        publish(root, "step_2", state)
    monkeypatch.undo()


def test_crash_after_rename_before_latest_keeps_the_orphan(monkeypatch, tmp_path, state) -> None:
    """Renamed into place, LATEST not moved: not committed, but never deleted (S8);
    the resumed run's identical re-publication adopts it."""
    root = tmp_path / "checkpoints"
    publish(root, "step_1", state)
    crash_after_rename(monkeypatch, root, state)
    orphan_manifest = (root / "step_2" / "manifest.json").read_bytes()
    assert latest_checkpoint(root) == root / "step_1"
    assert list_checkpoints(root) == [root / "step_1"]
    assert published_checkpoints(root) == [root / "step_1", root / "step_2"]
    assert clean_uncommitted(root) == []
    assert (root / "step_2" / "manifest.json").read_bytes() == orphan_manifest
    publish(root, "step_2", state)
    assert latest_checkpoint(root) == root / "step_2"
    assert (root / "step_2" / "manifest.json").read_bytes() == orphan_manifest  # adopted
    assert not (root / "quarantine").exists()


def test_no_latest_means_nothing_committed(tmp_path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert list_checkpoints(tmp_path) == []
    assert clean_uncommitted(tmp_path / "absent") == []


def test_clean_uncommitted_leaves_foreign_directories(tmp_path, state) -> None:
    publish(tmp_path, "step_1", state)
    (tmp_path / "notes").mkdir()
    assert clean_uncommitted(tmp_path) == []
    assert (tmp_path / "notes").is_dir()


def test_republishing_latest_name_identical_is_noop(tmp_path, state) -> None:
    path = publish(tmp_path, "step_1", state)
    before = (path / "manifest.json").read_bytes()
    assert publish(tmp_path, "step_1", state) == path
    assert (path / "manifest.json").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "step_1"]


def test_republishing_with_new_content_quarantines_the_old(tmp_path, state) -> None:
    model, parts = state
    path = publish(tmp_path, "step_1", state)
    old_manifest = (path / "manifest.json").read_bytes()
    changed = {**parts, "progress": {**parts["progress"], "committed": 99}}
    publish_checkpoint(tmp_path, "step_1", model.state_dict(), changed, keep=3)
    assert load_checkpoint(path)[1]["progress"]["committed"] == 99
    kept = tmp_path / "quarantine" / "step_1"
    assert (kept / "manifest.json").read_bytes() == old_manifest and verify_checkpoint(kept).ok
    assert load_checkpoint(kept)[1]["progress"]["committed"] == parts["progress"]["committed"]
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "quarantine", "step_1"]


def test_republishing_over_a_damaged_checkpoint_replaces_it(tmp_path, state) -> None:
    """A damaged checkpoint of the same name is quarantined and replaced, even though
    its recorded digests equal the new ones (S8)."""
    path = publish(tmp_path, "step_1", state)
    recorded = json.loads((path / "manifest.json").read_bytes())["files"]
    flip_byte(path / "optimizer.pt", 200)
    assert not verify_checkpoint(path).ok
    publish(tmp_path, "step_1", state)
    assert verify_checkpoint(path).ok
    assert json.loads((path / "manifest.json").read_bytes())["files"] == recorded
    damaged = tmp_path / "quarantine" / "step_1"
    assert verify_checkpoint(damaged).bad_files == ["optimizer.pt"]


def test_recorded_digests_alone_would_keep_the_damage(monkeypatch, tmp_path, state) -> None:
    """Negative control for the test above: a publisher that compares only the
    recorded digests (without recomputing them) adopts the damaged directory."""

    def recorded_only(existing: Path, manifest) -> bool:
        return json.loads((existing / "manifest.json").read_bytes())["files"] == manifest["files"]

    path = publish(tmp_path, "step_1", state)
    flip_byte(path / "optimizer.pt", 200)
    monkeypatch.setattr(store, "_same_checkpoint", recorded_only)
    publish(tmp_path, "step_1", state)
    assert verify_checkpoint(path).bad_files == ["optimizer.pt"]  # the damage stayed
    assert not (tmp_path / "quarantine").exists()


def test_edited_checkpoint_manifest_is_detected(tmp_path, state) -> None:
    """The manifest's own digest covers its sequence, names and records (S6)."""
    path = publish(tmp_path, "step_1", state)
    doc = json.loads((path / "manifest.json").read_bytes())
    doc["sequence"] = 7
    (path / "manifest.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    report = verify_checkpoint(path)
    assert not report.ok and "does not match its digest" in report.problems[0]
    with pytest.raises(CheckpointError, match="does not match its digest"):
        load_checkpoint(path)


@pytest.mark.parametrize("name", ["", ".hidden", "LATEST", "quarantine", "a/b", " x"])
def test_bad_names_refused(tmp_path, state, name) -> None:
    with pytest.raises(CheckpointError, match="not allowed"):
        publish(tmp_path, name, state)


def test_bad_part_name_refused(tmp_path, state) -> None:
    model, parts = state
    with pytest.raises(CheckpointError, match="part name"):
        publish_checkpoint(tmp_path, "a", model.state_dict(), {"model": 1}, keep=1)
    with pytest.raises(CheckpointError, match="part name"):
        publish_checkpoint(tmp_path, "a", model.state_dict(), {"../x": 1}, keep=1)


def test_pointer_is_single_line_and_only_pointer_is_followed(tmp_path, state) -> None:
    publish(tmp_path, "step_1", state)
    publish(tmp_path, "step_2", state)
    assert (tmp_path / "LATEST").read_text() == "step_2\n"
    (tmp_path / "LATEST").write_text("step_1\n")  # an operator rolls back
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    (tmp_path / "LATEST").write_text("step_9\n")
    with pytest.raises(CheckpointError, match="step_9"):
        latest_checkpoint(tmp_path)


# ------------------------------------------------------------ pruning


def test_keep_prunes_oldest_by_publication_order(tmp_path, state) -> None:
    names = ["step_9", "step_10", "step_11", "step_12"]  # lexical order would prune wrongly
    for name in names:
        publish(tmp_path, name, state, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_11", "step_12"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step_11", "step_12"]


def test_keep_one_keeps_only_latest(tmp_path, state) -> None:
    for i in range(3):
        publish(tmp_path, f"s{i}", state, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "s2"]


# ------------------------------------------------------------ corruption (S6)


def flip_byte(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset % len(data)] ^= 0x01
    file.write_bytes(bytes(data))


CHECKPOINT_FILES = [
    "model.safetensors",
    "optimizer.pt",
    "schedule.json",
    "scaler.json",
    "progress.json",
    "rng.pt",
    "data.json",
]


@pytest.mark.parametrize("filename", CHECKPOINT_FILES)
@pytest.mark.parametrize("where", [0, -1, 0.5])
def test_flipped_byte_detected_naming_file(tmp_path, state, filename, where) -> None:
    path = publish(tmp_path, "step_2", state)
    file = path / filename
    offset = int(where * file.stat().st_size) if isinstance(where, float) else where
    flip_byte(file, offset)
    report = verify_checkpoint(path)
    assert not report.ok
    assert report.bad_files == [filename]
    assert "corrupted" in report.format() and filename in report.format()
    with pytest.raises(CheckpointError, match=rf"{filename} is corrupted"):
        load_checkpoint(path)


@pytest.mark.parametrize("filename", CHECKPOINT_FILES)
def test_missing_file_detected_naming_file(tmp_path, state, filename) -> None:
    path = publish(tmp_path, "step_2", state)
    (path / filename).unlink()
    report = verify_checkpoint(path)
    assert [(p.file, p.status) for p in report.parts if p.status != "ok"] == [(filename, "missing")]
    with pytest.raises(CheckpointError, match=rf"{filename} is missing"):
        load_checkpoint(path)


def test_missing_or_damaged_checkpoint_manifest(tmp_path, state) -> None:
    path = publish(tmp_path, "step_2", state)
    flip_byte(path / "manifest.json", 3)
    assert not verify_checkpoint(path).ok
    with pytest.raises(CheckpointError, match="manifest.json"):
        load_checkpoint(path)
    (path / "manifest.json").unlink()
    report = verify_checkpoint(path)
    assert not report.ok and "manifest.json is missing" in report.problems[0]
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        load_checkpoint(path)


def test_unlisted_file_is_a_problem(tmp_path, state) -> None:
    path = publish(tmp_path, "step_2", state)
    (path / "stray.bin").write_bytes(b"x")
    report = verify_checkpoint(path)
    assert not report.ok and "stray.bin" in report.problems[0]


def test_unverified_load_misses_corruption(tmp_path, state) -> None:
    """Negative control: without the digest check a flipped tensor byte loads silently."""
    path = publish(tmp_path, "step_2", state)
    file = path / "model.safetensors"
    flip_byte(file, -1)  # last byte of the tensor data region
    model_state, _ = load_checkpoint(path, verify=False)
    original = dict(state[0].state_dict())
    assert any(not torch.equal(model_state[k], original[k]) for k in original)


def test_fallback_to_previous_committed_checkpoint(tmp_path, state) -> None:
    publish(tmp_path, "step_1", state)
    publish(tmp_path, "step_2", state)
    flip_byte(tmp_path / "step_2" / "optimizer.pt", 100)
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        load_checkpoint(latest_checkpoint(tmp_path))
    previous = list_checkpoints(tmp_path)[-2]
    assert previous.name == "step_1" and verify_checkpoint(previous).ok
    load_checkpoint(previous)


def test_verify_report_lists_every_part_with_digest(tmp_path, state) -> None:
    path = publish(tmp_path, "step_2", state)
    report = verify_checkpoint(path)
    assert report.ok
    assert {p.part for p in report.parts} == {
        "model",
        "optimizer",
        "schedule",
        "scaler",
        "progress",
        "rng",
        "data",
    }
    manifest = json.loads((path / "manifest.json").read_bytes())
    for p in report.parts:  # digests recomputed here from the files' bytes
        digest = hashlib.sha256((path / p.file).read_bytes()).hexdigest()
        assert p.actual_sha256 == digest == manifest["files"][p.file]["sha256"]
    json.dumps(report.to_dict())


def test_publication_leaves_no_temporaries(tmp_path, state) -> None:
    publish(tmp_path, "step_1", state)
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "step_1"]
