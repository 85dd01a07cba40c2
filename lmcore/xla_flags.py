"""What the entry points set in the environment by default, before JAX starts its backends.

``DEFAULTS`` (``XLA_FLAGS``): ``--xla_gpu_enable_triton_gemm=false`` runs XLA's matrix multiplications
on cuBLAS instead of its Triton GEMM emitter, which is slower on the tied output layer of a large
vocabulary (docs/BENCHMARKS.md, XLA's GEMMs on cuBLAS). The flag only concerns GPUs; other backends
ignore it. A flag already named in ``XLA_FLAGS`` is left as the user set it.

``JAX_PLATFORMS=cpu`` on a host with no accelerator: JAX tries no GPU or TPU backend there, whatever
is installed (an importable libtpu, the ``tpu`` extra, would otherwise start one and log errors). A
``JAX_PLATFORMS`` already set (even empty) is left as it is.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import MutableMapping

DEFAULTS = ("--xla_gpu_enable_triton_gemm=false",)
# Device files of accelerators JAX has backends for: NVIDIA and AMD GPUs, TPU chips (/dev/accel* on
# TPU VMs up to v4, /dev/vfio/* from v5e on).
ACCELERATOR_DEVICES = ("/dev/nvidia*", "/dev/kfd", "/dev/accel*", "/dev/vfio/[0-9]*")
# PCI vendor of Google's devices: TPU chips (and gVNIC network cards, for which JAX's choice is kept too).
GOOGLE_PCI_VENDOR = "0x1ae0"


def _name(flag: str) -> str:
  return flag.split("=", 1)[0].lstrip("-")


def with_defaults(xla_flags: str, defaults: tuple[str, ...] = DEFAULTS) -> str:
  """``xla_flags`` (the XLA_FLAGS string) plus every default whose flag it does not name."""
  named = {_name(flag) for flag in xla_flags.split()}
  return " ".join([*xla_flags.split(), *(flag for flag in defaults if _name(flag) not in named)])


def has_accelerator(root: str = "/") -> bool:
  """Whether this host has a GPU or TPU device (or a Google PCI device, which may be a TPU)."""
  if any(glob.glob(os.path.join(root, pattern.lstrip("/"))) for pattern in ACCELERATOR_DEVICES):
    return True
  for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
    with open(vendor) as f:
      if f.read().strip() == GOOGLE_PCI_VENDOR:
        return True
  return False


def apply_defaults(environ: MutableMapping[str, str] = os.environ, root: str = "/") -> None:
  """Sets ``XLA_FLAGS`` in ``environ`` to ``with_defaults`` of its value, and ``JAX_PLATFORMS=cpu`` when
  it is unset and the host (``root``) has no accelerator (in JAX's config too when JAX is imported
  already). Call it before the first JAX computation: the backends read both when they start."""
  environ["XLA_FLAGS"] = with_defaults(environ.get("XLA_FLAGS", ""))
  if "JAX_PLATFORMS" not in environ and not has_accelerator(root):
    environ["JAX_PLATFORMS"] = "cpu"
    if environ is os.environ and "jax" in sys.modules:  # JAX read the variable when it was imported
      sys.modules["jax"].config.update("jax_platforms", "cpu")
