"""Mutation check: each curated one-line fault in ``tests/mutants.toml`` must make its test fail.

    python scripts/mutate.py                 # every mutant (``make mutate``)
    python scripts/mutate.py --only decay    # the mutants whose name contains "decay"
    python scripts/mutate.py --list

The working tree (tracked and untracked files that git does not ignore) is copied to a temporary folder;
each mutant replaces one line of that copy, runs its test there with pytest, and puts the line back. A
mutant is *killed* when its test fails and *survives* when it passes. Each test selection first runs on
the unmutated copy and must pass there (else the report says so and nothing is counted). Exit status 0
when every mutant is killed, 1 when one survives, 2 for a stale mutant (its line is not in the file once)
or a test that fails or cannot run without a mutant.

Adding a mutant: append a ``[[mutant]]`` table to ``tests/mutants.toml`` with

    name        = "what the fault does, in a few words"
    file        = "lmcore/train/optim.py"          # relative to the repository root
    original    = "return getattr(path[-1], ...)"  # one line of that file, without its indentation
    replacement = "return True"                    # what it becomes (the line's indentation is kept)
    test        = "tests/train/test_optim.py"      # the test file that must kill it
    k           = "decayed"                        # optional: pytest -k expression

then run ``python scripts/mutate.py --only "<name>"``: the fault must be silent to the code (it runs,
it only computes something else) and the test must fail on it. Keep ``test`` and ``k`` narrow; the runner
is not part of CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTANTS = os.path.join(REPO, "tests", "mutants.toml")
# pytest exit codes: 0 passed, 1 some test failed; anything else means the test did not run.
PASSED, FAILED = 0, 1


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  file: str
  original: str
  replacement: str
  test: str
  k: str = ""

  def selection(self) -> tuple[str, str]:
    return self.test, self.k


def load_mutants(path: str = MUTANTS) -> list[Mutant]:
  with open(path, "rb") as f:
    entries = tomllib.load(f).get("mutant", [])
  fields = {f.name for f in dataclasses.fields(Mutant)}
  mutants = []
  for i, entry in enumerate(entries):
    unknown = set(entry) - fields
    if unknown:
      raise SystemExit(f"{path}: mutant {i} ({entry.get('name', '?')}) has unknown keys {sorted(unknown)}; "
                       f"valid keys: {sorted(fields)}.")
    mutants.append(Mutant(**entry))
  return mutants


def copy_tree(destination: str) -> None:
  """The working tree's files that git tracks or would track (ignored files, e.g. .venv, stay out)."""
  listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
  for name in filter(None, listing):
    source = os.path.join(REPO, name)
    if os.path.isfile(source):  # a tracked file deleted in the working tree is left out
      os.makedirs(os.path.dirname(os.path.join(destination, name)), exist_ok=True)
      shutil.copy2(source, os.path.join(destination, name))


def mutated_text(text: str, mutant: Mutant) -> str:
  """``text`` with the one line equal to ``mutant.original`` (indentation aside) replaced."""
  lines = text.splitlines(keepends=True)
  matches = [i for i, line in enumerate(lines) if line.strip() == mutant.original.strip()]
  if len(matches) != 1:
    raise LookupError(f"mutant {mutant.name!r}: {len(matches)} lines of {mutant.file} read "
                      f"{mutant.original.strip()!r} (need exactly one); update tests/mutants.toml.")
  line = lines[matches[0]]
  indent = line[:len(line) - len(line.lstrip())]
  ending = line[len(line.rstrip("\r\n")):]
  lines[matches[0]] = indent + mutant.replacement.strip() + ending
  return "".join(lines)


def run_test(tree: str, test: str, k: str, timeout: float) -> tuple[int | None, float, str]:
  """(pytest's exit code or None on timeout, seconds, the output's tail) of ``test`` run in ``tree``."""
  cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test, *(["-k", k] if k else [])]
  env = {**os.environ, "PYTHONPATH": tree, "PYTHONDONTWRITEBYTECODE": "1"}
  start = time.time()
  try:
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return None, time.time() - start, ""
  return proc.returncode, time.time() - start, (proc.stdout + proc.stderr)[-2000:]


def describe(test: str, k: str) -> str:
  return f"{test}" + (f" -k {k!r}" if k else "")


def check_baselines(tree: str, mutants: list[Mutant], timeout: float) -> bool:
  """Every test selection passes on the unmutated tree."""
  ok = True
  for test, k in dict.fromkeys(m.selection() for m in mutants):
    code, seconds, tail = run_test(tree, test, k, timeout)
    print(f"baseline  {'passes' if code == PASSED else 'FAILS '}  {describe(test, k)} ({seconds:.0f} s)",
          flush=True)
    if code != PASSED:
      print(tail, flush=True)
      ok = False
  return ok


def run_mutants(tree: str, mutants: list[Mutant], timeout: float) -> dict[str, list[str]]:
  """Applies each mutant in turn, runs its test and restores the file; returns names by outcome."""
  outcomes: dict[str, list[str]] = {"killed": [], "survived": [], "error": []}
  for mutant in mutants:
    path = os.path.join(tree, mutant.file)
    with open(path) as f:
      original = f.read()
    try:
      with open(path, "w") as f:
        f.write(mutated_text(original, mutant))
      code, seconds, tail = run_test(tree, mutant.test, mutant.k, timeout)
    except LookupError as e:
      code, seconds, tail = -1, 0.0, str(e)
    finally:
      with open(path, "w") as f:
        f.write(original)
    outcome = {FAILED: "killed", None: "killed", PASSED: "survived"}.get(code, "error")
    outcomes[outcome].append(mutant.name)
    note = " (timeout)" if code is None else ""
    print(f"{outcome.upper():8s}  {mutant.name}  [{describe(mutant.test, mutant.k)}, {seconds:.0f} s]{note}",
          flush=True)
    if outcome == "error":
      print(tail, flush=True)
  return outcomes


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", default="", help="run the mutants whose name contains this text")
  parser.add_argument("--list", action="store_true", help="list the mutants and exit")
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test run (a timeout kills)")
  args = parser.parse_args(argv)
  mutants = [m for m in load_mutants() if args.only in m.name]
  if args.list or not mutants:
    for m in mutants:
      print(f"{m.name}  ({m.file}; {describe(m.test, m.k)})")
    return 0 if mutants else 2
  with tempfile.TemporaryDirectory(prefix="mutate-") as tree:
    copy_tree(tree)
    if not check_baselines(tree, mutants, args.timeout):
      print("A test fails without any mutant: fix it first; no mutant was run.")
      return 2
    outcomes = run_mutants(tree, mutants, args.timeout)
  print(f"{len(outcomes['killed'])} killed, {len(outcomes['survived'])} survived, {len(outcomes['error'])} "
        f"could not run, of {len(mutants)} mutants.")
  for name in outcomes["survived"]:
    print(f"  survived: {name}")
  return 2 if outcomes["error"] else 1 if outcomes["survived"] else 0


if __name__ == "__main__":
  sys.exit(main())
