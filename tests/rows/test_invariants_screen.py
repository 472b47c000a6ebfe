"""The R7 screen: ``is_clean`` passes exactly the batches every check of
``check_each`` passes, for every setting, so the quick path never lets a bad batch
through (R7).

Expectation: ``check_each`` (each condition in turn, in torch) run on the same batch.
Batches: real packed rows (text and chat ownership, several segments per row,
padding) with one or a few slots corrupted at random -- an input or label id out of
range or negative, a label moved to padding, onto a segment's last column, or off
the next input, a segment id changed. Negative control: a screen that forgets the
row's last column lets batches through that the checks refuse.
"""

from __future__ import annotations

import numpy as np

from exactstep.errors import BatchInvariantError
from exactstep.rows import invariants
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.example import Example
from exactstep.rows.packing import PackPlanner

VOCAB, PAD, SEQ = 40, 39, 24
SETTINGS = [(vocab, boundary, shift) for vocab in (None, VOCAB)
            for boundary in ("ignore", "keep") for shift in (False, True)]


def base_batches(seed: int) -> list[Batch]:
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(30):
        n = int(rng.integers(1, 14))
        owned = None if i % 2 else rng.random(n) < 0.7
        examples.append(Example(i, rng.integers(0, PAD, n).astype(np.int64), owned))
    planner = PackPlanner(examples, seq_len=SEQ, buffer=6, overlong="split", seed=seed,
                          repeat=False)
    out = []
    while rows := planner.next_rows(3):
        for boundary in ("ignore", "keep"):
            out.append(compile_causal_batch(rows, examples, seq_len=SEQ, pad_id=PAD,
                                            boundary=boundary))
    return out


def corrupt(batch: Batch, rng: np.random.Generator) -> Batch:
    inputs, labels, segs = (t.clone() for t in (batch.input_ids, batch.labels,
                                                batch.segment_ids))
    rows, cols = inputs.shape
    for _ in range(int(rng.integers(1, 3))):
        b, i = int(rng.integers(rows)), int(rng.integers(cols))
        kind = int(rng.integers(7))
        if kind == 0:
            inputs[b, i] = int(rng.choice([-1, -100, VOCAB, VOCAB + 5, 3]))
        elif kind == 1:
            labels[b, i] = int(rng.choice([-1, -5, VOCAB, 2 * VOCAB, 0, 7]))
        elif kind == 2:
            labels[b, i] = IGNORE_INDEX
        elif kind == 3:  # a label that is the next input (right or not, by place)
            labels[b, i] = int(inputs[b, min(i + 1, cols - 1)])
        elif kind == 4:
            segs[b, i] = int(rng.integers(0, 4))
        elif kind == 5:
            segs[b, i:] = 0
        else:
            labels[b, i] = int(inputs[b, i])
    return Batch(inputs, labels, batch.position_ids, segs, batch.segments)


def refused(batch: Batch, vocab, boundary, shift) -> bool:
    try:
        invariants.check_each(batch, vocab, boundary, next_token_targets=shift)
    except BatchInvariantError:
        return True
    return False


def agreement(screen) -> tuple[int, int, int]:
    """(disagreements, refused, passed) of ``screen`` against ``check_each``."""
    rng = np.random.default_rng(0)
    wrong = bad = good = 0
    for seed in range(3):
        for batch in base_batches(seed):
            for candidate in [batch] + [corrupt(batch, rng) for _ in range(12)]:
                for vocab, boundary, shift in SETTINGS:
                    no = refused(candidate, vocab, boundary, shift)
                    clean = screen(candidate, vocab, boundary, next_token_targets=shift)
                    wrong += clean == no
                    bad += no
                    good += not no
    return wrong, bad, good


def test_screen_passes_exactly_what_every_check_passes() -> None:
    wrong, bad, good = agreement(invariants.is_clean)
    assert wrong == 0
    assert bad > 500 and good > 500  # both outcomes exercised under every setting


def test_check_batch_refuses_like_each_check() -> None:
    """``check_batch`` (screen first) raises exactly when ``check_each`` does, with
    the same message."""
    rng = np.random.default_rng(1)
    for batch in base_batches(4):
        candidate = corrupt(batch, rng)
        for vocab, boundary, shift in SETTINGS:
            messages = []
            for check in (invariants.check_batch, invariants.check_each):
                try:
                    check(candidate, vocab, boundary, next_token_targets=shift)
                    messages.append(None)
                except BatchInvariantError as exc:
                    messages.append(str(exc))
            assert messages[0] == messages[1]


def forgets_last_column(batch, vocab, boundary="ignore", *, next_token_targets=False):
    """Negative control: the screen without the rule that a row's last column is
    never supervised under either condition."""
    labels = batch.labels.clone()
    labels[:, -1] = IGNORE_INDEX
    return invariants.is_clean(Batch(batch.input_ids, labels, batch.position_ids,
                                     batch.segment_ids, batch.segments),
                               vocab, boundary, next_token_targets=next_token_targets)


def test_a_screen_without_the_last_column_rule_disagrees() -> None:
    wrong, _, _ = agreement(forgets_last_column)
    assert wrong > 0


def test_tensors_the_screen_cannot_read_go_the_long_way() -> None:
    """Labels that are not a plain host int64 tensor are never screened clean:
    ``check_each`` decides."""
    batch = base_batches(0)[0]
    floats = Batch(batch.input_ids, batch.labels.double().requires_grad_(),
                   batch.position_ids, batch.segment_ids, batch.segments)
    assert invariants.is_clean(batch, VOCAB)
    assert not invariants.is_clean(floats, VOCAB)
