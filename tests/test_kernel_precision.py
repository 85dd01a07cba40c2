"""The GPU kernels' ``kernel_precision``: at "float32" (and "tf32") the Pallas kernels run on fp32
copies of bf16 inputs and return fp32, so the op agrees with the fp32 XLA path within the
bf16 agreement limit (2e-3, relative L2) on the output and every input gradient; at "input" (the default)
they keep bf16 operands and outputs. "tf32" reaches the Triton dots as Precision.DEFAULT (TF32 on
the GPU; on CPU, where the kernels run interpreted, it computes in full fp32).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from based_jax import taylor_linear_attention
from benchmarks import kernel_check
from lmcore.ops.gated_linear_attention import gated_linear_attention
from lmcore.ops.common import pallas_utils as pu
from lmcore.numerics import relative_l2
from sanatan_jax import sanatan_attention

B, T, H, D, DV = 2, 77, 2, 16, 32  # T: a partial chunk and block
BF16_LIMIT = kernel_check.LIMITS["bfloat16"]
# Each op's GPU (Triton) kernels and TPU (Mosaic) kernels by implementation name (None: none).
KERNELS = {"sanatan_p1": "pallas_fused", "sanatan_p2": "pallas_flash", "gated": "pallas_triton",
           "taylor": "pallas_blocked"}
TPU_KERNELS = {"sanatan_p1": "pallas_tpu", "sanatan_p2": None, "gated": "pallas_tpu", "taylor": "pallas_tpu"}


def _op(name, rng):
  """(op(implementation, **options) -> fn(q, k, v) -> o, the XLA implementation it is checked
  against, the q, k scale)."""
  omega = jnp.asarray(np.pi / 4 + 0.3 * rng.normal(size=(H, D)), jnp.float32)
  lam_raw = jnp.asarray(rng.normal(size=(H, D)), jnp.float32)
  log_forget = jnp.asarray(-rng.uniform(0.01, 0.3, size=(B, T, H, D)), jnp.float32)
  ops = {
      "sanatan_p1": (lambda impl, **o: lambda q, k, v: sanatan_attention(
          q, k, v, omega, lam_raw, implementation=impl, **o)[0], "chunked", 0.2),
      "sanatan_p2": (lambda impl, **o: lambda q, k, v: sanatan_attention(
          q, k, v, omega, lam_raw, p=2, implementation=impl, **o)[0], "parallel", 0.2),
      "gated": (lambda impl, **o: lambda q, k, v: gated_linear_attention(
          q, k, v, log_forget, implementation=impl, **o)[0], "chunked", 0.25),
      "taylor": (lambda impl, **o: lambda q, k, v: taylor_linear_attention(
          q, k, v, implementation=impl, **o)[0], "chunked", 0.5),
  }
  return ops[name]


def _bf16_inputs(rng, scale):
  normal = lambda width, s=1.0: jnp.asarray(s * rng.normal(size=(B, T, H, width)), jnp.bfloat16)
  return normal(D, scale), normal(D, scale), normal(DV)


def _worst(results, reference):
  o, grads = results
  ref_o, ref_grads = reference
  return max(relative_l2(a, b) for a, b in zip((o, *grads), (ref_o, *ref_grads)))


@pytest.mark.parametrize("name", ["sanatan_p1", "sanatan_p2", "gated", "taylor"])
def test_float32_kernels_meet_the_bf16_limit(name):
  rng = np.random.default_rng(3)
  op, reference_impl, scale = _op(name, rng)
  args = _bf16_inputs(rng, scale)
  fp32_args = tuple(a.astype(jnp.float32) for a in args)
  reference = kernel_check.output_and_grads(op(reference_impl), fp32_args, "highest")
  kernel = KERNELS[name]
  fast = kernel_check.output_and_grads(op(kernel), args)
  accurate = kernel_check.output_and_grads(op(kernel, kernel_precision="float32"), args)
  assert jax.eval_shape(op(kernel), *args).dtype == jnp.bfloat16
  assert jax.eval_shape(op(kernel, kernel_precision="float32"), *args).dtype == jnp.float32
  assert all(g.dtype == jnp.bfloat16 for g in accurate[1])  # JAX: a cotangent has its primal's dtype
  worst_fast, worst_accurate = _worst(fast, reference), _worst(accurate, reference)
  assert worst_accurate <= BF16_LIMIT, (name, worst_accurate)
  assert worst_accurate < worst_fast, (name, worst_accurate, worst_fast)


_Config = collections.namedtuple("_Config", "interpret num_warps num_stages precision")


def _dot_precisions(precision, dtype):
  """The precision of the dot_general that ``pu.dot`` traces inside a kernel run by ``pu.call``."""

  def kernel(a_ref, b_ref, o_ref, *, cfg):
    del cfg
    o_ref[...] = pu.dot(a_ref[...], b_ref[...])

  a = jnp.ones((16, 16), dtype)
  out = jax.ShapeDtypeStruct((16, 16), jnp.float32)
  cfg = _Config(True, 4, 2, precision)
  spec = pl.BlockSpec((16, 16), lambda i: (0, 0))
  jaxpr = jax.make_jaxpr(lambda a, b: pu.call(kernel, cfg, (1,), [spec, spec], spec, out, a, b))(a, a)
  kernel_jaxpr = jaxpr.eqns[0].params["jaxpr"]
  return [e.params["precision"] for e in kernel_jaxpr.eqns if e.primitive.name == "dot_general"]


def test_tf32_reaches_the_fp32_dots_only():
  highest, default = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT
  assert _dot_precisions("tf32", jnp.float32) == [(default, default)]
  assert _dot_precisions("float32", jnp.float32) == [(highest, highest)]
  assert _dot_precisions("input", jnp.float32) == [(highest, highest)]
  assert _dot_precisions("tf32", jnp.bfloat16) == [None]
  assert not pu._FP32_DOTS  # the setting ends with the call


def test_precision_errors_name_the_choices():
  with pytest.raises(ValueError, match="unknown precision 'fp16'; valid: input, tf32, float32"):
    pu.kernel_options("fp16", "op")
  assert pu.kernel_options("tf32", "op") == {"precision": "tf32"}
  with pu.assume_backend("tpu"):
    with pytest.raises(ValueError, match="kernel_precision='input'"):
      pu.kernel_options("float32", "op")
    assert pu.kernel_options("input", "op") == {}


@pytest.mark.parametrize("name", ["sanatan_p1", "sanatan_p2", "gated", "taylor"])
def test_on_tpu_only_the_kernels_reject_fp32_precision(name):
  """The TPU kernels compute in the inputs' dtype, so a non-"input" precision fails there, while
  the XLA implementations (which ignore it) still run: a GPU config stays usable on a TPU host."""
  rng = np.random.default_rng(5)
  op, reference_impl, scale = _op(name, rng)
  args = _bf16_inputs(rng, scale)
  with pu.assume_backend("tpu"):
    assert jax.eval_shape(op(reference_impl, kernel_precision="tf32"), *args).dtype == jnp.bfloat16
    if TPU_KERNELS[name] is not None:
      with pytest.raises(ValueError, match="kernel_precision='input'"):
        jax.eval_shape(op(TPU_KERNELS[name], kernel_precision="tf32"), *args)
