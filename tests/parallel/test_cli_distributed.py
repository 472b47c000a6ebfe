"""The distributed run end to end through the real command line (D1, D3, S5, S7, X4).

``exactstep train --nproc 2`` (torchrun's launcher, gloo on CPU) runs N windows
straight. The same run with rank 1 SIGKILLed at the start of window 3 must stop in
bounded time with a non-zero exit and one ``error:`` line, and ``exactstep resume
--nproc 2`` must reach the same final state: the DCP model and optimizer tensors,
every rank's RNG streams and data cursor, the common state and the ledger, all
bitwise. Negative control: a resume that does not restore the data cursor must end
elsewhere. A world-size change is refused naming ``parallel.world_size`` unless
``--reshard`` is given, and the ledger's D is the sum of every rank's denominator.

The kill and the defect reach the workers through a ``sitecustomize`` module on
``PYTHONPATH`` (written into the test's directory), which every Python process
the launcher starts imports before ``exactstep`` runs. Runs are sequential: two
worker processes at a time.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import process_server
import pytest
from cli_support import KILL_HOOK, CliRoot, tiny_overrides
from run_support import multi_rank_state as final_state

from exactstep.state import latest_checkpoint
from exactstep.state.compare import state_differences

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WINDOWS = 6
EVERY = 2
KILL_RANK, KILL_WINDOW = 1, 3
RUN_TIMEOUT_S = 150  # every command is bounded; a hang fails the test instead

HOOK = KILL_HOOK + r"""
if os.environ.get("EXACTSTEP_TEST_DEFECT") == "no_cursor":
    from exactstep.rows.stream import RowStream
    RowStream.load_state_dict = lambda self, state: None
"""


def overrides(corpus: Path) -> list[str]:
    return tiny_overrides(corpus, windows=WINDOWS, every=EVERY)


class Cli(CliRoot):
    def __init__(self, root: Path) -> None:
        super().__init__(root, HOOK)

    def __call__(self, *args: str, kill_at: str = "", defect: str = "") -> tuple[int, str, float]:
        env = self.env()
        if kill_at:
            env["EXACTSTEP_TEST_KILL_AT"] = kill_at
        if defect:
            env["EXACTSTEP_TEST_DEFECT"] = defect
        start = time.monotonic()
        proc = process_server.run([sys.executable, "-m", "exactstep", *args], cwd=self.root,
                                  env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        return proc.returncode, proc.stderr, time.monotonic() - start

    def train(self, run_dir: Path, **kw) -> tuple[int, str, float]:
        return self("train", "--nproc", "2", "--no-progress", "--out", str(run_dir),
                    *overrides(self.corpus), **kw)

    def resume(self, run_dir: Path, *extra: str, **kw) -> tuple[int, str, float]:
        return self("resume", "--no-progress", str(run_dir), *extra, **kw)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cli_dist")
    cli = Cli(root)
    out: dict = {"cli": cli}
    straight = root / "straight"
    rc, err, _ = cli.train(straight)
    assert rc == 0, err
    out["straight"] = straight

    killed = root / "killed"
    rc, err, seconds = cli.train(killed, kill_at=f"{KILL_RANK}:{KILL_WINDOW}")
    out["kill"] = {"rc": rc, "stderr": err, "seconds": seconds}
    out["latest_after_kill"] = latest_checkpoint(killed / "checkpoints")
    for name in ("no_cursor", "reshard"):
        shutil.copytree(killed, root / name)
        out[name] = root / name
    rc, err, _ = cli.resume(killed, "--nproc", "2")
    assert rc == 0, err
    out["killed"] = killed
    rc, err, _ = cli.resume(out["no_cursor"], "--nproc", "2", defect="no_cursor")
    assert rc == 0, err
    return out




def test_killed_rank_stops_the_job_with_one_error_line(runs) -> None:
    """D1, X4: a SIGKILLed rank stops the job in bounded time, exit non-zero, and the
    user sees one line naming the dead rank; the last committed checkpoint stays."""
    kill = runs["kill"]
    assert kill["rc"] != 0
    assert kill["seconds"] < 120
    lines = error_lines(kill["stderr"])
    assert len(lines) == 1, kill["stderr"]
    assert f"rank {KILL_RANK} of 2 died" in lines[0] and "SIGKILL" in lines[0], lines
    assert "Traceback" not in kill["stderr"]
    assert runs["latest_after_kill"].name == f"window-{KILL_WINDOW - KILL_WINDOW % EVERY:08d}"


def test_resume_after_a_killed_rank_reaches_the_straight_state_bitwise(runs) -> None:
    """S5 + S7 through the CLI: model and optimizer (DCP), schedule/scaler/counters,
    per-rank RNG and data cursor, and the ledger are identical to the straight run."""
    a, b = final_state(runs["straight"]), final_state(runs["killed"])
    assert a["name"] == b["name"] == f"window-{WINDOWS:08d}"
    assert set(a) >= {"model", "optim", "common", "rank0", "rank1"}
    # the optimizer's entries are keyed by parameter name (state.<name>.exp_avg, ...)
    assert any(k.startswith("state.") and k.endswith(".exp_avg") for k in a["optim"]), \
        "the optimizer state must be in the checkpoint"
    assert state_differences(a, b) == []
    straight_ledger = (runs["straight"] / "ledger.jsonl").read_text().splitlines()
    killed_ledger = (runs["killed"] / "ledger.jsonl").read_text().splitlines()
    assert len(straight_ledger) == WINDOWS
    assert killed_ledger == straight_ledger


def test_negative_control_resume_without_cursor_differs(runs) -> None:
    a, c = final_state(runs["straight"]), final_state(runs["no_cursor"])
    differences = state_differences(a, c)
    assert any(d.startswith("model.") for d in differences), differences[:10]
    assert any(d.startswith("rank0.data") for d in differences), differences[:10]


def test_world_size_change_is_refused_naming_parallel_world_size(runs) -> None:
    """S7: a 2-rank run resumed by one process without --reshard is refused (X4)."""
    cli, run_dir = runs["cli"], runs["reshard"]
    before = (run_dir / "ledger.jsonl").read_bytes()
    for extra in (("--nproc", "1"), ()):
        rc, err, _ = cli.resume(run_dir, *extra)
        assert rc != 0
        lines = error_lines(err)
        assert len(lines) == 1 and "parallel.world_size" in lines[0], err
        assert "Traceback" not in err
    assert (run_dir / "ledger.jsonl").read_bytes() == before  # nothing committed is lost


def test_reshard_to_one_process_proceeds_and_is_recorded(runs, tmp_path) -> None:
    """S7: with --reshard the migration proceeds and the ledger says so (RESHARD)."""
    cli = runs["cli"]
    run_dir = tmp_path / "reshard"
    shutil.copytree(runs["reshard"], run_dir)
    rc, err, _ = cli.resume(run_dir, "--nproc", "1", "--reshard")
    assert rc == 0, err
    records = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    events = [r for r in records if r.get("event") == "RESHARD"]
    assert len(events) == 1
    assert events[0]["old_world_size"] == 2 and events[0]["new_world_size"] == 1
    assert records[-1].get("window") == WINDOWS - 1


def rank_denominators(cli: Cli, rank: int) -> list[float]:
    """Window denominators of one rank's shard: its stream replayed from the corpus
    (documents encoded here as BOS + bytes + EOS) and its supervised labels counted."""
    import numpy as np
    from run_support import tokens_of

    from exactstep import Example, load_config, load_corpus
    from exactstep.rows.stream import RowStream

    cfg = load_config(None, [o for o in overrides(cli.corpus) if o != "--set"])
    corpus = load_corpus(cfg.data)
    examples = [Example(i, np.array(tokens_of(d.text), dtype=np.int64))
                for i, d in enumerate(corpus.train)]
    stream = iter(RowStream(examples, cfg.batch, pad_id=258, seed=cfg.seed, vocab_size=259,
                            rank=rank, world=2))
    out = []
    for _ in range(WINDOWS):
        batches = [next(stream) for _ in range(cfg.update.accum)]
        out.append(float(sum(int((b.labels != -100).sum()) for b in batches)))
    return out


def test_ledger_denominator_is_the_global_sum_over_ranks(runs) -> None:
    """D1, L3: each ledger line's D is the sum of both ranks' window denominators,
    not one rank's (the negative control: rank 0's own D never matches)."""
    cli = runs["cli"]
    ledger = [json.loads(x) for x in (runs["straight"] / "ledger.jsonl").read_text().splitlines()]
    d0, d1 = rank_denominators(cli, 0), rank_denominators(cli, 1)
    assert [r["D"] for r in ledger] == [a + b for a, b in zip(d0, d1, strict=True)]
    assert all(r["D"] != a for r, a in zip(ledger, d0, strict=True))
    assert all(a > 0 and b > 0 for a, b in zip(d0, d1, strict=True))


def test_multi_rank_checkpoints_are_sequenced_listed_and_pruned(runs, tmp_path) -> None:
    """S3 for every format: multi-rank checkpoints record their publication order, so
    listing and ``checkpoint.keep`` see them (they were all sequence 0 before)."""
    from exactstep.state import list_checkpoints, prune, verify_checkpoint

    root = tmp_path / "checkpoints"
    shutil.copytree(runs["straight"] / "checkpoints", root)
    names = [f"window-{w:08d}" for w in range(EVERY, WINDOWS + 1, EVERY)]
    sequences = [json.loads((root / n / "manifest.json").read_bytes())["sequence"] for n in names]
    assert sequences == sorted(set(sequences)) and len(sequences) == 3
    assert [p.name for p in list_checkpoints(root)] == names
    assert all(verify_checkpoint(root / n).ok for n in names)
    assert [p.name for p in prune(root, 2)] == names[:1]
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", *names[1:]]
