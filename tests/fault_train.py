"""``train.py`` with an injected fault, for the resume tests: SIGKILL the process right after the
checkpoint of step ``$KILL_AFTER_STEP`` is committed (as a crash or a preempted host would).

    KILL_AFTER_STEP=4 python tests/fault_train.py <train.py flags>
"""

import os
import runpy
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from lmcore.train import checkpoint  # noqa: E402


def _kill_after(step_to_kill: int) -> None:
  save = checkpoint.Checkpointer.save

  def save_then_die(self, step, *args, **kwargs):
    save(self, step, *args, **kwargs)
    if step == step_to_kill:
      self.wait()
      os.kill(os.getpid(), signal.SIGKILL)

  checkpoint.Checkpointer.save = save_then_die


if __name__ == "__main__":
  _kill_after(int(os.environ["KILL_AFTER_STEP"]))
  sys.argv[0] = os.path.join(REPO, "train.py")
  runpy.run_path(sys.argv[0], run_name="__main__")
