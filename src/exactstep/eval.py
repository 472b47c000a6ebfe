"""Evaluation with isolation (E1), perplexity from global sums (L5), greedy decoding.

``evaluate`` reads only parameters, in eval mode under ``torch.no_grad`` with every
RNG stream isolated, and restores each module's mode (E1); ``Validator`` is the
component a run calls for held-out figures; ``greedy_answer_accuracy`` scores a chat
demo's held-out answers.
Design and derivations: docs/design/run.md#evalpy (E1, L5).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from exactstep.data.arith import last_turn_prompt
from exactstep.data.chat import DEFAULT_TEMPLATE, ChatTemplate, ChatTokenizer
from exactstep.data.conversation import Conversation
from exactstep.errors import DataError
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.cross_entropy import fused_row_losses
from exactstep.objective.perplexity import NotAvailable, perplexity
from exactstep.rows.batch import IGNORE_INDEX, Batch, held_out_batches, single_segment_batch
from exactstep.rows.compiler import CAUSAL, RowCompiler
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece
from exactstep.rows.stream import RowStream, eval_batches
from exactstep.state.rng import eval_mode, isolated, isolated_rng  # noqa: F401 (E1, re-exported)
from exactstep.update.window import head_for_loss

LN2 = math.log(2.0)


@dataclass(frozen=True)
class EvalResult:
    """Gold (unsmoothed) NLL summed over ``tokens`` held-out targets (L5), and the
    UTF-8 bytes those targets spell (``target_bytes``; ``None`` when the tokenizer
    cannot say, see ``byte_lengths`` of the tokenizers)."""

    gold_nll_sum: float
    tokens: int
    target_bytes: int | None = None

    @property
    def loss(self) -> float | None:
        return self.gold_nll_sum / self.tokens if self.tokens else None

    @property
    def perplexity(self) -> float | NotAvailable:
        return perplexity(self.gold_nll_sum, self.tokens)

    @property
    def bits_per_token(self) -> float | None:
        return self.gold_nll_sum / LN2 / self.tokens if self.tokens else None

    @property
    def bits_per_byte(self) -> float | None:
        """Bits per byte of held-out text: the same nats over the bytes the targets
        spell. With the byte tokenizer a target is one byte (the EOS counts as one),
        so this equals ``bits_per_token``; with a BPE it is comparable across
        tokenizers, which bits per token is not."""
        if not self.target_bytes:
            return None
        return self.gold_nll_sum / LN2 / self.target_bytes


def evaluate(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    *,
    device: torch.device,
    max_tokens: int,
    pad_id: int | None,
    autocast: Callable[[], AbstractContextManager] | None = None,
    byte_lengths: np.ndarray | None = None,
) -> EvalResult:
    """Sum gold NLL over held-out batches until ``max_tokens`` targets are seen.

    ``byte_lengths`` (one entry per id: the UTF-8 bytes the id spells as a target)
    also sums the bytes of the same targets, for bits per byte.

    Isolation (E1): the forward runs in eval mode under ``torch.no_grad`` inside
    ``isolated_rng``; on return (or on an error) every RNG stream and every module's
    ``training`` flag are what they were before the call (a submodule frozen in eval
    mode inside a training model stays so), no gradient is created and nothing but
    parameters is read. The sums are accumulated on the device and read once at the
    end (U7 spirit).
    """
    cfg = ObjectiveConfig(label_smoothing=0.0)
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    target_bytes = 0
    with isolated(model):
        for batch, n, spelled in held_out_batches(batches, max_tokens, byte_lengths):
            on_device = batch.to(device)
            with autocast() if autocast is not None else nullcontext():
                hidden = model(on_device)  # [B, T, H]
            _, gold = fused_row_losses(
                hidden.reshape(-1, hidden.shape[-1]),
                _head_weight(model),
                on_device.labels.reshape(-1),
                cfg,
                pad_id=pad_id,
            )
            nll_sum += gold.double().sum()
            tokens += n
            target_bytes += spelled
    return EvalResult(gold_nll_sum=float(nll_sum), tokens=tokens,
                      target_bytes=target_bytes if byte_lengths is not None else None)


#: Training targets a compiled unigram fit reads at most (families other than causal).
COMPILED_FIT_TARGETS = 250_000
FIT_SEED = 0  # the order in which those targets are read (a fixed, declared shuffle)


def example_target_counts(train_examples: Sequence[Example], vocab_size: int) -> np.ndarray:
    """Add-one counts of the training examples' supervised targets (causal and chat:
    every owned token, which is what their compiler supervises)."""
    counts = np.ones(vocab_size, dtype=np.float64)
    histogram = getattr(train_examples, "target_histogram", None)
    if histogram is not None and histogram(vocab_size) is not None:
        return counts + histogram(vocab_size)  # prepared shards: counted once by prepare (P2)
    for ex in train_examples:
        targets = ex.tokens[1:] if ex.owned is None else ex.tokens[ex.owned]
        counts += np.bincount(targets, minlength=vocab_size)[:vocab_size]
    return counts


def target_counts(batches: Iterable[Batch], vocab_size: int, limit: int) -> tuple[np.ndarray, int]:
    """Add-one counts of the supervised labels of ``batches`` until ``limit`` are seen,
    and how many were counted: the fit for a family whose compiler rewrites targets
    (span corruption's sentinels, masked positions, a factorisation's predictions)."""
    counts, seen = np.ones(vocab_size, dtype=np.float64), 0
    for batch in batches:
        if seen >= limit:
            break
        labels = batch.labels[batch.labels != IGNORE_INDEX].numpy()
        counts += np.bincount(labels, minlength=vocab_size)[:vocab_size]
        seen += len(labels)
    return counts, seen


def unigram_bits_on(val_batches: Iterable[Batch], counts: np.ndarray,
                    max_tokens: int) -> float | None:
    """Bits per target of the unigram ``counts`` on the validation targets ``evaluate``
    scores (the same batches and the same stopping rule)."""
    log2p = torch.from_numpy(np.log2(counts / counts.sum()))
    bits, tokens = 0.0, 0
    for batch in val_batches:
        if tokens >= max_tokens:
            break
        labels = batch.labels[batch.labels != IGNORE_INDEX]
        if labels.numel() == 0:
            continue
        bits -= float(log2p[labels].sum())
        tokens += labels.numel()
    return bits / tokens if tokens else None


def unigram_bits(
    train_examples: Sequence[Example], val_batches: Iterable[Batch], vocab_size: int,
    max_tokens: int,
) -> float | None:
    """Bits per target of a unigram (token-frequency) model fit on the training
    examples' supervised targets (add-one smoothing), scored on the same validation
    targets ``evaluate`` scores. The baseline the summary compares bits per byte to."""
    return unigram_bits_on(val_batches, example_target_counts(train_examples, vocab_size),
                           max_tokens)


def _head_weight(model: torch.nn.Module) -> torch.Tensor:
    return head_for_loss(getattr(model, "module", model))


def display_perplexity(result: EvalResult) -> float | str:
    """A perplexity for JSON and summaries: the number, or ``"N/A (cause)"`` (L5)."""
    ppl = result.perplexity
    return ppl if not isinstance(ppl, NotAvailable) else f"N/A ({ppl.cause})"


@dataclass(frozen=True)
class Validator:
    """Held-out evaluation of one run: its model and splits, fixed at build time (E1, L5)."""

    model: torch.nn.Module
    train: Sequence[Example]
    val: Sequence[Example]
    batch: BatchConfig
    pad_id: int
    vocab_size: int
    device: torch.device
    max_tokens: int
    autocast: Callable[[], AbstractContextManager] | None = None
    byte_lengths: np.ndarray | None = None  # the tokenizer's ``byte_lengths()``
    compiler: RowCompiler = CAUSAL  # the objective family's (R8)
    # a model split over processes (pipeline stages) sums its own held-out NLL:
    # ``(batches, max_tokens, byte_lengths) -> (gold NLL sum, targets, target bytes)``,
    # the same on every process
    evaluator: Callable[[Iterable[Batch], int, np.ndarray | None],
                        tuple[float, int, int | None]] | None = None

    def evaluate(self) -> EvalResult:
        batches = eval_batches(self.val, self.batch, pad_id=self.pad_id,
                               vocab_size=self.vocab_size, compiler=self.compiler)
        if self.evaluator is not None:
            with isolated(self.model):  # E1, as ``evaluate``
                nll, tokens, target_bytes = self.evaluator(batches, self.max_tokens,
                                                           self.byte_lengths)
            return EvalResult(gold_nll_sum=nll, tokens=tokens, target_bytes=target_bytes)
        return evaluate(self.model, batches, device=self.device, max_tokens=self.max_tokens,
                        pad_id=self.pad_id, autocast=self.autocast,
                        byte_lengths=self.byte_lengths)

    def record(self) -> dict[str, Any]:
        """One ``metrics.jsonl`` evaluation record."""
        result = self.evaluate()
        return {
            "eval_loss": result.loss,
            "eval_tokens": result.tokens,
            "eval_bits_per_byte": result.bits_per_byte,
            "eval_bits_per_token": result.bits_per_token,
            "eval_perplexity": display_perplexity(result),
        }

    def baseline_bits(self) -> float | None:
        """Unigram (token-frequency) bits per target on the same validation targets,
        fit on the training targets this family supervises: the examples' owned tokens
        for the causal compiler, the compiled training labels for a family that rewrites
        them (R8): one epoch of the split in a seeded order (``FIT_SEED``), at most
        ``COMPILED_FIT_TARGETS`` of them."""
        val = eval_batches(self.val, self.batch, pad_id=self.pad_id, compiler=self.compiler)
        if self.compiler is CAUSAL:
            return unigram_bits(self.train, val, self.vocab_size, self.max_tokens)
        # a seeded shuffle of the whole split, one epoch: the first targets of the corpus
        # in file order would be a biased sample of it
        train = RowStream(self.train, self.batch, pad_id=self.pad_id, seed=FIT_SEED,
                          repeat=False, shuffle=True, compiler=self.compiler)
        counts, _ = target_counts(train, self.vocab_size, COMPILED_FIT_TARGETS)
        return unigram_bits_on(val, counts, self.max_tokens)

    def summary(self) -> dict[str, Any]:
        """The held-out figures of the end-of-run summary: bits per token and, where
        the tokenizer says what its ids spell, bits per byte; the unigram baseline in
        both units on the same targets (so the ratio is one number either way)."""
        result = self.evaluate()
        unigram = self.baseline_bits()
        bpt = result.bits_per_token
        return {
            "heldout_loss": result.loss,
            "heldout_tokens": result.tokens,
            "heldout_bytes": result.target_bytes,
            "heldout_perplexity": display_perplexity(result),
            "heldout_bits_per_token": bpt,
            "heldout_bits_per_byte": result.bits_per_byte,
            "unigram_bits_per_token": unigram,
            "unigram_bits_per_byte": per_byte(unigram, result),
            "bpb_ratio_to_unigram": (bpt / unigram) if (bpt and unigram) else None,
        }


def per_byte(bits_per_target: float | None, result: EvalResult) -> float | None:
    """Bits per target of ``result``'s targets restated per byte they spell."""
    if bits_per_target is None or not result.target_bytes:
        return None
    return bits_per_target * result.tokens / result.target_bytes


# --------------------------------------------------------------------------- greedy decoding


class DecoderLike(Protocol):
    def __call__(self, batch: Batch) -> torch.Tensor: ...  # [B, T, H] (runs forward)
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [B, T, V]


@torch.no_grad()
def _greedy_continue(
    model: DecoderLike, prompts: torch.Tensor, eos_id: int, max_new_tokens: int,
    prefix_len: int | None = None,
) -> list[list[int]]:
    """Greedy decoding without a KV cache; each list stops before its first EOS.

    Every step's batch is whole rows (one document per row), so attention runs as one
    plain causal SDPA under ``auto`` and ``flex`` alike: a length that grows by one per
    step never reaches (and never recompiles) FlexAttention. With ``prefix_len`` (at
    most the prompt's length) the prompt's first ``prefix_len`` tokens stay one
    bidirectional prefix at every step and every generated token is causal: one
    masked SDPA per step, still never FlexAttention.
    """
    tokens = prompts  # [G, L]
    finished = torch.zeros(prompts.shape[0], dtype=torch.bool, device=prompts.device)
    for _ in range(max_new_tokens):
        hidden = model(single_segment_batch(tokens, prefix_len))  # [G, L', H]
        next_ids = model.logits(hidden[:, -1:, :])[:, -1, :].argmax(dim=-1)  # [G]
        next_ids = torch.where(finished, torch.full_like(next_ids, eos_id), next_ids)
        tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
        finished |= next_ids == eos_id
        if bool(finished.all()):
            break
    generated = tokens[:, prompts.shape[1]:].tolist()
    return [row[: row.index(eos_id)] if eos_id in row else row + [-1] for row in generated]


def greedy_answer_accuracy(
    model: DecoderLike,
    tokenizer: ChatTokenizer,
    conversations: Sequence[Conversation],
    *,
    device: torch.device | str,
    max_new_tokens: int = 16,
    batch_size: int = 64,
    template: ChatTemplate = DEFAULT_TEMPLATE,
    prefix_of: Callable[[Conversation, list[int]], int] | None = None,
) -> float:
    """Exact-match accuracy of greedy answers to each conversation's LAST assistant turn.

    The prompt is every earlier message plus the assistant header; an answer counts
    only if the model emits exactly the expected tokens and then the end-of-turn
    marker within ``max_new_tokens``. ``prefix_of(conversation, prompt)`` (prefix LM,
    R8) gives the bidirectional prefix of the decoding row, at most ``len(prompt)``;
    without it decoding is causal. Runs in eval mode under ``no_grad`` inside
    ``isolated_rng`` (every RNG stream is restored afterwards) and restores the model's
    previous mode (E1). Raises ``DataError`` on an empty set.
    """
    if not conversations:
        raise DataError("greedy_answer_accuracy needs at least one held-out conversation")
    by_length: dict[tuple[int, int | None], list[tuple[list[int], list[int]]]] = {}
    for conversation in conversations:
        messages, expected = last_turn_prompt(conversation)
        prompt = template.render_prompt(messages, tokenizer).tokens.tolist()
        prefix = None if prefix_of is None else prefix_of(conversation, prompt)
        by_length.setdefault((len(prompt), prefix), []).append(
            (prompt, tokenizer.encode(expected)))
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        correct = 0
        with isolated_rng():  # a stochastic layer must not move the run's streams (E1)
            for (_, prefix), group in by_length.items():
                for start in range(0, len(group), batch_size):
                    chunk = group[start : start + batch_size]
                    prompts = torch.tensor([p for p, _ in chunk], dtype=torch.int64, device=device)
                    answers = _greedy_continue(model, prompts, tokenizer.eos_id, max_new_tokens,
                                               prefix)
                    correct += sum(
                        got == want for got, (_, want) in zip(answers, chunk, strict=True)
                    )
    finally:
        if hasattr(model, "train"):
            model.train(was_training)
    return correct / len(conversations)


# --------------------------------------------------------------------------- a finished run


@dataclass(frozen=True)
class EvalReport:
    checkpoint: str
    result: EvalResult
    unigram: float | None  # bits per target
    environment: str = ""  # the numerics environment evaluated in, against the record (S9)
    teacher: dict | None = None  # the data's teacher, for a student of distillation (R10)

    def format(self) -> str:
        r = self.result
        ppl = r.perplexity
        ppl_s = f"N/A ({ppl.cause})" if isinstance(ppl, NotAvailable) else f"{ppl:.3f}"
        loss_s = f"{r.loss:.4f}" if r.loss is not None else "N/A (no targets)"
        lines = [f"checkpoint {self.checkpoint}", f"  held-out loss {loss_s} over {r.tokens} targets",
                 f"  perplexity {ppl_s}"]
        per_target = [("byte", r.bits_per_byte, per_byte(self.unigram, r))]
        if r.target_bytes != r.tokens:  # a target is not always one byte: say both
            per_target.append(("token", r.bits_per_token, self.unigram))
        for unit, bits, unigram in per_target:
            lines.append(f"  bits per {unit} {fmt(bits)} (unigram baseline {fmt(unigram)})")
        if self.environment:
            lines.append(f"  numerics {self.environment}")
        if self.teacher:
            lines.append(f"  trained on teacher targets: {teacher_line(self.teacher)}")
        return "\n".join(lines)


def teacher_line(teacher: dict) -> str:
    """One line naming a distilled run's teacher and its decoding (R10)."""
    what = teacher.get("kind", "?")
    digest = (teacher.get("checkpoint_sha256") or
              ",".join(sorted(teacher.get("weights_sha256", {}).values())) or "?")
    decoding = teacher.get("decoding", {})
    how = "greedy" if decoding.get("greedy") else (
        f"sampled (temperature {decoding.get('temperature')}, seed {decoding.get('seed')})")
    return f"{what} {teacher.get('path', '?')} (sha256 {digest[:12]}), {how}"


def fmt(x: float | None) -> str:
    return f"{x:.4f}" if x is not None else "N/A"


# ------------------------------------------------------- denoising reconstruction (R9)


def heldout_pieces(examples: Sequence[Any], n: int, max_tokens: int) -> list[tuple[Any, Any]]:
    """``(example, piece)`` for the first ``n`` held-out text examples with content: each
    one piece of its first ``max_tokens`` content tokens (``BOS`` included, as a row's
    first piece), drawn at epoch 0: the pieces an end-of-run reconstruction score reads."""
    out = []
    for i, example in enumerate(examples):
        if len(out) == n:
            break
        if len(example.tokens) > 2:  # BOS, content, EOS
            out.append((example, Piece(example=i, offset=0,
                                       length=min(len(example.tokens), max_tokens + 1),
                                       piece=0, epoch=0)))
    return out


def edit_accuracy(hypotheses: Sequence[Sequence[int]], references: Sequence[Sequence[int]]
                  ) -> float | None:
    """``1 - (sum of token edit distances) / (sum of reference lengths)``: 1 is every
    reference reproduced, 0 as many edits as tokens (it can go below 0); ``None``
    without reference tokens."""
    edits = total = 0
    for hyp, ref in zip(hypotheses, references, strict=True):
        edits += levenshtein(list(hyp), list(ref))
        total += len(ref)
    return None if total == 0 else 1.0 - edits / total


def levenshtein(a: list[int], b: list[int]) -> int:
    """Insertions, deletions and substitutions that turn ``a`` into ``b``."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]
