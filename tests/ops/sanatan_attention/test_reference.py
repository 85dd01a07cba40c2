"""The plain forms (reference.py): ``recurrent`` (a backend, the decode path) passes the shared checks
of ``SanatanAttentionTestBase``, and the materialised reference itself is causal and keeps packed
documents apart at a power."""

from .test_base import SanatanAttentionTestBase


class TestRecurrent(SanatanAttentionTestBase):
  implementation = "recurrent"


class TestReferenceAtAPower(SanatanAttentionTestBase):
  """``reference.parallel``: the comparisons with itself skip; causality and documents are checked."""

  implementation = "reference"
  variant = (4, 6, "clean")
