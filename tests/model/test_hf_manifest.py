"""An HF run's manifest pins what ``model.path`` resolved to (S1, S4, H1).

The configuration records only the directory's name, so the manifest's ``model``
section records what was in it: a digest of the resolved architecture, a digest of
the initial weights and the ``transformers`` version. A resume rebuilds the model from
the directory and must find the same three. Each expectation here comes from the
test's own files, not from the code under test: the section's architecture digest
follows a change of ``rms_norm_eps`` in ``config.json``, its weights digest follows a
change of one weight value written with ``safetensors``. Negative control: the same
resume with the directory untouched goes through, so the refusal is caused by the
change, not by resuming.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_support import hf_config, perturb_saved_weight  # noqa: E402
from run_support import TINY, set_args  # noqa: E402
from text_corpus import write_corpus  # noqa: E402

from exactstep.cli import main  # noqa: E402

VOCAB = 259  # the byte tokenizer's


def saved_llama(directory: Path) -> None:
    table = hf_config("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    config = transformers.AutoConfig.for_model(table.pop("model_type"), **table)
    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def manifest_of(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["manifest"]


def model_section(run: Path) -> dict:
    return manifest_of(run)["model"]


@pytest.fixture
def finished_run(tmp_path) -> tuple[Path, Path]:
    model_dir, run = tmp_path / "llama", tmp_path / "run"
    saved_llama(model_dir)
    corpus = tmp_path / "docs.jsonl"
    write_corpus(corpus)
    rows = {k: v for k, v in TINY.items() if not k.startswith("model.")}
    argv = ["train", "--out", str(run), "--no-progress",
            *set_args({**rows, "data.source": corpus, "model.source": "hf",
                       "model.path": model_dir, "train.steps": 2, "update.warmup": 1,
                       "train.eval_tokens": 64, "train.threads": 1})]
    assert main(argv) == 0
    return model_dir, run


def resume_error(run: Path, capfd) -> tuple[int, str]:
    capfd.readouterr()
    code = main(["resume", str(run), "--no-progress"])
    return code, capfd.readouterr().err


@pytest.mark.slow
def test_the_manifest_pins_the_directory_and_a_changed_one_refuses_resume(finished_run, capfd):
    model_dir, run = finished_run
    section = model_section(run)
    assert section["source"] == "hf" and section["model_type"] == "llama"
    # the default "auto" recorded as given, what it resolved to (a Llama: per document)
    assert manifest_of(run)["config"]["model"]["attn_implementation"] == "auto"
    assert section["attn_implementation"] == "exactstep"
    assert section["transformers"] == transformers.__version__
    assert len(section["config_sha256"]) == len(section["initial_weights_sha256"]) == 64

    code, err = resume_error(run, capfd)  # negative control: nothing changed
    assert code == 0, err
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}

    config_path = model_dir / "config.json"
    original = config_path.read_text()
    config = json.loads(original)
    config["rms_norm_eps"] = 1e-3  # same shapes, another model
    config_path.write_text(json.dumps(config))
    code, err = resume_error(run, capfd)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert "model.config_sha256" in err and "model.initial_weights_sha256" not in err
    config_path.write_text(original)

    perturb_saved_weight(model_dir)
    code, err = resume_error(run, capfd)
    assert code == 2 and err.count("\n") == 1
    assert "model.initial_weights_sha256" in err and "model.config_sha256" not in err
    after = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    assert after == before  # refused before anything on disk changed (S8)


def test_a_built_in_run_has_no_model_section(tmp_path):
    run = tmp_path / "run"
    corpus = tmp_path / "docs.jsonl"
    write_corpus(corpus)
    argv = ["train", "--out", str(run), "--no-progress",
            *set_args({**TINY, "data.source": corpus, "train.steps": 1, "update.warmup": 0,
                       "train.eval_tokens": 32, "train.threads": 1})]
    assert main(argv) == 0
    assert "model" not in json.loads((run / "manifest.json").read_text())["manifest"]
