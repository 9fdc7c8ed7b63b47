"""The planted-bug list of `make mutants` (tests/mutants.py) follows the code: every mutant's old
text occurs exactly once in its file and its relevant test files exist. Checked here, in every
`make test`, because `make mutants` itself is not part of it (a refactor once left a mutant's text
behind and only `make mutants` noticed)."""

from __future__ import annotations

import pytest
from mutants import MUTANTS, REPO, Mutant, patched


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_to_the_code_and_names_existing_tests(mutant: Mutant) -> None:
    text = patched(mutant)  # raises naming the mutant when its old text drifted
    assert text != (REPO / mutant.path).read_text()
    for test_file in mutant.tests:
        assert (REPO / test_file).is_file(), (mutant, test_file)
