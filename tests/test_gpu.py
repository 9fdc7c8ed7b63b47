"""GPU tier: the same engine on NCCL (native reduce-scatter / all-gather, AVG, CUDA tensors),
`init_distributed(device="cuda")`, a mixed gloo/NCCL group, and the GPT example and the
benchmark with `--device cuda`. Skipped without CUDA devices (the grad cases need two; the
others run on min(2, GPUs) ranks). None of these has run yet: no GPU machine so far."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import megabuf
from megabuf.pure.layout import shard_pieces
from megabuf.pure.overlap import analyze
from megabuf.testing import spawn
from megabuf.transport.collective_backends import BACKEND_STRATEGIES
from megabuf.transport.collectives import Collectives

REPO = Path(__file__).resolve().parent.parent
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD = max(1, min(2, GPUS))  # ranks of the cases that run on one GPU too

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason="needs CUDA for NCCL (no CUDA device on this machine)"),
]
needs_2_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"needs 2 CUDA devices for NCCL ({GPUS} on this machine)"
)


def nccl_grads(flags: dict[str, Any]) -> float:
    """Max |megabuf grad - one-process grad| on CUDA over NCCL."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    net = net.cuda()
    ref = copy.deepcopy(net)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).cuda()
    ref(x).square().mean().backward()
    model = megabuf.DistributedDataParallel(net, megabuf.DistributedDataParallelConfig(**flags))
    n = x.shape[0] // dist.get_world_size()
    model(x[dist.get_rank() * n : (dist.get_rank() + 1) * n]).square().mean().backward()
    model.finish_grad_sync()
    names = dict(ref.named_parameters())
    worst = 0.0
    for buf in model.buffers:
        if buf.param_data is None:
            for p in buf.params:
                want = names[model.engine.param_to_name[p]].grad
                worst = max(worst, (p.main_grad - want).abs().max().item())
            continue
        for piece in shard_pieces(buf.layout, buf.dp_rank, buf.dp_size):
            p = buf.params[piece.param_id]
            got = buf.grad_data[piece.buffer_start : piece.buffer_start + piece.numel]
            want = names[model.engine.param_to_name[p]].grad.flatten()[
                piece.param_start : piece.param_end
            ]
            worst = max(worst, (got - want).abs().max().item())
    return worst


@needs_2_gpus
@pytest.mark.parametrize(
    "flags",
    [
        {"overlap_grad_reduce": True, "bucket_size": 1000},
        {"overlap_grad_reduce": True, "average_in_collective": True},
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
    ],
)
def test_nccl_grads_match_reference(flags: dict[str, Any]) -> None:
    from conftest import get_pool

    for worst in get_pool(2, backend="nccl").run(nccl_grads, flags):
        assert worst <= 1e-5


def reduce_scatter_on(coll: Collectives, group: Any, device: torch.device) -> dict[str, Any]:
    """Rank side: average-reduce-scatter rank-scaled aranges on `device`, all-gather the shards
    back; the errors against the values worked out by hand and the bytes handed over."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    coll.stats.reset()
    x = torch.arange(4 * size, dtype=torch.float32, device=device) * (rank + 1)
    shard = torch.empty(4, device=device)
    coll.reduce_scatter(shard, x, group, average=True, async_op=False)
    full = torch.empty(4 * size, device=device)
    coll.all_gather(full, shard, group, async_op=False)
    mean = torch.arange(4 * size, dtype=torch.float32) * (size + 1) / 2  # mean of rank + 1
    return {
        "strategy": coll.strategy(group, device),
        "shard_error": float((shard.cpu() - mean[4 * rank : 4 * (rank + 1)]).abs().max()),
        "gather_error": float((full.cpu() - mean).abs().max()),
        "landing_nbytes": coll.stats.output_nbytes["reduce_scatter"],
    }


def cuda_init_run() -> dict[str, Any]:
    """Rank side: init_distributed(device='cuda'), then collectives on this rank's GPU."""
    pgs = megabuf.init_distributed(device="cuda")
    gpu = torch.device("cuda", torch.cuda.current_device())
    return {
        "config": dist.get_backend_config(),
        "current": torch.cuda.current_device(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        **reduce_scatter_on(Collectives(), pgs.dp, gpu),
    }


def test_init_distributed_cuda_binds_local_rank_and_uses_nccl() -> None:
    for rank, res in enumerate(spawn(cuda_init_run, WORLD, timeout_s=300)):
        assert res["config"] == "cuda:nccl", rank
        assert res["current"] == res["local_rank"] == rank
        assert res["strategy"] == BACKEND_STRATEGIES["nccl", "cuda"], rank
        assert res["shard_error"] == 0.0 and res["gather_error"] == 0.0, (rank, res)
        assert res["landing_nbytes"] == 4 * 4, rank  # native: into the shard, no scratch


def mixed_backend_run() -> dict[str, Any]:
    """Rank side: one group, gloo for CPU tensors and NCCL for CUDA tensors."""
    pgs = megabuf.init_distributed(device="cuda", backend="cpu:gloo,cuda:nccl")
    coll, gpu = Collectives(), torch.device("cuda", torch.cuda.current_device())
    cpu = reduce_scatter_on(coll, pgs.dp, torch.device("cpu"))
    return {
        "config": dist.get_backend_config(),
        "cpu": cpu,
        "cuda": reduce_scatter_on(coll, pgs.dp, gpu),
    }


def test_mixed_backend_serves_each_device_with_its_strategy() -> None:
    for rank, res in enumerate(spawn(mixed_backend_run, WORLD, timeout_s=300)):
        assert res["config"] == "cpu:gloo,cuda:nccl", rank
        cpu, cuda = res["cpu"], res["cuda"]
        assert cpu["strategy"] == BACKEND_STRATEGIES["gloo", "cpu"], rank
        assert cuda["strategy"] == BACKEND_STRATEGIES["nccl", "cuda"], rank
        assert cpu["landing_nbytes"] == 4 * WORLD * 4, rank  # all-to-all scratch of the input
        assert cuda["landing_nbytes"] == 4 * 4, rank
        for res_dev in (cpu, cuda):
            assert res_dev["shard_error"] == 0.0 and res_dev["gather_error"] == 0.0, (rank, res)


def _run(argv: list[str], timeout_s: int = 300) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (argv, proc.returncode, output[-4000:])
    return output


@pytest.mark.parametrize("config", ["ddp_overlap", "distopt_overlap"])
def test_train_gpt_example_on_cuda_passes_its_check(config: str) -> None:
    output = _run([
        "examples/train_gpt.py", "--device", "cuda", "--world-size", str(WORLD), "--steps", "3",
        "--config", f"configs/{config}.toml", "--check",
    ])  # fmt: skip
    assert "device cuda, backend cuda:nccl" in output, output[-4000:]
    assert re.search(r"check vs 1 process: .* -> OK", output), output[-4000:]


def test_bench_quick_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    systems = "no_comm,torch_ddp_gabv,fsdp2_reshard,megabuf_ar_overlap,megabuf_distopt_overlap"
    output = _run([
        "-m", "megabuf.bench", "--quick", "--device", "cuda", "--world-size", str(WORLD),
        "--models", "gpt_tiny:2", "--systems", systems, "--out", str(out),
    ])  # fmt: skip
    assert "megabuf collectives on nccl (cuda tensors): reduce-scatter = native" in output
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert {r["system"] for r in rows} == set(systems.split(",")), rows
    for row in rows:
        assert row["status"] == "ok", row
        assert row["peak_cuda_bytes"] > row["state_formula_bytes"] > 0, row
        assert row["tokens_per_s"] > 0, row
    assert "peak CUDA MiB" in output and "state formula MiB" in output, output[-4000:]
    for name in ("megabuf_ar_overlap", "megabuf_distopt_overlap"):
        overlap = next(r for r in rows if r["system"] == name)["overlap"]
        assert overlap["steps"] == 2 and overlap["median_exposed_ms"] >= 0.0, overlap


# ---- the overlap report on CUDA ([Note: timeline on CUDA]) ---------------------------------
SLEEP_CYCLES = 20_000_000  # torch.cuda._sleep: ~10 ms at ~2 GHz


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward keeps the compute stream busy (stands in for a large layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(SLEEP_CYCLES)
        return grad


class _WaitOnEvent:
    """A work handle whose wait() makes the current stream wait for `event`, as NCCL's does."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class _SlowCollectives(Collectives):
    """Every all-reduce also keeps a side stream busy for SLEEP_CYCLES / 2 after its dispatch:
    a slow network on any number of GPUs, one at a time, like one communicator."""

    def __init__(self) -> None:
        super().__init__()
        self.stream = torch.cuda.Stream()

    def all_reduce(self, tensor: torch.Tensor, group: Any, **kwargs: Any) -> Any:
        pending = super().all_reduce(tensor, group, **kwargs)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(SLEEP_CYCLES // 2)
            done = torch.cuda.Event()
            done.record()
        pending.handles.append(_WaitOnEvent(done))
        return pending


def exposed_comm_run(overlap: bool) -> dict[str, Any]:
    """Rank side: 4 layers, one bucket group each, slow backward and slow communication; the
    overlap report of 4 steps after the learning step."""
    megabuf.init_distributed(device="cuda")
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), _Slow()]
    net = torch.nn.Sequential(*layers).cuda()
    cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=256 * 257)
    model = megabuf.DistributedDataParallel(net, cfg, collectives=_SlowCollectives())
    x = torch.randn(32, 256, device="cuda")
    timeline = None
    for step in range(5):
        if step == 1:
            timeline = model.enable_timeline()
        model.zero_grad_buffer()
        model(x).square().mean().backward()
        model.finish_grad_sync()
    if timeline is None:
        raise RuntimeError("no timeline")
    report = analyze(timeline.events)
    return {"on_device": timeline.on_device, "groups": len(model.engine.all_bucket_groups),
            **report.to_dict()}  # fmt: skip


class _Slow(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)


def test_cuda_timeline_reports_exposed_communication_and_less_with_overlap() -> None:
    sync = spawn(exposed_comm_run, WORLD, False, timeout_s=300)
    overlapped = spawn(exposed_comm_run, WORLD, True, timeout_s=300)
    for rank, (s, o) in enumerate(zip(sync, overlapped, strict=True)):
        assert s["on_device"] and o["on_device"], rank
        assert s["groups"] == o["groups"] == 4 and s["steps"] == o["steps"] == 4, (s, o)
        # without overlap all four slow all-reduces (~5 ms each) run after backward: host
        # clocks would see ~0 (NCCL's wait() returns at enqueue), CUDA events see them
        assert s["median_exposed_ms"] > 5.0, s
        assert o["median_dispatched_before_backward_end"] >= 3, o
        # overlapped, each hides behind the next layer's slow backward but the last one
        assert o["median_exposed_ms"] < 0.6 * s["median_exposed_ms"], (s, o)


# ---- optimizer implementations on CUDA ([Note: optimizer implementation]) ------------------
def _installed(package: str) -> bool:
    from megabuf.optimizer.builder import importable_packages

    return package in importable_packages()


def cuda_implementation_run(implementation: str, name: str) -> dict[str, Any]:
    """Rank side: `build_optimizer` with `implementation` on a CUDA model, 3 steps; the class
    and kernel flags it built, and the params against a for-loop torch optimizer's."""
    from megabuf.optimizer.builder import optimizer_class_and_kwargs

    megabuf.init_distributed(device="cuda")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref = copy.deepcopy(net).cuda()
    model = megabuf.DistributedDataParallel(net.cuda(), megabuf.DistributedDataParallelConfig())
    cfg = megabuf.OptimizerConfig(optimizer=name, implementation=implementation, lr=1e-2)
    opt = megabuf.build_optimizer(model, cfg)
    ref_opt = megabuf.OptimizerConfig(optimizer=name, implementation="for_loop", lr=1e-2)
    ref_cls, ref_kwargs = optimizer_class_and_kwargs(ref_opt, torch.device("cuda"))
    torch_opt = ref_cls(ref.parameters(), **ref_kwargs)
    n = 8 // dist.get_world_size()
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step)).cuda()
        opt.zero_grad()
        model(x[dist.get_rank() * n : (dist.get_rank() + 1) * n]).square().mean().backward()
        model.finish_grad_sync()
        opt.step()
        torch_opt.zero_grad()
        ref(x).square().mean().backward()
        torch_opt.step()
    inner = opt.parts().domains[0].optimizer
    group = inner.param_groups[0]
    worst = max(
        (p - q).abs().max().item() for p, q in zip(net.parameters(), ref.parameters(), strict=True)
    )
    return {
        "class": f"{type(inner).__module__}.{type(inner).__name__}",
        "fused": group.get("fused"), "worst": worst,
    }  # fmt: skip


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_auto_is_torch_fused_on_cuda_and_matches_the_for_loop_kernel(name: str) -> None:
    for rank, res in enumerate(spawn(cuda_implementation_run, WORLD, "auto", name, timeout_s=300)):
        assert res["class"].startswith("torch.optim.") and res["fused"] is True, (rank, res)
        assert res["worst"] <= 1e-5, (rank, res)


@pytest.mark.parametrize(
    ("implementation", "module"),
    [("apex", "apex.optimizers"), ("transformer_engine", "transformer_engine.pytorch.optimizers")],
)
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_nvidia_fused_adam_when_asked(implementation: str, module: str, name: str) -> None:
    if not _installed(implementation):
        pytest.skip(f"{implementation} is not installed (never faked)")
    results = spawn(cuda_implementation_run, WORLD, implementation, name, timeout_s=300)
    for rank, res in enumerate(results):
        assert res["class"] == f"{module}.FusedAdam", (rank, res)
        assert res["worst"] <= 1e-5, (rank, res)
