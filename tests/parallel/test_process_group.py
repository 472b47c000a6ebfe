"""Process-group set-up without spawning (D1): launcher contract, backends, errors."""

from __future__ import annotations

import socket

import pytest
import torch

from exactstep.errors import DistributedError
from exactstep.parallel.agreement import agreed_window, empty_microbatch
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.process_group import (
    free_port,
    init_distributed,
    launcher_env,
    launcher_values,
    resolve_backend,
    shutdown,
)
from exactstep.parallel.reducer import DDPReducer, build_reducer
from exactstep.parallel.wrap import shard_model, wrap_train_module


def test_no_launcher_means_one_process() -> None:
    ctx = init_distributed(ParallelConfig(), "cpu", env={})
    assert (ctx.rank, ctx.world_size, ctx.distributed, ctx.is_main) == (0, 1, False, True)
    shutdown(ctx)  # a no-op, never raises


def test_world_of_one_under_torchrun_needs_no_group() -> None:
    ctx = init_distributed(ParallelConfig(), "cpu", env=launcher_env(0, 1, 1))
    assert not ctx.distributed and ctx.device == torch.device("cpu")


def test_launcher_values_are_validated() -> None:
    assert launcher_values({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == (1, 2, 1)
    with pytest.raises(DistributedError, match="outside a world"):
        launcher_values({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(DistributedError, match="integers"):
        launcher_values({"RANK": "x", "WORLD_SIZE": "2"})


def test_backend_choice_and_nccl_on_cpu_is_refused() -> None:
    assert resolve_backend(ParallelConfig(), "cpu") == "gloo"
    assert resolve_backend(ParallelConfig(), "cuda") == "nccl"
    with pytest.raises(DistributedError, match="nccl"):
        resolve_backend(ParallelConfig(backend="nccl"), "cpu")


def test_unreachable_rendezvous_fails_within_the_timeout() -> None:
    """Rank 1 of 2 whose rank 0 never comes: a clear error, not a hang (D1)."""
    port = free_port()
    env = launcher_env(1, 2, port)
    with pytest.raises(DistributedError, match="could not join"):
        init_distributed(ParallelConfig(timeout_s=2.0), "cpu", env=env)


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_single_process_helpers_are_identities() -> None:
    ctx = init_distributed(ParallelConfig(), "cpu", env={})
    module = torch.nn.Linear(2, 2)
    assert wrap_train_module(module, ctx, ParallelConfig()) is module
    assert type(build_reducer(ctx)).__name__ == "LocalReducer"
    with pytest.raises(DistributedError, match="process group"):
        DDPReducer(ctx)
    # one process holds every parameter: fsdp runs it unsharded, as ddp runs it unwrapped
    assert shard_model(module, ctx, ParallelConfig(strategy="fsdp")) is module


def test_fsdp_in_one_process_says_in_one_line_that_it_runs_unsharded(capsys) -> None:
    """D4: ``parallel.strategy = fsdp`` without a launcher shards nothing, and says so in
    one line on stderr; ``ddp`` in one process (unwrapped, as ever) prints nothing."""
    ctx = init_distributed(ParallelConfig(), "cpu", env={})
    module = torch.nn.Linear(2, 2)
    assert shard_model(module, ctx, ParallelConfig(strategy="ddp")) is module
    assert capsys.readouterr() == ("", "")  # the control: nothing for ddp
    assert shard_model(module, ctx, ParallelConfig(strategy="fsdp")) is module
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("exactstep: ")
    assert "parallel.strategy = fsdp" in err and "unsharded" in err


def test_zero1_and_zero2_in_one_process_say_in_one_line_that_nothing_is_sharded(capsys
                                                                               ) -> None:
    """D4: one process under ``zero2`` runs the model unsharded, under ``zero1`` keeps
    its optimizer whole (no ``ZeroRedundancyOptimizer``), each saying so in one line."""
    from workers import build_engine

    from exactstep.parallel.agreement import distribute_engine

    ctx = init_distributed(ParallelConfig(), "cpu", env={})
    module = torch.nn.Linear(2, 2)
    assert shard_model(module, ctx, ParallelConfig(strategy="zero2")) is module
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.strategy = zero2" in err and "unsharded" in err
    engine = build_engine()
    optimizer = engine.optimizer
    assert distribute_engine(engine, ctx, ParallelConfig(strategy="zero1")).optimizer is optimizer
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.strategy = zero1" in err
    assert "not sharded" in err


def test_zero1_and_zero2_over_pipeline_stages_are_refused_naming_the_strategy() -> None:
    """The pipeline's runner reduces each stage's gradients itself: zero1 / zero2 with
    parallel.pp > 1 are one DistributedError naming what to set. Control: the same
    strategies over data replicas, and ddp over stages, pass."""
    from exactstep.parallel.layout import Layout
    from exactstep.parallel.wrap import refuse_zero_layout

    for strategy in ("zero1", "zero2"):
        with pytest.raises(DistributedError) as info:
            refuse_zero_layout(strategy, Layout(pp=2, dp=1))
        message = str(info.value)
        assert "\n" not in message and f"'{strategy}'" in message
        assert "parallel.strategy = 'ddp'" in message
        refuse_zero_layout(strategy, Layout(dp=2))
    refuse_zero_layout("ddp", Layout(pp=2, dp=1))


def test_empty_microbatch_supervises_nothing_and_keeps_attention_finite() -> None:
    """Padding microbatches add 0 to D and a finite zero gradient (D1)."""
    from workers import MODEL, OBJECTIVE, PAD_ID, VOCAB

    from exactstep.model.decoder import build_model
    from exactstep.update.window import TrainModule

    batch = empty_microbatch(2, 8, PAD_ID)
    assert batch.num_targets() == 0
    module = TrainModule(build_model(MODEL, VOCAB, seed=0), OBJECTIVE, pad_id=PAD_ID)
    numerator, _ = module(batch, torch.zeros(2, 8))
    numerator.backward()
    grads = [p.grad for p in module.parameters()]
    assert all(g is not None and torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_agreed_window_without_reducer_is_plain_slicing() -> None:
    it = iter([empty_microbatch(1, 4, 0) for _ in range(3)])
    assert len(agreed_window(it, 2, None, rows=1, seq_len=4, pad_id=0)) == 2
    assert len(agreed_window(it, 2, None, rows=1, seq_len=4, pad_id=0)) == 1
    assert agreed_window(it, 2, None, rows=1, seq_len=4, pad_id=0) == []


def test_nproc_is_stripped_before_relaunch() -> None:
    from exactstep.parallel.launch import strip_nproc

    assert strip_nproc(["train", "--nproc", "2", "--out", "r"]) == (["train", "--out", "r"], 2)
    assert strip_nproc(["train", "--nproc=3"]) == (["train"], 3)
    assert strip_nproc(["train"]) == (["train"], None)
    with pytest.raises(DistributedError, match="positive"):
        strip_nproc(["train", "--nproc", "0"])


def test_only_collective_failures_become_distributed_errors() -> None:
    """A dead peer is one DistributedError; any other bug keeps its own exception."""
    from exactstep.parallel.launch import collective_guard
    from exactstep.parallel.process_group import DistContext

    ctx = DistContext(0, 2, 0, torch.device("cpu"), "gloo")
    with pytest.raises(DistributedError, match="collective failed"):
        with collective_guard(ctx):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    with pytest.raises(RuntimeError, match="shape mismatch"):  # negative control
        with collective_guard(ctx):
            raise RuntimeError("shape mismatch")


def test_failure_is_printed_by_rank_zero_and_recorded_by_every_rank(tmp_path, capsys) -> None:
    import json

    from exactstep.parallel.launch import report_failure
    from exactstep.parallel.process_group import DistContext

    for rank in (0, 1):
        ctx = DistContext(rank, 2, rank, torch.device("cpu"), "gloo")
        path = tmp_path / f"err{rank}.json"
        report_failure(DistributedError("boom"), ctx, env={"TORCHELASTIC_ERROR_FILE": str(path)})
        assert json.loads(path.read_text())["message"]["message"] == f"rank {rank}: boom"
    assert capsys.readouterr().err.count("error: boom") == 1


def test_a_message_with_line_breaks_is_printed_on_one_line(capsys) -> None:
    """X4: whatever a message holds (a path or value with a newline), one line."""
    from exactstep.errors import DataError
    from exactstep.parallel.launch import one_line, report_failure

    assert one_line("data file a\nb.jsonl does not exist\n") == "data file a | b.jsonl does not exist"
    assert one_line("plain") == "plain"
    report_failure(DataError("file a\r\nb missing"), None, env={})
    assert capsys.readouterr().err == "error: file a | b missing\n"


def write_error_file_for(log_dir, rank: int) -> None:
    """torchrun's layout: <log_dir>/<run>_<id>/attempt_0/<rank>/error.json."""
    from exactstep.parallel.launch import write_error_file

    folder = log_dir / "exactstep-1_abc" / "attempt_0" / str(rank)
    folder.mkdir(parents=True)
    write_error_file(str(folder / "error.json"), rank, RuntimeError("stopped"))


def test_after_a_signal_the_launcher_adds_a_line_only_when_rank_zero_did_not(
    tmp_path, capsys
) -> None:
    """X4: SIGTERM to the launcher: rank 0 already printed its line -> nothing more;
    no worker reported (it died before it could) -> one line of the launcher's own;
    130 either way."""
    import signal

    from exactstep.parallel.launch import rank_reported, report_signal

    argv = ["train", "--out", "runs/x"]
    assert report_signal(signal.SIGTERM, tmp_path, argv, 2) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: stopped by SIGTERM before the workers reported; continue from the last "
        "committed checkpoint, if any, with 'exactstep resume runs/x --nproc 2', or the same "
        "train command with --resume auto"]
    write_error_file_for(tmp_path, 1)  # rank 1's report alone is not rank 0's line
    assert not rank_reported(tmp_path, 0) and rank_reported(tmp_path, 1)
    write_error_file_for(tmp_path, 0)
    assert report_signal(signal.SIGTERM, tmp_path, argv, 2) == 130
    assert capsys.readouterr().err == ""


def test_launcher_log_lines_are_silenced_in_every_elastic_module() -> None:
    """Each torchrun module sets its own logger's level (so the parent's level alone
    does not silence "Received 15 death signal"); after the call none can warn."""
    import logging

    import torch.distributed.launcher.api  # noqa: F401  (creates the agent's loggers)

    from exactstep.parallel.launch import quiet_launcher_logs

    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent.setLevel(logging.WARNING)
    assert agent.isEnabledFor(logging.WARNING)  # negative control: it would print
    quiet_launcher_logs()
    assert not agent.isEnabledFor(logging.WARNING)
    assert not agent.isEnabledFor(logging.ERROR)


def agent_env(**changed: str) -> dict[str, str]:
    """What torchrun's agent sets for rank 1 of a 2-node x 1-process job with
    ``--max-restarts 1`` over its shared store (``changed`` replaces variables)."""
    env = {**launcher_env(1, 2, 1), "GROUP_WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1",
           "TORCHELASTIC_RESTART_COUNT": "0"}
    return {**env, **changed}


def test_a_multi_node_restart_over_the_agents_store_is_refused_naming_the_variable() -> None:
    """S10, X4: several nodes, --max-restarts > 0 and the agents' shared store: refused
    before the process group (and any window) in one line naming
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. Controls: one node (the prefixed store,
    test_resume_auto), no restarts, and the variable honoured (a store of the
    workers' own) are not refused; the variable set but ignored (static) says so."""
    from exactstep.parallel.process_group import SharedStoreRestarts, shared_store_restarts

    with pytest.raises(SharedStoreRestarts) as refused:
        init_distributed(ParallelConfig(timeout_s=2.0), "cpu", env=agent_env())
    text = str(refused.value)
    assert "\n" not in text and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text
    assert "--max-restarts 1 on 2 nodes" in text and "nothing was run" in text
    assert not refused.value.repeated  # rank 1 never prints: it asks no store
    for control in (agent_env(GROUP_WORLD_SIZE="1"), agent_env(TORCHELASTIC_MAX_RESTARTS="0"),
                    agent_env(TORCHELASTIC_USE_AGENT_STORE="False"), launcher_env(1, 2, 1)):
        assert shared_store_restarts(control) is None, control
    static = shared_store_restarts(agent_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    assert static is not None and "--rdzv-backend c10d" in static


def test_a_refusal_an_earlier_attempt_printed_is_recorded_but_not_printed_again(
        tmp_path, capsys) -> None:
    """X4: torchrun restarts a refused worker group like a failed one; rank 0 of each
    attempt counts the refusal in the agents' store, which outlives the attempts, and
    only the first prints it. Every attempt still records it for the launcher."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    from exactstep.parallel.launch import report_failure
    from exactstep.parallel.process_group import SharedStoreRestarts, refused_before

    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5))
    env = agent_env(RANK="0", LOCAL_RANK="0", MASTER_PORT=str(agent.port))
    printed = []
    for attempt in range(3):
        path = tmp_path / f"error-{attempt}.json"
        with pytest.raises(SharedStoreRestarts) as refused:
            init_distributed(ParallelConfig(timeout_s=5.0), "cpu",
                             env={**env, "TORCHELASTIC_RESTART_COUNT": str(attempt)})
        report_failure(refused.value, None, env={**env, "TORCHELASTIC_ERROR_FILE": str(path)})
        assert "TORCH_DISABLE_SHARE" in json.loads(path.read_text())["message"]["message"]
        printed.append(capsys.readouterr().err.count("error: torchrun --max-restarts"))
    assert printed == [1, 0, 0]
    # control: a store nobody serves cannot tell, so the line is printed (never lost)
    assert not refused_before("127.0.0.1", free_port(), timedelta(seconds=1))


def test_several_nodes_launch_with_a_fresh_store_per_round(monkeypatch) -> None:
    """S10: exactstep's own multi-node launcher sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    for its agent while it runs (each rendezvous round then forms over a fresh store)
    and removes it after; one node (control) and a value the user set are left alone."""
    import os

    from exactstep.parallel.launch import Nodes, fresh_store_per_round

    var = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    monkeypatch.delenv(var, raising=False)
    with fresh_store_per_round(Nodes(2, 0, "h:1")):
        assert os.environ[var] == "1"
    assert var not in os.environ
    with fresh_store_per_round(Nodes()):
        assert var not in os.environ
    monkeypatch.setenv(var, "0")
    with fresh_store_per_round(Nodes(2, 0, "h:1")):
        assert os.environ[var] == "0"
    assert os.environ[var] == "0"
