"""The collective strategy as a function of (backend, tensor device); see
[Note: collective strategies] in megabuf/transport/collective_backends.py. Pure tests of
`choose_strategy` from backend strings (no process group), the call sites read the tensor's device
(torch.distributed faked), and one gloo run: `init_process_group()` without a backend on CPU gets
gloo's strategy."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from background_jobs import Call, Runner

from megabuf.testing import spawn
from megabuf.transport.collective_backends import (
    BACKEND_STRATEGIES,
    FALLBACK_STRATEGY,
    CollectiveStrategy,
    backend_for_device,
    choose_strategy,
)
from megabuf.transport.collectives import Collectives

GLOO_CPU = CollectiveStrategy(reduce_scatter="all_to_all", all_gather="p2p", has_avg=False)
NCCL_CUDA = CollectiveStrategy(
    reduce_scatter="native", all_gather="native", has_avg=True, coalesce="manager"
)
NATIVE_NO_AVG = CollectiveStrategy(reduce_scatter="native", all_gather="native", has_avg=False)

# (backend string as torch reports it, device type) -> strategy, written out by hand
CHOICES: dict[tuple[str, str], CollectiveStrategy] = {
    ("gloo", "cpu"): GLOO_CPU,
    ("cpu:gloo,cuda:gloo", "cpu"): GLOO_CPU,  # get_backend_config of a "gloo" group
    ("cpu:gloo", "cpu"): GLOO_CPU,  # init_process_group() without a backend, no accelerator
    ("GLOO", "cpu"): GLOO_CPU,
    # gloo runs neither all_to_all nor point-to-point on CUDA tensors: native, no AVG
    ("gloo", "cuda"): NATIVE_NO_AVG,
    ("cpu:gloo,cuda:gloo", "cuda"): NATIVE_NO_AVG,
    ("nccl", "cuda"): NCCL_CUDA,
    ("cuda:nccl", "cuda"): NCCL_CUDA,  # init_process_group() without a backend on a GPU machine
    # mixed: each device type gets the backend that serves it
    ("cpu:gloo,cuda:nccl", "cpu"): GLOO_CPU,
    ("cpu:gloo,cuda:nccl", "cuda"): NCCL_CUDA,
    ("cuda:nccl,cpu:gloo", "cpu"): GLOO_CPU,
    ("ucc", "cpu"): FALLBACK_STRATEGY,  # a backend megabuf has no entry for
}
# (backend string, device type) that no backend of the group serves
UNSERVED = [("nccl", "cpu"), ("cuda:nccl", "cpu"), ("cpu:gloo", "cuda"), ("gloo", "meta")]


@pytest.mark.parametrize(("backend", "device_type"), CHOICES, ids=lambda v: str(v))
def test_choose_strategy_by_backend_and_device(backend: str, device_type: str) -> None:
    assert choose_strategy(backend, device_type) == CHOICES[backend, device_type]


def test_the_hand_written_table_matches_the_library_table() -> None:
    assert BACKEND_STRATEGIES == {("gloo", "cpu"): GLOO_CPU, ("nccl", "cuda"): NCCL_CUDA}
    assert FALLBACK_STRATEGY == NATIVE_NO_AVG


@pytest.mark.parametrize(("backend", "device_type"), UNSERVED)
def test_a_device_no_backend_serves_is_an_error(backend: str, device_type: str) -> None:
    assert backend_for_device(backend, device_type) is None
    with pytest.raises(ValueError, match=f"backend '{backend}' serves no {device_type} tensors"):
        choose_strategy(backend, device_type)


def test_undefined_backend_string_is_refused() -> None:
    # what dist.get_backend reports after init_process_group() without a backend
    with pytest.raises(ValueError, match="backend 'undefined' does not say"):
        choose_strategy("undefined", "cpu")


def test_backend_for_device_parses_mixed_strings() -> None:
    assert backend_for_device("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_for_device("cpu:gloo, cuda:nccl", "cuda") == "nccl"
    assert backend_for_device("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for_device("nccl", "cuda") == "nccl"


def test_strategies_override_applies_per_backend_and_device() -> None:
    native = {("gloo", "cpu"): NATIVE_NO_AVG}
    assert choose_strategy("gloo", "cpu", native) == NATIVE_NO_AVG
    assert choose_strategy("nccl", "cuda", native) == FALLBACK_STRATEGY  # not in the override


class FakeDist:
    """torch.distributed as `Collectives` sees it: a group of 2 with a given backend string,
    recording which collective each call reached."""

    def __init__(self, backend_config: str) -> None:
        self.backend_config = backend_config
        self.called: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("get_backend_config", "get_world_size", "get_rank"):
            monkeypatch.setattr(dist, name, getattr(self, name))
        for name in ("all_to_all_single", "reduce_scatter_tensor", "all_reduce"):
            monkeypatch.setattr(dist, name, self._record(name))

    def get_backend_config(self, group: Any = None) -> str:
        return self.backend_config

    def get_world_size(self, group: Any = None) -> int:
        return 2

    def get_rank(self, group: Any = None) -> int:
        return 0

    def _record(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            self.called.append(name)

        return call


def test_collectives_read_the_tensor_device_and_the_backend_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeDist("cpu:gloo,cuda:nccl")
    fake.install(monkeypatch)
    coll = Collectives()
    assert coll.strategy(None, torch.device("cpu")) == GLOO_CPU
    assert coll.strategy(None, torch.device("cuda", 1)) == NCCL_CUDA
    assert coll.strategy(None, "cuda:0") == NCCL_CUDA
    x = torch.ones(4)
    coll.reduce_scatter(x[:2], x, None, async_op=False)  # CPU tensor on the gloo side
    assert fake.called == ["all_to_all_single"]


def test_cpu_tensors_on_an_nccl_only_group_fail_before_torch_is_called(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeDist("cuda:nccl")
    fake.install(monkeypatch)
    x = torch.ones(4)
    with pytest.raises(ValueError, match="serves no cpu tensors"):
        Collectives().reduce_scatter(x[:2], x, None, async_op=False)
    with pytest.raises(ValueError, match="serves no cpu tensors"):
        Collectives().all_reduce(x, None, async_op=False)
    assert fake.called == []


def default_backend_run() -> dict[str, Any]:
    """Rank side: join with init_process_group() and no backend, then reduce-scatter on CPU."""
    dist.init_process_group()  # spawn set torchrun's environment
    rank, size = dist.get_rank(), dist.get_world_size()
    coll = Collectives()
    x = torch.arange(4 * size, dtype=torch.float32) * (rank + 1)
    out = torch.empty(4)
    coll.reduce_scatter(out, x, None, async_op=False, average=True)
    want = torch.arange(4 * size, dtype=torch.float32)[4 * rank : 4 * (rank + 1)] * 1.5
    return {
        "backend": str(dist.get_backend()),
        "strategy": coll.strategy(None, x.device),
        "calls": dict(coll.stats.calls),
        "all_to_all_landing_nbytes": coll.stats.output_nbytes["reduce_scatter"],
        "max_error": float((out - want).abs().max()),
    }


def _default_backend_ranks() -> list[Any] | None:
    """Both ranks' reports, spawned beside the suite ([Note: background jobs] in
    background_jobs.py); None where the test is skipped."""
    if torch.cuda.is_available():
        return None
    return spawn(default_backend_run, 2, timeout_s=120)


DEFAULT_BACKEND = Call("collectives: init without a backend", _default_backend_ranks)


@pytest.mark.background(DEFAULT_BACKEND)
@pytest.mark.skipif(torch.cuda.is_available(), reason="no backend given picks NCCL with CUDA")
def test_init_process_group_without_backend_gets_gloo_strategy_on_cpu(background: Runner) -> None:
    for rank, res in enumerate(background.result(DEFAULT_BACKEND)):
        # torch reports the backend as "undefined": the strategy must not come from it
        assert res["backend"] != "gloo", res["backend"]
        assert res["strategy"] == GLOO_CPU, rank
        # all-to-all into a scratch as large as the input (8 fp32), not a native reduce-scatter
        assert res["all_to_all_landing_nbytes"] == 8 * 4, rank
        assert res["max_error"] == 0.0, rank
