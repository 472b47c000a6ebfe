"""``exactstep generate`` (Q1, H3, X2, X4): a run's or an export's continuations, drawn by
the rollouts' sampler, repeatable from the command line.

Independent expectations: greedy decoding written with plain PyTorch on the
checkpoint's weights (argmax of the last position, one token at a time); the same
command twice prints the same text. Controls: another seed prints another text; a run
without a checkpoint is one error line.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from run_support import set_args

from exactstep.cli import main
from exactstep.data.chat import template_for
from exactstep.data.conversation import Message
from exactstep.rows.batch import single_segment_batch
from exactstep.run.finished_run import open_finished_run

CHAT = {"data.source": "arith", "data.kind": "chat", "arith.n_train": 64,
        "arith.n_heldout": 8, "batch.seq_len": 128, "batch.rows": 2, "model.d_model": 16,
        "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32, "train.steps": 2,
        "train.eval_tokens": 64, "train.threads": 1, "train.device": "cpu"}
PROMPT = "What is 2+3?"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("generate") / "run"
    assert main(["train", "--no-progress", "--out", str(out), *set_args(CHAT)]) == 0
    return out


def generated(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(["generate", *argv]) == 0
    return capsys.readouterr().out


def plain_greedy(run, tokens: int) -> str:
    """Greedy continuation of the chat prompt, written here with plain PyTorch."""
    with open_finished_run(run, purpose="read") as finished, torch.no_grad():
        model, tok = finished.model.eval(), finished.parts.tokenizer
        ids = template_for(tok).render_prompt([Message("user", PROMPT)], tok).tokens.tolist()
        out = []
        for _ in range(tokens):
            hidden = model(single_segment_batch(torch.tensor([ids + out])))
            nxt = int(model.logits(hidden[:, -1:, :])[0, -1].argmax())
            out.append(nxt)
            if nxt == tok.eos_id:
                break
        return tok.decode(out), len(out)


def test_greedy_generation_is_the_plain_greedy_continuation(run, capsys):
    text = generated(capsys, str(run), "--prompt", PROMPT, "--temperature", "0",
                     "--max-new-tokens", "6", "--samples", "1")
    body, footer = text.rsplit("\n-- ", 1)
    want, n = plain_greedy(run, 6)
    assert body == want
    assert footer.startswith(f"{n} tokens, ended at the ")


def test_the_same_command_draws_the_same_samples_and_another_seed_others(run, capsys):
    argv = [str(run), "--prompt", PROMPT, "--prompt", "Now add 4.", "--samples", "2",
            "--max-new-tokens", "8", "--seed", "4"]
    first = generated(capsys, *argv)
    assert generated(capsys, *argv) == first
    assert first.count("-- sample") == 4 and first.count("== prompt") == 2
    assert generated(capsys, *argv[:-1], "5") != first  # control: the seed is the address


def test_an_export_generates_what_its_run_generates(run, tmp_path, capsys):
    exported = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(exported)]) == 0
    argv = ["--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "6", "--samples",
            "1", "--chat"]
    assert generated(capsys, str(exported), *argv) == generated(capsys, str(run), *argv)


def test_a_run_without_a_checkpoint_is_one_error_line(run, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(run, bare)
    shutil.rmtree(bare / "checkpoints")
    capsys.readouterr()
    assert main(["generate", str(bare), "--prompt", PROMPT]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "no checkpoint" in err[0]


def test_a_bad_flag_value_names_the_flag(run, capsys):
    assert main(["generate", str(run), "--prompt", PROMPT, "--top-p", "1.5"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --top-p")
