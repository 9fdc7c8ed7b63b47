"""Pure tests of the ZeRO-3 param lifecycle (`ShardedParams`): guarded transitions, released
storages, the ledger, write-back into the shard and verify_param_access. No process group: a
recording stand-in of `Collectives` plays two ranks' all-gather."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from megabuf.sharding.ledger import MemoryLedger
from megabuf.sharding.params import ParamShardState, ShardedParams


class _Done:
    def wait(self) -> None:
        pass


class FakeCollectives:
    """all_gather_many as two dp ranks would: this rank's shard and `other`'s values."""

    def __init__(self, other: Sequence[Tensor]) -> None:
        self.other = list(other)
        self.calls: list[dict[str, Any]] = []

    def all_gather_many(
        self, outputs: Sequence[Tensor], inputs: Sequence[Tensor], group: Any, *,
        async_op: bool = True, tag: int = 0,
    ) -> list[_Done]:  # fmt: skip
        self.calls.append({"async_op": async_op, "tag": tag, "n": len(outputs)})
        for out, shard, other in zip(outputs, inputs, self.other, strict=True):
            n = shard.numel()
            out[:n].copy_(shard)  # dp rank 0
            out[n:].copy_(other)  # dp rank 1
        return [_Done()]


def make(poison: bool = False) -> tuple[ShardedParams, MemoryLedger, FakeCollectives, Tensor]:
    full = torch.arange(8, dtype=torch.float32)  # one bucket of 8 elements, dp=2
    shard = torch.zeros(4)
    ledger = MemoryLedger()
    other = torch.full((4,), -1.0)
    coll = FakeCollectives([other])
    params = ShardedParams(
        [full], [shard], coll, None, ledger,  # type: ignore[arg-type]
        group_id=3, unit_name="blocks.1", rank=5, dp_rank=0, dp_size=2, poison=poison,
    )  # fmt: skip
    return params, ledger, coll, full


def test_built_unsharded_then_writeback_fills_the_shard_and_frees_the_storage() -> None:
    params, ledger, _, full = make()
    assert params.state is ParamShardState.UNSHARDED
    assert ledger.now("unsharded_params") == 32 and ledger.now("param_shard") == 16
    view = full[2:6]  # a param's view, made once
    params.release_params(writeback=True)
    assert params.shards[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert full.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    assert params.state is ParamShardState.SHARDED and not params.holds_full
    assert ledger.now("unsharded_params") == 0 and ledger.peak("unsharded_params") == 32


def test_gather_refills_the_same_storage_in_place() -> None:
    params, ledger, coll, full = make()
    view = full[2:6]
    params.release_params(writeback=True)
    params.start_param_gather()
    assert params.state is ParamShardState.GATHERING and coll.calls[-1]["tag"] == 3
    params.finish_param_gather()
    assert params.state is ParamShardState.UNSHARDED
    assert view.tolist() == [2.0, 3.0, -1.0, -1.0]  # the old view sees the gathered values
    assert ledger.now("unsharded_params") == 32 and params.gathers == 1


@pytest.mark.parametrize(
    ("action", "state", "wanted"),
    [
        ("start_param_gather", "UNSHARDED", "SHARDED"),
        ("finish_param_gather", "UNSHARDED", "GATHERING"),
        ("release_params", "SHARDED", "UNSHARDED"),
    ],
)
def test_illegal_transitions_name_group_unit_and_rank(action: str, state: str, wanted: str) -> None:
    params, _, _, _ = make()
    if state == "SHARDED":
        params.release_params()
    with pytest.raises(RuntimeError) as err:
        getattr(params, action)()
    msg = str(err.value)
    assert msg.startswith("megabuf: bucket group 3 (shard unit 'blocks.1')"), msg
    assert f"params are {state}, expected {wanted} (rank 5)" in msg, msg
    assert "summon_full_params" in msg


def test_ensure_helpers_are_idempotent() -> None:
    params, ledger, coll, _ = make()
    params.ensure_released()
    params.ensure_released()
    assert params.state is ParamShardState.SHARDED
    params.ensure_gathered()
    params.ensure_gathered()
    assert params.state is ParamShardState.UNSHARDED and len(coll.calls) == 1
    params.ensure_released()
    assert ledger.now("unsharded_params") == 0


def test_verify_param_access_keeps_the_storage_filled_with_nan() -> None:
    params, ledger, _, full = make(poison=True)
    params.release_params(writeback=True)
    assert full.untyped_storage().nbytes() == 32
    assert all(math.isnan(v) for v in full.tolist())
    assert ledger.now("verify_param_access") == 32 and ledger.now("unsharded_params") == 0
    params.ensure_gathered()
    assert full.tolist() == [0.0, 1.0, 2.0, 3.0, -1.0, -1.0, -1.0, -1.0]


class _Containers(torch.nn.Module):
    """No ModuleList with two blocks: a ModuleDict holding one block and a ParameterList."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4)})
        self.gains = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(4))])


def test_default_units_never_pick_a_container_without_forward() -> None:
    """A unit's params are gathered around its forward, so the default policy picks the blocks
    of a ModuleDict (like a ModuleList) and never a ParameterList / ModuleDict itself."""
    from megabuf.sharding.units import plan_units

    model = _Containers()
    plan = plan_units(model, (), list(model.named_parameters()))
    assert [u.name for u in plan.units] == ["", "stem", "blocks.0"]
    assert plan.units[plan.unit_of_param["gains.0"]].name == ""
    many = torch.nn.Module()
    many.blocks = torch.nn.ModuleDict({str(i): torch.nn.Linear(4, 4) for i in range(3)})
    plan = plan_units(many, (), list(many.named_parameters()))
    assert [u.name for u in plan.units] == ["", "blocks.0", "blocks.1", "blocks.2"]


def test_stray_read_guard_allows_metadata_reads_of_a_released_param() -> None:
    """[Note: stray reads]: `.dtype`, `.shape`, `.size()` of a released param are metadata (a
    released param keeps them), so another unit may read them; reading values raises by name."""
    from types import SimpleNamespace

    from megabuf.sharding.read_guard import StrayReadGuard

    param = torch.nn.Parameter(torch.ones(3, 2))
    released = SimpleNamespace(state=ParamShardState.SHARDED)
    owners: Any = {param: ("tail.weight", "tail", released)}
    guard = StrayReadGuard(owners, lambda: "", rank=0)
    with guard:
        assert param.dtype == torch.float32 and param.shape == (3, 2) and param.size(0) == 3
        assert param.dim() == 2 and param.numel() == 6
        with pytest.raises(RuntimeError, match=r"megabuf: tail\.weight \(shard unit tail\)"):
            torch.ones(2).to(param)
