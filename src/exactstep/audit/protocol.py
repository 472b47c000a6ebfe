"""What a training step must offer to be audited (A1): ``TrainingStep``.

The audit treats a target as a black box and measures it by observation only; every
expected value is computed by the probe itself, in plain PyTorch, from the target's
model (``logits``) and the declared ``ProbeSpec``. ``TrainingStep`` lists what a loop
offers (the required methods, then the optional data-parallel and own-data-order
capabilities); a hand-written loop is wrapped in about 30 lines (``audit.examples``).
Design and derivations: docs/design/audit.md#auditprotocolpy (A1, A2, S2, D1, D5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import nn

SmoothingConvention = Literal["uniform", "non_pad", "harvard"]


@dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """The declared training step a probe asks for (tiny on purpose).

    Tokens: ``pad_id`` 0, ``bos_id`` 1, ``eos_id`` 2, content tokens 3..V-1. The model:
    ``d_model``, ``n_layers``, ``n_heads``, ``dropout`` (probability; a model without
    dropout ignores it), built from ``seed``.

    The declared objective (R1, R3, R5, L2, L3): each row ``i`` of a document predicts
    token ``i + 1`` of the same document when that token is owned
    (``Microbatch.owned``); the loss of a window is the mean over every supervised
    target of the window's microbatches (one token mean, U1), with label smoothing
    ``label_smoothing`` in ``smoothing_convention`` (L2; see
    ``exactstep.objective.smoothing``). A window with no supervised target commits
    nothing (L4).

    The declared update (U1-U6): ``optimizer`` ``sgd`` (plain: no momentum) or
    ``adamw`` (PyTorch's decoupled weight decay ``weight_decay``, ``betas``, ``eps``);
    the decay group is every matrix the forward does not read as a lookup table (an
    ``nn.Embedding`` weight, or an ``nn.Parameter`` read with ``F.embedding`` or
    indexing), the rest is not decayed; global L2 clipping at ``clip`` over unique parameters (0: none)
    after unscaling; the learning rate of the update taken after ``k`` committed
    updates is ``lr * min(1, (k + 1) / warmup)`` (``warmup`` 0: constant); a window
    with a non-finite loss or gradient is skipped and advances nothing (U4).
    ``loss_scale``: when set, the loop scales the loss with a ``GradScaler`` of that
    initial scale (growth disabled; a skipped window halves it, ``GradScaler``'s
    back-off, and the scale is checkpoint state, S2); ``None``: no scaling.
    """

    vocab_size: int = 16
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    d_model: int = 16
    n_layers: int = 1
    n_heads: int = 2
    dropout: float = 0.0
    seed: int = 0
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    accum: int = 1
    clip: float = 0.0
    warmup: int = 0
    label_smoothing: float = 0.0
    smoothing_convention: SmoothingConvention = "harvard"
    loss_scale: float | None = None

    def lr_at(self, committed: int) -> float:
        """The declared rate of the update taken after ``committed`` updates."""
        if self.warmup <= 0:
            return self.lr
        return self.lr * min(1.0, (committed + 1) / self.warmup)


@dataclass(frozen=True)
class Microbatch:
    """``B`` rows of ``L`` tokens, right-padded with ``pad_id``.

    ``tokens``: int64 ``[B, L]``. ``documents``: int64 ``[B, L]``, 1, 2, ... for the
    documents packed into a row, 0 on padding. ``positions``: int64 ``[B, L]``, the
    position of each token inside its document (0 at each document's first token).
    ``owned``: bool ``[B, L]``, token ``j`` is a supervised *target* (never a
    document's first token, never padding; for chat only the assistant's tokens).
    A microbatch holds documents, not rows: the loop under audit decides the shift, the
    masks and the normalization.
    """

    tokens: torch.Tensor
    documents: torch.Tensor
    positions: torch.Tensor
    owned: torch.Tensor

    @property
    def supervised(self) -> int:
        """Targets a correct step supervises in this microbatch (host count)."""
        same_doc = self.documents[:, 1:] == self.documents[:, :-1]
        return int((self.owned[:, 1:] & same_doc).sum())


@runtime_checkable
class TrainingStep(Protocol):
    """The adapter protocol: what the audit calls, and what each call must do.

    - ``build(spec)``: a fresh model, optimizer and schedule from ``spec``, seeded by
      ``spec.seed`` (two builds with one spec give bitwise equal parameters).
    - ``module``: the model; its unique named parameters are what the probes watch.
    - ``logits(input_ids, position_ids, document_ids)``: the loop's model forward,
      ``[B, T]`` inputs to ``[B, T, V]`` logits, with autograd, in the module's current
      mode; tokens with equal ``document_ids`` see each other causally, 0 is padding.
    - ``train(microbatches)``: run the loop once, closing a window every
      ``spec.accum`` microbatches and on the remainder; returns the loss it logs for
      each window: the window's declared token mean, unscaled (``None`` for a skipped
      window, or for every window when the loop logs none).
    - ``evaluate(microbatches)``: held-out ``(loss, perplexity)``.
    - ``save(path)`` / ``load(path)``: everything the loop needs to continue exactly.
    - ``smoothing_convention``: ``uniform`` (``F.cross_entropy(label_smoothing=...)``),
      ``non_pad`` or ``harvard`` (the Annotated Transformer's criterion; L2).

    Optional: ``data_parallel = True`` (under an initialized default process group,
    ``build`` and ``train`` run as one rank and each window's update is the token mean
    over every rank's targets, D1, D5); ``set_data(windows)`` after ``build`` and
    ``train_steps(n)``, the next ``n`` windows in the loop's own order, with
    ``save``/``load`` carrying that position (S2; ``WindowCursor``). A probe needing
    an optional capability the target lacks is N/A. Details:
    docs/design/audit.md#auditprotocolpy.
    """

    module: nn.Module
    smoothing_convention: SmoothingConvention
    # optional: data_parallel = True; set_data(windows) and train_steps(n) (see the
    # class docstring)

    def build(self, spec: ProbeSpec) -> None: ...

    def logits(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor
    ) -> torch.Tensor: ...

    def train(self, microbatches: Sequence[Microbatch]) -> list[float | None]: ...

    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]: ...

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...


class WindowCursor:
    """The optional ``set_data`` / ``train_steps`` pair, for a loop that owns its data
    order: a subclass defines ``epoch_order()`` (the permutation of ``dataset`` for
    ``self.epoch``, from whatever seeds it) and ``train``; its ``save``/``load`` carry
    ``epoch`` and ``index`` (the windows of this epoch already trained), which is the
    data cursor the ``resume_data`` probe checks (S2)."""

    dataset: list
    epoch: int = 0
    index: int = 0

    def set_data(self, windows: Sequence[Sequence[Microbatch]]) -> None:
        self.dataset, self.epoch, self.index = [list(w) for w in windows], 0, 0

    def epoch_order(self) -> list[int]:
        raise NotImplementedError

    def train(self, microbatches: Sequence[Microbatch]) -> list[float | None]:
        raise NotImplementedError

    def train_steps(self, n: int) -> list[float | None]:
        """The next ``n`` windows of ``dataset`` in the epoch's order, continuing from
        the saved position (a new epoch begins after the last window)."""
        if not getattr(self, "dataset", None):
            raise ValueError("train_steps() needs set_data() first")
        logs: list[float | None] = []
        for _ in range(n):
            if self.index == len(self.dataset):
                self.epoch, self.index = self.epoch + 1, 0
            window = self.dataset[self.epoch_order()[self.index]]
            self.index += 1
            logs += self.train(window)
        return logs

