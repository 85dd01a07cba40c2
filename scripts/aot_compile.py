"""Compile a preset's exact train step for a TPU slice or a GPU host, on any machine, and say whether it
fits in device memory.

    python scripts/aot_compile.py --config=configs/sanatan.py:184m_p2 --topology=v4-8
    python scripts/aot_compile.py --config=configs/sanatan.py:184m_p2 --topology=v4:2x2x1 \
        --config.mesh.data=1 --config.mesh.fsdp=-1
    python scripts/aot_compile.py --config=configs/based.py:1p3b --gpus=8 --gpu_memory_gib=140

The step is the one ``train.py`` runs (``lmcore.train.loop.make_train_step`` with the config's mesh,
shardings, gradient accumulation, remat and loss), lowered with abstract inputs and compiled for the
target: nothing is allocated. TPU targets need libtpu (``make aot``) but no TPU: the compiler runs on
the CPU. GPU targets need a CUDA host (the N GPUs are mocked if fewer are present).

Prints per-device memory (arguments = parameters, optimizer state and batch; temporaries; total
against the device's memory), the compiler's FLOPs per device per step, and "fits with N% headroom"
or "does not fit by X GiB" (exit status 1). For a TPU target it also prints the roofline step time,
max(FLOPs / peak, bytes accessed / HBM bandwidth) per chip, from the compiled step's cost analysis
with every loop body counted once per iteration (``benchmarks.tpu_aot.loop_costs``) and the chip's
peak bf16 FLOP/s and HBM bandwidth from ``benchmarks.tpu_aot.CHIPS``: an estimate, not a timing.
Topology names: docs/SCALING.md.

    python scripts/aot_compile.py --table=runs/aot.jsonl   # the records of --json as a Markdown table

Where the memory goes: ``--peak_buffers=N`` also prints the N largest groups of buffers live at the
step's peak, by the JAX op that made them and their shape, from XLA's own buffer assignment
(``benchmarks.memory_plan``). ``--chips=1`` compiles for one chip of the slice, e.g. a v5p chip
as a stand-in for one GPU of similar memory (docs/SCALING.md):

    python scripts/aot_compile.py --config=configs/based.py:360m --topology=v5p-8 --chips=1 \
        --config.train.batch_size=32 --config.train.grad_accum=1 --peak_buffers=20
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tempfile

from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# libtpu takes a machine-wide lock when it loads; another process compiling for a TPU on this host would
# otherwise make the compile fail.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

from benchmarks import memory_plan, tpu_aot  # noqa: E402
from lmcore import cli  # noqa: E402
from lmcore import config as cfg_lib  # noqa: E402
from lmcore import model_card  # noqa: E402
from lmcore.errors import UserError  # noqa: E402
from lmcore.model import with_mixer_overrides  # noqa: E402
from lmcore.tpu_slices import TPU_HBM_GIB, tpu_devices  # noqa: E402
from lmcore.train import loop, sharding, state  # noqa: E402
from lmcore.train.optim import make_optimizer  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file and preset.", lock_config=True)
_TOPOLOGY = flags.DEFINE_string("topology", "", "TPU slice: a name of TPU_SLICES (v4-8, v5p-8, ...) or a "
                                "topology like v4:2x2x1.")
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "TPU slices (multislice over the data-centre network).")
_CHIPS = flags.DEFINE_integer("chips", 0, "Compile for the first N chips of the slice only (0: all of them).")
_GPUS = flags.DEFINE_integer("gpus", 0, "Compile for this many GPUs of one host instead of a TPU slice.")
_GPU_MEMORY_GIB = flags.DEFINE_float("gpu_memory_gib", 0.0, "Memory of one GPU (default: what the first "
                                     "GPU reports).")
_JSON = flags.DEFINE_string("json", "", "Also append the result as one JSON line to this file.")
_HLO = flags.DEFINE_string("hlo", "", "Also write the compiled step's HLO text to this file.")
_PEAK_BUFFERS = flags.DEFINE_integer("peak_buffers", 0, "Also print the N largest groups of buffers live at "
                                     "the step's peak (XLA's buffer assignment).")
_TABLE = flags.DEFINE_string("table", "", "Compile nothing: print the records of this --json file as a "
                             "Markdown table (memory fit and roofline step time).")

GIB = 2 ** 30


def gpu_devices(count: int) -> list:
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    devices = []
  if not devices:
    raise UserError(f"--gpus={count} needs a machine with a CUDA GPU and jax[cuda] installed; this one has "
                    f"only {jax.default_backend()} devices. Compile for a TPU with --topology instead.")
  return devices[:count]


def device_memory_gib(device) -> float:
  if device.platform == "tpu":
    for kind, gib in TPU_HBM_GIB.items():
      if device.device_kind == kind:
        return gib
    raise UserError(f"no HBM size known for {device.device_kind!r}; add it to TPU_HBM_GIB.")
  if _GPU_MEMORY_GIB.value:
    return _GPU_MEMORY_GIB.value
  limit = (device.memory_stats() or {}).get("bytes_limit")
  if not limit:
    raise UserError("this GPU does not report its memory; pass --gpu_memory_gib.")
  return limit / GIB


def shard_bytes(abstract_tree) -> int:
  """Bytes one device holds of ``abstract_tree`` (sharded ShapeDtypeStructs)."""
  total = 0
  for x in jax.tree.leaves(abstract_tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * x.dtype.itemsize
  return total


def abstract_inputs(config: cfg_lib.ExperimentConfig, mesh):
  """The jitted train step and its abstract arguments (params, opt_state, rest, batch, step)."""
  tx = make_optimizer(config.train)
  graphdef, abstract_params, abstract_rest, shardings = state.make_shardings(config, mesh, tx)
  params = sharding.with_shardings(abstract_params, shardings.params)
  opt_state = sharding.with_shardings(jax.eval_shape(tx.init, abstract_params), shardings.opt_state)
  rest = sharding.with_shardings(abstract_rest, shardings.rest)
  step = jax.ShapeDtypeStruct((), jax.numpy.int32, sharding=shardings.replicated)
  args = (params, opt_state, rest, state.abstract_batch(config, shardings), step)
  return loop.make_train_step(graphdef, tx, config, shardings), args


def compile_step(config: cfg_lib.ExperimentConfig, devices) -> dict:
  mesh = sharding.make_mesh(config.mesh, devices)
  sharding.check_batch(mesh, config.train.batch_size, config.train.grad_accum)
  step_fn, args = abstract_inputs(config, mesh)
  memory_gib = device_memory_gib(devices[0])
  implementations = {kind: mixer.implementation for kind, mixer in config.model.mixers.items()
                     if getattr(mixer, "implementation", "")}
  record = {"devices": len(devices), "device_kind": devices[0].device_kind, "implementations": implementations,
            "mesh": dict(mesh.shape), "device_memory_gib": memory_gib,
            "argument_gib": shard_bytes(args) / GIB}
  # Lowering reads the mesh from the context: the Pallas kernels' shard_map needs it, and for a TPU
  # target compiled on a CPU host only the abstract mesh is available to them.
  with jax.set_mesh(mesh), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lowered = step_fn.lower(*args)
  try:
    compiled = lowered.compile()
  except Exception as e:  # XlaRuntimeError; only an out-of-memory verdict is a result, not a crash.
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    temp = re.search(r"temporaries \(([\d.]+)([GM])\)", str(e))
    temp_gib = float(temp.group(1)) / (1024 if temp.group(2) == "M" else 1) if temp else float("nan")
    record.update(fits=False, temp_gib=temp_gib, total_gib=record["argument_gib"] + temp_gib,
                  compiler_message=str(e).strip().splitlines()[0][:300])
    return record
  if _HLO.value:
    with open(_HLO.value, "w") as f:
      f.write(compiled.as_text())
  stats = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, list) else cost
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
           + stats.temp_size_in_bytes + stats.generated_code_size_in_bytes)
  record.update(argument_gib=stats.argument_size_in_bytes / GIB, output_gib=stats.output_size_in_bytes / GIB,
                alias_gib=stats.alias_size_in_bytes / GIB, temp_gib=stats.temp_size_in_bytes / GIB,
                code_gib=stats.generated_code_size_in_bytes / GIB, total_gib=total / GIB,
                xla_flops_per_device=float(cost.get("flops", float("nan"))), fits=total / GIB <= memory_gib)
  if devices[0].platform == "tpu":
    record.update(roofline(cost, compiled.as_text(), tpu_aot.chip(devices[0])))
  return record


def roofline(cost: dict, hlo_text: str, chip: tpu_aot.Chip) -> dict:
  """The compiled step's FLOPs and bytes accessed per chip, every loop body once per iteration (None
  where a trip count is unknown), and the roofline step time max(FLOPs / peak, bytes / HBM
  bandwidth) with the term that bounds it."""
  missing, trips = tpu_aot.loop_costs(hlo_text)
  if missing is None:
    return dict(roofline_s=None, loop_trip_counts=trips)
  flops = float(cost.get("flops", 0.0)) + missing["flops"]
  bytes_accessed = float(cost.get("bytes accessed", 0.0)) + missing["bytes accessed"]
  compute_s, memory_s = flops / chip.peak_flops, bytes_accessed / chip.hbm_bytes_per_s
  return dict(step_flops_per_device=flops, step_bytes_per_device=bytes_accessed,
              roofline_s=max(compute_s, memory_s), bound="compute" if compute_s >= memory_s else "memory",
              peak_flops=chip.peak_flops, hbm_bytes_per_s=chip.hbm_bytes_per_s, loop_trip_counts=trips)


def roofline_line(record: dict) -> str | None:
  """The report's roofline line of a TPU record (None for other targets)."""
  if "roofline_s" not in record:
    return None
  if record["roofline_s"] is None:
    return f"roofline step time: n/a (a loop of unknown trip count among {record['loop_trip_counts']})"
  flops, gb = record["step_flops_per_device"] / 1e12, record["step_bytes_per_device"] / 1e9
  peak, bandwidth = record["peak_flops"] / 1e12, record["hbm_bytes_per_s"] / 1e12
  return (f"roofline step time: {1e3 * record['roofline_s']:.1f} ms per step ({record['bound']}-bound; "
          f"{flops:.2f} TFLOP and {gb:.1f} GB per chip at {peak:.0f} TFLOP/s and {bandwidth:.2f} TB/s; "
          f"every loop body counted per iteration): an estimate, not a timing")


def model_flops_per_device(config: cfg_lib.ExperimentConfig, devices: int) -> float | None:
  """Training FLOPs of one step per device: the model card's FLOPs per token × tokens / devices.
  Pallas mixers are counted as their XLA forms ("auto" on a CPU host), whose math they share: XLA's
  cost model sees a kernel only through the estimate it passes (the Mosaic kernels', padding included)."""
  kernels = {kind for kind, mixer in config.model.mixers.items()
             if getattr(mixer, "implementation", "").startswith("pallas")}
  model = config.model
  if kernels:
    model = with_mixer_overrides(model, kernels, implementation="auto", tiles=None)
  per_token = model_card.card(model, config.data.seq_len)["flops_per_token_train"]
  if per_token is None:
    return None
  return per_token * config.train.batch_size * config.data.seq_len / devices


def remat_label(model: cfg_lib.ModelConfig) -> str | bool:
  """``model.remat_policy`` when ``model.remat`` is on (its default "full" as True), else False."""
  return (model.remat_policy if model.remat_policy != "full" else True) if model.remat else False


def report(name: str, target: str, config: cfg_lib.ExperimentConfig, record: dict) -> str:
  mesh = " ".join(f"{k}={v}" for k, v in record["mesh"].items())
  train = config.train
  lines = [f"{name} on {target}: {record['devices']} x {record['device_kind']} "
           f"({record['device_memory_gib']:.2f} GiB each), mesh {mesh}, batch {train.batch_size} x "
           f"{config.data.seq_len} in {train.grad_accum} micro-batches, remat {remat_label(config.model)}, "
           f"implementation {record['implementations'] or 'n/a'}"]
  if "temp_gib" in record and "output_gib" in record:
    lines.append(f"per device: arguments {record['argument_gib']:.2f} GiB (parameters, optimizer state, "
                 f"batch), temporaries {record['temp_gib']:.2f} GiB, outputs {record['output_gib']:.2f} GiB "
                 f"({record['alias_gib']:.2f} GiB donated), code {record['code_gib']:.2f} GiB: total "
                 f"{record['total_gib']:.2f} of {record['device_memory_gib']:.2f} GiB")
    model_flops = record.get("model_flops_per_device")
    lines.append(f"FLOPs per device per step: {'n/a' if model_flops is None else f'{model_flops:.4g}'} (model card: "
                 f"FLOPs/token x tokens / devices); XLA's count of the compiled step, which counts each loop "
                 f"body once: {record['xla_flops_per_device']:.4g}")
  else:
    lines.append(f"per device: arguments {record['argument_gib']:.2f} GiB, temporaries "
                 f"{record['temp_gib']:.2f} GiB (compiler: {record['compiler_message']})")
  if roofline_line(record):
    lines.append(roofline_line(record))
  headroom = 1 - record["total_gib"] / record["device_memory_gib"]
  record["headroom"] = headroom
  if record["fits"]:
    lines.append(f"fits with {100 * headroom:.0f}% headroom")
  else:
    lines.append(f"does not fit by {record['total_gib'] - record['device_memory_gib']:.2f} GiB")
  return "\n".join(lines)


def markdown_table(records: list[dict]) -> str:
  """One row per record of ``--json``: the memory fit and, for TPU targets, the roofline step time and
  the tokens per second it implies (the step's tokens over that time)."""
  lines = ["| preset | target | implementation | micro-batches | remat | total / HBM per chip | verdict | "
           "roofline ms per step (bound) | tokens/s at the roofline |", "|" + " --- |" * 9]
  for r in records:
    implementations = ", ".join(f"{k}: {v}" for k, v in r["implementations"].items()) or "n/a"
    verdict = (f"fits with {100 * r['headroom']:.0f}% headroom" if r["fits"]
               else f"does not fit by {r['total_gib'] - r['device_memory_gib']:.2f} GiB")
    time, rate = "n/a", "n/a"
    if r.get("roofline_s"):
      time = f"{1e3 * r['roofline_s']:.1f} ({r['bound']})"
      rate = f"{r['tokens_per_step'] / r['roofline_s']:,.0f}"
    lines.append(f"| {r['name']} | {r['target']} | {implementations} | {r['grad_accum']} × "
                 f"{r['batch_size'] // r['grad_accum']} × {r['seq_len']} | {r.get('remat', 'n/a')} | "
                 f"{r['total_gib']:.2f} / "
                 f"{r['device_memory_gib']:.2f} GiB | {verdict} | {time} | {rate} |")
  return "\n".join(lines)


def print_table(path: str) -> int:
  try:
    with open(path) as f:
      records = [json.loads(line) for line in f if line.strip()]
  except OSError as e:
    raise UserError(f"--table={path}: cannot read it ({e.strerror}); give a file written by --json.") from e
  print(markdown_table(records))
  return 0


def main(argv):
  del argv
  if _TABLE.value:
    return print_table(_TABLE.value)
  if _CONFIG.value is None:
    raise UserError("give --config=<file>:<preset> to compile, or --table=<file of --json records>.")
  if bool(_TOPOLOGY.value) == bool(_GPUS.value):
    raise UserError("give exactly one target: --topology=<TPU slice> or --gpus=N.")
  dump_dir = tempfile.mkdtemp(prefix="aot_compile_") if _PEAK_BUFFERS.value else ""
  if dump_dir:  # read when the first backend starts, below
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} "
                               "--xla_dump_hlo_module_re=.*train_step.*").strip()
  if _GPUS.value:
    jax.config.update("jax_mock_gpu_topology", f"1 x 1 x {_GPUS.value}")
    devices, target = gpu_devices(_GPUS.value), f"{_GPUS.value} GPUs"
  else:
    jax.config.update("jax_platforms", "cpu")  # the host only compiles; its own backend stays CPU
    devices, target = tpu_devices(_TOPOLOGY.value, _NUM_SLICES.value), _TOPOLOGY.value
    if _CHIPS.value:
      if not 0 < _CHIPS.value <= len(devices):
        raise UserError(f"--chips={_CHIPS.value}: {target} has {len(devices)} chips; give 1 to {len(devices)}.")
      devices, target = devices[:_CHIPS.value], f"{target}, {_CHIPS.value} of its {len(devices)} chips"
  config = cfg_lib.experiment_config(_CONFIG.value)
  name = config.name or "config"
  peak = ""
  try:
    record = compile_step(config, devices)
    if dump_dir and "output_gib" in record:
      peak = memory_plan.table(*memory_plan.peak_buffers(dump_dir), top=_PEAK_BUFFERS.value)
  finally:
    if dump_dir:
      shutil.rmtree(dump_dir, ignore_errors=True)
  record["model_flops_per_device"] = model_flops_per_device(config, len(devices))
  record.update(batch_size=config.train.batch_size, grad_accum=config.train.grad_accum,
                remat=remat_label(config.model), seq_len=config.data.seq_len,
                tokens_per_step=config.train.batch_size * config.data.seq_len)
  print(report(name, target, config, record), flush=True)
  if peak:
    print(f"\nbuffers live at the step's peak, by op and shape (XLA's buffer assignment):\n{peak}")
  if _JSON.value:
    with open(_JSON.value, "a") as f:
      f.write(json.dumps({"name": name, "target": target, **record}) + "\n")
  return 0 if record["fits"] else 1


if __name__ == "__main__":
  cli.run(main)
