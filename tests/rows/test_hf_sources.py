"""A run's data through a Hugging Face tokenizer and chat template (H2, R5, R6, S1, S4).

The bundle's manifest sections record the tokenizer and template hashes; ``inspect``
shows the assistant-mask trace with the tokenizer's own tokens; a real (tiny) run
through the command line records them, and a resume after the template file changed
is refused naming both hashes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from run_support import TINY, set_args
from tokenizer_support import CHATML, LLAMA3, raw_tokenizer, save_tokenizer

from exactstep.cli import main
from exactstep.config import load_config
from exactstep.data.hf_chat import HFChatTemplate
from exactstep.data.hf_tokenizer import load_hf_tokenizer
from exactstep.data.tokenizer import build_tokenizer
from exactstep.families.inspect import inspect_rows
from exactstep.rows.sources import load_bundle

pytestmark = pytest.mark.timeout(240)

LINE = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+→ (\S+)\s+([01])\s+(.*)$")
N = 24


def question(i: int) -> str:
    return f"What is {i}+{i}?"


def answer(i: int) -> str:
    return str(2 * i)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hfdata")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": question(i)},
        {"role": "assistant", "content": answer(i)}]}) + "\n" for i in range(N)))
    text = root / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i}: " + "x = 1\n" * i}) + "\n"
                            for i in range(1, N)))
    return {"chat": chat, "text": text, "tok": save_tokenizer(root / "tok", chat_template=CHATML)}


def overrides(files: dict[str, Path], kind: str, **extra: object) -> list[str]:
    pairs = {"data.kind": kind, "data.source": files[kind], "data.tokenizer": "hf",
             "data.tokenizer_path": files["tok"], "data.val_fraction": 0.3, **TINY,
             "batch.seq_len": 64, **extra}
    return [f"{k}={v}" for k, v in pairs.items()]


def test_text_bundle_is_bos_ids_eos_and_records_the_tokenizer(files) -> None:
    cfg = load_config(overrides=overrides(files, "text"))
    tok = build_tokenizer(cfg)
    data = load_bundle(cfg, tok)
    raw = raw_tokenizer(files["tok"])
    bos, eos = raw.token_to_id("<s>"), raw.token_to_id("</s>")
    first = data.train[0].tokens.tolist()
    assert first[0] == bos and first[-1] == eos and first.count(bos) == 1
    assert raw.decode(first[1:-1], skip_special_tokens=False).startswith("document ")
    assert data.representation == {
        "tokenizer": "hf", "tokenizer_hash": tok.fingerprint(),
        "special_ids": {"bos": bos, "eos": eos, "pad": raw.token_to_id("<pad>")},
        "template_hash": None, "vocab_size": 400}


def test_chat_bundle_records_the_template_and_a_changed_file_changes_the_hashes(
        files, tmp_path) -> None:
    cfg = load_config(overrides=overrides(files, "chat"))
    tok = build_tokenizer(cfg)
    data = load_bundle(cfg, tok)
    rep = data.representation
    assert rep["tokenizer"] == "hf" and rep["tokenizer_hash"] == tok.fingerprint()
    assert rep["template"] == f"{files['tok']} (the tokenizer's own chat template)"
    assert rep["template_hash"] == HFChatTemplate(CHATML, rep["template"]).fingerprint(tok)
    assert rep["template_ownership"] == "growing-prefixes"
    assert data.section["chat_train"]["kept"] == len(data.train) > 0 and len(data.val) > 0

    llama = tmp_path / "llama3.jinja"
    llama.write_text(LLAMA3)
    other_cfg = load_config(overrides=overrides(files, "chat", **{"data.chat_template": llama}))
    other = load_bundle(other_cfg, build_tokenizer(other_cfg)).representation
    assert other["template"] == str(llama)
    assert other["template_hash"] != rep["template_hash"]
    assert other["tokenizer_hash"] != rep["tokenizer_hash"]
    assert other["special_ids"] == rep["special_ids"]


def test_inspect_shows_the_assistant_mask_trace_with_the_tokenizers_tokens(files) -> None:
    """R6 with an HF template: reading only the printed table, each owned row's
    target is the next row's input, the owned targets of a conversation spell its
    answer then ``<|im_end|>``, the row holding the header's newline owns the first
    answer token, and no row predicting the separator after ``<|im_end|>`` is owned."""
    cfg = load_config(overrides=overrides(files, "chat"))
    text = inspect_rows(cfg, range(0, 1))
    cols = [m.groups() for line in text.splitlines() if (m := LINE.match(line))]
    assert len(cols) == 64
    by_segment: dict[str, list[tuple]] = {}
    for col, nxt in zip(cols, cols[1:] + [None], strict=True):
        if col[5] == "1":
            assert nxt is not None and nxt[1] == col[1] and nxt[3] == col[4]
            by_segment.setdefault(col[1], []).append(col)
    answers = {f"{answer(i)}<|im_end|>" for i in range(N)}
    assert len(by_segment) >= 2
    for owned in by_segment.values():
        assert "".join(c[4] for c in owned) in answers
        assert owned[0][3] == "\\n"  # the header's last token predicts the answer
        assert owned[-1][4] == "<|im_end|>"
    assert not any(c[5] == "1" and c[3] == "<|im_end|>" for c in cols)
    assert any(c[3] == "<|im_start|>" for c in cols)  # tokens shown by the tokenizer


def test_a_run_records_the_hf_representation_and_a_changed_template_refuses_resume(
        files, tmp_path, capfd) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(CHATML)
    run = tmp_path / "run"
    argv = ["train", "--out", str(run), "--no-progress",
            *set_args({"data.kind": "chat", "data.source": files["chat"],
                       "data.tokenizer": "hf", "data.tokenizer_path": files["tok"],
                       "data.chat_template": template, "data.val_fraction": 0.3, **TINY,
                       "batch.seq_len": 64, "train.steps": 2, "train.eval_tokens": 64,
                       "update.warmup": 1, "train.threads": 1})]
    assert main(argv) == 0
    body = json.loads((run / "manifest.json").read_text())["manifest"]
    tok = load_hf_tokenizer(files["tok"], chat_template=template)
    rep = body["representation"]
    assert rep["tokenizer"] == "hf" and rep["tokenizer_hash"] == tok.fingerprint()
    assert rep["template"] == str(template)
    assert rep["template_hash"] == HFChatTemplate(CHATML, str(template)).fingerprint(tok)
    assert rep["vocab_size"] == 400
    assert main(["eval", str(run)]) == 0

    template.write_text(CHATML + "{# v2 #}")  # renders the same; still another template
    capfd.readouterr()
    assert main(["resume", str(run), "--no-progress"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "representation.template_hash" in err and "representation.tokenizer_hash" in err
    assert not np.any([p.name.startswith(".tmp") for p in (run / "checkpoints").iterdir()])
