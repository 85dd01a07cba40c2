"""Your own text: a tiny SANATAN p = 1 model on a corpus of your own, with a tokenizer trained on it.

Preset ``tiny`` (2 CPU cores): the model of ``configs/sanatan.py:tiny_p1_scratch`` reading one source
named ``text`` and a SentencePiece tokenizer, at the paths the README's "Train on your own text"
commands write:

    python scripts/prepare_data.py --input='/path/to/your/text/*.txt' --kind=text --output_dir=runs/corpus/shards
    python scripts/train_tokenizer.py --input='runs/corpus/shards/*.array_record' --kind=array_record \\
        --heldout_fraction=0.05 --output=runs/corpus/tokenizer.model
    python train.py --config=configs/own_text.py:tiny --workdir=runs/corpus/model

Other layouts are overrides: ``--config.data.sources.text.kind=text
--config.data.sources.text.path='corpus/*.txt'`` reads the files directly. The held-out set is 5 % of
the documents, chosen by a hash of file path and index and never trained on
(``data.sources.text.heldout_fraction``; the library default of 1 % suits corpora of thousands of
documents, a small folder needs a larger share for a few held-out windows).
"""

from configs import common
from configs.sanatan import TINY_MIXER

CORPUS = "runs/corpus"


def tiny():
  return common.experiment(
      model=dict(common.TINY_MODEL, pattern="sanatan*4", max_positions=common.TINY_DATA["seq_len"]),
      mixers={"sanatan": dict(TINY_MIXER, p=1, implementation="parallel")},
      train=common.TINY_TRAIN, data=common.TINY_DATA,
      sources={"text": dict(kind="array_record", path=f"{CORPUS}/shards/*.array_record", heldout_fraction=0.05)},
      tokenizer=dict(kind="sentencepiece", path=f"{CORPUS}/tokenizer.model"), heldout=common.TINY_HELDOUT,
      eval=dict(paired_a="parallel"))


PRESETS = {"tiny": tiny}


def get_config(arg: str | None = None):
  return common.select(PRESETS, arg)
