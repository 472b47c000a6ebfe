"""The compiler seam: rows of planned pieces -> one ``Batch`` (R8).

Every objective family is a ``RowCompiler``: the planner (``rows.packing``) decides
which pieces fill each row; the compiler turns them into tensors and owns the shift
(R1), the targets, the visibility and its R7 checks. ``CausalCompiler`` serves
causal LM and chat SFT.
Design and derivations: docs/design/rows.md#rowscompilerpy (R8, R1, R7, S5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from exactstep.rows.batch import Batch
from exactstep.rows.causal import causal_screened, compile_causal_batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.invariants import check_batch, screen_settings
from exactstep.rows.packing import Piece


class RowCompiler(Protocol):
    """One family's compiler: rows of planned pieces -> a ``Batch`` (R8).

    Its output depends only on the rows, the examples and its own settings (seed
    included), so a resumed stream compiles bitwise the same batches (S5); a
    stochastic compiler draws from a generator addressed by ``(seed, piece.epoch,
    example id, piece)``; ``labels`` are row-aligned targets, never on padding.
    Optional members (``batch_maker``, ``render``, ``piece_cost``):
    docs/design/rows.md#rowscompilerpy.
    """

    name: str

    def capacity(self, cfg: BatchConfig) -> int:
        """Planner tokens one row holds (``cfg.seq_len`` for the decoder families)."""
        ...

    def compile(
        self,
        rows: Sequence[Sequence[Piece]],
        examples: Sequence[Example],
        cfg: BatchConfig,
        *,
        pad_id: int,
        weighted: bool,
    ) -> Batch:
        """The ``Batch`` of ``rows`` (``len(rows)`` rows of ``cfg.seq_len`` columns)."""
        ...

    def check(self, batch: Batch, vocab_size: int | None, cfg: BatchConfig) -> None:
        """The R7 checks this family's batches must pass; raises
        ``BatchInvariantError`` naming the example."""
        ...


class CausalCompiler:
    """Causal LM and chat SFT (``rows.causal``): the shift happens once, here (R1),
    ownership comes from the examples (R5), every supervised label is the next
    column's input (the R7 shift check)."""

    name = "causal"

    def capacity(self, cfg: BatchConfig) -> int:
        return cfg.seq_len

    def compile(
        self,
        rows: Sequence[Sequence[Piece]],
        examples: Sequence[Example],
        cfg: BatchConfig,
        *,
        pad_id: int,
        weighted: bool,
    ) -> Batch:
        return compile_causal_batch(
            rows,
            examples,
            seq_len=cfg.seq_len,
            pad_id=pad_id,
            boundary=cfg.boundary,
            positions=cfg.positions,
            weighted=weighted,
        )

    def check(self, batch: Batch, vocab_size: int | None, cfg: BatchConfig) -> None:
        check_batch(batch, vocab_size, cfg.boundary, next_token_targets=True)

    def batch_maker(
        self,
        examples: Sequence[Example],
        cfg: BatchConfig,
        *,
        pad_id: int,
        weighted: bool,
        vocab_size: int | None,
    ) -> Callable[[Sequence[Sequence[Piece]]], tuple[Batch, int]]:
        """``compile``, ``check`` (with ``cfg.check_invariants``) and the supervised
        count for one stream, as one function of the rows: the same batch, the same
        errors and the same count as the three calls. The kernel's screen clears a
        clean batch over prepared shards in the call that fills it; any other goes
        through ``check``."""
        check = cfg.check_invariants
        screened = causal_screened(
            examples, seq_len=cfg.seq_len, pad_id=pad_id, boundary=cfg.boundary,
            positions=cfg.positions, weighted=weighted,
            screen=screen_settings(vocab_size, cfg.boundary, next_token_targets=True)
            if check else None)

        def make(rows: Sequence[Sequence[Piece]]) -> tuple[Batch, int]:
            batch, clean, count = screened(rows)
            if check and not clean:
                self.check(batch, vocab_size, cfg)
            return batch, count

        return make


CAUSAL = CausalCompiler()
