"""The public surface is pinned: every exported name resolves, and nothing is exported
by accident (a new public name is a deliberate change to this list)."""

from __future__ import annotations

import subprocess
import sys

import exactstep

PINNED = {
    "__version__", "RunConfig", "load_config", "ExactstepError", "ConfigError", "DataError",
    "BatchInvariantError", "ObjectiveError", "ModelError", "CheckpointError", "ResumeError",
    "DistributedError", "StorageError", "ByteTokenizer", "load_corpus", "Example", "RowStream", "eval_batches",
    "Batch", "Segment", "IGNORE_INDEX", "check_batch", "ChatPolicy", "build_model", "Decoder",
    "plan_window", "microbatch_terms", "perplexity", "NoObjective", "UpdateEngine",
    "Disposition", "Outcome", "build_manifest", "publish_checkpoint", "load_checkpoint",
    "verify_checkpoint", "train", "resume", "evaluate", "evaluate_run",
}


def test_public_names_are_pinned_and_resolve() -> None:
    assert set(exactstep.__all__) == PINNED
    for name in exactstep.__all__:
        assert getattr(exactstep, name) is not None, name


def test_import_is_light() -> None:
    code = "import sys, exactstep; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
