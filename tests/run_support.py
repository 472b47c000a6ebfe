"""Independent expectations for tests that run the real ``exactstep`` command.

These helpers recompute what a run directory must hold from the test's own
declarations and plain PyTorch, never from the runner: the held-out loss of a
checkpoint (each validation document run alone, cross entropy over its shifted
targets), a closed-form learning-rate schedule, a bitwise comparison of checkpoint
states, and digests of whole directories. The tests using them read run outputs only
through public entry points (``load_checkpoint``, ``latest_checkpoint``,
``evaluate_run``, the command line) and the files themselves.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from exactstep import Batch, Segment, build_model, load_corpus
from exactstep.data.config import DataConfig
from exactstep.model.config import ModelConfig

BOS, EOS, VOCAB = 256, 257, 259  # the byte tokenizer, written out (its own test pins them)

# Tiny shapes shared by every test that trains through the command line, on the CPU:
# these tests check CPU semantics (bitwise resume, exact figures), and a GPU host would
# otherwise pick CUDA through train.device = "auto".
TINY = {
    "train.device": "cpu",
    "batch.seq_len": 32,
    "batch.rows": 2,
    "model.d_model": 16,
    "model.n_layers": 1,
    "model.n_heads": 2,
    "model.d_ff": 32,
}
TINY_MODEL = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32)


def set_args(pairs: Mapping[str, Any]) -> list[str]:
    """``--set key=value`` for every pair, in order."""
    return [arg for key, value in pairs.items() for arg in ("--set", f"{key}={value}")]


def train_catching(module: Any, builder: str, argv: Sequence[str]) -> torch.nn.Module:
    """Run ``exactstep`` with ``argv`` in this process, ``module.builder`` (a model
    builder) wrapped to catch the model the run trains; that very model (a LoRA
    checkpoint holds no base to compare with)."""
    import pytest

    from exactstep.cli import main

    built: list[torch.nn.Module] = []
    build = getattr(module, builder)

    def catching(*args: Any, **kwargs: Any) -> torch.nn.Module:
        built.append(build(*args, **kwargs))
        return built[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, builder, catching)
        assert main(list(argv)) == 0
    assert len(built) == 1
    return built[0]


def write_texts(path: Path, texts: Sequence[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def short_texts(n: int = 60) -> list[str]:
    """``n`` documents of 3..28 bytes (at most 30 tokens with BOS and EOS), so that
    every held-out document fits one 32-token row whole."""
    words = "the quick brown fox jumps over a lazy dog while seven owls watch".split()
    out = []
    for i in range(n):
        text = " ".join(words[(i * 3 + j * 5) % len(words)] for j in range(2 + (i * 7) % 5))
        out.append(f"{i % 10} {text}"[:28])
    return out


def tokens_of(text: str) -> list[int]:
    """``BOS + UTF-8 bytes + EOS``, as the byte tokenizer is documented to encode."""
    return [BOS, *text.encode("utf-8"), EOS]


def model_from(model_state: Mapping[str, torch.Tensor], cfg: ModelConfig = TINY_MODEL):
    model = build_model(cfg, VOCAB, seed=12345)  # any init: every weight is replaced
    model.load_state_dict(dict(model_state))
    return model.eval()


def alone(tokens: Sequence[int]) -> Batch:
    """One document alone in one unpadded row (no packing, positions from 0)."""
    n = len(tokens)
    ids = torch.tensor([list(tokens)], dtype=torch.long)  # [1, n]
    labels = torch.tensor([list(tokens[1:]) + [-100]], dtype=torch.long)  # [1, n]
    return Batch(ids, labels, torch.arange(n).unsqueeze(0), torch.ones(1, n, dtype=torch.int32),
                 ((Segment(0, 0, 0, 0, n),),))


def document_nll(model, tokens: Sequence[int]) -> torch.Tensor:
    """Per-target gold NLL ``[n - 1]`` (fp32 logits, or float64 for a float64 model;
    plain ``F.cross_entropy``)."""
    hidden = model(alone(tokens))[0]  # [n, H]
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden[:-1].to(dtype) @ model.head_weight.to(dtype).t()  # [n - 1, V]
    return F.cross_entropy(logits, torch.tensor(list(tokens[1:])), reduction="none")


def val_documents(source: Path, val_fraction: float) -> list[list[int]]:
    """The validation split's documents as token lists, in corpus order."""
    corpus = load_corpus(DataConfig(source=str(source), val_fraction=val_fraction))
    return [tokens_of(doc.text) for doc in corpus.val]


def heldout_per_document(model_state, docs: Sequence[Sequence[int]], *, exact: bool = False
                         ) -> list[tuple[float, int]]:
    """(NLL sum in float64, target count) of every document, each run alone; with
    ``exact`` the model runs in float64 (the yardstick for fp32's own rounding)."""
    model = model_from(model_state)
    if exact:
        model = model.double()
    with torch.no_grad():
        return [(float(document_nll(model, d).double().sum()), len(d) - 1) for d in docs]


def global_mean(per_doc: Sequence[tuple[float, int]]) -> tuple[float, int]:
    """L5: both sums reduced first, then divided."""
    total = math.fsum(s for s, _ in per_doc)
    count = sum(n for _, n in per_doc)
    return total / count, count


def cosine_lr(c: int, *, peak: float, warmup: int, horizon: int, floor: float) -> float:
    """U5 ``cosine`` in closed form: ``peak * (c + 1) / warmup`` during the warmup, then
    half a cosine from ``peak`` to ``floor * peak`` over ``[warmup, horizon]``."""
    if c < warmup:
        return peak * (c + 1) / warmup
    p = min(1.0, max(0.0, (c - warmup) / (horizon - warmup)))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def tree_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path (what "byte-identical" means)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def bitwise_differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Dotted paths where ``a`` and ``b`` differ; tensors compared by dtype, shape and
    bytes (so ``-0.0 != 0.0`` and a NaN equals only the same NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape
                and _raw_bytes(a) == _raw_bytes(b))
        return [] if same else [path]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                out.append(f"{where} (missing on one side)")
            else:
                out += bitwise_differences(a[key], b[key], where)
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{path} (length {len(a)} vs {len(b)})"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in bitwise_differences(x, y, f"{path}.{i}")]
    if type(a) is not type(b) or a != b:
        return [path]
    return []


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def kill_once_ledger_has(proc: subprocess.Popen, run_dir: Path, lines: int, *,
                         timeout: float = 300) -> None:
    """SIGKILL ``proc`` as soon as its ledger holds ``lines`` complete lines (polled
    every millisecond; gives up after ``timeout`` seconds or when it exits)."""
    path = run_dir / "ledger.jsonl"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= lines:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.001)


def kill_when_ledger_has(proc: subprocess.Popen, run_dir: Path, lines: int) -> None:
    """SIGKILL ``proc`` as soon as its ledger holds ``lines`` complete lines."""
    kill_once_ledger_has(proc, run_dir, lines, timeout=240)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"


def check_mid_run_evaluation_changes_nothing(tmp_path: Path, train_run: Any,
                                             monkeypatch: Any) -> None:
    """E1 through whole runs: ``train_run(tmp_path, name, eval_every)`` (returning the
    final state's two halves and the ledger lines) with ``eval_every=2`` against none
    gives bitwise-identical weights, optimizer, schedule, scaler, counters, RNG streams,
    data cursor and ledger; only the manifest digest (``train.eval_every`` is in it)
    and the metrics line count differ. Negative control: with evaluation's RNG
    isolation disabled the mid-run evaluations move the streams and the runs part."""
    import contextlib

    import exactstep.state.rng as rng_module
    from exactstep.state.compare import state_differences

    plain = train_run(tmp_path, "plain", 0)
    evaluated = train_run(tmp_path, "evaluated", 2)
    metrics = (tmp_path / "evaluated" / "metrics.jsonl").read_text()
    assert metrics.count('"eval_loss"') == 2  # windows 2 and 4 were evaluated mid-run
    assert state_differences(plain[0], evaluated[0]) == []
    assert state_differences(plain[1], evaluated[1]) == [
        "progress.manifest_digest", "progress.journals.metrics.jsonl.lines"]
    assert plain[2] == evaluated[2]

    monkeypatch.setattr(rng_module, "isolated_rng", contextlib.nullcontext)  # state.rng.isolated's
    leaky = train_run(tmp_path, "leaky", 2)
    assert state_differences(plain[0], leaky[0]) != []
    assert plain[2] != leaky[2]


# ------------------------------------------------------------ what evaluation may not touch (E1)


def python_stream() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def numpy_stream() -> list:
    """The legacy global generator's whole state: key array *and* position."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]


def observe(engine: Any) -> dict:
    """Everything evaluation must leave bitwise unchanged, read independently."""
    model = engine.model
    return {
        "parameters": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": [p.grad is None for p in model.parameters()],
        "modes": {name or "<model>": m.training for name, m in model.named_modules()},
        "python_rng": python_stream(),
        "numpy_rng": numpy_stream(),
        "torch_rng": torch.get_rng_state().clone(),
        "engine": copy.deepcopy(engine.state_dict()),  # optimizer, schedule, scaler, counters
        "lr": engine.schedule.lr(),
        "group_lrs": [g["lr"] for g in engine.optimizer.param_groups],
        "grad_enabled": torch.is_grad_enabled(),
    }


def changes(engine: Any, evaluation: Any) -> list[str]:
    """The paths evaluation changed (``[]``: untouched)."""
    from exactstep.state.compare import state_differences

    before = observe(engine)
    evaluation(engine)
    return state_differences(before, observe(engine))


def multi_rank_state(run_dir: Path, world: int = 2) -> dict:
    """Everything the newest multi-rank checkpoint of ``run_dir`` holds (the DCP model
    and optimizer, the common parts, each rank's RNG and cursor), loaded in this one
    process for a bitwise comparison (S5, S7)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from exactstep.state import latest_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None
    flat = run_dir / f"{path.name}.pt"
    dcp_to_torch_save(str(path / "dcp"), str(flat))
    state = {"name": path.name, **torch.load(flat, weights_only=False)}
    state["common"] = torch.load(path / "common.pt", weights_only=True)
    for rank in range(world):
        state[f"rank{rank}"] = torch.load(path / f"rank-{rank:05d}.pt", weights_only=True)
    return state
