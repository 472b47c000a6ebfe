"""R3 for Hugging Face models, measured: a packed batch through exactstep's adapter
against HF's *own* forward of each document alone (no mask, HF's default positions,
the model's own windows); the reference never goes through the adapter.

``run_packed`` and ``run_separately`` return per-document logits, the token-mean
loss and every parameter's gradient; ``equivalence_error`` is the largest absolute
difference of the three (R3 promises 1e-5 in fp32).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from equivalence import equivalence_tolerance
from model_batches import packed_batch

from exactstep.model.hf import HFCausalLM
from exactstep.rows.batch import IGNORE_INDEX


def flat(rows: list[list[list[int]]]) -> list[list[int]]:
    return [doc for row in rows for doc in row]


def run_packed(model: HFCausalLM, rows, seq_len: int, *, continue_positions: bool = False):
    """Per-document logits, token-mean loss and gradients from one packed batch."""
    batch = packed_batch(rows, seq_len, positions="continue" if continue_positions else "reset")
    model.zero_grad(set_to_none=True)
    logits = model.logits(model(batch))  # [B, T, V]
    supervised = batch.labels != IGNORE_INDEX
    loss = F.cross_entropy(logits[supervised], batch.labels[supervised], reduction="sum")
    loss = loss / supervised.sum()
    loss.backward()
    per_doc = [logits[b, s.start : s.stop].detach()
               for b, row in enumerate(batch.segments) for s in row]
    return per_doc, loss.detach(), grads(model)


def run_separately(model: HFCausalLM, rows):
    """The same objective from HF's own forward of each document alone (the reference)."""
    docs = flat(rows)
    total = sum(len(d) - 1 for d in docs)
    model.zero_grad(set_to_none=True)
    per_doc, loss = [], torch.zeros(())
    for doc in docs:
        ids = torch.tensor([doc])  # [1, n]
        logits = model.hf(input_ids=ids, use_cache=False).logits[0]  # [n, V]
        part = F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
        (part / total).backward()
        per_doc.append(logits.detach())
        loss = loss + part.detach() / total
    return per_doc, loss, grads(model)


def separate_tolerance(tol: float, model: HFCausalLM, rows, separate) -> float:
    """R3's ``tol``, or twice ``separate``'s own distance from the same documents run
    alone in float64 (a copy of ``model``) where that is larger."""
    return equivalence_tolerance(tol, separate, run_separately(copy.deepcopy(model).double(), rows))


def grads(model: HFCausalLM) -> dict[str, torch.Tensor]:
    """Every parameter's gradient; zeros for one the forward never reached (Mllama's
    cross-attention layers in a text-only forward), in either run alike."""
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for n, p in model.named_parameters()}


def logits_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


