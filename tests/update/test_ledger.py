"""The append-only ledger: one canonical line per window, exact truncation (U4, S2, S5)."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch
from update_support import make_engine, random_batch

from exactstep.state.durable import check_mark
from exactstep.update.disposition import Outcome
from exactstep.update.ledger import Ledger

U4_FIELDS = {"window", "disposition", "cause", "lr", "D", "loss", "grad_norm", "tokens"}


LR = 6e-3  # UpdateConfig's default peak; make_engine's schedule is constant, no warmup


def window_batches(windows: range) -> list[list]:
    gen = torch.Generator().manual_seed(0)
    return [[random_batch(gen, 2, 5)] for _ in windows]


def run_windows(ledger: Ledger, windows: range, *, fail_window: int = 2) -> None:
    engine = make_engine(fail_window=fail_window)
    for w, batches in zip(windows, window_batches(windows), strict=True):
        ledger.append(engine.run_window(batches, w))


def test_one_line_per_window_with_u4_fields(tmp_path):
    ledger = Ledger.create(tmp_path / "ledger.jsonl")
    run_windows(ledger, range(4))
    records = ledger.records()
    assert ledger.position == 4 and len(records) == 4
    assert [r["window"] for r in records] == [0, 1, 2, 3]
    assert all(U4_FIELDS <= set(r) for r in records)
    assert records[2]["disposition"] == Outcome.SKIPPED_NONFINITE.value
    assert records[2]["cause"] == "INJECTED_FAULT"
    assert records[2]["lr"] is None and records[2]["grad_norm"] == "nan"
    for w in (0, 1, 3):
        assert records[w]["disposition"] == "COMMITTED" and records[w]["cause"] is None
        assert records[w]["lr"] == LR
    # D and tokens: the supervised targets of each window, counted here from its labels
    for record, batches in zip(records, window_batches(range(4)), strict=True):
        targets = sum(int((b.labels != -100).sum()) for b in batches)
        assert record["D"] == float(targets) and record["tokens"] == targets
    for line in (tmp_path / "ledger.jsonl").read_text().splitlines():
        assert line == json.dumps(json.loads(line), sort_keys=True, separators=(",", ":"))


def test_mark_names_exactly_the_bytes_written(tmp_path):
    ledger = Ledger.create(tmp_path / "ledger.jsonl")
    run_windows(ledger, range(3))
    data = (tmp_path / "ledger.jsonl").read_bytes()
    assert ledger.mark() == {"lines": 3, "bytes": len(data),
                             "sha256": hashlib.sha256(data).hexdigest()}


def replay_after_crash(path, *, restore: bool) -> Ledger:
    """0..2, mark, 3..4 written, a torn line; reopen at the mark and run 3..4 again,
    from the engine state saved at the mark (``restore``) or from wherever the engine
    was left (the negative control)."""
    ledger = Ledger.create(path)
    engine = make_engine(fail_window=2)
    batches = window_batches(range(5))
    for w in range(3):
        ledger.append(engine.run_window(batches[w], w))
    mark, saved = ledger.mark(), copy.deepcopy(engine.state_dict())
    weights = copy.deepcopy(engine.model.state_dict())
    for w in (3, 4):  # ran ahead of its checkpoint...
        ledger.append(engine.run_window(batches[w], w))
    with path.open("a") as fh:
        fh.write('{"window": 5, "disp')  # ...and died mid-line
    assert check_mark(path, mark) is None  # the prefix still holds
    reopened = Ledger.open_at(path, mark)
    assert reopened.position == 3
    if restore:
        engine.load_state_dict(saved)
        engine.model.load_state_dict(weights)
    for w in (3, 4):
        reopened.append(engine.run_window(batches[w], w))
    return reopened


def test_reopen_at_mark_drops_the_torn_tail_and_continues_byte_identically_s5(tmp_path):
    """Windows 0..4 straight vs the same run crashed after its mark and replayed from
    the state saved there: identical bytes. Replaying without restoring differs."""
    straight = Ledger.create(tmp_path / "a.jsonl")
    run_windows(straight, range(5))
    reopened = replay_after_crash(tmp_path / "b.jsonl", restore=True)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert reopened.mark() == straight.mark()
    unrestored = replay_after_crash(tmp_path / "c.jsonl", restore=False)
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    assert unrestored.mark() != straight.mark()


@pytest.mark.parametrize("damage", ["delete_middle", "garbage_middle", "edit_value", "truncate"])
def test_damaged_prefix_is_refused_naming_the_problem(tmp_path, damage):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger.create(path)
    run_windows(ledger, range(4))
    mark = ledger.mark()
    lines = path.read_bytes().splitlines(keepends=True)
    if damage == "delete_middle":
        del lines[1]
    elif damage == "garbage_middle":
        lines[1] = b"not json\n"
    elif damage == "edit_value":
        lines[1] = lines[1].replace(b'"window":1', b'"window":7')
    else:
        lines[-1] = lines[-1][:5]
    path.write_bytes(b"".join(lines) + b'{"window":9}\n' * 3)  # later lines do not help
    problem = check_mark(path, mark)
    assert problem is not None
    if damage == "garbage_middle":
        assert "line 2 is not a JSON object" in problem
    with pytest.raises(ValueError):
        Ledger.open_at(path, mark)


def test_non_finite_values_keep_json_valid(tmp_path):
    ledger = Ledger.create(tmp_path / "ledger.jsonl")
    with pytest.raises(ValueError):
        ledger.append({"loss": float("inf")})  # raw dicts must already be valid JSON
    assert ledger.position == 0
