"""Hugging Face chat templates as exactstep chat renderers (H2, R5).

``HFChatTemplate`` renders a conversation with ``transformers``' ``apply_chat_template``
and labels every token with its message and part (``data.chat.Part``), so ownership goes
through the same compiler as the built-in template (``rows.chat``) and the ``chat.*``
policies keep their meaning. Everything is decided on tokens, never on decoded text.
Design and derivations: docs/design/data.md#datahf_chatpy (H2, R5).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from exactstep.data.chat import Part, RenderedChat, Role
from exactstep.data.conversation import Message
from exactstep.errors import DataError

# The test transformers itself applies before it computes an assistant mask.
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
DERIVATION_VERSION = 1


@dataclass(frozen=True, eq=False)
class HFChatTemplate:
    """A Jinja chat template (``source``) from ``label`` (a file, or a tokenizer's own).

    Used with an ``HFTokenizer`` (``exactstep.data.hf_tokenizer``).
    """

    source: str
    label: str

    @property
    def name(self) -> str:
        """How errors and the manifest name the template: where it came from."""
        return self.label

    @property
    def marked(self) -> bool:
        """The template declares its assistant generation with ``{% generation %}``."""
        return GENERATION_TAG.search(self.source) is not None

    @property
    def ownership(self) -> str:
        return "generation-markers" if self.marked else "growing-prefixes"

    def definition(self, tokenizer: Any) -> dict[str, Any]:
        """What ``fingerprint`` hashes: the template text, how ownership is derived,
        and the ids it depends on."""
        return {
            "kind": "hf-jinja",
            "version": DERIVATION_VERSION,
            "ownership": self.ownership,
            "source_sha256": hashlib.sha256(self.source.encode("utf-8")).hexdigest(),
            "special_ids": tokenizer.special_ids(),
            "end_of_turn_ids": sorted(tokenizer.special_token_ids()),
        }

    def fingerprint(self, tokenizer: Any) -> str:
        canonical = json.dumps(self.definition(tokenizer), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def render(self, messages: Sequence[Message], tokenizer: Any) -> RenderedChat:
        """Render a whole conversation with each token's role, message and part.

        Raises ``DataError`` naming the template when it is not prefix-stable (and has
        no generation markers to fall back on), when its marks do not give one run per
        assistant message or sit outside assistant messages, when its marked
        tokenization differs from the plain one, or when it refuses the conversation.
        """
        return _Rendering(self, tokenizer, messages).rendered()

    def render_prompt(self, messages: Sequence[Message], tokenizer: Any) -> RenderedChat:
        """Render ``messages`` then the generation prompt (the assistant header)."""
        rendering = _Rendering(self, tokenizer, messages)
        done = rendering.rendered() if messages else _empty_chat()
        prompt = rendering.tokens(len(messages), prompt=True)
        shared = done.tokens.tolist()
        if self.marked and prompt[: len(shared)] != shared:  # marks only (data.md, step 5)
            done = _head(done, _common_prefix(shared, prompt))
        else:
            rendering.require_prefix(shared, prompt, _first(len(messages)),
                                     _prompted(len(messages)))
        header = prompt[len(done):]
        if not header:
            raise rendering.no_header()
        n = len(header)
        return RenderedChat(
            tokens=np.concatenate([done.tokens, np.asarray(header, dtype=np.int64)]),
            role=np.concatenate([done.role, np.full(n, int(Role.ASSISTANT), dtype=np.int8)]),
            message=np.concatenate([done.message, np.full(n, len(messages), dtype=np.int32)]),
            part=np.concatenate([done.part, np.full(n, int(Part.HEADER), dtype=np.int8)]),
        )


class _Rendering:
    """One conversation under one template: renders prefixes and labels tokens."""

    def __init__(self, template: HFChatTemplate, tokenizer: Any,
                 messages: Sequence[Message]) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.messages = list(messages)
        self.dicts = [m.to_json() for m in self.messages]
        self.special = tokenizer.special_token_ids()

    # ------------------------------------------------------------------ rendering

    def tokens(self, k: int, *, prompt: bool = False, last: dict | None = None) -> list[int]:
        """Tokens of the first ``k`` messages (``last`` replacing message ``k-1``),
        with the generation prompt when ``prompt``."""
        conversation = self.dicts[:k] if last is None else [*self.dicts[: k - 1], last]
        try:
            text = self.tokenizer.hf.apply_chat_template(
                conversation, chat_template=self.template.source, tokenize=False,
                add_generation_prompt=prompt)
        except Exception as exc:  # a user's template may raise anything
            raise self.failed(k, exc) from None
        return self.tokenizer.encode(text)

    def marked_mask(self, tokens: list[int]) -> np.ndarray:
        """The template's assistant mask over the whole conversation (bool [n])."""
        ids, mask = self.assistant_mask(self.dicts)
        if ids != tokens:
            raise DataError(f"template {self.template.label}: the rendering with its "
                            "generation markers tokenizes differently from the plain one; "
                            "check the tokenizer and the template")
        return mask

    def assistant_mask(self, conversation: list[dict]) -> tuple[list[int], np.ndarray]:
        """(ids, assistant mask bool [n]) of ``conversation`` as transformers marks it."""
        try:
            out = self.tokenizer.hf.apply_chat_template(
                conversation, chat_template=self.template.source, tokenize=True,
                return_dict=True, return_assistant_tokens_mask=True)
        except Exception as exc:  # a user's template may raise anything
            raise self.failed(len(conversation), exc) from None
        mask = np.asarray(out["assistant_masks"], dtype=bool)
        if mask.shape != (len(out["input_ids"]),):
            raise DataError(f"template {self.template.label}: its assistant mask has "
                            f"{mask.size} entries for {len(out['input_ids'])} tokens")
        return list(out["input_ids"]), mask

    # ------------------------------------------------------------------ labelling

    def rendered(self) -> RenderedChat:
        if not self.messages:
            return _empty_chat()
        prefixes = [self.tokens(k) for k in range(1, len(self.messages) + 1)]
        for k in range(1, len(prefixes)):
            if self.template.marked and prefixes[k][: len(prefixes[k - 1])] != prefixes[k - 1]:
                return self.marks_only(prefixes[-1])
            self.require_prefix(prefixes[k - 1], prefixes[k], _first(k), _first(k + 1))
        tokens = prefixes[-1]
        mask = self.marked_mask(tokens) if self.template.marked else None
        n = len(tokens)
        role = np.zeros(n, dtype=np.int8)
        message = np.zeros(n, dtype=np.int32)
        part = np.full(n, int(Part.CONTENT), dtype=np.int8)
        for k, msg in enumerate(self.messages):
            lo, hi = (len(prefixes[k - 1]) if k else 0), len(prefixes[k])
            role[lo:hi] = int(Role.of(msg.role))
            message[lo:hi] = k
            if msg.role == "assistant":
                part[lo:hi] = self.assistant_parts(k, lo, hi, tokens, prefixes, mask)
            elif mask is not None and mask[lo:hi].any():
                raise DataError(f"template {self.template.label} marks tokens of the {msg.role} "
                                f"message {k} as assistant generation; only assistant turns "
                                "may sit inside {% generation %}")
        return RenderedChat(tokens=np.asarray(tokens, dtype=np.int64), role=role,
                            message=message, part=part)

    def assistant_parts(self, k: int, lo: int, hi: int, tokens: list[int],
                        prefixes: list[list[int]], mask: np.ndarray | None) -> np.ndarray:
        """Parts of assistant message ``k``'s tokens ``[lo, hi)``
        (docs/design/data.md#datahf_chatpy, steps 2-3)."""
        parts = np.full(hi - lo, int(Part.HEADER), dtype=np.int8)
        if hi == lo:
            return parts
        if mask is not None:
            generated = mask[lo:hi].copy()
        else:
            generated = np.zeros(hi - lo, dtype=bool)
            generated[self.header_end(k, lo, hi, tokens) - lo:] = True
        if not generated.any():
            return parts  # rows.chat refuses an empty generation, naming the conversation
        first = lo + int(np.argmax(generated))
        eot = self.end_of_turn(tokens, first, hi)
        if mask is None and eot is not None:
            generated[eot - lo + 1:] = False
        tool_start = self.tool_call_start(k, lo, hi, tokens) if self.messages[k].tool_calls else None
        for i in range(lo, hi):
            if not generated[i - lo]:
                parts[i - lo] = int(Part.HEADER if i < first else Part.SEPARATOR)
            elif i == eot:
                parts[i - lo] = int(Part.END_OF_TURN)
            elif tool_start is not None and i >= tool_start and (eot is None or i < eot):
                parts[i - lo] = int(Part.TOOL_CALL)
            else:
                parts[i - lo] = int(Part.CONTENT)
        return parts

    def marks_only(self, tokens: list[int]) -> RenderedChat:
        """Labels from the generation marks alone, for a marked template that is not
        prefix-stable (docs/design/data.md#datahf_chatpy, step 5)."""
        runs = _runs(self.marked_mask(tokens))
        turns = [k for k, msg in enumerate(self.messages) if msg.role == "assistant"]
        if len(runs) != len(turns):
            raise self.runs_mismatch(len(runs), len(turns))
        n = len(tokens)
        role = np.full(n, int(Role.NONE), dtype=np.int8)
        message = np.full(n, -1, dtype=np.int32)
        part = np.full(n, int(Part.BEGIN), dtype=np.int8)
        for index, (k, (lo, hi)) in enumerate(zip(turns, runs, strict=True)):
            role[lo:hi] = int(Role.ASSISTANT)
            message[lo:hi] = k
            part[lo:hi] = int(Part.CONTENT)
            eot = self.end_of_turn(tokens, lo, hi)
            if self.messages[k].tool_calls:
                start = self.marked_tool_call_start(k, index, lo, hi, tokens)
                part[start:hi if eot is None else eot] = int(Part.TOOL_CALL)
            if eot is not None:
                part[eot] = int(Part.END_OF_TURN)
        return RenderedChat(tokens=np.asarray(tokens, dtype=np.int64), role=role,
                            message=message, part=part)

    def marked_tool_call_start(self, k: int, index: int, lo: int, hi: int,
                               tokens: list[int]) -> int:
        """Where assistant message ``k``'s marked run ``[lo, hi)`` (its ``index``-th)
        first differs from the run of a rendering without its tool calls; ``lo`` when
        that rendering generates nothing for it."""
        without = [*self.dicts]
        without[k] = {"role": "assistant", "content": self.messages[k].content}
        ids, mask = self.assistant_mask(without)
        runs = _runs(mask)
        turns = sum(msg.role == "assistant" for msg in self.messages)
        if len(runs) == turns - 1:
            return lo
        if len(runs) != turns:
            raise self.runs_mismatch(len(runs), turns,
                                     f" (with message {k}'s tool calls left out)")
        a, b = runs[index]
        return lo + _common_prefix(tokens[lo:hi], ids[a:b])

    def header_end(self, k: int, lo: int, hi: int, tokens: list[int]) -> int:
        """Where assistant message ``k``'s header ends: the end of ``G_k``."""
        if k == 0:
            raise DataError(
                f"template {self.template.label} has no generation markers and the "
                "conversation opens with an assistant message, whose header cannot be told "
                "from its answer (a template renders no empty prompt); add {% generation %} "
                "markers to the template or start the conversation with another message")
        prompt = self.tokens(k, prompt=True)
        self.require_prefix(tokens[:lo], prompt, _first(k), _prompted(k))
        if len(prompt) == lo:
            raise self.no_header()
        self.require_prefix(prompt, tokens[:hi], _prompted(k), _first(k + 1))
        return len(prompt)

    def end_of_turn(self, tokens: list[int], first: int, hi: int) -> int | None:
        """The last special token in ``[first, hi)``, or ``None``."""
        for i in range(hi - 1, first - 1, -1):
            if tokens[i] in self.special:
                return i
        return None

    def tool_call_start(self, k: int, lo: int, hi: int, tokens: list[int]) -> int:
        """The first token of message ``k``'s turn that a rendering without its tool
        calls does not share."""
        without = {"role": "assistant", "content": self.messages[k].content}
        probe = self.tokens(k + 1, last=without)
        self.require_prefix(tokens[:lo], probe, _first(k),
                            f"{_first(k + 1)} with message {k}'s tool calls left out")
        i = lo
        while i < hi and i < len(probe) and probe[i] == tokens[i]:
            i += 1
        return i

    # ------------------------------------------------------------------ errors

    def require_prefix(self, shorter: list[int], longer: list[int], shorter_what: str,
                       longer_what: str) -> None:
        """``shorter`` must be a token prefix of ``longer`` (prefix stability, H2)."""
        if longer[: len(shorter)] == shorter:
            return
        at = next((j for j, (a, b) in enumerate(zip(shorter, longer, strict=False)) if a != b),
                  len(longer))
        got = self.tokenizer.token_text(shorter[at])
        other = self.tokenizer.token_text(longer[at]) if at < len(longer) else "(end)"
        raise DataError(
            f"template {self.template.label} is not prefix-stable: the rendering of "
            f"{shorter_what} ({len(shorter)} tokens) is not a token prefix of the rendering of "
            f"{longer_what} (token {at}: '{got}' vs '{other}'); ownership needs every prefix "
            "of a conversation to render as a token prefix of it"
            + ("" if self.template.marked else
               ", or the template to mark what the model generates: add {% generation %} "
               "markers around each assistant turn's answer and end-of-turn token"))

    def runs_mismatch(self, runs: int, turns: int, what: str = "") -> DataError:
        return DataError(
            f"template {self.template.label} is not prefix-stable, so only its "
            "{% generation %} marks can tell the assistant turns apart, and it marks "
            f"{runs} generation spans for {turns} assistant messages{what}; mark each "
            "assistant turn's answer (never empty) and nothing else")

    def no_header(self) -> DataError:
        return DataError(
            f"template {self.template.label} renders nothing for add_generation_prompt, so "
            "an assistant turn's header cannot be told from its answer; make the template "
            "honour add_generation_prompt or add {% generation %} markers")

    def failed(self, k: int, exc: BaseException) -> DataError:
        message = " ".join(str(exc).split()) or type(exc).__name__
        return DataError(f"template {self.template.label} cannot render {_first(k)} "
                         f"({type(exc).__name__}: {message})")


def _first(k: int) -> str:
    return f"the first {k} message" + ("s" if k != 1 else "")


def _prompted(k: int) -> str:
    return f"{_first(k)} with the generation prompt"


def _empty_chat() -> RenderedChat:
    return RenderedChat(tokens=np.zeros(0, dtype=np.int64), role=np.zeros(0, dtype=np.int8),
                        message=np.zeros(0, dtype=np.int32), part=np.zeros(0, dtype=np.int8))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The maximal runs ``[lo, hi)`` of true entries of a bool mask, in order."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(),
                    strict=True))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _head(chat: RenderedChat, n: int) -> RenderedChat:
    return RenderedChat(tokens=chat.tokens[:n], role=chat.role[:n], message=chat.message[:n],
                        part=chat.part[:n])
