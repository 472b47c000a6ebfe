"""The built-in byte-level tokenizer: 256 byte ids plus BOS, EOS and PAD (S1).

``ByteTokenizer`` maps text to its UTF-8 bytes, with the special ids above the byte
range and a fingerprint for the manifest; ``build_tokenizer(cfg)`` is the one place a
run's tokenizer is made (this one, or a Hugging Face tokenizer, H2).
Design and derivations: docs/design/data.md#datatokenizerpy (S1, R8, H2).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from exactstep.data.hf_tokenizer import load_hf_tokenizer
from exactstep.errors import ConfigError, DataError


class Tokenizer(Protocol):
    """What the stages use of a tokenizer (``ByteTokenizer``, ``HFTokenizer``).

    Ids lie in ``[0, vocab_size)``; ``encode`` never adds a special id.
    """

    kind: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_text(self, token: int) -> str: ...

    def special_ids(self) -> dict[str, int]: ...

    def byte_lengths(self) -> np.ndarray | None: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, with three special ids above the byte range, then
    the ``extra`` specials a family asked for (``extra_id(name)`` finds one).

    ``decode(encode(s)) == s`` for every string. ``bos_id = 256``, ``eos_id = 257``,
    ``pad_id = 258``; extras get ``259, 260, ...`` in the order given. The
    fingerprint changes whenever the mapping would (it is unchanged without extras).
    """

    kind: str = "bytes"
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    version: int = 1
    BASE_VOCAB: int = 259

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        reserved = {"bos", "eos", "pad"}
        if len(set(extra)) != len(extra) or reserved & set(extra):
            raise ConfigError(f"extra special tokens must be distinct and not bos/eos/pad; "
                              f"got {list(extra)}")
        self.extra = tuple(extra)
        self.vocab_size = self.BASE_VOCAB + len(self.extra)

    def extra_id(self, name: str) -> int:
        """The id of the extra special ``name``; ``ConfigError`` if it was not asked for."""
        if name not in self.extra:
            raise ConfigError(f"the byte tokenizer has no special token {name!r}")
        return self.BASE_VOCAB + self.extra.index(name)

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids in ``[0, 256)``; no special ids are added."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Same ids as ``encode``, as an int64 array (fast path for large corpora)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: byte runs decoded as UTF-8 (invalid sequences replaced by
        U+FFFD), special ids shown as ``<bos>``, ``<eos>``, ``<pad>``.

        Raises ``DataError`` for an id outside ``[0, vocab_size)``.
        """
        names = self.special_names()
        parts: list[str] = []
        run = bytearray()
        for raw in ids:
            token = int(raw)
            if 0 <= token < 256:
                run.append(token)
                continue
            if token not in names:
                raise DataError(
                    f"token id {token} is outside the byte tokenizer's vocabulary "
                    f"[0, {self.vocab_size}); check the data or the tokenizer setting"
                )
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            parts.append(f"<{names[token]}>")
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_text(self, token: int) -> str:
        """One token, printable on one line: ASCII graphic bytes as themselves, space as
        ``␣``, other bytes as ``\\xNN`` (``\\n``, ``\\t`` for newline and tab), specials
        as ``<bos>`` etc. Used by ``rows.inspect``."""
        names = self.special_names()
        if token in names:
            return f"<{names[token]}>"
        if not 0 <= token < 256:
            return f"<?{token}>"
        if token == 0x20:
            return "␣"
        if token == 0x0A:
            return "\\n"
        if token == 0x09:
            return "\\t"
        if 0x21 <= token <= 0x7E:
            return chr(token)
        return f"\\x{token:02x}"

    def special_ids(self) -> dict[str, int]:
        """``{"bos": 256, "eos": 257, "pad": 258}`` and the extras by name (recorded in
        the manifest, S1)."""
        ids = {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id}
        ids.update({name: self.BASE_VOCAB + k for k, name in enumerate(self.extra)})
        return ids

    def special_names(self) -> dict[int, str]:
        return {token: name for name, token in self.special_ids().items()}

    def byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes each id spells as a target: 1 for each byte id and for EOS (the
        end of a document counts as one symbol), 0 for BOS and PAD. Bits per byte of
        held-out text is then bits per target, as it always was for this tokenizer."""
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        lengths[:256] = 1
        lengths[self.eos_id] = 1
        return lengths

    def describe(self) -> dict:
        """The canonical description that ``fingerprint`` hashes."""
        return {
            "kind": "bytes",
            "version": self.version,
            "byte_encoding": "utf-8",
            "vocab_size": self.vocab_size,
            "special_ids": self.special_ids(),
        }

    def fingerprint(self) -> str:
        """sha256 (hex) of the canonical JSON of ``describe()`` (S1)."""
        canonical = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def build_tokenizer(cfg: Any, extra_specials: tuple[str, ...] = ()) -> Tokenizer:
    """The run's tokenizer, from its ``data`` section (S1, H2).

    ``data.tokenizer = "bytes"``: a ``ByteTokenizer`` with the ``extra_specials`` the
    run's objective family needs (R8). ``"hf"``: the Hugging Face
    tokenizer in ``data.tokenizer_path``, which defaults to ``model.path`` when the
    configuration has that key; ``ConfigError`` when neither is set, and whatever
    ``load_hf_tokenizer`` refuses (a missing directory, a missing BOS/EOS/PAD, ...).
    """
    data = cfg.data
    if data.tokenizer == "bytes":
        return ByteTokenizer(extra_specials)
    if extra_specials:
        raise ConfigError(
            f"this objective family needs the special tokens {list(extra_specials)}, which "
            "only the built-in byte tokenizer provides so far; set data.tokenizer = 'bytes'"
        )
    path, key = data.tokenizer_path, "data.tokenizer_path"
    if path is None:
        path = getattr(getattr(cfg, "model", None), "path", None)
        key = "data.tokenizer_path (defaulting to model.path)"
    if not path:
        raise ConfigError("data.tokenizer = 'hf' needs a tokenizer directory: set "
                          "data.tokenizer_path (or model.path)")
    return load_hf_tokenizer(path, path_key=key, bos_token=data.bos_token,
                             eos_token=data.eos_token, pad_token=data.pad_token,
                             chat_template=data.chat_template)
