"""Matrix optimizers under megabuf: `MuonAdamW` (Muon for 2-D weights, AdamW for the rest), the
usual split of params between them, and the checks that name what cannot work.

[Note: matrix optimizers]
A matrix optimizer (`torch.optim.Muon`, `MuonAdamW`'s Muon groups) orthogonalises the whole 2-D
momentum of a param, so each of its params must be stepped whole and 2-D:
- the non-distributed optimizers step whole params already;
- the distributed optimizer needs `DistributedDataParallelConfig(whole_param_owners=True)`
  ([Note: whole-param owners] in megabuf/pure/owners.py): each param is then one param-shaped main
  param on its owner. With element shards it raises `MatrixOptimizerError` at construction
  naming that field (torch would fail at the first step on a 1-D piece, or worse, step a
  piece that happens to be 2-D-shaped);
- a 1-D (or 3-D, ...) param in a Muon group raises naming it and its group.
Owner tables must agree over the dp ranks (`check_owners_agree`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.config import MUON_ADJUST_LR_FNS
from megabuf.transport.collectives import Collectives

MUON_KEY = "use_muon"
MUON_EPS = 1e-7  # Newton-Schulz stabiliser (torch.optim.Muon's `eps`)


class MatrixOptimizerError(ValueError):
    """A matrix optimizer was given params it cannot step whole; see [Note: matrix optimizers]."""


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer: `torch.optim.Muon` on the param groups with `use_muon=True`, `torch.optim.
    AdamW` on the others, sharing this optimizer's `param_groups` (LR schedulers edit them) and
    `state`. In a Muon group `eps` is Muon's Newton-Schulz epsilon (default `ns_eps`), in an
    AdamW group Adam's (default `eps`); group keys override the defaults as in torch."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        use_muon: bool = False,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_eps: float = MUON_EPS,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        foreach: bool | None = None,
    ) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, MUON_KEY: use_muon})
        muon = {"momentum": momentum, "nesterov": nesterov, "ns_coefficients": ns_coefficients,
                "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn, "eps": ns_eps}  # fmt: skip
        adam = {"betas": betas, "eps": eps}
        for group in self.param_groups:
            for key, value in (muon if group[MUON_KEY] else adam).items():
                group.setdefault(key, value)
        self._foreach = foreach
        self._link()

    def _link(self) -> None:
        """(Re)build the two inner optimizers over this optimizer's own group dicts and state."""
        muon = [g for g in self.param_groups if g[MUON_KEY]]
        for gi, group in enumerate(self.param_groups):
            if group[MUON_KEY] and group["adjust_lr_fn"] not in MUON_ADJUST_LR_FNS:
                raise ValueError(
                    f"megabuf: MuonAdamW param group {gi}: adjust_lr_fn={group['adjust_lr_fn']!r} "
                    f"is not one of {MUON_ADJUST_LR_FNS} (torch.optim.Muon's; an unknown one "
                    "would silently leave the learning rate unadjusted)"
                )
        adam = [g for g in self.param_groups if not g[MUON_KEY]]
        self._muon = torch.optim.Muon(muon) if muon else None
        self._adamw = torch.optim.AdamW(adam, foreach=self._foreach) if adam else None
        for inner in (self._muon, self._adamw):
            if inner is not None:
                inner.state = self.state  # one state, keyed by param

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # replaces param_groups and state: link again
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in (self._muon, self._adamw):
            if inner is not None:
                inner.step()
        return loss


def is_matrix_optimizer(optimizer_cls: type[torch.optim.Optimizer]) -> bool:
    return issubclass(optimizer_cls, (torch.optim.Muon, MuonAdamW))


def muon_param_groups(
    chunks: Sequence[DistributedDataParallel], muon_lr: float | None = None
) -> list[dict[str, Any]]:
    """The usual recipe as two torch param groups: Muon for the 2-D weights of hidden layers,
    AdamW for the rest: biases, norms, embeddings (weights of `nn.Embedding` modules, and params
    tied to them) and the output head, as the Muon recipe prescribes (`_output_head`: an untied
    `nn.Linear` head shaped like an embedding, vocab x dim; in a model without embeddings, the
    last trainable `nn.Linear` with no trainable 2-D param registered after it)."""
    to_adam = {
        id(m.weight) for c in chunks for m in c.module.modules() if isinstance(m, nn.Embedding)
    }
    to_adam |= {id(p) for c in chunks[-1:] for p in _output_head(c.module)}
    muon: list[nn.Parameter] = []
    adam: list[nn.Parameter] = []
    for chunk in chunks:
        for param in chunk.engine.param_to_name:
            (muon if param.dim() == 2 and id(param) not in to_adam else adam).append(param)
    extra = {} if muon_lr is None else {"lr": muon_lr}
    return [{"params": muon, MUON_KEY: True, **extra}, {"params": adam, MUON_KEY: False}]


def _output_head(module: nn.Module) -> list[nn.Parameter]:
    """The output head's weight, found without running the model: with `nn.Embedding`s, every
    trainable `nn.Linear` weight shaped like one of their weights (a language model's untied
    vocab x dim projection); without, the last trainable `nn.Linear`'s weight if no trainable
    2-D param is registered after it (a classifier's head)."""
    linears = [m.weight for m in module.modules() if isinstance(m, nn.Linear)]
    trainable = [p for p in module.parameters() if p.requires_grad]
    embeddings = [m.weight.shape for m in module.modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        return [p for p in trainable if any(p is w for w in linears) and p.shape in embeddings]
    heads = [p for p in trainable if any(p is w for w in linears)]
    if not heads:
        return []
    position = next(i for i, p in enumerate(trainable) if p is heads[-1])
    return [] if any(p.dim() == 2 for p in trainable[position + 1 :]) else [heads[-1]]


def check_matrix_groups(
    optimizer_cls: type[torch.optim.Optimizer],
    hparams: Sequence[dict[str, Any]],
    group_of: dict[nn.Parameter, int],
    keys: dict[nn.Parameter, str],
    whole_params: bool,
) -> None:
    """Raise `MatrixOptimizerError` for what a matrix optimizer cannot step; see
    [Note: matrix optimizers]. `group_of`: the group of every trainable param of the model (on
    every rank, so every rank raises alike); `whole_params`: main params are whole params."""
    if not is_matrix_optimizer(optimizer_cls):
        return
    if not whole_params:
        raise MatrixOptimizerError(
            f"megabuf: {optimizer_cls.__name__} orthogonalises whole matrices, but the "
            "distributed optimizer splits params into element shards; build the model with "
            "DistributedDataParallelConfig(whole_param_owners=True) so each param is owned whole "
            "by one dp rank"
        )
    everything_muon = issubclass(optimizer_cls, torch.optim.Muon)
    for gi, hp in enumerate(hparams):
        if not (everything_muon or hp.get(MUON_KEY, False)):
            continue
        bad = [f"{keys[p]} {tuple(p.shape)}" for p, g in group_of.items()
               if g == gi and p.dim() != 2]  # fmt: skip
        if bad:
            raise MatrixOptimizerError(
                f"megabuf: param group {gi} is stepped by Muon, which needs 2-D params, but holds "
                f"{', '.join(bad[:5])}; put them in a group with use_muon=False (MuonAdamW, or "
                "OptimizerConfig(optimizer='muon'), steps those with AdamW)"
            )


def check_owners_agree(chunks: Sequence[DistributedDataParallel], collectives: Collectives) -> None:
    """Every dp rank must hold the same owner table ([Note: whole-param owners]); raise on
    every rank naming the first param whose owner differs."""
    for i, chunk in enumerate(chunks):
        pgs, buffers = chunk.engine.process_groups, chunk.engine.plan.buffers
        for expert in (False, True):
            group = pgs.expt_dp if expert else pgs.dp
            mine = [(b.index, b.layout.owner_of) for b in buffers if b.expert == expert]
            if mine:
                _compare_owner_tables(i, chunk, collectives.all_gather_object(mine, group))


def _compare_owner_tables(i: int, chunk: DistributedDataParallel, everyone: list[Any]) -> None:
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise MatrixOptimizerError(
                f"megabuf: model chunk {i}: dp rank {rank} chose other param owners than dp "
                f"rank 0 ({_first_owner_difference(chunk, everyone[0], theirs)}); the owner "
                "layout must be a pure function of the model, the same on every rank"
            )


def _first_owner_difference(chunk: DistributedDataParallel, ref: list, theirs: list) -> str:
    names = list(chunk.engine.param_to_name.values())
    for (bi, a), (_, b) in zip(ref, theirs, strict=False):
        for j, (ra, rb) in enumerate(zip(a or (), b or (), strict=False)):
            if ra != rb:
                spec = chunk.engine.plan.buffers[bi].param_ids[j]
                return f"{names[spec]!r}: rank {ra} vs rank {rb}"
    return "the tables differ in length"
