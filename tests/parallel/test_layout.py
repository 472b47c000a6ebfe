"""The parallel layout: coordinates, groups, and the sums the window takes from them (D1-D3).

The expectation is an independent enumeration of the grid (``itertools.product`` over
``pp, dp, cp, tp`` in that order, the last fastest), not the layout's own arithmetic.
The negative control is the grid in another order (tp outermost): its groups must differ
from what the layout built, so the checks can tell the orders apart.
"""

from __future__ import annotations

import itertools

import pytest
from workers import layout_main, spawn_ranks

from exactstep.errors import DistributedError
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.layout import DIMS, Layout, check_built, layout_sizes
from exactstep.state.manifest import parallel_record


def grid(sizes: dict[str, int], order=DIMS) -> dict[int, dict[str, int]]:
    """rank -> coordinates, enumerating ``order`` with its last axis fastest."""
    points = itertools.product(*(range(sizes[d]) for d in order))
    return {rank: dict(zip(order, point, strict=True)) for rank, point in enumerate(points)}


def expected_members(sizes: dict[str, int], rank: int, dim: str, order=DIMS) -> list[int]:
    coords = grid(sizes, order)
    mine = coords[rank]
    return sorted(r for r, c in coords.items()
                  if all(c[d] == mine[d] for d in DIMS if d != dim))


@pytest.mark.parametrize("sizes", [
    {"pp": 2, "dp": 3, "cp": 1, "tp": 2},
    {"pp": 1, "dp": 2, "cp": 2, "tp": 3},
    {"pp": 3, "dp": 1, "cp": 1, "tp": 1},
])
def test_coordinates_follow_the_grid_tp_innermost(sizes) -> None:
    world = sizes["pp"] * sizes["dp"] * sizes["cp"] * sizes["tp"]
    expected = grid(sizes)
    for rank in range(world):
        layout = Layout(**sizes, rank=rank)
        assert layout.coords() == expected[rank]
        assert (layout.dp_rank, layout.tp_rank, layout.pp_rank, layout.cp_rank) == tuple(
            expected[rank][d] for d in ("dp", "tp", "pp", "cp"))
        assert layout.loss_owner == (expected[rank]["tp"] == 0 and expected[rank]["cp"] == 0
                                     and expected[rank]["pp"] == sizes["pp"] - 1)
    assert sum(Layout(**sizes, rank=r).loss_owner for r in range(world)) == sizes["dp"]


def test_data_parallel_size_is_what_the_model_axes_leave() -> None:
    assert layout_sizes(8, tp=2, pp=2) == {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    assert layout_sizes(6, tp=3) == {"pp": 1, "dp": 2, "cp": 1, "tp": 3}
    with pytest.raises(DistributedError, match="6 processes cannot be split into parallel.tp = 4"):
        layout_sizes(6, tp=4)
    with pytest.raises(DistributedError, match="1 process cannot be split"):
        layout_sizes(1, pp=2)


def test_an_axis_this_build_cannot_run_is_refused_by_name() -> None:
    check_built({"pp": 1, "dp": 4, "cp": 1, "tp": 1})
    for dim in ("tp", "pp", "cp"):
        from exactstep.parallel import layout as layout_module

        if dim in layout_module.BUILT_AXES:
            continue
        with pytest.raises(DistributedError, match=f"parallel.{dim} = 2"):
            check_built({"pp": 1, "dp": 1, "cp": 1, "tp": 1, dim: 2})


def test_a_pure_data_parallel_manifest_records_what_it_did_before_the_axes() -> None:
    """S4: a DDP/FSDP run's ``parallel`` section is unchanged, so its runs resume; a split
    replica records every axis (the control: the same record with tp = 2)."""
    config = {**ParallelConfig().__dict__}
    before = {k: config[k] for k in ("strategy", "backend", "timeout_s", "bucket_mb")}
    assert parallel_record(config, Layout(dp=4).section()) == before
    split = parallel_record({**config, "tp": 2}, Layout(dp=2, tp=2).section())
    assert split == {**before, "tp": 2, "pp": 1, "cp": 1}
    piped = parallel_record({**config, "pp": 2}, Layout(pp=2).section())
    assert piped["schedule"] == "1f1b"


def test_unknown_axis_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown parallel axis 'ep'"):
        Layout().group("ep")


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [{"pp": 1, "dp": 2, "cp": 1, "tp": 2},
                                   {"pp": 2, "dp": 1, "cp": 1, "tp": 2}])
def test_four_ranks_form_the_groups_of_the_grid(tmp_path, sizes) -> None:
    results, codes, _ = spawn_ranks(layout_main, 4, tmp_path, {"sizes": sizes}, deadline_s=120)
    assert codes == [0, 0, 0, 0], [r.get("traceback") if r else None for r in results]
    other_order = ("tp", "pp", "dp", "cp")
    told_apart = False
    for rank, result in enumerate(results):
        assert "error" not in result, result.get("traceback")
        assert result["coords"] == grid(sizes)[rank]
        for dim in DIMS:
            assert sorted(result["members"][dim]) == expected_members(sizes, rank, dim)
            told_apart |= (expected_members(sizes, rank, dim, other_order)
                           != expected_members(sizes, rank, dim))
        replicas = expected_members(sizes, rank, "dp")
        assert result["sum"] == sum(r + 1 for r in replicas)  # D over the replicas only
        assert result["agree"] == sum(range(1, 5))  # the finite flag over every rank (D2)
        assert result["replicas"] == sizes["dp"]
        assert result["gathered"] == replicas
        assert result["loss_owner"] == (grid(sizes)[rank]["tp"] == 0
                                        and grid(sizes)[rank]["pp"] == sizes["pp"] - 1)
    assert told_apart  # control: another grid order would have given other groups
