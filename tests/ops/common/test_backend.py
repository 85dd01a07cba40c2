"""The registry every op shares (lmcore/ops/common/backend.py), on a toy op: "auto" takes the first
supported and preferred backend of the platform's list, a name is checked against the problem, errors
are one line listing what runs, tiles given as a mapping become the backend's typed tiling."""

import dataclasses

import pytest

from lmcore.errors import ConfigError
from lmcore.ops.common import pallas_utils
from lmcore.ops.common.backend import TRITON, Backend, ChunkTiles, Registry, check_power_of_two


@dataclasses.dataclass(frozen=True)
class Problem:
  platform: str
  width: int = 8

  def describe(self) -> str:
    return f"width {self.width} on {self.platform}"


@dataclasses.dataclass(frozen=True)
class Inner:
  block: int = 16
  warps: int = 4


@dataclasses.dataclass(frozen=True)
class KernelTiles:
  forward: Inner = Inner()
  spans: int = 1


class Kernel(Backend[KernelTiles]):
  platforms = TRITON
  tiles_type = KernelTiles
  requirement = "widths up to 64"

  def supports(self, problem):
    return problem.width <= 64

  def preferred(self, problem):
    return problem.width <= 32

  def heuristic_config(self, problem):
    return KernelTiles(Inner(block=min(problem.width, 16)))


class Plain(Backend[ChunkTiles]):
  tiles_type = ChunkTiles

  def heuristic_config(self, problem):
    return ChunkTiles(64)


class Scan(Backend[None]):
  pass


REGISTRY = Registry("toy", {"scan": Scan(), "plain": Plain(), "kernel": Kernel()},
                    auto={"gpu": ("kernel", "plain"), "tpu": ("plain",), "cpu": ("plain",)})


@pytest.mark.parametrize("platform,width,expected", [
    ("gpu", 8, "kernel"), ("gpu", 32, "kernel"), ("gpu", 48, "plain"), ("gpu", 128, "plain"),
    ("cpu", 8, "plain"), ("tpu", 8, "plain")])
def test_auto_takes_the_first_supported_and_preferred_backend_of_the_platform(platform, width, expected):
  problem = Problem(platform, width)
  assert REGISTRY.resolve_name("auto", problem) == REGISTRY.resolve_name(None, problem) == expected


def test_a_named_backend_runs_where_it_is_supported_even_if_auto_would_not_take_it():
  assert REGISTRY.resolve_name("kernel", Problem("gpu", 48)) == "kernel"
  assert REGISTRY.resolve_name("kernel", Problem("cpu", 8)) == "kernel"  # interpreted


def test_unknown_and_unsupported_names_are_one_line_listing_what_runs():
  with pytest.raises(ConfigError, match=r"^toy: unknown implementation 'fast'; for width 8 on tpu use one of "
                                        r"scan, plain, auto$"):
    REGISTRY.resolve("fast", Problem("tpu"))
  with pytest.raises(ConfigError, match=r"^toy: implementation 'kernel' does not run width 128 on gpu \(it needs "
                                        r"widths up to 64 on gpu or cpu\); use one of scan, plain, auto$"):
    REGISTRY.resolve("kernel", Problem("gpu", 128))
  with pytest.raises(ConfigError, match="valid: scan, plain, kernel or 'auto'"):
    REGISTRY.check_name("fast")


def test_tiles_from_a_mapping_become_the_named_backends_typed_tiling():
  tiles = REGISTRY.tiles("kernel", {"forward": {"warps": 8}, "spans": 2}, "toy tiles")
  assert tiles == KernelTiles(Inner(block=16, warps=8), spans=2)
  assert REGISTRY.tiles("plain", ChunkTiles(32), "toy tiles") == ChunkTiles(32)
  assert REGISTRY.tiles("auto", None, "toy tiles") is None


@pytest.mark.parametrize("implementation,value,message", [
    ("auto", {"chunk": 32}, r"toy tiles: tiles belong to one backend, but the implementation is 'auto'.*"
                            r"name one of plain, kernel"),
    ("scan", {"chunk": 32}, "toy tiles: implementation 'scan' has no tiles; backends with tiles: plain, kernel"),
    ("kernel", {"forward": {"wraps": 8}}, r"toy tiles.forward: Inner has no field 'wraps'; valid: block, warps"),
    ("plain", 32, "toy tiles: expected the fields of ChunkTiles as a mapping, got 32"),
    ("plain", {"chunk": 0}, "chunk must be a positive number of tokens"),
])
def test_bad_tiles_are_one_line_naming_the_field(implementation, value, message):
  with pytest.raises(ConfigError, match=message):
    REGISTRY.tiles(implementation, value, "toy tiles")


def test_a_backend_takes_its_own_tiles_or_its_heuristic():
  kernel, problem = REGISTRY.backends["kernel"], Problem("gpu", 8)
  assert kernel.config(problem, None) == KernelTiles(Inner(block=8))
  assert kernel.config(problem, KernelTiles(spans=4)).spans == 4
  with pytest.raises(ConfigError, match="do not fit Kernel, which takes a KernelTiles"):
    kernel.config(problem, ChunkTiles(16))
  with pytest.raises(ConfigError, match="do not fit Scan, which takes no tiles"):
    REGISTRY.backends["scan"].config(problem, ChunkTiles(16))


def test_power_of_two_checks_name_the_field():
  check_power_of_two("tiles", chunk=16, block=1)
  with pytest.raises(ConfigError, match="tiles: block_v must be a power of two, got 24"):
    check_power_of_two("tiles", chunk=16, block_v=24)


def test_assume_backend_sets_the_platform_inside_the_block_only():
  host = pallas_utils.backend()
  with pallas_utils.assume_backend("gpu"):
    assert pallas_utils.backend() == "gpu"
    with pallas_utils.assume_backend("tpu"):  # blocks nest: the innermost wins
      assert pallas_utils.backend() == "tpu"
    assert pallas_utils.backend() == "gpu"
  assert pallas_utils.backend() == host


def test_a_model_card_counts_auto_and_gpu_backends_on_a_gpu_and_others_on_their_own_platform():
  assert REGISTRY.counting_platform("auto") == REGISTRY.counting_platform("kernel") == "gpu"
  assert REGISTRY.counting_platform("plain") == "gpu"
  tpu_only = Registry("toy", {"plain": Plain(), "tpu": type("Tpu", (Backend,), {"platforms": ("tpu", "cpu")})()},
                      auto={"gpu": ("plain",), "tpu": ("plain",), "cpu": ("plain",)})
  assert tpu_only.counting_platform("tpu") == "tpu"
