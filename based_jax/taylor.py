"""Second-order Taylor feature maps of BASED linear attention (MATH §2.1, based_zoology §1).

Both forms satisfy ``phi(q)·phi(k) = 1 + s + s²/2`` with ``s = q·k / sqrt(d')``, the second-order
Taylor expansion of ``exp(s)``; since ``1 + s + s²/2 = ((s + 1)² + 1) / 2 >= 1/2`` every kernel
weight is positive and the attention denominator never vanishes.

* ``full`` (what the released models build): ``[1, x / d'^{1/4}, vec(x ⊗ x) / (sqrt 2 sqrt d')]``,
  width ``1 + d' + d'²`` (273 for d' = 16), the outer product flattened row-major (index m d' + n).
* ``compact`` (zoology ``forward_mem_save``, FLA): ``[1, x / d'^{1/4}, x_i² / (sqrt 2 sqrt d'),
  x_i x_j / sqrt d' for i < j]``, width ``1 + d' + d'(d'+1)/2`` (153 for d' = 16). Each off-diagonal
  pair appears once instead of twice, hence the sqrt 2 larger scale; the dot product is identical.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Feature = Literal["full", "compact"]
FEATURES: tuple[str, ...] = ("full", "compact")


def feature_width(d: int, feature: Feature = "compact") -> int:
  """F: the width of ``taylor_features`` for key dim ``d`` (273 / 153 at d = 16)."""
  _check_feature(feature)
  return 1 + d + (d * d if feature == "full" else d * (d + 1) // 2)


def taylor_kernel(s: jax.Array) -> jax.Array:
  """``phi(q)·phi(k)`` as a function of ``s = q·k / sqrt(d')``: ``1 + s + s²/2``."""
  return 1.0 + s + 0.5 * s * s


def taylor_features(x_ZxK: jax.Array, feature: Feature = "compact") -> jax.Array:
  """phi(x) over the last axis: [..., d'] -> [..., F], in x's dtype (module docstring)."""
  _check_feature(feature)
  d = x_ZxK.shape[-1]
  ones_Zx1 = jnp.ones_like(x_ZxK[..., :1])
  linear_ZxK = x_ZxK * (d ** -0.25)
  if feature == "full":
    outer_ZxKxK = x_ZxK[..., :, None] * x_ZxK[..., None, :]
    quad_ZxQ = outer_ZxKxK.reshape(*x_ZxK.shape[:-1], d * d) / math.sqrt(2.0 * d)
  else:
    # Row i of the upper triangle, x_i x_j for j >= i (static slices: cheap to differentiate).
    # Diagonal terms count once in (q·k)², off-diagonal pairs twice: scale those by sqrt 2 more.
    scale_K = np.full(d, 1.0 / math.sqrt(d))
    scale_K[0] = 1.0 / math.sqrt(2.0 * d)
    quad_ZxQ = jnp.concatenate(
        [x_ZxK[..., i:i + 1] * x_ZxK[..., i:] * scale_K[:d - i].astype(x_ZxK.dtype)
         for i in range(d)], axis=-1)
  return jnp.concatenate([ones_Zx1, linear_ZxK, quad_ZxQ], axis=-1)


def _check_feature(feature: str) -> None:
  if feature not in FEATURES:
    raise ValueError(f"unknown Taylor feature form {feature!r}; valid forms: {', '.join(FEATURES)}")
