"""Element-level deltas, pure ([Note: element deltas] in megabuf/weights/delta.py): the
detector misses nothing, the crossover, a patch applied is bitwise the new slice."""

from __future__ import annotations

import pytest
import torch

from megabuf.weights.delta import WHOLE, apply, changed_indices, count, delta_pays


def _changed(previous: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    now = previous.clone()
    picked = torch.randperm(now.numel(), generator=gen)[: int(now.numel() * fraction)]
    now[picked] = torch.randn(picked.numel(), generator=gen).to(now.dtype)
    return now


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction", [0.01, 0.03, 0.3, 1.0])
def test_a_patch_makes_the_old_slice_bitwise_the_new(dtype: torch.dtype, fraction: float) -> None:
    previous = torch.randn(4096, generator=torch.Generator().manual_seed(1)).to(dtype)
    now = _changed(previous, fraction)
    at = changed_indices(previous, now)
    assert at is not None and at.dtype == torch.int32
    copy = previous.clone()
    apply(copy, at, now[at.long()])
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(copy.view(bits), now.view(bits))


def test_the_detector_compares_bits_not_values() -> None:
    """No false negatives: -0.0 for 0.0 and another NaN payload are changes (a value compare
    would miss them); an unchanged slice has no indices."""
    previous = torch.tensor([0.0, float("nan"), 1.0, 2.0])
    now = previous.clone()
    now[0] = -0.0
    now.view(torch.int32)[1] += 1  # still a NaN, other bits
    at = changed_indices(previous, now)
    assert at is not None and at.tolist() == [0, 1]
    empty = changed_indices(previous, previous.clone())
    assert empty is not None and empty.numel() == 0


def test_no_comparable_copy_means_whole() -> None:
    now = torch.ones(8)
    assert changed_indices(None, now) is None
    assert changed_indices(torch.ones(8, dtype=torch.bfloat16), now) is None  # a dtype switch
    assert changed_indices(torch.ones(4), now) is None  # another layout
    assert count(None, 8, 4) == WHOLE


def test_crossover_bytes_per_version() -> None:
    """Bytes of one slice of n bf16 elements at 1 %, 3 %, 30 %, 100 % changed: a delta costs
    6 bytes an element (int32 index + bf16 value), a whole slice 2 bytes an element, so a delta
    pays below 1/3 changed (1/2 for fp32), and the choice is automatic."""
    n = 1 << 16
    sent = {}
    for fraction in (0.01, 0.03, 0.3, 1.0):
        k = int(n * fraction)
        chosen = count(torch.arange(k, dtype=torch.int32), n, 2)
        sent[fraction] = 2 * n if chosen == WHOLE else chosen * 6
    assert sent == {0.01: 3930, 0.03: 11796, 0.3: 117960, 1.0: 131072}
    assert delta_pays(n // 3 - 1, n, 2) and not delta_pays(n // 3 + 1, n, 2)
    assert delta_pays(n // 2 - 1, n, 4) and not delta_pays(n // 2, n, 4)
    assert count(torch.arange(0, dtype=torch.int32), n, 2) == 0  # unchanged: nothing sent
