"""Scaffolding shared by the tests of the three text-corruption encoder-decoder
families (``span``, ``mass`` and ``bart``): each family's tests stay in its own folder
and keep their own assertions; what they had written three times lives here once,
parameterised by what differs (the family's name and settings, its compiler, its
corpus, the fields compared).

- rows: the corpus of ``BOS body EOS`` examples, the recording wrapper the oracles
  read, a batch as nested lists, the oracle's rows of pieces, each piece's compiled
  sides keyed by its address, and the checks every family runs on its compiler (draws
  addressed by piece, R7's refusals, the planner's charges, held-out rows, a decoder
  without the shift);
- end to end: the module fixtures of a family opened on the test corpus, the stdlib
  default, ``exactstep inspect``, one ``error:`` line per refusal, a tiny train run,
  a run configured through the real entry point and its first batches;
- S5: the shared-stream defect (every piece's draws from one process-wide stream)
  launched through ``families.test_family_kill_resume``'s harness, and that harness's
  bitwise lineage with its no-cursor control.
"""

from __future__ import annotations

import json
import math
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from operator import attrgetter
from pathlib import Path

import numpy as np
import pytest
import torch
from families.test_family_kill_resume import FamilyHarness, bitwise_lineage, final_state
from hypothesis import strategies as st
from run_support import TINY, set_args
from state.test_kill_resume import LAUNCHER
from text_corpus import write_corpus, write_whole

from exactstep.cli import main
from exactstep.config import load_config
from exactstep.errors import BatchInvariantError, ConfigError
from exactstep.families import open_family, resolve
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import PackPlanner, Piece
from exactstep.rows.stream import RowStream, eval_batches
from exactstep.state.compare import state_differences

BOS, EOS, PAD = 256, 257, 258

# --------------------------------------------------------------------------- rows


def byte_body(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, 256, size=n)


def text(i: int, n: int, rng: np.random.Generator, body=byte_body) -> Example:
    """Example ``i``: BOS, ``n`` tokens drawn by ``body(n, rng)``, EOS."""
    return Example(i, np.concatenate([[BOS], body(n, rng), [EOS]]).astype(np.int64))


def corpus(lengths, seed: int = 0, body=byte_body) -> list[Example]:
    rng = np.random.default_rng(seed)
    return [text(i, n, rng, body) for i, n in enumerate(lengths)]


class Recording:
    """A compiler wrapper that records each batch's pieces (the oracle reads them);
    ``with_examples``: each piece as ``(piece, its example)``."""

    def __init__(self, inner, *, with_examples: bool = False):
        self.inner, self.name, self.with_examples = inner, inner.name, with_examples

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def compile(self, rows, examples, cfg, *, pad_id, weighted):
        batch = self.inner.compile(rows, examples, cfg, pad_id=pad_id, weighted=weighted)
        if self.with_examples:
            batch.meta["pieces"] = [[(p, examples[p.example]) for p in r] for r in rows]
        else:
            batch.meta["pieces"] = [list(r) for r in rows]
        return batch


def actual_of(batch) -> dict[str, list[list[int]]]:
    src = batch.source
    return {"enc_ids": src.input_ids.tolist(), "enc_pos": src.position_ids.tolist(),
            "enc_seg": src.segment_ids.tolist(), "dec_ids": batch.input_ids.tolist(),
            "dec_pos": batch.position_ids.tolist(), "dec_seg": batch.segment_ids.tolist(),
            "labels": batch.labels.tolist()}


def oracle_rows(batch, examples, seed: int, draws_of):
    """A recorded batch's pieces as the oracles take them: the rows of ``(example
    tokens, offset, length)`` and ``draws(row, index)``, each piece's draws from
    ``draws_of(seed, epoch, example id, piece)``."""
    rows, by_key = [], {}
    by_id = {e.example_id: e for e in examples}
    for b, segments in enumerate(batch.segments):
        row = []
        for s, (seg, piece) in enumerate(zip(segments, batch.meta["pieces"][b], strict=True)):
            row.append((by_id[seg.example_id].tokens.tolist(), piece.offset, piece.length))
            by_key[b, s] = draws_of(seed, piece.epoch, seg.example_id, seg.piece)
        rows.append(row)
    return rows, lambda b, s: by_key[b, s]


def sides_by_piece(batches, *, labels: bool = True) -> dict:
    """Each piece's encoder input (and, with ``labels``, its decoder labels), keyed by
    ``(example id, piece, offset)``; a piece compiled twice must compile the same."""
    out = {}
    for batch in batches:
        for b, (dec, enc) in enumerate(zip(batch.segments, batch.source.segments, strict=True)):
            for d, e in zip(dec, enc, strict=True):
                value = batch.source.input_ids[b, e.start:e.stop].tolist()
                if labels:
                    value = (value, batch.labels[b, d.start:d.stop].tolist())
                assert out.setdefault((d.example_id, d.piece, d.offset), value) == value
    return out


def assert_same_in_any_row_rank_or_resume(examples, c, *, seed: int, fields: tuple[str, ...],
                                          by_piece=sides_by_piece) -> None:
    """R9, S5: another packing (buffer 1), two ranks and a resume after three batches
    compile every piece as one pass alone does; the resumed batches equal the
    uninterrupted ones in ``fields`` (attribute paths of a batch)."""

    def stream(**kw):
        cfg = BatchConfig(seq_len=48, rows=2, buffer=kw.pop("buffer", 8))
        return RowStream(examples, cfg, pad_id=PAD, seed=seed, repeat=False, compiler=c, **kw)

    alone = by_piece(stream())
    assert by_piece(stream(buffer=1)) == alone
    ranks = [by_piece(stream(rank=r, world=2)) for r in (0, 1)]
    assert {**ranks[0], **ranks[1]} == alone
    first = stream()
    head = [first.next_batch() for _ in range(3)]
    state = first.state_dict()
    rest = list(first)
    resumed = stream()
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(rest) > 0
    for a, b in zip(rest, again, strict=True):
        for field in fields:
            assert torch.equal(attrgetter(field)(a), attrgetter(field)(b)), field
    assert by_piece(head + rest) == alone


def assert_another_seed_or_epoch_draws_anew(inputs_of, example: Example) -> None:
    """``inputs_of(seed, example, piece)``: the compiled encoder input of a piece; seed 2,
    or epoch 1, gives another one than seed 1 at epoch 0."""
    piece = Piece(0, 0, len(example), 0)
    base = inputs_of(1, example, piece)
    assert inputs_of(2, example, piece) != base
    later = Piece(0, 0, len(example), 0, epoch=1)
    assert inputs_of(1, example, later) != base


def draw_rows(draw, seq_len: int) -> BatchConfig:
    """In a ``st.composite`` strategy: rows of ``seq_len`` columns, 1 to 3 of them, a
    planning buffer of 1 to 8, positions reset or continued."""
    return BatchConfig(seq_len=seq_len, rows=draw(st.integers(1, 3)),
                       buffer=draw(st.integers(1, 8)),
                       positions=draw(st.sampled_from(["reset", "continue"])))


def first_batch(examples, c, cfg: BatchConfig, seed: int):
    return next(iter(RowStream(examples, cfg, pad_id=PAD, seed=seed, compiler=c)))


def assert_r7_refuses_broken_rows(c, examples, vocab: int, *, label_column: int = 0,
                                  unpaired: bool = True, outside: bool = True) -> None:
    """A batch ``c`` compiled passes ``c.check``; with one label dropped (row 0,
    ``label_column``), without its encoder side, with the encoder segments in another
    order (``unpaired``) or an encoder id out of the vocabulary (``outside``) it is
    refused."""
    cfg = BatchConfig(seq_len=48, rows=2, buffer=4)
    batch = first_batch(examples, c, cfg, 0)
    c.check(batch, vocab, cfg)
    labels = batch.labels.clone()
    labels[0, label_column] = IGNORE_INDEX
    with pytest.raises(BatchInvariantError, match="no target"):
        c.check(replace(batch, labels=labels), vocab, cfg)
    with pytest.raises(BatchInvariantError, match="no encoder side"):
        c.check(replace(batch, source=None), vocab, cfg)
    source = batch.source
    if unpaired:
        swapped = replace(source, segments=source.segments[::-1])
        with pytest.raises(BatchInvariantError, match="not paired"):
            c.check(replace(batch, source=swapped), vocab, cfg)
    if outside:
        ids = source.input_ids.clone()
        ids[0, 0] = vocab
        with pytest.raises(BatchInvariantError, match="encoder row 0 column 0 .*outside"):
            c.check(replace(batch, source=replace(source, input_ids=ids)), vocab, cfg)


def assert_overflows_without_the_charges(c, examples, cfg: BatchConfig, match: str) -> None:
    """Negative control for ``piece_cost``: the first row planned by length alone does
    not compile (``match``); planned with the compiler's charges it does."""
    rows = PackPlanner(examples, seq_len=c.capacity(cfg), buffer=cfg.buffer, overlong="split",
                       seed=0).next_rows(1)
    with pytest.raises(BatchInvariantError, match=match):
        c.compile(rows, examples, cfg, pad_id=PAD, weighted=False)
    charged = PackPlanner(examples, seq_len=c.capacity(cfg), buffer=cfg.buffer,
                          overlong="split", seed=0, cost=c.piece_cost(cfg)).next_rows(1)
    c.compile(charged, examples, cfg, pad_id=PAD, weighted=False)


def held_out_pieces(c, examples, vocab: int) -> int:
    """How many pieces the held-out rows of ``examples`` hold; each batch passes R7."""
    cfg = BatchConfig(seq_len=40, rows=2, buffer=4)
    batches = list(eval_batches(examples, cfg, pad_id=PAD, vocab_size=vocab, compiler=c))
    for batch in batches:
        c.check(batch, vocab, cfg)
    return sum(len(s) for b in batches for s in b.segments)


class NoShiftMixin:
    """Wrong (before a family's compiler class): the decoder reads its target itself
    (no start token, no shift)."""

    def compile(self, rows, examples, cfg, *, pad_id, weighted):
        batch = super().compile(rows, examples, cfg, pad_id=pad_id, weighted=weighted)
        real = batch.labels != IGNORE_INDEX
        return replace(batch, input_ids=torch.where(real, batch.labels, batch.input_ids))


def trimmed(batch: Batch) -> Batch:
    """A one-piece batch cut to its piece's columns on both sides (no padding)."""
    g, f = batch.segments[0][0].length, batch.source.segments[0][0].length
    src = batch.source
    return replace(batch, input_ids=batch.input_ids[:, :g], labels=batch.labels[:, :g],
                   position_ids=batch.position_ids[:, :g], segment_ids=batch.segment_ids[:, :g],
                   source=replace(src, input_ids=src.input_ids[:, :f],
                                  position_ids=src.position_ids[:, :f],
                                  segment_ids=src.segment_ids[:, :f]))


# --------------------------------------------------------------------------- end to end


def family_fixtures(name: str, small: list[str]):
    """The module fixtures ``corpus`` (``data.source=`` the test corpus) and ``parts``
    (the config of ``small`` on it, resolved, and ``open_family``'s parts). Bind both
    in the test module: ``corpus, parts = family_fixtures(...)``."""

    @pytest.fixture(scope="module")
    def corpus(tmp_path_factory):
        path = tmp_path_factory.mktemp(name) / "corpus.jsonl"
        write_corpus(path)
        return [f"data.source={path}"]

    @pytest.fixture(scope="module")
    def parts(corpus):
        cfg = resolve(load_config(None, small + corpus))
        return cfg, open_family(cfg)

    return corpus, parts


def set_pairs(overrides: list[str]) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def assert_the_family_alone_opens_the_stdlib_corpus(name: str) -> None:
    cfg = resolve(load_config(None, [f"objective.family={name}"]))
    assert (cfg.data.source, cfg.data.kind, cfg.objective.family) == ("stdlib", "text", name)


def assert_boundary_keep_is_refused(overrides: list[str]) -> None:
    cfg = resolve(load_config(None, overrides + ["batch.boundary=keep"]))
    with pytest.raises(ConfigError, match="batch.boundary = 'keep' has no meaning"):
        open_family(cfg)


def inspected(overrides: list[str], capsys) -> str:
    """What ``exactstep inspect --rows 0:2`` prints for a run of ``overrides``."""
    assert main(["inspect", *set_pairs(overrides), "--rows", "0:2"]) in (0, None)
    return capsys.readouterr().out


def assert_one_error_line(overrides: list[str], tmp_path: Path, capsys, needle: str) -> None:
    """``exactstep train`` with ``overrides`` fails with one ``error:`` line holding
    ``needle``, before any checkpoint."""
    code = main(["train", "--no-progress", "--out", str(tmp_path / "run"),
                 *set_pairs(overrides)])
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert code != 0 and len(errors) == 1 and needle in errors[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def tiny_settings(name: str, family: dict | None = None) -> dict:
    """A six-step run of ``objective.family = name`` on the tiny model, with the
    ``family``'s own keys last."""
    return {"objective.family": name, **TINY, "data.max_docs": 24, "data.val_fraction": 0.25,
            "train.steps": 6, "checkpoint.every": 0, "train.eval_tokens": 128,
            "update.warmup": 1, "update.lr": 1e-2, "train.threads": 1, "train.log_every": 1,
            **(family or {})}


def tiny_run(settings: dict, corpus: list[str], run: Path) -> tuple[dict, list[float]]:
    """Train ``settings`` on ``corpus`` into ``run``: its manifest body and its logged
    losses, at least six of them and each finite."""
    assert main(["train", "--out", str(run), "--no-progress", *set_args(settings),
                 "--set", corpus[0]]) == 0
    manifest = json.loads((run / "manifest.json").read_bytes())["manifest"]
    records = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) >= 6 and all(math.isfinite(x) for x in losses)
    return manifest, losses


def configured(tmp_path: Path, name: str, seq_len: int, section: dict, **extra):
    """The resolved config of a run of family ``name`` on the test corpus (10% held
    out, rows of 4), with ``extra`` (``seed``...) and its ``section`` settings."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    overrides = {"objective.family": name, "data.source": corpus, "data.val_fraction": 0.1,
                 "batch.seq_len": seq_len, "batch.rows": 4, **extra, **section}
    return resolve(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))


def compiled(cfg, batches: int, wrap=lambda c: c):
    """The tokenizer, the train split and the first ``batches`` batches of the run's
    training stream, as the runner builds them from ``open_family``'s parts (the
    compiler passed through ``wrap``)."""
    parts = open_family(cfg)
    stream = RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id,
                       seed=cfg.seed, vocab_size=parts.tokenizer.vocab_size,
                       compiler=wrap(parts.compiler))
    return parts.tokenizer, parts.data.train, [stream.next_batch() for _ in range(batches)]


# --------------------------------------------------------------------------- S5

LAUNCH = "from exactstep.cli import main"


def shared_stream(name: str) -> str:
    """The launcher defect ``shared_<name>_stream``: family ``name``'s compiler draws
    every piece's corruption from one process-wide stream (seeded, so a straight run
    is still reproducible)."""
    return f'''
if defect == "shared_{name}_stream":  # every piece's draws from one process-wide stream
    import exactstep.families.{name}.compiler as {name}_rows
    shared = np.random.default_rng(0)
    {name}_rows.piece_generator = lambda *address: shared
'''


class SharedStreamHarness(FamilyHarness):
    """Family ``name``'s runs (its ``settings`` on the tiny run), every process with
    the shared-stream defect."""

    def __init__(self, root: Path, settings: dict, name: str) -> None:
        super().__init__(root, settings)
        self.defect = f"shared_{name}_stream"
        self.launcher = root / "shared_stream_launch.py"
        write_whole(self.launcher, LAUNCHER.replace(LAUNCH, shared_stream(name) + LAUNCH))

    def launch(self, command: list[str], **kw) -> int:
        return super().launch(command, defect=self.defect, **kw)


def straight(h: FamilyHarness) -> Path:
    run_dir = h.root / "straight"
    assert h.train(run_dir) == 0, h.last_output
    return run_dir


def killed(h: FamilyHarness) -> Path:
    run_dir = h.root / "killed"
    assert h.train(run_dir, kill_at="window_end:3") == -signal.SIGKILL, h.last_output
    assert h.resume(run_dir) == 0, h.last_output
    return run_dir


def unaddressed_differences(root: Path, settings: dict, name: str) -> list[str]:
    """The final states' differences between a straight run and one killed inside
    window 3 and resumed, both with the shared-stream defect, side by side."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        a = pool.submit(straight, SharedStreamHarness(root, settings, name))
        b = pool.submit(killed, SharedStreamHarness(root, settings, name))
        run_a, run_b = a.result(), b.result()
    return state_differences(final_state(run_a)[1], final_state(run_b)[1])


def bitwise_s5(root: Path, settings: dict) -> tuple[Path, dict]:
    """``families.test_family_kill_resume.bitwise_lineage`` of ``settings`` (S5 asserted
    there), and its negative control: the resume without the data cursor ends with
    other weights and another data state. The straight run and its manifest body."""
    run, defective, manifest = bitwise_lineage(FamilyHarness(root, settings))
    differences = state_differences(final_state(run)[1], final_state(defective)[1])
    assert any(d.startswith("model.") for d in differences)
    assert any(d.startswith("data.") for d in differences)
    return run, manifest
