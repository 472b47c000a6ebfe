"""The Professor Forcing discriminator and the behaviour it reads (Q5).

A behaviour sequence is the generator's final hidden states at a path's compared steps
(``behaviour``: gathered from a two-path batch's hidden states by the rows' ``steps``
mask, padded, with each sequence's length). ``Discriminator`` reads it with a linear
projection, a bidirectional GRU over exactly the sequence's steps (packed: padding is
never read) and an MLP on both directions' final states, giving one logit ``z`` per
sequence, ``P(teacher-forced) = sigmoid(z)``. Its weights are a function of the run's
seed alone (drawn in a forked RNG, so no other stream moves); it draws nothing after.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

RNG_TAG = 0x5046  # the discriminator's initial weights: (seed, tag)


class Discriminator(nn.Module):
    """Logit of ``P(teacher-forced)`` for each behaviour sequence ``[N, L, width]``."""

    def __init__(self, width: int, hidden: int, *, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((int(seed) * 0x9E3779B1 + RNG_TAG) % (1 << 63))
            self.project = nn.Linear(width, hidden)
            self.gru = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
            self.mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(),
                                     nn.Linear(hidden, 1))

    def forward(self, behaviour: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``behaviour`` ``[N, L, width]``, ``lengths`` ``[N]`` (each >= 1, host int64):
        the ``[N]`` logits; positions past a sequence's length are never read."""
        x = self.project(behaviour.to(self.project.weight.dtype))  # [N, L, hidden]
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        _, last = self.gru(packed)  # [2, N, hidden]: each direction's final state
        return self.mlp(torch.cat([last[0], last[1]], dim=-1)).squeeze(-1)  # [N]


def behaviour(hidden: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequences [R, L, H], lengths [R])``: row ``r``'s hidden states at its ``steps``
    columns, in column order, left-aligned and zero-padded to the longest (``L``);
    ``hidden`` ``[R, T, H]``, ``steps`` ``[R, T]`` bool (host or the hidden's device)."""
    steps = steps.to(hidden.device)
    lengths = steps.sum(dim=1)  # [R]
    width = int(lengths.max()) if lengths.numel() else 0
    rank = torch.cumsum(steps.long(), dim=1) - 1  # [R, T]: each step's place in its row
    rows, cols = steps.nonzero(as_tuple=True)
    out = hidden.new_zeros((hidden.shape[0], max(width, 1), hidden.shape[-1]))
    out = out.index_put((rows, rank[rows, cols]), hidden[rows, cols])
    return out, lengths.cpu()
