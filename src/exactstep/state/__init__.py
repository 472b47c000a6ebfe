"""State that survives: checkpoints, RNG capture, resume classification (S1-S6)."""

from exactstep.state.checkpoint import (
    PartReport,
    VerifyReport,
    clean_uncommitted,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune,
    publish_checkpoint,
    verify_checkpoint,
)
from exactstep.state.compare import state_differences, tensors_bitwise_equal
from exactstep.state.resume import (
    ResumeKind,
    ResumePlan,
    StopRequest,
    check_progress_digest,
    choose_checkpoint,
    classify_resume,
)
from exactstep.state.rng import capture_rng, restore_rng, seed_rng

__all__ = [
    "ResumeKind",
    "ResumePlan",
    "StopRequest",
    "check_progress_digest",
    "choose_checkpoint",
    "classify_resume",
    "PartReport",
    "VerifyReport",
    "capture_rng",
    "clean_uncommitted",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune",
    "publish_checkpoint",
    "restore_rng",
    "seed_rng",
    "state_differences",
    "tensors_bitwise_equal",
    "verify_checkpoint",
]
