"""Teacher targets as a declared source: ``exactstep distill`` (R10, S4, X4).

- Every training conversation's assistant turns are the teacher's greedy answers, in
  order, each given its own earlier answers: checked against a plain argmax loop over
  the teacher's model written here (not the sampler), token for token in the prepared
  shards; the validation split is the gold one, byte for byte as ``exactstep prepare``
  writes it.
- The student's manifest, ``eval`` and the export's passport name the teacher and its
  decoding; a teacher at other weights (another checkpoint) gives other data and
  another student manifest, and a resume of the student on it is refused.
- Sampled decoding draws from addressed streams: the same seed gives the same shards,
  another seed other ones.
- A teacher given as an export or a Hugging Face model directory is named by its
  weight files' sha256; another weight is another teacher.
- Bad input is one ``error:`` line: a teacher that is no run or model, an
  encoder-decoder teacher, a text student, a non-empty ``--out``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run_support import set_args

from exactstep.cli import main
from exactstep.config import load_config
from exactstep.data.chat import template_for
from exactstep.data.conversation import Message
from exactstep.data.prepared import open_prepared
from exactstep.rows.batch import single_segment_batch
from exactstep.rows.sources import split_conversations
from exactstep.run.finished_run import open_finished_run

TINY = {"data.source": "arith", "data.kind": "chat", "arith.n_train": 24,
        "arith.n_heldout": 8, "batch.seq_len": 128, "batch.rows": 2, "model.d_model": 16,
        "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32, "train.eval_tokens": 64,
        "train.threads": 1, "train.device": "cpu", "arith.max_new_tokens": 6}
NEW_TOKENS = 6
pytestmark = pytest.mark.slow  # trains a teacher and students (about 20 s)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A tiny chat run with checkpoints after windows 3 and 6."""
    run = tmp_path_factory.mktemp("teacher") / "run"
    assert main(["train", "--no-progress", "--out", str(run),
                 *set_args({**TINY, "train.steps": 6, "checkpoint.every": 3,
                            "update.lr": 1e-2})]) == 0
    return run


def distill(teacher: Path, out: Path, *extra: str, **sets) -> int:
    return main(["distill", str(teacher), "--out", str(out), "--no-progress",
                 "--max-new-tokens", str(NEW_TOKENS), *extra, *set_args({**TINY, **sets})])


def greedy(model, tokenizer, messages) -> str:
    """The teacher's greedy answer, by a plain argmax loop (no sampler)."""
    ids = template_for(tokenizer).render_prompt(messages, tokenizer).tokens.tolist()
    out: list[int] = []
    model.eval()
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens = torch.tensor([ids + out])
            nxt = int(model.logits(model(single_segment_batch(tokens)))[0, -1].argmax())
            if nxt == tokenizer.eos_id:
                break
            out.append(nxt)
    return tokenizer.decode(out)


def documents(path: Path, split: str) -> list[list[int]]:
    prepared = open_prepared(path).splits[split]
    return [prepared.tokens(d)[0].tolist() for d in range(prepared.documents)]


def test_targets_are_the_teachers_answers_and_validation_stays_gold(teacher, tmp_path):
    out = tmp_path / "distilled"
    assert distill(teacher, out) == 0
    cfg = load_config(None, [f"{k}={v}" for k, v in TINY.items()])
    train, val, _, _ = split_conversations(cfg)
    with open_finished_run(teacher) as run:
        tokenizer, model = run.parts.tokenizer, run.model
        template = template_for(tokenizer)
        expected = []
        for conversation in train:
            messages: list[Message] = []
            for m in conversation.messages:
                messages.append(Message("assistant", greedy(model, tokenizer, messages))
                                if m.role == "assistant" else m)
            expected.append(template.render(messages, tokenizer).tokens.tolist())
    got = documents(out, "train")
    assert got == expected
    gold = [template.render(list(c.messages), tokenizer).tokens.tolist() for c in train]
    assert got != gold  # control: the teacher's answers are not the gold ones
    assert documents(out, "val") == [template.render(list(c.messages), tokenizer)
                                     .tokens.tolist() for c in val]
    plain = tmp_path / "plain"
    assert main(["prepare", "arith", "--out", str(plain), "--no-progress",
                 *set_args(TINY)]) == 0
    for name in ("val-00000.tokens", "val-00000.index", "val-00000.owned"):
        assert (out / name).read_bytes() == (plain / name).read_bytes()


def manifest_of(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["manifest"]


def test_the_student_names_its_teacher_and_refuses_other_teacher_data(teacher, tmp_path,
                                                                      capsys):
    data = tmp_path / "distilled"
    assert distill(teacher, data) == 0
    meta = json.loads((data / "prepared.json").read_text())
    recorded = meta["teacher"]
    assert recorded["kind"] == "exactstep_run" and recorded["decoding"] == {
        "greedy": True, "max_new_tokens": NEW_TOKENS}
    assert recorded["checkpoint"] == "window-00000006"
    assert recorded["manifest_sha256"] == __import__("hashlib").sha256(
        (teacher / "manifest.json").read_bytes()).hexdigest()
    student = tmp_path / "student"
    args = set_args({**TINY, "data.source": str(data), "train.steps": 2,
                     "checkpoint.every": 1})
    assert main(["train", "--no-progress", "--out", str(student), *args]) == 0
    assert manifest_of(student)["data"]["teacher"] == recorded
    capsys.readouterr()
    assert main(["eval", str(student)]) == 0
    assert "trained on teacher targets: exactstep_run" in capsys.readouterr().out
    exported = tmp_path / "export"
    assert main(["export", str(student), "--out", str(exported)]) == 0
    passport = json.loads((exported / "passport.json").read_text())
    assert passport["teacher_targets"] == recorded

    # the teacher at other weights: other data, another student manifest, resume refused
    other = tmp_path / "other"
    assert distill(teacher, other, "--from",
                   str(teacher / "checkpoints" / "window-00000003")) == 0
    other_meta = json.loads((other / "prepared.json").read_text())
    assert other_meta["teacher"]["checkpoint_sha256"] != recorded["checkpoint_sha256"]
    assert other_meta["fingerprint"] != meta["fingerprint"]
    capsys.readouterr()
    assert main(["resume", str(student), "--no-progress", "--set",
                 f"data.source={other}"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "data.teacher" in err[0]


def test_sampled_targets_are_addressed(teacher, tmp_path):
    def fingerprint(name: str, seed: int) -> str:
        assert distill(teacher, tmp_path / name, "--temperature", "1", seed=seed) == 0
        return json.loads((tmp_path / name / "prepared.json").read_text())["fingerprint"]

    first = fingerprint("a", 0)
    assert fingerprint("b", 0) == first
    assert fingerprint("c", 1) != first  # control: another seed draws other answers
    decoding = json.loads((tmp_path / "a" / "prepared.json").read_text())["teacher"]["decoding"]
    assert decoding["greedy"] is False and decoding["seed"] == 0 and "rng" in decoding


def refused(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


def test_bad_inputs_are_one_error_line(teacher, tmp_path, capsys):
    capsys.readouterr()
    assert "neither an exactstep run" in refused(capsys, distill(tmp_path, tmp_path / "o1"))
    assert "must be chat" in refused(capsys, distill(teacher, tmp_path / "o2",
                                                     **{"data.kind": "text",
                                                        "data.source": "stdlib"}))
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    assert "not empty" in refused(capsys, distill(teacher, full))
    assert (full / "x").read_text() == "x"


def safetensors_digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_export_or_hf_directory_teacher_is_named_by_its_weights(teacher, tmp_path,
                                                                    capsys):
    """R10: a teacher given as an export or a Hugging Face model directory is recorded by
    the sha256 of its weight file (recomputed here from the file's bytes, and the
    export's passport's own entry); the student's manifest carries it. Negative control:
    the same directory with one weight changed records another digest, and a resume of
    the student on that data is refused (S4)."""
    import shutil

    from safetensors.torch import load_file, save_file

    exported = tmp_path / "export"
    assert main(["export", str(teacher), "--out", str(exported)]) == 0
    hf = tmp_path / "hf"
    shutil.copytree(exported, hf)
    (hf / "passport.json").unlink()  # a plain save_pretrained directory
    weights = safetensors_digest(exported / "model.safetensors")
    passport = json.loads((exported / "passport.json").read_text())
    assert passport["files"]["model.safetensors"] == weights
    recorded = {}
    for kind, directory in (("export", exported), ("hf_directory", hf)):
        data = tmp_path / f"distilled-{kind}"
        assert distill(directory, data) == 0
        recorded[kind] = json.loads((data / "prepared.json").read_text())["teacher"]
        assert recorded[kind]["kind"] == kind and recorded[kind]["path"] == str(directory)
        assert recorded[kind]["weights_sha256"] == {"model.safetensors": weights}
    student = tmp_path / "student"
    assert main(["train", "--no-progress", "--out", str(student),
                 *set_args({**TINY, "data.source": str(tmp_path / "distilled-hf_directory"),
                            "train.steps": 2, "checkpoint.every": 1})]) == 0
    assert manifest_of(student)["data"]["teacher"] == recorded["hf_directory"]

    # negative control: one weight changed, another recorded digest
    tensors = load_file(hf / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    changed = tmp_path / "distilled-changed"
    assert distill(hf, changed) == 0
    other = json.loads((changed / "prepared.json").read_text())["teacher"]["weights_sha256"]
    assert other == {"model.safetensors": safetensors_digest(hf / "model.safetensors")}
    assert other != recorded["hf_directory"]["weights_sha256"]
    capsys.readouterr()
    assert main(["resume", str(student), "--no-progress", "--set",
                 f"data.source={changed}"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "data.teacher" in err[0], err
