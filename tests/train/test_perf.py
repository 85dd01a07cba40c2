"""MFU and peak memory in the progress line, the persistent compilation cache and ``train.profile_steps``."""

import dataclasses
import os
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from lmcore import config as cfg_lib
from lmcore.train import loop, metrics, perf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_progress_line_shows_mfu_and_peak_memory_where_known():
  interval = metrics.Interval(tokens_per_s=183_000.0, step_s=0.358, wall_per_step_s=0.4, goodput=0.9)
  line = metrics.progress_line(10, 100, 2.5, interval, mfu=0.2041, peak_bytes=85 * 2 ** 30)
  assert line == ("step 10/100 | loss 2.5000 | 183,000 tok/s | 358.0 ms/step | MFU 20.4% | peak 85.0 GiB | "
                  "goodput 90% | ETA 0:00:36")
  bare = metrics.progress_line(10, 100, 2.5, interval)
  assert "MFU" not in bare and "peak" not in bare


def test_peak_flops_come_from_the_device_table(monkeypatch):
  device = lambda kind, platform="gpu": types.SimpleNamespace(platform=platform, device_kind=kind)
  assert perf.peak_flops(device("NVIDIA H200")) == 989e12
  assert perf.peak_flops(device("NVIDIA H100 PCIe")) == 756e12
  assert perf.peak_flops(device("NVIDIA A100-SXM4-80GB")) == 312e12
  assert perf.peak_flops(device("TPU v5 lite", "tpu")) == 197e12
  assert perf.peak_flops(device("TPU v4", "tpu")) == 275e12
  assert perf.peak_flops(device("cpu", "cpu")) is None and perf.peak_flops(device("Unknown GPU")) is None
  monkeypatch.setattr(perf, "peak_flops", lambda device=None: 989e12)
  # A softmax row: 183K tok/s at 6 × 184M FLOPs per token on one H200 is 20.4% MFU.
  assert perf.mfu(183e3, 6 * 184e6, devices=1) == pytest.approx(0.2043, abs=1e-4)
  assert perf.mfu(183e3, None) is None


def test_bad_train_fields_fail_with_one_line_naming_the_field():
  def build(**train):
    return cfg_lib.experiment_config({"train": train})

  for spec in ("x", "3,2", "0,2", "1,2,3"):
    with pytest.raises(cfg_lib.ConfigError, match=r"train.profile_steps=.*give 'FIRST,LAST'"):
      build(profile_steps=spec)
  with pytest.raises(cfg_lib.ConfigError, match="train.loss_impl='fast'; valid: 'auto', 'fused', 'materialized'"):
    build(loss_impl="fast")
  assert cfg_lib.parse_profile_steps("10,12") == (10, 12) and cfg_lib.parse_profile_steps(" 7 ") == (7, 7)
  assert cfg_lib.parse_profile_steps("") is None


def test_profile_window_never_traces_the_compile_step(tmp_path):
  assert perf.ProfileWindow("1,3", "", first_step=1).start == 2
  assert perf.ProfileWindow("5,5", "", first_step=5).empty  # only the compile step asked for
  assert perf.ProfileWindow("", "", first_step=1).empty
  window = perf.ProfileWindow("2,3", str(tmp_path / "profile"), first_step=1)
  fn = jax.jit(lambda x: x @ x)
  lines = []
  for step in range(1, 5):
    window.before(step)
    assert window.active == (step in (2, 3))
    lines.append(window.after(step, fn(jnp.ones((8, 8)))))
  assert lines == [None, None, f"profile: steps 2..3 traced into {tmp_path / 'profile'}", None]
  traces = [f for _, _, files in os.walk(tmp_path / "profile") for f in files if f.endswith(".xplane.pb")]
  assert len(traces) == 1


def test_compilation_cache_switch_off_leaves_jax_alone(monkeypatch):
  monkeypatch.setattr(perf, "enable_compilation_cache", lambda root: pytest.fail("cache enabled"))
  config = cfg_lib.experiment_config({"train": {"compilation_cache": False}})
  assert loop.setup_compilation_cache(config) is None
  assert dataclasses.replace(config.train, compilation_cache=True).compilation_cache


@pytest.mark.slow
def test_training_fills_the_compilation_cache_and_traces_the_chosen_steps(tmp_path):
  """train.py with the defaults: compiled executables land in <cache dir>/jax_compilation_cache; steps
  2..3 of profile_steps=1,3 are traced into <workdir>/profile (step 1 compiles)."""
  from lmcore.data import embedded
  from tests.process_cases import fast_compile_env
  from tests.test_train import SMALL

  cache = tmp_path / "cache"
  tokenizer = embedded.tokenizer_model_path(8192)  # trained once into the default cache
  (cache / "embedded").mkdir(parents=True)
  shutil.copy(tokenizer, cache / "embedded" / tokenizer.name)
  workdir = tmp_path / "run"
  cmd = [sys.executable, os.path.join(REPO, "train.py"), f"--config={REPO}/configs/baselines.py:tiny",
         f"--workdir={workdir}", *SMALL, "--config.train.steps=4", "--config.train.checkpoint_every=4",
         "--config.train.profile_steps=1,3", f"--config.data.cache_dir={cache}", "--config.eval.paired=False"]
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  # Fast compilation (what is compiled, and where it is cached, are the same).
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                        env={**env, **fast_compile_env(), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"profile: steps 2..3 traced into {workdir / 'profile'}" in proc.stdout
  assert any(f.endswith(".xplane.pb") for _, _, files in os.walk(workdir / "profile") for f in files)
  compiled = os.listdir(cache / perf.COMPILATION_CACHE_SUBDIR)
  assert any(name.startswith("jit_train_step") for name in compiled), compiled
