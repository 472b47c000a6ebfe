"""X1-X4 end to end: a tiny real run through the CLI, its run directory, and the
one-line errors a user sees for bad configuration and bad data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from exactstep.cli import main
from exactstep.manifest import canonical_json, read_manifest
from exactstep.state.checkpoint import latest_checkpoint, verify_checkpoint

TINY = [
    "--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
    "--set", "model.d_ff=64", "--set", "batch.rows=2", "--set", "batch.seq_len=64",
    "--set", "train.eval_tokens=2000", "--set", "update.warmup=2",
]


def write_jsonl(path: Path, n: int = 40) -> Path:
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 3)})
             for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_train_writes_a_complete_run_directory(tmp_path, capsys) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl")
    out = tmp_path / "run"
    code, stdout, _ = run_cli(
        ["train", "--out", str(out), "--no-progress", "--set", f"data.source={data}",
         "--set", "train.steps=6", "--set", "checkpoint.every=3", "--set", "update.accum=2",
         *TINY], capsys)
    assert code == 0
    for name in ("manifest.json", "ledger.jsonl", "metrics.jsonl", "loss.png",
                 "summary.json", "data_report.json"):
        assert (out / name).is_file(), name
    # S1: the manifest's digest is the sha256 of its canonical body
    raw = json.loads((out / "manifest.json").read_text())
    manifest = read_manifest(out)
    assert manifest.digest == raw["digest"]
    import hashlib

    assert hashlib.sha256(canonical_json(raw["manifest"])).hexdigest() == raw["digest"]
    assert raw["manifest"]["objective"]["shift_owner"] == "collator"
    # U4: one ledger line per window
    ledger = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert [r["window"] for r in ledger] == list(range(6))
    assert all(r["disposition"] == "COMMITTED" for r in ledger)
    # S3: LATEST points at a committed checkpoint with the weights as safetensors
    latest = latest_checkpoint(out / "checkpoints")
    assert latest is not None and (latest / "model.safetensors").is_file()
    assert verify_checkpoint(latest).ok
    summary = json.loads((out / "summary.json").read_text())
    assert summary["windows"]["committed"] == 6
    assert summary["heldout_tokens"] > 0
    assert "bits per byte" in stdout and "unigram baseline" in stdout


def test_train_refuses_an_existing_run(tmp_path, capsys) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl")
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--no-progress", "--set", f"data.source={data}",
            "--set", "train.steps=1", *TINY]
    assert run_cli(args, capsys)[0] == 0
    code, _, err = run_cli(args, capsys)
    assert code != 0
    assert "already holds a run" in err


@pytest.mark.parametrize(
    ("setup", "extra", "needle"),
    [
        (None, ["--set", "update.lrr=1"], "update.lrr"),
        (None, ["--set", "numerics.precision=fp8"], "numerics.precision"),
        ("missing", [], "does not exist"),
        ("malformed", [], "line 2"),
        ("no_text", [], "text"),
        ("empty", [], "empty"),
    ],
)
def test_user_errors_are_one_line_and_nonzero(tmp_path, capsys, setup, extra, needle) -> None:
    data = tmp_path / "docs.jsonl"
    if setup == "malformed":
        data.write_text('{"text": "ok"}\n{"text": \n')
    elif setup == "no_text":
        data.write_text('{"body": "no text key"}\n')
    elif setup == "empty":
        data.write_text("")
    elif setup is None:
        write_jsonl(data)
    code, _, err = run_cli(["train", "--out", str(tmp_path / "run"), "--no-progress",
                            "--set", f"data.source={data}", *TINY, *extra], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert needle in lines[0]
    assert "Traceback" not in err


def test_error_from_a_real_process_has_no_traceback(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "exactstep", "train", "--out", str(tmp_path / "r"),
         "--set", "batch.rows=zero"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "batch.rows" in proc.stderr and "Traceback" not in proc.stderr


def test_inspect_shows_the_shift(tmp_path, capsys) -> None:
    data = write_jsonl(tmp_path / "docs.jsonl")
    code, out, err = run_cli(["inspect", "--set", f"data.source={data}", "--set",
                              "batch.seq_len=32", "--set", "batch.rows=2", "--rows", "0:2"],
                             capsys)
    assert code == 0, err
    assert "<bos>" in out


def test_bench_list_is_exactly_the_shipped_benchmarks(capsys) -> None:
    # the helper module is not a benchmark; names written out, not taken from the code
    code, out, _ = run_cli(["bench", "list"], capsys)
    assert code == 0
    assert out.split() == ["attention", "checkpoint", "ddp", "loss", "packing", "step"]


def test_unknown_benchmark_names_the_available_ones(capsys) -> None:
    code, _, err = run_cli(["bench", "nosuch"], capsys)
    assert code == 2
    assert err.strip() == ("error: unknown benchmark 'nosuch'; available: "
                           "attention, checkpoint, ddp, loss, packing, step")

