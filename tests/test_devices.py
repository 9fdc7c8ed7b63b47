"""[Note: allocation device] (megabuf/transport/devices.py): every tensor megabuf allocates is on
the device of the params it serves. Pure tests: the source of `megabuf/` is scanned with `ast` for
tensor factories called without `device=` and for CPU fallbacks, against a small allowlist of
places that are CPU by design; and `comm_device` / `params_device` are checked without a
process group."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import torch

from megabuf.transport.devices import comm_device, params_device

ROOT = Path(__file__).resolve().parent.parent / "megabuf"

# Factories that make a tensor from sizes or Python data: without `device=` they allocate on the
# CPU. `*_like`, `Tensor.new_*`, `.clone()` and arithmetic inherit their input's device and are
# not listed; `as_tensor` is, since its input is often a Python number.
FACTORIES = frozenset({
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "scalar_tensor", "arange",
    "linspace", "logspace", "eye", "empty_strided", "rand", "randn", "randint", "randperm",
})  # fmt: skip

# (file under megabuf/, enclosing function) -> why allocating on the CPU is right there.
FACTORY_ALLOWLIST = {
    # Checkpoint state is assembled on the host; the inner torch optimizer's load_state_dict
    # moves it to its params' device.
    ("optimizer/model_space.py", "assemble_range"): "host-side checkpoint assembly",
    ("checkpoint/dcp_state.py", "optimizer_template"): "DCP reads the saved state into host "
    "templates, moved to the params' device by load_state_dict as above",
    ("checkpoint/offline.py", "_empty"): "offline checkpoint conversion: no model, no device",
    ("checkpoint/offline.py", "_hook_empty"): "offline listing of comm hook state: no device",
    ("comm_hooks/lowrank_hook.py", "_next_seed"): "PowerSGD's seed stream is a CPU generator, "
    "so every rank and device type draws the same seeds",
    ("comm_hooks/lowrank_hook.py", "_random"): "Q is drawn on the CPU (the same values on "
    "every device type) and copied to the bucket's device by its caller",
    ("inspect.py", "_itemsize"): "a 0-element tensor read for its element size only",
    # Test and benchmark helpers build models and data on the CPU like any torch user code;
    # callers move them (`.to(device)`), and nothing here serves an existing param.
    ("testing/models.py", "*"): "test models and batches (CPU generators, moved by callers)",
    ("testing/corpus.py", "*"): "token corpus for tests and the demo (host data)",
    ("testing/moe.py", "moe_batch"): "test batches from a CPU generator",
    ("bench/reference.py", "*"): "benchmark sample indices, used on the host",
    ("bench/fp8_systems.py", "wire_element_nbytes"): "a 0-element tensor read for its element "
    "size only",
}

# CPU devices named in code (`torch.device("cpu")`, a "cpu" string) -> why.
CPU_ALLOWLIST = {
    (
        "pure/bucket_planner.py",
        "_solve",
    ): "the pure planner's DP over a few numbers per param: host "
    "arithmetic whatever device the grads are on",
    ("weights/stash.py", "release"): "offload's host copies: the host is the point (pinned on "
    "CUDA)",
    ("weights/publish.py", "receive"): "the consumer's landing buffers for the gloo publish "
    "group (weights travel through host memory)",
    ("transport/devices.py", "comm_device"): "the one fallback: gloo or no process group",
    ("optimizer/grad_scaler.py", "__init__"): "default of a scaler built standalone; "
    "build_optimizer passes the params' device and step() moves inv_scale to it",
    ("transport/torch_compat.py", "_check_devices"): "only compares the user's device_ids with the "
    "params' device; allocates nothing",
    ("testing/models.py", "*"): "seeded CPU generator for reproducible test data",
    ("testing/launch.py", "decode_result"): "spawn's rank results arrive in the parent as CPU "
    "tensors by value ([Note: rank results by value])",
    ("bench/systems.py", "*"): "benchmark systems, CPU by choice (see megabuf.bench)",
    ("bench/curves.py", "run_ranks"): "loss curves of the demo GPT on gloo ranks, CPU by choice",
    ("bench/fp8_curves.py", "_ranks"): "FP8 loss band of the demo GPT on gloo ranks, CPU by choice",
    ("bench/fp8_peers.py", "run_rounds"): "FP8 peers bench on gloo ranks, CPU by choice",
    ("bench/planner.py", "*"): "memory planner bench: megabuf and FSDP2 on gloo ranks, CPU by "
    "choice (the measured bytes are the host's)",
    ("bench/options.py", "build_parser"): "--device's default: CPU models and gloo on any "
    "machine unless --device cuda is asked for",
    ("bench/worker.py", "rank_device"): "the benchmark's own choice of device (--device)",
    ("optimizer/offload.py", "*"): "cpu_offload: main params, optimizer state and grad copies "
    "live on the host by definition ([Note: cpu offload])",
    ("optimizer/builder.py", "build_optimizer"): "cpu_offload: the inner optimizer steps the "
    "host copies, so its kernels are chosen for the CPU",
    (
        "transport/distributed_init.py",
        "init_distributed",
    ): "device='cpu' default: gloo for CPU models "
    "even where CUDA is visible (the caller says which device its model is on)",
}


def _calls(tree: ast.AST) -> Iterator[tuple[str, ast.Call]]:
    """(enclosing function name or "<module>", call) for every call in `tree`."""

    def walk(node: ast.AST, func: str) -> Iterator[tuple[str, ast.Call]]:
        for child in ast.iter_child_nodes(node):
            name = func
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            if isinstance(child, ast.Call):
                yield func, child
            yield from walk(child, name)

    yield from walk(tree, "<module>")


def _is_torch_factory(call: ast.Call) -> bool:
    f = call.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr in FACTORIES
        and isinstance(f.value, ast.Name)
        and f.value.id == "torch"
    )


def _names_cpu(call: ast.Call) -> bool:
    """`torch.device("cpu")`, or any call passing the literal "cpu"."""
    args = list(call.args) + [k.value for k in call.keywords]
    return any(isinstance(a, ast.Constant) and a.value == "cpu" for a in args)


def _cpu_defaults(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(function, line) of every parameter whose default is the string "cpu"."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            defaults = node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
            for d in defaults:
                if isinstance(d, ast.Constant) and d.value == "cpu":
                    yield node.name, d.lineno


def _allowed(allowlist: dict[tuple[str, str], str], path: str, func: str) -> bool:
    return (path, func) in allowlist or (path, "*") in allowlist


def _sources() -> Iterator[tuple[str, ast.AST]]:
    for file in sorted(ROOT.rglob("*.py")):
        yield file.relative_to(ROOT).as_posix(), ast.parse(file.read_text(), str(file))


def test_every_tensor_factory_names_a_device() -> None:
    offenders = [
        f"megabuf/{path}:{call.lineno} torch.{call.func.attr}(...) in {func}()"  # type: ignore[attr-defined]
        for path, tree in _sources()
        for func, call in _calls(tree)
        if _is_torch_factory(call)
        and not any(k.arg == "device" for k in call.keywords)
        and not _allowed(FACTORY_ALLOWLIST, path, func)
    ]
    assert not offenders, "allocations without device= (pass the params' device):\n" + "\n".join(
        offenders
    )


def test_no_cpu_fallbacks_outside_the_allowlist() -> None:
    offenders = []
    for path, tree in _sources():
        for func, call in _calls(tree):
            if _names_cpu(call) and not _allowed(CPU_ALLOWLIST, path, func):
                offenders.append(f"megabuf/{path}:{call.lineno} in {func}()")
        for func, line in _cpu_defaults(tree):
            if not _allowed(CPU_ALLOWLIST, path, func):
                offenders.append(f"megabuf/{path}:{line} default 'cpu' of {func}()")
    assert not offenders, (
        "CPU fallbacks (use megabuf.transport.devices.params_device):\n" + "\n".join(offenders)
    )


def test_allowlists_name_existing_functions() -> None:
    """A stale entry (function renamed or fixed) must be removed, so the lists stay small."""
    defined: dict[str, set[str]] = {}
    for path, tree in _sources():
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        defined[path] = names | {"*"}
    for path, func in [*FACTORY_ALLOWLIST, *CPU_ALLOWLIST]:
        assert func in defined.get(path, set()), f"stale allowlist entry megabuf/{path} {func}"


def test_params_device_follows_params_and_falls_back_to_the_group() -> None:
    meta = torch.empty(2, device="meta")
    assert params_device([meta], None) == torch.device("meta")
    assert params_device(iter([meta]), None) == torch.device("meta")  # any iterable, once
    # no params and no process group (or gloo): the CPU; NCCL would give the current GPU
    assert params_device([], None) == torch.device("cpu") == comm_device(None)
