"""The SLURM recipe of docs/guides/multinode.md, dry-run (D1, S10, X1).

The ``sbatch`` script is taken from the page as written, checked by ``bash -n`` and
run with the ``SLURM_*`` variables of a two-node allocation set and ``srun``,
``torchrun`` and ``scontrol`` replaced by stand-ins on ``PATH`` that record what they
were asked to run. The ``torchrun`` command line must parse with torchrun's own
parser to the rendezvous the allocation implies, and its ``exactstep`` part with
exactstep's parser; a step stopped by a signal (exit 130) requeues the job, a
finished one does not. Negative control: without ``SLURM_JOB_NODELIST`` the script
stops before launching anything.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from exactstep.cli import build_parser

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "multinode.md"

SRUN = """#!/bin/sh
echo "srun $*" >> "$SHIM_LOG"
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
exec "$@"
"""
TORCHRUN = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["SHIM_LOG"], "a") as fh:
    fh.write("torchrun " + json.dumps({{"argv": sys.argv[1:],
             "share": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}}) + "\\n")
sys.exit(int(os.environ.get("SHIM_EXIT", "0")))
"""
SCONTROL = """#!/bin/sh
echo "scontrol $*" >> "$SHIM_LOG"
if [ "$1 $2" = "show hostnames" ]; then printf 'node-a\\nnode-b\\n'; fi
"""
ALLOCATION = {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_NUM_NODES": "2",
              "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "exactstep", "SLURM_NODEID": "0",
              "SLURM_GPUS_ON_NODE": "4"}


def script_text() -> str:
    found = re.search(r"<!-- slurm-script -->\n```bash\n(.*?)\n```", PAGE.read_text(), re.S)
    assert found, "the page must hold the sbatch script after <!-- slurm-script -->"
    return found.group(1) + "\n"


@pytest.fixture
def shims(tmp_path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("torchrun", TORCHRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755 | stat.S_IXUSR)
    (tmp_path / "job.sbatch").write_text(script_text())
    return tmp_path


def dry_run(root: Path, exit_code: int = 0, **env: str) -> tuple[int, list[str]]:
    log = root / f"log-{exit_code}-{len(env)}"
    full = {"PATH": f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}", "SHIM_LOG": str(log),
            "SHIM_EXIT": str(exit_code), "HOME": str(root), **env}
    proc = subprocess.run(["bash", str(root / "job.sbatch")], env=full, cwd=root,
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, log.read_text().splitlines() if log.exists() else []


def torchrun_argv(lines: list[str]) -> tuple[list[str], str | None]:
    calls = [json.loads(line[len("torchrun "):]) for line in lines
             if line.startswith("torchrun ")]
    assert len(calls) == 1, lines
    return calls[0]["argv"], calls[0]["share"]


def test_the_script_parses_and_asks_for_a_requeue() -> None:
    text = script_text()
    proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    directives = re.findall(r"^#SBATCH (\S+)", text, re.M)
    assert {"--requeue", "--nodes=2", "--ntasks-per-node=1"} <= set(directives)


def test_the_rendezvous_comes_from_the_slurm_variables(shims) -> None:
    """One srun task per node runs torchrun with the allocation's rendezvous: the first
    host, the job id, the node count, the GPUs per node; the exactstep part is a
    ``train --resume auto`` on the run directory (S10)."""
    from torch.distributed.run import get_args_parser

    rc, lines = dry_run(shims, **ALLOCATION)
    assert rc == 0, lines
    assert lines[0] == "scontrol show hostnames node-[a-b]"
    assert lines[1].startswith("srun --kill-on-bad-exit=1 torchrun ")
    argv, share = torchrun_argv(lines)
    args = get_args_parser().parse_args(argv)
    assert (args.nnodes, args.nproc_per_node) == ("2", "4")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "node-a:29500",
                                                                     "4242")
    assert args.module and args.training_script == "exactstep" and args.max_restarts == 1
    assert share == "1"
    ours = build_parser().parse_args(args.training_script_args)
    assert (ours.command, ours.resume, ours.out, ours.config) == (
        "train", "auto", "/shared/runs/exactstep", "train.toml")
    assert not any(line.startswith("scontrol requeue") for line in lines)


def test_a_step_stopped_by_a_signal_requeues_the_job(shims) -> None:
    """Exit 130 (SIGTERM on preemption or at the time limit; a checkpoint was published)
    requeues the job; the rerun is the same command, which ``--resume auto`` continues."""
    rc, lines = dry_run(shims, 130, **ALLOCATION, RUN_DIR="/lustre/me/run7")
    assert rc == 130
    assert "scontrol requeue 4242" in lines
    argv, _ = torchrun_argv(lines)
    assert argv[argv.index("--out") + 1] == "/lustre/me/run7"


def test_without_the_allocation_nothing_is_launched(shims) -> None:
    env = {k: v for k, v in ALLOCATION.items() if k != "SLURM_JOB_NODELIST"}
    rc, lines = dry_run(shims, **env)
    assert rc != 0
    assert not any(line.startswith(("srun", "torchrun")) for line in lines)
