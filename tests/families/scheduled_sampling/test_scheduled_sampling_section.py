"""The run's ``[scheduled_sampling]`` section is the schedule its inputs are mixed on
(R8, S1, U4).

Through the real entry points, with every setting away from its default:

* ``exactstep train`` with ``schedule = "linear"``, ``slope = 0.2``, ``floor = 0.35``
  (default: inverse sigmoid, ``k = 100``): each ledger line records the gold-input
  probability ``min(1, max(0.35, 1 - 0.2 c))`` exactly, ``c`` the windows committed
  before it, and the model inputs of all windows together are within 5 standard
  deviations of their binomial mean ``sum_w e_w (1 - eps_w)`` (variance ``sum_w e_w
  eps_w (1 - eps_w)``), ``e_w`` the eligible inputs of window ``w`` counted here from
  the run's own stream (a column whose input is the previous column's gold target).
* ``open_family`` and the family's input program (what the runner hands the engine):
  ``constant`` at ``probability = 0.3``, ``exponential`` at ``base = 0.9`` and
  ``inverse_sigmoid`` at ``k = 5`` give their closed forms at several clocks, and at
  0.3 the inputs replaced over several batches are within 5 sigma of Binomial(e, 0.7).
* ``over = "encdec"``: the family's model is the encoder-decoder, its data pairs.

The manifest records the configured section. Negative controls: the glue planted so
that its input program gets ``ScheduledSamplingConfig()`` (the defaults) instead of
``cfg.scheduled_sampling``, or picks its base family from the defaults; the same
checks then report violations while the manifest still records the configured values.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import replace

import pytest
from run_support import TINY, ledger, set_args
from text_corpus import write_corpus

import exactstep.families.scheduled_sampling.family as ss_family
from exactstep.cli import main
from exactstep.config import load_config
from exactstep.families import open_family, resolve
from exactstep.families.scheduled_sampling.config import ScheduledSamplingConfig
from exactstep.families.scheduled_sampling.inputs import ScheduledSampling
from exactstep.rows.stream import RowStream

IGNORE_INDEX = -100
SIGMAS = 5.0  # a count outside 5 sigma of its binomial: probability below 1e-6
LINEAR = {"scheduled_sampling.schedule": "linear", "scheduled_sampling.slope": 0.2,
          "scheduled_sampling.floor": 0.35}
WINDOWS = 6
RUN = {"objective.family": "scheduled_sampling", **TINY, "data.val_fraction": 0.2,
       "train.steps": WINDOWS, "train.threads": 1, "train.eval_tokens": 64,
       "checkpoint.every": 0, "update.warmup": 1, **LINEAR}


def linear_eps(committed: int) -> float:
    return min(1.0, max(0.35, 1.0 - 0.2 * committed))


def eligible(batch) -> int:
    """Columns whose input is the previous column's gold target, in the same segment."""
    ids, labels, segs = batch.input_ids, batch.labels, batch.segment_ids
    same = (segs[:, 1:] == segs[:, :-1]) & (segs[:, 1:] > 0)
    return int((same & (labels[:, :-1] != IGNORE_INDEX) & (labels[:, :-1] == ids[:, 1:])).sum())


def binomial_outside(count: int, trials: list[tuple[int, float]]) -> bool:
    """``count`` outside 5 sigma of a sum of Binomial(e, 1 - eps) over ``trials``."""
    mean = sum(e * (1 - eps) for e, eps in trials)
    sd = math.sqrt(sum(e * eps * (1 - eps) for e, eps in trials))
    return abs(count - mean) > SIGMAS * sd


def stream_batches(cfg, n: int) -> list:
    """The run's first ``n`` training batches, as the runner builds its stream."""
    parts = open_family(cfg)
    stream = RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id,
                       seed=cfg.seed, vocab_size=parts.tokenizer.vocab_size,
                       compiler=parts.compiler)
    return [stream.next_batch() for _ in range(n)]


def trained(tmp_path, name: str) -> tuple[list[dict], list]:
    """A real ``exactstep train`` run: its window records, and the batches its stream
    held (rebuilt from the same configuration: the stream is fixed by it, S5)."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    settings = {**RUN, "data.source": corpus}
    out = tmp_path / name
    assert main(["train", "--out", str(out), "--no-progress", *set_args(settings)]) == 0
    records = [r for r in ledger(out) if "window" in r]
    manifest = json.loads((out / "manifest.json").read_text())["manifest"]
    assert manifest["objective"]["inputs"]["schedule"] == "linear"  # what the run says
    assert manifest["objective"]["inputs"]["floor"] == 0.35
    cfg = resolve(load_config(None, [f"{k}={v}" for k, v in settings.items()]))
    return records, stream_batches(cfg, WINDOWS)


def ledger_violations(records: list[dict], batches: list) -> list[str]:
    found, committed, trials = [], 0, []
    assert len(records) == WINDOWS == len(batches)
    for record, batch in zip(records, batches, strict=True):
        eps = record["inputs"]["gold_probability"]
        if eps != linear_eps(committed):
            found.append(f"window {record['window']}: gold probability {eps}, the linear "
                         f"schedule gives {linear_eps(committed)} after {committed} commits")
        trials.append((eligible(batch), linear_eps(committed)))
        committed += record["disposition"] == "COMMITTED"
    model_inputs = sum(r["inputs"]["model_inputs"] for r in records)
    if binomial_outside(model_inputs, trials):
        found.append(f"{model_inputs} model inputs over {sum(e for e, _ in trials)} eligible")
    return found


def plant_program_defaults(monkeypatch) -> None:
    """The planted defect: the input program built from the section's defaults."""
    monkeypatch.setattr(ss_family, "ScheduledSampling",
                        lambda section, *, seed: ScheduledSampling(ScheduledSamplingConfig(),
                                                                   seed=seed))


def test_a_trained_run_mixes_its_inputs_on_the_configured_schedule(tmp_path, monkeypatch):
    records, batches = trained(tmp_path, "configured")
    assert [r["disposition"] for r in records] == ["COMMITTED"] * WINDOWS
    assert ledger_violations(records, batches) == []
    assert sum(r["inputs"]["model_inputs"] for r in records) > 100  # the check has power

    plant_program_defaults(monkeypatch)  # negative control
    records, batches = trained(tmp_path, "defaults")
    found = ledger_violations(records, batches)
    assert len([v for v in found if "gold probability" in v]) == WINDOWS, found
    assert any("model inputs" in v for v in found)


# ---------------------------------------------------------------- the program, schedule by schedule

SCHEDULES = {
    "constant": ({"scheduled_sampling.probability": 0.3}, lambda c: 0.3),
    "exponential": ({"scheduled_sampling.base": 0.9}, lambda c: 0.9 ** c),
    "inverse_sigmoid": ({"scheduled_sampling.k": 5.0}, lambda c: 5.0 / (5.0 + math.exp(c / 5.0))),
}
GLUE = {"objective.family": "scheduled_sampling", **TINY, "batch.rows": 4}


def program_violations(tmp_path, schedule: str) -> list[str]:
    """The family's input program for ``schedule`` (as the runner gets it from
    ``open_family``'s family) at clocks 0, 3, 10 on the run's batches: its gold
    probability against the closed form; for ``constant`` also the replaced inputs."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    setting, closed_form = SCHEDULES[schedule]
    overrides = {**GLUE, "data.source": corpus, "scheduled_sampling.schedule": schedule,
                 **setting}
    cfg = resolve(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))
    parts = open_family(cfg)
    program = parts.family.inputs(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    found, replaced, trials = [], 0, []
    for window, batch in enumerate(stream_batches(cfg, 3)):
        for clock in (0, 3, 10):
            _, info = program.construct(model, batch, batch, clock=clock, window=window,
                                        autocast=contextlib.nullcontext)
            if info["gold_probability"] != closed_form(clock):
                found.append(f"{schedule} at clock {clock}: {info['gold_probability']}, "
                             f"not {closed_form(clock)}")
            replaced += info["model_inputs"]
            trials.append((eligible(batch), closed_form(clock)))
    if schedule == "constant" and binomial_outside(replaced, trials):
        found.append(f"{replaced} of {sum(e for e, _ in trials)} eligible inputs replaced")
    return found


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_input_program_is_the_configured_schedule(tmp_path, monkeypatch, schedule):
    assert program_violations(tmp_path, schedule) == []
    plant_program_defaults(monkeypatch)  # negative control
    found = program_violations(tmp_path, schedule)
    assert len([v for v in found if " at clock " in v]) == 9, found
    if schedule == "constant":
        assert any("inputs replaced" in v for v in found)


def test_the_base_family_is_the_configured_one(monkeypatch):
    """``over = "encdec"``: the encoder-decoder on pairs. Negative control: the base
    picked from the defaults (``over = "causal"``) is the decoder on text."""
    def base(cfg) -> tuple[str, str]:
        cfg = resolve(cfg)
        family = open_family(cfg).family
        return family.model, family.data_kind

    cfg = load_config(None, ["objective.family=scheduled_sampling",
                             "scheduled_sampling.over=encdec", "encdec.n_train=20",
                             "encdec.n_heldout=4"])
    assert base(cfg) == ("encdec", "pairs")
    family = ss_family.FAMILY
    monkeypatch.setattr(ss_family, "FAMILY", lambda cfg: family(
        replace(cfg, scheduled_sampling=ScheduledSamplingConfig())))
    assert base(cfg) == ("decoder", "text")
