"""Weights & Biases (offline) and MLflow (local file store) tracking (X3): what each
library holds, read back with its own reader (MLflow's client; W&B's record format),
against the run's ledger and metrics; a resume's segment supersedes what the earlier
start wrote after its checkpoint."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from run_support import TINY, short_texts, write_texts
from wandb_reader import read_run, run_files

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

from exactstep.config import load_config  # noqa: E402
from exactstep.errors import ConfigError  # noqa: E402
from exactstep.tracking import RunIdentity, segment_curve  # noqa: E402
from exactstep.tracking.mlflow_run import MlflowTracker, tracking_uri  # noqa: E402
from exactstep.update.disposition import Disposition, Outcome  # noqa: E402


def overrides(source: Path, store: Path) -> list[str]:
    return [f"{k}={v}" for k, v in TINY.items()] + [
        f"data.source={source}", "data.val_fraction=0.2", "train.steps=6", "train.eval_every=3",
        "train.log_every=2", "train.progress=false", "log.wandb=offline",
        f"log.mlflow={store}", "update.warmup=2", "checkpoint.every=3", "checkpoint.keep=5",
    ]


def mlflow_segments(store: Path, experiment: str = "exactstep") -> list:
    """The store's runs of the experiment, in the order they were started."""
    client = MlflowClient(tracking_uri(str(store)))
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    return sorted(runs, key=lambda r: r.info.start_time)


def mlflow_history(store: Path, run, key: str) -> dict[int, float]:
    client = MlflowClient(tracking_uri(str(store)))
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


def committed_curve(run_dir: Path, field: str) -> dict[int, float]:
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return {r["window"] + 1: r[field] for r in ledger if r["disposition"] == "COMMITTED"}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A 6-window run tracked in W&B (offline) and MLflow, then resumed from its
    window-3 checkpoint (a second segment in each store)."""
    from exactstep.run.continuation import resume
    from exactstep.run.runner import train

    root = tmp_path_factory.mktemp("tracked")
    source = write_texts(root / "docs.jsonl", short_texts())
    out, store = root / "run", root / "mlruns"
    train(load_config(None, overrides(source, store)), out, progress=False)
    first = {"wandb": run_files(out), "mlflow": mlflow_segments(store),
             "ledger": (out / "ledger.jsonl").read_text(),
             "metrics": (out / "metrics.jsonl").read_text()}
    shutil.copytree(out, root / "before-resume")
    resume(out, from_checkpoint=out / "checkpoints" / "window-00000003", progress=False)
    return root, out, store, first


def test_wandb_offline_holds_the_ledger_and_the_evaluations(tracked_run):
    root, _, _, first = tracked_run
    (path,) = first["wandb"]
    seen = read_run(path)
    before = root / "before-resume"
    for figure, field in (("train/loss", "loss"), ("train/lr", "lr"),
                          ("train/grad_norm", "grad_norm"), ("train/gold_nll", "gold_nll")):
        assert seen["history"][figure] == committed_curve(before, field), figure
    assert seen["history"]["train/committed"] == {w: float(w) for w in range(1, 7)}
    metrics = [json.loads(line) for line in first["metrics"].splitlines()]
    evals = {m["window"]: m["eval_loss"] for m in metrics if "eval_loss" in m}
    assert evals and seen["history"]["eval/loss"] == evals
    rates = {m["window"]: m["tokens_per_s"] for m in metrics if "tokens_per_s" in m}
    assert seen["history"]["train/tokens_per_s"] == rates and sorted(rates) == [2, 4, 6]
    assert seen["config"]["update"]["warmup"] == 2
    assert seen["config"]["exactstep"]["start_window"] == 0
    manifest = json.loads((before / "manifest.json").read_text())
    assert seen["config"]["exactstep"]["manifest_digest"] == manifest["digest"]
    assert seen["name"] == "run@0" and seen["group"] == f"run-{manifest['digest'][:12]}"


def test_mlflow_holds_the_ledger_params_and_the_evaluations(tracked_run):
    root, _, store, first = tracked_run
    (seg,) = first["mlflow"]
    before = root / "before-resume"
    for figure, field in (("train/loss", "loss"), ("train/lr", "lr"),
                          ("train/grad_norm", "grad_norm")):
        assert mlflow_history(store, seg, figure) == committed_curve(before, field), figure
    metrics = [json.loads(line) for line in first["metrics"].splitlines()]
    evals = {m["window"]: m["eval_loss"] for m in metrics if "eval_loss" in m}
    assert evals and mlflow_history(store, seg, "eval/loss") == evals
    assert seg.data.params["update.warmup"] == "2"
    assert seg.data.params["train.steps"] == "6"
    assert seg.data.tags["exactstep.start_window"] == "0"
    assert seg.info.status == "FINISHED"


def test_a_resume_is_a_second_segment_that_supersedes_the_first_after_its_start(tracked_run):
    _, out, store, _ = tracked_run
    first, second = mlflow_segments(store)
    assert second.data.tags["exactstep.start_window"] == "3"
    assert first.data.tags["exactstep.superseded_after"] == "3"
    assert second.data.tags["exactstep.run"] == first.data.tags["exactstep.run"]
    assert sorted(mlflow_history(store, second, "train/loss")) == [4, 5, 6]
    curve = segment_curve([(int(s.data.tags["exactstep.start_window"]),
                            mlflow_history(store, s, "train/loss")) for s in (first, second)])
    assert curve == committed_curve(out, "loss")
    runs = [read_run(p) for p in run_files(out)]
    assert [r["config"]["exactstep"]["start_window"] for r in runs] == [0, 3]
    assert len({r["group"] for r in runs}) == 1
    curve = segment_curve([(r["config"]["exactstep"]["start_window"], r["history"]["train/loss"])
                           for r in runs])
    assert curve == committed_curve(out, "loss")


def test_segment_curve_keeps_each_steps_latest_start():
    killed = (0, {k: 1.0 for k in range(1, 7)})        # wrote 1..6, checkpoint at 3
    resumed = (3, {4: 2.0})                             # still running: only 4 so far
    assert segment_curve([killed, resumed]) == {1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0}
    rewound = (2, {3: 3.0, 4: 3.0, 5: 3.0})             # then resumed from checkpoint 2
    assert segment_curve([killed, resumed, rewound]) == {1: 1.0, 2: 1.0, 3: 3.0, 4: 3.0,
                                                          5: 3.0}
    # negative control: merging every point by step keeps the killed start's 5 and 6
    naive: dict[int, float] = {}
    for _, points in (killed, resumed):
        naive.update(points)
    assert naive != segment_curve([killed, resumed])


def disposition(window: int, loss: float) -> Disposition:
    return Disposition(window=window, outcome=Outcome.COMMITTED, cause=None, lr=1e-3,
                       denominator=1.0, loss=loss, grad_norm=1.0, tokens=1)


def test_a_killed_segment_is_marked_killed_and_superseded(tmp_path):
    store = tmp_path / "mlruns"
    counts = {o.value: 0 for o in Outcome}
    killed = MlflowTracker(str(store), RunIdentity("r", "ab" * 32, {}, 0), experiment="e")
    for w in range(6):
        killed.window(disposition(w, 1.0), counts)  # never closed: the process was killed
    resumed = MlflowTracker(str(store), RunIdentity("r", "ab" * 32, {}, 3), experiment="e")
    resumed.window(disposition(3, 2.0), counts)
    other = MlflowTracker(str(store), RunIdentity("r", "cd" * 32, {}, 2), experiment="e")
    other.close()  # another run's segment leaves this run's segments alone
    segs = mlflow_segments(store, "e")
    assert [s.info.status for s in segs] == ["KILLED", "RUNNING", "FINISHED"]
    assert segs[0].data.tags["exactstep.superseded_after"] == "3"
    assert "exactstep.superseded_after" not in segs[1].data.tags
    curve = segment_curve([(int(s.data.tags["exactstep.start_window"]),
                            mlflow_history(store, s, "train/loss")) for s in segs[:2]])
    assert curve == {1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0}


@pytest.mark.parametrize("module, key", [("wandb", "log.wandb=offline"),
                                         ("mlflow.tracking", "log.mlflow=mlruns")])
def test_a_missing_library_is_one_config_error(tmp_path, monkeypatch, module, key):
    from exactstep.run.runner import train

    monkeypatch.setitem(sys.modules, module, None)
    source = write_texts(tmp_path / "docs.jsonl", short_texts(20))
    cfg = load_config(None, [f"{k}={v}" for k, v in TINY.items()] + [
        f"data.source={source}", "train.steps=2", "train.progress=false", key])
    with pytest.raises(ConfigError, match=rf"{key.split('=')[0]}.*'track' extra"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir())


def test_an_unwritable_mlflow_directory_is_one_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="log.mlflow: cannot create"):
        MlflowTracker(str(blocker / "store"), RunIdentity("r", "ab" * 32, {}, 0),
                      experiment="e")


def test_log_wandb_takes_off_offline_online_only(tmp_path):
    with pytest.raises(ConfigError, match="log.wandb must be one of off, offline, online"):
        load_config(None, ["log.wandb=yes"])


def test_a_tracker_that_cannot_start_leaves_no_run_behind(tmp_path):
    """The CLI prints one line and exits 2; the run directory holds no manifest or
    journal, so the same ``--out`` can be used again once the setting is fixed."""
    import process_server

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    source = write_texts(tmp_path / "docs.jsonl", short_texts(20))
    args = [sys.executable, "-m", "exactstep", "train", "--out", str(tmp_path / "run")]
    for pair in [f"{k}={v}" for k, v in TINY.items()] + [
            f"data.source={source}", "train.steps=2", "train.progress=false",
            f"log.mlflow={blocker / 'store'}"]:
        args += ["--set", pair]
    done = process_server.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "log.mlflow: cannot create" in errors[0]
    assert "Traceback" not in done.stderr
    left = {p.name for p in (tmp_path / "run").iterdir()} if (tmp_path / "run").exists() else set()
    assert not left & {"manifest.json", "ledger.jsonl", "metrics.jsonl"}


def refused_start(out: Path, source: Path, blocker: Path) -> list[str]:
    """``train --out OUT`` with TensorBoard and W&B (offline) starting, then MLflow
    refusing; returns its stderr lines (after checking the one-line refusal)."""
    import process_server

    args = [sys.executable, "-m", "exactstep", "train", "--out", str(out)]
    for pair in [f"{k}={v}" for k, v in TINY.items()] + [
            f"data.source={source}", "train.steps=2", "train.progress=false",
            "log.tensorboard=true", "log.wandb=offline", f"log.mlflow={blocker / 'store'}"]:
        args += ["--set", pair]
    done = process_server.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "log.mlflow: cannot create" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr.splitlines()


def open_files_under(root: Path) -> list[str]:
    """What this process holds open below ``root`` (Linux's /proc/self/fd)."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if target.startswith(str(root) + "/"):
            found.append(target)
    return found


def test_a_refused_start_leaves_no_new_directory_and_no_tracker_logs(tmp_path):
    """S8, X4: the trackers that had started (TensorBoard's events, W&B's offline run)
    are closed and removed with the --out this start created; an --out that existed
    (empty) is left as it was. Negative control: a directory holding a committed run
    keeps every file when a start into it is refused."""
    from run_support import tree_digests

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    source = write_texts(tmp_path / "docs.jsonl", short_texts(20))
    refused_start(tmp_path / "new" / "run", source, blocker)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "file"]

    empty = tmp_path / "empty"
    empty.mkdir()
    refused_start(empty, source, blocker)
    assert list(empty.iterdir()) == []

    from exactstep.run.runner import train

    with pytest.raises(ConfigError, match="log.mlflow: cannot create"):  # in this process
        train(load_config(None, [f"{k}={v}" for k, v in TINY.items()] + [
            f"data.source={source}", "train.steps=2", "train.progress=false",
            "log.tensorboard=true", "log.wandb=offline", f"log.mlflow={blocker / 'store'}"]),
            tmp_path / "in", progress=False)
    assert not (tmp_path / "in").exists()
    if Path("/proc/self/fd").is_dir():  # the trackers that started were closed: W&B's
        # log was left open in the removed directory while its run was never finished
        assert open_files_under(tmp_path / "in") == []

    done = tmp_path / "done"
    train(load_config(None, [f"{k}={v}" for k, v in TINY.items()] + [
        f"data.source={source}", "train.steps=2", "train.progress=false"]), done,
        progress=False)
    before = tree_digests(done)
    with pytest.raises(ConfigError, match="log.mlflow: cannot create"):
        train(load_config(None, [f"{k}={v}" for k, v in TINY.items()] + [
            f"data.source={source}", "train.steps=2", "train.progress=false",
            f"log.mlflow={blocker / 'store'}"]), done, progress=False)
    assert tree_digests(done) == before
