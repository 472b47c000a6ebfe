"""A bad-input campaign through the real command line (X4).

Every bad input ends in one ``error: ...`` line on stderr and a non-zero exit status
(2 for a user error), never a traceback; a refused command leaves an existing run
directory byte for byte as it was ("nothing already committed is lost").

``CASES`` is a plain list of ``Case`` entries; to add a bad input, append one. A case
gives the command line after ``exactstep`` with placeholders filled per case:

    {tmp}     the case's own empty directory (``setup(tmp)`` may write files there)
    {corpus}  a good 48-document text corpus in {tmp}
    {run}     a copy, in {tmp}, of a tiny finished run built once per module with
              the real CLI; every file of the copy must be byte-identical afterwards

Cases run in-process through ``exactstep.cli.main(argv)`` (it returns the exit
status) under ``capfd``, so anything written to the process's file descriptors, by
exactstep or by a library, is seen. The signal case runs as a real subprocess, since
the launcher must be a process of its own to receive SIGTERM.

Negative controls at the end show that the checker fails on a traceback, on a
multi-line error, on a command that succeeds, and that the snapshot comparison sees
a changed byte.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import process_server
import pytest
from text_corpus import write_corpus

from exactstep.cli import main

pytestmark = pytest.mark.timeout(240)

TINY = (
    "--set", "batch.seq_len=32", "--set", "batch.rows=2", "--set", "model.d_model=16",
    "--set", "model.n_layers=1", "--set", "model.n_heads=2", "--set", "model.d_ff=32",
    "--set", "train.steps=2", "--set", "train.eval_tokens=64", "--set", "update.warmup=1",
    "--set", "train.threads=1", "--set", "train.device=cpu",
)


@dataclass(frozen=True)
class Case:
    """One bad input: ``exactstep <argv>`` must fail with one ``error:`` line.

    ``needle``: a fragment the line must contain (the key, file:line or field the
    user must change). ``setup(tmp)`` writes the case's files. ``exit_code``: the
    expected status. ``xfail``: a reason, for a known defect whose fix lies outside
    this test's reach (the case then runs as ``xfail(strict=True)``).
    """

    id: str
    argv: tuple[str, ...]
    needle: str = ""
    setup: Callable[[Path], object] | None = None
    exit_code: int = 2
    xfail: str = ""

    @property
    def uses_run(self) -> bool:
        return any("{run}" in arg for arg in self.argv)


# --------------------------------------------------------------------------- checker


def refusal_problems(code: int, stdout: str, stderr: str, *, exit_code: int = 2,
                     notices: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with a command's refusal; empty when it is one clean line.

    ``notices``: prefixes of status lines a run prints on stderr before it fails
    (e.g. ``"exactstep: "``), left out of the one-line count.
    """
    problems = []
    if code != exit_code:
        problems.append(f"exit status {code}, expected {exit_code}")
    lines = [line for line in stderr.splitlines() if not (notices and line.startswith(notices))]
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr, expected exactly 1")
    elif not lines[0].startswith("error: "):
        problems.append(f"the stderr line does not start with 'error: ': {lines[0]!r}")
    if "Traceback" in stdout or "Traceback" in stderr:
        problems.append("a traceback in the output")
    return problems


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def changed_files(before: dict[str, bytes], after: dict[str, bytes]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


# --------------------------------------------------------------------------- builders


def train(*extra: str) -> tuple[str, ...]:
    return ("train", "--out", "{tmp}/out", "--no-progress", "--set", "data.source={corpus}",
            *TINY, *extra)


def with_config(*extra: str, corpus: bool = True) -> tuple[str, ...]:
    """``train`` with ``--config {tmp}/run.toml`` (which the case's setup writes)."""
    source = ("--set", "data.source={corpus}") if corpus else ()
    return ("train", "--config", "{tmp}/run.toml", "--out", "{tmp}/out", "--no-progress",
            *source, *TINY, *extra)


def chat(*extra: str) -> tuple[str, ...]:
    return train("--set", "data.kind=chat", "--set", "data.source={tmp}/chat.jsonl",
                 "--set", "batch.seq_len=64", *extra)


def inspect(*extra: str) -> tuple[str, ...]:
    return ("inspect", "--set", "data.source={corpus}", *TINY, *extra)


def resume(*extra: str) -> tuple[str, ...]:
    return ("resume", "{run}", "--no-progress", *extra)


def writes(name: str, content: str | bytes) -> Callable[[Path], None]:
    """A setup writing ``content`` to ``{tmp}/name``."""
    def setup(tmp: Path) -> None:
        data = content.encode("utf-8") if isinstance(content, str) else content
        (tmp / name).write_bytes(data)

    return setup


def lines(*items: object) -> str:
    """JSONL text: dicts and lists are dumped, strings are taken as they are."""
    return "".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in items)


def conversation(*messages: dict) -> dict:
    return {"messages": list(messages)}


USER = {"role": "user", "content": "What is 2+2?"}
ANSWER = {"role": "assistant", "content": "4"}
GOOD_CHAT = [conversation(USER, ANSWER)] * 3


def chat_file(*bad: object) -> Callable[[Path], None]:
    """Good conversations, then the bad line(s), then a good one."""
    return writes("chat.jsonl", lines(*GOOD_CHAT, *bad, GOOD_CHAT[0]))


def other_corpus(tmp: Path) -> None:
    with (tmp / "other.jsonl").open("w") as fh:
        for i in range(40):
            fh.write(json.dumps({"text": f"another document {i} " * 4}) + "\n")


def a_directory_with_a_file(tmp: Path) -> None:
    (tmp / "notes.txt").write_text("not a run\n")


def in_run(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    """A setup that damages the case's copy of the finished run ({tmp}/run)."""
    return lambda tmp: edit(tmp / "run")


FINAL = "checkpoints/window-00000002"


def flip(relative: str) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        data = bytearray((run / relative).read_bytes())
        data[len(data) // 2] ^= 0x01
        (run / relative).write_bytes(bytes(data))

    return edit


def garbage_line(relative: str, at: int = 0) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        lines_ = (run / relative).read_bytes().splitlines(keepends=True)
        lines_.insert(at, b"not json\n")
        (run / relative).write_bytes(b"".join(lines_))

    return edit


def only_checkpoint_damaged_and_no_latest(run: Path) -> None:
    flip(f"{FINAL}/optimizer.pt")(run)
    (run / "checkpoints" / "LATEST").unlink()


WARM = ("--set", "update.lr=0.002")  # what the warm start below changes


def killed_warm_start(damage: Callable[[Path], object] = lambda parent: None
                      ) -> Callable[[Path], None]:
    """{run} becomes a warm start of the finished run (moved to {tmp}/parent) as a
    SIGKILL inside its window 0 leaves it (S4): its manifest recording the parent,
    empty journals, no checkpoint, no summary. Then ``damage(parent)``."""
    def setup(tmp: Path) -> None:
        parent, run = tmp / "parent", tmp / "run"
        run.rename(parent)
        assert main(["resume", str(parent), "--warm-start", str(run), "--no-progress",
                     *WARM]) == 0
        shutil.rmtree(run / "checkpoints")
        for name in ("summary.json", "loss.png"):
            (run / name).unlink(missing_ok=True)
        for name in ("ledger.jsonl", "metrics.jsonl"):
            (run / name).write_bytes(b"")
        damage(parent)

    return setup


def another_parent_manifest(parent: Path) -> None:
    """The parent directory now holds another run's (valid) manifest."""
    from exactstep.state.manifest import digest_of

    body = json.loads((parent / "manifest.json").read_bytes())["manifest"]
    body["seeds"]["seed"] += 1
    (parent / "manifest.json").write_text(json.dumps({"digest": digest_of(body),
                                                      "manifest": body}))


def auto_resume(tmp: Path) -> None:
    """``train --resume auto`` of the warm start: the finished run's settings (its
    corpus) and the warm start's, written as a configuration file."""
    manifest = json.loads((tmp / "parent" / "manifest.json").read_bytes())["manifest"]
    (tmp / "run.toml").write_text(f'[data]\nsource = "{manifest["config"]["data"]["source"]}"'
                                  '\n[update]\nlr = 0.002\n')


SECTIONS = ("data", "batch", "model", "objective", "update", "numerics", "train",
            "checkpoint", "parallel", "chat", "arith")
TEXT = '{"text": "a document"}'

def hf(table: dict | None = None, *extra: str) -> tuple[str, ...]:
    """``train`` with ``model.source = hf`` and, if given, ``model.hf_config = table``
    (a tiny Llama unless the table says otherwise)."""
    llama = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = () if table is None else ("--set", f"model.hf_config={json.dumps({**llama, **table})}")
    return train("--set", "model.source=hf", *config, *extra)


def hf_chat(*extra: str) -> tuple[str, ...]:
    """``chat`` through the Hugging Face tokenizer that ``hf_files`` writes to {tmp}/tok."""
    return chat("--set", "data.tokenizer=hf", "--set", "data.tokenizer_path={tmp}/tok",
                "--set", "data.val_fraction=0.3", *extra)


def hf_files(template: str | None = None, pad: str | None = "<pad>") -> Callable[[Path], None]:
    """A BPE tokenizer trained in-process (ChatML template, PAD unless ``pad=None``),
    20 good conversations, and ``template`` (a tokenizer_support name) as {tmp}/t.jinja."""
    def setup(tmp: Path) -> None:
        import tokenizer_support

        tokenizer_support.save_tokenizer(tmp / "tok", pad=pad, chat_template=tokenizer_support.CHATML)
        if template is not None:
            (tmp / "t.jinja").write_text(getattr(tokenizer_support, template))
        (tmp / "chat.jsonl").write_text(lines(*[
            conversation({"role": "user", "content": f"q{i}"},
                         {"role": "assistant", "content": f"a{i}"}) for i in range(20)]))

    return setup


# --------------------------------------------------------------------------- cases

CASES: list[Case] = [
    # --- configuration: unknown keys, at the top and in every section
    Case("config-unknown-top-level-key", train("--set", "sede=1"), "'sede'"),
    *[Case(f"config-unknown-key-in-{s}", train("--set", f"{s}.nosuch=1"), f"{s}.nosuch")
      for s in SECTIONS],
    # --- configuration: wrong types and malformed overrides
    Case("config-int-given-a-word", train("--set", "batch.rows=two"), "batch.rows"),
    Case("config-int-given-a-fraction", train("--set", "update.accum=1.5"), "update.accum"),
    Case("config-float-given-a-word", train("--set", "update.lr=fast"), "update.lr"),
    Case("config-bool-given-a-word", train("--set", "model.tie_embeddings=maybe"),
         "model.tie_embeddings"),
    Case("config-choice-not-offered", train("--set", "data.kind=video"), "data.kind"),
    Case("config-section-given-a-value", train("--set", "update=3"), "'update'"),
    Case("config-section-json-unknown-key", train("--set", 'model.lora={"rank": 4}'),
         "unknown config key 'model.lora.rank'"),
    Case("config-section-json-nested-unknown-key",
         train("--set", 'model={"lora": {"rank": 4}}'), "unknown config key 'model.lora.rank'"),
    Case("config-section-json-not-an-object", train("--set", 'model.lora={"r": 4'),
         "'model.lora' is a section"),
    Case("config-section-json-bad-value", train("--set", 'update={"lr": "fast"}'), "update.lr"),
    Case("config-value-given-a-subkey", train("--set", "update.lr.peak=1"), "update.lr"),
    Case("config-override-without-equals", train("--set", "update.lr"), "KEY=VALUE"),
    Case("config-int-beyond-64-bits", train("--set", "train.steps=1e30"), "train.steps"),
    # --- configuration: out-of-range values, every section
    Case("range-seed-negative", train("--set", "seed=-1"), "seed must be in [0"),
    Case("range-data-val-fraction-one", train("--set", "data.val_fraction=1"),
         "data.val_fraction must be in (0, 1)"),
    Case("range-data-max-docs-negative", train("--set", "data.max_docs=-1"), "data.max_docs"),
    Case("range-batch-seq-len-one", train("--set", "batch.seq_len=1"), "batch.seq_len must be >= 2"),
    Case("range-batch-buffer-zero", train("--set", "batch.buffer=0"), "batch.buffer must be >= 1"),
    Case("range-model-norm-eps-negative", train("--set", "model.norm_eps=-1"), "model.norm_eps"),
    Case("range-model-rope-theta-zero", train("--set", "model.rope_theta=0"), "model.rope_theta"),
    Case("range-model-init-std-negative", train("--set", "model.init_std=-1"), "model.init_std"),
    Case("range-model-heads-do-not-divide", train("--set", "model.n_heads=3"), "model.n_heads"),
    Case("range-objective-smoothing-above-one", train("--set", "objective.label_smoothing=2"),
         "objective.label_smoothing must be in [0, 1]"),
    Case("range-objective-chunk-rows-negative", train("--set", "objective.chunk_rows=-1"),
         "objective.chunk_rows"),
    Case("range-update-beta2-one", train("--set", "update.beta2=1"), "update.beta2 must be in [0, 1)"),
    Case("range-update-eps-zero", train("--set", "update.eps=0"), "update.eps"),
    Case("range-update-fail-window-below-off", train("--set", "update.fail_window=-2"),
         "update.fail_window must be >= -1"),
    Case("range-numerics-init-scale-zero", train("--set", "numerics.init_scale=0"),
         "numerics.init_scale"),
    Case("range-train-steps-zero", train("--set", "train.steps=0"), "train.steps must be >= 1"),
    Case("range-train-threads-negative", train("--set", "train.threads=-1"), "train.threads"),
    Case("range-checkpoint-keep-zero", train("--set", "checkpoint.keep=0"), "checkpoint.keep"),
    Case("range-checkpoint-every-negative", train("--set", "checkpoint.every=-1"),
         "checkpoint.every"),
    Case("range-parallel-timeout-zero", train("--set", "parallel.timeout_s=0"),
         "parallel.timeout_s"),
    Case("range-parallel-bucket-zero", train("--set", "parallel.bucket_mb=0"), "parallel.bucket_mb"),
    Case("range-parallel-cp-zero", train("--set", "parallel.cp=0"), "parallel.cp must be >= 1"),
    # --- parallel axes no engine here runs (0x0A): refused at parse time
    Case("refused-context-parallel", train("--set", "parallel.cp=2"),
         "parallel.cp = 2 is not supported: PyTorch's context parallel keeps packed-document "
         "visibility only through FlexAttention, which has no backward on the CPU"),
    Case("refused-expert-parallel", train("--set", "parallel.ep=2"),
         "parallel.ep = 2 is not supported: exactstep's built-in decoder has no experts"),
    Case("range-chat-turns-not-offered", train("--set", "chat.turns=first"), "chat.turns"),
    Case("range-arith-multiplier-one", train("--set", "arith.max_multiplier=1"),
         "arith.max_multiplier must be >= 2"),
    Case("range-arith-follow-ups-inverted",
         train("--set", "arith.min_follow_ups=2", "--set", "arith.max_follow_ups=1"),
         "arith.max_follow_ups"),
    # --- configuration: non-finite floats (no key gives them a meaning)
    Case("nonfinite-weight-decay-nan", train("--set", "update.weight_decay=nan"),
         "update.weight_decay must be a finite number"),
    Case("nonfinite-lr-inf", train("--set", "update.lr=inf"), "update.lr must be a finite number"),
    Case("nonfinite-rope-theta-minus-inf", train("--set", "model.rope_theta=-inf"),
         "model.rope_theta"),
    Case("nonfinite-timeout-nan", train("--set", "parallel.timeout_s=NaN"), "parallel.timeout_s"),
    Case("nonfinite-float-overflow", train("--set", "update.clip=1e999"), "update.clip"),
    Case("nonfinite-toml-nan-literal", with_config(),
         "update.weight_decay", writes("run.toml", "[update]\nweight_decay = nan\n")),
    # --- configuration files
    Case("toml-syntax-error", with_config(),
         "not valid TOML", writes("run.toml", "[update\nlr = 1\n")),
    Case("toml-missing-file", with_config("--config", "{tmp}/nope.toml"),
         "nope.toml does not exist"),
    Case("toml-is-a-directory", with_config("--config", "{tmp}"), "is a directory"),
    Case("toml-not-utf8", with_config(),
         "not UTF-8", writes("run.toml", b'[data]\nsource = "caf\xe9"\n')),
    Case("toml-number-for-a-string", with_config(corpus=False),
         "data.source must be a string", writes("run.toml", "[data]\nsource = 5\n")),
    Case("toml-array-for-a-number", with_config(),
         "update.lr must be a number", writes("run.toml", "[update]\nlr = [1]\n")),
    Case("toml-value-for-a-section", with_config(),
         "'checkpoint' is a section", writes("run.toml", "checkpoint = 5\n")),
    # --- text data
    Case("text-missing-file", train("--set", "data.source={tmp}/nope.jsonl"),
         "nope.jsonl does not exist"),
    Case("text-source-is-a-directory", train("--set", "data.source={tmp}/docs"), "is a directory",
         lambda tmp: (tmp / "docs").mkdir()),
    Case("text-empty-file", train("--set", "data.source={tmp}/d.jsonl"), "no non-empty document",
         writes("d.jsonl", "")),
    Case("text-only-blank-lines", train("--set", "data.source={tmp}/d.jsonl"),
         "no non-empty document", writes("d.jsonl", "\n  \n\n")),
    Case("text-malformed-json", train("--set", "data.source={tmp}/d.jsonl"),
         "d.jsonl:2: not valid JSON", writes("d.jsonl", lines(TEXT, '{"text": '))),
    Case("text-line-not-an-object", train("--set", "data.source={tmp}/d.jsonl"),
         "d.jsonl:2: no \"text\" field", writes("d.jsonl", lines(TEXT, '["a", "b"]'))),
    Case("text-missing-text", train("--set", "data.source={tmp}/d.jsonl"),
         'd.jsonl:3: no "text" field', writes("d.jsonl", lines(TEXT, TEXT, {"body": "x"}))),
    Case("text-text-not-a-string", train("--set", "data.source={tmp}/d.jsonl"),
         'd.jsonl:1: "text" must be a string', writes("d.jsonl", lines({"text": 5}, TEXT))),
    Case("text-invalid-utf8", train("--set", "data.source={tmp}/d.jsonl"),
         "d.jsonl:2: not valid UTF-8",
         writes("d.jsonl", TEXT.encode() + b'\n{"text": "caf\xe9"}\n')),
    Case("text-unpaired-surrogate", train("--set", "data.source={tmp}/d.jsonl"),
         "d.jsonl:2: \"text\" holds an unpaired surrogate",
         writes("d.jsonl", lines(TEXT, '{"text": "a\\ud800b"}'))),
    Case("text-nested-too-deeply", train("--set", "data.source={tmp}/d.jsonl"),
         "d.jsonl:1: JSON nested too deeply",
         writes("d.jsonl", '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")),
    Case("text-path-with-a-line-break", train("--set", "data.source={tmp}/a\nb.jsonl"),
         "does not exist"),
    # --- chat data
    Case("chat-invalid-utf8", chat(), "chat.jsonl:4: not valid UTF-8",
         writes("chat.jsonl", lines(*GOOD_CHAT).encode()
                + b'{"messages": [{"role": "user", "content": "\xff"}]}\n')),
    Case("chat-unknown-role", chat(), "chat.jsonl:4: message 1 has unknown role 'bot'",
         chat_file(conversation(USER, {"role": "bot", "content": "4"}))),
    Case("chat-missing-role", chat(), 'chat.jsonl:4: message 0: "role" is missing',
         chat_file(conversation({"content": "hi"}, ANSWER))),
    Case("chat-empty-messages", chat(), "chat.jsonl:4: \"messages\" must be a non-empty list",
         chat_file({"messages": []})),
    Case("chat-no-messages-key", chat(), 'chat.jsonl:4: expected an object with a "messages"',
         chat_file({"text": "not chat"})),
    Case("chat-content-not-a-string", chat(), "chat.jsonl:4: message 1 (assistant): \"content\"",
         chat_file(conversation(USER, {"role": "assistant", "content": {"text": "4"}}))),
    Case("chat-tool-calls-hold-non-objects", chat(),
         'chat.jsonl:4: message 1: "tool_calls" item 0 must be a JSON object',
         chat_file(conversation(USER, {"role": "assistant", "content": None,
                                       "tool_calls": [5, None]}))),
    Case("chat-tool-calls-not-a-list", chat(), '"tool_calls" must be a list of JSON objects',
         chat_file(conversation(USER, {"role": "assistant", "content": "",
                                       "tool_calls": "f(x)"}))),
    Case("chat-tool-calls-on-a-user-message", chat(), "only assistant messages",
         chat_file(conversation({**USER, "tool_calls": [{"name": "f"}]}, ANSWER))),
    Case("chat-unknown-message-key", chat(), "chat.jsonl:4: message 1 has unknown key 'weight'",
         chat_file(conversation(USER, {**ANSWER, "weight": 0.5}))),
    Case("chat-nan-in-a-tool-call", chat(),
         'chat.jsonl:4: message 0: "tool_calls" item 0 holds NaN or Infinity',
         chat_file('{"messages": [{"role": "assistant", "content": "", '
                   '"tool_calls": [{"x": NaN}]}]}')),
    Case("chat-nan-weight", chat(), 'chat.jsonl:4: "weight" must be a finite number >= 0',
         chat_file('{"messages": [{"role": "user", "content": "q"}, '
                   '{"role": "assistant", "content": "a"}], "weight": NaN}')),
    Case("chat-repeated-key", chat(), "key 'content' appears twice",
         chat_file('{"messages": [{"role": "user", "content": "a", "content": "b"}]}')),
    Case("chat-no-supervised-token-under-empty-error",
         chat("--set", "chat.empty=error", "--set", "data.val_fraction=0.3"),
         "no supervised token",
         writes("chat.jsonl", lines(*[conversation({"role": "user", "content": f"q{i}"})
                                      for i in range(20)]))),
    Case("chat-missing-file", chat(), "chat.jsonl does not exist"),
    Case("chat-empty-validation-split", chat("--set", "data.val_fraction=1e-9"),
         "data.val_fraction",
         writes("chat.jsonl", lines(*[conversation({"role": "user", "content": f"q{i}"},
                                                   {"role": "assistant", "content": f"a{i}"})
                                      for i in range(5)]))),
    # --- settings this machine cannot hold: 16 x 2**44 float32 weights need 2**50
    # bytes, beyond any 64-bit address space, so the allocation fails at once
    Case("resource-model-beyond-memory", train("--set", "model.d_ff=17592186044416"),
         "out of memory"),
    Case("resource-rows-beyond-memory", train("--set", "batch.seq_len=10000000000000"),
         "out of memory"),
    # --- command-line arguments
    Case("cli-rows-not-a-range", inspect("--rows", "x"), "--rows expects A:B"),
    Case("cli-rows-reversed", inspect("--rows", "3:1"), "--rows expects 0 <= A < B"),
    Case("cli-rows-negative", inspect("--rows=-1:2"), "--rows expects 0 <= A < B"),
    Case("cli-rows-outside-the-microbatch", inspect("--rows", "0:99"), "outside the microbatch"),
    Case("cli-nproc-zero", train("--nproc", "0"), "--nproc expects a positive number"),
    Case("cli-nproc-negative", train("--nproc", "-1"), "--nproc expects a positive number"),
    Case("cli-nproc-not-a-number", train("--nproc", "two"), "--nproc"),
    Case("cli-unknown-bench", ("bench", "nosuch"), "nosuch"),
    Case("cli-unknown-command", ("trian",), "invalid choice: 'trian'"),
    Case("cli-unknown-option", train("--learning-rate", "1"), "--learning-rate"),
    Case("cli-resume-without-a-run-dir", ("resume",), "run_dir"),
    Case("cli-checkpoint-without-a-subcommand", ("checkpoint",), "checkpoint_command"),
    Case("cli-resume-a-directory-that-is-not-a-run", ("resume", "{tmp}", "--no-progress"),
         "manifest.json does not exist", a_directory_with_a_file),
    Case("cli-resume-a-missing-directory", ("resume", "{tmp}/nope", "--no-progress"),
         "does not exist"),
    Case("cli-eval-a-directory-that-is-not-a-run", ("eval", "{tmp}"),
         "manifest.json does not exist", a_directory_with_a_file),
    # --- resume refusals: a manifest field differs (the run must stay as it was)
    Case("resume-other-lr", resume("--set", "update.lr=1e-3"), "update.lr"),
    Case("resume-other-seed", resume("--set", "seed=3"), "seed"),
    Case("resume-other-rows", resume("--set", "batch.rows=3"), "batch.rows"),
    Case("resume-other-width", resume("--set", "model.d_model=32"), "model.d_model"),
    Case("resume-other-reduction", resume("--set", "objective.reduction=sequence_mean"),
         "objective.reduction"),
    Case("resume-other-precision", resume("--set", "numerics.precision=bf16"),
         "numerics.precision"),
    Case("resume-other-accum", resume("--set", "update.accum=2"), "update.accum"),
    Case("resume-other-steps", resume("--set", "train.steps=5"), "train.steps"),
    Case("resume-other-data", resume("--set", "data.source={tmp}/other.jsonl"), "data.source",
         other_corpus),
    Case("resume-invalid-value", resume("--set", "update.lr=nan"), "update.lr"),
    Case("resume-unknown-key", resume("--set", "update.lrr=1"), "update.lrr"),
    Case("resume-from-a-missing-checkpoint", resume("--from", "{tmp}/nope"), "nope"),
    Case("resume-warm-start-into-the-run-itself", resume("--warm-start", "{run}"),
         "already holds a run"),
    Case("train-into-an-existing-run", ("train", "--out", "{run}", "--no-progress", "--set",
                                        "data.source={corpus}", *TINY), "already holds a run"),
    # --- run directories: where a run may be written, and damage a resume must refuse
    # without changing a byte (S8); recoverable damage is in tests/state
    Case("out-is-a-file", train("--out", "{tmp}/notes.txt"), "is a file, not a directory",
         a_directory_with_a_file),
    Case("out-below-a-file", train("--out", "{tmp}/notes.txt/run"), "lies below",
         a_directory_with_a_file),
    Case("warm-start-into-a-file", resume("--warm-start", "{tmp}/notes.txt"), "is a file",
         a_directory_with_a_file),
    Case("resume-damaged-final-checkpoint", resume(), "model.safetensors is corrupted",
         in_run(flip(f"{FINAL}/model.safetensors"))),
    Case("resume-from-a-damaged-checkpoint", resume("--from", "{run}/" + FINAL),
         "optimizer.pt is corrupted", in_run(flip(f"{FINAL}/optimizer.pt"))),
    Case("resume-edited-checkpoint-manifest", resume(), "does not match its digest",
         in_run(lambda run: (run / FINAL / "manifest.json").write_text(
             (run / FINAL / "manifest.json").read_text().replace('"sequence": 0',
                                                                 '"sequence": 5')))),
    Case("resume-no-checkpoint-verifies", resume(), "no checkpoint in",
         in_run(only_checkpoint_damaged_and_no_latest)),
    Case("resume-damaged-run-manifest", resume(), "manifest.json",
         in_run(flip("manifest.json"))),
    Case("resume-ledger-garbage-line", resume(), "ledger.jsonl does not match",
         in_run(garbage_line("ledger.jsonl"))),
    Case("resume-ledger-lost-a-line", resume(), "ledger.jsonl does not match",
         in_run(lambda run: (run / "ledger.jsonl").write_bytes(
             b"".join((run / "ledger.jsonl").read_bytes().splitlines(keepends=True)[1:])))),
    Case("resume-metrics-garbage-line", resume(), "metrics.jsonl does not match",
         in_run(garbage_line("metrics.jsonl"))),
    Case("eval-damaged-final-checkpoint", ("eval", "{run}"), "rng.pt is corrupted",
         in_run(flip(f"{FINAL}/rng.pt"))),
    Case("warm-start-into-another-width",
         resume("--warm-start", "{tmp}/new", "--set", "model.d_model=32"),
         "do not fit the model this warm start's settings build (in loading state_dict "
         "for Decoder: size mismatch for embed.weight"),
    Case("warm-start-into-a-family-over-another-model",
         resume("--warm-start", "{tmp}/new", "--set", "objective.family=permutation"),
         'TwoStreamDecoder: Missing key(s) in state_dict: "query"'),
    # --- a warm start killed before its first checkpoint starts again from its
    # parent's weights (S4), or not at all
    Case("resume-warm-start-whose-parent-checkpoint-is-gone", resume(),
         f"/parent/{FINAL} recorded in",
         killed_warm_start(lambda parent: shutil.rmtree(parent / FINAL))),
    Case("resume-warm-start-whose-parent-is-gone", resume(), "is gone; nothing was changed",
         killed_warm_start(lambda parent: shutil.rmtree(parent))),
    Case("resume-warm-start-whose-parent-checkpoint-is-damaged", resume(),
         "model.safetensors is corrupted",
         killed_warm_start(flip(f"{FINAL}/model.safetensors"))),
    Case("resume-warm-start-whose-parent-is-another-run", resume(),
         "the parent has changed", killed_warm_start(another_parent_manifest)),
    Case("resume-auto-warm-start-whose-parent-checkpoint-is-gone",
         ("train", "--config", "{tmp}/run.toml", "--out", "{run}", "--no-progress",
          "--resume", "auto", *TINY), "is gone; nothing was changed",
         lambda tmp: (killed_warm_start(lambda parent: shutil.rmtree(parent / FINAL))(tmp),
                      auto_resume(tmp))),
    # --- Hugging Face models (H1): refused before the first step
    Case("hf-model-path-missing", hf(None, "--set", "model.path={tmp}/nope"),
         "nope does not exist"),
    Case("hf-model-path-without-weights", hf(None, "--set", "model.path={tmp}"),
         "has no safetensors weights", writes("config.json", '{"model_type": "llama"}')),
    Case("hf-model-path-without-config", hf(None, "--set", "model.path={tmp}"),
         "has no config.json", writes("model.safetensors", b"")),
    Case("hf-source-without-a-model", hf(), "needs exactly one of model.path"),
    Case("hf-backend-cannot-isolate", hf({}, "--set", "model.attn_implementation=flash_attention_2"),
         "model type llama with attn_implementation 'flash_attention_2' cannot isolate"),
    Case("hf-architecture-cannot-isolate",
         hf({"model_type": "jamba", "attn_layer_period": 2, "attn_layer_offset": 1,
             "num_experts": 1}), "jamba with attn_implementation 'sdpa' does not isolate"),
    Case("hf-vocabulary-mismatch", hf({"vocab_size": 100}),
         "tokenizer has 259 tokens but the llama model's vocabulary has 100"),
    Case("hf-head-soft-capping", hf({"model_type": "gemma2", "head_dim": 8}),
         "final logit soft-capping"),
    Case("hf-head-logit-scale", hf({"model_type": "cohere"}), "a final logit scale"),
    Case("hf-head-bias", hf({"model_type": "phi"}), "lm_head bias"),
    Case("hf-config-not-a-table", hf(None, "--set", "model.hf_config=[1]"),
         "model.hf_config must be a table"),
    Case("hf-config-unknown-key", hf({"hiden_size": 3}), "model.hf_config.hiden_size"),
    Case("hf-config-unknown-model-type", hf({"model_type": "nosuch"}), "'nosuch' is not a model"),
    Case("hf-rows-beyond-positions", hf({"max_position_embeddings": 16}),
         "batch.seq_len = 32 exceeds the llama model's max_position_embeddings = 16"),
    Case("hf-moe-router-logits",
         hf({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 1,
             "output_router_logits": True}), "model.hf_config.output_router_logits = true"),
    Case("hf-model-without-sdpa",  # sdpa asked for: the default auto would run eager
         hf({"model_type": "gemma2", "head_dim": 8, "final_logit_softcapping": None},
            "--set", "model.attn_implementation=sdpa"),
         "set model.attn_implementation = 'eager'"),
    Case("hf-rows-reach-llama4-floor-scale",
         hf({"model_type": "llama4_text", "head_dim": 8, "intermediate_size_mlp": 64,
             "num_local_experts": 1, "no_rope_layer_interval": 2, "floor_scale": 16}),
         "batch.seq_len = 32 reaches the llama4_text model's floor_scale = 16"),
]


# --- Parquet, Arrow and directories of shards (exactstep.data.datasets_source)


def table_file(name: str, rows: list[dict]) -> Callable[[Path], None]:
    """A setup writing ``rows`` as the Parquet (or Arrow stream) file ``{tmp}/name``."""
    def setup(tmp: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist(rows)
        if path.suffix == ".arrow":
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
                w.write_table(table)
        else:
            pq.write_table(table, path)

    return setup


def all_of(*setups: Callable[[Path], object]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / "d").mkdir(exist_ok=True)
        for each in setups:
            each(tmp)

    return setup


def shards_run(source: str, *extra: str) -> tuple[str, ...]:
    return train("--set", f"data.source={{tmp}}/{source}", *extra)


def shards_chat(source: str, *extra: str) -> tuple[str, ...]:
    return shards_run(source, "--set", "data.kind=chat", "--set", "batch.seq_len=64", *extra)


SHARD_TEXTS = [{"text": f"document {i}"} for i in range(4)]
SHARD_CHATS = [conversation(USER, ANSWER)] * 3

CASES += [
    Case("datasets-text-field-not-a-column", shards_run("d.parquet", "--set", "data.text_field=body"),
         "data.text_field 'body' is not a column of", table_file("d.parquet", SHARD_TEXTS)),
    Case("datasets-default-text-field-missing", shards_run("d.arrow"), "d.arrow; columns: body, n",
         table_file("d.arrow", [{"body": "x", "n": 1}])),
    Case("datasets-text-column-of-numbers", shards_run("d.parquet"), "is a column of int64, not of strings",
         table_file("d.parquet", [{"text": 5}, {"text": 6}])),
    Case("datasets-null-text", shards_run("d.parquet"), "d.parquet row 2: data.text_field 'text' is null",
         table_file("d.parquet", [*SHARD_TEXTS[:2], {"text": None}])),
    Case("datasets-bad-weight", shards_run("d.parquet"), 'd.parquet row 1: "weight" must be a finite',
         table_file("d.parquet", [{"text": "a", "weight": 1.0}, {"text": "b", "weight": -2.0}])),
    Case("datasets-empty-shard-dir", shards_run("d"), "is a directory with no .jsonl, .parquet or .arrow",
         all_of(writes("d/README.md", "# card\n"), writes("d/_SUCCESS", ""))),
    Case("datasets-no-rows", shards_run("d"), "holds no rows (2 .parquet files)",
         all_of(table_file("d/a.parquet", []), table_file("d/b.parquet", []))),
    Case("datasets-unsupported-file", shards_run("d.csv"), "d.csv is a .csv file, which exactstep does not",
         writes("d.csv", "text\nhello\n")),
    Case("datasets-unsupported-file-in-shard-dir", shards_run("d"), "holds notes.csv, which is not a",
         all_of(table_file("d/a.parquet", SHARD_TEXTS), writes("d/notes.csv", "a,b\n"))),
    Case("datasets-mixed-shard-formats", shards_run("d"), "mixes shard formats",
         all_of(table_file("d/a.parquet", SHARD_TEXTS), writes("d/b.jsonl", lines(*SHARD_TEXTS)))),
    Case("datasets-corrupt-parquet", shards_run("d.parquet"), "d.parquet cannot be read as .parquet",
         writes("d.parquet", b"PAR1 not really")),
    Case("datasets-missing-parquet", shards_run("nope.parquet"), "nope.parquet does not exist"),
    Case("datasets-jsonl-shard-bad-line", shards_run("d"), "b.jsonl:2: not valid JSON",
         all_of(writes("d/a.jsonl", lines(*SHARD_TEXTS)), writes("d/b.jsonl", lines(TEXT, "{")))),
    Case("datasets-chat-messages-field-not-a-column", shards_chat("c.parquet"),
         "data.messages_field 'messages' is not a column of",
         table_file("c.parquet", [{"conversation": c["messages"]} for c in SHARD_CHATS])),
    Case("datasets-chat-messages-of-wrong-type", shards_chat("c.parquet"),
         "is a column of string, not of lists of messages",
         table_file("c.parquet", [{"messages": "user: hi"}])),
    Case("datasets-chat-unknown-role", shards_chat("c.parquet"),
         "c.parquet row 3: message 1 has unknown role 'bot'",
         table_file("c.parquet", [*SHARD_CHATS, conversation(USER, {"role": "bot", "content": "4"})])),
    Case("datasets-chat-empty-messages", shards_chat("c.arrow"),
         'c.arrow row 0: "messages" must be a non-empty list',
         table_file("c.arrow", [{"messages": []}, *SHARD_CHATS])),
]

# --- Hugging Face tokenizers and chat templates (H2)

CASES += [
    Case("hf-template-without-assistant-tokens",
         hf_chat("--set", "data.chat_template={tmp}/t.jinja"), "renders no assistant tokens",
         hf_files("NO_ASSISTANT")),
    Case("hf-template-not-prefix-stable", hf_chat("--set", "data.chat_template={tmp}/t.jinja"),
         "is not prefix-stable", hf_files("UNSTABLE")),
    Case("hf-tokenizer-without-pad-token", hf_chat(), "has no PAD token; set data.pad_token",
         hf_files(pad=None)),
    Case("hf-tokenizer-directory-missing",
         hf_chat("--set", "data.tokenizer_path={tmp}/nope"), "data.tokenizer_path"),
    Case("hf-chat-template-file-missing",
         hf_chat("--set", "data.chat_template={tmp}/nope.jinja"), "data.chat_template",
         hf_files()),
    Case("hf-key-with-the-byte-tokenizer", train("--set", "data.pad_token=<pad>"),
         "data.pad_token applies only to a Hugging Face tokenizer"),
]


# --- prepared token shards (P1, P2, S6): {tmp}/p is prepared from {tmp}/corpus.jsonl


def prepared_dir(damage: str = "", hf: bool = False) -> Callable[[Path], None]:
    """Prepare {tmp}/corpus.jsonl into {tmp}/p (byte tokenizer, several shards), then
    ``damage`` the second train shard: ``delete``, ``truncate`` or ``flip`` a byte;
    ``hf`` also writes the Hugging Face tokenizer of ``hf_files`` to {tmp}/tok."""
    def setup(tmp: Path) -> None:
        from exactstep.artifacts.prepare import prepare
        from exactstep.config import load_config

        if hf:
            hf_files()(tmp)
        prepare(load_config(None, []), str(tmp / "corpus.jsonl"), tmp / "p",
                shard_tokens=200, progress=False)
        victim = tmp / "p" / "train-00001.tokens"
        data = bytearray(victim.read_bytes())
        if damage == "delete":
            victim.unlink()
        elif damage == "truncate":
            victim.write_bytes(bytes(data[:-1]))
        elif damage == "flip":
            data[3] ^= 0x10
            victim.write_bytes(bytes(data))

    return setup


def from_prepared(*extra: str) -> tuple[str, ...]:
    return train("--set", "data.source={tmp}/p", *extra)


def prepare_cmd(source: str, *extra: str) -> tuple[str, ...]:
    return ("prepare", source, "--out", "{tmp}/p", "--no-progress", *extra)


def prepared_chat(tmp: Path) -> None:
    """20 good conversations prepared (seq_len 64, default chat policy) into {tmp}/p."""
    from exactstep.artifacts.prepare import prepare
    from exactstep.config import load_config

    (tmp / "chat.jsonl").write_text(lines(*[
        conversation({"role": "user", "content": f"q{i}"},
                     {"role": "assistant", "content": f"a{i}"}) for i in range(20)]))
    cfg = load_config(None, ["data.kind=chat", "batch.seq_len=64", "data.val_fraction=0.3"])
    prepare(cfg, str(tmp / "chat.jsonl"), tmp / "p", progress=False)


CASES += [
    Case("prepared-chat-policy-differs",
         from_prepared("--set", "data.kind=chat", "--set", "batch.seq_len=64",
                       "--set", "chat.turns=last"),
         "prepared under another chat policy (differing: chat.turns)", prepared_chat),
    Case("prepared-chat-seq-len-differs",
         from_prepared("--set", "data.kind=chat", "--set", "batch.seq_len=128"),
         "truncated conversations to 64 tokens but batch.seq_len = 128", prepared_chat),
    Case("prepared-other-tokenizer",
         from_prepared("--set", "data.tokenizer=hf", "--set", "data.tokenizer_path={tmp}/tok"),
         "was prepared with a different tokenizer (tokenizer_hash", prepared_dir(hf=True)),
    Case("prepared-missing-shard", from_prepared(), "train-00001.tokens is missing",
         prepared_dir("delete")),
    Case("prepared-truncated-shard", from_prepared(), "train-00001.tokens has",
         prepared_dir("truncate")),
    Case("prepared-altered-shard", from_prepared(),
         "train-00001.tokens does not match its fingerprint", prepared_dir("flip")),
    Case("prepared-manifest-missing", from_prepared(), "is not a prepared directory (no prepared.json)",
         all_of(prepared_dir(), lambda tmp: (tmp / "p" / "prepared.json").unlink())),
    Case("prepared-kind-is-not-the-runs", from_prepared("--set", "data.kind=chat"),
         "was prepared as data.kind = 'text'", prepared_dir()),
    Case("prepare-zero-documents", prepare_cmd("{tmp}/empty.jsonl"),
         "holds no non-empty document", writes("empty.jsonl", lines({"text": ""}))),
    Case("prepare-out-not-empty", ("prepare", "{corpus}", "--out", "{tmp}", "--no-progress"),
         "already exists and is not empty"),
    Case("prepare-zero-workers", prepare_cmd("{corpus}", "--workers", "0"),
         "--workers expects a positive number"),
]


def professor(*extra: str) -> tuple[str, ...]:
    """``train`` with Professor Forcing over the causal decoder on the text corpus."""
    return train("--set", "objective.family=professor", "--set", "professor.over=causal",
                 "--set", "generation.max_new_tokens=8", *extra)


CASES += [  # Professor Forcing (Q5)
    Case("professor-negative-lambda", professor("--set", "professor.lambda_free=-0.5"),
         "professor.lambda_free must be >= 0"),
    Case("professor-negative-forced-lambda",
         professor("--set", "professor.lambda_forced=-1"), "professor.lambda_forced"),
    Case("professor-discriminator-without-optimizer",
         professor("--set", "professor.d_optimizer=none"),
         "the discriminator is trained by its own optimizer"),
    Case("professor-free-run-beyond-the-rows",
         professor("--set", "generation.max_new_tokens=32"),
         "generation.max_new_tokens = 32 tokens after its prompt cannot fit"),
    Case("professor-over-a-family-without-a-decoder",
         professor("--set", "professor.over=mlm"), "professor.over = 'mlm' has no decoder"),
    Case("professor-simultaneous-with-two-steps",
         professor("--set", "professor.order=simultaneous", "--set", "professor.d_steps=2"),
         "professor.d_steps = 1"),
    Case("resume-into-professor-with-a-negative-lambda",
         resume("--set", "objective.family=professor", "--set", "professor.lambda_free=-1"),
         "professor.lambda_free"),
]


def policy(*extra: str) -> tuple[str, ...]:
    """``train`` with the policy family over the causal decoder on the text corpus."""
    return train("--set", "objective.family=policy", "--set", "policy.over=causal",
                 "--set", "generation.max_new_tokens=4", "--set", "policy.baseline=none",
                 *extra)


CASES += [  # weighted rewards, declared columns, a LoRA policy's base reference (Q2, H4)
    Case("data-column-a-line-lacks", policy("--set", "data.columns=answer"),
         'corpus.jsonl:1: no "answer" field, which data.columns declares'),
    Case("data-column-the-text-field", policy("--set", "data.columns=text"),
         "data.columns entry 'text'"),
    Case("policy-reward-and-rewards",
         policy("--set", "policy.reward=token_f1",
                "--set", 'policy.rewards=[{"name": "exact_match", "weight": 1}]'),
         "policy.reward = 'token_f1' and policy.rewards are both set"),
    Case("policy-rewards-not-a-list", policy("--set", 'policy.rewards={"name": "x"}'),
         "policy.rewards must be a list of tables"),
    Case("data-columns-over-pairs",
         policy("--set", "policy.over=encdec", "--set", "data.columns=answer"),
         "the encoder-decoder's pairs carry none"),
    Case("policy-reference-base-without-lora",
         policy("--set", "policy.kl=k1", "--set", "policy.beta=0.1",
                "--set", "policy.reference=base"),
         'policy.reference = "base" is the frozen base of a LoRA policy'),
]


# --------------------------------------------------------------------------- running


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A tiny finished run, built once with the real CLI (2 windows, 1 checkpoint)."""
    root = tmp_path_factory.mktemp("finished")
    write_corpus(root / "corpus.jsonl")
    run = root / "run"
    code = main(["train", "--out", str(run), "--no-progress",
                 "--set", f"data.source={root / 'corpus.jsonl'}", *TINY])
    assert code == 0
    assert (run / "checkpoints" / "LATEST").is_file()
    return run


def fill(argv: Sequence[str], tmp: Path, corpus: Path, run: Path | None) -> list[str]:
    out = []
    for arg in argv:
        arg = arg.replace("{tmp}", str(tmp)).replace("{corpus}", str(corpus))
        out.append(arg.replace("{run}", str(run)) if run is not None else arg)
    return out


def params() -> list:
    return [pytest.param(case, id=case.id,
                         marks=[pytest.mark.xfail(strict=True, reason=case.xfail)]
                         if case.xfail else [])
            for case in CASES]


@pytest.mark.parametrize("case", params())
def test_bad_input_is_refused_with_one_line(case: Case, tmp_path: Path, capfd,
                                            request) -> None:
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    run = None
    if case.uses_run:
        run = tmp_path / "run"
        shutil.copytree(request.getfixturevalue("finished_run"), run)
    if case.setup is not None:
        case.setup(tmp_path)
    before = snapshot(run) if run is not None else {}
    capfd.readouterr()
    code = main(fill(case.argv, tmp_path, corpus, run))
    out, err = capfd.readouterr()
    assert refusal_problems(code, out, err, exit_code=case.exit_code) == [], err
    assert case.needle in err, err
    if run is not None:
        assert changed_files(before, snapshot(run)) == []


def test_the_campaign_is_large_and_its_ids_are_distinct() -> None:
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 50


def test_negative_control_a_killed_warm_start_with_its_parent_intact_resumes(
        finished_run, tmp_path, capfd) -> None:
    """The warm-start cases' setup without damage: ``resume`` and ``train --resume
    auto`` both run it, window 0 from the parent's weights, so each refusal above is
    its damage's (S4, S10)."""
    commands = {"resume": ["resume", "{run}", "--no-progress"],
                "auto": ["train", "--config", "{tmp}/run.toml", "--out", "{run}",
                         "--no-progress", "--resume", "auto", *TINY]}
    for name, argv in commands.items():
        tmp = tmp_path / name
        tmp.mkdir()
        shutil.copytree(finished_run, tmp / "run")
        killed_warm_start()(tmp)
        auto_resume(tmp)
        capfd.readouterr()
        assert main(fill(argv, tmp, tmp / "corpus.jsonl", tmp / "run")) == 0, name
        assert "from the parent's weights" in capfd.readouterr().err, name
        assert (tmp / "run" / "checkpoints" / "LATEST").is_file()


# --------------------------------------------------------------------------- signals


def clean_env() -> dict[str, str]:
    """This environment without a launcher's variables (the CLI must start its own)."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in launcher}


@pytest.mark.slow
def test_sigterm_to_the_nproc_launcher_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """D1, X4: SIGTERM to ``exactstep train --nproc 2`` reaches the workers through
    torchrun's agent; rank 0 prints the one line, the launcher adds nothing (no
    traceback, no log line) and exits 130, as one process does."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    out = tmp_path / "run"
    argv = [a.replace("train.steps=2", "train.steps=400") for a in TINY]
    proc = process_server.Popen(
        [sys.executable, "-m", "exactstep", "train", "--nproc", "2", "--no-progress",
         "--out", str(out), "--set", f"data.source={corpus}", "--set", "checkpoint.every=0",
         *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    ledger = out / "ledger.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if ledger.exists() and ledger.read_text().count("\n") >= 1:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    # the run's own status line ("exactstep: N parameters ...") is not an error
    assert refusal_problems(proc.returncode, stdout, stderr, exit_code=130,
                            notices=("exactstep: ",)) == [], stderr
    assert "stopped by SIGTERM" in stderr


# --------------------------------------------------------------------------- controls


def test_negative_control_the_checker_fails_on_a_traceback() -> None:
    """A command that raises a non-exactstep exception (a bug keeps its traceback)
    fails the checker: wrong status, several lines, a traceback."""
    crash = ("import sys\nfrom exactstep import cli\n"
             "cli.dispatch = lambda args: {}['no such key']\nsys.exit(cli.main(['config']))\n")
    proc = process_server.run([sys.executable, "-c", crash], capture_output=True, text=True,
                              timeout=120, env=clean_env())
    assert "KeyError" in proc.stderr  # it really crashed
    problems = refusal_problems(proc.returncode, proc.stdout, proc.stderr)
    assert "a traceback in the output" in problems
    assert any(p.startswith("exit status") for p in problems)
    assert any(p.endswith("expected exactly 1") for p in problems)


def test_negative_control_the_checker_fails_on_a_usage_block() -> None:
    """argparse's own output (usage, then the error) is two lines, not one."""
    stderr = ("usage: exactstep train [-h] [--config CONFIG]\n"
              "exactstep train: error: argument --nproc: invalid int value: 'two'\n")
    assert refusal_problems(2, "", stderr) == ["2 lines on stderr, expected exactly 1"]
    assert refusal_problems(2, "", "exactstep: error: x\n") == [
        "the stderr line does not start with 'error: ': 'exactstep: error: x'"]


def test_negative_control_a_command_that_succeeds_fails_the_checker(capfd) -> None:
    code = main(["config"])
    out, err = capfd.readouterr()
    assert code == 0 and "update.lr" in out
    assert refusal_problems(code, out, err) == ["exit status 0, expected 2",
                                                "0 lines on stderr, expected exactly 1"]


def test_negative_control_the_snapshot_sees_one_changed_byte(finished_run, tmp_path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = snapshot(run)
    ledger = run / "ledger.jsonl"
    data = bytearray(ledger.read_bytes())
    data[0] ^= 1
    ledger.write_bytes(bytes(data))
    (run / "extra").write_text("")
    assert changed_files(before, snapshot(run)) == ["extra", "ledger.jsonl"]


# --------------------------------------------------------------------------- filesystems


@pytest.fixture
def small_filesystem(tmp_path: Path):
    """A directory on a filesystem of its own: ``make(read_only, size)`` returns it.

    As root, a tmpfs is mounted (the only way root meets EROFS or a real ENOSPC); as
    another user, a read-only directory is one without write permission. Skipped
    where neither is possible.
    """
    mounted: list[Path] = []

    def make(*, read_only: bool, size: str = "4m") -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        if os.geteuid() != 0:
            if not read_only:
                pytest.skip("a full filesystem needs a tmpfs mount (root)")
            where.chmod(0o555)
            return where
        options = f"size={size}" + (",ro" if read_only else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_out_in_a_read_only_directory_is_one_line(small_filesystem, tmp_path, capfd) -> None:
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    read_only = small_filesystem(read_only=True)
    capfd.readouterr()
    code = main(fill(train("--out", f"{read_only}/run"), tmp_path, corpus, None))
    out, err = capfd.readouterr()
    assert refusal_problems(code, out, err) == [], err
    assert f"--out {read_only}/run cannot be created" in err


def test_a_full_filesystem_is_one_line_and_the_last_checkpoint_survives(
        small_filesystem, tmp_path, capfd) -> None:
    """S8 with a real ENOSPC: a 1 MiB filesystem holds the first checkpoints of a tiny
    run but not all of them; the failing write is one line naming the intact one."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    disk = small_filesystem(read_only=False, size="1m")
    run = disk / "run"
    argv = [a.replace("train.steps=2", "train.steps=400") for a in
            train("--out", str(run), "--set", "checkpoint.every=1", "--set",
                  "checkpoint.keep=400")]
    capfd.readouterr()
    code = main(fill(argv, tmp_path, corpus, None))
    out, err = capfd.readouterr()
    assert refusal_problems(code, out, err, notices=("exactstep: ",)) == [], err
    assert "No space left on device" in err and "is intact" in err
    intact = re.search(r"checkpoint (window-\d+) is intact", err).group(1)
    from exactstep.state import verify_checkpoint

    assert verify_checkpoint(run / "checkpoints" / intact).ok
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
