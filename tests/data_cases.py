"""Shared builders for the data tests."""


class CharTokenizer:
  """One id per character (ASCII test documents), EOS = 0: a window decodes back to the text it holds."""

  name = "chars"
  vocab_size = 128
  eos_id = 0

  def encode(self, text: str) -> list[int]:
    return [ord(c) for c in text]

  def decode(self, ids) -> str:
    return "".join(chr(i) for i in ids)
