"""The masked-LM compiler (R8, ``families.mlm.compiler``): the oracle, the rule's invariants, the
80/10/10 split, addressed draws, the R7 checks and the rows view.

Every check that could pass vacuously is also run on a deliberately wrong compiler
(``mlm_support.WRONG``) and must fail there.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mlm_reference import BOS, EOS, IGNORE_INDEX, MASK, PAD, SPECIAL, expected_batch
from mlm_support import (
    VOCAB,
    WRONG,
    BernoulliSelection,
    SharedStream,
    TargetsOnUnselected,
    WholeVocabularyRandom,
    alone,
    compile_rows,
    compiler,
    plan,
    random_examples,
    segment_view,
    text_example,
    violations,
)

from exactstep.config import load_config
from exactstep.errors import BatchInvariantError, ConfigError
from exactstep.families.mlm.compiler import MLMCompiler, selection_count
from exactstep.families.mlm.family import mlm_compiler
from exactstep.rows.batch import Batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.packing import Piece
from exactstep.rows.stream import RowStream

# A count outside mean +- 5 standard deviations of its binomial: a correct compiler
# fails such a check with probability below 1e-6 (the draws are fixed by the seeds,
# so each check is deterministic anyway).
SIGMAS = 5.0


def batch_lists(batch: Batch) -> dict[str, list]:
    actions = {0: "", 1: "mask", 2: "random", 3: "keep"}
    return {"input_ids": batch.input_ids.tolist(), "labels": batch.labels.tolist(),
            "position_ids": batch.position_ids.tolist(),
            "segment_ids": batch.segment_ids.tolist(),
            "actions": [[actions[a] for a in row] for row in batch.meta["mlm"].action.tolist()]}


# ----------------------------------------------------------------------------- the count rule


def test_selection_count_by_hand():
    # k = max(1, floor(0.15 * m + 0.5)) and 0 for an empty piece, worked out by hand
    table = {0: 0, 1: 1, 3: 1, 6: 1, 7: 1, 9: 1, 10: 2, 16: 2, 17: 3, 100: 15, 256: 38}
    assert {m: selection_count(m, 0.15) for m in table} == table
    assert selection_count(5, 1.0) == 5 and selection_count(4, 0.5) == 2
    assert selection_count(5, 0.5) == 3  # 2.5 + 0.5 = 3: half rounds up


def test_hand_compiled_examples():
    """Two rates whose outcome needs no random number: everything masked, everything kept."""
    ex = [text_example(0, [104, 105, 33]), text_example(1, [120])]  # "hi!", "x"
    rows = [[Piece(0, 0, 5, 0), Piece(1, 0, 3, 0)]]
    every = compile_rows(compiler(mask_rate=1.0, replace_mask=1.0, replace_random=0.0),
                         rows, ex, 10)
    assert every.input_ids.tolist() == [[BOS, MASK, MASK, MASK, EOS, BOS, MASK, EOS, PAD, PAD]]
    assert every.labels.tolist() == [[-100, 104, 105, 33, -100, -100, 120, -100, -100, -100]]
    assert every.segment_ids.tolist() == [[1, 1, 1, 1, 1, 2, 2, 2, 0, 0]]
    assert every.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 0]]
    assert every.causal is False
    kept = compile_rows(compiler(mask_rate=1.0, replace_mask=0.0, replace_random=0.0),
                        rows, ex, 10)
    assert kept.input_ids.tolist() == [[BOS, 104, 105, 33, EOS, BOS, 120, EOS, PAD, PAD]]
    assert kept.labels.tolist() == every.labels.tolist()
    # one of three eligible tokens is selected at 15%, and the 1-byte example has its one
    default = compile_rows(compiler(), rows, ex, 10)
    assert [int((default.labels[0, a:b] != -100).sum()) for a, b in ((0, 5), (5, 8))] == [1, 1]


# ----------------------------------------------------------------------------- the oracle


@st.composite
def packings(draw):
    n = draw(st.integers(1, 12))
    examples = random_examples(n, draw(st.integers(0, 2**16)), lo=0, hi=draw(st.integers(1, 50)))
    seq_len = draw(st.integers(4, 48))
    rows = plan(examples, seq_len, draw(st.integers(1, 6)), seed=draw(st.integers(0, 99)),
                buffer=draw(st.integers(1, 8)))
    return examples, seq_len, rows


rates = st.tuples(st.floats(0.01, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0)).map(
    lambda t: (t[0], t[1], min(t[2], 1.0 - t[1])))


def oracle_agrees(cls, examples, seq_len, rows, seed, rate, p_mask, p_random,
                  positions="reset") -> bool:
    c = compiler(seed, cls, mask_rate=rate, replace_mask=p_mask, replace_random=p_random)
    got = batch_lists(compile_rows(c, rows, examples, seq_len, positions))
    want = expected_batch(rows, examples, seq_len=seq_len, seed=seed, rate=rate, p_mask=p_mask,
                          p_random=p_random, positions=positions)
    return got == want


@settings(max_examples=40, deadline=None)
@given(packings(), st.integers(0, 2**31), rates, st.sampled_from(["reset", "continue"]))
def test_compiler_equals_the_oracle(packing, seed, r, positions):
    assert oracle_agrees(MLMCompiler, *packing, seed, *r, positions)


def test_a_hand_checked_piece_of_the_oracle():
    """The oracle itself, on one piece, against a by-hand reading of its draws."""
    import mlm_reference as ref

    tokens = [BOS, *b"masked lm", EOS]
    inputs, labels, actions = ref.corrupt(tokens, (5, 0, 3, 0), 0.3, 0.8, 0.1)
    u, v, r = ref.draws(5, 0, 3, 0, 9, 3)  # 9 eligible bytes, 0.3 * 9 + 0.5 = 3.2 -> 3
    smallest = sorted(range(9), key=u.__getitem__)[:3]
    assert [c for c, a in enumerate(actions) if a] == sorted(1 + i for i in smallest)
    assert [labels[c] for c in sorted(1 + i for i in smallest)] == \
        [tokens[c] for c in sorted(1 + i for i in smallest)]
    for j, c in enumerate(sorted(1 + i for i in smallest)):
        assert actions[c] == ("mask" if v[j] < 0.8 else "random" if v[j] < 0.9 else "keep")


@pytest.mark.parametrize("name", ["targets on unselected positions", "one shared generator",
                                  "random from the whole vocabulary", "Bernoulli selection"])
def test_the_oracle_catches_every_wrong_compiler(name):
    examples = random_examples(30, seed=4, hi=60)
    rows = plan(examples, 64, 8)
    assert oracle_agrees(MLMCompiler, examples, 64, rows, 3, 0.15, 0.8, 0.1)
    assert not oracle_agrees(WRONG[name], examples, 64, rows, 3, 0.15, 0.8, 0.1)


# ----------------------------------------------------------------------------- invariants


@settings(max_examples=40, deadline=None)
@given(packings(), st.integers(0, 2**31), rates)
def test_invariants_hold_for_any_packing(packing, seed, r):
    examples, seq_len, rows = packing
    c = compiler(seed, mask_rate=r[0], replace_mask=r[1], replace_random=r[2])
    batch = compile_rows(c, rows, examples, seq_len)
    assert violations(batch, examples, r[0]) == []
    c.check(batch, VOCAB.normal.size + VOCAB.special.size, BatchConfig(seq_len=seq_len))


@pytest.mark.parametrize("cls", [TargetsOnUnselected, WholeVocabularyRandom, BernoulliSelection])
def test_the_invariant_checks_catch_wrong_compilers(cls):
    examples = random_examples(60, seed=1, hi=80)
    rows = plan(examples, 96, 24)
    rate, p_mask, p_random = (0.15, 0.0, 1.0) if cls is WholeVocabularyRandom else (0.15, .8, .1)
    c = compiler(2, mask_rate=rate, replace_mask=p_mask, replace_random=p_random)
    assert violations(compile_rows(c, rows, examples, 96), examples, rate) == []
    wrong = compiler(2, cls, mask_rate=rate, replace_mask=p_mask, replace_random=p_random)
    batch = compile_rows(wrong, rows, examples, 96)
    assert violations(batch, examples, rate)
    with pytest.raises(BatchInvariantError, match=r"row \d+ (column|columns) \d+"):
        wrong.check(batch, 260, BatchConfig(seq_len=96))


def binomial_ok(hits: int, n: int, p: float) -> bool:
    return abs(hits - n * p) <= SIGMAS * math.sqrt(n * p * (1 - p)) + 1e-9


def split_counts(c, examples, seq_len: int, n_rows: int) -> Counter:
    """Selected positions by what they show, read from inputs and the examples: the
    mask id, their own token (kept, or a random draw that hit it: 1 in 256), another."""
    out: Counter = Counter()
    batch = compile_rows(c, plan(examples, seq_len, n_rows), examples, seq_len)
    by_id = {e.example_id: e for e in examples}
    for b, row in enumerate(batch.segments):
        for seg in row:
            tokens = by_id[seg.example_id].tokens[seg.offset : seg.offset + seg.length]
            for k, t in enumerate(tokens.tolist()):
                col = seg.start + k
                if batch.labels[b, col] == IGNORE_INDEX:
                    continue
                shown = int(batch.input_ids[b, col])
                out["mask" if shown == MASK else "own" if shown == t else "other"] += 1
    return out


@pytest.mark.parametrize("p_mask,p_random", [(0.8, 0.1), (0.5, 0.3)])
def test_the_replacement_split_is_binomial(p_mask, p_random):
    """80/10/10 (and another split) over ~4500 selected positions, within 5 sigma."""
    examples = random_examples(400, seed=9, lo=60, hi=90)
    counts = split_counts(compiler(1, replace_mask=p_mask, replace_random=p_random),
                          examples, 128, 600)
    n = sum(counts.values())
    assert n > 4000
    p_keep = 1 - p_mask - p_random
    assert binomial_ok(counts["mask"], n, p_mask)
    assert binomial_ok(counts["other"], n, p_random * 255 / 256)
    assert binomial_ok(counts["own"], n, p_keep + p_random / 256)


def test_the_split_check_catches_a_wrong_split():
    """Negative control: a compiler run at 70/20/10 fails the 80/10/10 check."""
    examples = random_examples(400, seed=9, lo=60, hi=90)
    counts = split_counts(compiler(1, replace_mask=0.7, replace_random=0.2), examples, 128, 600)
    n = sum(counts.values())
    assert not (binomial_ok(counts["mask"], n, 0.8) and binomial_ok(counts["other"], n, 0.1))


def position_frequencies(cls, epochs: int) -> np.ndarray:
    """How often each of 40 eligible positions of one example is selected over epochs."""
    example = random_examples(1, seed=3, lo=40, hi=40)
    c = compiler(0, cls)
    freq = np.zeros(42, dtype=np.int64)
    for epoch in range(epochs):
        _, action = c.corrupt(example[0].tokens, 0, Piece(0, 0, 42, 0, epoch))
        freq += action != 0
    return freq[1:-1]


def test_selection_is_uniform_over_eligible_positions():
    """6 of 40 selected per epoch: each position in 6/40 of 1500 epochs, within 5 sigma;
    BOS and EOS never. Negative control: selecting the first k eligible positions."""
    freq = position_frequencies(MLMCompiler, 1500)
    assert all(binomial_ok(int(f), 1500, 6 / 40) for f in freq)

    class FirstK(MLMCompiler):
        def corrupt(self, tokens, example_id, piece):
            inputs, action = super().corrupt(tokens, example_id, piece)
            k = int((action != 0).sum())
            first = np.zeros_like(action)
            first[1 : 1 + k] = 1
            return np.where(first == 1, MASK, tokens), first

    assert not all(binomial_ok(int(f), 1500, 6 / 40) for f in position_frequencies(FirstK, 1500))


def test_random_replacements_are_uniform_and_never_special():
    """Everything selected, everything random: 200 bytes x 400 epochs = 80000 draws over
    the 256 non-special ids, each count within 5 sigma of 312.5; never a special id.
    The same counting on the whole-vocabulary variant sees special ids."""
    def draws(cls) -> np.ndarray:
        c = compiler(0, cls, mask_rate=1.0, replace_mask=0.0, replace_random=1.0)
        tokens = np.array([BOS, *([65] * 200), EOS], dtype=np.int64)
        shown = [c.corrupt(tokens, 7, Piece(0, 0, 202, 0, epoch))[0][1:-1] for epoch in range(400)]
        return np.bincount(np.concatenate(shown), minlength=260)

    counts = draws(MLMCompiler)
    assert counts[256:].sum() == 0
    assert all(binomial_ok(int(f), 80000, 1 / 256) for f in counts[:256])
    assert draws(WholeVocabularyRandom)[sorted(SPECIAL)].sum() > 0


# ----------------------------------------------------------------------------- addressing


def addressing_holds(cls, examples, rows, seq_len, seed=5) -> bool:
    """Each segment of the batch == its piece compiled alone, and == the same rows
    compiled in reverse order (another row, other neighbours)."""
    c = compiler(seed, cls)
    batch = compile_rows(c, rows, examples, seq_len)
    flipped = compile_rows(compiler(seed, cls), rows[::-1], examples, seq_len)
    n = len(rows)
    for b, row in enumerate(batch.segments):
        for seg, piece in zip(row, rows[b], strict=True):
            single = alone(compiler(seed, cls), piece, examples)
            view = segment_view(batch, b, seg.start, seg.stop)
            if view != segment_view(single, 0, 0, piece.length):
                return False
            other = flipped.segments[n - 1 - b]
            twin = next(s for s in other if (s.example_id, s.piece) == (seg.example_id, seg.piece))
            if view != segment_view(flipped, n - 1 - b, twin.start, twin.stop):
                return False
    return True


@settings(max_examples=25, deadline=None)
@given(packings(), st.integers(0, 2**31))
def test_an_example_compiles_the_same_in_any_row_beside_anything(packing, seed):
    examples, seq_len, rows = packing
    assert addressing_holds(MLMCompiler, examples, rows, seq_len, seed)


def test_the_addressing_check_catches_a_shared_stream():
    examples = random_examples(20, seed=2)
    rows = plan(examples, 48, 6)
    assert addressing_holds(MLMCompiler, examples, rows, 48)
    assert not addressing_holds(SharedStream, examples, rows, 48)


def test_any_rank_compiles_an_example_as_one_process_does():
    """Sharded over two ranks (D3), every piece a rank compiles equals that piece in a
    single-process epoch: the draws follow the example, not the rank's stream."""
    examples = random_examples(16, seed=6)
    c = compiler(8)
    single = {}
    for row in plan(examples, 40, 40):  # more rows than one epoch needs
        for piece in row:
            if piece.epoch == 0:
                single[piece.example, piece.piece] = segment_view(alone(c, piece, examples),
                                                                  0, 0, piece.length)
    seen = set()
    for rank in (0, 1):
        rows = [r for r in plan(examples, 40, 12, rank=rank, world=2)]
        batch = compile_rows(c, rows, examples, 40)
        for b, row in enumerate(batch.segments):
            for seg, piece in zip(row, rows[b], strict=True):
                if piece.epoch == 0:
                    want = single[piece.example, piece.piece]
                    assert segment_view(batch, b, seg.start, seg.stop) == want
                    seen.add((piece.example, piece.piece))
    assert seen == set(single)


@pytest.mark.parametrize("cls,same", [(MLMCompiler, True), (SharedStream, False)])
def test_a_resumed_stream_compiles_the_same_batches(cls, same):
    """S5 at the stream: state after 3 batches, loaded into a fresh stream (and a fresh
    compiler, as a new process has), continues bitwise. A shared generator does not."""
    examples = random_examples(30, seed=11)
    cfg = BatchConfig(seq_len=32, rows=3, buffer=5)
    straight = RowStream(examples, cfg, pad_id=PAD, seed=1, compiler=compiler(4, cls))
    batches = [straight.next_batch() for _ in range(8)]
    again = RowStream(examples, cfg, pad_id=PAD, seed=1, compiler=compiler(4, cls))
    for _ in range(3):
        again.next_batch()
    resumed = RowStream(examples, cfg, pad_id=PAD, seed=1, compiler=compiler(4, cls))
    resumed.load_state_dict(again.state_dict())
    later = [resumed.next_batch() for _ in range(5)]
    equal = all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
                for a, b in zip(batches[3:], later, strict=True))
    assert equal is same


def test_the_epoch_changes_the_mask_and_the_seed_too():
    tokens = random_examples(1, seed=0, lo=60, hi=60)[0].tokens
    c = compiler(0)
    first = c.corrupt(tokens, 0, Piece(0, 0, 62, 0, 0))[1]
    assert not np.array_equal(first, c.corrupt(tokens, 0, Piece(0, 0, 62, 0, 1))[1])
    assert not np.array_equal(first, compiler(1).corrupt(tokens, 0, Piece(0, 0, 62, 0, 0))[1])
    assert np.array_equal(first, compiler(0).corrupt(tokens, 0, Piece(0, 0, 62, 0, 0))[1])


# ----------------------------------------------------------------------------- R7 checks


def valid_batch() -> tuple[MLMCompiler, Batch]:
    examples = random_examples(12, seed=5, lo=10, hi=30)
    c = compiler(1)
    return c, compile_rows(c, plan(examples, 48, 4), examples, 48)


def edited(batch: Batch, **tensors) -> Batch:
    return dataclasses.replace(batch, **tensors)


def test_check_accepts_the_compiled_batch_and_names_the_example_when_broken():
    c, batch = valid_batch()
    cfg = BatchConfig(seq_len=48)
    c.check(batch, 260, cfg)
    record = batch.meta["mlm"]
    selected = record.action != 0
    b, col = (int(x) for x in torch.nonzero((~selected) & (batch.segment_ids > 0))[1])
    labels = batch.labels.clone()
    labels[b, col] = record.original[b, col]  # a target on an unselected position
    with pytest.raises(BatchInvariantError, match=rf"row {b} column {col} \(example \d+"):
        c.check(edited(batch, labels=labels), 260, cfg)
    b, col = (int(x) for x in torch.nonzero(selected)[0])
    wrong = batch.labels.clone()
    wrong[b, col] = (int(record.original[b, col]) + 1) % 256  # not the original token
    with pytest.raises(BatchInvariantError, match="not the original token"):
        c.check(edited(batch, labels=wrong), 260, cfg)
    shown = batch.input_ids.clone()
    unselected = torch.nonzero((~selected) & (batch.segment_ids > 0))[0]
    shown[tuple(unselected)] = MASK  # corrupted but not selected
    with pytest.raises(BatchInvariantError, match="not its original token"):
        c.check(edited(batch, input_ids=shown), 260, cfg)
    with pytest.raises(BatchInvariantError, match="not be causal"):
        c.check(edited(batch, causal=True), 260, cfg)
    with pytest.raises(BatchInvariantError, match="corruption record"):
        c.check(dataclasses.replace(batch, meta={}), 260, cfg)


def test_check_refuses_a_special_random_token_and_a_wrong_count():
    c, batch = valid_batch()
    record = batch.meta["mlm"]
    action = record.action.clone()
    b, col = (int(x) for x in torch.nonzero(action != 0)[0])
    action[b, col] = 2
    shown = batch.input_ids.clone()
    shown[b, col] = EOS
    meta = {"mlm": type(record)(record.original, action)}
    with pytest.raises(BatchInvariantError, match="special id"):
        c.check(edited(batch, input_ids=shown, meta=meta), 260, BatchConfig(seq_len=48))
    fewer = record.action.clone()
    fewer[b, col] = 0
    labels, shown = batch.labels.clone(), batch.input_ids.clone()
    labels[b, col], shown[b, col] = IGNORE_INDEX, record.original[b, col]
    meta = {"mlm": type(record)(record.original, fewer)}
    with pytest.raises(BatchInvariantError, match="the rule selects"):
        c.check(edited(batch, labels=labels, input_ids=shown, meta=meta), 260,
                BatchConfig(seq_len=48))


def test_special_tokens_inside_a_piece_are_never_selected():
    body = [MASK, 65, PAD, 66, BOS, 67, EOS, 68]  # specials by id wherever they sit
    ex = [text_example(0, body)]
    c = compiler(0, mask_rate=1.0)
    batch = compile_rows(c, [[Piece(0, 0, 10, 0)]], ex, 10)
    selected = [col for col, label in enumerate(batch.labels[0].tolist()) if label != -100]
    assert selected == [2, 4, 6, 8]


# ----------------------------------------------------------------------------- configuration


def test_mlm_settings_are_validated_with_the_key_named():
    assert load_config(None, []).mlm.mask_rate == 0.15
    for bad, key in (("mlm.mask_rate=0", "mlm.mask_rate"), ("mlm.mask_rate=1.5", "mlm.mask_rate"),
                     ("mlm.replace_random=-0.1", "mlm.replace_random"),
                     ("mlm.replace_mask=0.95", "replace_mask \\+ mlm.replace_random")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])


def test_boundary_keep_is_refused_and_the_passport_is_recorded():
    from exactstep.families import family_of, resolve

    cfg = resolve(load_config(None, ["objective.family=mlm", "batch.boundary=keep"]))
    with pytest.raises(ConfigError, match="batch.boundary = 'ignore'"):
        mlm_compiler(cfg, None)
    family = family_of(cfg)
    assert family.specials(cfg) == ("mask",) and family.model == "encoder"
    section = family.objective(cfg)
    assert section["family"] == "masked_lm" and section["ownership"] == "selected_positions"
    assert section["selection"]["keep"] == pytest.approx(0.1)


def test_inspect_shows_original_input_target_and_the_mask_marks(tmp_path, capsys):
    from exactstep.cli import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "document number {i} says hello"}}\n'
                              for i in range(30)))
    code = main(["inspect", "--set", "objective.family=mlm", "--set", f"data.source={corpus}",
                 "--set", "data.val_fraction=0.2", "--set", "batch.seq_len=40",
                 "--set", "batch.rows=2", "--rows", "0:2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "original" in out and "input" in out and "target" in out and "bidirectional" in out
    assert "<mask>" in out and " mask " in out
    assert out.count("row ") >= 2


def test_weighted_examples_weigh_every_column_of_their_pieces_l3():
    examples = [dataclasses.replace(e, weight=float(e.example_id + 1))
                for e in random_examples(8, seed=3, lo=5, hi=30)]
    rows = plan(examples, 32, 4)
    batch = compiler(0).compile(rows, examples, BatchConfig(seq_len=32, rows=4), pad_id=PAD,
                                weighted=True)
    expected = torch.zeros(batch.shape)
    for b, row in enumerate(batch.segments):
        for seg in row:
            expected[b, seg.start : seg.stop] = seg.example_id + 1
    assert torch.equal(batch.weights, expected)


def test_the_shipped_demo_is_a_masked_lm_run_at_berts_rates():
    from importlib import resources

    from exactstep.families.mlm.config import MLMConfig

    cfg = load_config(str(resources.files("exactstep") / "configs" / "mlm_stdlib.toml"))
    assert cfg.objective.family == "mlm" and cfg.mlm == MLMConfig()
    assert (cfg.mlm.mask_rate, cfg.mlm.replace_mask, cfg.mlm.replace_random) == (0.15, 0.8, 0.1)
