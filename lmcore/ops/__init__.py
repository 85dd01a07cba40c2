"""Sequence-mixing ops shared by every family: plain functions on arrays with an ``implementation=``
switch, one folder each (``api``, ``base``, ``reference``, ``xla``, ``pallas_triton``, ``pallas_mosaic_tpu``)."""
