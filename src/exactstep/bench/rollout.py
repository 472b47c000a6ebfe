"""Rollouts: the sampler's tokens/s against a plain ``generate`` loop on the same model,
and the share of a policy window spent sampling (Q1).

The model is the arithmetic-chat demo's decoder (``configs/sft_arith.toml``'s shape) at
its initial weights; each side continues the same prompts ``K`` times for the same
number of tokens. Candidate: ``generation.sample_group`` (addressed float64 inverse-CDF
draws, one prompt's ``K`` rows per batch, eval mode, RNG isolation, per-token
log-probabilities). Baseline: the loop a user writes (``torch.multinomial`` over
``softmax(logits)`` of the same batch, no addressing, nothing recorded). Both run
without a KV cache. Then whole policy windows through ``UpdateEngine`` (the reward
the response's length, so that every window trains): the share of their time spent
in the rollout program. Last, the numwords encoder-decoder (``encdec_numwords.toml``'s
shape): the sampler (its key-value cache, the source encoded once) against the same
sampler on whole rows (what every step cost before the cache), same draws.
Design and derivations: docs/design/bench.md#benchrolloutpy.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from exactstep.bench.common import interleaved_times, median

FULL = {"prompts": 8, "samples": 4, "tokens": 8, "repeats": 5, "windows": 4}
QUICK = {"prompts": 2, "samples": 2, "tokens": 4, "repeats": 2, "windows": 1}


def run(quick: bool) -> dict:
    from exactstep.config import load_config
    from exactstep.families import open_family, resolve
    from exactstep.generation.sampler import sample_group
    from exactstep.rows.batch import single_segment_batch

    shape = QUICK if quick else FULL
    config = Path(__file__).resolve().parents[1] / "configs" / "sft_arith.toml"
    cfg = resolve(load_config(config, [
        "objective.family=policy", "policy.reward=token_f1", "policy.baseline=none",
        f"generation.samples={shape['samples']}",
        f"generation.max_new_tokens={shape['tokens']}", "arith.n_train=256",
        "batch.seq_len=128", "batch.rows=4", "update.accum=1"]))
    parts = open_family(cfg)
    tokenizer = parts.tokenizer
    model = parts.family.build_model(cfg, tokenizer.vocab_size)
    from exactstep.generation.rollouts import split_example

    prompts = [list(split_example(e, "chat")[0]) for e in parts.data.train[:shape["prompts"]]]
    gen = cfg.generation
    no_stop = (-1,)  # every continuation runs its full length on both sides

    def ours() -> int:
        return sum(len(c.tokens) for i, p in enumerate(prompts)
                   for c in sample_group(model, p, gen, seed=0, window=0, example_id=i,
                                         stop_ids=no_stop))

    @torch.no_grad()
    def plain() -> int:
        model.eval()
        drawn = 0
        for p in prompts:
            tokens = torch.tensor([p] * gen.samples)
            for _ in range(gen.max_new_tokens):
                hidden = model(single_segment_batch(tokens))
                probs = torch.softmax(model.logits(hidden[:, -1:, :])[:, -1, :].float(), -1)
                tokens = torch.cat([tokens, torch.multinomial(probs, 1)], dim=1)
                drawn += gen.samples
        model.train()
        return drawn

    tokens_each = len(prompts) * gen.samples * gen.max_new_tokens
    assert ours() == plain() == tokens_each
    cand, base = interleaved_times(ours, plain, repeats=shape["repeats"])
    figures = {"prompts": len(prompts), "samples": gen.samples, "new_tokens": gen.max_new_tokens,
               "threads": torch.get_num_threads(),
               "sampled_tokens_per_s": tokens_each / median(cand),
               "plain_tokens_per_s": tokens_each / median(base),
               "time_ratio": median(cand) / median(base)}
    figures.update(window_share(cfg, parts, model, shape["windows"]))
    figures.update(encdec_sampling(shape))
    return figures


def encdec_sampling(shape: dict) -> dict:
    """The encoder-decoder's sampler with its cache against the same sampler on whole
    rows (a view of the model without ``decode_step``): tokens per second, same draws."""
    from exactstep.config import load_config
    from exactstep.families import open_family, resolve
    from exactstep.generation.rollouts import split_example
    from exactstep.generation.sampler import sample_group

    config = Path(__file__).resolve().parents[1] / "configs" / "encdec_numwords.toml"
    cfg = resolve(load_config(config, [f"generation.max_new_tokens={4 * shape['tokens']}",
                                       f"generation.samples={shape['samples']}",
                                       "encdec.n_train=64"]))
    parts = open_family(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    pad = parts.tokenizer.pad_id
    requests = [(list(split_example(e, "encdec")[0]), [int(t) for t in e.source])
                for e in parts.data.train[:shape["prompts"]]]
    gen = cfg.generation

    class WholeRows(torch.nn.Module):  # the model without its cache: whole rows a step
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, batch):
            return self.inner(batch)

        def logits(self, hidden):
            return self.inner.logits(hidden)

    def sampler(m):
        def go() -> list[tuple[int, ...]]:
            return [c.tokens for i, (p, src) in enumerate(requests)
                    for c in sample_group(m, p, gen, seed=0, window=0, example_id=i,
                                          stop_ids=(-1,), source=src, source_pad_id=pad)]
        return go

    cached, whole = sampler(model), sampler(WholeRows())
    same = cached() == whole()  # the same draws either way (rounding could flip one)
    tokens_each = len(requests) * gen.samples * gen.max_new_tokens
    cand, base = interleaved_times(lambda: cached(), lambda: whole(), repeats=shape["repeats"])
    return {"encdec_new_tokens": gen.max_new_tokens, "encdec_same_draws": same,
            "encdec_cached_tokens_per_s": tokens_each / median(cand),
            "encdec_whole_row_tokens_per_s": tokens_each / median(base),
            "encdec_time_ratio": median(cand) / median(base)}


def window_share(cfg, parts, model, windows: int) -> dict:
    """Whole policy windows through the engine: the rollout program's share of them."""
    from exactstep.families.policy.rewards import Reward
    from exactstep.rows.stream import RowStream
    from exactstep.update.groups import build_optimizer
    from exactstep.update.precision import Precision
    from exactstep.update.schedule import build_schedule
    from exactstep.update.window import UpdateEngine

    program = parts.family.program(cfg, parts, model, torch.device("cpu"))
    # the bench's own reward, the response's length: it varies, so every window trains
    program.reward = Reward("length", lambda s: float(len(s.content(s.response))),
                            {"name": "length", "kind": "bench"}, False)
    optimizer, _ = build_optimizer(model, cfg.update)
    engine = UpdateEngine(model, optimizer, build_schedule(cfg.update, windows),
                          Precision(cfg.numerics, "cpu"), cfg.update, cfg.objective,
                          device="cpu", pad_id=parts.tokenizer.pad_id,
                          plan=parts.family.plan(cfg, 0), program=program)
    stream = iter(RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id,
                            seed=cfg.seed, compiler=parts.compiler))
    sampling = 0.0
    prepare = program.prepare

    def timed(*args, **kwargs):
        nonlocal sampling
        t0 = time.perf_counter()
        out = prepare(*args, **kwargs)
        sampling += time.perf_counter() - t0
        return out

    program.prepare = timed
    total, sampled, committed = 0.0, 0, 0
    for w in range(windows):
        batch = next(stream)
        t0 = time.perf_counter()
        disposition = engine.run_window([batch], w)
        total += time.perf_counter() - t0
        sampled += (disposition.inputs or {}).get("sampled_tokens", 0)
        committed += disposition.outcome.value == "COMMITTED"
    return {"windows": windows, "committed": committed, "window_s": total / windows,
            "sampling_share": sampling / total, "window_sampled_tokens": sampled}
