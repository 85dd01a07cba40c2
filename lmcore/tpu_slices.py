"""TPU slices as compile targets: a slice name -> the devices of its topology, on any host.

``jax.experimental.topologies`` describes a slice's chips without a TPU: with libtpu, a CPU host lowers
and compiles programs for them ahead of time (``scripts/aot_compile.py``, ``scripts/bench_tpu_aot.py``).
Topology names: docs/SCALING.md.

Where libtpu comes from (``libtpu_path``): ``TPU_LIBRARY_PATH``; else the ``libtpu`` package where it is
importable (the ``tpu`` extra, as on a TPU VM); else ``AOT_LIBTPU_DIR`` of the running environment, where
``make aot`` installs it outside the import path. JAX starts a TPU backend from any importable libtpu at
its first computation, and on a host without TPU chips libtpu then logs initialisation errors, so the
project's own environment keeps it out of ``import libtpu``'s reach and loads it here, only to compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import os
import re
import sys
from collections.abc import Iterator, MutableMapping

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


# ``make aot`` installs libtpu here (``pip install --target``): beside the environment, not importable.
AOT_LIBTPU_DIR = os.path.join(sys.prefix, "libtpu-aot")
MISSING_LIBTPU = ("compiling for a TPU needs libtpu on this machine (no TPU needed): run `make aot`, which "
                  f"installs it into {AOT_LIBTPU_DIR}, or set TPU_LIBRARY_PATH to a libtpu.so.")
# On a host without TPU chips libtpu's runtime start looks for this host's place in a slice (the cloud
# metadata server, then these variables) and logs errors when it finds none. A one-host slice of this
# host satisfies it; compiling for a described topology does not read them.
NO_TPU_HOST = {"TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost"}


def libtpu_path(environ: MutableMapping[str, str] = os.environ) -> str | None:
  """The libtpu.so to compile with (module docstring), or None if there is none."""
  candidates = [environ.get("TPU_LIBRARY_PATH", "")]
  spec = importlib.util.find_spec("libtpu")
  if spec is not None and spec.origin:
    candidates.append(os.path.join(os.path.dirname(spec.origin), "libtpu.so"))
  candidates.append(os.path.join(AOT_LIBTPU_DIR, "libtpu", "libtpu.so"))
  return next((path for path in candidates if path and os.path.isfile(path)), None)


def has_tpu_chips(root: str = "/") -> bool:
  """Whether this host has TPU chips (device files of TPU VMs up to v4, /dev/vfio from v5e on)."""
  return any(glob.glob(os.path.join(root, pattern)) for pattern in ("dev/accel*", "dev/vfio/[0-9]*"))


@contextlib.contextmanager
def _libtpu_start(path: str, environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
  """While libtpu loads: ``TPU_LIBRARY_PATH`` (where JAX loads it from) and, on a host without TPU
  chips, ``NO_TPU_HOST`` where unset; then the environment as before, so that processes started later
  do not load libtpu."""
  added = {"TPU_LIBRARY_PATH": path} if environ.get("TPU_LIBRARY_PATH") != path else {}
  if not has_tpu_chips():
    added |= {k: v for k, v in NO_TPU_HOST.items() if k not in environ}
  previous = {k: environ[k] for k in added if k in environ}
  environ.update(added)
  try:
    yield
  finally:
    for key in added:
      environ.pop(key, None)
    environ.update(previous)


def tpu_devices(name: str, num_slices: int = 1) -> list:
  """The devices of slice ``name`` (``tpu_slice``) times ``num_slices``; needs libtpu (``libtpu_path``),
  not a TPU."""
  path = libtpu_path()
  if path is None:
    raise UserError(MISSING_LIBTPU)
  from jax.experimental import topologies

  target = tpu_slice(name)
  with _libtpu_start(path):
    return list(topologies.get_topology_desc(
        topology_name=target.topology, platform="tpu", chip_config_name=target.chip_config,
        chips_per_host_bounds=target.chips_per_host, num_slices=num_slices).devices)
