"""The window over the real decoder and the real objective stage (U1, U2, U7).

Host syncs are counted structurally: every Python-level call that reads a tensor
value into the host (``item``, ``tolist``, ``__bool__``, ``__int__``, ``__float__``,
``__index__``, ``cpu``, ``numpy``) made while the window runs is counted, except
reads of the host-side batch itself (the loader's CPU tensors: on an accelerator
they never leave the host) and reads inside the objective's ``plan_window``,
which by contract works on that host copy before anything reaches the device
(L3). U7 allows one per window.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from update.update_support import IGNORE_INDEX, make_batch

from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.objective import microbatch_terms, plan_window
from exactstep.objective.config import ObjectiveConfig
from exactstep.rows.batch import Batch
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

VOCAB = 13
PAD = 0
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


def tiny_decoder(seed: int = 0):
    cfg = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32, tie_embeddings=True)
    return build_model(cfg, VOCAB, seed=seed)


def real_engine(
    model=None, *, precision="fp32", engine_cls=UpdateEngine, **overrides
) -> UpdateEngine:
    model = model if model is not None else tiny_decoder()
    settings = {"schedule": "constant", "warmup": 0, "clip": 1.0, "weight_decay": 0.1}
    settings.update(overrides)
    cfg = UpdateConfig(**settings)
    optimizer, _ = build_optimizer(model, cfg)
    return engine_cls(
        model,
        optimizer,
        build_schedule(cfg, 10),
        Precision(NumericsConfig(precision=precision, init_scale=1024.0), "cpu"),
        cfg,
        ObjectiveConfig(chunk_rows=8),
        device="cpu",
        pad_id=PAD,
    )


def random_rows(gen: torch.Generator, rows: int, length: int, keep: float) -> Batch:
    ids = torch.randint(1, VOCAB, (rows, length), generator=gen)
    labels = torch.randint(1, VOCAB, (rows, length), generator=gen)
    mask = torch.rand(rows, length, generator=gen) < keep
    labels = torch.where(mask, labels, torch.full_like(labels, IGNORE_INDEX))
    return make_batch(ids.tolist(), labels.tolist())


def window_batches(seed: int = 0) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [
        random_rows(gen, 2, 12, 0.9),
        random_rows(gen, 1, 12, 0.3),
        random_rows(gen, 3, 12, 0.6),
    ]


class SyncCounter:
    """Counts host reads of tensor values while active (see module docstring)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.paused = 0
        self.calls: list[str] = []
        self.host_inputs: set[int] = set()
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            if not self.paused and id(tensor) not in self.host_inputs:
                self.count += 1
                self.calls.append(name)
            return original(tensor, *args, **kwargs)

        return counted

    def exempt_host_batches(self, batches: list[Batch]) -> None:
        self.host_inputs = {
            id(t) for b in batches for t in (b.input_ids, b.labels, b.position_ids, b.segment_ids)
        }

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def host_plan(counter: SyncCounter):
    def plan(batches, cfg, **kwargs):
        with counter.pause():
            return plan_window(batches, cfg, **kwargs)

    return plan


def syncs_per_window(engine: UpdateEngine, monkeypatch, windows: int = 3) -> list[int]:
    counter = SyncCounter(monkeypatch)
    engine.plan = host_plan(counter)
    counts = []
    for w in range(windows):
        batches = window_batches(seed=w)
        counter.exempt_host_batches(batches)
        counter.count = 0
        disposition = engine.run_window(batches, w)
        assert disposition.outcome is Outcome.COMMITTED
        counts.append(counter.count)
    monkeypatch.undo()
    return counts


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_at_most_one_host_sync_per_window_u7(monkeypatch, precision):
    engine = real_engine(precision=precision, accum=3)
    assert max(syncs_per_window(engine, monkeypatch)) <= 1


def test_per_microbatch_loss_logging_is_caught_u7(monkeypatch):
    """Negative control: reading each microbatch's loss (a classic) breaks U7."""
    engine = real_engine(accum=3)

    def logging_terms(*args, **kwargs):
        numerator, gold = microbatch_terms(*args, **kwargs)
        numerator.detach().item()  # WRONG: one sync per microbatch
        return numerator, gold

    engine.train_module.terms = logging_terms
    assert max(syncs_per_window(engine, monkeypatch)) > 1


def test_sync_counter_sees_python_level_reads(monkeypatch):
    counter = SyncCounter(monkeypatch)
    t = torch.ones(2)
    t.sum().item()
    bool(t.all())
    t.tolist()
    assert counter.count == 3


# ----------------------------------------------------------------------------- U1 on the real stack


def concat_rows(batches: list[Batch]) -> Batch:
    return make_batch(
        [r for b in batches for r in b.input_ids.tolist()],
        [r for b in batches for r in b.labels.tolist()],
    )


def one_update(batches: list[Batch], *, mean_of_means: bool = False) -> list[torch.Tensor]:
    engine = real_engine(
        tiny_decoder(seed=4),
        optimizer="sgd",
        lr=1.0,
        momentum=0.0,
        clip=0.0,
        weight_decay=0.0,
        accum=len(batches),
    )
    if mean_of_means:

        def wrong_plan(bs, cfg):  # each microbatch's own mean, divided by K
            plan = plan_window(bs, cfg)
            k = len(bs)
            coeffs = [c / max(1.0, float(c.sum())) / k for c in plan.coefficients]
            return type(plan)(
                coeffs, 1.0, plan.tokens, [1.0] * k, plan.row_indices, plan.microbatch_tokens
            )

        engine.plan = wrong_plan
    assert engine.run_window(batches, 0).outcome is Outcome.COMMITTED
    return [p.detach().clone() for p in engine.parameters]


def matches_big_batch(*, mean_of_means: bool) -> bool:
    batches = window_batches(seed=9)
    split = one_update(batches, mean_of_means=mean_of_means)
    whole = one_update([concat_rows(batches)])
    # U1's fp32 1e-5: SGD (lr 1) moves each parameter by its gradient, whose split and whole
    # forms differ in summation order only (~1e-7 on these O(1) tiny models), two orders below
    return max(float((a - b).abs().max()) for a, b in zip(split, whole, strict=True)) <= 1e-5


def test_real_decoder_accumulation_equals_big_batch_u1():
    assert matches_big_batch(mean_of_means=False)


def test_real_decoder_mean_of_means_is_caught_u1():
    assert not matches_big_batch(mean_of_means=True)


def test_bf16_and_fp16_windows_commit_finite_u2():
    for precision in ("bf16", "fp16"):
        engine = real_engine(precision=precision, accum=3)
        d = engine.run_window(window_batches(seed=1), 0)
        assert d.outcome is Outcome.COMMITTED, precision
        assert all(p.dtype == torch.float32 for p in engine.parameters)  # fp32 master weights


# ----------------------------------------------------------------------------- reducer seam (D1, D2)


class IdenticalPeerReducer:
    """Two ranks where the other rank holds exactly the same data: every sum doubles.

    Without DDP wrapping no gradient averaging happens, and with an identical peer
    DDP's average would change nothing, so the update must equal one process's.
    """

    world_size = 2

    def sum(self, values):
        return values * 2

    def no_sync(self, module, is_last):
        return contextlib.nullcontext()


class PeerWithDataReducer(IdenticalPeerReducer):
    """This rank's share is empty; the peer has ``peer_denominator`` supervised rows."""

    def __init__(self, peer_denominator: float):
        self.peer = peer_denominator

    def sum(self, values):
        if values.dtype == torch.float64:  # the host-side [D, tokens, signal] of the plan
            return values + torch.tensor([self.peer] * 3, dtype=torch.float64)
        return values  # flags and reports: the peer is finite and reports nothing here


class ForgetsWorldSizeEngine(UpdateEngine):
    """WRONG (D1): scales by ``1 / D_global``, forgetting the ``R`` that undoes DDP's mean."""

    def _loss_scale(self, denominator: float) -> float:
        return 1.0 / denominator


def update_with_reducer(reducer, engine_cls=UpdateEngine):
    engine = real_engine(
        tiny_decoder(seed=5),
        accum=3,
        optimizer="sgd",
        lr=1.0,
        momentum=0.0,
        clip=0.0,
        weight_decay=0.0,
        engine_cls=engine_cls,
    )
    if reducer is not None:
        engine.reducer = reducer
    d = engine.run_window(window_batches(seed=3), 0)
    return [p.detach() for p in engine.parameters], d


def same_update_as_alone(reducer, engine_cls=UpdateEngine) -> bool:
    alone, a = update_with_reducer(None)
    paired, b = update_with_reducer(reducer, engine_cls)
    # an identical peer doubles the sums and the world size halves them, both exact
    # (powers of two): only a wrong factor moves anything, by 2x (1e-6 is slack, not rounding)
    return b.loss == pytest.approx(a.loss, rel=1e-6) and all(
        torch.allclose(x, y, rtol=0, atol=1e-6) for x, y in zip(alone, paired, strict=True)
    )


def test_identical_peer_gives_the_single_process_update_d1():
    assert same_update_as_alone(IdenticalPeerReducer())


def test_forgetting_the_world_size_factor_is_caught_d1():
    assert not same_update_as_alone(IdenticalPeerReducer(), ForgetsWorldSizeEngine)


def test_locally_empty_rank_runs_a_zero_pass_and_commits_with_its_peer_d1():
    empty = [make_batch([[1, 2, 3, 4]], [[IGNORE_INDEX] * 4])] * 2
    engine = real_engine(accum=2, weight_decay=0.0)
    engine.reducer = PeerWithDataReducer(peer_denominator=7.0)
    grads_seen = []
    engine.optimizer.register_step_pre_hook(
        lambda opt, *a: grads_seen.extend(p.grad for p in engine.parameters)
    )
    d = engine.run_window(empty, 0)
    assert d.outcome is Outcome.COMMITTED and d.denominator == 7.0
    assert grads_seen and all(g is not None and not g.any() for g in grads_seen)
    # alone, the same window has no objective at all (L4)
    assert real_engine(accum=2).run_window(empty, 0).outcome is Outcome.NO_OBJECTIVE
