"""SANATAN (MATH §1): root-parity gated angular attention, two-stage p=2 -> p=1 schedule.

Presets:
  tiny, tiny_p1_adapt, tiny_p1_scratch   embedded corpus, 2 CPU cores (the quick start chains them)
  184m_p2                                stage 1: p = 2, 10B tokens (152,588 steps of 65,536 tokens)
  184m_p1_adapt                          stage 2: p = 1 from the stage-1 parameters, LR 6e-5, 0.63B
                                         tokens (9,613 steps), continuing the stage-1 data stream
  184m_p1_scratch                        control: p = 1 from scratch
  ablate_<name>                          1B-token ablations (15,259 steps): p2 (6ch p=2), no_omega,
                                         no_lambda, p4 (6ch p=4), 4ch_p2, 4ch_p4, 3ch_legacy, 3ch_clean

Stage 2 reads stage 1 from ``train.init_from`` (default ``runs/sanatan_184m_p2``; override it):

    python train.py --config=configs/sanatan.py:184m_p1_adapt --workdir=runs/sanatan_184m_p1 \
        --config.train.init_from=runs/sanatan_184m_p2 --config.train.init_data_from=runs/sanatan_184m_p2

Every ablation is also an override of the base preset, e.g. ``--config.model.mixers.sanatan.channels=4``.
"""

from configs import common

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
  # p = 1 trains with the chunked constant-state form, "auto": the Pallas kernel on GPU, XLA chunked
  # elsewhere; p >= 2 with the materialised parallel form, the fastest where its T×T scores fit
  # (3.3–6.8× XLA blocked at T ≤ 8192, the blocked kernel 1.2–2.6×; micro-batches of 8 sequences
  # keep them in memory).
  implementation = "auto" if p == 1 and fields.get("channels", 6) == 6 else "parallel"
  return dict(n_heads=12, head_dim=64, p=p, implementation=implementation, **fields)


def _184m(p: int, train: dict, name: str, **mixer_fields):
  return common.experiment(
      model=MODEL_184M, mixers={"sanatan": _mixer(p, **mixer_fields)}, train=train, data=paper_data(),
      sources=paper_sources(), tokenizer=paper_tokenizer(), heldout=paper_heldout(),
      eval=dict(paired_a="parallel", gate_stats=True), name=name)


def sanatan_184m_p2():
  return _184m(2, paper_train(grad_accum=4), "sanatan_184m_p2")


def sanatan_184m_p1_adapt():
  # "Short warmup" in the seed: 100 steps (our choice). Fresh optimizer state; data continues.
  train = paper_train(steps=9_613, learning_rate=6e-5, warmup_steps=100,
                      init_from="runs/sanatan_184m_p2", init_data_from="runs/sanatan_184m_p2",
                      checkpoint_every=1000, keep_every=0, eval_every=0)
  return _184m(1, train, "sanatan_184m_p1_adapt")


def sanatan_184m_p1_scratch():
  return _184m(1, paper_train(), "sanatan_184m_p1_scratch")


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
  return lambda: _184m(p, paper_train(steps=ABLATION_STEPS, grad_accum=4), f"sanatan_ablate_{name}",
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
    **{f"ablate_{name}": _ablation(name) for name in ABLATIONS},
}


def get_config(arg: str | None = None):
  return common.select(PRESETS, arg)
