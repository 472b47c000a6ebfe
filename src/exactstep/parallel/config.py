"""Configuration of multi-process training (D1-D4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.errors import ConfigError
from exactstep.ranges import at_least, between, check

# Python's timedelta, which carries the timeout to the collectives, overflows past
# ~8.6e13 s; 1e9 s (about 31 years) is a round bound far below that.
MAX_TIMEOUT_S = 1e9


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """``strategy``: ``ddp`` (replicated) or ``fsdp`` (FSDP2 ``fully_shard`` per decoder
    layer, built-in and HF models; gloo on CPU, NCCL on CUDA; one process runs
    unsharded). World size comes from the launcher (torchrun), not from the
    configuration.

    ``timeout_s`` bounds every collective: when a peer dies or stalls, the surviving
    ranks fail with a ``DistributedError`` within this many seconds instead of hanging.
    ``bucket_mb`` is DDP's gradient bucket size.

    ``tp``, ``pp``, ``cp``: ranks a replica is split into by tensor, pipeline and
    context (sequence) parallelism; the data-parallel size is what is left of the world
    (``dp = world / (tp * pp * cp)``, ``parallel.layout``). ``schedule`` is the
    pipeline schedule (``pp > 1`` only).

    ``cp`` (context parallel) and ``ep`` (expert parallel) above 1 are refused
    (``refuse_unrun_axes``): no engine here keeps their invariants (0x0A).
    """

    strategy: Literal["ddp", "fsdp"] = "ddp"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = 300.0
    bucket_mb: int = 25
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"

    def __post_init__(self) -> None:
        check("parallel.timeout_s", self.timeout_s, between(0, MAX_TIMEOUT_S, low_open=True))
        check("parallel.bucket_mb", self.bucket_mb, at_least(1))
        for axis in ("tp", "pp", "cp", "ep"):
            check(f"parallel.{axis}", getattr(self, axis), at_least(1))
        refuse_unrun_axes(self)


# PyTorch 2.13's context parallel, probed on 2 gloo ranks and read in its source
# (docs/guides/distributed.md#context-parallel): SDPA ring attention has no CPU kernel
# (aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy) and its
# CUDA kernels take no attention mask, so packed documents cannot keep their visibility;
# FlexAttention's context parallel keeps it (forward checked equal on the CPU) but
# FlexAttention has no CPU backward. ``exactstep smoke gpu`` checks it on CUDA.
CONTEXT_PARALLEL_REFUSAL = (
    "parallel.cp = {cp} is not supported: PyTorch's context parallel keeps packed-document "
    "visibility only through FlexAttention, which has no backward on the CPU (its SDPA ring "
    "attention takes no document mask), and exactstep does not run it on CUDA either; set "
    "parallel.cp = 1 and split the model with parallel.tp or the data over more processes"
)
# transformers' expert parallel (``DistributedConfig(ep_size=...)``, from_pretrained
# only) shards an HF MoE model's experts and ran forward and backward on 2 gloo ranks
# equal to one process; exactstep does not wire it in (docs/guides/distributed.md).
EXPERT_PARALLEL_REFUSAL = (
    "parallel.ep = {ep} is not supported: exactstep's built-in decoder has no experts, and "
    "exactstep does not run transformers' expert parallel for an HF mixture-of-experts model; "
    "set parallel.ep = 1 (an HF MoE model's experts are then ordinary weights, replicated or "
    "sharded by parallel.strategy like every other)"
)


def refuse_unrun_axes(parallel: ParallelConfig) -> None:
    """Refuse context and expert parallel (``ConfigError``, one line each): at parse
    time, before a run directory exists (0x0A)."""
    if parallel.cp > 1:
        raise ConfigError(CONTEXT_PARALLEL_REFUSAL.format(cp=parallel.cp))
    if parallel.ep > 1:
        raise ConfigError(EXPERT_PARALLEL_REFUSAL.format(ep=parallel.ep))
