"""SANATAN (MATH §1): root-parity gated angular attention, two-stage p=2 -> p=1 schedule.

Presets:
  tiny, tiny_p1_adapt, tiny_p1_scratch   embedded corpus, 2 CPU cores (the quick start chains them)
  184m_p2                                stage 1: p = 2, 10B tokens (152,588 steps of 65,536 tokens)
  184m_p1_adapt                          stage 2: p = 1 from the stage-1 parameters, LR 6e-5, 0.63B
                                         tokens (9,613 steps), continuing the stage-1 data stream
  184m_p1_scratch                        control: p = 1 from scratch
  repro_p2, repro_p1_adapt,              the reproduction chain (scripts/reproduce.py) on one GPU: 8 layers
  repro_p1_scratch                       of 512, 4,000 stage-1 steps of 32 x 1024 tokens on runs/linux;
                                         stage 2 for 240 steps at LR 6e-5; the control for 4,240
  repro_p2_no_table,                     the chain's position ablations: stage 1 and the p = 1 control
  repro_p1_scratch_no_table              without the learned table (the rotation carries position)
  ablate_<name>                          1B-token ablations (15,259 steps): p2 (6ch p=2), no_omega,
                                         no_lambda, p4 (6ch p=4), 4ch_p2, 4ch_p4, 3ch_legacy, 3ch_clean

Stage 2 reads stage 1 from ``train.init_from`` (default ``runs/sanatan_184m_p2``; override it):

    python train.py --config=configs/sanatan.py:184m_p1_adapt --workdir=runs/sanatan_184m_p1 \
        --config.train.init_from=runs/sanatan_184m_p2 --config.train.init_data_from=runs/sanatan_184m_p2

Every ablation is also an override of the base preset, e.g. ``--config.model.mixers.sanatan.channels=4``.
The softmax reference at the 184M width and tokens is ``configs/baselines.py:transformer_pp_184m``
(Transformer++: RoPE, no position table); at the reproduction's, ``transformer_pp_repro``.
"""

import dataclasses
import math

from configs import common
from lmcore.errors import ConfigError

TOKENS_PER_STEP = 32 * 2048  # 65,536 (MATH §1.4)


def paper_tokenizer():
  """The LLaDA-8B-Instruct tokenizer (its ``len()`` is 126,349), from a local tokenizer.json."""
  return dict(kind="hf_json", path="")


def paper_sources():
  """MATH §1.4 document sampling probabilities. ``heldout_skip`` draws the held-out set deep in each
  stream, past what training consumes (the seed says ~0.8M–4M documents; the split is our choice)."""
  def source(weight, heldout_skip, kind="parquet"):
    return dict(kind=kind, path="", weight=weight, heldout_skip=heldout_skip)
  return {"fineweb": source(0.52, 4_000_000), "starcoder": source(0.28, 2_000_000),
          "culturax_zh": source(0.11, 1_000_000), "fineweb_edu": source(0.06, 800_000),
          "openwebmath": source(0.015, 800_000), "finemath": source(0.015, 800_000)}


def paper_data():
  return dict(seq_len=2048)


def paper_heldout():
  return dict(seed=4321, num_sequences=256)


def paper_train(steps: int = 152_588, learning_rate: float = 6e-4, warmup_steps: int = 500, **extra):
  train = dict(steps=steps, batch_size=32, learning_rate=learning_rate, warmup_steps=warmup_steps,
               min_lr_ratio=0.1, b1=0.9, b2=0.95, weight_decay=0.1, grad_clip=1.0, log_every=50,
               checkpoint_every=2000, keep_last=2, keep_every=20_000, eval_every=10_000, eval_batches=0)
  return {**train, **extra}


MODEL_184M = dict(vocab_size=126_349, d_model=768, n_layers=12, pattern="sanatan*12", mlp_hidden=2048,
                  max_positions=2048, tie_embeddings=True, dtype="bfloat16")


def _mixer(p: int, **fields):
  # Every variant trains at "auto" (sanatan_attention's REGISTRY): on GPUs the fused-chunk kernels for
  # p = 1 with 6 channels and the flash kernels for every other power and channel variant; elsewhere
  # XLA "chunked" and "parallel". docs/BENCHMARKS.md measures the whole steps.
  return dict(n_heads=12, head_dim=64, p=p, implementation="auto", **fields)


def _184m(p: int, train: dict, name: str, **mixer_fields):
  return common.experiment(
      model=MODEL_184M, mixers={"sanatan": _mixer(p, **mixer_fields)}, train=train, data=paper_data(),
      sources=paper_sources(), tokenizer=paper_tokenizer(), heldout=paper_heldout(),
      eval=dict(paired_a="parallel", gate_stats=True), name=name)


def sanatan_184m_p2():
  return _184m(2, paper_train(), "sanatan_184m_p2")


def sanatan_184m_p1_adapt():
  # "Short warmup" in the seed: 100 steps (our choice). Fresh optimizer state; data continues.
  train = paper_train(steps=9_613, learning_rate=6e-5, warmup_steps=100,
                      init_from="runs/sanatan_184m_p2", init_data_from="runs/sanatan_184m_p2",
                      checkpoint_every=1000, keep_every=0, eval_every=0)
  return _184m(1, train, "sanatan_184m_p1_adapt")


def sanatan_184m_p1_scratch():
  return _184m(1, paper_train(), "sanatan_184m_p1_scratch")


# The reproduction chain (scripts/reproduce.py): the 184M recipe at 8 layers of 512 (34,619,904
# parameters) on one GPU, on a corpus of C sources in REPRO_CORPUS (ArrayRecord shards with
# one source file per document, a SentencePiece tokenizer of 16,384 pieces). Stage 1's steps are the one
# knob (``repro_steps``); ``REPRO_TINY`` is the same chain at the scale of a CPU test.
REPRO_CORPUS = "runs/linux"
REPRO_WORKDIR = "runs/reproduce"
REPRO_LENGTHS = (0.25, 0.5, 0.75, 1.0)  # fractions of stage 1 at which the chain reads the model out
REPRO_SEEDS = (0, 1)  # every run of the chain at each: model initialisation and data order (train.seed)
ADAPT_FRACTION = 0.06  # stage 2's steps per step it adapts (the 184M schedule: 9,613 / 152,588 = 0.063)
STAGE1_WARMUP = 0.02  # of stage 1's steps (and of every control's)
STAGE2_WARMUP = 0.05  # of stage 2's steps: "a short warmup" (our choice)
MAX_KEPT_CHECKPOINTS = 20  # stage-1 steps kept for the readouts, at most


@dataclasses.dataclass(frozen=True)
class ReproScale:
  """What the GPU chain and its CPU test form set differently. ``p1_implementation`` and
  ``gla_implementation``: SANATAN p = 1's and GLA's forms; ``saves``: checkpoints per run; ``evals``:
  held-out evaluations during a run as long as stage 1 (0: only at the end); ``token_cache``: the corpus
  tokenized once for every run of the chain (``data.token_cache``)."""

  model: dict
  n_heads: int
  head_dim: int
  seq_len: int
  batch_size: int
  learning_rate: float
  stage1_steps: int
  heldout_sequences: int
  worker_count: int
  token_cache: bool
  p1_implementation: str
  gla_implementation: str
  log_every: int
  saves: int
  evals: int


REPRO_CORPUS_VOCAB = 16_384  # the corpus tokenizer's pieces (the model's vocabulary on that corpus)
REPRO_GPU = ReproScale(
    model=dict(vocab_size=REPRO_CORPUS_VOCAB, d_model=512, n_layers=8, mlp_hidden=1408, max_positions=1024,
               tie_embeddings=True, dtype="bfloat16"),
    n_heads=8, head_dim=64, seq_len=1024, batch_size=32, learning_rate=6e-4, stage1_steps=4_000,  # 131M tokens
    heldout_sequences=256, worker_count=8, token_cache=True, p1_implementation="auto", gla_implementation="auto",
    log_every=50, saves=8, evals=4)
REPRO_TINY = ReproScale(
    model=dict(vocab_size=8192, d_model=64, n_layers=1, mlp_hidden=192, max_positions=64, dtype="float32"),
    n_heads=4, head_dim=16, seq_len=64, batch_size=4, learning_rate=3e-3, stage1_steps=4,
    heldout_sequences=8, worker_count=0, token_cache=False, p1_implementation="parallel",
    gla_implementation="parallel", log_every=4, saves=1, evals=0)


def adapt_steps(steps: int) -> int:
  """Stage 2's steps when it adapts a stage 1 of ``steps`` steps: ADAPT_FRACTION of them, at least 1."""
  return max(1, round(ADAPT_FRACTION * steps))


def repro_steps(stage1_steps: int) -> dict[str, int]:
  """Every step count of the chain: stage 2 adapts the whole stage 1; the controls (p = 1 from scratch,
  softmax, GLA) train as many tokens as stage 1 and stage 2 together."""
  stage2 = adapt_steps(stage1_steps)
  return {"stage1": stage1_steps, "stage2": stage2, "scratch": stage1_steps + stage2}


def length_steps(stage1_steps: int, lengths=REPRO_LENGTHS) -> tuple[int, ...]:
  """The stage-1 steps of the fractions ``lengths`` (each in (0, 1]), sorted and distinct."""
  bad = [f for f in lengths if not 0 < f <= 1]
  if bad or not lengths:
    raise ConfigError(f"lengths {list(lengths)}: give fractions of stage 1 in (0, 1], e.g. 0.25,0.5,1.")
  return tuple(sorted({max(1, round(f * stage1_steps)) for f in lengths}))


def stage1_checkpointing(stage1_steps: int, lengths=REPRO_LENGTHS, saves: int = REPRO_GPU.saves) -> dict[str, int]:
  """``checkpoint_every`` and ``keep_every`` of stage 1: each step of ``lengths`` is saved and kept
  (keep_every is their greatest common divisor; the last step is always kept as the latest)."""
  every = max(1, stage1_steps // saves)
  inner = [s for s in length_steps(stage1_steps, lengths) if s < stage1_steps]
  if not inner:
    return {"checkpoint_every": every, "keep_every": 0}
  keep = math.gcd(*inner)
  if stage1_steps // keep > MAX_KEPT_CHECKPOINTS:
    raise ConfigError(f"lengths {list(lengths)} of {stage1_steps} stage-1 steps are steps {inner}, whose "
                      f"common divisor {keep} would keep {stage1_steps // keep} checkpoints; choose fractions "
                      f"on a coarser grid (multiples of 1/{MAX_KEPT_CHECKPOINTS} at most), e.g. 0.25,0.5,1.")
  return {"checkpoint_every": math.gcd(keep, every), "keep_every": keep}


def _repro_train(scale: ReproScale, steps: int, eval_every: int, *, learning_rate: float | None = None,
                 warmup: float = STAGE1_WARMUP, **extra):
  fields = dict(batch_size=scale.batch_size, log_every=scale.log_every, checkpoint_every=max(1, steps // scale.saves),
                keep_every=0, eval_every=eval_every)
  # A run shorter than one warmup step starts at the peak (warmup 0): its first step would train at 0.
  return paper_train(steps=steps, learning_rate=learning_rate or scale.learning_rate,
                     warmup_steps=round(warmup * steps), **{**fields, **extra})


def _control_eval_every(scale: ReproScale, stage1_steps: int) -> int:
  """Held-out evaluations at the same steps in every run as long as stage 1 (plot points)."""
  return stage1_steps // scale.evals if scale.evals else 0


def repro_experiment(mixers: dict[str, dict], train: dict, scale: ReproScale, corpus: str | None, name: str,
                     eval: dict | None = None, **model):
  """One run of the chain on the scale's backbone with ``model``'s fields changed (one mixer kind: in
  every layer unless ``model`` gives a pattern), on ``corpus`` (its ``shards/*.array_record`` and
  ``tokenizer.model``; None: the embedded corpus and tokenizer)."""
  n_layers = model.get("n_layers", scale.model["n_layers"])
  every_layer = {"pattern": f"{next(iter(mixers))}*{n_layers}"} if len(mixers) == 1 else {}
  model = {**scale.model, **every_layer, **model}
  sources = tokenizer = None
  if corpus:
    model["vocab_size"] = REPRO_CORPUS_VOCAB
    sources = {"linux": dict(kind="array_record", path=f"{corpus}/shards/*.array_record", heldout_fraction=0.01)}
    tokenizer = dict(kind="sentencepiece", path=f"{corpus}/tokenizer.model")
  data = dict(seq_len=scale.seq_len, worker_count=scale.worker_count, token_cache=scale.token_cache)
  return common.experiment(
      model=model, mixers=mixers, train=train, data=data,
      sources=sources, tokenizer=tokenizer, heldout=dict(paper_heldout(), num_sequences=scale.heldout_sequences),
      eval=eval, name=name)


def _repro_sanatan(p: int, scale: ReproScale, train: dict, corpus: str | None, name: str, *, table: bool = True,
                   reported: bool = False):
  """``reported``: a run whose evaluation the chain's tables show (stage 1: root-gate statistics; stage 2:
  those and parallel against recurrent on the same sequences); the controls report the loss alone."""
  # p = 2 at "parallel" on every backend: the form docs/REPRODUCTION.md's runs trained with.
  implementation = "parallel" if p > 1 else scale.p1_implementation
  # At 35M parameters memory is no limit: the chunked form keeps its residuals (no recomputation).
  mixer = dict(n_heads=scale.n_heads, head_dim=scale.head_dim, p=p, implementation=implementation,
               chunked_remat=False)
  # p = 2 has no recurrent form to pair with; p = 1 is checked parallel against recurrent.
  evaluation = dict(paired=reported and p == 1, paired_a="parallel", gate_stats=reported)
  positions = {} if table else {"max_positions": 0}  # without the table, SANATAN's rotation carries position
  return repro_experiment({"sanatan": mixer}, train, scale, corpus, name, eval=evaluation, **positions)


def repro_p2(stage1_steps: int | None = None, lengths=REPRO_LENGTHS, scale: ReproScale = REPRO_GPU,
             corpus: str | None = REPRO_CORPUS):
  """Stage 1: p = 2, keeping the checkpoints of the stage-1 ``lengths`` the chain reads out."""
  steps = stage1_steps or scale.stage1_steps
  train = _repro_train(scale, steps, _control_eval_every(scale, steps),
                       **stage1_checkpointing(steps, lengths, scale.saves))
  return _repro_sanatan(2, scale, train, corpus, "sanatan_repro_p2", reported=True)


def repro_p1_adapt(from_steps: int | None = None, init_from: str = f"{REPRO_WORKDIR}/p2",
                   scale: ReproScale = REPRO_GPU, corpus: str | None = REPRO_CORPUS):
  """Stage 2: p = 1 from stage 1's parameters at step ``from_steps`` (the latest step of ``init_from``),
  continuing its data stream, for ``adapt_steps(from_steps)`` steps at a tenth of stage 1's learning
  rate, with a fresh optimizer state."""
  steps = adapt_steps(from_steps or scale.stage1_steps)
  train = _repro_train(scale, steps, 0, learning_rate=scale.learning_rate / 10, warmup=STAGE2_WARMUP,
                       init_from=init_from, init_data_from=init_from)
  return _repro_sanatan(1, scale, train, corpus, "sanatan_repro_p1_adapt", reported=True)


def repro_control(stage1_steps: int | None, scale: ReproScale) -> dict:
  """The training of every control: stage 1 + stage 2 steps, stage 1's learning rate and warmup."""
  stage1 = stage1_steps or scale.stage1_steps
  return _repro_train(scale, repro_steps(stage1)["scratch"], _control_eval_every(scale, stage1))


def repro_p1_scratch(stage1_steps: int | None = None, scale: ReproScale = REPRO_GPU,
                     corpus: str | None = REPRO_CORPUS):
  """Control: p = 1 from scratch for as many tokens as stage 1 and stage 2 together."""
  return _repro_sanatan(1, scale, repro_control(stage1_steps, scale), corpus, "sanatan_repro_p1_scratch")


def repro_p2_no_table(stage1_steps: int | None = None, scale: ReproScale = REPRO_GPU,
                      corpus: str | None = REPRO_CORPUS):
  """Position ablation of stage 1: p = 2 for stage 1's steps and schedule without the learned table."""
  steps = stage1_steps or scale.stage1_steps
  train = _repro_train(scale, steps, _control_eval_every(scale, steps))
  return _repro_sanatan(2, scale, train, corpus, "sanatan_repro_p2_no_table", table=False)


def repro_p1_scratch_no_table(stage1_steps: int | None = None, scale: ReproScale = REPRO_GPU,
                              corpus: str | None = REPRO_CORPUS):
  """Position ablation of the p = 1 control: the same run without the learned table."""
  return _repro_sanatan(1, scale, repro_control(stage1_steps, scale), corpus, "sanatan_repro_p1_scratch_no_table",
                        table=False)


ABLATION_STEPS = 15_259  # 1B tokens
ABLATIONS = {
    "p2": dict(p=2), "no_omega": dict(p=2, learn_omega=False), "no_lambda": dict(p=2, rotate=False),
    "p4": dict(p=4), "4ch_p2": dict(p=2, channels=4), "4ch_p4": dict(p=4, channels=4),
    "3ch_legacy": dict(p=2, channels=3, three_channel="legacy"),
    "3ch_clean": dict(p=2, channels=3, three_channel="clean"),
}


def _ablation(name: str):
  fields = dict(ABLATIONS[name])
  p = fields.pop("p")
  return lambda: _184m(p, paper_train(steps=ABLATION_STEPS), f"sanatan_ablate_{name}",
                       **fields)


TINY_MIXER = dict(n_heads=8, head_dim=16)


def tiny(p: int = 2, **train):
  implementation = "parallel"
  return common.experiment(
      model=dict(common.TINY_MODEL, pattern="sanatan*4", max_positions=common.TINY_DATA["seq_len"]),
      mixers={"sanatan": dict(TINY_MIXER, p=p, implementation=implementation)},
      train=dict(common.TINY_TRAIN, **train), data=common.TINY_DATA, heldout=common.TINY_HELDOUT,
      eval=dict(paired_a="parallel", gate_stats=True))


PRESETS = {
    "tiny": lambda: tiny(2, steps=600, batch_size=8),
    "tiny_p1_adapt": lambda: tiny(1, steps=150, batch_size=8, learning_rate=3e-4, warmup_steps=15),
    "tiny_p1_scratch": lambda: tiny(1),
    "184m_p2": sanatan_184m_p2,
    "184m_p1_adapt": sanatan_184m_p1_adapt,
    "184m_p1_scratch": sanatan_184m_p1_scratch,
    "repro_p2": repro_p2,
    "repro_p1_adapt": repro_p1_adapt,
    "repro_p1_scratch": repro_p1_scratch,
    "repro_p2_no_table": repro_p2_no_table,
    "repro_p1_scratch_no_table": repro_p1_scratch_no_table,
    **{f"ablate_{name}": _ablation(name) for name in ABLATIONS},
}


def get_config(arg: str | None = None):
  return common.select(PRESETS, arg)
