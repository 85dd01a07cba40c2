"""The plain forms (reference.py) pass the shared checks of ``SanatanAttentionTestBase``."""

from .test_base import SanatanAttentionTestBase


class TestParallel(SanatanAttentionTestBase):
  implementation = "reference"  # reference.parallel
  future_power = (4, 6, "clean")
  packed_power = 4


class TestRecurrent(SanatanAttentionTestBase):
  implementation = "recurrent"
