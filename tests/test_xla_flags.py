"""The entry points' environment defaults: XLA flags added once, never over a user's own setting; on a
host without accelerators JAX starts on the CPU alone. A plain ``import jax`` in the project's
environment logs nothing (libtpu stays outside it), and neither does loading libtpu to compile for a
TPU."""

import os
import subprocess
import sys

import pytest

from lmcore import tpu_slices, xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_are_added_once_and_a_users_flag_wins():
  env = {"JAX_PLATFORMS": ""}
  xla_flags.apply_defaults(env)
  assert env["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false"
  xla_flags.apply_defaults(env)  # idempotent
  assert env["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false"
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=true"}
  xla_flags.apply_defaults(env)
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=true"


def _host(tmp_path, *files: str, vendor: str = "0x8086"):
  """A fake root with the given device files and one PCI device of ``vendor``."""
  for name in files:
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).touch()
  pci = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
  pci.mkdir(parents=True, exist_ok=True)
  (pci / "vendor").write_text(vendor + "\n")
  return str(tmp_path)


@pytest.mark.parametrize("files, vendor, platforms", [
    ((), "0x8086", "cpu"),  # no accelerator: the CPU alone
    (("dev/nvidia0",), "0x8086", None),  # a GPU: JAX picks
    (("dev/kfd",), "0x8086", None),
    (("dev/accel0",), "0x8086", None),  # TPU chips
    (("dev/vfio/0",), "0x8086", None),
    ((), "0x1ae0", None),  # a Google PCI device may be a TPU
])
def test_jax_platforms_is_cpu_only_on_a_host_without_accelerators(tmp_path, files, vendor, platforms):
  env = {}
  xla_flags.apply_defaults(env, root=_host(tmp_path, *files, vendor=vendor))
  assert env.get("JAX_PLATFORMS") == platforms
  env = {"JAX_PLATFORMS": "cuda"}  # a user's choice is kept
  xla_flags.apply_defaults(env, root=_host(tmp_path, vendor="0x8086"))
  assert env["JAX_PLATFORMS"] == "cuda"


def test_the_entry_points_runner_sets_them_before_main():
  """``cli.run`` (train.py, eval.py, ...) sets them before main, where JAX starts (a CPU backend
  accepts the GPU flag)."""
  code = ("import os, jax; from lmcore import cli;"
          "cli.run(lambda argv: print('FLAGS=' + os.environ['XLA_FLAGS'], jax.numpy.ones(2).sum()))")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                        env={**os.environ, "XLA_FLAGS": ""})
  assert "FLAGS=--xla_gpu_enable_triton_gemm=false 2.0" in proc.stdout, proc.stderr[-2000:]


def _lone_process(code: str) -> subprocess.CompletedProcess:
  """``code`` in a fresh interpreter, JAX choosing its own backends. libtpu takes a machine-wide lock
  when it loads and says nothing while another process holds it: without the lock the process prints
  what a lone one does."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                        env={**env, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})


@pytest.mark.skipif(xla_flags.has_accelerator(), reason="a host without accelerators")
def test_a_plain_import_of_jax_prints_nothing_on_a_host_without_accelerators():
  proc = _lone_process("import jax; print(jax.devices())")
  assert proc.returncode == 0 and "CpuDevice" in proc.stdout, proc.stderr[-2000:]
  assert proc.stderr == "", ("libtpu is importable here, so JAX starts a TPU backend from it: install it "
                             "with `make aot` instead of the tpu extra.\n" + proc.stderr[-2000:])


@pytest.mark.skipif(tpu_slices.has_tpu_chips(), reason="a host without TPU chips")
def test_loading_libtpu_to_compile_for_a_tpu_prints_nothing_and_leaves_the_environment():
  if tpu_slices.libtpu_path() is None:
    pytest.skip(tpu_slices.MISSING_LIBTPU)
  # Processes started afterwards do not find libtpu through the environment either.
  proc = _lone_process("import os, jax; from lmcore import tpu_slices; print(len(tpu_slices.tpu_devices('v4-8')), "
                       "jax.devices(), [k for k in ('TPU_LIBRARY_PATH', *tpu_slices.NO_TPU_HOST) if k in os.environ])")
  assert proc.returncode == 0 and "4 [CpuDevice(id=0)] []" in proc.stdout, proc.stdout + proc.stderr[-2000:]
  assert proc.stderr == "", proc.stderr[-2000:]
