"""Benchmark harness: scoremod against cuDNN, JAX, its XLA reference and FlexAttention.

    python benchmarks/run.py --seqs 4096 --head-dims 128 --json s4096.json   # a subset, on a GPU
    python benchmarks/run.py --from s1024.json s4096.json --doc docs/performance.md  # merge runs
    python benchmarks/run.py --dry-run --json /tmp/b.json --doc /tmp/perf.md  # CPU, tiny shapes

It refuses to start without a GPU unless --dry-run (or --from, which runs
nothing), and writes a page (and its plot) only when given --doc.

Same shapes, same run, side by side (``--impls``):

  scoremod   scoremod.attention(implementation=None): the planner's pick, recorded as the
             row's backend: "cudnn-varlen" for the document masks (ragged sequences), else
             "cudnn" (through XLA FFI), else "pallas"; with the backend it fell back to,
             and its warnings, when operand gradients (fwdbwd_ops) took another one
  scoremod-plain  the same backend by name with LoweringOptions.plain(): the mod lowered as
             written, no native mask, no query-block split, no scale folding (what those
             lowerings gain)
  scoremod-cudnn  scoremod.attention(implementation="cudnn"): the cuDNN route by name,
             for the calls the planner gives another backend (the static masks the
             Pallas kernels claim by tile counts: the crossover's other side)
  scoremod-mosaic-forward  scoremod with LoweringOptions(mosaic_forward=True,
             low_rank_bias=False): where the
             planner picks cuDNN's score_mod graphs, the forward on the Pallas kernels'
             Mosaic GPU engine and cuDNN's backward on its O and LSE (recorded as "pallas")
  scoremod-ids  scoremod with the mod's arrays passed as arguments of the jitted
             function, as in training (document ids change per batch): the document
             mods' route is then chosen per call inside the program (a lax.cond)
  direct     the same serialized cuDNN graphs run by the cuDNN frontend's Python API
             (torch buffers, CUDA events), as in benchmarks/ffi_overhead.py; for the
             document mods, the ragged graphs on offsets computed once beforehand
  xla        scoremod.attention(implementation="xla"): the reference path
  pallas     scoremod.attention(implementation="pallas") with
             LoweringOptions(pallas_engine="triton"): the block-sparse Pallas kernels on
             the Triton engine (the default engine, "auto", takes the Mosaic one where
             it runs the call); asked for by name (not in the default --impls, which compare the
             planner's route, scoremod, against the other libraries)
  pallas-mosaic  the same with LoweringOptions(pallas_engine="mosaic"): the Mosaic GPU
             kernels (Hopper), forward and backward (fwdbwd_ops too: its dK/dV kernel
             learns arrays read at b, h and constants, ALiBi's slopes; a relbias table,
             read at a tile-varying index, is refused by its forward); by name too
  jax-cudnn  jax.nn.dot_product_attention(implementation="cudnn") without the mod (upper
             bound), with is_causal / local_window_size (/ a mask) for the mask mods
             (mla_rope: q and k at head dim D + 64, v zero-padded to it, O sliced back)
  jax-cudnn-mla  mla_rope only: JAX's cuDNN attention (jax._src.cudnn) with q and k at
             D + 64 and v at D, as cuDNN's MLA support takes it (the exact baseline)
  jax-bias   the same with the mod materialized as a bias (ALiBi, relative bias)
  flex       PyTorch FlexAttention, torch.compile(flex_attention), with a block mask for
             the mask mods (when torch is importable)

Directions (``--directions``): fwd, fwdbwd (gradients of q, k, v) and fwdbwd_ops
(the same and the gradients of the mod's captured float arrays: ALiBi's slopes,
relbias's table, learned_cap's cap, kind_pair's and rel2d's tables; scoremod, xla, pallas,
pallas-mosaic and flex only).

Times are medians (min, max) over ``--reps`` repetitions of N calls after warm-up;
the first call (compilation and cuDNN graph builds) is timed apart. FLOPs are
dense: 4*B*H*S*S*D forward and 2.5x that backward (fwdbwd_ops as fwdbwd), for
masked mods too.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

IMPLS = {
    "scoremod": "scoremod fused",
    "scoremod-plain": "scoremod fused, plain score_mod",
    "scoremod-ids": "scoremod fused, operands as jit arguments",
    "scoremod-sinks": "scoremod fused, with sinks (learned)",
    "scoremod-sinks-dsink": "scoremod fused, with sinks (learned), cuDNN's backward summing dSink",
    "scoremod-deterministic": "scoremod fused, deterministic=True",
    "scoremod-mosaic-forward": "scoremod, Mosaic GPU forward, cuDNN backward",
    "scoremod-cudnn": "scoremod on cuDNN by name",
    "direct": "same graph, cuDNN frontend Python",
    "xla": "scoremod XLA reference",
    "pallas": "scoremod Pallas kernels",
    "pallas-mosaic": "scoremod Pallas, Mosaic GPU",
    "jax-cudnn": "jax.nn cuDNN",
    "jax-cudnn-mla": "JAX cuDNN, v at head dim D",
    "jax-bias": "jax.nn cuDNN + bias",
    "flex": "FlexAttention",
}
PALLAS_IMPLS = ("pallas", "pallas-mosaic")  # by name only, as the backend
MODS = ("identity", "softcap", "alibi", "relbias", "causal", "window", "softcap_causal",
        "document", "document_random", "document_noncausal", "document_softcap", "mla_rope",
        "prefix_lm", "softcap_prefix_lm", "alibi_causal", "t5", "learned_cap", "kind_pair",
        "pair_bias", "pair_mask", "rel2d")


def _canvas(s):
    """R x C = s, as square as a power of two allows (64 x 64 at 4096, 128 x 256 at 32768)."""
    r = 2 ** (int(math.log2(s)) // 2)
    return {"R": r, "C": s // r}


def _sta(s, dims):
    """STA's canvas at seq s: tiles of 64 tokens (2-D) or 32 (3-D), s / 16 text tokens."""
    tile = (8, 8) if dims == 2 else (2, 4, 4)
    if s < 1024:
        tile = (1,) * dims
    text = s // 16
    tiles = (s - text) // math.prod(tile)
    if dims == 2:
        rows = math.isqrt(tiles)
        return {"CR": rows, "CC": tiles // rows, "TR": tile[0], "TC": tile[1], "KR": 3, "KC": 3,
                "TEXT": text}
    rest = tiles // 4
    rows = math.isqrt(rest)
    return {"CT": 4, "CR": rows, "CC": rest // rows, "TT": tile[0], "TR": tile[1], "TC": tile[2],
            "KT": 3, "KR": 2, "KC": 3, "TEXT": text}


def _svg(s):
    p = 64 if s >= 1024 else s // 16
    return {"P": p, "T": (s - p) // 4, "F": 4, "WIDTH": 2, "ROUND": 128 if s >= 1024 else 4,
            "SINK": 1}


# The attention-gym catalogue's static masks (tests/catalogue/mods.py), as "gym_<entry>": the
# entry's own code, run by each library, with the constants it reads set for seq s (the
# catalogue's kernels and tiles, its canvas grown to s); None where the mask has no form at s
# (Morton order needs a square canvas).
GYM = {
    "dilated_sliding_window": lambda s: {"W": s // 8, "D": 3},
    "global_sliding_window": lambda s: {"W": s // 16,
                                        "is_global": np.random.default_rng(0).random(s) < 0.05},
    "batchify_causal": lambda s: {"N": s // 32},
    "block_diffusion": lambda s: {"L": s // 2, "BS": 16},
    "natten": lambda s: dict(_canvas(s), KR=5, KC=7),
    "tiled_natten": lambda s: dict(_canvas(s), TR=min(8, _canvas(s)["R"]),
                                   TC=min(8, _canvas(s)["C"]), KR=7, KC=7),
    "morton_natten": lambda s: (dict(_canvas(s), KR=5, KC=5)
                                if _canvas(s)["R"] == _canvas(s)["C"] else None),
    "sta_2d": lambda s: _sta(s, 2),
    "sta_3d": lambda s: _sta(s, 3),
    "svg_spatial_head": _svg,
    "svg_temporal_head": _svg,
    # its prefix a third of the keys, as the catalogue's 512 of 1536 (Sq = Skv here: the
    # last third of the queries see the prefix alone)
    "jetspec_training": lambda s: {"P": s // 3, "BS": 16},
}
GYM_MODS = tuple(f"gym_{name}" for name in GYM)
MODS += GYM_MODS
DEFAULT_MODS = tuple(m for m in MODS if m not in GYM_MODS)  # the gym rows: --mods asks
PREFIX = 8  # prefix-LM: the first S / PREFIX keys are seen by every query
# MLA's decoupled RoPE: causal, plus q_pe . k_pe of rank ROPE_DIM (k_pe shared by the
# heads), a low-rank bias scoremod folds into the head dim (q and k at D + ROPE_DIM, v at
# D); plain cuDNN runs q and k at head dim D + ROPE_DIM, the comparison the issue asks for:
# jax-cudnn through jax.nn, which wants v at q's head dim, so v is zero-padded to
# D + ROPE_DIM and O sliced back to D (the P.V product does 1.5x the work); jax-cudnn-mla
# through JAX's cuDNN module, which takes v at head dim D (cuDNN >= 9.10 on Hopper, a
# private JAX API).
ROPE_MODS = ("mla_rope",)
ROPE_DIM = 64
# Packed documents: 4 equal ones per row, causal inside; random lengths (1 to S, seeded),
# causal inside; 4 equal ones without causal; 4 equal ones, causal inside, with softcap on
# the kept scores. Each mod's (ids array of aux_arrays, causal inside).
DOC_IDS = {"document": ("doc", True), "document_random": ("doc_random", True),
           "document_noncausal": ("doc", False), "document_softcap": ("doc", True)}
DOC_MODS = ("document", "document_random", "document_noncausal")  # the pure document masks
MASK_MODS = ("causal", "window") + DOC_MODS  # pure masks: jax.nn has them natively
ARRAYS = ("slopes", "doc", "doc_random", "table", "buckets", "t5_table",
          "cap", "kind", "pair", "rel_table")  # what the mods capture
# fwdbwd_ops: forward+backward that also differentiates with respect to the mod's captured
# float arrays (ALiBi's slopes, relbias's table: learned parameters), on the
# implementations whose gradients reach them; not run unless --directions asks.
OPS = "fwdbwd_ops"
DIRECTIONS = {"fwd": "fwd", "fwdbwd": "fwd+bwd", OPS: "fwd+bwd, operand grads"}
DEFAULT_DIRECTIONS = ("fwd", "fwdbwd")
FLOP_FACTOR = {"fwd": 1.0, "fwdbwd": 3.5, OPS: 3.5}  # backward counted as 2.5x the forward
PLANNED_IMPLS = ("scoremod", "scoremod-plain", "scoremod-ids",
                 "scoremod-sinks", "scoremod-sinks-dsink", "scoremod-deterministic",
                 "scoremod-mosaic-forward")  # on fused_backend: recorded
CUDNN_IMPLS = PLANNED_IMPLS + ("direct",)  # the cuDNN lowerings' switches apply when planned there
CUDNN_BACKENDS = ("cudnn", "cudnn-varlen")
OPS_IMPLS = ("scoremod", "xla", "pallas", "pallas-mosaic", "flex")
# The captured float arrays of FlexAttention's score_mods, by aux_arrays name (those of the
# JAX mods are their float operands)
FLEX_LEARNED = {"alibi": ("slopes",), "alibi_causal": ("slopes",), "relbias": ("table",),
                "t5": ("t5_table",), "learned_cap": ("cap",), "kind_pair": ("pair",),
                "pair_bias": ("pair_bias",), "rel2d": ("rel_table",)}
# pair_bias's [H, S, S] float32 bias (Flax's ``bias``, a pair bias): 1 GiB at h16 s4096,
# built on demand (``pair_bias``); longer sequences are not run.
PAIR_BIAS_MAX_SEQ = 8192
KINDS, KIND_RUN = 3, 256  # kind_pair's token kinds (text, image, ..), in runs of 256 tokens
T5_BUCKETS = 32  # T5's: a bucket per distance up to 8 back or ahead, then logarithmic
SOFTCAP, DOCS = 30.0, 4
ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
# One short and one long shape: every mod's rows and every direction, compiled once each
# (a smoke test of the harness end to end, about a minute on a CPU).
DRY = dict(batch=1, heads=2, seqs=[32], head_dims=[16], long=64, impls=["xla"], reps=3,
           rep_ms=2.0, window=16, directions=list(DIRECTIONS))


class NotApplicable(Exception):
    """This implementation has no variant for this mod (no row is written)."""


# --- the mods, for each library ----------------------------------------------


def aux_arrays(b, h, s, window):
    """What the mods close over: ALiBi slopes, document ids, a relative-bias table."""
    return {
        "slopes": (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32),
        "doc": np.repeat((np.arange(s) * DOCS // s)[None], b, 0).astype(np.int32),
        "doc_random": random_documents(b, s),
        "table": (0.1 * np.random.default_rng(0).standard_normal((h, 2 * s - 1))).astype(np.float32),
        "buckets": t5_buckets(s),
        "t5_table": (0.1 * np.random.default_rng(1).standard_normal((T5_BUCKETS, h))
                     ).astype(np.float32),
        "cap": np.asarray(SOFTCAP, np.float32),  # learned_cap's: a 0-d learned softcap
        # kind_pair's: each row's runs of tokens of one kind, a bias per head and kind pair
        "kind": np.repeat(np.random.default_rng(2).integers(0, KINDS, (b, -(-s // KIND_RUN))),
                          KIND_RUN, 1)[:, :s].astype(np.int32),
        "pair": (0.5 * np.random.default_rng(3).standard_normal((h, KINDS, KINDS))
                 ).astype(np.float32),
        # rel2d's: a bias per head and 2-D offset on the R x C canvas (``_canvas``)
        "rel_table": (0.1 * np.random.default_rng(6).standard_normal(
            (h, (2 * _canvas(s)["R"] - 1) * (2 * _canvas(s)["C"] - 1)))).astype(np.float32),
        "window": window, "seq": s, "batch": b, "heads": h,
    }


@functools.cache
def _pair_bias(h, s):
    return (0.1 * np.random.default_rng(4).standard_normal((h, s, s), dtype=np.float32))


def pair_bias(a):
    """pair_bias's array [H, S, S] (float32, seeded), built on the first call that
    needs it; NotApplicable past ``PAIR_BIAS_MAX_SEQ``."""
    if a["seq"] > PAIR_BIAS_MAX_SEQ:
        raise NotApplicable(f"pair_bias's [H, S, S] bias is not built past seq "
                            f"{PAIR_BIAS_MAX_SEQ}")
    return _pair_bias(a["heads"], a["seq"])


@functools.cache
def _pair_mask(b, s):
    keep = np.random.default_rng(5).random((b, 1, s, s), dtype=np.float32) < 0.9
    return keep & (np.arange(s)[:, None] >= np.arange(s)[None, :])


def pair_mask(a):
    """pair_mask's bool array [B, 1, S, S] (Flax's ``mask``: causal, a tenth of the rest
    dropped at random, seeded), built on the first call that needs it; NotApplicable
    past ``PAIR_BIAS_MAX_SEQ``."""
    if a["seq"] > PAIR_BIAS_MAX_SEQ:
        raise NotApplicable(f"pair_mask's [B, 1, S, S] mask is not built past seq "
                            f"{PAIR_BIAS_MAX_SEQ}")
    return _pair_mask(a["batch"], a["seq"])


@functools.cache
def _rel2d_index(s):
    r, c = _canvas(s)["R"], _canvas(s)["C"]
    row, col = np.arange(s) // c, np.arange(s) % c
    return ((row[:, None] - row[None, :] + r - 1) * (2 * c - 1)
            + col[:, None] - col[None, :] + c - 1).astype(np.int32)


def rel2d_index(a):
    """rel2d's int32 [S, S] index (timm's ``relative_position_index``: each pair of
    positions' 2-D offset on the R x C canvas, flattened), built on the first call
    that needs it; NotApplicable past ``PAIR_BIAS_MAX_SEQ``."""
    if a["seq"] > PAIR_BIAS_MAX_SEQ:
        raise NotApplicable(f"rel2d's [S, S] index is not built past seq {PAIR_BIAS_MAX_SEQ}")
    return _rel2d_index(a["seq"])


# Arrays too large to build for every mod: name -> builder from ``aux_arrays``' dict.
ON_DEMAND = {"pair_bias": pair_bias, "pair_mask": pair_mask}


def random_documents(b, s, seed=0):
    """[b, s] ids: each row packed with documents of lengths drawn uniformly from 1..s
    (the last one cut at the row's end)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        lengths = []
        while sum(lengths) < s:
            lengths.append(int(rng.integers(1, s + 1)))
        lengths[-1] -= sum(lengths) - s
        rows.append(np.repeat(np.arange(len(lengths)), lengths))
    return np.stack(rows).astype(np.int32)


def t5_buckets(s):
    """T5's bidirectional relative buckets of ``kv_idx - q_idx + s - 1`` (int32 [2s - 1]):
    half the buckets per direction, exact up to 8 apart, logarithmic to 128."""
    rel = np.arange(2 * s - 1) - (s - 1)
    half = T5_BUCKETS // 2
    exact = half // 2
    far = exact + (np.log(np.maximum(np.abs(rel), 1) / exact) / np.log(128 / exact)
                   * (half - exact)).astype(np.int64)
    bucket = np.where(np.abs(rel) < exact, np.abs(rel), np.minimum(far, half - 1))
    return (bucket + np.where(rel > 0, half, 0)).astype(np.int32)


def mod_parts(name, t, lib):
    """(score part ``(sc, b, h, q, k)``, mask ``(b, h, q, k)``) of mod ``name``, either
    None, written once for JAX and torch alike: ``t`` holds ``aux_arrays``' arrays in
    the library's own type, ``lib`` its numpy-like namespace (jax.numpy, numpy,
    ``TorchNumpy``); mla_rope is jax_mod's own."""
    w, s, slopes, table = t["window"], t["seq"], t["slopes"], t["table"]
    tanh = lib.tanh
    if name in GYM_MODS:
        mod = gym_mod(name, s, lib)
        return None, lambda b, h, q, k: lib.isfinite(mod(0.0, b, h, q, k))

    def softcap(sc, b, h, q, k):
        return SOFTCAP * tanh(sc / SOFTCAP)

    def causal(b, h, q, k):
        return q >= k

    scores = {
        "softcap": softcap, "softcap_causal": softcap, "document_softcap": softcap,
        "alibi": lambda sc, b, h, q, k: sc + slopes[h] * (k - q),
        "relbias": lambda sc, b, h, q, k: sc + table[h, q - k + s - 1],
        "t5": lambda sc, b, h, q, k: sc + t["t5_table"][t["buckets"][k - q + s - 1], h],
        "learned_cap": lambda sc, b, h, q, k: t["cap"] * tanh(sc / t["cap"]),
        "kind_pair": lambda sc, b, h, q, k: sc + t["pair"][h, t["kind"][b, q], t["kind"][b, k]],
    }
    if name == "pair_bias":  # its array on demand (``ON_DEMAND``), the caller's where given
        bias = t["pair_bias"] if "pair_bias" in t else lib.asarray(pair_bias(t))
        scores["pair_bias"] = lambda sc, b, h, q, k: sc + bias[h, q, k]
    if name == "rel2d":  # its index built on demand (never learned)
        rel = lib.asarray(rel2d_index(t))
        scores["rel2d"] = lambda sc, b, h, q, k: sc + t["rel_table"][h, rel[q, k]]

    def prefix_lm(b, h, q, k):
        return (k < s // PREFIX) | (q >= k)

    scores["softcap_prefix_lm"] = softcap
    scores["alibi_causal"] = scores["alibi"]
    if name == "pair_mask":  # its array on demand, as pair_bias's
        keep = t["pair_mask"] if "pair_mask" in t else lib.asarray(pair_mask(t))
        return None, lambda b, h, q, k: keep[b, 0, q, k]
    masks = {"causal": causal, "softcap_causal": causal, "mla_rope": causal,
             "window": lambda b, h, q, k: (q >= k) & (q - k < w),
             "prefix_lm": prefix_lm, "softcap_prefix_lm": prefix_lm, "alibi_causal": causal}
    if name in DOC_IDS:
        masks[name] = document_mask(t[DOC_IDS[name][0]], DOC_IDS[name][1])
    return scores.get(name), masks.get(name)


def gym_mod(name, s, lib):
    """The catalogue entry's ``mod(s, b, h, q, k)`` at seq ``s``, its code run with ``lib``
    as ``jnp``; NotApplicable where the mask has no form at ``s``."""
    from tests.catalogue.mods import CATALOGUE

    consts = GYM[name[len("gym_"):]](s)
    if consts is None:
        raise NotApplicable(f"{name} has no form at seq {s}")
    return CATALOGUE[name[len("gym_"):]].build(consts, namespace=lib)


class TorchNumpy:
    """The numpy functions the harness's mods use, on torch tensors (FlexAttention)."""

    inf = math.inf

    def __init__(self, device="cuda"):
        import torch

        self.torch, self.device = torch, device
        self.tanh, self.abs, self.isfinite = torch.tanh, torch.abs, torch.isfinite
        self.clip, self.where = torch.clamp, torch.where

    def asarray(self, x):
        return self.torch.as_tensor(x, device=self.device)


def document_mask(ids, causal):
    """Packed documents: a query sees the keys of its own document (up to itself if
    ``causal``); ``ids`` [B, S], a JAX or torch array."""
    if causal:
        return lambda b, h, q, k: (ids[b, q] == ids[b, k]) & (q >= k)
    return lambda b, h, q, k: ids[b, q] == ids[b, k]


def jax_mod(name, a, dtype="float32"):
    import jax.numpy as jnp

    import scoremod

    t = dict(a, **{n: jnp.asarray(a[n]) for n in ARRAYS})
    if name in GYM_MODS:
        return scoremod.trace(gym_mod(name, a["seq"], jnp))
    score, mask = mod_parts(name, t, jnp)
    if name == "mla_rope":
        q_pe, k_pe = rope_arrays(a, dtype)
        score = lambda sc, b, h, q, k: sc + jnp.dot(  # noqa: E731
            q_pe[b, q, h].astype(jnp.float32), k_pe[b, k].astype(jnp.float32))
    score = score or (lambda sc, b, h, q, k: sc)
    if mask is None:
        return scoremod.trace(score)
    return scoremod.trace(lambda sc, b, h, q, k: jnp.where(mask(b, h, q, k), score(sc, b, h, q, k),
                                                            -jnp.inf))


def rope_arrays(a, dtype="float32"):
    """q_pe [B, S, H, ROPE_DIM] and k_pe [B, S, ROPE_DIM] (seeded, built on demand), in
    ``dtype``: the inputs' one, as an MLA layer holds them."""
    import jax
    import jax.numpy as jnp

    b, h, s = a["batch"], a["heads"], a["seq"]
    kq, kk = jax.random.split(jax.random.key(1))
    out = (jax.random.normal(kq, (b, s, h, ROPE_DIM), jnp.float32),
           jax.random.normal(kk, (b, s, ROPE_DIM), jnp.float32))
    return tuple(x.astype(dtype) for x in out)


def rope_augmented(q, k, a):
    """q and k [B, S, H, D] with q_pe, k_pe appended: [B, S, H, D + ROPE_DIM].
    q_pe is multiplied by sqrt(D), so that at attention's scale 1 / sqrt(D)
    the scores are mla_rope's: q . k / sqrt(D) + q_pe . k_pe."""
    import jax.numpy as jnp

    q_pe, k_pe = rope_arrays(a, q.dtype)
    q_pe = q_pe.astype(jnp.float32) * math.sqrt(q.shape[-1])
    k_pe = jnp.broadcast_to(k_pe[:, :, None], k.shape[:3] + (ROPE_DIM,))
    return tuple(jnp.concatenate([x, pe.astype(x.dtype)], axis=-1)
                 for x, pe in ((q, q_pe), (k, k_pe)))


def rope_padded_v(attend, q, k, v, d, **kw):
    """``attend`` (jax.nn.dot_product_attention's signature) on q, k at head dim
    D + ROPE_DIM and v zero-padded to it; O's first D columns (the padded columns
    of O are zeros), at mla_rope's scale 1 / sqrt(D)."""
    import jax.numpy as jnp

    pad = q.shape[-1] - v.shape[-1]
    v_wide = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (pad,), v.dtype)], axis=-1)
    return attend(q, k, v_wide, scale=1.0 / math.sqrt(d), implementation="cudnn", **kw)[..., :d]


def jax_cudnn_mla():
    """JAX's cuDNN attention taking v at a smaller head dim than q and k (cuDNN's
    MLA support): ``f(q, k, v, scale)``, causal. A private JAX module: its absence
    (or a refusal when called) is this row's error, the other rows run."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    def attend(q, k, v, scale):
        return dot_product_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL)

    return attend


def jax_native(name, a):
    """(variant, kwargs, mask or None): jax.nn.dot_product_attention's own masks."""
    if name == "document_softcap":
        raise NotApplicable("jax.nn has no softcap (and no score_mod): no faithful variant")
    if name in ("causal", "softcap_causal"):
        return "is_causal", {"is_causal": True}, None
    if name in ROPE_MODS:
        return (f"is_causal, q and k at head dim D + {ROPE_DIM}, v zero-padded to it",
                {"is_causal": True}, None)
    if name == "window":
        w = a["window"]
        return f"local_window_size=({w - 1}, 0)", {"is_causal": True, "local_window_size": (w - 1, 0)}, None
    if name == "pair_mask":
        import jax.numpy as jnp

        return "[B, 1, S, S] mask", {}, jnp.asarray(pair_mask(a))
    if name in DOC_MODS:
        import jax
        import jax.numpy as jnp

        ids, causal = DOC_IDS[name]
        mask = jax.jit(lambda d: d[:, None, :, None] == d[:, None, None, :])(jnp.asarray(a[ids]))
        return (f"{'is_causal + ' if causal else ''}[B, 1, S, S] mask", {"is_causal": causal}, mask)
    return "no mod", {}, None


def jax_bias(name, a, dtype):
    """The mod as a [1, H, S, S] bias, built once on the device, or None."""
    import jax
    import jax.numpy as jnp

    s = a["seq"]
    if name == "pair_bias":
        return jnp.asarray(pair_bias(a))[None].astype(dtype)
    if name == "rel2d":
        return jax.jit(lambda t, i: t[:, i][None].astype(dtype))(
            jnp.asarray(a["rel_table"]), jnp.asarray(rel2d_index(a)))
    if name not in ("alibi", "relbias", "t5"):
        return None

    def build(slopes, table, buckets, t5_table):
        qi, ki = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
        if name == "alibi":
            bias = slopes[:, None, None] * (ki - qi)
        elif name == "relbias":
            bias = table[:, qi - ki + s - 1]
        else:
            bias = jnp.moveaxis(t5_table[buckets[ki - qi + s - 1]], -1, 0)
        return bias[None].astype(dtype)

    return jax.jit(build)(*(jnp.asarray(a[n]) for n in ("slopes", "table", "buckets", "t5_table")))


def flex_mods(name, a, learn=False):
    """(score_mod, mask_mod, learned) for FlexAttention: ``learned``, the captured float
    tensors the score_mod reads (``FLEX_LEARNED``), with requires_grad if ``learn``."""
    import torch

    t = dict(a, **{n: torch.as_tensor(a[n], device="cuda") for n in ARRAYS})
    for n, build in ON_DEMAND.items():
        if n in FLEX_LEARNED.get(name, ()):
            t[n] = torch.as_tensor(build(a), device="cuda")
    learned = [t[n] for n in FLEX_LEARNED.get(name, ())]
    for x in learned if learn else ():
        x.requires_grad_()
    score_mod, mask_mod = mod_parts(name, t, TorchNumpy())
    return score_mod, mask_mod, learned


@functools.cache
def _flex_attention():
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config  # one recompilation per mod and shape: never fall back to eager
    for limit in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                  "accumulated_recompile_limit"):
        if hasattr(cfg, limit):
            setattr(cfg, limit, 4096)
    return torch.compile(flex_attention, dynamic=False)


# --- one shape: inputs and the implementations ------------------------------


class Shape:
    def __init__(self, batch, heads, seq, head_dim, dtype, window, long=False):
        self.b, self.h, self.s, self.d = batch, heads, seq, head_dim
        self.dtype, self.long = dtype, long
        self.aux = aux_arrays(batch, heads, seq, window)
        self._mods, self._jax, self._torch, self._masks = {}, None, None, {}

    def flops(self, direction):
        return 4 * self.b * self.h * self.s * self.s * self.d * FLOP_FACTOR[direction]

    def record(self):
        return {"batch": self.b, "heads": self.h, "seq": self.s, "head_dim": self.d,
                "dtype": self.dtype, "long": self.long}

    def mod(self, name):
        if name not in self._mods:
            self._mods[name] = jax_mod(name, self.aux, self.dtype)
        return self._mods[name]

    def jax_inputs(self):
        """q, k, v, dO: [B, S, H, D]."""
        if self._jax is None:
            import jax

            keys = jax.random.split(jax.random.key(0), 4)
            self._jax = [jax.random.normal(k, (self.b, self.s, self.h, self.d), self.dtype) for k in keys]
        return self._jax

    def torch_inputs(self):
        """q, k, v, dO, each [B, S, H, D] contiguous (``t.transpose(1, 2)`` is [B, H, S, D])."""
        if self._torch is None:
            import torch

            torch.manual_seed(0)
            self._torch = [torch.randn(self.b, self.s, self.h, self.d, dtype=getattr(torch, self.dtype),
                                       device="cuda") for _ in range(4)]
        return self._torch

    def block_mask(self, name, mask_mod):
        key = DOC_IDS.get(name, name)  # document and document_softcap share theirs
        if key not in self._masks:
            from torch.nn.attention.flex_attention import create_block_mask

            b = self.b if name in DOC_IDS else None
            kw = {"_compile": True} if self.s <= 8192 else {}  # compiled at seq 16384 (torch
            # 2.11), the mask builder sat in ptxas for over 150 s; built eagerly it is a vmap
            try:
                self._masks[key] = create_block_mask(mask_mod, b, None, self.s, self.s, device="cuda", **kw)
            except TypeError:  # a torch without _compile
                self._masks[key] = create_block_mask(mask_mod, b, None, self.s, self.s, device="cuda")
        return self._masks[key]


def make_call(impl, name, shape, direction):
    """(call, clock, variant): ``call()`` launches one call; ``clock`` times loops of it."""
    if direction == OPS and impl not in OPS_IMPLS:
        raise NotApplicable(f"{impl} computes no gradients of captured arrays")
    if impl in ("direct", "flex") and name in ROPE_MODS:
        raise NotApplicable(f"{impl} has no variant for {name} (its q and k are augmented)")
    if impl in ("direct", "flex"):
        try:
            import torch  # noqa: F401
        except ImportError:
            raise ImportError("torch is not importable") from None
        call, variant = (make_direct if impl == "direct" else make_flex)(name, shape, direction)
        return call, cuda_clock, variant
    import jax

    import scoremod

    variant, extra, learned = "", (), ()
    if impl == "scoremod-ids":
        mod = shape.mod(name)
        if not mod.operands:
            raise NotApplicable(f"{name} has no arrays")
        how, extra = fused_backend(name, shape).name, tuple(mod.operands)

        def fn(q, k, v, *ops):
            return scoremod.attention(q, k, v, scoremod.ScoreMod(mod.expr, ops), implementation=how)
    elif impl in ("scoremod-sinks", "scoremod-sinks-dsink"):
        # implementation=None, sinks differentiated in fwd+bwd; -dsink: with cuDNN's
        # backward graph summing the sinks' gradient (cudnn.backend.SINK_GRADIENT_IN_GRAPH,
        # off by default until measured) while the call is traced
        if impl == "scoremod-sinks-dsink" and direction == "fwd":
            raise NotApplicable(f"{impl}'s forward is scoremod-sinks' (the switch is the "
                                "backward's)")
        mod = shape.mod(name)
        learned = (jax.numpy.linspace(-1.0, 1.0, shape.h, dtype=jax.numpy.float32),)

        def fn(q, k, v, sinks):
            return scoremod.attention(q, k, v, mod, sinks=sinks)
    elif impl in ("scoremod", "scoremod-plain", "scoremod-deterministic", "scoremod-cudnn",
                  "scoremod-mosaic-forward",
                  "xla") + PALLAS_IMPLS:
        mod = shape.mod(name)
        # scoremod: implementation=None, what the planner picks (run() records it)
        how = ("xla" if impl == "xla" else "pallas" if impl in PALLAS_IMPLS
               else "cudnn" if impl == "scoremod-cudnn"
               else fused_backend(name, shape).name if impl == "scoremod-plain" else None)
        options = {"scoremod-plain": scoremod.LoweringOptions.plain(),
                   "scoremod-deterministic": scoremod.LoweringOptions(deterministic=True),
                   # (the low-rank fold off: ALiBi folded into q and k, head dim 136, is
                   # not the Mosaic engine's, so with it no ALiBi forward moves)
                   "scoremod-mosaic-forward": scoremod.LoweringOptions(mosaic_forward=True,
                                                                       low_rank_bias=False),
                   "pallas": scoremod.LoweringOptions(pallas_engine="triton"),
                   "pallas-mosaic": scoremod.LoweringOptions(pallas_engine="mosaic")}.get(impl)
        with_learned = (lambda learned: mod) if direction != OPS else learned_operands(name, mod)
        learned = () if direction != OPS else tuple(x for x in mod.operands if _is_float(x))

        def fn(q, k, v, *learned):
            return scoremod.attention(q, k, v, with_learned(learned), implementation=how,
                                      options=options)
    elif impl == "jax-cudnn" and name in ROPE_MODS:
        variant, kw, _ = jax_native(name, shape.aux)

        def fn(q, k, v):  # jax.nn wants v at q's head dim: zeros in the extra columns
            return rope_padded_v(jax.nn.dot_product_attention, q, k, v, shape.d, **kw)
    elif impl == "jax-cudnn-mla":
        if name not in ROPE_MODS:
            raise NotApplicable(f"{impl} is the baseline of {', '.join(ROPE_MODS)} only")
        cudnn_mla = jax_cudnn_mla()
        variant = f"causal, q and k at head dim D + {ROPE_DIM}, v at D"

        def fn(q, k, v):
            return cudnn_mla(q, k, v, scale=1.0 / math.sqrt(shape.d))
    elif impl == "jax-cudnn":
        variant, kw, mask = jax_native(name, shape.aux)
        extra = () if mask is None else (mask,)

        def fn(q, k, v, *mask):
            return jax.nn.dot_product_attention(q, k, v, mask=mask[0] if mask else None,
                                                implementation="cudnn", **kw)
    else:  # jax-bias
        bias = jax_bias(name, shape.aux, shape.dtype)
        if bias is None:
            raise NotApplicable(f"{impl} has no variant for {name}")
        variant, extra = "[1, H, S, S] bias", (bias,)

        def fn(q, k, v, bias):
            return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="cudnn")
    q, k, v, do = shape.jax_inputs()
    if impl in ("jax-cudnn", "jax-cudnn-mla") and name in ROPE_MODS:
        q, k = rope_augmented(q, k, shape.aux)  # q_pe and k_pe as extra head-dim columns
    if impl == "pallas-mosaic" and direction != "fwd":
        variant = mosaic_backward_variant(mod, q, k, v, options, direction)
    if direction == "fwd":
        f, args = jax.jit(fn), (q, k, v, *extra, *learned)
    else:  # extra: fixed arguments; learned (OPS): the captured arrays differentiated
        def step(q, k, v, do, extra, learned):
            o, vjp = jax.vjp(lambda q, k, v, *learned: fn(q, k, v, *extra, *learned),
                             q, k, v, *learned)
            return (o, *vjp(do))

        f, args = jax.jit(step), (q, k, v, do, extra, learned)
    if impl == "scoremod-sinks-dsink":
        return _sink_gradient_in_graph(lambda: f(*args)), wall_clock, variant
    return (lambda: f(*args)), wall_clock, variant


def _sink_gradient_in_graph(call):
    """``call`` with cuDNN's backward summing the sinks' gradient while it runs (the
    switch is read when the backward is traced: at the jitted step's first call)."""
    from scoremod.lowering.cudnn import backend as cudnn_backend

    def switched():
        before = cudnn_backend.SINK_GRADIENT_IN_GRAPH
        cudnn_backend.SINK_GRADIENT_IN_GRAPH = True
        try:
            return call()
        finally:
            cudnn_backend.SINK_GRADIENT_IN_GRAPH = before
    return switched


def mosaic_backward_variant(mod, q, k, v, options, direction):
    """Which backward the Mosaic engine's call runs, as its plan decides (for the row)."""
    from scoremod.lowering.pallas.backend import PALLAS
    from scoremod.lowering.problem import Problem

    plan = PALLAS.plan(Problem.of(q, k, v), mod, 1.0 / math.sqrt(q.shape[-1]), options, False)
    learned = direction == OPS and any(_is_float(x) for x in mod.operands)
    if plan.backward_engine != "mosaic" or (learned and plan.triton_operands):
        return "Triton backward"
    return "Mosaic backward" + (", operand gradients included" if learned else "")


def _is_float(x):
    import jax.numpy as jnp

    return jnp.issubdtype(x.dtype, jnp.floating)


def learned_operands(name, mod):
    """``with_learned(arrays)``: ``mod`` with its float operands (in order) replaced by
    ``arrays``, the values being differentiated; its integer ones (ids) stay."""
    import scoremod

    floats = [i for i, x in enumerate(mod.operands) if _is_float(x)]
    if not floats:
        raise NotApplicable(f"{name} captures no float array")

    def with_learned(arrays):
        ops = list(mod.operands)
        for i, x in zip(floats, arrays):
            ops[i] = x
        return scoremod.ScoreMod(mod.expr, tuple(ops))

    return with_learned


def _problem(shape):
    from scoremod.lowering.problem import Problem

    return Problem(shape.b, shape.s, shape.s, shape.h, shape.h, shape.d, shape.d, shape.dtype)


def fused_backend(name, shape):
    """The backend ``implementation=None`` picks for mod ``name`` at ``shape``
    (``scoremod.which_implementation``): on a GPU, cuDNN's variable-length attention
    for the document masks, else cudnn where it takes the mod, else the Pallas kernels."""
    import scoremod
    from scoremod.lowering import registry

    q, k, v, _ = shape.jax_inputs()
    return registry.get(scoremod.which_implementation(q, k, v, shape.mod(name)).implementation)


def backend_ran(planned, said):
    """What ran a call planned on backend ``planned`` (a name): itself, or, where the
    scoremod warnings it gave (``said``) name a backend it fell back to (operand
    gradients, a kernel refused when built), e.g. "pallas (fallback from cudnn)"."""
    from scoremod.lowering import registry

    took = [b.name for b in registry.backends() if b.name != planned
            and any(("falls back to" in w or "runs it on" in w) and b.title in w for w in said)]
    return f"{', '.join(took)} (fallback from {planned})" if took else planned


def plan_of(name, shape, options=None):
    """scoremod's plan for the benchmark's mod ``name`` at ``shape`` (public hooks only:
    the cudnn backend's ``plan``, whose blocks and parts hold the graphs it runs)."""
    import scoremod
    from scoremod.lowering import registry

    return registry.get("cudnn").plan(_problem(shape), shape.mod(name), 1.0 / math.sqrt(shape.d),
                                      options or scoremod.options.current(), False)


def varlen_plan_of(name, shape):
    """The cudnn-varlen plan of a document mod (its ragged graphs, offsets and check), or None."""
    import scoremod

    backend = fused_backend(name, shape)
    if backend.name != "cudnn-varlen":
        return None
    plan = backend.plan(_problem(shape), shape.mod(name), 1.0 / math.sqrt(shape.d),
                        scoremod.options.current(), False)
    return plan if plan.segments is not None else None


def make_direct_varlen(plan, operands, shape, direction):
    """The ragged graphs run by the frontend's Python API, on offsets and lengths
    computed once (what scoremod adds around them: that computation, the run-time
    check and its cond, the LSE transpose)."""
    import jax
    import torch

    from scoremod.lowering.cudnn import graph as cg
    from scoremod.lowering.cudnn_varlen.graph import RAGGED_UIDS

    layout = jax.jit(plan.layout)(tuple(operands))
    if not bool(layout.ok):
        raise NotApplicable("these ids take the dense route")
    arrays = jax.jit(plan.ragged_inputs)(layout)
    ragged = [_torch_view(x) for x in arrays]
    b, s, h, d = shape.b, shape.s, shape.h, shape.d
    q, k, v, do = shape.torch_inputs()
    bufs = {cg.UID_Q: q, cg.UID_K: k, cg.UID_V: v, cg.UID_DO: do, cg.UID_O: torch.empty_like(q),
            cg.UID_STATS: torch.empty(b, s, h, dtype=torch.float32, device="cuda"),
            cg.UID_DQ: torch.empty_like(q), cg.UID_DK: torch.empty_like(k),
            cg.UID_DV: torch.empty_like(v), **dict(zip(RAGGED_UIDS, ragged))}
    fwd = _direct_runner(plan.forward_graph(), (), (), [], bufs, {})
    keep = (bufs, arrays)  # the buffers the graphs' pointers name stay alive
    if direction == "fwd":
        return (lambda keep=keep: fwd()), "ragged sequences"
    bwd = _direct_runner(plan.backward_graph(), (), (), [], bufs, {})
    return (lambda keep=keep: (fwd(), bwd())), "ragged sequences"


def make_direct(name, shape, direction):
    """The graphs scoremod runs for this mod and shape, executed by the frontend's Python API
    (with the split on: each block's graphs in turn, on its rows of the full arrays as
    scoremod runs them; the sum of the blocks' dK, dV is not included)."""
    import torch

    from scoremod.lowering.cudnn import graph as cg

    planned = fused_backend(name, shape).name
    if planned not in CUDNN_BACKENDS:
        raise NotApplicable(f"scoremod runs {name} on {planned} here: no cuDNN graphs to run")
    varlen = varlen_plan_of(name, shape)
    if varlen is not None:
        return make_direct_varlen(varlen, shape.mod(name).operands, shape, direction)
    b, s, h, d = shape.b, shape.s, shape.h, shape.d
    mod = shape.mod(name)
    plan = plan_of(name, shape)
    if plan.key_split or plan.backward_plan is not plan:
        raise NotApplicable("key blocks (their rows joined, or a backward of its own plan) are "
                            "not run here")
    q, k, v, do = shape.torch_inputs()
    shared = {cg.UID_Q: q, cg.UID_K: k, cg.UID_V: v, cg.UID_DO: do, cg.UID_O: torch.empty_like(q),
              cg.UID_STATS: torch.empty(b, h, s, 1, dtype=torch.float32, device="cuda"),
              cg.UID_DQ: torch.empty_like(q)}
    if not plan.split:
        (part,) = plan.parts
        bufs = {**shared, cg.UID_DK: torch.empty_like(k), cg.UID_DV: torch.empty_like(v)}
        fwd_parts = bwd_parts = [(part, {}, bufs)]
    else:
        fwd_parts, bwd_parts, packed = [], [], []
        for blk, part in zip(plan.blocks, plan.parts):
            oq, ok, ov, oo, os_ = plan.offsets(blk)
            offsets = {cg.UID_Q: oq, cg.UID_DQ: oq, cg.UID_K: ok, cg.UID_V: ov, cg.UID_O: oo,
                       cg.UID_DO: oo, cg.UID_STATS: os_}
            fwd_parts.append((part, offsets, shared))
            rows = (b, blk.k1 - blk.k0, h, d)  # the block's own dK, dV (as the backend's backward)
            # sdpa_backward reads the block's stats packed, not at the forward's offset
            stats = torch.empty(b, h, blk.q1 - blk.q0, 1, dtype=torch.float32, device="cuda")
            packed.append((stats, blk))
            bwd_parts.append((part, {**offsets, cg.UID_STATS: 0},
                              {**shared, cg.UID_DK: k.new_empty(rows), cg.UID_DV: v.new_empty(rows),
                               cg.UID_STATS: stats}))
    arrays = _load_arrays_once(mod.operands)
    fwds = [_direct_runner(part.forward_graph(), part.fwd_consts, part.fwd_loads,
                           arrays(part, forward=True), bufs, offsets)
            for part, offsets, bufs in fwd_parts]
    if direction == "fwd":
        return (lambda: [f() for f in fwds]), ""
    bwds = [_direct_runner(part.backward_graph(), part.consts, part.loads, arrays(part), bufs,
                           offsets)
            for part, offsets, bufs in bwd_parts]
    if plan.split:  # the backward reads the forward's LSE: compute it once, copy it
        for f in fwds:
            f()
        for stats, blk in packed:
            stats.copy_(shared[cg.UID_STATS][:, :, blk.q0:blk.q1])
        torch.cuda.synchronize()
    return (lambda: [f() for f in fwds] + [g() for g in bwds]), ""


def _torch_view(x):
    """A JAX device array as a flat torch CUDA tensor (row-major, as the graphs read it),
    sharing its memory: a materialized [1, H, S, S] bias is 17 GB at seq 16384, and a
    ``jnp.ravel`` copy of it ran out of memory there."""
    import torch

    return torch.from_dlpack(x.block_until_ready()).reshape(-1)


def _load_arrays_once(operands):
    """``arrays(part, forward=False)``: the graph's load arrays, with the values scoremod
    gives them, computed once per ``part`` (the forward's are a subset of the
    backward's) and in one jitted computation (op by op, a [1, H, S, S] bias built its
    int32 index grids at full size: out of memory at seq 16384)."""
    import jax

    done = {}

    def arrays(static, forward=False):
        if static not in done:
            done[static] = jax.jit(static.load_arrays)(tuple(operands))
        return [x for plan, x in zip(static.loads, done[static])
                if not forward or plan in static.fwd_loads]

    return arrays


def _direct_runner(built, consts, loads, arrays, bufs, offsets):
    """An execute of ``built`` on ``bufs`` (by uid) at byte ``offsets``, with the
    graph's scalars ``consts`` and its ``loads`` given ``arrays``."""
    import cudnn
    import torch

    from scoremod.dsl.ir import F32

    g = cudnn.pygraph()
    g.deserialize(built.blob)
    pack = {uid: bufs[uid].data_ptr() + offsets.get(uid, 0)
            for uid in built.in_uids + built.out_uids if uid in bufs}
    keep = [_torch_view(x) for x in arrays]
    for plan, x in zip(loads, keep):
        assert x.numel() == math.prod(plan.spec.dims), (plan.spec, x.shape)
        pack[plan.spec.uid] = x.data_ptr()
    for uid, bits, c in zip(built.scalar_uids, built.scalar_bits, consts):
        x = torch.tensor([bits], dtype=torch.int32)
        pack[uid] = (x.view(torch.float32) if c.dtype == F32 else x).reshape(1, 1, 1, 1)
    ws = torch.empty(max(built.workspace, 1), dtype=torch.uint8, device="cuda")
    return lambda keep=keep: g.execute(pack, ws)  # keep: the load buffers stay alive


def make_flex(name, shape, direction):
    import torch

    flex = _flex_attention()
    score_mod, mask_mod, learned = flex_mods(name, shape.aux, learn=direction == OPS)
    if direction == OPS and not learned:
        raise NotApplicable(f"{name} captures no float array")
    block_mask = shape.block_mask(name, mask_mod) if mask_mod is not None else None
    q, k, v, do = (t.transpose(1, 2).contiguous() for t in shape.torch_inputs())  # [B, H, S, D]
    variant = "block mask" if block_mask is not None else ""
    if direction == "fwd":
        def call():
            with torch.no_grad():
                return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
        return call, variant
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    wrt = (qg, kg, vg, *(learned if direction == OPS else ()))  # OPS: the captured arrays too

    def call():
        o = flex(qg, kg, vg, score_mod=score_mod, block_mask=block_mask)
        return torch.autograd.grad(o, wrt, do)

    return call, variant


# --- timing ---------------------------------------------------------------


def wall_clock(call, iters):
    """ms per call of a JAX function: dispatch ``iters`` calls, block on the last."""
    import jax

    t0 = time.perf_counter()
    for _ in range(iters):
        r = call()
    jax.block_until_ready(r)
    return (time.perf_counter() - t0) / iters * 1e3


def cuda_clock(call, iters):
    """ms per call on the current CUDA stream, between two CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure(call, clock, reps, rep_ms, iters=0):
    """(first call s, iters, [ms per call] per repetition); iters=0 picks it for ~rep_ms a rep."""
    t0 = time.perf_counter()
    clock(call, 1)
    first = time.perf_counter() - t0
    once = clock(call, 1)
    iters = iters or max(1, min(50, round(rep_ms / max(once, 1e-6))))
    return first, iters, [clock(call, iters) for _ in range(reps)]


def failure(e):
    """(status, message) of an exception: out of memory, skipped or error."""
    text = f"{type(e).__name__}: {e}".strip()
    first = next((line for line in text.splitlines() if line.strip()), text)[:300]
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OutOfMemory" in text:
        return "oom", first
    if isinstance(e, (ImportError, NotApplicable)) or type(e).__name__ == "CudnnUnavailableError":
        return "skipped", first
    return "error", first


def cache_info():
    import scoremod

    return scoremod.cache_info()


def cache_counts():
    info = cache_info()
    return info["builds"], info["build_seconds"]


def run(cfg, save=lambda records, not_run: None):
    """Run every selected case, calling ``save`` after each; returns (records, cases not run)."""
    shapes = [(s, d, s == cfg.long) for s in cfg.seqs for d in cfg.head_dims]
    if cfg.long and not any(s == cfg.long for s, _, _ in shapes):
        shapes.append((cfg.long, max(cfg.head_dims), True))
    units = [(sh, m, i) for sh in shapes for m in cfg.mods for i in cfg.impls]
    records, not_run, start, shape = [], [], time.perf_counter(), None
    for n, ((seq, d, long), name, impl) in enumerate(units, 1):
        if cfg.max_seconds and time.perf_counter() - start > cfg.max_seconds:
            not_run = [f"s{s} d{dd} {m} {i}" for (s, dd, _), m, i in units[n - 1:]]
            print(f"--max-seconds {cfg.max_seconds:g} reached: {len(not_run)} cases not run", flush=True)
            save(records, not_run)
            break
        if shape is None or (shape.s, shape.d) != (seq, d):
            shape = None  # free the previous shape's inputs and masks first
            _free_memory()
            shape = Shape(cfg.batch, cfg.heads, seq, d, cfg.dtype, cfg.window, long)
        for direction in cfg.directions:
            rec = dict(shape.record(), mod=name, impl=impl, direction=direction, variant="",
                       lowered="as written")
            builds, build_s = cache_counts()
            planned = None
            try:
                with warnings.catch_warnings(record=True) as caught:  # scoremod's are recorded
                    warnings.simplefilter("default")  # each once per case
                    if impl in PLANNED_IMPLS:
                        planned = fused_backend(name, shape).name
                    rec["lowered"] = _lowered_here(name, impl, shape)
                    call, clock, rec["variant"] = make_call(impl, name, shape, direction)
                    first, iters, ms = measure(call, clock, cfg.reps, cfg.rep_ms, cfg.iters)
                med = statistics.median(ms)
                rec.update(status="ok", median_ms=med, min_ms=min(ms), max_ms=max(ms),
                           tflops=shape.flops(direction) / med / 1e9, first_call_s=first,
                           iters=iters, reps=len(ms))
            except NotApplicable:
                continue
            except Exception as e:  # OOM and refusals are results too
                rec["status"], rec["message"] = failure(e)
            finally:
                call = None
            said = _sort_warnings(caught)
            if said:
                rec["warnings"] = said
            if planned is not None:  # the backend that ran, and if not cuDNN, as written
                rec["backend"] = backend_ran(planned, said)
                if rec["backend"].split(" ")[0] not in CUDNN_BACKENDS:
                    rec["lowered"] = "as written"
            if rec["status"] == "oom":
                _free_memory()
            b1, s1 = cache_counts()
            rec.update(graph_builds=b1 - builds, graph_build_s=s1 - build_s)
            records.append(rec)
            print(f"[{n:3d}/{len(units)} {time.perf_counter() - start:6.0f}s] {progress(rec)}", flush=True)
            save(records, not_run)  # a command killed at its time limit keeps what it measured
    return records, not_run


def _sort_warnings(caught):
    """The scoremod warnings of a case, in order, once each (they go in its record);
    the others are given again, to the filters in effect outside the case."""
    said = []
    for w in caught:
        text = str(w.message)
        if text.startswith("scoremod:"):
            said += [text] if text not in said else []
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_SHOWN)
    return said


_SHOWN: dict = {}  # warnings.warn_explicit's registry: the "default" action shows each once


def warm_up(impls):
    """Load cuDNN, JAX's CUDA kernels and (for direct, flex) torch with tiny calls,
    so that the first case's first call measures its own compilation and graph
    builds, not the process's start-up. Returns the seconds it took."""
    import jax
    import jax.numpy as jnp

    import scoremod

    t0 = time.perf_counter()
    x = jnp.ones((1, 128, 1, 64), jnp.bfloat16)
    f = lambda q: jnp.sum(jax.nn.dot_product_attention(q, q, q, implementation="cudnn"))  # noqa: E731
    jax.block_until_ready(jax.jit(jax.grad(f))(x))
    mod = scoremod.trace(lambda s, b, h, q, k: 2.0 * jnp.tanh(s / 2.0))
    f = lambda q: jnp.sum(scoremod.attention(q, q, q, mod, implementation="cudnn"))  # noqa: E731
    jax.block_until_ready(jax.jit(jax.grad(f))(x))
    if {"direct", "flex"} & set(impls):
        import torch

        torch.ones(1, device="cuda").sum().item()
    return time.perf_counter() - t0


def _free_memory():
    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        sys.modules["torch"].cuda.empty_cache()


def progress(r):
    head = f"s{r['seq']} d{r['head_dim']} {r['mod']:14s} {r['impl']:9s} {DIRECTIONS[r['direction']]:7s}"
    head += f" [{r['backend']}]" if "backend" in r else ""
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()}: {r.get('message', '')}"
    builds = f", {r['graph_builds']} graph builds" if r["graph_builds"] else ""
    return (f"{head} {fmt_ms(r['median_ms'])} ms ({fmt_ms(r['min_ms'])}-{fmt_ms(r['max_ms'])})"
            f" {fmt_tf(r['tflops'])} TF/s  first call {r['first_call_s']:.2f} s{builds}")


# --- targets ----------------------------------------------------------------

# (name, mods (None: all), directions, numerator (impl, mod), denominator impl, bound, at least?)
# ratio = time(numerator) / time(scoremod or direct); "bwd" is fwd+bwd minus fwd. The
# result shows on the row of the implementation compared with scoremod fused.
TARGETS = [
    ("FFI / direct", None, ("fwd", "fwdbwd"), ("scoremod", None), "direct", 1.03, False),
    ("ids traced / direct", DOC_MODS, ("fwd", "fwdbwd"), ("scoremod-ids", None), "direct", 1.03,
     False),
    ("vs plain cuDNN", ("softcap",), ("fwd",), ("jax-cudnn", None), "scoremod", 0.80, True),
    ("vs plain cuDNN", ("softcap",), ("bwd",), ("jax-cudnn", None), "scoremod", 0.92, True),
    ("vs plain cuDNN", ("alibi",), ("fwd",), ("jax-cudnn", None), "scoremod", 0.80, True),
    ("vs plain cuDNN", ("alibi",), ("bwd",), ("jax-cudnn", None), "scoremod", 0.95, True),
    ("vs native mask", MASK_MODS, ("fwd", "fwdbwd"), ("jax-cudnn", None), "scoremod", 0.95, True),
    ("vs plain cuDNN at D + 64", ROPE_MODS, ("fwd", "fwdbwd"), ("jax-cudnn", None), "scoremod",
     0.90, True),
    ("vs cuDNN MLA, v at D", ROPE_MODS, ("fwd", "fwdbwd"), ("jax-cudnn-mla", None), "scoremod",
     0.90, True),
    ("vs unsplit score_mod", ("softcap_causal",), ("fwd", "fwdbwd"), ("scoremod-plain", None),
     "scoremod", 1.5, True),
    ("vs XLA reference at seq 4096", None, ("fwdbwd",), ("xla", None), "scoremod", 4.0, True),
    ("vs FlexAttention", None, ("fwd", "fwdbwd", OPS), ("flex", None), "scoremod", 1.2, True),
    ("prefix-LM vs FlexAttention", ("prefix_lm", "softcap_prefix_lm"), ("fwd", "fwdbwd"),
     ("flex", None), "scoremod", 1.3, True),
    ("sinks / without", ("softcap_causal", "window"), ("fwd", "fwdbwd"), ("scoremod-sinks", None),
     "scoremod", 1.05, False),
    ("sinks, dSink in cuDNN's graph / without", ("softcap_causal", "window"), ("fwdbwd",),
     ("scoremod-sinks-dsink", None), "scoremod", 1.05, False),
    # the cost of repeatable gradients: cuDNN's deterministic backward measured
    # 1.04-1.08x its default (benchmarks/probes/cudnn_deterministic.py)
    ("deterministic / default", ("softcap", "causal", "softcap_causal"), ("fwdbwd",),
     ("scoremod-deterministic", None), "scoremod", 1.1, False),
]


TARGET_SHAPES = ((4096, 128), (16384, 128))  # (seq, head dim) where the ratios are targets


def targets(records):
    """The issue's targets: one row per case and direction where both times exist, at the
    ``TARGET_SHAPES`` (other shapes are reported without targets), and the long case's
    "runs where the XLA reference runs out of memory"."""
    by = {(r["seq"], r["head_dim"], r["mod"], r["impl"], r["direction"]): r for r in records}

    def ms(case, mod, impl, direction):
        """(time or None, the runs it comes from: merged files mix runs)."""
        if direction == "bwd":
            (fb, r1), (f, r2) = ms(case, mod, impl, "fwdbwd"), ms(case, mod, impl, "fwd")
            return (fb - f if fb is not None and f is not None and fb > f else None), r1 | r2
        r = by.get((*case, mod, impl, direction), {})
        return (r.get("median_ms") if r.get("status") == "ok" else None), {r.get("run")}

    rows = []
    for long, seq, d in _shapes(records):
        checked = TARGETS if (seq, d) in TARGET_SHAPES else ()
        for mod in (m for m in MODS if any((seq, d, m) == (r["seq"], r["head_dim"], r["mod"]) for r in records)):
            for name, mods, directions, (num, num_mod), den, bound, at_least in checked:
                if (mods is not None and mod not in mods) or ("4096" in name and seq != 4096):
                    continue
                for direction in directions:
                    (a, ra), (b, rb) = (ms((seq, d), num_mod or mod, num, direction),
                                        ms((seq, d), mod, den, direction))
                    if a is not None and b is not None:
                        runs = ra | rb
                        rows.append({"seq": seq, "head_dim": d, "mod": mod, "direction": direction,
                                     "impl": den if num == "scoremod" and num_mod is None else num,
                                     "target": name, "ratio": a / b,
                                     # a ratio should come from one run; say when it does not
                                     "runs": sorted(runs) if len(runs) > 1 else [],
                                     "needed": f"{'>=' if at_least else '<='} {bound:g}",
                                     "pass": a / b >= bound if at_least else a / b <= bound})
            for direction in DIRECTIONS if long else ():
                r = by.get((seq, d, mod, "scoremod", direction))
                xla = by.get((seq, d, mod, "xla", direction), {}).get("status", "not run")
                if r is not None:
                    rows.append({"seq": seq, "head_dim": d, "mod": mod, "direction": direction,
                                 "impl": "xla", "target": f"scoremod runs (XLA: {xla})", "ratio": None,
                                 "needed": "runs", "pass": r["status"] == "ok"})
    return rows


# --- output: JSON, markdown, plot -----------------------------------------


def fmt_ms(x):
    return f"{x:.{max(0, min(3, 3 - math.floor(math.log10(x))))}f}" if x > 0 else "0"


def fmt_tf(x):
    return f"{x:.0f}" if x >= 10 else f"{x:.3g}"


def _cell(r):
    if r is None:
        return "", ""
    if r["status"] != "ok":
        msg = r.get("message", "").replace("|", "\\|")
        return ("OOM" if r["status"] == "oom" else f"{r['status']}: {msg[:90]}"), ""
    return (f"{fmt_ms(r['median_ms'])} ({fmt_ms(r['min_ms'])}-{fmt_ms(r['max_ms'])})",
            fmt_tf(r["tflops"]))


def _verdict(t):
    ratio = "" if t["ratio"] is None else f"{t['ratio']:.3f} "
    runs = f" (runs {'+'.join(str(r + 1) for r in t['runs'])})" if t.get("runs") else ""
    return (f"{DIRECTIONS.get(t['direction'], t['direction'])} {ratio}"
            f"{'pass' if t['pass'] else '**miss**'}{runs}")


def _shapes(records):
    return sorted({(r["long"], r["seq"], r["head_dim"]) for r in records})


def markdown(records, metas, image=None):
    """The generated section of docs/performance.md (without the markers)."""
    out = ["## Benchmark harness", "",
           "Generated by `python benchmarks/run.py` (benchmarks/harness.py, see benchmarks/README.md); "
           "edit the code, not this section.", ""]
    for i, m in enumerate(metas, 1):
        skipped = f"; {len(m['not_run'])} cases not run (--max-seconds)" if m.get("not_run") else ""
        if "startup_s" in m:  # runs since e4507c5 warm the libraries up before the first case
            skipped += f"; library start-up {m['startup_s']:.1f} s, before the first case"
        out.append(f"- run {i}: {m.get('date', '?')}, commit {m.get('commit', '?')}: {m.get('device', '?')}; "
                   f"jax {m.get('jax', '?')}, cuDNN {m.get('cudnn_backend', '-')}, frontend "
                   f"{m.get('cudnn_frontend', '-')}, torch {m.get('torch', '-')}: "
                   f"`python benchmarks/run.py {' '.join(m.get('argv', []))}`{skipped}")
    r0 = records[0] if records else {}
    out += ["", f"Batch {r0.get('batch')}, {r0.get('heads')} heads, {r0.get('dtype')}. Time per call in "
            "ms: median (min-max) of the repetitions, each of N calls after warm-up (JAX: wall clock "
            "to the last result; torch and the frontend: CUDA events). TF/s at the median, with "
            "FLOPs counted dense for every mod, masked ones too: 4·B·H·S²·D forward, 2.5x that "
            "backward (fwd+bwd: 3.5x). The first call (compilation, cuDNN graph builds) is timed "
            "apart. jax.nn's masks and biases and FlexAttention's block masks are built once, "
            "outside the timed call; scoremod materializes what it needs inside it.", "",
            "Targets: a ratio is the other implementation's time over scoremod fused's (FFI: "
            "scoremod's over the direct run's); `bwd` is fwd+bwd minus fwd. They are checked at "
            "the issue's shapes, seq 4096 and 16384 with head dim 128 (and the long case runs); "
            "the other shapes are reported without them. A ratio whose two times come from "
            "different runs of the list above names them, e.g. \"(runs 2+5)\". The `direct` run of a split mod leaves "
            "out the sum of the blocks' key gradients. scoremod fused, plain "
            "score_mod: the mod lowered as written (no native mask, query-block split or scale "
            "folding), the baseline of those three lowerings.", ""]
    if image:
        out += [f"![throughput and time per call]({image})", ""]
    rows = targets(records)
    if rows:
        out += ["| target | needed | pass | miss | worst |", "|---|---|---|---|---|"]
        for name, needed in dict.fromkeys((t["target"], t["needed"]) for t in rows):
            these = [t for t in rows if (t["target"], t["needed"]) == (name, needed)]
            rated = [t for t in these if t["ratio"] is not None]
            worst = min(rated, key=lambda t: t["ratio"] if ">=" in needed else -t["ratio"], default=None)
            worst = f"{worst['ratio']:.3f}: s{worst['seq']} d{worst['head_dim']} {worst['mod']} " \
                    f"{worst['direction']}" if worst else ""
            out.append(f"| {name} | {needed} | {sum(t['pass'] for t in these)} "
                       f"| {sum(not t['pass'] for t in these)} | {worst} |")
        out.append("")
    for long, seq, d in _shapes(records):
        here = {(r["mod"], r["impl"], r["direction"]): r for r in records
                if (r["long"], r["seq"], r["head_dim"]) == (long, seq, d)}
        dirs = _directions(here.values())
        out += [f"### seq {seq}, head dim {d}{' (long case)' if long else ''}", "",
                "| mod | implementation | "
                + " | ".join(f"{DIRECTIONS[x]} ms | {DIRECTIONS[x]} TF/s" for x in dirs)
                + " | first call s | graph builds | targets |",
                "|---|---|" + "---|---|" * len(dirs) + "---|---|---|"]
        for mod in MODS:
            for impl in IMPLS:
                got = [here.get((mod, impl, x)) for x in dirs]
                some = [r for r in got if r is not None]
                if not some:
                    continue
                variant = some[0].get("variant")
                how = some[0].get("lowered", "as written") if impl in ("scoremod", "direct") else ""
                parts = [p for p in (_backends(dirs, got), variant, "" if how == "as written" else how)
                         if p]
                label = IMPLS[impl] + (f" ({'; '.join(parts)})" if parts else "")
                first = " / ".join(f"{r['first_call_s']:.2f}" if r and "first_call_s" in r else "-"
                                   for r in got)
                builds = " / ".join(str(r["graph_builds"]) if r else "-" for r in got) \
                    if impl in ("scoremod", "scoremod-plain", "scoremod-ids", "direct") else ""
                mine = [t for t in rows if (t["seq"], t["head_dim"], t["mod"], t["impl"]) == (seq, d, mod, impl)]
                verdicts = "; ".join(f"{name}{'' if needed == 'runs' else f' ({needed})'}: " + ", ".join(
                    _verdict(t) for t in mine if (t["target"], t["needed"]) == (name, needed))
                    for name, needed in dict.fromkeys((t["target"], t["needed"]) for t in mine))
                cells = " | ".join(" | ".join(_cell(r)) for r in got)
                out.append(f"| {mod} | {label} | {cells} | {first} | {builds} | {verdicts} |")
        out.append("")
    out.append("First call s and graph builds: one per direction, in the columns' order. Cells of "
               "runs that failed say why. scoremod fused runs implementation=None: the backend in "
               "its label is the one the planner picked (and any it fell back to).")
    return "\n".join(out)


def _directions(records):
    """The directions of a table or plot: fwd and fwd+bwd, and the operand-gradient
    timing where some record has it."""
    return [x for x in DIRECTIONS if x in DEFAULT_DIRECTIONS or any(r["direction"] == x for r in records)]


def _backends(dirs, got):
    """The backends that ran a row's calls: one name, or one per direction where they differ."""
    ran = {DIRECTIONS[x]: r["backend"] for x, r in zip(dirs, got) if r and r.get("backend")}
    if len(set(ran.values())) <= 1:
        return next(iter(ran.values()), "")
    return "; ".join(f"{x}: {b}" for x, b in ran.items())


def write_section(path, section):
    """Replace the text between the bench markers of ``path`` (appended if absent)."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Performance\n"
    block = f"{BEGIN}\n{section.rstrip()}\n{END}"
    i, j = text.find(BEGIN), text.find(END)
    if 0 <= i < j:
        text = text[:i] + block + text[j + len(END):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def plot(records, path):
    """One row per shape: TF/s and ms per call, forward and forward+backward (and with
    operand gradients, when measured). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: plot skipped")
        return None
    shapes, dirs = _shapes(records), _directions(records)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    fig, axes = plt.subplots(len(shapes), 2 * len(dirs), figsize=(11 * len(dirs), 3.2 * len(shapes)),
                             squeeze=False)
    for row, (long, seq, d) in enumerate(shapes):
        here = [r for r in records if (r["long"], r["seq"], r["head_dim"]) == (long, seq, d)]
        mods = [m for m in MODS if any(r["mod"] == m for r in here)]
        x = np.arange(len(mods))
        for col, (direction, key) in enumerate([(dd, k) for dd in dirs for k in ("tflops", "median_ms")]):
            ax, width = axes[row][col], 0.8 / len(impls)
            measured = False
            for j, impl in enumerate(impls):
                got = [next((r for r in here if (r["mod"], r["impl"], r["direction"]) == (m, impl, direction)),
                            {}) for m in mods]
                pos = x + (j - len(impls) / 2 + 0.5) * width
                heights = [r.get(key, np.nan) for r in got]
                measured |= any(h is not None and h > 0 for h in heights)
                ax.bar(pos, heights, width, label=IMPLS[impl])
                for p, r in zip(pos, got):
                    if r.get("status") == "oom":
                        ax.text(p, 0.02, "OOM", rotation=90, fontsize=6, ha="center",
                                transform=ax.get_xaxis_transform())
            ax.set_xticks(x, mods, rotation=30, fontsize=7)
            unit = "TF/s" if key == "tflops" else "ms per call (log)"
            ax.set_title(f"seq {seq}{' (long)' if long else ''}, head dim {d}: {DIRECTIONS[direction]}, {unit}",
                         fontsize=9)
            if key == "median_ms" and measured:  # a log axis needs a positive value
                ax.set_yscale("log")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="upper center", ncol=len(impls), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.2 * len(shapes))))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def metadata(argv, cfg):
    import jax

    m = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "argv": list(argv), "jax": jax.__version__, "config": vars(cfg).copy()}
    m["config"].pop("from_", None)
    try:
        dev = jax.devices()[0]
        m["device"] = f"{dev.device_kind} ({dev.platform})"
    except RuntimeError as e:
        m["device"] = f"none ({e})"
    try:
        m["commit"] = cfg.commit or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True,
            timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        m["commit"] = "?"
    if "torch" in sys.modules:
        m["torch"] = sys.modules["torch"].__version__
    if "cudnn" in sys.modules:
        m["cudnn_frontend"] = sys.modules["cudnn"].__version__
        try:
            m["cudnn_backend"] = sys.modules["cudnn"].backend_version()
        except Exception:  # the backend library may not load on this machine
            pass
    m["graph_cache"] = cache_info()
    m.update(switches())
    return m


def switches():
    """The default lowering options of this process (the SCOREMOD_* environment variables)."""
    import scoremod

    o = scoremod.options.defaults()
    return {"native_masks": o.native_masks, "split_blocks": o.split_blocks,
            "fold_scale": o.fold_scale, "max_segments": o.max_segments}


def load(paths):
    """Merge saved runs: metadata listed, results keyed by case (a later file wins).

    A result of the ``direct`` run is kept only if scoremod's result for the
    same case ran the same lowering (``lowered``): else they ran different graphs."""
    metas, merged = [], {}
    for p in paths:
        data = json.loads(Path(p).read_text())
        base = len(metas)  # "run": index into the merged metadata (a fresh run's file has one)
        metas += data["meta"]
        for r in data["results"]:
            run = base + r.get("run", len(data["meta"]) - 1)
            meta = {} if r["impl"] == "scoremod-plain" else metas[run]
            merged[(r["seq"], r["head_dim"], r["mod"], r["impl"], r["direction"])] = \
                dict(r, run=run, lowered=r.get("lowered") or lowered(r["mod"], meta))
    records = list(merged.values())
    mine = {(r["seq"], r["head_dim"], r["mod"], r["direction"]): r["lowered"]
            for r in records if r["impl"] == "scoremod"}
    kept = []
    for r in records:
        theirs = mine.get((r["seq"], r["head_dim"], r["mod"], r["direction"]))
        if r["impl"] != "direct" or theirs in (None, r["lowered"]):
            kept.append(r)
        else:
            print(f"dropped: s{r['seq']} d{r['head_dim']} {r['mod']} direct {r['direction']} "
                  f"(ran {r['lowered']}; scoremod ran {theirs})")
    return kept, metas


# Which of the benchmark's mods each lowering switch changes (run metadata key, test).
SWITCHES = {
    "native mask": ("native_masks", lambda v: bool(v), ("causal", "window")),
    "ragged sequences": ("native_masks", lambda v: bool(v), DOC_MODS),
    "query blocks": ("split_blocks", lambda v: (v or 0) > 1, ("softcap_causal", "document_softcap")),
    "scale folded": ("fold_scale", lambda v: bool(v), ("softcap", "softcap_causal",
                                                      "document_softcap")),
}


def _lowered_here(name, impl, shape):
    """``lowered`` for this run, with the block count the split plans at this shape."""
    if impl in ("xla",) + PALLAS_IMPLS:  # the cuDNN lowerings' switches do not apply
        return "as written"
    if impl in CUDNN_IMPLS and fused_backend(name, shape).name not in CUDNN_BACKENDS:
        return "as written"  # the planner gave the mod to another backend (Pallas)
    how = lowered(name, {} if impl == "scoremod-plain" else switches())
    if "query blocks" not in how:
        return how
    plan = plan_of(name, shape)
    parts = [p for p in how.split(", ") if p != "query blocks"]
    return ", ".join(([f"{len(plan.blocks)} query blocks"] if plan.split else []) + parts) \
        or "as written"


def lowered(mod, meta):
    """How a run with these switches (its metadata) lowered the benchmark's ``mod``."""
    on = [name for name, (key, test, mods) in SWITCHES.items() if mod in mods and test(meta.get(key))]
    return ", ".join(on) or "as written"


# --- command line -----------------------------------------------------------


def _list(kind, choices=None):
    def parse(text):
        items = [kind(x) for x in text.split(",") if x.strip()]
        bad = [x for x in items if choices is not None and x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return items

    return parse


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke run: tiny shapes, reference path only (runs without a GPU)")
    ap.add_argument("--seqs", type=_list(int), default=[1024, 4096, 16384], help="comma list ('' for none)")
    ap.add_argument("--head-dims", type=_list(int), default=[64, 128])
    ap.add_argument("--long", type=int, default=32768,
                    help="the long case's seq (largest head dim); 0 for none")
    ap.add_argument("--mods", type=_list(str, MODS), default=list(DEFAULT_MODS),
                    help=", ".join(MODS) + f" (default: all but {', '.join(GYM_MODS)})")
    ap.add_argument("--impls", type=_list(str, IMPLS),
                    default=[i for i in IMPLS if i not in PALLAS_IMPLS],
                    help=", ".join(IMPLS) + " (default: all but " + ", ".join(PALLAS_IMPLS) + ")")
    ap.add_argument("--directions", type=_list(str, DIRECTIONS), default=list(DEFAULT_DIRECTIONS),
                    help="fwd, fwdbwd and fwdbwd_ops: forward+backward with the gradients of the "
                    "mod's captured float arrays too (ALiBi slopes, relbias table), on "
                    + ", ".join(OPS_IMPLS) + " (default: fwd,fwdbwd; --dry-run: all three)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--window", type=int, default=256, help="sliding window size")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=0, help="calls per repetition (0: about --rep-ms)")
    ap.add_argument("--rep-ms", type=float, default=50.0)
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="start no new case after this many seconds (0: no limit)")
    ap.add_argument("--json", help="write the results here (after every case)")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse HEAD of this checkout)")
    ap.add_argument("--doc", help="markdown page whose bench section is replaced, e.g. "
                    "docs/performance.md (default: no page, no plot)")
    ap.add_argument("--images", help="folder for bench.png (default: images/ beside --doc)")
    ap.add_argument("--from", dest="from_", nargs="+", metavar="JSON",
                    help="run nothing: merge these results and write the page and the plot")
    a = ap.parse_args(argv)
    if a.dry_run:  # tiny defaults, unless given on the command line
        given = {x.split("=")[0].lstrip("-").replace("-", "_") for x in argv if x.startswith("--")}
        for k, v in DRY.items():
            if k not in given:
                setattr(a, k, v)
    if not a.head_dims or not (a.seqs or a.long):
        ap.error("no shapes selected")
    return a


def no_gpu():
    """Why this machine cannot run the benchmarks (no GPU), or None."""
    import scoremod

    dev = scoremod.device.current()
    return None if dev.platform == "gpu" else f"no GPU is visible to JAX (device: {dev.platform})"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    def save(records, metas):
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps({"meta": metas, "results": records,
                                                "targets": targets(records)}, indent=1))

    if a.from_:
        records, metas = load(a.from_)
    else:
        if not a.dry_run:
            reason = no_gpu()
            if reason:
                print(f"benchmarks/run.py: {reason}; the benchmarks time the fused path on an "
                      "NVIDIA GPU. Run with --dry-run for a CPU smoke test.", file=sys.stderr)
                return 2
        if not a.dry_run:  # torch shares the GPU: JAX grows its pool instead of taking 75% up front
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        meta = metadata(argv, a)
        metas = [meta]

        def checkpoint(records, not_run):
            meta.update(not_run=not_run, graph_cache=cache_info())
            save(records, metas)

        if not a.dry_run:
            try:
                meta["startup_s"] = warm_up(a.impls)
                print(f"library start-up (before the first case): {meta['startup_s']:.2f} s",
                      flush=True)
            except Exception as e:  # the cases still run; their first calls include start-up
                print(f"warm-up failed, the first case pays library start-up: {failure(e)}",
                      flush=True)
        records, _ = run(a, checkpoint)
        meta.update(metadata(argv, a))  # now with the torch and cuDNN versions
    for t in targets(records):
        ratio = "" if t["ratio"] is None else f"{t['ratio']:.3f} "
        print(f"target s{t['seq']} d{t['head_dim']} {t['mod']} {t['direction']}: {t['target']}: "
              f"{ratio}(needs {t['needed']}) {'pass' if t['pass'] else 'MISS'}")
    if a.json:
        save(records, metas)
        print(f"wrote {a.json}")
    doc = a.doc
    if doc:
        images = Path(a.images) if a.images else Path(doc).parent / "images"
        png = plot(records, images / "bench.png")
        image = os.path.relpath(png, Path(doc).parent) if png else None
        write_section(doc, markdown(records, metas, image))
        print(f"wrote {doc}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
