"""Cheap checks at the rows boundary (R7), before any model or loss sees a batch.

``check_batch`` raises ``BatchInvariantError`` naming the example (its row address,
R6) for bad shapes or ids, a label on padding, a target crossing a segment under
``boundary = "ignore"`` and a missing or doubled shift (R1); a compiled screen
(``is_clean``) clears a clean host batch in one sweep.
Design and derivations: docs/design/rows.md#rowsinvariantspy (R7, R6, R1).
"""

from __future__ import annotations

import torch

from exactstep.errors import BatchInvariantError
from exactstep.rows import kernels
from exactstep.rows.batch import IGNORE_INDEX, Batch


def check_batch(
    batch: Batch,
    vocab_size: int | None,
    boundary: str = "ignore",
    *,
    next_token_targets: bool = False,
) -> None:
    """Raise ``BatchInvariantError`` naming the example for any R7 violation.

    Refused: mismatched shapes or an empty batch; ids outside ``[0, vocab_size)``;
    negative labels other than ``IGNORE_INDEX``; a supervised label on padding; under
    ``boundary = "ignore"`` a supervised last column of a segment; with
    ``next_token_targets`` a label that is not the next column's input (R1). The
    message names the row, the column and the example, piece and token offset there.
    ``vocab_size=None`` skips the upper bound on ids (negative ids are still refused).
    A batch that ``is_clean`` proves free of every violation returns at once; any
    other batch goes through each check in turn, so the first violation is reported.
    """
    check_shapes(batch)
    if is_clean(batch, vocab_size, boundary, next_token_targets=next_token_targets):
        return
    check_each(batch, vocab_size, boundary, next_token_targets=next_token_targets)


def check_each(
    batch: Batch,
    vocab_size: int | None,
    boundary: str = "ignore",
    *,
    next_token_targets: bool = False,
) -> None:
    """Every check of ``check_batch`` in turn (shapes already checked): raises for
    the first violation of the first check that finds one."""
    inputs, labels, segs = batch.input_ids, batch.labels, batch.segment_ids
    upper = vocab_size
    bad_input = inputs < 0 if upper is None else (inputs < 0) | (inputs >= upper)
    fail_at(
        batch, bad_input, "input id {value} is outside the vocabulary" + vocab_note(upper), inputs
    )
    supervised = labels != IGNORE_INDEX  # [B, T]
    fail_at(
        batch,
        (labels < 0) & supervised,
        f"label {{value}} is negative and not the ignore id {IGNORE_INDEX}",
        labels,
    )
    if upper is not None:
        fail_at(
            batch,
            labels >= upper,
            "label id {value} is outside the vocabulary" + vocab_note(upper),
            labels,
        )
    fail_at(batch, supervised & (segs == 0), "padding carries a supervised label {value}", labels)
    last_of_segment = torch.ones_like(supervised)  # [B, T]
    last_of_segment[:, :-1] = segs[:, :-1] != segs[:, 1:]
    if boundary == "ignore":
        fail_at(
            batch,
            supervised & last_of_segment & (segs > 0),
            "the last row of a segment is supervised (label {value}): a target that crosses "
            "a segment boundary under boundary = 'ignore'",
            labels,
        )
    if next_token_targets:
        wrong = torch.zeros_like(supervised)
        wrong[:, :-1] = supervised[:, :-1] & (labels[:, :-1] != inputs[:, 1:])
        wrong[:, -1] = supervised[:, -1]
        fail_at(
            batch,
            wrong,
            "label {value} is not the next token of the row: the shift is missing or doubled",
            labels,
        )


def is_clean(
    batch: Batch,
    vocab_size: int | None,
    boundary: str = "ignore",
    *,
    next_token_targets: bool = False,
) -> bool:
    """Whether ``check_batch`` would find nothing: the union of its conditions, one
    compiled sweep over host tensors of the batch's shapes (``False`` -- decide the
    long way -- for device tensors or other dtypes). Never ``True`` for a batch a check refuses.

    Two conditions are implied by others and not computed again: with
    ``next_token_targets``, a supervised label equal to the next column's input lies
    in the vocabulary whenever every input does; and a supervised last column of the
    row is refused by the shift check itself.
    """
    inputs, labels, segs = (t if t.is_contiguous() else t.contiguous()  # [B*T] row-major
                            for t in (batch.input_ids, batch.labels, batch.segment_ids))
    try:  # integer tensors, so none requires grad
        return kernels.screen(inputs, labels, segs, batch.labels.shape[1],
                              *screen_settings(vocab_size, boundary,
                                               next_token_targets=next_token_targets))
    except ValueError:  # not host tensors of the screen's dtypes and of one size
        return False


def screen_settings(vocab_size: int | None, boundary: str, *,
                    next_token_targets: bool) -> tuple[int, bool, bool]:
    """The compiled screen's settings for ``check_batch``'s arguments: ``(vocab_size``
    (-1: no upper bound)``, ignore_boundary, next_token)``, as ``rows.kernels.screen``
    and ``rows.kernels.CausalFill`` take them."""
    return (-1 if vocab_size is None else vocab_size, boundary == "ignore", next_token_targets)


def vocab_note(vocab_size: int | None) -> str:
    return "" if vocab_size is None else f" [0, {vocab_size})"


def check_shapes(batch: Batch) -> None:
    shape = tuple(batch.input_ids.shape)
    if len(shape) != 2 or 0 in shape:
        raise BatchInvariantError(
            f"empty or malformed input: input_ids has shape {shape}, expected [B>0, T>0]"
        )
    for name in ("labels", "position_ids", "segment_ids"):
        other = tuple(getattr(batch, name).shape)
        if other != shape:
            raise BatchInvariantError(f"{name} has shape {other} but input_ids has {shape}")
    if batch.weights is not None and tuple(batch.weights.shape) != shape:
        raise BatchInvariantError(
            f"weights has shape {tuple(batch.weights.shape)} but input_ids has {shape}"
        )
    if len(batch.segments) != shape[0]:
        raise BatchInvariantError(
            f"segments lists {len(batch.segments)} rows but input_ids has {shape[0]}"
        )


def fail_at(batch: Batch, bad: torch.Tensor, what: str, values: torch.Tensor) -> None:
    """Raise for the first ``True`` of ``bad`` (row-major), naming the row address."""
    if not bool(bad.any()):
        return
    flat = int(torch.nonzero(bad.reshape(-1))[0, 0])
    b, i = divmod(flat, bad.shape[1])
    value = int(values[b, i])
    raise BatchInvariantError(f"{where(batch, b, i)}: {what.format(value=value)}")


def where(batch: Batch, b: int, i: int) -> str:
    """``row b column i (example E, piece P, token K)`` or ``... (padding)``."""
    for seg in batch.segments[b] if b < len(batch.segments) else ():
        if seg.start <= i < seg.stop:
            token = seg.offset + i - seg.start
            return (
                f"row {b} column {i} (example {seg.example_id}, piece {seg.piece}, token {token})"
            )
    return f"row {b} column {i} (padding)"
