"""The parallel layout: which replica, stage, sequence shard and tensor shard a rank is (D1, D3).

One ``Layout`` names every axis of the job: ``pp`` (pipeline stages), ``dp`` (data
replicas: the data shard's identity, D3), ``cp`` (sequence shards), ``tp`` (tensor
shards), in that order with ``tp`` innermost, so the ranks of one tensor-parallel group
are neighbours. Data sharding, the global denominator (summed over ``dp``), the finite
agreement (over every rank, D2) and the reported loss (from the loss owners only)
take their groups from it, never from the flat world size.
Design and derivations: docs/design/parallel.md#parallellayoutpy (D1, D2, D3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from exactstep.errors import DistributedError

DIMS = ("pp", "dp", "cp", "tp")  # mesh order: the last varies fastest over ranks


@dataclass(frozen=True)
class Layout:
    """The sizes of the job's axes and this process's place on them.

    ``rank`` is the global rank; ``mesh`` a ``DeviceMesh`` over the axes of size > 1
    (``dp`` always), None for one process. ``groups`` / ``host_groups`` map an axis
    of size > 1 to this rank's process group on it (the mesh's, and a ``gloo`` one
    for host values; the same groups when the backend is gloo).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    rank: int = 0
    mesh: Any = field(default=None, compare=False, repr=False)
    groups: dict = field(default_factory=dict, compare=False, repr=False)
    host_groups: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def coords(self) -> dict[str, int]:
        """This rank's index on every axis (``rank = ((pp*dp + dp)*cp + cp)*tp + tp``)."""
        out, rest = {}, self.rank
        for dim in reversed(DIMS):
            size = getattr(self, dim)
            out[dim], rest = rest % size, rest // size
        return {dim: out[dim] for dim in DIMS}

    @property
    def dp_rank(self) -> int:
        return self.coords()["dp"]

    @property
    def tp_rank(self) -> int:
        return self.coords()["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords()["pp"]

    @property
    def cp_rank(self) -> int:
        return self.coords()["cp"]

    @property
    def only_data(self) -> bool:
        """Every rank a whole replica (DDP / FSDP over the world): no tp, pp or cp."""
        return self.tp == self.pp == self.cp == 1

    @property
    def loss_owner(self) -> bool:
        """Whether this rank's numerator and NLL count in the reported sums: the first
        tensor and sequence shard of the last stage (the other shards of a replica hold
        the same values, or none)."""
        c = self.coords()
        return c["tp"] == 0 and c["cp"] == 0 and c["pp"] == self.pp - 1

    def group(self, dim: str):
        """This rank's process group on axis ``dim``; None when the axis has one rank."""
        check_dim(dim)
        return self.groups.get(dim)

    def host_group(self, dim: str):
        """This rank's ``gloo`` group on axis ``dim`` (host values); None for one rank."""
        check_dim(dim)
        return self.host_groups.get(dim)

    def submesh(self, *dims: str):
        """The mesh over ``dims`` (those of size > 1 among them, and ``dp``), or None
        when none of them has more than one rank."""
        for dim in dims:
            check_dim(dim)
        if self.mesh is None:
            return None
        names = self.mesh.mesh_dim_names
        kept = tuple(d for d in dims if d in names)
        if not kept:
            return None
        return self.mesh if kept == tuple(names) else self.mesh[kept]

    def section(self) -> dict[str, Any]:
        """The layout as the manifest records it (its ``parallel`` section)."""
        return {**self.sizes(), "world_size": self.world, "mesh_order": list(DIMS)}


def check_dim(dim: str) -> None:
    if dim not in DIMS:
        raise ValueError(f"unknown parallel axis {dim!r}; the axes are {', '.join(DIMS)}")


def layout_sizes(world: int, *, tp: int = 1, pp: int = 1, cp: int = 1) -> dict[str, int]:
    """The axes' sizes for ``world`` ranks: ``dp = world / (tp * pp * cp)``. Raises
    ``DistributedError`` when the model axes do not divide the world."""
    model = tp * pp * cp
    if world % model:
        raise DistributedError(
            f"{world} process{'es' if world != 1 else ''} cannot be split into parallel.tp = {tp} x parallel.pp = {pp} "
            f"x parallel.cp = {cp} ({model} ranks a replica); launch a multiple of {model} "
            "processes or change the axes")
    return {"pp": pp, "dp": world // model, "cp": cp, "tp": tp}


# The axes this build splits a replica along; a layout naming another is refused
# before the process joins the job (``check_built``).
BUILT_AXES = frozenset({"dp", "pp", "tp"})


def check_built(sizes: dict[str, int]) -> None:
    """Refuse an axis of size > 1 that this build cannot run, naming it."""
    for dim in DIMS:
        if sizes.get(dim, 1) > 1 and dim not in BUILT_AXES:
            raise DistributedError(
                f"parallel.{dim} = {sizes[dim]}: this build does not split a replica along "
                f"{dim}; set parallel.{dim} = 1 (and use more data-parallel ranks)")


def single_layout() -> Layout:
    """The one-process layout: every axis of size 1, no mesh."""
    return Layout()


def build_layout(sizes: dict[str, int], rank: int, device_type: str, backend: str,
                 timeout: timedelta, world_host_group: Any = None) -> Layout:
    """The layout of an initialised job (collective: every rank calls it once, right
    after the default group formed, with the same ``sizes``).

    Every axis of size > 1 gets its groups from ``dist.new_group`` with the job's
    ``timeout`` (``init_device_mesh`` would use the default 30 minutes), and a
    ``gloo`` twin when ``backend`` is not gloo. A pure data-parallel job (the only
    axis ``dp``) forms no new group: its mesh is the default group's.
    """
    world = dist.get_world_size()
    if world != sizes["pp"] * sizes["dp"] * sizes["cp"] * sizes["tp"]:
        raise DistributedError(f"the layout {sizes} does not cover the {world} ranks")
    names = tuple(d for d in DIMS if d == "dp" or sizes[d] > 1)
    shape = tuple(sizes[d] for d in names)
    from torch.distributed.device_mesh import DeviceMesh

    if names == ("dp",):
        mesh = DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=names)
        groups = {"dp": dist.group.WORLD} if sizes["dp"] > 1 else {}
        hosts = ({"dp": world_host_group if world_host_group is not None else dist.group.WORLD}
                 if sizes["dp"] > 1 else {})
        return Layout(**sizes, rank=dist.get_rank(), mesh=mesh, groups=groups,
                      host_groups=hosts)
    grid = torch.arange(world).view(shape)
    rank = dist.get_rank()
    mine: dict[str, Any] = {}
    hosts = {}
    for axis, dim in enumerate(names):
        # every rank creates every group of the axis, in the same order (new_group)
        lines = grid.movedim(axis, -1).reshape(-1, shape[axis]).tolist()
        for line in lines:
            group = dist.new_group(line, timeout=timeout)
            host = group if backend == "gloo" else dist.new_group(line, backend="gloo",
                                                                  timeout=timeout)
            if rank in line:
                mine[dim], hosts[dim] = group, host
    mesh = DeviceMesh.from_group([mine[d] for d in names], device_type, mesh=grid,
                                 mesh_dim_names=names)
    groups = {d: g for d, g in mine.items() if sizes[d] > 1}
    return Layout(**sizes, rank=rank, mesh=mesh, groups=groups,
                  host_groups={d: g for d, g in hosts.items() if sizes[d] > 1})
