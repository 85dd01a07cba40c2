"""Baseline mixers in the shared backbone (MATH §3, §4).

Presets: ``tiny`` (softmax) and ``<mixer>_tiny`` for every baseline (embedded corpus, 2 CPU cores);
``gla_182m`` (the SANATAN paper's GLA reference: FLA's layer, 4 heads, 182,217,984 params tied at
vocab 126,349) and ``gla_182m_12heads`` (MATH §4's exact 182,216,448);
``cyfa_equal_state`` / ``gdn_equal_state`` (CyFA vs Gated DeltaNet at equal recurrent state, MATH §3);
``hybrid_cyfa_gdn`` (CyFA in the lower layers, Gated DeltaNet in the upper ones);
``repro_softmax`` / ``repro_gla`` (the controls of scripts/reproduce.py, at the size and tokens of
``configs/sanatan.py:repro_p1_scratch``).

    python train.py --config=configs/baselines.py:gla_tiny --workdir=runs/gla_tiny
"""

from configs import common
from configs.sanatan import (REPRO_CORPUS, REPRO_GPU, ReproScale, paper_data, paper_heldout, paper_sources,
                             paper_tokenizer, paper_train, repro_control, repro_experiment)


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


def repro_softmax(stage1_steps: int | None = None, scale: ReproScale = REPRO_GPU,
                  corpus: str | None = REPRO_CORPUS):
  """The reproduction chain's softmax control (scripts/reproduce.py): SANATAN's backbone and heads,
  positions from its learned table (no RoPE), as many tokens as SANATAN's stage 1 + stage 2."""
  mixer = dict(n_heads=scale.n_heads, head_dim=scale.head_dim, rope=False)
  return repro_experiment("softmax", mixer, repro_control(stage1_steps, scale), scale, corpus, "softmax_repro",
                          eval=dict(paired=False))


def repro_gla(stage1_steps: int | None = None, scale: ReproScale = REPRO_GPU, corpus: str | None = REPRO_CORPUS):
  """The chain's GLA control, ``gla_182m`` at the chain's width: FLA's layer with 4 heads, no position
  table, norm eps 1e-6; the same tokens as the softmax control."""
  mixer = dict(n_heads=4, implementation="auto", chunked_remat=False)  # as SANATAN's: no recomputation
  return repro_experiment("gla", mixer, repro_control(stage1_steps, scale), scale,
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
    "repro_softmax": repro_softmax,
    "repro_gla": repro_gla,
}


def get_config(arg: str | None = None):
  return common.select(PRESETS, arg)
