"""What a block keeps for the backward pass under ``model.remat``; the rest is recomputed there.

``ModelConfig.remat_policy`` names one policy of ``POLICIES`` for every layer, or one per layer with
the syntax of ``model.pattern`` (``"dots*27;full@0,13"``: layers 0 and 13 ``full``, the rest ``dots``).

* ``none``: no recomputation; autodiff keeps what it needs (as without ``model.remat``).
* ``full``: the block's input only; the backward runs the whole block's forward again (one more
  forward of every matrix multiplication).
* ``dots``: also the outputs of the block's projections (matrix multiplications without batch
  dimensions: q/k/v and in/out projections, the MLP's gate and up). Norms, activations, gates, the
  short convolutions, the sliding-window scores and softmax and the attention kernels are recomputed:
  work on activations already in memory, no projection again.
* ``dots_except_mlp``: ``dots`` for the mixer half; the MLP half keeps only its input and recomputes
  its gate and up projections (its two halves are two checkpoints, so the residual stream between
  them is kept in fp32 instead of the mixer's bf16 output).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

_NOTHING = jax.checkpoint_policies.nothing_saveable
_DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@dataclasses.dataclass(frozen=True)
class Policy:
  """``jax.checkpoint`` policies: ``block`` for the whole block (None: no checkpoint), or for its mixer
  half when the MLP half has its own, ``mlp``."""

  block: Callable | None
  mlp: Callable | None = None


POLICIES = {
    "none": Policy(None),
    "full": Policy(_NOTHING),
    "dots": Policy(_DOTS),
    "dots_except_mlp": Policy(_DOTS, mlp=_NOTHING),
}
