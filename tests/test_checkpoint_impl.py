"""A checkpoint moves between optimizer implementations ([Note: optimizer state layout]): saved
with torch's foreach / fused kernel, resumed with the for-loop / fused / foreach kernel on CPU,
it restores params and state exactly, keeps the loading optimizer's kernel, and the remaining
steps equal the uninterrupted run switched to that kernel at the save, bit for bit. Another
optimizer (other math or other state) is refused naming what differs. 2 ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from checkpoint_impl_cases import MISFITS, misfit_error, save_then_switch
from dist_pool import case_result, run_each

FUSED, FOREACH, FOR_LOOP = (True, None), (None, True), (False, False)  # (fused, foreach) flags
FLAGS = {"fused": FUSED, "foreach": FOREACH, "for_loop": FOR_LOOP}
# case -> (kind, saved with, resumed with)
SWITCHES: dict[str, tuple[str, str, list[str]]] = {
    "distopt_foreach": ("distopt", "foreach", ["for_loop", "fused"]),
    "allreduce_fused": ("allreduce", "fused", ["foreach", "for_loop"]),
    "torch_foreach": ("torch", "foreach", ["fused", "for_loop"]),
}


@pytest.fixture(scope="module")
def results(pools: Any, tmp_path_factory: Any) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("ckpt_impl"))
    cases: dict[str, tuple[Any, ...]] = {
        name: (save_then_switch, root, *spec) for name, spec in SWITCHES.items()
    }
    cases |= {label: (misfit_error, root, label) for label in MISFITS}
    return pools(2).run(run_each, cases)


@pytest.mark.parametrize("name", SWITCHES)
def test_checkpoint_resumes_with_another_implementation_bitwise(results: Any, name: str) -> None:
    _, saved_with, resumed_with = SWITCHES[name]
    for rank, res in enumerate(case_result(results, name)):
        assert set(res["saved_flags"]) == {FLAGS[saved_with]}, (rank, res["saved_flags"])
        for implementation in resumed_with:
            got = res[implementation]
            assert set(got["flags"]) == {FLAGS[implementation]}, (rank, implementation)
            assert got["loaded_params_equal"] and got["loaded_state_equal"], (rank, implementation)
            want = got["uninterrupted"]
            bad = [k for k in want if not torch.equal(got["resumed"][k], want[k])]
            assert not bad, (name, implementation, rank, bad)


MISFIT_MESSAGES = {
    "adam_into_adamw": [
        "saved by torch.optim.adam.Adam",
        "decoupled_weight_decay=False saved, this optimizer has decoupled_weight_decay=True",
    ],
    "adam_into_sgd_torch": [
        "SGD optimizer does not fit",
        "['dampening', 'momentum', 'nesterov'] in this optimizer only",
    ],
    "adam_into_extra_state": [
        "does not fit this optimizer (AdamWithTrace",
        "state 'trace' not saved (params ",
    ],
    "extra_state_into_adam": [
        "saved by checkpoint_impl_cases.AdamWithTrace",
        "state 'trace' saved, this optimizer keeps none",
    ],
}


@pytest.mark.parametrize("label", MISFITS)
def test_another_optimizer_is_refused_naming_what_differs(results: Any, label: str) -> None:
    for message in case_result(results, label):
        for part in MISFIT_MESSAGES[label]:
            assert part in message, (label, message)
