"""The run's ``[encdec]`` section is what its model, rows, data and score are built with
(R8, S1).

Through the real entry point (``load_config`` with overrides, ``resolve``,
``open_family`` and the family's ``build_model`` and ``score``, as the runner calls
them) a run configured away from every default (``encoder_layers = 3``,
``decoder_layers = 1`` against ``model.n_layers = 2``, ``share_embeddings = false``,
``source_len = 12``, ``source_pad_id = 7``, ``n_train = 50``, ``n_heldout = 7``,
``max_value = 999``, ``max_new_tokens = 5``) gets: a model whose state dict holds
encoder blocks 0..2, decoder block 0 and a separate source table; batches whose
encoder side is 12 columns wide with source padding id 7; 50 training and 7 held-out
pairs, every number at most 999; and greedy decoding of the 7 held-out sources for at
most 5 tokens with source pad 7. (``n_heldout`` also caps the scored pairs, which only
shows with a pairs file larger than that: the numwords held-out split has exactly
``n_heldout`` pairs.)

Negative controls: the glue planted so that one of its parts (model, compiler, data,
score) reads ``EncDecConfig()`` (the dataclass defaults) instead of ``cfg.encdec``;
the same check then reports that part's violations.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import exactstep.families.encdec.family as encdec_family
from exactstep.config import load_config
from exactstep.families import open_family, resolve
from exactstep.families.encdec.config import EncDecConfig
from exactstep.rows.stream import RowStream

EOS = 257
SECTION = {"encdec.encoder_layers": 3, "encdec.decoder_layers": 1,
           "encdec.share_embeddings": "false", "encdec.source_len": 12,
           "encdec.source_pad_id": 7, "encdec.n_train": 50, "encdec.n_heldout": 7,
           "encdec.max_value": 999, "encdec.max_new_tokens": 5}
TINY = {"train.device": "cpu", "model.d_model": 16, "model.n_layers": 2, "model.n_heads": 2,
        "model.d_ff": 32, "batch.seq_len": 48, "batch.rows": 2}


def configured():
    overrides = {"objective.family": "encdec", **TINY, **SECTION}
    return resolve(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))


def observe(cfg, monkeypatch) -> dict:
    """What the run builds from ``cfg``: its model's state-dict names, a few compiled
    training batches, both data splits, and the greedy decoding its end-of-run score
    asks for (the decoder is wrapped to record its arguments, then run)."""
    parts = open_family(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    stream = RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id,
                       seed=cfg.seed, vocab_size=parts.tokenizer.vocab_size,
                       compiler=parts.compiler)
    decodes = []
    decode = encdec_family.greedy_decode

    def recording(model, sources, **kw):
        decodes.append({"sources": len(sources), **kw})
        return decode(model, sources, **kw)

    monkeypatch.setattr(encdec_family, "greedy_decode", recording)
    score = parts.family.score(model, parts, cfg, torch.device("cpu"))
    return {"names": set(model.state_dict()), "batches": [stream.next_batch() for _ in range(8)],
            "train": parts.data.train, "val": parts.data.val, "decodes": decodes,
            "score": score}


def number(example) -> int:
    """The number a numwords pair asks for: its source's digits (before EOS)."""
    source = list(example.source)
    assert source[-1] == EOS
    return int(bytes(source[:-1]).decode())


def violations(seen: dict) -> list[str]:
    """What the built run breaks of the configured section, each tagged with the part
    of the glue that builds it."""
    found = []
    blocks = {side: {name.split(".")[1] for name in seen["names"] if name.startswith(side + ".")}
              for side in ("encoder", "decoder")}
    if blocks != {"encoder": {"0", "1", "2"}, "decoder": {"0"}}:
        found.append(f"model: blocks {blocks}, not encoder 0..2 and decoder 0")
    if "source_embed.weight" not in seen["names"]:
        found.append("model: the source side shares the target table")
    for batch in seen["batches"]:
        source = batch.source
        if source.input_ids.shape[1] != 12:
            found.append(f"compiler: encoder side of {source.input_ids.shape[1]} columns")
            break
        padding = source.input_ids[source.segment_ids == 0]
        if padding.numel() == 0 or not bool((padding == 7).all()):
            found.append(f"compiler: source padding {sorted(set(padding.tolist()))}, not 7")
            break
    numbers = [number(e) for e in [*seen["train"], *seen["val"]]]
    if (len(seen["train"]), len(seen["val"])) != (50, 7) or max(numbers) > 999:
        found.append(f"data: {len(seen['train'])} train / {len(seen['val'])} held-out pairs, "
                     f"numbers up to {max(numbers)}")
    wanted = [{"sources": 7, "max_new_tokens": 5, "source_pad_id": 7}]
    got = [{k: d[k] for k in wanted[0]} for d in seen["decodes"]]
    if got != wanted or seen["score"]["exact_match_n"] != 7:
        found.append(f"score: decoded {got}, scored {seen['score']['exact_match_n']}")
    return found


def test_the_run_builds_model_rows_data_and_score_from_the_section(monkeypatch):
    cfg = configured()
    assert (cfg.encdec.encoder_layers, cfg.encdec.decoder_layers, cfg.model.n_layers) == (3, 1, 2)
    assert violations(observe(cfg, monkeypatch)) == []
    assert encdec_family.FAMILY.objective(cfg)["source_len"] == 12


def with_defaults(function, at: int = 0):
    """``function`` reading ``EncDecConfig()`` where its argument ``at`` (the run's
    configuration) has the run's section: the planted defect."""
    def planted(*args, **kwargs):
        args = list(args)
        args[at] = replace(args[at], encdec=EncDecConfig())
        return function(*args, **kwargs)

    return planted


@pytest.mark.parametrize("part, field, at", [("model", "build_model", 0),
                                             ("compiler", "compiler", 0),
                                             ("data", "load", 0), ("score", "score", 2)])
def test_negative_control_a_glue_part_reading_the_defaults_is_caught(monkeypatch, part,
                                                                     field, at):
    family = encdec_family.FAMILY
    monkeypatch.setattr(encdec_family, "FAMILY", replace(
        family, **{field: with_defaults(getattr(family, field), at)}))
    cfg = configured()
    found = violations(observe(cfg, monkeypatch))
    assert [v for v in found if v.startswith(part + ":")], found
    assert encdec_family.FAMILY.objective(cfg)["source_len"] == 12  # still says so
