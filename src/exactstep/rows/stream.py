"""Batches from examples, with an exact, resumable cursor (R1-R4, R7, R8, D3, S2).

``RowStream`` composes the packing plan, a family's compiler and its R7 checks; every
family shares the planner and the cursor, so resuming from ``state_dict()`` gives
bitwise the same batches (S2, S5). ``report()`` is the data report (R4);
``eval_batches`` gives held-out batches, every example once.
Design and derivations: docs/design/rows.md#rowsstreampy (R1-R4, R7, R8, D3, S2, S5, L3).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from exactstep.rows.batch import Batch
from exactstep.rows.compiler import CAUSAL, RowCompiler
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example, all_weighted
from exactstep.rows.packing import PackPlanner, PlannerSnapshot


class BatchSource:
    """Anything with ``next_batch() -> Batch | None`` (``None``: a finite stream has
    ended) iterates over its batches, continuing from where it stands."""

    def next_batch(self) -> Batch | None:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Batch]:
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            yield batch


class RowStream(BatchSource):
    """Rows packed from ``examples`` and compiled by ``compiler`` (R8).

    Every batch has ``cfg.rows`` rows of ``cfg.seq_len`` columns, except the last
    batch of a finite stream (``repeat=False``), which has fewer rows rather than
    losing data. ``state_dict()`` loaded into a fresh stream of the same examples and
    settings continues with bitwise the same batches (S2, S5). Batches carry
    ``weights`` when every example has one (L3). Design:
    docs/design/rows.md#rowsstreampy.

    ``seed`` and the epoch fix the permutation; ``rank``/``world`` shard it (D3).
    ``vocab_size``, when given, bounds every id in the R7 checks (pass the
    tokenizer's). Iterating again continues from the current position.
    Raises ``DataError`` when there is nothing to pack and ``BatchInvariantError``
    (with ``cfg.check_invariants``) if a compiled batch breaks R7.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        cfg: BatchConfig,
        *,
        pad_id: int,
        seed: int,
        repeat: bool = True,
        shuffle: bool = True,
        rank: int = 0,
        world: int = 1,
        vocab_size: int | None = None,
        compiler: RowCompiler = CAUSAL,
    ) -> None:
        self.examples = examples
        self.cfg = cfg
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self.compiler = compiler
        self.planner = PackPlanner(
            examples,
            seq_len=compiler.capacity(cfg),
            buffer=cfg.buffer,
            overlong=cfg.overlong,
            seed=seed,
            shuffle=shuffle,
            repeat=repeat,
            rank=rank,
            world=world,
            cost=piece_cost(compiler, cfg),
        )
        self.weighted = all_weighted(examples)  # batches carry weights (L3)
        self._make = batch_maker(compiler, examples, cfg, pad_id, vocab_size,
                                 weighted=self.weighted)
        self.batches = 0
        self.supervised_rows = 0
        self.boundary_targets = 0

    def next_batch(self) -> Batch | None:
        """The next batch, or ``None`` at the end of a finite stream."""
        rows = self.planner.next_plan(self.cfg.rows)
        if not rows:
            return None
        batch, targets = self._make(rows)
        self.batches += 1
        self.supervised_rows += targets
        if self.cfg.boundary == "keep":
            self.boundary_targets += sum(max(len(segs) - 1, 0) for segs in batch.segments)
        return batch

    def __reduce__(self):
        """A fresh stream of the same recipe (examples, settings, compiler) at this
        one's position, so the copy continues bitwise like the original (S2)."""
        return (restore_stream, (self.examples, self.cfg, self.pad_id, self.vocab_size,
                                 self.compiler, self.recipe(), self.state_dict()))

    def recipe(self) -> dict:
        """The order's settings this stream was built with (its planner holds them)."""
        p = self.planner
        return {"seed": p.seed, "repeat": p.repeat, "shuffle": p.shuffle, "rank": p.rank,
                "world": p.world}

    def close(self) -> None:
        """Nothing to release (``rows.background.BackgroundStream`` has a worker)."""

    def snapshot(self) -> StreamSnapshot:
        """The position after the batches yielded so far, cheap to take; its
        ``state_dict()`` is ``state_dict()`` now (what a loader keeps per batch)."""
        return StreamSnapshot(self.planner.snapshot(), self.batches, self.supervised_rows,
                              self.boundary_targets)

    def state_dict(self) -> dict:
        """JSON-serialisable position after the batches yielded so far (S2)."""
        return self.snapshot().state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batches counted in ``state``; raises
        ``ResumeError`` if ``state`` came from a stream with other settings."""
        self.planner.load_state_dict(state["planner"])
        self.batches = int(state["batches"])
        self.supervised_rows = int(state["supervised_rows"])
        self.boundary_targets = int(state["boundary_targets"])

    def report(self) -> dict:
        """The data report (R4): what was admitted, what each over-long outcome cost,
        and how well the rows were filled (``efficiency = real_tokens / slots``)."""
        return data_report(
            self.planner, self.cfg, self.batches, self.supervised_rows, self.boundary_targets
        )


@dataclass(frozen=True)
class StreamSnapshot:
    """A ``RowStream``'s position at one moment (``RowStream.snapshot``)."""

    planner: PlannerSnapshot
    batches: int
    supervised_rows: int
    boundary_targets: int

    def state_dict(self) -> dict:
        return {
            "planner": self.planner.state_dict(),
            "batches": self.batches,
            "supervised_rows": self.supervised_rows,
            "boundary_targets": self.boundary_targets,
        }


def restore_stream(examples: Sequence[Example], cfg: BatchConfig, pad_id: int,
                   vocab_size: int | None, compiler: RowCompiler, recipe: dict,
                   state: dict) -> RowStream:
    """The unpickled ``RowStream`` (``RowStream.__reduce__``): built again, then moved
    to ``state``."""
    stream = RowStream(examples, cfg, pad_id=pad_id, vocab_size=vocab_size,
                       compiler=compiler, **recipe)
    stream.load_state_dict(state)
    return stream


def piece_cost(compiler: RowCompiler, cfg: BatchConfig):
    """The compiler's charge per piece length (``piece_cost(cfg)``), or ``None`` for a
    compiler whose pieces take their length (docs/design/rows.md#charges-r8)."""
    charges = getattr(compiler, "piece_cost", None)
    return None if charges is None else charges(cfg)


def compile_rows(
    rows: list,
    examples: Sequence[Example],
    cfg: BatchConfig,
    pad_id: int,
    vocab_size: int | None,
    *,
    weighted: bool = False,
    compiler: RowCompiler = CAUSAL,
) -> Batch:
    """``compiler``'s batch of ``rows``, checked by its R7 checks when
    ``cfg.check_invariants``."""
    batch = compiler.compile(rows, examples, cfg, pad_id=pad_id, weighted=weighted)
    if cfg.check_invariants:
        compiler.check(batch, vocab_size, cfg)
    return batch


def batch_maker(
    compiler: RowCompiler,
    examples: Sequence[Example],
    cfg: BatchConfig,
    pad_id: int,
    vocab_size: int | None,
    *,
    weighted: bool,
) -> Callable[[list], tuple[Batch, int]]:
    """One stream's ``rows -> (batch, batch.num_targets())``, the batch as
    ``compile_rows`` makes it: the compiler's own where it has one
    (``batch_maker``, ``rows.compiler``), else ``compile_rows`` and the count."""
    own = getattr(compiler, "batch_maker", None)
    if own is not None:
        return own(examples, cfg, pad_id=pad_id, weighted=weighted, vocab_size=vocab_size)

    def make(rows: list) -> tuple[Batch, int]:
        batch = compile_rows(rows, examples, cfg, pad_id, vocab_size, weighted=weighted,
                             compiler=compiler)
        return batch, batch.num_targets()

    return make


def data_report(
    planner: PackPlanner,
    cfg: BatchConfig,
    batches: int,
    supervised_rows: int,
    boundary_targets: int,
) -> dict:
    """Counts of ``planner`` (R4); slots and efficiency are in planner tokens
    (``planner.seq_len`` per row: the compiler's capacity)."""
    c = planner.counts
    slots = c.rows * planner.seq_len
    return {
        "documents": c.documents,
        "tokens": c.tokens,
        "targets": c.targets,
        "supervised_rows": supervised_rows,
        "boundary_targets_kept": boundary_targets,
        "overlong_policy": cfg.overlong,
        "split_documents": c.split_documents,
        "split_pieces": c.split_pieces,
        "split_targets_lost": c.split_targets_lost,
        "split_repeated_tokens": c.split_repeated_tokens,
        "truncated_documents": c.truncated_documents,
        "truncated_tokens": c.truncated_tokens,
        "truncated_targets_lost": c.truncated_targets_lost,
        "dropped_documents": c.dropped_documents,
        "dropped_tokens": c.dropped_tokens,
        "dropped_targets_lost": c.dropped_targets_lost,
        "pending_pieces": planner.pending_pieces,
        "epoch": planner.epoch,
        "batches": batches,
        "rows": c.rows,
        "slots": slots,
        "real_tokens": c.real_tokens,
        "padding_tokens": slots - c.real_tokens,
        "efficiency": c.real_tokens / slots if slots else 0.0,
    }


def eval_batches(
    examples: Sequence[Example],
    cfg: BatchConfig,
    *,
    pad_id: int,
    vocab_size: int | None = None,
    compiler: RowCompiler = CAUSAL,
) -> Iterator[Batch]:
    """Held-out batches: unshuffled, packed deterministically, every example once.

    Over-long examples are always split, with one token of overlap per cut, so every
    owned target of every example is supervised exactly once (L5 needs all of them),
    whatever ``cfg.overlong`` says for training. The last batch may have fewer rows.
    """
    planner = PackPlanner(
        examples,
        seq_len=compiler.capacity(cfg),
        buffer=cfg.buffer,
        overlong="split",
        seed=0,
        shuffle=False,
        repeat=False,
        overlap_split=True,
        cost=piece_cost(compiler, cfg),
    )
    while True:
        rows = planner.next_plan(cfg.rows)
        if not rows:
            return
        yield compile_rows(rows, examples, cfg, pad_id, vocab_size, compiler=compiler)
