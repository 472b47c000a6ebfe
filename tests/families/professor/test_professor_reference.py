"""Q5, L3: one Professor Forcing window's two updates are the reference's.

The engine's window (``families.professor.forcing`` under ``UpdateEngine``: both paths padded
into two-path micro-batches, the packed GRU, the family's plan, fused SGD) against
``families.professor.reference`` (each example alone, the GRU written out from its
equations, plain SGD), in float64. Tolerance, per model: twice the larger of the
reference's own fp32 distance from its float64 self and ``u max|p|``, the largest over
the model's tensors (``equivalence.contract_tolerance``): derived from the window,
never observed here.

Orders: ``d_then_g`` with two discriminator steps (the generator against the stepped
discriminator) and ``simultaneous`` (against the window's start); both ``compare``
modes; the window as one micro-batch and as two (accumulation, L3).

Negative controls, each a planted variant of the program whose disagreement with the
reference is far outside the tolerance:
- the discriminator steps after the generator and sees its new weights;
- the generator steps against the discriminator of the other order;
- the discriminator's behaviour keeps its graph, so its loss reaches the generator's
  gradient (a leak between the two steps).
"""

from __future__ import annotations

import pytest
import torch
from equivalence import contract_tolerance
from forcing_support import Setup, professor, reference_updates, with_order

from exactstep.families.professor.discriminator import behaviour
from exactstep.families.professor.forcing import ProfessorForcing
from exactstep.rows.batch import Batch
from exactstep.update.disposition import Outcome

IDS = range(6)
SPLITS = {"one": [[0, 1, 2, 3, 4, 5]], "two": [[0, 1, 2], [3, 4, 5]]}


def run(cfg, split="two", program_cls=ProfessorForcing):
    setup = Setup(cfg, program_cls=program_cls)
    g, d = setup.generator(), setup.discriminator()
    disposition = setup.window(SPLITS[split])
    assert disposition.outcome is Outcome.COMMITTED, disposition
    return setup, g, d


def worst(engine: dict, want: dict, fp32: dict) -> tuple[float, str]:
    """The largest ``|engine - reference| / tolerance`` over tensors, and where."""
    tol = contract_tolerance(0.0, [fp32[n] for n in want], list(want.values()))
    ratios = {name: float((engine[name].double() - ref).abs().max()) / tol
              for name, ref in want.items()}
    name = max(ratios, key=ratios.get)
    return ratios[name], name


def agreement(setup: Setup, g, d, cfg=None) -> tuple[float, float]:
    g64, d64 = reference_updates(setup, g, d, IDS, torch.float64, cfg)
    g32, d32 = reference_updates(setup, g, d, IDS, torch.float32, cfg)
    return (worst(setup.generator(), g64, g32)[0], worst(setup.discriminator(), d64, d32)[0])


@pytest.mark.parametrize("order", ["d_then_g", "simultaneous"])
@pytest.mark.parametrize("compare", ["response", "common"])
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_one_window_is_the_float64_reference(order, compare, split):
    cfg = with_order(professor(compare=compare), order)
    setup, g, d = run(cfg, split)
    g_ratio, d_ratio = agreement(setup, g, d)
    assert g_ratio <= 1.0 and d_ratio <= 1.0, (g_ratio, d_ratio)
    # both models moved: the check is not of an idle window
    assert any(not torch.equal(a, b) for a, b in zip(g.values(), setup.generator().values(), strict=True))
    assert any(not torch.equal(a, b) for a, b in
               zip(d.values(), setup.discriminator().values(), strict=True))


def test_the_reference_tells_the_two_orders_apart():
    """Negative control: the generator stepped against the discriminator of the other
    order is caught (and the discriminator's own update, the same in both, is not)."""
    cfg = professor()
    setup, g, d = run(cfg)
    g_ratio, d_ratio = agreement(setup, g, d, with_order(cfg, "simultaneous"))
    assert g_ratio > 100 and d_ratio > 100  # d_steps differ too: 2 steps against 1
    setup, g, d = run(with_order(cfg, "simultaneous"))
    g_ratio, d_ratio = agreement(setup, g, d, cfg)
    assert g_ratio > 100


class SeesNewGenerator(ProfessorForcing):
    """Planted: the discriminator steps after the generator's step, on behaviour of the
    generator's new weights (the order the family forbids)."""

    def prepare(self, model, batches, **kw):
        self._model, self._window_batches = model, None
        out, info = super().prepare(model, batches, **kw)
        self._window_batches = out
        self.second.rollback()  # undo the steps taken on the window's start
        self.second.begin()
        return out, info

    def close(self, disposition):
        seqs, lengths, path = self.behaviours(self._model, self._window_batches, "cpu")
        for _ in range(self.cfg.d_steps):
            self.second.step(lambda: self.discriminator_loss(seqs, lengths, path),
                             type("L", (), {"world_size": 1})())
        super().close(disposition)


class LeakyBehaviour(ProfessorForcing):
    """Planted: the discriminator's behaviour is computed with gradients on, so its loss's
    backward reaches the generator's parameters before the generator's own step."""

    def behaviours(self, model, batches: list[Batch], device):
        seqs, lengths, paths = [], [], []
        for b in batches:
            rows = b.meta["professor"]
            s, n = behaviour(model(b).float(), rows.steps)
            seqs.append(s[:, :max(int(x) for x in n)])
            lengths.append(n)
            paths.append(rows.path)
        longest = max(s.shape[1] for s in seqs)
        seqs = [torch.nn.functional.pad(s, (0, 0, 0, longest - s.shape[1])) for s in seqs]
        return torch.cat(seqs), torch.cat(lengths), torch.cat(paths)

    def window_records(self, *args):
        with torch.no_grad():
            return super().window_records(*args)

    def adversarial_value(self, seqs, *args):
        return super().adversarial_value(seqs.detach(), *args)


def test_a_discriminator_that_sees_the_new_generator_is_caught():
    setup, g, d = run(professor(d_steps=1), program_cls=SeesNewGenerator)
    g_ratio, d_ratio = agreement(setup, g, d)
    assert g_ratio > 100  # the generator stepped against the unstepped discriminator
    assert d_ratio > 100  # the discriminator read the generator's new behaviour


def test_a_discriminator_loss_leaking_into_the_generator_is_caught():
    cfg = professor(d_steps=1)
    setup, g, d = run(cfg, program_cls=LeakyBehaviour)
    g_ratio, d_ratio = agreement(setup, g, d)
    assert d_ratio <= 1.0  # the discriminator's own step is right
    assert g_ratio > 100  # the generator's update holds the discriminator's gradient


class LiveDiscriminator(ProfessorForcing):
    """Planted: the generator's step reads the discriminator's live parameters."""

    def prepare(self, model, batches, **kw):
        out, info = super().prepare(model, batches, **kw)
        self._frozen = dict(self.discriminator.named_parameters())
        return out, info


def backward_passes_into_discriminator(program_cls) -> int:
    setup = Setup(professor(), program_cls=program_cls)
    params = list(setup.program.discriminator.parameters())
    seen = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.shape))
    setup.window(SPLITS["two"])
    return len(seen) // len(params)


def test_no_gradient_of_the_generator_step_reaches_the_discriminator():
    """Gradients reach the discriminator's parameters only in its own d_steps = 2
    backward passes, never in the generator's two micro-batches' (the step reads them
    detached). Negative control: a step reading the live parameters adds two passes."""
    assert backward_passes_into_discriminator(ProfessorForcing) == 2
    assert backward_passes_into_discriminator(LiveDiscriminator) == 4
