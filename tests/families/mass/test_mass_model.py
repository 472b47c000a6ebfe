"""MASS rows on the built-in encoder-decoder (R3, R9).

- Packed = separate (R3): a row packing several masked pieces gives, for each piece,
  the decoder hidden states of that piece compiled alone into an unpadded row (fp32,
  1e-5); its draws are addressed by its identity, so the piece alone is masked the same.
- What the decoder positions do here: the built-in model applies RoPE in the decoder's
  self-attention and no positions in cross-attention, so only *relative* decoder
  positions matter. A fragment's positions rise by one, so the original positions
  (``u .. u + k - 1``, what MASS prescribes and what the rows carry) give the same
  hidden states as ``0 .. k - 1`` (1e-5): on this model the decoder learns where the
  fragment lies only through cross-attention. Control: positions that are not
  contiguous (reversed) do change the hidden states, so the comparison can fail.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from families.corruption_support import corpus, trimmed

from exactstep.config import load_config
from exactstep.families.mass.compiler import MassCompiler
from exactstep.families.mass.config import MassConfig
from exactstep.model.encdec import build_encoder_decoder
from exactstep.rows.batch import Batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece

BOS, EOS, PAD, MASK = 256, 257, 258, 259
VOCAB = 260
CFG = BatchConfig(seq_len=64, rows=2, buffer=8)
TINY = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32", "seed=3"]
TOL = 1e-5


def compiler() -> MassCompiler:
    return MassCompiler(MassConfig(), seed=3, bos_id=BOS, eos_id=EOS, mask_id=MASK,
                        content_ids=range(256))


def examples(lengths) -> list[Example]:
    return corpus(lengths, seed=1)


EXAMPLES = examples([9, 14, 6, 20, 11, 4])
ROWS = [[Piece(0, 0, 11, 0), Piece(1, 0, 16, 0), Piece(2, 0, 8, 0)],
        [Piece(3, 0, 22, 0), Piece(4, 0, 13, 0), Piece(5, 0, 6, 0)]]


def model():
    torch.manual_seed(0)
    return build_encoder_decoder(load_config(None, TINY), VOCAB).eval()


def test_packed_pieces_equal_each_piece_alone_r3():
    m, c = model(), compiler()
    packed = c.compile(ROWS, EXAMPLES, CFG, pad_id=PAD, weighted=False)
    c.check(packed, VOCAB, CFG)
    with torch.no_grad():
        hidden = m(packed)
        for b, row in enumerate(ROWS):
            for s, piece in enumerate(row):
                alone = trimmed(c.compile([[piece]], EXAMPLES, CFG, pad_id=PAD, weighted=False))
                seg = packed.segments[b][s]
                assert torch.equal(alone.labels[0], packed.labels[b, seg.start:seg.stop])
                diff = (m(alone)[0] - hidden[b, seg.start:seg.stop]).abs().max()
                assert float(diff) < TOL, (b, s, float(diff))


def with_positions(batch: Batch, make) -> Batch:
    positions = batch.position_ids.clone()
    for b, row in enumerate(batch.segments):
        for seg in row:
            positions[b, seg.start:seg.stop] = make(seg.length)
    return replace(batch, position_ids=positions)


def test_decoder_positions_matter_only_relatively_on_the_builtin_model():
    m, c = model(), compiler()
    batch = c.compile(ROWS, EXAMPLES, CFG, pad_id=PAD, weighted=False)
    assert any(int(batch.position_ids[b, seg.start]) > 0
               for b, row in enumerate(batch.segments) for seg in row)  # original positions
    with torch.no_grad():
        original = m(batch)
        from_zero = m(with_positions(batch, lambda n: torch.arange(n)))
        reversed_ = m(with_positions(batch, lambda n: torch.arange(n).flip(0)))
    real = batch.segment_ids > 0
    assert float((original - from_zero)[real].abs().max()) < TOL
    assert float((original - reversed_)[real].abs().max()) > 1e-3  # control
