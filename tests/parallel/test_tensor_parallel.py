"""Tensor + sequence parallel (0x0A: the sharded operator is the dense one; D4, D5, U3).

``parallel.tp = 2`` over spawned gloo ranks trains the built-in decoder (fused ``qkv``
and ``gate_up``, strided so each rank keeps whole heads) and a tiny Llama to the
one-process run, after one window and after three, within the derived tolerance
``|tp - f64| <= 2 |fp32 - f64| + 2 u |f64|`` per tensor (docs/design/parallel.md
#tolerance-of-a-layout). Negative controls, caught by the same check: a clip norm
that counts the replicated norm weights once per rank, and sequence-parallel norms
whose weight gradient is not summed over the other ranks' token rows. Whole heads:
each rank's share of the fused weights is its heads' q, k and v rows, the attention
kernel sees those heads, and the split model's hidden states and gradients are the
dense model's (negative control: a plain ``Shard(0)`` of the fused weights).
"""

from __future__ import annotations

import pytest
import torch
from equivalence import FP32_UNIT
from tensor_workers import BUILTIN, heads_main, reference_run, tp_main
from workers import OBJECTIVE, PAD_ID, VOCAB, make_batch, shards, spawn_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# token counts [dp rank][window][microbatch]: three windows, unequal microbatches
COUNTS = [[[12, 3], [9, 16], [5, 14]]]


def windows_of(counts) -> list[list]:
    """The one-process windows: every data replica's microbatches of each window."""
    per_rank = shards(counts)
    return [[b for rank in per_rank for b in rank[w]] for w in range(len(counts[0]))]


def excess(layout: dict, fp32: dict, f64: dict, window: int) -> tuple[float, str]:
    """The largest ``|layout - f64| - tolerance`` over the parameters after ``window``
    and the ledger's loss and gradient norm up to it (> 0: the layout fails)."""
    worst = (-float("inf"), "")
    for name, exact in f64["params"][window].items():
        gap = (layout["params"][window][name] - exact).abs().max().item()
        tol = tolerance(fp32["params"][window][name], exact)
        worst = max(worst, (gap - tol, name))
    for w in range(window + 1):
        for key in ("loss", "grad_norm"):
            exact = torch.tensor(f64["ledger"][w][key], dtype=torch.float64)
            got = torch.tensor(layout["ledger"][w][key], dtype=torch.float64)
            tol = tolerance(torch.tensor(fp32["ledger"][w][key], dtype=torch.float64), exact)
            worst = max(worst, ((got - exact).abs().item() - tol, f"{key}[{w}]"))
    return worst


def tolerance(fp32: torch.Tensor, exact: torch.Tensor) -> float:
    """Twice the one-process fp32 run's distance from float64, plus the rounding of the
    result itself (``u`` times its magnitude) on each side."""
    return (2 * (fp32.double() - exact).abs().max().item()
            + 2 * FP32_UNIT * exact.abs().max().item())


def spawn(tmp_path, job: dict, world: int) -> list[dict]:
    results, codes, _ = spawn_ranks(tp_main, world, tmp_path, job, deadline_s=280)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote nothing (exit code {codes[rank]})"
        assert "error" not in result, result.get("traceback")
    return results


@pytest.mark.parametrize("model", ["builtin", "llama"])
def test_tp2_trains_to_the_one_process_run(tmp_path, model) -> None:
    variants = ["right", "norms_twice", "unreduced_norms"]
    results = spawn(tmp_path, {"model": model, "tp": 2, "windows": shards(COUNTS),
                               "variants": variants}, world=2)
    windows = windows_of(COUNTS)
    fp32 = reference_run(model, windows, torch.float32)
    f64 = reference_run(model, windows, torch.float64)
    assert all(r["grad_norm"] > 2 * 0.5 for r in f64["ledger"])  # the clip acts every window
    for rank in results:
        for window in (0, 2):  # one window, three windows
            gap, where = excess(rank["right"], fp32, f64, window)
            assert gap <= 0, f"window {window}: {where} exceeds the tolerance by {gap:.3g}"
    # the ranks hold one model: every gathered parameter is the same bit for bit
    for name, value in results[0]["right"]["params"][2].items():
        assert torch.equal(value, results[1]["right"]["params"][2][name]), name
    # negative controls: caught after one window already
    for variant in variants[1:]:
        gap, where = excess(results[0][variant], fp32, f64, 0)
        assert gap > 0, f"{variant} passed the check"


def dense_side(batch, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """The one-process model's hidden states and numerator gradients in ``dtype``."""
    from exactstep.model.decoder import build_model
    from exactstep.update.window import TrainModule

    model = build_model(BUILTIN, VOCAB, seed=0).to(dtype)
    numerator, _ = TrainModule(model, OBJECTIVE, pad_id=PAD_ID)(
        batch, (batch.labels != -100).float())
    numerator.backward()
    return (model(batch).detach().double(),
            {n: p.grad.double() for n, p in model.named_parameters()})


# two data replicas, unequal microbatches, one of them empty on one replica
COUNTS_DP2 = [[[12, 3], [0, 16], [5, 14]], [[4, 9], [11, 7], [0, 2]]]


def test_dp2_tp2_fsdp_trains_to_the_one_process_run(tmp_path) -> None:
    """dp 2 x tp 2 (4 processes): FSDP2 on the mesh's dp dimension over the tensor
    shards (2-D DTensor parameters); the denominator is summed over the replicas only,
    the reported loss over the loss owners only (D1, D5, U3)."""
    results = spawn(tmp_path, {"model": "builtin", "tp": 2, "strategy": "fsdp",
                               "windows": shards(COUNTS_DP2),
                               "variants": ["right", "norms_twice"]}, world=4)
    windows = windows_of(COUNTS_DP2)
    fp32 = reference_run("builtin", windows, torch.float32)
    f64 = reference_run("builtin", windows, torch.float64)
    for rank in results:
        for window in (0, 2):
            gap, where = excess(rank["right"], fp32, f64, window)
            assert gap <= 0, f"window {window}: {where} exceeds the tolerance by {gap:.3g}"
    gap, where = excess(results[0]["norms_twice"], fp32, f64, 0)
    assert gap > 0, "norms counted per tensor shard passed the check"


def test_fused_weights_keep_whole_heads_on_each_rank(tmp_path) -> None:
    batch = make_batch(5, rows=2, seq_len=8, supervised=12)
    results = spawn_ranks(heads_main, 2, tmp_path, {"batch": batch}, deadline_s=120)[0]
    for result in results:
        assert result is not None and "error" not in result, result and result.get("traceback")
    from exactstep.model.decoder import build_model

    dense = build_model(BUILTIN, VOCAB, seed=0)
    d, f = BUILTIN.d_model, BUILTIN.d_ff
    qkv, gate_up = dense.layers[0].attn.qkv.weight, dense.layers[0].mlp.gate_up.weight
    hidden32, grads32 = dense_side(batch, torch.float32)
    hidden64, grads64 = dense_side(batch, torch.float64)
    head_dim = d // BUILTIN.n_heads
    for r, result in enumerate(results):
        right = result["right"]
        # rank r holds heads 2r, 2r+1 of q, of k and of v, in that order (whole heads)
        rows = [slice(part * d + r * d // 2, part * d + (r + 1) * d // 2) for part in range(3)]
        assert torch.equal(right["qkv"], torch.cat([qkv[s] for s in rows]))
        rows = [slice(part * f + r * f // 2, part * f + (r + 1) * f // 2) for part in range(2)]
        assert torch.equal(right["gate_up"], torch.cat([gate_up[s] for s in rows]))
        # the attention kernel saw this rank's two heads of the whole rows
        assert set(right["kernel_shapes"]) == {(2, 8, 3, BUILTIN.n_heads // 2, head_dim)}
        assert (right["hidden"] - hidden64).abs().max() <= tolerance(hidden32, hidden64)
        for name, exact in grads64.items():
            gap = (right["grads"][name] - exact).abs().max()
            assert gap <= tolerance(grads32[name], exact), name
        # negative control: plain Shard(0) of the fused weights mixes q, k and v rows
        plain = result["plain"]
        assert (plain["hidden"] - hidden64).abs().max() > tolerance(hidden32, hidden64)


def test_tp2_checkpoint_resumes_bitwise_and_loads_at_tp1_only_declared(tmp_path) -> None:
    """S7 at tp = 2: a checkpoint written by the split model resumes it bit for bit;
    one process (tp = 1) reads the same checkpoint by its logical names only as a
    declared migration (``reshard``), and continues within the layout's tolerance."""
    from tensor_workers import MODELS, build_engine
    from workers import load_common

    from exactstep.errors import DistributedError
    from exactstep.model.decoder import build_model
    from exactstep.parallel.dcp_format import load_distributed_checkpoint
    from exactstep.parallel.process_group import single_process

    root = tmp_path / "checkpoints"
    job = {"model": "builtin", "tp": 2, "windows": shards(COUNTS), "variants": ["checkpoint"],
           "root": str(root)}
    results = spawn(tmp_path, job, world=2)
    for rank in results:
        straight, resumed = rank["checkpoint"]["straight"], rank["checkpoint"]["resumed"]
        assert straight["ledger"] == resumed["ledger"]
        for name, value in straight["params"].items():
            assert torch.equal(value, resumed["params"][name]), name
        # negative control: without the optimizer's momentum the same check fails
        control = rank["checkpoint"]["control"]["params"]
        assert any(not torch.equal(v, control[k]) for k, v in straight["params"].items())
    # tp = 1: the same checkpoint, refused unless declared
    engine = build_engine(build_model(MODELS["builtin"], VOCAB, seed=7))
    ctx = single_process(torch.device("cpu"))
    path = root / "window-00000002"
    with pytest.raises(DistributedError, match="--reshard"):
        load_distributed_checkpoint(path, model=engine.model, optimizer=engine.optimizer,
                                    ctx=ctx)
    state = load_distributed_checkpoint(path, model=engine.model, optimizer=engine.optimizer,
                                        ctx=ctx, reshard=True)
    assert state.reshard["old_world_size"] == 2 and state.reshard["new_world_size"] == 1
    load_common(engine, state.common)
    record = engine.run_window(windows_of(COUNTS)[2], 2).ledger_record()
    params = {k: v.detach().double() for k, v in engine.model.state_dict().items()}
    windows = windows_of(COUNTS)
    fp32 = reference_run("builtin", windows, torch.float32)
    f64 = reference_run("builtin", windows, torch.float64)
    migrated = {"params": [None, None, params],
                "ledger": results[0]["checkpoint"]["straight"]["ledger"][:2] + [record]}
    gap, where = excess(migrated, fp32, f64, 2)
    assert gap <= 0, f"{where} exceeds the tolerance by {gap:.3g}"


# ------------------------------------------------------------------ the command line


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory) -> dict:
    """``train --set parallel.tp=2`` over 2 processes: straight; under ``torchrun
    --max-restarts 1`` with rank 1 SIGKILLed in window 3 (``--resume auto``); killed
    in window 3 and resumed in one process at ``tp = 1`` (without, then with
    ``--reshard``); with LoRA (refused)."""
    import sys

    import process_server
    from test_resume_auto import TORCHRUN, Cli, committed

    root = tmp_path_factory.mktemp("tensor_cli")
    cli = Cli(root)
    out: dict = {"root": root}
    out["straight"] = cli.train(root / "straight", "--nproc", "2", parallel__tp=2)
    out["restarted"] = cli.train(root / "restarted", launcher=TORCHRUN, kill_once="1:3",
                                 parallel__tp=2)
    migrated = root / "migrated"
    out["migrated_first"] = cli.train(migrated, "--nproc", "2", kill_once="0:3",
                                      parallel__tp=2)

    def resume(*extra: str) -> tuple[int, str]:
        command = [sys.executable, "-m", "exactstep", "resume", str(migrated), "--no-progress",
                   "--set", "parallel.tp=1", *extra]
        proc = process_server.run(command, cwd=root, env=cli.env(), capture_output=True,
                                  text=True, timeout=150)
        return proc.returncode, proc.stderr

    before = committed(migrated)  # the killed attempt's lock file aside
    out["undeclared"] = resume()
    out["undeclared_unchanged"] = committed(migrated) == before
    out["declared"] = resume("--reshard")
    out["lora"] = cli.train(root / "lora", "--nproc", "2", parallel__tp=2, model__lora__r=4)
    return out


def test_cli_tp2_restart_after_a_killed_worker_ends_bitwise_equal(cli_runs) -> None:
    """S10, S5, S7 at tp = 2: the restarted workers resume from window-00000002 and end
    with the straight run's model, optimizer, per-rank RNG and cursor, and ledger."""
    from run_support import multi_rank_state
    from test_resume_auto import ledger_text, said

    from exactstep.state.compare import state_differences

    root = cli_runs["root"]
    assert cli_runs["straight"][0] == 0, cli_runs["straight"][1][-3000:]
    rc, err = cli_runs["restarted"]
    assert rc == 0, err[-3000:]
    assert (root / "restarted.killed").exists(), "the worker was never killed"
    assert said(err, "resuming") == [f"exactstep: resuming {root / 'restarted'} at window 2 "
                                     "from window-00000002"], err[-3000:]
    a, b = multi_rank_state(root / "straight"), multi_rank_state(root / "restarted")
    assert a["name"] == b["name"] == "window-00000006"
    assert state_differences(a, b) == []
    assert ledger_text(root / "restarted") == ledger_text(root / "straight")


def test_cli_tp2_checkpoint_continues_at_tp1_only_declared(cli_runs) -> None:
    """S7: a tp = 2 run resumed by one process at tp = 1 is refused in one line naming
    the layout and ``--reshard``, the run directory unchanged; with ``--reshard`` it
    continues (a RESHARD line in the ledger) to the last window."""
    import json

    from test_resume_auto import error_lines

    root = cli_runs["root"]
    assert cli_runs["migrated_first"][0] != 0
    rc, err = cli_runs["undeclared"]
    lines = error_lines(err)
    assert rc != 0 and len(lines) == 1, err
    assert "parallel.tp" in lines[0] and "--reshard" in lines[0]
    assert cli_runs["undeclared_unchanged"]
    rc, err = cli_runs["declared"]
    assert rc == 0, err[-3000:]
    records = [json.loads(line) for line in (root / "migrated" / "ledger.jsonl")
               .read_text().splitlines()]
    events = [r for r in records if r.get("event") == "RESHARD"]
    assert len(events) == 1 and events[0]["new_world_size"] == 1
    assert len(events[0]["old_epochs"]) == 1  # one replica: its two shards' cursor once
    assert [r["window"] for r in records if "window" in r] == list(range(6))


def test_cli_tp_with_lora_is_refused_before_anything_is_written(cli_runs) -> None:
    from test_resume_auto import error_lines

    rc, err = cli_runs["lora"]
    lines = error_lines(err)
    assert rc != 0 and len(lines) == 1, err
    assert "parallel.tp = 2" in lines[0] and "model.lora.r" in lines[0]
    assert not (cli_runs["root"] / "lora" / "manifest.json").exists()


@pytest.mark.parametrize("family", ["policy", "professor", "scheduled_sampling"])
def test_tp_refuses_the_rollout_families_in_one_line(family) -> None:
    from exactstep.errors import ConfigError
    from exactstep.parallel.tensor import refuse_tensor_parallel

    with pytest.raises(ConfigError) as info:
        refuse_tensor_parallel(2, family=family, lora=False, compiled=False,
                               strategy="ddp", dp=1)
    assert "\n" not in str(info.value) and family in str(info.value)
    assert "parallel.tp = 1" in str(info.value)
    # control: the same layout with a family that does not generate is not refused
    refuse_tensor_parallel(2, family="causal", lora=False, compiled=False, strategy="ddp",
                           dp=1)


def test_tp_with_ddp_replicas_is_refused_naming_the_strategy() -> None:
    from exactstep.errors import ConfigError
    from exactstep.parallel.tensor import refuse_tensor_parallel

    for strategy in ("ddp", "zero1", "zero2"):  # DDP replicas; zero2's not proven
        with pytest.raises(ConfigError, match="parallel.strategy = 'fsdp'"):
            refuse_tensor_parallel(2, family="causal", lora=False, compiled=False,
                                   strategy=strategy, dp=2)
        # one replica: nothing is replicated or sharded over replicas
        refuse_tensor_parallel(2, family="causal", lora=False, compiled=False,
                               strategy=strategy, dp=1)
    refuse_tensor_parallel(2, family="causal", lora=False, compiled=False, strategy="fsdp",
                           dp=2)


@pytest.mark.parametrize(("changes", "named"), [({"n_heads": 4}, None),
                                                ({"n_heads": 3, "d_model": 18}, "model.n_heads"),
                                                ({"d_ff": 33}, "model.d_ff")])
def test_tp_must_divide_the_heads_and_the_mlp_width(changes, named) -> None:
    """A rank holds whole heads and whole MLP columns: a tp that does not divide them is
    one ``ConfigError`` naming the size (control: 4 heads, d_ff 32 at tp = 2 pass)."""
    from dataclasses import replace

    from exactstep.errors import ConfigError
    from exactstep.model.decoder import build_model
    from exactstep.parallel.tensor import check_divisible

    model = build_model(replace(BUILTIN, **changes), VOCAB, seed=0)
    if named is None:
        check_divisible(model, 2)
        return
    with pytest.raises(ConfigError, match=named) as info:
        check_divisible(model, 2)
    assert "\n" not in str(info.value)
