"""The benchmark's memory figures (megabuf/bench/memory.py, report.py): the textbook formula picks
up the ZeRO-2/3 systems by name, the measured model state of a plain torch system, and the
measured-vs-formula table. Pure: no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megabuf.bench.memory import measured_persistent_nbytes, state_bytes_per_param
from megabuf.bench.report import memory_table
from megabuf.bench.systems import Engine


@pytest.mark.parametrize(
    ("system", "dp", "want"),
    [
        ("megabuf_zero2", 4, 7.0),  # 4 param + (4 grad + 8 moments) / 4
        ("megabuf_zero2_overlap", 2, 10.0),
        ("megabuf_zero3", 4, 4.0),  # 16 / 4, as FSDP2
        ("megabuf_zero3_noreshard", 2, 8.0),
    ],
)
def test_state_formula_knows_the_sharded_megabuf_systems(system: str, dp: int, want: float) -> None:
    assert state_bytes_per_param(system, dp) == want


def test_measured_model_state_of_a_torch_system() -> None:
    """fp32 params, their grads, AdamW's two moments and one 4-byte `step` per param; the
    module buffer is left out."""
    module = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5))
    opt = torch.optim.AdamW(module.parameters(), foreach=True)
    module(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    engine = Engine(module, module, opt, 0, opt.zero_grad)
    n = sum(p.numel() for p in module.parameters())
    n_tensors = len(list(module.parameters()))
    assert measured_persistent_nbytes(engine) == 16 * n + 4 * n_tensors


def test_memory_table_compares_measured_with_formula() -> None:
    rows = [
        {"model": "m", "system": "megabuf_distopt_sync", "status": "ok", "n_params": 100,
         "persistent_nbytes": 1000, "persistent_formula_nbytes": 1000},
        {"model": "m", "system": "megabuf_distopt_overlap", "status": "ok", "n_params": 100,
         "persistent_nbytes": 900, "persistent_formula_nbytes": 800},
        {"model": "m", "system": "fsdp2_reshard", "status": "ok", "n_params": 100,
         "persistent_nbytes": 900, "persistent_formula_nbytes": 800,
         "persistent_formula_exact": False},
        {"model": "m", "system": "torch_ddp", "status": "n/a (not available)"},
    ]  # fmt: skip
    table = memory_table(rows)
    lines = table.splitlines()
    assert len(lines) == 5  # header, rule, three ok rows
    assert "| megabuf_distopt_sync" in lines[2] and "10.000" in lines[2] and "yes" in lines[2]
    assert "9.000" in lines[3] and "8.000" in lines[3] and "no (+100 B)" in lines[3]
    assert "| fsdp2_reshard" in lines[4] and "textbook" in lines[4]
    assert memory_table([rows[3]]) == ""


class _KeyedState:
    """A mapping readable by key only, as megatron-core's ProxyDict (no `.values()`)."""

    def __init__(self, inner: dict) -> None:
        self._inner = inner

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._inner)

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        return self._inner[key]


def test_storage_walk_reads_a_chained_foreign_optimizer() -> None:
    """The GPU bench's megatron-core rows crashed here (2026-11-26, H200): its optimizer's state
    has no `.values()`. Walked: main params of each chained torch optimizer and their state."""
    from types import SimpleNamespace

    from megabuf.sharding.walk import storage_walk

    main = torch.nn.Parameter(torch.zeros(10))
    inner = torch.optim.Adam([main])
    main.grad = torch.ones(10)
    inner.step()
    chained = SimpleNamespace(optimizer=inner)
    outer = SimpleNamespace(chained_optimizers=[chained], state=_KeyedState(dict(inner.state)))
    walked = storage_walk(torch.nn.Linear(1, 1, bias=False), outer)["cpu"]
    # the Linear's weight (4 B), main (40 B), exp_avg and exp_avg_sq (80 B), step (4 B)
    assert walked == 4 + 40 + 80 + 4
