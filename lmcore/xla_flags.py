"""XLA flags the entry points set by default, before JAX starts its backends.

``DEFAULTS``: ``--xla_gpu_enable_triton_gemm=false`` runs XLA's matrix multiplications on cuBLAS
instead of its Triton GEMM emitter. On one H200 (``scripts/bench_train.py``, 32 × 2048, two processes
one after the other; docs/BENCHMARKS.md) the softmax model on the SANATAN 184M backbone went from 308.0 to
243.5 ms per step (212.8K → 269.1K tokens/s) and SANATAN p = 1 from 406.3 to 338.7 ms: the Triton
GEMMs of the tied 126,349-word output layer took 45% of the softmax step. The flag only concerns
GPUs; other backends ignore it. A flag already named in ``XLA_FLAGS`` is left as the user set it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULTS = ("--xla_gpu_enable_triton_gemm=false",)


def _name(flag: str) -> str:
  return flag.split("=", 1)[0].lstrip("-")


def with_defaults(xla_flags: str, defaults: tuple[str, ...] = DEFAULTS) -> str:
  """``xla_flags`` (the XLA_FLAGS string) plus every default whose flag it does not name."""
  named = {_name(flag) for flag in xla_flags.split()}
  return " ".join([*xla_flags.split(), *(flag for flag in defaults if _name(flag) not in named)])


def apply_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
  """Sets ``XLA_FLAGS`` in ``environ`` to ``with_defaults`` of its value. Call it before the first
  JAX computation (backends read XLA_FLAGS once, when they start)."""
  environ["XLA_FLAGS"] = with_defaults(environ.get("XLA_FLAGS", ""))
