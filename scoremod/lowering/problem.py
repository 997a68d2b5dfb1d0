"""The shape of one attention call, and the one order of the mod's index axes.

    >>> from scoremod.lowering.problem import AXES, Problem
    >>> p = Problem(b=2, sq=128, skv=192, hq=4, hkv=2, d=64, dv=64, dtype="bfloat16")
    >>> [p.extent(axis) for axis in AXES]
    [2, 4, 128, 192]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from scoremod.dsl.ir import INDEX_VARS

# The mod's index variables, in the order of the axes of every [B, H, Sq, Skv]
# value: the reference path's scores, cuDNN's dims and strides, materialized
# tensors (the DSL's own order of the indices, so the two never disagree).
AXES = INDEX_VARS
AXIS = {name: i for i, name in enumerate(AXES)}


@dataclasses.dataclass(frozen=True)
class Problem:
    """Sizes and dtype of a call: q [b, sq, hq, d], k [b, skv, hkv, d], v [b, skv, hkv, dv]."""

    b: int
    sq: int
    skv: int
    hq: int
    hkv: int
    d: int
    dv: int
    dtype: str  # numpy name of q, k and v's dtype

    @classmethod
    def of(cls, query, key, value) -> "Problem":
        b, sq, hq, d = query.shape
        _, skv, hkv, _ = key.shape
        return cls(int(b), int(sq), int(skv), int(hq), int(hkv), int(d), int(value.shape[-1]),
                   np.dtype(query.dtype).name)

    def extent(self, axis: str) -> int:
        """How far the mod's index ``axis`` ("b", "h", "q_idx" or "kv_idx") runs."""
        return (self.b, self.hq, self.sq, self.skv)[AXIS[axis]]

    @property
    def scores(self) -> int:
        """Entries of the [b, hq, sq, skv] score matrix."""
        return self.b * self.hq * self.sq * self.skv

    def rows(self, sq: int, skv: int) -> "Problem":
        """The same call on ``sq`` queries and ``skv`` keys (a block of a split)."""
        return dataclasses.replace(self, sq=sq, skv=skv)
