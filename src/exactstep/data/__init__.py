"""The data stage: where examples come from, before rows are compiled (R5, S1, H2, P1).

Text and chat sources (the stdlib corpus, JSONL, Parquet/Arrow shards, the built-in
arithmetic and number-words demos), the byte tokenizer and Hugging Face tokenizers,
chat templates with ownership (built-in and Jinja), and the prepared-shard format read
through memory maps; ``rows/`` compiles what they yield into batches.
Design and derivations: docs/design/data.md (R5, S1, H2, P1).
"""

from exactstep.lazy import lazy_exports

_EXPORTS = {
    "ArithSpec": "exactstep.data.arith",
    "ByteTokenizer": "exactstep.data.tokenizer",
    "Conversation": "exactstep.data.conversation",
    "DEFAULT_TEMPLATE": "exactstep.data.chat",
    "DataConfig": "exactstep.data.config",
    "Document": "exactstep.data.documents",
    "HFChatTemplate": "exactstep.data.hf_chat",
    "HFTokenizer": "exactstep.data.hf_tokenizer",
    "Message": "exactstep.data.conversation",
    "arith_conversations": "exactstep.data.arith",
    "build_tokenizer": "exactstep.data.tokenizer",
    "load_chat_jsonl": "exactstep.data.chat",
    "load_corpus": "exactstep.data.corpus",
    "load_hf_tokenizer": "exactstep.data.hf_tokenizer",
    "open_prepared": "exactstep.data.prepared",
    "template_for": "exactstep.data.chat",
    "train_bpe_tokenizer": "exactstep.data.bpe",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
