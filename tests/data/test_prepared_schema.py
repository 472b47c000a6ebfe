"""A ``prepared.json`` is read whole or refused in one line (P1, S6, X4).

``exactstep prepare`` writes ``prepared.json`` last and fingerprints it, so an edit is
refused as "edited". An edit whose fingerprint was recomputed (by hand, by another
tool, by an older writer) passes that check; what it changed must then be refused by
the schema check, through the real command line, as one ``error:`` line naming the
file, the key and the fix -- never a ``KeyError`` traceback from deep in the loader.

``MUTATIONS`` is the table of edits (each with the key the line must name), written
here from the format's description in ``data.prepared``, not derived from the
validator. Each is applied to a copy of a freshly prepared directory, the fingerprint
recomputed, then ``exactstep train`` and ``exactstep resume`` must refuse it. Negative
controls: the intact directory trains and resumes; the edits do pass the fingerprint
check (so it is the schema check that refuses them).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from text_corpus import write_corpus

from exactstep.artifacts.prepare import prepare
from exactstep.cli import main
from exactstep.config import load_config
from exactstep.data.prepared import MANIFEST, fingerprint_of

pytestmark = pytest.mark.timeout(300)

TINY = ("--no-progress", "--set", "batch.seq_len=32", "--set", "batch.rows=2",
        "--set", "model.d_model=16", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "model.d_ff=32", "--set", "train.steps=2", "--set", "train.eval_tokens=64",
        "--set", "update.warmup=1", "--set", "train.threads=1", "--set", "train.device=cpu")

Meta = dict[str, Any]


@dataclass(frozen=True)
class Mutation:
    """One edit of ``prepared.json``; ``key``: the dotted key the error line must name."""

    id: str
    edit: Callable[[Meta], object]
    key: str
    kind: str = "text"


FIRST = "train-00000.index"  # a file every prepared directory records


def set_in(path: str, value: Any) -> Callable[[Meta], None]:
    """An edit setting the dotted ``path`` (list positions as numbers) to ``value``."""
    def edit(meta: Meta) -> None:
        *parents, last = path.split(".")
        node: Any = meta
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = value
    return edit


def drop(path: str) -> Callable[[Meta], None]:
    def edit(meta: Meta) -> None:
        *parents, last = path.split(".")
        node: Any = meta
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        del node[last]
    return edit


def add_documents(meta: Meta) -> None:
    meta["splits"]["train"]["documents"] += 1  # the shards still hold the old count


def swap_lengths(meta: Meta) -> None:
    split = meta["splits"]["train"]
    split["min_length"], split["max_length"] = split["max_length"] + 1, split["min_length"]


def unknown_shard_file(meta: Meta) -> None:
    meta["splits"]["val"]["shards"][0]["files"]["tokens"] = "val-00099.tokens"


def escaping_file_name(meta: Meta) -> None:
    meta["files"]["../" + FIRST] = meta["files"].pop(FIRST)


def negative_file_size(meta: Meta) -> None:
    meta["files"][FIRST]["bytes"] = -1


def short_digest(meta: Meta) -> None:
    meta["files"][FIRST]["sha256"] = "abc"


def drop_owned(meta: Meta) -> None:
    del meta["splits"]["train"]["shards"][0]["files"]["owned"]


MUTATIONS = [
    Mutation("files-missing", drop("files"), "files"),
    Mutation("files-a-list", set_in("files", []), "files"),
    Mutation("splits-missing", drop("splits"), "splits"),
    Mutation("val-split-missing", drop("splits.val"), "splits.val"),
    Mutation("documents-negative", set_in("splits.train.documents", -3), "splits.train.documents"),
    Mutation("documents-a-string", set_in("splits.train.documents", "72"),
             "splits.train.documents"),
    Mutation("documents-a-bool", set_in("splits.train.tokens", True), "splits.train.tokens"),
    Mutation("documents-not-the-shards-sum", add_documents, "splits.train.documents"),
    Mutation("min-over-max-length", swap_lengths, "splits.train.min_length"),
    Mutation("targets-missing", drop("splits.train.targets"), "splits.train.targets"),
    Mutation("shards-not-a-list", set_in("splits.train.shards", {}), "splits.train.shards"),
    Mutation("shard-count-negative", set_in("splits.val.shards.0.documents", -1),
             "splits.val.shards.0.documents"),
    Mutation("shard-file-not-recorded", unknown_shard_file, "splits.val.shards.0.files.tokens"),
    Mutation("file-size-negative", negative_file_size, f"files.{FIRST}.bytes"),
    Mutation("file-digest-not-sha256", short_digest, f"files.{FIRST}.sha256"),
    Mutation("file-name-escapes-the-directory", escaping_file_name, "files"),
    Mutation("dtype-unknown", set_in("dtype", "float32"), "dtype"),
    Mutation("dtype-missing", drop("dtype"), "dtype"),
    Mutation("kind-unknown", set_in("kind", "audio"), "kind"),
    Mutation("order-block-zero", set_in("order.block_documents", 0), "order.block_documents"),
    Mutation("order-rule-unknown", set_in("order.rule", "sorted"), "order.rule"),
    Mutation("order-missing", drop("order"), "order"),
    Mutation("representation-missing", drop("representation"), "representation"),
    Mutation("tokenizer-hash-missing", drop("representation.tokenizer_hash"),
             "representation.tokenizer_hash"),
    Mutation("source-fingerprint-a-number", set_in("source_fingerprint", 7),
             "source_fingerprint"),
    Mutation("split-rule-missing", drop("split_rule"), "split_rule"),
    Mutation("chat-policy-missing", drop("chat_policy"), "chat_policy", kind="chat"),
    Mutation("chat-max-len-zero", set_in("max_len", 0), "max_len", kind="chat"),
    Mutation("chat-shard-without-ownership-bits", drop_owned,
             "splits.train.shards.0.files.owned", kind="chat"),
]


# --------------------------------------------------------------------------- helpers


def refusal_problems(code: int, stdout: str, stderr: str) -> list[str]:
    """What is wrong with a refusal; empty when it is one clean ``error:`` line."""
    problems = []
    if code != 2:
        problems.append(f"exit status {code}, expected 2")
    lines = stderr.splitlines()
    if len(lines) != 1 or not lines[0].startswith("error: "):
        problems.append(f"{len(lines)} stderr lines, expected one 'error: ' line")
    if "Traceback" in stdout + stderr:
        problems.append("a traceback in the output")
    return problems


def rewrite(directory: Path, edit: Callable[[Meta], object], *, refingerprint: bool = True
            ) -> None:
    """Apply ``edit`` to ``directory/prepared.json`` and recompute its fingerprint,
    as a tool that edits the file knowingly would."""
    file = directory / MANIFEST
    meta = json.loads(file.read_text())
    edit(meta)
    if refingerprint:
        meta["fingerprint"] = fingerprint_of(meta)
    file.write_text(json.dumps(meta))


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def chat_lines(n: int) -> str:
    rows = []
    for i in range(n):
        rows.append(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                             {"role": "assistant", "content": f"answer {i}"}]}))
    return "\n".join(rows) + "\n"


def kind_args(kind: str) -> tuple[str, ...]:
    return ("--set", "data.kind=chat", "--set", "batch.seq_len=64") if kind == "chat" else ()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, Path]:
    """A text and a chat directory, prepared once (several shards each)."""
    root = tmp_path_factory.mktemp("prepared")
    write_corpus(root / "corpus.jsonl")
    prepare(load_config(None, []), str(root / "corpus.jsonl"), root / "text",
            shard_tokens=200, block_documents=4, progress=False)
    (root / "chat.jsonl").write_text(chat_lines(24))
    prepare(load_config(None, ["data.kind=chat", "batch.seq_len=64", "data.val_fraction=0.3"]),
            str(root / "chat.jsonl"), root / "chat", shard_tokens=200, progress=False)
    return {"text": root / "text", "chat": root / "chat"}


def copy_of(prepared: dict[str, Path], kind: str, tmp: Path) -> Path:
    target = tmp / f"p-{kind}"
    shutil.copytree(prepared[kind], target)
    return target


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.id for m in MUTATIONS])
def test_a_refingerprinted_schema_edit_is_one_line_at_train(
        mutation: Mutation, prepared: dict[str, Path], tmp_path: Path, capfd) -> None:
    """X4, S6: the edit passes the fingerprint but not the schema; the line names
    ``prepared.json``, the key, and that the directory must be prepared again."""
    source = copy_of(prepared, mutation.kind, tmp_path)
    rewrite(source, mutation.edit)
    meta = json.loads((source / MANIFEST).read_text())
    assert fingerprint_of(meta) == meta["fingerprint"]  # control: the fingerprint holds
    capfd.readouterr()
    code = main(["train", "--out", str(tmp_path / "run"), "--set", f"data.source={source}",
                 *TINY, *kind_args(mutation.kind)])
    out, err = capfd.readouterr()
    assert refusal_problems(code, out, err) == [], err
    assert MANIFEST in err and f"'{mutation.key}'" in err and "prepare" in err, err
    assert not (tmp_path / "run" / "ledger.jsonl").exists()


def test_the_intact_directories_train(prepared: dict[str, Path], tmp_path: Path,
                                      capfd) -> None:
    """Negative control: unedited (or re-fingerprinted without a change), both kinds
    train to the end, so the validator refuses nothing ``exactstep prepare`` writes."""
    for kind in ("text", "chat"):
        source = copy_of(prepared, kind, tmp_path)
        rewrite(source, lambda meta: None)  # re-serialised and re-fingerprinted
        code = main(["train", "--out", str(tmp_path / f"run-{kind}"),
                     "--set", f"data.source={source}", *TINY, *kind_args(kind)])
        assert code == 0, capfd.readouterr().err
        assert (tmp_path / f"run-{kind}" / "checkpoints" / "LATEST").is_file()


@pytest.mark.parametrize("mutation", [m for m in MUTATIONS if m.id in
                                      ("files-missing", "documents-negative", "dtype-unknown")],
                         ids=lambda m: m.id)
def test_a_schema_edit_after_training_is_one_line_at_resume(
        mutation: Mutation, prepared: dict[str, Path], tmp_path: Path, capfd) -> None:
    """The same refusal at ``exactstep resume`` (the run reopens its data), and the
    run directory is byte for byte what it was (X4, S8). Control: before the edit the
    resume succeeds."""
    source = copy_of(prepared, "text", tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--set", f"data.source={source}", *TINY]) == 0
    assert main(["resume", str(run), "--no-progress"]) == 0  # control: it resumes
    rewrite(source, mutation.edit)
    before = snapshot(run)
    capfd.readouterr()
    code = main(["resume", str(run), "--no-progress"])
    out, err = capfd.readouterr()
    assert refusal_problems(code, out, err) == [], err
    assert MANIFEST in err and f"'{mutation.key}'" in err, err
    assert snapshot(run) == before
