"""Every objective family x every data kind: it trains with a recorded meaning, or it
is refused naming both keys (R8, S1, X4).

``objective.family`` chooses what is read and how; ``data.kind`` says what the data
is. A pair the family does not read (span corruption over conversations, a prefix LM
over plain text) used to train without a word on the family's own kind of data.
``data.kind`` is now ``auto`` unless the user sets it, and a kind a family does not
read is refused before anything is written.

``EXPECTED`` is the whole matrix, written here from the families' documentation
(README's ``objective.family`` row; ``families`` module doc), not computed from the
registry: for each (family, data.kind), either ``None`` (refused) or what the
manifest must record -- the resolved family, ``config.data.kind``, the data
section's ``kind`` and the objective section's ``family``. ``auto`` is the value left
unset. Refusals run through the real command line (one ``error:`` line naming
``objective.family`` and ``data.kind``, no run directory written); the pairs that
train do so through the command line too, on the built-in data (stdlib corpus,
``arith`` conversations, ``numwords`` pairs), one window each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exactstep.cli import main

pytestmark = pytest.mark.timeout(600)

FAMILIES = ("auto", "causal", "chat", "prefix", "encdec", "mlm", "span", "permutation",
            "scheduled_sampling")
KINDS = ("auto", "text", "chat")

# (family, data.kind) -> None (refused) or (resolved family, config.data.kind,
# manifest data.kind, manifest objective.family)
CAUSAL_TEXT = ("causal", "text", "text", "causal_lm")
CHAT_SFT = ("chat", "chat", "chat", "chat_sft")
PREFIX = ("prefix", "chat", "chat", "prefix_lm")
ENCDEC = ("encdec", "text", "pairs", "encoder_decoder")  # a pair is two texts
MLM = ("mlm", "text", "text", "masked_lm")
SPAN = ("span", "text", "text", "span_corruption")
PERMUTATION = ("permutation", "text", "text", "permutation_lm")
SCHEDULED = ("scheduled_sampling", "text", "text", "scheduled_sampling_causal_lm")
EXPECTED: dict[tuple[str, str], tuple[str, str, str, str] | None] = {
    ("auto", "auto"): CAUSAL_TEXT, ("auto", "text"): CAUSAL_TEXT, ("auto", "chat"): CHAT_SFT,
    ("causal", "auto"): CAUSAL_TEXT, ("causal", "text"): CAUSAL_TEXT, ("causal", "chat"): None,
    ("chat", "auto"): CHAT_SFT, ("chat", "text"): None, ("chat", "chat"): CHAT_SFT,
    ("prefix", "auto"): PREFIX, ("prefix", "text"): None, ("prefix", "chat"): PREFIX,
    ("encdec", "auto"): ENCDEC, ("encdec", "text"): ENCDEC, ("encdec", "chat"): None,
    ("mlm", "auto"): MLM, ("mlm", "text"): MLM, ("mlm", "chat"): None,
    ("span", "auto"): SPAN, ("span", "text"): SPAN, ("span", "chat"): None,
    ("permutation", "auto"): PERMUTATION, ("permutation", "text"): PERMUTATION,
    ("permutation", "chat"): None,
    ("scheduled_sampling", "auto"): SCHEDULED, ("scheduled_sampling", "text"): SCHEDULED,
    ("scheduled_sampling", "chat"): None,
}

TINY = ("--no-progress", "--set", "model.d_model=16", "--set", "model.n_layers=1",
        "--set", "model.n_heads=2", "--set", "model.d_ff=32", "--set", "batch.rows=2",
        "--set", "batch.seq_len=64", "--set", "train.steps=1", "--set", "train.eval_tokens=64",
        "--set", "update.warmup=1", "--set", "train.threads=1", "--set", "train.device=cpu",
        "--set", "data.max_docs=40", "--set", "data.val_fraction=0.3")


def argv(family: str, kind: str, out: Path) -> list[str]:
    args = ["train", "--out", str(out), *TINY]
    if family != "auto":
        args += ["--set", f"objective.family={family}"]
    if kind != "auto":
        args += ["--set", f"data.kind={kind}"]
    return args


def test_the_table_is_the_whole_matrix() -> None:
    assert set(EXPECTED) == {(f, k) for f in FAMILIES for k in KINDS}


REFUSED = [pair for pair, want in EXPECTED.items() if want is None]
TRAINED = [pair for pair, want in EXPECTED.items() if want is not None]


@pytest.mark.parametrize("family, kind", REFUSED, ids=[f"{f}-{k}" for f, k in REFUSED])
def test_a_kind_the_family_does_not_read_is_one_line_naming_both_keys(
        family: str, kind: str, tmp_path: Path, capfd) -> None:
    capfd.readouterr()
    code = main(argv(family, kind, tmp_path / "run"))
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err
    assert f"objective.family = '{family}'" in lines[0], lines[0]
    assert f"data.kind = '{kind}'" in lines[0], lines[0]
    run = tmp_path / "run"
    assert not run.exists() or not {p.name for p in run.iterdir()} & {
        "manifest.json", "ledger.jsonl", "checkpoints"}


@pytest.mark.slow
@pytest.mark.parametrize("family, kind", TRAINED, ids=[f"{f}-{k}" for f, k in TRAINED])
def test_a_kind_the_family_reads_trains_and_the_manifest_records_its_meaning(
        family: str, kind: str, tmp_path: Path, capfd) -> None:
    resolved, config_kind, data_kind, objective = EXPECTED[(family, kind)]
    code = main(argv(family, kind, tmp_path / "run"))
    assert code == 0, capfd.readouterr().err
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())["manifest"]
    assert manifest["config"]["objective"]["family"] == resolved
    assert manifest["config"]["data"]["kind"] == config_kind
    assert manifest["data"]["kind"] == data_kind
    assert manifest["objective"]["family"] == objective


def test_prepare_refuses_the_same_pairs(tmp_path: Path, capfd) -> None:
    """``exactstep prepare`` resolves the kind as a run does: a pair the run would
    refuse is refused before anything is written."""
    source = tmp_path / "docs.jsonl"
    source.write_text(json.dumps({"text": "one document"}) + "\n")
    capfd.readouterr()
    code = main(["prepare", str(source), "--out", str(tmp_path / "p"), "--no-progress",
                 "--set", "objective.family=span", "--set", "data.kind=chat"])
    err = capfd.readouterr().err
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "objective.family = 'span'" in lines[0] and "data.kind = 'chat'" in lines[0]
    assert not (tmp_path / "p").exists()
