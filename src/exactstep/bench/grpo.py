"""A policy run against trl's ``GRPOTrainer`` on the same Qwen2-shaped LoRA model (Q1-Q4, H4).

Both sides train the same LoRA adapters (peft, the same rank and targets) on a
Qwen2-shaped model with Qwen2.5's 151,936-token vocabulary, random init from seed 0,
on the same arithmetic-chat prompts in the same order (``P`` a step, each answered
``K`` times, temperature 1, untruncated, at most ``C`` new tokens), scored by one
reward written once (``answer_reward``), one AdamW update per rollout batch, no
reference model (beta 0). Each side runs in a fresh interpreter so its peak resident
set is its own; ``exactstep bench grpo`` reports rollout, update and whole-step
completion tokens per second, peak RSS, and the ratios exactstep / trl.
Design and derivations: docs/design/bench.md#benchgrpopy (Q1-Q4, H4).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from exactstep.bench.common import run_child
from exactstep.bench.finetune import QWEN2, status_kib

#: the run: ``steps`` optimizer steps a side, each on ``prompts`` prompts x ``samples``
#: completions of at most ``new_tokens`` tokens
FULL = {"steps": 3, "prompts": 2, "samples": 4, "new_tokens": 16, "warmup_steps": 1}
#: the work at Qwen2.5-0.5B's own shape (``python -m exactstep.bench.grpo --qwen2.5-0.5b``):
#: what two cores do in minutes
REAL = {"steps": 1, "prompts": 1, "samples": 4, "new_tokens": 8, "warmup_steps": 1}
QUICK = {"steps": 1, "prompts": 2, "samples": 2, "new_tokens": 4, "warmup_steps": 0}
#: the adapters of both sides (``configs/qwen2_0p5b_lora.toml``'s)
LORA = {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}
#: AdamW of both sides: constant learning rate, no warmup, no weight decay, clip 1
OPTIM = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
         "clip": 1.0}
#: intra-op threads of both sides (see ``bench finetune``: one, on a shared machine)
THREADS = 1
CHILD_MODULE = "exactstep.bench.grpo"
SIDES = ("exactstep", "trl")


# ------------------------------------------------------------------------ the reward


def answer_reward(completion: Sequence[int], reference: Sequence[int], stop_ids: Sequence[int],
                  vocab_size: int) -> float:
    """One completion's reward, from token ids (both sides call this function).

    1 when the completion's content (up to its first stop token) is the reference's,
    else minus the mean distance of the ids, position by position, over the longer of
    the two (a missing position counts ``vocab_size``), divided by ``vocab_size``: in
    ``[-1, 0)``. The dense part gives a randomly initialised model's groups unequal
    rewards, so every step has an objective on both sides (an exact match alone is 0
    for every sample at random init, and exactstep commits no step on an all-zero
    advantage, Q4, where trl steps on a zero gradient)."""
    stops = set(int(s) for s in stop_ids)

    def content(ids: Sequence[int]) -> list[int]:
        out = []
        for i in ids:
            if int(i) in stops:
                break
            out.append(int(i))
        return out

    got, want = content(completion), content(reference)
    if got == want:
        return 1.0
    n = max(len(got), len(want))
    distance = sum(abs(got[i] - want[i]) if i < len(got) and i < len(want) else vocab_size
                   for i in range(n))
    return -distance / (n * vocab_size)


# ------------------------------------------------------------------------ parent side


def run(quick: bool) -> dict:
    return compare(dict(QWEN2), dict(QUICK if quick else FULL))


def compare(model: dict, work: dict) -> dict:
    """Both sides on the model table ``model`` doing ``work``; the figures."""
    spec = {"model": model, "lora": dict(LORA), "optim": dict(OPTIM), "work": work,
            "threads": THREADS}
    sides = {side: child({**spec, "side": side}) for side in SIDES}
    return summarise(spec, sides["exactstep"], sides["trl"])


def qwen_0p5b() -> dict:
    """Qwen2.5-0.5B's own shape: ``configs/qwen2_0p5b_lora.toml``'s model table
    (24 layers, hidden 896, 14 query / 2 key-value heads, 494M parameters)."""
    import tomllib

    config = Path(__file__).resolve().parents[1] / "configs" / "qwen2_0p5b_lora.toml"
    return dict(tomllib.loads(config.read_text(encoding="utf-8"))["model"]["hf_config"])


def summarise(spec: dict, exact: dict, trl: dict) -> dict:
    """Both sides' figures, prefixed, and the ratios exactstep / trl."""
    work = spec["work"]
    out: dict[str, Any] = {"threads": spec["threads"], "model": spec["model"],
                           "lora": spec["lora"], "optimizer": {"name": "adamw", **spec["optim"]},
                           "steps": work["steps"], "prompts_per_step": work["prompts"],
                           "samples_per_prompt": work["samples"],
                           "max_new_tokens": work["new_tokens"],
                           "warmup_steps": work["warmup_steps"],
                           "same_prompts": exact["prompt_ids"] == trl["prompt_ids"]}
    for name, side in (("exactstep", exact), ("trl", trl)):
        for key in ("completions", "completion_tokens", "updates", "rollout_s", "update_s",
                    "rollout_cpu_s", "update_cpu_s", "peak_rss_mib", "built_rss_mib", "import_rss_mib", "trainable_parameters",
                    "trainable_non_adapter", "reward_mean"):
            out[f"{name}_{key}"] = side[key]
        tokens = side["completion_tokens"]
        out[f"{name}_rollout_tokens_per_s"] = tokens / side["rollout_s"]
        out[f"{name}_update_tokens_per_s"] = tokens / side["update_s"]
        out[f"{name}_step_tokens_per_s"] = tokens / (side["rollout_s"] + side["update_s"])
        out[f"{name}_rollout_share"] = side["rollout_s"] / (side["rollout_s"] + side["update_s"])
        # per CPU second: what the side computed, whatever else the machine ran
        out[f"{name}_rollout_tokens_per_cpu_s"] = tokens / side["rollout_cpu_s"]
        out[f"{name}_update_tokens_per_cpu_s"] = tokens / side["update_cpu_s"]
        out[f"{name}_step_tokens_per_cpu_s"] = tokens / (side["rollout_cpu_s"]
                                                         + side["update_cpu_s"])
    for figure in ("rollout_tokens_per_s", "update_tokens_per_s", "step_tokens_per_s",
                   "rollout_tokens_per_cpu_s", "update_tokens_per_cpu_s",
                   "step_tokens_per_cpu_s", "peak_rss_mib"):
        out[f"{figure}_ratio"] = out[f"exactstep_{figure}"] / out[f"trl_{figure}"]
    return out


def child(spec: dict) -> dict:
    """One side in a fresh interpreter (``python -m exactstep.bench.grpo``), so its
    ``VmHWM`` is its own: imports, model build, data, rollouts and updates."""
    return run_child(CHILD_MODULE, spec, "grpo")


# ----------------------------------------------------------------------- both sides


def policy_config(spec: dict) -> Any:
    """exactstep's run configuration: ``qwen2_0p5b_lora.toml`` (arithmetic chats, LoRA)
    as a policy run with GRPO's estimator (``group_normalized``, the group mean with
    the sample and its standard deviation: what trl's default ``scale_rewards =
    "group"`` computes) and the token-mean normaliser (trl's ``dapo``), the model
    table ``spec["model"]``, one prompt a row, ``P`` rows a window."""
    from exactstep.config import load_config
    from exactstep.families import resolve

    work, lora, optim = spec["work"], spec["lora"], spec["optim"]
    config = Path(__file__).resolve().parents[1] / "configs" / "qwen2_0p5b_lora.toml"
    cfg = resolve(load_config(config, [
        "objective.family=policy", "policy.over=chat", "policy.baseline=group_normalized",
        "policy.normalizer=token_mean", "policy.kl=none",
        f"generation.samples={work['samples']}", f"generation.max_new_tokens={work['new_tokens']}",
        "generation.temperature=1.0", "generation.top_k=0", "generation.top_p=1.0",
        f"arith.n_train={4 * (work['steps'] + work['warmup_steps']) * work['prompts'] + 8}",
        f"batch.rows={work['prompts']}", "batch.seq_len=160", "update.accum=1",
        f"update.lr={optim['lr']}", "update.schedule=constant", "update.warmup=0",
        f"update.clip={optim['clip']}", f"update.weight_decay={optim['weight_decay']}",
        f"update.beta1={optim['beta1']}", f"update.beta2={optim['beta2']}",
        f"update.eps={optim['eps']}", "model.activation_checkpointing=false",
        f"model.lora.r={lora['r']}", f"model.lora.alpha={lora['alpha']}",
        f"model.lora.dropout={lora['dropout']}",
        f"model.lora.target_modules={lora['target_modules']}"]))
    return replace(cfg, model=replace(cfg.model, hf_config=dict(spec["model"])))


def schedule(cfg: Any, parts: Any, windows: int) -> list[list[int]]:
    """The example ids of exactstep's first ``windows`` windows, in row order (the
    prompts trl is given in the same order); each window ``batch.rows`` prompts."""
    from exactstep.generation.prompts import example_ids
    from exactstep.rows.stream import RowStream

    stream = iter(RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id,
                            seed=cfg.seed, compiler=parts.compiler))
    out = []
    for _ in range(windows):
        ids = example_ids(next(stream), 0)
        if len(ids) != cfg.batch.rows:
            raise RuntimeError(f"bench grpo: a window packed {len(ids)} prompts, not "
                               f"{cfg.batch.rows}; lower batch.seq_len")
        out.append(ids)
    return out


def measure(spec: dict) -> dict:
    """One side's run from a fresh model; its figures."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(spec["threads"])
    try:
        import_rss = status_kib("VmRSS")
        from exactstep.bench.hf import quiet_hf
        from exactstep.families import open_family

        cfg = policy_config(spec)
        parts = open_family(cfg)
        work = spec["work"]
        windows = schedule(cfg, parts, work["warmup_steps"] + work["steps"])
        with quiet_hf():
            side = exactstep_side if spec["side"] == "exactstep" else trl_side
            result = side(spec, cfg, parts, windows)
        return {**result, "import_rss_mib": import_rss / 1024,
                "peak_rss_mib": status_kib("VmHWM") / 1024}
    finally:
        torch.set_num_threads(previous)


def trainable(model: Any) -> dict:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {"trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "trainable_non_adapter": sum("lora_" not in n for n in names)}


# -------------------------------------------------------------------------- exactstep


def exactstep_side(spec: dict, cfg: Any, parts: Any, windows: list[list[int]]) -> dict:
    """exactstep's policy windows through ``UpdateEngine`` (what ``exactstep train``
    runs per window): rollouts timed inside the rollout program's ``prepare``."""
    import torch

    from exactstep.families.policy.rewards import Reward
    from exactstep.rows.stream import RowStream
    from exactstep.run.host_memory import pin_mmap_threshold
    from exactstep.update.groups import build_optimizer
    from exactstep.update.precision import Precision
    from exactstep.update.schedule import build_schedule
    from exactstep.update.window import UpdateEngine

    pin_mmap_threshold()  # as every exactstep run does (runner.build_run, L1)
    vocab = spec["model"]["vocab_size"]
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    program = parts.family.program(cfg, parts, model, torch.device("cpu"))
    program.reward = Reward("answer_reward",
                            lambda s: answer_reward(s.response, s.reference, s.stop_ids, vocab),
                            {"name": "answer_reward", "kind": "bench"}, False)
    # the journal's text: ids past the tokenizer's (the model's padded rows, which a
    # random model draws) decode to nothing, as trl's tokenizer decodes them
    tokenizer = parts.tokenizer
    program.decode = lambda ids: tokenizer.decode([i for i in ids
                                                   if int(i) < tokenizer.vocab_size])
    optimizer, _ = build_optimizer(model, cfg.update)
    engine = UpdateEngine(model, optimizer, build_schedule(cfg.update, len(windows)),
                          Precision(cfg.numerics, "cpu"), cfg.update, cfg.objective,
                          device="cpu", pad_id=parts.tokenizer.pad_id,
                          plan=parts.family.plan(cfg, 0), program=program)
    built_rss = status_kib("VmRSS")
    prepare, sampling = program.prepare, [0.0, 0.0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        out = prepare(*args, **kwargs)
        sampling[0] += time.perf_counter() - t0
        sampling[1] += time.process_time() - c0
        return out

    program.prepare = timed
    stream = iter(RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id,
                            seed=cfg.seed, compiler=parts.compiler))
    warm = spec["work"]["warmup_steps"]
    figures = {"completions": 0, "completion_tokens": 0, "rollout_s": 0.0, "update_s": 0.0,
               "rollout_cpu_s": 0.0, "update_cpu_s": 0.0}
    rewards, committed, prompt_ids = [], 0, []
    for w in range(len(windows)):
        batch = next(stream)
        sampling[:] = [0.0, 0.0]
        t0, c0 = time.perf_counter(), time.process_time()
        disposition = engine.run_window([batch], w)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
        info = disposition.inputs or {}
        committed += disposition.outcome.value == "COMMITTED"
        if w < warm:
            continue
        prompt_ids.append([list(program.request(e, None).prompt) for e in windows[w]])
        figures["completions"] += info.get("samples", 0)
        figures["completion_tokens"] += info.get("sampled_tokens", 0)
        figures["rollout_s"] += sampling[0]
        figures["update_s"] += total - sampling[0]
        figures["rollout_cpu_s"] += sampling[1]
        figures["update_cpu_s"] += cpu - sampling[1]
        rewards.append(info.get("reward_mean"))
    return {**figures, "updates": committed - min(committed, warm),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "prompt_ids": prompt_ids, "built_rss_mib": built_rss / 1024, **trainable(model)}


# -------------------------------------------------------------------------------- trl


def trl_side(spec: dict, cfg: Any, parts: Any, windows: list[list[int]]) -> dict:
    """trl's ``GRPOTrainer`` as its user runs it: ``AutoModelForCausalLM.from_config``
    (seeded) under ``peft``, the prompts as text in exactstep's window order (no
    shuffle), ``generate`` without vLLM; rollouts timed around
    ``_generate_and_score_completions`` (generation, reward, advantages), updates the
    rest of each step."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from exactstep.artifacts.export import byte_tokenizer_hf
    from exactstep.bench.finetune import build_trainer_model
    from exactstep.generation.prompts import split_example

    work, optim = spec["work"], spec["optim"]
    tokenizer = parts.tokenizer
    hf_tokenizer = byte_tokenizer_hf(tokenizer)
    vocab = spec["model"]["vocab_size"]
    examples = {e.example_id: e for e in parts.data.train}
    rows = []
    for ids in windows:
        for e in ids:
            prompt, reference = split_example(examples[e], "chat")
            rows.append({"prompt": tokenizer.decode(prompt), "reference": list(reference)})
    stop_ids = (tokenizer.eos_id,)

    def reward(prompts: list, completions: list, completion_ids: list, reference: list,
               **kwargs: Any) -> list[float]:
        return [answer_reward(c, r, stop_ids, vocab)
                for c, r in zip(completion_ids, reference, strict=True)]

    model = build_trainer_model({"model": spec["model"], "lora": True,
                                 "lora_config": spec["lora"]}, tokenizer.pad_id)
    model.config.eos_token_id = tokenizer.eos_id
    model.config.bos_token_id = tokenizer.bos_id
    group = work["prompts"] * work["samples"]
    steps = work["warmup_steps"] + work["steps"]
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=group,
            gradient_accumulation_steps=1, num_generations=work["samples"],
            steps_per_generation=1, num_iterations=1, max_steps=steps,
            max_completion_length=work["new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
            use_vllm=False, loss_type="dapo", scale_rewards="group", beta=0.0,
            shuffle_dataset=False, learning_rate=optim["lr"], adam_beta1=optim["beta1"],
            adam_beta2=optim["beta2"], adam_epsilon=optim["eps"],
            weight_decay=optim["weight_decay"], max_grad_norm=optim["clip"],
            lr_scheduler_type="constant", warmup_steps=0, gradient_checkpointing=False,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
            disable_tqdm=True, seed=0, dataloader_num_workers=0, log_completions=False)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args,
                              train_dataset=Dataset.from_list(rows),
                              processing_class=hf_tokenizer)
        trainer.remove_callback(PrinterCallback)
        clock = StepClock()
        trainer.add_callback(clock)
        generate = trainer._generate_and_score_completions
        seen: list[dict] = []

        def timed(*a: Any, **kw: Any) -> Any:
            t0, c0 = time.perf_counter(), time.process_time()
            out = generate(*a, **kw)
            mask = out["completion_mask"]
            seen.append({"rollout_s": time.perf_counter() - t0,
                         "rollout_cpu_s": time.process_time() - c0,
                         "completions": int(mask.shape[0]),
                         "completion_tokens": int(mask.sum()),
                         "prompt_ids": [row[m.bool()].tolist() for row, m in
                                        zip(out["prompt_ids"], out["prompt_mask"], strict=True)],
                         "reward_mean": trainer._metrics["train"]["reward"][-1]})
            return out

        trainer._generate_and_score_completions = timed
        built_rss = status_kib("VmRSS")
        output = trainer.train()
    warm = work["warmup_steps"]
    if len(seen) != steps or len(clock.steps) != steps:
        raise RuntimeError(f"bench grpo: trl generated {len(seen)} times in "
                           f"{len(clock.steps)} steps, not {steps}")
    measured = seen[warm:]
    rollout = sum(s["rollout_s"] for s in measured)
    whole = sum(clock.steps[warm:])
    rollout_cpu = sum(s["rollout_cpu_s"] for s in measured)
    whole_cpu = sum(clock.cpu[warm:])
    k = work["samples"]
    return {"completions": sum(s["completions"] for s in measured),
            "completion_tokens": sum(s["completion_tokens"] for s in measured),
            "rollout_s": rollout, "update_s": whole - rollout,
            "rollout_cpu_s": rollout_cpu, "update_cpu_s": whole_cpu - rollout_cpu,
            "updates": output.global_step - warm,
            "reward_mean": sum(s["reward_mean"] for s in measured) / len(measured),
            # trl repeats each prompt K times in a row; one copy each, as exactstep's
            "prompt_ids": [s["prompt_ids"][::k] for s in measured],
            "built_rss_mib": built_rss / 1024, **trainable(model)}


class StepClock:
    """A ``TrainerCallback`` timing each optimizer step, ``on_step_begin`` (before the
    step's generation) to ``on_step_end`` (after its update): wall and process CPU
    seconds."""

    def __init__(self) -> None:
        self.started = self.started_cpu = 0.0
        self.steps: list[float] = []
        self.cpu: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.started, self.started_cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.append(time.perf_counter() - self.started)
        self.cpu.append(time.process_time() - self.started_cpu)

    def __getattr__(self, name: str) -> Any:  # every other event: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--qwen2.5-0.5b"]:  # the whole comparison at Qwen2.5-0.5B's shape
        print(json.dumps(compare(qwen_0p5b(), json.loads(sys.argv[2]) if sys.argv[2:]
                                 else dict(REAL)), indent=2))
    else:  # one side (``child``)
        print(json.dumps(measure(json.loads(sys.argv[1]))))
