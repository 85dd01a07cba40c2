"""The op's switch and defaults: the registry maps names to backends, "auto"/None resolve to
"chunked" on every platform, unknown names list the ones that run, the state defaults to zeros and
the scale to K^-1/2, bad shapes and tiles raise clear errors."""

import jax
import numpy as np
import pytest

from lmcore.ops.common.backend import ChunkTiles
from lmcore.ops.gated_delta_rule import REGISTRY, DeltaRuleState, Problem, gated_delta_rule
from lmcore.ops.gated_delta_rule import reference, xla

from .test_base import ARG_NAMES, B, H, K, V, gdr_inputs

_forward = jax.jit(gated_delta_rule, static_argnames=("implementation", "tiles"))


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_registry_names_their_backends_and_auto_means_chunked(platform):
  problem = Problem(platform, K, V)
  assert REGISTRY.resolve_name(None, problem) == REGISTRY.resolve_name("auto", problem) == "chunked"
  assert isinstance(REGISTRY.backends["chunked"], xla.Chunked)
  assert isinstance(REGISTRY.backends["recurrent"], reference.Recurrent)
  assert REGISTRY.resolve(None, problem).heuristic_config(problem) == ChunkTiles(64)


def test_state_defaults_to_zeros_and_scale_to_inverse_sqrt_key_dim():
  inputs = gdr_inputs(seed=7, length=33, with_state=False)
  args = [inputs[name] for name in ARG_NAMES[:5]]
  o_default, _ = _forward(*args)
  o_explicit, _ = _forward(*args, state=DeltaRuleState.zeros(B, H, K, V), scale=K**-0.5)
  np.testing.assert_array_equal(o_default, o_explicit)


def test_unknown_implementation_and_mismatched_shapes_raise_clear_errors():
  inputs = gdr_inputs(seed=8, length=5)
  args = [inputs[name] for name in ARG_NAMES[:5]]
  for name in ("pallas", "reference", "xla"):
    with pytest.raises(ValueError, match="use one of recurrent, chunked, auto"):
      gated_delta_rule(*args, implementation=name)
  with pytest.raises(ValueError, match="chunk must be a positive number"):
    ChunkTiles(0)
  with pytest.raises(ValueError, match="do not fit Recurrent, which takes no tiles"):
    gated_delta_rule(*args, implementation="recurrent", tiles=ChunkTiles(16))
  with pytest.raises(ValueError, match="beta has shape"):
    gated_delta_rule(*args[:4], args[4][:, :3])
  with pytest.raises(ValueError, match="state.S has shape"):
    gated_delta_rule(*args, state=DeltaRuleState.zeros(B, H, V, K))
