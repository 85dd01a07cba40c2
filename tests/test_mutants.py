"""Every curated mutant of ``make mutate`` (tests/mutants.toml) still names exactly one line of its file,
differs from it, and names a test file that exists: a change to the code cannot leave a mutant stale
until someone runs the mutation check."""

import os

import pytest

from scripts import mutate

MUTANTS = mutate.load_mutants()


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_mutant_applies_to_exactly_one_line_and_its_test_exists(mutant):
  with open(os.path.join(mutate.REPO, mutant.file)) as f:
    text = f.read()
  assert mutate.mutated_text(text, mutant) != text
  assert os.path.isfile(os.path.join(mutate.REPO, mutant.test))
