"""The same training steps on several device meshes, in one process with 8 fake CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/scale/mesh_worker.py OUT.json

One fp32 model holds a layer of every mixer family (SANATAN, GLA and Taylor attention through their
Pallas kernels, interpreted on CPU). From the same initial parameters it takes ``STEPS`` optimizer steps of 2 micro-batches on one
device and on each mesh of ``MESHES``. Writes, per mesh, the largest relative difference from the
one-device run of the losses and the gradient norms, that of the final parameters as a whole (relative
L2 and max |Δ| / max |p|; a zero-initialised bias taken alone can differ by 2e-5 of itself after Adam's
first, sign-like steps), and the all-gathers in the compiled step whose result has a sequence-length dimension
(activations; parameter all-gathers of FSDP are expected). Also: a Pallas kernel on a batch the mesh
does not divide (one sequence on 8 devices) gives the one-device result, and the end-of-run gate
statistics (SANATAN's layer, MATH §1.3: one compiled program with the parameters in their shardings)
on the (data 2, fsdp 4) mesh give the one-device statistics.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import common  # noqa: E402
from lmcore import config as cfg_lib  # noqa: E402
from lmcore.eval import evaluate  # noqa: E402
from lmcore.train import loop, sharding, state  # noqa: E402
from lmcore.train.optim import make_optimizer  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)  # halves the compile time; same math

MESHES = [tuple(map(int, m.split("x"))) for m in os.environ.get("MESHES", "8x1x1,2x4x1,2x2x2").split(",")]
# Step 1 runs at learning rate 0 (warmup from 0) and fills Adam's moments; step 2 moves the parameters.
# More steps would compare Adam's early, sign-like updates of gradients that are rounding noise.
STEPS = 2
SEQ_LEN = 24  # no parameter has a dimension of 24 or 25: an all-gather with one gathers activations
HEADS = dict(n_heads=2, head_dim=8)
FUSED_TILES = {walk: {"chunk": 8} for walk in ("forward", "dq", "dkv")}  # SANATAN's walks: 3 chunks
MIXERS = {
    "softmax": dict(n_heads=2),
    "sanatan": dict(HEADS, p=1, implementation="pallas_fused", tiles=FUSED_TILES),
    "taylor": dict(n_heads=2, feature_dim=4, implementation="pallas_fused", tiles={"chunk": 8}),
    "swa": dict(n_heads=2, window=4, block_size=8),
    "base_conv": {},
    "gla": dict(n_heads=2, implementation="pallas_triton", tiles={"chunk": 8}),
    "gdn": dict(HEADS, tiles={"chunk": 8}),
    "cyfa": dict(HEADS, v_head_dim=8, tiles={"chunk": 8}),
    "linear_transformer": dict(HEADS, tiles={"chunk": 8}),
    "performer": dict(HEADS, n_features=8, tiles={"chunk": 8}),
    "cosformer": dict(HEADS, tiles={"chunk": 8}, max_len=SEQ_LEN),
}


def experiment(mesh: tuple[int, int, int], mixers=None) -> cfg_lib.ExperimentConfig:
  mixers = MIXERS if mixers is None else mixers
  cd = common.experiment(
      model=dict(vocab_size=256, d_model=32, n_layers=len(mixers), pattern=",".join(f"{k}*1" for k in mixers),
                 mlp_hidden=64, dtype="float32"),
      mixers=mixers, train=dict(batch_size=16, grad_accum=2, steps=STEPS, warmup_steps=1, learning_rate=1e-3),
      data=dict(seq_len=SEQ_LEN), mesh=dict(zip(("data", "fsdp", "tensor"), mesh)))
  return cfg_lib.experiment_config(cd)


def batches(config: cfg_lib.ExperimentConfig) -> list[dict[str, np.ndarray]]:
  rng = np.random.default_rng(0)
  shape = (config.train.batch_size, config.data.seq_len + 1)
  return [{"tokens": rng.integers(0, config.model.vocab_size, shape, dtype=np.int32)} for _ in range(STEPS)]


def activation_all_gathers(hlo: str, seq_len: int) -> list[dict]:
  """Floating-point all-gathers in the HLO text whose result has a dimension of ``seq_len`` (or
  ``seq_len + 1``): activations. Returns their dtype, shape and gathered dimension."""
  gathers = []
  for line in hlo.splitlines():
    match = re.search(r"=\s*(\w+)\[([\d,]*)\]\S*\s+all-gather(?:-start)?\(.*dimensions=\{(\d+)\}", line)
    if not match or not match.group(1).startswith(("f", "bf")):
      continue
    dims = [int(d) for d in match.group(2).split(",") if d]
    if seq_len in dims or seq_len + 1 in dims:
      gathers.append({"dtype": match.group(1), "shape": dims, "dimension": int(match.group(3))})
  return gathers


def train(config: cfg_lib.ExperimentConfig, devices, initial=None) -> dict:
  """``STEPS`` train steps on the config's mesh over ``devices``, from ``initial`` (numpy params, rest)
  or a fresh initialisation."""
  mesh = sharding.make_mesh(config.mesh, devices)
  tx = make_optimizer(config.train)
  graphdef, _, _, shardings = state.make_shardings(config, mesh, tx)
  if initial is None:
    params, rest = state.init_params(config, shardings)
    initial = jax.tree.map(np.asarray, (params, rest))
  params, rest = jax.device_put(initial, (shardings.params, shardings.rest))
  opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
  step_fn = loop.make_train_step(graphdef, tx, config, shardings)
  losses, grad_norms, hlo = [], [], ""
  with jax.set_mesh(mesh):
    for i, batch in enumerate(batches(config)):
      batch = sharding.global_batch(batch, mesh)
      if i == 0:  # one compilation: its HLO is read, and it runs every step
        compiled = step_fn.lower(params, opt_state, rest, batch, 0).compile()
        hlo = compiled.as_text()
      params, opt_state, metrics = compiled(params, opt_state, rest, batch, i)
      losses.append(float(metrics["loss"]))
      grad_norms.append(float(metrics["grad_norm"]))
  flat = {"/".join(sharding.path_names(p)): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  return {"losses": losses, "grad_norms": grad_norms, "params": flat, "initial": initial,
          "activation_all_gathers": activation_all_gathers(hlo, config.data.seq_len)}


def indivisible_batch_difference(mesh_shape: tuple[int, int, int]) -> float:
  """Max |Δ| of SANATAN's Pallas kernel on 1 sequence under the mesh vs without a mesh."""
  from sanatan_jax.ops.sanatan_attention import REGISTRY, sanatan_attention

  rng = np.random.default_rng(1)
  q, k, v = (rng.standard_normal((1, SEQ_LEN, 2, 8), np.float32) * 0.3 for _ in range(3))
  omega, lam_raw = (rng.standard_normal((2, 8), np.float32) for _ in range(2))
  tiles = REGISTRY.tiles("pallas_fused", FUSED_TILES, "mesh_worker")
  kernel = lambda *a: sanatan_attention(*a, implementation="pallas_fused", tiles=tiles)[0]
  expected = jax.jit(kernel)(q, k, v, omega, lam_raw)
  mesh = sharding.make_mesh(cfg_lib.MeshConfig(*mesh_shape), jax.devices())
  with jax.set_mesh(mesh):
    got = jax.jit(lambda *a: kernel(*a))(q, k, v, omega, lam_raw)
  return float(np.max(np.abs(np.asarray(got) - np.asarray(expected))))


def gate_statistics_on_meshes(devices_of_mesh: dict) -> dict[str, list[dict]]:
  """``evaluate.gate_statistics`` (layer 1, SANATAN's) of one softmax + SANATAN model's fresh
  parameters on each mesh of ``devices_of_mesh`` (mesh shape -> devices), in the parameters' shardings."""
  mixers = {kind: MIXERS[kind] for kind in ("softmax", "sanatan")}
  initial = None
  results = {}
  for mesh_shape, devices in devices_of_mesh.items():
    config = experiment(mesh_shape, mixers)
    mesh = sharding.make_mesh(config.mesh, devices)
    graphdef, _, _, shardings = state.make_shardings(config, mesh, make_optimizer(config.train))
    if initial is None:
      initial = jax.tree.map(np.asarray, state.init_params(config, shardings))
    params, rest = jax.device_put(initial, (shardings.params, shardings.rest))
    rows = (config.eval.gate_stats_sequences, config.data.seq_len + 1)
    heldout = {"tokens": np.random.default_rng(2).integers(0, config.model.vocab_size, rows, dtype=np.int32)}
    with jax.set_mesh(mesh):
      name = "x".join(map(str, mesh_shape))
      results[name] = evaluate.gate_statistics(config, graphdef, params, rest, heldout)
  return results


def rel(a, b) -> float:
  return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main(out_path: str) -> None:
  start = time.process_time()
  reference = train(experiment((1, 1, 1)), jax.devices()[:1])
  results = {"reference_losses": reference["losses"], "meshes": {}}
  for mesh_shape in MESHES:
    run = train(experiment(mesh_shape), jax.devices(), reference["initial"])
    ref = reference["params"]
    diffs = {k: run["params"][k] - v for k, v in ref.items()}
    leaf_rel = {k: float(np.max(np.abs(d)) / np.max(np.abs(ref[k]))) for k, d in diffs.items()}
    worst = max(leaf_rel, key=leaf_rel.get)
    results["meshes"]["x".join(map(str, mesh_shape))] = {
        "losses": run["losses"], "loss_rel": rel(run["losses"], reference["losses"]),
        "grad_norm_rel": rel(run["grad_norms"], reference["grad_norms"]),
        # The whole parameter tree: ‖Δ‖ / ‖p‖, and max |Δ| / max |p| over every entry.
        "param_rel_l2": float(np.sqrt(sum(np.sum(d ** 2) for d in diffs.values())
                                      / sum(np.sum(v ** 2) for v in ref.values()))),
        "param_rel_max": float(max(np.max(np.abs(d)) for d in diffs.values())
                               / max(np.max(np.abs(v)) for v in ref.values())),
        "worst_leaf": worst, "worst_leaf_rel": leaf_rel[worst],
        "activation_all_gathers": run["activation_all_gathers"]}
  results["indivisible_batch_max_abs_diff"] = indivisible_batch_difference((2, 2, 2))
  results["gate_stats"] = gate_statistics_on_meshes({(1, 1, 1): jax.devices()[:1], (2, 4, 1): jax.devices()})
  results["cpu_seconds"] = time.process_time() - start
  with open(out_path, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
