"""ProcessGroups.build on real gloo ranks matches the documented rank order (rank_layout)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

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


def all_layouts() -> list[dict[str, list[int] | None]]:
    return [my_groups(1, 1), my_groups(2, 1), my_groups(1, 2), my_groups(2, 2)]


def test_groups_follow_rank_layout(pools: Any) -> None:
    results = pools(4).run(all_layouts)
    for i, (pp_size, ep_size) in enumerate([(1, 1), (2, 1), (1, 2), (2, 2)]):
        expected = rank_layout(4, pp_size=pp_size, ep_size=ep_size)
        for rank, per_rank in enumerate(results):
            got = per_rank[i]
            for name in ("dp", "expt_dp", "ep", "pp"):
                mine = next(r for r in expected[name] if rank in r)
                assert got[name] == mine, (pp_size, ep_size, rank, name)
            assert got["pp_ranks"] == next(r for r in expected["pp"] if rank in r)
            if pp_size == 1:
                assert got["embd"] is None
            else:
                assert got["embd"] == next(r for r in expected["embd"] if rank in r)
