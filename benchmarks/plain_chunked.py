"""A plain chunked form of SANATAN p = 1, as a benchmark baseline (not an implementation of the op).

Whole-array einsums in chunks of C tokens (MATH §1.2), the features from ``base.prepare``: per chunk
the masked block A_n = Mask ⊙ Phi(Q_n) Phi(K_n)ᵀ and the increment ΔS_n = Phi(K_n)ᵀ V_n, the states
entering the chunks as an exclusive ``jnp.cumsum`` over chunks, O_n = (A_n V_n + Phi(Q_n) S_<n) /
(A_n 1 + Phi(Q_n) z_<n + c · eps). No packed documents, no incoming or final state, no
recomputation in the backward pass: what the op's "chunked" form does beyond this is what the
benchmarks' comparison with this baseline costs it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sanatan_jax.ops.sanatan_attention import base

F32 = jnp.float32


def plain_chunked(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array, lam_raw: jax.Array,
                  chunk_size: int = 64) -> jax.Array:
  """o [B, T, H, dv] in v's dtype, for T a multiple of ``chunk_size``."""
  x = base.prepare(q, k, omega, lam_raw, None, None, None, base.Options())
  B, T, H, _ = q.shape
  C = min(chunk_size, T)
  if T % C:
    raise ValueError(f"plain_chunked: T={T} must be a multiple of chunk_size={C}")
  chunks = lambda a: a.reshape(B, T // C, C, H, a.shape[-1])
  q_BxNxCxHxF, k_BxNxCxHxF, v_BxNxCxHxV = chunks(x.phi_q), chunks(x.phi_k), chunks(v)
  s_BxNxHxCxC = jnp.einsum("bnqhf,bnkhf->bnhqk", q_BxNxCxHxF, k_BxNxCxHxF, preferred_element_type=F32)
  s_BxNxHxCxC = jnp.where(jnp.tril(jnp.ones((C, C), bool)), s_BxNxHxCxC, 0.0)
  num_BxNxCxHxV = jnp.einsum("bnhqk,bnkhv->bnqhv", s_BxNxHxCxC.astype(v.dtype), v_BxNxCxHxV,
                             preferred_element_type=F32)
  den_BxNxCxH = s_BxNxHxCxC.sum(-1).transpose(0, 1, 3, 2)
  dS_BxNxHxFxV = jnp.einsum("bnkhf,bnkhv->bnhfv", k_BxNxCxHxF, v_BxNxCxHxV, preferred_element_type=F32)
  dz_BxNxHxF = k_BxNxCxHxF.astype(F32).sum(2)
  S_BxNxHxFxV = jnp.cumsum(dS_BxNxHxFxV, axis=1) - dS_BxNxHxFxV
  z_BxNxHxF = jnp.cumsum(dz_BxNxHxF, axis=1) - dz_BxNxHxF
  num_BxNxCxHxV += jnp.einsum("bnqhf,bnhfv->bnqhv", q_BxNxCxHxF, S_BxNxHxFxV.astype(q.dtype),
                              preferred_element_type=F32)
  den_BxNxCxH += jnp.einsum("bnqhf,bnhf->bnqh", q_BxNxCxHxF, z_BxNxHxF.astype(q.dtype),
                            preferred_element_type=F32)
  o_BxNxCxHxV = num_BxNxCxHxV / (den_BxNxCxH[..., None] + x.c * base.EPS)
  return o_BxNxCxHxV.reshape(B, T, H, -1).astype(v.dtype)
