"""Many processes, one objective: process groups, DDP/FSDP2 wrapping, global
reductions, the agreed window and multi-rank checkpoints (D1-D5, S7)."""

from exactstep.lazy import lazy_exports

_EXPORTS = {
    "DDPReducer": "exactstep.parallel.reducer",
    "DcpFormat": "exactstep.parallel.dcp_format",
    "DistContext": "exactstep.parallel.process_group",
    "ParallelConfig": "exactstep.parallel.config",
    "agreed_window": "exactstep.parallel.agreement",
    "build_reducer": "exactstep.parallel.reducer",
    "distribute_engine": "exactstep.parallel.agreement",
    "init_distributed": "exactstep.parallel.process_group",
    "load_distributed_checkpoint": "exactstep.parallel.dcp_format",
    "save_distributed_checkpoint": "exactstep.parallel.dcp_format",
    "shard_model": "exactstep.parallel.wrap",
    "single_process": "exactstep.parallel.process_group",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
