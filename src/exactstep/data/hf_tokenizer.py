"""A Hugging Face tokenizer behind the interface the stages use (H2, S1).

``load_hf_tokenizer`` reads a fast tokenizer saved by ``save_pretrained``, offline, and
wraps it as an ``HFTokenizer`` with the same surface as ``ByteTokenizer``: ids of text
with no special token added, resolved BOS/EOS/PAD ids, and a fingerprint for the
manifest that also covers the chat template in use.
Design and derivations: docs/design/data.md#datahf_tokenizerpy (H2, S1, R1, R5).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from exactstep.data.hf_chat import HFChatTemplate
from exactstep.errors import ConfigError, DataError

SPECIAL_ROLES = ("bos", "eos", "pad")
FINGERPRINT_VERSION = 2  # 2: special-token text in documents is text


class HFTokenizer:
    """A loaded Hugging Face fast tokenizer with resolved BOS/EOS/PAD ids.

    ``hf`` is the ``transformers`` tokenizer; ``path`` the directory it came from;
    ``chat_template`` the Jinja text a chat run renders with (``None`` when there is
    none) and ``template_label`` where that text came from (for errors and the
    manifest).

    Invariants: ``encode`` / ``encode_array`` never add BOS or EOS, and a document's
    text never yields a special id; every id lies in ``[0, vocab_size)``, where
    ``vocab_size`` is one more than the largest id (a model's embedding may have more
    rows, never fewer).
    """

    kind: str = "hf"

    def __init__(self, hf: Any, path: Path, special: dict[str, int],
                 chat_template: str | None, template_label: str) -> None:
        self.hf = hf
        self.path = path
        self.bos_id = special["bos"]
        self.eos_id = special["eos"]
        self.pad_id = special["pad"]
        self.chat_template = chat_template
        self.template_label = template_label
        self._backend = hf.backend_tokenizer
        vocab = hf.get_vocab()
        self.vocab_size = 1 + max(vocab.values())
        self._special = frozenset(
            token_id for token_id, token in hf.added_tokens_decoder.items() if token.special
        ) | {self.eos_id}
        self._names = {token_id: token.content for token_id, token in hf.added_tokens_decoder.items()}
        self._fingerprint = self._compute_fingerprint()

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` with no special token added by the tokenizer."""
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str) -> np.ndarray:
        """A *document's* ids, as an int64 array. A document is data, not markup: the
        text of a special token inside it (``<|endoftext|>`` quoted in a source file)
        is encoded as the ordinary text it is, never as that special id, just as the
        byte tokenizer cannot produce one from text. ``encode`` (rendered chat
        templates, whose markup is meant) keeps the tokenizer's own recognition."""
        backend = self._backend
        recognised = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            ids = backend.encode(text, add_special_tokens=False).ids
        finally:
            backend.encode_special_tokens = recognised
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens kept as their text (``<|im_end|>``).

        Raises ``DataError`` for an id outside ``[0, vocab_size)``.
        """
        ids = [int(token) for token in ids]
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise DataError(
                    f"token id {token} is outside the vocabulary [0, {self.vocab_size}) of the "
                    f"tokenizer at {self.path}; check the data or data.tokenizer_path"
                )
        return self._backend.decode(ids, skip_special_tokens=False)

    def token_text(self, token: int) -> str:
        """One token, printable on one line (used by ``rows.inspect``): added tokens as
        their text, others decoded with ``\\n``, ``\\t``, ``\\xNN`` escapes and space
        as ``␣``; an id outside the vocabulary as ``<?id>``."""
        token = int(token)
        if token in self._names:
            return self._names[token]
        if not 0 <= token < self.vocab_size:
            return f"<?{token}>"
        text = self._backend.decode([token], skip_special_tokens=False)
        escaped = text.encode("unicode_escape").decode("ascii").replace(" ", "␣")
        return escaped or "''"

    # ------------------------------------------------------------------ identity

    def special_ids(self) -> dict[str, int]:
        """``{"bos": ..., "eos": ..., "pad": ...}`` (recorded in the manifest, S1)."""
        return {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id}

    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens flagged special, and EOS: the tokens a chat
        template's end-of-turn marker is recognised by (``data.hf_chat``)."""
        return self._special

    def special_tokens(self) -> dict[str, str]:
        """The text of the BOS, EOS and PAD tokens."""
        return {role: self._backend.id_to_token(token_id)
                for role, token_id in self.special_ids().items()}

    def byte_lengths(self) -> np.ndarray | None:
        """UTF-8 bytes each id spells as a target, for bits per byte of held-out text.

        Exact for byte-level BPE (GPT-2, Llama 3, Qwen and ``exactstep tokenizer
        train``): every character of a vocabulary entry stands for one byte. An added
        token that is not special spells its own text; special tokens spell nothing,
        except EOS, which counts as one symbol (as the byte tokenizer counts it).
        ``None`` for any other kind of tokenizer (SentencePiece, WordPiece): its
        held-out figures are then per token only.
        """
        if not is_byte_level(json.loads(self._backend.to_str()).get("decoder")):
            return None
        from tokenizers import pre_tokenizers

        alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for token, token_id in self.hf.get_vocab().items():
            if all(char in alphabet for char in token):
                lengths[token_id] = len(token)
        for token_id, added in self.hf.added_tokens_decoder.items():
            lengths[token_id] = 0 if added.special else len(added.content.encode("utf-8"))
        lengths[self.eos_id] = 1
        return lengths

    def fingerprint(self) -> str:
        """sha256 (hex) over the tokenizer, its special ids and its chat template (S1);
        the transient truncation/padding state is left out. Computed once, at load."""
        return self._fingerprint

    def chat_renderer(self) -> Any:
        """The ``HFChatTemplate`` for this tokenizer's chat template (H2).

        Raises ``ConfigError`` when there is none, naming ``data.chat_template``.
        """
        if self.chat_template is None:
            raise ConfigError(
                f"the tokenizer at {self.path} has no chat template; set data.chat_template "
                "to a Jinja file, or use data.kind = 'text'"
            )
        return HFChatTemplate(source=self.chat_template, label=self.template_label)

    def _compute_fingerprint(self) -> str:
        backend = json.loads(self._backend.to_str())
        backend.pop("truncation", None)  # transient call state, not the mapping
        backend.pop("padding", None)
        backend_hash = hashlib.sha256(canonical_json(backend).encode("utf-8")).hexdigest()
        description = {
            "kind": self.kind,
            "version": FINGERPRINT_VERSION,
            "backend_sha256": backend_hash,
            "split_special_tokens": bool(getattr(self.hf, "split_special_tokens", False)),
            "vocab_size": self.vocab_size,
            "special_ids": self.special_ids(),
            "special_tokens": self.special_tokens(),
            "chat_template": self.chat_template,
        }
        return hashlib.sha256(canonical_json(description).encode("utf-8")).hexdigest()


def is_byte_level(decoder: dict | None) -> bool:
    """Whether a ``tokenizer.json`` decoder maps each character to one byte."""
    if not decoder:
        return False
    if decoder.get("type") == "Sequence":
        return any(is_byte_level(d) for d in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# --------------------------------------------------------------------------- loading


def load_hf_tokenizer(
    path: str | Path,
    *,
    path_key: str = "data.tokenizer_path",
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    chat_template: str | Path | None = None,
) -> HFTokenizer:
    """Load the fast tokenizer saved in directory ``path``, offline (H2).

    ``path_key`` names the setting the path came from, in errors. ``chat_template``
    is a Jinja file replacing the tokenizer's own template. Raises ``ConfigError``
    for a missing directory, a directory without a loadable fast tokenizer, a
    declared token that is not in the vocabulary, a BOS/EOS/PAD neither the
    tokenizer has nor the configuration declares (naming ``data.<role>_token``),
    and a missing or unreadable template file.
    """
    path = Path(path)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise ConfigError(f"{path_key} {path} {what}; point it at a tokenizer directory "
                          "written by save_pretrained (tokenizer.json, tokenizer_config.json)")
    hf = _from_pretrained(path, path_key)
    vocab = hf.get_vocab()
    declared = {"bos": bos_token, "eos": eos_token, "pad": pad_token}
    special = {role: _special_id(hf, vocab, role, declared[role], path) for role in SPECIAL_ROLES}
    for role, token in declared.items():
        if token is not None:
            setattr(hf, f"{role}_token", token)  # templates read bos_token / eos_token
    source, label = _template_source(hf, path, chat_template)
    return HFTokenizer(hf, path, special, source, label)


def _from_pretrained(path: Path, path_key: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("data.tokenizer = 'hf' needs the Hugging Face extra; install it "
                          "with pip install 'exactstep[hf]'") from None
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{path_key} {path} holds no loadable Hugging Face tokenizer "
                          f"({one_line(exc)}); save one there with save_pretrained") from None
    if not getattr(hf, "is_fast", False) or not hasattr(hf, "backend_tokenizer"):
        raise ConfigError(f"{path_key} {path} holds a slow (Python) tokenizer; exactstep needs "
                          "a fast one (tokenizer.json): convert it and save it with save_pretrained")
    hf.model_max_length = 2**62  # rows are cut by batch.seq_len, never by the tokenizer
    return hf


def _special_id(hf: Any, vocab: dict[str, int], role: str, declared: str | None,
                path: Path) -> int:
    key = f"data.{role}_token"
    if declared is not None:
        if declared not in vocab:
            raise ConfigError(f"{key} = {declared!r} is not a token of the tokenizer at {path}; "
                              f"name one of its tokens ({_known_specials(hf)})")
        return vocab[declared]
    own = getattr(hf, f"{role}_token_id", None)
    if own is None:
        raise ConfigError(f"the tokenizer at {path} has no {role.upper()} token; set {key} to "
                          f"one of its tokens ({_known_specials(hf)})")
    return int(own)


def _known_specials(hf: Any) -> str:
    names = [token.content for token in hf.added_tokens_decoder.values() if token.special]
    if not names:
        return "it has no special tokens"
    shown = ", ".join(repr(name) for name in names[:8])
    return f"its special tokens: {shown}" + (", ..." if len(names) > 8 else "")


def _template_source(hf: Any, path: Path, chat_template: str | Path | None) -> tuple[str | None, str]:
    """(Jinja text, label): the file ``data.chat_template`` names, else the tokenizer's own."""
    if chat_template is not None:
        file = Path(chat_template)
        if not file.is_file():
            what = "is a directory, not a file" if file.is_dir() else "does not exist"
            raise ConfigError(f"data.chat_template {file} {what}; point it at a Jinja file")
        try:
            return file.read_text(encoding="utf-8"), str(file)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"data.chat_template {file} cannot be read as UTF-8 text "
                              f"({one_line(exc)})") from None
    own = getattr(hf, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one is used
        own = own.get("default")
    label = f"{path} (the tokenizer's own chat template)"
    return (own if isinstance(own, str) else None), label


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (foreign messages may span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__
