"""Multi-host start-up: which environments count as a cluster, and a detected cluster that does not come up
stops train.py with one line naming what was detected, before the workdir exists."""

import os
import subprocess
import sys

import pytest

from lmcore.train import sharding

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_PCI = "/nonexistent"


def test_a_single_process_is_no_cluster(tmp_path):
  assert sharding.detect_cluster({}, NO_PCI) is None
  # One SLURM task, one MPI rank, one TPU host: still a single process.
  single = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "OMPI_COMM_WORLD_SIZE": "1", "TPU_WORKER_HOSTNAMES": "h0"}
  assert sharding.detect_cluster(single, NO_PCI) is None
  (tmp_path / "0000:00:04.0").mkdir()
  (tmp_path / "0000:00:04.0" / "vendor").write_text("0x10de\n")  # an NVIDIA GPU is not a TPU
  assert sharding.detect_cluster({}, str(tmp_path)) is None


def test_clusters_are_detected_from_the_environment(tmp_path):
  explicit = sharding.detect_cluster(
      {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, NO_PCI)
  assert explicit.kwargs == {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1,
                             "cluster_detection_method": "deactivate"}
  slurm = sharding.detect_cluster({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "16", "SLURM_PROCID": "3",
                                   "SLURM_STEP_NODELIST": "gpu[01-02]"}, NO_PCI)
  assert "SLURM job step of 16 tasks" in slurm.description and slurm.kwargs == {"cluster_detection_method": "slurm"}
  mpi = sharding.detect_cluster({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"}, NO_PCI)
  assert "Open MPI job of 4 ranks" in mpi.description
  pod = sharding.detect_cluster({"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3", "TPU_WORKER_ID": "2"}, NO_PCI)
  assert "TPU slice of 4 hosts" in pod.description and pod.kwargs == {}
  for chip in ("0000:00:04.0", "0000:00:05.0"):
    (tmp_path / chip).mkdir()
    (tmp_path / chip / "vendor").write_text("0x1ae0\n")
  assert "Cloud TPU VM (2 TPU chips on PCI)" in sharding.detect_cluster({}, str(tmp_path)).description


def test_a_coordinator_without_process_count_is_an_error():
  with pytest.raises(sharding.ClusterError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID must both be"):
    sharding.detect_cluster({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, NO_PCI)


def test_skipping_detection_runs_one_process():
  assert sharding.initialize_distributed({"FSLM_DISTRIBUTED": "off", "JAX_COORDINATOR_ADDRESS": "x:1"}) is None


@pytest.mark.slow
def test_a_detected_cluster_that_fails_stops_train_py_before_the_workdir_exists(tmp_path):
  workdir = tmp_path / "run"
  env = {**os.environ, "JAX_COORDINATOR_ADDRESS": "127.0.0.1:12345", "JAX_NUM_PROCESSES": "2",
         "JAX_PROCESS_ID": "5", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "train.py", "--config=configs/baselines.py:tiny", f"--workdir={workdir}"],
                        cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode != 0
  assert "ClusterError: detected JAX_COORDINATOR_ADDRESS=127.0.0.1:12345 (JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=5)" \
      in proc.stderr, proc.stderr[-3000:]
  assert "jax.distributed.initialize() failed" in proc.stderr and "Traceback" not in proc.stderr
  assert not workdir.exists()
