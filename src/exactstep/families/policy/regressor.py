"""MIXER's learned baseline (Q3, U4): ``b_t = w . h_t + c`` on the policy's states.

``h_t`` is the policy's last hidden state at the column that predicts sampled token
``t``: a function of the prompt and the tokens drawn before ``t``, never of ``t``
itself, so ``b_t`` is a baseline REINFORCE may subtract without bias. The states are
computed at the window's parameters in eval mode without gradients (stop-gradient: the
regressor's loss never reaches the policy), one prompt's ``K`` continuations per
forward, so packing, the micro-batch split and the rank never change a baseline.

The regressor has its own loss, ``sum_t (b_t - R)^2 / N`` over every sampled token of
the window (all ranks), its own parameters (float64) and its own Adam optimizer: its
gradient is computed while the window is prepared and applied only when the window
commits (U4); parameters and optimizer state are the program's checkpoint part.
Design and derivations: docs/design/families.md#familiespolicyregressorpy (Q3, U4).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from exactstep.generation.sampler import prompt_batch
from exactstep.state.rng import isolated


class Regressor:
    """The learned baseline's parameters, optimizer and pending gradient."""

    def __init__(self, lr: float) -> None:
        self.lr = lr
        self.weight: torch.Tensor | None = None  # [H] float64
        self.bias: torch.Tensor | None = None  # [1] float64
        self.optimizer: torch.optim.Adam | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def _ensure(self, width: int) -> None:
        if self.weight is not None:
            if self.weight.numel() != width:
                raise ValueError(f"the learned baseline has {self.weight.numel()} inputs; "
                                 f"the policy's states have {width}")
            return
        self.weight = torch.zeros(width, dtype=torch.float64, requires_grad=True)
        self.bias = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        self.optimizer = torch.optim.Adam([self.weight, self.bias], lr=self.lr)

    @torch.no_grad()
    def states(self, model: torch.nn.Module, context: Sequence[int],
               continuations: Sequence[Sequence[int]], device: torch.device, *,
               source: Sequence[int] | None = None, source_pad_id: int = 0
               ) -> list[torch.Tensor]:
        """``h_t`` (float64, ``[n_k, H]``) of each continuation's sampled tokens, from
        one forward over the prompt's ``K`` rows (padded after their ends: a causal
        model's earlier columns never see the padding)."""
        rows = [list(context) + list(c) for c in continuations]
        width = max(len(r) for r in rows) - 1
        if width <= 0 or not any(continuations):
            return [torch.zeros((len(c), 0), dtype=torch.float64) for c in continuations]
        ids = torch.zeros((len(rows), width), dtype=torch.int64)
        for k, r in enumerate(rows):
            ids[k, :len(r) - 1] = torch.tensor(r[:-1])
        with isolated(model):
            hidden = model(prompt_batch(ids.to(device), source, source_pad_id)).double().cpu()
        first = len(context) - 1  # the column whose state predicts the first sampled token
        return [hidden[k, first:first + len(c)] for k, c in enumerate(continuations)]

    def predict(self, states: torch.Tensor) -> torch.Tensor:
        """``b_t`` for ``states`` ``[n, H]`` (float64)."""
        if states.numel() == 0:
            return torch.zeros(states.shape[0], dtype=torch.float64)
        self._ensure(states.shape[1])
        with torch.no_grad():
            return states @ self.weight + self.bias

    def prepare_step(self, states: Sequence[torch.Tensor], targets: Sequence[float],
                     reducer: Any = None) -> dict:
        """The regressor's loss and gradient over the window (every rank), kept until
        the window closes; ``states[i]`` are trajectory ``i``'s sampled states, all
        regressed on its reward ``targets[i]``."""
        width = next((s.shape[1] for s in states if s.numel()), 0)
        several = reducer is not None and getattr(reducer, "world_size", 1) > 1
        if several:  # a rank with no sampled state (an empty share) still joins (D2)
            width = int(reducer.max(torch.tensor([width], dtype=torch.int64)).item())
        if not width:
            self._pending = None
            return {"baseline_loss": None, "baseline_tokens": 0}
        self._ensure(width)
        sums = torch.zeros(width + 3, dtype=torch.float64)  # [d/dw, d/dc, squares, n]
        with torch.no_grad():
            for s, target in zip(states, targets, strict=True):
                if not s.numel():
                    continue
                error = s @ self.weight + self.bias - target  # [n]
                sums[:width] += s.t() @ error
                sums[width] += error.sum()
                sums[width + 1] += (error * error).sum()
                sums[width + 2] += error.numel()
        if several:
            sums = reducer.sum(sums)
        n = float(sums[width + 2])
        self._pending = (2.0 * sums[:width] / n, 2.0 * sums[width:width + 1] / n)
        return {"baseline_loss": float(sums[width + 1]) / n, "baseline_tokens": int(n)}

    def step(self, committed: bool) -> None:
        """Apply the pending gradient when the window committed; drop it otherwise."""
        pending, self._pending = self._pending, None
        if not committed or pending is None:
            return
        self.weight.grad, self.bias.grad = pending[0].clone(), pending[1].clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        if self.weight is None:
            return {}
        return {"weight": self.weight.detach().clone(), "bias": self.bias.detach().clone(),
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._pending = None
        if not state:
            self.weight = self.bias = self.optimizer = None
            return
        self.weight = None
        self._ensure(int(state["weight"].numel()))
        with torch.no_grad():
            self.weight.copy_(state["weight"])
            self.bias.copy_(state["bias"])
        self.optimizer.load_state_dict(state["optimizer"])
