"""What the verify mode and the spike guards check of each optimizer step, after the global grad
norm ([Note: verify mode]; the optimizer calls `skip` once per step with a finite norm)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megabuf.pure.verify_levels import large_grad_action, verify_checks
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import ProcessGroups
from megabuf.verify.norms import Piece, check_norm, gather_pieces, square_sum
from megabuf.verify.spikes import SpikeGuard


class StepChecks:
    """The ownership-set norm check (verify "norms" / "all") and the spike guards of one
    optimizer. `chunks`: its model chunks (their `ddp_config`s say what runs)."""

    def __init__(
        self, chunks: Sequence[Any], collectives: Collectives, process_groups: ProcessGroups,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.collectives, self.process_groups, self.device = collectives, process_groups, device
        self.rank = process_groups.topology.rank
        self.norms = any("norms" in verify_checks(c.ddp_config.verify) for c in chunks)
        config = chunks[0].ddp_config
        self.guard = SpikeGuard(
            large_grad_action(config.check_for_large_grads), config.grad_norm_skip_threshold,
            self._agree, self.rank,
        )  # fmt: skip
        self.norm_checks = 0  # comparisons made (tests read it)

    @property
    def skipped(self) -> dict[str, int]:
        """Steps the spike guards skipped, by reason."""
        return self.guard.skipped

    def _agree(self, flag: bool) -> bool:
        """`flag`'s max over pp, then dp: every rank that steps (as the optimizer's kinds)."""
        value = torch.tensor([float(flag)], device=self.device)
        pgs = self.process_groups
        for group, size in ((pgs.pp, pgs.pp_size), (pgs.dp, pgs.dp_size)):
            if size > 1:
                self.collectives.all_reduce_max(value, group)
        return bool(value.item() > 0)

    def skip(
        self, grad_norm: float, kinds: Sequence[str], domains: Sequence[Any],
        part_norm: Callable[[int], float],
    ) -> bool:  # fmt: skip
        """Check the norm (raises naming the set), then ask the spike guards; True: skip the
        step on every rank. `part_norm(i)`: the optimizer's norm of its part of `kinds[i]`."""
        if self.norms:
            self.norm_checks += 1
            pgs = self.process_groups
            pieces = gather_pieces(self._pieces(domains), (pgs.dp, pgs.pp), self.collectives)
            check_norm(grad_norm, pieces, kinds, part_norm, self.rank)
        return self.guard.skip(grad_norm)

    def _pieces(self, domains: Sequence[Any]) -> list[Piece]:
        """This rank's owned grad pieces ([Note: verify mode], norms): a tied embedding counts
        on the first pipeline stage only ([Note: global grad norm])."""
        topo, pieces = self.process_groups.topology, []
        for domain in domains:
            for mp in domain.main_params:
                if topo.pp_rank != 0 and getattr(mp.model_param, "shared_embedding", False):
                    continue
                expert = domain.kind == "expert"
                key = (topo.pp_rank, topo.ep_rank, mp.key) if expert else (topo.pp_rank, mp.key)
                grad = mp.main.grad if mp.main.grad is not None else mp.model_grad
                pieces.append(Piece(
                    domain.kind, key, mp.param_start, mp.param_end, mp.model_param.numel(),
                    square_sum(grad), self.rank,
                ))  # fmt: skip
        return pieces
