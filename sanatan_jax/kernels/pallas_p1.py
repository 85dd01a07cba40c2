"""Pallas (Triton lowering) kernels for SANATAN p = 1, six channels (SPEC §1.2), with custom VJP.

Per head, with Phi the six-channel feature map of SPEC §1.1 computed *inside* the kernels from the
raw q, k chunk (features.py's functions), the write-then-read recurrence of attention.py::

    S_t = S_{t-1} + Phi(k_t) v_tᵀ,   z_t = z_{t-1} + Phi(k_t),
    o_t = Phi(q_t)ᵀ S_t / (Phi(q_t)ᵀ z_t + c eps)

is computed in chunks of C tokens (intra-chunk causal block + fp32 state). The 6d-wide features
never reach HBM: inside a kernel they are [C, d] channel arrays ``1, cos th, sin th, r, r cos th,
r sin th`` and the state six [d, BV] tiles. Outside the kernels the state has SanatanState's layout,
feature index ``6 a + channel``.

With N chunks, the state at the start of chunk n follows

    S_{n+1} = keep_n S_n + W_n,   z_{n+1} = keep_n z_n + w_n,

where W_n = sum Phi(k) vᵀ and w_n = sum Phi(k) run over chunk n's last run (its writes) and
keep_n says the state's run continues through the chunk (0 at a new packed document). Forward:

1. ``_state_kernel``, grid (batch, head, channel, value tile): one program carries one channel's
   fp32 [d, BV] tile (and its z row) through the chunks in a loop, adding each chunk's writes
   (features of that channel from the raw k), and writes the tile entering every chunk to HBM in
   q's dtype (the dtype the output kernel's dots take it in), z in fp32. A step is one [d, C] x
   [C, BV] dot; the grid has 6 dv / BV programs per (batch, head).
2. ``_output_kernel``, grid (batch, head, chunk, value tile), fully parallel: the outputs of every
   chunk from its start state and the intra-chunk block (``_outputs``), features recomputed from
   the raw q, k.

Backward (``jax.custom_vjp``). The forward stores its inputs, the output o (in v's dtype) and the
fp32 denominator D_t = Phi(q_t)ᵀ z_t per token; no features and no chunk states. With
dN = do / (D + c eps) and dD = -(do · o) / (D + c eps) (computed outside the kernels), the state
kernel recomputes the start states and, walking the chunks in reverse over (q, dN, dD), gives the
gradient of the state after every chunk, G_n = keep_n G_{n+1} + R_n with R_n = sum Phi(q) dNᵀ over
chunk n's reads (G_N = dS_T; the walk's end is dS_0). A last kernel, again over (batch, head,
chunk, value tile), computes d Phi(q) from the start state, d Phi(k) and dv from the gradient after
the chunk (``_dphi_q``, ``_dphi_k_dv``) and chains them through the feature map inside the kernel
(``jax.vjp`` of the same feature functions) into dq, dk, d omega and d lam_raw. Sums over value
tiles (dq, dk) and over tiles and chunks (d omega, d lam_raw) are taken outside; the denominator
does not depend on the value tile, so its gradient terms come from value tile 0 only.

Chunk states cross HBM in the dtype the dots cast them to anyway (q's for the output kernel, v's
for the gradient kernel, with dN and the state gradients in v's), so at bf16 at half width for no
loss. The normalisers z and their gradients stay fp32.

Packed documents follow attention.py: ``runs`` (non-decreasing per row) mark maximal runs of equal
segment ids; a token reads the carried state only in the state's run and a chunk hands on only its
last run's writes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lmcore.kernels import pallas_utils as pu
from lmcore.mixers.base import default_positions
from sanatan_jax import attention, features

CHANNELS = 6
# Fastest on the H200 at T = 8192 (fwd+bwd 9.6 ms; C = 16 11.2; C = 64 13.4, fp32 overflows smem).
DEFAULT_CHUNK = 32
_F32 = jnp.float32


class KernelConfig(NamedTuple):
  """Static kernel parameters: chunk C, value tile BV, real head dim and length, c * eps."""

  chunk: int
  block_v: int
  head_dim: int
  length: int
  c_eps: float
  interpret: bool
  num_warps: int
  num_stages: int


class _Chunk(NamedTuple):
  """One chunk inside a kernel: features (input dtype), values and run ids."""

  phi_q: tuple  # 6 x [C, dp]
  phi_k: tuple  # 6 x [C, dp]
  v: jax.Array  # [C, BV]
  run: jax.Array  # [C] int32


def _angles_and_roots(u, omega, lam_raw, pos):
  """(r, cos th, sin th) of a chunk of raw q or k [C, dp] (fp32): roots from the pre-rotation
  angles (SPEC §1.1 step 3), th the rotated angle (step 4)."""
  theta = features.angles(u)
  r = features.soft_roots(theta, omega)
  # features.rotate on a [C, d] chunk, written out: its [B, T, H, d] broadcasting would put 4-D
  # arrays (and 4-D reductions in the VJP) into the kernel, which the Triton lowering handles badly.
  rot = theta + pos[:, None].astype(_F32) * (features.LAMBDA_SCALE * jnp.tanh(lam_raw))
  return r, jnp.cos(rot), jnp.sin(rot)


def _feature_channels(u, omega, lam_raw, pos, valid):
  """The six channels of Phi for a chunk of raw q or k [C, dp] (fp32), zero where not ``valid``;
  the channel order is feature_map's."""
  r, cos, sin = _angles_and_roots(u, omega, lam_raw, pos)
  channels = (jnp.ones_like(r), cos, sin, r, r * cos, r * sin)
  return tuple(jnp.where(valid, x, 0.0) for x in channels)


def _channel_weights(channel):
  """Float flags (a, b, e0, e1, e2) of a traced channel index: channel = (a + b r)(e0 + e1 cos +
  e2 sin). Flags, not scalar selects: the Triton lowering mishandles those in loop bodies."""
  rooted = (channel >= CHANNELS // 2).astype(jnp.int32)
  trig = channel - rooted * (CHANNELS // 2)
  flag = lambda x: x.astype(_F32)
  return (flag(1 - rooted), flag(rooted), flag(trig == 0), flag(trig == 1), flag(trig == 2))


def _one_channel(u, omega, lam_raw, pos, valid, weights):
  """One channel of Phi (``_channel_weights``) for a chunk of raw q or k [C, dp] (fp32)."""
  r, cos, sin = _angles_and_roots(u, omega, lam_raw, pos)
  a, b, e0, e1, e2 = weights
  return jnp.where(valid, (a + b * r) * (e0 + e1 * cos + e2 * sin), 0.0)


def _valid(n, cfg: KernelConfig, dp: int):
  """[C, dp] bool: a real token (not time padding) and a real head dimension (not dim padding)."""
  C = cfg.chunk
  token = n * C + jax.lax.broadcasted_iota(jnp.int32, (C, dp), 0)
  dim = jax.lax.broadcasted_iota(jnp.int32, (C, dp), 1)
  return (token < cfg.length) & (dim < cfg.head_dim)


def _phi(u_ref, params, n, cfg):
  """Features of chunk n of a raw q or k ref, and (for the backward) their VJP."""
  omega_ref, lam_ref, pos_ref = params
  u = pu.rows(u_ref, n * cfg.chunk, cfg.chunk).astype(_F32)
  pos = pu.rows(pos_ref, n * cfg.chunk, cfg.chunk)
  valid = _valid(n, cfg, u.shape[1])
  fn = lambda u, omega, lam_raw: _feature_channels(u, omega, lam_raw, pos, valid)
  phi, vjp = jax.vjp(fn, u, omega_ref[...], lam_ref[...])
  return tuple(x.astype(u_ref.dtype) for x in phi), vjp


def _load(n, refs, params, cfg):
  q_ref, k_ref, v_ref, run_ref = refs
  (phi_q, q_vjp), (phi_k, k_vjp) = _phi(q_ref, params, n, cfg), _phi(k_ref, params, n, cfg)
  chunk = _Chunk(phi_q, phi_k, pu.rows(v_ref, n * cfg.chunk, cfg.chunk),
                 pu.rows(run_ref, n * cfg.chunk, cfg.chunk))
  return chunk, q_vjp, k_vjp


def _causal_same_run(run):
  C = run.shape[0]
  iota = functools.partial(jax.lax.broadcasted_iota, jnp.int32, (C, C))
  return (run[:, None] == run[None, :]) & (iota(0) >= iota(1))


def _scores(x: _Chunk):
  """s_ij = Phi(q_i) · Phi(k_j) on visible pairs (j <= i, same run), else 0: fp32 [C, C]."""
  s = sum(pu.dot(a, b, trans_b=True) for a, b in zip(x.phi_q, x.phi_k))
  return jnp.where(_causal_same_run(x.run), s, 0.0)


def _masked(phi, mask):
  return tuple(jnp.where(mask[:, None], a, 0) for a in phi)


def _outputs(x: _Chunk, S, z, state_run, c_eps):
  """o [C, BV] (fp32) and the denominator D [C] of one chunk from the state (S, z) at its start:
  N = s v + Phi(q) S and D = rowsum(s) + Phi(q) z (state terms for tokens of the state's run),
  o = N / (D + c eps)."""
  reads = _masked(x.phi_q, x.run == state_run)
  s = _scores(x)
  num = pu.dot(s.astype(x.v.dtype), x.v)
  den = jnp.sum(s, axis=1)
  for a, S_c, z_c in zip(reads, S, z):
    num += pu.dot(a, S_c.astype(a.dtype))
    den += jnp.sum(a.astype(_F32) * z_c, axis=1)
  return num / (den[:, None] + c_eps), den


def _load_state(S_ref, z_ref):
  S = tuple(S_ref[c] for c in range(CHANNELS))
  z = tuple(z_ref[c].reshape(1, -1) for c in range(CHANNELS))
  return S, z


def _dphi_q(x: _Chunk, dN, dD, S, z, state_run, tile0):
  """d Phi(q) of one chunk [6 x [C, dp] fp32] from the state at its start and the intra scores."""
  dt = x.v.dtype
  A = jnp.where(_causal_same_run(x.run), pu.dot(dN, x.v, trans_b=True) + tile0 * dD[:, None], 0.0)
  reads = (x.run == state_run)[:, None]
  return tuple(
      pu.dot(A.astype(dt), b)
      + jnp.where(reads, pu.dot(dN, S_c.astype(dt), trans_b=True) + tile0 * dD[:, None] * z_c, 0.0)
      for b, S_c, z_c in zip(x.phi_k, S, z))


def _dphi_k_dv(x: _Chunk, dN, dD, dS, dz, last_run, tile0):
  """d Phi(k) [6 x [C, dp]] and dv [C, BV] of one chunk from (dS, dz) after it and later queries."""
  dt = x.v.dtype
  visible = _causal_same_run(x.run)
  A = jnp.where(visible, pu.dot(dN, x.v, trans_b=True) + tile0 * dD[:, None], 0.0)
  writes = (x.run == last_run)[:, None]
  dphi_k = tuple(
      pu.dot(A.astype(dt), a, trans_a=True)
      + jnp.where(writes, pu.dot(x.v, dS_c.astype(dt), trans_b=True) + tile0 * dz_c, 0.0)
      for a, dS_c, dz_c in zip(x.phi_q, dS, dz))
  dv = pu.dot(_scores(x).astype(dt), dN, trans_a=True)
  for b, dS_c in zip(_masked(x.phi_k, x.run == last_run), dS):
    dv += pu.dot(b, dS_c.astype(dt))
  return dphi_k, dv


def _runs(run_ref, n, C):
  """Chunk n's run ids [C], the run of the state entering it and its last run.

  Runs are non-decreasing, so the state entering chunk n > 0 is in chunk n - 1's last run and
  the initial state in the first token's run.
  """
  run = pu.rows(run_ref, n * C, C)
  previous = pu.rows(run_ref, jnp.maximum(n - 1, 0) * C, C)
  return run, jnp.where(n > 0, jnp.max(previous), jnp.min(previous)), jnp.max(run)


def _state_kernel(u_ref, y_ref, w_ref, pos_ref, run_ref, omega_ref, lam_ref, S0_ref, z0_ref,
                  S_ref, z_ref, S_end_ref, z_end_ref, *, cfg: KernelConfig, reverse: bool):
  """One channel's state tile (channel = program 2, one value tile) carried across every chunk.

  Forward (u = k, y = v, w = 1): S <- keep_n S + sum Phi_c(k_j) y_jᵀ and z <- keep_n z +
  sum Phi_c(k_j) w_j over chunk n's last run, keep_n = (no new run starts in chunk n). Reverse
  (u = q, y = dN, w = dD, chunks last to first): the same sums over chunk n's reads (tokens of the
  entering state's run) give the state gradient, G_n = keep_n G_{n+1} + R_n. The tile held when
  chunk n is reached goes to slot n (forward: S_n; reverse: G_{n+1}); the last one to the end refs.
  """
  C, dp = cfg.chunk, u_ref.shape[-1]
  n_chunks = u_ref.shape[0] // C
  weights = _channel_weights(pl.program_id(2))
  omega, lam_raw = omega_ref[...], lam_ref[...]

  def step(m, carry):
    S, z = carry
    n = n_chunks - 1 - m if reverse else m
    run, state_run, last_run = _runs(run_ref, n, C)
    pu.store_rows(S_ref, n * dp, S.astype(S_ref.dtype))
    pu.store_rows(z_ref, n, z)
    mine = (run == (state_run if reverse else last_run))[:, None]
    u = pu.rows(u_ref, n * C, C).astype(_F32)
    phi = _one_channel(u, omega, lam_raw, pu.rows(pos_ref, n * C, C),
                       _valid(n, cfg, dp) & mine, weights)
    keep = last_run == state_run
    S = jnp.where(keep, S, 0.0) + pu.dot(phi.astype(u_ref.dtype), pu.rows(y_ref, n * C, C),
                                         trans_a=True)
    w = pu.rows(w_ref, n * C, C)
    z = jnp.where(keep, z, 0.0) + jnp.sum(phi * w[:, None], axis=0, keepdims=True)
    return S, z

  S, z = jax.lax.fori_loop(0, n_chunks, step, (S0_ref[...], z0_ref[...]))
  S_end_ref[...] = S
  z_end_ref[...] = z


def _output_kernel(q_ref, k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, S_ref, z_ref,
                   o_ref, den_ref, *, cfg):
  """Phase 3: chunk n's outputs and denominators from the state (S_n, z_n) at its start."""
  n, C = pl.program_id(2), cfg.chunk
  x, _, _ = _load(n, (q_ref, k_ref, v_ref, run_ref), (omega_ref, lam_ref, pos_ref), cfg)
  _, state_run, _ = _runs(run_ref, n, C)
  o, den = _outputs(x, *_load_state(S_ref, z_ref), state_run, cfg.c_eps)
  pu.store_rows(o_ref, n * C, o.astype(o_ref.dtype))
  pu.store_rows(den_ref, n * C, den)


def _grads_kernel(q_ref, k_ref, v_ref, pos_ref, run_ref, omega_ref, lam_ref, S_ref, z_ref,
                  dS_ref, dz_ref, dN_ref, dD_ref,
                  dq_ref, dk_ref, dv_ref, domega_ref, dlam_ref, *, cfg):
  """Backward phase 3: chunk n's dq, dk, dv and its parts of d omega, d lam_raw from the state
  at its start (S_n, z_n) and the gradient of the state after it (G_{n+1}, g_{n+1})."""
  n, C = pl.program_id(2), cfg.chunk
  tile0 = (pl.program_id(3) == 0).astype(_F32)
  x, q_vjp, k_vjp = _load(n, (q_ref, k_ref, v_ref, run_ref), (omega_ref, lam_ref, pos_ref), cfg)
  _, state_run, last_run = _runs(run_ref, n, C)
  dN, dD = pu.rows(dN_ref, n * C, C), pu.rows(dD_ref, n * C, C)
  S, z = _load_state(S_ref, z_ref)
  dq, domega_q, dlam_q = q_vjp(_dphi_q(x, dN, dD, S, z, state_run, tile0))
  dS, dz = _load_state(dS_ref, dz_ref)
  dphi_k, dv = _dphi_k_dv(x, dN, dD, dS, dz, last_run, tile0)
  dk, domega_k, dlam_k = k_vjp(dphi_k)
  pu.store_rows(dq_ref, n * C, dq)
  pu.store_rows(dk_ref, n * C, dk)
  pu.store_rows(dv_ref, n * C, dv)
  domega_ref[...] = domega_q + domega_k
  dlam_ref[...] = dlam_q + dlam_k


def _specs(Tp, dp, cfg):
  """BlockSpecs over the grid (batch, head, chunk, value tile). Token arrays are whole rows (each
  program reads and writes its chunk's rows); chunk states are ``_states``' S [B, H, 6, N dp, Vp]
  and z [B, H, N, 6, dp]."""
  BV = cfg.block_v
  return dict(
      qk=pl.BlockSpec((None, Tp, None, dp), lambda b, h, n, j: (b, 0, h, 0)),
      v=pl.BlockSpec((None, Tp, None, BV), lambda b, h, n, j: (b, 0, h, j)),
      row=pl.BlockSpec((None, Tp), lambda b, h, n, j: (b, 0)),
      param=pl.BlockSpec((None, 1, dp), lambda b, h, n, j: (h, 0, 0)),
      token=pl.BlockSpec((None, Tp, None), lambda b, h, n, j: (b, 0, h)),
      S=pl.BlockSpec((None, None, CHANNELS, dp, BV), lambda b, h, n, j: (b, h, 0, n, j)),
      z=pl.BlockSpec((None, None, None, CHANNELS, dp), lambda b, h, n, j: (b, h, n, 0, 0)),
      # Per value tile: partial sums (or copies, for what does not depend on the tile).
      tile_den=pl.BlockSpec((None, None, Tp, None), lambda b, h, n, j: (j, b, 0, h)),
      tile_qk=pl.BlockSpec((None, None, Tp, None, dp), lambda b, h, n, j: (j, b, 0, h, 0)),
      tile_param=pl.BlockSpec((None, None, None, None, 1, dp),
                              lambda b, h, n, j: (j, b, h, n, 0, 0)))


def _grid(q, v, cfg):
  B, Tp, H, _ = q.shape
  return B, H, Tp // cfg.chunk, v.shape[-1] // cfg.block_v


def _call(kernel, cfg, grid, in_specs, out_specs, out_shape, *args):
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=cfg.interpret,
      compiler_params=pu.compiler_params(cfg.interpret, cfg.num_warps, cfg.num_stages))(*args)


def _states(u, y, w, pos, run, omega, lam_raw, S0, z0, cfg, *, reverse: bool, dtype):
  """``_state_kernel`` over the grid (batch, head, channel, value tile).

  Args: u [B, Tp, H, dp] (k, or q for ``reverse``), y [B, Tp, H, Vp] (v or dN), w [B, Tp, H] fp32
  (ones or dD), the edge tiles S0 [B, H, 6, dp, Vp] and z0 [B, H, 6, dp] (fp32).
  Returns the tiles held at every chunk, S [B, H, 6, N dp, Vp] in ``dtype`` and z [B, H, N, 6, dp],
  and at the end, S [B, H, 6, dp, Vp] and z [B, H, 6, dp] (fp32).
  """
  B, Tp, H, dp = u.shape
  Vp, BV = y.shape[-1], cfg.block_v
  N, n_tiles = Tp // cfg.chunk, Vp // BV
  tile = lambda rows: pl.BlockSpec((None, None, None, rows, BV), lambda b, h, c, j: (b, h, c, 0, j))
  # z does not depend on the value tile: every tile writes its own copy, tile 0's is kept.
  z_tile = lambda rows: pl.BlockSpec((None, None, None, None, rows, dp),
                                     lambda b, h, c, j: (j, b, h, c, 0, 0))
  row = pl.BlockSpec((None, Tp), lambda b, h, c, j: (b, 0))
  param = pl.BlockSpec((None, 1, dp), lambda b, h, c, j: (h, 0, 0))
  in_specs = [pl.BlockSpec((None, Tp, None, dp), lambda b, h, c, j: (b, 0, h, 0)),
              pl.BlockSpec((None, Tp, None, BV), lambda b, h, c, j: (b, 0, h, j)),
              pl.BlockSpec((None, Tp, None), lambda b, h, c, j: (b, 0, h)),
              row, row, param, param, tile(dp),
              pl.BlockSpec((None, None, None, 1, dp), lambda b, h, c, j: (b, h, c, 0, 0))]
  out_shape = (jax.ShapeDtypeStruct((B, H, CHANNELS, N * dp, Vp), dtype),
               jax.ShapeDtypeStruct((n_tiles, B, H, CHANNELS, N, dp), _F32),
               jax.ShapeDtypeStruct(S0.shape, _F32),
               jax.ShapeDtypeStruct((n_tiles, B, H, CHANNELS, 1, dp), _F32))
  kernel = functools.partial(_state_kernel, reverse=reverse)
  S, z, S_end, z_end = _call(kernel, cfg, (B, H, CHANNELS, n_tiles), in_specs,
                             [tile(N * dp), z_tile(N), tile(dp), z_tile(1)], out_shape,
                             u, y, w, pos, run, omega, lam_raw, S0, z0[:, :, :, None])
  return S, z[0].swapaxes(2, 3), S_end, z_end[0, :, :, :, 0]


def _forward(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg):
  """(o, den [B, Tp, H], S, z) in kernel layout."""
  S_start, z_start, S_end, z_end = _states(k, v, _ones(q), pos, run, omega, lam_raw, S0, z0, cfg,
                                           reverse=False, dtype=q.dtype)
  grid = _grid(q, v, cfg)
  B, Tp, H, dp = q.shape
  s = _specs(Tp, dp, cfg)
  out_shape = (jax.ShapeDtypeStruct(v.shape, v.dtype),
               jax.ShapeDtypeStruct((grid[-1], B, Tp, H), _F32))
  o, den = _call(
      _output_kernel, cfg, grid,
      [s["qk"], s["qk"], s["v"], s["row"], s["row"], s["param"], s["param"], s["S"], s["z"]],
      [s["v"], s["tile_den"]], out_shape,
      q, k, v, pos, run, omega, lam_raw, S_start, z_start)
  return o, den[0], S_end, z_end


def _ones(q):
  """The forward state walk's per-token weight w = 1 [B, Tp, H] (fp32)."""
  return jnp.ones(q.shape[:3], _F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attend(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg: KernelConfig):
  """(o, S_T, z_T) of padded kernel-layout inputs: q, k [B, Tp, H, dp], v [B, Tp, H, Vp], pos and
  run [B, Tp], omega and lam_raw [H, 1, dp], S0 [B, H, 6, dp, Vp], z0 [B, H, 6, dp]."""
  o, _, S, z = _forward(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg)
  return o, S, z


def _attend_fwd(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg):
  o, den, S, z = _forward(q, k, v, pos, run, omega, lam_raw, S0, z0, cfg)
  return (o, S, z), (q, k, v, pos, run, omega, lam_raw, S0, z0, o, den)


def _output_grads(do, o, den, c_eps):
  """dN = do / (D + c eps) [B, Tp, H, Vp] and dD = -(do · o) / (D + c eps) [B, Tp, H], fp32: the
  gradients of o = N / (D + c eps) w.r.t. its numerator and denominator."""
  inv_BxTxH = 1.0 / (den + c_eps)
  return do * inv_BxTxH[..., None], -jnp.sum(do * o.astype(_F32), axis=-1) * inv_BxTxH


def _attend_bwd(cfg, residuals, cotangents):
  q, k, v, pos, run, omega, lam_raw, S0, z0, o, den = residuals
  do, dS_end, dz_end = (x.astype(_F32) for x in cotangents)
  dN, dD = _output_grads(do, o, den, cfg.c_eps)
  dN = dN.astype(v.dtype)  # the dots take it in v's dtype
  S, z, _, _ = _states(k, v, _ones(q), pos, run, omega, lam_raw, S0, z0, cfg, reverse=False,
                       dtype=v.dtype)
  dS, dz, dS0, dz0 = _states(q, dN, dD, pos, run, omega, lam_raw, dS_end, dz_end, cfg,
                             reverse=True, dtype=v.dtype)
  B, H, N, n_tiles = grid = _grid(q, v, cfg)
  Tp, dp = q.shape[1], q.shape[-1]
  s = _specs(Tp, dp, cfg)
  partial_qk = jax.ShapeDtypeStruct((n_tiles, B, Tp, H, dp), _F32)
  partial_param = jax.ShapeDtypeStruct((n_tiles, B, H, N, 1, dp), _F32)
  out_shape = (partial_qk, partial_qk, jax.ShapeDtypeStruct(v.shape, _F32), partial_param,
               partial_param)
  dq, dk, dv, d_omega, d_lam = _call(
      _grads_kernel, cfg, grid,
      [s["qk"], s["qk"], s["v"], s["row"], s["row"], s["param"], s["param"], s["S"], s["z"],
       s["S"], s["z"], s["v"], s["token"]],
      [s["tile_qk"], s["tile_qk"], s["v"], s["tile_param"], s["tile_param"]], out_shape,
      q, k, v, pos, run, omega, lam_raw, S, z, dS, dz, dN, dD)
  return (dq.sum(0).astype(q.dtype), dk.sum(0).astype(k.dtype), dv.astype(v.dtype), None, None,
          d_omega.sum((0, 1, 3)), d_lam.sum((0, 1, 3)), dS0, dz0)


_attend.defvjp(_attend_fwd, _attend_bwd)


def _to_kernel_state(state, B, H, d, dp, V, Vp):
  """SanatanState's S [B, H, 6d, V], z [B, H, 6d] (index 6a + c) -> padded channel-major
  [B, H, 6, dp, Vp], [B, H, 6, dp]; zeros for no state."""
  if state is None:
    return jnp.zeros((B, H, CHANNELS, dp, Vp), _F32), jnp.zeros((B, H, CHANNELS, dp), _F32)
  S = state.S.astype(_F32).reshape(B, H, d, CHANNELS, V).swapaxes(2, 3)
  z = state.z.astype(_F32).reshape(B, H, d, CHANNELS).swapaxes(2, 3)
  return pu.pad_axis(pu.pad_axis(S, 3, dp), 4, Vp), pu.pad_axis(z, 3, dp)


def _from_kernel_state(S, z, d, V):
  """The inverse of ``_to_kernel_state``: drops the padding and interleaves the channels."""
  B, H = S.shape[:2]
  S = S[:, :, :, :d, :V].swapaxes(2, 3).reshape(B, H, CHANNELS * d, V)
  return S, z[:, :, :, :d].swapaxes(2, 3).reshape(B, H, CHANNELS * d)


def _check(q, v, state):
  B, T, H, d = q.shape
  expected = (B, H, CHANNELS * d, v.shape[-1])
  if state is not None and tuple(state.S.shape) != expected:
    raise ValueError(f"sanatan_p1_pallas: state.S has shape {tuple(state.S.shape)}, expected "
                     f"[B, H, 6d, dv] = {expected}")


def sanatan_p1_pallas(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array,
                      lam_raw: jax.Array, *, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None,
                      state: attention.SanatanState | None = None,
                      chunk_size: int | None = None, rotate: bool = True,
                      interpret: bool | None = None, block_v: int = 64,
                      num_warps: int = 8, num_stages: int = 2
                      ) -> tuple[jax.Array, attention.SanatanState]:
  """SANATAN p = 1, 6 channels (SPEC §1.2) by the Pallas kernels; same function as
  ``sanatan_attention(..., p=1, channels=6)``.

  Args:
    q, k: raw [B, T, H, d] (already divided by sqrt(d)); v: [B, T, H, dv]; bf16 or fp32.
    omega, lam_raw: [H, d] root anchors and raw rotation rates.
    positions: int [B, T] document positions; default 0..T-1 offset by ``state.position``.
    segment_ids: optional [B, T] packed-document ids (attention.py's convention).
    state: a SanatanState to continue from; None means zeros.
    chunk_size: tokens per chunk, a power of two (>= 16 when compiled); None means ``DEFAULT_CHUNK``.
    rotate: False drops the temporal rotation (the "no lambda" ablation).
    interpret: run the kernels interpreted; None means "unless on a GPU".
    block_v, num_warps, num_stages: GPU tuning knobs (value tile width, Triton warps and stages);
      the defaults were the fastest found on the H200 at T = 8192.

  Returns:
    o [B, T, H, dv] in v's dtype and the SanatanState after the last token (fp32 S, z).
  """
  interpret = pu.resolve_interpret(interpret)
  pu.check_backend(interpret, "sanatan_p1_pallas", "sanatan_attention(implementation='chunked')")
  chunk_size = DEFAULT_CHUNK if chunk_size is None else chunk_size
  if chunk_size < 1 or chunk_size & (chunk_size - 1):
    raise ValueError(f"sanatan_p1_pallas: chunk_size must be a power of two, got {chunk_size}")
  _check(q, v, state)
  B, T, H, d = q.shape
  V = v.shape[-1]
  if positions is None:
    positions = default_positions(B, T, None if state is None else state.position)
  C = max(chunk_size, 1 if interpret else pu.MIN_DOT)
  dp, BV = pu.block_size(d, interpret), min(pu.block_size(V, interpret), block_v)
  Tp, Vp = pu.round_up(T, C), pu.round_up(V, BV)
  cfg = KernelConfig(chunk=C, block_v=BV, head_dim=d, length=T,
                     c_eps=features.score_scale(CHANNELS, "clean", d) * attention.EPS,
                     interpret=interpret, num_warps=num_warps, num_stages=num_stages)
  pad_qk = lambda x: pu.pad_axis(pu.pad_axis(x, 1, Tp), 3, dp)
  pos = positions.astype(jnp.int32) if rotate else jnp.zeros((B, T), jnp.int32)
  run = attention.segment_runs(segment_ids, B, T)
  param = lambda p: pu.pad_axis(p.astype(_F32), 1, dp).reshape(H, 1, dp)
  S0, z0 = _to_kernel_state(state, B, H, d, dp, V, Vp)
  o, S, z = _attend(pad_qk(q), pad_qk(k), pu.pad_axis(pu.pad_axis(v, 1, Tp), 3, Vp),
                    pu.pad_axis(pos, 1, Tp), pu.pad_axis(run, 1, Tp, mode="edge"),
                    param(omega), param(lam_raw), S0, z0, cfg)
  S, z = _from_kernel_state(S, z, d, V)
  return o[:, :T, :, :V], attention.SanatanState(S, z, positions[:, -1].astype(jnp.int32) + 1)
