"""What a pipeline cannot split is refused in one line naming the key to change (D1, X4).

``runner.pipeline_model`` on the real families: the sequence-level ones (policy
rollouts, Professor Forcing's second model, scheduled sampling's rewritten inputs)
and the encoder-decoder are a ``ConfigError`` naming ``parallel.pp``; the control, the
causal family, is split into its stages under the one-process names. The layout
that cannot run (a pipeline of tensor shards) and a model too shallow for its stages
are refused the same way.
"""

from __future__ import annotations

import pytest
import torch
from text_corpus import write_corpus

from exactstep.config import load_config
from exactstep.errors import ConfigError, DistributedError
from exactstep.families import open_family
from exactstep.families import resolve as resolve_family
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.model.stages import split_decoder, stage_bounds
from exactstep.parallel.layout import Layout
from exactstep.parallel.pipeline import pipeline_engine
from exactstep.parallel.process_group import DistContext
from exactstep.run.runner import pipeline_model

TINY = {"model.d_model": 16, "model.n_layers": 2, "model.n_heads": 2, "model.d_ff": 32,
        "batch.rows": 2, "train.threads": 1, "train.device": "cpu", "parallel.pp": 2}
FAMILIES = {
    "policy": {"objective.family": "policy", "data.source": "arith", "data.kind": "chat",
               "arith.n_train": 16, "arith.n_heldout": 4,
               "batch.seq_len": 128, "generation.max_new_tokens": 4,
               "generation.samples": 2, "arith.max_new_tokens": 4},
    "professor": {"objective.family": "professor", "data.source": "arith",
                  "data.kind": "chat", "arith.n_train": 16, "arith.n_heldout": 4,
                  "arith.max_new_tokens": 4, "batch.seq_len": 112,
                  "generation.max_new_tokens": 4, "professor.d_hidden": 8},
    "scheduled_sampling": {"objective.family": "scheduled_sampling", "batch.seq_len": 32,
                           "scheduled_sampling.schedule": "linear",
                           "scheduled_sampling.slope": 0.1, "scheduled_sampling.floor": 0.5},
    "encdec": {"objective.family": "encdec", "data.source": "numwords", "encdec.n_train": 16,
               "encdec.n_heldout": 4, "encdec.max_value": 99, "encdec.source_len": 16,
               "encdec.max_new_tokens": 24, "encdec.encoder_layers": 1,
               "encdec.decoder_layers": 1, "batch.seq_len": 64},
}


def family_run(tmp_path, settings: dict):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    pairs = {"data.source": str(corpus), **TINY, **settings}
    cfg = resolve_family(load_config(None, [f"{k}={v}" for k, v in pairs.items()]))
    parts = open_family(cfg)
    return cfg, parts, parts.family.build_model(cfg, parts.tokenizer.vocab_size)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_a_pipeline_cannot_split_is_one_line_naming_parallel_pp(tmp_path, family):
    cfg, parts, model = family_run(tmp_path, FAMILIES[family])
    with pytest.raises(ConfigError) as refused:
        pipeline_model(cfg, parts, model, Layout(pp=2, rank=0), torch.device("cpu"))
    message = str(refused.value)
    assert "parallel.pp" in message and "\n" not in message


def test_control_the_causal_family_is_split_into_its_stages(tmp_path) -> None:
    cfg, parts, model = family_run(tmp_path, {"batch.seq_len": 32})
    names = set(model.state_dict())
    first = pipeline_model(cfg, parts, model, Layout(pp=2, rank=0), torch.device("cpu"))
    last = pipeline_model(cfg, parts, model, Layout(pp=2, rank=1), torch.device("cpu"))
    assert set(first.state_dict()) | set(last.state_dict()) == names
    assert "layers.0.attn.qkv.weight" in first.state_dict()
    assert "layers.1.attn.qkv.weight" in last.state_dict()
    # what the run reports it trains is the whole model, on every stage
    assert first.num_parameters() == last.num_parameters() == model.num_parameters()
    assert sum(p.numel() for p in first.parameters()) < model.num_parameters()


def test_a_stage_without_a_layer_is_refused_and_the_split_is_even() -> None:
    assert stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ConfigError, match="model.n_layers"):
        stage_bounds(2, 4)
    decoder = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32), 32, seed=0)
    with pytest.raises(ConfigError, match="parallel.pp"):
        split_decoder(decoder, stages=[0], n_stages=2)


def test_a_pipeline_of_tensor_shards_is_refused_naming_the_axis() -> None:
    """``pp = 2`` with ``tp = 2`` is not built: one line naming parallel.tp, before any
    collective; the control, pp = 2 with data replicas, passes this check (and fails
    later, on the process group this hand-made context lacks, with another error)."""
    def ctx(layout: Layout) -> DistContext:
        return DistContext(rank=0, world_size=layout.world, local_rank=0,
                           device=torch.device("cpu"), backend="gloo", layout=layout)

    with pytest.raises(DistributedError, match="parallel.tp = 2 .* set parallel.tp ="):
        pipeline_engine(None, None, ctx(Layout(pp=2, tp=2)), schedule="1f1b", rows=2,
                        seq_len=8)
    with pytest.raises(Exception) as other:
        pipeline_engine(None, None, ctx(Layout(pp=2, dp=2)), schedule="1f1b", rows=2,
                        seq_len=8)
    assert "parallel.tp" not in str(other.value)
