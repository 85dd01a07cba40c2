"""The mixers' ``kernel_precision`` config field reaches the Pallas kernels of their op, and a bad
value fails when the config is converted.

The mixers are built from ``model.mixers.<kind>`` as a config file or ``--config`` override gives
them. At "float32" the kernels run on fp32 copies of the bf16 activations, so the bf16 output
moves by about one bf16 rounding (2^-8; measured 2e-3 to 4e-3 relative L2): the test asks for a
different output within 1e-2, which an ignored field (the same computation, bitwise) fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernel_cases import FAST_COMPILE
from lmcore import config as cfg_lib
from lmcore.registry import mixer_class
from lmcore.mixers.base import InitSpec
from lmcore.numerics import relative_l2

D, T = 16, 37  # T: a partial kernel chunk
BF16_ROUNDINGS = 1e-2
INIT = InitSpec(std=0.3, out_std=0.3)  # activations of order 1, as in the mixers' own tests
SMALL = {
    "sanatan": dict(n_heads=2, head_dim=8),
    "gla": dict(n_heads=2),
    "cyfa": dict(n_heads=2, head_dim=8, v_head_dim=8),
    "linear_transformer": dict(n_heads=2, head_dim=8),
    "performer": dict(n_heads=2, head_dim=8, n_features=16),
    "cosformer": dict(n_heads=2, head_dim=8, max_len=64),
    "taylor": dict(n_heads=2, feature_dim=4),
}
KERNELS = {"sanatan": "pallas_fused", "taylor": "pallas_fused"}  # each kind's Triton kernels (else GLA's)


def _mixer_config(kind, **fields):
  """The typed config of mixer ``kind`` converted from ``model.mixers.<kind>`` values."""
  values = {"d_model": D, "n_layers": 1, "pattern": kind, "mixers": {kind: fields}}
  return cfg_lib.model_config(values).mixers[kind]


def _bf16_output(kind, kernel_precision, x_BxTxD, seed):
  """y of a bf16 Pallas ``kind`` mixer with parameters drawn from ``seed``, on ``x``."""
  config = _mixer_config(kind, **SMALL[kind], implementation=KERNELS.get(kind, "pallas_triton"),
                         kernel_precision=kernel_precision)
  mixer = mixer_class(kind)(config, d_model=D, init=INIT, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(mixer)
  apply = lambda params, x: nnx.merge(graphdef, params)(x)[0]
  return jax.jit(apply, compiler_options=FAST_COMPILE)(params, x_BxTxD)


@pytest.mark.parametrize("seed,kind", list(enumerate(SMALL)))
def test_float32_kernel_precision_reaches_the_kernels(seed, kind):
  x = jnp.asarray(np.random.default_rng(seed).normal(size=(2, T, D)), jnp.bfloat16)
  fast, accurate = (_bf16_output(kind, precision, x, seed) for precision in ("input", "float32"))
  assert fast.dtype == accurate.dtype == jnp.bfloat16
  assert not np.array_equal(np.asarray(fast), np.asarray(accurate)), "kernel_precision ignored"
  assert relative_l2(accurate, fast) < BF16_ROUNDINGS


@pytest.mark.parametrize("kind", list(SMALL))
def test_unknown_kernel_precision_fails_at_config_conversion(kind):
  with pytest.raises(ValueError, match="unknown precision 'fp16'; valid: input, tf32, float32"):
    _mixer_config(kind, kernel_precision="fp16")


@pytest.mark.parametrize("kind", ["gla", "cyfa"])
def test_kernel_split_state_reaches_the_gated_kernels_backward(kind):
  """``kernel_split_state`` (the gated kernels' backward state dots in two bf16 parts, default True)
  changes the parameter gradients of a bf16 Pallas mixer by about a bf16 rounding, not its output."""
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, T, D)), jnp.bfloat16)

  def outputs_and_grads(split):
    config = _mixer_config(kind, **SMALL[kind], implementation="pallas_triton", kernel_split_state=split)
    mixer = mixer_class(kind)(config, d_model=D, init=INIT, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(mixer)
    loss = lambda params: jnp.sum(nnx.merge(graphdef, params)(x)[0].astype(jnp.float32) ** 2)
    grads = jax.jit(jax.grad(loss), compiler_options=FAST_COMPILE)(params)
    return nnx.merge(graphdef, params)(x)[0], jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])

  (y_two, g_two), (y_one, g_one) = outputs_and_grads(True), outputs_and_grads(False)
  np.testing.assert_array_equal(np.asarray(y_two), np.asarray(y_one))
  assert not np.array_equal(np.asarray(g_two), np.asarray(g_one)), "kernel_split_state ignored"
  assert relative_l2(g_one, g_two) < BF16_ROUNDINGS
