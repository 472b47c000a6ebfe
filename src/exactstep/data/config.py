"""Configuration of the data stage (sources, split, tokenizer).

``DataConfig`` is a run's ``[data]`` section: frozen, keyword-only and checked when
built; the resolved values are recorded in the manifest (S1, X2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.errors import ConfigError
from exactstep.ranges import at_least, between, check

# Keys that only mean something for a Hugging Face tokenizer (H2).
HF_TOKENIZER_KEYS = ("tokenizer_path", "bos_token", "eos_token", "pad_token", "chat_template")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where examples come from.

    ``source`` may also be a ``.parquet`` or ``.arrow`` file, or a directory of shards
    of one format (``.jsonl``, ``.parquet`` or ``.arrow``; ``data.datasets_source``).
    ``text_field`` names the field (column) holding a text example, and
    ``messages_field`` the one holding a conversation's messages (``kind = "chat"``).
    ``columns``: further fields (columns) each example carries from a JSONL, Parquet
    or Arrow source, every one required (e.g. ``answer``: a policy reward sees them).

    ``kind``: ``text`` (documents), ``chat`` (conversations), or ``auto`` (unset): the
    kind the objective family reads (``families.resolve`` makes it explicit before the
    manifest records it; a kind the family does not read is refused there, R8).

    ``source``: ``"stdlib"`` (the Python standard library's own source files, one
    document per file) or a path to a JSONL file of ``{"text": ...}`` lines (or
    ``{"messages": [...]}`` lines when ``kind = "chat"``). ``val_fraction`` of the
    documents, chosen by a hash of each document's name, form the validation split.
    ``max_docs`` (0 = all) caps the number of documents read, for quick runs.

    ``tokenizer``: ``"bytes"`` (the built-in byte tokenizer) or ``"hf"`` (a Hugging
    Face tokenizer directory, H2). For ``"hf"`` only: ``tokenizer_path`` (defaults to
    ``model.path`` when the configuration has one); ``bos_token`` / ``eos_token`` /
    ``pad_token`` name tokens of its vocabulary to use as BOS, EOS and PAD (they
    override the tokenizer's own, and are required where it has none);
    ``chat_template`` is a Jinja file that replaces the tokenizer's own chat template.
    Setting any of these with ``tokenizer = "bytes"`` is refused rather than ignored.
    """

    source: str = "stdlib"
    kind: Literal["auto", "text", "chat"] = "auto"
    text_field: str = "text"
    messages_field: str = "messages"
    columns: tuple[str, ...] = ()
    val_fraction: float = 0.05
    max_docs: int = 0
    tokenizer: Literal["bytes", "hf"] = "bytes"
    tokenizer_path: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("data.source must be 'stdlib' or a path to a .jsonl file")
        for key, name in (("data.text_field", self.text_field),
                          ("data.messages_field", self.messages_field)):
            if not name:
                raise ConfigError(f"{key} must name a field of the data; it is empty")
        for name in self.columns:
            if not name or name in (self.text_field, self.messages_field, "weight"):
                raise ConfigError(f"data.columns entry {name!r} must name a further field "
                                  "of the data (not empty, not the text, messages or "
                                  "weight field)")
        if len(set(self.columns)) != len(self.columns):
            raise ConfigError(f"data.columns names a field twice: {list(self.columns)}")
        check("data.val_fraction", self.val_fraction, between(0, 1, low_open=True, high_open=True))
        check("data.max_docs", self.max_docs, at_least(0))  # 0 = all documents
        if self.tokenizer == "bytes":
            for key in HF_TOKENIZER_KEYS:
                if getattr(self, key) is not None:
                    raise ConfigError(
                        f"data.{key} applies only to a Hugging Face tokenizer; set "
                        f"data.tokenizer = 'hf' or remove data.{key}"
                    )
