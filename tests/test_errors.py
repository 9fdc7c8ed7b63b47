"""Bad input gets a clear error on every rank, naming the param, field or rank: never a hang."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import megabuf


class TwoHeads(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.body = nn.Linear(4, width)
        self.unused_head = nn.Linear(width, 2)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _message(fn: Any) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def unused_param_case() -> str:
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=8, error_on_unused_params=True
    )
    model = megabuf.DistributedDataParallel(TwoHeads(), cfg)
    loss = model(torch.randn(3, 4)).sum()
    return _message(loss.backward)  # backward ends by finishing the grad sync


def mismatched_replicas_case() -> str:
    width = 4 if dist.get_rank() == 0 else 5
    return _message(lambda: megabuf.DistributedDataParallel(TwoHeads(width)))


def mismatched_dtype_case() -> str:
    net = TwoHeads()
    if dist.get_rank() == 1:
        net.head.to(torch.float64)  # same names and shapes; a later param differs in dtype
    return _message(lambda: megabuf.DistributedDataParallel(net))


def extra_param_case() -> str:
    net = TwoHeads()
    if dist.get_rank() == 1:
        net.extra = nn.Linear(2, 2)
    return _message(lambda: megabuf.DistributedDataParallel(net))


def devices_case() -> str:
    net = TwoHeads()
    net.head.to("meta")
    return _message(lambda: megabuf.DistributedDataParallel(net))


def nan_case(overlap: bool) -> str:
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, check_for_nan_in_grad=True, bucket_size=10**6
    )
    torch.manual_seed(0)
    net = TwoHeads()
    net.unused_head.requires_grad_(False)
    model = megabuf.DistributedDataParallel(net, cfg)
    x = torch.randn(3, 4)
    if dist.get_rank() == 1:
        x[0, 0] = float("nan")

    def step() -> None:
        model(x).sum().backward()
        model.finish_grad_sync()

    return _message(step)


def all_error_cases() -> dict[str, str]:
    return {
        "unused": unused_param_case(),
        "mismatch": mismatched_replicas_case(),
        "dtype": mismatched_dtype_case(),
        "extra": extra_param_case(),
        "devices": devices_case(),
        "nan_sync": nan_case(False),
        "nan_overlap": nan_case(True),
    }


@pytest.fixture(scope="module")
def messages(pools: Any) -> list[dict[str, str]]:
    return pools(2).run(all_error_cases)


def test_unused_param_raises_naming_it_on_every_rank(messages: list[dict[str, str]]) -> None:
    for rank, msgs in enumerate(messages):  # strict mode: error_on_unused_params=True
        assert "unused_head.weight (ranks [0, 1])" in msgs["unused"], msgs["unused"]
        assert "unused_head.bias" in msgs["unused"] and f"rank {rank}" in msgs["unused"]


def test_replica_shape_mismatch_raises_on_every_rank(messages: list[dict[str, str]]) -> None:
    for msgs in messages:
        assert msgs["mismatch"].startswith("ValueError"), msgs["mismatch"]
        assert "'body.weight' shape (4, 4)" in msgs["mismatch"] and "(5, 4)" in msgs["mismatch"]


def test_replica_dtype_mismatch_raises_naming_the_param(messages: list[dict[str, str]]) -> None:
    for msgs in messages:
        msg = msgs["dtype"]
        assert msg.startswith("ValueError") and "rank 1 differs" in msg, msg
        assert "'head.weight' shape (2, 4) torch.float32" in msg and "torch.float64" in msg, msg


def test_replica_param_count_mismatch_names_extra_param(messages: list[dict[str, str]]) -> None:
    for msgs in messages:
        assert "rank 1 differs" in msgs["extra"] and "extra.weight" in msgs["extra"], msgs["extra"]


def test_params_on_different_devices(messages: list[dict[str, str]]) -> None:
    for msgs in messages:
        assert "different devices" in msgs["devices"] and "head.weight" in msgs["devices"]


@pytest.mark.parametrize("mode", ["nan_sync", "nan_overlap"])
def test_nan_check_raises_on_every_rank_naming_bucket_and_rank(
    messages: list[dict[str, str]], mode: str
) -> None:
    for rank, msgs in enumerate(messages):
        msg = msgs[mode]
        assert "NaN or Inf" in msg and "bucket 0" in msg and "rank(s) [1]" in msg, msg
        if rank == 1:
            assert "non-finite grads in: " in msg and "body.weight" in msg.split("in: ")[-1]


def module_buffers_case() -> tuple[int, int]:
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model = megabuf.DistributedDataParallel(net)
    return len(model.buffers), len(list(model.buffers()))


def test_buffers_attribute_and_module_buffers_coexist(pools: Any) -> None:
    n_grad_buffers, n_module_buffers = pools(1).run(module_buffers_case)[0]
    assert n_grad_buffers == 1  # Megatron's attribute: the list of grad buffers
    assert n_module_buffers == 3  # nn.Module.buffers(): BatchNorm running mean/var/count
