"""Helpers shared by the kernel tests, above all the Pallas GPU (Triton) and TPU (Mosaic) ones,
which run interpreted on CPU: random inputs, packed documents, abstract inputs for the lowering
tests, runners that return outputs, final states and gradients, and the relative-L2 comparison.

A plain module, not a test file: pytest's default import mode puts tests/ on sys.path, so the tests
(also under pytest-xdist) import it as ``kernel_cases``.
"""

import jax
import jax.numpy as jnp
import numpy as np

from based_jax import TaylorState
from lmcore.ops.common.backend import ChunkTiles
from lmcore.ops.gated_linear_attention import LinearAttentionState, gated_linear_attention
from lmcore.numerics import relative_l2
from sanatan_jax import SanatanState
from sanatan_jax.ops.sanatan_attention.base import sanatan_features

CHUNK = 16
RTOL = 1e-5
# These tests check the math, not code generation: skip LLVM's expensive passes on a shared CPU.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def normal(rng, *shape):
  """A standard normal fp32 array drawn from ``rng``."""
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def normals(rng, *shapes):
  """Standard normal fp32 arrays of ``shapes`` drawn in order (as random projections of o, S, z)."""
  return tuple(normal(rng, *shape) for shape in shapes)


def document_ids(B, T, starts):
  """Row 0 one document; row 1 a new one from each of ``starts``."""
  ids_BxT = np.zeros((B, T), np.int32)
  for start in starts:
    ids_BxT[1, start:] += 1
  return jnp.asarray(ids_BxT)


def packed_documents(B, T, starts, first_position=5):
  """``document_ids`` and positions: row 0's count on from ``first_position``, row 1's restart at 0
  with each document."""
  positions_BxT = np.tile(np.arange(T, dtype=np.int32), (B, 1)) + first_position
  for start in starts:
    positions_BxT[1, start:] = np.arange(T - start)
  return dict(segment_ids=document_ids(B, T, starts), positions=jnp.asarray(positions_BxT))


def assert_close(got, want, what):
  """Every array of ``want`` within relative L2 error ``RTOL`` of ``got``'s; positions equal."""
  if "position" in want:
    np.testing.assert_array_equal(got["position"], want["position"])
  errors = {name: relative_l2(got[name], want[name]) for name in want if name != "position"}
  bad = {name: e for name, e in errors.items() if e > RTOL}
  assert not bad, f"{what}: relative L2 errors above {RTOL}: {bad}"


def bf16(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


# Gated linear attention.

def gated_inputs(rng, T, gate, normalize, *, B, H, K, V, decay=(0.01, 0.3)):
  """q, k, v and the log forget gate (None, per head or per key channel) drawn from ``rng``;
  positive q, k when normalised (as feature maps produce). The default log gates, in
  [-0.3, -0.01], are weak enough that what a chunk hands on still matters chunks later."""
  q, k, v = normal(rng, B, T, H, K), normal(rng, B, T, H, K), normal(rng, B, T, H, V)
  if normalize:
    q, k = jnp.exp(0.5 * q), jnp.exp(0.5 * k)
  gate_shape = {"head": (B, T, H), "channel": (B, T, H, K)}.get(gate)
  log_forget = (None if gate is None
                else jnp.asarray(-rng.uniform(*decay, size=gate_shape), jnp.float32))
  return q, k, v, log_forget


def run_gated(fn, inputs, projections, **options):
  """Outputs, final state and gradients of a random projection of both w.r.t. every input; ``fn`` has
  ``gated_linear_attention``'s signature."""
  q, k, v, log_forget, state = inputs
  B, T, H, K = q.shape
  state = state or LinearAttentionState.zeros(B, H, K, v.shape[-1])
  gate = jnp.zeros((B, T, H)) if log_forget is None else log_forget

  def loss(q, k, v, gate, state):
    o, new = fn(q, k, v, None if log_forget is None else gate, state=state, **options)
    do, dS, dz = projections
    return (o * do).sum() + (new.S * dS).sum() + (new.z * dz).sum(), (o, new)

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
  (_, (o, new)), grads = jax.jit(grad, compiler_options=FAST_COMPILE)(q, k, v, gate, state)
  return {"o": o, "S": new.S, "z": new.z, "dq": grads[0], "dk": grads[1], "dv": grads[2],
          "dlog_forget": grads[3], "dS0": grads[4].S, "dz0": grads[4].z}


def gated_bf16_gradient_errors(kernel, kernel_split_off) -> dict[str, np.ndarray]:
  """Relative L2 errors of the gradients (q, k, v, log forget gate) from bf16 inputs (T = 64, 2 heads
  of 32, per-key gates drawn as the benchmarks draw them) against the fp32 scan on the same values:
  for XLA chunked ("xla"), ``kernel`` ("split": its default) and ``kernel_split_off`` ("one": its state
  dots with one rounding)."""
  B, T, H, K = 1, 64, 2, 32
  keys = jax.random.split(jax.random.key(0), 5)
  q, k, v = (jax.random.normal(key, (B, T, H, K)) * scale for key, scale in zip(keys, (K ** -0.5, K ** -0.5, 1)))
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  gate = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, T, H, K)) + 4.0) / 16
  do = jax.random.normal(keys[4], (B, T, H, K))

  def grads(fn, *args):
    loss = lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) * do)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)

  with jax.default_matmul_precision("highest"):
    want = grads(lambda *a: gated_linear_attention(*a, implementation="recurrent"),
                 *(x.astype(jnp.float32) for x in (q, k, v)), gate)
  errors = lambda fn: np.array([relative_l2(g.astype(jnp.float32), w)
                                for g, w in zip(grads(fn, q, k, v, gate), want)])
  xla = lambda *a: gated_linear_attention(*a, implementation="chunked", tiles=ChunkTiles(CHUNK))
  return {"xla": errors(xla), "split": errors(kernel), "one": errors(kernel_split_off)}


def gated_abstract_inputs(gate_shape, B=1, T=200, H=2, K=24, V=40):
  """bf16 q, k, v with head dims that need padding, a partial chunk, fp32 gate, segment ids."""
  gate = jax.ShapeDtypeStruct((B, T, H) if gate_shape == "head" else (B, T, H, K), jnp.float32)
  return (bf16(B, T, H, K), bf16(B, T, H, K), bf16(B, T, H, V), gate,
          jax.ShapeDtypeStruct((B, T), jnp.int32))


# SANATAN.

def sanatan_inputs(seed, T, *, B=2, H=2, d=8, dv=5):
  """q, k, v, omega, lam_raw with |u| spread across both edges of the root saturation band."""
  rng = np.random.default_rng(seed)
  spread = lambda *s: rng.normal(size=s) * np.exp(rng.uniform(np.log(0.01), np.log(50.0), size=s))
  arrays = (spread(B, T, H, d), spread(B, T, H, d), rng.normal(size=(B, T, H, dv)),
            np.pi / 4 + 0.3 * rng.normal(size=(H, d)), 2.0 * rng.normal(size=(H, d)))
  return tuple(jnp.asarray(x, jnp.float32) for x in arrays)


def run_sanatan(fn, inputs, state, projections, **options):
  """Outputs, final state and gradients of a random projection of both w.r.t. every input."""
  q, k, v, omega, lam_raw = inputs
  B, T, H, d = q.shape
  F, dv = 6 * d, v.shape[-1]
  position = jnp.zeros((B,), jnp.int32) if state is None else state.position
  S0, z0 = (jnp.zeros((B, H, F, dv)), jnp.zeros((B, H, F))) if state is None else state[:2]

  def loss(q, k, v, omega, lam_raw, S0, z0):
    o, new = fn(q, k, v, omega, lam_raw, state=SanatanState(S0, z0, position), **options)
    do, dS, dz = projections
    return (o * do).sum() + (new.S * dS).sum() + (new.z * dz).sum(), (o, new)

  grad = jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True)
  (_, (o, new)), grads = jax.jit(grad, compiler_options=FAST_COMPILE)(*inputs, S0, z0)
  names = ("dq", "dk", "dv", "domega", "dlam_raw", "dS0", "dz0")
  return {"o": o, "S": new.S, "z": new.z, "position": new.position, **dict(zip(names, grads))}


def run_stateless(fn, inputs, **options):
  """The output and the gradients of a random projection of it w.r.t. q, k, v, omega, lam_raw."""
  do, = normals(np.random.default_rng(99), inputs[2].shape)

  def outputs_and_grads(*args):
    o, vjp = jax.vjp(lambda *a: fn(*a, **options), *args)
    return o, vjp(do)

  o, grads = jax.jit(outputs_and_grads, compiler_options=FAST_COMPILE)(*inputs)
  return {"o": o, **dict(zip(("dq", "dk", "dv", "domega", "dlam_raw"), grads))}


def clipped_scores(seed, T):
  """How many causal total scores of the 4-channel features of ``sanatan_inputs(seed, T, d=4)``
  are negative (clipped to 0 before the power)."""
  q, k, _, omega, lam_raw = sanatan_inputs(seed, T, d=4)
  positions = jnp.broadcast_to(jnp.arange(T), (2, T))
  phi_q, phi_k = sanatan_features(q, k, omega, lam_raw, positions, channels=4)
  s_BxHxTxT = jnp.einsum("bthf,bshf->bhts", phi_q, phi_k)
  return int(jnp.sum(jnp.tril(jnp.ones((T, T), bool)) & (s_BxHxTxT < 0)))


def sanatan_abstract_inputs(B=1, T=200, H=2, d=24, dv=40):
  """bf16 q, k, v with head dims that need padding and a partial chunk or block; fp32 omega,
  lam_raw; segment ids."""
  param = jax.ShapeDtypeStruct((H, d), jnp.float32)
  return (bf16(B, T, H, d), bf16(B, T, H, d), bf16(B, T, H, dv), param, param,
          jax.ShapeDtypeStruct((B, T), jnp.int32))


# BASED Taylor linear attention.

def run_taylor(fn, inputs, state, projections, **options):
  """Outputs, final state and gradients of a random projection of both w.r.t. q, k, v, S0, z0; ``fn``
  has ``taylor_linear_attention``'s arguments (a backend's own entry point brings its tiling)."""

  def loss(q, k, v, S0, z0):
    o, new = fn(q, k, v, state=TaylorState(S0, z0), **options)
    do, dS, dz = projections
    return (o * do).sum() + (new.S * dS).sum() + (new.z * dz).sum(), (o, new)

  grad = jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True)
  (_, (o, new)), grads = jax.jit(grad, compiler_options=FAST_COMPILE)(*inputs, *state)
  return {"o": o, "S": new.S, "z": new.z, **dict(zip(("dq", "dk", "dv", "dS0", "dz0"), grads))}


def taylor_abstract_inputs(B=1, T=200, H=2, d=16, dv=64):
  """bf16 q, k, v of the BASED head shape (d' = 16, dv = 64), a partial chunk, segment ids."""
  return (bf16(B, T, H, d), bf16(B, T, H, d), bf16(B, T, H, dv),
          jax.ShapeDtypeStruct((B, T), jnp.int32))
