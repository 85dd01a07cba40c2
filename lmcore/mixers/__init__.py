"""lmcore's own mixers (softmax, GLA, Gated DeltaNet, CyFA, the linear baselines), registered under
their kind names on import (``lmcore.registry``)."""

from lmcore.mixers.cyfa import CyFA
from lmcore.mixers.gated_deltanet import GatedDeltaNet
from lmcore.mixers.gla import GLA
from lmcore.mixers.linear_attention import CosFormer, LinearTransformer, Performer
from lmcore.mixers.softmax import SoftmaxAttention
from lmcore.registry import register_mixer

for _kind, _cls in {"softmax": SoftmaxAttention, "gla": GLA, "gdn": GatedDeltaNet, "cyfa": CyFA,
                    "linear_transformer": LinearTransformer, "performer": Performer,
                    "cosformer": CosFormer}.items():
  register_mixer(_kind, _cls)
