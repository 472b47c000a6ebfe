"""A Hugging Face tokenizer behind exactstep's tokenizer interface (H2, S1).

The independent side is the saved ``tokenizer.json`` read back by the ``tokenizers``
library alone (``raw_tokenizer``); tokenizers are trained in-process on stdlib text
(``tokenizer_support``), nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizer_support import CHATML, GEMMA, LLAMA3, raw_tokenizer, save_tokenizer

from exactstep.config import load_config
from exactstep.data.config import DataConfig
from exactstep.data.documents import Document
from exactstep.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from exactstep.data.tokenizer import ByteTokenizer, build_tokenizer
from exactstep.errors import ConfigError, DataError
from exactstep.rows.example import encode_documents

TEXTS = ["def f(x):\n    return x + 1\n", "Ünïcödé — ✓ 漢字", "a  b\n\n\tc", "", " "]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok") / "tok", chat_template=CHATML)


@pytest.fixture(scope="module")
def tok(tok_dir) -> HFTokenizer:
    return load_hf_tokenizer(tok_dir)


# --------------------------------------------------------------------------- encoding


def test_encode_is_the_raw_tokenizers_ids_without_special_tokens(tok, tok_dir) -> None:
    raw = raw_tokenizer(tok_dir)
    for text in TEXTS:
        want = raw.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == want
        array = tok.encode_array(text)
        assert array.dtype == np.int64 and array.tolist() == want
        assert tok.decode(want) == text  # byte-level BPE is lossless


def test_vocab_size_covers_every_id_and_decode_refuses_ids_beyond_it(tok, tok_dir) -> None:
    raw = raw_tokenizer(tok_dir)
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) == 400
    assert max(raw.get_vocab(with_added_tokens=True).values()) == tok.vocab_size - 1
    with pytest.raises(DataError, match=r"outside the vocabulary \[0, 400\)"):
        tok.decode([1, 400])


def test_special_ids_are_the_tokenizers_own(tok, tok_dir) -> None:
    raw = raw_tokenizer(tok_dir)
    assert tok.special_ids() == {"bos": raw.token_to_id("<s>"), "eos": raw.token_to_id("</s>"),
                                 "pad": raw.token_to_id("<pad>")}
    assert tok.kind == "hf"


def test_text_examples_are_bos_ids_eos_with_one_bos_even_when_the_tokenizer_adds_one(
        tmp_path) -> None:
    """The tokenizer's post-processor prepends BOS; exactstep encodes without it and
    adds BOS and EOS itself, so each example holds exactly one BOS."""
    directory = save_tokenizer(tmp_path / "tok", add_bos=True)
    raw = raw_tokenizer(directory)
    bos, eos = raw.token_to_id("<s>"), raw.token_to_id("</s>")
    text = "x = 1\n"
    assert raw.encode(text).ids[0] == bos  # the tokenizer really adds a BOS of its own
    tok = load_hf_tokenizer(directory)
    [example] = encode_documents([Document("d", text)], tok)
    ids = raw.encode(text, add_special_tokens=False).ids
    assert example.tokens.tolist() == [bos, *ids, eos]
    assert example.tokens.tolist().count(bos) == 1
    # negative control: encoding with the tokenizer's own specials would double the BOS
    doubled = [bos, *raw.encode(text).ids, eos]
    assert doubled.count(bos) == 2


def test_token_text_is_one_printable_word(tok) -> None:
    raw_ids = tok.encode("a b\n\t")
    shown = [tok.token_text(t) for t in raw_ids]
    assert "".join(shown).replace("␣", " ") == "a b\\n\\t"
    assert all(s and not any(c.isspace() for c in s) for s in shown)
    assert tok.token_text(tok.eos_id) == "</s>"
    assert tok.token_text(10**6) == f"<?{10**6}>"


# --------------------------------------------------------------------------- special tokens


def test_declared_tokens_override_and_reach_the_template(tmp_path) -> None:
    directory = save_tokenizer(tmp_path / "tok", bos=None, chat_template=GEMMA)
    raw = raw_tokenizer(directory)
    with pytest.raises(ConfigError, match="no BOS token; set data.bos_token"):
        load_hf_tokenizer(directory)
    tok = load_hf_tokenizer(directory, bos_token="<|begin_of_text|>", pad_token="<|im_end|>")
    assert tok.bos_id == raw.token_to_id("<|begin_of_text|>")
    assert tok.pad_id == raw.token_to_id("<|im_end|>")
    text = tok.hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.startswith("<|begin_of_text|><start_of_turn>user")


@pytest.mark.parametrize(("role", "kwargs"), [("pad", {"pad": None}), ("eos", {"eos": None})])
def test_a_missing_special_token_names_the_key_to_set(tmp_path, role, kwargs) -> None:
    directory = save_tokenizer(tmp_path / "tok", **kwargs)
    with pytest.raises(ConfigError, match=f"no {role.upper()} token; set data.{role}_token to "
                                          r"one of its tokens \(its special tokens: '<s>'"):
        load_hf_tokenizer(directory)
    tok = load_hf_tokenizer(directory, **{f"{role}_token": "<|im_end|>"})
    assert tok.special_ids()[role] == raw_tokenizer(directory).token_to_id("<|im_end|>")


def test_a_declared_token_outside_the_vocabulary_is_refused(tok_dir) -> None:
    with pytest.raises(ConfigError, match=r"data.pad_token = '<nope>' is not a token"):
        load_hf_tokenizer(tok_dir, pad_token="<nope>")


def test_directories_that_hold_no_tokenizer_are_refused_naming_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"data.tokenizer_path .*nope does not exist"):
        load_hf_tokenizer(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        load_hf_tokenizer(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no loadable Hugging Face tokenizer"):
        load_hf_tokenizer(tmp_path / "empty")


def test_a_chat_template_file_replaces_the_tokenizers_own(tok_dir, tmp_path) -> None:
    path = tmp_path / "llama3.jinja"
    path.write_text(LLAMA3)
    tok = load_hf_tokenizer(tok_dir, chat_template=path)
    assert tok.chat_template == LLAMA3 and tok.template_label == str(path)
    assert tok.chat_renderer().source == LLAMA3
    with pytest.raises(ConfigError, match=r"data.chat_template .*missing.jinja does not exist"):
        load_hf_tokenizer(tok_dir, chat_template=tmp_path / "missing.jinja")
    bare = load_hf_tokenizer(save_tokenizer(tmp_path / "bare"))
    with pytest.raises(ConfigError, match="has no chat template; set data.chat_template"):
        bare.chat_renderer()


# --------------------------------------------------------------------------- fingerprint


def test_fingerprint_is_stable_and_sees_template_vocabulary_and_specials(tok, tok_dir,
                                                                         tmp_path) -> None:
    """S1: the same tokenizer anywhere gives the same hash; a changed chat template,
    vocabulary or special-token choice changes it."""
    copy = tmp_path / "copy"
    shutil.copytree(tok_dir, copy)
    same = load_hf_tokenizer(copy)
    assert same.fingerprint() == tok.fingerprint() == load_hf_tokenizer(tok_dir).fingerprint()
    tok.encode("warm the backend up")  # calling the tokenizer changes nothing
    assert tok.fingerprint() == same.fingerprint()

    template = tmp_path / "t.jinja"
    template.write_text(CHATML + " ")
    changed = {
        "template file": load_hf_tokenizer(tok_dir, chat_template=template),
        "own template": load_hf_tokenizer(save_tokenizer(tmp_path / "g", chat_template=GEMMA)),
        "vocabulary": load_hf_tokenizer(save_tokenizer(tmp_path / "v", chat_template=CHATML,
                                                       extra=("zebra " * 50,))),
        "pad token": load_hf_tokenizer(tok_dir, pad_token="<|im_end|>"),
        "post-processor": load_hf_tokenizer(save_tokenizer(tmp_path / "b", chat_template=CHATML,
                                                           add_bos=True)),
    }
    hashes = {name: other.fingerprint() for name, other in changed.items()}
    assert tok.fingerprint() not in hashes.values(), hashes
    assert len(set(hashes.values())) == len(hashes)


def test_the_tokenizer_json_really_differs_where_the_fingerprint_says_so(tok_dir,
                                                                         tmp_path) -> None:
    """Control for the vocabulary case above: the retrained tokenizer's merges differ."""
    other = save_tokenizer(tmp_path / "v", extra=("zebra " * 50,))
    merges = [json.loads((d / "tokenizer.json").read_text())["model"]["merges"]
              for d in (tok_dir, other)]
    assert merges[0] != merges[1]


# --------------------------------------------------------------------------- config


def test_build_tokenizer_follows_the_data_section(tok_dir, tok) -> None:
    assert isinstance(build_tokenizer(SimpleNamespace(data=DataConfig())), ByteTokenizer)
    cfg = load_config(overrides=["data.tokenizer=hf", f"data.tokenizer_path={tok_dir}",
                                 "data.pad_token=<|im_end|>"])
    built = build_tokenizer(cfg)
    assert isinstance(built, HFTokenizer) and built.pad_id == raw_tokenizer(tok_dir).token_to_id(
        "<|im_end|>")


def test_tokenizer_path_defaults_to_model_path(tok_dir, tok) -> None:
    data = DataConfig(tokenizer="hf")
    built = build_tokenizer(SimpleNamespace(data=data, model=SimpleNamespace(path=str(tok_dir))))
    assert built.fingerprint() == tok.fingerprint()
    with pytest.raises(ConfigError, match="needs a tokenizer directory: set data.tokenizer_path"):
        build_tokenizer(SimpleNamespace(data=data, model=SimpleNamespace()))
    with pytest.raises(ConfigError, match=r"defaulting to model.path\) .*nope does not exist"):
        build_tokenizer(SimpleNamespace(data=data, model=SimpleNamespace(path="nope")))


@pytest.mark.parametrize("key", ["tokenizer_path", "bos_token", "eos_token", "pad_token",
                                 "chat_template"])
def test_hf_keys_with_the_byte_tokenizer_are_refused_not_ignored(key) -> None:
    with pytest.raises(ConfigError, match=f"data.{key} applies only to a Hugging Face"):
        load_config(overrides=[f"data.{key}=x"])
    assert getattr(load_config(overrides=["data.tokenizer=hf", f"data.{key}=x"]).data, key) == "x"
