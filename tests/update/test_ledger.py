"""The append-only ledger: one canonical line per window, exact truncation (U4, S2, S5)."""

from __future__ import annotations

import json

import pytest
import torch
from update_support import make_engine, random_batch

from exactstep.errors import CheckpointError
from exactstep.update.disposition import Outcome
from exactstep.update.ledger import Ledger

U4_FIELDS = {"window", "disposition", "cause", "lr", "D", "loss", "grad_norm", "tokens"}


def run_windows(ledger: Ledger, windows: range, *, fail_window: int = 2) -> None:
    engine = make_engine(fail_window=fail_window)
    gen = torch.Generator().manual_seed(0)
    for w in windows:
        ledger.append(engine.run_window([random_batch(gen, 2, 5)], w))


def test_one_line_per_window_with_u4_fields(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    run_windows(ledger, range(4))
    records = ledger.records()
    assert ledger.position == 4 and len(records) == 4
    assert [r["window"] for r in records] == [0, 1, 2, 3]
    assert all(U4_FIELDS <= set(r) for r in records)
    assert records[2]["disposition"] == Outcome.SKIPPED_NONFINITE.value
    assert records[2]["lr"] is None and records[2]["grad_norm"] == "nan"
    assert records[0]["disposition"] == "COMMITTED" and records[0]["lr"] > 0
    for line in (tmp_path / "ledger.jsonl").read_text().splitlines():
        assert line == json.dumps(json.loads(line), sort_keys=True, separators=(",", ":"))


def test_truncate_then_rerun_is_byte_identical_s5(tmp_path):
    straight = Ledger(tmp_path / "a.jsonl")
    run_windows(straight, range(5))

    resumed = Ledger(tmp_path / "b.jsonl")
    run_windows(resumed, range(5))  # ran ahead of its last checkpoint...
    with (tmp_path / "b.jsonl").open("a") as fh:
        fh.write('{"window": 5, "disp')  # ...and died mid-line
    reopened = Ledger(tmp_path / "b.jsonl")
    assert reopened.position == 5  # the torn tail is not a line
    reopened.truncate_to(3)  # the checkpoint said 3
    assert reopened.position == 3
    # re-running windows 3..4 from the same state must reproduce the same lines
    lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
    for line in lines[3:]:
        reopened.append(json.loads(line))
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_truncate_beyond_end_is_refused(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.append({"window": 0})
    with pytest.raises(CheckpointError, match="fewer than 3"):
        ledger.truncate_to(3)


def test_non_finite_values_keep_json_valid(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    with pytest.raises(ValueError):
        ledger.append({"loss": float("inf")})  # raw dicts must already be valid JSON
    assert ledger.position == 0
