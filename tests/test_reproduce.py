"""The reproduction chain of SANATAN's two-stage claim (scripts/reproduce.py): its presets state the
documented sizes, positions and step relations, the seed changes the model's initialisation,
a missing corpus is one line before any folder exists, and the chain at CPU scale (every control and
position ablation at two seeds, recall scored) writes its table with means and spreads, readouts,
recall and plot; a rerun trains nothing and gives the same table, and so does a fresh workdir holding
only the portable records, where a stage 2 whose stage 1 was trained elsewhere is refused."""

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from unittest import mock

import pytest
from absl import flags

from configs import baselines, sanatan
import numpy as np

from lmcore import config as cfg_lib
from lmcore.errors import ConfigError, MissingFileError
from lmcore.model import abstract_param_count
from lmcore.train import chain, sharding
from lmcore.train import state as state_lib
from lmcore.train.optim import make_optimizer
from process_cases import compilation_cache_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "reproduce.py")


def typed(cd) -> cfg_lib.ExperimentConfig:
  return cfg_lib.experiment_config(cd)


def test_presets_have_the_documented_sizes_and_step_relations():
  stage1, stage2 = typed(sanatan.get_config("repro_p2")), typed(sanatan.get_config("repro_p1_adapt"))
  scratch = typed(sanatan.get_config("repro_p1_scratch"))
  p2_no_table = typed(sanatan.get_config("repro_p2_no_table"))
  scratch_no_table = typed(sanatan.get_config("repro_p1_scratch_no_table"))
  transformer_pp = typed(baselines.get_config("transformer_pp_repro"))
  table, nope = typed(baselines.get_config("repro_softmax_table")), typed(baselines.get_config("repro_softmax_nope"))
  gla = typed(baselines.get_config("repro_gla"))
  controls = (scratch, scratch_no_table, transformer_pp, table, nope, gla)
  s1 = stage1.train.steps
  assert s1 == 4000 and stage2.train.steps == round(0.06 * s1) == 240 and p2_no_table.train.steps == s1
  assert {c.train.steps for c in controls} == {s1 + stage2.train.steps}
  assert stage2.train.learning_rate == pytest.approx(stage1.train.learning_rate / 10)
  assert {c.train.learning_rate for c in (stage1, p2_no_table, *controls)} == {6e-4}
  assert stage1.train.warmup_steps == round(0.02 * s1) and stage2.train.warmup_steps == round(0.05 * 240)
  assert stage2.train.init_from == stage2.train.init_data_from == "runs/reproduce/p2"
  for config in (stage1, stage2, p2_no_table, *controls):
    train, model, data = config.train, config.model, config.data
    assert (train.batch_size, train.grad_accum, data.seq_len) == (32, 1, 1024)
    assert (train.b2, train.weight_decay, train.grad_clip, train.min_lr_ratio) == (0.95, 0.1, 1.0, 0.1)
    assert (model.n_layers, model.d_model, model.mlp_hidden, model.vocab_size) == (8, 512, 1408, 16_384)
    assert model.dtype == "bfloat16" and model.tie_embeddings
    (source,) = data.sources
    assert (source.name, source.kind, source.path) == ("linux", "array_record", "runs/linux/shards/*.array_record")
    assert source.heldout_fraction == 0.01 and data.heldout.num_sequences == 256 and data.worker_count == 8
    assert (data.tokenizer.kind, data.tokenizer.path) == ("sentencepiece", "runs/linux/tokenizer.model")
  sanatan_mixers = [c.model.mixers["sanatan"] for c in (stage1, stage2, scratch, p2_no_table, scratch_no_table)]
  assert [(m.p, m.implementation, m.n_heads, m.head_dim) for m in sanatan_mixers] == [
      (2, "parallel", 8, 64), (1, "auto", 8, 64), (1, "auto", 8, 64), (2, "parallel", 8, 64), (1, "auto", 8, 64)]
  # Positions: the learned table, RoPE, both or neither, as each row's label says.
  softmax = {name: (c.model.max_positions, c.model.mixers["softmax"].rope, c.model.mixers["softmax"].n_heads)
             for name, c in (("transformer_pp", transformer_pp), ("table", table), ("nope", nope))}
  assert softmax == {"transformer_pp": (0, True, 8), "table": (1024, False, 8), "nope": (0, False, 8)}
  assert stage1.model.max_positions == scratch.model.max_positions == 1024
  assert p2_no_table.model.max_positions == scratch_no_table.model.max_positions == gla.model.max_positions == 0
  assert gla.model.mixers["gla"].n_heads == 4
  # Only the evaluations the tables show: stage 1's gate statistics, stage 2's and its parallel/recurrent pair.
  assert [(c.eval.paired, c.eval.gate_stats) for c in (stage1, stage2, scratch, p2_no_table, scratch_no_table)] == [
      (False, True), (True, True), (False, False), (False, False), (False, False)]
  # Stage 1 keeps the steps the chain reads out (0.25, 0.5 and 0.75 of it); the last is the latest.
  assert sanatan.length_steps(s1) == (1000, 2000, 3000, 4000)
  assert all(step % stage1.train.keep_every == 0 and stage1.train.keep_every % stage1.train.checkpoint_every == 0
             for step in (1000, 2000, 3000))
  # Embeddings 16,384 × 512 + positions 1,024 × 512 + 8 blocks × (4 · 512² + omega, lam 2 · 512 + SwiGLU
  # 3 · 512 · 1,408 + norms 2 · 512) + final norm 512; Transformer++ lacks the positions, omega and lam.
  assert abstract_param_count(stage1.model) == 8_388_608 + 524_288 + 8 * 3_213_312 + 512 == 34_619_904
  assert abstract_param_count(transformer_pp.model) == 8_388_608 + 8 * 3_212_288 + 512 == 34_087_424
  assert abstract_param_count(table.model) == 34_087_424 + 524_288
  assert abstract_param_count(p2_no_table.model) == 34_619_904 - 524_288
  assert abstract_param_count(gla.model) == pytest.approx(34_619_904, rel=0.02)


def test_the_seed_changes_the_model_initialisation():
  """``train.seed`` (what --seeds sets) draws the parameters; that it also orders the documents is
  tests/test_data.py's test_same_seed_gives_same_batches_and_another_seed_differs."""
  embeddings = []
  for seed in (0, 1):
    cd = baselines.transformer_pp_repro(scale=sanatan.REPRO_TINY, corpus=None)
    cd.train.seed = seed
    config = typed(cd)
    _, _, _, shardings = state_lib.make_shardings(config, sharding.make_mesh(config.mesh),
                                                  make_optimizer(config.train))
    params, _ = state_lib.init_params(config, shardings)
    embeddings.append(np.asarray(params["embed"]["embedding"]))
  assert embeddings[0].shape == embeddings[1].shape and not np.array_equal(*embeddings)


@pytest.mark.parametrize("stage1_steps", [1000, 2500])
def test_every_step_count_derives_from_stage_one(stage1_steps):
  steps = sanatan.repro_steps(stage1_steps)
  assert steps["stage2"] == round(0.06 * stage1_steps) and steps["scratch"] == stage1_steps + steps["stage2"]
  stage1 = typed(sanatan.repro_p2(stage1_steps))
  assert typed(sanatan.repro_p1_adapt(stage1_steps)).train.steps == steps["stage2"]
  assert typed(baselines.repro_gla(stage1_steps)).train.steps == steps["scratch"]
  for step in sanatan.length_steps(stage1_steps)[:-1]:
    assert step % stage1.train.keep_every == 0 and stage1.train.keep_every % stage1.train.checkpoint_every == 0


def test_a_length_grid_that_would_keep_too_many_checkpoints_is_refused():
  assert sanatan.stage1_checkpointing(4000) == {"checkpoint_every": 500, "keep_every": 1000}
  with pytest.raises(ConfigError, match="coarser grid"):
    sanatan.stage1_checkpointing(4000, (0.33, 0.5, 1))
  with pytest.raises(ConfigError, match=r"in \(0, 1\]"):
    sanatan.length_steps(4000, (0.5, 1.5))


def test_training_seconds_and_loss_curve_follow_a_resumed_run():
  # Process 1 logs steps 1..6 (step_s at 1 and 4) and dies after its checkpoint at step 4;
  # process 2 resumes at step 4 and logs 5..8 (step_s at 8).
  rows = ([{"step": 1, "loss": 9.0, "step_s": 5.0}, {"step": 2, "loss": 8.0}, {"step": 3, "loss": 7.0},
           {"step": 4, "loss": 6.0, "step_s": 1.0}, {"step": 5, "loss": 5.5}, {"step": 6, "loss": 5.4}]
          + [{"step": 5, "loss": 5.0}, {"step": 6, "loss": 4.5}, {"step": 7, "loss": 4.0},
             {"step": 8, "loss": 3.5, "step_s": 2.0}, {"step": 8, "eval/loss": 3.9}])
  assert chain.training_seconds(rows) == 5.0 + 3 * 1.0 + 4 * 2.0
  steps, loss = chain.loss_curve(rows)
  assert steps.tolist() == list(range(1, 9)) and loss.tolist() == [9, 8, 7, 6, 5, 4.5, 4, 3.5]
  assert chain.loss_curve(rows, "eval/loss")[1].tolist() == [3.9]


def test_curve_points_keep_a_short_curve_and_average_a_long_one_in_runs():
  rows = [{"step": s, "loss": float(s)} for s in range(1, 11)]
  assert chain.curve_points(rows) == [[s, float(s)] for s in range(1, 11)]
  # 10 points in 4 runs of consecutive points (3, 3, 2, 2): each its last step and its mean.
  assert chain.curve_points(rows, max_points=4) == [[3, 2.0], [6, 5.0], [8, 7.5], [10, 9.5]]


def test_a_record_counts_in_another_workdir_and_one_of_a_changed_config_is_refused(tmp_path):
  """A record's paths inside its workdir are written from ``<workdir>``; fields that measure nothing
  (wandb) or that only one side has (added or removed since) are not compared; any other change is."""
  reproduce = load_script()
  def plan(name):
    return reproduce.Plan(str(tmp_path / name), sanatan.REPRO_TINY, None, 4, (0.5, 1.0), (2,), ("p2", "adapt"), (),
                          (0,))
  here, there = plan("here"), plan("there")
  stage2 = reproduce.build_runs(there)[1]
  assert stage2.config.train.init_from == str(tmp_path / "there" / "s0" / "p2" / "views" / "2")
  config = reproduce.portable_config(stage2.config, there.workdir)
  assert config == reproduce.portable_config(reproduce.build_runs(here)[1].config, here.workdir)
  assert config["train"]["init_from"] == "<workdir>/s0/p2/views/2"
  record = {"format": reproduce.RECORD_FORMAT, "chain": there.identity(), "config": config}
  path = tmp_path / "there" / "records" / "s0" / "adapt_2.json"
  path.parent.mkdir(parents=True)
  config["wandb"]["mode"], config["train"]["removed_field"] = "online", 1
  path.write_text(json.dumps(record))
  assert reproduce.read_run_record(stage2, there) == record
  config["train"]["learning_rate"] *= 2
  path.write_text(json.dumps(record))
  with pytest.raises(ConfigError, match=r"adapt_2.json records a run set up otherwise \(train.learning_rate="):
    reproduce.read_run_record(stage2, there)


# The tiny chain compiles each run's programs once and runs them a few steps: XLA's CPU backend without
# its expensive optimisations compiles them faster (the losses are compared with each other, not pinned).
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def defined_in_script() -> bool:
  """Whether the flag being registered is defined by the script's own code (not by a module it imports)."""
  frame = sys._getframe(2)
  while frame is not None and frame.f_globals.get("__name__", "").startswith("absl."):
    frame = frame.f_back
  return frame is not None and frame.f_code.co_filename == str(SCRIPT)


def load_script():
  """scripts/reproduce.py as a module, once per process. Its own flags go to a FlagValues of their own:
  a test process loads other scripts whose flags have the same names, and the functions used here read
  no flag. Flags of the modules it imports go where they always go."""
  if "reproduce" not in sys.modules:
    spec = importlib.util.spec_from_file_location("reproduce", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    own, register = flags.FlagValues(), flags.FlagValues.__setitem__

    def register_apart(flag_values, name, flag):
      register(own if flag_values is flags.FLAGS and defined_in_script() else flag_values, name, flag)

    with mock.patch.object(flags.FlagValues, "__setitem__", register_apart):
      spec.loader.exec_module(module)
    sys.modules["reproduce"] = module
  return sys.modules["reproduce"]


def run_script(*args, expect: int = 0, cache=None):
  """``cache``: a persistent compilation cache of the run's own that keeps every program, however quick
  to compile (the chain's evaluations at each read-out step compile the same programs), and fast
  compilation."""
  env = {**os.environ, "WANDB_MODE": "disabled"}
  if cache is not None:
    env.update(compilation_cache_env(cache))
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()
  proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                        env=env)
  assert proc.returncode == expect, f"STDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
  return proc


def test_a_missing_corpus_is_one_line_before_any_folder(tmp_path):
  workdir = tmp_path / "chain"
  proc = run_script(f"--workdir={workdir}", f"--corpus={tmp_path / 'no_corpus'}", expect=2)
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("MissingFileError: --corpus="), proc.stderr
  assert "tokenizer.model" in lines[0] and not workdir.exists()


def finite_numbers(value):
  if isinstance(value, dict):
    return all(finite_numbers(v) for v in value.values())
  if isinstance(value, list):
    return all(finite_numbers(v) for v in value)
  return not isinstance(value, float) or math.isfinite(value)


C_FILE = """static int helper_{i}(int x)
{{
\tint scaled_value_{i} = x * {i} + 7;
\treturn scaled_value_{i};
}}
"""


def recall_task(folder) -> str:
  """A recall task of scripts/make_recall_task.py (3 examples) from C files the tiny runs never saw."""
  (folder / "corpus").mkdir(parents=True)
  for i in range(3):
    (folder / "corpus" / f"file_{i}.c").write_text(C_FILE.format(i=i))
  proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_recall_task.py"),
                         f"--input={folder / 'corpus' / '*.c'}", "--kind=text", "--heldout_fraction=0",
                         f"--output_dir={folder / 'task'}", "--max_chars=400", "--max_gen_toks=4"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  return str(folder / "task")


@pytest.mark.slow
def test_tiny_chain_writes_table_readouts_recall_and_plot_and_its_records_rebuild_it_without_training(tmp_path):
  workdir = tmp_path / "chain"
  # Every run at seeds 0 and 1; stage 2 from half of stage 1 (through a view of a kept step), readouts at
  # 0.5 and 1.
  settings = ["--tiny", "--lengths=0.5,1", "--adapt_lengths=0.5", "--seeds=0,1", "--override=wandb.mode=disabled"]
  first = run_script(f"--workdir={workdir}", *settings, cache=tmp_path / "jax_cache").stdout
  results = json.load(open(workdir / "results.json"))
  table = (workdir / "results.md").read_text()
  assert finite_numbers(results) and list(results["seeds"]) == ["0", "1"]
  names = ["p2", "adapt_2", "scratch", "transformer_pp", "gla", "based", "softmax_table", "softmax_nope",
           "p2_no_table", "scratch_no_table"]
  for seed, result in results["seeds"].items():
    runs = result["runs"]
    assert list(runs) == names and all(run["workdir"].startswith(str(workdir / f"s{seed}")) for run in runs.values())
    assert [r["step"] for r in result["lengths"]] == [2, 4]
    assert result["lengths"][0]["adapted_loss"] == runs["adapt_2"]["loss"]
    assert runs["adapt_2"]["loss"] != result["lengths"][0]["loss_p1_readout"]  # stage 2 trained
    assert result["lengths"][1]["adapted_loss"] is None
    for row in result["lengths"]:
      assert row["gap"] == pytest.approx(row["loss_p1_readout"] - row["loss_p2"])
    stage2 = runs["adapt_2"]["eval"]
    assert abs(stage2["paired_diff"]) < 1e-4 and stage2["max_abs_dlogit"] < 1e-4
    assert {runs[name]["steps"] for name in names[2:8] + names[9:]} == {4 + 1} and runs["p2_no_table"]["steps"] == 4
    assert len(result["gate_stats"]["stage1"]) == len(result["gate_stats"]["stage2"]) == 1  # one layer
  # The summary: per run the mean and spread over the seeds (which differ: both draws changed), the
  # difference from Transformer++ and whether it exceeds both spreads.
  summary, reference = results["summary"]["runs"], results["summary"]["runs"]["transformer_pp"]
  assert list(summary) == names
  for name, row in summary.items():
    losses = [results["seeds"][seed]["runs"][name]["loss"] for seed in ("0", "1")]
    assert losses[0] != losses[1], name
    assert row["mean"] == pytest.approx(sum(losses) / 2) and row["spread"] == pytest.approx(abs(losses[0] - losses[1]))
    assert f"| {row['label']} | {row['steps']:,} |" in table
    if name != "transformer_pp":
      assert row["minus_reference"] == pytest.approx(row["mean"] - reference["mean"])
      assert row["beyond_spreads"] == (abs(row["minus_reference"]) > max(row["spread"], reference["spread"]))
  assert reference["minus_reference"] is None and "beyond both spreads" in table
  gaps = [results["seeds"][seed]["lengths"][1]["gap"] for seed in ("0", "1")]
  assert results["summary"]["lengths"][1]["gap"]["mean"] == pytest.approx(sum(gaps) / 2)
  assert [r["what"] for r in results["summary"]["source"] if r["n"] == 2] == ["p = 1 read out, not adapted − p = 2"]
  assert "| 4 (1.00) |" in table and "| 2 (0.50) |" in table
  assert results["summary"]["recall"] == {} and "Recall on" not in table
  assert (workdir / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert first.count("Initialised parameters from step 2") == 2
  # Where each trained run's wall time went, a row per run in the order the process trained them.
  goodput_rows = [json.loads(line) for line in (workdir / "goodput.jsonl").read_text().splitlines()]
  assert [r["control"] for r in goodput_rows[:len(names)]] == [f"{name}, seed 0" for name in names]
  assert len(goodput_rows) == 2 * len(names) and goodput_rows[0]["corpus"] == "embedded"
  assert all(sum(r["phases"].values()) == pytest.approx(r["wall_s"], rel=0.02) for r in goodput_rows)

  # The same command with a recall task: every run is read back from its record (nothing trains), and
  # the recalled runs, whose checkpoints are here, are scored on two examples beside their held-out loss.
  metrics = {p: p.read_bytes() for p in workdir.glob("s*/*/metrics.jsonl")}
  assert len(metrics) == 2 * len(names) and len(list(workdir.glob("records/s*/*.json"))) == 2 * len(names)
  settings += [f"--recall_task={recall_task(tmp_path / 'recall')}", "--recall_limit=2", "--recall_batch_size=2"]
  again = run_script(f"--workdir={workdir}", *settings, cache=tmp_path / "jax_cache").stdout
  assert again.count("(recorded: read back") == 2 * len(names) and "step 1/" not in again and "Resumed" not in again
  assert {p: p.read_bytes() for p in workdir.glob("s*/*/metrics.jsonl")} == metrics
  recalled = ["adapt_2", "scratch", "transformer_pp", "gla", "based", "scratch_no_table"]
  assert again.count("recall on code_recall") == 2 * len(recalled)
  with_recall = json.load(open(workdir / "results.json"))
  recall_table = (workdir / "results.md").read_text()
  assert recall_table.splitlines()[:len(table.splitlines()) - 1] == table.splitlines()[:-1]  # the command differs
  recall = with_recall["summary"]["recall"]
  assert list(recall["runs"]) == recalled
  for name, row in recall["runs"].items():
    assert row["n"] == 2 and row["loss"]["mean"] == summary[name]["mean"] and row["examples"] == 2
    assert all(0 <= row["accuracies"][seed] <= 1 for seed in ("0", "1"))
    assert f"| {row['label']} | {row['accuracies']['0']:.3f} |" in recall_table
  assert "Recall on `code_recall` (2 held-out examples" in recall_table

  # A fresh workdir holding only the records (another machine): stage 2 whose record is missing cannot
  # start from a stage 1 whose checkpoints stayed behind (the chain checks it before anything trains) ...
  fresh = tmp_path / "fresh"
  shutil.copytree(workdir / "records", fresh / "records")
  (fresh / "records" / "s0" / "adapt_2.json").unlink()
  reproduce = load_script()
  plan = reproduce.Plan(str(fresh), sanatan.REPRO_TINY, None, 4, (0.5, 1.0), (2,), ("p2", "adapt"),
                        ("wandb.mode=disabled",), (0,))
  with pytest.raises(MissingFileError, match=r"^stage 2 at seed 0 .* has none: .* finish in one sitting"):
    reproduce.check_stage2_sources(plan, reproduce.build_runs(plan))
  # ... and with every record, the same tables and a plot from the records' curves, without training
  # or scoring.
  shutil.copy(workdir / "records" / "s0" / "adapt_2.json", fresh / "records" / "s0" / "adapt_2.json")
  copied = run_script(f"--workdir={fresh}", *settings, cache=tmp_path / "jax_cache").stdout
  assert copied.count("(recorded: read back") == 2 * len(names) and "recall on" not in copied
  assert not list(fresh.glob("s*")) and (fresh / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (fresh / "results.md").read_text().splitlines()[:-1] == recall_table.splitlines()[:-1]
  assert json.load(open(fresh / "results.json"))["summary"] == with_recall["summary"]
  # A record missing (a run not made yet): --from_records builds the tables from the others and names it.
  (fresh / "records" / "s1" / "p2_no_table.json").unlink()
  partial = run_script(f"--workdir={fresh}", *settings, "--from_records", cache=tmp_path / "jax_cache").stdout
  assert "Not in the tables (no record): p2_no_table (seed 1)" in partial and not list(fresh.glob("s*"))
  row = json.load(open(fresh / "results.json"))["summary"]["runs"]["p2_no_table"]
  assert row["n"] == 1 and list(row["losses"]) == ["0"] and row["beyond_spreads"] is None
