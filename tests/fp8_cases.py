"""Rank-side code for the FP8 param tests (runs inside DistPool workers; [Note: FP8 params] in
megabuf/fp8/__init__.py).

The model is what a user converts with torchao (`convert_to_float8_training` with
`enable_fsdp_float8_all_gather=True`): two float8 linears (FP8 weights) with high precision
biases and a LayerNorm (mixed params). Each case trains it under a sharded strategy and reports
what the tests compare: every rank's gathered FP8 bytes and scales, the full fp32 master (put
together from every rank's shard), a single-process torchao model's cast of that master and its
forward on the same input, the calls and bytes the collectives were handed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import megabuf
from megabuf.fp8 import AMAX_OP, adapter_for, is_converted_fp8

DIM, HIDDEN, OUT, BATCH = 32, 64, 16, 16
FP8_NAMES = ("up.weight", "down.weight")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.down = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.norm(self.up(x))))


def float8_config(recipe: str = "tensorwise", fsdp: bool = True) -> Any:
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    return Float8LinearConfig.from_recipe_name(recipe)


def build_net(fsdp: bool = True, recipe: str = "tensorwise", seed: int = 0) -> nn.Module:
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(seed)
    net = Net()
    convert_to_float8_training(net, config=float8_config(recipe, fsdp))
    return net


def make_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, OUT, generator=g)


def local(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * n : (dist.get_rank() + 1) * n]


def wrap(
    strategy: str, net: nn.Module | None = None, **ddp: Any
) -> megabuf.DistributedDataParallel:
    cfg = megabuf.DistributedDataParallelConfig.from_dict(
        {"data_parallel_sharding_strategy": strategy, "bucket_size": 3000, **ddp}
    )
    return megabuf.DistributedDataParallel(build_net() if net is None else net, cfg)


def train(model: Any, opt: Any, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        x, y = make_data(step)
        opt.zero_grad()
        loss = ((model(local(x)) - local(y)) ** 2).mean()
        loss.backward()
        opt.step()


def fp8_parts(model: Any) -> dict[str, tuple[bytes, float]]:
    """Each FP8 param's bytes and scale as forward would read them (gathers waited for)."""
    out = {}
    with model.summon_full_params():
        for name, param in model.module.named_parameters():
            if is_converted_fp8(param):
                data, scale = adapter_for(param).parts(param)  # type: ignore[union-attr]
                out[name] = (data.view(torch.uint8).clone().numpy().tobytes(), float(scale))
    return out


def full_masters(opt: Any) -> dict[str, torch.Tensor]:
    """The fp32 master of every param, put together from every rank's shard."""
    mine = [(mp.key, mp.param_start, mp.param_end, mp.main.detach().reshape(-1).clone())
            for mp in opt.main_params]  # fmt: skip
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    shapes = {n: p.shape for n, p in opt.model_chunks[0].module.named_parameters()}
    flat: dict[str, torch.Tensor] = {}
    for pieces in everyone:
        for key, lo, hi, values in pieces:
            name = key.split(".", 1)[1] if key not in shapes else key
            flat.setdefault(name, torch.zeros(shapes[name].numel()))[lo:hi] = values
    return {n: t.view(shapes[n]) for n, t in flat.items()}


def torchao_cast(full: torch.Tensor) -> tuple[bytes, float]:
    """What single-process torchao makes of a full weight: its own dynamic tensorwise cast."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    cast = hp_tensor_to_float8_dynamic(
        full, torch.float8_e4m3fn, LinearMMConfig(), gemm_input_role=GemmInputRole.WEIGHT
    )
    return cast._data.view(torch.uint8).numpy().tobytes(), float(cast._scale)


def reference_forward(masters: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A single-process torchao model (weights cast by torchao in forward) holding the masters."""
    net = build_net(fsdp=False)
    with torch.no_grad():
        for name, param in net.named_parameters():
            param.copy_(masters[name])
    return net(x)


def reference_masters(steps: int) -> dict[str, torch.Tensor]:
    """The same training in one process on the global batch, torchao casting in forward."""
    net = build_net(fsdp=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        x, y = make_data(step)
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def numerics_case(strategy: str, steps: int = 3) -> dict[str, Any]:
    model = wrap(strategy)
    opt = megabuf.DistributedOptimizer(model, torch.optim.SGD, model.parameters(), lr=0.1)
    stats = model.engine.collectives.stats
    stats.reset()
    train(model, opt, steps)
    amax_calls = stats.calls.get(AMAX_OP, 0)
    gather_ring_nbytes = stats.ring_nbytes.get("all_gather", 0)
    parts = fp8_parts(model)
    masters = full_masters(opt)
    x, _ = make_data(999)
    with torch.no_grad():
        ours = model(x)
        ref_out = reference_forward(masters, x)
    buffers = [(str(b.param_dtype), str(b.grad_dtype), b.numel) for b in model.engine.buffers]
    ref = reference_masters(steps)
    return {
        "master_diff": max(float((masters[n] - ref[n]).abs().max()) for n in ref),
        "gather_ring_nbytes": gather_ring_nbytes,
        "expected_ring_nbytes": steps
        * sum(
            (dist.get_world_size() - 1) * b.numel * b.param_dtype.itemsize // dist.get_world_size()
            for b in model.engine.buffers
        ),
        "parts": parts,
        "torchao": {n: torchao_cast(masters[n]) for n in FP8_NAMES},
        "forward_equal": bool(torch.equal(ours, ref_out)),
        "forward_diff": float((ours - ref_out).abs().max()),
        "amax_calls": amax_calls,
        "steps": steps,
        "buffers": buffers,
        "types": {n: type(p).__name__ for n, p in model.module.named_parameters()},
    }


def refusal_case(kind: str) -> str:
    """Construct what is refused; the message (every rank raises alike, before a collective)."""
    strategy, net, ddp = "optim", None, {}
    if kind in ("rowwise", "rowwise_with_gw_hp"):
        net = build_net(fsdp=False, recipe=kind)
    cfg = megabuf.DistributedDataParallelConfig.from_dict(
        {"data_parallel_sharding_strategy": strategy, "bucket_size": 3000, **ddp}
    )
    try:
        megabuf.DistributedDataParallel(net if net is not None else build_net(), cfg)
    except ValueError as err:
        return str(err)
    return "not refused"


def no_shard_case(steps: int = 3) -> dict[str, Any]:
    """no_shard: the weights stay as torchao made them (cast in forward), as under torch DDP."""
    model = wrap("no_shard")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, steps)
    ref = reference_masters(steps)
    params = dict(model.module.named_parameters())
    return {
        "types": {n: type(p).__name__ for n, p in params.items()},
        "buffers": [str(b.param_dtype) for b in model.engine.buffers],
        "master_diff": max(float((params[n].detach() - ref[n]).abs().max()) for n in ref),
    }


def memory_case(strategy: str) -> dict[str, Any]:
    """This rank's memory report, the formula and the storage walk after two Adam steps."""
    from megabuf.sharding.formula import optimizer_spec, persistent_bytes
    from megabuf.sharding.walk import storage_walk

    model = wrap(strategy)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="adam", lr=1e-2))
    train(model, opt, 2)
    pgs = model.process_groups
    scratch = model.engine.collectives.strategy(pgs.dp, "cpu").reduce_scatter == "all_to_all"
    formula = persistent_bytes(
        model.engine.plan, strategy, optimizer_spec(opt.domains[0].optimizer),
        dp_rank=pgs.dp_rank, reduce_scatter_scratch=scratch,
    )  # fmt: skip
    fp8 = model.engine.buffers[0]
    return {
        "persistent": dict(opt.memory_report().persistent),
        "formula": formula,
        "walk": storage_walk(model, opt),
        "fp8_buffer": (str(fp8.param_dtype), fp8.numel, len(fp8.params)),
        "module_buffer_nbytes": sum(b.numel() * b.element_size() for b in model.module.buffers()),
    }


def _trainers() -> Any:
    """A publish group whose trainers are the model's dp ranks (the checks before FP8's)."""
    from types import SimpleNamespace

    return SimpleNamespace(trainers=tuple(range(dist.get_world_size())))


def unsupported_case(kind: str, root: str) -> str:
    """What FP8 params do not support yet is refused by name (the message), never wrong."""
    from megabuf.checkpoint import load_checkpoint, save_checkpoint
    from megabuf.weights import Publisher

    model = wrap("optim")
    acts = {
        "save_checkpoint": lambda: save_checkpoint(f"{root}/ckpt", model),
        "load_checkpoint": lambda: load_checkpoint(f"{root}/ckpt", model),
        "publisher": lambda: Publisher(model, _trainers()),  # type: ignore[arg-type]
    }
    try:
        acts[kind]()
    except ValueError as err:
        return str(err)
    return "not refused"


# ---- checkpoints ([Note: FP8 params in checkpoints]) -------------------------------------------
def adam(strategy: str, net: nn.Module | None = None) -> tuple[Any, Any]:
    model = wrap(strategy, net)
    return model, megabuf.DistributedOptimizer(model, torch.optim.Adam, model.parameters(), lr=1e-2)


def plain_net(seed: int = 1) -> nn.Module:
    """The same model without torchao: its weights are high precision params."""
    torch.manual_seed(seed)
    return Net()


def state(model: Any, opt: Any) -> tuple[dict[str, tuple[bytes, float]], dict[str, torch.Tensor]]:
    return fp8_parts(model), full_masters(opt)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def resume_case(strategy: str, root: str) -> dict[str, bool]:
    """Save after 2 Adam steps and take a third; a fresh model (other init) loads and takes the
    same third step: bytes, scales and masters bitwise those of the uninterrupted run."""
    from megabuf.checkpoint import load_checkpoint, save_checkpoint

    path = f"{root}/resume_{strategy}"
    model, opt = adam(strategy)
    train(model, opt, 2)
    save_checkpoint(path, model, opt)
    saved = state(model, opt)
    train(model, opt, 1, start=2)
    want = state(model, opt)
    model2, opt2 = adam(strategy, build_net(seed=1))
    load_checkpoint(path, model2, opt2)
    loaded = state(model2, opt2)
    train(model2, opt2, 1, start=2)
    got = state(model2, opt2)
    return {
        "loaded_bitwise": loaded[0] == saved[0] and same(loaded[1], saved[1]),
        "step_bitwise": got[0] == want[0] and same(got[1], want[1]),
        "changed": want[0] != saved[0],
    }


def cross_case(strategy: str, root: str) -> dict[str, bool]:
    """An FP8 model's checkpoint loads into the model without FP8 (no torchao), and a checkpoint
    of the model with torchao casting in forward loads into the FP8 model: the masters are the
    saved values bitwise, and the FP8 bytes torchao's cast of them."""
    from megabuf.checkpoint import load_checkpoint, save_checkpoint

    model, opt = adam(strategy)
    train(model, opt, 2)
    save_checkpoint(f"{root}/cross_fp8_{strategy}", model, opt)
    plain, plain_opt = adam(strategy, plain_net())
    load_checkpoint(f"{root}/cross_fp8_{strategy}", plain, plain_opt)
    to_plain = same(full_masters(plain_opt), full_masters(opt))
    hp, hp_opt = adam(strategy, build_net(fsdp=False, seed=2))
    train(hp, hp_opt, 2)
    save_checkpoint(f"{root}/cross_hp_{strategy}", hp, hp_opt)
    fp8, fp8_opt = adam(strategy, build_net(seed=3))
    load_checkpoint(f"{root}/cross_hp_{strategy}", fp8, fp8_opt)
    parts, masters = state(fp8, fp8_opt)
    casts = {n: torchao_cast(masters[n]) for n in FP8_NAMES}
    return {
        "to_plain": to_plain,
        "from_hp": same(masters, full_masters(hp_opt)),
        "bytes_are_casts": parts == casts,
    }


def reshard_save_case(strategy: str, root: str) -> dict[str, torch.Tensor]:
    """Train 2 steps and save at this dp size; the full masters (what the other dp loads)."""
    from megabuf.checkpoint import save_checkpoint

    model, opt = adam(strategy)
    train(model, opt, 2)
    save_checkpoint(f"{root}/reshard_{strategy}_dp{dist.get_world_size()}", model, opt)
    return full_masters(opt)


def reshard_load_case(strategy: str, root: str, saved_dp: int) -> dict[str, Any]:
    """Load a checkpoint saved at another dp size: the masters, the FP8 bytes and torchao's
    cast of the masters; then one step runs."""
    from megabuf.checkpoint import load_checkpoint

    model, opt = adam(strategy, build_net(seed=1))
    load_checkpoint(f"{root}/reshard_{strategy}_dp{saved_dp}", model, opt)
    parts, masters = state(model, opt)
    out = {"masters": masters, "parts": parts}
    out["torchao"] = {n: torchao_cast(masters[n]) for n in FP8_NAMES}
    train(model, opt, 1, start=2)
    return out


def hybrid_case(strategy: str, steps: int = 3) -> dict[str, Any]:
    """Two replicas of a shard group: the scales agreed over the shard group only; every rank's
    bytes and scales, torchao's cast of the masters, the trajectory."""
    model = wrap(strategy, num_distributed_optimizer_instances=2)
    opt = megabuf.DistributedOptimizer(model, torch.optim.SGD, model.parameters(), lr=0.1)
    train(model, opt, steps)
    parts, masters = state(model, opt)
    ref = reference_masters(steps)
    return {
        "parts": parts,
        "torchao": {n: torchao_cast(masters[n]) for n in FP8_NAMES},
        "master_diff": max(float((masters[n] - ref[n]).abs().max()) for n in ref),
    }


def buckets(model: Any) -> list[int]:
    """The number of buckets of each buffer."""
    return [len(b.layout.buckets) for b in model.engine.buffers]


def auto_case(strategy: str) -> dict[str, Any]:
    """bucket_size="auto": after 2 Adam steps the buffers are rebuilt on other bucket boundaries
    (the re-plan's own path, `engine.rebucket`), then 2 more steps; against a model on those
    boundaries from the start: bytes, scales and masters bitwise."""
    auto_cfg = {"bucket_size": "auto", "overlap_grad_reduce": True, "auto_bucket_warmup_steps": 99}
    other = wrap(strategy, bucket_size=10**6).engine.plan  # one bucket per buffer
    model = wrap(strategy, **auto_cfg)
    opt = megabuf.DistributedOptimizer(model, torch.optim.Adam, model.parameters(), lr=1e-2)
    before = (buckets(model), model.engine.buffers[0])
    train(model, opt, 2)
    model.engine.rebucket(other)
    train(model, opt, 2, start=2)
    fixed = wrap(strategy, overlap_grad_reduce=True)
    fixed.engine.rebucket(other)
    fixed_opt = megabuf.DistributedOptimizer(fixed, torch.optim.Adam, fixed.parameters(), lr=1e-2)
    train(fixed, fixed_opt, 4)
    got, want = state(model, opt), state(fixed, fixed_opt)
    return {
        # new buffers (ZeRO-3 buckets follow the shard units: the boundaries may stay)
        "moved": before[1] is not model.engine.buffers[0]
        and (strategy == "optim_grads_params" or before[0] != buckets(model)),
        "parts_bitwise": got[0] == want[0],
        "masters_bitwise": same(got[1], want[1]),
    }


def offload_case(strategy: str) -> dict[str, Any]:
    """offload / restore after 2 Adam steps: the FP8 bytes, scales and masters are released and
    come back bitwise, and the next step equals that of a model never offloaded."""
    from megabuf.weights import offload, restore

    model, opt = adam(strategy)
    twin, twin_opt = adam(strategy)
    train(model, opt, 2)
    train(twin, twin_opt, 2)
    before = state(model, opt)
    fp8 = next(b.fp8 for b in model.engine.buffers if b.fp8 is not None)
    report = offload(model, opt)
    released = fp8.masters[0].untyped_storage().nbytes() == 0
    restore(model, opt)
    restored = state(model, opt)
    train(model, opt, 1, start=2)
    train(twin, twin_opt, 1, start=2)
    got, want = state(model, opt), state(twin, twin_opt)
    return {
        "released": released and report.released_nbytes["main_params"] > 0,
        "restored_bitwise": restored[0] == before[0] and same(restored[1], before[1]),
        "step_bitwise": got[0] == want[0] and same(got[1], want[1]),
    }


def export_case(strategy: str) -> dict[str, Any]:
    """export_weights after 2 steps, both FP8 choices: "bytes" hands over each FP8 weight's
    bytes and scale as forward reads them; "dequantized" (bf16) is bytes / scale in bf16."""
    from megabuf.weights import export_weights

    model, opt = adam(strategy)
    train(model, opt, 2)
    parts = fp8_parts(model)
    raw = dict(
        pair for item in export_weights(model, optimizer=opt, fp8="bytes") for pair in item.named
    )
    deq = dict(
        pair
        for item in export_weights(model, optimizer=opt, fp8="dequantized", dtype=torch.bfloat16)
        for pair in item.named
    )
    bytes_ok, deq_ok = True, True
    for name, (data, scale) in parts.items():
        mine = raw[name].view(torch.uint8).numpy().tobytes()
        bytes_ok &= mine == data and float(raw[name + "_scale"]) == scale
        values = torch.frombuffer(bytearray(data), dtype=torch.float8_e4m3fn).float() / scale
        deq_ok &= torch.equal(deq[name].reshape(-1), values.to(torch.bfloat16))
    return {
        "bytes": bytes_ok,
        "dequantized": deq_ok,
        "dtypes": (str(raw[FP8_NAMES[0]].dtype), str(deq[FP8_NAMES[0]].dtype)),
        "names": sorted(raw) == sorted(set(deq) | {n + "_scale" for n in FP8_NAMES}),
    }


def expert_case(strategy: str) -> dict[str, Any]:
    """`down` expert-parallel (ep_size 2; every ep rank its own expert value): after 2 steps
    every rank's FP8 bytes and scales are torchao's cast of its full master, the expert's
    agreed over the expert shard group; the dense weight's bytes as every other rank's."""
    from moe_cases import groups

    from megabuf.fp8.masters import gather_by_kind

    net = build_net(seed=dist.get_rank())
    megabuf.mark_expert_parallel(net.down.parameters())
    cfg = megabuf.DistributedDataParallelConfig.from_dict(
        {"data_parallel_sharding_strategy": strategy, "bucket_size": 3000}
    )
    pgs = groups(ep_size=2)
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    opt = megabuf.DistributedOptimizer(model, torch.optim.SGD, model.parameters(), lr=0.1)
    train(model, opt, 2)
    parts = fp8_parts(model)
    fp8 = [b.fp8 for b in model.engine.buffers if b.fp8 is not None]
    full = gather_by_kind(fp8, model.engine.collectives, pgs.shard_group)
    names = {p: n for n, p in model.module.named_parameters()}
    casts = {names[p]: torchao_cast(t) for p, t in full.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, parts)
    return {
        "bytes_are_casts": parts == casts,
        "dense_equal": all(e["up.weight"] == parts["up.weight"] for e in everyone),
        "experts_differ": any(e["down.weight"] != parts["down.weight"] for e in everyone),
        "expert_buffers": sum(
            b.is_expert_parallel and b.fp8 is not None for b in model.engine.buffers
        ),
    }
