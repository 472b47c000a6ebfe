"""A checkpoint of another run is refused by ``resume --from`` (S2, S4, S8, X4).

Runs A and B are the same but for ``checkpoint.keep``, a field that changes no
window: their ledgers are byte for byte the same, so the journal check cannot tell
them apart, and B's own manifest matches B's configuration. Only the checkpoint's
recorded manifest digest (``check_progress_digest``) says A's window-2 checkpoint is
not B's. ``exactstep resume B --from A/checkpoints/window-00000002`` must be one
``error:`` line naming the manifest mismatch, and leave every file of B as it was.

Controls: the two ledgers are identical (so nothing else would refuse), the digests
differ, and B resumes from its own window-2 checkpoint. Without the digest check the
refusal test fails (B is resumed from A's state and rewritten); checked by hand.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from run_support import set_args, short_texts, write_texts

from exactstep.cli import main
from exactstep.state.manifest import read_manifest

pytestmark = pytest.mark.timeout(300)

POINT = "window-00000002"


def settings(source: Path, keep: int) -> list[str]:
    return set_args({
        "seed": 2, "data.source": source, "data.val_fraction": 0.2, "batch.seq_len": 32,
        "batch.rows": 2, "model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2,
        "model.d_ff": 32, "update.warmup": 1, "train.steps": 4, "train.eval_tokens": 64,
        "train.threads": 1, "train.device": "cpu", "checkpoint.every": 2,
        "checkpoint.keep": keep,
    })


def digests(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("two-runs")
    source = write_texts(root / "docs.jsonl", short_texts(40))
    for name, keep in (("a", 2), ("b", 3)):
        assert main(["train", "--out", str(root / name), "--no-progress",
                     *settings(source, keep)]) == 0
    return root / "a", root / "b"


def test_a_checkpoint_of_a_run_differing_only_in_keep_is_refused(runs, tmp_path: Path,
                                                                   capfd) -> None:
    a, b = runs
    assert (a / "ledger.jsonl").read_bytes() == (b / "ledger.jsonl").read_bytes()
    digest_a, digest_b = read_manifest(a).digest, read_manifest(b).digest
    assert digest_a != digest_b
    before = digests(b)
    capfd.readouterr()
    code = main(["resume", str(b), "--no-progress", "--from",
                 str(a / "checkpoints" / POINT)])
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err
    assert "manifest" in lines[0] and digest_a[:12] in lines[0] and digest_b[:12] in lines[0]
    assert digests(b) == before


def test_control_the_run_resumes_from_its_own_checkpoint(runs, tmp_path: Path) -> None:
    import shutil

    _, b = runs
    copy = tmp_path / "b"
    shutil.copytree(b, copy)
    assert main(["resume", str(copy), "--no-progress", "--from",
                 str(copy / "checkpoints" / POINT)]) == 0
    assert (copy / "ledger.jsonl").read_bytes() == (b / "ledger.jsonl").read_bytes()
