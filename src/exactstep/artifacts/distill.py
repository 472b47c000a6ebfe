"""``exactstep distill``: a teacher's targets as a declared, prepared source (R10).

Sequence-level distillation changes the dataset, so it is made a dataset: every
training conversation of the student's source keeps its user (and system and tool)
messages and gets the teacher's answer in place of each assistant turn, in order,
by the sampler every rollout uses (greedy, or sampled from the stream addressed by
``(seed, turn, conversation, 0)``); the validation split stays gold, so held-out figures
still measure the task. The result is written by ``prepare`` with the student's
tokenizer and chat policy, and its ``prepared.json`` names the teacher (an exactstep
run: its manifest's and checkpoint's sha256; an export or Hugging Face directory: the
sha256 of its weight files) and the decoding policy. A run on it carries that into
its manifest's ``data.teacher``; ``eval`` and ``export`` say so. Resume stays exact:
the targets are data, and other teacher data is another fingerprint, which a resume
refuses (S4).
Design and derivations: docs/design/prepare-export.md#artifactsdistillpy (R10).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from exactstep.artifacts.export import is_export, open_export
from exactstep.artifacts.prepare import SourceItems, prepare, read_source
from exactstep.data.chat import template_for
from exactstep.data.conversation import Conversation, Message
from exactstep.errors import ConfigError
from exactstep.families import run_data_kind
from exactstep.generation.config import GenerationConfig
from exactstep.generation.sampler import sample_group
from exactstep.rows.sources import conversations_digest
from exactstep.run.finished_run import open_finished_run
from exactstep.state.durable import sha256_file

TEACHER_RNG = ("the sampler's stream (seed, assistant turn, training conversation index, "
               "sample 0)")


@contextlib.contextmanager
def open_teacher(path: Path, from_checkpoint: Path | None = None) -> Iterator[dict[str, Any]]:
    """The teacher as ``{"model", "tokenizer", "device", "identity"}``: an exactstep run
    (at ``from_checkpoint`` or the checkpoint a resume would choose) or an export /
    Hugging Face model directory."""
    path = Path(path)
    if is_export(path) or (path / "config.json").is_file():
        model, tokenizer = open_export(path)
        weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
        if not weights:
            raise ConfigError(f"teacher {path} holds no weight file (*.safetensors); give an "
                              "exactstep run, an export or a Hugging Face model directory")
        yield {"model": model, "tokenizer": tokenizer, "device": "cpu", "identity": {
            "kind": "export" if is_export(path) else "hf_directory", "path": str(path),
            "weights_sha256": {p.name: sha256_file(p) for p in weights}}}
        return
    if not (path / "manifest.json").is_file():
        raise ConfigError(f"teacher {path} is neither an exactstep run (manifest.json) nor a "
                          "model directory (config.json); give one of them")
    with open_finished_run(path, from_checkpoint=from_checkpoint,
                           purpose="distill from") as run:
        if run.parts.family.model != "decoder":
            raise ConfigError(f"teacher {path} is a {run.parts.family.name!r} run; a teacher "
                              "answers chat prompts, so it must be a decoder (chat or causal)")
        yield {"model": run.model, "tokenizer": run.parts.tokenizer, "device": run.device,
               "identity": {
                   "kind": "exactstep_run", "path": str(path),
                   "manifest_sha256": sha256_file(path / "manifest.json"),
                   "run_manifest_digest": run.manifest.digest,
                   "checkpoint": run.checkpoint.name,
                   "checkpoint_sha256": checkpoint_digest(run.checkpoint)}}


def checkpoint_digest(checkpoint: Path) -> str:
    """sha256 over the checkpoint's files (names and contents, sorted): its weights."""
    h = hashlib.sha256()
    for p in sorted(q for q in checkpoint.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(checkpoint)).encode() + b"\0")
        h.update(bytes.fromhex(sha256_file(p)))
    return h.hexdigest()


def answer(teacher: dict[str, Any], messages: tuple[Message, ...], policy: GenerationConfig,
           seed: int, index: int, turn: int) -> str:
    """The teacher's answer to ``messages`` (up to its stop token), as text, drawn from
    the stream ``(seed, turn, index, 0)``."""
    tokenizer = teacher["tokenizer"]
    ids = template_for(tokenizer).render_prompt(list(messages), tokenizer).tokens.tolist()
    (cont,) = sample_group(teacher["model"], ids, policy, seed=seed, window=turn,
                           example_id=index, stop_ids=(tokenizer.eos_id,),
                           device=teacher["device"], samples=1)
    tokens = list(cont.tokens[:-1] if cont.stopped else cont.tokens)
    return tokenizer.decode(tokens)


def answered(teacher: dict[str, Any], conversation: Conversation, policy: GenerationConfig,
             seed: int, index: int) -> Conversation:
    """``conversation`` with every assistant turn the teacher's, in order: each answered
    given the messages before it, the teacher's own earlier answers included."""
    messages: list[Message] = []
    turn = 0
    for message in conversation.messages:
        if message.role == "assistant":
            message = Message("assistant", answer(teacher, tuple(messages), policy, seed,
                                                  index, turn))
            turn += 1
        messages.append(message)
    if turn == 0:
        raise ConfigError(f"conversation {conversation.name or index} has no assistant turn "
                          "for a teacher to answer; distill needs chat data with answers")
    return replace(conversation, messages=tuple(messages))


def distill(cfg: Any, teacher_path: Path, out: Path, *, policy: GenerationConfig,
            from_checkpoint: Path | None = None, workers: int = 1,
            progress: bool = True) -> dict[str, Any]:
    """Write the student's source with the teacher's answers into ``out`` (prepared
    shards); returns the published ``prepared.json``. ``cfg``: the student's run
    configuration (its data, tokenizer, chat policy and seed)."""
    cfg = replace(cfg, data=replace(cfg.data, kind=run_data_kind(cfg)))
    if cfg.data.kind != "chat":
        raise ConfigError(f"distill replaces assistant turns, so the student's data must be "
                          f"chat; data.kind is {cfg.data.kind!r} (text and pairs are not "
                          "distilled yet)")
    if Path(out).exists() and any(Path(out).iterdir()):
        raise ConfigError(f"--out {out} already exists and is not empty; choose a new --out")
    gold = read_source(cfg)
    with open_teacher(teacher_path, from_checkpoint) as teacher:
        pairs, train, val = [], [], []
        for split, conversation in gold:
            if split == "train":
                conversation = answered(teacher, conversation, policy, cfg.seed, len(train))
                train.append(conversation)
            else:
                val.append(conversation)
            pairs.append((split, conversation))
        gold_info = gold.info()
        info = {"split_rule": gold_info["split_rule"],
                "source_fingerprint": conversations_digest(train + val),
                "teacher": {**teacher["identity"], "decoding": decoding(policy, cfg.seed),
                            "replaced": "every assistant turn of each training "
                                        "conversation, in order, each given the teacher's "
                                        "earlier answers; the validation split is gold",
                            "gold_source": str(cfg.data.source),
                            "gold_source_fingerprint": gold_info["source_fingerprint"]}}
    items = SourceItems(iter(pairs), lambda: info, len(pairs))
    return prepare(cfg, f"distilled:{cfg.data.source}", Path(out), workers=workers,
                   progress=progress, items=items)


def decoding(policy: GenerationConfig, seed: int) -> dict[str, Any]:
    if policy.greedy:
        return {"greedy": True, "max_new_tokens": policy.max_new_tokens}
    return {"greedy": False, "temperature": policy.temperature, "top_k": policy.top_k,
            "top_p": policy.top_p, "max_new_tokens": policy.max_new_tokens, "seed": seed,
            "rng": TEACHER_RNG}
