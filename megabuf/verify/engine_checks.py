"""What the verify mode checks of one engine at every grad sync ([Note: verify mode]).

`EngineVerifier(engine)` is built by the engine before its parts and reads it, at each check,
through the engine's read API only ([Note: the engine's read API] in megabuf/core/engine.py):
config, process_groups, collectives, rank, module, param_to_name, hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from megabuf.planning.replicas import is_expert_parallel
from megabuf.pure.verify_levels import verify_checks
from megabuf.transport.collectives import Group
from megabuf.verify.fingerprint import CollectiveLog
from megabuf.verify.replicas import check_replicas

REDUCING_GROUPS = ("dp_shard", "dp_replicate", "dp", "expt_dp")
"""The groups whose every rank runs this engine's grad sync: their fingerprints are compared."""


class EngineVerifier:
    """The collective log and the replica checks of one engine (nothing when verify="off")."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.checks = verify_checks(engine.config.verify)
        pgs = engine.process_groups
        self.log: CollectiveLog | None = None
        if "collectives" in self.checks:
            self.log = CollectiveLog(engine.collectives, pgs.named(), engine.rank)

    def sync_checks(self) -> list[Callable[[], None]]:
        """The grad sync's checks to add (each raises on every rank of its group)."""
        checks: list[Callable[[], None]] = []
        if self.log is not None:
            checks.append(self.check_collectives)
        if "replicas" in self.checks:
            checks.append(self.check_replicas)
        return checks

    def reducing_groups(self) -> list[Group]:
        """The distinct reducing groups of more than one rank, in REDUCING_GROUPS order."""
        named, seen, groups = self.engine.process_groups.named(), set(), []
        for name in REDUCING_GROUPS:
            group = named[name]
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                groups.append(group)
        return groups

    def check_collectives(self) -> None:
        if self.log is not None:
            self.log.check(self.reducing_groups())

    def check_replicas(self) -> None:
        """Params equal over dp (dense) / expt_dp (expert); no_shard: synced grads too."""
        engine = self.engine
        sharding = engine.config.sharding
        if engine.hooks.comm_hooks() and not engine.config.deterministic_reduction:
            return  # a user's hook (local SGD) may keep replicas apart by design
        pgs, coll, rank = engine.process_groups, engine.collectives, engine.rank
        for expert, group in ((False, pgs.dp), (True, pgs.expt_dp)):
            named = [
                (n, p) for p, n in engine.param_to_name.items() if is_expert_parallel(p) == expert
            ]
            if not sharding.shards_params:  # ZeRO-3: each rank holds its own shard only
                check_replicas([(n, p.data) for n, p in named], group, coll, rank, "param")
            if not sharding.shards_optimizer:
                grads: list[tuple[str, Tensor]] = [
                    (n, p.main_grad) for n, p in named if hasattr(p, "main_grad")
                ]
                check_replicas(grads, group, coll, rank, "synced grad of param")
