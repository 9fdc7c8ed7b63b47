"""ProcessGroups.build on real gloo ranks, and the pure rank_layout, against rank lists written
out by hand from [Note: rank order] in megabuf/transport/process_groups.py:
rank = pp_rank * dp_size + dp_rank, dp_rank = expt_dp_rank * ep_size + ep_rank (ep fastest).
Then init_distributed's choice of backend from the model's device (gloo for CPU models, whatever
the machine; the CUDA path runs in tests/test_gpu.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_pool import case_result, run_each

import megabuf
from megabuf import ProcessGroups
from megabuf.testing import spawn
from megabuf.transport.collective_backends import BACKEND_STRATEGIES
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import rank_layout

Groups = list[list[int]]
# (world, pp_size, ep_size) -> every group of each kind, by hand.
EXPECTED: dict[tuple[int, int, int], dict[str, Groups]] = {
    # dp 4: one stage of 4; ep 1: each rank alone holds all experts
    (4, 1, 1): {"dp": [[0, 1, 2, 3]], "ep": [[0], [1], [2], [3]], "expt_dp": [[0, 1, 2, 3]],
                "pp": [[0], [1], [2], [3]], "embd": [[0], [1], [2], [3]]},
    # 2 stages of dp 2: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3; pp pairs dp_rank-wise
    (4, 2, 1): {"dp": [[0, 1], [2, 3]], "ep": [[0], [1], [2], [3]], "expt_dp": [[0, 1], [2, 3]],
                "pp": [[0, 2], [1, 3]], "embd": [[0, 2], [1, 3]]},
    # dp 4 = expt_dp 2 x ep 2: ep neighbours (0,1) (2,3); same expert shard at stride 2
    (4, 1, 2): {"dp": [[0, 1, 2, 3]], "ep": [[0, 1], [2, 3]], "expt_dp": [[0, 2], [1, 3]],
                "pp": [[0], [1], [2], [3]], "embd": [[0], [1], [2], [3]]},
    # 2 stages of dp 2 = ep 2: every expert held once per stage, so expt_dp is each rank alone
    (4, 2, 2): {"dp": [[0, 1], [2, 3]], "ep": [[0, 1], [2, 3]], "expt_dp": [[0], [1], [2], [3]],
                "pp": [[0, 2], [1, 3]], "embd": [[0, 2], [1, 3]]},
    # the Note's example: pp 2 x dp 4, ep 2
    (8, 2, 2): {"dp": [[0, 1, 2, 3], [4, 5, 6, 7]], "ep": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "expt_dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "embd": [[0, 4], [1, 5], [2, 6], [3, 7]]},
    # 4 stages of dp 2: embd joins only the first and last stage (ranks 2-5 are in none)
    (8, 4, 1): {"dp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "ep": [[0], [1], [2], [3], [4], [5], [6], [7]],
                "expt_dp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "pp": [[0, 2, 4, 6], [1, 3, 5, 7]], "embd": [[0, 6], [1, 7]]},
    # one stage, dp 8 = expt_dp 2 x ep 4
    (8, 1, 4): {"dp": [list(range(8))], "ep": [[0, 1, 2, 3], [4, 5, 6, 7]],
                "expt_dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "pp": [[r] for r in range(8)], "embd": [[r] for r in range(8)]},
}  # fmt: skip


@pytest.mark.parametrize("key", EXPECTED, ids=lambda k: "world{}_pp{}_ep{}".format(*k))
def test_rank_layout_matches_the_hand_written_table(key: tuple[int, int, int]) -> None:
    world, pp_size, ep_size = key
    assert rank_layout(world, pp_size=pp_size, ep_size=ep_size) == EXPECTED[key]


def my_groups(pp_size: int, ep_size: int) -> dict[str, list[int] | None]:
    pgs = ProcessGroups.build(pp_size=pp_size, ep_size=ep_size)
    out: dict[str, list[int] | None] = {
        name: dist.get_process_group_ranks(getattr(pgs, name))
        for name in ("dp", "expt_dp", "ep", "pp")
    }
    out["embd"] = dist.get_process_group_ranks(pgs.embd) if pgs.embd is not None else None
    out["pp_ranks"] = list(pgs.pp_ranks)
    out["sizes"] = [pgs.dp_size, pgs.dp_rank, pgs.pp_size, pgs.pp_rank]
    return out


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (pp_size, ep_size) at world 4


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    cases = {f"pp{pp}_ep{ep}": (my_groups, pp, ep) for pp, ep in LAYOUTS}
    return pools(4).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("pp_size", "ep_size"), LAYOUTS, ids=[f"pp{p}_ep{e}" for p, e in LAYOUTS])
def test_built_groups_match_the_hand_written_table(
    results: Any, pp_size: int, ep_size: int
) -> None:
    table = EXPECTED[4, pp_size, ep_size]
    dp_size = 4 // pp_size
    for rank, got in enumerate(case_result(results, f"pp{pp_size}_ep{ep_size}")):
        for name in ("dp", "expt_dp", "ep", "pp"):
            mine = [group for group in table[name] if rank in group]
            assert [got[name]] == mine, (pp_size, ep_size, rank, name)
        assert got["pp_ranks"] == got["pp"]
        # pp 1: no embd group at all; pp 2: first and last stage = the whole pipeline
        assert got["embd"] == (None if pp_size == 1 else got["pp"]), rank
        assert got["sizes"] == [dp_size, rank % dp_size, pp_size, rank // dp_size], rank


# ---- init_distributed: the backend follows the model's device ----------------------------------


def default_init_run() -> dict[str, Any]:
    """Rank side: init_distributed() with no arguments on a machine that reports a GPU
    (torch.cuda.is_available patched where there is none: the old rule picked NCCL there)."""
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    pgs = megabuf.init_distributed()
    return {
        "config": dist.get_backend_config(),
        "strategy": Collectives().strategy(pgs.dp, "cpu"),
        "dp": dist.get_process_group_ranks(pgs.dp),
    }


def test_init_distributed_gives_cpu_models_gloo_even_where_cuda_is_visible() -> None:
    for rank, res in enumerate(spawn(default_init_run, 2, timeout_s=120)):
        assert res["config"] == "cpu:gloo,cuda:gloo", rank
        assert res["strategy"] == BACKEND_STRATEGIES["gloo", "cpu"], rank
        assert res["dp"] == [0, 1], rank


def test_init_distributed_checks_an_existing_group_serves_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch.distributed faked as already initialised with a group that serves CPU tensors only
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo")
    with pytest.raises(ValueError, match="backend 'cpu:gloo' serves no cuda tensors"):
        megabuf.init_distributed(device="cuda")


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, local_rank: int) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for key, value in {**env, "LOCAL_RANK": str(local_rank)}.items():
        monkeypatch.setenv(key, value)


def test_init_distributed_cuda_needs_a_gpu_for_its_local_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not dist.is_initialized()  # the test process itself never joins a group
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    _torchrun_env(monkeypatch, local_rank=count)  # one past the last GPU (0 on a CPU machine)
    with pytest.raises(RuntimeError, match=rf"LOCAL_RANK {count} needs {count + 1} CUDA devices"):
        megabuf.init_distributed(device="cuda")
    assert not dist.is_initialized()


def test_init_distributed_refuses_a_device_without_a_default_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _torchrun_env(monkeypatch, local_rank=0)
    with pytest.raises(ValueError, match=r"known devices are \['cpu', 'cuda'\]"):
        megabuf.init_distributed(device="meta")
    assert not dist.is_initialized()
