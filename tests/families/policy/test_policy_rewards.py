"""Weighted reward lists over the dataset's own columns, and the rollout text (Q2, S1, X4).

- ``policy.rewards = [{name, weight}, ...]``: a built-in and a user's ``module:function``
  (trl's form: called once per window's batch with lists, the declared ``data.columns``
  among its keywords). Each ``rollouts.jsonl`` record holds the decoded prompt and
  completion, every term's value and the total; the test recomputes the user's term
  from the record's own text and the example's ``answer`` (read from the data file, not
  from the run), and the total as ``sum weight x value``; trl's own
  ``think_format_reward`` runs unchanged. Negative controls: the same
  records with a weight applied twice, and with another example's column, fail the
  same checks.
- The manifest names each function, its source's SHA-256 (of the text written to the
  module file) and its weight.
- X4: a column the function asks for that the data does not declare, a declared column
  a line lacks, both ``policy.reward`` and ``policy.rewards``, a weight that is not a
  number: one ``error:`` line each, nothing written.
"""

from __future__ import annotations

import hashlib
import json
import math
import textwrap
from pathlib import Path

import pytest
from run_support import set_args

from exactstep.cli import main

FMT = textwrap.dedent('''
    calls = []
    def fmt(prompts, completions, answer, **kwargs):
        calls.append(len(completions))
        assert len(prompts) == len(answer) == len(kwargs["completion_ids"])
        texts = [c[0]["content"] for c in completions]  # a chat's: trl's one message
        return [float(a in t) + int(a) / 64 + 0.5 * len(t) for t, a in zip(texts, answer)]
''')
FMT_SOURCE = FMT.split("\n", 2)[2]  # the function's own lines, as inspect reads them

TINY = {"objective.family": "policy", "data.kind": "chat", "data.val_fraction": 0.1,
        "batch.seq_len": 64, "batch.rows": 4, "model.d_model": 16, "model.n_layers": 1,
        "model.n_heads": 2, "model.d_ff": 32, "generation.max_new_tokens": 4,
        "generation.samples": 2, "train.eval_tokens": 64, "train.threads": 1,
        "train.device": "cpu", "train.steps": 3}


def write_chats(path: Path, n: int = 40, drop_answer_at: int | None = None) -> dict[str, str]:
    """``n`` one-turn sums as chat JSONL with ``answer`` and ``id`` columns; returns each
    question's answer (what the test expects the reward to see)."""
    answers = {}
    with path.open("w") as fh:
        for i in range(n):
            q, a = f"{i}+{i % 7}", str(i + i % 7)
            line = {"messages": [{"role": "user", "content": q},
                                 {"role": "assistant", "content": a}], "answer": a, "id": i}
            if i == drop_answer_at:
                del line["answer"]
            fh.write(json.dumps(line) + "\n")
            answers[q] = a
    return answers


@pytest.fixture
def data(tmp_path, monkeypatch):
    (tmp_path / "policy_fmt.py").write_text(FMT)
    monkeypatch.syspath_prepend(str(tmp_path))
    chats = tmp_path / "chats.jsonl"
    return chats, write_chats(chats)


def train(out: Path, **extra) -> int:
    return main(["train", "--no-progress", "--out", str(out), *set_args({**TINY, **extra})])


REWARDS = '[{"name": "exact_match", "weight": 1.0}, {"name": "policy_fmt:fmt", "weight": 0.2}]'


def question_of(prompt: str, answers: dict[str, str]) -> str:
    found = [q for q in answers if f"{q}" in prompt]
    longest = max(found, key=len)  # "1+1" is inside "11+4"'s prompt too
    return longest


def mismatches(records: list[dict], answers: dict[str, str], weights: dict[str, float]
               ) -> list[str]:
    """Records whose ``fmt`` term, or whose total, is not what their own text and the
    data file's answer give (``weights`` applied once)."""
    bad = []
    for r in records:
        a = answers[question_of(r["prompt"], answers)]
        want = float(a in r["completion"]) + int(a) / 64 + 0.5 * len(r["completion"])
        total = math.fsum(weights[n] * r["rewards"][n] for n in weights)
        if r["rewards"]["policy_fmt:fmt"] != want or r["reward"] != total:
            bad.append(f"window {r['window']} example {r['example']} sample {r['sample']}")
    return bad


def test_a_weighted_reward_list_sees_the_columns_and_every_term_is_journalled(tmp_path, data):
    chats, answers = data
    run = tmp_path / "run"
    assert train(run, **{"data.source": str(chats), "data.columns": "answer,id",
                         "policy.rewards": REWARDS}) == 0
    records = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 8 * 2  # windows x prompts (4 rows of 2) x samples
    assert all(isinstance(r["prompt"], str) and isinstance(r["completion"], str)
               and set(r["rewards"]) == {"exact_match", "policy_fmt:fmt"} for r in records)
    weights = {"exact_match": 1.0, "policy_fmt:fmt": 0.2}
    assert mismatches(records, answers, weights) == []
    # negative controls: a weight applied twice; another example's answer column
    doubled = [{**r, "reward": math.fsum(w * w * r["rewards"][n] for n, w in weights.items())}
               for r in records]
    assert mismatches(doubled, answers, weights) != []
    shifted = dict(zip(answers, list(answers.values())[1:] + list(answers.values())[:1],
                       strict=True))
    assert mismatches(records, shifted, weights) != []
    manifest = json.loads((run / "manifest.json").read_text())["manifest"]["objective"]
    assert manifest["reward"] == [
        {"name": "exact_match", "kind": "built_in", "weight": 1.0},
        {"name": "policy_fmt:fmt", "kind": "user", "call": "per_batch", "weight": 0.2,
         "source_sha256": hashlib.sha256(FMT_SOURCE.encode()).hexdigest()}]
    assert manifest["columns"] == ["answer", "id"]
    import policy_fmt  # the function ran once per window, on the window's whole batch
    assert policy_fmt.calls == [16, 16, 16]


def test_a_trl_reward_function_runs_unchanged(tmp_path, data):
    """trl's own ``think_format_reward`` (conversational completions, ``**kwargs``) as a
    term: its values are what trl's function gives the journalled completions, and a
    planted ``<think>`` completion scores 1 (so the check is not of zeros alone)."""
    from trl.rewards import think_format_reward

    chats, _ = data
    run = tmp_path / "run"
    assert train(run, **{"data.source": str(chats), "policy.rewards":
                         '[{"name": "trl.rewards:think_format_reward", "weight": 2.0}]'}) == 0
    records = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    theirs = think_format_reward([[{"role": "assistant", "content": r["completion"]}]
                                  for r in records])
    assert [r["rewards"]["trl.rewards:think_format_reward"] for r in records] == theirs
    assert [r["reward"] for r in records] == [2.0 * v for v in theirs]
    assert think_format_reward([[{"content": "<think>x</think>y"}]]) == [1.0]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


@pytest.mark.parametrize("extra, words", [
    ({"policy.rewards": REWARDS}, ["asks for 'answer'", "data.columns"]),  # column not passed
    ({"policy.rewards": REWARDS, "policy.reward": "token_f1"},
     ["policy.reward", "policy.rewards", "both"]),
    ({"policy.rewards": '[{"name": "exact_match", "weight": "x"}]'},
     ["policy.rewards.0.weight", "number"]),
    ({"policy.rewards": '[{"name": "exact_match"}]'}, ["policy.rewards.0", "weight"]),
    ({"policy.rewards": '[{"name": "exact_match", "weight": 1}, '
                        '{"name": "exact_match", "weight": 2}]'}, ["twice"]),
    ({"data.columns": "answer", "data.source": "arith"}, ["data.columns", "arith"]),
])
def test_each_bad_reward_list_is_one_error_line_before_anything_is_written(
        tmp_path, data, capsys, extra, words):
    chats, _ = data
    run = tmp_path / "run"
    assert train(run, **{"data.source": str(chats), **extra}) != 0
    line = one_error_line(capsys)
    assert all(w in line for w in words), line
    assert not run.exists() or not list(run.iterdir())


def test_a_declared_column_a_line_lacks_is_one_error_line(tmp_path, data, capsys):
    chats, _ = data
    write_chats(chats, drop_answer_at=5)
    run = tmp_path / "run"
    assert train(run, **{"data.source": str(chats), "data.columns": "answer",
                         "policy.rewards": REWARDS}) != 0
    line = one_error_line(capsys)
    assert f"{chats}:6" in line and '"answer"' in line and "data.columns" in line
    assert not run.exists() or not list(run.iterdir())
