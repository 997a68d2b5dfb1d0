"""Lowering options: how a fused backend may rewrite a mod, as one frozen value.

The lowerings below make common mods faster; each is on by default and
each can be switched off per call (for comparison, and as an escape hatch):

    >>> import scoremod
    >>> plain = scoremod.LoweringOptions(native_masks=False, split_blocks=0, fold_scale=False,
    ...                                  low_rank_bias=False, decode_splits=0)
    >>> plain == scoremod.LoweringOptions.plain()
    True
    >>> with scoremod.lowering_options(plain):
    ...     scoremod.options.current() == plain
    True

An options value is hashable and part of every plan and graph cache key, so
two calls with different options never share a plan or a graph. A call takes
``attention(..., options=...)`` when given, else the innermost
``with lowering_options(...)``, else the defaults, which the environment
variables ``SCOREMOD_NATIVE_MASKS``, ``SCOREMOD_SPLIT_BLOCKS``,
``SCOREMOD_FOLD_SCALE``, ``SCOREMOD_LOW_RANK_BIAS``, ``SCOREMOD_MAX_SEGMENTS``,
``SCOREMOD_CHECK_VALUES``, ``SCOREMOD_DETERMINISTIC`` and ``SCOREMOD_DECODE_SPLITS`` set
(read once, here and nowhere else).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os

from scoremod.errors import ScoreModError

__all__ = ["LoweringOptions", "defaults", "current", "lowering_options"]

PALLAS_ENGINES = ("auto", "triton", "mosaic")  # LoweringOptions.pallas_engine


@dataclasses.dataclass(frozen=True)
class LoweringOptions:
    """How the fused path may lower a mod (all three lowerings passed their GPU tests).

    Attributes:
      native_masks: a pure band mask (causal, sliding window) runs as plain
        attention under cuDNN's native mask, which skips masked tiles.
      split_blocks: a band-masked mod with a modifier (softcap + causal)
        splits into at most this many query blocks, each a fused call on the
        keys it can see; 0 or 1: one call. Measured at seq 4096 and 16384
        (batch 4, 16 heads): 8 blocks beat 4 by 6-9% forward.
      fold_scale: a constant factor of the score on every use (softcap's
        ``score / 30``) joins cuDNN's attn_scale, where it costs nothing.
      low_rank_bias: a mod ``f(score + sum_j a[.., q_idx, j] * c[.., kv_idx, j])``
        runs as ``f(score)`` on q and k with the bias's columns appended, for
        every backend (``scoremod.lowering.lowrank``; docs/guide.md).
      max_segments: segment (packed-document) masks run as ragged sequences,
        at most this many per row (the slots every call pays for); a row with
        more runs, or ids that are not increasing runs, takes the dense
        route at run time (docs/guide.md, "Packed documents").
      sms: streaming multiprocessors the split's wave model assumes; None
        asks the device (132 where it cannot tell). Small values make small
        shapes split, as the tests do.
      pallas_block_q, pallas_block_kv: the Pallas backend's forward tile
        (query rows x keys); powers of two, at least 16.
      pallas_backward_block_q, pallas_backward_block_kv: its backward tile.
      pallas_num_warps: warps per Pallas program (None: 4 for head dim 64,
        8 for 128); pallas_num_stages: Triton's software-pipelining depth.
      pallas_engine: the Pallas backend's kernels: ``"triton"`` (Pallas's
        Triton lowering: any NVIDIA GPU, interpret mode elsewhere, every dtype
        and op of the table), ``"mosaic"`` (Pallas's Mosaic GPU lowering for
        Hopper: wgmma, TMA and warp specialization; float16 and bfloat16, head
        dim 64 or 128, fixed tiles, captured arrays read at positions built
        from ``b``, ``h``, constants and at most one of ``q_idx`` or
        ``kv_idx``; refused elsewhere) or ``"auto"``, the default: the Mosaic
        GPU engine where it takes the call, else the Triton one (the plan's
        description says which ran and why). The backward follows the
        forward's engine (on the Mosaic one, gradients of captured float
        arrays read at an index that varies over the tile run on the Triton
        backward); the pallas_* tile and warp options above are the Triton
        kernels'.
      check_values: the fused paths follow the masked-key rule for NaN and
        inf in V (docs/guide.md, "Fully masked rows") as the reference path
        does: each kernel call tests V (a reduction, and a conditional whose
        predicate XLA reads on the host) and runs twice when V holds one.
        Off by default (V is taken to be finite): a non-finite value at a
        masked key may then make NaN the rows of the tiles that read it.
      deterministic: every gradient repeats bitwise from run to run. cuDNN's
        backward graphs are then built with its deterministic algorithm (dQ
        accumulated in a fixed order; by default the order varies, in the
        last bits: measured on the H200, cuDNN 9.19), at about 1.04-1.08x the
        default backward's time; the Pallas kernels' Mosaic GPU backward then
        computes dQ in a kernel of its own (where its dK/dV kernel computes dQ,
        ``mosaic_backward.FUSE_DQ``, it adds dQ up in float32 in any order: the
        last bits vary); the Triton backward uses no atomics either way, nor do
        the gradients of captured arrays on either; the reference path repeats
        as XLA's ops do (on a GPU,
        ``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` for its scatters). The
        forward is the same either way.
      decode_splits: short queries (at most 16 query rows, and 64 once a group's
        query heads are packed together: decoding, speculative decoding) run folded
        on the fused backends (``scoremod.lowering.decode``): the query heads
        of each key/value head packed into query rows, and the keys cut into
        this many chunks folded into the batch, joined by their LSEs (on the
        Pallas kernels' Mosaic GPU engine: this many programs per query tile,
        each taking a part of the tile's key list). None: the fewest chunks
        (of at least 1024 keys) that give the GPU two waves of tiles (parts:
        one wave); 1: packing only; 0: no folding.
      mosaic_forward: where the planner puts a call on cuDNN's score_mod graphs
        (a mod cuDNN evaluates per score, not a native mask) and the Pallas
        kernels' Mosaic GPU engine takes it, run the forward there and keep
        cuDNN's backward, which runs on that forward's O and LSE (both compute
        the same softmax; a gradient cuDNN does not compute, of captured arrays
        or of the LSE, runs on the Pallas kernels' own backward). Off by
        default until the benchmarks (``scoremod-mosaic-forward``) show where
        it is faster.

    Example: softcap + causal as one score_mod call, for comparison::

        >>> import scoremod
        >>> scoremod.LoweringOptions().replace(split_blocks=0)
        LoweringOptions(native_masks=True, split_blocks=0, fold_scale=True, low_rank_bias=True, max_segments=8, sms=None, pallas_block_q=128, pallas_block_kv=64, pallas_backward_block_q=64, pallas_backward_block_kv=64, pallas_num_warps=None, pallas_num_stages=2, pallas_engine='auto', check_values=False, deterministic=False, decode_splits=None, mosaic_forward=False)
    """

    native_masks: bool = True
    split_blocks: int = 8
    fold_scale: bool = True
    low_rank_bias: bool = True
    max_segments: int = 8
    sms: int | None = None
    pallas_block_q: int = 128
    pallas_block_kv: int = 64
    pallas_backward_block_q: int = 64
    pallas_backward_block_kv: int = 64
    pallas_num_warps: int | None = None
    pallas_num_stages: int = 2
    pallas_engine: str = "auto"
    check_values: bool = False
    deterministic: bool = False
    decode_splits: int | None = None
    mosaic_forward: bool = False

    def __post_init__(self):
        for name in ("native_masks", "fold_scale", "low_rank_bias", "check_values",
                     "deterministic", "mosaic_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ScoreModError(f"LoweringOptions.{name} must be True or False, "
                                    f"got {getattr(self, name)!r}")
        if not isinstance(self.split_blocks, int) or self.split_blocks < 0:
            raise ScoreModError("LoweringOptions.split_blocks must be a number of query blocks "
                                f"(0: no split), got {self.split_blocks!r}")
        if not isinstance(self.max_segments, int) or self.max_segments < 1:
            raise ScoreModError("LoweringOptions.max_segments must be a positive number of "
                                f"segments per row, got {self.max_segments!r}")
        if self.decode_splits is not None and (
                not isinstance(self.decode_splits, int) or isinstance(self.decode_splits, bool)
                or self.decode_splits < 0):
            raise ScoreModError("LoweringOptions.decode_splits must be a number of key chunks "
                                f"(0: no folding) or None, got {self.decode_splits!r}")
        if self.sms is not None and (not isinstance(self.sms, int) or self.sms < 1):
            raise ScoreModError(f"LoweringOptions.sms must be a positive int or None, got {self.sms!r}")
        for name in ("pallas_block_q", "pallas_block_kv", "pallas_backward_block_q",
                     "pallas_backward_block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ScoreModError(f"LoweringOptions.{name} must be a power of two of at least "
                                    f"16 (a Triton tile), got {value!r}")
        if self.pallas_num_warps is not None and self.pallas_num_warps not in (1, 2, 4, 8, 16):
            raise ScoreModError("LoweringOptions.pallas_num_warps must be 1, 2, 4, 8, 16 or None, "
                                f"got {self.pallas_num_warps!r}")
        if not isinstance(self.pallas_num_stages, int) or self.pallas_num_stages < 1:
            raise ScoreModError("LoweringOptions.pallas_num_stages must be a positive int, "
                                f"got {self.pallas_num_stages!r}")
        if self.pallas_engine not in PALLAS_ENGINES:
            raise ScoreModError(f"LoweringOptions.pallas_engine must be one of "
                                f"{', '.join(map(repr, PALLAS_ENGINES))}, got {self.pallas_engine!r}")

    @classmethod
    def plain(cls) -> "LoweringOptions":
        """The mod lowered as written: no native mask, no split, no folding (of the
        scale, of a low-rank bias, of short queries)."""
        return cls(native_masks=False, split_blocks=0, fold_scale=False, low_rank_bias=False,
                   decode_splits=0)

    def replace(self, **changes) -> "LoweringOptions":
        return dataclasses.replace(self, **changes)


# Environment variable -> (field, parse, what it expects).
_ENVIRONMENT = {
    "SCOREMOD_NATIVE_MASKS": ("native_masks", bool, "0 (off) or 1 (on)"),
    "SCOREMOD_SPLIT_BLOCKS": ("split_blocks", int, "a number of query blocks (0: off)"),
    "SCOREMOD_FOLD_SCALE": ("fold_scale", bool, "0 (off) or 1 (on)"),
    "SCOREMOD_LOW_RANK_BIAS": ("low_rank_bias", bool, "0 (off) or 1 (on)"),
    "SCOREMOD_MAX_SEGMENTS": ("max_segments", int, "a positive number of segments per row"),
    "SCOREMOD_CHECK_VALUES": ("check_values", bool, "0 (off) or 1 (on)"),
    "SCOREMOD_DETERMINISTIC": ("deterministic", bool, "0 (off) or 1 (on)"),
    "SCOREMOD_DECODE_SPLITS": ("decode_splits", int, "a number of key chunks (0: no folding)"),
    "SCOREMOD_MOSAIC_FORWARD": ("mosaic_forward", bool, "0 (off) or 1 (on)"),
}


@functools.lru_cache(maxsize=None)
def defaults() -> LoweringOptions:
    """The options of calls that give none: the environment's, read once per process."""
    values = {}
    for name, (field, kind, wanted) in _ENVIRONMENT.items():
        text = os.environ.get(name)
        if text is None:
            continue
        try:
            value = int(text)
            if value < (1 if field == "max_segments" else 0) or (kind is bool and value > 1):
                raise ValueError
        except ValueError:
            raise ScoreModError(f"environment variable {name}={text!r}: expected {wanted}") from None
        values[field] = kind(value)
    return LoweringOptions(**values)


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("scoremod_lowering_options", default=None)


def current() -> LoweringOptions:
    """The options in effect here: the innermost ``lowering_options`` block's, else the defaults."""
    options = _CURRENT.get()
    return defaults() if options is None else options


@contextlib.contextmanager
def lowering_options(options: LoweringOptions | None = None, **changes):
    """Calls traced inside use ``options`` (default: the current ones) with ``changes``.

    The options are read when a call is traced: a function jitted inside the
    block and called outside keeps what it was traced with.

        >>> import scoremod
        >>> with scoremod.lowering_options(fold_scale=False) as inside:
        ...     inside.fold_scale, scoremod.options.current() is inside
        (False, True)
    """
    base = current() if options is None else options
    if not isinstance(base, LoweringOptions):
        raise ScoreModError(f"lowering_options takes a LoweringOptions, got {type(base).__name__}")
    token = _CURRENT.set(base.replace(**changes) if changes else base)
    try:
        yield current()
    finally:
        _CURRENT.reset(token)


# --- the process's on-disk caches (process settings, not part of any key) ------------

DEFAULT_PLAN_CACHE_MB = 256


def _flag(name, default) -> bool:
    text = os.environ.get(name, default).strip()
    if text not in ("0", "1"):
        raise ScoreModError(f"environment variable {name}={text!r}: expected 0 (off) or 1 (on)")
    return text == "1"


def cache_root() -> str | None:
    """Where scoremod's on-disk caches live: ``$SCOREMOD_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/scoremod``, else ``~/.cache/scoremod``; None when
    ``SCOREMOD_CACHE_DIR`` is set empty (no on-disk cache at all)."""
    explicit = os.environ.get("SCOREMOD_CACHE_DIR")
    if explicit is not None:
        return os.path.expanduser(explicit) if explicit.strip() else None
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return os.path.join(xdg if xdg else os.path.join(os.path.expanduser("~"), ".cache"),
                        "scoremod")


def jax_cache_dir() -> str | None:
    """``<cache root>/jax`` when ``SCOREMOD_JAX_CACHE=1`` (default 0) asks for JAX's
    persistent compilation cache there, for every compile of the process; else None.
    Independent of the cuDNN plan cache's switch."""
    root = cache_root()
    return os.path.join(root, "jax") if root is not None and _flag("SCOREMOD_JAX_CACHE", "0") else None


def cudnn_verify_on_first_use() -> bool:
    """``SCOREMOD_CUDNN_VERIFY`` (default 1): whether ``implementation=None`` checks a
    cuDNN that is neither validated nor verified on this machine yet, once, at its
    first automatic use (``lowering/cudnn/verify.py``); 0 leaves that to
    ``scoremod doctor --verify`` and takes the next route until then."""
    return _flag("SCOREMOD_CUDNN_VERIFY", "1")


@dataclasses.dataclass(frozen=True)
class PlanCacheSettings:
    """Where built cuDNN graphs persist between processes (see ``lowering.cudnn.plan_store``).

    ``enabled``: ``SCOREMOD_PLAN_CACHE`` (default 1); ``root``: :func:`cache_root` (None when
    off); ``max_bytes``: ``SCOREMOD_CACHE_MAX_MB`` (default 256).
    """

    enabled: bool
    root: str | None
    max_bytes: int


def plan_cache_settings() -> PlanCacheSettings:
    """The plan cache's settings from the environment (read when the cache is configured)."""
    enabled = _flag("SCOREMOD_PLAN_CACHE", "1")
    root = cache_root() if enabled else None
    text = os.environ.get("SCOREMOD_CACHE_MAX_MB", str(DEFAULT_PLAN_CACHE_MB)).strip()
    try:
        mb = float(text)
        if not mb > 0:
            raise ValueError
    except ValueError:
        raise ScoreModError(f"environment variable SCOREMOD_CACHE_MAX_MB={text!r}: expected a "
                            "positive number of megabytes") from None
    return PlanCacheSettings(enabled, root, int(mb * (1 << 20)))
