"""exactstep: train language models so every optimizer update is exactly the declared
objective. The contracts (R, L, U, D, S, E, A, X ids) are listed in the README.

The public names below are imported lazily, so ``import exactstep`` (and the CLI's
start-up) does not pay for torch until a name that needs it is used.
"""

from __future__ import annotations

from exactstep.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    # configuration and errors
    "RunConfig": "exactstep.config",
    "load_config": "exactstep.config",
    "ExactstepError": "exactstep.errors",
    "ConfigError": "exactstep.errors",
    "DataError": "exactstep.errors",
    "BatchInvariantError": "exactstep.errors",
    "ObjectiveError": "exactstep.errors",
    "ModelError": "exactstep.errors",
    "CheckpointError": "exactstep.errors",
    "ResumeError": "exactstep.errors",
    "DistributedError": "exactstep.errors",
    "StorageError": "exactstep.errors",
    # data and rows
    "ByteTokenizer": "exactstep.data.tokenizer",
    "load_corpus": "exactstep.data.corpus",
    "Example": "exactstep.rows.example",
    "RowStream": "exactstep.rows.stream",
    "eval_batches": "exactstep.rows.stream",
    "Batch": "exactstep.rows.batch",
    "Segment": "exactstep.rows.batch",
    "IGNORE_INDEX": "exactstep.rows.batch",
    "check_batch": "exactstep.rows.invariants",
    "ChatPolicy": "exactstep.rows.chat",
    # model, objective, update
    "build_model": "exactstep.model.decoder",
    "Decoder": "exactstep.model.decoder",
    "plan_window": "exactstep.objective.plan",
    "microbatch_terms": "exactstep.objective.terms",
    "perplexity": "exactstep.objective.perplexity",
    "NoObjective": "exactstep.objective.types",
    "UpdateEngine": "exactstep.update.window",
    "Disposition": "exactstep.update.disposition",
    "Outcome": "exactstep.update.disposition",
    # state and runs
    "build_manifest": "exactstep.state.manifest",
    "publish_checkpoint": "exactstep.state.safetensors_format",
    "load_checkpoint": "exactstep.state.safetensors_format",
    "verify_checkpoint": "exactstep.state.store",
    "evaluate_run": "exactstep.run.finished_run",
    "train": "exactstep.run.runner",
    "resume": "exactstep.run.continuation",
    "evaluate": "exactstep.eval",
}

_NAMES, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["__version__", *_NAMES]
