"""scoremod: attention with a custom score modification, fused by cuDNN.

    >>> import jax.numpy as jnp, scoremod
    >>> softcap = scoremod.trace(lambda s, b, h, q, k: 30 * jnp.tanh(s / 30))
    >>> q = k = v = jnp.ones((1, 16, 4, 64), jnp.bfloat16)
    >>> scoremod.attention(q, k, v, softcap).shape
    (1, 16, 4, 64)
"""

from scoremod import device, options, support
from scoremod.attention import attention, which_implementation
from scoremod.lowering.cudnn.graph import cache_info
from scoremod.dsl.ops import OPS
from scoremod.dsl.scoremod import ScoreMod, parse, score_mod, trace
from scoremod.errors import (
    CudnnUnavailableError,
    ScoreModError,
    ScoreModSyntaxError,
    ScoreModTypeError,
    ScoreModValueError,
    UnsupportedOpError,
)
from scoremod.options import LoweringOptions, lowering_options

__version__ = support.VERSION

__all__ = [
    "attention",
    "cache_info",
    "which_implementation",
    "LoweringOptions",
    "lowering_options",
    "trace",
    "score_mod",
    "parse",
    "ScoreMod",
    "OPS",
    "ScoreModError",
    "ScoreModSyntaxError",
    "ScoreModTypeError",
    "ScoreModValueError",
    "UnsupportedOpError",
    "CudnnUnavailableError",
]
