"""TPU slices as compile targets: a slice name -> the devices of its topology, on any host.

``jax.experimental.topologies`` describes a slice's chips without a TPU: with libtpu installed, a CPU
host lowers and compiles programs for them ahead of time (``scripts/aot_compile.py``,
``scripts/bench_tpu_aot.py``). Topology names: docs/SCALING.md.
"""

from __future__ import annotations

import dataclasses
import re

from lmcore.errors import UserError


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  topology: str  # get_topology_desc's topology_name
  chip_config: str  # "megacore": one device per chip (v4, v5p), else "default"
  chips_per_host: tuple[int, int, int]


# Cloud TPU slice names (v4/v5p count TensorCores, two per chip; v5e/v6e count chips).
TPU_SLICES = {
    "v4-8": TpuSlice("v4:2x2x1", "megacore", (2, 2, 1)),
    "v4-16": TpuSlice("v4:2x2x2", "megacore", (2, 2, 1)),
    "v4-32": TpuSlice("v4:2x2x4", "megacore", (2, 2, 1)),
    "v5p-8": TpuSlice("v5p:2x2x1", "megacore", (2, 2, 1)),
    "v5p-16": TpuSlice("v5p:2x2x2", "megacore", (2, 2, 1)),
    "v5e-4": TpuSlice("v5e:2x2", "default", (2, 2, 1)),
    "v5e-8": TpuSlice("v5e:2x4", "default", (2, 4, 1)),
    "v5e-16": TpuSlice("v5e:4x4", "default", (2, 4, 1)),
    "v6e-4": TpuSlice("v6e:2x2", "default", (2, 2, 1)),
    "v6e-8": TpuSlice("v6e:2x4", "default", (2, 4, 1)),
}
# HBM a program may use per device, by device_kind: the limit libtpu 0.0.48's compiler reports in its
# out-of-memory message (physical HBM: v4 32 GiB, v5e 16, v5p 95, v6e 32).
TPU_HBM_GIB = {"TPU v4": 30.75, "TPU v5 lite": 15.75, "TPU v5": 95.73, "TPU v6 lite": 31.24}


def tpu_slice(name: str) -> TpuSlice:
  """A name of ``TPU_SLICES``, or a topology such as "v4:2x2x1" / "v5e:2x4"."""
  if name in TPU_SLICES:
    return TPU_SLICES[name]
  match = re.fullmatch(r"(v4|v5p|v5e|v6e):(\d+)x(\d+)(?:x(\d+))?", name)
  if not match:
    raise UserError(f"--topology={name!r}: give one of {', '.join(TPU_SLICES)} or a topology like "
                    f"v4:2x2x1, v5p:2x2x2, v5e:2x4, v6e:4x4.")
  generation = match.group(1)
  dims = [int(d) for d in match.group(2, 3)]
  if generation in ("v4", "v5p"):
    return TpuSlice(name, "megacore", (2, 2, 1))
  return TpuSlice(name, "default", (min(dims[0], 2), min(dims[1], 4), 1))


def tpu_devices(name: str, num_slices: int = 1) -> list:
  """The devices of slice ``name`` (``tpu_slice``) times ``num_slices``; needs libtpu, not a TPU."""
  try:
    import libtpu  # noqa: F401  (only to say clearly that it is missing)
  except ImportError:
    raise UserError("compiling for a TPU needs libtpu on this machine (no TPU needed): "
                    "pip install -e '.[tpu]'") from None
  from jax.experimental import topologies

  target = tpu_slice(name)
  return list(topologies.get_topology_desc(
      topology_name=target.topology, platform="tpu", chip_config_name=target.chip_config,
      chips_per_host_bounds=target.chips_per_host, num_slices=num_slices).devices)
