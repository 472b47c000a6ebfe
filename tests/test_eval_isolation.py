"""E1: evaluation leaves the training run exactly as it found it.

The model under evaluation draws from every RNG stream a run uses (Python, NumPy,
torch CPU) in every forward, as a stochastic layer would, and holds a submodule
frozen in eval mode inside a model in train mode. It is trained for two windows by a
real ``UpdateEngine`` (fp16, so the loss scaler has state), then evaluated. The check
compares, bitwise: parameters and buffers, gradients, every module's mode, every RNG
stream (read with the libraries' own getters), and the engine's optimizer, schedule,
scaler and counters. Negative controls: evaluation variants that draw from one
stream, isolate only torch's stream (the previous behaviour), leave the model in eval
mode, restore the mode only at the top, or touch the engine must each fail the check.

``test_mid_run_evaluation_changes_nothing_in_training`` runs ``train()`` end to end
with and without ``train.eval_every`` on a decoder made stochastic the same way; its
negative control is the same comparison with the RNG isolation disabled.
"""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from run_support import (
    changes,
    check_mid_run_evaluation_changes_nothing,
    numpy_stream,
    python_stream,
)
from torch import nn
from update.update_support import HIDDEN, PAD, TinyLM, random_batch

import exactstep.eval as eval_module
import exactstep.state.rng as rng_module
from exactstep.config import load_config
from exactstep.data.arith import ArithSpec, arith_conversations
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.eval import evaluate, greedy_answer_accuracy
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import Decoder, build_model
from exactstep.objective.config import ObjectiveConfig
from exactstep.state import latest_checkpoint, load_checkpoint
from exactstep.state.compare import state_differences
from exactstep.state.rng import isolated_rng
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine


def draw_everywhere() -> float:
    """One draw from each global stream (what a stochastic layer consumes)."""
    return random.random() + float(np.random.random()) + float(torch.rand(()))


class StochasticLM(nn.Module):
    """TinyLM + dropout + a frozen norm; draws from every stream in every forward.

    In training the draws perturb the output (so the trajectory depends on them); in
    eval mode they are still drawn but unused, so evaluation results stay
    deterministic while its RNG consumption is observable.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM(seed=1)
        self.dropout = nn.Dropout(0.2)
        self.frozen = nn.LayerNorm(HIDDEN)
        self.frozen.eval()  # stays in eval mode inside a training model
        self.seen: list[tuple[bool, bool]] = []  # (training, grad enabled) per forward

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm.head_weight

    def forward(self, batch) -> torch.Tensor:
        self.seen.append((self.training, torch.is_grad_enabled()))
        jitter = draw_everywhere()
        hidden = self.frozen(self.dropout(self.lm(batch)))  # [B, T, H]
        return hidden * (1.0 + 1e-3 * jitter) if self.training else hidden


def trained_engine() -> UpdateEngine:
    """A real engine (real plan and fused loss, fp16 scaler) after two windows."""
    model = StochasticLM()
    model.train()
    model.frozen.eval()
    cfg = UpdateConfig(schedule="cosine", warmup=1, decay_steps=10, clip=1.0)
    optimizer, _ = build_optimizer(model, cfg)
    engine = UpdateEngine(
        model,
        optimizer,
        build_schedule(cfg, 10),
        Precision(NumericsConfig(precision="fp16", init_scale=1024.0), "cpu"),
        cfg,
        ObjectiveConfig(),
        device="cpu",
        pad_id=PAD,
    )
    gen = torch.Generator().manual_seed(0)
    for w in range(2):
        assert engine.run_window([random_batch(gen, 2, 6), random_batch(gen, 1, 6)], w).lr
    assert engine.committed == 2 and engine.optimizer.state
    return engine


def held_out_batches():
    gen = torch.Generator().manual_seed(9)
    return [random_batch(gen, 2, 7) for _ in range(3)]


def run_evaluate(engine: UpdateEngine):
    return evaluate(engine.model, held_out_batches(), device=torch.device("cpu"),
                    max_tokens=10**9, pad_id=PAD, autocast=engine.precision.autocast)


# ------------------------------------------------------------------- the real evaluate


def test_evaluate_leaves_everything_untouched_e1() -> None:
    engine = trained_engine()
    model = engine.model
    model.seen.clear()
    result = None

    def evaluation(e):
        nonlocal result
        result = run_evaluate(e)

    assert changes(engine, evaluation) == []
    assert result.tokens > 0 and result.loss is not None
    assert model.seen and all(seen == (False, False) for seen in model.seen)  # eval, no_grad
    assert model.training and model.lm.training and not model.frozen.training


def test_evaluation_does_consume_every_stream_so_the_check_can_see_it() -> None:
    """Without isolation the same evaluation moves Python's, NumPy's and torch's streams."""
    engine = trained_engine()
    with pytest.MonkeyPatch.context() as mp:  # the one E1 isolation lives in state.rng
        mp.setattr(rng_module, "isolated_rng", contextlib.nullcontext)
        found = changes(engine, run_evaluate)
    assert {"python_rng", "numpy_rng", "torch_rng"} <= {p.split(".")[0] for p in found}


def torch_only_isolation(engine: UpdateEngine) -> None:
    """The previous behaviour: only torch's stream was forked."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rng_module, "isolated_rng", torch.random.fork_rng)
        run_evaluate(engine)


def then(action):
    def evaluation(engine: UpdateEngine) -> None:
        run_evaluate(engine)
        action(engine)

    return evaluation


def nudge_parameter(engine: UpdateEngine) -> None:
    with torch.no_grad():
        next(engine.model.parameters()).view(-1)[0] += 1e-6


WRONG_EVALUATIONS = {
    "draws from Python's stream": (then(lambda e: random.random()), {"python_rng"}),
    "draws from NumPy's stream": (then(lambda e: np.random.random()), {"numpy_rng"}),
    "draws from torch's stream": (then(lambda e: torch.rand(1)), {"torch_rng"}),
    "isolates torch's stream only": (torch_only_isolation, {"python_rng", "numpy_rng"}),
    "leaves the model in eval mode": (then(lambda e: e.model.eval()), {"modes"}),
    "restores the mode at the top only": (then(lambda e: e.model.train(True)), {"modes"}),
    "mutates a parameter": (then(nudge_parameter), {"parameters"}),
    "advances the schedule": (then(lambda e: e.schedule.advance(3)), {"engine", "lr"}),
    "updates the loss scaler": (
        then(lambda e: e.precision.scaler.update(new_scale=7.0)), {"engine"}),
    "counts a window": (then(lambda e: setattr(e, "committed", e.committed + 1)), {"engine"}),
}


@pytest.mark.parametrize("variant", sorted(WRONG_EVALUATIONS))
def test_negative_control_wrong_evaluation_is_caught_e1(variant: str) -> None:
    evaluation, expected = WRONG_EVALUATIONS[variant]
    found = {path.split(".")[0] for path in changes(trained_engine(), evaluation)}
    assert expected <= found, found


def test_isolation_holds_when_evaluation_raises_e1() -> None:
    engine = trained_engine()

    class Broken(Exception):
        pass

    def failing(e: UpdateEngine) -> None:
        def batches():
            yield held_out_batches()[0]
            raise Broken

        with pytest.raises(Broken):
            evaluate(e.model, batches(), device=torch.device("cpu"), max_tokens=10**9,
                     pad_id=PAD)

    assert changes(engine, failing) == []


def test_isolated_rng_restores_every_stream_after_draws() -> None:
    before = [python_stream(), numpy_stream(), torch.get_rng_state()]
    with isolated_rng():
        inside = draw_everywhere()
    assert state_differences(before, [python_stream(), numpy_stream(), torch.get_rng_state()]) == []
    assert draw_everywhere() == inside  # the next draws are the ones evaluation made


# ------------------------------------------------------------------ greedy decoding


TOK = ByteTokenizer()


class StochasticDecoder(nn.Module):
    """The built-in decoder, drawing from every stream in each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32),
                                 TOK.vocab_size, seed=0)

    def forward(self, batch) -> torch.Tensor:
        draw_everywhere()
        return self.inner(batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(hidden)


def greedy_changes() -> list[str]:
    model = StochasticDecoder()
    model.train()
    conversations = arith_conversations(0, 3, split="heldout", spec=ArithSpec())

    def snapshot() -> dict:
        return {
            "python_rng": python_stream(),
            "numpy_rng": numpy_stream(),
            "torch_rng": torch.get_rng_state().clone(),
            "parameters": {k: v.clone() for k, v in model.state_dict().items()},
            "training": model.training,
        }

    before = snapshot()
    greedy_answer_accuracy(model, TOK, conversations, device="cpu", max_new_tokens=2)
    return state_differences(before, snapshot())


def test_greedy_decoding_isolates_every_stream_e1() -> None:
    assert greedy_changes() == []


def test_negative_control_greedy_without_isolation_moves_the_streams_e1(monkeypatch) -> None:
    monkeypatch.setattr(eval_module, "isolated_rng", contextlib.nullcontext)
    assert {"python_rng", "numpy_rng", "torch_rng"} <= {p.split(".")[0] for p in greedy_changes()}


# ---------------------------------------------------------------- end to end: train()


def stochastic_decoder_forward(monkeypatch) -> None:
    """Make the built-in decoder draw from every stream in every forward and, in
    training only, let the draws perturb its output (a stand-in for dropout)."""
    original = Decoder.forward

    def forward(self, batch, *args, **kwargs):
        jitter = draw_everywhere()
        hidden = original(self, batch, *args, **kwargs)
        return hidden * (1.0 + 1e-3 * jitter) if self.training else hidden

    monkeypatch.setattr(Decoder, "forward", forward)


def write_docs(path: Path) -> Path:
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 3)})
             for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return path


def train_run(tmp_path: Path, name: str, eval_every: int) -> tuple[dict, dict, list[str]]:
    from exactstep.run.runner import train

    data = tmp_path / "docs.jsonl"
    if not data.exists():
        write_docs(data)
    cfg = load_config(overrides=[
        f"data.source={data}", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
        "model.d_ff=64", "batch.rows=2", "batch.seq_len=64", "train.steps=6",
        f"train.eval_every={eval_every}", "train.eval_tokens=300", "update.warmup=2",
        "checkpoint.every=0", "train.progress=false", "train.device=cpu",
    ])
    out = tmp_path / name
    train(cfg, out, progress=False)
    weights, parts = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    ledger = (out / "ledger.jsonl").read_text().splitlines()
    return weights, parts, ledger


def test_mid_run_evaluation_changes_nothing_in_training(tmp_path, monkeypatch) -> None:
    """train.eval_every=2 vs no mid-run evaluation: bitwise-identical final weights,
    optimizer, schedule, scaler, counters, RNG streams and data cursor, and the same
    ledger. Negative control: with evaluation's RNG isolation disabled the mid-run
    evaluations move the streams and the two runs part ways."""
    stochastic_decoder_forward(monkeypatch)
    check_mid_run_evaluation_changes_nothing(tmp_path, train_run, monkeypatch)
