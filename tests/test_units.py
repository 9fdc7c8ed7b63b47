"""Shard units (megabuf/sharding/units.py) and unit-aligned plans (megabuf/planning/plan.py,
megabuf/pure/layout.py).

Pure: module trees and param specs only, no process group.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.planning.plan import ParamSpec, Plan, build_plan
from megabuf.planning.replicas import param_specs
from megabuf.pure.layout import shard_pieces
from megabuf.sharding.units import UnitPlan, plan_units
from megabuf.testing.models import GPT, GPTConfig, MLPStack

F32, BF16 = torch.float32, torch.bfloat16
ZERO3 = "optim_grads_params"
TINY = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=3, n_heads=2, d_ff=32)


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def units_of(model: nn.Module, shard_units: Sequence[str | type] = ()) -> UnitPlan:
    return plan_units(model, shard_units, trainable(model))


def owned(plan: UnitPlan) -> dict[str, tuple[str, ...]]:
    return {u.name: u.param_names for u in plan.units}


def tied_gpt() -> GPT:
    return GPT(GPTConfig(**{**TINY.__dict__, "tie_embeddings": True}))


# ---- units by hand ------------------------------------------------------------------------------


def test_default_policy_takes_the_block_list_root_keeps_the_rest() -> None:
    plan = units_of(tied_gpt())
    assert [u.name for u in plan.units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert [u.parent for u in plan.units] == [None, 0, 0, 0]
    assert plan.units[0].param_names == (
        "tok_emb.weight",
        "pos_emb.weight",
        "ln_f.weight",
        "ln_f.bias",
    )  # fmt: skip  (the tied lm_head.weight is tok_emb.weight)
    assert all(n.startswith("blocks.1.") for n in plan.units[2].param_names)
    assert plan.unit_of_param["blocks.2.fc.weight"] == 3


def test_default_policy_prefers_the_largest_container() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))  # registered first
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    plan = units_of(Net())
    assert [u.name for u in plan.units] == ["", "layers.0", "layers.1", "layers.2"]
    assert len(plan.units[0].param_names) == 4  # the stem stays with the root


def test_default_policy_without_a_container_takes_children_with_params() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.act = nn.ReLU()  # no params: not a unit
            self.b = nn.Linear(2, 2)
            self.scale = nn.Parameter(torch.ones(2))

    plan = units_of(Net())
    assert owned(plan) == {"": ("scale",), "a": ("a.weight", "a.bias"), "b": ("b.weight", "b.bias")}


def test_default_policy_needs_two_children_with_params() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = nn.ModuleList([nn.Linear(16, 16), nn.ReLU()])  # one child with params
            self.small = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    plan = units_of(Net())
    assert [u.name for u in plan.units] == ["", "small.0", "small.1"]


def test_a_class_entry_matches_subclasses_a_class_name_only_that_class() -> None:
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(2, 2), nn.Linear(2, 2))
    assert [u.name for u in units_of(model, [nn.Linear]).units] == ["", "0", "1"]
    assert [u.name for u in units_of(model, ["Linear"]).units] == ["", "1"]
    assert [u.name for u in units_of(model, ["MyLinear"]).units] == ["", "0"]


def test_entries_by_class_name_class_and_path_agree() -> None:
    model = MLPStack(4, 3)
    by_name = units_of(model, ["Linear"])
    by_class = units_of(model, [nn.Linear])
    by_path = units_of(model, ["layers.0", "layers.1", "layers.2"])
    assert owned(by_name) == owned(by_class) == owned(by_path)
    assert owned(by_name)["layers.1"] == ("layers.1.weight", "layers.1.bias")


def test_nested_units_params_go_to_the_lowest() -> None:
    plan = units_of(GPT(TINY), ["_Block", "_CausalSelfAttention"])
    attn = plan.units[plan.unit_of_param["blocks.0.attn.qkv.weight"]]
    assert attn.name == "blocks.0.attn" and plan.units[attn.parent or 0].name == "blocks.0"
    assert plan.unit_of_param["blocks.0.fc.weight"] == attn.parent
    assert plan.ancestors(attn.index) == (attn.index, attn.parent, 0)


def test_tied_embedding_goes_to_the_lowest_common_ancestor() -> None:
    plan = units_of(tied_gpt(), ["Embedding", "Linear", "_Block"])
    assert plan.units[plan.unit_of_param["tok_emb.weight"]].name == ""
    assert owned(plan)["lm_head"] == () and owned(plan)["tok_emb"] == ()
    assert owned(plan)["pos_emb"] == ("pos_emb.weight",)


class _Tied(nn.Module):
    """Two containers; the tie lives inside `inner` (emb and head both there)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleDict({"emb": nn.Embedding(4, 4), "head": nn.Linear(4, 4)})
        self.inner["head"].weight = self.inner["emb"].weight
        self.other = nn.Linear(4, 4)


def test_explicit_unit_that_registers_a_split_shared_param_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"shard unit 'lm_head'.*splits shared param "
                       r"'tok_emb.weight'.*'lm_head'.*'tok_emb'"):  # fmt: skip
        units_of(tied_gpt(), ["lm_head", "_Block"])
    with pytest.raises(ValueError, match=r"'inner.head'.*'inner.emb'"):
        units_of(_Tied(), ["inner.head"])


def test_explicit_unit_enclosing_every_holder_is_accepted() -> None:
    plan = units_of(_Tied(), ["inner", "other"])
    assert owned(plan)["inner"] == ("inner.emb.weight", "inner.head.bias")


class _UsedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.a = nn.Sequential(self.shared, nn.Linear(4, 4))
        self.b = nn.Sequential(nn.Linear(4, 4), self.shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_module_used_twice_is_one_unit() -> None:
    plan = units_of(_UsedTwice(), ["Linear"])
    names = [u.name for u in plan.units]
    assert names == ["", "shared", "a.1", "b.0"]  # "a.0" and "b.1" are "shared" again
    assert owned(plan)["shared"] == ("shared.weight", "shared.bias")
    assert plan.units[1].parent == 0


def test_a_module_used_twice_inside_one_unit_has_that_unit_as_parent() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU(), shared), nn.Linear(4, 4))
    plan = units_of(model, ["0", "Linear"])
    assert [u.name for u in plan.units] == ["", "0", "0.0", "1"]
    assert [u.parent for u in plan.units] == [None, 0, 1, 0]
    assert owned(plan)["0.0"] == ("0.0.weight", "0.0.bias")


def test_containers_sharing_a_child_send_it_to_their_common_ancestor() -> None:
    plan = units_of(_UsedTwice(), ["a", "b"])
    assert owned(plan)[""] == ("shared.weight", "shared.bias")
    assert owned(plan)["a"] == ("a.1.weight", "a.1.bias")


def test_unknown_entry_names_it_and_lists_classes() -> None:
    with pytest.raises(ValueError, match=r"entry 'Blok' matches no module.*'_Block'"):
        units_of(GPT(TINY), ["Blok"])
    with pytest.raises(ValueError, match=r"no module is an instance of Conv1d.*'Linear'"):
        units_of(MLPStack(4, 2), [nn.Conv1d])


def test_one_unit_owning_everything_warns() -> None:
    with pytest.warns(UserWarning, match=r"every trainable param in one shard unit"):
        units_of(nn.Linear(2, 2))  # the default policy finds no unit
    with pytest.warns(UserWarning, match=r"shard_units=\['layers'\].*\(layers, ModuleList\)"):
        units_of(MLPStack(4, 2), ["layers"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        units_of(MLPStack(4, 2))  # two units: no warning


def test_frozen_params_are_in_no_unit() -> None:
    model = MLPStack(4, 3)
    model.layers[1].requires_grad_(False)
    plan = units_of(model)
    assert [u.name for u in plan.units] == ["", "layers.0", "layers.2"]  # default skips it
    assert "layers.1.weight" not in plan.unit_of_param
    assert owned(units_of(model, ["Linear"]))["layers.1"] == ()  # named: a unit owning nothing


def test_describe_lists_units_params_and_elements() -> None:
    model = tied_gpt()
    lines = str(units_of(model)).splitlines()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert lines[0] == "4 shard units (owned trainable params):"
    # 32 x 16 tok_emb + 8 x 16 pos_emb + 2 x 16 ln_f = 672
    assert lines[1] == ("  unit 0 <root> (GPT, root): 4 params, 672 elements: tok_emb.weight, "
                        "pos_emb.weight, ln_f.weight, ln_f.bias")  # fmt: skip
    assert lines[2].startswith(f"  unit 1 blocks.0 (_Block, in unit 0): 11 params, {block:,} "
                               "elements: blocks.0.ln1.weight, ")  # fmt: skip
    assert lines[2].endswith(", ...")


# ---- unit-aligned plans by hand -----------------------------------------------------------------


def zero3_plan(specs: Sequence[ParamSpec], units: Sequence[int] | None, **cfg: Any) -> Plan:
    dp = cfg.pop("dp", 2)
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=ZERO3, **cfg)
    return build_plan(specs, config, dp_size=dp, expt_dp_size=dp, expert_shares_dp_group=True,
                      unit_of_param=units)  # fmt: skip


def test_interleaved_units_are_made_contiguous_one_bucket_per_unit() -> None:
    # registration: root a, unit 1 b, unit 2 c, root d; laid out d a (root), c, b
    specs = [ParamSpec(n, 10, F32) for n in "abcd"]
    plan = zero3_plan(specs, [0, 1, 2, 0])
    (buf,) = plan.buffers
    assert [tuple(specs[buf.param_ids[i]].name for i in k.param_ids) for k in buf.layout.buckets] \
        == [("d", "a"), ("c",), ("b",)]  # fmt: skip
    assert all(k.numel % 128 == 0 for k in buf.layout.buckets)  # sharded padding kept
    assert [(g.unit, g.members) for g in plan.groups] == [
        (0, ((0, 0),)), (1, ((0, 2),)), (2, ((0, 1),)),
    ]  # fmt: skip
    assert plan.chains == ((2, 1, 0),)  # root (holding a, registered first) dispatches last
    assert plan.unit_of_spec == (0, 1, 2, 0)


def test_a_large_unit_takes_several_buckets_all_in_its_group() -> None:
    specs = [ParamSpec(f"p{i}", 100, F32) for i in range(4)] + [ParamSpec("x", 8, BF16)]
    plan = zero3_plan(specs, [1, 1, 1, 2, 1], bucket_size=150)
    dense_f32, _ = plan.buffers
    assert len(dense_f32.layout.buckets) == 3  # unit 2: (p3); unit 1: (p2, p1), (p0)
    unit1 = next(g for g in plan.groups if g.unit == 1)
    assert unit1.members == ((0, 1), (0, 2), (1, 0))  # across both dtype buffers


def test_expert_buffers_get_their_own_unit_groups() -> None:
    specs = [ParamSpec("d0", 8, F32), ParamSpec("e0", 8, F32, expert=True),
             ParamSpec("d1", 8, F32), ParamSpec("e1", 8, F32, expert=True)]  # fmt: skip
    plan = zero3_plan(specs, [1, 1, 2, 2])
    assert [(g.expert, g.unit, g.members) for g in plan.groups] == [
        (False, 1, ((0, 1),)), (False, 2, ((0, 0),)), (True, 1, ((1, 1),)), (True, 2, ((1, 0),)),
    ]  # fmt: skip


def test_without_unit_of_param_the_whole_model_is_unit_zero() -> None:
    specs = [ParamSpec(f"p{i}", 10, F32) for i in range(3)]
    plan = zero3_plan(specs, None)
    assert [(g.unit, len(g.members)) for g in plan.groups] == [(0, 1)]


@pytest.mark.parametrize(
    "units, match",
    [
        pytest.param([0, 1], "got 2 for 3 params", id="length"),
        pytest.param([0, -1, 0], r"bad entries for \['p1'\]", id="negative"),
    ],
)
def test_bad_unit_of_param_is_named(units: list[int], match: str) -> None:
    specs = [ParamSpec(f"p{i}", 10, F32) for i in range(3)]
    with pytest.raises(ValueError, match=match):
        zero3_plan(specs, units)


def test_disable_bucketing_still_one_group_per_unit() -> None:
    specs = [ParamSpec(f"p{i}", 10, F32) for i in range(4)]
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=ZERO3)
    plan = build_plan(specs, config, dp_size=2, expt_dp_size=2, expert_shares_dp_group=True,
                      disable_bucketing=True, unit_of_param=[0, 1, 1, 2])  # fmt: skip
    assert [g.unit for g in plan.groups] == [0, 1, 2]
    assert plan.bucket_size is None and len(plan.buffers[0].layout.buckets) == 3


# ---- property tests -----------------------------------------------------------------------------

LEAF_KINDS = ("linear", "linear_nobias", "embedding", "vector")


@st.composite
def module_trees(draw: st.DrawFn) -> tuple[nn.Module, list[str]]:
    """A small tree of ModuleList / Sequential / custom containers over Linear / Embedding /
    vector leaves (every [4, 4] weight may be tied to another), some params frozen, maybe one
    module used twice. Returns the root and the kinds of leaves it drew."""
    leaves: list[nn.Module] = []

    def leaf() -> nn.Module:
        kind = draw(st.sampled_from(LEAF_KINDS))
        if kind == "embedding":
            m: nn.Module = nn.Embedding(4, 4)
        elif kind == "vector":
            m = _Vector(draw(st.integers(1, 70)))
        else:
            m = nn.Linear(4, 4, bias=kind == "linear")
        leaves.append(m)
        return m

    def node(depth: int) -> nn.Module:
        if depth >= 3 or draw(st.booleans()):
            return leaf()
        kids = [node(depth + 1) for _ in range(draw(st.integers(1, 3)))]
        kind = draw(st.sampled_from(("list", "seq", "custom")))
        if kind == "list":
            return nn.ModuleList(kids)
        if kind == "seq":
            return nn.Sequential(*kids)
        return _Container(kids, draw(st.booleans()))

    root = _Container([node(1) for _ in range(draw(st.integers(1, 3)))], draw(st.booleans()))
    square = [m for m in leaves if isinstance(m, (nn.Linear, nn.Embedding))]
    if len(square) >= 2:
        for _ in range(draw(st.integers(0, 2))):
            i, j = draw(st.tuples(*[st.integers(0, len(square) - 1)] * 2))
            square[j].weight = square[i].weight
    if leaves and draw(st.booleans()):
        root.add_module("again", leaves[draw(st.integers(0, len(leaves) - 1))])  # used twice
    for p in root.parameters():
        if draw(st.integers(0, 5)) == 0:
            p.requires_grad_(False)
    return root, [type(m).__name__ for m in leaves]


class _Vector(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.zeros(numel))


class _Container(nn.Module):
    def __init__(self, kids: Sequence[nn.Module], own_param: bool) -> None:
        super().__init__()
        for i, kid in enumerate(kids):
            self.add_module(f"k{i}", kid)
        if own_param:
            self.own = nn.Parameter(torch.zeros(3))


def _paths_of(model: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        out.setdefault(id(m), []).append(path)
    return out


def _encloses(unit_paths: Sequence[str], path: str) -> bool:
    return any(u == "" or path == u or path.startswith(u + ".") for u in unit_paths)


def _holder_paths(model: nn.Module, param: nn.Parameter) -> list[str]:
    return [path for path, m in model.named_modules(remove_duplicate=False)
            for _, p in m.named_parameters(recurse=False) if p is param]  # fmt: skip


@st.composite
def unit_choices(draw: st.DrawFn, model: nn.Module) -> list[str | type]:
    names = sorted({type(m).__name__ for m in model.modules()})
    paths = [p for p, _ in model.named_modules() if p]
    pool: list[str | type] = [*names, *paths]
    if "Linear" in names:
        pool.append(nn.Linear)
    return draw(st.lists(st.sampled_from(pool), max_size=4))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_param_in_exactly_one_unit_shared_ones_at_the_common_ancestor(data: Any) -> None:
    model, _ = data.draw(module_trees())
    entries = data.draw(unit_choices(model))
    named = trainable(model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_units(model, entries, named)
    except ValueError as exc:
        assert "splits shared param" in str(exc)
        assert _has_explicit_split(model, entries, named), str(exc)
        return
    assert not _has_explicit_split(model, entries, named)
    paths = _paths_of(model)
    assert plan.units[0].name == "" and plan.units[0].module is model
    assert plan.units[0].parent is None
    assert len({id(u.module) for u in plan.units}) == len(plan.units)  # used twice: one unit
    for u in plan.units[1:]:
        assert u.parent is not None and u.parent < u.index
        parent_paths = paths[id(plan.units[u.parent].module)]
        assert all(_encloses(parent_paths, p) for p in paths[id(u.module)] if p != "")
    # exactly one unit per trainable param, registration order inside a unit
    assert dict(plan.unit_of_param).keys() == {n for n, _ in named}
    flat = [n for u in plan.units for n in u.param_names]
    assert sorted(flat) == sorted(n for n, _ in named)
    order = [n for n, _ in named]
    for u in plan.units:
        assert list(u.param_names) == [n for n in order if plan.unit_of_param[n] == u.index]
    # the owner encloses every holder on every path; every unit doing so is an ancestor of it
    for name, p in named:
        holders = _holder_paths(model, p)
        owner = plan.unit_of_param[name]
        enclosing = [u.index for u in plan.units
                     if all(_encloses(paths[id(u.module)], h) for h in holders)]  # fmt: skip
        assert owner in enclosing
        assert set(enclosing) <= set(plan.ancestors(owner)), (name, holders, enclosing)


def _has_explicit_split(
    model: nn.Module, entries: Sequence[str | type], named: Sequence[tuple[str, nn.Parameter]]
) -> bool:
    """The rejection rule from paths alone: an entry that is a module path whose module itself
    registers a shared trainable param that some path of that module does not enclose."""
    paths = _paths_of(model)
    by_path = dict(model.named_modules(remove_duplicate=False))
    for entry in entries:
        if not isinstance(entry, str) or entry not in by_path:
            continue
        unit_paths = paths[id(by_path[entry])]
        for _, p in named:
            holders = _holder_paths(model, p)
            mine = any(by_path[h] is by_path[entry] for h in holders)
            if mine and not all(_encloses(unit_paths, h) for h in holders):
                return True
    return False


def _check_unit_aligned(plan: Plan, specs: Sequence[ParamSpec], units: Sequence[int]) -> None:
    """The unit-aligned invariants of [Note: unit-aligned plan]."""
    grouped: set[tuple[int, int]] = set()
    for buf in plan.buffers:
        unit_buckets: dict[int, list[int]] = {}
        for k in buf.layout.buckets:
            owners = {units[buf.param_ids[i]] for i in k.param_ids}
            assert len(owners) == 1, f"bucket {k.bucket_id} spans units {owners}"
            unit_buckets.setdefault(owners.pop(), []).append(k.bucket_id)
        for ids in unit_buckets.values():  # a unit's buckets (and so params) are contiguous
            assert ids == list(range(ids[0], ids[0] + len(ids)))
        ends = [k.start for k in buf.layout.buckets[1:]] + [buf.layout.numel]
        assert [k.end for k in buf.layout.buckets] == ends
        for k in buf.layout.buckets:  # shards cover each bucket exactly
            ranges = [k.shard_range(r, buf.dp_size) for r in range(buf.dp_size)]
            assert ranges[0][0] == k.start and ranges[-1][1] == k.end
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        covered = [0] * len(buf.param_ids)
        for r in range(buf.dp_size):
            for piece in shard_pieces(buf.layout, r, buf.dp_size):
                covered[piece.param_id] += piece.numel
        assert covered == [specs[i].numel for i in buf.param_ids]
    for g in plan.groups:  # one group per (kind, unit), holding all of that unit's buckets
        assert g.unit is not None
        want = [
            (b.index, k.bucket_id)
            for b in plan.buffers
            if b.expert == g.expert
            for k in b.layout.buckets
            if units[b.param_ids[k.param_ids[0]]] == g.unit
        ]
        assert list(g.members) == want
        grouped.update(g.members)
    kinds = {(g.expert, g.unit) for g in plan.groups}
    assert len(kinds) == len(plan.groups)
    assert kinds == {(s.expert, u) for s, u in zip(specs, units)}
    assert grouped == {(b.index, k.bucket_id) for b in plan.buffers for k in b.layout.buckets}
    assert sorted(g for chain in plan.chains for g in chain) == list(range(len(plan.groups)))


def _plans(
    specs: Sequence[ParamSpec], units: Sequence[int], strategy: str, dp: int, **cfg: Any
) -> tuple[Plan, Plan]:
    """The plan with `unit_of_param` and without it."""
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, **cfg)
    kw: dict[str, Any] = {"dp_size": dp, "expt_dp_size": dp, "expert_shares_dp_group": True}
    return build_plan(specs, config, unit_of_param=units, **kw), build_plan(specs, config, **kw)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_unit_aligned_plans_of_generated_models(data: Any) -> None:
    model, _ = data.draw(module_trees())
    named = trainable(model)
    entries = data.draw(
        unit_choices(model).filter(lambda e: not _has_explicit_split(model, e, named))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_units(model, entries, named)
    specs = param_specs(named)
    units = plan.unit_ids([n for n, _ in named])
    dp = data.draw(st.sampled_from([1, 2, 3, 4]))
    bucket = data.draw(st.sampled_from([None, 1, 20, 64, 200]))
    zero3, _ = _plans(specs, units, ZERO3, dp, bucket_size=bucket)
    _check_unit_aligned(zero3, specs, units)


@settings(max_examples=80, deadline=None)
@given(
    params=st.lists(
        st.tuples(
            st.integers(1, 300),  # numel
            st.sampled_from([F32, BF16]),
            st.booleans(),  # expert
            st.integers(0, 8).map(lambda x: x == 0),  # own bucket, now and then
            st.integers(0, 3),  # unit
        ),
        min_size=1,
        max_size=12,
    ),
    dp=st.sampled_from([1, 2, 3, 4, 8]),
    bucket=st.sampled_from([None, 1, 50, 128, 500]),
    fp32_grads=st.booleans(),
)
def test_unit_aligned_invariants_and_other_strategies_unchanged(
    params: list[tuple[int, torch.dtype, bool, bool, int]],
    dp: int,
    bucket: int | None,
    fp32_grads: bool,
) -> None:
    specs = [ParamSpec(f"p{i}", n, dt, expert=e, own_bucket=own)
             for i, (n, dt, e, own, _) in enumerate(params)]  # fmt: skip
    units = [u for *_, u in params]
    cfg = {"bucket_size": bucket, "grad_reduce_in_fp32": fp32_grads}
    zero3, zero3_default = _plans(specs, units, ZERO3, dp, **cfg)
    _check_unit_aligned(zero3, specs, units)
    _check_unit_aligned(zero3_default, specs, [0] * len(specs))
    for strategy in ("no_shard", "optim", "optim_grads"):
        with_units, without = _plans(specs, units, strategy, dp, **cfg)
        assert with_units == without  # unit_of_param is ignored: today's plan
        assert all(g.unit is None for g in without.groups) and without.unit_of_spec is None
    zero2, _ = _plans(specs, units, "optim_grads", dp, **cfg)
    assert zero2 == _plans(specs, units, "optim", dp, **cfg)[0]
    # one unit: the plain sharded layout
    optim, _ = _plans(specs, units, "optim", dp, **cfg)
    assert [b.layout for b in zero3_default.buffers] == [b.layout for b in optim.buffers]
    # units contiguous in registration order: params in plain reverse order
    contiguous = sorted(units)
    in_order, _ = _plans(specs, contiguous, ZERO3, dp, **cfg)
    _check_unit_aligned(in_order, specs, contiguous)
    for buf in in_order.buffers:
        placed = [buf.param_ids[i] for k in buf.layout.buckets for i in k.param_ids]
        assert placed == sorted(buf.param_ids, reverse=True)
