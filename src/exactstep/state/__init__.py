"""State that survives: the checkpoint store, checkpoint formats, the Checkpointer,
resume choice, RNG capture (S1-S8). Public names are re-exported here."""

from exactstep.state.checkpoint import load_checkpoint, publish_checkpoint
from exactstep.state.checkpointer import Checkpointer, Restored, load_weights
from exactstep.state.compare import state_differences, tensors_bitwise_equal
from exactstep.state.resume import (
    ResumePoint,
    StopRequest,
    check_progress_digest,
    choose_resume_point,
    require_same_manifest,
)
from exactstep.state.rng import capture_rng, restore_rng, seed_rng
from exactstep.state.store import (
    PartReport,
    Publication,
    VerifyReport,
    clean_uncommitted,
    latest_checkpoint,
    list_checkpoints,
    prune,
    published_checkpoints,
    quarantine,
    verify_checkpoint,
)

__all__ = [
    "Checkpointer",
    "PartReport",
    "Publication",
    "Restored",
    "ResumePoint",
    "StopRequest",
    "VerifyReport",
    "capture_rng",
    "check_progress_digest",
    "choose_resume_point",
    "clean_uncommitted",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_weights",
    "prune",
    "publish_checkpoint",
    "published_checkpoints",
    "quarantine",
    "require_same_manifest",
    "restore_rng",
    "seed_rng",
    "state_differences",
    "tensors_bitwise_equal",
    "verify_checkpoint",
]
