"""Where a run's examples come from: ``load_bundle(cfg, tokenizer) -> DataBundle`` (R5, S1).

Text sources become ``BOS + ids + EOS`` examples that own every target; chat sources
are rendered once by the tokenizer's template and owned by the chat policy (R5, H2);
a prepared directory is opened by ``rows.prepared`` (P2). The bundle carries the
manifest's ``data`` and ``representation`` sections (S1).
Design and derivations: docs/design/rows.md#rowssourcespy (R5, S1, H2).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from exactstep.data.arith import ArithSpec, arith_conversations
from exactstep.data.chat import ChatRenderer, load_chat_jsonl, template_for
from exactstep.data.conversation import Conversation
from exactstep.data.corpus import check_split, load_corpus
from exactstep.data.prepared import is_prepared
from exactstep.data.tokenizer import Tokenizer
from exactstep.errors import ConfigError
from exactstep.rows.chat import ChatPolicy, chat_examples
from exactstep.rows.config import run_section
from exactstep.rows.example import DataBundle, encode_documents
from exactstep.rows.prepared import load_prepared_bundle

ARITH_SOURCE = "arith"


def conversations_digest(conversations: Sequence[Conversation]) -> str:
    """sha256 over the canonical JSON lines of ``conversations`` (data fingerprint, S1)."""
    h = hashlib.sha256()
    for conversation in conversations:
        h.update(json.dumps(conversation.to_json(), sort_keys=True, ensure_ascii=False).encode())
        if conversation.columns is not None:  # declared columns (data.columns)
            h.update(json.dumps(conversation.columns, sort_keys=True,
                                ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


def is_val(conversation: Conversation, val_fraction: float) -> bool:
    """Hash split: a conversation's content alone decides its split (stable across runs)."""
    canonical = json.dumps(conversation.to_json(), sort_keys=True, ensure_ascii=False)
    bucket = int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "big")
    return bucket / 2**64 < val_fraction


def split_conversations(
    cfg: Any,
) -> tuple[list[Conversation], list[Conversation], str, list[Conversation] | None]:
    """(train, val, split rule, held-out conversations to score or None)."""
    data = cfg.data
    if data.source == ARITH_SOURCE:
        spec = run_section(cfg, "arith", ArithSpec)
        n_train = min(spec.n_train, data.max_docs) if data.max_docs else spec.n_train
        train = arith_conversations(cfg.seed, n_train, split="train", spec=spec)
        heldout = arith_conversations(cfg.seed, spec.n_heldout, split="heldout", spec=spec)
        rule = "arith: problem hash bucket 0 of 10 is held out; val = held-out conversations"
        return train, heldout, rule, heldout
    conversations = load_chat_jsonl(data.source, messages_field=data.messages_field,
                                    columns=data.columns)
    if data.max_docs:
        conversations = conversations[: data.max_docs]
    train = [c for c in conversations if not is_val(c, data.val_fraction)]
    val = [c for c in conversations if is_val(c, data.val_fraction)]
    check_split(train, val, data)
    return train, val, chat_split_rule(data.val_fraction), None


def chat_split_rule(val_fraction: float) -> str:
    """The manifest's words for ``is_val``'s split."""
    return f"sha256(conversation json) / 2^64 < {val_fraction} is val"


def load_bundle(cfg: Any, tokenizer: Tokenizer, *, share: tuple[int, int] = (0, 1)
                ) -> DataBundle:
    """Load and encode both splits of the run's data (text or chat, by ``data.kind``),
    or open a prepared directory (``rows.prepared``: memory-mapped, nothing encoded).

    Raises ``DataError`` for a missing, malformed or empty source (file and line
    named where there is one), and ``ConfigError`` when a weighted reduction meets
    examples without a ``weight`` (L3), before anything is written. ``share``: which
    prepared files this process hashes (``open_family``).
    """
    if cfg.data.columns and (cfg.data.source in (ARITH_SOURCE, "stdlib")
                             or is_prepared(cfg.data.source)):
        raise ConfigError(f"data.columns reads further fields of a JSONL, Parquet or Arrow "
                          f"source; data.source {cfg.data.source!r} has none: drop "
                          "data.columns or point data.source at such a file")
    if is_prepared(cfg.data.source):  # a directory written by ``exactstep prepare`` (P2)
        template = template_for(tokenizer) if cfg.data.kind == "chat" else None
        return load_prepared_bundle(cfg, tokenizer, representation_of(tokenizer, template),
                                    share=share)
    bundle = (load_chat_bundle(cfg, tokenizer) if cfg.data.kind == "chat"
              else load_text_bundle(cfg, tokenizer))
    bundle.require_weights(cfg.objective.reduction)
    return bundle


def load_text_bundle(cfg: Any, tokenizer: Tokenizer) -> DataBundle:
    """Text examples: ``BOS + ids + EOS`` per document, every target owned."""
    corpus = load_corpus(cfg.data)
    section = {
        "source": corpus.source,
        "kind": "text",
        "fingerprint": corpus.fingerprint,
        "split": corpus.split_rule,
        "train_documents": len(corpus.train),
        "val_documents": len(corpus.val),
    }
    return DataBundle(
        train=encode_documents(corpus.train, tokenizer),
        val=encode_documents(corpus.val, tokenizer),
        section=section,
        representation=representation_of(tokenizer),
    )


def load_chat_bundle(cfg: Any, tokenizer: Tokenizer) -> DataBundle:
    """Compile the run's chat data (R5): rendered once, owned on targets, truncated to
    ``batch.seq_len`` with ``chat.empty`` deciding empty conversations.

    Raises ``DataError`` for malformed chat JSONL (file and line named) or, under
    ``chat.empty = 'error'``, for a conversation with no supervised token.
    """
    policy = run_section(cfg, "chat", ChatPolicy)
    template = template_for(tokenizer)
    train_conv, val_conv, rule, heldout = split_conversations(cfg)
    max_len = cfg.batch.seq_len
    train, train_report = chat_examples(train_conv, tokenizer, policy, max_len=max_len,
                                        template=template)
    val, val_report = chat_examples(val_conv, tokenizer, policy, max_len=max_len,
                                    template=template)
    section = {
        "source": cfg.data.source,
        "kind": "chat",
        "fingerprint": conversations_digest(train_conv + val_conv),
        "split": rule,
        "train_documents": len(train),
        "val_documents": len(val),
        "chat_policy": asdict(policy),
        "chat_train": train_report.to_dict(),
        "chat_val": val_report.to_dict(),
    }
    if cfg.data.source == ARITH_SOURCE:
        section["arith"] = asdict(run_section(cfg, "arith", ArithSpec))
    return DataBundle(train, val, section, representation_of(tokenizer, template), heldout)


def representation_of(tokenizer: Tokenizer, template: ChatRenderer | None = None) -> dict[str, Any]:
    """The manifest's ``representation`` section (S1): tokenizer kind, hash and special
    ids, and the chat template's name and hash (``template_hash`` is ``None`` for text).

    For the byte tokenizer these are exactly the keys runs have always recorded; a
    Hugging Face tokenizer adds ``vocab_size`` and, for chat, ``template_ownership``
    (``generation-markers`` or ``growing-prefixes``, H2).
    """
    representation: dict[str, Any] = {
        "tokenizer": tokenizer.kind,
        "tokenizer_hash": tokenizer.fingerprint(),
        "special_ids": tokenizer.special_ids(),
    }
    if template is not None:
        representation["template"] = template.name
    representation["template_hash"] = (template.fingerprint(tokenizer)
                                       if template is not None else None)
    if tokenizer.kind != "bytes":
        representation["vocab_size"] = tokenizer.vocab_size
        if template is not None:
            representation["template_ownership"] = getattr(template, "ownership", None)
    return representation
