"""Trains a SentencePiece BPE tokenizer on your own corpus.

  python scripts/train_tokenizer.py --input='corpus/*.txt' --kind=text --vocab_size=8192 \\
      --output=tokenizers/corpus.model

Documents are sampled in a seeded random order up to --max_documents / --max_chars (a corpus of any
size trains in bounded memory). Byte fallback (any text encodes), identity normalisation (text
round-trips), fixed ids: <unk> 0, <s> 1, </s> 2 (EOS, the document separator), <pad> 3, "\\n" 4.
Documents the training run holds out by default (--heldout_fraction, the same hash of file path and
index as data.sources.<name>.heldout_fraction; give the same glob) are left out of tokenizer training,
and tokens per character is measured on them. Then train with

  --config.data.tokenizer.kind=sentencepiece --config.data.tokenizer.path=tokenizers/corpus.model
  --config.model.vocab_size=8192
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmcore import cli  # noqa: E402
from lmcore.data.config import DEFAULT_HELDOUT_FRACTION  # noqa: E402
from lmcore.data.corpus_tokenizer import KINDS, train_corpus_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", required=True, help="glob of corpus files (quote it)")
  parser.add_argument("--kind", required=True, choices=KINDS,
                      help="text: a document per file; jsonl: per line; parquet: per row; array_record: per record")
  parser.add_argument("--output", required=True, help="where the .model file goes")
  parser.add_argument("--vocab_size", type=int, default=8192)
  parser.add_argument("--text_key", default="text", help="jsonl key or parquet column holding the text")
  parser.add_argument("--max_documents", type=int, default=1_000_000, help="documents sampled at most")
  parser.add_argument("--max_chars", type=int, default=20_000_000, help="characters sampled at most")
  parser.add_argument("--heldout_fraction", type=float, default=DEFAULT_HELDOUT_FRACTION,
                      help="documents left out as the training run's held-out set would be (0: none)")
  parser.add_argument("--seed", type=int, default=0, help="sampling order")
  parser.add_argument("--num_threads", type=int, default=os.cpu_count() or 1,
                      help="trainer threads; the model depends on it (1 is reproducible everywhere)")
  args = parser.parse_args(argv)
  with cli.user_errors():
    report = train_corpus_tokenizer(
        args.input, args.output, kind=args.kind, vocab_size=args.vocab_size, text_key=args.text_key,
        max_documents=args.max_documents, max_chars=args.max_chars, heldout_fraction=args.heldout_fraction,
        seed=args.seed, num_threads=args.num_threads)
    print("\n".join(report.lines()), flush=True)


if __name__ == "__main__":
  main()
