"""Where a run's wall time goes: host-side phase accounting and goodput (step time ÷ wall time).

A run is always in exactly one phase; ``PhaseClock.phase(name)`` switches to ``name`` for the duration of
a ``with`` block and back to the enclosing phase after it, so the phases partition the wall time:

    start-up    imports (the first run of a process), config, data sources, held-out set, model
                initialisation or restore, the data iterator's first batch
    compile     compiling the train step (ahead of its first call)
    steps       dispatching steps and waiting for the device to finish them; also getting the next
                batch while the previous step still runs on the device (part ``steps/data_overlapped``),
                which costs the device nothing
    data_wait   waiting for the next batch from the input pipeline with no step left on the device
    checkpoint  starting saves, and waiting for them where the loop must
    eval        periodic and final evaluations, by part: held-out loss, paired implementations, gate
                statistics, the unigram yardstick
    shutdown    the last save's commit, stopping the data workers, closing the writers

A phase's parts are phases named ``<phase>/<part>`` (``eval/heldout``, ``startup/restore``): the record
gives each phase's total and its parts. Goodput is ``steps / wall``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Iterator, Sequence

PHASES = ("startup", "compile", "steps", "data_wait", "checkpoint", "eval", "shutdown")


def process_age_s() -> float:
  """Seconds since this process started (Linux: ``/proc``), 0 where that is unknown."""
  try:
    with open("/proc/self/stat") as f:
      start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
      uptime_s = float(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return 0.0
  return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))


_process_start_pending = False


def count_process_start() -> None:
  """Called by an entry point as its ``main`` starts: the next run of this process charges the process's
  age (interpreter start, imports, argument parsing) to its start-up."""
  global _process_start_pending
  _process_start_pending = True


def take_process_start() -> float:
  """The process's age if an entry point asked for it (``count_process_start``) and no run took it yet,
  else 0: a process that trains several runs charges its start to the first, and a library caller (a
  notebook, a test) to none."""
  global _process_start_pending
  if not _process_start_pending:
    return 0.0
  _process_start_pending = False
  return process_age_s()


class PhaseClock:
  """Host wall time per phase. ``before_s``: wall time that preceded the clock and counts as start-up
  (the process's imports)."""

  def __init__(self, before_s: float = 0.0, *, clock=time.perf_counter):
    self._clock = clock
    self._start = clock() - before_s
    self._seconds: dict[str, float] = {"startup/imports": before_s} if before_s else {}
    self._current = "startup"
    self._since = self._start + before_s

  @property
  def current(self) -> str:
    return self._current

  def switch(self, name: str, *, charge_as: str | None = None) -> str:
    """Charges the time since the last switch to the current phase (to ``charge_as`` instead, when the
    current phase turned out to be another), enters ``name``; returns the phase left."""
    now = self._clock()
    charged = charge_as or self._current
    self._seconds[charged] = self._seconds.get(charged, 0.0) + now - self._since
    previous, self._current, self._since = self._current, name, now
    return previous

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[None]:
    previous = self.switch(name)
    try:
      yield
    finally:
      self.switch(previous)

  def seconds(self) -> dict[str, float]:
    """Seconds per phase so far (the current phase up to now), parts of ``eval`` under their own names."""
    now = self._clock()
    totals = dict(self._seconds)
    totals[self._current] = totals.get(self._current, 0.0) + now - self._since
    return totals

  def phase_s(self, phase: str) -> float:
    """Seconds in ``phase`` so far, its parts included."""
    return sum(s for name, s in self.seconds().items() if name.partition("/")[0] == phase)

  def wall_s(self) -> float:
    return self._clock() - self._start

  def goodput(self) -> float:
    wall = self.wall_s()
    return self.phase_s("steps") / wall if wall > 0 else 0.0

  def record(self) -> dict[str, Any]:
    """``{"wall_s", "goodput", "phases": {phase: s}, "parts": {phase: {part: s}}}``: the JSON of a run's
    breakdown (a phase's seconds include its parts')."""
    seconds, wall = self.seconds(), self.wall_s()
    phases = {name: 0.0 for name in PHASES}
    parts: dict[str, dict[str, float]] = {}
    for name, s in seconds.items():
      phase, _, part = name.partition("/")
      if phase not in phases:
        phase, part = "other", name
      phases[phase] = phases.get(phase, 0.0) + s
      if part:
        parts.setdefault(phase, {})[part] = parts.get(phase, {}).get(part, 0.0) + s
    return {"wall_s": wall, "goodput": phases["steps"] / wall if wall > 0 else 0.0, "phases": phases,
            "parts": parts}


def fetch_beside(clock: PhaseClock, fetch: Callable[[], Any], running: Sequence[Any]) -> Any:
  """``fetch()`` (the next batch), charged to ``data_wait`` unless the computation that writes
  ``running`` (arrays with ``is_ready()``: the outputs of the step just dispatched) is still running
  when it returns; the device then had work throughout and the time counts as ``steps/data_overlapped``.
  Returns to ``steps``."""
  clock.switch("data_wait")
  value = fetch()
  busy = not all(x.is_ready() for x in running)
  clock.switch("steps", charge_as="steps/data_overlapped" if busy else None)
  return value


def summary_line(record: dict[str, Any]) -> str:
  """``wall W s: steps S s (G %; data overlapped ...), startup ... s (imports ..., ...), compile ... s, ...``:
  each phase's seconds, and its parts' where it has them."""
  phases, parts = record["phases"], record["parts"]

  def parts_text(name: str) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in parts.get(name, {}).items())

  steps_parts = parts_text("steps")
  texts = [f"steps {phases['steps']:.1f} s ({100 * record['goodput']:.0f} %"
           + (f"; {steps_parts})" if steps_parts else ")")]
  for name, seconds in phases.items():
    if name == "steps" or (name == "other" and not seconds):
      continue
    text = f"{name.replace('_', ' ')} {seconds:.1f} s"
    if parts.get(name):
      text += f" ({parts_text(name)})"
    texts.append(text)
  return f"wall {record['wall_s']:.1f} s: " + ", ".join(texts)
