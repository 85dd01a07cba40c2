"""The relative error every correctness comparison uses (tests, ``benchmarks.kernel_check``; fla.md §3)."""

import numpy as np


def relative_l2(a, b, floor: float = 1e-30) -> float:
  """``||a - b|| / max(||b||, floor)`` over all elements, in float64; ``b`` is the reference.

  ``floor`` keeps the ratio finite for analytically (near-)zero references.
  """
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor))
