"""`ProcessGroups`: the explicit record of every group the engine talks over.

[Note: rank order]
World ranks are laid out as (pp, expt_dp, ep) with ep varying fastest:

    rank = pp_rank * dp_size + dp_rank,    dp_rank = expt_dp_rank * ep_size + ep_rank

so `dp` (dense data parallel) holds the dp_size consecutive ranks of one pipeline stage, `ep`
holds ep_size consecutive ranks inside it (experts exchange tokens with near neighbours), and
`expt_dp` holds the ranks of one stage with the same ep_rank (stride ep_size): the replicas of the
same experts. `pp` holds the ranks with the same dp_rank across stages (stride dp_size). `embd`
joins the first and last stage of a pipeline (tied word embeddings).
Example, world 8 = pp 2 x dp 4, ep 2: dp groups [0,1,2,3] [4,5,6,7]; ep [0,1] [2,3] [4,5] [6,7];
expt_dp [0,2] [1,3] [4,6] [5,7]; pp [0,4] [1,5] [2,6] [3,7].
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

from megabuf.config import DistributedDataParallelConfig
from megabuf.pure.hybrid import HybridSplit, hybrid_layout, node_shard_size, split_for
from megabuf.transport.cross_replica import CrossReplica, ReplicateGroup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Topology:
    """This rank's place in every group the engine uses, resolved once from `ProcessGroups`
    ([Note: rank order]); nothing else in the engine asks torch.distributed for ranks or sizes
    (arbitrary groups: `Collectives.rank` / `Collectives.size`)."""

    rank: int  # global
    world_size: int
    dp_rank: int
    dp_size: int
    expt_dp_rank: int
    expt_dp_size: int
    ep_rank: int
    ep_size: int
    pp_rank: int
    pp_size: int
    embd_size: int  # 0 without an embedding group
    # the replicate x shard split of dp ([Note: hybrid rank order]); flat: shard = dp, R = 1
    dp_shard_rank: int = 0
    dp_shard_size: int = 1
    dp_replicate_rank: int = 0
    dp_replicate_size: int = 1

    def data_parallel(self, expert: bool) -> tuple[int, int]:
        """(rank, size) in the group a buffer's grads reduce over: expt_dp or dp."""
        if expert:
            return self.expt_dp_rank, self.expt_dp_size
        return self.dp_rank, self.dp_size

    def sharding(self, expert: bool) -> tuple[int, int]:
        """(rank, size) in the group a buffer is laid out, sharded and gathered over: the
        shard group under a hybrid split ([Note: hybrid rank order]), else expt_dp or dp."""
        if self.dp_replicate_size > 1:
            return self.dp_shard_rank, self.dp_shard_size
        return self.data_parallel(expert)


@dataclass(frozen=True)
class ProcessGroups:
    """Groups the engine uses; pass it explicitly (megabuf keeps no global group state)."""

    dp: ProcessGroup
    """Dense data-parallel group: grads of ordinary params are reduced over it."""
    expt_dp: ProcessGroup
    """Expert data-parallel group: grads of expert-parallel params are reduced over it."""
    ep: ProcessGroup
    """Expert-parallel group: ranks holding different experts of one layer (token all-to-all)."""
    pp: ProcessGroup
    """Pipeline group: the stages of one pipeline, in stage order."""
    embd: ProcessGroup | None = None
    """First and last pipeline stage of this pipeline (tied embeddings); None without pp."""
    pp_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's pipeline, in stage order (for point-to-point send/recv)."""
    dp_shard: ProcessGroup | None = None
    """Hybrid sharding: the S ranks of dp a bucket is sharded over ([Note: hybrid rank order]);
    None when flat (the shard group is dp)."""
    dp_replicate: ProcessGroup | None = None
    """Hybrid sharding: the R ranks of dp holding the same shard; None when flat."""
    cross_replica: CrossReplica | None = None
    """Fault tolerance: what all-reduces across replica groups, torchft's Manager
    (`megabuf.ft`); dp is then one replica group. None: see `replicas()`."""

    def __post_init__(self) -> None:
        if (self.dp_shard is None) != (self.dp_replicate is None):
            raise ValueError(
                "megabuf: ProcessGroups needs both dp_shard and dp_replicate, or neither"
            )
        if self.cross_replica is not None and self.dp_replicate is not None:
            raise ValueError(
                "megabuf: ProcessGroups got both a cross_replica level (fault tolerance) and a "
                "hybrid dp_replicate group; under megabuf.ft dp is one replica group"
            )

    def named(self) -> dict[str, ProcessGroup | None]:
        """Every group by name, the hybrid levels first ([Note: wire accounting by group])."""
        return {
            "dp_shard": self.dp_shard, "dp_replicate": self.dp_replicate, "dp": self.dp,
            "expt_dp": self.expt_dp, "ep": self.ep, "pp": self.pp, "embd": self.embd,
        }  # fmt: skip

    @property
    def hybrid(self) -> bool:
        """dp is split into replicas of a shard ([Note: hybrid rank order])."""
        return self.dp_replicate is not None

    def shard_group(self, expert: bool) -> ProcessGroup:
        """The group a buffer is sharded and its params gathered over (`Topology.sharding`)."""
        if self.dp_shard is not None:
            return self.dp_shard
        return self.expt_dp if expert else self.dp

    def replicate_group(self) -> ProcessGroup | None:
        """The group a reduced shard is all-reduced over after the shard group's
        reduce-scatter; None when flat."""
        return self.dp_replicate

    def replicas(self) -> CrossReplica | None:
        """The level every bucket group's reduction ends with across replicas ([Note:
        cross-replica level]): `cross_replica` if given, else the replicate group's, else none."""
        if self.cross_replica is not None:
            return self.cross_replica
        return None if self.dp_replicate is None else ReplicateGroup(self.dp_replicate)

    @functools.cached_property
    def topology(self) -> Topology:
        """Every rank and size of these groups, asked of torch.distributed once."""
        return Topology(
            rank=dist.get_rank(), world_size=dist.get_world_size(),
            dp_rank=dist.get_rank(self.dp), dp_size=dist.get_world_size(self.dp),
            expt_dp_rank=dist.get_rank(self.expt_dp),
            expt_dp_size=dist.get_world_size(self.expt_dp),
            ep_rank=dist.get_rank(self.ep), ep_size=dist.get_world_size(self.ep),
            pp_rank=dist.get_rank(self.pp), pp_size=dist.get_world_size(self.pp),
            embd_size=0 if self.embd is None else dist.get_world_size(self.embd),
            **self._split_topology(),
        )  # fmt: skip

    def _split_topology(self) -> dict[str, int]:
        if self.dp_shard is None or self.dp_replicate is None:
            return {"dp_shard_rank": dist.get_rank(self.dp),
                    "dp_shard_size": dist.get_world_size(self.dp)}  # fmt: skip
        return {
            "dp_shard_rank": dist.get_rank(self.dp_shard),
            "dp_shard_size": dist.get_world_size(self.dp_shard),
            "dp_replicate_rank": dist.get_rank(self.dp_replicate),
            "dp_replicate_size": dist.get_world_size(self.dp_replicate),
        }

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank

    @property
    def pp_size(self) -> int:
        return self.topology.pp_size

    @property
    def pp_rank(self) -> int:
        return self.topology.pp_rank

    @classmethod
    def default(cls) -> ProcessGroups:
        """Plain data parallelism over the whole world (no expert or pipeline parallelism)."""
        return cls.build(pp_size=1, ep_size=1)

    @classmethod
    def default_local(cls) -> ProcessGroups:
        """The same groups as `default()`, made without a collective (this rank's ep and pp
        groups of one rank are created by it alone), so one rank may build them alone: an
        unpickled copy ([Note: pickling a wrapped model] in pickling.py)."""
        return cls.for_dp_group(dist.group.WORLD)  # type: ignore[arg-type]

    @classmethod
    def for_dp_group(cls, group: ProcessGroup) -> ProcessGroups:
        """Plain data parallelism over `group` (torch DDP's `process_group`): no expert or
        pipeline parallelism, so ep and pp hold this rank alone. Only `group`'s ranks call it."""
        rank = dist.get_rank()
        alone = _cached(
            ("alone", rank), lambda: dist.new_group([rank], use_local_synchronization=True)
        )
        return cls(dp=group, expt_dp=group, ep=alone, pp=alone, pp_ranks=(rank,))

    def split_dp(self, split: HybridSplit) -> ProcessGroups:
        """These groups with every dp group split into `split.replicate_size` replicas of a
        `split.shard_size`-way shard ([Note: hybrid rank order]). Collective over each dp
        group (its ranks only). A flat split (one replica) returns `self`."""
        if split.dp_size != self.dp_size:
            raise ValueError(
                f"megabuf: a hybrid split of {split.replicate_size} replicas x "
                f"{split.shard_size} shards needs dp_size {split.dp_size}, got {self.dp_size}"
            )
        if split.is_flat:
            return self
        _refuse_expert_split(self)
        dp_ranks = group_ranks(self.dp)
        layout = hybrid_layout([dp_ranks], split)
        rank = dist.get_rank()
        made = [_split_group(next(g for g in layout[kind] if rank in g)) for kind in
                ("dp_shard", "dp_replicate")]  # fmt: skip
        return dataclasses.replace(self, dp_shard=made[0], dp_replicate=made[1])

    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh) -> ProcessGroups:
        """Hybrid data parallelism over a 2-D torch `DeviceMesh` whose dims are named
        "replicate" and "shard" (FSDP2's HSDP mesh): the mesh's own groups are the replicate
        and shard groups, and dp is the mesh's ranks in row-major order (no expert or pipeline
        parallelism). Collective: every rank of the mesh calls it."""
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim != 2 or sorted(names) != ["replicate", "shard"]:
            raise ValueError(
                f"megabuf: ProcessGroups.from_device_mesh needs a 2-D DeviceMesh with dims "
                f"named ('replicate', 'shard'), got {mesh.ndim} dims named {names or None}; "
                "build it with init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
            )
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        if ranks == list(range(dist.get_world_size())):
            dp: ProcessGroup = dist.group.WORLD  # type: ignore[assignment]
        else:
            dp = _cached(("mesh_dp", tuple(ranks)), lambda: new_subgroup(None, ranks))
        rank = dist.get_rank()
        alone = _cached(
            ("alone", rank), lambda: dist.new_group([rank], use_local_synchronization=True)
        )
        return cls(
            dp=dp, expt_dp=dp, ep=alone, pp=alone, pp_ranks=(rank,),
            dp_shard=mesh.get_group("shard"), dp_replicate=mesh.get_group("replicate"),
        )  # fmt: skip

    @classmethod
    def build(
        cls, *, pp_size: int = 1, ep_size: int = 1, dp_shard_size: int | str | None = None
    ) -> ProcessGroups:
        """Carve the world into (pp, dp, ep) groups; see [Note: rank order]. `dp_shard_size`
        splits dp for hybrid sharding ([Note: hybrid rank order]): an int, "node" (torchrun's
        LOCAL_WORLD_SIZE) or None (flat). Collective: every rank must call it with the same
        sizes."""
        flat = cls._build_flat(pp_size=pp_size, ep_size=ep_size)
        if dp_shard_size is None:
            return flat
        size = node_shard_size() if dp_shard_size == "node" else dp_shard_size
        if not isinstance(size, int):
            raise ValueError(
                f"megabuf: dp_shard_size={dp_shard_size!r} must be an int, 'node' or None"
            )
        return flat.split_dp(split_for(flat.dp_size, shard_size=size))

    @classmethod
    def _build_flat(cls, *, pp_size: int, ep_size: int) -> ProcessGroups:
        if not dist.is_initialized():
            raise RuntimeError(
                "megabuf: torch.distributed is not initialised; call megabuf.init_distributed() "
                "(or torch.distributed.init_process_group) first"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = rank_layout(world, pp_size=pp_size, ep_size=ep_size)
        if pp_size == 1:
            del layout["embd"]
        # Kinds with identical rank lists share one group (e.g. expt_dp == dp when ep_size == 1).
        made: dict[tuple[tuple[int, ...], ...], ProcessGroup | None] = {}
        groups: dict[str, ProcessGroup | None] = {}
        for name, ranks_list in layout.items():
            key = tuple(tuple(r) for r in ranks_list)
            if key not in made:
                # Middle pipeline stages (pp_size > 2) belong to no embd group.
                made[key] = _my_group(ranks_list, rank, optional=name == "embd")
            groups[name] = made[key]
        my_pp = next(r for r in layout["pp"] if rank in r)
        embd = groups.get("embd")
        return cls(
            dp=_required(groups["dp"]),
            expt_dp=_required(groups["expt_dp"]),
            ep=_required(groups["ep"]),
            pp=_required(groups["pp"]),
            embd=embd,
            pp_ranks=tuple(my_pp),
        )


def resolve_split(pgs: ProcessGroups, config: DistributedDataParallelConfig) -> ProcessGroups:
    """The groups an engine runs over: `pgs`, split into R replicas when the config asks for
    `num_distributed_optimizer_instances = R` > 1 (collective over dp), checked against a
    split the groups already carry and against the strategy."""
    field = "DistributedDataParallelConfig.num_distributed_optimizer_instances"
    replicas = config.num_distributed_optimizer_instances
    if replicas > 1 and not pgs.hybrid:
        pgs = pgs.split_dp(split_for(pgs.dp_size, replicas=replicas, what=field))
    have = pgs.topology.dp_replicate_size
    if replicas > 1 and have != replicas:
        raise ValueError(
            f"megabuf: {field}={replicas} but the process groups are already split into {have} "
            "replicas; give one of them (or the same R in both)"
        )
    if pgs.hybrid and not config.sharding.shards_optimizer:
        raise ValueError(
            f"megabuf: the process groups split dp into {have} replicas x "
            f"{pgs.topology.dp_shard_size} shards (hybrid sharding), which needs a strategy that "
            f"shards the optimizer; data_parallel_sharding_strategy="
            f"{config.sharding.name!r} would only all-reduce: use 'optim', 'optim_grads' or "
            "'optim_grads_params', or flat process groups"
        )
    return pgs


def _split_group(ranks: list[int]) -> ProcessGroup:
    """One shard or replicate group, made by its members only (once per world)."""
    return _cached(("split", tuple(ranks)), lambda: new_subgroup(None, ranks))


def _refuse_expert_split(pgs: ProcessGroups) -> None:
    if pgs.expt_dp is not pgs.dp:
        raise ValueError(
            f"megabuf: hybrid sharding with expert parallelism (ep_size "
            f"{dist.get_world_size(pgs.ep)}) is not supported: the expert-dp group of "
            f"{dist.get_world_size(pgs.expt_dp)} ranks would need its own replicate x shard "
            "split; use a flat strategy (dp_shard_size=None, "
            "num_distributed_optimizer_instances=1) with ep_size > 1"
        )


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of `group` (None: the default group), in group-rank order."""
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def new_subgroup(group: ProcessGroup | None, members: list[int]) -> ProcessGroup:
    """A new group of `members` (ranks *in `group`*, this rank among them). Collective over the
    members only (`use_local_synchronization`): every member must call it, in the same order
    relative to its other group creations; other ranks need not."""
    ranks = group_ranks(group)
    return dist.new_group([ranks[m] for m in members], use_local_synchronization=True)


def new_group_with_timeout(ranks: list[int], timeout: datetime.timedelta) -> ProcessGroup:
    """A new group of the global `ranks` whose collectives fail after `timeout` instead of the
    default's (the weight publishing group: a dead peer must not hang the others). Collective
    over the whole world: every rank calls it with the same list, members or not."""
    return dist.new_group(sorted(ranks), timeout=timeout)


def _check_sizes(world: int, pp_size: int, ep_size: int) -> int:
    if pp_size < 1 or world % pp_size != 0:
        raise ValueError(
            f"megabuf: pp_size={pp_size} must be >= 1 and divide the world size {world}"
        )
    dp_size = world // pp_size
    if ep_size < 1 or dp_size % ep_size != 0:
        raise ValueError(
            f"megabuf: ep_size={ep_size} must be >= 1 and divide dp_size={dp_size} "
            f"(world {world} / pp_size {pp_size})"
        )
    return dp_size


def rank_layout(world: int, *, pp_size: int = 1, ep_size: int = 1) -> dict[str, list[list[int]]]:
    """Pure: the global ranks of every group of each kind; see [Note: rank order]."""
    dp_size = _check_sizes(world, pp_size, ep_size)
    dp = [list(range(p * dp_size, (p + 1) * dp_size)) for p in range(pp_size)]
    ep = [ranks[i : i + ep_size] for ranks in dp for i in range(0, dp_size, ep_size)]
    expt_dp = [ranks[e::ep_size] for ranks in dp for e in range(ep_size)]
    pp = [list(range(d, world, dp_size)) for d in range(dp_size)]
    embd = [sorted({r[0], r[-1]}) for r in pp]
    return {"dp": dp, "expt_dp": expt_dp, "ep": ep, "pp": pp, "embd": embd}


def _required(group: ProcessGroup | None) -> ProcessGroup:
    if group is None:
        raise RuntimeError(f"megabuf: rank {dist.get_rank()} is in no group of a required kind")
    return group


def _my_group(
    ranks_list: list[list[int]], rank: int, *, optional: bool = False
) -> ProcessGroup | None:
    """Create all groups of one kind (collectively) and return the one holding `rank` (None if
    `optional` and no group holds it)."""
    world = dist.get_world_size()
    if len(ranks_list) == 1 and len(ranks_list[0]) == world:
        return dist.group.WORLD  # type: ignore[return-value]
    mine = _cached(("kind", tuple(map(tuple, ranks_list))), lambda: _create_kind(ranks_list, rank))
    if mine is None and not optional:
        raise RuntimeError(f"megabuf: rank {rank} is in no group of {ranks_list}")
    return mine


def _create_kind(ranks_list: list[list[int]], rank: int) -> ProcessGroup | None:
    mine: ProcessGroup | None = None
    for ranks in ranks_list:  # every rank creates every group, in the same order
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


# [Note: groups are made once per world]
# Each gloo group owns worker threads and sockets that live until the world is destroyed, so a
# process that builds many engines (a notebook, a test worker, a sweep) must not make new groups
# for each: `build` and `for_dp_group` reuse the groups made for the same rank lists in the same
# world. Sharing a communicator between engines is safe because every rank builds, and therefore
# dispatches, its engines in the same program order; a new `init_process_group` (a new WORLD
# object) starts a fresh cache. The key includes every group of the kind, so every rank hits or
# misses together and the collective `new_group` calls stay matched.
_G = TypeVar("_G")
_GROUP_CACHE: dict[object, object] = {"world": None}


def _cached(key: object, make: Callable[[], _G]) -> _G:
    world = dist.group.WORLD
    if _GROUP_CACHE["world"] is not world:
        _GROUP_CACHE.clear()
        _GROUP_CACHE["world"] = world
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = make()
    return _GROUP_CACHE[key]  # type: ignore[return-value]
