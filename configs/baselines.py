"""Baseline mixers in the shared backbone (MATH §3, §4).

Presets: ``tiny`` (softmax) and ``<mixer>_tiny`` for every baseline (embedded corpus, 2 CPU cores);
``transformer_pp_<size>``: Transformer++ (softmax attention with RoPE, SwiGLU, RMSNorm, no position
table), the softmax reference of every comparison: ``transformer_pp_184m`` (SANATAN 184M's width,
vocabulary, data and tokens), ``transformer_pp_360m`` / ``transformer_pp_1p3b`` (the BASED paper's
Transformer++ rows on its recipe, 10B tokens; ``transformer_pp_1p3b_50b`` its reported 50B-token row),
``transformer_pp_repro`` (the reproduction chain's size and tokens);
``gla_182m`` (the SANATAN paper's GLA reference: FLA's layer, 4 heads, 182,217,984 params tied at
vocab 126,349) and ``gla_182m_12heads`` (MATH §4's exact 182,216,448);
``cyfa_equal_state`` / ``gdn_equal_state`` (CyFA vs Gated DeltaNet at equal recurrent state, MATH §3);
``hybrid_cyfa_gdn`` (CyFA in the lower layers, Gated DeltaNet in the upper ones);
``repro_gla``, ``repro_softmax_table`` (softmax with the learned table, no RoPE) and
``repro_softmax_nope`` (neither): the controls and position ablations of scripts/reproduce.py, at the
size and tokens of ``configs/sanatan.py:repro_p1_scratch``.

    python train.py --config=configs/baselines.py:gla_tiny --workdir=runs/gla_tiny
"""

from configs import based, common
from configs.sanatan import (MODEL_184M, REPRO_CORPUS, REPRO_GPU, ReproScale, paper_data, paper_heldout,
                             paper_sources, paper_tokenizer, paper_train, repro_control, repro_experiment)


def _tiny(kind: str, **mixer_fields):
  return lambda: common.experiment(
      model=dict(common.TINY_MODEL, pattern=f"{kind}*4"), mixers={kind: mixer_fields},
      train=common.TINY_TRAIN, data=common.TINY_DATA, heldout=common.TINY_HELDOUT)


def gla_182m(n_heads: int = 4):
  """FLA GLA layer defaults at hidden 768 (4 heads, expand_k 0.5, expand_v 1, gate rank 16):
  182,217,984 parameters tied. MATH §4's 182,216,448 is the same model with 12 heads (its output
  group-norm weight has 64 entries instead of 192): preset ``gla_182m_12heads`` (docs/DECISIONS.md)."""
  return common.experiment(
      model=dict(vocab_size=126_349, d_model=768, n_layers=12, pattern="gla*12", mlp_hidden=2048,
                 norm_eps=1e-6, tie_embeddings=True, dtype="bfloat16"),
      mixers={"gla": {"n_heads": n_heads, "implementation": "auto"}}, train=paper_train(), data=paper_data(),
      sources=paper_sources(), tokenizer=paper_tokenizer(), heldout=paper_heldout(),
      name=f"gla_182m_{n_heads}heads")


def transformer_pp_184m():
  """Transformer++ at SANATAN 184M's width (12 × 768, 12 heads of 64, SwiGLU 2048, tied), vocabulary,
  data, schedule and tokens: 181,989,888 parameters (SANATAN's less its position table, ω and λ)."""
  model = dict(MODEL_184M, pattern="softmax*12", max_positions=0)
  return common.experiment(
      model=model, mixers={"softmax": dict(n_heads=12, head_dim=64, rope=True)}, train=paper_train(),
      data=paper_data(), sources=paper_sources(), tokenizer=paper_tokenizer(), heldout=paper_heldout(),
      name="transformer_pp_184m")


# The BASED paper's Transformer++ rows (its released attention configs): GPT-2 BPE padded to a multiple
# of 16 (50,272), SwiGLU hidden 8 D / 3 rounded up to a multiple of 256, out projections scaled by
# 1 / sqrt(2 L), tied head, no position table. The released layer rotates half of each head; ours
# rotates all of it (the parameter count is the same).
TRANSFORMER_PP_SIZES = {
    "360m": dict(d_model=1024, n_layers=24, mlp_hidden=2816, n_heads=16),  # 359,810,048 parameters
    "1p3b": dict(d_model=1680, n_layers=36, mlp_hidden=4608, n_heads=24),  # 1,327,080,720 (heads of 70)
}
TRANSFORMER_PP_VOCAB = 50_272


def transformer_pp_based(size: str, budget: str = "10b"):
  """Transformer++ at a BASED size on BASED's recipe (``configs/based.py``: the Pile, AdamW 8e-4,
  256 × 2048 tokens per step, the budget's steps and warmup)."""
  spec = dict(TRANSFORMER_PP_SIZES[size])
  n_heads = spec.pop("n_heads")
  recipe = based.paper(size, budget)()
  return common.experiment(
      model=dict(spec, pattern=f"softmax*{spec['n_layers']}", vocab_size=TRANSFORMER_PP_VOCAB, norm_eps=1e-5,
                 tie_embeddings=True, init_std=0.02, scale_out_init=True, dtype="bfloat16"),
      mixers={"softmax": _softmax_mixer(n_heads, spec["d_model"] // n_heads)}, train=recipe.train.to_dict(),
      data={k: v for k, v in recipe.data.to_dict().items() if k not in ("sources", "tokenizer", "heldout")},
      sources=based.pile_sources(), tokenizer=based.gpt2_tokenizer(), heldout=recipe.data.heldout.to_dict(),
      mesh=recipe.mesh.to_dict(), name=f"transformer_pp_{size}_{budget}")


def _softmax_mixer(n_heads: int, head_dim: int) -> dict:
  # cuDNN's fused attention takes head dims that are multiples of 8; others (1.3B's 70) run XLA's.
  return dict(n_heads=n_heads, rope=True, **({} if head_dim % 8 == 0 else {"implementation": "xla"}))


def transformer_pp_repro(stage1_steps: int | None = None, scale: ReproScale = REPRO_GPU,
                         corpus: str | None = REPRO_CORPUS):
  """The reproduction chain's softmax reference: Transformer++ at the chain's size (the heads of
  SANATAN's runs, RoPE, no table), as many tokens as SANATAN's stage 1 + stage 2."""
  return _repro_softmax(stage1_steps, scale, corpus, "transformer_pp_repro", rope=True, table=False)


def repro_softmax_table(stage1_steps: int | None = None, scale: ReproScale = REPRO_GPU,
                        corpus: str | None = REPRO_CORPUS):
  """Position ablation: softmax attention with positions from the backbone's learned table, no RoPE
  (the positions SANATAN's runs have)."""
  return _repro_softmax(stage1_steps, scale, corpus, "softmax_table_repro", rope=False, table=True)


def repro_softmax_nope(stage1_steps: int | None = None, scale: ReproScale = REPRO_GPU,
                       corpus: str | None = REPRO_CORPUS):
  """Position ablation: softmax attention with neither a table nor RoPE (causal masking alone)."""
  return _repro_softmax(stage1_steps, scale, corpus, "softmax_nope_repro", rope=False, table=False)


def _repro_softmax(stage1_steps, scale: ReproScale, corpus, name: str, *, rope: bool, table: bool):
  mixer = dict(n_heads=scale.n_heads, head_dim=scale.head_dim, rope=rope)
  positions = {} if table else {"max_positions": 0}
  return repro_experiment({"softmax": mixer}, repro_control(stage1_steps, scale), scale, corpus, name,
                          eval=dict(paired=False), **positions)


def repro_gla(stage1_steps: int | None = None, scale: ReproScale = REPRO_GPU, corpus: str | None = REPRO_CORPUS):
  """The chain's GLA control, ``gla_182m`` at the chain's width: FLA's layer with 4 heads, no position
  table, norm eps 1e-6; the same tokens as the softmax control."""
  mixer = dict(n_heads=4, implementation=scale.gla_implementation, chunked_remat=False)  # as SANATAN's: no recomputation
  return repro_experiment({"gla": mixer}, repro_control(stage1_steps, scale), scale,
                          corpus, "gla_repro", max_positions=0, norm_eps=1e-6)


# Equal recurrent state (the CyFA article's rule, MATH §3): CyFA and GDN both carry S ∈ R^{128×128} per head, 4 heads at
# D = 512 (262,144 B per layer). Totals per layer differ slightly: CyFA also stores the op's key-sum
# slot z (264,192 B), GDN its short-conv windows (280,576 B); parameters 33.61M vs 33.65M. The model
# card printed at the start of every run (and scripts/model_card.py) shows all three numbers.
_EQUAL_STATE = dict(vocab_size=8192, d_model=512, n_layers=8, mlp_hidden=1536, dtype="bfloat16")


def cyfa_equal_state():
  return common.experiment(model=dict(_EQUAL_STATE, pattern="cyfa*8"),
                           mixers={"cyfa": dict(n_heads=4, head_dim=128, v_head_dim=128, implementation="auto")},
                           train=dict(steps=20_000, batch_size=64, learning_rate=1e-3), data=dict(seq_len=1024))


def gdn_equal_state():
  return common.experiment(model=dict(_EQUAL_STATE, pattern="gdn*8"),
                           mixers={"gdn": dict(n_heads=4, head_dim=128, v_head_dim=128)},
                           train=dict(steps=20_000, batch_size=64, learning_rate=1e-3), data=dict(seq_len=1024))


def hybrid_cyfa_gdn():
  """Seed 002's hybrid: gated accumulation in the lower layers, the delta rule in the upper ones."""
  return common.experiment(model=dict(_EQUAL_STATE, pattern="cyfa*6,gdn*2"),
                           mixers={"cyfa": dict(n_heads=4, head_dim=128, v_head_dim=128, implementation="auto"),
                                   "gdn": dict(n_heads=4, head_dim=128, v_head_dim=128)},
                           train=dict(steps=20_000, batch_size=64, learning_rate=1e-3), data=dict(seq_len=1024))


PRESETS = {
    "tiny": _tiny("softmax"),
    "softmax_tiny": _tiny("softmax"),
    "gla_tiny": _tiny("gla"),
    "gdn_tiny": _tiny("gdn"),
    "cyfa_tiny": _tiny("cyfa"),
    "linear_transformer_tiny": _tiny("linear_transformer"),
    "performer_tiny": _tiny("performer"),
    "cosformer_tiny": _tiny("cosformer"),
    "gla_182m": gla_182m,
    "gla_182m_12heads": lambda: gla_182m(12),
    "cyfa_equal_state": cyfa_equal_state,
    "gdn_equal_state": gdn_equal_state,
    "hybrid_cyfa_gdn": hybrid_cyfa_gdn,
    "transformer_pp_184m": transformer_pp_184m,
    "transformer_pp_360m": lambda: transformer_pp_based("360m"),
    "transformer_pp_1p3b": lambda: transformer_pp_based("1p3b"),
    "transformer_pp_1p3b_50b": lambda: transformer_pp_based("1p3b", "50b"),
    "transformer_pp_repro": transformer_pp_repro,
    "repro_gla": repro_gla,
    "repro_softmax_table": repro_softmax_table,
    "repro_softmax_nope": repro_softmax_nope,
}


def get_config(arg: str | None = None):
  return common.select(PRESETS, arg)
