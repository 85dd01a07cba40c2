"""Where every array of a run lives: the mesh, parameter/optimizer/batch shardings, multi-host start-up.

Mesh axes (``MeshConfig``, docs/SCALING.md): ``data`` splits the batch; ``fsdp`` splits the batch and
shards parameters and optimizer state (XLA gathers a matrix where it is used); ``tensor`` splits heads
and MLP columns. A parameter's dimensions get logical names from its path and shape (``logical_axes``),
and ``RULES`` maps them to mesh axes; a dimension its axes do not divide stays whole, so every model
runs on every mesh. ``initialize_distributed()`` runs before anything touches a device; each process
feeds its own rows, which ``global_batch`` assembles.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lmcore.config import MeshConfig
from lmcore.errors import ConfigError, UserError
from lmcore.ops.common.shard_map import BATCH_AXES, HEAD_AXIS

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or axes, or None: never split). The one table for every model.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "embed": "fsdp",  # d_model, the dimension every large matrix has: FSDP shards it
    "vocab": None,  # split, a lookup would gather activations over the batch; FSDP splits d_model
    "heads": HEAD_AXIS,  # a mixer's projected width (heads × head dim)
    "mlp": "tensor",
    "positions": None,
}


def mesh_shape(config: MeshConfig, device_count: int) -> tuple[int, int, int]:
  """(data, fsdp, tensor) with the -1 resolved; ``ConfigError`` when the product is not the device count."""
  names = [f"mesh.{axis}" for axis in MESH_AXES]
  sizes = [config.data, config.fsdp, config.tensor]
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    auto = sizes.index(-1)
    if device_count % fixed:
      given = " × ".join(f"{n}={s}" for n, s in zip(names, sizes) if s != -1)
      raise ConfigError(f"{given} = {fixed} does not divide the {device_count} devices, so {names[auto]}=-1 "
                        f"has no size; make the product of the others divide {device_count}.")
    sizes[auto] = device_count // fixed
  if math.prod(sizes) != device_count:
    given = " × ".join(f"{n}={s}" for n, s in zip(names, sizes))
    raise ConfigError(f"{given} = {math.prod(sizes)} devices, but there are {device_count}; make the "
                      f"product {device_count} (or set one of them to -1).")
  return sizes[0], sizes[1], sizes[2]


def make_mesh(config: MeshConfig = MeshConfig(), devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The ("data", "fsdp", "tensor") mesh over ``devices`` (default: every device of every process)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(config, len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def batch_shards(mesh: Mesh) -> int:
  """How many ways the batch is split: data × fsdp."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch(mesh: Mesh, batch_size: int, grad_accum: int) -> None:
  """Every micro-batch must split evenly over data × fsdp (``ConfigError`` naming the fields)."""
  micro, shards = batch_size // grad_accum, batch_shards(mesh)
  if micro % shards:
    raise ConfigError(
        f"train.batch_size={batch_size} / train.grad_accum={grad_accum} = {micro} sequences per micro-batch "
        f"do not split over mesh.data × mesh.fsdp = {mesh.shape['data']} × {mesh.shape['fsdp']} = {shards} "
        f"devices; make the micro-batch a multiple of {shards} (lower train.grad_accum or change the mesh).")


def path_names(path) -> tuple[str, ...]:
  """A ``tree_flatten_with_path`` key path as strings, e.g. ("blocks", "3", "mixer", "wq", "kernel")."""
  return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def logical_axes(names: Sequence[str], shape: Sequence[int], d_model: int) -> tuple[str | None, ...]:
  """Logical names of a parameter's dimensions: embeddings [vocab | positions, embed], an untied head
  [embed, vocab], the MLP [embed, mlp] / [mlp, embed], any other 2-D Linear kernel [embed, heads] or
  [heads, embed] by which side is d_model (every mixer's projections); anything else is replicated."""
  none = (None,) * len(shape)
  if len(shape) != 2:
    return none
  if names[0] == "embed":
    return ("vocab", "embed")
  if names[0] == "pos_embed":
    return ("positions", "embed")
  if names[0] == "head":
    return ("embed", "vocab")
  if names[-1] != "kernel":
    return none
  if "mlp" in names:
    return ("mlp", "embed") if names[-2] == "w_down" else ("embed", "mlp")
  if shape[0] == d_model:
    return ("embed", "heads")
  if shape[1] == d_model:
    return ("heads", "embed")
  return none


def spec_for(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, skip: Sequence[str] = ()) -> P:
  """The PartitionSpec of ``RULES`` applied to ``logical``, leaving out mesh axes ``skip``; a dimension
  whose mesh axes do not divide it (or whose axes an earlier dimension already uses) stays whole."""
  used: set[str] = set(skip)
  spec = []
  for name, size in zip(logical, shape):
    axes = RULES.get(name) if name is not None else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in used)
    if not axes or size % math.prod(mesh.shape[a] for a in axes):
      spec.append(None)
      continue
    used.update(axes)
    spec.append(axes[0] if len(axes) == 1 else axes)
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def param_shardings(params, mesh: Mesh, d_model: int, skip: Sequence[str] = ()):
  """A NamedSharding for every parameter leaf (arrays or ShapeDtypeStructs), by ``logical_axes``;
  ``skip``: mesh axes not to shard over (("fsdp",): the parameters as the forward pass uses them)."""
  def sharding(path, leaf):
    logical = logical_axes(path_names(path), leaf.shape, d_model)
    return NamedSharding(mesh, spec_for(logical, leaf.shape, mesh, skip))
  return jax.tree_util.tree_map_with_path(sharding, params)


def current_mesh() -> Mesh:
  """The mesh of the enclosing ``jax.set_mesh``, else data parallelism over every device."""
  mesh = jax.sharding.get_mesh()
  return make_mesh() if mesh.empty else mesh


def replicated(mesh: Mesh | None = None) -> NamedSharding:
  """Every device holds the whole array (default: of ``current_mesh()``)."""
  return NamedSharding(mesh if mesh is not None else current_mesh(), P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[B, ...] arrays: rows split over data × fsdp, replicated over tensor."""
  return NamedSharding(mesh, P(BATCH_AXES))


def micro_batch_sharding(mesh: Mesh) -> NamedSharding:
  """[accum, B / accum, ...] micro-batches: each micro-batch split like a batch."""
  return NamedSharding(mesh, P(None, BATCH_AXES))


@dataclasses.dataclass(frozen=True)
class TrainShardings:
  """The shardings of everything the train step reads and writes. ``compute_params``: the parameters
  gathered over fsdp, as the forward and backward passes read them (once per step)."""

  mesh: Mesh
  params: Any
  compute_params: Any
  rest: Any
  opt_state: Any
  batch: NamedSharding
  micro_batch: NamedSharding
  replicated: NamedSharding


def train_shardings(mesh: Mesh, abstract_params, abstract_rest, tx: optax.GradientTransformation,
                    d_model: int) -> TrainShardings:
  """Parameters by the rules; the optimizer's parameter-shaped state (Adam's moments) exactly like the
  parameters, its counters replicated; non-trainable model state replicated."""
  params = param_shardings(abstract_params, mesh, d_model)
  rep = replicated(mesh)
  abstract_opt_state = jax.eval_shape(tx.init, abstract_params)
  opt_state = optax.tree_map_params(tx, lambda _, s: s, abstract_opt_state, params,
                                    transform_non_params=lambda _: rep,
                                    is_leaf=lambda x: isinstance(x, NamedSharding))
  rest = jax.tree.map(lambda _: rep, abstract_rest)
  compute = param_shardings(abstract_params, mesh, d_model, skip=("fsdp",))
  return TrainShardings(mesh, params, compute, rest, opt_state, batch_sharding(mesh), micro_batch_sharding(mesh),
                        rep)


def with_shardings(abstract_tree, shardings):
  """ShapeDtypeStructs carrying ``shardings`` (the targets of an Orbax restore, or AOT inputs)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_tree, shardings)


def global_batch(local_batch: Mapping[str, np.ndarray], mesh: Mesh | None = None) -> dict[str, jax.Array]:
  """This process's numpy rows -> global arrays split over data × fsdp."""
  sharding = batch_sharding(mesh if mesh is not None else current_mesh())
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}


class ClusterError(UserError, RuntimeError):
  """A multi-process cluster was detected but JAX's distributed runtime did not come up."""


@dataclasses.dataclass(frozen=True)
class Cluster:
  description: str  # what was detected, for messages
  kwargs: dict[str, Any]  # explicit jax.distributed.initialize arguments ({}: JAX's own detection)


GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips on a Cloud TPU VM


def _int_env(environ: Mapping[str, str], name: str) -> int | None:
  value = environ.get(name, "")
  return int(value) if value.strip().isdigit() else None


def detect_cluster(environ: Mapping[str, str] = os.environ,
                   pci_devices: str = "/sys/bus/pci/devices") -> Cluster | None:
  """The multi-process cluster of this process, or None: in order, JAX_COORDINATOR_ADDRESS, a SLURM
  step or Open MPI job of several tasks, a TPU slice (TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES),
  a Cloud TPU VM (TPU chips on PCI)."""
  if address := environ.get("JAX_COORDINATOR_ADDRESS"):
    count, index = environ.get("JAX_NUM_PROCESSES"), environ.get("JAX_PROCESS_ID")
    description = (f"JAX_COORDINATOR_ADDRESS={address} (JAX_NUM_PROCESSES={count}, JAX_PROCESS_ID={index})")
    if _int_env(environ, "JAX_NUM_PROCESSES") is None or _int_env(environ, "JAX_PROCESS_ID") is None:
      raise ClusterError(f"detected {description}, but JAX_NUM_PROCESSES and JAX_PROCESS_ID must both be "
                         f"non-negative integers; set them on every process, or unset JAX_COORDINATOR_ADDRESS "
                         f"to run one process alone.")
    return Cluster(description, dict(coordinator_address=address, num_processes=int(count),
                                     process_id=int(index), cluster_detection_method="deactivate"))
  if (_int_env(environ, "SLURM_NTASKS") or 0) > 1 and "SLURM_JOB_ID" in environ:
    return Cluster(f"a SLURM job step of {environ['SLURM_NTASKS']} tasks (SLURM_JOB_ID={environ['SLURM_JOB_ID']}, "
                   f"SLURM_PROCID={environ.get('SLURM_PROCID')}, nodes {environ.get('SLURM_STEP_NODELIST')})",
                   dict(cluster_detection_method="slurm"))
  if (_int_env(environ, "OMPI_COMM_WORLD_SIZE") or 0) > 1:
    return Cluster(f"an Open MPI job of {environ['OMPI_COMM_WORLD_SIZE']} ranks "
                   f"(OMPI_COMM_WORLD_RANK={environ.get('OMPI_COMM_WORLD_RANK')})", dict(cluster_detection_method="ompi"))
  for name in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES"):
    hosts = [h for h in environ.get(name, "").split(",") if h.strip()]
    if len(hosts) > 1:
      return Cluster(f"a TPU slice of {len(hosts)} hosts ({name}={environ[name]}, "
                     f"TPU_WORKER_ID={environ.get('TPU_WORKER_ID')})", {})
  chips = sum(1 for path in glob.glob(os.path.join(pci_devices, "*", "vendor"))
              if _read(path) == GOOGLE_PCI_VENDOR)
  if chips:
    return Cluster(f"a Cloud TPU VM ({chips} TPU chips on PCI)", {})
  return None


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return ""


def initialize_distributed(environ: Mapping[str, str] = os.environ) -> Cluster | None:
  """``jax.distributed.initialize()`` where ``detect_cluster`` finds a cluster, before anything touches
  a device. A detected cluster that does not come up raises ``ClusterError`` (training alone on each
  host is never what was meant); FSLM_DISTRIBUTED=off skips the detection."""
  if environ.get("FSLM_DISTRIBUTED", "auto").lower() == "off":
    return None
  cluster = detect_cluster(environ)
  if cluster is None:
    return None
  try:
    jax.distributed.initialize(**cluster.kwargs)
  except Exception as e:  # JAX raises ValueError, RuntimeError or XlaRuntimeError for these.
    reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
    raise ClusterError(
        f"detected {cluster.description}, but jax.distributed.initialize() failed ({type(e).__name__}: "
        f"{reason}). Check that every process of the job is started with the same settings and can reach "
        f"the coordinator, or set FSLM_DISTRIBUTED=off to run this process alone.") from e
  return cluster


def is_main_process() -> bool:
  """Process 0 writes logs, run records and console lines; every process writes its checkpoint shards."""
  return jax.process_index() == 0
