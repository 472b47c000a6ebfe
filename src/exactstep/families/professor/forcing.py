"""Professor Forcing's window program (Q5, Q1): two paths, a discriminator, one transaction.

Before the window is planned (``UpdateEngine(program=)``), each example of each
micro-batch is split into prompt and reference (as the policy family splits it) and one
free-running continuation is drawn at the window's parameters (``sample_window``:
addressed draws, eval mode, no gradients). Each example becomes two rows of a two-path
batch: teacher-forced (prompt + reference, the reference supervised) and free-running
(prompt + the continuation, nothing supervised); ``meta["professor"]`` says which steps
the discriminator compares. Then the discriminator's steps, on the behaviour of both
paths at the window's generator parameters (eval mode, no gradients: nothing reaches
the generator), each reduced over ranks and decided finite (``update.second``). The
generator's step (``ForcingModule``: NLL + lambda x the adversarial cost through the
discriminator's detached parameters: nothing reaches the discriminator) follows in the
engine. ``close`` commits the discriminator's steps only if the window committed, else
restores it bit for bit: both updates, or neither (U3, U4).
Design and derivations: docs/design/families.md#familiesprofessorforcingpy (Q5, Q1, U3, U4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from exactstep.errors import ConfigError, DataError
from exactstep.families.professor.config import ProfessorConfig
from exactstep.families.professor.discriminator import Discriminator, behaviour
from exactstep.generation.config import GenerationConfig
from exactstep.generation.prompts import Request, example_ids, response_batch, split_example
from exactstep.generation.sampler import Continuation, SampleRequest, sample_window
from exactstep.objective import microbatch_terms
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.professor import FORCED, FREE, ForcingRows
from exactstep.rows.batch import Batch
from exactstep.rows.example import Example
from exactstep.state.rng import isolated
from exactstep.update.config import UpdateConfig
from exactstep.update.disposition import Disposition, Outcome
from exactstep.update.second import SecondModel

PAD_EXAMPLE_ID = -1  # a padding micro-batch's rows (parallel.agreement)


def discriminator_update(cfg: ProfessorConfig) -> UpdateConfig:
    """The discriminator's own update settings (its optimizer, rate, schedule, clip)."""
    return UpdateConfig(optimizer=cfg.d_optimizer, lr=cfg.d_lr, schedule=cfg.d_schedule,
                        warmup=cfg.d_warmup, clip=cfg.d_clip, weight_decay=cfg.d_weight_decay,
                        momentum=0.0)


class ForcingModule(nn.Module):
    """The generator's objective on a two-path micro-batch (``UpdateEngine``'s train
    module): ``(S_m, NLL sum)`` with ``S_m`` the NLL terms of the teacher-forced rows
    (the plan's coefficients) plus each row's adversarial coefficient times its cost
    (free-running: ``softplus(-z)``, teacher-forced: ``softplus(z)``), ``z`` from the
    discriminator at the parameters the program froze for this step."""

    def __init__(self, model: nn.Module, objective_cfg: ObjectiveConfig, *, pad_id: int,
                 program: ProfessorForcing) -> None:
        super().__init__()
        self.model = model
        self.objective_cfg = objective_cfg
        self.pad_id = pad_id
        object.__setattr__(self, "program", program)  # not a submodule: not DDP's, not G's

    def forward(self, batch: Batch, coeff: torch.Tensor, rows_index: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(batch)  # [R, T, H]
        numerator, gold = microbatch_terms(hidden, self.model.head_weight, batch.labels, coeff,
                                           self.objective_cfg, pad_id=self.pad_id,
                                           rows_index=rows_index)
        rows: ForcingRows = batch.meta["professor"]
        return numerator + self.program.adversarial(hidden, rows), gold


class ProfessorForcing:
    """The family's ``WindowProgram``. ``examples``: the training split; ``width``: the
    generator's hidden size; ``total_windows``: the run's windows (the discriminator's
    schedule horizon is ``d_steps`` times that)."""

    def __init__(self, cfg: ProfessorConfig, generation: GenerationConfig, *, seed: int,
                 seq_len: int, examples: Sequence[Example], stop_ids: Sequence[int],
                 width: int, total_windows: int, device: torch.device | str = "cpu",
                 source_pad_id: int = 0, update: UpdateConfig | None = None) -> None:
        self.cfg, self.generation, self.seed, self.seq_len = cfg, generation, seed, seq_len
        self.examples = {e.example_id: e for e in examples}
        self.stop_ids = tuple(int(s) for s in stop_ids)
        self.source_pad_id = source_pad_id
        self.discriminator = Discriminator(width, cfg.d_hidden, seed=seed).to(device)
        self.second = SecondModel(self.discriminator,
                                  discriminator_update(cfg) if update is None else update,
                                  total_steps=total_windows * cfg.d_steps, name="discriminator")
        self._frozen: dict[str, torch.Tensor] | None = None
        self._skip: str | None = None
        self._info: dict | None = None
        self.records: list[dict] = []  # the last window's examples, for the journal

    # -- WindowProgram ------------------------------------------------------------------

    def train_module(self, model: nn.Module, objective_cfg: ObjectiveConfig, pad_id: int
                     ) -> ForcingModule:
        return ForcingModule(model, objective_cfg, pad_id=pad_id, program=self)

    def prepare(self, model: nn.Module, batches: Sequence[Batch], *, clock: int, window: int,
                device: torch.device, reducer: Any = None) -> tuple[list[Batch], dict]:
        del clock  # the procedure has no curriculum: the window's draws are addressed
        groups = [[self.request(eid) for eid in example_ids(b, m) if eid != PAD_EXAMPLE_ID]
                  for m, b in enumerate(batches)]
        out, free = [], []
        drawn = iter(self.rollouts(model, [r for group in groups for r in group], window,
                                   device))
        for m, group in enumerate(groups):
            conts = [next(drawn) for _ in group]
            free.append(conts)
            out.append(self.two_path_batch(group, conts, m))
        seqs, lengths, path = self.behaviours(model, out, device)
        self._skip, self._info = None, None
        self.second.begin()
        steps = []
        for i in range(self.cfg.d_steps):
            step = self.second.step(lambda: self.discriminator_loss(seqs, lengths, path),
                                    reducer if reducer is not None else _Local(),
                                    inject=(self.cfg.fail_window == window and i == 0))
            steps.append(step)
            if step["cause"] is not None:
                self._skip = step["cause"]
                break
        self._frozen = self.second.frozen(at_start=self.cfg.order == "simultaneous")
        self.records = self.window_records(window, groups, free, seqs, lengths, path)
        gather = getattr(reducer, "gather", None)
        if gather is not None and getattr(reducer, "world_size", 1) > 1:  # every rank's
            self.records = [r for part in gather(self.records) for r in part]
        n = len(self.records)
        info: dict = {"estimator": "professor_forcing", "examples": n,
                      "forced_tokens": sum(r["forced_tokens"] for r in self.records),
                      "free_tokens": sum(r["free_tokens"] for r in self.records),
                      "free_stopped": sum(r["free_stopped"] for r in self.records),
                      "discriminator": {"loss": [s["loss"] for s in steps],
                                        "grad_norm": [s["grad_norm"] for s in steps],
                                        "lr": [s["lr"] for s in steps],
                                        "accuracy": _accuracy(self.records)}}
        if self._skip is None and n:
            info["generator_adversarial"] = self.adversarial_value(seqs, lengths, path, reducer)
        self._info = info
        return out, info

    def skip_cause(self) -> str | None:
        """The discriminator's non-finite decision for this window (the same on every
        rank): the engine then skips the generator's step too (Q5, U3)."""
        return self._skip

    def close(self, disposition: Disposition) -> None:
        """Both updates or neither: the discriminator's steps commit with the window."""
        committed = disposition.outcome is Outcome.COMMITTED
        if committed:
            self.second.commit()
        else:
            self.second.rollback()
        if self._info is not None:
            self._info["discriminator"]["committed"] = committed
        self._frozen = None

    def state_dict(self) -> dict:
        return {"discriminator": self.second.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.second.load_state_dict(state["discriminator"])

    # -- the two paths ------------------------------------------------------------------

    def request(self, example_id: int) -> Request:
        example = self.examples.get(example_id)
        if example is None:
            raise DataError(f"professor: the window names example {example_id}, which is not "
                            "in the training split")
        prompt, reference = split_example(example, self.cfg.over)
        if not reference:
            raise DataError(f"professor: example {example_id} has no reference response to "
                            "teacher-force (one token long); drop it or use longer examples")
        longest = len(prompt) + max(len(reference), self.generation.max_new_tokens)
        if longest - 1 > self.seq_len:
            raise ConfigError(
                f"professor: example {example_id}'s paths can reach {longest} tokens (prompt "
                f"{len(prompt)}, reference {len(reference)}, generation.max_new_tokens "
                f"{self.generation.max_new_tokens}), beyond a row of batch.seq_len = "
                f"{self.seq_len} (+1); raise batch.seq_len or lower generation.max_new_tokens")
        source = getattr(example, "source", None)
        return Request(example_id, prompt, reference, (),
                       None if source is None else tuple(int(t) for t in source))

    def rollouts(self, model: nn.Module, requests: Sequence[Request], window: int,
                 device: torch.device) -> list[Continuation]:
        """Each request's free-running continuation (sample 0 of its address), the whole
        window in batches of ``generation.batch_rows`` rows (``sample_window``, Q1)."""
        groups = sample_window(model, [SampleRequest(r.example_id, r.prompt, r.source)
                                       for r in requests], self.generation, seed=self.seed,
                               window=window, stop_ids=self.stop_ids, device=device,
                               samples=1, source_pad_id=self.source_pad_id)
        return [group[0] for group in groups]

    def two_path_batch(self, group: Sequence[Request], conts: Sequence[Continuation],
                       microbatch: int) -> Batch:
        """Rows ``0..n-1`` teacher-forced, ``n..2n-1`` free-running, in example order;
        each padded to the longest row; ``meta["professor"]`` the steps and coefficients."""
        paths = [(r, r.reference, FORCED) for r in group] + \
            [(r, c.tokens, FREE) for r, c in zip(group, conts, strict=True)]
        base = response_batch([(r, resp, p, p == FORCED) for r, resp, p in paths],
                              self.source_pad_id)
        n_rows, T = base.input_ids.shape
        steps = torch.zeros((n_rows, T), dtype=torch.bool)
        coefficient = torch.zeros((n_rows, T), dtype=torch.float64)
        adversarial = torch.zeros(n_rows, dtype=torch.float64)
        path_ids = torch.tensor([p for _, _, p in paths], dtype=torch.int64)
        example = torch.tensor([r.example_id for r, _, _ in paths], dtype=torch.int64)
        half = len(group)
        for b, (r, resp, p) in enumerate(paths):
            first = len(r.prompt) - 1  # the column that predicts the response's first token
            compared = len(resp)
            if self.cfg.compare == "common":
                other = paths[b + half if p == FORCED else b - half][1]
                compared = min(compared, len(other))
            steps[b, first:first + compared] = True
            if p == FORCED:
                coefficient[b, first:first + len(resp)] = (
                    1.0 if self.cfg.nll == "sequence_sum" else 1.0 / len(resp))
                adversarial[b] = self.cfg.lambda_forced
            else:
                adversarial[b] = self.cfg.lambda_free
        rows = ForcingRows(path_ids, steps, coefficient, adversarial, example)
        return replace(base, meta={"professor": rows})

    @torch.no_grad()
    def behaviours(self, model: nn.Module, batches: Sequence[Batch], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row's behaviour at the window's parameters (eval mode, no gradients,
        every RNG stream untouched): ``(sequences [N2, L, H], lengths [N2], path [N2])``
        over the window's micro-batches, in row order."""
        seqs, lengths, paths = [], [], []
        with isolated(model):
            for b in batches:
                rows: ForcingRows = b.meta["professor"]
                if rows.path.numel() == 0:
                    continue
                hidden = model(b.to(device)).float()  # [R, T, H]
                s, n = behaviour(hidden, rows.steps)
                seqs.append(s)
                lengths.append(n)
                paths.append(rows.path)
        if not seqs:
            width = self.discriminator.project.in_features
            return (torch.zeros((0, 1, width), device=device), torch.zeros(0, dtype=torch.int64),
                    torch.zeros(0, dtype=torch.int64))
        longest = max(s.shape[1] for s in seqs)
        seqs = [F.pad(s, (0, 0, 0, longest - s.shape[1])) for s in seqs]
        return torch.cat(seqs), torch.cat(lengths), torch.cat(paths)

    # -- the two objectives -------------------------------------------------------------

    def discriminator_loss(self, seqs: torch.Tensor, lengths: torch.Tensor,
                           path: torch.Tensor) -> tuple[torch.Tensor, float]:
        """``(sum_tf softplus(-z) + sum_free softplus(z), examples)`` of this rank."""
        if path.numel() == 0:  # graph-connected zero: every rank joins the reduction
            return sum(p.sum() * 0.0 for p in self.discriminator.parameters()), 0.0
        z = self.discriminator(seqs, lengths)  # [N2]
        sign = torch.where(path.to(z.device) == FORCED, -1.0, 1.0)
        return F.softplus(sign * z).sum(), float(int((path == FORCED).sum()))

    def adversarial(self, hidden: torch.Tensor, rows: ForcingRows) -> torch.Tensor:
        """The generator's adversarial terms of one micro-batch, graph-connected to
        ``hidden`` only: ``sum_rows lambda_row * softplus(-+z)`` (free rows are pushed to
        look teacher-forced, teacher-forced rows, with ``lambda_forced``, free)."""
        if rows.path.numel() == 0 or not bool((rows.adversarial != 0).any()):
            return hidden.sum() * 0.0
        seqs, lengths = behaviour(hidden, rows.steps)
        with torch.autocast(hidden.device.type, enabled=False):
            z = functional_call(self.discriminator, self._frozen, (seqs.float(), lengths))
        sign = torch.where(rows.path.to(z.device) == FREE, -1.0, 1.0)
        weight = rows.adversarial.to(device=z.device, dtype=z.dtype)
        return (weight * F.softplus(sign * z)).sum()

    @torch.no_grad()
    def adversarial_value(self, seqs: torch.Tensor, lengths: torch.Tensor, path: torch.Tensor,
                          reducer: Any) -> float:
        """The generator's adversarial cost per example at the discriminator it steps
        against (the ledger's figure; the step itself recomputes it with gradients)."""
        z = functional_call(self.discriminator, self._frozen, (seqs, lengths)) \
            if path.numel() else torch.zeros(0)
        free = (path == FREE).to(z.device)
        coeff = torch.where(free, self.cfg.lambda_free, self.cfg.lambda_forced)
        sign = torch.where(free, -1.0, 1.0)
        totals = torch.tensor([float((coeff * F.softplus(sign * z)).sum()),
                               float(int((path == FORCED).sum()))], dtype=torch.float64)
        if reducer is not None and getattr(reducer, "world_size", 1) > 1:
            totals = reducer.sum(totals)
        s, n = totals.tolist()
        return s / n if n else 0.0

    # -- the journal --------------------------------------------------------------------

    @torch.no_grad()
    def window_records(self, window: int, groups: Sequence[Sequence[Request]],
                       free: Sequence[Sequence[Continuation]], seqs: torch.Tensor,
                       lengths: torch.Tensor, path: torch.Tensor) -> list[dict]:
        """One line per example: both paths' lengths, whether the free run stopped, and
        the discriminator's ``P(teacher-forced)`` of each path before its steps."""
        if not path.numel():
            return []
        weights = self.second.frozen(at_start=True)
        p = torch.sigmoid(functional_call(self.discriminator, weights, (seqs, lengths))).tolist()
        out, cursor = [], 0
        for group, conts in zip(groups, free, strict=True):
            half = len(group)
            for i, (r, c) in enumerate(zip(group, conts, strict=True)):
                out.append({"window": window, "example": r.example_id,
                            "forced_tokens": len(r.reference), "free_tokens": len(c.tokens),
                            "free_stopped": c.stopped,
                            "p_forced_of_forced": p[cursor + i],
                            "p_forced_of_free": p[cursor + half + i]})
            cursor += 2 * half
        return out


class _Local:
    world_size = 1


def _accuracy(records: Sequence[dict]) -> float | None:
    """The discriminator's accuracy on the window before its steps (both paths)."""
    if not records:
        return None
    right = sum((r["p_forced_of_forced"] > 0.5) + (r["p_forced_of_free"] <= 0.5)
                for r in records)
    return right / (2 * len(records))
