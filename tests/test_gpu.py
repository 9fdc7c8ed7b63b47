"""GPU tier: the same engine on NCCL (native reduce-scatter / all-gather, AVG, CUDA tensors).
Skipped without at least two CUDA devices."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import megabuf
from megabuf.layout import shard_pieces

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for NCCL (none on this machine)"
    ),
]


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
                want = names[model.param_to_name[p]].grad
                worst = max(worst, (p.main_grad - want).abs().max().item())
            continue
        for piece in shard_pieces(buf.layout, buf.dp_rank, buf.dp_size):
            p = buf.params[piece.param_id]
            got = buf.grad_data[piece.buffer_start : piece.buffer_start + piece.numel]
            want = names[model.param_to_name[p]].grad.flatten()[piece.param_start : piece.param_end]
            worst = max(worst, (got - want).abs().max().item())
    return worst


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
