"""The torch DDP conformance tier (issue 40): torch's own DDP tests, run from the installed wheel
with megabuf bound in place of torch DDP in every rank.

- selection.py: the explicit list of tests, and how it was chosen (discover.py re-derives it);
- binding.py: how megabuf replaces torch DDP for the tests ([Note: binding]);
- suite.py: the test classes, ranks forked per test ([Note: forked ranks]), outcome per test;
- expectations.toml / expectations.py: what each test does on megabuf and why;
- __main__.py: `python -m tests.conformance` ([Note: refreshing]);
- tests/test_torch_conformance.py: the tier inside `make test`.
"""
