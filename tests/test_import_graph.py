"""The import graph of megabuf/ follows its layers: no module imports one of a higher layer,
and there are no import cycles, counting every import (module level, inside functions and under
TYPE_CHECKING alike: a type-only back edge is still a dependency a reader must follow).

[Note: import layers]
The folder a module is in is its layer: each package directly under megabuf/ is one layer, and
the few modules users import or run by name stay in megabuf/ itself, each its own layer.
`LAYERS` is the order, lowest first; a module may import its own layer and those below:
    pure/         layout math and the small records the config and the plan are made from
    config.py     `DistributedDataParallelConfig` (user-facing)
    transport/    every torch.distributed call, process groups and topology, devices
    fp8/          FP8 params: the adapters, the conversion, the buffer part, the scale agreement
    planning/     the one planner, `plan_model`, the replica checks and param markers
    comm_hooks/   the communication-hook library: tensors and collectives, never the engine
    sharding/     ZeRO's grad and param storages and unit runtime (and see below)
    buckets/      the contiguous buffers and the bucket groups (both lifecycles)
    sync/         the grad sync, the param side, the hooks and the parts they drive
    replan/       bucket_size = "auto": warm-up, agreed plan, rebuild
    core/         `assemble`, the `Engine` and its `Wiring`, what acts on it whole (pickling, join)
    ddp.py        `DistributedDataParallel` (user-facing)
    optimizer/, training/, pipeline/, checkpoint/, weights/, ft/: what takes wrapped models
    __init__.py   the package root: what a training script calls (user-facing)
    testing/, bench/, inspect.py, cli.py: tools (test models, benchmarks, `megabuf inspect`)
A new package, or a new module in megabuf/ itself, must be given a place in `LAYERS` (the test
fails naming it); .ci/relayer.py moves modules into their layer's folder.

One package is a feature, not a layer: `sharding/` holds everything specific to a sharding
strategy (the strategy objects, the memory formula, ZeRO-2's grad and ZeRO-3's param storages,
ZeRO-3's units and param side), so that a newcomer finds a strategy in one folder. Its modules sit
on the layers of what they are, each placed by `SHARDING_LAYERS` (a new module there fails until
it is placed): the strategies are pure (the config resolves them), the formula plans, the
storages sit below the buckets, the ZeRO-3 param side beside the syncs.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS: list[str] = [
    "megabuf.pure",
    "megabuf.config",
    "megabuf.transport",
    "megabuf.fp8",
    "megabuf.planning",
    "megabuf.comm_hooks",
    "megabuf.sharding",
    "megabuf.buckets",
    "megabuf.sync",
    "megabuf.replan",
    "megabuf.core",
    "megabuf.ddp",
    "megabuf.optimizer",
    "megabuf.training",
    "megabuf.pipeline",
    "megabuf.checkpoint",
    "megabuf.weights",
    "megabuf.ft",
    "megabuf",
    "megabuf.testing",
    "megabuf.bench",
    "megabuf.inspect",
    "megabuf.cli",
]


SHARDING_LAYERS: dict[str, str] = {
    "megabuf.sharding": "megabuf.pure",
    "megabuf.sharding.strategies": "megabuf.pure",
    "megabuf.sharding.ledger": "megabuf.pure",
    "megabuf.sharding.walk": "megabuf.pure",
    "megabuf.sharding.units": "megabuf.pure",
    "megabuf.sharding.formula": "megabuf.planning",
    "megabuf.sharding.memory_table": "megabuf.planning",
    "megabuf.sharding.grads": "megabuf.sharding",
    "megabuf.sharding.params": "megabuf.sharding",
    "megabuf.sharding.read_guard": "megabuf.sharding",
    "megabuf.sharding.units_runtime": "megabuf.sharding",
    "megabuf.sharding.replicate": "megabuf.sharding",
    "megabuf.sharding.replica_hooks": "megabuf.sharding",
    "megabuf.sharding.parts": "megabuf.sync",
    "megabuf.sharding.param_units": "megabuf.sync",
    "megabuf.sharding.unit_params": "megabuf.sync",
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (REPO / "megabuf").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """Every megabuf module `path` imports, anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megabuf"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in mods else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("megabuf"))
    return out


def _layer_of(module: str) -> int:
    """The index in LAYERS of `module`'s folder (in megabuf/ itself: of the module); -1: none."""
    if module.startswith("megabuf.sharding"):
        placed = SHARDING_LAYERS.get(module)
        return LAYERS.index(placed) if placed else -1
    parts = module.split(".")
    top = ".".join(parts[:2])
    return LAYERS.index(top) if top in LAYERS else -1


def test_every_module_has_a_layer() -> None:
    """A module outside the layer folders, other than the user-facing ones, fails by name."""
    assert [m for m in sorted(_modules()) if _layer_of(m) < 0] == []


def test_every_layer_names_an_existing_folder_or_module() -> None:
    mods = _modules()
    assert [layer for layer in LAYERS if layer not in mods] == []


def test_user_facing_modules_in_the_root_are_files_and_layers_are_folders() -> None:
    root = REPO / "megabuf"
    wrong = []
    for layer in [layer for layer in LAYERS if layer != "megabuf"]:
        name = layer.removeprefix("megabuf.")
        if not ((root / name).is_dir() or (root / f"{name}.py").is_file()):
            wrong.append(layer)
    assert wrong == []


def test_no_module_imports_a_higher_layer() -> None:
    mods = _modules()
    back = []
    for name, path in sorted(mods.items()):
        for target in sorted(_imports(path, mods)):
            if _layer_of(target) > _layer_of(name):
                back.append(
                    f"{name} ({LAYERS[_layer_of(name)]}) -> {target} ({LAYERS[_layer_of(target)]})"
                )
    assert back == []


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {name: _imports(path, mods) - {name} for name, path in mods.items()}
    # a package's __init__ importing its own submodules is how packages re-export: not a cycle
    for name in graph:
        graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []


RANK_CALLS = {"get_rank", "get_world_size", "get_global_rank"}
RANK_OWNERS = (
    "megabuf.transport.collectives",
    "megabuf.transport.process_groups",
    "megabuf.bench",
    "megabuf.testing",
)


def test_only_the_collectives_and_process_group_modules_ask_for_ranks_and_sizes() -> None:
    """[Note: rank order] in process_groups.py: ranks and sizes come from `Topology` (or
    `Collectives.rank` / `.size` for an arbitrary group); the benchmark and test-model tools
    may ask torch.distributed themselves."""
    calls = []
    for name, path in sorted(_modules().items()):
        if name.startswith(RANK_OWNERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in RANK_CALLS:
                calls.append(f"{name}:{node.lineno} .{node.attr}")
    assert calls == []
