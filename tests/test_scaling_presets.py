"""benchmarks/scaling_presets.py (docs/SCALING.md's roofline table): every model at every length takes the
same tokens per chip of a v4-8 (at least one sequence), in micro-batches that split over its 4 chips, with
the position table stretched to the length and the mesh data parallel."""

import pytest

from benchmarks import scaling_presets
from lmcore import config as cfg_lib


@pytest.mark.parametrize("model", scaling_presets.MODELS)
def test_every_length_splits_over_the_chips_with_positions_to_fit(model):
  for name, length in scaling_presets.LENGTHS.items():
    config = cfg_lib.experiment_config(scaling_presets.get_config(f"{model}_{name}"))
    train = config.train
    assert config.name == f"{model}_{name}" and config.data.seq_len == length
    assert train.batch_size * length == scaling_presets.CHIPS * max(scaling_presets.TOKENS_PER_CHIP, length)
    micro_rows = train.batch_size // train.grad_accum
    assert micro_rows % scaling_presets.CHIPS == 0
    assert micro_rows // scaling_presets.CHIPS * length <= max(scaling_presets.MICRO_TOKENS_PER_CHIP, length)
    assert config.model.max_positions in (0, length)
    assert (config.mesh.data, config.mesh.fsdp, config.mesh.tensor) == (-1, 1, 1)
