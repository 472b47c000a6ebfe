"""State that survives: durable writes and journals (``durable``), the run manifest
(``manifest``), the checkpoint store, checkpoint formats, the Checkpointer, resume
choice, RNG capture (S1-S8). Public names are re-exported here."""

from exactstep.lazy import lazy_exports

_EXPORTS = {
    "Checkpointer": "exactstep.state.checkpointer",
    "PartReport": "exactstep.state.store",
    "Publication": "exactstep.state.store",
    "Restored": "exactstep.state.checkpointer",
    "ResumePoint": "exactstep.state.resume",
    "StopRequest": "exactstep.state.resume",
    "VerifyReport": "exactstep.state.store",
    "capture_rng": "exactstep.state.rng",
    "check_progress_digest": "exactstep.state.resume",
    "choose_resume_point": "exactstep.state.resume",
    "clean_uncommitted": "exactstep.state.store",
    "latest_checkpoint": "exactstep.state.store",
    "list_checkpoints": "exactstep.state.store",
    "load_checkpoint": "exactstep.state.safetensors_format",
    "load_weights": "exactstep.state.checkpointer",
    "prune": "exactstep.state.store",
    "publish_checkpoint": "exactstep.state.safetensors_format",
    "published_checkpoints": "exactstep.state.store",
    "quarantine": "exactstep.state.store",
    "require_same_manifest": "exactstep.state.resume",
    "restore_rng": "exactstep.state.rng",
    "seed_rng": "exactstep.state.rng",
    "state_differences": "exactstep.state.compare",
    "tensors_bitwise_equal": "exactstep.state.compare",
    "verify_checkpoint": "exactstep.state.store",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
