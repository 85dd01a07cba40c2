"""The device mesh: sizes from the config, parameter shardings from the rules, and training on 8 fake CPU
devices that matches one device, resumes bitwise and restores onto another mesh."""

import json
import os
import signal
import subprocess
import sys

import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from lmcore import config as cfg_lib
from lmcore.errors import ConfigError
from lmcore.train import sharding
from process_cases import compilation_cache_env, fast_compile_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


def test_mesh_sizes_resolve_minus_one_and_must_multiply_to_the_device_count():
  assert sharding.mesh_shape(cfg_lib.MeshConfig(), 8) == (8, 1, 1)
  assert sharding.mesh_shape(cfg_lib.MeshConfig(data=2, fsdp=-1), 8) == (2, 4, 1)
  assert sharding.mesh_shape(cfg_lib.MeshConfig(data=2, fsdp=2, tensor=2), 8) == (2, 2, 2)
  with pytest.raises(ConfigError, match=r"mesh.data=2 × mesh.fsdp=2 × mesh.tensor=1 = 4 devices, but there are 8"):
    sharding.mesh_shape(cfg_lib.MeshConfig(data=2, fsdp=2), 8)
  with pytest.raises(ConfigError, match=r"mesh.fsdp=3 .* does not divide the 8 devices, so mesh.data=-1"):
    sharding.mesh_shape(cfg_lib.MeshConfig(fsdp=3), 8)
  with pytest.raises(ConfigError, match=r"mesh.data and mesh.fsdp are all -1"):
    cfg_lib.validate_mesh(cfg_lib.MeshConfig(data=-1, fsdp=-1))
  with pytest.raises(ConfigError, match=r"mesh.tensor=0"):
    cfg_lib.experiment_config({"mesh": {"tensor": 0}})


def test_rules_shard_weights_on_d_model_and_replicate_what_does_not_divide():
  mesh = AbstractMesh((1, 4, 2), sharding.MESH_AXES)
  d = 768

  def spec(path, shape):
    return sharding.spec_for(sharding.logical_axes(path.split("/"), shape, d), shape, mesh)

  assert spec("embed/embedding", (126_349, d)) == P(None, "fsdp")  # the vocabulary is never split
  assert spec("head/kernel", (d, 50_264)) == P("fsdp")
  assert spec("blocks/0/mixer/wq/kernel", (d, 384)) == P("fsdp", "tensor")
  assert spec("blocks/0/mixer/wo/kernel", (384, d)) == P("tensor", "fsdp")
  assert spec("blocks/0/mlp/w_down/kernel", (2048, d)) == P("tensor", "fsdp")
  assert spec("blocks/0/mlp/w_gate/kernel", (d, 2048)) == P("fsdp", "tensor")
  assert spec("blocks/0/mixer/gate_up/kernel", (16, 384)) == P()  # touches no d_model: replicated
  assert spec("blocks/0/mixer/omega", (12, 64)) == P()
  assert spec("blocks/0/mixer_norm/scale", (d,)) == P()
  assert sharding.spec_for(("embed", "heads"), (d, 384), mesh, skip=("fsdp",)) == P(None, "tensor")


def _run(cmd, env=None, check=True):
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})},
                        timeout=900)
  if check and proc.returncode != 0:
    raise AssertionError(f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-5000:]}")
  return proc


@pytest.mark.slow
def test_every_mixer_family_trains_the_same_on_three_meshes_as_on_one_device(tmp_path):
  """fp32, 2 steps of 2 micro-batches (three Pallas kernels interpreted): losses, gradient norms and
  the final parameters (as a whole: relative L2, and max |Δ| / max |p|) within 1e-5. No floating-point all-gather of an activation (an array with the
  sequence dimension) along the batch; without a tensor axis, none at all."""
  out = tmp_path / "meshes.json"
  _run([sys.executable, "tests/scale/mesh_worker.py", str(out)], env=EIGHT_DEVICES)
  results = json.loads(out.read_text())
  assert set(results["meshes"]) == {"8x1x1", "2x4x1", "2x2x2"}
  for name, mesh in results["meshes"].items():
    assert mesh["loss_rel"] <= 1e-5, (name, mesh["losses"], results["reference_losses"])
    assert mesh["grad_norm_rel"] <= 1e-5, (name, mesh)
    assert mesh["param_rel_l2"] <= 1e-5 and mesh["param_rel_max"] <= 1e-5, (name, mesh)
    gathers = mesh["activation_all_gathers"]
    if name.endswith("x1"):
      assert not gathers, (name, gathers)
    else:  # tensor parallelism gathers features within the tensor group, never the batch
      assert all(g["dimension"] != 0 for g in gathers), (name, gathers)
  assert results["indivisible_batch_max_abs_diff"] <= 1e-6
  # The gate statistics under jit on (data 2, fsdp 4): SANATAN's layer only, the one-device numbers
  # (fp32 sums of the same roots; the counts exact).
  one, mesh = results["gate_stats"]["1x1x1"], results["gate_stats"]["2x4x1"]
  assert [r["layer"] for r in one] == [r["layer"] for r in mesh] == [1]
  assert 0 < one[0]["mismatch_fraction"] < 1 and 0 < one[0]["mismatch_gate_mean"] < 1
  assert mesh[0]["num_pairs"] == one[0]["num_pairs"] and mesh[0]["num_mismatched"] == one[0]["num_mismatched"]
  for key in ("frac_saturated_q", "frac_saturated_k", "mismatch_fraction", "mismatch_gate_mean"):
    assert mesh[0][key] == pytest.approx(one[0][key], rel=1e-5), key


TRAIN = ["--config.model.d_model=32", "--config.model.n_layers=2", "--config.model.pattern=sanatan*2",
         "--config.model.mlp_hidden=64", "--config.model.mixers.sanatan.n_heads=2",
         "--config.data.seq_len=32", "--config.train.batch_size=16", "--config.train.grad_accum=2",
         "--config.train.steps=4", "--config.train.checkpoint_every=2", "--config.train.warmup_steps=1",
         "--config.train.log_every=1", "--config.data.heldout.num_sequences=8", "--config.eval.batch_size=8",
         "--config.eval.paired=False", "--config.eval.gate_stats=True", "--config.wandb.mode=disabled",
         "--config.mesh.data=2", "--config.mesh.fsdp=4"]


def _train_cmd(workdir, script="train.py"):
  return [sys.executable, os.path.join(REPO, script), "--config=configs/sanatan.py:tiny", f"--workdir={workdir}",
          *TRAIN]


def _losses(workdir):
  rows = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    if "loss" in row:
      rows[row["step"]] = row["loss"]
  return rows


@pytest.mark.slow
def test_train_py_on_a_data_fsdp_mesh_resumes_bitwise_and_restores_onto_another_mesh(tmp_path):
  """train.py on (data 2, fsdp 4): 4 steps straight == 2 steps, SIGKILL, resume for 2 (same losses,
  bitwise-equal checkpoints), evaluated with the gate statistics on that mesh; the final checkpoint then
  restores onto (4, 2, 1) with every parameter and
  optimizer array bitwise equal, each sharded for that mesh. The processes share a persistent
  compilation cache of their own (every program, however quick to compile): the later ones load the
  programs the first compiled, as train.py's compilation cache does when a run restarts. They compile
  without most of XLA's optimisations, as mesh_worker.py does."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  env = {**EIGHT_DEVICES, **compilation_cache_env(tmp_path / "jax_cache"), **fast_compile_env()}
  _run(_train_cmd(straight), env=env)
  killed = _run(_train_cmd(resumed, "tests/fault_train.py"), env={**env, "KILL_AFTER_STEP": "2"}, check=False)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  second = _run(_train_cmd(resumed), env=env)
  assert "Resumed from step 2" in second.stdout
  assert _losses(straight) == _losses(resumed) and len(_losses(straight)) == 4
  # The end-of-run gate statistics, one compiled program on the (data 2, fsdp 4) mesh: one record a layer.
  gate_layers = [json.loads(line) for line in (straight / "gate_stats_4.jsonl").read_text().splitlines()]
  assert [g["layer"] for g in gate_layers] == [0, 1]
  assert all(0 < g["mismatch_fraction"] < 1 for g in gate_layers)

  out = tmp_path / "restore.json"
  overrides = [a.removeprefix("--config.") for a in TRAIN if not a.startswith("--config.mesh")]
  _run([sys.executable, "tests/scale/restore_worker.py", "configs/sanatan.py:tiny", str(resumed), str(straight),
        str(out), "4x2x1", *overrides], env=env)
  restored = json.loads(out.read_text())
  assert restored["step"] == restored["stored_step"] == 4 and restored["arrays"] > 20
  assert restored["reference_differs"] == []  # resumed == straight, bitwise
  assert restored["restored_differs"] == []  # restored on (4, 2, 1) == as written on (2, 4, 1)
  spec, mesh = restored["param_specs"]["blocks/0/mixer/wq/kernel"]
  assert mesh == {"data": 4, "fsdp": 2, "tensor": 1} and spec == str(P("fsdp"))
