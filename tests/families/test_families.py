"""The objective-family seam (R8): resolution, refusal, specials, addressed epochs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from exactstep.config import load_config
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import ConfigError
from exactstep.families import BUILT, SPECIFIED, family_of, open_family, resolve
from exactstep.rows.example import Example
from exactstep.rows.packing import PackPlanner


def test_auto_follows_data_kind_and_is_made_explicit():
    assert resolve(load_config(None, [])).objective.family == "causal"
    chat = resolve(load_config(None, ["data.kind=chat", "data.source=arith"]))
    assert chat.objective.family == "chat"


def test_choosing_chat_alone_points_at_the_builtin_conversations():
    cfg = resolve(load_config(None, ["objective.family=chat"]))
    assert (cfg.data.source, cfg.data.kind) == ("arith", "chat")
    # a source the run chose is kept
    mine = resolve(load_config(None, ["objective.family=chat", "data.source=my.jsonl"]))
    assert mine.data.source == "my.jsonl"


@pytest.mark.parametrize("name", [n for n in SPECIFIED if n not in BUILT])
def test_a_family_not_built_is_refused_naming_the_built_ones(name):
    with pytest.raises(ConfigError, match=f"'{name}' is not built yet; choose one of causal"):
        family_of(load_config(None, [f"objective.family={name}"]))


def test_every_built_family_opens_on_its_builtin_data():
    for name in BUILT:
        cfg = resolve(load_config(None, [f"objective.family={name}", "data.max_docs=40",
                                     "data.val_fraction=0.3"]))
        parts = open_family(cfg)
        assert parts.family.name == name and parts.data.train


def test_byte_tokenizer_extras_follow_the_base_vocabulary():
    plain, extra = ByteTokenizer(), ByteTokenizer(("mask", "sentinel_0"))
    assert plain.vocab_size == 259 and extra.vocab_size == 261
    assert extra.extra_id("mask") == 259 and extra.extra_id("sentinel_0") == 260
    assert extra.special_ids() == {"bos": 256, "eos": 257, "pad": 258, "mask": 259,
                                   "sentinel_0": 260}
    assert extra.decode([104, 259, 105]) == "h<mask>i"
    assert extra.byte_lengths()[259:].tolist() == [0, 0]
    assert plain.fingerprint() != extra.fingerprint()
    # the fingerprint of the plain tokenizer is what it always was (run directories)
    assert plain.fingerprint() == ByteTokenizer(()).fingerprint()
    with pytest.raises(ConfigError):
        ByteTokenizer(("pad",))
    with pytest.raises(ConfigError):
        extra.extra_id("cls")


def examples(n: int) -> list[Example]:
    rng = np.random.default_rng(0)
    return [Example(i, rng.integers(0, 256, size=int(rng.integers(3, 12)))) for i in range(n)]


def test_every_piece_carries_the_epoch_that_admitted_it_and_resume_keeps_it():
    """Each epoch emits each example exactly once (R4); the pieces tagged with epoch e
    must be exactly those examples, once each, and a resumed planner tags the same."""
    exs = examples(9)
    planner = PackPlanner(exs, seq_len=16, buffer=4, overlong="split", seed=3)
    rows = planner.next_rows(10)
    state = planner.state_dict()
    later = planner.next_rows(12)
    by_epoch: dict[int, Counter] = {}
    for row in rows + later:
        for piece in row:
            by_epoch.setdefault(piece.epoch, Counter())[piece.example] += 1
    complete = [e for e in by_epoch if e < max(by_epoch)]
    assert len(complete) >= 2  # the rows crossed at least two epoch boundaries
    for epoch in complete:
        assert by_epoch[epoch] == Counter(range(9)), epoch
    resumed = PackPlanner(exs, seq_len=16, buffer=4, overlong="split", seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_rows(12) == later  # epochs included (Piece equality)
