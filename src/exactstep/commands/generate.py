"""``exactstep generate``: continuations of prompts from a run's checkpoint or an export
directory, drawn by the sampler every rollout uses (Q1), streamed to the terminal.

Continuation ``k`` of the ``i``-th prompt draws from the stream addressed by
``(seed, 0, i, k)``: the same command prints the same text. One sample a prompt is
streamed as it is drawn (``sample_group``); several are drawn for every prompt at once
(``sample_window``, batches of ``generation.batch_rows`` rows). A run samples with its
``generation`` section unless a flag says otherwise; an export with one sample, at
temperature 1.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from exactstep.artifacts.export import is_export, open_export
from exactstep.data.chat import template_for
from exactstep.data.conversation import Message
from exactstep.errors import ConfigError
from exactstep.families.encdec.compiler import source_pad_of
from exactstep.generation.config import GenerationConfig
from exactstep.generation.sampler import SampleRequest, sample_group, sample_window
from exactstep.run.finished_run import open_finished_run

FLAGS = {"samples": "samples", "max_new_tokens": "max_new_tokens",
         "temperature": "temperature", "top_k": "top_k", "top_p": "top_p"}


def run(args: argparse.Namespace) -> int:
    source = Path(args.source)
    if is_export(source):
        model, tokenizer = open_export(source)
        return generate(model, tokenizer, args, GenerationConfig(samples=1),
                        chat=bool(args.chat), device="cpu")
    with open_finished_run(source, purpose="generate from",
                           from_checkpoint=Path(args.from_checkpoint)
                           if args.from_checkpoint else None) as run_:
        chat = args.chat or (run_.cfg.data.kind == "chat" and not args.text)
        encdec = run_.parts.family.model == "encdec"  # the prompt is the encoder's source
        return generate(run_.model, run_.parts.tokenizer, args, run_.cfg.generation,
                        chat=chat and not encdec, device=run_.device,
                        source_pad_id=source_pad_of(run_.cfg.encdec, run_.parts.tokenizer)
                        if encdec else None)


def policy_of(base: GenerationConfig, args: argparse.Namespace) -> GenerationConfig:
    """``base`` with every flag given; a bad value is the config's own error, named by
    its flag."""
    changes = {field: getattr(args, flag) for flag, field in FLAGS.items()
               if getattr(args, flag, None) is not None}
    try:
        return replace(base, **changes)
    except ConfigError as exc:
        flag = str(exc).split()[0].removeprefix("generation.").replace("_", "-")
        raise ConfigError(f"--{flag}: {exc}") from None


def prompt_ids(text: str, tokenizer: Any, chat: bool) -> list[int]:
    """The prompt's ids: a user turn and the assistant's header (``chat``), or the
    beginning-of-sequence token and the text."""
    if chat:
        return template_for(tokenizer).render_prompt([Message("user", text)],
                                                     tokenizer).tokens.tolist()
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_id", None)
    return ids if bos is None or (ids and ids[0] == bos) else [bos, *ids]


class Stream:
    """Prints one continuation as its tokens arrive: the decoded text so far, less what
    was printed, held back at a character the next token may complete."""

    def __init__(self, tokenizer: Any, out: Any) -> None:
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out, [], 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = max(self.shown, len(text))


def generate(model: Any, tokenizer: Any, args: argparse.Namespace, base: GenerationConfig,
             *, chat: bool, device: Any, source_pad_id: int | None = None) -> int:
    """Each prompt's continuations; with ``source_pad_id`` (an encoder-decoder) the
    prompt is the encoder's source (its ids and ``EOS``, as pairs are encoded) and the
    decoder starts from ``BOS``."""
    cfg = policy_of(base, args)
    out = sys.stdout
    requests = []
    for i, text in enumerate(args.prompt):
        if source_pad_id is None:
            requests.append(SampleRequest(i, tuple(prompt_ids(text, tokenizer, chat))))
        else:
            requests.append(SampleRequest(i, (tokenizer.bos_id,), tuple(
                [*tokenizer.encode(text), tokenizer.eos_id])))
    streamed = cfg.samples == 1  # one continuation a prompt: printed as it is drawn
    batched = None if streamed else iter(sample_window(
        model, requests, cfg, seed=args.seed, window=0, stop_ids=(tokenizer.eos_id,),
        device=device, source_pad_id=source_pad_id or 0))  # every prompt's rows at once
    for i, (text, r) in enumerate(zip(args.prompt, requests, strict=True)):
        if len(args.prompt) > 1:
            out.write(f"== prompt {i}: {text}\n")
        stream = Stream(tokenizer, out) if streamed else None
        conts = next(batched) if batched is not None else sample_group(
            model, r.prompt, cfg, seed=args.seed, window=0, example_id=i,
            stop_ids=(tokenizer.eos_id,), device=device, source=r.source,
            source_pad_id=source_pad_id or 0,
            on_token=lambda k, t, stream=stream: stream.add(t))
        for k, cont in enumerate(conts):
            end = "stop token" if cont.stopped else f"limit of {cfg.max_new_tokens}"
            if stream is None:
                out.write(f"-- sample {k}\n{tokenizer.decode(list(cont.tokens))}")
            out.write(f"\n-- {len(cont.tokens)} tokens, ended at the {end}\n")
    return 0
