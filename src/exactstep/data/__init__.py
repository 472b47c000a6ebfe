"""Data sources: the stdlib corpus, JSONL text and chat, the byte tokenizer, chat
templates with ownership, and the built-in arithmetic demo (R5, S1)."""

from exactstep.lazy import lazy_exports

_EXPORTS = {
    "ArithSpec": "exactstep.data.arith",
    "ByteTokenizer": "exactstep.data.tokenizer",
    "Conversation": "exactstep.data.chat",
    "DEFAULT_TEMPLATE": "exactstep.data.chat",
    "DataConfig": "exactstep.data.config",
    "Document": "exactstep.data.corpus",
    "Message": "exactstep.data.chat",
    "arith_conversations": "exactstep.data.arith",
    "load_chat_jsonl": "exactstep.data.chat",
    "load_corpus": "exactstep.data.corpus",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
