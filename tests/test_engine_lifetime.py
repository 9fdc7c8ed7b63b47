"""An engine dropped by the user is collected ([Note: hooks hold the engine weakly] in
megabuf/sync/hooks.py): before, every engine lived until the process ended, its buffers (on a GPU
its memory) with it, because its grad hooks held it from inside autograd's C++ state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lifetime_cases import dropped_engine_case

from megabuf.config import SHARDING_STRATEGIES

CASES = [(s, False) for s in SHARDING_STRATEGIES] + [
    (s, True)
    for s in ("optim", "optim_grads")  # overlap_param_gather
]


@pytest.mark.parametrize(("strategy", "gather"), CASES)
def test_a_dropped_engine_is_collected_and_its_module_trains_plain(
    pools: Any, strategy: str, gather: bool
) -> None:
    results = pools(2).run(dropped_engine_case, strategy, gather)
    for rank, res in enumerate(results):
        assert not res["engine_alive"], f"{strategy}: rank {rank} kept the dropped engine alive"
        assert not res["group_alive"], f"{strategy}: rank {rank} kept a bucket group alive"
        if gather:  # the gathers the step left in flight were waited for when dropped
            assert res["in_flight"] > 0 and res["unwaited"] == 0, (strategy, rank, res)
        if strategy == "optim_grads_params":
            continue  # the kept module holds this rank's shards, not whole params
        for got, want in zip(res["grads_after"], res["plain_grads"]):
            assert got is not None, f"{strategy}: a dead engine's hook took the grad"
            torch.testing.assert_close(got, want, rtol=0, atol=0)
