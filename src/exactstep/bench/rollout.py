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
sampler on whole rows (what every step cost before the cache), same draws. Then HF
Llama-shaped models (a small one, and a 151,936 vocabulary at Qwen2.5-0.5B's width):
``sample_window`` (the window's rows in one left-padded batch, HF's own key-value
cache) against HF ``generate`` (sampling at temperature 1, no top-k or top-p, the
same rows batched with left padding), ``sample_group`` per prompt (cached) and per
prompt on whole rows (the path before), each side in a fresh interpreter so its
peak resident set is its own.
Design and derivations: docs/design/bench.md#benchrolloutpy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from exactstep.bench.common import interleaved_times, median, whole_rows

FULL = {"prompts": 8, "samples": 4, "tokens": 8, "repeats": 5, "windows": 4}
QUICK = {"prompts": 2, "samples": 2, "tokens": 4, "repeats": 2, "windows": 1}
#: HF Llama-shaped models, random init from the config: a small one, and Qwen2.5-0.5B's
#: vocabulary, width, heads (GQA 14:2) and tied head with 4 of its 24 layers
HF_MODELS = {
    "small": {"model_type": "llama", "vocab_size": 259, "hidden_size": 64,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512},
    "qwen_shape": {"model_type": "llama", "vocab_size": 151_936, "hidden_size": 896,
                   "intermediate_size": 4864, "num_hidden_layers": 4,
                   "num_attention_heads": 14, "num_key_value_heads": 2,
                   "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                   "rope_theta": 1_000_000.0, "tie_word_embeddings": True},
}
#: the rollout workload of each HF model: prompts of these lengths, K samples, new tokens
HF_FULL = {"lengths": (8, 13, 21, 34, 11, 27, 16, 40), "samples": 4, "tokens": 32,
           "repeats": {"small": 5, "qwen_shape": 2}}
HF_QUICK = {"lengths": (3, 7), "samples": 2, "tokens": 4, "repeats": {"small": 1}}
HF_SIDES = ("window", "generate", "per_prompt", "whole_rows")
#: intra-op threads of every HF side: one, as ``bench finetune`` (on a shared machine a
#: second thread that loses its core makes the other wait at every barrier)
HF_THREADS = 1
CHILD_MODULE = "exactstep.bench.rollout"
NO_STOP: tuple[int, ...] = ()  # the HF sides' stop ids: none, every row its full length


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
    from exactstep.generation.prompts import split_example

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
    figures.update(hf_sampling(quick))
    return figures


def hf_sampling(quick: bool) -> dict:
    """Every HF side on every HF model, each in its own interpreter: tokens per second
    (median of the repeats after a warm-up), peak and built resident set, and the
    ratios of ``sample_window``'s tokens per second to each other side's."""
    work = HF_QUICK if quick else HF_FULL
    figures: dict[str, Any] = {"cpu": cpu_model(), "hf_threads": HF_THREADS, "hf_workload": {
        "prompt_lengths": list(work["lengths"]), "samples": work["samples"],
        "new_tokens": work["tokens"], "repeats": work["repeats"]}, "hf_models": HF_MODELS}
    for name, table in HF_MODELS.items():
        if quick and name != "small":
            continue
        sides = HF_SIDES if name == "small" or quick else HF_SIDES[:3]  # whole rows: slow
        rounds = 2 if name == "small" else 1  # the second in reverse order
        passes: dict[str, list[dict]] = {side: [] for side in sides}
        for r in range(rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                passes[side].append(child({"model": table, "side": side, **work,
                                           "repeats": work["repeats"][name],
                                           "threads": HF_THREADS}))
        out = {side: {key: median([p[key] for p in got]) for key in
                      ("tokens_per_s", "peak_rss_mib", "built_rss_mib", "tokens", "parameters")}
               for side, got in passes.items()}
        for side, got in out.items():
            for key in ("tokens_per_s", "peak_rss_mib", "built_rss_mib"):
                figures[f"hf_{name}_{side}_{key}"] = got[key]
            figures[f"hf_{name}_{side}_seconds"] = [t for p in passes[side] for t in p["seconds"]]
        for side in sides[1:]:
            figures[f"hf_{name}_speedup_vs_{side}"] = (out["window"]["tokens_per_s"]
                                                       / out[side]["tokens_per_s"])
        figures[f"hf_{name}_parameters"] = out["window"]["parameters"]
    return figures


def cpu_model() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it, and the cores this process
    may use."""
    name = "unknown"
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def child(spec: dict) -> dict:
    """One side in a fresh interpreter (``python -m exactstep.bench.rollout``), so its
    ``VmHWM`` is its own."""
    threads = str(spec["threads"])
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    done = subprocess.run([sys.executable, "-m", CHILD_MODULE, json.dumps(spec)],
                          capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"bench rollout child {spec['side']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def reset_peak() -> None:
    """Reset this process's peak resident set (``VmHWM``) to its current one (Linux's
    ``clear_refs`` 5); where that is refused the peak keeps the build's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def hf_side(spec: dict) -> dict:
    """Build the HF model (exactstep's adapter, seeded random init; HF ``generate``
    runs on the same ``transformers`` module inside it), then time one side: the
    prompts' ``K`` rows for ``tokens`` new tokens each, no stop token; the peak
    resident set counted from after the build (``peak_rss_mib``)."""
    import warnings

    from exactstep.generation.config import GenerationConfig
    from exactstep.generation.sampler import SampleRequest, sample_group, sample_window
    from exactstep.model.config import ModelConfig
    from exactstep.model.hf import build_hf_model

    warnings.filterwarnings("ignore")
    torch.set_num_threads(spec["threads"])
    table = dict(spec["model"])
    adapter = build_hf_model(ModelConfig(source="hf", hf_config=table,
                                         attn_implementation="sdpa"),
                             table["vocab_size"], seed=0).eval()
    hf = adapter.hf
    hf.generation_config.eos_token_id = None  # every row runs its full length
    hf.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, table["vocab_size"], (n,), generator=g).tolist()
               for n in spec["lengths"]]
    K, N = spec["samples"], spec["tokens"]
    cfg = GenerationConfig(samples=K, max_new_tokens=N)
    requests = [SampleRequest(i, tuple(p)) for i, p in enumerate(prompts)]
    side = spec["side"]


    whole = whole_rows(adapter)  # the adapter without its cache: whole rows a step

    @torch.no_grad()
    def generate() -> int:  # the rows left-padded, as generate pads a batch
        rows = [p for p in prompts for _ in range(K)]
        width = max(len(p) for p in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for b, p in enumerate(rows):
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0,
                          top_p=1.0, temperature=1.0, max_new_tokens=N, min_new_tokens=0)
        return int((out.shape[1] - width) * len(rows))

    def drawn(groups) -> int:
        return sum(len(c.tokens) for cs in groups for c in cs)

    run = {
        "window": lambda: drawn(sample_window(adapter, requests, cfg, seed=0, window=0,
                                              stop_ids=NO_STOP)),
        "generate": generate,
        "per_prompt": lambda: drawn(
            [sample_group(adapter, r.prompt, cfg, seed=0, window=0, example_id=r.example_id,
                          stop_ids=NO_STOP) for r in requests]),
        "whole_rows": lambda: drawn(
            [sample_group(whole, r.prompt, cfg, seed=0, window=0, example_id=r.example_id,
                          stop_ids=NO_STOP) for r in requests]),
    }[side]
    built = status_kib("VmRSS")
    reset_peak()  # the peak from here on is the sampling's (the build's is not counted)
    tokens = run()  # warm-up
    times = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        assert run() == tokens == len(prompts) * K * N
        times.append(time.perf_counter() - t0)
    return {"side": side, "tokens": tokens, "tokens_per_s": tokens / median(times),
            "seconds": times, "built_rss_mib": built / 1024,
            "peak_rss_mib": status_kib("VmHWM") / 1024,
            "parameters": adapter.num_parameters(), "threads": torch.get_num_threads()}


def encdec_sampling(shape: dict) -> dict:
    """The encoder-decoder's sampler with its cache against the same sampler on whole
    rows (a view of the model without ``decode_step``): tokens per second, same draws."""
    from exactstep.config import load_config
    from exactstep.families import open_family, resolve
    from exactstep.generation.prompts import split_example
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


    def sampler(m):
        def go() -> list[tuple[int, ...]]:
            return [c.tokens for i, (p, src) in enumerate(requests)
                    for c in sample_group(m, p, gen, seed=0, window=0, example_id=i,
                                          stop_ids=(-1,), source=src, source_pad_id=pad)]
        return go

    cached, whole = sampler(model), sampler(whole_rows(model))
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


if __name__ == "__main__":
    print(json.dumps(hf_side(json.loads(sys.argv[1]))))
