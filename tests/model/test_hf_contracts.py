"""Existing contracts re-run with a Hugging Face Llama as the model (H1).

* U1: a window of K packed microbatches gives the update of one batch of the same
  rows (fp32, 1e-5) through the real engine, plan and fused loss; negative
  control: the mean of microbatch means.
* U7: one host read of a device value per window, HF forward included; negative
  control: HF's own document inference (mask withheld) reads in every forward.
* L5 / E1: ``evaluate`` reports the global mean of the gold NLL of every held-out
  document, computed independently with HF's own forward of each document alone,
  and leaves parameters, gradients, every module's mode, every RNG stream and the
  engine (optimizer, schedule, scaler, counters) bitwise unchanged; negative
  controls: an evaluation that leaves the model in eval mode or nudges a weight.
* E1 end to end: ``train()`` with and without mid-run evaluation ends bitwise
  equal, with the HF forward made stochastic; negative control: the same with
  evaluation's RNG isolation disabled.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hf_support import FAMILIES, hf_model  # noqa: E402
from model_batches import fill_rows, packed_batch  # noqa: E402
from run_support import changes, check_mid_run_evaluation_changes_nothing  # noqa: E402

from exactstep.config import load_config  # noqa: E402
from exactstep.eval import evaluate  # noqa: E402
from exactstep.model.hf import HFCausalLM  # noqa: E402
from exactstep.objective import plan_window  # noqa: E402
from exactstep.objective.config import ObjectiveConfig  # noqa: E402
from exactstep.state import latest_checkpoint, load_checkpoint  # noqa: E402
from exactstep.update.config import NumericsConfig, UpdateConfig  # noqa: E402
from exactstep.update.disposition import Outcome  # noqa: E402
from exactstep.update.groups import build_optimizer  # noqa: E402
from exactstep.update.precision import Precision  # noqa: E402
from exactstep.update.schedule import build_schedule  # noqa: E402
from exactstep.update.window import UpdateEngine  # noqa: E402

VOCAB = 64
PAD = 0
SEQ_LEN = 16
MICROBATCHES = [[[5, 9], [12, 3]], [[16]], [[2, 2, 7], [4], [1, 6, 6]]]  # docs per row


def engine_for(model, *, precision="fp32", **overrides) -> UpdateEngine:
    settings = {"schedule": "constant", "warmup": 0, "clip": 1.0, "weight_decay": 0.1}
    settings.update(overrides)
    cfg = UpdateConfig(**settings)
    optimizer, _ = build_optimizer(model, cfg)
    return UpdateEngine(model, optimizer, build_schedule(cfg, 10),
                        Precision(NumericsConfig(precision=precision, init_scale=1024.0), "cpu"),
                        cfg, ObjectiveConfig(chunk_rows=8), device="cpu", pad_id=PAD)


# ----------------------------------------------------------------------------- U1


def window_rows() -> list[list[list[list[int]]]]:
    return [fill_rows(rows, VOCAB, seed=m) for m, rows in enumerate(MICROBATCHES)]


def one_update(batches, *, mean_of_means: bool = False) -> list[torch.Tensor]:
    engine = engine_for(hf_model("llama", VOCAB, seed=4), optimizer="sgd", lr=1.0,
                        momentum=0.0, clip=0.0, weight_decay=0.0, accum=len(batches))
    if mean_of_means:
        def wrong_plan(bs, cfg):  # each microbatch's own mean, divided by K
            plan = plan_window(bs, cfg)
            k = len(bs)
            coeffs = [c / max(1.0, float(c.sum())) / k for c in plan.coefficients]
            return type(plan)(coeffs, 1.0, plan.tokens, [1.0] * k, plan.row_indices,
                              plan.microbatch_tokens)

        engine.plan = wrong_plan
    assert engine.run_window(batches, 0).outcome is Outcome.COMMITTED
    return [p.detach().clone() for p in engine.parameters]


def matches_one_batch(*, mean_of_means: bool) -> bool:
    rows = window_rows()
    split = one_update([packed_batch(r, SEQ_LEN) for r in rows], mean_of_means=mean_of_means)
    whole = one_update([packed_batch([row for r in rows for row in r], SEQ_LEN)])
    # U1's fp32 1e-5: SGD (lr 1) moves each parameter by its gradient, whose split and whole
    # forms differ in summation order only (~1e-7 on these O(1) tiny models), two orders below
    return max(float((a - b).abs().max()) for a, b in zip(split, whole, strict=True)) <= 1e-5


def test_hf_llama_window_of_k_microbatches_equals_one_batch_u1():
    assert matches_one_batch(mean_of_means=False)


def test_hf_llama_mean_of_microbatch_means_is_caught_u1():
    assert not matches_one_batch(mean_of_means=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_hf_windows_commit_finite_in_mixed_precision_u2(precision):
    engine = engine_for(hf_model("llama", VOCAB, seed=1), precision=precision, accum=3)
    batches = [packed_batch(r, SEQ_LEN) for r in window_rows()]
    assert engine.run_window(batches, 0).outcome is Outcome.COMMITTED
    assert all(p.dtype == torch.float32 for p in engine.parameters)  # fp32 master weights


# ----------------------------------------------------------------------------- U7

SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
                "numpy")


def host_reads_in_one_window(engine: UpdateEngine, monkeypatch) -> int:
    """Python-level reads of tensor values while the window runs, except of the host
    batch itself and inside the host-side plan (as in tests/update/test_real_stack.py)."""
    batches = [packed_batch(r, SEQ_LEN) for r in window_rows()]
    host = {id(t) for b in batches for t in (b.input_ids, b.labels, b.position_ids,
                                             b.segment_ids)}
    state = {"reads": 0, "paused": 0}

    def counted(original):
        def read(tensor, *args, **kwargs):
            if not state["paused"] and id(tensor) not in host:
                state["reads"] += 1
            return original(tensor, *args, **kwargs)
        return read

    def plan(bs, cfg, **kwargs):
        state["paused"] += 1
        try:
            return plan_window(bs, cfg, **kwargs)
        finally:
            state["paused"] -= 1

    engine.plan = plan
    with monkeypatch.context() as patch:
        for name in SYNC_METHODS:
            patch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
        assert engine.run_window(batches, 0).outcome is Outcome.COMMITTED
    return state["reads"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_window_reads_the_device_once_u7(family, monkeypatch):
    engine = engine_for(hf_model(family, VOCAB, seed=1), accum=3)
    assert host_reads_in_one_window(engine, monkeypatch) <= 1


def test_an_hf_side_host_read_is_counted_u7(monkeypatch):
    """Negative control: without exactstep's mask, HF infers documents from the
    positions and reads a tensor into an ``if`` in every forward: the counter sees it."""
    model = hf_model("llama", VOCAB, seed=1)
    monkeypatch.setattr(model, "attention_mask", lambda segment_ids, *_: None)
    assert host_reads_in_one_window(engine_for(model, accum=3), monkeypatch) > 1


# ----------------------------------------------------------------------------- E1, L5


HELD_OUT = [[7, 3, 9, 1], [4, 4, 8], [2, 5, 6, 7, 8, 9, 1], [3, 3]]


def trained_engine(family: str = "llama") -> UpdateEngine:
    model = hf_model(family, VOCAB, seed=2)
    model.train()
    engine = engine_for(model, precision="fp16", schedule="cosine", warmup=1, decay_steps=10,
                        accum=3)
    for w in range(2):
        batches = [packed_batch(r, SEQ_LEN) for r in window_rows()]
        assert engine.run_window(batches, w).outcome is Outcome.COMMITTED
    assert engine.committed == 2 and engine.optimizer.state
    return engine


def held_out_batches():
    return [packed_batch([HELD_OUT[:2], HELD_OUT[2:]], 10)]


def run_evaluate(engine: UpdateEngine):
    return evaluate(engine.model, held_out_batches(), device=torch.device("cpu"),
                    max_tokens=10**9, pad_id=PAD)


@pytest.mark.parametrize("family", ["llama"])
def test_hf_evaluation_is_the_global_mean_and_leaves_everything_untouched_e1_l5(family):
    engine = trained_engine(family)
    result = {}
    assert changes(engine, lambda e: result.setdefault("r", run_evaluate(e))) == []
    # independent expectation: HF's own forward of each document alone, both sums first
    hf = engine.model.hf
    with torch.no_grad():
        was = hf.training
        hf.eval()
        nll = [F.cross_entropy(hf(input_ids=torch.tensor([d]), use_cache=False).logits[0, :-1],
                               torch.tensor(d[1:]), reduction="sum").double()
               for d in HELD_OUT]
        hf.train(was)
    tokens = sum(len(d) - 1 for d in HELD_OUT)
    assert result["r"].tokens == tokens
    assert result["r"].loss == pytest.approx(math.fsum(map(float, nll)) / tokens, abs=1e-6)


def nudge(engine: UpdateEngine) -> None:
    with torch.no_grad():
        engine.model.head_weight.view(-1)[0] += 1e-6


@pytest.mark.parametrize("wrong, expected", [
    (lambda e: e.model.hf.model.layers[0].eval(), "modes"),
    (nudge, "parameters"),
    (lambda e: e.schedule.advance(3), "engine"),
])
def test_negative_control_wrong_hf_evaluation_is_caught_e1(wrong, expected):
    def evaluation(e):
        run_evaluate(e)
        wrong(e)

    assert expected in {p.split(".")[0] for p in changes(trained_engine(), evaluation)}


# ----------------------------------------------------------------------------- E1 end to end


def draw_everywhere() -> float:
    return random.random() + float(np.random.random()) + float(torch.rand(()))


def stochastic_hf_forward(monkeypatch) -> None:
    """The adapter draws from every stream in every forward and, in training only, lets
    the draws perturb its output (a stand-in for dropout)."""
    original = HFCausalLM.forward

    def forward(self, batch):
        jitter = draw_everywhere()
        hidden = original(self, batch)
        return hidden * (1.0 + 1e-3 * jitter) if self.training else hidden

    monkeypatch.setattr(HFCausalLM, "forward", forward)


def train_run(tmp_path, name: str, eval_every: int):
    from exactstep.run.runner import train

    data = tmp_path / "docs.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"})
                                + "\n" for i in range(40)))
    table = json.dumps({**FAMILIES["llama"], "max_position_embeddings": 64})
    cfg = load_config(overrides=[
        f"data.source={data}", "model.source=hf", f"model.hf_config={table}", "batch.rows=2",
        "batch.seq_len=64", "train.steps=6", f"train.eval_every={eval_every}",
        "train.eval_tokens=300", "update.warmup=2", "checkpoint.every=0",
        "train.progress=false", "train.device=cpu",
    ])
    out = tmp_path / name
    train(cfg, out, progress=False)
    weights, parts = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    return weights, parts, (out / "ledger.jsonl").read_text().splitlines()


def test_hf_mid_run_evaluation_changes_nothing_in_training_e1(tmp_path, monkeypatch):
    stochastic_hf_forward(monkeypatch)
    check_mid_run_evaluation_changes_nothing(tmp_path, train_run, monkeypatch)
