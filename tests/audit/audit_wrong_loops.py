"""The A2 catalogue: deliberately wrong training loops, one bug each.

Every class is a correct example loop (``exactstep.audit.examples``) with one method
changed; the line marked ``# BUG`` is the whole difference. ``test_audit_matrix``
states, for each, exactly which probes must fail, and which of those report the
target's own exception (an ERROR per probe, never an audit crash). The last sections
cover the shape-correct failure list item by item (AUDIT.md maps each item to its loop
and probes).

Four entries pass every probe, on purpose, and the matrix says so:

- two benign variants, the same objective by another route (``LogProbsIntoCrossEntropy``:
  ``log_softmax`` is idempotent; ``BackwardInsideNoSync``: DDP all-reduces every
  micro-step, the same average);
- two blind spots of this protocol, each shown to be a real bug by a test of its own:
  ``PadMaskWrongAxis`` and ``CheckpointRecomputesDropout``.

Why the padding mask's axis is not observable here: a ``Microbatch`` is right-padded,
so every padded key lies after every real query of its row and the causal triangle
hides it whatever the padding mask says. ``[B, T, 1]`` instead of ``[B, 1, T]`` then
changes only the padded *query* rows; they carry no target, and no real row attends to
them in any layer (they are in its future), so the real rows' logits and every
gradient are the correct loop's, bitwise. A protocol that allowed left padding, or
padding between the documents of a row, would put padded keys in the past of real
queries; ``[B, T, 1]`` leaves them visible there, and a probe comparing a padded row's
real logits with the unpadded document's would see it.

Why recomputed checkpoint dropout is not observable here: the dropout masks live
inside the target's forward; a probe sees a dropout update (as a correct one is) and a
resume that replays the same draws. Seeing it needs a protocol that replays the
target's forward under a given RNG state.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from audit_correct_loops import FunctionalEmbedding
from torch.utils.checkpoint import checkpoint

from exactstep.audit.examples.annotated import (
    AnnotatedLoop,
    Batch,
    LabelSmoothing,
    SimpleLossCompute,
    subsequent_mask,
)
from exactstep.audit.examples.nanogpt import GPT, IGNORE, CausalSelfAttention, NanoGPTLoop
from exactstep.audit.protocol import Microbatch

# -- the shift (R1) ---------------------------------------------------------------------


class NoShift(NanoGPTLoop):
    def get_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        x, y = mb.tokens, mb.tokens  # BUG: the target is the input token itself
        keep = mb.owned & (mb.documents > 0)
        return x, mb.positions, mb.documents, y.masked_fill(~keep, IGNORE)


class ReversedShift(NanoGPTLoop):
    def get_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        x, y = mb.tokens[:, 1:], mb.tokens[:, :-1]  # BUG: predicts the previous token
        keep = mb.owned[:, 1:] & (mb.documents[:, 1:] == mb.documents[:, :-1])
        return x, mb.positions[:, 1:], mb.documents[:, 1:], y.masked_fill(~keep, IGNORE)


class DoubleShift(NanoGPTLoop):
    def loss_sum(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits, y = logits[:, :-1], y[:, 1:]  # BUG: shifts labels that are already shifted
        return super().loss_sum(logits.contiguous(), y.contiguous())


class LabelsAsDecoderInput(AnnotatedLoop):
    def forward(self, batch: Batch) -> torch.Tensor:
        # BUG: feeds tgt_y (one step ahead) to the decoder
        return self.module.forward(batch.tgt_y, batch.positions, batch.tgt_mask)


class DropEos(NanoGPTLoop):
    def get_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        x, pos, docs, y = super().get_batch(mb)
        return x, pos, docs, y.masked_fill(y == self.spec.eos_id, IGNORE)  # BUG: no EOS target


# -- padding and the denominator (L3) -------------------------------------------------


class ProbabilitiesIntoCrossEntropy(NanoGPTLoop):
    def loss_sum(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # BUG: F.cross_entropy expects logits; probabilities are normalised once more
        return super().loss_sum(logits.softmax(-1), y)


class PadInLoss(NanoGPTLoop):
    def get_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        x, y = mb.tokens[:, :-1], mb.tokens[:, 1:]
        keep = mb.owned[:, 1:] & (mb.documents[:, 1:] == mb.documents[:, :-1])
        keep |= y == self.spec.pad_id  # BUG: PAD targets stay in the loss
        return x, mb.positions[:, :-1], mb.documents[:, :-1], y.masked_fill(~keep, IGNORE)


class BatchBT(Batch):
    def __init__(self, mb: Microbatch, pad: int) -> None:
        super().__init__(mb, pad)
        self.ntokens = self.tgt_y.numel()  # BUG: norm = B * T counts padding


class NormBT(AnnotatedLoop):
    batch_type = BatchBT


class BatchCountsTgt(Batch):
    def __init__(self, mb: Microbatch, pad: int) -> None:
        super().__init__(mb, pad)
        self.ntokens = int((self.tgt != pad).sum())  # BUG: counts inputs, not targets


class CountsTgt(AnnotatedLoop):
    batch_type = BatchCountsTgt


# -- the window (U1) --------------------------------------------------------------------


class MeanOfMicrobatchMeans(NanoGPTLoop):
    def micro_loss(self, logits: torch.Tensor, y: torch.Tensor, n_tokens: int,
                   n_micro: int) -> torch.Tensor:
        # BUG: nanoGPT's loss / gradient_accumulation_steps: a mean of microbatch means
        return self.loss_sum(logits, y) / (y != IGNORE).sum() / n_micro


class RankLocalTokenMean(NanoGPTLoop):
    def global_count(self, n: int) -> int:
        return n  # BUG: each rank divides by its own targets; DDP then averages the means


class FirstMicrobatchSteps(AnnotatedLoop):
    @staticmethod
    def closes(i: int, n: int, accum_iter: int) -> bool:
        return i % accum_iter == 0  # BUG: i == 0 closes a window of one batch


class DropRemainder(NanoGPTLoop):
    def windows(self, microbatches: Sequence[Microbatch]) -> list[Sequence[Microbatch]]:
        k = self.spec.accum
        # BUG: only full windows; the last partial window is never stepped
        return [microbatches[i:i + k] for i in range(0, len(microbatches) - k + 1, k)]


class NoRemainderClose(AnnotatedLoop):
    @staticmethod
    def closes(i: int, n: int, accum_iter: int) -> bool:
        return (i + 1) % accum_iter == 0  # BUG: the last, shorter window never closes


class NoZeroGrad(NanoGPTLoop):
    def zero_grad(self) -> None:
        pass  # BUG: gradients of earlier windows leak into later ones


class ZeroGradBeforeStep(NanoGPTLoop):
    def step_optimizer(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)  # BUG: erases the update
        super().step_optimizer()


class ZeroGradEveryMicrobatch(AnnotatedLoop):
    def forward(self, batch: Batch) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)  # BUG: only the last microbatch counts
        return super().forward(batch)


# -- packed documents (R2, R3) ----------------------------------------------------------


class CausalOnlyGPT(GPT):
    def attention_mask(self, documents: torch.Tensor) -> torch.Tensor:
        T = documents.shape[1]
        return torch.ones(T, T, dtype=torch.bool).tril().expand(len(documents), T, T)  # BUG


class OneCausalMaskOverDocuments(NanoGPTLoop):
    model_type = CausalOnlyGPT


class SoftmaxThenMaskAttention(CausalSelfAttention):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))  # [B, h, T, Dh]
        weights = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1)
        weights = weights * mask[:, None]  # BUG: masked after the softmax, so the hidden
        # keys (the future, other documents) still weigh in every row's normalisation
        return self.resid_dropout(self.c_proj((weights @ v).transpose(1, 2).reshape(B, T, C)))


class MaskAfterSoftmaxGPT(GPT):
    def __init__(self, spec, block_size: int = 64) -> None:
        super().__init__(spec, block_size)
        for block in self.h:  # the same parameters, the attention arithmetic of the bug
            block.attn.__class__ = SoftmaxThenMaskAttention


class MaskAfterSoftmax(NanoGPTLoop):
    model_type = MaskAfterSoftmaxGPT


class PositionsNotReset(NanoGPTLoop):
    def get_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        x, pos, docs, y = super().get_batch(mb)
        pos = torch.arange(x.shape[1]).expand_as(x)  # BUG: positions run along the row
        return x, pos, docs, y


class PositionsResetWithoutSegments(NanoGPTLoop):
    def get_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        x, pos, docs, y = super().get_batch(mb)
        return x, pos, (docs > 0).long(), y  # BUG: positions reset, but one segment per row


class CrossDocumentTarget(NanoGPTLoop):
    def get_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        x, y = mb.tokens[:, :-1], mb.tokens[:, 1:]
        keep = mb.owned[:, 1:] & (mb.documents[:, 1:] == mb.documents[:, :-1])
        keep |= (mb.positions[:, 1:] == 0) & (mb.documents[:, 1:] > 0)  # BUG: EOS -> next BOS
        return x, mb.positions[:, :-1], mb.documents[:, :-1], y.masked_fill(~keep, IGNORE)


class BatchPadMaskOnly(Batch):
    @staticmethod
    def make_std_mask(documents: torch.Tensor) -> torch.Tensor:
        tgt_mask = (documents != 0).unsqueeze(-2)
        size = documents.size(-1)
        # BUG: the Annotated Transformer's mask: causal and non-pad, blind to documents
        return tgt_mask & (torch.triu(torch.ones(1, size, size), diagonal=1) == 0)


class MaskIgnoresDocuments(AnnotatedLoop):
    batch_type = BatchPadMaskOnly


class BatchPaddingOnlyMask(Batch):
    @staticmethod
    def make_std_mask(documents: torch.Tensor) -> torch.Tensor:
        return (documents != 0).unsqueeze(-2)  # BUG: hides padding, not the future


class PaddingOnlyMask(AnnotatedLoop):
    batch_type = BatchPaddingOnlyMask


# -- chat ownership (R2, R5) ------------------------------------------------------------


class UnshiftedOwnership(NanoGPTLoop):
    def get_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        x, y = mb.tokens[:, :-1], mb.tokens[:, 1:]
        keep = mb.owned[:, :-1] & (mb.documents[:, 1:] == mb.documents[:, :-1])  # BUG
        return x, mb.positions[:, :-1], mb.documents[:, :-1], y.masked_fill(~keep, IGNORE)


class LossMaskAsAttentionMask(NanoGPTLoop):
    def get_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        x, pos, docs, y = super().get_batch(mb)
        docs = docs.masked_fill(y == IGNORE, 0)  # BUG: unsupervised rows become invisible
        return x, pos, docs, y


# -- label smoothing (L2) ---------------------------------------------------------------


class SmoothingMassOnPad(LabelSmoothing):
    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        true_dist = x.data.clone()
        true_dist.fill_(self.smoothing / (self.size - 2))
        true_dist.scatter_(1, target.data.unsqueeze(1), self.confidence)
        true_dist[target.data == self.padding_idx] = 0  # BUG: the PAD column keeps its mass
        return self.criterion(x, true_dist.clone().detach())


class PadGetsSmoothingMass(AnnotatedLoop):
    criterion_type = SmoothingMassOnPad


class SmoothingVMinus1(LabelSmoothing):
    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        true_dist = x.data.clone()
        true_dist.fill_(self.smoothing / (self.size - 1))  # BUG: V - 1, not V - 2
        true_dist.scatter_(1, target.data.unsqueeze(1), self.confidence)
        true_dist[:, self.padding_idx] = 0
        true_dist[target.data == self.padding_idx] = 0
        return self.criterion(x, true_dist.clone().detach())


class SmoothingDenominatorVMinus1(AnnotatedLoop):
    criterion_type = SmoothingVMinus1


class PadRowsKept(LabelSmoothing):
    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        true_dist = x.data.clone()
        true_dist.fill_(self.smoothing / (self.size - 2))
        true_dist.scatter_(1, target.data.unsqueeze(1), self.confidence)
        true_dist[:, self.padding_idx] = 0  # BUG: rows whose target is PAD are not zeroed
        return self.criterion(x, true_dist.clone().detach())


class PadRowsNotZeroed(AnnotatedLoop):
    criterion_type = PadRowsKept


# -- clipping and the loss scale (U2, U3, U6) -------------------------------------------


class PerTensorClip(NanoGPTLoop):
    def clip(self) -> torch.Tensor:
        max_norm = self.spec.clip if self.spec.clip > 0 else math.inf
        norms = [torch.nn.utils.clip_grad_norm_([p], max_norm)  # BUG: each tensor alone
                 for p in self.module.parameters()]
        return torch.stack(norms).norm()


class TiedCountedTwice(NanoGPTLoop):
    def clip(self) -> torch.Tensor:
        max_norm = self.spec.clip if self.spec.clip > 0 else math.inf
        params = [p for _, p in self.module.named_parameters(remove_duplicate=False)]  # BUG
        return torch.nn.utils.clip_grad_norm_(params, max_norm)


class ClipBeforeUnscale(NanoGPTLoop):
    def unscale_and_clip(self) -> torch.Tensor:
        norm = self.clip()  # BUG: clips the scaled gradients
        self.scaler.unscale_(self.optimizer)
        return norm


class DoubleUnscale(NanoGPTLoop):
    def unscale_and_clip(self) -> torch.Tensor:
        self.scaler.unscale_(self.optimizer)  # BUG: a second unscale_ before step()
        return super().unscale_and_clip()


# -- the optimizer (U6) -----------------------------------------------------------------


class L2InLossWithAdam(NanoGPTLoop):
    def build(self, spec) -> None:  # noqa: ANN001
        super().build(spec)
        for group in self.optimizer.param_groups:
            group["l2"], group["weight_decay"] = group["weight_decay"], 0.0

    def loss_sum(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = max(int((y != IGNORE).sum()), 1)
        l2 = sum(g["l2"] / 2 * sum((p * p).sum() for p in g["params"])
                 for g in self.optimizer.param_groups)
        return super().loss_sum(logits, y) + n * l2  # BUG: L2 in the loss, not decoupled


class DecayOnEverything(NanoGPTLoop):
    def configure_optimizer(self) -> torch.optim.Optimizer:
        groups = [{"params": list(self.module.parameters()),
                   "weight_decay": self.spec.weight_decay}]  # BUG: norms, biases, embeddings
        if self.spec.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=self.spec.lr)
        return torch.optim.AdamW(groups, lr=self.spec.lr, betas=self.spec.betas,
                                 eps=self.spec.eps)


class DecayOnNothing(AnnotatedLoop):
    def build(self, spec) -> None:  # noqa: ANN001
        super().build(spec)
        for group in self.optimizer.param_groups:
            group["weight_decay"] = 0.0  # BUG: the declared decay group is not decayed


class FunctionalTableDecayed(FunctionalEmbedding):
    def configure_optimizer(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizer()
        if self.spec.optimizer == "adamw":
            # BUG: the token table, an nn.Parameter read with F.embedding, is decayed
            optimizer.param_groups[0]["params"].append(self.module.wte)
            optimizer.param_groups[1]["params"] = [
                p for p in optimizer.param_groups[1]["params"] if p is not self.module.wte]
        return optimizer


class SwappedBetas(NanoGPTLoop):
    def configure_optimizer(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizer()
        if self.spec.optimizer == "adamw":
            for group in optimizer.param_groups:
                group["betas"] = group["betas"][::-1]  # BUG: (beta2, beta1)
        return optimizer


class NoBiasCorrection(NanoGPTLoop):
    def configure_optimizer(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizer()
        if self.spec.optimizer == "adamw":
            for group in optimizer.param_groups:
                for p in group["params"]:
                    # BUG: a step count so large that 1 - beta**t is 1: m / (sqrt(v) + eps)
                    optimizer.state[p] = {"step": torch.tensor(1e9),
                                          "exp_avg": torch.zeros_like(p),
                                          "exp_avg_sq": torch.zeros_like(p)}
        return optimizer


class Amsgrad(AnnotatedLoop):
    def build(self, spec) -> None:  # noqa: ANN001
        super().build(spec)
        if spec.optimizer == "adamw":
            for group in self.optimizer.param_groups:
                group["amsgrad"] = True  # BUG: the running max of v, not v


class FreshOptimizerEachWindow(NanoGPTLoop):
    def train_window(self, window: Sequence[Microbatch]) -> float | None:
        self.optimizer = self.configure_optimizer()  # BUG: moments and step count reset
        return super().train_window(window)


# -- the logged loss (U1, U4) ----------------------------------------------------------


class LogsScaledLoss(NanoGPTLoop):
    def close_window(self, loss: float) -> float | None:
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        logged = super().close_window(loss)
        return None if logged is None else logged * scale  # BUG: the loss scale is logged


class LogsMeanOfMicrobatchMeans(NanoGPTLoop):
    def build(self, spec) -> None:  # noqa: ANN001
        super().build(spec)
        self.means: list[float] = []

    def micro_loss(self, logits: torch.Tensor, y: torch.Tensor, n_tokens: int,
                   n_micro: int) -> torch.Tensor:
        loss = super().micro_loss(logits, y, n_tokens, n_micro)
        if (y != IGNORE).any():
            self.means.append(loss.item() * n_tokens / int((y != IGNORE).sum()))
        return loss

    def close_window(self, loss: float) -> float | None:
        means, self.means = self.means, []
        logged = super().close_window(loss)
        # BUG: the logged loss is a mean of the microbatches' means (the update is right)
        return None if logged is None else sum(means) / len(means)


class LogsLastMicrostep(LogsMeanOfMicrobatchMeans):
    def close_window(self, loss: float) -> float | None:
        last, self.means = self.means[-1:], []
        logged = NanoGPTLoop.close_window(self, loss)
        # BUG: nanoGPT's print, lossf = loss.item() * gradient_accumulation_steps, is the
        # last micro-step's mean, not the window's
        return None if logged is None else last[0]


# -- skipped and empty windows (L4, U4, U5) ---------------------------------------------


class SchedulerAdvancesOnSkip(NanoGPTLoop):
    def close_window(self, loss: float) -> float | None:
        if not math.isfinite(loss):
            self.iter_num += 1  # BUG: a skipped window advances the schedule
        return super().close_window(loss)


class NoFiniteCheck(NanoGPTLoop):
    def finite(self, loss: float, norm: torch.Tensor) -> bool:
        return True  # BUG: steps on a non-finite loss or gradient (a scaler alone may skip)


class LambdaLRStepsOnSkip(AnnotatedLoop):
    def close(self, loss: float, ntokens: int) -> float | None:
        if not math.isfinite(loss):
            self.lr_scheduler.step()  # BUG: the schedule moves without an update
        return super().close(loss, ntokens)


class SkipDecidedFromLossOnly(NanoGPTLoop):
    def finite(self, loss: float, norm: torch.Tensor) -> bool:
        # BUG: a finite loss with a non-finite gradient commits: GradScaler.step skips the
        # update, the schedule and the log go on
        return math.isfinite(loss)


class EmptyWindowAdvancesSchedule(AnnotatedLoop):
    def close(self, loss: float, ntokens: int) -> float | None:
        if ntokens == 0:
            self.lr_scheduler.step()  # BUG: a window without targets moves the schedule
        return super().close(loss, ntokens)


class SGDWithMomentum(NanoGPTLoop):
    def configure_optimizer(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizer()
        if self.spec.optimizer == "sgd":
            for group in optimizer.param_groups:
                group["momentum"] = 0.9  # BUG: the declared update is plain SGD
        return optimizer


class UncappedWarmup(NanoGPTLoop):
    def get_lr(self, it: int) -> float:
        if self.spec.warmup <= 0:
            return self.spec.lr
        return self.spec.lr * (it + 1) / self.spec.warmup  # BUG: no min(1, .): keeps growing


class ZeroTargetWindowSteps(NanoGPTLoop):
    def global_count(self, n: int) -> int:
        # BUG: "avoid 0 / 0": a window without targets steps (weight decay moves) and logs 0.0
        return max(super().global_count(n), 1)


# -- modes and evaluation (E1, L5) ------------------------------------------------------


class TrainsInEvalMode(NanoGPTLoop):
    def train(self, microbatches: Sequence[Microbatch]) -> list[float | None]:
        self.module.eval()  # BUG: dropout off while training
        return [self.train_window(window) for window in self.windows(microbatches)]


class EvaluatesInTrainMode(AnnotatedLoop):
    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        with torch.no_grad():  # BUG: no model.eval(): dropout stays on
            batches = [self.batch_type(mb, self.spec.pad_id) for mb in microbatches]
            loss, tokens = self.run_epoch(batches, "eval")
        return loss / tokens, math.exp(loss / tokens)


class EvalLeavesEvalMode(NanoGPTLoop):
    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        loss, ppl = super().evaluate(microbatches)
        self.module.eval()  # BUG: the caller's train mode is not restored
        return loss, ppl


class EvalReseeds(NanoGPTLoop):
    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        torch.manual_seed(0)  # BUG: "deterministic eval" resets the training RNG
        return super().evaluate(microbatches)


class EvalThroughTrainStep(NanoGPTLoop):
    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        nll, count = 0.0, 0
        for mb in microbatches:
            n = int((self.get_batch(mb)[-1] != IGNORE).sum())
            nll += self.train_window([mb]) * n  # BUG: the training step scores (and steps)
            count += n
        return nll / count, math.exp(nll / count)


class PerplexityPerBatch(NanoGPTLoop):
    @torch.no_grad()
    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        self.module.eval()
        nll, count, ppls = 0.0, 0, []
        for mb in microbatches:
            x, pos, docs, y = self.get_batch(mb)
            logits = self.module(x, pos, docs)
            s = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                                ignore_index=IGNORE, reduction="sum").item()
            n = int((y != IGNORE).sum())
            nll, count = nll + s, count + n
            ppls.append(math.exp(s / n))
        self.module.train()
        return nll / count, sum(ppls) / len(ppls)  # BUG: mean of per-batch perplexities


class PerplexityOfMeanLoss(AnnotatedLoop):
    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        self.module.eval()
        losses = []
        with torch.no_grad():
            for mb in microbatches:
                loss, tokens = self.run_epoch([self.batch_type(mb, self.spec.pad_id)], "eval")
                losses.append(loss / tokens)
        self.module.train()
        mean = sum(losses) / len(losses)
        return mean, math.exp(mean)  # BUG: exp of a mean of batch means


class EvalWithLabelSmoothing(NanoGPTLoop):
    def eval_nll(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_sum(logits, y)  # BUG: the training criterion, smoothing included


class EvalScoresPrompt(NanoGPTLoop):
    def get_eval_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        x, y = mb.tokens[:, :-1], mb.tokens[:, 1:]
        keep = (mb.documents[:, 1:] == mb.documents[:, :-1]) & (mb.documents[:, 1:] > 0)
        # BUG: evaluation scores every token of the document, the prompt's too
        return x, mb.positions[:, :-1], mb.documents[:, :-1], y.masked_fill(~keep, IGNORE)


class EvalCountsPadding(NanoGPTLoop):
    def eval_count(self, y: torch.Tensor) -> int:
        return y.numel()  # BUG: padded (and unowned) positions in the denominator


# -- resume (S2) ------------------------------------------------------------------------


class ResumeWithoutOptimizer(NanoGPTLoop):
    def load(self, path) -> None:  # noqa: ANN001
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["model"])  # BUG: Adam moments start from zero
        self.scaler.load_state_dict(state["scaler"])
        self.iter_num = state["iter_num"]
        torch.set_rng_state(state["rng"])
        self.load_data_position(state["data"])


class ResumeWithoutRng(NanoGPTLoop):
    def load(self, path) -> None:  # noqa: ANN001
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.iter_num = state["iter_num"]  # BUG: dropout masks continue from another RNG
        self.load_data_position(state["data"])


class ResumeWithoutStepCounter(NanoGPTLoop):
    def load(self, path) -> None:  # noqa: ANN001
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])  # BUG: iter_num restarts at 0 (warmup again)
        self.load_data_position(state["data"])


class ResumeWithoutScheduler(AnnotatedLoop):
    def load(self, path) -> None:  # noqa: ANN001
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])  # BUG: LambdaLR restarts its warmup
        self.epoch, self.index = state["data"]


class ResumeWithoutScaler(NanoGPTLoop):
    def load(self, path) -> None:  # noqa: ANN001
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.iter_num = state["iter_num"]  # BUG: the loss scale restarts at init_scale
        torch.set_rng_state(state["rng"])
        self.load_data_position(state["data"])


class ResumeWithoutDataCursor(NanoGPTLoop):
    def load(self, path) -> None:  # noqa: ANN001
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.iter_num = state["iter_num"]
        torch.set_rng_state(state["rng"])  # BUG: the data restarts at its first window


class LoadRebuildsModel(NanoGPTLoop):
    def load(self, path) -> None:  # noqa: ANN001
        self.module = self.model_type(self.spec)  # BUG: the optimizer holds the old module's
        self.model = self.module                  # parameters; the new one never moves
        super().load(path)


class ResumeReshufflesData(NanoGPTLoop):
    def load(self, path) -> None:  # noqa: ANN001
        super().load(path)
        self.data_seed += 1  # BUG: the reload re-seeds the shuffle (another order)


# -- targets that break (A1: a per-probe ERROR, never a crash) --------------------------


class RaisesInTrain(NanoGPTLoop):
    def train(self, microbatches: Sequence[Microbatch]) -> list[float | None]:
        raise RuntimeError("CUDA error: device-side assert triggered")


class NeverSteps(NanoGPTLoop):
    def train(self, microbatches: Sequence[Microbatch]) -> list[float | None]:
        return [1.0 for _ in self.windows(microbatches)]


class NaNLogits(NanoGPTLoop):
    def logits(self, input_ids, position_ids, document_ids) -> torch.Tensor:  # noqa: ANN001
        return super().logits(input_ids, position_ids, document_ids) * float("nan")


# == the shape-correct failure list: what the sections above did not yet cover =========
# Each loop below is one item of that list (AUDIT.md, "The wrong-loop catalogue against
# the shape-correct failure list"); the sections keep the topics of the ones above.

# -- masks (R2) -------------------------------------------------------------------------


class BatchInvertedTriangle(Batch):
    @staticmethod
    def make_std_mask(documents: torch.Tensor) -> torch.Tensor:
        same = documents.unsqueeze(-1) == documents.unsqueeze(-2)
        size = documents.size(-1)
        # BUG: the triangle is inverted: the future is visible, the past hidden
        return same & (torch.tril(torch.ones(1, size, size), diagonal=-1) == 0)


class InvertedTriangle(AnnotatedLoop):
    batch_type = BatchInvertedTriangle


class BatchMaskForFullTarget(Batch):
    def __init__(self, mb: Microbatch, pad: int) -> None:
        super().__init__(mb, pad)
        # BUG: subsequent_mask(full_tgt.size(-1)): built for T_full, the input has T_full - 1
        self.tgt_mask = self.make_std_mask(mb.documents)


class WrongMaskLength(AnnotatedLoop):
    """Not shape-correct in PyTorch: the [T, T] mask does not broadcast against the
    [T - 1, T - 1] scores, so every probe that trains or evaluates reports the target's
    own ``RuntimeError`` (the probes that read only ``logits`` pass: its mask is right)."""

    batch_type = BatchMaskForFullTarget


class BatchPadMaskWrongAxis(Batch):
    @staticmethod
    def make_std_mask(documents: torch.Tensor) -> torch.Tensor:
        real = documents != 0
        same = documents.unsqueeze(-1) == documents.unsqueeze(-2)
        # BUG: the padding mask broadcast as [B, T, 1] (hides padded query rows) instead of
        # [B, 1, T] (hides padded key columns)
        return real.unsqueeze(-1) & same & subsequent_mask(documents.size(-1))


class PadMaskWrongAxis(AnnotatedLoop):
    """Not observable here, and provably so: rows are right-padded, so every padded key
    lies after every real query and the causal triangle already hides it; the wrong axis
    changes only the padded query rows (they now attend uniformly to the whole row),
    which carry no target and which no real row attends to, in any layer. The real rows'
    logits and every gradient are those of the correct loop, bitwise
    (``test_the_pad_mask_axis_changes_only_padded_rows``). A protocol with left padding,
    or padding between the documents of a row, would put padded keys in the past of real
    queries and make it observable (``[B, T, 1]`` leaves them visible)."""

    batch_type = BatchPadMaskWrongAxis


# -- the generator and the criterion (L1, L2) -------------------------------------------


class OutAsLogitsLossCompute(SimpleLossCompute):
    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
        # BUG: the decoder's [B, T, d_model] output scored as vocabulary log-probabilities
        # (the generator is skipped; d_model == V here, so the shapes still agree)
        sloss = self.criterion(x.contiguous().view(-1, x.size(-1)), y.contiguous().view(-1))
        return sloss.item(), sloss


class OutAsLogits(AnnotatedLoop):
    def loss_compute(self, smoothing: float) -> SimpleLossCompute:
        loss = super().loss_compute(smoothing)
        return OutAsLogitsLossCompute(loss.generator, loss.criterion)


class GeneratorTwice(AnnotatedLoop):
    def forward(self, batch: Batch) -> torch.Tensor:
        # BUG: generator(out) precomputed, and SimpleLossCompute applies it once more
        return self.module.generator(super().forward(batch))


class FlattenAllAxes(SimpleLossCompute):
    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
        x = self.generator(x)
        sloss = self.criterion(x.view(-1), y.contiguous().view(-1))  # BUG: no vocabulary axis
        return sloss.item(), sloss


class FlattenDestroysVocabulary(AnnotatedLoop):
    """Not shape-correct: ``LabelSmoothing`` cannot scatter into a 1-D tensor; every probe
    that trains or evaluates reports the target's own error."""

    def loss_compute(self, smoothing: float) -> SimpleLossCompute:
        loss = super().loss_compute(smoothing)
        return FlattenAllAxes(loss.generator, loss.criterion)


class ProbabilitiesLossCompute(SimpleLossCompute):
    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
        x = self.generator(x).exp()  # BUG: probabilities into KLDivLoss, which wants logs
        sloss = self.criterion(x.contiguous().view(-1, x.size(-1)), y.contiguous().view(-1))
        return sloss.item(), sloss


class ProbabilitiesIntoKLDiv(AnnotatedLoop):
    def loss_compute(self, smoothing: float) -> SimpleLossCompute:
        loss = super().loss_compute(smoothing)
        return ProbabilitiesLossCompute(loss.generator, loss.criterion)


class LogProbsIntoCrossEntropy(NanoGPTLoop):
    """Benign, and the matrix says so: ``log_softmax`` is idempotent, so
    ``F.cross_entropy(log_softmax(z))`` is ``F.cross_entropy(z)`` (with or without
    ``label_smoothing``) up to rounding: the same objective, nothing to observe."""

    def loss_sum(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().loss_sum(logits.log_softmax(-1), y)  # log-probs where logits are due


class ScatterAlongRows(LabelSmoothing):
    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        true_dist = x.data.clone()
        true_dist.fill_(self.smoothing / (self.size - 2))
        # BUG: scatter_ along dim 0: the confidence goes to row target[i] of column 0, not
        # to column target[i] of row i (and an index past the row count raises)
        true_dist.scatter_(0, target.data.unsqueeze(1), self.confidence)
        true_dist[:, self.padding_idx] = 0
        true_dist[target.data == self.padding_idx] = 0
        return self.criterion(x, true_dist.clone().detach())


class SmoothingScatterWrongDim(AnnotatedLoop):
    criterion_type = ScatterAlongRows


# -- padding and the denominator (L3) ---------------------------------------------------

# A source vocabulary built with the Annotated Transformer's specials order
# (<s>, </s>, <blank>, <unk>) has its pad <blank> at 2: this target vocabulary's EOS.
SOURCE_PAD = 2


class BatchSourcePad(Batch):
    def __init__(self, mb: Microbatch, pad: int) -> None:
        super().__init__(mb, pad)  # the collator pads the labels with the target's pad
        self.ntokens = int((self.tgt_y != SOURCE_PAD).sum())  # BUG: the source's pad id


class SourcePadForTargets(AnnotatedLoop):
    """The target labels masked with the source vocabulary's pad id: padded labels are
    counted and scored (as the target's pad class), real EOS targets are dropped."""

    batch_type = BatchSourcePad

    def loss_compute(self, smoothing: float) -> SimpleLossCompute:
        # BUG (the same id): the criterion's padding_idx is the source's pad
        criterion = self.criterion_type(self.spec.vocab_size, SOURCE_PAD, smoothing)
        return SimpleLossCompute(self.module.generator, criterion)


class LastPositionOnly(NanoGPTLoop):
    def loss_sum(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # BUG: inference's out[:, -1] used to train: one position per row is scored
        return super().loss_sum(logits[:, -1:].contiguous(), y[:, -1:].contiguous())


class MeanOfSequenceMeans(NanoGPTLoop):
    def micro_loss(self, logits: torch.Tensor, y: torch.Tensor, n_tokens: int,
                   n_micro: int) -> torch.Tensor:
        per_token = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=IGNORE,
                                    reduction="none",
                                    label_smoothing=self.spec.label_smoothing)  # [B, T]
        counts = (y != IGNORE).sum(1)
        rows = counts > 0
        # BUG: a mean of per-sequence means: every sequence weighs the same, whatever
        # its length, while the window claims a token mean
        return (per_token.sum(1)[rows] / counts[rows]).mean() * self.world / n_micro


# -- the window and the backward (U1, U2, U5) -------------------------------------------


class BackwardOfLoggedValue(NanoGPTLoop):
    """Backpropagates the detached logging value: PyTorch refuses, and every probe that
    trains reports that as its ERROR (A1: never an audit crash)."""

    def train_window(self, window: Sequence[Microbatch]) -> float | None:
        batches = [self.get_batch(mb) for mb in window]
        n_tokens = self.global_count(sum(int((y != IGNORE).sum()) for *_, y in batches))
        if n_tokens == 0:
            return None
        total = 0.0
        for i, (x, pos, docs, y) in enumerate(batches):
            with self.sync(last=i == len(batches) - 1):
                loss_node = self.micro_loss(self.model(x, pos, docs), y, n_tokens, len(batches))
                loss = loss_node.detach()  # the logging value
                self.scaler.scale(loss).backward()  # BUG: not loss_node.backward()
            total += loss.item()
        return self.close_window(total)


class UnscaleEachMicrobatch(NanoGPTLoop):
    """``scaler.unscale_`` after the window's first micro-step: the later micro-steps add
    scaled gradients to unscaled ones, and the close must not unscale again (it would
    raise), so it only clips."""

    def train_window(self, window: Sequence[Microbatch]) -> float | None:
        batches = [self.get_batch(mb) for mb in window]
        n_tokens = self.global_count(sum(int((y != IGNORE).sum()) for *_, y in batches))
        if n_tokens == 0:
            return None
        total = 0.0
        for i, (x, pos, docs, y) in enumerate(batches):
            with self.sync(last=i == len(batches) - 1):
                loss = self.micro_loss(self.model(x, pos, docs), y, n_tokens, len(batches))
                self.scaler.scale(loss).backward()
            if i == 0:
                self.scaler.unscale_(self.optimizer)  # BUG: before the window closes
            total += loss.item()
        return self.close_window(total)

    def unscale_and_clip(self) -> torch.Tensor:
        return self.clip()  # already unscaled (once, too early)


class ScheduleCountsMicrobatches(NanoGPTLoop):
    def get_lr(self, it: int) -> float:
        # BUG: the schedule is indexed by micro-steps (iter_num * accum), not by updates
        return super().get_lr(it * self.spec.accum)


# -- data parallel (D1, D5) -------------------------------------------------------------


class ForwardInsideNoSync(NanoGPTLoop):
    """The last micro-step's forward under ``no_sync()``, its backward outside: DDP
    decides at the forward whether the backward all-reduces, so no gradient of the window
    is ever reduced and each rank steps on its own (they diverge)."""

    def train_window(self, window: Sequence[Microbatch]) -> float | None:
        batches = [self.get_batch(mb) for mb in window]
        n_tokens = self.global_count(sum(int((y != IGNORE).sum()) for *_, y in batches))
        if n_tokens == 0:
            return None
        total = 0.0
        for i, (x, pos, docs, y) in enumerate(batches):
            with self.no_sync():  # BUG: the forward of every micro-step, the last one too
                logits = self.model(x, pos, docs)
            loss = self.micro_loss(logits, y, n_tokens, len(batches))
            with self.sync(last=i == len(batches) - 1):  # ... only the backward syncs
                self.scaler.scale(loss).backward()
            total += loss.item()
        return self.close_window(total)

    def no_sync(self):  # noqa: ANN201
        return self.model.no_sync() if self.world > 1 else contextlib.nullcontext()


class BackwardInsideNoSync(NanoGPTLoop):
    """Benign, and the matrix says so: the forwards outside ``no_sync()``, the backwards of
    the early micro-steps inside. DDP then all-reduces every micro-step (its forward
    armed the reduction): communication every microbatch, against DDP's documented usage,
    but the same gradients (an average of sums is the sum of averages)."""

    def train_window(self, window: Sequence[Microbatch]) -> float | None:
        batches = [self.get_batch(mb) for mb in window]
        n_tokens = self.global_count(sum(int((y != IGNORE).sum()) for *_, y in batches))
        if n_tokens == 0:
            return None
        total = 0.0
        for i, (x, pos, docs, y) in enumerate(batches):
            logits = self.model(x, pos, docs)  # the forward outside no_sync()
            loss = self.micro_loss(logits, y, n_tokens, len(batches))
            with self.sync(last=i == len(batches) - 1):  # only the backward inside
                self.scaler.scale(loss).backward()
            total += loss.item()
        return self.close_window(total)


# -- modes and randomness (E1) ----------------------------------------------------------


class CheckpointedGPT(GPT):
    preserve_rng_state = True

    def forward(self, idx: torch.Tensor, pos: torch.Tensor,
                documents: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(pos))
        mask = self.attention_mask(documents)
        for block in self.h:
            x = checkpoint(block, x, mask, use_reentrant=False,
                           preserve_rng_state=self.preserve_rng_state)
        return self.lm_head(self.ln_f(x))


class CheckpointDropoutFreshRng(CheckpointedGPT):
    preserve_rng_state = False  # BUG: the recomputation draws new dropout masks


class CheckpointRecomputesDropout(NanoGPTLoop):
    """Activation checkpointing with ``preserve_rng_state=False`` and dropout on: the
    backward differentiates a forward with other dropout masks than the one whose loss
    was taken. Not observable through this protocol: the masks live inside the target's
    forward, the probes see a dropout update (``train_mode``: it differs from the
    dropout-free one, as a correct one does) and a resume that replays the same draws.
    The bug is real (``test_checkpointed_dropout_without_the_rng_state_changes_the_update``);
    seeing it needs a protocol that replays a forward under a given RNG state."""

    model_type = CheckpointDropoutFreshRng
