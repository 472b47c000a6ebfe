"""The ``exactstep`` target: exactstep's own engine behind ``TrainingStep`` (A1).

Everything the probes measure runs through the production path: the causal compiler
(R1-R3, R5), the built-in ``Decoder``, the window transaction ``UpdateEngine.run_window``
(U1-U6), ``exactstep.eval.evaluate`` (E1, L5), the checkpoint store with RNG capture
(S2), and, under a process group, one rank of a DDP job (D1, D5). The adapter only
translates data and settings.
Design and derivations: docs/design/audit.md#auditenginepy (A1, S2, D1, D5).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from exactstep.audit.protocol import Microbatch, ProbeSpec, WindowCursor
from exactstep.eval import evaluate
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.objective.config import ObjectiveConfig
from exactstep.parallel.agreement import distribute_engine
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.process_group import DistContext
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece
from exactstep.state.rng import capture_rng, restore_rng
from exactstep.state.safetensors_format import load_checkpoint, publish_checkpoint
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

DEVICE = torch.device("cpu")


class ExactstepStep(WindowCursor):
    """``TrainingStep`` over ``UpdateEngine`` and the built-in decoder.

    Its own data order permutes each epoch with ``numpy.random.default_rng([seed,
    epoch])`` (the row stream's law); ``save`` keeps ``(epoch, index)``, never the order.
    """

    smoothing_convention = "harvard"
    data_parallel = True  # under a process group: one rank, distribute_engine (D1, D5)

    def build(self, spec: ProbeSpec) -> None:
        self.spec = spec
        model_cfg = ModelConfig(d_model=spec.d_model, n_layers=spec.n_layers,
                                n_heads=spec.n_heads, d_ff=2 * spec.d_model,
                                attention="segments")
        self.module = build_model(model_cfg, spec.vocab_size, seed=spec.seed)
        update_cfg = UpdateConfig(
            accum=spec.accum, optimizer=spec.optimizer, lr=spec.lr, schedule="constant",
            warmup=spec.warmup, clip=spec.clip, weight_decay=spec.weight_decay,
            beta1=spec.betas[0], beta2=spec.betas[1], eps=spec.eps, momentum=0.0,
        )
        numerics = NumericsConfig(precision="fp32" if spec.loss_scale is None else "fp16",
                                  init_scale=spec.loss_scale or 65536.0)
        optimizer, _ = build_optimizer(self.module, update_cfg)
        self.engine = UpdateEngine(
            self.module, optimizer, build_schedule(update_cfg, 1), Precision(numerics, DEVICE),
            update_cfg,
            ObjectiveConfig(label_smoothing=spec.label_smoothing, smoothing="harvard"),
            device=DEVICE, pad_id=spec.pad_id,
        )
        if dist.is_initialized():  # a rank of the audit's data-parallel probe
            ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                              local_rank=dist.get_rank(), device=DEVICE, backend="gloo")
            distribute_engine(self.engine, ctx, ParallelConfig())
        self.window = 0
        self.dataset: list[Sequence[Microbatch]] = []
        self.epoch, self.index = 0, 0

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               document_ids: torch.Tensor) -> torch.Tensor:
        batch = Batch(input_ids=input_ids, labels=torch.full_like(input_ids, IGNORE_INDEX),
                      position_ids=position_ids, segment_ids=document_ids.to(torch.int32),
                      segments=segments_of(document_ids))
        return self.module.logits(self.module(batch))

    def batch(self, mb: Microbatch) -> Batch:
        """The causal compiler's rows for the microbatch's documents (R1-R3, R5)."""
        examples, rows = [], []
        for r in range(mb.tokens.shape[0]):
            row = []
            for d in mb.documents[r].unique().tolist():
                if d == 0:
                    continue
                cols = mb.documents[r] == d
                examples.append(Example(example_id=len(examples),
                                        tokens=mb.tokens[r][cols].numpy().astype(np.int64),
                                        owned=mb.owned[r][cols].numpy()))
                row.append(Piece(example=len(examples) - 1, offset=0,
                                 length=int(cols.sum()), piece=0))
            rows.append(row)
        return compile_causal_batch(rows, examples, seq_len=mb.tokens.shape[1],
                                    pad_id=self.spec.pad_id)

    def train(self, microbatches: Sequence[Microbatch]) -> list[float | None]:
        self.module.train()
        logs: list[float | None] = []
        k = self.spec.accum
        for start in range(0, len(microbatches), k):
            batches = [self.batch(mb) for mb in microbatches[start:start + k]]
            disposition = self.engine.run_window(batches, self.window)
            self.window += 1
            logs.append(disposition.loss if disposition.outcome is Outcome.COMMITTED else None)
        return logs

    def epoch_order(self) -> list[int]:
        """The epoch's order: ``rows.packing``'s law, drawn from ``(seed, epoch)``."""
        return np.random.default_rng([self.spec.seed, self.epoch]).permutation(
            len(self.dataset)).tolist()

    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        result = evaluate(self.module, [self.batch(mb) for mb in microbatches], device=DEVICE,
                          max_tokens=1 << 62, pad_id=self.spec.pad_id)
        return float(result.loss), float(result.perplexity)

    def save(self, path: Path) -> None:
        parts = {"engine": self.engine.state_dict(), "rng": capture_rng(),
                 "window": self.window, "data": {"epoch": self.epoch, "index": self.index}}
        publish_checkpoint(path, "state", self.module.state_dict(), parts, keep=1)

    def load(self, path: Path) -> None:
        model_state, parts = load_checkpoint(path / "state")
        self.module.load_state_dict(model_state)
        self.engine.load_state_dict(parts["engine"])
        restore_rng(parts["rng"])
        self.window = int(parts["window"])
        self.epoch, self.index = int(parts["data"]["epoch"]), int(parts["data"]["index"])


def segments_of(document_ids: torch.Tensor) -> tuple[tuple[Segment, ...], ...]:
    """Row segments (host data) from document ids: one per run of equal non-zero ids."""
    rows = []
    for row in document_ids.tolist():
        segments, start = [], 0
        while start < len(row):
            stop = start
            while stop < len(row) and row[stop] == row[start]:
                stop += 1
            if row[start] != 0:
                segments.append(Segment(example_id=len(segments), piece=0, offset=0,
                                        start=start, length=stop - start))
            start = stop
        rows.append(tuple(segments))
    return tuple(rows)


def make() -> ExactstepStep:
    return ExactstepStep()
