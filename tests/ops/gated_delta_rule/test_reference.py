"""The token-by-token scan (reference.py): the shared checks of ``test_base``, compared with the
chunked form."""

from .test_base import GatedDeltaRuleTestBase


class TestRecurrent(GatedDeltaRuleTestBase):
  implementation = "recurrent"
  reference_implementation = "chunked"
