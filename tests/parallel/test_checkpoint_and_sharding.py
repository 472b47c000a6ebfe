"""Multi-rank checkpoints (S7, S2, S3, S6) and the sharded sampler (D3)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from workers import build_engine, ckpt_main, spawn_ranks, stream_for, tiny_examples

from exactstep.errors import CheckpointError, DistributedError
from exactstep.parallel.dcp_format import (
    COMMON_FILE,
    load_distributed_checkpoint,
    rank_file,
    read_manifest,
    reshard_stream_state,
)
from exactstep.parallel.process_group import single_process
from exactstep.state import latest_checkpoint

NAME = "window-00000002"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    results, codes, _ = spawn_ranks(ckpt_main, 2, out, {}, deadline_s=100)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote nothing (exit code {codes[rank]})"
        assert "error" not in result, result.get("traceback")
    return out, results


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_resume_from_a_multi_rank_checkpoint_is_bitwise_exact(run) -> None:
    """S7 + S5: straight 4 windows == 2, checkpoint, load in fresh engines, 2 more
    (atol = 0): weights and optimizer via DCP, per-rank RNG and data cursor."""
    _, results = run
    for rank in results:
        straight, resumed = rank["straight"], rank["resumed"]
        assert torch.equal(straight["draw"], resumed["draw"])
        assert straight["ledger"] == resumed["ledger"]
        for key, value in straight["params"].items():
            assert torch.equal(value, resumed["params"][key]), key
    assert not torch.equal(results[0]["straight"]["draw"], results[1]["straight"]["draw"])


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_negative_control_weights_without_optimizer_state_differs(run) -> None:
    _, results = run
    straight, control = results[0]["straight"]["params"], results[0]["control"]["params"]
    assert any(not torch.equal(v, control[k]) for k, v in straight.items())


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_checkpoint_is_published_atomically_with_digests(run) -> None:
    """S3: LATEST names the directory; manifest written last lists every file."""
    out, _ = run
    path = latest_checkpoint(out / "checkpoints")
    assert path is not None and path.name == NAME
    manifest = read_manifest(path)
    assert manifest["world_size"] == 2
    assert {COMMON_FILE, rank_file(0), rank_file(1)} <= set(manifest["files"])
    assert any(name.startswith("dcp/") for name in manifest["files"])
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_other_world_size_is_refused_unless_resharded(run) -> None:
    """S7: 2 ranks -> 1 is a declared migration, not a silent load."""
    out, _ = run
    path = out / "checkpoints" / NAME
    engine = build_engine(seed=7)
    ctx = single_process(torch.device("cpu"))
    with pytest.raises(DistributedError, match="--reshard"):
        load_distributed_checkpoint(path, model=engine.model, optimizer=engine.optimizer, ctx=ctx)
    state = load_distributed_checkpoint(path, model=engine.model, optimizer=engine.optimizer,
                                        ctx=ctx, reshard=True)
    assert state.reshard is not None and state.reshard["old_world_size"] == 2
    assert state.rank_state["data"] is None and len(state.old_data) == 2
    stream = stream_for(0, 1)
    moved = reshard_stream_state(state.old_data, stream.state_dict())
    stream.load_state_dict(moved)
    assert stream.planner.epoch == state.reshard["resume_epoch"]
    assert next(iter(stream)).num_targets() > 0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_corrupted_rank_file_is_named(run, tmp_path) -> None:
    """S6: a flipped byte is found by digest and the file is named."""
    out, _ = run
    copy = tmp_path / NAME
    shutil.copytree(out / "checkpoints" / NAME, copy)
    data = bytearray((copy / COMMON_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / COMMON_FILE).write_bytes(bytes(data))
    engine = build_engine()
    ctx = single_process(torch.device("cpu"))
    with pytest.raises(CheckpointError, match=COMMON_FILE):
        load_distributed_checkpoint(copy, model=engine.model, optimizer=engine.optimizer,
                                    ctx=ctx, reshard=True)
    assert json.loads((copy / "manifest.json").read_text())["world_size"] == 2


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_sampler_partitions_each_epoch(world: int) -> None:
    """D3: in one epoch the ranks' shards are disjoint and cover every example once;
    the same (seed, epoch) gives the same shards. Negative control: sharding that
    ignores the rank (every rank reads the whole permutation) overlaps."""
    from exactstep.rows.packing import PackPlanner

    examples = tiny_examples(25)

    def epoch_ids(rank: int, world_: int) -> list[int]:
        planner = PackPlanner(examples, seq_len=64, buffer=4, overlong="split", seed=3,
                              shuffle=True, repeat=False, rank=rank, world=world_)
        return [int(i) for i in planner._shard]

    shards = [epoch_ids(r, world) for r in range(world)]
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == list(range(len(examples)))
    assert shards == [epoch_ids(r, world) for r in range(world)]
    wrong = [epoch_ids(0, 1) for _ in range(world)]
    assert len({i for s in wrong for i in s}) < sum(len(s) for s in wrong)


@pytest.mark.parametrize("world", [2])
def test_sharded_streams_emit_disjoint_documents(world: int) -> None:
    """D3 on the emitted rows: no document appears in two ranks' first-epoch batches."""
    from workers import PAD_ID, VOCAB

    from exactstep.rows.config import BatchConfig
    from exactstep.rows.stream import RowStream

    cfg = BatchConfig(seq_len=64, rows=2, buffer=4)
    seen = []
    for rank in range(world):
        stream = RowStream(tiny_examples(25), cfg, pad_id=PAD_ID, seed=3, repeat=False,
                           rank=rank, world=world, vocab_size=VOCAB)
        seen.append({seg.example_id for b in stream for row in b.segments for seg in row})
    assert set.intersection(*seen) == set()
    assert set.union(*seen) == set(range(25))
