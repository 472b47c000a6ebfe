"""FSDP2 with HF models, whole and with LoRA, on two gloo ranks (D4, D5, S5, S7, H4).

Engine level, a tiny HF Llama built from a config, whole and with LoRA adapters:
- D5: two ranks, sharded per decoder layer and at the root, give the one-process
  update over the same global windows (fp32, 1e-5 on every parameter); negative
  control: the reference with lr x 1.2 fails it. With LoRA the base stays bitwise as
  built and only the adapters move.
- S5, S7: a multi-rank checkpoint after window 1, loaded into fresh sharded engines,
  continues bitwise as the straight run; negative control: its weights alone (fresh
  optimizer) differ. ``--reshard``'s load, 2 ranks -> 1 unsharded process, gives
  the saved parameters bitwise and continues within 1e-5 of the 2-rank run.
- H4, S2: under LoRA the checkpoint's model part is the adapters only, the tensors
  a one-process checkpoint holds; without LoRA, every tensor. A checkpoint without
  the tensors a model needs is refused before loading (X4).

Through the command line, with LoRA (S7, X4, H4): ``train --nproc 2`` with rank 1
SIGKILLed in window 3 stops with one ``error:`` line and its window-2 checkpoint
published; ``resume --nproc 1 --reshard`` runs it on in one unsharded process,
records RESHARD, and its one-process checkpoint holds the tensors the multi-rank one
holds. (The bitwise kill-and-resume through the command line is
``test_cli_distributed.py``'s, the same runner path; here the resume is checked
bitwise at the engine level above, which costs one launch instead of three.)
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import process_server
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402
from cli_support import KILL_HOOK, tiny_overrides, worker_env, write_hook  # noqa: E402
from fsdp_hf_workers import (  # noqa: E402
    LLAMA,
    SAVED_AFTER,
    checkpoint_path,
    fsdp_hf_main,
    hf_engine,
    windows_from,
)
from text_corpus import write_corpus  # noqa: E402
from workers import UPDATE, load_common, shards, spawn_ranks  # noqa: E402

from exactstep.errors import CheckpointError, ModelError  # noqa: E402
from exactstep.parallel.dcp_format import load_distributed_checkpoint  # noqa: E402
from exactstep.parallel.process_group import single_process  # noqa: E402
from exactstep.state import latest_checkpoint  # noqa: E402
from exactstep.state.checkpointer import checkpoint_model_state  # noqa: E402
from exactstep.state.compare import state_differences  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              # a one-process load of a multi-rank checkpoint (the reshard), as intended
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

# token counts [rank][window][microbatch], unequal, never empty on a whole rank
COUNTS = [[[12, 3], [1, 0], [5, 16]], [[1, 0], [16, 9], [0, 2]]]
#: D5, fp32, absolute on every parameter: ranks reduce the same gradient terms in another
#: order, ~1e-7 on these O(1) tiny-model parameters, two orders below
TOLERANCE = 1e-5
LORA = (0, 4)  # model.lora.r: 0 = the whole model


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def global_windows() -> list[list]:
    per_rank = shards(COUNTS)
    return [per_rank[0][w] + per_rank[1][w] for w in range(len(COUNTS[0]))]


def params(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def one_process(lora_r: int, lr: float) -> tuple[dict, dict]:
    """Initial and final parameters of one process over the global windows."""
    engine = hf_engine(lora_r, lr)
    initial = params(engine)
    windows_from(engine, global_windows(), 0)
    return initial, params(engine)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("fsdp_hf_ranks")
    results, codes, _ = spawn_ranks(fsdp_hf_main, 2, out,
                                    {"windows": shards(COUNTS), "lora": list(LORA)},
                                    deadline_s=240)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote nothing (exit code {codes[rank]})"
        assert "error" not in result, result.get("traceback")
    return out, results


@pytest.mark.parametrize("lora_r", LORA)
def test_fsdp2_hf_model_equals_one_process(ranks, lora_r) -> None:
    _, results = ranks
    initial, reference = one_process(lora_r, UPDATE.lr)
    _, wrong_lr = one_process(lora_r, UPDATE.lr * 1.2)
    for rank in results:
        run = rank[lora_r]
        # every decoder layer is its own FSDP2 unit, and the root is one (D4)
        layers = [u for u in run["units"] if u.rsplit(".", 2)[-2:-1] == ["layers"]]
        assert len(layers) == LLAMA["num_hidden_layers"] and "" in run["units"], run["units"]
        assert set(run["params"]) == set(reference)
        assert max_diff(run["params"], reference) <= TOLERANCE
        assert max_diff(run["params"], wrong_lr) > TOLERANCE  # negative control
        assert all(r["disposition"] == "COMMITTED" for r in run["ledger"]), run["ledger"]
    final = results[0][lora_r]["params"]
    moved = {k for k in reference if not final[k].equal(initial[k])}
    if lora_r:  # H4: the base is bitwise as built; only adapters moved
        assert moved and all(".lora_" in k for k in moved), sorted(moved)[:4]
    else:
        assert any(".lora_" not in k for k in moved)


@pytest.mark.parametrize("lora_r", LORA)
def test_fsdp2_hf_resume_is_bitwise_and_reshards_to_one_process(ranks, lora_r) -> None:
    out, results = ranks
    for rank in results:
        run = rank[lora_r]
        assert state_differences(run["params"], run["resumed"]["params"]) == []
        assert run["resumed"]["ledger"] == run["ledger"]
        assert state_differences(run["params"], run["weights_only"]["params"])  # control
    # --reshard's load: 2 ranks -> 1 unsharded process, then the remaining windows
    engine = hf_engine(lora_r, UPDATE.lr)
    state = load_distributed_checkpoint(checkpoint_path(out, lora_r), model=engine.model,
                                        optimizer=engine.optimizer,
                                        ctx=single_process(torch.device("cpu")), reshard=True)
    assert state is not None and state.reshard["old_world_size"] == 2
    assert state_differences(results[0][lora_r]["saved"], params(engine)) == []
    load_common(engine, state.common)
    windows_from(engine, global_windows()[SAVED_AFTER:], SAVED_AFTER)
    assert max_diff(params(engine), results[0][lora_r]["params"]) <= TOLERANCE


@pytest.mark.parametrize("lora_r", LORA)
def test_fsdp2_checkpoint_holds_what_one_process_holds(ranks, lora_r) -> None:
    """H4, S2: the DCP model part (read from its metadata) names exactly the tensors
    the one-process path checkpoints (``checkpoint_model_state``)."""
    out, _ = ranks
    held = set(dcp_keys(checkpoint_path(out, lora_r)))
    engine = hf_engine(lora_r, UPDATE.lr)
    assert held == set(checkpoint_model_state(engine.model))
    if lora_r:
        assert held and all(".lora_" in k for k in held)
    else:  # the whole model, base tensors included
        assert held == set(engine.model.state_dict())


def test_a_checkpoint_without_the_tensors_a_model_needs_is_refused_before_loading(ranks) -> None:
    """X4, H4: weights of a run without LoRA into a LoRA model (a warm start) is one
    ``ModelError`` saying how to train adapters on them, as in one process; adapters
    alone into the whole model a ``CheckpointError``. Control: each loads into its own."""
    out, results = ranks
    cpu = single_process(torch.device("cpu"))
    for lora_r, other, error in ((4, 0, ModelError), (0, 4, CheckpointError)):
        model = hf_engine(lora_r, UPDATE.lr).model
        with pytest.raises(error, match="holds no LoRA adapters" if lora_r else "missing"):
            load_distributed_checkpoint(checkpoint_path(out, other), model=model,
                                        optimizer=None, ctx=cpu)
        load_distributed_checkpoint(checkpoint_path(out, lora_r), model=model, optimizer=None,
                                    ctx=cpu)
        assert state_differences(results[0][lora_r]["saved"], dict(model.state_dict())) == []


# ----------------------------------------------------------------- the command line

WINDOWS, EVERY = 4, 2
KILL_RANK, KILL_WINDOW = 1, 3
RUN_TIMEOUT_S = 150


def overrides(corpus: Path, lora_r: int) -> list[str]:
    return tiny_overrides(corpus, windows=WINDOWS, every=EVERY, model={
        "model.source": "hf", "model.hf_config": json.dumps({**LLAMA, "vocab_size": 259}),
        "model.lora.r": lora_r, "model.lora.dropout": 0.25, "parallel.strategy": "fsdp",
    })


def cli(root: Path, *args: str, kill_at: str = "") -> tuple[int, str]:
    env = worker_env(root / "hook")
    if kill_at:
        env["EXACTSTEP_TEST_KILL_AT"] = kill_at
    proc = process_server.run([sys.executable, "-m", "exactstep", *args, "--no-progress"],
                              cwd=root, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    return proc.returncode, proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp_hf_lora")
    write_hook(root, KILL_HOOK)
    corpus = root / "corpus.jsonl"
    write_corpus(corpus)
    out: dict = {"root": root, "killed": root / "killed", "reshard": root / "reshard"}
    start = time.monotonic()
    rc, err = cli(root, "train", "--nproc", "2", "--out", "killed", *overrides(corpus, 4),
                  kill_at=f"{KILL_RANK}:{KILL_WINDOW}")
    out["kill"] = {"rc": rc, "stderr": err, "seconds": time.monotonic() - start}
    out["latest_after_kill"] = latest_checkpoint(root / "killed" / "checkpoints")
    shutil.copytree(root / "killed", root / "reshard")
    rc, err = cli(root, "resume", "reshard", "--nproc", "1", "--reshard")
    assert rc == 0, err
    return out


def test_killed_fsdp_hf_lora_rank_stops_the_job_with_one_error_line(runs) -> None:
    """D1, X4 under FSDP2: one line naming the dead rank; the last checkpoint stays."""
    kill = runs["kill"]
    assert kill["rc"] != 0 and kill["seconds"] < RUN_TIMEOUT_S
    lines = [line for line in kill["stderr"].splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"rank {KILL_RANK} of 2 died" in lines[0], kill["stderr"]
    assert "Traceback" not in kill["stderr"]
    assert runs["latest_after_kill"].name == f"window-{KILL_WINDOW - KILL_WINDOW % EVERY:08d}"


def test_reshard_two_ranks_to_one_proceeds_and_is_recorded(runs) -> None:
    """S7: ``--reshard`` moves the 2-rank FSDP checkpoint to one process (unsharded);
    the ledger records the migration and the run reaches its last window."""
    records = [json.loads(x) for x in (runs["reshard"] / "ledger.jsonl").read_text().splitlines()]
    events = [r for r in records if r.get("event") == "RESHARD"]
    assert len(events) == 1 and events[0]["old_world_size"] == 2
    assert events[0]["new_world_size"] == 1
    assert records[-1].get("window") == WINDOWS - 1


def test_multi_rank_lora_checkpoint_holds_what_one_process_holds(runs) -> None:
    """H4, S2: the DCP model part of the 2-rank run holds exactly the tensors of the
    one-process checkpoint written after the reshard: the adapters only."""
    from exactstep.state import load_checkpoint

    checkpoint = runs["latest_after_kill"]
    dcp_model = set(dcp_keys(checkpoint))
    one_process = set(load_checkpoint(latest_checkpoint(runs["reshard"] / "checkpoints"))[0])
    assert dcp_model == one_process
    assert dcp_model and all(".lora_" in k for k in dcp_model)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert "adapters+optimizer" in manifest["parts"]


def dcp_keys(checkpoint: Path) -> list[str]:
    """The model tensors a multi-rank checkpoint holds, from its DCP metadata."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint / "dcp")).read_metadata()
    return [k.removeprefix("model.") for k in metadata.state_dict_metadata
            if k.startswith("model.")]
