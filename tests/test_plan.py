"""The planner (`megabuf.planning.plan`): pure, no process group, no Parameter objects."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megabuf.config import DistributedDataParallelConfig
from megabuf.planning.plan import ParamSpec, Plan, build_plan
from megabuf.pure.layout import compute_layout, default_bucket_size

F32, BF16 = torch.float32, torch.bfloat16


def dense(name: str, numel: int, dtype: torch.dtype = F32, **kw: Any) -> ParamSpec:
    return ParamSpec(name, numel, dtype, **kw)


def expert(name: str, numel: int, dtype: torch.dtype = F32) -> ParamSpec:
    return ParamSpec(name, numel, dtype, expert=True)


def plan(
    specs: list[ParamSpec], *, dp: int = 2, expt_dp: int = 2, shared: bool = True, **cfg: Any
) -> Plan:
    disable = cfg.pop("disable_bucketing", False)
    return build_plan(
        specs,
        DistributedDataParallelConfig(**cfg),
        dp_size=dp,
        expt_dp_size=expt_dp,
        expert_shares_dp_group=shared,
        disable_bucketing=disable,
    )


# a MoE-like model: dense a, expert e1, dense b, expert e2, dense c (registration order)
MOE = [dense("a", 10), expert("e1", 30), dense("b", 10), expert("e2", 30), dense("c", 10)]


@pytest.mark.parametrize(
    "cfg, expected",
    [
        pytest.param({"disable_bucketing": True, "bucket_size": 7}, None, id="disable-wins"),
        pytest.param({"bucket_size": 7}, 7, id="explicit"),
        pytest.param({}, None, id="no-overlap-one-bucket"),
        # the largest buffer is the expert one (60 elements): quarter of it
        pytest.param({"overlap_grad_reduce": True}, 15, id="overlap-default-largest-buffer"),
    ],
)
def test_bucket_size_rule(cfg: dict[str, Any], expected: int | None) -> None:
    assert plan(MOE, **cfg).bucket_size == expected


def test_overlap_default_uses_dense_dp_size() -> None:
    big = [dense("w", 400_000_000)]
    got = plan(big, dp=64, expt_dp=64, overlap_grad_reduce=True).bucket_size
    assert got == default_bucket_size(64, 400_000_000) == 64_000_000


def test_buffers_dense_first_then_expert_keyed_by_dtypes_in_first_seen_order() -> None:
    specs = [expert("e", 4, BF16), dense("x", 3, BF16), dense("y", 5), dense("z", 2, BF16)]
    buffers = plan(specs).buffers
    assert [(b.index, b.expert, b.param_dtype, b.grad_dtype, b.param_ids) for b in buffers] == [
        (0, False, BF16, BF16, (1, 3)),
        (1, False, F32, F32, (2,)),
        (2, True, BF16, BF16, (0,)),
    ]


def test_grad_reduce_in_fp32_keys_grad_dtype_fp32() -> None:
    specs = [dense("x", 3, BF16), dense("y", 5), dense("z", 2, BF16)]
    buffers = plan(specs, grad_reduce_in_fp32=True).buffers
    assert [(b.param_dtype, b.grad_dtype, b.param_ids) for b in buffers] == [
        (BF16, F32, (0, 2)),
        (F32, F32, (1,)),
    ]


def test_layout_is_compute_layout_with_own_bucket_and_expert_dp_size() -> None:
    specs = [dense("emb", 100, own_bucket=True), dense("w", 50), expert("e", 20)]
    p = plan(specs, dp=4, expt_dp=2, shared=False, use_distributed_optimizer=True)
    d, e = p.buffers
    assert d.layout == compute_layout(
        [100, 50], bucket_size=None, dp_size=4, sharded=True, own_bucket=[True, False]
    )
    assert len(d.layout.buckets) == 2 and d.bucket_param_ids(1) == (0,)  # emb alone
    assert (d.dp_size, e.dp_size) == (4, 2)
    assert e.layout == compute_layout([20], bucket_size=None, dp_size=2, sharded=True)


def test_group_per_bucket_ids_unique_across_dense_and_expert() -> None:
    p = plan(MOE, bucket_size=10)  # dense: 3 buckets (c, b, a); expert: 2 (e2, e1)
    assert [(g.group_id, g.expert, g.members) for g in p.groups] == [
        (0, False, ((0, 0),)),
        (1, False, ((0, 1),)),
        (2, False, ((0, 2),)),
        (3, True, ((1, 0),)),
        (4, True, ((1, 1),)),
    ]


def test_disable_bucketing_one_group_per_kind() -> None:
    specs = [dense("emb", 10, own_bucket=True), *MOE]
    p = plan(specs, disable_bucketing=True, shared=False)
    assert [len(b.layout.buckets) for b in p.buffers] == [2, 1]  # own_bucket still splits
    assert [(g.group_id, g.expert, g.members) for g in p.groups] == [
        (0, False, ((0, 0), (0, 1))),
        (1, True, ((1, 0),)),
    ]
    assert p.chains == ((0,), (1,))


def test_disable_bucketing_expert_only_gets_group_zero() -> None:
    p = plan([expert("e1", 5), expert("e2", 5)], disable_bucketing=True)
    assert [(g.group_id, g.expert, g.chain_id) for g in p.groups] == [(0, True, 0)]


def test_expert_sharing_dp_group_merges_into_one_chain_in_backward_order() -> None:
    # group (param): 0 (c), 1 (b), 2 (a), 3 (e2), 4 (e1); registration a e1 b e2 c
    p = plan(MOE, bucket_size=10, shared=True)
    assert p.chains == ((0, 3, 1, 4, 2),)  # c, e2, b, e1, a: last-registered first
    assert [(g.chain_id, g.dispatch_position) for g in p.groups] == [
        (0, 0), (0, 2), (0, 4), (0, 1), (0, 3),
    ]  # fmt: skip


def test_expert_on_own_group_gets_separate_chains() -> None:
    p = plan(MOE, bucket_size=10, dp=4, expt_dp=2, shared=False)
    assert p.chains == ((0, 1, 2), (3, 4))
    assert [(g.chain_id, g.dispatch_position) for g in p.groups] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1),
    ]  # fmt: skip


def test_dispatch_order_follows_registration_not_buffer_order() -> None:
    # bf16 buffer holds the last-registered param, so its group dispatches first
    specs = [dense("x", 4), dense("y", 4, BF16), dense("z", 4)]
    p = plan(specs)  # buffer 0 = f32 (x, z), buffer 1 = bf16 (y): one bucket each
    assert [g.members for g in p.groups] == [((0, 0),), ((1, 0),)]
    assert p.chains == ((0, 1),)  # group 0 holds z, registered last


def test_dense_only_model_has_one_chain_either_way() -> None:
    specs = [dense("a", 3), dense("b", 3)]
    assert plan(specs, shared=True).chains == plan(specs, shared=False).chains == ((0,),)


def test_no_trainable_params_plans_nothing() -> None:
    p = plan([])
    assert (p.buffers, p.groups, p.chains) == ((), (), ())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"dp": 0}, "dp_size and expt_dp_size", id="dp-size-zero"),
        pytest.param({"dp": 4, "expt_dp": 2, "shared": True}, "expt_dp_size=2", id="shared-size"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan(MOE, **kwargs)


def test_empty_param_is_named() -> None:
    with pytest.raises(ValueError, match=r"\['b'\] have no elements"):
        plan([dense("a", 3), dense("b", 0)])


def _buffer_with_layout(params: list[torch.nn.Parameter], layout_numels: list[int]) -> Any:
    from megabuf.buckets.buffer import _ParamAndGradBuffer

    layout = compute_layout(layout_numels, bucket_size=None)
    names = {p: f"p{i}" for i, p in enumerate(params)}
    cfg = DistributedDataParallelConfig()
    return _ParamAndGradBuffer(
        cfg, F32, F32, params, None, layout, names, 1.0, dp_size=1, dp_rank=0
    )


def test_buffer_allocates_the_planned_slots() -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    p = plan([dense("p0", 3), dense("p1", 4)])
    buf = _buffer_with_layout(params, [3, 4])
    assert buf.layout == p.buffers[0].layout
    assert [buf.param_index_map[q] for q in params] == list(p.buffers[0].layout.params)
    assert params[1].main_grad.data_ptr() == buf.grad_data[0:4].data_ptr()  # reversed order


@pytest.mark.parametrize(
    "numels, match",
    [
        pytest.param([3], "1 param slots for 2 params", id="slot-count"),
        pytest.param([3, 5], r"p1 \(4 elements, slot 5\)", id="slot-numel"),
    ],
)
def test_buffer_rejects_a_layout_of_other_params(numels: list[int], match: str) -> None:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    with pytest.raises(ValueError, match=match):
        _buffer_with_layout(params, numels)
