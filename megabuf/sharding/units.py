"""Shard units: which modules' params are gathered and released together under ZeRO-3.

Pure: it sees a module tree, the `shard_units` entries and the trainable params (name, param),
never a process group, and returns a frozen `UnitPlan`. The planner (megabuf/planning/plan.py) turns
the plan's `unit_of_param` into unit-aligned buckets and one bucket group per unit.

[Note: shard units]
Under `data_parallel_sharding_strategy = "optim_grads_params"` a *unit* is a module whose params
are gathered before its forward/backward and released after; the wrapped module itself is always
unit 0, the root, named "".
- Entries of `shard_units`: a class (matches every module that is an instance of it, subclasses
  included); a string that is a dotted module path of the model ("blocks.0"; matches exactly that
  module, an *explicit* unit); any other string is a class name (matches modules whose
  `type(m).__name__` equals it). An entry that matches nothing raises naming it and listing the
  model's class names.
- Default policy (empty `shard_units`): the children of the largest `nn.ModuleList` /
  `nn.ModuleDict` / `nn.Sequential` (by trainable elements held) that has at least two children
  holding trainable params; without one, each direct child of the root that holds trainable
  params, where a container that has no forward of its own (`ModuleList`, `ModuleDict`: its
  parent calls its members) stands for its children and a `ParameterList` / `ParameterDict`
  (read by its parent) is no unit: a unit's params are gathered only around its forward. Why: the
  repeated blocks of a model (transformer layers, an MLP stack) sit in such a container, they
  are the natural gather granularity (coarse enough that per-unit hooks cost little, fine enough
  that the peak is a few blocks, not the model), and the largest container is the block list
  rather than a small stem or head that happens to be registered first. Children holding no
  trainable param are skipped (they would be empty units).
- Ownership: a param belongs to the lowest unit that encloses it. A param registered in several
  modules (tied embeddings), or in a module reachable under several paths (a module used twice),
  belongs to the lowest unit that encloses *every* holder on *every* path: their lowest common
  ancestor, the root if need be. The root owns what no other unit encloses. A module reachable
  under several paths is one unit (named by its first path), whose parent is the lowest unit
  enclosing it on every path.
- Rejected: an explicit unit (named by path) whose module itself registers a shared trainable
  param that another module outside the unit also registers (e.g. naming "lm_head" when its
  weight is tied to "tok_emb"). Naming exactly the module that holds the param places it there,
  and the ownership rule would silently move it to the common ancestor instead: the unit set
  "splits" the param, and the error names both modules. Everywhere else the ownership rule
  applies without complaint: units matched by class, and explicit units that only *contain* a
  holder (naming containers "a" and "b" that share a child module sends its params to the
  common ancestor of "a" and "b").
- Warned (`UserWarning`): a unit set where one unit owns every trainable param (e.g. only the
  root), since that unit's gathered params are a full param copy, the peak ZeRO-3 exists to avoid.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from torch import nn


@dataclass(frozen=True)
class Unit:
    """One shard unit: a module whose owned params are gathered and released together."""

    index: int  # position in UnitPlan.units
    name: str  # dotted module path (first path if several); "" for the root (the wrapped module)
    module: nn.Module
    param_names: tuple[str, ...]  # trainable params this unit OWNS, registration order
    parent: int | None  # index of the enclosing unit (None for the root)


@dataclass(frozen=True)
class UnitPlan:
    """The units of one wrapped module; see [Note: shard units]."""

    units: tuple[Unit, ...]  # units[0] is always the root unit ""; parents before children
    unit_of_param: Mapping[str, int]  # every trainable param name -> owning unit index

    def unit_ids(self, param_names: Sequence[str]) -> tuple[int, ...]:
        """The owning unit of each named param (what `build_plan(unit_of_param=...)` takes)."""
        return tuple(self.unit_of_param[name] for name in param_names)

    def ancestors(self, index: int) -> tuple[int, ...]:
        """Unit `index` and its enclosing units, innermost first, ending at the root (0)."""
        chain = [index]
        while (parent := self.units[chain[-1]].parent) is not None:
            chain.append(parent)
        return tuple(chain)

    def describe(self) -> str:
        """One line per unit: index, name, class, parent, owned params and their elements."""
        root = self.units[0].module
        lines = [f"{len(self.units)} shard units (owned trainable params):"]
        for unit in self.units:
            numel = sum(root.get_parameter(n).numel() for n in unit.param_names)
            where = "root" if unit.parent is None else f"in unit {unit.parent}"
            names = ", ".join(unit.param_names[:4]) + (", ..." if len(unit.param_names) > 4 else "")
            lines.append(
                f"  unit {unit.index} {unit.name or '<root>'} ({type(unit.module).__name__}, "
                f"{where}): {_count(len(unit.param_names), 'param')}, {numel:,} elements"
                + (f": {names}" if names else "")
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def plan_units(
    module: nn.Module,
    shard_units: Sequence[str | type],
    trainable: Sequence[tuple[str, nn.Parameter]],
) -> UnitPlan:
    """The units of `module` for `shard_units` (see [Note: shard units]); `trainable` are the
    (name, param) pairs the engine shards, names as `module.named_parameters()` gives them."""
    tree = _Tree(module)
    if shard_units:
        chosen, explicit = _resolve_entries(tree, shard_units)
    else:
        chosen, explicit = _default_units(tree, {id(p) for _, p in trainable}), set()
    modules = _unit_modules(tree, chosen)
    index = {id(m): i for i, m in enumerate(modules)}
    owner = {name: _owner(tree, index, name, p) for name, p in trainable}
    _reject_splits(tree, index, explicit, trainable, modules)
    owned: list[list[str]] = [[] for _ in modules]
    for name, _ in trainable:
        owned[owner[name]].append(name)
    units = tuple(
        Unit(i, tree.first_path[id(m)], m, tuple(owned[i]), _parent(tree, index, m) if i else None)
        for i, m in enumerate(modules)
    )
    plan = UnitPlan(units, MappingProxyType(owner))
    _warn_one_unit(plan, len(trainable), shard_units)
    return plan


class _Tree:
    """Every path of every module (a module used twice has several) and who holds each param."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.paths = list(root.named_modules(remove_duplicate=False))  # preorder
        self.by_path = dict(self.paths)
        self.first_path: dict[int, str] = {}
        self.all_paths: dict[int, list[str]] = {}
        self.holders: dict[int, list[str]] = {}  # id(param) -> paths of modules registering it
        for path, m in self.paths:
            self.first_path.setdefault(id(m), path)
            self.all_paths.setdefault(id(m), []).append(path)
            for _, p in m.named_parameters(recurse=False, remove_duplicate=False):
                self.holders.setdefault(id(p), []).append(path)

    def chain(self, path: str) -> list[nn.Module]:
        """The modules from the root down to (and including) the one at `path`."""
        parts = path.split(".") if path else []
        return [self.by_path[".".join(parts[:k])] for k in range(len(parts) + 1)]

    def units_on(self, path: str, index: Mapping[int, int]) -> list[int]:
        """Unit indices along the chain of `path`, outermost (the root) first."""
        return [index[id(m)] for m in self.chain(path) if id(m) in index]


def _resolve_entries(
    tree: _Tree, entries: Sequence[str | type]
) -> tuple[list[nn.Module], set[int]]:
    """Modules matched by `shard_units` entries, and the ids of those named by path."""
    chosen: list[nn.Module] = []
    explicit: set[int] = set()
    for entry in entries:
        matched: list[nn.Module]
        if isinstance(entry, type):
            matched = [m for _, m in tree.paths if issubclass(type(m), entry)]
        elif entry in tree.by_path:
            matched = [tree.by_path[entry]]
            explicit.add(id(matched[0]))
        else:
            matched = [m for _, m in tree.paths if type(m).__name__ == entry]
        if not matched:
            classes = sorted({type(m).__name__ for _, m in tree.paths})
            what = (
                f"no module is an instance of {entry.__name__}" if isinstance(entry, type)
                else f"it is neither a dotted module path (e.g. {tree.paths[-1][0]!r}) nor a "
                "class name of one of its modules"
            )  # fmt: skip
            raise ValueError(
                f"megabuf: DistributedDataParallelConfig.shard_units entry {entry!r} matches no "
                f"module of the wrapped {type(tree.root).__name__}: {what}; its module classes "
                f"are {classes}. Fix the entry or drop it"
            )
        chosen.extend(matched)
    return chosen, explicit


def _default_units(tree: _Tree, trainable_ids: set[int]) -> list[nn.Module]:
    """The default policy of [Note: shard units]."""

    def held(m: nn.Module) -> int:
        return sum(p.numel() for p in m.parameters() if id(p) in trainable_ids)

    best: list[nn.Module] = []
    best_numel = 0
    for _, m in tree.paths:
        if not isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        kids = [c for c in m.children() if held(c) > 0]
        if len(kids) >= 2 and held(m) > best_numel:
            best, best_numel = kids, held(m)
    if best:
        return best
    out: list[nn.Module] = []
    for child in tree.root.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # no forward: its parent calls
            out.extend(c for c in child.children() if held(c) > 0)
        elif held(child) > 0 and not isinstance(child, (nn.ParameterList, nn.ParameterDict)):
            out.append(child)
    return out


def _unit_modules(tree: _Tree, chosen: Sequence[nn.Module]) -> list[nn.Module]:
    """The root, then every chosen module once, in first-path preorder."""
    wanted = {id(m) for m in chosen}
    out = [tree.root]
    seen = {id(tree.root)}
    for _, m in tree.paths:
        if id(m) in wanted and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


def _lowest_common(chains: Sequence[Sequence[int]]) -> int:
    """The deepest unit present on every chain (each chain starts at the root, 0)."""
    common = set(chains[0]).intersection(*chains[1:])
    return [u for u in chains[0] if u in common][-1]


def _owner(tree: _Tree, index: Mapping[int, int], name: str, param: nn.Parameter) -> int:
    holders = tree.holders.get(id(param))
    if not holders:
        raise ValueError(
            f"megabuf: trainable param {name!r} is not registered in any module of the wrapped "
            f"{type(tree.root).__name__}; pass the params of the module being planned"
        )
    return _lowest_common([tree.units_on(h, index) for h in holders])


def _parent(tree: _Tree, index: Mapping[int, int], m: nn.Module) -> int:
    return _lowest_common([tree.units_on(p, index)[:-1] for p in tree.all_paths[id(m)]])


def _reject_splits(
    tree: _Tree,
    index: Mapping[int, int],
    explicit: set[int],
    trainable: Sequence[tuple[str, nn.Parameter]],
    modules: Sequence[nn.Module],
) -> None:
    """An explicit unit that registers a shared param must enclose every other holder of it
    ([Note: shard units])."""
    if not explicit:
        return
    for name, p in trainable:
        holders = tree.holders.get(id(p), [])
        if len(holders) < 2:
            continue
        for m in modules:
            if id(m) not in explicit or all(tree.by_path[h] is not m for h in holders):
                continue
            inside = [index[id(m)] in tree.units_on(h, index) for h in holders]
            if not all(inside):
                held = tree.first_path[id(m)] or "<root>"
                out = holders[inside.index(False)] or "<root>"
                raise ValueError(
                    f"megabuf: shard unit {tree.first_path[id(m)]!r} (named by path in "
                    f"DistributedDataParallelConfig.shard_units) splits shared param {name!r}: "
                    f"it is registered in module {held!r} and in module {out!r} outside that "
                    "unit, and a param is gathered by one unit only. Name a module enclosing "
                    "both, name the units by class (the param then goes to their lowest common "
                    "ancestor), or untie the param"
                )


def _warn_one_unit(plan: UnitPlan, n_trainable: int, shard_units: Sequence[str | type]) -> None:
    if not n_trainable:
        return
    for unit in plan.units:
        if len(unit.param_names) == n_trainable:
            what = f"shard_units={list(shard_units)!r}" if shard_units else "the default policy"
            warnings.warn(
                f"megabuf: {what} puts every trainable param in one shard unit "
                f"({unit.name or '<root>'}, {type(unit.module).__name__}): under "
                "optim_grads_params its gathered params are a full param copy, the peak ZeRO-3 "
                "avoids; set DistributedDataParallelConfig.shard_units to the repeated blocks "
                "(e.g. the transformer block class)",
                UserWarning,
                stacklevel=3,
            )
            return
