"""ZeRO-1 and ZeRO-2 over gloo: the one-process update, sharded state, exact resume (D1, D4, U3, S5, S7).

``parallel.strategy = "zero1"`` (DDP + ``ZeroRedundancyOptimizer``) and ``"zero2"``
(FSDP2 ``fully_shard(reshard_after_forward=False)``) on two spawned ranks must give
the update one process gives over the same global windows, after one window and
after three: ``|layout - f64| <= 2 |one-process fp32 - f64| + one fp32 ulp of the
largest value``, per parameter, where f64 is the same one-process run in float64.
Negative controls in the same job: a rank that clips by its own shard's norm
(zero1, zero2), ranks that step their shards but never broadcast them (zero1), shards
whose optimizer never receives the schedule's lr (zero1), fsdp's resharding after the
forward (against zero2's kept weights and its all-gather count). The memory claim is
measured from the state tensors each rank holds, against an expectation from the
parameters' shapes. Resume: in-process round trips bitwise, then ``torchrun
--max-restarts 1`` with a worker SIGKILLed, ``train --resume auto``.
"""

from __future__ import annotations

import pytest
import torch
from workers import MODEL, OBJECTIVE, PAD_ID, UPDATE, VOCAB, params_of, shards, spawn_ranks
from zero_workers import AFTER, zero_main

from exactstep.model.decoder import build_model
from exactstep.update.config import NumericsConfig
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

WORLD = 2
FP32_EPS = 2.0 ** -23  # one ulp of 1.0 in fp32
# token counts [rank][window][microbatch], K = 2; the clip (1.0) binds in every window
WINDOWS = [[[6, 2], [3, 3], [4, 0]], [[1, 7], [0, 2], [8, 8]]]
CHECKPOINT = [[[5, 3], [2, 6], [7, 1], [3, 3]], [[4, 4], [6, 0], [1, 7], [2, 2]]]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("zero")
    spec = {"windows": shards(WINDOWS), "checkpoint": shards(CHECKPOINT)}
    results, codes, _ = spawn_ranks(zero_main, WORLD, out, spec, deadline_s=300)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote nothing (exit code {codes[rank]})"
        assert "error" not in result, result.get("traceback", result.get("error"))
    return results


def one_process(dtype: torch.dtype) -> dict[int, dict[str, torch.Tensor]]:
    """The same global windows in one process (rank 0's microbatches, then rank 1's),
    in ``dtype``; the parameters after windows 1 and 3."""
    from exactstep.update.groups import build_optimizer

    model = build_model(MODEL, VOCAB, seed=0).to(dtype)
    optimizer, _ = build_optimizer(model, UPDATE)
    engine = UpdateEngine(model, optimizer, build_schedule(UPDATE, total_windows=100),
                          Precision(NumericsConfig(), "cpu"), UPDATE, OBJECTIVE,
                          device=torch.device("cpu"), pad_id=PAD_ID)
    per_rank = shards(WINDOWS)
    out = {}
    for w in range(len(WINDOWS[0])):
        engine.run_window(per_rank[0][w] + per_rank[1][w], w)
        if w in AFTER:
            out[w + 1] = params_of(engine)
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    return {"fp32": one_process(torch.float32), "f64": one_process(torch.float64)}


def beyond_tolerance(params: dict, references: dict, after: int) -> list[str]:
    """The parameters outside ``2 |fp32 - f64| + FP32_EPS max|f64|`` after ``after``
    windows (empty: the layout gives the one-process update)."""
    f64, fp32 = references["f64"][after], references["fp32"][after]
    out = []
    for name, exact in f64.items():
        bound = (2 * (fp32[name].double() - exact).abs().max().item()
                 + FP32_EPS * exact.abs().max().item())
        if (params[name].double() - exact).abs().max().item() > bound:
            out.append(name)
    return out


@pytest.mark.parametrize("layout", ["zero1", "zero2"])
@pytest.mark.parametrize("after", [1, 3])
def test_two_ranks_give_the_one_process_update(job, references, layout, after) -> None:
    """D1, D4, U3: on both ranks, after one window and after three, within the bound."""
    assert [r["optimizer"] for r in (job[0][layout], job[1][layout])] == (
        ["ShardedOptimizer"] * 2 if layout == "zero1" else ["AdamW"] * 2)
    for rank in job:
        assert beyond_tolerance(rank[layout]["params"][after], references, after) == []
        assert [r["disposition"] for r in rank[layout]["ledger"]] == ["COMMITTED"] * 3


@pytest.mark.parametrize("control", ["zero1_shard_norm", "zero1_ungathered",
                                     "zero2_local_norm"])
def test_negative_controls_fail_the_same_check(job, references, control) -> None:
    """A rank clipping by its own shard's norm (U3), or shards stepped but never
    broadcast, leave the bound after the first window already."""
    for after in (1, 3):
        assert beyond_tolerance(job[0][control]["params"][after], references, after) != []


def test_zero1_is_ddp_bit_for_bit(job) -> None:
    """ZeRO-1 steps each parameter once, on its owner, with DDP's averaged gradient,
    and broadcasts the result: every rank holds DDP's parameters exactly."""
    for rank in job:
        for after in (1, 3):
            ddp, zero1 = rank["ddp"]["params"][after], rank["zero1"]["params"][after]
            assert all(torch.equal(ddp[k], zero1[k]) for k in ddp)
        assert rank["zero1"]["ledger"] == rank["ddp"]["ledger"]


def test_zero1_steps_with_the_lr_the_schedule_sets(job) -> None:
    """U5, U6: under a warm-up the engine sets a new lr on the groups every window;
    zero1 stays DDP bit for bit. Control: a shard's optimizer that never receives the
    groups' lr steps with its first one and leaves DDP."""
    for rank in job:
        assert [r["lr"] for r in rank["ddp_warmup"]["ledger"]] != [UPDATE.lr] * 3
        assert len({r["lr"] for r in rank["ddp_warmup"]["ledger"]}) == 3
        for after in (1, 3):
            ddp = rank["ddp_warmup"]["params"][after]
            right, wrong = (rank[name]["params"][after]
                            for name in ("zero1_warmup", "zero1_unsynced_lr"))
            assert all(torch.equal(ddp[k], right[k]) for k in ddp)
            assert not all(torch.equal(ddp[k], wrong[k]) for k in ddp)


def test_groups_keep_their_decay_and_the_engines_lr(job) -> None:
    """U6: ZeRO-1's groups are the engine's (name, weight decay), lr set by the engine."""
    for rank in job:
        groups = rank["zero1"]["groups"]
        assert [(g["name"], g["weight_decay"]) for g in groups] == [
            ("decay", UPDATE.weight_decay), ("no_decay", 0.0)]
        assert [g["lr"] for g in groups] == [UPDATE.lr] * 2
        assert groups == rank["ddp"]["groups"]


def test_zero2_keeps_a_blocks_parameters_gathered_from_forward_to_backward(job) -> None:
    """D4: once a block's forward has ended, under zero2 its weight is the whole
    gathered tensor (kept for the backward); control: under fsdp (ZeRO-3) it is this
    rank's row shard again (gathered anew for the backward)."""
    whole = [3 * MODEL.d_model, MODEL.d_model]  # the qkv projection's weight
    for rank in job:
        assert rank["zero2"]["after_forward"] and rank["fsdp"]["after_forward"]
        assert all(shape == whole for shape in rank["zero2"]["after_forward"])
        assert all(shape == [whole[0] // WORLD, whole[1]]
                   for shape in rank["fsdp"]["after_forward"])


def test_zero2_gathers_each_block_once_per_microbatch_fsdp_twice(job) -> None:
    """D4: per microbatch the root unit is gathered once (it stays gathered for the
    backward under both) and each of the L blocks once under zero2, twice under fsdp
    (again for its backward): K (1 + L) against K (1 + 2 L) all-gathers a window."""
    layers = MODEL.n_layers
    for rank in job:
        for w, window in enumerate(WINDOWS[0]):
            k = len(window)
            assert rank["zero2"]["all_gathers"][w] == k * (1 + layers)
            assert rank["fsdp"]["all_gathers"][w] == k * (1 + 2 * layers)
        assert rank["ddp"]["all_gathers"] == [0] * len(WINDOWS[0])


def moment_bytes(shape: list[int]) -> int:
    return 4 * (1 if not shape else int(torch.Size(shape).numel()))


def state_bytes(layout: dict[str, dict[str, list[int]]]) -> int:
    return sum(moment_bytes(s) for keys in layout.values() for s in keys.values())


def about_one_rth(rank_bytes: int, ddp_bytes: int, slack: int) -> bool:
    """The memory claim: a rank holds at most 1/R of DDP's state plus ``slack``."""
    return rank_bytes <= ddp_bytes / WORLD + slack


def test_zero1_state_is_partitioned_across_ranks(job) -> None:
    """Each parameter's state lives on exactly one rank, whole: the ranks' state bytes
    sum to DDP's, and each holds at most 1/R of it plus the largest parameter's state
    (the greedy largest-first partition's bound). Control: DDP's own layout fails it."""
    ddp = job[0]["ddp"]["state"]
    ddp_bytes = state_bytes(ddp)
    assert ddp_bytes == job[0]["ddp"]["state_bytes"] == job[1]["ddp"]["state_bytes"]
    shards_ = [rank["zero1"]["state"] for rank in job]
    assert not set(shards_[0]) & set(shards_[1])
    assert {**shards_[0], **shards_[1]} == ddp
    largest = max(sum(moment_bytes(s) for s in keys.values()) for keys in ddp.values())
    measured = [rank["zero1"]["state_bytes"] for rank in job]
    assert measured == [state_bytes(s) for s in shards_] and sum(measured) == ddp_bytes
    assert all(about_one_rth(b, ddp_bytes, largest) for b in measured)
    assert not about_one_rth(job[0]["ddp"]["state_bytes"], ddp_bytes, largest)


def test_zero2_state_is_each_parameters_row_shard(job) -> None:
    """FSDP2 shards every state tensor on its first dimension as ``torch.chunk`` does:
    rank r holds chunk r of each moment (the step count, a scalar, on every rank), so a
    rank holds 1/R of DDP's moments exactly when every first dimension divides by R.
    Control: DDP's layout fails the 1/R claim."""
    ddp = job[0]["ddp"]["state"]
    steps = sum(moment_bytes(keys["step"]) for keys in ddp.values())
    for r, rank in enumerate(job):
        layout = rank["zero2"]["state"]
        assert set(layout) == set(ddp)
        for name, keys in ddp.items():
            for key, shape in keys.items():
                if not shape:  # the step count
                    assert layout[name][key] == shape
                    continue
                rows = torch.arange(shape[0]).chunk(WORLD)
                assert layout[name][key] == [len(rows[r]), *shape[1:]], (name, key)
        assert rank["zero2"]["state_bytes"] == state_bytes(layout)
        assert all(keys_[0] % WORLD == 0 for keys in ddp.values()
                   for keys_ in keys.values() if keys_)
        assert rank["zero2"]["state_bytes"] == (state_bytes(ddp) - steps) / WORLD + steps
        assert about_one_rth(rank["zero2"]["state_bytes"], state_bytes(ddp), steps)
    assert not about_one_rth(job[0]["ddp"]["state_bytes"], state_bytes(ddp), steps)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_checkpoint_round_trip_is_bitwise(job, strategy) -> None:
    """S5, S7: 2 windows, checkpoint, 2 windows == a fresh engine loading it and
    running the same 2: parameters, every rank's optimizer shard, the ledger.
    Control: the weights without the optimizer state end elsewhere."""
    for rank in job:
        trip = rank["round_trip"][strategy]
        straight, resumed = trip["straight"], trip["resumed"]
        assert all(torch.equal(straight["params"][k], resumed["params"][k])
                   for k in straight["params"])
        assert straight["state"].keys() == resumed["state"].keys()
        assert all(torch.equal(v, resumed["state"][n][k])
                   for n, keys in straight["state"].items() for k, v in keys.items())
        assert straight["ledger"] == resumed["ledger"]
        control = trip["control"]["params"]
        assert any(not torch.equal(straight["params"][k], control[k]) for k in control)


def test_zero1_checkpoint_holds_every_shard_once(job) -> None:
    """The zero1 checkpoint, loaded in one process (a declared 2 -> 1 reshard), gives
    one optimizer whose state is the two ranks' shards at the checkpoint, bit for bit."""
    from pathlib import Path

    from exactstep.parallel.dcp_format import load_distributed_checkpoint
    from exactstep.parallel.process_group import single_process
    from exactstep.update.groups import build_optimizer

    model = build_model(MODEL, VOCAB, seed=5)
    optimizer, _ = build_optimizer(model, UPDATE)
    path = Path(job[0]["round_trip"]["zero1"]["path"])
    load_distributed_checkpoint(path, model=model, optimizer=optimizer,
                                ctx=single_process(torch.device("cpu")), reshard=True,
                                strategy="zero1")
    names = {id(p): n for n, p in model.named_parameters()}
    loaded = {names[id(p)]: s for p, s in optimizer.state.items()}
    saved = {**job[0]["round_trip"]["zero1"]["saved_state"],
             **job[1]["round_trip"]["zero1"]["saved_state"]}
    assert loaded.keys() == saved.keys() == set(names.values())
    assert all(torch.equal(loaded[n][k], v) for n, keys in saved.items()
               for k, v in keys.items())


def test_another_strategy_is_refused_before_anything_loads(job) -> None:
    """S7: a zero1 checkpoint resumed under ddp, a ddp one under zero1, a zero2 one
    under zero1: one DistributedError naming both strategies, the model untouched."""
    for rank in job:
        for case in rank["refused"]:
            error = case["error"]
            assert error is not None, case
            assert f"parallel.strategy = '{case['saved']}'" in error
            assert f"parallel.strategy = '{case['strategy']}'" in error
            assert not case["moved"]


# ------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict:
    from test_resume_auto import TORCHRUN, Cli

    root = tmp_path_factory.mktemp("zero_cli")
    cli = Cli(root)
    out: dict = {"root": root, "cli": cli}
    for strategy in ("zero1", "zero2"):
        rc, err = cli.train(root / f"straight-{strategy}", "--nproc", "2",
                            parallel__strategy=strategy)
        assert rc == 0, err
        out[strategy] = cli.train(root / f"restarted-{strategy}", launcher=TORCHRUN,
                                  kill_once="1:3", parallel__strategy=strategy)
    return out


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_sigkill_and_resume_auto_end_bitwise_equal(cli_runs, strategy) -> None:
    """S10, S5, S7: rank 1 SIGKILLed in window 3 under torchrun; the restarted workers
    resume from window-00000002 and end with the straight run's model, optimizer
    shards, RNG, cursors and ledger. The manifest's parallel section names the
    strategy, and so does each checkpoint."""
    import json

    from run_support import multi_rank_state
    from test_resume_auto import WINDOWS, ledger_text, said

    from exactstep.state.compare import state_differences
    from exactstep.state.store import latest_checkpoint, read_checkpoint_manifest

    root = cli_runs["root"]
    rc, err = cli_runs[strategy]
    assert rc == 0, err[-3000:]
    run, straight = root / f"restarted-{strategy}", root / f"straight-{strategy}"
    assert (root / f"restarted-{strategy}.killed").exists(), "the worker was never killed"
    assert said(err, "resuming") == [f"exactstep: resuming {run} at window 2 from "
                                     "window-00000002"], err[-3000:]
    a, b = multi_rank_state(straight), multi_rank_state(run)
    assert a["name"] == b["name"] == f"window-{WINDOWS:08d}"
    assert state_differences(a, b) == []
    assert ledger_text(run) == ledger_text(straight)
    manifest = json.loads((run / "manifest.json").read_text())["manifest"]
    assert manifest["parallel"]["strategy"] == strategy
    checkpoint = read_checkpoint_manifest(latest_checkpoint(run / "checkpoints"))
    assert checkpoint["strategy"] == strategy


def test_resume_auto_under_another_strategy_is_refused(cli_runs) -> None:
    """S4, S10: the zero1 run's command again with parallel.strategy = ddp is refused
    in one line naming the field; the run directory is byte-identical afterwards."""
    from test_resume_auto import committed, error_lines

    run = cli_runs["root"] / "straight-zero1"
    before = committed(run)
    rc, err = cli_runs["cli"].train(run, "--nproc", "2", parallel__strategy="ddp")
    assert rc == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and "parallel.strategy" in lines[0] and "Traceback" not in err
    assert committed(run) == before
