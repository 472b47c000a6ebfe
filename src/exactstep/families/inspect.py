"""``exactstep inspect`` (R6): the rows of the first microbatch a run with a configuration
would see, compiled by its family and rendered by ``rows.inspect`` (or by the family's
own ``render`` where it has more to show). A family with a window program (the policy
family's rollouts, Q1) shows the trajectories the model at its initial weights samples
for that microbatch: each with its reward, baseline, advantage and scored rows;
Professor Forcing (Q5) shows each example's two paths, teacher-forced and free-running,
the steps the discriminator compares and its initial verdict on each.
"""

from __future__ import annotations

from typing import Any

import torch

from exactstep.config import RunConfig
from exactstep.errors import ConfigError
from exactstep.families.registry import FamilyParts, open_family, resolve
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.inspect import render_rows
from exactstep.rows.stream import RowStream, eval_batches


def inspect_rows(cfg: RunConfig, rows: range, *, split: str = "train") -> str:
    """Render rows of the first microbatch a run with ``cfg`` would see (R6).

    Raises ``ConfigError`` when ``rows`` reaches past the microbatch.
    """
    parts = open_family(resolve(cfg))
    tokenizer, data, compiler = parts.tokenizer, parts.data, parts.compiler
    if split == "train":
        batch = next(iter(RowStream(data.train, cfg.batch, pad_id=tokenizer.pad_id,
                                    seed=cfg.seed, compiler=compiler)))
    else:
        batch = next(iter(eval_batches(data.val, cfg.batch, pad_id=tokenizer.pad_id,
                                       compiler=compiler)))
    program = parts.family.program(cfg, parts, None, torch.device("cpu")) \
        if split == "train" else None
    if program is not None:
        return render_rollouts(cfg, parts, program, batch, rows)
    if rows.stop > batch.input_ids.shape[0]:
        raise ConfigError(f"--rows {rows.start}:{rows.stop} is outside the microbatch's "
                          f"{batch.input_ids.shape[0]} rows")
    render = getattr(compiler, "render", None)  # a family with more to show (R8)
    return render(batch, tokenizer, rows) if render else render_rows(batch, tokenizer, rows)


def render_rollouts(cfg: RunConfig, parts: FamilyParts, program: Any, batch: Batch,
                    rows: range) -> str:
    """The trajectories window 0 would train on from ``batch``'s prompts, sampled by the
    model at its initial weights (``seed``): per trajectory the prompt's example, the
    sample, the response, reward, baseline and advantage, then the row's table."""
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    trajectories, info = program.prepare(model, [batch], clock=0, window=0,
                                         device=torch.device("cpu"), reducer=None)
    out = trajectories[0]
    if "professor" in out.meta:
        return render_two_paths(parts, program, out, info, rows)
    if rows.stop > out.input_ids.shape[0]:
        raise ConfigError(f"--rows {rows.start}:{rows.stop} is outside the window's "
                          f"{out.input_ids.shape[0]} trajectories")
    lines = [f"window 0: {info['prompts']} prompts, {info['samples']} samples at the initial "
             f"weights, mean reward {info['reward_mean']}"]
    for b in rows:
        record = program.records[b]
        seg = out.segments[b][0]
        scored = out.labels[b][out.labels[b] != IGNORE_INDEX].tolist()
        coefficient = out.meta["policy"].coefficient[b][out.labels[b] != IGNORE_INDEX]
        lines += [f"trajectory {b}: example {seg.example_id} sample {seg.piece}: response "
                  f"{parts.tokenizer.decode(scored)!r} ({record['tokens']} sampled, "
                  f"{'stop token' if record['stopped'] else 'limit reached'}); reward "
                  f"{record['reward']}, baseline {record['baseline']}, advantage "
                  f"{record['advantage']}; coefficients {[round(float(c), 6) for c in coefficient]}",
                  render_rows(out, parts.tokenizer, range(b, b + 1))]
    return "\n".join(lines)


def render_two_paths(parts: FamilyParts, program: Any, out: Batch, info: dict,
                     rows: range) -> str:
    """Professor Forcing's window 0 from ``out`` (a two-path micro-batch): for each
    example of ``rows``, its prompt, the teacher-forced reference and the free run drawn
    at the initial weights, the steps compared, the discriminator's ``P(teacher-forced)``
    of each path at its initial weights, then both rows' tables."""
    half = out.input_ids.shape[0] // 2
    if rows.stop > half:
        raise ConfigError(f"--rows {rows.start}:{rows.stop} is outside the window's {half} "
                          "examples (each has a teacher-forced and a free-running row)")
    decode = parts.tokenizer.decode
    lines = [f"window 0: {info['examples']} examples, each a teacher-forced row and a "
             f"free-running row; the discriminator's accuracy at its initial weights "
             f"{info['discriminator']['accuracy']}"]
    rows_meta = out.meta["professor"]
    for b in rows:
        record = program.records[b]
        free = b + half
        prompt_len = int(out.segments[b][0].length) - record["forced_tokens"] + 1
        prompt = out.input_ids[b][:prompt_len].tolist()
        forced = out.labels[b][out.labels[b] != IGNORE_INDEX].tolist()
        drawn = out.input_ids[free][prompt_len:int(out.segments[free][0].length)].tolist()
        source = "" if out.source is None else \
            f", source {decode(out.source.input_ids[b][out.source.segment_ids[b] > 0].tolist())!r}"
        lines += [f"example {record['example']}: prompt {decode(prompt)!r}{source}",
                  f"  teacher-forced: {decode(forced)!r} ({record['forced_tokens']} tokens, "
                  f"{int(rows_meta.steps[b].sum())} steps compared), "
                  f"P(teacher-forced) {record['p_forced_of_forced']:.4f}",
                  f"  free-running:   {decode(drawn)!r} + its last draw ({record['free_tokens']} drawn, "
                  f"{'stop token' if record['free_stopped'] else 'limit reached'}, "
                  f"{int(rows_meta.steps[free].sum())} steps compared), "
                  f"P(teacher-forced) {record['p_forced_of_free']:.4f}",
                  render_rows(out, parts.tokenizer, range(b, b + 1)),
                  render_rows(out, parts.tokenizer, range(free, free + 1))]
    return "\n".join(lines)
