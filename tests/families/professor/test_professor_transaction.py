"""Q5, U3, U4: the generator's and the discriminator's updates are one transaction.

- A non-finite discriminator (``professor.fail_window``) skips the window for both: the
  generator, the discriminator, both optimizers' states and both clocks bitwise as before,
  one disposition naming the discriminator.
- A non-finite generator (``update.fail_window``) after the discriminator already stepped
  (``d_then_g``, AdamW): the discriminator is restored bit for bit, parameters, moments
  and clock. Negative control: a program that keeps the discriminator's steps of a
  skipped window is caught by the same comparison.
- Clocks advance on commit only: the discriminator's learning rate per step follows its
  schedule on its committed steps, across a window skipped before its first
  discriminator step and one skipped after three tentative ones (a clock advanced per
  tentative step shows there).
- The discriminator's parameters, optimizer state and clock are in the engine's state:
  a window after restoring them is bitwise the window of the run that never stopped.
  Negative control: restoring everything but the program's state differs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from forcing_support import Setup, generator_update, professor

from exactstep.families.professor.forcing import ProfessorForcing
from exactstep.state.compare import state_differences
from exactstep.update.disposition import Outcome

WINDOW = [[0, 1, 2], [3, 4, 5]]
ADAM = dict(d_optimizer="adamw", d_lr=1e-2, d_clip=1.0)


def snapshot(setup: Setup) -> dict:
    """Everything either model's update may touch, copied."""
    return {"generator": setup.generator(), "discriminator": setup.discriminator(),
            "engine": _copy(setup.engine.state_dict())}


def _copy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_copy(v) for v in x)
    return x


def test_a_nonfinite_discriminator_skips_both_updates():
    setup = Setup(professor(fail_window=1, **ADAM))
    assert setup.window(WINDOW, 0).outcome is Outcome.COMMITTED
    before = snapshot(setup)
    disposition = setup.window(WINDOW, 1)
    assert disposition.outcome is Outcome.SKIPPED_NONFINITE
    assert disposition.cause == "DISCRIMINATOR_INJECTED_FAULT"
    assert disposition.ledger_record()["inputs"]["discriminator"]["committed"] is False
    after = snapshot(setup)
    differences = state_differences(before, after)
    assert sorted(differences) == ["engine.counters.microbatches", "engine.counters.skipped"]
    assert setup.window(WINDOW, 2).outcome is Outcome.COMMITTED  # and the run goes on


class KeepsSkippedSteps(ProfessorForcing):
    """Planted: a skipped window's discriminator steps are kept."""

    def close(self, disposition):
        self.second.commit()


@pytest.mark.parametrize("program_cls, kept", [(ProfessorForcing, False),
                                               (KeepsSkippedSteps, True)])
def test_a_nonfinite_generator_restores_the_stepped_discriminator(program_cls, kept):
    setup = Setup(professor(**ADAM), program_cls=program_cls,
                  update=generator_update(fail_window=1))
    assert setup.window(WINDOW, 0).outcome is Outcome.COMMITTED
    before = snapshot(setup)
    disposition = setup.window(WINDOW, 1)
    assert disposition.outcome is Outcome.SKIPPED_NONFINITE
    assert disposition.cause == "INJECTED_FAULT"  # the generator's cause, its own name
    assert disposition.ledger_record()["inputs"]["discriminator"]["lr"] == [1e-2, 1e-2]
    differences = state_differences(before, snapshot(setup))
    touched = [d for d in differences if d.startswith(("discriminator", "engine.program"))]
    assert not any(d.startswith("generator") for d in differences)
    assert bool(touched) is kept, touched


@pytest.mark.parametrize("fault", ["discriminator", "generator"])
def test_the_discriminator_clock_advances_on_committed_steps_only(fault):
    """Window 1 is skipped: by the discriminator's own first step (nothing stepped) or
    by the generator after the discriminator's three tentative steps (``d_then_g``),
    which the skip rolls back. Either way window 2 steps at the clock of window 1's
    start (3..5), and the clock counts the committed steps only (6)."""
    if fault == "discriminator":
        cfg = professor(d_steps=3, d_schedule="cosine", d_warmup=2, fail_window=1, **ADAM)
        setup = Setup(cfg, windows=4)
    else:
        cfg = professor(d_steps=3, d_schedule="cosine", d_warmup=2, **ADAM)
        setup = Setup(cfg, windows=4, update=generator_update(fail_window=1))
    schedule = setup.program.second.schedule
    dispositions = [setup.window(WINDOW, w) for w in range(3)]
    assert [d.outcome for d in dispositions] == [Outcome.COMMITTED, Outcome.SKIPPED_NONFINITE,
                                                 Outcome.COMMITTED]
    lrs = [d.ledger_record()["inputs"]["discriminator"]["lr"] for d in dispositions]
    assert lrs[0] == [schedule.lr_at(c) for c in range(3)]
    if fault == "discriminator":
        assert lrs[1] == [None]  # the injected step: nothing stepped, the window skipped
    else:  # three tentative steps, at the committed clock, then rolled back
        assert lrs[1] == [schedule.lr_at(c) for c in range(3, 6)]
    assert lrs[2] == [schedule.lr_at(c) for c in range(3, 6)]  # not 6..8: no skipped clock
    assert schedule.state_dict()["updates"] == setup.program.second.committed == 6
    assert lrs[2] != [schedule.lr_at(c) for c in range(6, 9)]  # the control: a decaying
    # schedule tells a clock that counted the skipped window's steps apart


@pytest.mark.parametrize("restore_program", [True, False])
def test_a_window_after_restoring_the_engine_state_is_bitwise_the_same(restore_program):
    cfg = professor(**ADAM)
    straight = Setup(cfg)
    straight.window(WINDOW, 0)
    saved = _copy(straight.engine.state_dict())
    weights = _copy(straight.model.state_dict())
    straight.window(WINDOW, 1)

    resumed = Setup(cfg)
    resumed.model.load_state_dict(weights)
    state = saved if restore_program else {k: v for k, v in saved.items() if k != "program"}
    if restore_program:
        resumed.engine.load_state_dict(state)
    else:
        resumed.engine.optimizer.load_state_dict(state["optimizer"])
        resumed.engine.schedule.load_state_dict(state["schedule"])
    resumed.window(WINDOW, 1)
    differences = state_differences(snapshot(straight), snapshot(resumed))
    if restore_program:
        assert differences == []
    else:
        assert any(d.startswith("discriminator") for d in differences)


def test_the_discriminator_state_is_checkpointed_whole():
    setup = Setup(professor(**ADAM))
    setup.window(WINDOW, 0)
    state = setup.engine.state_dict()["program"]["discriminator"]
    assert set(state) == {"weights", "optimizer", "schedule", "committed"}
    assert state["committed"] == 2 and state["schedule"]["updates"] == 2
    moments = state["optimizer"]["state"][0]
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(moments)
    assert float(moments["step"]) == 2.0
    assert set(state["weights"]) == set(dict(setup.program.discriminator.named_parameters()))


def test_an_idle_adversary_trains_the_teacher_forced_likelihood_alone():
    """With both coefficients 0 the generator's update is the sequence-summed NLL's
    alone: the discriminator's steps change nothing of it (compared with a run whose
    discriminator learns ten times faster)."""
    slow = Setup(professor(lambda_free=0.0, lambda_forced=0.0, **ADAM))
    fast = Setup(replace(professor(lambda_free=0.0, lambda_forced=0.0, **ADAM), d_lr=0.1))
    slow.window(WINDOW, 0)
    fast.window(WINDOW, 0)
    assert state_differences(slow.generator(), fast.generator()) == []
    assert state_differences(slow.discriminator(), fast.discriminator()) != []
