"""Converts raw text / jsonl / parquet files into ArrayRecord shards (one utf-8 document per record).

  python scripts/prepare_data.py --input='raw/*.jsonl' --output_dir=data/web --kind=jsonl --text_key=text

Then train on them with ``data.sources[i].kind='array_record'`` and ``path='data/web/*.array_record'``.
"""

import argparse

from lmcore import cli
from lmcore.data.convert import CONVERTIBLE_KINDS, DEFAULT_WRITER_OPTIONS, convert_to_array_record


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--input", required=True, help="glob of input files (quote it)")
  parser.add_argument("--output_dir", required=True, help="folder for the .array_record shards")
  parser.add_argument("--kind", required=True, choices=CONVERTIBLE_KINDS,
                      help="text: a document per file; jsonl: per line; parquet: per row")
  parser.add_argument("--text_key", default="text", help="jsonl key or parquet column holding the text")
  parser.add_argument("--docs_per_shard", type=int, default=100_000)
  parser.add_argument("--prefix", default="docs", help="shard file name prefix")
  parser.add_argument("--shuffle_seed", type=int, default=None,
                      help="read the files in this seeded random order (default: sorted), so that every "
                           "shard is a uniform sample of them")
  parser.add_argument("--writer_options", default=DEFAULT_WRITER_OPTIONS,
                      help="ArrayRecord writer options; 'group_size:1,uncompressed' leaves compression to "
                           "an external tool (xz shrinks source code ~2x more than the default zstd)")
  args = parser.parse_args(argv)
  with cli.user_errors():
    shards = convert_to_array_record(args.input, args.output_dir, kind=args.kind, text_key=args.text_key,
                                     docs_per_shard=args.docs_per_shard, prefix=args.prefix,
                                     shuffle_seed=args.shuffle_seed, writer_options=args.writer_options)
  print(f"Wrote {len(shards)} shard(s) to {args.output_dir}")


if __name__ == "__main__":
  main()
