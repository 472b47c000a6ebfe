"""Encoder-decoder teacher forcing (R8): pairs -> a ``Batch`` with an encoder side.

The decoder is fed ``tgt[:-1]`` and scored on ``tgt[1:]`` (the shift, once, R1); the
encoder side rides in ``Batch.source``, its segment ``s`` paired with decoder segment
``s`` (R6). A pair is planned by one length that fits both sides and never split
(R4), and checked by its own R7 rules. The module also loads the pair data (S1).
Design and derivations: docs/design/families.md#familiesencdeccompilerpy (R8, R1, R4, R6, R7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from exactstep.data.pairs import (
    NUMWORDS_SOURCE,
    Pair,
    is_val_pair,
    load_pairs_jsonl,
    numwords_pairs,
    pairs_fingerprint,
)
from exactstep.errors import BatchInvariantError, DataError
from exactstep.families.encdec.config import EncDecConfig
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment, SourceSide
from exactstep.rows.causal import example_weight
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import DataBundle, Example
from exactstep.rows.inspect import render_rows, token_label
from exactstep.rows.invariants import check_batch, fail_at
from exactstep.rows.packing import Piece
from exactstep.rows.sources import representation_of


def source_len_of(spec: EncDecConfig, seq_len: int) -> int:
    """Encoder columns per row: ``encdec.source_len``, or ``batch.seq_len`` when 0."""
    return spec.source_len or seq_len


def source_pad_of(spec: EncDecConfig, tokenizer: Any) -> int:
    """The encoder side's pad id: ``encdec.source_pad_id``, or the tokenizer's when < 0."""
    pad = spec.source_pad_id
    return tokenizer.pad_id if pad < 0 else pad


# ----------------------------------------------------------------------- examples


@dataclass(frozen=True, kw_only=True)
class PairExample(Example):
    """A pair: ``tokens`` is the target side (``BOS ... EOS``, every token after the
    first a target), ``source`` the encoder side, ``units`` its planner length
    (``pair_units``). A pair is indivisible: ``len`` is ``units`` and ``targets_in``
    counts the whole target side."""

    source: np.ndarray  # [m] int64
    units: int

    def __len__(self) -> int:
        return self.units

    def targets_in(self, start: int, stop: int) -> int:
        return len(self.tokens) - 1 if stop > max(start, 1) else 0


def pair_units(n_source: int, n_target: int, seq_len: int, source_len: int) -> int:
    """Planner length of a pair: ``max(n_target - 1, ceil(n_source * T / S))``, so
    that pairs whose units sum to at most ``T`` fit both sides of a row."""
    return max(n_target - 1, -(-n_source * seq_len // source_len))


@dataclass
class PairReport:
    """What encoding a split did to its pairs (the manifest's data section)."""

    pairs: int = 0
    kept: int = 0
    dropped: int = 0
    truncated: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def encode_pairs(pairs: Sequence[Pair], tokenizer: Any, *, seq_len: int, source_len: int,
                 overlong: str) -> tuple[list[PairExample], PairReport]:
    """``PairExample``s (``example_id`` = index among the kept pairs) under the
    over-long policy: a pair that does not fit is dropped (``"drop"``), truncated to
    ``source_len`` source and ``seq_len + 1`` target tokens (``"truncate"``), or
    refused (``"split"``: a pair is never split), each counted in the report. Raises
    ``DataError`` naming the pair for one that does not fit under ``"split"``."""
    bos = np.array([tokenizer.bos_id], dtype=np.int64)
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    report, out = PairReport(pairs=len(pairs)), []
    for pair in pairs:
        src = np.concatenate([tokenizer.encode_array(pair.source), eos])
        tgt = np.concatenate([bos, tokenizer.encode_array(pair.target), eos])
        if len(tgt) - 1 > seq_len or len(src) > source_len:
            if overlong == "drop":
                report.dropped += 1
                continue
            if overlong != "truncate":
                raise DataError(
                    f"pair {pair.name or pair.source!r} needs {len(tgt) - 1} decoder and "
                    f"{len(src)} encoder columns but a row has {seq_len} (batch.seq_len) and "
                    f"{source_len} (encdec.source_len); a pair cannot be split: raise them, or "
                    "set batch.overlong to 'drop' or 'truncate'"
                )
            report.truncated += 1
            src, tgt = src[:source_len], tgt[: seq_len + 1]
        out.append(PairExample(
            example_id=len(out), tokens=tgt, source=src, weight=pair.weight,
            units=pair_units(len(src), len(tgt), seq_len, source_len)))
    report.kept = len(out)
    return out, report


# ----------------------------------------------------------------------- compiler


@dataclass(frozen=True)
class PairPiece:
    """One pair as a compiler lays it out: the address (``example_id``, ``piece``) and
    both sides' tokens. ``compile_pair_batch`` is shared with the families that build
    their pairs at compile time (span corruption draws them per piece)."""

    example_id: int
    piece: int
    source: np.ndarray  # [m] int64, the encoder's tokens
    target: np.ndarray  # [n] int64, decoder input target[:-1], labels target[1:]
    weight: float | None = None


def compile_pair_batch(
    rows: Sequence[Sequence[PairPiece]],
    *,
    seq_len: int,
    source_len: int,
    pad_id: int,
    source_pad_id: int,
    positions: str = "reset",
    weighted: bool = False,
) -> Batch:
    """One ``Batch`` of ``len(rows)`` rows: ``seq_len`` decoder and ``source_len``
    encoder columns. Each pair's decoder columns hold ``target[:-1]`` labelled
    ``target[1:]`` (R1); its source is encoder segment ``s`` for decoder segment
    ``s``; padding is ``pad_id`` / ``source_pad_id``, ``IGNORE_INDEX``, position 0,
    segment 0 (docs/design/families.md#familiesencdeccompilerpy). Raises ``DataError`` when
    a row's pairs overflow a side (a planner that ignored the units)."""
    B = len(rows)
    ids = np.full((B, seq_len), pad_id, dtype=np.int64)
    labels = np.full((B, seq_len), IGNORE_INDEX, dtype=np.int64)
    pos = np.zeros((B, seq_len), dtype=np.int64)
    seg = np.zeros((B, seq_len), dtype=np.int32)
    weights = np.zeros((B, seq_len), dtype=np.float32) if weighted else None
    s_ids = np.full((B, source_len), source_pad_id, dtype=np.int64)
    s_pos = np.zeros((B, source_len), dtype=np.int64)
    s_seg = np.zeros((B, source_len), dtype=np.int32)
    dec_rows, enc_rows = [], []
    for r, row in enumerate(rows):
        col = scol = 0
        dec, enc = [], []
        for s, p in enumerate(row, start=1):
            n, m = len(p.target) - 1, len(p.source)
            if col + n > seq_len or scol + m > source_len:
                raise DataError(f"row {r}: pair {p.example_id} overflows the row "
                                f"({col + n} > {seq_len} or {scol + m} > {source_len})")
            ids[r, col:col + n] = p.target[:-1]
            labels[r, col:col + n] = p.target[1:]
            pos[r, col:col + n] = np.arange(n) if positions == "reset" else np.arange(col, col + n)
            seg[r, col:col + n] = s
            if weights is not None:
                weights[r, col:col + n] = p.weight
            s_ids[r, scol:scol + m] = p.source
            s_pos[r, scol:scol + m] = (np.arange(m) if positions == "reset"
                                       else np.arange(scol, scol + m))
            s_seg[r, scol:scol + m] = s
            dec.append(Segment(p.example_id, p.piece, 0, col, n))
            enc.append(Segment(p.example_id, p.piece, 0, scol, m))
            col, scol = col + n, scol + m
        dec_rows.append(tuple(dec))
        enc_rows.append(tuple(enc))
    source = SourceSide(torch.from_numpy(s_ids), torch.from_numpy(s_pos),
                        torch.from_numpy(s_seg), tuple(enc_rows))
    return Batch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(pos),
                 torch.from_numpy(seg), tuple(dec_rows),
                 weights=None if weights is None else torch.from_numpy(weights), source=source)


class EncDecCompiler:
    """The encoder-decoder teacher-forcing compiler
    (docs/design/families.md#familiesencdeccompilerpy)."""

    name = "encdec"

    def __init__(self, *, source_len: int, pad_id: int, source_pad_id: int) -> None:
        self.source_len = source_len
        self.pad_id = pad_id
        self.source_pad_id = source_pad_id

    def capacity(self, cfg: BatchConfig) -> int:
        return cfg.seq_len

    def compile(self, rows: Sequence[Sequence[Piece]], examples: Sequence[Example],
                cfg: BatchConfig, *, pad_id: int, weighted: bool) -> Batch:
        pieces = [[self.piece(examples[p.example], p, weighted) for p in row] for row in rows]
        return compile_pair_batch(pieces, seq_len=cfg.seq_len, source_len=self.source_len,
                                  pad_id=pad_id, source_pad_id=self.source_pad_id,
                                  positions=cfg.positions, weighted=weighted)

    @staticmethod
    def piece(example: Example, piece: Piece, weighted: bool) -> PairPiece:
        if not isinstance(example, PairExample):
            raise DataError(f"example {example.example_id} is not a (source, target) pair; "
                            "objective.family = 'encdec' reads pairs (data.source)")
        return PairPiece(example.example_id, piece.piece, example.source, example.tokens,
                         example_weight(example) if weighted else None)

    def check(self, batch: Batch, vocab_size: int | None, cfg: BatchConfig) -> None:
        check_batch(batch, vocab_size, "keep")  # the last decoder column IS supervised
        check_teacher_forcing(batch, self.pad_id)
        check_source(batch, vocab_size, self.source_len)

    def render(self, batch: Batch, tokenizer: Any, rows: range) -> str:
        return render_pairs(batch, tokenizer, rows)


def check_teacher_forcing(batch: Batch, pad_id: int) -> None:
    """R1/R7 for the decoder side: every real decoder column supervised, each label
    the next decoder input inside its segment, no target the pad id;
    ``BatchInvariantError`` naming the example."""
    inputs, labels, segs = batch.input_ids, batch.labels, batch.segment_ids
    supervised = labels != IGNORE_INDEX
    fail_at(batch, (segs > 0) & ~supervised,
            "a decoder column has no target (label {value}): the decoder input must be "
            "tgt[:-1], every column predicting the next target token", labels)
    inner = torch.zeros_like(supervised)
    inner[:, :-1] = (segs[:, :-1] == segs[:, 1:]) & (segs[:, :-1] > 0)
    wrong = torch.zeros_like(supervised)
    wrong[:, :-1] = inner[:, :-1] & (labels[:, :-1] != inputs[:, 1:])
    fail_at(batch, wrong, "label {value} is not the next decoder input of its segment: the "
            "shift is missing or doubled (R1)", labels)
    fail_at(batch, supervised & (labels == pad_id),
            "a target is the pad id ({value}): ntokens counts non-pad targets only", labels)


def check_source(batch: Batch, vocab_size: int | None, source_len: int) -> None:
    """The encoder side: present, ``[B, source_len]``, ids in the vocabulary, its
    segments matching its ids and paired one to one with the decoder's."""
    source = batch.source
    if source is None:
        raise BatchInvariantError("an encoder-decoder batch has no encoder side (batch.source)")
    want = (batch.shape[0], source_len)
    for name in ("input_ids", "position_ids", "segment_ids"):
        got = tuple(getattr(source, name).shape)
        if got != want:
            raise BatchInvariantError(f"source.{name} has shape {got}, expected {want}")
    ids = source.input_ids
    bad = (ids < 0) if vocab_size is None else (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        b, j = (int(x) for x in torch.nonzero(bad)[0])
        raise BatchInvariantError(f"source row {b} column {j}: id {int(ids[b, j])} is outside "
                                  "the vocabulary")
    expected = np.zeros(want, dtype=np.int32)
    for b, (dec, enc) in enumerate(zip(batch.segments, source.segments, strict=True)):
        if len(dec) != len(enc) or any((d.example_id, d.piece) != (e.example_id, e.piece)
                                       for d, e in zip(dec, enc, strict=False)):
            raise BatchInvariantError(
                f"row {b}: decoder segments {[d.example_id for d in dec]} and encoder segments "
                f"{[e.example_id for e in enc]} do not pair up example by example")
        for k, e in enumerate(enc, start=1):
            expected[b, e.start:e.stop] = k
    if not np.array_equal(source.segment_ids.numpy(), expected):
        raise BatchInvariantError("source.segment_ids disagree with source.segments "
                                  "(segment k carries id k, padding 0)")


def render_pairs(batch: Batch, tokenizer: Any, rows: range) -> str:
    """The decoder rows (input, target, own, causal span) and, under each, the encoder
    side: every source segment with its columns and tokens, and what each decoder
    segment cross-attends to."""
    chosen = [b for b in rows if 0 <= b < batch.shape[0]]
    if not chosen:
        return render_rows(batch, tokenizer, rows)
    source = batch.source
    blocks = []
    for b in chosen:
        lines = [render_rows(batch, tokenizer, range(b, b + 1)), f"  encoder side (row {b}):"]
        real = sum(e.length for e in source.segments[b])
        lines.append(f"    {len(source.segments[b])} segment(s), {real} tokens, "
                     f"{source.shape[1] - real} padding (never attended, never scored)")
        ids = source.input_ids[b].tolist()
        for s, (d, e) in enumerate(zip(batch.segments[b], source.segments[b], strict=True),
                                   start=1):
            shown = " ".join(token_label(tokenizer, t) for t in ids[e.start:e.stop])
            lines.append(f"    source segment {s}: example {e.example_id} at cols "
                         f"{e.start}..{e.stop - 1}: {shown}")
            lines.append(f"      decoder cols {d.start}..{d.stop - 1} cross-attend to source "
                         f"cols {e.start}..{e.stop - 1} (bidirectional inside the segment)")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# --------------------------------------------------------------------------- data


def split_pairs(cfg: Any, spec: EncDecConfig) -> tuple[list[Pair], list[Pair], str]:
    """(train, val, split rule) of the run's pairs: the built-in numwords task or a
    pairs JSONL (``data.pairs``)."""
    data = cfg.data
    if data.source == NUMWORDS_SOURCE:
        n_train = min(spec.n_train, data.max_docs) if data.max_docs else spec.n_train
        train = numwords_pairs(cfg.seed, n_train, split="train", max_value=spec.max_value)
        val = numwords_pairs(cfg.seed, spec.n_heldout, split="heldout", max_value=spec.max_value)
        return train, val, ("numwords: sha256(digits)[0] % 10 == 0 is held out; val = "
                            "distinct held-out numbers")
    pairs = load_pairs_jsonl(data.source)
    if data.max_docs:
        pairs = pairs[: data.max_docs]
    train = [p for p in pairs if not is_val_pair(p, data.val_fraction)]
    val = [p for p in pairs if is_val_pair(p, data.val_fraction)]
    if not train or not val:
        which = "validation" if not val else "training"
        raise DataError(f"the {which} split of {data.source!r} is empty ({len(pairs)} pairs, "
                        f"data.val_fraction = {data.val_fraction}); change data.val_fraction "
                        "or add pairs")
    return train, val, f"sha256([source, target]) / 2^64 < {data.val_fraction} is val"


def load_pair_bundle(cfg: Any, spec: EncDecConfig, tokenizer: Any, *,
                     share: tuple[int, int] = (0, 1)) -> DataBundle:
    """Both splits as ``PairExample``s, with the manifest's data and representation
    sections (S1); ``spec`` is the run's ``encdec`` section. Raises ``DataError`` for
    bad pairs (file and line named) or a pair that does not fit a row (see
    ``encode_pairs``). ``share`` is unused: pairs are never prepared shards."""
    train_pairs, val_pairs, rule = split_pairs(cfg, spec)
    seq_len = cfg.batch.seq_len
    source_len = source_len_of(spec, seq_len)
    train, train_report = encode_pairs(train_pairs, tokenizer, seq_len=seq_len,
                                       source_len=source_len, overlong=cfg.batch.overlong)
    val, val_report = encode_pairs(val_pairs, tokenizer, seq_len=seq_len,
                                   source_len=source_len, overlong=cfg.batch.overlong)
    if not train or not val:
        raise DataError("every pair of a split was dropped as too long for a row; raise "
                        "batch.seq_len or encdec.source_len")
    section = {
        "source": cfg.data.source,
        "kind": "pairs",
        "fingerprint": pairs_fingerprint(train_pairs, val_pairs),
        "split": rule,
        "train_documents": len(train),
        "val_documents": len(val),
        "pairs_train": train_report.to_dict(),
        "pairs_val": val_report.to_dict(),
        "source_len": source_len,
        "encdec": asdict(spec),
    }
    bundle = DataBundle(train, val, section, representation_of(tokenizer))
    bundle.require_weights(cfg.objective.reduction)
    return bundle
