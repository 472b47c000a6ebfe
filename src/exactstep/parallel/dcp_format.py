"""Multi-rank checkpoints: ``torch.distributed.checkpoint`` published like S3 (S7, S2, D3).

Every rank writes its shards, RNG streams and data cursor into one temporary
directory; rank 0 commits it through ``state.store`` between two host barriers, so
``LATEST`` always names a complete checkpoint (S3). Loading on another world size is
a declared migration (``reshard``), never a silent load (S7); on another
``parallel.strategy`` it is refused. The model part holds what a one-process
checkpoint holds: with LoRA the adapters only (H4, S2); a ``zero1`` run's optimizer
state is written by parameter name, each shard by the rank that owns it.
Design and derivations: docs/design/parallel.md#paralleldcp_formatpy (S7, S2, S3, D3).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from exactstep.errors import CheckpointError, DistributedError, ModelError
from exactstep.parallel.layout import Layout
from exactstep.parallel.process_group import DistContext, host_group
from exactstep.parallel.tensor import gathered_state, scattered_state
from exactstep.state.durable import fsync_path
from exactstep.state.store import (
    Publication,
    check_files,
    read_checkpoint_manifest,
    temporary_directory,
)

DIST_FORMAT = "exactstep-dist-checkpoint/2"
DCP_DIR = "dcp"
COMMON_FILE = "common.pt"
PUBLICATION_TAG = "dist"  # every rank must name the same temporary directory
# the manifest field saying the optimizer's entries are keyed by parameter name
# (``param_groups.<name>.lr``), not by group index: ranks holding different parameters
# (pipeline stages) then never write the same key with different values
OPTIMIZER_KEYS = "optimizer_keys"
BY_NAME = "by_name"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def part_labels(world: int, *, adapters_only: bool = False) -> dict[str, str]:
    """What each file holds, for ``checkpoint verify`` (S6)."""
    model = "adapters" if adapters_only else "model"
    labels = {f"{model}+optimizer": DCP_DIR, "scheduler+scaler+progress": COMMON_FILE}
    labels.update({f"rng+data (rank {r})": rank_file(r) for r in range(world)})
    return labels


def held_names(model: nn.Module) -> set[str] | None:
    """The names of the model tensors a checkpoint holds: those of the model's own
    ``checkpoint_state()`` where it has one (with LoRA the adapters only, the base
    being rebuilt from its source and pinned by its digest in the manifest: H4, S4),
    else None (every tensor). The same rule as a one-process checkpoint's."""
    own = getattr(model, "checkpoint_state", None)
    return set(own()) if callable(own) else None


def held_part(state: dict[str, Any], names: set[str] | None) -> dict[str, Any]:
    """``state`` narrowed to ``names`` (None: all of it)."""
    return state if names is None else {k: v for k, v in state.items() if k in names}


def load_options(held: dict[str, Any], whole: dict[str, Any], *, by_name: bool = False):
    """``strict`` loading, unless the checkpoint holds a part of the model (LoRA):
    then the frozen base tensors, rebuilt from the source, are absent on purpose.
    ``by_name``: the optimizer's entries keyed by parameter name (``OPTIMIZER_KEYS``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=len(held) == len(whole), flatten_optimizer_state_dict=by_name)


def by_name_options():
    """The options of a save: every optimizer entry keyed by its parameter's name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds: a ``zero1`` run's
    ``ZeroRedundancyOptimizer``'s local optimizer (the parameters this rank owns; keyed
    by name, each entry lives on its owner alone, so DCP writes every shard once, from
    the rank that holds it, and a load on any world reads the names its optimizer
    holds), else the optimizer itself."""
    sharded = callable(getattr(optimizer, "shard_params", None))  # a zero.ShardedOptimizer
    return optimizer.optim if sharded else optimizer


def check_strategy(path: Path, manifest: dict[str, Any], strategy: str) -> None:
    """Refuse to resume a checkpoint's optimizer under another ``parallel.strategy``:
    an exact resume continues the strategy it was written under (where its state lives:
    one rank per parameter under ``zero1``, row shards under ``fsdp`` / ``zero2``). A
    checkpoint from before strategies were recorded was written under ``ddp`` or
    ``fsdp``, its optimizer by group index, which ``zero1``'s shards cannot read."""
    saved = manifest.get("strategy")
    if saved == strategy or (saved is None and strategy != "zero1"):
        return
    was = f"parallel.strategy = '{saved}'" if saved else "a strategy other than zero1"
    again = f"parallel.strategy = '{saved}'" if saved else "its own parallel.strategy"
    raise DistributedError(
        f"checkpoint {path.name} was written under {was} but this run has "
        f"parallel.strategy = '{strategy}' (an exact resume keeps the strategy); "
        f"resume it with {again}, or warm-start a new run from its weights "
        "(exactstep resume RUN --warm-start DIR)")


def require_held(path: Path, held: dict[str, Any], whole: dict[str, Any]) -> None:
    """Refuse, before loading, a checkpoint that lacks model tensors ``held`` names:
    with LoRA and no adapter at all (a run without LoRA, e.g. a warm start's parent)
    a ``ModelError`` saying how to train adapters on it; else a ``CheckpointError``."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(path / DCP_DIR)).read_metadata().state_dict_metadata
    missing = sorted(k for k in held if f"model.{k}" not in saved)
    if missing and len(held) < len(whole) and len(missing) == len(held):
        raise ModelError(
            f"checkpoint {path.name} holds no LoRA adapters (a run without model.lora, "
            "e.g. the parent of a warm start): a LoRA run rebuilds its base from the "
            "model's source and seed, never from another run's weights; export that run "
            "(exactstep export) and train adapters on it with model.source = 'hf' and "
            "model.path = the export")
    if missing:
        raise CheckpointError(f"checkpoint {path.name} does not fit this model: "
                              f"{len(missing)} tensor(s) missing, e.g. {missing[:2]}")


# ------------------------------------------------------------------------ save


def save_distributed_checkpoint(
    root: Path,
    name: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    common: dict[str, Any],
    rank_state: dict[str, Any],
    ctx: DistContext,
    keep: int,
    strategy: str = "ddp",
) -> Path:
    """Every rank calls this at the same window; returns ``root/<name>`` once committed.

    ``model`` is the unwrapped model (DDP shares its parameters; FSDP2 shards them),
    ``common`` the rank-independent parts (rank 0's copy is written), ``rank_state``
    this rank's RNG streams and data cursor; ``strategy`` (``parallel.strategy``) is
    recorded (``check_strategy``); a ``zero1`` optimizer writes its shard
    (``local_optimizer``). Collective: all ranks must call it.
    Rank 0 owns the ``Publication`` (S3); the others write into its directory.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(root)
    tmp = temporary_directory(root, name, PUBLICATION_TAG)
    owner = Publication(root, name, tag=PUBLICATION_TAG) if ctx.is_main else nullcontext()
    with owner as publication:
        _barrier(ctx)  # the directory exists before any rank writes into it
        names = held_names(model)
        local = local_optimizer(optimizer)
        model_sd, optim_sd = get_state_dict(model, local, options=by_name_options())
        whole = len(model_sd)
        model_sd = held_part(model_sd, names)
        # tensor parallel's strided shards go whole, by their logical names (S7)
        dcp.save(gathered_state({"model": model_sd, "optim": optim_sd}),
                 checkpoint_id=str(tmp / DCP_DIR), process_group=_group(ctx))
        torch.save(rank_state, tmp / rank_file(ctx.rank))
        fsync_path(tmp / rank_file(ctx.rank))  # durable from its own node before the barrier
        if publication is not None:
            torch.save(common, tmp / COMMON_FILE)
        _barrier(ctx)
        if publication is not None:
            parts = part_labels(ctx.world_size, adapters_only=len(model_sd) < whole)
            fields: dict[str, Any] = {"world_size": ctx.world_size, OPTIMIZER_KEYS: BY_NAME,
                                      "strategy": strategy}
            if not ctx.layout.only_data:  # a split replica: which rank held which shard
                fields["layout"] = ctx.layout.sizes()
            publication.commit(format=DIST_FORMAT, parts=parts, fields=fields, keep=keep)
    _barrier(ctx)
    return root / name


def _barrier(ctx: DistContext) -> None:
    """Every rank waits here, on the host group (bounded by ``parallel.timeout_s``)."""
    if ctx.distributed:
        dist.barrier(group=host_group(ctx))


def _group(ctx: DistContext):
    """The group torch.distributed.checkpoint coordinates over (None: no job)."""
    return host_group(ctx) if ctx.distributed else None


# ------------------------------------------------------------------------ load


@dataclass(frozen=True)
class DistributedState:
    """What ``load_distributed_checkpoint`` gives back besides the loaded weights.

    ``rank_state``: this rank's RNG and data cursor (on a reshard: the RNG of old rank
    ``rank mod W_old`` and ``data`` = None). ``old_data``: every old rank's data
    cursor (for ``reshard_stream_state``); ``reshard``: the migration record, or None.
    """

    common: dict[str, Any]
    rank_state: dict[str, Any]
    saved_world: int
    old_data: list[Any]
    reshard: dict[str, Any] | None


def read_manifest(path: Path) -> dict[str, Any]:
    """The checkpoint's manifest, refusing any other format."""
    manifest = read_checkpoint_manifest(path)
    if manifest["format"] != DIST_FORMAT:
        raise CheckpointError(f"{path} is not a multi-rank checkpoint "
                              f"(format {manifest['format']!r})")
    return manifest


def load_distributed_checkpoint(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    ctx: DistContext,
    reshard: bool = False,
    strategy: str = "ddp",
) -> DistributedState | None:
    """Load weights (and optimizer) into ``model``/``optimizer``, return the rest (S7).

    With ``optimizer=None`` only the weights are loaded (evaluation, warm start, any
    strategy) and ``None`` is returned. Raises ``DistributedError`` when the
    checkpoint was written by another world size and ``reshard`` is False, or under
    another ``strategy`` (``check_strategy``), before anything is loaded;
    ``CheckpointError`` (naming the file) on a missing or corrupted file. Collective
    when ``ctx`` is distributed.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    path = Path(path)
    manifest = read_manifest(path)
    saved_world = int(manifest["world_size"])
    dcp_files = [k for k in manifest["files"] if k.startswith(DCP_DIR + "/")]
    names = held_names(model)
    if optimizer is None:
        check_files(path, manifest, dcp_files if ctx.is_main else [])
        _barrier(ctx)
        whole = get_model_state_dict(model)
        state = {"model": held_part(whole, names)}
        options = load_options(state["model"], whole)
        require_held(path, state["model"], whole)
        state = _load_dcp(state, path, ctx)
        set_model_state_dict(model, state["model"], options=options)
        return None
    check_strategy(path, manifest, strategy)
    if saved_world != ctx.world_size and not reshard:
        raise DistributedError(
            f"checkpoint {path.name} was written by {saved_world} ranks but this job has "
            f"{ctx.world_size}; relaunch with {saved_world} ranks, or pass --reshard to "
            "re-partition the data by the declared rule (restart at the next epoch)"
        )
    saved_layout = saved_sizes(manifest)
    if saved_layout != ctx.layout.sizes() and not reshard:
        raise DistributedError(
            f"checkpoint {path.name} was written by the layout {layout_text(saved_layout)} "
            f"but this job's is {layout_text(ctx.layout.sizes())}; relaunch with the "
            "checkpoint's parallel.tp / pp / cp, or pass --reshard to load it by logical "
            "names (a declared, non-bitwise continuation)")
    moved = saved_world != ctx.world_size or saved_layout != ctx.layout.sizes()
    old_ranks = [rank_file(r) for r in range(saved_world)]
    mine = [rank_file(ctx.rank % saved_world)] if not reshard else old_ranks
    check_files(path, manifest, [COMMON_FILE, *mine, *(dcp_files if ctx.is_main else [])])
    _barrier(ctx)
    by_name = manifest.get(OPTIMIZER_KEYS) == BY_NAME  # else by group index (before)
    local = local_optimizer(optimizer)
    model_sd, optim_sd = get_state_dict(model, local,
                                        options=by_name_options() if by_name else None)
    state = {"model": held_part(model_sd, names), "optim": optim_sd}
    options = load_options(state["model"], model_sd, by_name=by_name)
    require_held(path, state["model"], model_sd)
    state = _load_dcp(state, path, ctx)
    set_state_dict(model, local, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)
    common = torch.load(path / COMMON_FILE, weights_only=True)
    olds = [torch.load(path / f, weights_only=True) for f in mine]
    if not moved:  # this rank's own state (all of them were read under --reshard)
        own = olds[ctx.rank] if len(olds) > 1 else olds[0]
        return DistributedState(common, own, saved_world, [own["data"]], None)
    rank_state = {**olds[ctx.rank % saved_world], "data": None}
    # one cursor per old replica: its tensor, sequence and pipeline shards read the same
    cursors = [olds[r]["data"] for r in range(saved_world)
               if not any(Layout(**saved_layout, rank=r).coords()[d] for d in ("pp", "cp", "tp"))]
    record = reshard_record(saved_world, ctx.world_size, cursors)
    if saved_layout != ctx.layout.sizes():  # the same tensors by name, split otherwise
        record.update(old_layout=saved_layout, new_layout=ctx.layout.sizes())
    return DistributedState(common, rank_state, saved_world, cursors, record)


def saved_sizes(manifest: dict[str, Any]) -> dict[str, int]:
    """The layout a checkpoint was written by (one without a record: every rank a
    replica, as before the layout was recorded)."""
    recorded = manifest.get("layout")
    if recorded is not None:
        return {dim: int(recorded[dim]) for dim in ("pp", "dp", "cp", "tp")}
    return {"pp": 1, "dp": int(manifest["world_size"]), "cp": 1, "tp": 1}


def layout_text(sizes: dict[str, int]) -> str:
    return " x ".join(f"{dim} {size}" for dim, size in sizes.items())


def _load_dcp(state: dict[str, Any], path: Path, ctx: DistContext) -> dict[str, Any]:
    """``state`` filled from the checkpoint's DCP part: tensor parallel's strided shards
    are read whole and split back into this rank's shard (``parallel.tensor``)."""
    import torch.distributed.checkpoint as dcp

    whole = gathered_state(state)
    dcp.load(whole, checkpoint_id=str(path / DCP_DIR), process_group=_group(ctx))
    return scattered_state(whole, state)


# ------------------------------------------------------------------------ reshard rule


def resume_epoch(old_data: list[dict[str, Any]]) -> int:
    """The epoch every new rank starts at: one past the furthest old rank's epoch."""
    return 1 + max(int(d["planner"]["epoch"]) for d in old_data)


def reshard_stream_state(old_data: list[dict[str, Any]], fresh: dict[str, Any]) -> dict[str, Any]:
    """A data cursor for a new rank: ``fresh`` (a new stream's ``state_dict()`` built
    with the new rank/world) moved to the start of ``resume_epoch(old_data)``."""
    state = copy.deepcopy(fresh)
    planner = state["planner"]
    planner.update(epoch=resume_epoch(old_data), cursor=0, exhausted=False,
                   admitted_this_epoch=0, pending=[])
    return state


def reshard_record(old_world: int, new_world: int, old_data: list[dict[str, Any]]) -> dict:
    """The ledger's account of the migration (S7)."""
    epochs = [int(d["planner"]["epoch"]) for d in old_data]
    return {
        "event": "RESHARD",
        "old_world_size": old_world,
        "new_world_size": new_world,
        "rule": "data restarts at the next epoch, sharded for the new world; "
                "rank r takes the RNG of old rank r mod old_world_size",
        "old_epochs": epochs,
        "resume_epoch": resume_epoch(old_data),
        "pending_pieces_dropped": sum(len(d["planner"]["pending"]) for d in old_data),
    }


class DcpFormat:
    """The multi-rank format as the state stage's ``Checkpointer`` uses it (S7)."""

    format = DIST_FORMAT

    def __init__(self, ctx: DistContext, strategy: str = "ddp") -> None:
        self.ctx = ctx
        self.strategy = strategy  # parallel.strategy: recorded, and checked on resume

    def save(self, root: Path, name: str, *, model: nn.Module,
             optimizer: torch.optim.Optimizer, common: dict[str, Any],
             rank_state: dict[str, Any], keep: int) -> Path:
        return save_distributed_checkpoint(root, name, model=model, optimizer=optimizer,
                                           common=common, rank_state=rank_state,
                                           ctx=self.ctx, keep=keep, strategy=self.strategy)

    def load(self, path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             reshard: bool) -> DistributedState | None:
        return load_distributed_checkpoint(path, model=model, optimizer=optimizer,
                                           ctx=self.ctx, reshard=reshard,
                                           strategy=self.strategy)

    @staticmethod
    def read_progress(path: Path) -> dict[str, Any]:
        """The progress part alone (verified), for choosing a checkpoint."""
        manifest = read_manifest(path)
        check_files(path, manifest, [COMMON_FILE])
        return torch.load(Path(path) / COMMON_FILE, weights_only=True)["progress"]

    @staticmethod
    def reshard_stream_state(old_data: list[dict[str, Any]], fresh: dict[str, Any]) -> dict:
        return reshard_stream_state(old_data, fresh)

    @staticmethod
    def reshard_record(old_world: int, new_world: int, old_data: list[dict[str, Any]]) -> dict:
        return reshard_record(old_world, new_world, old_data)
