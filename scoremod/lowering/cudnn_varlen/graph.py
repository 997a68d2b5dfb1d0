"""Ragged (THD) SDPA graphs: every segment of every row is one sequence.

q, k, v, O (dO, dQ, dK, dV) stay the caller's ``[B, S, H, D]`` arrays, read as
``B*S`` packed tokens: a tensor has dims ``[n, H, S, D]`` for ``n = B *
max_segments`` sequence slots, the strides of a token-major layout, and a
ragged offset per slot (element offsets, int32, ``n + 1`` entries) that says
where its sequence starts; ``seq_len_q``/``seq_len_kv`` (``[n, 1, 1, 1]``,
int32) say how long it is, with cuDNN's padding mask. The softmax statistics
are ragged too, token-major ``[B*Sq, Hq]``, so no buffer grows with the slot
count; ``max_total_seq_len_q/kv`` size the backward's workspace by tokens,
not by ``n * S``. A causal band (and window) runs inside every sequence as
cuDNN's top-left diagonal band. There is no score_mod: cuDNN 9.19 refuses
one together with sequence lengths.
"""

from __future__ import annotations

import dataclasses

from scoremod.lowering.cudnn import graph as cg
from scoremod.lowering.cudnn.graph import (UID_DK, UID_DO, UID_DQ, UID_DV, UID_K, UID_O, UID_Q,
                                           UID_STATS, UID_V, Built)
from scoremod.lowering.problem import Problem

UID_RO_Q, UID_RO_K, UID_RO_V, UID_RO_O, UID_RO_STATS, UID_SEQ_Q, UID_SEQ_KV = range(20, 27)
RAGGED_UIDS = (UID_RO_Q, UID_RO_K, UID_RO_V, UID_RO_O, UID_RO_STATS, UID_SEQ_Q, UID_SEQ_KV)


@dataclasses.dataclass(frozen=True)
class RaggedSpec:
    """Everything a ragged graph depends on (part of the cache key)."""

    shape: Problem
    sequences: int  # B * max_segments slots
    scale: float
    causal: bool
    window: int | None
    deterministic: bool = False  # the backward's dQ in a fixed order (graph.GraphSpec's)

    def layout(self, s, h, d):
        """dims and strides of a ragged ``[n, h, s, d]`` tensor over token-major rows."""
        return (self.sequences, h, s, d), (s * h * d, d, h * d, 1)

    def stats_layout(self):
        s = self.shape
        return (self.sequences, s.hq, s.sq, 1), (s.sq * s.hq, 1, s.hq, 1)


def _index(g, name, uid, n):
    t = g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cg.dtype("int32"))
    t.set_uid(uid)
    return t


def _ragged(g, name, uid, dims_strides, dtype, offsets):
    dims, strides = dims_strides
    t = g.tensor(name=name, dim=list(dims), stride=list(strides), data_type=cg.dtype(dtype),
                 ragged_offset=offsets)
    t.set_uid(uid)
    return t


def _output(t, uid, dims_strides, dtype, offsets):
    dims, strides = dims_strides
    t.set_output(True).set_dim(list(dims)).set_stride(list(strides))
    t.set_data_type(cg.dtype(dtype))
    t.set_ragged_offset(offsets)
    t.set_uid(uid)


def _inputs(g, p: RaggedSpec):
    s, n = p.shape, p.sequences
    ro = {uid: _index(g, name, uid, n + 1) for name, uid in (
        ("ro_q", UID_RO_Q), ("ro_k", UID_RO_K), ("ro_v", UID_RO_V), ("ro_o", UID_RO_O),
        ("ro_stats", UID_RO_STATS))}
    seq_q, seq_kv = _index(g, "seq_q", UID_SEQ_Q, n), _index(g, "seq_kv", UID_SEQ_KV, n)
    q = _ragged(g, "q", UID_Q, p.layout(s.sq, s.hq, s.d), s.dtype, ro[UID_RO_Q])
    k = _ragged(g, "k", UID_K, p.layout(s.skv, s.hkv, s.d), s.dtype, ro[UID_RO_K])
    v = _ragged(g, "v", UID_V, p.layout(s.skv, s.hkv, s.dv), s.dtype, ro[UID_RO_V])
    return q, k, v, ro, seq_q, seq_kv


def _mask_args(p: RaggedSpec, seq_q, seq_kv) -> dict:
    args = {"use_padding_mask": True, "seq_len_q": seq_q, "seq_len_kv": seq_kv}
    if p.causal:
        args["diagonal_alignment"] = cg.alignment("TOP_LEFT")
        args["diagonal_band_right_bound"] = 0
        if p.window is not None:
            args["diagonal_band_left_bound"] = p.window
    return args


def build_forward(p: RaggedSpec, describe) -> Built:
    g = cg.new_graph()
    q, k, v, ro, seq_q, seq_kv = _inputs(g, p)
    o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=p.scale, generate_stats=True,
                      **_mask_args(p, seq_q, seq_kv))
    s = p.shape
    _output(o, UID_O, p.layout(s.sq, s.hq, s.dv), s.dtype, ro[UID_RO_O])
    _output(stats, UID_STATS, p.stats_layout(), "float32", ro[UID_RO_STATS])
    blob, gid, ws, plan, secs = cg.finalize(g, "forward", describe)
    return Built(blob, gid, (UID_Q, UID_K, UID_V) + RAGGED_UIDS, (UID_O, UID_STATS), (), (), ws,
                 plan, secs)


def build_backward(p: RaggedSpec, describe) -> Built:
    g = cg.new_graph()
    q, k, v, ro, seq_q, seq_kv = _inputs(g, p)
    s = p.shape
    o = _ragged(g, "o", UID_O, p.layout(s.sq, s.hq, s.dv), s.dtype, ro[UID_RO_O])
    do = _ragged(g, "dO", UID_DO, p.layout(s.sq, s.hq, s.dv), s.dtype, ro[UID_RO_O])
    stats = _ragged(g, "stats", UID_STATS, p.stats_layout(), "float32", ro[UID_RO_STATS])
    dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                 attn_scale=p.scale, max_total_seq_len_q=s.b * s.sq,
                                 max_total_seq_len_kv=s.b * s.skv,
                                 use_deterministic_algorithm=p.deterministic,
                                 **_mask_args(p, seq_q, seq_kv))
    _output(dq, UID_DQ, p.layout(s.sq, s.hq, s.d), s.dtype, ro[UID_RO_Q])
    _output(dk, UID_DK, p.layout(s.skv, s.hkv, s.d), s.dtype, ro[UID_RO_K])
    _output(dv, UID_DV, p.layout(s.skv, s.hkv, s.dv), s.dtype, ro[UID_RO_V])
    blob, gid, ws, plan, secs = cg.finalize(g, "backward", describe)
    ins = (UID_Q, UID_K, UID_V, UID_O, UID_DO, UID_STATS) + RAGGED_UIDS
    return Built(blob, gid, ins, (UID_DQ, UID_DK, UID_DV), (), (), ws, plan, secs)
