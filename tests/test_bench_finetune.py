"""``exactstep bench finetune``: exactstep against ``Trainer`` (+ ``peft``) at V = 151,936 (H1, H4).

Timings and memory are figures, never asserted on; what is promised is that every
pair of sides did the same work. At a tiny shape (vocabulary 512, hidden 32), each
side's supervised-target count, counted by the side itself (exactstep's committed
tokens, the shifted non--100 labels of Trainer's batches), must equal a count made
here from the examples' ownership alone (R5: assistant tokens after the first
position); the LoRA sides must change adapter tensors only (H4) and the full sides
the base; the JSON must carry the documented figures.

Negative controls: labels that supervise every token (no assistant-only mask, what a
plain language-model collator does) give another count, and the adapter-only check
rejects what a full fine-tuning pass changes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from exactstep.bench import finetune as bench  # noqa: E402
from exactstep.cli import main  # noqa: E402

TINY_MODEL = {**bench.QWEN2, "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
              "max_position_embeddings": 256}
TINY_DATA = {"seq_len": 256, "rows": 1, "short": 4, "long": 2, "long_tokens": (60, 200),
             "repeats": 1}
SIDE_FIGURES = ("tokens_per_s", "peak_rss_mib", "built_rss_mib", "import_rss_mib", "loop_s",
                "supervised_tokens", "updates", "trainable_parameters", "real_token_fraction",
                "pass_loss")
VARIANT_FIGURES = ("peak_rss_ratio", "tokens_per_s_ratio", "same_targets", "trainer_batch_size",
                   *(f"{side}_{f}" for side in ("exactstep", "trainer") for f in SIDE_FIGURES))
EXPECTED_KEYS = {"bench", "quick", "threads", "repeats", "model", "lora", "seq_len", "rows",
                 "short", "long", "long_tokens",
                 *(f"{v}_{f}" for v in ("full", "lora", "full_ac", "lora_ac", "full_2t",
                                       "lora_2t")
                   for f in VARIANT_FIGURES)}


def owned_targets(examples: list) -> int:
    """Targets from ownership alone: position i > 0 is a target when it is owned."""
    return sum(sum(1 for i, owned in enumerate(e.owned.tolist()) if i > 0 and owned)
               for e in examples)


def only_adapters(changed: list[str]) -> bool:
    return bool(changed) and all(".lora_A." in n or ".lora_B." in n for n in changed)


@pytest.mark.slow
def test_quick_json_both_sides_same_targets_and_lora_trains_adapters_only(
        monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench, "QWEN2", TINY_MODEL)
    monkeypatch.setattr(bench, "QUICK", TINY_DATA)
    seen: list[tuple[dict, dict]] = []

    def in_process(spec: dict) -> dict:  # the child's work without a fresh interpreter
        result = bench.measure(spec, check=True)
        seen.append((spec, result))
        return result

    monkeypatch.setattr(bench, "child", in_process)
    assert main(["bench", "finetune", "--quick", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)  # stdout is exactly one JSON object
    assert set(figures) == EXPECTED_KEYS
    assert figures["model"]["vocab_size"] == 512 and figures["threads"] == bench.THREADS

    data = {k: v for k, v in TINY_DATA.items() if k != "repeats"}
    expected = owned_targets(bench.finetune_examples(data))
    assert expected > 0
    for variant in bench.VARIANTS:
        assert figures[f"{variant}_exactstep_supervised_tokens"] == [expected]
        assert figures[f"{variant}_trainer_supervised_tokens"] == [expected]
        assert figures[f"{variant}_same_targets"] is True
    assert len(seen) == 2 * len(bench.VARIANTS)
    for spec, result in seen:
        if spec["lora"]:
            assert only_adapters(result["changed"]), (spec, result["changed"][:4])
            assert result["trainable_non_adapter"] == 0
        else:
            assert any("embed_tokens" in n for n in result["changed"])
            assert not only_adapters(result["changed"])  # negative control of the check
    lora = {s["side"]: r["trainable_parameters"] for s, r in seen if s["lora"]}
    full = {s["side"]: r["trainable_parameters"] for s, r in seen if not s["lora"]}
    assert lora["exactstep"] == lora["trainer"] < full["exactstep"] == full["trainer"]


def test_the_target_count_tells_assistant_only_labels_from_plain_lm_labels() -> None:
    from transformers import DataCollatorForSeq2Seq

    from exactstep.artifacts.export import byte_tokenizer_hf
    from exactstep.bench.hf import CountingCollator, labelled_items
    from exactstep.data.tokenizer import ByteTokenizer

    data = {k: v for k, v in TINY_DATA.items() if k != "repeats"}
    examples = bench.finetune_examples(data)
    lengths = [len(e) for e in examples]
    assert min(lengths) < 100 and max(lengths) > 150  # short chats and long answers
    collate = DataCollatorForSeq2Seq(byte_tokenizer_hf(ByteTokenizer()), padding="longest",
                                     label_pad_token_id=-100)
    right = CountingCollator(collate)
    items = labelled_items(examples)
    for start in range(0, len(items), 3):
        right(items[start : start + 3])
    assert right.supervised_tokens == owned_targets(examples) == bench.expected_targets(examples)
    # negative control: every token a label (no assistant-only mask) counts differently
    wrong = CountingCollator(collate)
    plain = [{"input_ids": i["input_ids"], "labels": list(i["input_ids"])} for i in items]
    for start in range(0, len(plain), 3):
        wrong(plain[start : start + 3])
    assert wrong.supervised_tokens == sum(n - 1 for n in lengths) != right.supervised_tokens
    assert np.all([e.owned[0] == 0 for e in examples])  # the first token is the prompt's


@pytest.mark.slow
def test_a_child_interpreter_reports_its_own_peak() -> None:
    data = {k: v for k, v in TINY_DATA.items() if k != "repeats"}
    spec = {"side": "trainer", "lora": True, "ac": True, "threads": 1, "model": TINY_MODEL,
            "lora_config": bench.LORA, "data": data}
    result = bench.child(spec)
    assert result["supervised_tokens"] == owned_targets(bench.finetune_examples(data))
    assert 0 < result["import_rss_mib"] <= result["built_rss_mib"] <= result["peak_rss_mib"]
    assert result["trainable_non_adapter"] == 0
