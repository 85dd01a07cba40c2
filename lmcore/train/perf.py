"""How fast and how big a step is: model FLOPs utilisation (MFU), peak device memory, the persistent
compilation cache and ``jax.profiler`` traces of chosen steps."""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from lmcore.config import parse_profile_steps

# Dense bf16 peak FLOP/s per chip from the vendors' data sheets, matched against ``device_kind`` (first
# match wins, so longer names come first). Devices not listed (CPUs included) have no MFU.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
    ("TPU v6 lite", 918e12),  # v6e
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),  # v5p reports "TPU v5"
    ("TPU v4", 275e12),
)
COMPILATION_CACHE_SUBDIR = "jax_compilation_cache"


def peak_flops(device: jax.Device | None = None) -> float | None:
  """Dense bf16 FLOP/s of one ``device`` (default: the first), or None when not in the table."""
  device = device or jax.devices()[0]
  if device.platform == "cpu":
    return None
  kind = getattr(device, "device_kind", "")
  return next((flops for name, flops in PEAK_BF16_FLOPS if name.lower() in kind.lower()), None)


def mfu(tokens_per_s: float, flops_per_token: float | None, devices: int | None = None) -> float | None:
  """Model FLOPs per second over the peak of every device (a fraction), None when either is unknown."""
  peak = peak_flops()
  if not peak or not flops_per_token:
    return None
  return tokens_per_s * flops_per_token / (peak * (devices or jax.device_count()))


def peak_memory_bytes() -> int | None:
  """The most memory any local device has held since the process started (``memory_stats``), None where
  the backend does not report it (CPU)."""
  peaks = []
  for device in jax.local_devices():
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None


def enable_compilation_cache(cache_root: str) -> str:
  """Compiled executables are stored in and read from ``<cache_root>/jax_compilation_cache``, so that a
  restarted run of the same model skips compilation. A directory set already (``JAX_COMPILATION_CACHE_DIR``)
  is kept. Returns the directory in use."""
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  directory = os.path.join(os.path.expanduser(cache_root), COMPILATION_CACHE_SUBDIR)
  os.makedirs(directory, exist_ok=True)
  compilation_cache.set_cache_dir(directory)
  compilation_cache.reset_cache()  # the cache opens its directory once; open the new one
  return directory


class ProfileWindow:
  """A ``jax.profiler`` trace of steps FIRST..LAST (``train.profile_steps``, 1-based) in ``directory``,
  from after ``first_step`` (which compiles) at the earliest. Call ``before(step)`` before dispatching
  a step and ``after(step, outputs)`` after; the trace ends once step LAST's outputs are ready."""

  def __init__(self, spec: str, directory: str, first_step: int):
    window = parse_profile_steps(spec)
    self.directory = directory
    self.start, self.stop = (None, None) if window is None else (max(window[0], first_step + 1), window[1])
    self.active = False

  @property
  def empty(self) -> bool:
    return self.start is None or self.start > self.stop

  def before(self, step: int) -> None:
    if not self.empty and step == self.start:
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after(self, step: int, outputs) -> str | None:
    """Stops the trace after step LAST; returns a line saying what was traced (else None)."""
    if self.active and step >= self.stop:
      jax.block_until_ready(outputs)
      self.close()
      return f"profile: steps {self.start}..{step} traced into {self.directory}"
    return None

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
