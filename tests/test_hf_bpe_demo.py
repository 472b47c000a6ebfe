"""Demo (b) of the README, end to end through the CLI (H1, H2, X3).

``exactstep tokenizer train`` writes a tiny BPE, then the bundled
``configs/hf_llama_bpe.toml`` (read from the installed package, as a user's copy
would be) trains its HF Llama with it for 3 windows with small overrides. The run
records the Hugging Face tokenizer in its manifest. Its summary (printed,
``summary.json``) and ``exactstep eval`` report bits per *byte* over the UTF-8
bytes of the held-out documents (counted here from the documents' text, plus one
per EOS) and bits per *token*; the two differ by exactly the bytes-per-target
ratio, and a byte-tokenizer summary prints no separate per-token line.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from exactstep.cli import main  # noqa: E402
from exactstep.run.report import format_summary  # noqa: E402
from exactstep.state.manifest import read_manifest  # noqa: E402

VAL_FRACTION = "0.2"
TINY = ["batch.rows=2", "batch.seq_len=256", "train.steps=3", "train.eval_tokens=1000000",
        "update.warmup=1", f"data.val_fraction={VAL_FRACTION}"]


def write_jsonl(path: Path, n: int = 60) -> Path:
    lines = [json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 4)})
             for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def demo_config() -> Path:
    return Path(str(resources.files("exactstep") / "configs" / "hf_llama_bpe.toml"))


@pytest.mark.slow
def test_the_bpe_demo_trains_and_reports_bits_per_byte_and_per_token(tmp_path, capsys) -> None:
    from exactstep.data.config import DataConfig
    from exactstep.data.corpus import load_corpus

    data = write_jsonl(tmp_path / "docs.jsonl")
    tok = tmp_path / "tok"
    assert main(["tokenizer", "train", "--source", str(data), "--vocab-size", "300",
                 "--val-fraction", VAL_FRACTION, "--out", str(tok)]) == 0
    run = tmp_path / "run"
    code = main(["train", "--config", str(demo_config()), "--out", str(run), "--no-progress",
                 "--set", f"data.tokenizer_path={tok}", f"data.source={data}", *TINY])
    stdout = capsys.readouterr().out
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["windows"] == {"committed": 3, "skipped_nonfinite": 0, "no_objective": 0}
    loss = summary["heldout_loss"]
    assert math.isfinite(loss) and summary["heldout_tokens"] > 0
    # every held-out document fits one row (no split), so its targets spell its bytes
    val = load_corpus(DataConfig(source=str(data), val_fraction=float(VAL_FRACTION))).val
    val_bytes = sum(len(d.text.encode("utf-8")) + 1 for d in val)  # + its EOS
    assert summary["heldout_bytes"] == val_bytes > summary["heldout_tokens"]
    nats = loss * summary["heldout_tokens"]
    assert summary["heldout_bits_per_byte"] == pytest.approx(nats / math.log(2) / val_bytes,
                                                             rel=1e-9)
    assert summary["heldout_bits_per_token"] == pytest.approx(loss / math.log(2), rel=1e-9)
    assert summary["unigram_bits_per_byte"] == pytest.approx(
        summary["unigram_bits_per_token"] * summary["heldout_tokens"] / val_bytes, rel=1e-9)
    assert "bits per byte" in stdout and "bits per token" in stdout
    representation = read_manifest(run).section("representation")
    assert representation["tokenizer"] == "hf" and representation["vocab_size"] == 300
    assert read_manifest(run).section("config")["model"]["source"] == "hf"

    assert main(["eval", str(run)]) == 0
    evaluated = capsys.readouterr().out
    assert f"bits per byte {summary['heldout_bits_per_byte']:.4f}" in evaluated
    assert f"bits per token {summary['heldout_bits_per_token']:.4f}" in evaluated


def test_a_byte_summary_prints_bits_per_byte_only() -> None:
    summary = {"windows": {"committed": 1, "skipped_nonfinite": 0, "no_objective": 0},
               "supervised_tokens": 10, "wall_s": 1.0, "heldout_loss": 1.0,
               "heldout_tokens": 5, "heldout_bytes": 5, "heldout_perplexity": math.e,
               "heldout_bits_per_byte": 1 / math.log(2), "heldout_bits_per_token": 1 / math.log(2),
               "unigram_bits_per_byte": 2.0, "unigram_bits_per_token": 2.0,
               "bpb_ratio_to_unigram": 0.72, "data": {"efficiency": 1.0}}
    as_bytes = format_summary(summary)
    as_tokens = format_summary({**summary, "heldout_bytes": 15, "heldout_bits_per_byte": 0.48,
                                "unigram_bits_per_byte": 0.6667})
    assert "bits per byte" in as_bytes and "bits per token" not in as_bytes
    assert "bits per byte       0.4800" in as_tokens
    assert "0.6667 bits per byte" in as_tokens
    assert "bits per token      1.4427 (unigram 2.0000)" in as_tokens
