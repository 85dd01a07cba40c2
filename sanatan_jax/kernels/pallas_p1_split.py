"""The chunk-parallel ("split") form of the SANATAN p = 1 Pallas kernels: same function, same
chunk math and in-kernel feature map as pallas_p1.py's fused form, but no program walks the chunks.

Per head, with N chunks of C tokens, the state at the start of chunk n follows

    S_{n+1} = keep_n S_n + W_n,   z_{n+1} = keep_n z_n + w_n,

where W_n = sum Phi(k) vᵀ and w_n = sum Phi(k) run over chunk n's last run (its writes) and
keep_n says the state's run continues through the chunk (0 at a new packed document). Forward:

1. a kernel over the grid (batch, head, chunk, value tile) writes every chunk's (W_n, w_n) to
   HBM (fp32, channel-major [6, dp, BV] and [6, dp]);
2. plain JAX solves the recurrence for the state at every chunk start (``_through_chunks``: an
   associative scan over the N chunks, so no sequential loop);
3. a kernel over the same grid computes the outputs of every chunk from its start state and the
   intra-chunk block (pallas_p1._outputs), features recomputed from the raw q, k.

Backward (``jax.custom_vjp``; residuals as the fused form: inputs, o and the fp32 denominator):
the start states are recomputed by phases 1-2; a kernel writes every chunk's contribution
(R_n, r_n) = (sum Phi(q) dNᵀ, sum Phi(q) dD) over its tokens that read the state; the reverse
recurrence G_n = keep_n G_{n+1} + R_n (G_N = dS_T) gives the gradient of the state after every
chunk (and dS_0 = G_0); a last kernel, again over (batch, head, chunk, value tile), computes
d Phi(q) from the start state, d Phi(k) and dv from the gradient after the chunk
(pallas_p1._dphi_q, ._dphi_k_dv) and chains them through the feature map into dq, dk, d omega and
d lam_raw. Sums over value tiles (dq, dk) and over tiles and chunks (d omega, d lam_raw) are
taken outside; the denominator's gradient terms come from value tile 0 only.

The start states S_n enter the output kernel in q's dtype and the gradient kernel in v's (and the
state gradients in v's): the dtypes the fused kernels cast them to before their dots, so this is the
same arithmetic with half the HBM traffic at bf16. The normalisers z and their gradients stay fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lmcore.kernels import pallas_utils as pu
from sanatan_jax.kernels import pallas_p1 as fused
from sanatan_jax.kernels.pallas_p1 import CHANNELS, KernelConfig

_F32 = jnp.float32


def _runs(run_ref, n, C):
  """Chunk n's run ids [C], the run of the state entering it and its last run.

  Runs are non-decreasing, so the state entering chunk n > 0 is in chunk n - 1's last run and
  the initial state in the first token's run.
  """
  run = pu.rows(run_ref, n * C, C)
  previous = pu.rows(run_ref, jnp.maximum(n - 1, 0) * C, C)
  return run, jnp.where(n > 0, jnp.max(previous), jnp.min(previous)), jnp.max(run)


def _writes_kernel(k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, W_ref, w_ref, *, cfg):
  """Phase 1: chunk n's writes (W_n, w_n)."""
  n, C = pl.program_id(2), cfg.chunk
  phi_k, _ = fused._phi(k_ref, (omega_ref, lam_ref, pos_ref), n, cfg)
  run, _, last_run = _runs(run_ref, n, C)
  W, w = fused._writes(phi_k, pu.rows(v_ref, n * C, C), run, last_run)
  fused._store_state(W_ref, w_ref, W, w)


def _output_kernel(q_ref, k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, S_ref, z_ref,
                   o_ref, den_ref, *, cfg):
  """Phase 3: chunk n's outputs and denominators from the state (S_n, z_n) at its start."""
  n, C = pl.program_id(2), cfg.chunk
  x, _, _ = fused._load(n, (q_ref, k_ref, v_ref, run_ref), (omega_ref, lam_ref, pos_ref), cfg)
  _, state_run, _ = _runs(run_ref, n, C)
  o, den = fused._outputs(x, *fused._load_state(S_ref, z_ref), state_run, cfg.c_eps)
  pu.store_rows(o_ref, n * C, o.astype(o_ref.dtype))
  pu.store_rows(den_ref, n * C, den)


def _read_grads_kernel(q_ref, pos_ref, run_ref, omega_ref, lam_ref, dN_ref, dD_ref, R_ref, r_ref,
                       *, cfg):
  """Backward phase 1: what chunk n's reads add to the gradient of the state at its start."""
  n, C = pl.program_id(2), cfg.chunk
  phi_q, _ = fused._phi(q_ref, (omega_ref, lam_ref, pos_ref), n, cfg)
  run, state_run, _ = _runs(run_ref, n, C)
  R, r = fused._read_grads(phi_q, run, state_run, pu.rows(dN_ref, n * C, C),
                           pu.rows(dD_ref, n * C, C))
  fused._store_state(R_ref, r_ref, R, r)


def _grads_kernel(q_ref, k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, S_ref, z_ref,
                  dS_ref, dz_ref, dN_ref, dD_ref,
                  dq_ref, dk_ref, dv_ref, domega_ref, dlam_ref, *, cfg):
  """Backward phase 3: chunk n's dq, dk, dv and its parts of d omega, d lam_raw from the state
  at its start (S_n, z_n) and the gradient of the state after it (G_{n+1}, g_{n+1})."""
  n, C = pl.program_id(2), cfg.chunk
  tile0 = (pl.program_id(3) == 0).astype(_F32)
  x, q_vjp, k_vjp = fused._load(n, (q_ref, k_ref, v_ref, run_ref), (omega_ref, lam_ref, pos_ref),
                                cfg)
  _, state_run, last_run = _runs(run_ref, n, C)
  dN, dD = pu.rows(dN_ref, n * C, C), pu.rows(dD_ref, n * C, C)
  S, z = fused._load_state(S_ref, z_ref)
  dq, domega_q, dlam_q = q_vjp(fused._dphi_q(x, dN, dD, S, z, state_run, tile0))
  dS, dz = fused._load_state(dS_ref, dz_ref)
  dphi_k, dv = fused._dphi_k_dv(x, dN, dD, dS, dz, last_run, tile0)
  dk, domega_k, dlam_k = k_vjp(dphi_k)
  pu.store_rows(dq_ref, n * C, dq)
  pu.store_rows(dk_ref, n * C, dk)
  pu.store_rows(dv_ref, n * C, dv)
  domega_ref[...] = domega_q + domega_k
  dlam_ref[...] = dlam_q + dlam_k


def _specs(Tp, dp, cfg):
  """BlockSpecs over the grid (batch, head, chunk, value tile). Token arrays are whole rows (each
  program reads and writes its chunk's rows, as the fused kernels do); chunk states are
  [B, H, N, 6, dp, Vp] and [B, H, N, 6, dp]."""
  BV = cfg.block_v
  return dict(
      qk=pl.BlockSpec((None, Tp, None, dp), lambda b, h, n, j: (b, 0, h, 0)),
      v=pl.BlockSpec((None, Tp, None, BV), lambda b, h, n, j: (b, 0, h, j)),
      row=pl.BlockSpec((None, Tp), lambda b, h, n, j: (b, 0)),
      param=pl.BlockSpec((None, 1, dp), lambda b, h, n, j: (h, 0, 0)),
      token=pl.BlockSpec((None, Tp, None), lambda b, h, n, j: (b, 0, h)),
      S=pl.BlockSpec((None, None, None, CHANNELS, dp, BV), lambda b, h, n, j: (b, h, n, 0, 0, j)),
      z=pl.BlockSpec((None, None, None, CHANNELS, dp), lambda b, h, n, j: (b, h, n, 0, 0)),
      # Per value tile: partial sums (or copies, for what does not depend on the tile).
      tile_z=pl.BlockSpec((None, None, None, None, CHANNELS, dp),
                          lambda b, h, n, j: (j, b, h, n, 0, 0)),
      tile_den=pl.BlockSpec((None, None, Tp, None), lambda b, h, n, j: (j, b, 0, h)),
      tile_qk=pl.BlockSpec((None, None, Tp, None, dp), lambda b, h, n, j: (j, b, 0, h, 0)),
      tile_param=pl.BlockSpec((None, None, None, None, 1, dp),
                              lambda b, h, n, j: (j, b, h, n, 0, 0)))


def _grid(q, v, cfg):
  B, Tp, H, _ = q.shape
  return B, H, Tp // cfg.chunk, v.shape[-1] // cfg.block_v


def _keep(run_BxTp, C):
  """keep_n [B, N]: chunk n's last run is the run of the state entering it (no reset inside)."""
  B, Tp = run_BxTp.shape
  last_BxN = run_BxTp.reshape(B, Tp // C, C)[:, :, -1]
  entering_BxN = jnp.concatenate([run_BxTp[:, :1], last_BxN[:, :-1]], axis=1)
  return last_BxN == entering_BxN


def _through_chunks(keep_BxN, c_BxHxNx, edge_BxHx, reverse=False):
  """Solves x_{n+1} = keep_n x_n + c_n from x_0 = ``edge`` (``reverse``: x_n = keep_n x_{n+1} +
  c_n from x_N = ``edge``) by an associative scan over the chunk axis.

  Returns x where the walk enters every chunk (x_n; reverse: x_{n+1}) [B, H, N, ...] and where it
  leaves the last one (x_N; reverse: x_0) [B, H, ...], fp32.
  """
  B, _, N = c_BxHxNx.shape[:3]
  keep = keep_BxN.astype(_F32).reshape(B, 1, N, *(1,) * (c_BxHxNx.ndim - 3))
  first = N - 1 if reverse else 0
  c = c_BxHxNx.at[:, :, first].add(keep[:, :, first] * edge_BxHx)
  compose = lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1])  # x_{n+1} = a x_n + c, composed
  _, x = jax.lax.associative_scan(compose, (keep, c), reverse=reverse, axis=2)
  edge = edge_BxHx[:, :, None]
  if reverse:
    return jnp.concatenate([x[:, :, 1:], edge], axis=2), x[:, :, 0]
  return jnp.concatenate([edge, x[:, :, :-1]], axis=2), x[:, :, -1]


def _chunk_states(k, v, pos, run, omega, lam_raw, S0, z0, cfg):
  """Phases 1-2: S_n at every chunk start [B, H, N, 6, dp, Vp], S after the last chunk, and the
  same two for z ([B, H, N, 6, dp], [B, H, 6, dp]); fp32."""
  B, H, N, n_tiles = grid = _grid(k, v, cfg)
  Tp, dp, Vp = k.shape[1], k.shape[-1], v.shape[-1]
  s = _specs(Tp, dp, cfg)
  out_shape = (jax.ShapeDtypeStruct((B, H, N, CHANNELS, dp, Vp), _F32),
               jax.ShapeDtypeStruct((n_tiles, B, H, N, CHANNELS, dp), _F32))
  W, w = fused._call(_writes_kernel, cfg, grid,
                     [s["qk"], s["v"], s["row"], s["row"], s["param"], s["param"]],
                     [s["S"], s["tile_z"]], out_shape, k, v, pos, run, omega, lam_raw)
  keep = _keep(run, cfg.chunk)
  return (*_through_chunks(keep, W, S0), *_through_chunks(keep, w[0], z0))


def _forward(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg):
  """(o, den [B, Tp, H], S, z) in kernel layout."""
  S_start, S_end, z_start, z_end = _chunk_states(k, v, pos, run, omega, lam_raw, S0, z0, cfg)
  grid = _grid(q, v, cfg)
  B, Tp, H, dp = q.shape
  s = _specs(Tp, dp, cfg)
  out_shape = (jax.ShapeDtypeStruct(v.shape, v.dtype),
               jax.ShapeDtypeStruct((grid[-1], B, Tp, H), _F32))
  o, den = fused._call(
      _output_kernel, cfg, grid,
      [s["qk"], s["qk"], s["v"], s["row"], s["row"], s["param"], s["param"], s["S"], s["z"]],
      [s["v"], s["tile_den"]], out_shape,
      q, k, v, pos, run, omega, lam_raw, S_start.astype(q.dtype), z_start)
  return o, den[0], S_end, z_end


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def split(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg: KernelConfig):
  """(o, S_T, z_T) of padded kernel-layout inputs (pallas_p1._fused's contract)."""
  o, _, S, z = _forward(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg)
  return o, S, z


def _split_fwd(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg):
  o, den, S, z = _forward(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg)
  return (o, S, z), (q, k, v, pos, run, omega, lam_raw, S0, z0, o, den)


def _state_grads(q, v, pos, run, omega, lam_raw, dN, dD, dS_end, dz_end, cfg):
  """Backward phases 1-2: (G_{n+1}, g_{n+1}) after every chunk, and (dS_0, dz_0)."""
  B, H, N, n_tiles = grid = _grid(q, v, cfg)
  Tp, dp, Vp = q.shape[1], q.shape[-1], v.shape[-1]
  s = _specs(Tp, dp, cfg)
  out_shape = (jax.ShapeDtypeStruct((B, H, N, CHANNELS, dp, Vp), _F32),
               jax.ShapeDtypeStruct((n_tiles, B, H, N, CHANNELS, dp), _F32))
  R, r = fused._call(_read_grads_kernel, cfg, grid,
                     [s["qk"], s["row"], s["row"], s["param"], s["param"], s["v"], s["token"]],
                     [s["S"], s["tile_z"]], out_shape, q, pos, run, omega, lam_raw, dN, dD)
  keep = _keep(run, cfg.chunk)
  dS, dS0 = _through_chunks(keep, R, dS_end, reverse=True)
  dz, dz0 = _through_chunks(keep, r[0], dz_end, reverse=True)
  return dS, dz, dS0, dz0


def _split_bwd(cfg, residuals, cotangents):
  q, k, v, pos, run, omega, lam_raw, S0, z0, o, den = residuals
  do, dS_end, dz_end = (x.astype(_F32) for x in cotangents)
  dN, dD = fused._output_grads(do, o, den, cfg.c_eps)
  dN = dN.astype(v.dtype)  # the fused kernel casts dN to v's dtype before its dots
  S, _, z, _ = _chunk_states(k, v, pos, run, omega, lam_raw, S0, z0, cfg)
  dS, dz, dS0, dz0 = _state_grads(q, v, pos, run, omega, lam_raw, dN, dD, dS_end, dz_end, cfg)
  B, H, N, n_tiles = grid = _grid(q, v, cfg)
  Tp, dp = q.shape[1], q.shape[-1]
  s = _specs(Tp, dp, cfg)
  partial_qk = jax.ShapeDtypeStruct((n_tiles, B, Tp, H, dp), _F32)
  partial_param = jax.ShapeDtypeStruct((n_tiles, B, H, N, 1, dp), _F32)
  out_shape = (partial_qk, partial_qk, jax.ShapeDtypeStruct(v.shape, _F32), partial_param,
               partial_param)
  dq, dk, dv, d_omega, d_lam = fused._call(
      _grads_kernel, cfg, grid,
      [s["qk"], s["qk"], s["v"], s["row"], s["row"], s["param"], s["param"], s["S"], s["z"],
       s["S"], s["z"], s["v"], s["token"]],
      [s["tile_qk"], s["tile_qk"], s["v"], s["tile_param"], s["tile_param"]], out_shape,
      q, k, v, pos, run, omega, lam_raw, S.astype(v.dtype), z, dS.astype(v.dtype), dz, dN, dD)
  return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv.astype(v.dtype), None, None,
          d_omega.sum((0, 1, 3)), d_lam.sum((0, 1, 3)), dS0, dz0)


split.defvjp(_split_fwd, _split_bwd)
