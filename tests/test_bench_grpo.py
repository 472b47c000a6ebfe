"""``exactstep bench grpo``: a policy run against trl's ``GRPOTrainer`` (Q1-Q4, H4).

Timings and memory are figures, never asserted on; what is promised is that both
sides did the declared work. At a tiny shape (vocabulary 512, hidden 32, one layer),
each side's own count of generated completions must be steps x prompts x K (counted
by exactstep's rollout program and by trl's completion mask), each side must make
``steps`` optimizer updates, train adapters only (H4) and the same number of them,
every completion must hold between 1 and ``max_new_tokens`` tokens, and the prompts
trl tokenized from text must be exactstep's prompt ids, window by window. The shared
reward is checked against values worked by hand.

Negative controls: the declared-work check rejects a side that generated one group
fewer or made one update fewer, and the prompt comparison rejects trl's prompts once
their ``<bos>`` is dropped (what tokenizing the decoded prompt with special tokens
skipped gives) or in another window order (a shuffled dataset); the reward's hand
values reject a reward that ignores the stop token.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("trl")

from exactstep.bench import grpo as bench  # noqa: E402
from exactstep.cli import main  # noqa: E402

TINY_MODEL = {**bench.QWEN2, "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
              "max_position_embeddings": 512}
TINY_WORK = {"steps": 2, "prompts": 2, "samples": 2, "new_tokens": 4, "warmup_steps": 1}
SIDE_FIGURES = ("completions", "completion_tokens", "updates", "rollout_s", "update_s",
                "peak_rss_mib", "built_rss_mib", "import_rss_mib", "trainable_parameters",
                "trainable_non_adapter", "reward_mean", "rollout_tokens_per_s",
                "update_tokens_per_s", "step_tokens_per_s", "rollout_share", "rollout_cpu_s",
                "update_cpu_s", "rollout_tokens_per_cpu_s", "update_tokens_per_cpu_s",
                "step_tokens_per_cpu_s")
EXPECTED_KEYS = {"bench", "quick", "threads", "model", "lora", "optimizer", "steps",
                 "prompts_per_step", "samples_per_prompt", "max_new_tokens", "warmup_steps",
                 "same_prompts", "rollout_tokens_per_s_ratio", "update_tokens_per_s_ratio",
                 "step_tokens_per_s_ratio", "peak_rss_mib_ratio",
                 "rollout_tokens_per_cpu_s_ratio", "update_tokens_per_cpu_s_ratio",
                 "step_tokens_per_cpu_s_ratio",
                 *(f"{side}_{f}" for side in bench.SIDES for f in SIDE_FIGURES)}


def declared_work_problems(figures: dict, work: dict) -> list[str]:
    """What either side did other than declared: its completions, updates, adapters."""
    expected = work["steps"] * work["prompts"] * work["samples"]
    problems = []
    for side in bench.SIDES:
        if figures[f"{side}_completions"] != expected:
            problems.append(f"{side} generated {figures[f'{side}_completions']}, not {expected}")
        if figures[f"{side}_updates"] != work["steps"]:
            problems.append(f"{side} made {figures[f'{side}_updates']} updates")
        tokens = figures[f"{side}_completion_tokens"]
        if not expected <= tokens <= expected * work["new_tokens"]:
            problems.append(f"{side} generated {tokens} tokens")
        if figures[f"{side}_trainable_non_adapter"] != 0:
            problems.append(f"{side} trains non-adapter tensors")
    if figures["exactstep_trainable_parameters"] != figures["trl_trainable_parameters"]:
        problems.append("different adapters")
    return problems


@pytest.mark.slow
def test_quick_json_both_sides_did_the_declared_work(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench, "QWEN2", TINY_MODEL)
    monkeypatch.setattr(bench, "QUICK", TINY_WORK)
    monkeypatch.setattr(bench, "LORA", {**bench.LORA, "r": 4})
    sides: dict[str, dict] = {}
    child = bench.child

    def keep(spec: dict) -> dict:
        sides[spec["side"]] = child(spec)
        return sides[spec["side"]]

    monkeypatch.setattr(bench, "child", keep)
    assert main(["bench", "grpo", "--quick", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) == EXPECTED_KEYS
    assert figures["model"]["vocab_size"] == 512
    assert declared_work_problems(figures, TINY_WORK) == []
    # adapters of rank 4 on every linear layer of one layer (q, k, v, o, gate, up, down)
    h, kv, ff = 32, 32 // 4 * 2, 64
    per_layer = sum(4 * (i + o) for i, o in ((h, h), (h, kv), (h, kv), (h, h),
                                            (h, ff), (h, ff), (ff, h)))
    assert figures["exactstep_trainable_parameters"] == per_layer
    # the prompts: trl's tokenization of the text equals exactstep's ids, window by window
    exact, trl = sides["exactstep"]["prompt_ids"], sides["trl"]["prompt_ids"]
    assert figures["same_prompts"] and exact == trl
    assert len(exact) == TINY_WORK["steps"] and all(len(w) == TINY_WORK["prompts"] for w in exact)
    assert all(p[0] == 256 for w in exact for p in w)  # each prompt opens with <bos>
    # negative controls: one group fewer, one update fewer, prompts without <bos>
    fewer = {**figures, "trl_completions": figures["trl_completions"] - TINY_WORK["samples"]}
    assert any("trl generated" in p for p in declared_work_problems(fewer, TINY_WORK))
    skipped = {**figures, "exactstep_updates": figures["exactstep_updates"] - 1}
    assert any("exactstep made" in p for p in declared_work_problems(skipped, TINY_WORK))
    assert [[p[1:] for p in w] for w in trl] != exact
    assert trl[::-1] != exact  # trl given the windows in another order (a shuffle) is caught


def test_answer_reward_hand_values() -> None:
    """Exact match of the content before the stop token is 1; otherwise minus the mean
    id distance per position over the longer content, a missing position ``V``."""
    eos, v = 257, 512
    assert bench.answer_reward([49, 50, eos], [49, 50, eos], (eos,), v) == 1.0
    assert bench.answer_reward([49, 50, eos, 7], [49, 50, eos], (eos,), v) == 1.0
    assert bench.answer_reward([49, 52, eos], [49, 50, eos], (eos,), v) == -2 / (2 * v)
    assert bench.answer_reward([49, eos], [49, 50, eos], (eos,), v) == -v / (2 * v)
    assert bench.answer_reward([300, 10, 11], [49, 50, eos], (eos,), v) == \
        -(251 + 40 + v) / (3 * v)
    # negative control: a reward blind to the stop token scores the truncated answer 1
    def blind(c, r, stops, vocab):
        return bench.answer_reward(c, r, (), vocab)
    assert blind([49, eos, 50], [49, eos], (eos,), v) != 1.0
    assert bench.answer_reward([49, eos, 50], [49, eos], (eos,), v) == 1.0
