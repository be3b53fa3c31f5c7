"""Models with an injectable dense layer: MLP, ViT, MLP-Mixer and GPT-2 (flax.linen).

Every model takes ``dense=``: a layer constructor, or a :class:`ByPath` that makes the layers whose
module path matches a regex list diagonal-sparse. Each model module exports ``SPARSE_LAYERS``, the
patterns of the authors' choice (ViT: qkv, proj, fc1, fc2; Mixer: token and channel MLPs; GPT-2:
c_attn, c_proj, c_fc), and ``DENSE``, its default dense constructor.
"""

from dynadiag_jax.models import gpt2, mixer, mlp, vit
from dynadiag_jax.models.gpt2 import GPT2
from dynadiag_jax.models.mixer import MlpMixer
from dynadiag_jax.models.mlp import MLP
from dynadiag_jax.models.routing import ByPath, replaceable_layers, unmatched_patterns
from dynadiag_jax.models.vit import ViT

__all__ = [
    "ByPath",
    "GPT2",
    "MLP",
    "MlpMixer",
    "ViT",
    "gpt2",
    "mixer",
    "mlp",
    "replaceable_layers",
    "unmatched_patterns",
    "vit",
]
