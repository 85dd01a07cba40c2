"""The blocked SANATAN Pallas kernels compute sanatan_attention's function (SPEC §1.1 step 6) for
every power and channel variant: outputs and gradients (q, k, v, omega, lam_raw) equal the
materialised ``parallel`` form, for partial blocks, query blocks longer and shorter than key blocks,
padded head and value dims, packed documents, explicit positions and the no-rotation ablation.

The kernels run in interpret mode on CPU. Tolerance: relative L2 error 1e-5 at fp32 (the forms
differ only in summation order; observed below 1e-6 here).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.kernels import pallas_utils
from lmcore.numerics import relative_l2
from sanatan_jax import sanatan_attention
from sanatan_jax.attention import sanatan_features
from sanatan_jax.kernels import sanatan_blocked_pallas

RTOL = 1e-5
# These tests check the math, not code generation: skip LLVM's expensive passes on a shared CPU.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_GRAD_NAMES = ("dq", "dk", "dv", "domega", "dlam_raw")


def _inputs(seed, T, *, B=2, H=2, d=8, dv=5):
  """q, k, v, omega, lam_raw with |u| spread across both edges of the root saturation band."""
  rng = np.random.default_rng(seed)
  spread = lambda *s: rng.normal(size=s) * np.exp(rng.uniform(np.log(0.01), np.log(50.0), size=s))
  arrays = (spread(B, T, H, d), spread(B, T, H, d), rng.normal(size=(B, T, H, dv)),
            np.pi / 4 + 0.3 * rng.normal(size=(H, d)), 2.0 * rng.normal(size=(H, d)))
  return tuple(jnp.asarray(x, jnp.float32) for x in arrays)


def _parallel(*args, **options):
  return sanatan_attention(*args, implementation="parallel", **options)[0]


def _run(fn, inputs, seed=99, **options):
  """The output and the gradients of a random projection of it w.r.t. q, k, v, omega, lam_raw."""
  do = jnp.asarray(np.random.default_rng(seed).normal(size=inputs[2].shape), jnp.float32)

  def outputs_and_grads(*args):
    o, vjp = jax.vjp(lambda *a: fn(*a, **options), *args)
    return o, vjp(do)

  o, grads = jax.jit(outputs_and_grads, compiler_options=_FAST_COMPILE)(*inputs)
  return {"o": o, **dict(zip(_GRAD_NAMES, grads))}


def _assert_same(got, want, what):
  errors = {name: relative_l2(got[name], want[name]) for name in want}
  bad = {name: e for name, e in errors.items() if e > RTOL}
  assert not bad, f"{what}: relative L2 errors above {RTOL}: {bad}"


@pytest.mark.parametrize("p,channels,three_channel,T,d,blocks", [
    (2, 6, "clean", 37, 8, (16, 8)),  # partial last block; query blocks longer than key blocks
    (4, 6, "clean", 16, 8, (8, 16)),  # key blocks longer than query blocks
    (2, 4, "clean", 29, 4, (8, 8)),  # d = 4: some total scores are negative and clipped at 0
    (1, 4, "clean", 21, 6, (8, 8)),  # head dim padded 6 -> 8
    (3, 3, "legacy", 23, 8, (8, 16)),  # any positive integer power
    (2, 3, "clean", 23, 8, (16, 8)),
])
def test_blocked_kernel_equals_parallel_with_gradients(p, channels, three_channel, T, d, blocks):
  inputs = _inputs(10 * p + channels + T, T, d=d)
  options = dict(p=p, channels=channels, three_channel=three_channel)
  block_q, block_k = blocks
  got = _run(functools.partial(sanatan_blocked_pallas, block_q=block_q, block_k=block_k), inputs,
             **options)
  want = _run(_parallel, inputs, **options)
  _assert_same(got, want, f"p={p} {channels}ch {three_channel} T={T} d={d} blocks={blocks}")


def test_four_channel_inputs_above_reach_the_clip():
  """The d = 4 inputs of the 4-channel p = 2 case have negative total scores (clipped to 0 before
  the power), so that case tests the clip and its gradient."""
  T = 29
  q, k, _, omega, lam_raw = _inputs(10 * 2 + 4 + T, T, d=4)
  positions = jnp.broadcast_to(jnp.arange(T), (2, T))
  phi_q, phi_k = sanatan_features(q, k, omega, lam_raw, positions, channels=4)
  s_BxHxTxT = jnp.einsum("bthf,bshf->bhts", phi_q, phi_k)
  assert int(jnp.sum(jnp.tril(jnp.ones((T, T), bool)) & (s_BxHxTxT < 0))) >= 10


def test_blocked_kernel_honours_segment_ids_explicit_positions_and_no_rotation():
  """Row 1 packs two documents (boundary mid-block, positions restarting); row 0 is one document."""
  T = 37
  inputs = _inputs(7, T)
  segment_ids = np.zeros((2, T), np.int32)
  segment_ids[1, 12:] = 1
  positions = np.tile(np.arange(T, dtype=np.int32), (2, 1)) + 5
  positions[1, 12:] = np.arange(T - 12)
  for rotate in (True, False):
    options = dict(p=2, segment_ids=jnp.asarray(segment_ids), positions=jnp.asarray(positions),
                   rotate=rotate)
    got = _run(functools.partial(sanatan_blocked_pallas, block_q=8, block_k=8), inputs, **options)
    want = _run(_parallel, inputs, **options)
    _assert_same(got, want, f"segments, rotate={rotate}")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("p,channels,three_channel", [(2, 6, "clean"), (4, 4, "clean"),
                                                      (1, 3, "legacy")])
def test_kernels_lower_to_triton_for_an_h200_with_bfloat16_inputs(p, channels, three_channel):
  """Forward, dq and dk/dv kernels pass the Pallas Triton lowering (power-of-two blocks, traced
  loop bounds, the in-kernel feature map and its VJP) for an abstract H200, with padded dims."""
  B, T, H, d, dv = 1, 40, 2, 24, 40
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  param = jax.ShapeDtypeStruct((H, d), jnp.float32)

  def loss(q, k, v, omega, lam_raw):
    o = sanatan_blocked_pallas(q, k, v, omega, lam_raw, p=p, channels=channels,
                               three_channel=three_channel, interpret=False)
    return o.astype(jnp.float32).sum()

  lowered = pallas_utils.lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), bf16(B, T, H, d),
                                       bf16(B, T, H, d), bf16(B, T, H, dv), param, param)
  assert lowered.as_text().count("xla.gpu.triton") == 3  # forward, dq, dk/dv


def test_op_dispatches_every_variant_but_p1_six_channels_to_the_blocked_kernel():
  """``implementation="pallas"`` runs the blocked kernel, without a state, wherever the p = 1
  kernel does not apply (p = 1 with 6 channels: test_pallas_sanatan.py)."""
  inputs = _inputs(5, 13)
  for options in (dict(p=2), dict(p=1, channels=4)):
    op = functools.partial(sanatan_attention, implementation="pallas", **options)
    o, state = jax.jit(op, compiler_options=_FAST_COMPILE)(*inputs)
    kernel = functools.partial(sanatan_blocked_pallas, **options)
    assert state is None
    np.testing.assert_array_equal(o, jax.jit(kernel, compiler_options=_FAST_COMPILE)(*inputs))


def test_bad_options_raise_clear_errors():
  q, k, v, omega, lam_raw = _inputs(3, 9)
  with pytest.raises(NotImplementedError, match="implementation='blocked'"):
    sanatan_blocked_pallas(q, k, v, omega, lam_raw, interpret=False)
  with pytest.raises(ValueError, match="block_k must be a power of two"):
    sanatan_blocked_pallas(q, k, v, omega, lam_raw, block_k=24)
  with pytest.raises(ValueError, match="p must be a positive integer"):
    sanatan_blocked_pallas(q, k, v, omega, lam_raw, p=0)
  with pytest.raises(ValueError, match="channels must be one of"):
    sanatan_blocked_pallas(q, k, v, omega, lam_raw, channels=5)
  state = sanatan_attention(q, k, v, omega, lam_raw, implementation="recurrent")[1]
  with pytest.raises(ValueError, match="no constant-size state"):
    sanatan_attention(q, k, v, omega, lam_raw, p=2, implementation="pallas", state=state)
