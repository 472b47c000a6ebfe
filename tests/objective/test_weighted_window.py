"""L3 weighted reductions over real packed data: weights from the JSONL, through
examples, packing and the compiler, into ``plan_window`` and the engine.

The expectation is written here from the documents and their weights alone: each
document is cut into ``seq_len`` pieces by the split rule, each piece is scored on its
own (positions from 0) by the test model's own formula in float64, and

    weighted:        S / D = sum_d w_d sum_t ce_dt / sum_d w_d n_d
    weighted_count:  S / D = sum_d w_d sum_t ce_dt / sum_d n_d

The window packs six documents into microbatches of two rows; the longest document
is split across rows and microbatches. Negative controls: giving each physical row
the weight of its first document, or ignoring the weights, gives other values.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from equivalence import linear_cross_entropy_bounds, smoothed_targets
from torch import nn

from exactstep.data.documents import read_jsonl
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.objective.config import ObjectiveConfig
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import encode_documents
from exactstep.rows.stream import RowStream
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

TOK = ByteTokenizer()
SEQ = 16
ROWS = 2
HIDDEN = 8
# Weights are multiples of 1/4, so D = sum w_d n_d is exact in float32.
DOCS = [
    ("a long document that is cut into three pieces", 0.5),  # 47 tokens: 16 + 16 + 15
    ("short one", 2.0),
    ("middle sized doc", 0.25),
    ("xy", 3.0),
    ("another document", 1.5),
    ("zero weight here", 0.0),
]
LONG = 0  # example id of the document that is split


class PositionalLM(nn.Module):
    """``hidden = tanh(E[token] + P[position])``; no mixing across columns, so a
    piece's losses depend only on the piece (and the positions packing gave it)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.tok = nn.Parameter(torch.randn(TOK.vocab_size, HIDDEN, generator=gen))
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN, generator=gen))
        self.head = nn.Parameter(torch.randn(TOK.vocab_size, HIDDEN, generator=gen))

    @property
    def head_weight(self) -> torch.Tensor:
        return self.head

    def forward(self, batch: Batch) -> torch.Tensor:
        return torch.tanh(self.tok[batch.input_ids] + self.pos[batch.position_ids])  # [B, T, H]


def write_docs(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": t, "weight": w}) + "\n" for t, w in DOCS))
    return path


def window(path: Path) -> list[Batch]:
    """One epoch of the data, packed: every batch of a finite stream is one window."""
    examples = encode_documents(read_jsonl(path), TOK)
    stream = RowStream(examples, BatchConfig(seq_len=SEQ, rows=ROWS), pad_id=TOK.pad_id,
                       seed=3, repeat=False)
    batches = list(stream)
    assert stream.weighted and all(b.weights is not None for b in batches)
    return batches


def engine_for(reduction: str) -> UpdateEngine:
    model = PositionalLM()
    cfg = UpdateConfig(schedule="constant", warmup=0, clip=0.0, weight_decay=0.0)
    optimizer, _ = build_optimizer(model, cfg)
    return UpdateEngine(model, optimizer, build_schedule(cfg, 1), Precision(NumericsConfig(),
                        "cpu"), cfg, ObjectiveConfig(reduction=reduction, chunk_rows=5),
                        device="cpu", pad_id=TOK.pad_id)


# ------------------------------------------------------------ the independent expectation


def pieces(tokens: list[int]) -> list[list[int]]:
    """The split rule: consecutive runs of at most SEQ tokens, each its own segment."""
    return [tokens[s:s + SEQ] for s in range(0, len(tokens), SEQ)]


def piece_hidden(model: PositionalLM, piece: list[int]) -> torch.Tensor:
    """The fp32 hidden states of one piece, positions 0..L-1 ``[L, H]``."""
    ids = torch.tensor(piece)
    with torch.no_grad():
        return torch.tanh(model.tok[ids] + model.pos[: len(piece)])


def piece_losses(model: PositionalLM, piece: list[int]) -> list[float]:
    """Float64 CE of each next-token target inside one piece, positions 0..L-1."""
    with torch.no_grad():
        hidden = piece_hidden(model, piece).double()  # [L, H]
        logp = torch.log_softmax(hidden @ model.head.double().t(), dim=-1)  # [L, V]
    return [-float(logp[k, piece[k + 1]]) for k in range(len(piece) - 1)]


def expected(model: PositionalLM, reduction: str) -> tuple[float, float, float]:
    """(S / D, D, tolerance) from the documents and their weights. The engine rounds the
    same fp32 hidden states through its fused head and cross entropy: the tolerance is
    their worst-case fp32 bound for ``sum_t (w_t / D) ce_t`` (``tests/equivalence.py``);
    ``D`` is exact (weights are multiples of 1/4)."""
    numerator, denominator, hidden, targets, weights = [], [], [], [], []
    for text, weight in DOCS:
        tokens = [TOK.bos_id, *TOK.encode(text), TOK.eos_id]
        for piece in pieces(tokens):
            losses = piece_losses(model, piece)
            numerator.append(weight * math.fsum(losses))
            denominator.append(weight * len(losses) if reduction == "weighted" else len(losses))
            hidden.append(piece_hidden(model, piece)[:-1])
            targets += piece[1:]
            weights += [weight] * (len(piece) - 1)
    d = math.fsum(denominator)
    labels = torch.tensor(targets)
    bound, _, _ = linear_cross_entropy_bounds(
        torch.cat(hidden), model.head.detach(), smoothed_targets(labels, TOK.vocab_size, 0.0),
        torch.tensor(weights, dtype=torch.float64) / d)
    return math.fsum(numerator) / d, d, bound


def matches(disposition, want: tuple[float, float, float]) -> bool:
    loss, d, tolerance = want
    return disposition.denominator == d and abs(disposition.loss - loss) <= tolerance


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("reduction", ["weighted", "weighted_count"])
def test_weighted_window_equals_the_independent_objective_l3(tmp_path, reduction) -> None:
    batches = window(write_docs(tmp_path / "docs.jsonl"))
    long_in = {m for m, b in enumerate(batches) for row in b.segments for s in row
               if s.example_id == LONG}
    assert len(long_in) >= 2  # the split document spans microbatches (and so rows)
    engine = engine_for(reduction)
    want = expected(engine.model, reduction)
    disposition = engine.run_window(batches, 0)
    assert disposition.outcome.value == "COMMITTED"
    assert matches(disposition, want), (disposition.loss, disposition.denominator, want)


def per_physical_row(batch: Batch) -> Batch:
    """The wrong seam: each row weighted by its first document's weight."""
    first = batch.weights[:, :1].expand_as(batch.weights).clone()  # [B, T]
    return replace(batch, weights=first)


@pytest.mark.parametrize("reduction", ["weighted", "weighted_count"])
def test_negative_control_per_row_weights_or_no_weights_differ_l3(tmp_path, reduction) -> None:
    batches = window(write_docs(tmp_path / "docs.jsonl"))
    # some row holds documents of different weights, so the wrong seam matters
    assert any(len({float(b.weights[r, s.start]) for s in row}) > 1
               for b in batches for r, row in enumerate(b.segments))
    want = expected(PositionalLM(), reduction)
    per_row = engine_for(reduction).run_window([per_physical_row(b) for b in batches], 0)
    assert not matches(per_row, want)
    unweighted = engine_for("token_mean").run_window(batches, 0)
    assert not matches(unweighted, want)


def test_supervised_rows_carry_their_documents_weight_r6_l3(tmp_path) -> None:
    """Row addresses (R6) say which document owns each column; its weight is there."""
    batches = window(write_docs(tmp_path / "docs.jsonl"))
    for batch in batches:
        for r, row in enumerate(batch.segments):
            for seg in row:
                got = batch.weights[r, seg.start:seg.stop]
                assert torch.all(got == DOCS[seg.example_id][1])
        unsegmented = batch.segment_ids == 0
        assert torch.all(batch.weights[unsegmented] == 0)
        assert torch.all(batch.labels[unsegmented] == IGNORE_INDEX)


def test_an_empty_filler_microbatch_needs_no_weights_d1_l3(tmp_path) -> None:
    """A rank that ran out of data pads with empty microbatches (no weights, nothing
    supervised): the plan accepts them and D is unchanged. Supervised rows without
    weights are still refused, naming the reduction and the field."""
    from exactstep.errors import ObjectiveError
    from exactstep.objective import plan_window
    from exactstep.parallel.agreement import empty_microbatch

    batches = window(write_docs(tmp_path / "docs.jsonl"))
    cfg = ObjectiveConfig(reduction="weighted")
    alone = plan_window(batches, cfg)
    padded = plan_window([*batches, empty_microbatch(ROWS, SEQ, TOK.pad_id)], cfg)
    assert padded.denominator == alone.denominator == expected(PositionalLM(), "weighted")[1]
    with pytest.raises(ObjectiveError, match=r"objective.reduction = 'weighted' needs a "
                       r'numeric "weight" field'):
        plan_window([replace(batches[0], weights=None)], cfg)
