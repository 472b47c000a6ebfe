"""Hugging Face tokenizers and chat templates for tests, built in-process (H2).

Nothing is downloaded: ``train_bpe`` trains a small byte-level BPE with the
``tokenizers`` library on text from the standard library (plus any given strings),
``save_tokenizer`` wraps it as a ``transformers.PreTrainedTokenizerFast`` and writes
it with ``save_pretrained``. ``TEMPLATES`` holds three chat-template styles written
here as Jinja (ChatML-like, Llama-3-like, Gemma-like), each with and without
``{% generation %}`` markers. In the template texts ``⏎`` stands for a newline
emitted by an expression (Hugging Face renders with ``trim_blocks``, which would
swallow a literal newline after a block tag).
"""

from __future__ import annotations

import sysconfig
from functools import lru_cache
from pathlib import Path

import numpy as np

SPECIALS = ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>",
            "<end_of_turn>")
STDLIB_FILES = ("json/__init__.py", "textwrap.py")
EXTRA_TEXT = ("system user assistant tool model What is 2+2? And 3+3? 6, of course. Be brief. "
              "Weather in Paris? It is 18C. weather city arguments name tool_call")


def jinja(text: str) -> str:
    return text.replace("⏎", "{{ '\\n' }}")


def stdlib_text() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in STDLIB_FILES]


@lru_cache(maxsize=8)
def train_bpe(extra: tuple[str, ...] = (), vocab_size: int = 400):
    """A byte-level BPE over the stdlib files, ``EXTRA_TEXT`` and ``extra``, with
    ``SPECIALS`` as special tokens (ids 0..len(SPECIALS)-1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([*stdlib_text(), EXTRA_TEXT, *extra], trainer)
    return tok


def save_tokenizer(directory: Path, *, bos: str | None = "<s>", eos: str | None = "</s>",
                   pad: str | None = "<pad>", chat_template: str | None = None,
                   add_bos: bool = False, extra: tuple[str, ...] = (),
                   vocab_size: int = 400) -> Path:
    """Write a tokenizer directory; ``add_bos`` makes its post-processor prepend BOS
    (as many real tokenizers do) so a test can show exactstep never doubles it."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(train_bpe(extra, vocab_size).to_str())
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    kwargs = {k: v for k, v in {"bos_token": bos, "eos_token": eos, "pad_token": pad}.items()
              if v is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if chat_template is not None:
        fast.chat_template = chat_template
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


def save_byte_tokenizer(directory: Path, chat_template: str) -> Path:
    """exactstep's byte tokenizer as a Hugging Face one: byte b -> id b (no merges),
    ``<bos>``, ``<eos>``, ``<pad>`` = 256, 257, 258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: b for b, char in bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<bos>", "<eos>", "<pad>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", chat_template=chat_template)
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


def raw_tokenizer(directory: Path):
    """The saved ``tokenizer.json`` read back by ``tokenizers`` alone (no exactstep,
    no transformers): the independent side of the tests."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json"))


# --------------------------------------------------------------------------- templates

CHATML = jinja(
    "{% for m in messages %}<|im_start|>{{ m.role }}⏎{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>⏎{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant⏎{% endif %}")
CHATML_MARKED = jinja(
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant⏎"
    "{% generation %}{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>"
    "{% endgeneration %}⏎{% else %}<|im_start|>{{ m.role }}⏎{{ m.content }}<|im_end|>⏎"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant⏎{% endif %}")
LLAMA3 = jinja(
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    "⏎⏎{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>⏎⏎{% endif %}")
LLAMA3_MARKED = jinja(
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>⏎⏎"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}<|eot_id|>"
    "{% endgeneration %}{% else %}{{ m.content | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>⏎⏎{% endif %}")
_GEMMA_HEAD = (
    "{{ bos_token }}{% if messages[0].role == 'system' %}"
    "{% set prefix = messages[0].content + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}")
GEMMA = jinja(
    _GEMMA_HEAD + "{% for m in loop_messages %}"
    "{% set role = 'model' if m.role == 'assistant' else m.role %}<start_of_turn>{{ role }}⏎"
    "{{ (prefix if loop.first else '') + m.content | trim }}<end_of_turn>⏎{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model⏎{% endif %}")
GEMMA_MARKED = jinja(
    _GEMMA_HEAD + "{% for m in loop_messages %}{% if m.role == 'assistant' %}"
    "<start_of_turn>model⏎{% generation %}{{ m.content | trim }}<end_of_turn>{% endgeneration %}⏎"
    "{% else %}<start_of_turn>{{ m.role }}⏎{{ (prefix if loop.first else '') + m.content | trim }}"
    "<end_of_turn>⏎{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model⏎{% endif %}")

# exactstep's built-in byte chat template (exactstep-bytes-chat-v1), rewritten in Jinja
# from its specification in data/chat.py; tool calls as compact sorted-key JSON.
BYTES_MARKED = jinja(
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>⏎{% if m.role == 'assistant' %}"
    "{% generation %}{{ m.content }}{% for c in m.tool_calls or [] %}<|tool_call|>"
    "{{ c | tojson(separators=(',', ':'), sort_keys=True) }}⏎{% endfor %}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>⏎{% endif %}")
BYTES = BYTES_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")

TEMPLATES = {
    ("chatml", False): CHATML, ("chatml", True): CHATML_MARKED,
    ("llama3", False): LLAMA3, ("llama3", True): LLAMA3_MARKED,
    ("gemma", False): GEMMA, ("gemma", True): GEMMA_MARKED,
}

# Negative controls. Not prefix-stable: the end-of-turn marker closes only the last
# message, so a shorter conversation renders a marker the longer one does not have.
UNSTABLE = jinja(
    "{% for m in messages %}<|im_start|>{{ m.role }}⏎{{ m.content }}"
    "{% if loop.last %}<|im_end|>{% endif %}⏎{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant⏎{% endif %}")
UNSTABLE_MARKED = jinja(
    "{% for m in messages %}<|im_start|>{{ m.role }}⏎{% if m.role == 'assistant' %}"
    "{% generation %}{{ m.content }}{% if loop.last %}<|im_end|>{% endif %}{% endgeneration %}"
    "{% else %}{{ m.content }}{% if loop.last %}<|im_end|>{% endif %}{% endif %}⏎{% endfor %}")
# Phi-3 style: every turn ends with its end-of-turn marker, but the conversation as a
# whole ends with EOS only when no generation prompt follows, so a shorter
# conversation renders an EOS where the longer one continues (not prefix-stable).
PHI3_STYLE_MARKED = jinja(
    "{% for m in messages %}<|im_start|>{{ m.role }}⏎{% if m.role == 'assistant' %}"
    "{% generation %}{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}⏎{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant⏎{% else %}{{ eos_token }}{% endif %}")
PHI3_STYLE = PHI3_STYLE_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Qwen3 style: an earlier turn changes once a later one exists. The reasoning of an
# assistant answer (before '</think>') is rendered only in the last message.
REASONING_MARKED = jinja(
    "{% for m in messages %}<|im_start|>{{ m.role }}⏎{% if m.role == 'assistant' %}"
    "{% generation %}{{ m.content if loop.last else m.content.split('</think>')[-1] }}"
    "<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}⏎{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant⏎{% endif %}")
# A marked template that is not prefix-stable and also marks its user turns: the marks
# give more generation spans than there are assistant messages.
PHI3_STYLE_MARKS_USERS = jinja(
    "{% for m in messages %}<|im_start|>{{ m.role }}⏎{% if m.role != 'system' %}"
    "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}"
    "<|im_end|>{% endif %}⏎{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant⏎{% else %}{{ eos_token }}{% endif %}")
# No assistant tokens: assistant messages are not rendered at all.
NO_ASSISTANT = jinja(
    "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.role }}⏎"
    "{{ m.content }}<|im_end|>⏎{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant⏎{% endif %}")
# No assistant tokens with markers: the generation block encloses nothing.
NO_ASSISTANT_MARKED = jinja(
    "{% for m in messages %}<|im_start|>{{ m.role }}⏎{% if m.role == 'assistant' %}"
    "{% generation %}{% endgeneration %}{% endif %}{{ m.content }}<|im_end|>⏎{% endfor %}")
# Markers that leave the end-of-turn marker outside the generation.
EOT_OUTSIDE_MARKED = jinja(
    "{% for m in messages %}<|im_start|>{{ m.role }}⏎{% if m.role == 'assistant' %}"
    "{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>⏎{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant⏎{% endif %}")


def expected_tokens(directory: Path, pieces: list[tuple[str, str]]) -> tuple[list[int], list[str]]:
    """Token ids of the concatenated ``pieces`` (by the raw tokenizer) and, for every
    token, the kind of the hand-written piece it lies in. Fails if a token straddles
    two pieces (the expectation would be ambiguous)."""
    text = "".join(piece for piece, _ in pieces)
    ends = np.cumsum([len(piece) for piece, _ in pieces])
    encoding = raw_tokenizer(directory).encode(text, add_special_tokens=False)
    kinds = []
    for start, stop in encoding.offsets:
        first = int(np.searchsorted(ends, start, side="right"))
        last = int(np.searchsorted(ends, stop - 1, side="right"))
        assert first == last, f"a token spans pieces {first} and {last} of {text!r}"
        kinds.append(pieces[first][1])
    return list(encoding.ids), kinds
