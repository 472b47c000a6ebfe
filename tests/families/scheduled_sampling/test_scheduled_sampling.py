"""Scheduled sampling (R8): declared schedule on the committed clock, addressed coins,
exact sequential input construction, and teacher forcing as its eps = 1 case."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from exactstep.families.scheduled_sampling.config import ScheduledSamplingConfig
from exactstep.families.scheduled_sampling.inputs import (
    ScheduledSampling,
    construct_inputs,
    model_input_mask,
)
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.objective.config import ObjectiveConfig
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

VOCAB, PAD = 259, 258
MODEL = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32)


def test_schedules_are_the_declared_closed_forms():
    def eps(clock, **kw):
        return ScheduledSamplingConfig(**kw).gold_probability(clock)

    for i in (0, 1, 50, 400):
        assert eps(i, schedule="inverse_sigmoid", k=20.0) == pytest.approx(
            20.0 / (20.0 + math.exp(i / 20.0)), rel=1e-15)
        assert eps(i, schedule="exponential", base=0.99) == pytest.approx(0.99 ** i, rel=1e-15)
    assert [eps(i, schedule="linear", slope=0.25) for i in range(6)] == [
        1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert [eps(i, schedule="linear", slope=0.25, floor=0.4) for i in range(4)] == [
        1.0, 0.75, 0.5, 0.4]
    assert eps(10**9, schedule="inverse_sigmoid") == 0.0  # no overflow far out
    assert eps(3, schedule="constant", probability=0.3) == 0.3


def examples(seed: int = 0, n: int = 6) -> list[Example]:
    rng = np.random.default_rng(seed)
    return [Example(i, np.concatenate([[256], rng.integers(0, 256, int(rng.integers(4, 9))),
                                       [257]]).astype(np.int64)) for i in range(n)]


def packed(exs: list[Example], rows: list[list[int]], seq_len: int = 32) -> Batch:
    pieces = [[Piece(i, 0, len(exs[i]), 0) for i in row] for row in rows]
    return compile_causal_batch(pieces, exs, seq_len=seq_len, pad_id=PAD)


def segment_mask(batch: Batch, mask: np.ndarray) -> dict[int, list[bool]]:
    return {s.example_id: mask[b, s.start:s.stop].tolist()
            for b, row in enumerate(batch.segments) for s in row}


def test_coins_are_addressed_by_example_not_by_where_it_was_packed():
    exs = examples()
    a = packed(exs, [[0, 1, 2], [3, 4, 5]])
    b = packed(exs, [[5, 3], [1, 0, 4], [2]])
    ma = model_input_mask(a, 0.5, seed=7, window=3)
    mb = model_input_mask(b, 0.5, seed=7, window=3)
    assert segment_mask(a, ma) == segment_mask(b, mb)
    assert segment_mask(a, ma) != segment_mask(a, model_input_mask(a, 0.5, seed=7, window=4))


def test_only_gold_inputs_can_be_replaced_never_a_first_token_or_a_prompt():
    exs = examples()
    owned = np.ones(len(exs[0]), dtype=bool)
    owned[:4] = False  # a prompt: tokens 0..3 are not targets
    exs[0] = Example(0, exs[0].tokens, owned=owned)
    batch = packed(exs, [[0, 1, 2], [3, 4, 5]])
    mask = model_input_mask(batch, 0.0, seed=1, window=0)  # every eligible input replaced
    for b, row in enumerate(batch.segments):
        for s in row:
            expected = [k >= 1 and bool(exs[s.example_id].owned is None
                                        or exs[s.example_id].owned[k]) for k in range(s.length)]
            assert mask[b, s.start:s.stop].tolist() == expected
    assert not mask[batch.segment_ids.numpy() == 0].any()  # padding
    assert not model_input_mask(batch, 1.0, seed=1, window=0).any()


@settings(max_examples=20, deadline=None)
@given(eps=st.floats(0.05, 0.95), seed=st.integers(0, 2**31))
def test_the_replaced_fraction_is_one_minus_eps(eps, seed):
    exs = [Example(i, np.arange(40, dtype=np.int64) % 250) for i in range(50)]
    batch = packed(exs, [[i] for i in range(50)], seq_len=40)
    mask = model_input_mask(batch, eps, seed=seed, window=0)
    n = 50 * 39
    sd = math.sqrt(n * eps * (1 - eps))
    assert abs(int(mask.sum()) - n * (1 - eps)) < 5 * sd  # 5 sigma: never flaky


def model():
    torch.manual_seed(0)
    return build_model(MODEL, VOCAB, seed=11)


def one_document(tokens: list[int]) -> Batch:
    n = len(tokens)
    ids = torch.tensor([tokens])
    return Batch(input_ids=ids, labels=torch.full_like(ids, IGNORE_INDEX),
                 position_ids=torch.arange(n)[None], segment_ids=torch.ones(1, n, dtype=torch.int32),
                 segments=((Segment(0, 0, 0, 0, n),),))


def oracle(m, batch: Batch, mask: np.ndarray) -> torch.Tensor:
    """Each document alone, token by token: a replaced input is the argmax of the model
    run on that document's inputs constructed so far (independent of packing)."""
    ids = batch.input_ids.clone()
    with torch.no_grad():
        for b, row in enumerate(batch.segments):
            for s in row:
                doc = ids[b, s.start:s.stop].tolist()
                for k in range(1, s.length):
                    if mask[b, s.start + k]:
                        hidden = m(one_document(doc[:k]))
                        doc[k] = int(F.linear(hidden[0, -1], m.head_weight).argmax())
                ids[b, s.start:s.stop] = torch.tensor(doc)
    return ids


def parallel_variant(m, batch: Batch, mask: np.ndarray) -> torch.Tensor:
    """The wrong, one-pass construction: every replacement predicted from gold inputs."""
    with torch.no_grad():
        predicted = F.linear(m(batch), m.head_weight).argmax(-1)  # [B, T]
    shifted = torch.cat([batch.input_ids[:, :1], predicted[:, :-1]], dim=1)
    return torch.where(torch.from_numpy(mask), shifted, batch.input_ids)


def test_sequential_construction_equals_the_per_document_oracle():
    m, exs = model(), examples(3)
    batch = packed(exs, [[0, 1, 2], [3, 4, 5]])
    mask = model_input_mask(batch, 0.0, seed=2, window=0)
    built = construct_inputs(m, batch, mask, autocast=contextlib.nullcontext)
    expected = oracle(m, batch, mask)
    assert torch.equal(built, expected)
    assert not torch.equal(built, batch.input_ids)  # the model's tokens went in
    # negative control: the one-pass shortcut is not the sequential construction
    assert not torch.equal(parallel_variant(m, batch, mask), expected)


def engine(m, inputs=None):
    update = UpdateConfig(lr=1e-2, warmup=0, accum=2, weight_decay=0.0)
    optimizer, _ = build_optimizer(m, update)
    return UpdateEngine(m, optimizer, build_schedule(update, total_windows=8),
                        Precision(NumericsConfig(), torch.device("cpu")), update,
                        ObjectiveConfig(), device="cpu", pad_id=PAD, inputs=inputs)


def windows(exs):
    return [[packed(exs, [[0, 1], [2]]), packed(exs, [[3, 4], [5]])] for _ in range(3)]


def final_params(e, batches) -> list[torch.Tensor]:
    for w, window in enumerate(batches):
        e.run_window(window, w)
    return [p.detach().clone() for p in e.model.parameters()]


def test_gold_probability_one_is_teacher_forcing_bitwise():
    exs = examples(5)
    forced = final_params(engine(model()), windows(exs))
    always_gold = ScheduledSampling(ScheduledSamplingConfig(schedule="constant"), seed=0)
    sampled_one = final_params(engine(model(), always_gold), windows(exs))
    assert all(torch.equal(a, b) for a, b in zip(forced, sampled_one, strict=True))
    half = ScheduledSampling(ScheduledSamplingConfig(schedule="constant", probability=0.5),
                             seed=0)
    sampled_half = final_params(engine(model(), half), windows(exs))
    assert not all(torch.equal(a, b) for a, b in zip(forced, sampled_half, strict=True))


def test_the_clock_is_committed_windows_and_the_ledger_says_what_was_fed():
    exs = examples(6)
    program = ScheduledSampling(ScheduledSamplingConfig(schedule="linear", slope=0.25), seed=0)
    e = engine(model(), program)
    e.update_cfg = UpdateConfig(lr=1e-2, warmup=0, accum=2, weight_decay=0.0, fail_window=1)
    records = [e.run_window(window, w).ledger_record() for w, window in
               enumerate(windows(exs) + windows(exs)[:1])]
    assert [r["disposition"] for r in records] == [
        "COMMITTED", "SKIPPED_NONFINITE", "COMMITTED", "COMMITTED"]
    # window 1 is skipped: it does not advance the clock, so window 2 sees eps(1) again
    assert [r["inputs"]["gold_probability"] for r in records] == [1.0, 0.75, 0.75, 0.5]
    for w, r in enumerate(records):
        expected = sum(int(model_input_mask(b, r["inputs"]["gold_probability"], seed=0,
                                            window=w).sum()) for b in windows(exs)[0])
        assert r["inputs"]["model_inputs"] == expected
    assert records[0]["inputs"]["model_inputs"] == 0 < records[3]["inputs"]["model_inputs"]


def test_over_the_encoder_decoder_all_model_inputs_are_greedy_decoding():
    """``scheduled_sampling.over = "encdec"``: with eps = 0 every decoder input after the
    start token is the model's own previous argmax, built sequentially; that is greedy
    decoding of each pair's source, which ``greedy_decode`` computes independently
    (each source alone, encoded once, one token per step)."""
    from exactstep.config import load_config
    from exactstep.families import open_family, resolve
    from exactstep.model.encdec import greedy_decode
    from exactstep.rows.stream import RowStream

    cfg = resolve(load_config(None, [
        "objective.family=scheduled_sampling", "scheduled_sampling.over=encdec",
        "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32",
        "batch.seq_len=48", "batch.rows=2", "encdec.n_train=40", "encdec.n_heldout=8"]))
    parts = open_family(cfg)
    assert parts.family.name == "scheduled_sampling" and cfg.data.source == "numwords"
    m = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    batch = RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id, seed=0,
                      compiler=parts.compiler).next_batch()
    mask = model_input_mask(batch, 0.0, seed=0, window=0)
    built = construct_inputs(m, batch, mask, autocast=contextlib.nullcontext)
    tok = parts.tokenizer
    checked = 0
    for b, row in enumerate(batch.segments):
        for seg, src in zip(row, batch.source.segments[b], strict=True):
            source = batch.source.input_ids[b, src.start:src.stop].tolist()
            (answer,) = greedy_decode(m, [source], bos_id=tok.bos_id, eos_id=tok.eos_id,
                                      source_pad_id=tok.pad_id, max_new_tokens=seg.length)
            inputs = built[b, seg.start:seg.stop].tolist()
            assert inputs[0] == batch.input_ids[b, seg.start]  # the start token is kept
            n = min(len(answer), seg.length - 1)
            assert inputs[1:1 + n] == answer[:n]
            checked += 1
    assert checked >= 2
    assert built.shape == batch.input_ids.shape  # decoder inputs only: the source stays
