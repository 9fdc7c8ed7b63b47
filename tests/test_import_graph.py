"""The import graph of megabuf/ follows its layers: no module imports one of a higher layer,
and there are no import cycles, counting every import (module level, inside functions and under
TYPE_CHECKING alike: a type-only back edge is still a dependency a reader must follow).

[Note: import layers]
Lowest first; a module may import its own layer and those below:
    pure        layout, planning inputs and small records with no megabuf dependency
    plan        the config, the sharding strategy objects' users that stay pure (plan, formula)
    transport   the one collectives module, process groups, devices, replica checks
    hook_lib    the communication-hook library (contract, built-in hooks): tensors and
                collectives only, never the engine
    storage     buffers and the sharded grad / param storages and the unit runtime
    group       the bucket group (both lifecycles)
    engine      what the wrapper is made of: hooks, grads contract, backward-end sync, the
                grad sync object, NaN check, the comm-hook registry, the ZeRO-3 param units
    wrapper     ddp.py
    above       what takes wrapped models: finalize, optimizers, checkpoints, pipelines
    tools       benchmarks, test models, `megabuf inspect` and the CLI, the package root
A new module must be given a layer here (the test fails naming it).
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("pure", (
        "megabuf.sharding.strategies", "megabuf.collective_backends", "megabuf.layout",
        "megabuf.sharding.units",
        "megabuf.timeline", "megabuf.overlap", "megabuf.owners", "megabuf.sharding",
        "megabuf.sharding.ledger", "megabuf.sharding.walk", "megabuf.comm_hooks.lowrank",
        "megabuf.optimizer.grad_scaler", "megabuf.optimizer.implementation",
        "megabuf.optimizer.state_layout",
        "megabuf.pipeline.order", "megabuf.checkpoint.files", "megabuf.hybrid",
        "megabuf.config_fields", "megabuf.bucket_planner",
    )),
    ("plan", (
        "megabuf.config", "megabuf.plan", "megabuf.sharding.formula",
        "megabuf.sharding.memory_table", "megabuf.optimizer.config",
    )),
    ("transport", (
        "megabuf.collectives", "megabuf.comm_records", "megabuf.devices",
        "megabuf.process_groups", "megabuf.replicas", "megabuf.torch_compat",
        "megabuf.pipeline.p2p", "megabuf.model_plan", "megabuf.distributed_init",
        "megabuf.dist_autograd", "megabuf.worker_refs",
    )),
    ("hook_lib", ("megabuf.comm_hooks", "megabuf.comm_hooks.*")),
    ("storage", (
        "megabuf.buffer", "megabuf.sharding.grads", "megabuf.sharding.params",
        "megabuf.sharding.read_guard", "megabuf.sharding.units_runtime",
        "megabuf.sharding.replicate", "megabuf.sharding.replica_hooks", "megabuf.full_grads",
    )),
    ("group", (
        "megabuf.bucket_group", "megabuf.dispatch", "megabuf.grad_math", "megabuf.readiness",
        "megabuf.arrivals", "megabuf.reductions", "megabuf.param_gather",
    )),
    ("engine", (
        "megabuf.nan_check", "megabuf.microbatches", "megabuf.hooks", "megabuf.grads",
        "megabuf.backward_sync", "megabuf.hook_registry", "megabuf.sharding.param_units",
        "megabuf.sharding.unit_params", "megabuf.sharding.parts",
        "megabuf.sharding.unit_params", "megabuf.sharding.parts",
        "megabuf.grad_sync",
        "megabuf.param_sync", "megabuf.assembly", "megabuf.sharded_replan", "megabuf.engine",
        "megabuf.residency", "megabuf.autobucket", "megabuf.warmup", "megabuf.sparse_grads",
        "megabuf.pickling", "megabuf.wiring",
    )),
    ("wrapper", ("megabuf.ddp", "megabuf.join")),
    ("above", (
        "megabuf.finalize", "megabuf.reproducible", "megabuf.optimizer", "megabuf.optimizer.*",
        "megabuf.checkpoint", "megabuf.checkpoint.*", "megabuf.pipeline", "megabuf.pipeline.*",
        "megabuf.weights", "megabuf.weights.*",
    )),
    ("tools", (
        "megabuf", "megabuf.cli", "megabuf.inspect", "megabuf.bench", "megabuf.bench.*",
        "megabuf.testing", "megabuf.testing.*",
    )),
]  # fmt: skip


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
    hits = [i for i, (_, pats) in enumerate(LAYERS) for p in pats if fnmatch.fnmatch(module, p)]
    exact = [i for i, (_, pats) in enumerate(LAYERS) if module in pats]
    return (exact or hits or [-1])[0]


def test_every_module_has_a_layer() -> None:
    assert [m for m in sorted(_modules()) if _layer_of(m) < 0] == []


def test_no_module_imports_a_higher_layer() -> None:
    mods = _modules()
    back = []
    for name, path in sorted(mods.items()):
        for target in sorted(_imports(path, mods)):
            if _layer_of(target) > _layer_of(name):
                back.append(
                    f"{name} ({LAYERS[_layer_of(name)][0]}) -> {target} "
                    f"({LAYERS[_layer_of(target)][0]})"
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
RANK_OWNERS = ("megabuf.collectives", "megabuf.process_groups", "megabuf.bench", "megabuf.testing")


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
