"""Probe data: tiny documents and microbatches, deterministic from a seed (A1).

Content tokens are drawn from ``3..V-1`` (never pad, BOS or EOS), so a probe controls
exactly where the special tokens are. Each probe draws only the features it probes
(padding, EOS, packing, chat ownership), so a bug shows up in its own probe.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exactstep.audit.protocol import Microbatch, ProbeSpec

Doc = tuple[torch.Tensor, torch.Tensor]  # tokens [n] int64, owned [n] bool


def draw(gen: torch.Generator, n: int, spec: ProbeSpec) -> torch.Tensor:
    """``n`` content tokens."""
    return torch.randint(3, spec.vocab_size, (n,), generator=gen)


def text(gen: torch.Generator, length: int, spec: ProbeSpec, *, eos: bool = False) -> Doc:
    """``BOS content... [EOS]`` of ``length`` tokens; every token but the first owned."""
    body = draw(gen, length - 1 - int(eos), spec)
    parts = [torch.tensor([spec.bos_id]), body] + ([torch.tensor([spec.eos_id])] if eos else [])
    tokens = torch.cat(parts)
    owned = torch.ones(length, dtype=torch.bool)
    owned[0] = False
    return tokens, owned


def chat(gen: torch.Generator, prompt: int, answer: int, spec: ProbeSpec) -> Doc:
    """``BOS prompt... answer...``: only the answer's tokens are owned targets (R5)."""
    tokens = torch.cat([torch.tensor([spec.bos_id]), draw(gen, prompt + answer, spec)])
    owned = torch.zeros(1 + prompt + answer, dtype=torch.bool)
    owned[1 + prompt:] = True
    return tokens, owned


def microbatch(rows: Sequence[Sequence[Doc]], spec: ProbeSpec,
               length: int | None = None) -> Microbatch:
    """Pack each row's documents in order and right-pad every row to ``length``."""
    width = max(sum(len(t) for t, _ in row) for row in rows)
    length = width if length is None else length
    shape = (len(rows), length)
    tokens = torch.full(shape, spec.pad_id, dtype=torch.int64)
    documents = torch.zeros(shape, dtype=torch.int64)
    positions = torch.zeros(shape, dtype=torch.int64)
    owned = torch.zeros(shape, dtype=torch.bool)
    for r, row in enumerate(rows):
        start = 0
        for d, (doc, own) in enumerate(row, start=1):
            stop = start + len(doc)
            tokens[r, start:stop] = doc
            documents[r, start:stop] = d
            positions[r, start:stop] = torch.arange(len(doc))
            owned[r, start:stop] = own
            start = stop
    return Microbatch(tokens=tokens, documents=documents, positions=positions, owned=owned)


def single(docs: Sequence[Doc], spec: ProbeSpec, length: int | None = None) -> Microbatch:
    """One document per row."""
    return microbatch([[d] for d in docs], spec, length)


def replace_tokens(mb: Microbatch, mask: torch.Tensor, gen: torch.Generator,
                   spec: ProbeSpec) -> Microbatch:
    """``mb`` with the content tokens under ``mask`` redrawn (each one changes)."""
    tokens = mb.tokens.clone()
    old = tokens[mask]
    new = 3 + (old - 3 + torch.randint(1, spec.vocab_size - 3, old.shape, generator=gen)) % (
        spec.vocab_size - 3)
    tokens[mask] = new
    return Microbatch(tokens=tokens, documents=mb.documents, positions=mb.positions,
                      owned=mb.owned)
