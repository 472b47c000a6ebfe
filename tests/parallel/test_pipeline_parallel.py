"""Pipeline parallel over real gloo ranks equals the one-process run (D1, D2, U1, U3).

Two spawned ranks, one pipeline of two stages (``parallel.pp = 2``), run every phase of
one job: each schedule (GPipe, 1F1B, interleaved 1F1B with two stages per rank), tied
embeddings, a NaN on one stage, and the planted wrong variants (a per-microbatch mean
denominator, a stage-local clip norm, an unagreed finite flag) that the same checks
must catch. The windows have unequal token counts and the last one is short (one
microbatch: the pipeline pads it with an empty one, U1).

Tolerance (derived, never observed): the reference is the one-process run in float64;
the pipeline may be at most twice as far from it as the one-process fp32 run is, plus
a floor of ``FLOOR_ULPS`` fp32 units of the tensor's magnitude (the pipeline reorders
a few sums, the norm over stages and the tied gradient, each one rounding).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import process_server
import pytest
import torch
from cli_support import KILL_ONCE_HOOK, TINY_MODEL, CliRoot, tiny_overrides, worker_env
from equivalence import FP32_UNIT
from pipeline_workers import ROWS, SEQ, one_process_engine, pipeline_main
from run_support import multi_rank_state, tree_digests
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from workers import PAD_ID, UPDATE, shards, spawn_ranks

from exactstep.eval import evaluate
from exactstep.parallel.dcp_format import load_distributed_checkpoint
from exactstep.parallel.process_group import single_process
from exactstep.state.compare import state_differences
from exactstep.update.window import MicrobatchLoop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORLD = 2
SAVED = "checkpoints/after-2"
# held-out batches (one without targets) and the evaluation's target limit: the first
# three batches with targets count (5 + 3 + 7 >= 12), a schedule step of 2 and one of 1
HELD_OUT = shards([[[5, 0, 3, 7, 2]]], rows=ROWS, seq_len=SEQ)[0][0]
EVAL_TOKENS = 12
FLOOR_ULPS = 4
# [window][microbatch] supervised tokens; the last window is short (U1)
TOKENS = [[[5, 3], [4, 7], [6]]]
WINDOWS = shards(TOKENS, rows=ROWS, seq_len=SEQ)[0]

PHASES = {
    "gpipe": {"schedule": "gpipe", "layers": 2},
    "1f1b": {"schedule": "1f1b", "layers": 2},
    "interleaved": {"schedule": "interleaved_1f1b", "layers": 4},
    "tied": {"schedule": "1f1b", "layers": 2, "tied": True},
    "record": {"schedule": "1f1b", "layers": 2, "runner": "record"},
    "schedule_mean": {"schedule": "1f1b", "layers": 2, "runner": "schedule_mean"},
    "mean_per_microbatch": {"schedule": "1f1b", "layers": 2, "runner": "mean_per_microbatch"},
    "local_norm": {"schedule": "1f1b", "layers": 2, "runner": "local_norm"},
    "nan": {"schedule": "1f1b", "layers": 2, "fail_window": {1: 1}},
    "nan_local": {"schedule": "1f1b", "layers": 2, "fail_window": {1: 1},
                  "reducer": "unagreed_flag", "runner": "local_norm"},
}


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def job(out: Path) -> dict[str, list[dict]]:
    PHASES["save"] = {"schedule": "1f1b", "layers": 2, "tied": True, "save": str(out / SAVED),
                      "windows": WINDOWS[:2]}
    PHASES["resume"] = {"schedule": "1f1b", "layers": 2, "tied": True, "load": str(out / SAVED),
                        "first": 2}
    PHASES["resume_weights_only"] = {**PHASES["resume"], "weights_only": True}
    for name in ("eval_1f1b", "eval_interleaved"):
        PHASES[name] = {"schedule": "1f1b" if name == "eval_1f1b" else "interleaved_1f1b",
                        "layers": 4, "windows": [], "eval": (HELD_OUT, EVAL_TOKENS)}
    phases = [{"windows": WINDOWS, **p} for p in PHASES.values()]
    results, codes, _ = spawn_ranks(pipeline_main, WORLD, out, {"phases": phases},
                                    deadline_s=280)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote nothing (exit code {codes[rank]})"
        assert "error" not in result, result.get("traceback", result.get("error"))
    return {name: [r["phases"][i] for r in results] for i, name in enumerate(PHASES)}


class RecordingLoop(MicrobatchLoop):
    """The one-process runner, keeping the window's gradients (before the clip)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def run(self, engine, *args, **kwargs):
        out = super().run(engine, *args, **kwargs)
        self.grads.append({n: p.grad.detach().clone()
                           for n, p in engine.model.named_parameters() if p.grad is not None})
        return out


def one_process(layers: int, tied: bool = False, fail_window: int = -1,
                dtype: torch.dtype = torch.float32):
    """Parameters after each window, the ledger and the gradients of the one-process run."""
    engine = one_process_engine(layers, tied, replace(UPDATE, fail_window=fail_window), dtype)
    engine.runner = RecordingLoop()
    params, ledger = [], []
    for w, batches in enumerate(WINDOWS):
        ledger.append(engine.run_window(list(batches), w).ledger_record())
        params.append({k: v.detach().clone() for k, v in engine.model.state_dict().items()})
    return params, ledger, engine.runner.grads


def worst_ratio(pipeline: dict[str, torch.Tensor], fp32: dict[str, torch.Tensor],
                f64: dict[str, torch.Tensor]) -> float:
    """max over the tensors of ``|pipeline - f64| / (2 |fp32 - f64| + floor)``: <= 1
    passes. ``pipeline`` may hold a part of the model (one stage's tensors)."""
    ratios = []
    for name, value in pipeline.items():
        ref = f64[name]
        bound = (2 * (fp32[name].double() - ref).abs().max()
                 + FLOOR_ULPS * FP32_UNIT * ref.abs().max())
        ratios.append(float((value.double() - ref).abs().max() / bound))
    return max(ratios)


def stages_ratio(ranks: list[dict], windows: list[int], layers: int, tied: bool = False,
                 fail_window: int = -1) -> float:
    fp32, _, _ = one_process(layers, tied, fail_window)
    f64, _, _ = one_process(layers, tied, fail_window, torch.float64)
    return max(worst_ratio(rank["params"][w], fp32[w], f64[w]) for rank in ranks for w in windows)


def test_stages_hold_the_one_process_names_between_them(job) -> None:
    """S7: each stage's tensors under the one-process names; together the whole model
    (a tied embedding on both end stages, as one name)."""
    fp32, _, _ = one_process(2)
    rank0, rank1 = (set(r["params"][0]) for r in job["1f1b"])
    assert rank0 | rank1 == set(fp32[0]) and not rank0 & rank1
    assert "embed.weight" in rank0 and {"head.weight", "final_norm.weight"} <= rank1
    tied0, tied1 = (set(r["params"][0]) for r in job["tied"])
    assert tied0 & tied1 == {"embed.weight"}


@pytest.mark.parametrize("name,layers", [("gpipe", 2), ("1f1b", 2), ("interleaved", 4)])
def test_each_schedule_equals_the_one_process_run(job, name: str, layers: int) -> None:
    """D1, U1: after one window and after three (the last one short), every stage's
    parameters equal the one-process run's within the derived tolerance; the ledgers
    (D, loss, grad norm) agree on every stage."""
    assert stages_ratio(job[name], [0], layers) <= 1.0
    assert stages_ratio(job[name], [2], layers) <= 1.0
    _, ledger, _ = one_process(layers)
    for rank in job[name]:
        assert [r["D"] for r in rank["ledger"]] == [r["D"] for r in ledger]
        assert [r["disposition"] for r in rank["ledger"]] == ["COMMITTED"] * 3
        for mine, theirs in zip(rank["ledger"], ledger, strict=True):
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=8 * FP32_UNIT)
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=8 * FP32_UNIT)


def test_tied_embeddings_across_the_end_stages(job) -> None:
    """The tied embedding lives on stage 0 and (as the head) on the last stage: the two
    copies stay bitwise equal and equal the one-process tied model within tolerance."""
    rank0, rank1 = job["tied"]
    for w in range(3):
        assert torch.equal(rank0["params"][w]["embed.weight"], rank1["params"][w]["embed.weight"])
    assert stages_ratio(job["tied"], [0, 2], 2, tied=True) <= 1.0


def test_the_schedule_divides_by_its_microbatch_count_unless_told_not_to(job) -> None:
    """What ``scale_grads`` does, measured: with the schedule's default (True) every
    gradient of the stage's module is the right one divided by n_microbatches = 2
    (exact in binary), and the head's, which the loss function uses outside the stage's
    module, is not divided at all; with ``scale_grads=False`` and the loss
    ``S_m / D_global`` the gradient is the one-process window gradient within the
    derived tolerance."""
    right, halved = job["record"], job["schedule_mean"]
    for r, h in zip(right, halved, strict=True):
        for name, grad in r["grads"][0].items():
            factor = 1 if name == "head.weight" else 2
            assert torch.equal(h["grads"][0][name] * factor, grad), name
    _, _, fp32 = one_process(2)
    _, _, f64 = one_process(2, dtype=torch.float64)
    assert max(worst_ratio(rank["grads"][0], fp32[0], f64[0]) for rank in right) <= 1.0
    # the same check catches the halved gradient
    assert max(worst_ratio(rank["grads"][0], fp32[0], f64[0]) for rank in halved) > 1.0


def test_negative_control_per_microbatch_mean_fails(job) -> None:
    """The schedule's own convention (mean per microbatch, then / n_microbatches) is
    not the window objective: the same check fails, after one window already."""
    assert stages_ratio(job["mean_per_microbatch"], [0], 2) > 1.0


def test_negative_control_stage_local_clip_norm_fails(job) -> None:
    """Clipping each stage by its own stage's norm (every window here is clipped: the
    norms exceed update.clip = 1) fails the same check."""
    _, ledger, _ = one_process(2)
    assert all(r["grad_norm"] > UPDATE.clip for r in ledger)
    assert stages_ratio(job["local_norm"], [0], 2) > 1.0


def test_nan_on_one_stage_skips_every_stage(job) -> None:
    """D2, U4: a NaN injected on stage 1 only in window 1: every stage skips it, its
    parameters bitwise those of window 0, its optimizer one step short; the run then
    equals the one-process run that skipped the same window."""
    for rank in job["nan"]:
        assert [r["disposition"] for r in rank["ledger"]] == [
            "COMMITTED", "SKIPPED_NONFINITE", "COMMITTED"]
        for name, value in rank["params"][0].items():
            assert torch.equal(rank["params"][1][name], value), name
        assert set(rank["optimizer_steps"]) == {2}
    # stage 0's own gradient is finite: the summed norm and the agreed flag told it
    assert job["nan"][0]["ledger"][1]["cause"] in ("NONFINITE_GRAD_NORM",
                                                   "NONFINITE_ON_ANOTHER_RANK")
    assert stages_ratio(job["nan"], [2], 2, fail_window=1) <= 1.0


def test_negative_control_stage_local_decision_lets_stages_diverge(job) -> None:
    """A stage that decides from its own gradients (its own norm, its own flag) commits
    the window the other skips: their ledgers and step counts disagree (two weight
    versions in one model)."""
    rank0, rank1 = job["nan_local"]
    assert rank0["ledger"][1]["disposition"] == "COMMITTED"
    assert rank1["ledger"][1]["disposition"] == "SKIPPED_NONFINITE"
    assert set(rank0["optimizer_steps"]) != set(rank1["optimizer_steps"])


def test_resume_at_pp2_from_a_stage_checkpoint_is_bitwise(job) -> None:
    """S7, S2: two windows, a DCP checkpoint of every stage (logical names, the tied
    embedding once), a fresh pipeline that loads it and runs window 2: bitwise the
    uninterrupted pipeline's parameters and optimizer state, on every stage."""
    for straight, resumed in zip(job["tied"], job["resume"], strict=True):
        assert resumed["ledger"] == straight["ledger"][2:]
        assert set(resumed["params"][0]) == set(straight["params"][2])
        for name, value in straight["params"][2].items():
            assert torch.equal(resumed["params"][0][name], value), name
        assert_same_optimizer(resumed["optimizer"], straight["optimizer"])
    # control: the same check on a resume that loads the weights alone must fail
    for straight, control in zip(job["tied"], job["resume_weights_only"], strict=True):
        assert any(not torch.equal(control["params"][0][name], value)
                   for name, value in straight["params"][2].items())


def assert_same_optimizer(a: dict, b: dict) -> None:
    assert set(a["state"]) == set(b["state"])
    for name, state in b["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(a["state"][name][key]),
                               torch.as_tensor(value)), (name, key)


def test_pp2_checkpoint_loads_into_one_process_by_names(job, out: Path) -> None:
    """S7: the stages' checkpoint loads into the one-process model by the one-process
    names (every tensor and optimizer moment bitwise the stage's), as a declared
    migration (a reshard record, never silent); the one-process run continued from it
    equals the pipeline's window 2 within the derived tolerance."""
    engine = one_process_engine(2, tied=True)
    state = load_distributed_checkpoint(out / SAVED, model=engine.model,
                                        optimizer=engine.optimizer,
                                        ctx=single_process(torch.device("cpu")), reshard=True)
    assert state.reshard is not None and state.reshard["old_world_size"] == WORLD
    loaded = engine.model.state_dict()
    optimizer = get_optimizer_state_dict(engine.model, engine.optimizer)
    for rank in job["save"]:
        for name, value in rank["params"][1].items():
            assert torch.equal(loaded[name], value), name
        mine = {"state": {k: v for k, v in optimizer["state"].items()
                          if k in rank["optimizer"]["state"]}}
        assert_same_optimizer(mine, rank["optimizer"])
    engine.schedule.load_state_dict(state.common["schedule"])
    engine.run_window(list(WINDOWS[2]), 2)
    fp32, _, _ = one_process(2, tied=True)
    f64, _, _ = one_process(2, tied=True, dtype=torch.float64)
    continued = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    assert worst_ratio(continued, fp32[2], f64[2]) <= 1.0


def test_held_out_evaluation_through_the_schedule(job) -> None:
    """E1, L5: the held-out gold NLL through the schedule (forward only), the same on
    every stage, counts the batches ``evaluate`` counts and equals its one-process sum
    within the derived tolerance."""
    model = one_process_engine(4, False).model
    fp32 = evaluate(model, HELD_OUT, device=torch.device("cpu"), max_tokens=EVAL_TOKENS,
                    pad_id=PAD_ID)
    f64 = evaluate(model.double(), HELD_OUT, device=torch.device("cpu"),
                   max_tokens=EVAL_TOKENS, pad_id=PAD_ID)
    assert fp32.tokens == 15
    bound = 2 * abs(fp32.gold_nll_sum - f64.gold_nll_sum) + FLOOR_ULPS * FP32_UNIT * abs(
        f64.gold_nll_sum)
    for name in ("eval_1f1b", "eval_interleaved"):
        (nll0, tokens0, _), (nll1, tokens1, _) = (r["eval"] for r in job[name])
        assert nll0 == nll1 and tokens0 == tokens1 == fp32.tokens
        assert abs(nll0 - f64.gold_nll_sum) <= bound


# ------------------------------------------------------------- the command line (S10, S7)

CLI_WINDOWS, CLI_EVERY = 6, 2
RUN_TIMEOUT_S = 150  # every command is bounded; a hang fails the test instead


class PipelineCli(CliRoot):
    """``exactstep train`` of a tiny two-layer decoder on ``--nproc`` processes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, KILL_ONCE_HOOK)

    def run(self, *command: str, kill_once: str = "", run_dir: Path | None = None,
            **changed: object) -> tuple[int, str]:
        env = worker_env(self.hook, drop_prefix="TORCHELASTIC_")
        if kill_once:
            env["EXACTSTEP_TEST_KILL_ONCE"] = f"{kill_once}:{run_dir}.killed"
        pairs = tiny_overrides(self.corpus, windows=CLI_WINDOWS, every=CLI_EVERY,
                               model={**TINY_MODEL, "model.n_layers": 2},
                               extra={k.replace("__", "."): v for k, v in changed.items()})
        proc = process_server.run([sys.executable, "-m", "exactstep", *command, *pairs],
                                  cwd=self.root, env=env, capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_S)
        return proc.returncode, proc.stderr

    def resume(self, run_dir: Path, point: str, *extra: str, **changed) -> tuple[int, str]:
        """``resume run_dir --from <point>`` with ``changed`` keys set."""
        pairs = [a for k, v in changed.items() for a in ("--set", f"{k.replace('__', '.')}={v}")]
        env = worker_env(self.hook, drop_prefix="TORCHELASTIC_")
        proc = process_server.run(
            [sys.executable, "-m", "exactstep", "resume", str(run_dir), "--no-progress",
             "--from", str(run_dir / "checkpoints" / point), *extra, *pairs],
            cwd=self.root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        return proc.returncode, proc.stderr

    def train(self, run_dir: Path, *extra: str, **kwargs) -> tuple[int, str]:
        return self.run("train", "--no-progress", "--out", str(run_dir), "--resume", "auto",
                        *extra, run_dir=run_dir, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pipeline_cli")
    cli = PipelineCli(root)
    out: dict = {"cli": cli, "root": root}
    out["straight"] = cli.train(root / "straight", "--nproc", "2", parallel__pp=2)
    # the first attempt: rank 1 killed as it starts window 3; then the same command again
    rc, err = cli.train(root / "killed", "--nproc", "2", kill_once="1:3", parallel__pp=2)
    out["killed_first"] = (rc, err, ledger_lines(root / "killed"))
    out["killed"] = cli.train(root / "killed", "--nproc", "2", kill_once="1:3", parallel__pp=2)
    # migrations of the straight run from its window-4 checkpoint: refused unasked, then
    # declared, to one process and to two data replicas
    for name in ("refused", "to_one", "to_dp2"):
        shutil.copytree(root / "straight", root / name)
    point = f"window-{CLI_WINDOWS - CLI_EVERY:08d}"
    out["refused_before"] = tree_digests(root / "refused")
    out["too_few"] = cli.run("train", "--no-progress", "--out", str(root / "too_few"),
                             "--nproc", "2", parallel__pp=2, update__accum=1)
    out["refused"] = cli.resume(root / "refused", point, parallel__pp=1)
    out["to_one"] = cli.resume(root / "to_one", point, "--reshard", parallel__pp=1)
    out["to_dp2"] = cli.resume(root / "to_dp2", point, "--reshard", "--nproc", "2",
                               parallel__pp=1)
    return out


def ledger_lines(run_dir: Path) -> list[str]:
    path = run_dir / "ledger.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def test_sigkill_and_resume_auto_at_pp2_is_bitwise(runs) -> None:
    """S10, S5, S7: ``train --resume auto`` at pp = 2, rank 1 SIGKILLed as it starts
    window 3; the same command again resumes at window 2 and ends with the straight
    run's stage parameters, optimizer, RNG, cursor and ledger, bitwise."""
    root = runs["root"]
    assert runs["straight"][0] == 0, runs["straight"][1][-3000:]
    first_rc, _, first_ledger = runs["killed_first"]
    assert first_rc != 0 and (root / "killed.killed").exists(), "rank 1 was never killed"
    assert len(first_ledger) == 3
    rc, err = runs["killed"]
    assert rc == 0, err[-3000:]
    assert [line for line in err.splitlines() if "resuming" in line] == [
        f"exactstep: resuming {root / 'killed'} at window 2 from window-00000002"]
    a, b = multi_rank_state(root / "straight"), multi_rank_state(root / "killed")
    assert a["name"] == b["name"] == f"window-{CLI_WINDOWS:08d}"
    assert "layers.1.attn.qkv.weight" in a["model"] and "embed.weight" in a["model"]
    assert state_differences(a, b) == []
    assert ledger_lines(root / "killed") == ledger_lines(root / "straight")


def ledger_events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in ledger_lines(run_dir) if '"event"' in line]


def test_pp2_to_one_process_or_two_replicas_is_a_declared_migration(runs) -> None:
    """S7: the pp = 2 run resumed with parallel.pp = 1 is refused in one line naming
    --reshard, its directory untouched (the control); with --reshard, on one process
    and on two data replicas, it loads by names, runs to the end, and its ledger's
    RESHARD line names both layouts: a declared, non-bitwise continuation."""
    root = runs["root"]
    rc, err = runs["refused"]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "--reshard" in errors[0] and "parallel.pp" in errors[0], errors
    assert tree_digests(root / "refused") == runs["refused_before"]
    for name, layout in (("to_one", {"pp": 1, "dp": 1, "cp": 1, "tp": 1}),
                         ("to_dp2", {"pp": 1, "dp": 2, "cp": 1, "tp": 1})):
        rc, err = runs[name]
        assert rc == 0, err[-3000:]
        (event,) = ledger_events(root / name)
        assert event["event"] == "RESHARD"
        assert event["old_layout"] == {"pp": 2, "dp": 1, "cp": 1, "tp": 1}
        assert event["new_layout"] == layout
        assert len(event["old_epochs"]) == 1  # one replica: its two stages' cursor once
        windows = [json.loads(line)["window"] for line in ledger_lines(root / name)
                   if '"window"' in line]
        assert windows == list(range(CLI_WINDOWS))


# ------------------------------------------------- pipelines and data replicas (pp x dp)

# [replica][window][microbatch] supervised tokens; replica 1 has an empty microbatch and
# both end with a short window
REPLICA_TOKENS = [[[5, 3], [4, 7], [6]], [[2, 6], [0, 9], [3]]]
REPLICA_WINDOWS = shards(REPLICA_TOKENS, rows=ROWS, seq_len=SEQ)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> dict[str, list[dict]]:
    """Four ranks: two pipelines of two stages (pp = 2, dp = 2), tied embeddings."""
    out = tmp_path_factory.mktemp("pipeline_replicas")
    phases = {"right": {}, "replica_local": {"runner": "replica_local"}}
    job = {"pp": 2, "phases": [{"schedule": "1f1b", "layers": 2, "tied": True, "windows": [],
                                "replica_windows": REPLICA_WINDOWS, **p}
                               for p in phases.values()]}
    results, codes, _ = spawn_ranks(pipeline_main, 4, out, job, deadline_s=280)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote nothing (exit code {codes[rank]})"
        assert "error" not in result, result.get("traceback", result.get("error"))
    return {name: [r["phases"][i] for r in results] for i, name in enumerate(phases)}


def replica_reference(dtype: torch.dtype):
    """The one-process run of the global windows: replica 0's microbatches, then 1's."""
    engine = one_process_engine(2, True, UPDATE, dtype)
    params, ledger = [], []
    for w in range(len(REPLICA_TOKENS[0])):
        batches = [b for replica in REPLICA_WINDOWS for b in replica[w]]
        ledger.append(engine.run_window(batches, w).ledger_record())
        params.append({k: v.detach().clone() for k, v in engine.model.state_dict().items()})
    return params, ledger


def test_two_pipelines_of_two_stages_equal_the_one_process_run(replicas) -> None:
    """D1, D5: pp = 2 x dp = 2, unequal replica shards: after one window and after
    three, every stage of both pipelines equals the one-process run over the global
    windows within the derived tolerance, D is the global count, and the two replicas
    of a stage are bitwise equal. Control: replicas that step on their own gradient
    fail the same check."""
    fp32, ledger = replica_reference(torch.float32)
    f64, _ = replica_reference(torch.float64)
    ranks = replicas["right"]
    assert sorted((r["coords"]["pp"], r["coords"]["dp"]) for r in ranks) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    for w in (0, 2):
        assert max(worst_ratio(r["params"][w], fp32[w], f64[w]) for r in ranks) <= 1.0
    for rank in ranks:
        assert [r["D"] for r in rank["ledger"]] == [r["D"] for r in ledger]
    by_stage: dict[int, list[dict]] = {}
    for rank in ranks:
        by_stage.setdefault(rank["coords"]["pp"], []).append(rank["params"][2])
    for a, b in by_stage.values():
        assert state_differences(a, b) == []
    wrong = replicas["replica_local"]
    assert max(worst_ratio(r["params"][0], fp32[0], f64[0]) for r in wrong) > 1.0


def test_fewer_microbatches_than_stages_is_one_line_naming_update_accum(runs) -> None:
    """X4: 1F1B needs at least as many microbatches as stages; update.accum = 1 at
    pp = 2 is refused in one line naming update.accum, before anything is written."""
    rc, err = runs["too_few"]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "update.accum" in errors[0] and "parallel.schedule = '1f1b'" in errors[0]
    # nothing written (the two ranks each hold, then drop, the new directory; which of
    # them removes it last is theirs to race, so it may remain, empty or with its lock)
    assert [p for p in (runs["root"] / "too_few").rglob("*")
            if p.is_file() and p.name != ".exactstep.lock"] == []
