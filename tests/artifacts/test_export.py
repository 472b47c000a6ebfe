"""H3 export of a built-in decoder run: plain ``transformers`` loads the directory, its
logits match the checkpoint's model, its tokenizer is the byte tokenizer, its chat
template renders what exactstep rendered (and owns what exactstep owned), and the
handoff check refuses a wrong artifact before anything is published. An HF run with a
tokenizer from ``exactstep tokenizer train`` exports that tokenizer and its special
ids in config.json, generation_config.json and the tokenizer alike, or is refused
naming why (Qwen2). ``exactstep export verify`` (and ``checkpoint verify`` on an
export) recomputes the passport's digests and names a damaged file.

Expectations are independent of the export code: the checkpoint's weights are loaded
into the built-in decoder by the test, the byte ids are the text's UTF-8 bytes, and
the rendered chat tokens come from exactstep's own template.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from text_corpus import write_corpus

from exactstep.artifacts import export as export_module
from exactstep.artifacts.export import read_passport
from exactstep.cli import main
from exactstep.data.arith import arith_conversations
from exactstep.data.chat import DEFAULT_TEMPLATE
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import ExportError
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.rows.batch import single_segment_batch
from exactstep.rows.chat import ChatPolicy, chat_examples
from exactstep.state import latest_checkpoint, load_checkpoint
from exactstep.state.manifest import read_manifest

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

TOK = ByteTokenizer()
SHAPES = ["batch.seq_len=32", "batch.rows=2", "model.d_model=16", "model.n_layers=2",
          "model.n_heads=2", "model.d_ff=24", "train.steps=3", "train.eval_tokens=64",
          "update.warmup=1", "train.threads=1", "model.rope_theta=500.0", "model.norm_eps=1e-6",
          "train.device=cpu"]


def train(tmp_path: Path, name: str, *extra: str) -> Path:
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(corpus)
    run = tmp_path / name
    assert main(["train", "--no-progress", "--out", str(run), "--set",
                 f"data.source={corpus}", *SHAPES, *extra]) == 0
    return run


def checkpoint_model(run: Path, **model_keys) -> torch.nn.Module:
    cfg = ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=24, rope_theta=500.0,
                      norm_eps=1e-6, **model_keys)
    model = build_model(cfg, TOK.vocab_size, seed=12345)  # weights replaced below
    model.load_state_dict(load_checkpoint(latest_checkpoint(run / "checkpoints"))[0])
    return model.eval()


TEXTS = ["def f(x):\n    return x + 1\n", "héllo, wörld — ünïcode ✓", "a" * 40]


@pytest.fixture(scope="module")
def text_export(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("export")
    run = train(root, "run")
    out = root / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    return run, out


@pytest.mark.parametrize("tied", [True, False])
def test_plain_transformers_reproduces_the_trained_logits(tmp_path, tied) -> None:
    run = train(tmp_path, "run", f"model.tie_embeddings={str(tied).lower()}")
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    reference = checkpoint_model(run, tie_embeddings=tied)
    # H3's handoff tolerance, as the export derived it: 1e-5, or twice transformers' own
    # sdpa/eager spread on these weights where that is larger
    tolerance = json.loads((out / "passport.json").read_text())["check"]["tolerance"]
    for text in TEXTS:
        ids = torch.tensor([[TOK.bos_id, *text.encode("utf-8")]])
        with torch.no_grad():
            expected = reference.logits(reference(single_segment_batch(ids)))
            got = hf(input_ids=ids).logits
        assert (got - expected).abs().max().item() <= tolerance
    assert hf.config.tie_word_embeddings is tied


def test_the_tokenizer_is_the_byte_tokenizer(text_export) -> None:
    _, out = text_export
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        256, 257, 258)


def test_greedy_generation_matches_exactstep(text_export) -> None:
    run, out = text_export
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = checkpoint_model(run)
    ids = torch.tensor([[TOK.bos_id, *b"def "]])
    generated = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=258)[0, ids.shape[1]:].tolist()
    tokens = ids
    with torch.no_grad():
        for _ in range(8):
            logits = reference.logits(reference(single_segment_batch(tokens)))
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert generated == tokens[0, ids.shape[1]:].tolist()


def test_passport_names_what_was_exported(text_export) -> None:
    run, out = text_export
    passport = json.loads((out / "passport.json").read_text())
    checkpoint = latest_checkpoint(run / "checkpoints")
    assert passport["run_manifest_digest"] == read_manifest(run).digest
    assert passport["checkpoint"] == checkpoint.name
    recorded = hashlib.sha256((checkpoint / "manifest.json").read_bytes()).hexdigest()
    assert passport["checkpoint_manifest_sha256"] == recorded
    assert passport["tokenizer_hash"] == TOK.fingerprint()
    assert passport["dtype"] == "float32"
    check = passport["check"]
    assert check["max_abs_logit_diff"] <= check["tolerance"] and check["tokens"] > 0
    for name, digest in passport["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest


def test_a_wrong_artifact_is_refused_and_nothing_is_published(text_export, tmp_path,
                                                              monkeypatch) -> None:
    """Negative control for the handoff check: q and k swapped in the written weights."""
    run, _ = text_export
    mapping = export_module.llama_state

    def swapped(state, cfg):
        out = mapping(state, cfg)
        q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
        out[q], out[k] = out[k], out[q]
        return out

    monkeypatch.setattr(export_module, "llama_state", swapped)
    out = tmp_path / "bad"
    with pytest.raises(ExportError, match="logits differ"):
        export_module.export_run(run, out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bad")]


def test_export_into_an_existing_directory_is_one_line(text_export, capsys) -> None:
    run, out = text_export
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not an empty directory" in err[0]


def test_an_export_in_progress_refuses_another_and_a_killed_ones_leftover_goes(
        text_export, tmp_path, capfd) -> None:
    """One export at a time per --out (S8, X4): while an export is inside its handoff
    check (its ``.OUT.tmp-PID`` written), a second into the same --out is refused in
    one line naming its PID and touches nothing. A SIGKILL then leaves that temporary
    directory, which no rerun used to remove (4 of 4 times); the rerun removes it (its
    process has ended: never published) and publishes. Negative control: a temporary
    name whose process still runs is kept (``tests/state/test_durable_lock.py``)."""
    from hold_support import Held, error_lines

    from exactstep.errors import DirectoryInUse

    run, _ = text_export
    out = tmp_path / "exported"
    argv = ["export", str(run), "--out", str(out)]
    first = Held.start(tmp_path, "export", argv)
    try:
        first.wait_reached()
        leftover = tmp_path / f".exported.tmp-{first.pid}"
        assert leftover.is_dir()
        before = sorted(p.name for p in tmp_path.iterdir())
        capfd.readouterr()
        assert main(argv) == DirectoryInUse.exit_code
        err = capfd.readouterr().err
        assert len(error_lines(err)) == 1 and f"process {first.pid}" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == before
        first.kill()
    finally:
        first.stop()
    assert leftover.is_dir() and not out.exists()
    capfd.readouterr()
    assert main(argv) == 0, capfd.readouterr().err
    assert read_passport(out)["run_manifest_digest"] == read_manifest(run).digest
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".exported")]


def test_chat_export_renders_and_owns_what_exactstep_did(tmp_path) -> None:
    """The exported Jinja template gives exactstep's tokens, and its generation
    markers give exactly the targets exactstep supervises (R5 through the handoff)."""
    run = train(tmp_path, "chat", "data.kind=chat", "data.source=arith", "arith.n_train=40",
                "arith.n_heldout=10", "batch.seq_len=64")
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    conversations = arith_conversations(0, 5, split="train")
    examples, _ = chat_examples(conversations, TOK, ChatPolicy(), max_len=10_000)
    for conversation, example in zip(conversations, examples, strict=True):
        messages = [{"role": m.role, "content": m.content} for m in conversation.messages]
        rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        assert rendered["input_ids"] == DEFAULT_TEMPLATE.render(conversation.messages,
                                                                TOK).tokens.tolist()
        assert rendered["assistant_masks"] == example.owned.astype(int).tolist()


def test_an_hf_model_run_exports_as_itself(tmp_path) -> None:
    """A run that trained an HF model (here Qwen3 from a config) exports that model;
    plain transformers reproduces the checkpoint's logits (H1 + H3) and loads the
    byte tokenizer back as itself (a decomposed accent stays its three bytes)."""
    config = json.dumps({"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8,
                         "num_key_value_heads": 2, "max_position_embeddings": 64})
    run = train(tmp_path, "hf", "model.source=hf", f"model.hf_config={config}")
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    weights = load_checkpoint(latest_checkpoint(run / "checkpoints"))[0]
    fresh = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{**json.loads(config), "vocab_size": TOK.vocab_size}))
    fresh.load_state_dict({k.removeprefix("hf."): v for k, v in weights.items()}, strict=False)
    fresh.eval()
    ids = torch.tensor([[TOK.bos_id, *TEXTS[0].encode("utf-8")]])
    tolerance = json.loads((out / "passport.json").read_text())["check"]["tolerance"]  # H3's
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - fresh(input_ids=ids).logits).abs().max() <= tolerance
    assert json.loads((out / "passport.json").read_text())["architecture"] == "Qwen3ForCausalLM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == TOK.vocab_size
    for text in [*TEXTS, "e\u0301te\u0301"]:
        assert tokenizer.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))


def test_a_qwen2_run_with_the_byte_tokenizer_is_refused(tmp_path) -> None:
    """Under model_type qwen2 plain transformers would load the byte tokenizer as
    Qwen2Tokenizer: NFC-normalized text (a decomposed accent no longer its bytes) and
    an added '<|endoftext|>' at id 259, outside the model's 259 embedding rows. The
    export is refused, naming that; Qwen3 above is the negative control."""
    config = json.dumps({"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "max_position_embeddings": 64})
    run = train(tmp_path, "hf", "model.source=hf", f"model.hf_config={config}")
    with pytest.raises(ExportError, match=r"as Qwen2Tokenizer .* normalizer.*260 tokens "
                                          r"instead of 259"):
        export_module.export_run(run, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


def test_an_hf_tokenizer_run_exports_its_tokenizer_and_template(tmp_path) -> None:
    """H2 + H3: the exported tokenizer is the run's (same ids, same chat template), and
    the model's logits still match on rows of that tokenizer's ids."""
    from tokenizer_support import CHATML_MARKED, save_tokenizer

    from exactstep.data.hf_tokenizer import load_hf_tokenizer

    tok_dir = save_tokenizer(tmp_path / "tok", chat_template=CHATML_MARKED)
    run = train(tmp_path, "bpe", "data.tokenizer=hf", f"data.tokenizer_path={tok_dir}")
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_hf_tokenizer(tok_dir)
    for text in TEXTS:
        assert exported.encode(text, add_special_tokens=False) == ours.encode(text)
    assert exported.chat_template == CHATML_MARKED
    passport = json.loads((out / "passport.json").read_text())
    assert passport["tokenizer_hash"] == ours.fingerprint()
    assert passport["check"]["max_abs_logit_diff"] <= passport["check"]["tolerance"]


def test_an_export_fine_tunes_as_an_hf_model_with_the_same_ownership(text_export,
                                                                      tmp_path) -> None:
    """Demo (a): the exported text run is fine-tuned on chat as an HF model with the
    exported tokenizer and template. Every window supervises exactly the targets the
    built-in template and byte tokenizer supervise on the same data (R5 through H2)."""
    _, out = text_export
    chat = ["data.kind=chat", "data.source=arith", "arith.n_train=40", "arith.n_heldout=10",
            "batch.seq_len=64", "train.steps=3"]
    hf = train(tmp_path, "hf-chat", *chat, "model.source=hf", f"model.path={out}",
               "data.tokenizer=hf")
    builtin = train(tmp_path, "builtin-chat", *chat)
    denominators = [[r["D"] for r in map(json.loads, (run / "ledger.jsonl").read_text()
                                         .splitlines())] for run in (hf, builtin)]
    assert denominators[0] == denominators[1] and all(d > 0 for d in denominators[0])


def test_the_decoder_rotates_with_llamas_own_tables_bit_for_bit() -> None:
    """RoPE as transformers' Llama computes it (the independent expectation):
    ``1 / theta^(2i/Dh)`` in fp32, cos and sin of position x frequency. The last-bit
    rounding of ``theta^(-2i/Dh)`` (negative control) is a different table."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from exactstep.model.decoder import rope_tables

    head_dim, theta = 32, 10000.0
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4,
                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    positions = torch.arange(256)[None]
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_tables(positions, head_dim, theta)  # [B, T, 3, 1, Dh]; slot 0 = queries
    half = head_dim // 2
    assert torch.equal(cos[:, :, 0, 0], cos_hf)
    assert torch.equal(sin[:, :, 0, 0, half:], sin_hf[..., half:])
    assert torch.equal(sin[:, :, 0, 0, :half], -sin_hf[..., :half])  # sign folded in

    other = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wrong = torch.cat([positions[..., None].float() * other] * 2, dim=-1).cos()
    assert not torch.equal(wrong, cos_hf)


def test_the_tolerance_is_transformers_own_spread_and_a_near_miss_is_refused(
        text_export, tmp_path, monkeypatch) -> None:
    """The passport records the tolerance it used: 1e-5, or twice the spread of the
    artifact's own sdpa and eager logits. A mapping that is nearly right (the norm
    epsilon written as 1e-6 instead of the trained 1e-5) is still refused."""
    _, out = text_export
    check = json.loads((out / "passport.json").read_text())["check"]
    spread = check["transformers_sdpa_eager_spread"]
    assert spread >= 0  # any size: it is the artifact's own rounding, the tolerance follows it
    assert check["tolerance"] == max(1e-5, 2 * spread) and check["base_tolerance"] == 1e-5

    run, _ = text_export
    config_of = export_module.llama_config

    def other_eps(*args, **kwargs):
        config = config_of(*args, **kwargs)
        config.rms_norm_eps = config.rms_norm_eps / 10
        return config

    monkeypatch.setattr(export_module, "llama_config", other_eps)
    with pytest.raises(ExportError, match="logits differ"):
        export_module.export_run(run, tmp_path / "near")
    assert not (tmp_path / "near").exists()


# --------------------------------------------------------------------------- HF runs with a
# tokenizer from `exactstep tokenizer train` (H2 + H3)

HF_SHAPES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
# Text where a pre-tokenizer or normalizer other than the trained one would cut differently:
# digit runs, punctuation before letters, a decomposed accent.
BPE_TEXTS = [*TEXTS, "12: the quick brown fox.", "x.the (fox) 47 owls", "e\u0301te\u0301"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus, tokenizer directory) written by ``exactstep tokenizer train``."""
    root = tmp_path_factory.mktemp("bpe")
    corpus = root / "corpus.jsonl"
    write_corpus(corpus)
    tok = root / "tok"
    assert main(["tokenizer", "train", "--source", str(corpus), "--vocab-size", "300",
                 "--out", str(tok)]) == 0
    return corpus, tok


def train_hf_bpe(tmp_path: Path, bpe: tuple[Path, Path], model_type: str) -> Path:
    corpus, tok = bpe
    config = json.dumps({"model_type": model_type, **HF_SHAPES})
    run = tmp_path / model_type
    assert main(["train", "--no-progress", "--out", str(run), "--set", f"data.source={corpus}",
                 "data.tokenizer=hf", f"data.tokenizer_path={tok}", "model.source=hf",
                 f"model.hf_config={config}", *SHAPES]) == 0
    return run


def test_an_hf_llama_run_exports_its_tokenizer_and_its_special_ids_everywhere(tmp_path,
                                                                             bpe) -> None:
    """Plain transformers loads the trained BPE back as itself, and config.json,
    generation_config.json and the tokenizer all name the run's BOS / EOS / PAD (the
    trained tokenizer's 0 / 1 / 2), not the architecture's defaults (negative control:
    LlamaConfig's own 1 / 2 / none, where 2 is ``<pad>``)."""
    from exactstep.data.hf_tokenizer import load_hf_tokenizer

    run = train_hf_bpe(tmp_path, bpe, "llama")
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    ours = load_hf_tokenizer(bpe[1])
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert len(exported) == len(ours.hf) == 300
    for text in BPE_TEXTS:
        assert exported.encode(text, add_special_tokens=False) == ours.encode(text)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    want = (ours.bos_id, ours.eos_id, ours.pad_id)
    assert want == (0, 1, 2) and ours.special_tokens() == {"bos": "<bos>", "eos": "<eos>",
                                                           "pad": "<pad>"}
    for where in (model.config, model.generation_config, exported):
        assert (where.bos_token_id, where.eos_token_id, where.pad_token_id) == want, where
    default = transformers.LlamaConfig()
    assert (default.bos_token_id, default.eos_token_id, default.pad_token_id) != want
    assert json.loads((out / "passport.json").read_text())["special_ids"] == {
        "bos": 0, "eos": 1, "pad": 2}


def test_a_qwen2_run_whose_tokenizer_transformers_would_replace_is_refused(tmp_path, bpe,
                                                                           capsys) -> None:
    """transformers loads a ``qwen2`` directory's tokenizer as Qwen2Tokenizer whatever
    tokenizer_config.json says, and Qwen2Tokenizer rebuilds the trained BPE with its
    own normalizer and pre-tokenizer (and one more token): the export is refused before
    anything is published, naming that cause and what to do instead. The same
    tokenizer under Llama exports (the test above) is the negative control."""
    run = train_hf_bpe(tmp_path, bpe, "qwen2")
    out = tmp_path / "exported"
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    line = err[0]
    assert "Qwen2Tokenizer" in line and "model_type 'qwen2'" in line
    assert "pre_tokenizer" in line and "normalizer" in line and "301 tokens" in line
    assert "'llama'" in line and "nothing was published" in line
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_qwen2_run_with_a_tokenizer_qwen2tokenizer_reproduces_exports(tmp_path, bpe) -> None:
    """The refusal above is about the tokenizer, not about Qwen2: the same vocabulary
    and merges saved by Qwen2Tokenizer itself (so trained and exported with Qwen2's
    own pipeline) export, and plain transformers loads that tokenizer back as it was."""
    from transformers import Qwen2Tokenizer

    from exactstep.data.hf_tokenizer import load_hf_tokenizer

    corpus, trained = bpe
    core = json.loads((trained / "tokenizer.json").read_text())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in core["merges"]]
    qwen = Qwen2Tokenizer(vocab=core["vocab"], merges=merges, bos_token="<bos>",
                          eos_token="<eos>", pad_token="<pad>", unk_token=None)
    qwen.save_pretrained(tmp_path / "qwen-tok")
    run = train_hf_bpe(tmp_path, (corpus, tmp_path / "qwen-tok"), "qwen2")
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_hf_tokenizer(tmp_path / "qwen-tok")
    assert type(exported).__name__ == "Qwen2Tokenizer" and len(exported) == len(ours.hf)
    for text in BPE_TEXTS:
        assert exported.encode(text, add_special_tokens=False) == ours.encode(text)


# --------------------------------------------------------------------------- verify


def flip_one_byte(path: Path, at: int = -100) -> None:
    """One bit of one byte changed (by default in the tensor data at the end)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_export_verify_recomputes_the_passport_digests(text_export, tmp_path, capsys) -> None:
    """Healthy: OK, exit 0. One flipped byte in the weights (negative control): FAILED
    naming model.safetensors, exit 1; every other file still ok."""
    import shutil

    _, out = text_export
    capsys.readouterr()
    assert main(["export", "verify", str(out)]) == 0
    healthy = capsys.readouterr().out
    assert healthy.rstrip().endswith("verdict   OK")
    assert all(f" {name} " in healthy for name in read_passport(out)["files"])

    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    flip_one_byte(damaged / "model.safetensors")
    assert main(["export", "verify", str(damaged)]) == 1
    report = capsys.readouterr().out
    assert report.rstrip().endswith("verdict   FAILED")
    bad = [line for line in report.splitlines() if "corrupted" in line]
    assert len(bad) == 1 and "model.safetensors" in bad[0], report


def test_export_verify_names_a_missing_or_unlisted_file(text_export, tmp_path, capsys) -> None:
    import shutil

    _, out = text_export
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    (damaged / "tokenizer.json").unlink()
    (damaged / "extra.bin").write_bytes(b"x")
    capsys.readouterr()
    assert main(["export", "verify", str(damaged)]) == 1
    report = capsys.readouterr().out
    assert "missing" in report and "tokenizer.json" in report
    assert "extra.bin is not listed in passport.json" in report
    (tmp_path / "bare").mkdir()
    assert main(["export", "verify", str(tmp_path / "bare")]) == 1
    assert "no passport.json" in capsys.readouterr().out


def test_checkpoint_verify_recognises_an_export(text_export, tmp_path, capsys) -> None:
    """``checkpoint verify`` on an export verifies it as an export (it has no
    checkpoint manifest, and a healthy one is not FAILED); a damaged one still fails."""
    import shutil

    _, out = text_export
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(out)]) == 0
    report = capsys.readouterr().out
    assert "FAILED" not in report and "exactstep export verify" in report
    assert report.rstrip().endswith("verdict   OK")
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    flip_one_byte(damaged / "model.safetensors")
    assert main(["checkpoint", "verify", str(damaged)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_export_verify_usage_errors_are_one_line(text_export, tmp_path, capsys) -> None:
    run, out = text_export
    for argv, words in [(["export", "verify"], "export verify DIR"),
                        (["export", str(run)], "--out"),
                        (["export", "verify", str(out), "--out", str(tmp_path / "x")], "--out"),
                        (["export", "verify", str(tmp_path / "nope")], "does not exist")]:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (argv, err)
