"""S9: the numerics environment is state.

A run records the environment a bitwise continuation depends on (threads, torch
build, device, CPU dispatch, deterministic switch) in its manifest and in each
checkpoint. A plain resume restores the recorded thread count whatever the resuming
process's default, so a run trained at one thread resumes bitwise under
``OMP_NUM_THREADS`` unset, 1 or 2 (and its checkpoints record 1 as the count used); an
explicit other count is a declared, non-bitwise continuation (one line, a CONTINUATION
ledger line, the count used recorded as 2) and is the negative control.
``checkpoint verify`` and ``eval`` print the record. A run whose history proves a
checkpoint was published, but none is left, is refused unchanged (S8).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from families.test_family_kill_resume import FAMILIES, FamilyHarness, lines
from run_support import TINY, set_args, tree_digests
from state.test_kill_resume import final_state, killed
from text_corpus import write_corpus

from exactstep.cli import main
from exactstep.state import environment
from exactstep.state.compare import state_differences


def test_capture_records_what_torch_reports_and_the_run_gives_the_count_back():
    before = torch.get_num_threads()
    with environment.numerics_restored():
        torch.set_num_threads(1)
        record = environment.capture("cpu")
    assert torch.get_num_threads() == before
    assert record["threads"] == 1
    assert record["torch"] == str(torch.__version__)
    assert record["device"] == "cpu" and record["gpu"] is None and record["cuda"] is None
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert record["deterministic"] is torch.are_deterministic_algorithms_enabled()
    assert json.loads(json.dumps(record)) == record  # plain data, written as it is
    assert environment.differences(record, dict(record)) == []
    # negative controls: each field that differs is named with both values
    assert environment.differences(record, {**record, "threads": 2}) == ["threads 1 -> 2"]
    other = {**record, "cpu_capability": "DEFAULT", "deterministic": True}
    assert [d.split()[0] for d in environment.differences(record, other)] == [
        "cpu_capability", "deterministic"]
    assert environment.differences(None, record) == ["environment not recorded"]


def continuation_lines(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == "CONTINUATION"]


@pytest.mark.slow
def test_a_run_trained_at_one_thread_resumes_plainly_bitwise_under_any_thread_default(
        tmp_path, capsys):
    """The defect: ``train.threads=1``, then a plain ``resume`` ran at PyTorch's
    default (2 on two cores) and ended elsewhere without a word (mlm, tiny shapes)."""
    h = FamilyHarness(tmp_path, FAMILIES["mlm"])
    straight = tmp_path / "straight"
    assert h.train(straight, omp="2") == 0, h.last_output
    run_dir = tmp_path / "killed"
    assert killed(h.train(run_dir, kill_at="window_end:3", omp="2")), h.last_output
    assert lines(run_dir) == 3
    copies = {setting: tmp_path / f"resumed-{setting or 'unset'}" for setting in (None, "1", "2")}
    override = tmp_path / "override"
    for path in [*copies.values(), override]:
        shutil.copytree(run_dir, path)

    def resume(path: Path, omp: str | None, *extra: str) -> tuple[int, str]:
        harness = FamilyHarness(tmp_path, FAMILIES["mlm"])
        status = harness.launch(["resume", "--no-progress", str(path), *extra], run_dir=path,
                                omp=omp)
        return status, harness.last_output

    with ThreadPoolExecutor(2) as pool:
        plain = {s: pool.submit(resume, p, s) for s, p in copies.items()}
        declared = pool.submit(resume, override, None, "--set", "train.threads=2")
        results = {s: f.result() for s, f in plain.items()}
        status, output = declared.result()

    name, expected = final_state(straight)
    for setting, path in copies.items():
        assert results[setting][0] == 0, results[setting][1]
        assert "non-bitwise" not in results[setting][1]
        got_name, got = final_state(path)
        assert got_name == name
        assert state_differences(expected, got) == [], f"OMP_NUM_THREADS={setting}"
        assert (path / "ledger.jsonl").read_bytes() == (straight / "ledger.jsonl").read_bytes()
        assert (path / "manifest.json").read_bytes() == (straight / "manifest.json").read_bytes()
        # the count the resumed process really computed with, whatever this CPU's
        # kernels make of 1 and 2 threads (on some, mlm's states are bitwise equal)
        assert got["progress"]["environment"]["threads"] == 1, f"OMP_NUM_THREADS={setting}"
    manifest = json.loads((straight / "manifest.json").read_text())["manifest"]
    assert manifest["environment"]["threads"] == 1
    assert "threads" not in manifest["config"]["train"]  # recorded as the count used

    # negative control: another count given explicitly is declared, and is not bitwise
    assert status == 0, output
    said = [line for line in output.splitlines() if "non-bitwise" in line]
    assert len(said) == 1 and "threads 1 -> 2" in said[0], output
    (event,) = continuation_lines(override)
    assert event["bitwise"] is False and event["differs"] == ["threads 1 -> 2"]
    assert event["recorded"]["threads"] == 1 and event["environment"]["threads"] == 2
    assert event["next_window"] == 2  # the checkpoint it continued from
    # (whether 2 threads round differently from 1 is the CPU's affair: the declared
    # facts are the control, never a state difference this machine may not make)
    # the checkpoint written after the continuation records the new environment,
    # and the run keeps its manifest (a later plain resume is the same run)
    assert (override / "manifest.json").read_bytes() == (straight / "manifest.json").read_bytes()
    assert final_state(override)[1]["progress"]["environment"]["threads"] == 2

    # checkpoint verify and eval print what the checkpoint recorded
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(straight)]) == 0
    verified = capsys.readouterr().out
    assert "verdict   OK" in verified
    numerics = [line for line in verified.splitlines() if line.strip().startswith("numerics")]
    assert len(numerics) == 1 and "threads=1" in numerics[0]
    assert f"cpu_capability={torch.backends.cpu.get_cpu_capability()}" in numerics[0]
    before = torch.get_num_threads()
    assert main(["eval", str(straight)]) == 0
    evaluated = capsys.readouterr().out
    assert "numerics threads=1" in evaluated and "(as the checkpoint recorded)" in evaluated
    assert torch.get_num_threads() == before


def tiny_run(tmp_path: Path, name: str, **extra) -> Path:
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(corpus)
    run_dir = tmp_path / name
    pairs = {**TINY, "seed": 1, "data.source": str(corpus), "train.steps": 4,
             "train.threads": 1, "train.eval_tokens": 32, "checkpoint.every": 2, **extra}
    assert main(["train", "--no-progress", "--out", str(run_dir), *set_args(pairs)]) == 0
    return run_dir


def test_lost_checkpoints_are_refused_unchanged_and_a_run_never_checkpointed_restarts(
        tmp_path, capsys):
    """S8: ``resume`` of a finished run whose checkpoints/ was removed started again at
    window 0 and rewrote the run directory, although its history proved committed
    windows. It must be refused, naming what is missing, and change nothing."""
    finished = tiny_run(tmp_path, "finished")
    shutil.rmtree(finished / "checkpoints")
    cases = {"summary": finished}
    # the ledger alone is evidence too: 4 windows, a checkpoint every 2
    logged = tmp_path / "logged"
    shutil.copytree(finished, logged)
    (logged / "summary.json").unlink()
    cases["ledger"] = logged
    for evidence, run_dir in cases.items():
        before = tree_digests(run_dir)
        capsys.readouterr()
        assert main(["resume", "--no-progress", str(run_dir)]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:"), err
        assert "checkpoints were lost" in err[0] and "nothing was changed" in err[0]
        assert ("summary.json" if evidence == "summary" else "ledger.jsonl holds 4") in err[0]
        assert tree_digests(run_dir) == before
    # at the boundary: one window more than the cadence (3, every 2) proves the
    # checkpoint after window 2 was published before window 3 was logged
    beyond = tmp_path / "beyond"
    shutil.copytree(logged, beyond)
    ledger = beyond / "ledger.jsonl"
    ledger.write_bytes(b"".join(ledger.read_bytes().splitlines(keepends=True)[:3]))
    before = tree_digests(beyond)
    assert main(["resume", "--no-progress", str(beyond)]) != 0
    assert "ledger.jsonl holds 3 windows" in capsys.readouterr().err
    assert tree_digests(beyond) == before
    # negative controls: a run killed before its first checkpoint has no such evidence
    # and starts again from window 0: one window logged, or exactly checkpoint.every
    # (killed while publishing the first checkpoint, which is written after window 2
    # is logged)
    for kept in (1, 2):
        early = tmp_path / f"early-{kept}"
        shutil.copytree(logged, early)
        ledger = early / "ledger.jsonl"
        ledger.write_bytes(b"".join(ledger.read_bytes().splitlines(keepends=True)[:kept]))
        assert main(["resume", "--no-progress", str(early)]) == 0, kept
        assert (early / "ledger.jsonl").read_bytes() == (finished / "ledger.jsonl").read_bytes()
