"""The plain forms of SANATAN attention (MATH §1.1 step 6, §1.2), the references of the tests.

* ``parallel``: the materialised T x T weights, differentiated by autodiff; any p and channel variant
  (the tests' reference; not a backend: ``xla.parallel`` is the one that runs).
* ``recurrent`` (p = 1, 6ch; the backend ``Recurrent``, the decode path): write-then-read
  ``S_t = S_{t-1} + Phi(k_t) v_t^T``, ``z_t = z_{t-1} + Phi(k_t)``,
  ``o_t = Phi(q_t)^T S_t / (Phi(q_t)^T z_t + c eps)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmcore.ops.common import flops
from lmcore.ops.common.backend import Backend
from sanatan_jax.ops.sanatan_attention import base
from sanatan_jax.ops.sanatan_attention.base import EPS, Options, Problem, SanatanState, einsum


def parallel(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array, lam_raw: jax.Array, *,
             positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
             state: SanatanState | None = None,
             options: Options = Options()) -> tuple[jax.Array, SanatanState | None]:
  """o [B, T, H, dv] from the full T x T score matrix, and the final state at p = 1 with 6 channels
  (else None); arguments as ``sanatan_attention``'s."""
  x = base.prepare(q, k, omega, lam_raw, positions, segment_ids, state, options)
  T = q.shape[1]
  s_BxHxTxT = einsum("bthf,bshf->bhts", x.phi_q, x.phi_k)
  causal_TxT = jnp.tril(jnp.ones((T, T), bool))
  mask_BxTxT = causal_TxT[None] & (x.doc[:, :, None] == x.doc[:, None, :])
  w_BxHxTxT = base.power_weights(s_BxHxTxT, mask_BxTxT[:, None], p=options.p,
                                 channels=options.channels, three_channel=options.three_channel,
                                 d=q.shape[-1])
  num_BxTxHxV = einsum("bhts,bshv->bthv", w_BxHxTxT.astype(v.dtype), v)
  den_BxTxH = jnp.sum(w_BxHxTxT, axis=-1).transpose(0, 2, 1)
  return base.power_output(num_BxTxHxV, den_BxTxH, v, x, state, options)


def token_step(S_BxHxFxV, z_BxHxF, q_BxHxF, k_BxHxF, v_BxHxV, c: float):
  """One token of the recurrence: the new (S, z) and o [B, H, dv] (fp32).

  Written as products and sums over F rather than dots, so that XLA can compute the new state and
  the readout in one pass over S (a decode step reads the fp32 state once and writes it once).
  """
  k_BxHxF, q_BxHxF = k_BxHxF.astype(base.F32), q_BxHxF.astype(base.F32)
  S_BxHxFxV = S_BxHxFxV + k_BxHxF[..., :, None] * v_BxHxV.astype(base.F32)[..., None, :]
  z_BxHxF = z_BxHxF + k_BxHxF
  num_BxHxV = jnp.sum(q_BxHxF[..., :, None] * S_BxHxFxV, axis=-2)
  den_BxH = jnp.sum(q_BxHxF * z_BxHxF, axis=-1)
  return S_BxHxFxV, z_BxHxF, num_BxHxV / (den_BxH[..., None] + c * EPS)


def recurrent(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array, lam_raw: jax.Array, *,
              positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
              state: SanatanState | None = None,
              options: Options = Options()) -> tuple[jax.Array, SanatanState]:
  """Token-by-token write-then-read recurrence (p = 1, 6 channels): o [B, T, H, dv] in v's dtype
  and the final state. One token (decoding) is one ``token_step``, without a scan."""
  x = base.prepare(q, k, omega, lam_raw, positions, segment_ids, state, options)
  B, T, H, _ = q.shape
  S_BxHxFxV, z_BxHxF = base.start_state(state, B, H, x.phi_q.shape[-1], v.shape[-1])
  if T == 1:  # a lone token continues the incoming state's document
    S_BxHxFxV, z_BxHxF, o_BxHxV = token_step(S_BxHxFxV, z_BxHxF, x.phi_q[:, 0], x.phi_k[:, 0], v[:, 0],
                                             x.c)
    new_state = SanatanState(S_BxHxFxV, z_BxHxF, base.next_position(x.positions))
    return o_BxHxV[:, None].astype(v.dtype), new_state

  def step(carry, xs):
    S_BxHxFxV, z_BxHxF, doc_prev_B = carry
    q_BxHxF, k_BxHxF, v_BxHxV, doc_B = xs
    keep_B = doc_B == doc_prev_B
    S_BxHxFxV = jnp.where(keep_B[:, None, None, None], S_BxHxFxV, 0.0)
    z_BxHxF = jnp.where(keep_B[:, None, None], z_BxHxF, 0.0)
    S_BxHxFxV, z_BxHxF, o_BxHxV = token_step(S_BxHxFxV, z_BxHxF, q_BxHxF, k_BxHxF, v_BxHxV, x.c)
    return (S_BxHxFxV, z_BxHxF, doc_B), o_BxHxV

  xs = tuple(a.swapaxes(0, 1) for a in (x.phi_q, x.phi_k, v, x.doc))
  init = (S_BxHxFxV, z_BxHxF, jnp.zeros((B,), jnp.int32))
  (S_BxHxFxV, z_BxHxF, _), o_TxBxHxV = jax.lax.scan(step, init, xs)
  new_state = SanatanState(S_BxHxFxV, z_BxHxF, base.next_position(x.positions))
  return o_TxBxHxV.swapaxes(0, 1).astype(v.dtype), new_state


class Recurrent(Backend[None]):
  """``recurrent`` as a backend: any platform, p = 1 with 6 channels; the decode path."""

  requirement = "p = 1 with 6 channels"

  def supports(self, problem: Problem) -> bool:
    return problem.constant_state

  def flops_per_head(self, problem: Problem, tiles=None) -> float:
    return flops.recurrent(problem.feature_dim, problem.value_dim + 1)

  def __call__(self, q, k, v, omega, lam_raw, *, positions, segment_ids, state, tiles=None,
               options: Options = Options()):
    del tiles
    return recurrent(q, k, v, omega, lam_raw, positions=positions, segment_ids=segment_ids,
                     state=state, options=options)
