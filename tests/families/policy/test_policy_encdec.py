"""Q1-Q4 for policy training over the encoder-decoder (``policy.over = "encdec"``).

- The sampler with an encoder side: greedy continuations of each source from ``BOS``
  are the encoder-decoder's own ``greedy_decode`` answers (an independent decoder in
  ``model.encdec``); sampled ones depend on the source (another source, other tokens).
- Q1, Q4: a window of eight numwords pairs split as 1 x 8 and 8 x 1 micro-batches
  samples the same tokens and gives the same gradient, within twice the fp32
  gradient's distance from the same window in float64; negative control: another
  window is outside that tolerance.
- A run through ``exactstep train`` records ``policy_encoder_decoder``, journals every sample,
  trains, and reports the encoder-decoder's held-out exact match.
"""

from __future__ import annotations

import json

import torch
from families.policy.test_policy_run import (
    Replay,
    one_window,
    outside,
    sampled_tokens,
    spread_tolerance,
)
from run_support import set_args

from exactstep.cli import main
from exactstep.config import load_config
from exactstep.families import open_family, resolve
from exactstep.families.encdec.compiler import PairExample, source_pad_of
from exactstep.generation.config import GenerationConfig
from exactstep.generation.sampler import sample_group
from exactstep.model.encdec import greedy_decode

TINY = {"objective.family": "policy", "policy.over": "encdec", "data.source": "numwords",
        "encdec.n_train": 64, "encdec.n_heldout": 8, "encdec.max_value": 99,
        "encdec.source_len": 16, "encdec.max_new_tokens": 24, "encdec.encoder_layers": 1,
        "encdec.decoder_layers": 1, "batch.seq_len": 64, "batch.rows": 2,
        "model.d_model": 16, "model.n_heads": 2, "model.d_ff": 32,
        "generation.max_new_tokens": 24, "generation.samples": 2,
        "policy.reward": "token_f1", "policy.baseline": "none",
        "train.eval_tokens": 64, "train.threads": 1, "train.device": "cpu"}


def setup(**extra):
    cfg = resolve(load_config(None, [f"{k}={v}" for k, v in {**TINY, **extra}.items()]))
    parts = open_family(cfg)
    return cfg, parts, parts.family.build_model(cfg, parts.tokenizer.vocab_size)


def test_greedy_sampling_from_a_source_is_the_encoder_decoders_greedy_decode():
    cfg, parts, model = setup()
    tok = parts.tokenizer
    pad = source_pad_of(cfg.encdec, tok)
    pairs = [e for e in parts.data.train if isinstance(e, PairExample)][:6]
    greedy = GenerationConfig(temperature=0.0, samples=1, max_new_tokens=24)
    with torch.no_grad():
        want = greedy_decode(model, [e.source for e in pairs], bos_id=tok.bos_id,
                             eos_id=tok.eos_id, source_pad_id=pad, max_new_tokens=24)
    for e, answer in zip(pairs, want, strict=True):
        got = sample_group(model, [tok.bos_id], greedy, seed=0, window=0,
                           example_id=e.example_id, stop_ids=(tok.eos_id,),
                           source=e.source.tolist(), source_pad_id=pad)[0].tokens
        # greedy_decode cuts before EOS, or marks an unfinished answer with -1
        assert list(got) == (answer + [tok.eos_id] if answer[-1:] != [-1] else answer[:-1])
    # sampled continuations read the source: the same address, another source
    sampled = GenerationConfig(samples=4, max_new_tokens=8)
    a, b = ([c.tokens for c in sample_group(model, [tok.bos_id], sampled, seed=0, window=0,
                                            example_id=0, stop_ids=(tok.eos_id,),
                                            source=e.source.tolist(), source_pad_id=pad)]
            for e in pairs[:2])
    assert a != b


def test_a_window_split_two_ways_samples_and_steps_the_same():
    cfg, parts, model = setup()
    splits = {"1x8": [list(range(8))], "8x1": [[i] for i in range(8)]}
    results = {name: one_window(cfg, parts, model, ids) for name, ids in splits.items()}
    assert sorted(sampled_tokens(results["1x8"][1])) == sorted(sampled_tokens(results["8x1"][1]))
    assert all(b.source is not None for b in results["1x8"][1])
    exact, _ = one_window(cfg, parts, model, splits["1x8"],
                          program=Replay([b.map(lambda t: t) for b in results["1x8"][1]]),
                          dtype=torch.float64)
    reference = results["1x8"][0]
    tolerance = spread_tolerance(reference, exact)
    assert outside(results["8x1"][0], reference, tolerance) == []
    other, _ = one_window(cfg, parts, model, [list(range(8, 16))])
    assert outside(other, reference, tolerance) != []


def test_a_run_trains_journals_and_reports_exact_match(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--no-progress", "--out", str(run),
                 *set_args({**TINY, "train.steps": 3, "policy.baseline": "leave_one_out"})]) == 0
    manifest = json.loads((run / "manifest.json").read_text())["manifest"]
    assert manifest["objective"]["family"] == "policy_encoder_decoder"
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    samples = (run / "rollouts.jsonl").read_text().splitlines()
    assert len(samples) == sum(r["inputs"]["samples"] for r in ledger) > 0
    assert any(r["disposition"] == "COMMITTED" for r in ledger)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exact_match_of"] == "held-out pairs"


def test_generate_from_an_encoder_decoder_run_takes_the_prompt_as_its_source(tmp_path,
                                                                            capsys):
    """``exactstep generate`` on a trained encoder-decoder: greedy output is the model's
    own ``greedy_decode`` of the prompt's source (ids and EOS, as pairs are encoded)."""
    from exactstep.run.finished_run import open_finished_run

    run = tmp_path / "run"
    settings = {k: v for k, v in TINY.items() if not k.startswith(("policy.", "generation."))}
    assert main(["train", "--no-progress", "--out", str(run),
                 *set_args({**settings, "objective.family": "encdec", "train.steps": 2})]) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "42", "--temperature", "0",
                 "--samples", "1", "--max-new-tokens", "10"]) == 0
    body = capsys.readouterr().out.rsplit("\n-- ", 1)[0]
    with open_finished_run(run, purpose="read") as finished, torch.no_grad():
        tok, cfg = finished.parts.tokenizer, finished.cfg
        want = greedy_decode(finished.model.eval(), [[*tok.encode("42"), tok.eos_id]],
                             bos_id=tok.bos_id, eos_id=tok.eos_id,
                             source_pad_id=source_pad_of(cfg.encdec, tok), max_new_tokens=10)[0]
    assert body == tok.decode([t for t in want if t >= 0] + ([tok.eos_id] if want[-1:] != [-1]
                                                              else []))
