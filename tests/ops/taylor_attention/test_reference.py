"""The plain forms (reference.py): the materialised T x T form and the token-by-token scan pass the
shared checks of ``test_base``, each against the other."""

from .test_base import TaylorAttentionTestBase


class TestParallel(TaylorAttentionTestBase):
  implementation = "parallel"


class TestRecurrent(TaylorAttentionTestBase):
  implementation = "recurrent"
  reference_implementation = "parallel"
