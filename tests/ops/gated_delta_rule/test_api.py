"""The op's switch and defaults: the registry maps names to forms, "auto"/None resolve to
"chunked", unknown names (including the dropped "reference") list the valid ones, the state
defaults to zeros and the scale to K^-1/2, bad shapes raise clear errors."""

import jax
import numpy as np
import pytest

from lmcore.ops.gated_delta_rule import (IMPLEMENTATIONS, DeltaRuleState, gated_delta_rule,
                                         reference, resolve_implementation, xla)

from .test_base import ARG_NAMES, B, H, K, V, gdr_inputs

_forward = jax.jit(gated_delta_rule, static_argnames=("implementation", "chunk_size"))


def test_registry_names_their_forms_and_auto_means_chunked():
  assert resolve_implementation(None) == resolve_implementation("auto") == "chunked"
  assert IMPLEMENTATIONS["chunked"] is IMPLEMENTATIONS["xla"] is xla.chunked
  assert IMPLEMENTATIONS["recurrent"] is reference.recurrent


def test_state_defaults_to_zeros_and_scale_to_inverse_sqrt_key_dim():
  inputs = gdr_inputs(seed=7, length=33, with_state=False)
  args = [inputs[name] for name in ARG_NAMES[:5]]
  o_default, _ = _forward(*args)
  o_explicit, _ = _forward(*args, state=DeltaRuleState.zeros(B, H, K, V), scale=K**-0.5)
  np.testing.assert_array_equal(o_default, o_explicit)


def test_unknown_implementation_and_mismatched_shapes_raise_clear_errors():
  inputs = gdr_inputs(seed=8, length=5)
  args = [inputs[name] for name in ARG_NAMES[:5]]
  for name in ("pallas", "reference"):
    with pytest.raises(ValueError, match="valid: recurrent, chunked, xla"):
      gated_delta_rule(*args, implementation=name)
  with pytest.raises(ValueError, match="chunk_size must be >= 1"):
    gated_delta_rule(*args, chunk_size=0)
  with pytest.raises(ValueError, match="beta has shape"):
    gated_delta_rule(*args[:4], args[4][:, :3])
  with pytest.raises(ValueError, match="state.S has shape"):
    gated_delta_rule(*args, state=DeltaRuleState.zeros(B, H, V, K))
