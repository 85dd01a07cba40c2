"""Restore a run's latest checkpoint onto another mesh, as ``train.py`` would when it resumes there.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/scale/restore_worker.py \
        CONFIG_FILE:PRESET WORKDIR REFERENCE_WORKDIR OUT.json DATAxFSDPxTENSOR [key=value ...]

Builds the run (``lmcore.train.state.build_run``, which resumes from WORKDIR) on the given mesh, and
reads the latest step of WORKDIR and of REFERENCE_WORKDIR as written (the devices must be those that
wrote them). Writes which arrays of the restored run differ from WORKDIR's checkpoint and which of
WORKDIR's checkpoint differ from REFERENCE_WORKDIR's (bitwise), and the PartitionSpec and mesh every
parameter was restored with.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from lmcore import config as cfg_lib  # noqa: E402
from lmcore.train import sharding, state  # noqa: E402


def load_config(spec: str, mesh: str, overrides: list[str]) -> cfg_lib.ExperimentConfig:
  path, preset = spec.split(":")
  module_spec = importlib.util.spec_from_file_location("config_file", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  cd = module.get_config(preset)
  for item in overrides + [f"mesh.{a}={n}" for a, n in zip(("data", "fsdp", "tensor"), mesh.split("x"))]:
    key, value = item.split("=", 1)
    *parents, leaf = key.split(".")
    node = cd
    for parent in parents:
      node = node[parent]
    try:
      node[leaf] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      node[leaf] = value
  return cfg_lib.experiment_config(cd)


def flat(tree) -> dict[str, np.ndarray]:
  return {"/".join(sharding.path_names(p)): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def stored_state(workdir: str) -> tuple[int, dict[str, np.ndarray]]:
  """The latest checkpoint's params and optimizer state as saved (no target shardings)."""
  manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
  step = manager.latest_step()
  stored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  return step, {f"{part}/{name}": value for part in ("params", "opt_state") for name, value in flat(stored[part]).items()}


def differing(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
  return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not np.array_equal(a[k], b[k]))


def main(spec: str, workdir: str, reference: str, out_path: str, mesh: str, *overrides: str) -> None:
  step, stored = stored_state(workdir)
  _, stored_reference = stored_state(reference)
  config = load_config(spec, mesh, list(overrides))
  run = state.build_run(config, workdir)
  restored = {f"{part}/{name}": value for part, tree in (("params", run.params), ("opt_state", run.opt_state))
              for name, value in flat(tree).items()}
  specs = {"/".join(sharding.path_names(p)): [str(x.sharding.spec), dict(x.sharding.mesh.shape)]
           for p, x in jax.tree_util.tree_flatten_with_path(run.params)[0]}
  run.checkpointer.close()
  with open(out_path, "w") as f:
    json.dump({"step": run.step, "stored_step": step, "arrays": len(stored),
               "restored_differs": differing(stored, restored),
               "reference_differs": differing(stored, stored_reference), "param_specs": specs}, f, indent=1)


if __name__ == "__main__":
  main(*sys.argv[1:])
