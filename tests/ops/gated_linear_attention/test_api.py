"""The op's switch: the registry maps names to forms, "auto"/None resolve to "chunked" off GPU,
unknown names (including the dropped "reference") list the valid ones, bad shapes and chunk sizes
raise clear errors."""

import jax.numpy as jnp
import pytest

from lmcore.ops.common import pallas_utils
from lmcore.ops.gated_linear_attention import (IMPLEMENTATIONS, LinearAttentionState,
                                               gated_linear_attention, reference, xla,
                                               resolve_implementation)
from .test_base import gla_inputs


def test_registry_names_their_forms_and_none_means_chunked_off_gpu(monkeypatch):
  monkeypatch.setattr(pallas_utils, "backend", lambda: "cpu")
  assert resolve_implementation(None) == resolve_implementation("auto") == "chunked"
  assert IMPLEMENTATIONS["chunked"] is IMPLEMENTATIONS["xla"] is xla.chunked
  assert IMPLEMENTATIONS["recurrent"] is reference.recurrent
  assert IMPLEMENTATIONS["parallel"] is reference.parallel


def test_unknown_implementation_names_list_the_valid_ones():
  q, k, v, _, _ = gla_inputs(51, 9, None, False)
  for name in ("cuda_magic", "reference"):
    with pytest.raises(ValueError, match="valid: recurrent, parallel, chunked, xla, pallas"):
      gated_linear_attention(q, k, v, implementation=name)


def test_invalid_shapes_and_chunk_sizes_raise_clear_errors():
  q, k, v, _, _ = gla_inputs(61, 9, None, False)
  with pytest.raises(ValueError, match=r"log_forget has shape \(2, 9, 3\)"):
    gated_linear_attention(q, k, v, jnp.zeros((2, 9, 3)))
  with pytest.raises(ValueError, match="power of two"):
    gated_linear_attention(q, k, v, chunk_size=24)
  with pytest.raises(ValueError, match="state.S"):
    gated_linear_attention(q, k, v, state=LinearAttentionState.zeros(2, 2, 8, 4))
