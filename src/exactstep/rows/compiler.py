"""The compiler seam: rows of planned pieces -> one ``Batch`` (R8).

Every objective family is a compiler from examples to the same ``Batch`` type. The
packing planner (``rows.packing``) decides which pieces of which examples fill each
row, knowing only lengths; the family's compiler turns those rows into tensors and
owns everything the family means: where the shift happens (R1), which positions are
targets, how visibility is described (``segment_ids``, ``causal``, ``prefix_len``,
``source``, ``order``), and which R7 checks its batches must pass.

A compiler may also have ``batch_maker(examples, cfg, *, pad_id, weighted,
vocab_size) -> (rows -> (Batch, int))``: for one stream, its ``compile``, its
``check`` when ``cfg.check_invariants`` and the batch's ``num_targets()`` in one
step, with whatever the stream's settings fix resolved once; a stream then takes
it instead of the three (``rows.stream.batch_maker``; the causal compiler fills,
screens and counts prepared shards in one kernel call). It must give the same
batch, raise the same errors and count the same targets.

A compiler may also have ``render(batch, tokenizer, rows) -> str``: what
``exactstep inspect`` prints for its rows when ``rows.inspect.render_rows`` (input,
target, visibility span, ownership) does not show everything the family means
(sentinels, mask marks, the encoder side).

A compiler is also what fixes how many planner tokens one row holds
(``capacity``): the identity for the decoder families; a family that rewrites a
piece (span corruption shortens inputs) plans in the units it consumes. Such a
compiler may also have ``piece_cost(cfg) -> (length -> int)``: what a piece of a
given length is charged of the capacity when rows are filled (``rows.packing``,
"Charges"), so that rewritten pieces always fit their row.

Invariants every compiler keeps (checked by the tests of each family):

- its output depends only on the rows, the examples and its own settings (seed
  included), never on how many batches came before: a resumed stream compiles
  bitwise the same batches (S5);
- a stochastic compiler draws from a generator addressed by
  ``(seed, piece.epoch, example id, piece)``, so packing, sharding over ranks and
  resuming never change an example's draws;
- ``labels`` are row-aligned targets (``shift_owner == "collator"``) and are never
  on padding.
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
    """One family's compiler (see module doc)."""

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
        count for one stream (module doc): the kernel's screen clears a clean batch
        over prepared shards in the call that fills it; any other goes through
        ``check``."""
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
