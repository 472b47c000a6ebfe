"""The byte tokenizer (issue 2 item 3): exact round trip, specials, stable fingerprint (S1)."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import DataError

TOK = ByteTokenizer()


@given(st.text())
def test_round_trip_is_exact(text: str) -> None:
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids) == text
    assert TOK.encode_array(text).tolist() == ids


def test_specials_are_above_the_byte_range_and_named_in_decode() -> None:
    assert TOK.special_ids() == {"bos": 256, "eos": 257, "pad": 258}
    assert TOK.vocab_size == 259
    assert TOK.decode([256, *TOK.encode("hé"), 257, 258]) == "<bos>hé<eos><pad>"


def test_invalid_utf8_is_replaced_and_unknown_ids_refused() -> None:
    assert TOK.decode([0xFF, ord("a")]) == "\ufffda"
    with pytest.raises(DataError, match="259"):
        TOK.decode([259])


def test_fingerprint_is_sha256_of_the_canonical_description() -> None:
    description = TOK.describe()
    assert description["kind"] == "bytes" and description["byte_encoding"] == "utf-8"
    assert description["vocab_size"] == 259
    assert description["special_ids"] == {"bos": 256, "eos": 257, "pad": 258}
    canonical = json.dumps(description, sort_keys=True, separators=(",", ":"))
    assert TOK.fingerprint() == hashlib.sha256(canonical.encode()).hexdigest()
    assert ByteTokenizer().fingerprint() == TOK.fingerprint()


def test_fingerprint_changes_with_the_definition() -> None:
    """Negative control: a tokenizer with another pad id must not share the hash."""

    class OtherPad(ByteTokenizer):
        pad_id = 300

    assert OtherPad().fingerprint() != TOK.fingerprint()


def test_token_text_is_one_printable_line() -> None:
    shown = [TOK.token_text(i) for i in range(259)]
    assert all(s and s.isprintable() for s in shown)
    assert len(set(shown)) == 259  # no two tokens look alike
    assert TOK.token_text(ord("\n")) == "\\n" and TOK.token_text(256) == "<bos>"
