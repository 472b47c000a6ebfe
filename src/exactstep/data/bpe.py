"""A byte-level BPE tokenizer trained offline on a corpus' training split (H2, S1).

``train_bpe_tokenizer`` is what ``exactstep tokenizer train`` runs: it reads a text
corpus as a run reads it, trains on the training documents only, and publishes a
``PreTrainedTokenizerFast`` directory that ``data.tokenizer = "hf"`` loads.
Design and derivations: docs/design/data.md#databpepy (H2, S1).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from exactstep.data.config import DataConfig
from exactstep.data.corpus import Corpus, load_corpus
from exactstep.errors import ConfigError
from exactstep.state.durable import check_out, json_bytes, publish_directory, write_durably

SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
BYTE_SYMBOLS = 256
MIN_VOCAB = len(SPECIAL_TOKENS) + BYTE_SYMBOLS
MAX_VOCAB = 1 << 20
TRAINING_RECORD = "training.json"


def train_bpe_tokenizer(source: str, vocab_size: int, out: Path, *,
                        val_fraction: float = DataConfig.val_fraction,
                        text_field: str = DataConfig.text_field) -> dict[str, Any]:
    """Train on ``source``'s training split and publish the tokenizer at ``out``.

    ``source`` is any text ``data.source`` (``stdlib``, a JSONL, Parquet or Arrow
    file or shard directory). Returns the record written to ``training.json``.

    Only ``corpus.train`` is seen, never a validation document. Ids: ``<bos>`` 0,
    ``<eos>`` 1, ``<pad>`` 2, the 256 byte symbols, then the merges. The files are
    byte-identical for the same corpus, ``vocab_size`` and ``tokenizers`` version, and
    are published atomically: an interrupted call leaves nothing at ``out``.
    Raises ``ConfigError`` for a ``vocab_size`` outside ``[259, 2**20]`` or an
    ``out`` that exists and is not an empty directory, and ``DataError`` (from the
    corpus) for missing or malformed data, before anything is written.
    """
    check_vocab_size(vocab_size)
    out = Path(out)
    check_out(out)
    corpus = load_corpus(DataConfig(source=source, val_fraction=val_fraction,
                                    text_field=text_field))
    hf = train_on(corpus, vocab_size)
    record = training_record(corpus, vocab_size, val_fraction)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf.save_pretrained(str(tmp))
        write_durably(tmp / TRAINING_RECORD, json_bytes(record))
        publish_directory(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ConfigError(
            f"--vocab-size must be between {MIN_VOCAB} (3 special tokens + 256 bytes) and "
            f"{MAX_VOCAB}; got {vocab_size}"
        )


def train_on(corpus: Corpus, vocab_size: int) -> Any:
    """A ``PreTrainedTokenizerFast``: byte-level BPE over ``corpus.train`` only."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError("exactstep tokenizer train needs the Hugging Face extra; install it "
                          "with pip install 'exactstep[hf]'") from None
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
    )
    texts = [document.text for document in corpus.train]  # never corpus.val
    core.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos = core.token_to_id(SPECIAL_TOKENS[0])
    core.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[0]} $A", pair=f"{SPECIAL_TOKENS[0]} $A {SPECIAL_TOKENS[0]} $B",
        special_tokens=[(SPECIAL_TOKENS[0], bos)],
    )
    bos_token, eos_token, pad_token = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos_token,
                                   eos_token=eos_token, pad_token=pad_token,
                                   model_max_length=1 << 30)


def training_record(corpus: Corpus, vocab_size: int, val_fraction: float) -> dict[str, Any]:
    """What ``training.json`` says about the tokenizer's provenance (S1)."""
    import tokenizers
    import transformers

    return {
        "format": "exactstep-bpe/1",
        "kind": "byte-level BPE",
        "vocab_size": vocab_size,
        "special_tokens": list(SPECIAL_TOKENS),
        "source": corpus.source,
        "corpus_fingerprint": corpus.fingerprint,
        "split_rule": corpus.split_rule,
        "val_fraction": val_fraction,
        "trained_on": "train split only",
        "train_documents": len(corpus.train),
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
    }
