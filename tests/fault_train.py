"""``train.py`` with an injected fault, for the resume and signal tests:

* ``KILL_AFTER_STEP=N``: SIGKILL the process right after the checkpoint of step N is committed (as a
  crash or a preempted host would);
* ``TERM_GROUP_AFTER_STEP=N``: SIGTERM to the whole process group (the data workers too, as a job
  scheduler or a Ctrl-C does) right after the checkpoint of step N is committed;
* ``TERM_GROUP_AT_EVAL=1``: the same when the final evaluation starts.

    KILL_AFTER_STEP=4 python tests/fault_train.py <train.py flags>
"""

import os
import runpy
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from lmcore.train import checkpoint  # noqa: E402
from lmcore.train import loop  # noqa: E402


def _after_save(step_to_fault: int, fault) -> None:
  save = checkpoint.Checkpointer.save

  def save_then_fault(self, step, *args, **kwargs):
    save(self, step, *args, **kwargs)
    if step == step_to_fault:
      self.wait()
      fault()

  checkpoint.Checkpointer.save = save_then_fault


def _at_eval(fault) -> None:
  evaluate_run = loop.evaluate_run

  def fault_then_evaluate(*args, **kwargs):
    fault()
    return evaluate_run(*args, **kwargs)

  loop.evaluate_run = fault_then_evaluate


def _term_group() -> None:
  os.killpg(os.getpgrp(), signal.SIGTERM)


if __name__ == "__main__":
  if "KILL_AFTER_STEP" in os.environ:
    _after_save(int(os.environ["KILL_AFTER_STEP"]), lambda: os.kill(os.getpid(), signal.SIGKILL))
  if "TERM_GROUP_AFTER_STEP" in os.environ:
    _after_save(int(os.environ["TERM_GROUP_AFTER_STEP"]), _term_group)
  if os.environ.get("TERM_GROUP_AT_EVAL"):
    _at_eval(_term_group)
  sys.argv[0] = os.path.join(REPO, "train.py")
  runpy.run_path(sys.argv[0], run_name="__main__")
