"""``implementation="auto"`` picks Pallas on GPU and XLA elsewhere (TPU included), per op and mixer;
on a GPU only at heads no wider than a kernel was measured to win at, XLA for wider ones.

Resolvers are checked with ``pallas_utils.backend`` patched to each platform; on this CPU host
"auto" must give exactly the outputs of the XLA form it resolves to, in the ops and in the mixers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from based_jax.mixers import TaylorLinearAttention
from based_jax.ops.taylor_attention import api as taylor
from lmcore.mixers import GLA
from lmcore.ops.common import pallas_utils
from lmcore.ops.gated_delta_rule import api as delta
from lmcore.ops.gated_linear_attention import api as gated
from lmcore.registry import mixer_class
from lmcore.mixers.base import InitSpec
from lmcore.numerics import relative_l2
from sanatan_jax.ops.sanatan_attention import api as sanatan
from sanatan_jax.mixer import SanatanMixer

D = 16


@pytest.fixture
def on(monkeypatch):
  """``on("gpu")`` makes every resolver see that platform."""
  return lambda platform: monkeypatch.setattr(pallas_utils, "backend", lambda: platform)


def _normal(seed, *shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.mark.parametrize("platform,expected", [("gpu", "pallas"), ("cpu", "chunked"),
                                               ("tpu", "chunked")])
def test_default_and_gated_pick_pallas_only_on_gpu(on, platform, expected):
  on(platform)
  assert pallas_utils.default_implementation() == expected
  assert gated.resolve_implementation("auto") == gated.resolve_implementation(None) == expected
  assert gated.resolve_implementation("recurrent") == "recurrent"


@pytest.mark.parametrize("key_dim,value_dim,expected", [
    (64, 64, "pallas"), (32, 64, "pallas"), (128, 128, "pallas"), (96, 192, "pallas"),
    (64, 128, "pallas"), (128, 256, "pallas"), (192, 384, "chunked"), (128, 257, "chunked"),
    (128, 512, "chunked"), (256, 64, "chunked")])
def test_gated_auto_keeps_heads_wider_than_measured_on_xla_on_gpu(on, key_dim, value_dim, expected):
  """The kernel beat XLA at every head up to 128 x 256 on the H200 (CyFA's 128 x 128, repro_gla's
  64 x 128, GLA 182M's 96 x 192, whose whole step is faster on it too) and lost at 128 x 512."""
  on("gpu")
  assert gated.resolve_implementation("auto", key_dim=key_dim, value_dim=value_dim) == expected


@pytest.mark.parametrize("key_dim,value_dim", [(256, 256), (256, 1024), (512, 128), (512, 512)])
def test_auto_is_xla_for_wide_heads_of_every_op_on_gpu(on, key_dim, value_dim):
  """At heads this wide no kernel was measured to beat XLA (or compiled), so on a GPU "auto" is each
  op's XLA form."""
  on("gpu")
  assert gated.resolve_implementation("auto", key_dim=key_dim, value_dim=value_dim) == "chunked"
  assert delta.resolve_implementation("auto", key_dim=key_dim, value_dim=value_dim) == "chunked"
  for p, xla in ((1, "chunked"), (2, "parallel")):
    assert sanatan.resolve_implementation("auto", p=p, head_dim=key_dim, value_dim=value_dim) == xla
  for length in (2048, 8192):  # Taylor's key width is d' (BASED: 16)
    for d, dv in ((16, 1024), (key_dim, 64)):
      assert taylor.resolve_implementation("auto", length=length, key_dim=d, value_dim=dv) == "chunked"
      assert taylor.resolve_implementation("auto", length=length, key_dim=d, value_dim=dv,
                                           segments=True) == "parallel"


@pytest.mark.parametrize("key_dim,value_dim,expected", [
    (16, 64, "pallas_blocked"), (8, 32, "pallas_blocked"), (16, 112, "pallas_blocked"),
    (16, 256, "pallas_blocked"), (32, 128, "pallas_blocked"), (64, 128, "pallas_blocked"),
    (16, 512, "pallas_fused"), (64, 512, "pallas"), (16, 1024, "chunked"), (128, 64, "chunked")])
def test_taylor_auto_keeps_heads_wider_than_measured_on_xla_on_gpu(on, key_dim, value_dim, expected):
  """At T = 2048 the blocked kernel beat XLA and the other kernels at d' up to 64 and dv up to 256
  (BASED 1.3B's 112 among them); at dv = 512 it does not fit in shared memory and the fused kernel
  runs (1.69 against the chunked kernel's 3.19 ms), or, at key dims the fused kernel does not take,
  the chunked one; wider heads take XLA."""
  on("gpu")
  assert taylor.resolve_implementation("auto", length=2048, key_dim=key_dim, value_dim=value_dim) == expected


@pytest.mark.parametrize("key_dim,value_dim,expected", [
    (16, 64, "pallas_fused"), (16, 112, "pallas_fused"), (16, 512, "pallas_fused"),
    (32, 128, "pallas_blocked"), (64, 64, "pallas_blocked"), (64, 512, "pallas")])
def test_taylor_auto_on_long_sequences_on_gpu(on, key_dim, value_dim, expected):
  """From T = 8192 the fused kernel runs at d' = 16 (H200, T = 8192: 2.25 / 3.34 / 2.27 ms at dv = 64 /
  112 / 512 against the chunked kernel's 4.65 / 6.30 / 3.14; GPU time 1.74 / 3.41 against the blocked
  kernel's 3.22 / 3.97 at dv = 64 / 112); wider keys keep the blocked kernel (3.74 against the fused
  kernel's 5.89 at 32 x 128), past its value width the chunked one."""
  on("gpu")
  for length in (8192, 32768):
    got = taylor.resolve_implementation("auto", length=length, key_dim=key_dim, value_dim=value_dim)
    assert got == expected


def _no_kernel(monkeypatch, module, *names):
  """Makes the kernels ``names`` of the op ``module`` fail if "auto" runs them."""
  def kernel(*args, **kwargs):
    raise AssertionError("auto ran a kernel at heads wider than it was measured at")
  for name in names:
    monkeypatch.setitem(module.IMPLEMENTATIONS, name, kernel)


def test_gated_auto_counts_the_normaliser_column_on_gpu(on, monkeypatch):
  """A normalised form's kernel is V + 1 wide: at V = KERNEL_MAX_VALUE "auto" runs XLA chunked on a
  GPU."""
  on("gpu")
  _no_kernel(monkeypatch, gated, "pallas")
  B, T, H, K, V = 1, 8, 1, 4, gated.KERNEL_MAX_VALUE
  phi = lambda seed: jax.nn.elu(_normal(seed, B, T, H, K)) + 1
  _same(gated.gated_linear_attention, "chunked", phi(0), phi(1), _normal(2, B, T, H, V), None,
        normalize=True, chunk_size=4)


def test_taylor_auto_runs_xla_for_wide_values_on_gpu(on, monkeypatch):
  """dv = 640 is wider than the kernels were measured to win at: "auto" runs XLA chunked on a GPU."""
  on("gpu")
  _no_kernel(monkeypatch, taylor, "pallas", "pallas_blocked", "pallas_fused")
  B, T, H, d, V = 1, 8, 1, 4, 640
  _same(taylor.taylor_linear_attention, "chunked", _normal(0, B, T, H, d), _normal(1, B, T, H, d),
        _normal(2, B, T, H, V), chunk_size=4)


def _abstract(cls, d_model: int, **fields):
  return nnx.eval_shape(lambda: cls(cls.Config(**fields), d_model=d_model, init=InitSpec(),
                                    rngs=nnx.Rngs(0)))


def test_flop_counts_follow_auto_by_head_shape():
  """The model card counts "auto" as it resolves on a GPU, head widths included: GLA with two heads
  at 768 (192 x 384) counts XLA chunked, GLA 182M's (96 x 192), narrower ones and BASED 1.3B's
  (d' = 16, dv = 112) the kernels."""
  def flops(cls, d_model, implementation, **fields):
    return _abstract(cls, d_model, implementation=implementation, **fields).flops_per_token(2048)

  assert flops(GLA, 768, "auto", n_heads=2) == flops(GLA, 768, "chunked", n_heads=2)
  assert flops(GLA, 768, "auto") == flops(GLA, 768, "pallas")
  assert flops(GLA, 768, "auto", n_heads=12) == flops(GLA, 768, "pallas", n_heads=12)
  assert flops(TaylorLinearAttention, 1792, "auto") == flops(TaylorLinearAttention, 1792, "pallas_blocked")
  assert flops(TaylorLinearAttention, 1024, "auto") == flops(TaylorLinearAttention, 1024, "pallas_blocked")


@pytest.mark.parametrize("platform,p,channels,expected", [
    ("gpu", 1, 6, "pallas_fused"), ("cpu", 1, 6, "chunked"), ("tpu", 1, 6, "chunked"),
    ("gpu", 2, 6, "pallas_flash"), ("cpu", 2, 6, "parallel"), ("tpu", 2, 6, "parallel"),
    ("gpu", 1, 4, "pallas_flash"), ("cpu", 1, 4, "parallel"),
])
def test_sanatan_resolver(on, platform, p, channels, expected):
  on(platform)
  assert sanatan.resolve_implementation("auto", p=p, channels=channels) == expected
  assert sanatan.resolve_implementation(None, p=p, channels=channels) == expected
  assert sanatan.resolve_implementation("parallel", p=p, channels=channels) == "parallel"


@pytest.mark.parametrize("head_dim,value_dim,expected", [(64, 64, "pallas_flash"), (32, 48, "pallas_flash"),
                                                         (128, 64, "parallel"), (64, 128, "parallel")])
def test_sanatan_auto_keeps_heads_wider_than_the_flash_tiles_on_xla_on_gpu(on, head_dim, value_dim, expected):
  """The flash kernels' tiles were compiled and timed at heads of 64; wider heads take XLA parallel."""
  on("gpu")
  assert sanatan.resolve_implementation("auto", p=2, head_dim=head_dim, value_dim=value_dim) == expected


@pytest.mark.parametrize("platform,length,decay,segments,expected", [
    ("gpu", 2048, False, False, "pallas_blocked"), ("gpu", 2048, False, True, "pallas_blocked"),
    ("gpu", 4096, False, False, "pallas_blocked"), ("gpu", 8191, False, True, "pallas_blocked"),
    ("gpu", 8192, False, False, "pallas_fused"), ("gpu", 8192, False, True, "pallas_fused"),
    ("gpu", 2048, True, False, "chunked"), ("gpu", 2048, True, True, "parallel"),
    ("cpu", 2048, False, False, "chunked"), ("cpu", 2048, False, True, "parallel"),
    ("tpu", 2048, False, False, "chunked"), ("tpu", 2048, True, True, "parallel"),
])
def test_taylor_resolver(on, platform, length, decay, segments, expected):
  on(platform)
  options = dict(length=length, decay=decay, segments=segments)
  assert taylor.resolve_implementation("auto", **options) == expected
  assert taylor.resolve_implementation("recurrent", **options) == "recurrent"


def _same(fn, implementation, *args, **kwargs):
  """fn(..., implementation="auto") and fn(..., implementation=implementation) agree exactly."""
  auto = jax.jit(lambda *a: fn(*a, implementation="auto", **kwargs))(*args)
  xla = jax.jit(lambda *a: fn(*a, implementation=implementation, **kwargs))(*args)
  jax.tree.map(np.testing.assert_array_equal, auto, xla)


@pytest.mark.parametrize("p,implementation", [(1, "chunked"), (2, "parallel")])
def test_sanatan_auto_on_cpu_is_its_xla_form(p, implementation):
  B, T, H, d = 2, 11, 2, 4
  args = (_normal(0, B, T, H, d) / 2, _normal(1, B, T, H, d) / 2, _normal(2, B, T, H, d),
          jnp.full((H, d), np.pi / 4), _normal(3, H, d))
  _same(sanatan.sanatan_attention, implementation, *args, p=p, chunk_size=4, block_size=4)


def test_gated_auto_on_cpu_is_chunked():
  B, T, H, K, V = 2, 11, 2, 4, 3
  log_forget = -jax.nn.softplus(_normal(3, B, T, H))
  _same(gated.gated_linear_attention, "chunked", _normal(0, B, T, H, K), _normal(1, B, T, H, K),
        _normal(2, B, T, H, V), log_forget, chunk_size=4)


@pytest.mark.parametrize("segmented,implementation", [(False, "chunked"), (True, "parallel")])
def test_taylor_auto_on_cpu_is_its_xla_form(segmented, implementation):
  B, T, H, d = 2, 11, 2, 4
  segment_ids = jnp.asarray([[0] * 5 + [1] * 6, [0] * 11]) if segmented else None
  _same(taylor.taylor_linear_attention, implementation, _normal(0, B, T, H, d),
        _normal(1, B, T, H, d), _normal(2, B, T, H, 3), chunk_size=4, segment_ids=segment_ids)


MIXERS = {  # kind -> (small config fields, the XLA implementation "auto" resolves to on CPU)
    "sanatan": (dict(n_heads=2, head_dim=4, chunk_size=4), "chunked"),
    "taylor": (dict(n_heads=2, feature_dim=4, chunk_size=4), "chunked"),
    "gla": (dict(n_heads=2, chunk_size=4), "chunked"),
    "cyfa": (dict(n_heads=2, head_dim=4, v_head_dim=4, chunk_size=4), "chunked"),
    "linear_transformer": (dict(n_heads=2, head_dim=4, chunk_size=4), "chunked"),
}


def _mixer(kind: str, implementation: str):
  cls = mixer_class(kind)
  return cls(cls.Config(**MIXERS[kind][0], implementation=implementation), d_model=D, init=InitSpec(),
             rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kind", MIXERS)
def test_mixer_built_with_auto_runs_its_xla_form_on_cpu(kind):
  implementation = MIXERS[kind][1]
  build = lambda name: _mixer(kind, name)
  x = _normal(0, 2, 9, D)
  y_auto, _ = nnx.jit(lambda m, x: m(x))(build("auto"), x)
  y_xla, _ = nnx.jit(lambda m, x: m(x))(build(implementation), x)
  np.testing.assert_array_equal(y_auto, y_xla)


@pytest.mark.parametrize("p,channels", [(1, 6), (2, 6), (4, 4), (2, 3)])
def test_sanatan_mixer_config_accepts_auto(p, channels):
  SanatanMixer.Config(p=p, channels=channels, implementation="auto")


@pytest.mark.parametrize("head_dim,kernel", [(16, True), (256, False)])
def test_sanatan_mixer_with_auto_lowers_to_the_fused_kernel_for_a_gpu(head_dim, kernel):
  """Lowered for an abstract H200, the "auto" p = 1 mixer's forward is the fused-chunk Triton kernel
  (measured faster) at heads up to 128 wide, and XLA chunked at wider heads."""
  mixer = SanatanMixer(SanatanMixer.Config(n_heads=2, head_dim=head_dim, implementation="auto"),
                       d_model=D, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(mixer)
  forward = lambda state, x: nnx.merge(graphdef, state)(x)[0]
  x = jax.ShapeDtypeStruct((1, 32, D), jnp.float32)
  assert ("xla.gpu.triton" in pallas_utils.lower_for_gpu(forward, state, x).as_text()) == kernel


@pytest.mark.parametrize("kind", ["gla", "cyfa"])
def test_gated_mixers_run_the_pallas_kernel_like_chunked(kind):
  """What "auto" gives GLA and CyFA on a GPU, interpreted here: the same outputs as XLA chunked."""
  x = _normal(1, 2, 9, D)
  y_pallas, _ = _mixer(kind, "pallas")(x)
  y_xla, _ = _mixer(kind, "chunked")(x)
  assert relative_l2(y_pallas, y_xla) <= 1e-5


def test_assume_backend_overrides_the_platform_inside_the_block_only():
  host = pallas_utils.backend()
  with pallas_utils.assume_backend("gpu"):
    assert pallas_utils.default_implementation() == "pallas"
    with pallas_utils.assume_backend("cpu"):  # blocks nest: the innermost wins
      assert sanatan.resolve_implementation("auto", p=1, channels=6) == "chunked"
    assert pallas_utils.backend() == "gpu"
  assert pallas_utils.backend() == host
