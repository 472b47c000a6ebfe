"""S8 damage campaign: every file of a checkpoint and of the run directory is flipped,
truncated or deleted (and ``LATEST`` removed, garbled or left dangling), then
``exactstep resume`` runs. In every case no published checkpoint is ever removed:
each one's files still exist byte for byte, in place or in ``quarantine/``. The
outcome is one of two, decided per case:

* refused: exit 2, exactly one ``error:`` line, no traceback, and every file of the
  run directory byte-identical to before;
* resumed: exit 0, and the final checkpoint verifies and holds exactly the files of
  the undamaged run's final checkpoint (the state is bitwise the same).

Negative control: the same preservation check fails on a clean-up that deletes
published checkpoints newer than a dangling ``LATEST`` (the defect this replaces).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from run_support import tree_digests
from text_corpus import write_corpus

from exactstep.cli import main
from exactstep.state import verify_checkpoint

pytestmark = pytest.mark.slow

CHECKPOINT_FILES = ["counters.json", "data.json", "manifest.json", "model.safetensors",
                    "optimizer.pt", "progress.json", "rng.pt", "scaler.json", "scheduler.json"]
RUN_FILES = ["manifest.json", "ledger.jsonl", "metrics.jsonl", "summary.json",
             "data_report.json", "loss.png"]
DAMAGES = ["flip", "truncate", "delete"]
FINAL, OLDER = "window-00000006", "window-00000004"


def settings(corpus: Path) -> list[str]:
    return ["--set", f"data.source={corpus}", "data.val_fraction=0.2", "batch.seq_len=32",
            "batch.rows=2", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
            "model.d_ff=32", "train.steps=6", "checkpoint.every=2", "checkpoint.keep=3",
            "train.eval_tokens=64", "update.warmup=2", "train.threads=1", "train.device=cpu"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("damage")
    write_corpus(root / "corpus.jsonl")
    assert main(["train", "--no-progress", "--out", str(root / "run"),
                 *settings(root / "corpus.jsonl")]) == 0
    return root / "run"


def checkpoint_contents(run_dir: Path) -> list[dict[str, str]]:
    """The files of every checkpoint directory, in place or quarantined."""
    root = run_dir / "checkpoints"
    dirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    dirs = [d for d in dirs if d.name != "quarantine"]
    if (root / "quarantine").is_dir():
        dirs += list((root / "quarantine").iterdir())
    return [{f.relative_to(d).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
             for f in d.rglob("*") if f.is_file()} for d in dirs]


def published_before(run_dir: Path) -> list[dict[str, str]]:
    return [c for c in checkpoint_contents(run_dir) if c]


def assert_nothing_published_was_removed(before: list[dict[str, str]], run_dir: Path) -> None:
    after = checkpoint_contents(run_dir)
    for contents in before:
        assert contents in after, f"a published checkpoint lost files: {sorted(contents)}"


def damage(file: Path, how: str) -> None:
    data = file.read_bytes()
    if how == "flip":
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01
        file.write_bytes(bytes(flipped))
    elif how == "truncate":
        file.write_bytes(data[: len(data) // 2])
    else:
        file.unlink()


def resume(run_dir: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["resume", "--no-progress", str(run_dir), *extra])
    _, err = capsys.readouterr()
    return code, err


def assert_refused(code: int, err: str, before: dict[str, str], run_dir: Path) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert tree_digests(run_dir) == before


def final_files(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoints" / FINAL / "manifest.json").read_bytes())["files"]


def assert_resumed(code: int, err: str, base: Path, run_dir: Path) -> None:
    assert code == 0, err
    assert "Traceback" not in err and "error:" not in err
    assert verify_checkpoint(run_dir / "checkpoints" / FINAL).ok
    assert (run_dir / "checkpoints" / "LATEST").read_text() == FINAL + "\n"
    assert final_files(run_dir) == final_files(base)


def copy_of(base: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(base, run_dir)
    return run_dir


def test_the_campaign_covers_every_file(base) -> None:
    assert sorted(p.name for p in (base / "checkpoints" / FINAL).iterdir()) == CHECKPOINT_FILES
    top = sorted(p.name for p in base.iterdir() if p.is_file())
    assert top == sorted(RUN_FILES)


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("filename", CHECKPOINT_FILES)
def test_damaged_latest_checkpoint_is_refused_and_nothing_changes(base, tmp_path, capsys,
                                                                   filename, how) -> None:
    run_dir = copy_of(base, tmp_path)
    damage(run_dir / "checkpoints" / FINAL / filename, how)
    before = tree_digests(run_dir)
    code, err = resume(run_dir, capsys)
    assert_refused(code, err, before, run_dir)
    assert f"--from {run_dir / 'checkpoints' / OLDER}" in err  # names the fallback


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("filename", CHECKPOINT_FILES)
def test_damaged_older_checkpoint_is_kept_and_the_run_resumes(base, tmp_path, capsys,
                                                              filename, how) -> None:
    run_dir = copy_of(base, tmp_path)
    damage(run_dir / "checkpoints" / OLDER / filename, how)
    before = published_before(run_dir)
    code, err = resume(run_dir, capsys)
    assert_resumed(code, err, base, run_dir)
    assert_nothing_published_was_removed(before, run_dir)


# What each damage to a run-directory file leads to. Metrics lines hold timings, so
# their record is a line count: a flipped byte that keeps every line valid JSON is
# not detectable there, and the run may go on.
RUN_FILE_OUTCOME = {
    "manifest.json": "refused", "ledger.jsonl": "refused", "metrics.jsonl": "refused",
    "summary.json": "resumed", "data_report.json": "resumed", "loss.png": "resumed",
}


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("filename", RUN_FILES)
def test_damaged_run_file(base, tmp_path, capsys, filename, how) -> None:
    run_dir = copy_of(base, tmp_path)
    damage(run_dir / filename, how)
    before, published = tree_digests(run_dir), published_before(run_dir)
    code, err = resume(run_dir, capsys)
    expected = RUN_FILE_OUTCOME[filename]
    if filename == "metrics.jsonl" and how == "flip" and code == 0:
        expected = "resumed"
    if expected == "refused":
        assert_refused(code, err, before, run_dir)
        assert filename in err
    else:
        assert_resumed(code, err, base, run_dir)
    assert_nothing_published_was_removed(published, run_dir)


@pytest.mark.parametrize("latest", ["missing", "garbage", "dangling"])
def test_broken_latest_is_recovered_from_the_newest_checkpoint_that_verifies(
        base, tmp_path, capsys, latest) -> None:
    run_dir = copy_of(base, tmp_path)
    pointer = run_dir / "checkpoints" / "LATEST"
    if latest == "missing":
        pointer.unlink()
    elif latest == "garbage":
        pointer.write_bytes(b"\xff\xfe not a name/\n")
    else:
        pointer.write_text("window-00000099\n")
    published = published_before(run_dir)
    code, err = resume(run_dir, capsys)
    assert_resumed(code, err, base, run_dir)
    assert f"resuming from {FINAL}, the newest checkpoint that verifies" in err
    assert_nothing_published_was_removed(published, run_dir)


def test_issue_repro_deleted_final_checkpoint_and_resume_from_an_earlier_one(
        base, tmp_path, capsys) -> None:
    """The reported defect: LATEST dangling after the final checkpoint was removed;
    ``resume --from`` an earlier one must keep every checkpoint and finish exactly."""
    run_dir = copy_of(base, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / FINAL)
    published = published_before(run_dir)
    code, err = resume(run_dir, capsys, "--from", str(run_dir / "checkpoints" / OLDER))
    assert_resumed(code, err, base, run_dir)
    assert_nothing_published_was_removed(published, run_dir)
    assert (run_dir / "ledger.jsonl").read_bytes() == (base / "ledger.jsonl").read_bytes()


def test_resume_from_earlier_replaces_a_damaged_final_checkpoint(base, tmp_path, capsys) -> None:
    """Re-publishing the damaged final name quarantines the damaged copy and puts the
    recomputed one in place, so ``checkpoint verify RUN`` passes again (S8)."""
    run_dir = copy_of(base, tmp_path)
    damage(run_dir / "checkpoints" / FINAL / "optimizer.pt", "flip")
    assert main(["checkpoint", "verify", str(run_dir)]) == 1
    code, err = resume(run_dir, capsys, "--from", str(run_dir / "checkpoints" / OLDER))
    assert_resumed(code, err, base, run_dir)
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(run_dir)]) == 0
    quarantined = run_dir / "checkpoints" / "quarantine" / FINAL
    assert verify_checkpoint(quarantined).bad_files == ["optimizer.pt"]


def test_preservation_check_catches_a_clean_up_that_deletes(base, tmp_path) -> None:
    """Negative control: the old clean-up removed checkpoints not below LATEST."""
    run_dir = copy_of(base, tmp_path)
    published = published_before(run_dir)
    (run_dir / "checkpoints" / "LATEST").write_text("window-00000099\n")
    for name in (FINAL, OLDER, "window-00000002"):  # what the defective clean-up did
        shutil.rmtree(run_dir / "checkpoints" / name)
    with pytest.raises(AssertionError, match="lost files"):
        assert_nothing_published_was_removed(published, run_dir)
