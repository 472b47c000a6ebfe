"""X1-X4 end to end: a tiny real run through the CLI, its run directory, and the
one-line errors a user sees for bad configuration and bad data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from exactstep.cli import main
from exactstep.state import latest_checkpoint, verify_checkpoint
from exactstep.state.manifest import read_manifest

TINY = [  # on the CPU: a GPU host would otherwise train on CUDA (train.device = auto)
    "--set", "train.device=cpu",
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

    text = json.dumps(raw["manifest"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert hashlib.sha256((text + "\n").encode()).hexdigest() == raw["digest"]
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
        (None, ["--set", 'model.lora={"rank": 4}'], "unknown config key 'model.lora.rank'"),
        (None, ["--set", 'model.lora={"r": 4'], "'model.lora' is a section"),
        ("missing", [], "does not exist"),
        ("malformed", [], "docs.jsonl:2: not valid JSON"),
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


def test_inspect_shows_the_layout_of_the_world_it_is_given(tmp_path, capsys) -> None:
    """D1, D3: ``inspect --world 4`` prints ``Layout.section()`` (every axis, the world,
    the mesh order) and each rank's place: four data replicas, each its own loss owner."""
    data = write_jsonl(tmp_path / "docs.jsonl")
    code, out, err = run_cli(["inspect", "--world", "4", "--set", f"data.source={data}",
                              "--set", "batch.seq_len=32", "--set", "batch.rows=2"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == ("layout: 4 processes = pp 1 x dp 4 x cp 1 x tp 1 (mesh order pp, dp, "
                        "cp, tp, the last innermost); parallel.strategy = ddp")
    assert [line.split() for line in lines[2:6]] == [
        [str(r), "0", str(r), "0", "0", "yes"] for r in range(4)]
    assert lines[6].startswith("row 0:")


def test_inspect_refuses_a_world_the_model_axes_do_not_divide(tmp_path, capsys) -> None:
    code, out, err = run_cli(["inspect", "--world", "3", "--set", "parallel.tp=2"], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: 3 processes cannot be split into parallel.tp = 2 x parallel.pp = 1 x "
        "parallel.cp = 1 (2 ranks a replica); launch a multiple of 2 processes or change the axes"]


# pp 2 x dp 2 x tp 2, written out from rank = (pp * dp + dp) * tp + tp: the loss owners
# are tensor shard 0 of the last stage (ranks 4 and 6)
SPLIT_RANKS = [
    # rank pp dp cp tp owner
    "0 0 0 0 0 no", "1 0 0 0 1 no", "2 0 1 0 0 no", "3 0 1 0 1 no",
    "4 1 0 0 0 yes", "5 1 0 0 1 no", "6 1 1 0 0 yes", "7 1 1 0 1 no",
]


def test_inspect_layout_lines_place_every_rank_of_a_split_replica(monkeypatch) -> None:
    """Every axis of a split layout (what ``inspect`` prints for it, D1): each rank's
    coordinates tp innermost and its loss ownership. Negative control: a layout whose
    coordinates put dp innermost renders differently, so the comparison catches it."""
    from exactstep.commands.inspect import layout_lines
    from exactstep.parallel.layout import Layout

    lines = layout_lines(Layout(pp=2, dp=2, tp=2), "fsdp")
    assert lines[0] == ("layout: 8 processes = pp 2 x dp 2 x cp 1 x tp 2 (mesh order pp, dp, "
                        "cp, tp, the last innermost); parallel.strategy = fsdp")
    assert [" ".join(line.split()) for line in lines[2:]] == SPLIT_RANKS

    def dp_innermost(self):  # WRONG: the data axis varies fastest
        rest, out = self.rank, {}
        for dim in ("dp", "tp", "cp", "pp"):
            out[dim], rest = rest % getattr(self, dim), rest // getattr(self, dim)
        return out

    monkeypatch.setattr(Layout, "coords", dp_innermost)
    wrong = layout_lines(Layout(pp=2, dp=2, tp=2), "fsdp")
    assert [" ".join(line.split()) for line in wrong[2:]] != SPLIT_RANKS


def test_bench_list_is_exactly_the_shipped_benchmarks(capsys) -> None:
    # the helper module is not a benchmark; names written out, not taken from the code
    code, out, _ = run_cli(["bench", "list"], capsys)
    assert code == 0
    assert out.split() == ["attention", "checkpoint", "ddp", "default", "denormals",
                           "families", "finetune", "grpo", "hf", "loader", "loss",
                           "packing", "prepare", "rollout", "step"]


def test_unknown_benchmark_names_the_available_ones(capsys) -> None:
    code, _, err = run_cli(["bench", "nosuch"], capsys)
    assert code == 2
    assert err.strip() == ("error: unknown benchmark 'nosuch'; available: "
                           "attention, checkpoint, ddp, default, denormals, families, "
                           "finetune, grpo, hf, loader, loss, packing, prepare, rollout, "
                           "step")


# ---------------------------------------------------------------- start-up cost (X4)


def imported_top_modules(importtime_stderr: str) -> set[str]:
    """Top-level package names in ``python -X importtime`` output."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            names.add(name.split(".")[0])
    return names - {"package"}  # the header line


def usage_error(stderr_lines: list[str], prog: str) -> str:
    """A usage error (X4): exactly one line, ``error: <prog>: <argparse's message>; see
    '<prog> --help'`` (no usage block); returns argparse's message."""
    lines = [line for line in stderr_lines if line.strip()]
    assert len(lines) == 1, stderr_lines
    head, hint = f"error: {prog}: ", f"; see '{prog} --help'"
    assert lines[0].startswith(head) and lines[0].endswith(hint), lines
    return lines[0][len(head):-len(hint)]


def run_importtime(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def without_importtime(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


def test_a_usage_error_does_not_import_torch() -> None:
    proc = run_importtime(["-m", "exactstep", "train", "--bogus"])
    assert proc.returncode == 2
    # argparse reports an unknown option of a sub-command at the top level
    assert usage_error(without_importtime(proc.stderr), "exactstep") == (
        "unrecognized arguments: --bogus")
    imported = imported_top_modules(proc.stderr)
    assert "exactstep" in imported  # the detector sees the package itself ...
    assert not imported & {"torch", "numpy"}  # ... and nothing heavy


@pytest.mark.parametrize(
    "args",
    [["--help"], ["train", "--help"], ["resume", "--help"], ["bench", "--help"],
     ["bench", "list"], ["audit", "--help"]],
)
def test_help_and_bench_list_do_not_import_torch(args) -> None:
    proc = run_importtime(["-m", "exactstep", *args])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not without_importtime(proc.stderr)
    assert "torch" not in imported_top_modules(proc.stderr)


def test_every_command_body_is_found_from_its_name() -> None:
    """``cli`` parses and dispatches: ``exactstep NAME`` runs ``exactstep.commands.NAME``'s
    ``run``. Every command the parser offers has that module, and every module there is
    a command but ``launch`` (which runs the others under torchrun). Read with ``ast``,
    nothing imported."""
    import argparse
    import ast

    from exactstep.cli import build_parser

    folder = Path(__file__).resolve().parents[1] / "src" / "exactstep" / "commands"
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bodies = {p.stem for p in folder.glob("*.py")
              if "run" in {f.name for f in ast.parse(p.read_text()).body
                           if isinstance(f, ast.FunctionDef)}}
    assert bodies == set(sub.choices)
    assert {p.stem for p in folder.glob("*.py")} - bodies == {"__init__", "launch"}


def test_the_import_detector_sees_torch() -> None:
    # negative control: the check above fails for a command path that does load torch
    proc = run_importtime(["-c", "import exactstep.run.runner"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch" in imported_top_modules(proc.stderr)


# ------------------------------------------------------------------- --set forms (X2)


@pytest.mark.parametrize("head", [["train"], ["inspect"], ["resume", "runs/r"]])
def test_set_takes_several_pairs_after_one_flag_or_repeated_flags(head) -> None:
    from exactstep.cli import build_parser

    expected = ["update.lr=1e-3", "train.steps=7", "batch.rows=3"]
    for form in (
        ["--set", "update.lr=1e-3", "train.steps=7", "batch.rows=3"],
        ["--set", "update.lr=1e-3", "--set", "train.steps=7", "--set", "batch.rows=3"],
        ["--set", "update.lr=1e-3", "train.steps=7", "--set", "batch.rows=3"],
    ):
        args = build_parser().parse_args([*head, *form])
        assert args.overrides == expected, form
        if head[0] == "resume":
            assert args.run_dir == "runs/r"


def test_both_set_forms_reach_the_configuration() -> None:
    from exactstep.cli import build_parser
    from exactstep.config import load_config

    for form in (["--set", "update.lr=1e-3", "train.steps=7"],
                 ["--set", "update.lr=1e-3", "--set", "train.steps=7"]):
        cfg = load_config(None, build_parser().parse_args(["train", *form]).overrides)
        assert cfg.update.lr == 1e-3 and cfg.train.steps == 7, form


def test_a_section_set_as_json_reaches_the_run(tmp_path, capsys) -> None:
    """X2: ``--set 'model.lora={"r": 4, "alpha": 8}'`` trains with those keys, recorded in
    the manifest as ``--set model.lora.r=4 model.lora.alpha=8`` would be."""
    data = write_jsonl(tmp_path / "docs.jsonl")
    runs = {}
    for name, form in (("json", ['model.lora={"r": 4, "alpha": 8}']),
                       ("keys", ["model.lora.r=4", "model.lora.alpha=8"])):
        runs[name] = tmp_path / name
        code, _, err = run_cli(["train", "--out", str(runs[name]), "--no-progress",
                                "--set", f"data.source={data}", "--set", "train.steps=1", *TINY,
                                "--set", *form], capsys)
        assert code == 0, err
    configs = [read_manifest(run).body["config"] for run in runs.values()]
    assert configs[0] == configs[1]
    assert configs[0]["model"]["lora"]["r"] == 4 and configs[0]["model"]["lora"]["alpha"] == 8.0


def test_fsdp_in_one_process_prints_one_line_that_it_runs_unsharded(tmp_path, capsys) -> None:
    """D4: one process asked for ``parallel.strategy=fsdp`` trains unsharded and says so
    in exactly one stderr line; the default ``ddp`` run prints no such line."""
    data = write_jsonl(tmp_path / "docs.jsonl")
    lines = {}
    for strategy in ("ddp", "fsdp"):
        code, _, err = run_cli(["train", "--out", str(tmp_path / strategy), "--no-progress",
                                "--set", f"data.source={data}", "--set", "train.steps=1", *TINY,
                                "--set", f"parallel.strategy={strategy}"], capsys)
        assert code == 0, err
        lines[strategy] = [line for line in err.splitlines() if "unsharded" in line]
    assert lines["ddp"] == []
    assert len(lines["fsdp"]) == 1 and "parallel.strategy = fsdp" in lines["fsdp"][0]


@pytest.mark.parametrize(
    ("argv", "bad"),
    [(["train", "--set", "update.lr"], "update.lr"),
     (["inspect", "--set", "batch.rows=2", "batch.seq_len"], "batch.seq_len"),
     (["resume", "runs/r", "--set", "=3"], "=3"),
     (["resume", "--set", "update.lr=1", "runs/r"], "runs/r")],
)
def test_a_set_value_without_equals_is_a_usage_error(capsys, argv, bad) -> None:
    assert main(argv) == 2
    assert usage_error(capsys.readouterr().err.splitlines(), f"exactstep {argv[0]}") == (
        "argument --set: expected KEY=VALUE "
        f"(e.g. update.lr=3e-4), got {bad!r}; a positional argument such as RUN_DIR goes "
        "before --set"
    )

