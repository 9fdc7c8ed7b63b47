"""Ownership-set norms ([Note: verify mode], norms): the global grad norm again, in fp64, over
the exact sets of pieces each param is owned in, against the norm the optimizer used."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from megabuf.transport.collectives import Collectives, Group
from megabuf.verify.errors import VerifyError

NORM_RTOL = 1e-4
"""Relative gap between the optimizer's norm (fp32 sums) and the fp64 one that is rounding."""


@dataclass(frozen=True)
class Piece:
    """One range of one param's grad that a rank owns, and its fp64 sum of squares."""

    kind: str  # "dense" or "expert"
    key: tuple[object, ...]  # the ownership set: (pp rank, name) or (pp rank, ep rank, name)
    start: int
    end: int
    numel: int  # of the whole param
    sq: float
    rank: int  # global, for messages


def square_sum(grad: Tensor) -> float:
    """fp64 sum of squares of `grad` (exact-ish: squares of fp32/bf16/fp16 values are exact)."""
    return float(grad.detach().double().square().sum().item())


def gather_pieces(
    mine: list[Piece], groups: Sequence[Group], collectives: Collectives
) -> list[Piece]:
    """Every rank's pieces over `groups` in turn (dp, then pp: the model's grid)."""
    pieces = mine
    for group in groups:
        if collectives.size(group) > 1:
            gathered = collectives.all_gather_object(pieces, group)
            pieces = [piece for rank_pieces in gathered for piece in rank_pieces]
    return pieces


def ownership_sets(pieces: Sequence[Piece]) -> dict[tuple[object, ...], list[Piece]]:
    """Pieces by set, one per distinct range (replicas own the same range again); raise naming
    a set whose ranges do not tile the param exactly once."""
    sets: dict[tuple[object, ...], dict[tuple[int, int], Piece]] = {}
    for piece in sorted(pieces, key=lambda p: (str(p.key), p.start, p.end, p.rank)):
        sets.setdefault(piece.key, {}).setdefault((piece.start, piece.end), piece)
    for key, ranges in sets.items():
        end, numel = 0, next(iter(ranges.values())).numel
        for start, stop in sorted(ranges):
            if start != end:
                owners = sorted(p.rank for p in pieces if p.key == key)
                how = (
                    "owned by no rank (left out of the norm)"
                    if start > end
                    else (f"counted twice (ranges overlap at [{start}, {end}))")
                )
                raise VerifyError(
                    f"megabuf verify: grad norm ownership set {key!r}: elements "
                    f"[{min(start, end)}, {max(start, end)}) of {numel} are {how}; its pieces "
                    f"come from ranks {owners}"
                )  # fmt: skip
            end = stop
        if end != numel:
            raise VerifyError(
                f"megabuf verify: grad norm ownership set {key!r}: elements [{end}, {numel}) "
                "are owned by no rank (left out of the norm)"
            )
    return {key: list(ranges.values()) for key, ranges in sets.items()}


def check_norm(
    grad_norm: float, pieces: Sequence[Piece], kinds: Sequence[str],
    part_norm: Callable[[int], float], rank: int,
) -> None:  # fmt: skip
    """Raise (on every rank: every input is the same on every rank) when `grad_norm` is not the
    fp64 norm over the ownership sets within NORM_RTOL, naming each kind whose part differs
    (`part_norm(i)`: the optimizer's norm of its part i, of kind `kinds[i]`; collective)."""
    sets = ownership_sets(pieces)
    sq_of = {kind: 0.0 for kind in kinds}
    for key in sorted(sets, key=str):
        for piece in sets[key]:
            sq_of[piece.kind] = sq_of.get(piece.kind, 0.0) + piece.sq
    exact = math.sqrt(sum(sq_of.values()))
    if abs(grad_norm - exact) <= NORM_RTOL * max(exact, 1e-30):
        return
    wrong = []
    for i, kind in enumerate(kinds):
        got, want = part_norm(i), math.sqrt(sq_of.get(kind, 0.0))
        if abs(got - want) > NORM_RTOL * max(want, 1e-30):
            names = sorted({str(k[-1]) for k, s in sets.items() if s[0].kind == kind})
            wrong.append(
                f"set {kind!r} (params {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
                f": the optimizer's part {got!r}, the ownership set's {want!r}"
            )
    raise VerifyError(
        f"megabuf verify (rank {rank}): the optimizer's global grad norm {grad_norm!r} is not "
        f"the fp64 norm over the exact ownership sets, {exact!r} (relative gap "
        f"{abs(grad_norm - exact) / max(exact, 1e-30):.3g} > {NORM_RTOL}): "
        f"{'; '.join(wrong) or 'no single kind differs'}. Every rank raises this"
    )
