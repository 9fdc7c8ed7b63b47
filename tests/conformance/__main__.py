"""`python -m tests.conformance`: run torch's own DDP tests against megabuf (issue 40).

    python -m tests.conformance              # the selection on megabuf: per-test outcome, expected
                                             # vs actual; exit 1 on any change
    python -m tests.conformance --ddp torch  # the same selection on torch DDP (the harness check:
                                             # every test should pass)
    python -m tests.conformance --refresh    # run, then rewrite expectations.toml
    python -m tests.conformance --only test_ddp_sink_noclone   # a subset (substring of the id)
    python -m tests.conformance --discover   # re-derive the selection (discover.py)

Needs `expecttest` (torch's test modules import it; in the `test` extra) and the repository
root on PYTHONPATH (run it from there with `PYTHONPATH=$PWD`).

[Note: refreshing]
After a change to megabuf (or to torch) moves tests: `--refresh` runs the selection and rewrites
expectations.toml; tests whose outcome is unchanged keep their reason, a test that now passes
loses its, and a newly failing one gets `reason = "TODO: <the rank's message>"`, which the tier
refuses until a person writes the real reason. `git diff tests/conformance/expectations.toml`
then shows exactly what moved; update the README's counts from the summary line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from . import expectations, selection, suite

PER_TEST_TIMEOUT_S = 30  # torch DDP runs each selected test in 0.3-3 s here


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance", description=__doc__)
    parser.add_argument("--ddp", default="megabuf", choices=("megabuf", "torch"))
    parser.add_argument("--only", nargs="+", default=None, help="substrings of test ids to run")
    parser.add_argument("--refresh", action="store_true", help="rewrite expectations.toml")
    parser.add_argument("--discover", action="store_true", help="re-derive the selection")
    parser.add_argument("--json", default=None, help="write the outcomes here as JSON")
    parser.add_argument("--timeout", type=int, default=PER_TEST_TIMEOUT_S, help="per test, s")
    return parser.parse_args(argv)


def _report(
    impl: str, outcomes: list[suite.Outcome], expected: dict[str, expectations.Expectation]
) -> None:
    for o in outcomes:
        e = expected.get(o.test_id)
        actual = f"{o.outcome}({o.exception})" if o.exception else o.outcome
        mark = "" if e is not None and e.matches(o) else "  CHANGED"
        was = e.describe() if e is not None else "-"
        detail = f"  {o.message[:110]}" if o.outcome != "pass" else ""
        print(f"{actual:28} expected {was:28} {o.seconds:5.1f}s {o.test_id}{mark}{detail}")
    print(f"torch DDP tests on {impl}: {expectations.summary(outcomes)}")


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.discover:
        from . import discover

        print("# for SELECTED in tests/conformance/selection.py:")
        for test_id in discover.discover(args.timeout):
            print(f'    "{test_id}",')
        return 0
    chosen = [t for t in selection.SELECTED if not args.only or any(s in t for s in args.only)]
    outcomes = suite.run_selection(chosen, args.ddp, args.timeout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(o) for o in outcomes], f, indent=1)
    expected = expectations.load()
    if args.ddp == "torch":  # the harness check: torch DDP is expected to pass everything
        expected = {t: expectations.Expectation("pass") for t in chosen}
    _report(args.ddp, outcomes, expected)
    if args.refresh and args.ddp == "megabuf":
        text = expectations.render(expected, outcomes, selection.SELECTED)
        expectations.PATH.write_text(text)
        print(f"wrote {expectations.PATH}")
    found = expectations.changes({t: expected[t] for t in chosen if t in expected}, outcomes)
    for line in found:
        print(f"CHANGED {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
