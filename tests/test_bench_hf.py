"""``exactstep bench hf``: exactstep driving an HF Llama against HF ``Trainer`` (H1).

The benchmark's figures are timings, which tests never assert on; what is promised
is that both sides trained on the same work. The quick run's supervised token
counts, each counted by its own side (exactstep's committed tokens, the shifted
non--100 labels of Trainer's batches), must equal an expectation computed here from
the examples alone: a text example of ``n`` tokens cut into ``ceil(n / 256)`` pieces
supervises ``n - pieces`` targets, a chat example its owned tokens. Where each side
made a single update over the whole data (the quick ``long`` workload), the two
mean losses are the same objective at the same initial weights, packed against
padded (R3), so they agree to fp32 rounding.

Negative control: the counting collator over Hugging Face's own
``DataCollatorForLanguageModeling`` with the common ``pad_token = eos_token``
setting drops every EOS target, and the same expectation catches it.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from exactstep.bench import hf as bench  # noqa: E402
from exactstep.cli import main  # noqa: E402

WORKLOAD_FIGURES = (
    "speedup", "speedup_per_pass", "speedup_whole_pass", "supervised_tokens_per_s",
    "baseline_supervised_tokens_per_s", "supervised_tokens", "baseline_supervised_tokens",
    "examples", "rows", "updates", "baseline_updates", "baseline_batch_size",
    "real_token_fraction", "baseline_real_token_fraction", "pass_loss", "baseline_pass_loss",
)
EXPECTED_KEYS = {"bench", "quick", "threads", "seq_len", "repeats",
                 *(f"{w}_{f}" for w in ("long", "sft") for f in WORKLOAD_FIGURES)}


def expected_targets(workload: bench.Workload) -> int:
    """Supervised targets of one pass, from the examples (see the module docstring)."""
    total = 0
    for example in workload.examples:
        if example.owned is None:
            total += len(example) - math.ceil(len(example) / bench.SEQ_LEN)
        else:
            total += int(example.owned[1:].sum())
    return total


@pytest.mark.slow
def test_quick_json_has_every_figure_and_both_sides_did_the_same_work(capsys) -> None:
    assert main(["bench", "hf", "--quick", "--json"]) == 0
    out = capsys.readouterr().out
    figures = json.loads(out)  # stdout is exactly one JSON object (Trainer prints nothing)
    assert set(figures) == EXPECTED_KEYS
    assert figures["bench"] == "hf" and figures["quick"] is True
    for workload in bench.workloads(quick=True):
        name = workload.name
        expected = expected_targets(workload)
        assert expected > 0
        assert figures[f"{name}_supervised_tokens"] == [expected] * figures["repeats"]
        assert figures[f"{name}_baseline_supervised_tokens"] == [expected] * figures["repeats"]
        assert figures[f"{name}_rows"] == len(workload.items)
    # one update each over all of the data: the same mean loss at the same start (R3)
    assert figures["long_updates"] == figures["long_baseline_updates"] == 1
    assert figures["long_pass_loss"] == pytest.approx(figures["long_baseline_pass_loss"],
                                                      rel=1e-5)


def test_counting_collator_counts_shifted_targets_and_catches_pad_as_eos() -> None:
    from transformers import DataCollatorForLanguageModeling

    from exactstep.artifacts.export import byte_tokenizer_hf
    from exactstep.data.tokenizer import ByteTokenizer

    byte = ByteTokenizer()
    examples = bench.long_documents(3_000)
    workload = bench.Workload("long", examples, bench.pieces_of(examples, bench.SEQ_LEN),
                              rows=16, collator="lm")
    expected = expected_targets(workload)
    items = workload.items

    right = bench.CountingCollator(bench.hf_collator("lm", byte_tokenizer_hf(byte)))
    for start in range(0, len(items), 5):
        right(items[start : start + 5])
    assert right.supervised_tokens == expected
    assert right.real_tokens == sum(len(item["input_ids"]) for item in items)

    # negative control: pad = EOS, as many scripts set it, masks the EOS targets too
    pad_is_eos = byte_tokenizer_hf(byte)
    pad_is_eos.pad_token = pad_is_eos.eos_token
    wrong = bench.CountingCollator(DataCollatorForLanguageModeling(pad_is_eos, mlm=False))
    for start in range(0, len(items), 5):
        wrong(items[start : start + 5])
    assert wrong.supervised_tokens == expected - len(examples)  # one EOS per document


def test_pieces_are_the_rows_exactstep_splits_into() -> None:
    """The baseline's rows are exactly the pieces ``batch.overlong = 'split'`` cuts."""
    from exactstep.rows.packing import cut_example

    examples = bench.long_documents(20_000)
    items = bench.pieces_of(examples, bench.SEQ_LEN)
    cut = [example.tokens[offset : offset + length].tolist()
           for example in examples
           for offset, length in cut_example(example, bench.SEQ_LEN, "split", False)[0]]
    assert [item["input_ids"] for item in items] == cut
    assert any(len(example) > bench.SEQ_LEN for example in examples)
