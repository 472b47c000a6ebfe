"""X2 from an installed wheel: ``exactstep bench`` ships its benchmarks in the package.

A wheel is built from a copy of the project (pyproject, README, ``src/``), installed
non-editable into a fresh virtual environment, and ``exactstep bench list`` and one
``--quick --json`` benchmark run from a directory outside the source tree. The new
environment sees the already-installed dependencies (torch, numpy, ...) through a
``.pth`` line naming this interpreter's site-packages as a plain path entry (its own
``.pth`` files, the editable install's among them, are not processed), so nothing is
downloaded. Negative control: the same check on a wheel built without the
``exactstep.bench`` sub-package fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# every benchmark the package ships, written out (independent of the discovery code)
EXPECTED_BENCHMARKS = ["attention", "checkpoint", "ddp", "default", "denormals", "families",
                       "finetune", "grpo", "hf", "loader", "loss", "packing", "parallel",
                       "prepare",
                       "rollout", "step"]
# the quickest benchmark (about 2 s with --quick) and every figure it reports
QUICK_BENCH = "packing"
PACKING_FIGURES = {
    "seq_len", "documents", "efficiency", "tokens_per_s",
    *(f"{d}_{f}" for d in ("gamma", "lognormal") for f in (
        "efficiency", "baseline_efficiency", "tokens_per_s", "baseline_tokens_per_s",
        "time_ratio")),
}
TIMEOUT_S = 300


def clean_env() -> dict[str, str]:
    """The environment minus anything that would put the source tree on the path."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONSAFEPATH"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)


def copy_project(dst: Path, *, with_bench: bool) -> Path:
    """The files a wheel is built from, without build leftovers (or without the benchmarks)."""
    dst.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):  # setup.py: the C kernels
        shutil.copy2(ROOT / name, dst / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc", "*.so")
    shutil.copytree(ROOT / "src", dst / "src", ignore=ignore)
    if not with_bench:
        shutil.rmtree(dst / "src" / "exactstep" / "bench")
    return dst


def build_wheel(project: Path, out: Path) -> Path:
    done = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "--no-index", "--quiet", "-w", out, project], cwd=project)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("exactstep-*.whl")
    return wheel


def site_packages() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def install_in_fresh_venv(wheel: Path, venv: Path) -> Path:
    """A new venv whose ``exactstep`` is ``wheel``; returns its ``bin`` directory."""
    done = run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv.parent)
    assert done.returncode == 0, done.stderr
    python = venv / "bin" / "python"
    own_site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=venv.parent).stdout.strip()
    # plain path lines: the dependencies (and pip) resolve there, after the venv's own site
    Path(own_site, "zz_shared_deps.pth").write_text("\n".join(site_packages()) + "\n")
    done = run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                "--quiet", wheel], cwd=venv.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv / "bin"


def listed_benchmarks(bin_dir: Path, cwd: Path) -> list[str] | None:
    """What ``exactstep bench list`` prints, one name a line; None when it fails."""
    done = run([bin_dir / "exactstep", "bench", "list"], cwd=cwd)
    return done.stdout.split() if done.returncode == 0 else None


def install(base: Path, *, with_bench: bool) -> Path:
    """Build and install a wheel of the project (or of it without ``exactstep.bench``)."""
    label = "full" if with_bench else "no_bench"
    project = copy_project(base / f"src_{label}", with_bench=with_bench)
    wheel = build_wheel(project, base / f"wheel_{label}")
    return install_in_fresh_venv(wheel, base / f"venv_{label}")


def outside_the_tree(base: Path) -> Path:
    cwd = base / "elsewhere"
    cwd.mkdir()
    return cwd


def test_an_installed_wheel_lists_and_runs_its_benchmarks(tmp_path) -> None:
    bin_dir, cwd = install(tmp_path, with_bench=True), outside_the_tree(tmp_path)
    # the command under test is the wheel's copy, not the source tree
    done = run([bin_dir / "python", "-c",
                "import exactstep.cli, exactstep.bench; print(exactstep.cli.__file__); "
                "print(exactstep.bench.__file__)"], cwd=cwd)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.split():
        assert Path(line).resolve().is_relative_to(bin_dir.parent.resolve()), line
        assert not Path(line).resolve().is_relative_to(ROOT), line

    assert listed_benchmarks(bin_dir, cwd) == EXPECTED_BENCHMARKS

    done = run([bin_dir / "exactstep", "bench", QUICK_BENCH, "--quick", "--json"], cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    report = json.loads(lines[0])
    assert report.pop("bench") == QUICK_BENCH
    assert report.pop("quick") is True
    assert set(report) == PACKING_FIGURES
    assert report["seq_len"] == 2048 and report["documents"] == 2000
    for key in ("efficiency", "gamma_efficiency", "lognormal_efficiency"):
        assert 0.0 < report[key] <= 1.0, key
    assert report["efficiency"] == min(report["gamma_efficiency"], report["lognormal_efficiency"])


def test_the_listing_check_fails_on_a_wheel_without_the_benchmarks(tmp_path) -> None:
    # negative control: the listing check above rejects a wheel lacking exactstep.bench
    bin_dir, cwd = install(tmp_path, with_bench=False), outside_the_tree(tmp_path)
    assert listed_benchmarks(bin_dir, cwd) != EXPECTED_BENCHMARKS
