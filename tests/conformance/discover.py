"""How the selection (selection.py) is chosen, rerunnable: `python -m tests.conformance --discover`.

1. Candidates, read from the installed wheel's source: every `test_*` of
   `DistributedTest._DistTestBase` whose body, or a `self._helper` it calls (transitively),
   names `DistributedDataParallel` or calls `DDP(`; and every test of the rpc suite's classes.
2. Each candidate runs once on torch DDP itself, bound through the `torch-probe` class (torch
   DDP leaving a marker file when a rank constructs it), gloo, CPU, world size 2.
3. Selected: the candidates that were not skipped (CUDA, NCCL, other world sizes, ... skip here)
   and in which a rank constructed a DDP.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

from . import suite

_NAMES_DDP = re.compile(r"DistributedDataParallel|\bDDP\(")
_CALLS_HELPER = re.compile(r"self\.(_\w+)\(")


def _source(cls: type, name: str) -> str:
    try:
        return inspect.getsource(inspect.unwrap(getattr(cls, name)))
    except (TypeError, OSError):
        return ""


def _names_ddp(cls: type, name: str, seen: set[str]) -> bool:
    if name in seen:
        return False
    seen.add(name)
    text = _source(cls, name)
    if _NAMES_DDP.search(text):
        return True
    helpers = {h for h in _CALLS_HELPER.findall(text) if hasattr(cls, h)}
    return any(_names_ddp(cls, h, seen) for h in sorted(helpers))


def candidates() -> list[str]:
    suite.prepare_environment(per_test_timeout_s=60)
    from torch.testing._internal.distributed import ddp_under_dist_autograd_test as rpc_tests
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    base = DistributedTest._DistTestBase
    found = [
        f"dist.{suite.DIST_CLASS}.{name}"
        for name in sorted(n for n in dir(base) if n.startswith("test_"))
        if _names_ddp(base, name, set())
    ]
    for cls_name in suite.RPC_CLASSES:
        cls = getattr(rpc_tests, cls_name)
        found += [f"rpc.{cls_name}.{n}" for n in sorted(dir(cls)) if n.startswith("test_")]
    return found


def discover(per_test_timeout_s: int, log: Any = sys.stderr) -> list[str]:
    """The candidates that run on gloo/CPU at these world sizes and build a DDP (step 3)."""
    outcomes = suite.run_selection(candidates(), "torch-probe", per_test_timeout_s, log)
    selected = [o.test_id for o in outcomes if o.outcome != "skip" and o.ddp_built]
    not_passing = [o.test_id for o in outcomes if o.test_id in selected and o.outcome != "pass"]
    print(
        f"{len(selected)} of {len(outcomes)} candidates selected; on torch DDP, not passing: "
        f"{not_passing or 'none'}",
        file=log,
    )
    return selected
