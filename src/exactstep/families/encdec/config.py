"""Configuration of the encoder-decoder families (R8): the ``encdec`` section.

``EncDecConfig``: the model's layers, the encoder side of a row (``source_len``,
``source_pad_id``) and the built-in ``numwords`` task with its end-of-run score.
Design and derivations: docs/design/families.md#familiesencdecconfigpy (R8).
"""

from __future__ import annotations

from dataclasses import dataclass

from exactstep.ranges import at_least, check


@dataclass(frozen=True, kw_only=True)
class EncDecConfig:
    """The encoder-decoder families' settings (config section ``encdec``).

    Model (``model.encdec``; also what span corruption trains): ``encoder_layers``
    and ``decoder_layers`` (0 = ``model.n_layers``), ``share_embeddings`` (one table
    for source and target; the head is tied to it under ``model.tie_embeddings``).
    Rows: ``source_len`` encoder columns per row (0 = ``batch.seq_len``);
    ``source_pad_id`` the encoder side's pad id (-1 = the tokenizer's pad id).
    Built-in ``numwords`` task: ``n_train`` training pairs (drawn with replacement),
    ``n_heldout`` distinct held-out pairs, numbers in ``[0, max_value]``. End of run:
    greedy exact match on at most ``n_heldout`` validation pairs, each answer at most
    ``max_new_tokens`` tokens.
    """

    encoder_layers: int = 0
    decoder_layers: int = 0
    share_embeddings: bool = True
    source_len: int = 0
    source_pad_id: int = -1
    n_train: int = 20000
    n_heldout: int = 200
    max_value: int = 9999
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("encoder_layers", "decoder_layers", "source_len"):
            check(f"encdec.{name}", getattr(self, name), at_least(0))  # 0 = the default
        check("encdec.source_pad_id", self.source_pad_id, at_least(-1))  # -1 = tokenizer's
        for name in ("n_train", "n_heldout", "max_new_tokens"):
            check(f"encdec.{name}", getattr(self, name), at_least(1))
        check("encdec.max_value", self.max_value, at_least(0))
