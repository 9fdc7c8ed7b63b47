"""ProcessGroups.build on real gloo ranks matches the documented rank order (rank_layout)."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist
from dist_pool import case_result, run_each

from megabuf import ProcessGroups
from megabuf.process_groups import rank_layout


def my_groups(pp_size: int, ep_size: int) -> dict[str, list[int] | None]:
    pgs = ProcessGroups.build(pp_size=pp_size, ep_size=ep_size)
    out: dict[str, list[int] | None] = {
        name: dist.get_process_group_ranks(getattr(pgs, name))
        for name in ("dp", "expt_dp", "ep", "pp")
    }
    out["embd"] = dist.get_process_group_ranks(pgs.embd) if pgs.embd is not None else None
    out["pp_ranks"] = list(pgs.pp_ranks)
    return out


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (pp_size, ep_size)


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    cases = {f"pp{pp}_ep{ep}": (my_groups, pp, ep) for pp, ep in LAYOUTS}
    return pools(4).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("pp_size", "ep_size"), LAYOUTS, ids=[f"pp{p}_ep{e}" for p, e in LAYOUTS])
def test_groups_follow_rank_layout(results: Any, pp_size: int, ep_size: int) -> None:
    expected = rank_layout(4, pp_size=pp_size, ep_size=ep_size)
    for rank, got in enumerate(case_result(results, f"pp{pp_size}_ep{ep_size}")):
        for name in ("dp", "expt_dp", "ep", "pp"):
            mine = next(r for r in expected[name] if rank in r)
            assert got[name] == mine, (pp_size, ep_size, rank, name)
        assert got["pp_ranks"] == next(r for r in expected["pp"] if rank in r)
        if pp_size == 1:
            assert got["embd"] is None
        else:
            assert got["embd"] == next(r for r in expected["embd"] if rank in r)
