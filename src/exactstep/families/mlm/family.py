"""The masked-LM family (R8): text, the MLM compiler (``compiler.py``: 15% selected,
80/10/10), the built-in stack run bidirectionally, its ``<mask>`` special, and masked-token
accuracy on held-out rows, evaluated under the one E1 isolation (``eval.eval_mode``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from exactstep.config import RunConfig
from exactstep.errors import ConfigError
from exactstep.eval import isolated
from exactstep.families.causal.family import build_decoder
from exactstep.families.mlm.compiler import (
    ACTION_NAMES,
    KEEP,
    MASK,
    MLM_STREAM,
    RANDOM,
    MLMCompiler,
    Vocabulary,
)
from exactstep.families.mlm.config import MLMConfig
from exactstep.families.registry import DEFAULT_SOURCE, Family
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.example import Example
from exactstep.rows.stream import eval_batches
from exactstep.update.window import head_for_loss


def scored_batches(batches: Iterable[Batch], max_tokens: int) -> Iterator[Batch]:
    """The held-out batches ``eval.evaluate`` scores: those with a target, until
    ``max_tokens`` targets have been seen (checked before each batch)."""
    tokens = 0
    for batch in batches:
        if tokens >= max_tokens:
            return
        n = batch.num_targets()
        if n:
            tokens += n
            yield batch


def masked_token_hits(model: torch.nn.Module, batches: Iterable[Batch], *,
                      device: torch.device) -> dict[int, tuple[int, int]]:
    """``{action: (correct, targets)}``: top-1 hits of the model at each supervised
    column of ``batches``, by the column's corruption action (E1 isolation)."""
    hits = {MASK: [0, 0], RANDOM: [0, 0], KEEP: [0, 0]}
    inner = getattr(model, "module", model)
    with isolated(model):
        for batch in batches:
            supervised = batch.labels != IGNORE_INDEX  # [B, T] host
            hidden = model(batch.to(device))[supervised.to(device)]  # [n, H]
            guess = (hidden.float() @ head_for_loss(inner).float().t()).argmax(-1).cpu()  # [n]
            right = guess == batch.labels[supervised]  # [n]
            acts = batch.meta["mlm"].action[supervised]  # [n]
            for code, tally in hits.items():
                tally[0] += int(right[acts == code].sum())
                tally[1] += int((acts == code).sum())
    return {code: (c, t) for code, (c, t) in hits.items()}


def unigram_guess(train: Sequence[Example], vocab: Vocabulary) -> int:
    """The most frequent non-special token of the training examples: the unigram
    model's top-1 answer at every masked position (the lowest id on ties)."""
    size = int(max(vocab.normal.max(initial=0), vocab.special.max(initial=0))) + 1
    counts = np.zeros(size, dtype=np.int64)
    for example in train:
        counts += np.bincount(example.tokens, minlength=size)[:size]
    return int(vocab.normal[int(np.argmax(counts[vocab.normal]))])


def mlm_score(model: Any, parts: Any, cfg: RunConfig, device: Any) -> dict[str, Any]:
    """The family's end-of-run held-out figures (``Family.score``): top-1 accuracy at
    the held-out selected positions, overall and by action (the masked ones are the
    figure that matters: a kept token is visible in the input), against the unigram
    answer (the most frequent training token) on the same targets. The held-out loss
    and the unigram bits beside it are the Validator's, on the same targets."""
    compiler, tokenizer, budget = parts.compiler, parts.tokenizer, cfg.train.eval_tokens

    def heldout() -> Iterator[Batch]:
        return scored_batches(eval_batches(parts.data.val, cfg.batch, pad_id=tokenizer.pad_id,
                                           vocab_size=tokenizer.vocab_size, compiler=compiler),
                              budget)

    hits = masked_token_hits(model, heldout(), device=device)
    guess = unigram_guess(parts.data.train, compiler.vocab)
    unigram = [int((b.labels == guess).sum()) for b in heldout()]
    correct, total = sum(c for c, _ in hits.values()), sum(t for _, t in hits.values())
    out: dict[str, Any] = {
        "masked_accuracy": correct / total if total else None,
        "masked_targets": total,
        "unigram_accuracy": sum(unigram) / total if total else None,
        "unigram_answer": guess,
    }
    for code, (c, t) in hits.items():
        out[f"masked_accuracy_{ACTION_NAMES[code]}"] = c / t if t else None
        out[f"masked_targets_{ACTION_NAMES[code]}"] = t
    return out


# --------------------------------------------------------------------------- the family


def mlm_compiler(cfg: RunConfig, tokenizer: Any) -> MLMCompiler:
    """The run's compiler: its ``[mlm]`` settings, the tokenizer's ids, the run's seed.
    ``batch.boundary = "keep"`` is refused: it supervises a next document's first
    token, and a masked LM has no next-token target."""
    if cfg.batch.boundary != "ignore":
        raise ConfigError("objective.family = 'mlm' has no next-token targets, so "
                          "batch.boundary = 'keep' means nothing; set batch.boundary = 'ignore'")
    return MLMCompiler(cfg.mlm, Vocabulary.of(tokenizer), seed=cfg.seed)


def mlm_objective(cfg: RunConfig) -> dict[str, Any]:
    """The manifest's objective section (S1): the family's passport (selection law,
    eligible tokens, replacement distribution, RNG address)."""
    s: MLMConfig = cfg.mlm
    return {
        "family": "masked_lm",
        "shift_owner": "collator",
        "ownership": "selected_positions",
        "estimator": "masked_reconstruction_mle",
        "selection": {
            "rule": "fixed_count: max(1, floor(mask_rate * eligible + 0.5)) per piece, "
                    "uniform without replacement",
            "eligible": "non-special tokens",
            "mask_rate": s.mask_rate,
            "replace_mask": s.replace_mask,
            "replace_random": s.replace_random,
            "keep": s.keep,
            "random_tokens": "uniform over non-special ids",
            "rng": f"numpy default_rng([{MLM_STREAM}, seed, epoch, example_id, piece])",
        },
    }


def mlm_specials(cfg: RunConfig) -> tuple[str, ...]:
    return ("mask",)


def build_encoder(cfg: RunConfig, vocab_size: int) -> Any:
    """The built-in block stack as a bidirectional encoder (its batches are not causal)."""
    if cfg.model.source != "builtin":
        raise ConfigError(
            f"objective.family = {cfg.objective.family!r} trains the built-in bidirectional "
            "encoder; set model.source = 'builtin' (Hugging Face models are causal LMs here)"
        )
    return build_decoder(cfg, vocab_size)


FAMILY = Family(name="mlm", model="encoder", data_kind="text", default_source=DEFAULT_SOURCE,
                compiler=mlm_compiler, objective=mlm_objective, build_model=build_encoder,
                specials=mlm_specials, score=mlm_score)
