"""Shared builders for the masked-LM tests: examples, plans, the compiler under test
and deliberately wrong compilers (each one must be caught by some test)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from mlm_reference import BOS, EOS, IGNORE_INDEX, MASK, PAD, SPECIAL

from exactstep.data.tokenizer import ByteTokenizer
from exactstep.families.mlm.compiler import MLMCompiler, Vocabulary
from exactstep.families.mlm.config import MLMConfig
from exactstep.rows.batch import Batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import PackPlanner, Piece

TOKENIZER = ByteTokenizer(("mask",))
VOCAB = Vocabulary.of(TOKENIZER)


def compiler(seed: int = 0, cls: type = MLMCompiler, **rates) -> MLMCompiler:
    return cls(MLMConfig(**rates), VOCAB, seed=seed)


def text_example(example_id: int, body: Sequence[int]) -> Example:
    return Example(example_id, np.array([BOS, *body, EOS], dtype=np.int64))


def random_examples(n: int, seed: int, lo: int = 1, hi: int = 40) -> list[Example]:
    """``n`` text examples of ``lo..hi`` random bytes (BOS + bytes + EOS)."""
    rng = np.random.default_rng(seed)
    return [text_example(i, rng.integers(0, 256, size=int(rng.integers(lo, hi + 1))).tolist())
            for i in range(n)]


def plan(examples: Sequence[Example], seq_len: int, n_rows: int, *, seed: int = 0,
         buffer: int = 6, rank: int = 0, world: int = 1) -> list[list[Piece]]:
    planner = PackPlanner(examples, seq_len=seq_len, buffer=buffer, overlong="split", seed=seed,
                          rank=rank, world=world)
    return planner.next_rows(n_rows)


def compile_rows(c, rows, examples, seq_len: int, positions: str = "reset") -> Batch:
    cfg = BatchConfig(seq_len=seq_len, rows=max(1, len(rows)), positions=positions)
    return c.compile(rows, examples, cfg, pad_id=PAD, weighted=False)


def alone(c, piece: Piece, examples) -> Batch:
    """The piece alone in one row (unpadded, but a row has at least two columns)."""
    return compile_rows(c, [[piece]], examples, max(2, piece.length))


def segment_view(batch: Batch, b: int, start: int, stop: int) -> tuple[list, list]:
    return batch.input_ids[b, start:stop].tolist(), batch.labels[b, start:stop].tolist()


# ----------------------------------------------------------------------------- wrong compilers


class TargetsOnUnselected(MLMCompiler):
    """WRONG: every eligible token is a target, selected or not (BERT's loss is on the
    selected positions only)."""

    def compile(self, rows, examples, cfg, *, pad_id, weighted):
        batch = super().compile(rows, examples, cfg, pad_id=pad_id, weighted=weighted)
        original = batch.meta["mlm"].original
        eligible = (batch.segment_ids > 0) & (original < 256)
        labels = torch.where(eligible, original, torch.full_like(original, IGNORE_INDEX))
        return Batch(batch.input_ids, labels, batch.position_ids, batch.segment_ids,
                     batch.segments, causal=False, meta=batch.meta)


class SharedStream(MLMCompiler):
    """WRONG: one generator for the whole stream, consumed piece after piece, so an
    example's mask depends on what was compiled before it (packing, resume)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rng = np.random.default_rng(self.seed)

    def corrupt(self, tokens, example_id, piece):
        from exactstep.families.mlm.compiler import corrupt_piece

        return corrupt_piece(tokens, self.rng, self.settings, self.vocab)


class WholeVocabularyRandom(MLMCompiler):
    """WRONG: random replacements drawn from the whole vocabulary, specials included."""

    def corrupt(self, tokens, example_id, piece):
        inputs, action = super().corrupt(tokens, example_id, piece)
        rng = np.random.default_rng([example_id, piece.piece, piece.epoch])
        random = np.flatnonzero(action == 2)
        inputs[random] = rng.integers(0, VOCAB.normal.size + VOCAB.special.size, size=random.size)
        return inputs, action


class BernoulliSelection(MLMCompiler):
    """WRONG for the documented rule: each eligible position selected independently
    with probability ``mask_rate`` (the count varies, and may be 0)."""

    def corrupt(self, tokens, example_id, piece):
        rng = np.random.default_rng([7, example_id, piece.piece, piece.epoch])
        eligible = ~np.isin(tokens, VOCAB.special)
        picked = eligible & (rng.random(tokens.shape[0]) < self.settings.mask_rate)
        inputs = tokens.copy()
        inputs[picked] = MASK
        action = np.where(picked, 1, 0).astype(np.int8)
        return inputs, action


WRONG = {"targets on unselected positions": TargetsOnUnselected,
         "one shared generator": SharedStream,
         "random from the whole vocabulary": WholeVocabularyRandom,
         "Bernoulli selection": BernoulliSelection}


def violations(batch: Batch, examples: Sequence[Example], rate: float) -> list[str]:
    """What the batch breaks of the rule's invariants, recomputed from the examples
    through the row addresses (never from the compiler's own record): the count, no
    special selected, labels only on selected positions and equal to the original
    token, unselected columns untouched, a selected column showing the mask id or a
    non-special token, padding unsupervised."""
    from mlm_reference import count

    by_id = {e.example_id: e for e in examples}
    found = []
    inputs, labels = batch.input_ids.tolist(), batch.labels.tolist()
    for b, row in enumerate(batch.segments):
        covered = set()
        for seg in row:
            tokens = by_id[seg.example_id].tokens[seg.offset : seg.offset + seg.length].tolist()
            cols = range(seg.start, seg.stop)
            covered.update(cols)
            chosen = [c for c in cols if labels[b][c] != IGNORE_INDEX]
            eligible = sum(t not in SPECIAL for t in tokens)
            if len(chosen) != count(eligible, rate):
                found.append(f"row {b} seg at {seg.start}: {len(chosen)} selected of {eligible}")
            for c, t in zip(cols, tokens, strict=True):
                if c in chosen:
                    if t in SPECIAL:
                        found.append(f"special {t} selected at {b},{c}")
                    if labels[b][c] != t:
                        found.append(f"label {labels[b][c]} is not the original {t} at {b},{c}")
                    if inputs[b][c] != MASK and inputs[b][c] in SPECIAL:
                        found.append(f"special {inputs[b][c]} shown at {b},{c}")
                elif inputs[b][c] != t:
                    found.append(f"unselected {b},{c} shows {inputs[b][c]}, not {t}")
        for c in set(range(batch.shape[1])) - covered:
            if labels[b][c] != IGNORE_INDEX or inputs[b][c] != PAD:
                found.append(f"padding {b},{c} is not plain padding")
    return found
