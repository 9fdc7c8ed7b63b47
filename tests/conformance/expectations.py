"""expectations.toml: the outcome each selected torch DDP test has on megabuf, and why.

One table per selected test, keyed by its id (`suite.Class.test_name`, see suite.py):
`outcome` (one of suite.OUTCOMES), `exception` (the rank's exception type, for fail and error)
and, for every outcome but pass, a hand-written `reason`. The tier fails on any difference
between this file and a run, in either direction, so the file stays true. `render` rewrites it
from a run, keeping every reason whose outcome did not change ([Note: refreshing] in
__main__.py).
"""

from __future__ import annotations

import json
import pathlib
import sys
from dataclasses import dataclass

from .suite import OUTCOMES, Outcome

if sys.version_info >= (3, 11):
    import tomllib
else:  # the `tomli` backport, a dependency below 3.11
    import tomli as tomllib

PATH = pathlib.Path(__file__).with_name("expectations.toml")
TODO = "TODO"
HEADER = """\
# What each selected torch DDP test (tests/conformance/selection.py) does on megabuf, bound in
# place of torch.nn.parallel.DistributedDataParallel in every rank (gloo, CPU, world size 2; the
# rpc suite at its own sizes). Checked by tests/test_torch_conformance.py: any difference from a
# run fails, an expected pass that fails and an excused test that now passes alike.
#
# outcome: pass | fail (a rank's AssertionError) | error (another exception; `exception` names
# its type) | timeout | crash (a rank died without a Python exception) | skip.
# reason: hand-written, for every outcome but pass: the refusal documented in
# docs/porting-from-torch-ddp.md (quoting megabuf's message) or the torch DDP internal the test
# reads. Refresh after a change: `python -m tests.conformance --refresh` rewrites the outcomes,
# keeps the reasons of unchanged tests and writes "TODO" where a reason is owed (the tier fails
# until it is written).
"""


@dataclass(frozen=True)
class Expectation:
    outcome: str
    exception: str = ""
    reason: str = ""

    def matches(self, outcome: Outcome) -> bool:
        return (self.outcome, self.exception) == (outcome.outcome, outcome.exception)

    def describe(self) -> str:
        return f"{self.outcome}({self.exception})" if self.exception else self.outcome


def load(path: pathlib.Path = PATH) -> dict[str, Expectation]:
    with open(path, "rb") as f:
        table = tomllib.load(f)
    return {
        test_id: Expectation(e["outcome"], e.get("exception", ""), e.get("reason", ""))
        for test_id, e in table.items()
    }


def problems(expected: dict[str, Expectation], selected: tuple[str, ...]) -> list[str]:
    """What is wrong with the file itself: tests missing or extra, bad outcomes, owed reasons."""
    found = [f"{t}: selected but not in expectations.toml" for t in selected if t not in expected]
    found += [f"{t}: in expectations.toml but not selected" for t in expected if t not in selected]
    for test_id, e in expected.items():
        if e.outcome not in OUTCOMES:
            found.append(f"{test_id}: outcome {e.outcome!r} is not one of {OUTCOMES}")
        if e.outcome != "pass" and (not e.reason.strip() or e.reason.startswith(TODO)):
            found.append(f"{test_id}: {e.describe()} needs a hand-written reason")
        if e.outcome == "pass" and e.reason:
            found.append(f"{test_id}: a pass carries no reason")
    return found


def changes(expected: dict[str, Expectation], outcomes: list[Outcome]) -> list[str]:
    """One line per test whose run differs from its expectation (a test not run included)."""
    seen = {o.test_id: o for o in outcomes}
    found = []
    for test_id, e in expected.items():
        o = seen.get(test_id)
        if o is None:
            found.append(f"{test_id}: expected {e.describe()}, not run")
        elif not e.matches(o):
            actual = f"{o.outcome}({o.exception})" if o.exception else o.outcome
            found.append(f"{test_id}: expected {e.describe()}, got {actual}: {o.message}")
    return found


def _stanza(test_id: str, outcome: str, exception: str, reason: str) -> str:
    lines = [f"[{json.dumps(test_id)}]", f"outcome = {json.dumps(outcome)}"]
    if exception:
        lines.append(f"exception = {json.dumps(exception)}")
    if reason:
        lines.append(f"reason = {json.dumps(reason, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def render(
    expected: dict[str, Expectation], outcomes: list[Outcome], selected: tuple[str, ...]
) -> str:
    """The file for `selected` after `outcomes`: reasons kept where the outcome is unchanged,
    "TODO: <the rank's message>" where a non-pass outcome is new."""
    seen = {o.test_id: o for o in outcomes}
    stanzas = []
    for test_id in selected:
        o, e = seen.get(test_id), expected.get(test_id)
        if o is None:  # not run this time (--only): keep what the file says
            if e is not None:
                stanzas.append(_stanza(test_id, e.outcome, e.exception, e.reason))
            continue
        reason = ""
        if o.outcome != "pass":
            kept = e is not None and e.matches(o) and bool(e.reason)
            reason = e.reason if kept and e is not None else f"{TODO}: {o.message}".rstrip(": ")
        stanzas.append(_stanza(test_id, o.outcome, o.exception, reason))
    return HEADER + "\n" + "\n".join(stanzas)


def summary(outcomes: list[Outcome]) -> str:
    counts = {k: sum(o.outcome == k for o in outcomes) for k in OUTCOMES}
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n) + f" of {len(outcomes)}"
