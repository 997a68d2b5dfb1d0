"""The forward as a Mosaic GPU kernel for Hopper: wgmma, TMA and warp specialization.

One program holds ``TILE_Q`` query rows of one (batch, query head) and runs
three warpgroups: two compute warpgroups of ``BLOCK_Q`` rows each and one
memory warpgroup. The memory warpgroup streams the key and value tiles that
the block map lists for the program's query tile (``q_blocks[.., :q_counts]``)
into ``STAGES`` shared-memory slots with the copy engine (TMA); each compute
warpgroup multiplies its queries by a key tile on the tensor cores
(``wgmma``, accumulating in registers), evaluates the mod on the score tile
in registers (``codegen.evaluate_tile``: the IR as jax.numpy, on Mosaic GPU's
register arrays), runs the online softmax and multiplies the probabilities
by the value tile. The two compute warpgroups take turns on the tensor cores
(a shared barrier), so one's softmax overlaps the other's matrix products.

The outputs are the Triton forward's: O in the inputs' dtype and the
natural-log LSE (float32, -inf on rows that see no key, whose O is 0), so
the Triton FA2 backward (``kernels``) runs on them unchanged.

Captured arrays are read at scalar positions (indices built from b, h and
constants: ``slopes[h]``, one load per program) or along one tile axis
(indices built from those and one of q_idx or kv_idx: ``doc[b, q_idx]``,
``doc[b, kv_idx]``): the wrapper evaluates such a read at every position of
its axis (``vector_arrays``, the reference path's clamped reads, so the
tiles' padding reads in bounds), the kernel copies a tile's slice into
shared memory with TMA (the query rows' once per program, each key tile's
beside its key and value tiles) and broadcasts it over the tile.

A read whose index sees q_idx and kv_idx only as their difference (a
relative position: ``bias[h, q_idx - kv_idx + S - 1]``) is the same on
every tile along one diagonal of the score matrix: the wrapper evaluates it
once per diagonal of the score matrix (``OffsetDiagonals``: Sq + Skv values
per batch and head it reads, O(S) memory, never S x S); the memory
warpgroup copies the program's window of them (256 values) beside the key
tile, and each compute warpgroup spreads it over its tile in registers (a
gather from shared memory, written in Mosaic GPU: ``diagonal_gather``). One
such table per mod (``refusal``).

An array read per score, each index built from b, h, constants and one of
q_idx or kv_idx (a bias ``bias[b, h, q_idx, kv_idx]``: one value per score, as
Flax's ``bias`` argument or a pair bias; a mask, Flax's ``mask``; a decode
step's packed rows), is read per tile from global memory straight into
registers, each thread loading its own scores' values at its row's offset plus
its column's (``dense_gather``), clamped as the reference reads; nothing is
copied ahead.

A small table read through other arrays at both tile axes (``pair[kind[q_idx],
kind[kv_idx]]``) is picked by comparisons along a short axis, each entry one of
the reads above (``selects``, applied by the backend before the kernels see
the mod). Any other read (a gather: ``t[h, (q_idx + kv_idx) % 8]``, Swin's
``table[h, rel[q_idx, kv_idx]]``) is loaded per score at its index evaluated on
the tile (``gathered``, ``tile_load``).

What this engine cannot evaluate is refused up front (``refusal``): float
remainders, which Mosaic GPU cannot lower, and reads at an index computed from
the score.

Off a GPU (the plan's interpret flag) the kernel runs in Mosaic GPU's
interpret mode, a CPU simulation, for tests (see ``mosaic_backward``).

jax.experimental.pallas.mosaic_gpu is imported when a kernel is built, never
at import (jax versions without it import this module too).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scoremod.dsl import ir
from scoremod.dsl.evaluate import evaluate
from scoremod.dsl.ir import CONST, F32, LOAD, MATERIALIZE
from scoremod.dsl.text import format_expr
from scoremod.lowering.patterns import (dependencies, difference_form, reads_difference_only,
                                        score_factor)
from scoremod.lowering.pallas import codegen

BLOCK_Q = 64  # query rows per compute warpgroup (wgmma's M is 64 per warpgroup)
COMPUTE_WGS = 2
TILE_Q = BLOCK_Q * COMPUTE_WGS  # query rows per program: the block map's query block
BLOCK_KV = 128  # keys per tile: the block map's key block
STAGES = 2  # key/value tiles in flight
# A call of at most BLOCK_Q live rows (a decode step's packed rows) runs one compute
# warpgroup (not yet measured against two on the H200: gqa_pack_decode's "2wg" rows).
SHORT_ONE_WARPGROUP = True
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)
# Registers per thread: compute warpgroups take what the memory warpgroup gives up.
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40

NEG_INF = float("-inf")
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# Ops whose jax.numpy implementation reaches a primitive that Pallas's Mosaic
# GPU lowering has no rule for and ``TILE_RULES`` does not respell: none since
# erf, erfc and pow are (jax 0.11.2; tests/test_pallas_mosaic.py lowers every op
# of the table through the kernel and checks that exactly these fail).
NOT_LOWERABLE: dict = {}


def _ints(a, b) -> bool:
    return jnp.issubdtype(jnp.result_type(a, b), jnp.integer)


def _rem(a, b):
    """lax.rem (C fmod): int32 by a division; float32 exactly (``_float_rem``:
    Mosaic GPU lowers no float remainder)."""
    if not _ints(a, b):
        return _float_rem(a, b)
    return a - lax.div(*jnp.broadcast_arrays(a, b)) * b


def _mod(a, b):  # the sign of b, as jnp.remainder
    r = _rem(a, b)
    return jnp.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


def _floordiv(a, b):
    """a // b as jnp.floor_divide: ints round toward -inf; floats as its divmod
    (CPython's: the quotient of a - fmod(a, b), one less where the remainder's
    sign differs from b's, rounded away from zero)."""
    r = _rem(a, b)
    carried = (r != 0) & ((r < 0) != (b < 0))
    if _ints(a, b):
        return lax.div(*jnp.broadcast_arrays(a, b)) - jnp.where(carried, 1, 0)
    quotient = jnp.where(b == 0.0, a, a - r) / b  # a true division, as jnp's
    return lax.round(jnp.where(carried, quotient - 1.0, quotient))


# float32 as int32 bits: the sign, an exponent above the mantissa's 23 bits.
_SIGN, _MAGNITUDE, _INF_BITS = -2 ** 31, 2 ** 31 - 1, 0x7F800000
_MANTISSA, _HIDDEN = 2 ** 23 - 1, 2 ** 23
# Quotient bits per step of the float remainder: a float32 quotient below 2**20 is
# within 1/8 of the true one (division within 2 ulp), so its truncation within one.
_REM_BITS = 20
_REM_STEPS = -(-253 // _REM_BITS)  # finite exponents differ by at most 253 binades


def _float_rem(a, b):
    """lax.rem on float32, exactly (the same bits as C fmod; an integer long
    division: Mosaic GPU lowers no float remainder). |a| = ma * 2**ea and |b| =
    mb * 2**eb with 24-bit mantissas; |a| mod |b| = ((ma * 2**(ea - eb)) mod mb)
    * 2**eb, taken _REM_BITS exponent bits a step: each step's quotient estimated in
    float32 (within one), the remainder computed in wrapping int32 (exact: it lies
    within 2**26) and corrected once. NaN for a b of 0, an infinite a or a NaN;
    a itself where |a| < |b|; the result has a's sign (signed zeros kept). Its
    float operations see normal numbers only, so subnormal inputs and results are
    exact where floats flush them (XLA on the CPU reads a subnormal b as 0).
    About 200 operations a score (13 steps of a loop)."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    ia, ib = (lax.bitcast_convert_type(x, jnp.int32) for x in (a, b))
    xa, xb = ia & _MAGNITUDE, ib & _MAGNITUDE
    ea, eb = xa >> 23, xb >> 23
    ma = jnp.where(ea > 0, (xa & _MANTISSA) | _HIDDEN, xa)  # subnormals: no hidden bit
    mb = jnp.maximum(jnp.where(eb > 0, (xb & _MANTISSA) | _HIDDEN, xb), 1)  # b == 0: NaN below
    ea, eb = jnp.maximum(ea, 1), jnp.maximum(eb, 1)  # value = m * 2**(e - 150)
    gap = ea - eb  # >= 0 wherever |a| >= |b|, the only lanes kept
    fb = mb.astype(jnp.float32)

    def step(i, r):
        bits = jnp.clip(gap - i * _REM_BITS, 0, _REM_BITS)
        quotient = (r.astype(jnp.float32) * (1 << bits).astype(jnp.float32) / fb).astype(jnp.int32)
        r = (r << bits) - quotient * mb  # wraps in int32; the true value is in (-mb, 2 mb)
        return jnp.where(r < 0, r + mb, jnp.where(r >= mb, r - mb, r))

    # A loop, not unrolled: a mod with a few remainders, and its derivative's, compiled
    # past the GPU suite's per-test limit with 13 copies of the step each.
    r = lax.fori_loop(0, _REM_STEPS, step, ma - lax.div(ma, mb) * mb)
    # r * 2**(eb - 150): a normal result by two normal powers of two (exact: the
    # remainder is a float32), a subnormal one as its bits, r * 2**(eb - 1) (no
    # float operation: a GPU or CPU that flushes subnormals keeps it)
    k = eb - 150
    half = k >> 1
    scale = [lax.bitcast_convert_type((e + 127) << 23, jnp.float32) for e in (half, k - half)]
    normal = lax.bitcast_convert_type(r.astype(jnp.float32) * scale[0] * scale[1], jnp.int32)
    shift = jnp.minimum(eb - 1, 23)
    magnitude = jnp.where(r < (_HIDDEN >> shift), r << shift, normal)
    out = lax.bitcast_convert_type(magnitude | (ia & _SIGN), jnp.float32)
    nan = (xa >= _INF_BITS) | (xb > _INF_BITS) | (xb == 0)
    return jnp.where(nan, jnp.float32(jnp.nan), jnp.where(xa < xb, a, out))


def _divide(a, b):
    """a / b; by a constant, a times its reciprocal (a multiply, not a division:
    within an ulp of it)."""
    if jnp.ndim(b) == 0 and not isinstance(b, jax.core.Tracer) and float(b) != 0.0:
        return a * jnp.float32(1.0 / float(b))  # b an IR constant
    return a / b


_WHOLE = 2.0 ** 23  # float32 values at least this large are whole numbers
# log1p and expm1 sum their series below these |x| (relative error under 1e-9 there)
_LOG1P_SERIES, _EXPM1_SERIES = 2.0 ** -4, 2.0 ** -2


def _floor(x):
    """floor(x), exactly: a conversion to int32 truncates (|x| < 2**23; larger floats,
    inf and NaN are their own floor), one less where that rounded up; zeros kept."""
    t = x.astype(jnp.int32).astype(jnp.float32)
    down = jnp.where(t > x, t - 1.0, t)
    return jnp.where((jnp.abs(x) < _WHOLE) & (x != 0.0), down, x)


def _ceil(x):
    return -_floor(-x)


def _log1p(x):
    """log(1 + x): below |x| = 2**-4 its series to x**7 (relative error under 1e-9),
    else log(u) * x / (u - 1) for u = 1 + x (Goldberg's: the rounding of u cancels),
    as accurate as the engine's log there."""
    small = jnp.abs(x) < _LOG1P_SERIES
    series = x * (1.0 + x * (-1.0 / 2 + x * (1.0 / 3 + x * (-1.0 / 4 + x * (
        1.0 / 5 + x * (-1.0 / 6 + x * (1.0 / 7)))))))
    y = jnp.where(small, 1.0, x)  # the other branch finite where the series is taken
    u = 1.0 + y
    log_u = jnp.log(u)
    far = jnp.where(u == jnp.inf, log_u, log_u * (y / (u - 1.0)))
    return jnp.where(small, series, far)


def _expm1(x):
    """exp(x) - 1: below |x| = 2**-2 its series to x**8, else the difference (whose
    cancellation costs at most 2.7e-7 of it there)."""
    series = x * (1.0 + x * (1.0 / 2 + x * (1.0 / 6 + x * (1.0 / 24 + x * (
        1.0 / 120 + x * (1.0 / 720 + x * (1.0 / 5040 + x * (1.0 / 40320))))))))
    return jnp.where(jnp.abs(x) < _EXPM1_SERIES, series, jnp.exp(x) - 1.0)


_TAN_3PI_8, _TAN_PI_8 = 2.414213562373095, 0.41421356237309503


def _atan(x):
    """atan(x): |x| reduced to at most tan(pi/8) (by pi/2 - atan(1/|x|) past
    tan(3pi/8), pi/4 + atan((|x| - 1) / (|x| + 1)) between), then Cephes' odd
    polynomial of degree 9; the sign of x (zeros, NaN) restored by a product."""
    a = jnp.abs(x)
    big = a > _TAN_3PI_8
    mid = (a > _TAN_PI_8) & (a <= _TAN_3PI_8)
    r = jnp.where(big, -1.0 / jnp.where(big, a, 1.0), jnp.where(mid, (a - 1.0) / (a + 1.0), a))
    base = jnp.where(big, math.pi / 2, jnp.where(mid, math.pi / 4, 0.0))
    z = r * r
    poly = (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z
            - 3.33329491539e-1) * z * r + r
    return (base + poly) * jnp.sign(x)


# erf below this |x| is its Taylor series to x**17 (relative error under 1e-9 there);
# erfc(x) at or past it is t * exp(-x**2 + P(t)), t = 1 / (1 + x / 2), with P of
# degree 10 fitted by least squares on 600 Chebyshev nodes of t (relative error
# under 2e-9 of erfc in float64, from x = 0.75 to 1e4).
_ERF_SERIES_BELOW = 0.75
_ERF_SERIES = tuple(2 / math.sqrt(math.pi) * (-1) ** m / (math.factorial(m) * (2 * m + 1))
                    for m in range(9))
_ERFC_FIT = (-1.2655121232, 0.99999984545, 0.37501216403, 0.082980679521, -0.080882545001,
             -0.18488029487, 0.11154654472, -0.594829168, 1.2916382863, -1.0226430617,
             0.28798472692)


def _horner(coefficients, x):
    out = jnp.float32(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        out = out * x + c
    return out


def _erf_series(x):
    return x * _horner(_ERF_SERIES, x * x)


def _erfc_far(a):
    """erfc(a) for a >= 0.75 (not NaN). Past 16 it is 0 in float32 (from about 10.1),
    so a is clamped there; exp(-a**2) is taken as exp(-h * h) exp(-(a - h)(a + h))
    with h a to 1/256 (h * h exact: no rounding of a**2 to magnify)."""
    a = jnp.minimum(a, 16.0)
    t = 1.0 / (1.0 + 0.5 * a)
    h = (a * 256.0).astype(jnp.int32).astype(jnp.float32) * (1.0 / 256.0)
    return t * jnp.exp(-(h * h)) * jnp.exp(_horner(_ERFC_FIT, t) - (a - h) * (a + h))


def _erf_parts(x):
    """``(near, erf's series at x, erfc(|x|))``: where |x| is below the series' bound,
    and each side's value (the other side's entries finite: 0 and 1 stand in)."""
    a = jnp.abs(x)
    near = a < _ERF_SERIES_BELOW
    return (near, _erf_series(jnp.where(near, x, 0.0)),
            _erfc_far(jnp.where(near | (x != x), 1.0, a)))


def _erf(x):
    """erf(x): its series near 0 (signed zeros kept), 1 - erfc(|x|) with x's sign
    past it; NaN kept."""
    near, series, tail = _erf_parts(x)
    far = 1.0 - tail
    return jnp.where(x != x, x, jnp.where(near, series, jnp.where(x < 0, -far, far)))


def _erfc(x):
    """erfc(x): 1 - erf(x) near 0, ``_erfc_far`` past it (2 minus it for x < 0);
    NaN kept."""
    near, series, tail = _erf_parts(x)
    return jnp.where(x != x, x,
                     jnp.where(near, 1.0 - series, jnp.where(x < 0, 2.0 - tail, tail)))


def _pow(a, b):
    """a ** b on floats as lax.pow: exp2(b * log2|a|) (the roundings of the log and
    the product cost about |b * log2|a|| ulps: 1.2e-5 of the result at worst for
    a in [0, 50], b in [-20, 20]), a's sign back where b is an odd whole number,
    NaN for finite a < 0 and b not whole; b == 0, a == 1, and a == -1 with b
    infinite give 1 (NaN included), as IEEE's pow."""
    a, b = jnp.broadcast_arrays(a, b)
    odd = (_floor(b) == b) & (_floor(b * 0.5) * 2.0 != b)  # |b| past 2**24 is even
    negative = (a < 0.0) | ((a == 0.0) & (1.0 / a < 0.0))  # -0.0 too
    out = jnp.exp2(b * jnp.log2(jnp.abs(a)))
    out = jnp.where(negative & odd, -out, out)
    out = jnp.where((a < 0.0) & (a != -jnp.inf) & (_floor(b) != b), jnp.nan, out)
    one = (b == 0.0) | (a == 1.0) | ((a == -1.0) & (jnp.abs(b) == jnp.inf))
    return jnp.where(one, 1.0, out)


def _integer_pow(x, n):
    """x ** n as lax.integer_pow computes it (the reciprocal of x ** -n for
    n < 0): Mosaic GPU lowers n >= 2 and n == -1 only (a derivative's n - 1)."""
    if n < 0:
        return 1.0 / lax.integer_pow(x, -n) if n < -1 else 1.0 / x
    return jnp.ones_like(x) if n == 0 else x if n == 1 else lax.integer_pow(x, n)


# The table's ops as Mosaic GPU lowers them: exact respellings of what it
# cannot lower as written (custom_jvp functions, remainders, bool casts).
TILE_RULES = {
    "relu": lambda x: jnp.maximum(x, 0.0),
    "with_grad": lambda value, *pairs: value,  # the forward needs the value only
    "not": lambda x: x == False,  # noqa: E712 - a compare, not Mosaic's i1 negation
    "bool": lambda x: x != 0,
    "rem": _rem,
    "mod": _mod,
    "floordiv": _floordiv,
    "div": _divide,
    "integer_pow": _integer_pow,
    "floor": _floor,
    "ceil": _ceil,
    "log1p": _log1p,
    "expm1": _expm1,
    "tan": lambda x: jnp.sin(x) / jnp.cos(x),
    "atan": _atan,
    "erf": _erf,
    "erfc": _erfc,
    "pow": _pow,
}

_TILE_AXES = ("q_idx", "kv_idx")
_PROGRAM_VARS = frozenset(("b", "h"))
# ``read_axis`` of a read at an index that sees q_idx and kv_idx only as q_idx - kv_idx.
OFFSET = "offset"
# ``read_axis`` of a read at an index that sees q_idx and kv_idx only as whole
# blocks of positions (``block_map[b, h, q_idx // 64, kv_idx // 64]``): a few
# values per tile (``block_values``), at most this many.
BLOCKS = "blocks"
DENSE = "dense"  # ``read_axis``: a value per score, a row's offset plus a column's
MAX_BLOCK_VALUES = 16
# The most entries of a table that ``selects`` picks by comparisons on one read.
MAX_PICKED = 16
_TILE_ROWS = 128  # the longest side of any kernel's tile (``block_values``'s bound)
_TILE_ALIGN = 64  # every kernel's tiles start at multiples of this


def refusal(expr, sources, advice=True) -> str | None:
    """Why the Mosaic GPU forward cannot evaluate ``expr`` (a sentence naming
    the op and where it was written, with what runs it if ``advice``), or None."""
    second = _second_offset_source(expr)
    flags = {r for r in offset_reads(expr) if r.dtype == ir.BOOL}
    for node in ir.toposort(expr):
        why = NOT_LOWERABLE.get(node.op)
        if node.op == MATERIALIZE:
            why = "materialized values are a cuDNN lowering's, not a mod's"
        if node.op == LOAD and read_axis(node) is False and not _int32_positions(node):
            why = (f"it reads arrays per score at int32 positions, at most {_MOST_INDEXED} "
                   f"entries, and this one has {math.prod(node.args[0].attr[1])}")
        if node in flags:
            why = ("a bool array read at q_idx - kv_idx has not run on the GPU, and bool arrays "
                   "read along one tile axis gave wrong results there; capture it as an int "
                   "array (`ints = flags.astype(jnp.int32)` outside the mod, `ints[...] != 0` in "
                   "it)")
        if node.op == LOAD and node is second:
            why = ("it takes one array read at q_idx - kv_idx per mod (its kernels have run "
                   "on the GPU with one only); this mod reads another one here")
        if why:
            where = ir.source_of(node, expr, sources)
            return (f"its Mosaic GPU engine cannot run `{node.op}` in `{format_expr(node)}`"
                    f"{' at ' + where if where else ''}: {why}"
                    + ("; LoweringOptions(pallas_engine=\"triton\") runs it" if advice else ""))
    return None


def read_axis(load):
    """How the kernels read captured array ``load`` (a LOAD node): None, a scalar
    per program (its indices use b, h and constants only); ``"q_idx"`` or
    ``"kv_idx"``, a vector along that tile axis (they use that index too, and
    no other); ``OFFSET``, a value per diagonal (they use q_idx and kv_idx only
    as ``q_idx - kv_idx`` or ``kv_idx - q_idx``); ``BLOCKS``, a value per block
    of positions (``block_sizes``); ``DENSE``, a value per score (``is_dense``);
    False, a gather (``gathered``)."""
    used = ir.variables(*load.args[1:])
    axes = [a for a in _TILE_AXES if a in used]
    if reads_score(load):
        return False
    if len(axes) <= 1:
        return axes[0] if axes else None
    if reads_difference_only(*load.args[1:]):
        return OFFSET
    if block_sizes(load) is not None:
        return BLOCKS
    return DENSE if is_dense(load) else False


def is_dense(load) -> bool:
    """Whether read ``load`` is a value per score whose position is a sum of a part
    of the query and a part of the key (``dense_sides``): a bias per score
    (``bias[b, h, q_idx, kv_idx]``), a mask (Flax's ``mask[b, 0, q_idx, kv_idx]``),
    pair features (``edges[b, q_idx, kv_idx, 0]``), one stored keys first
    (``bias[h, kv_idx, q_idx]``), one per pair of queries (``bias[h, q_idx // 2,
    kv_idx]``), a mask of a decode step whose query heads are packed into its rows
    (``mask[b, h * 4 + q_idx % 4, q_idx // 4, kv_idx]``)."""
    return dense_sides(load) is not None and _int32_positions(load)


_MOST_INDEXED = 2 ** 31 - 1  # the kernels' positions in an array are int32


def _int32_positions(load) -> bool:
    """Whether the array ``load`` reads has at most ``_MOST_INDEXED`` entries."""
    return math.prod(load.args[0].attr[1]) <= _MOST_INDEXED


def reads_score(load) -> bool:
    """Whether an index of read ``load`` reads the score (or another non-index variable):
    where it reads is known in the kernel only."""
    return bool(ir.variables(*load.args[1:]) - _PROGRAM_VARS - set(_TILE_AXES))


def gathered(load) -> bool:
    """Whether read ``load``, of none of ``read_axis``'s kinds (its index mixes q_idx
    and kv_idx otherwise: ``table[h, q_idx // 8 % 8 - kv_idx // 8 % 8 + 7]``, reads
    arrays per score: ``table[h, rel[q_idx, kv_idx]]``, or reads the score: a lookup
    table ``lut[clip((score * 4).astype(int32), 0, 255)]``), is read per score at the
    positions its index takes on the tile (``tile_load``): the array has at most
    2^31 - 1 entries (int32 positions)."""
    return read_axis(load) is False and _int32_positions(load)


def tile_load(interpret):
    """The kernels' ``codegen.evaluate_tile`` gather: a scalar load at one position,
    each thread's own loads from global memory at a tile of them (``dense_gather``)."""
    def load(ref, flat, dtype):
        if jnp.ndim(flat) == 0:
            return scalar_load(ref, flat, dtype)
        x = dense_gather(ref, flat, interpret, dtype == F32)
        return x != 0 if dtype == ir.BOOL else x
    return load


def dense_sides(load) -> tuple[tuple, tuple] | None:
    """``(query axes, key axes)``: the axes of read ``load`` whose indices read
    q_idx (and not kv_idx), and those that read kv_idx (and not q_idx), both
    non-empty, where every index is built from b, h, constants and at most one of
    the positions (no array reads: the backward places a float array's gradient
    by them when tracing); else None. Its position is then a row's offset plus a
    column's."""
    sides = ([], [])
    for i, a in enumerate(load.args[1:]):
        if any(n.op == ir.OPERAND for n in ir.toposort(a)):
            return None
        used = ir.variables(a)
        if used - _PROGRAM_VARS - set(_TILE_AXES) or set(_TILE_AXES) <= used:
            return None
        for side, axis in zip(sides, _TILE_AXES):
            if axis in used:
                side.append(i)
    return (tuple(sides[0]), tuple(sides[1])) if all(sides) else None


def bare_axis(load, axis: str) -> int | None:
    """The one axis of read ``load`` indexed by ``axis`` ("q_idx" or "kv_idx")
    itself, where no other index reads it; else None."""
    at = [i for i, a in enumerate(load.args[1:]) if axis in ir.variables(a)]
    return at[0] if len(at) == 1 and load.args[1 + at[0]] is ir.var(axis) else None


def blocks_along(size, rows=_TILE_ROWS, align=_TILE_ALIGN) -> int:
    """The most blocks of ``size`` positions that ``rows`` positions from a multiple
    of ``align`` meet (the pattern repeats every lcm(size, align) positions)."""
    period = size * align // math.gcd(size, align)
    if period // align > 1024:  # a long period (q_idx >> 20): the bound for any start
        return (rows - 1) // size + 2
    return max((s + rows - 1) // size - s // size + 1 for s in range(0, period, align))


@functools.lru_cache(maxsize=1024)
def block_sizes(load):
    """``{"q_idx": t, "kv_idx": u}`` where every use of q_idx in the read's index
    is ``q_idx // c`` (or ``q_idx >> n``) with t dividing every such c (and so
    for kv_idx): the index, and the value read, are the same on each block of t
    queries by u keys aligned at multiples of (t, u). None where another use
    is made of them, or a 128 x 128 tile meets more than ``MAX_BLOCK_VALUES``
    such blocks."""
    args = load.args[1:]
    sizes = {}
    for node in ir.toposort(*args):
        for i, a in enumerate(node.args):
            if a.op != ir.VAR or a.attr not in _TILE_AXES:
                continue
            c = _divisor(node) if i == 0 else None
            if c is None:
                return None
            sizes[a.attr] = math.gcd(sizes.get(a.attr, 0), c)
    if set(sizes) != set(_TILE_AXES) or any(a.op == ir.VAR and a.attr in _TILE_AXES
                                            for a in args):
        return None
    if math.prod(blocks_along(t) for t in sizes.values()) > MAX_BLOCK_VALUES:
        return None
    return sizes


def _divisor(node):
    """c where ``node`` is ``x // c`` or ``x >> n`` (c = 2**n) of int32 x by a
    positive constant, else None (positions are never negative: both are floors)."""
    if node.dtype != ir.I32 or len(node.args) != 2 or node.args[1].op != CONST:
        return None
    c = int(node.args[1].attr)
    if node.op == "floordiv" and c > 0:
        return c
    if node.op == "right_shift" and 0 <= c <= 30:
        return 1 << c
    return None


def _is_tile_read(node) -> bool:
    return node.op == LOAD and read_axis(node) in (*_TILE_AXES, OFFSET, BLOCKS, DENSE)


def _is_vector_read(node) -> bool:
    return node.op == LOAD and read_axis(node) in _TILE_AXES


def _tile_reads_of(exprs, kind) -> tuple:
    return tuple(n for n in ir.toposort(*(e for e in exprs if e is not None),
                                        stop=_is_tile_read) if kind(n))


def vector_reads(*exprs) -> tuple:
    """The reads of ``exprs`` along one tile axis (a read inside another's index
    is the outer read's business: the kernels take the outer one's values whole)."""
    return _tile_reads_of(exprs, _is_vector_read)


def offset_reads(*exprs) -> tuple:
    """The reads of ``exprs`` at q_idx - kv_idx (``read_axis`` ``OFFSET``)."""
    return _tile_reads_of(exprs, lambda n: n.op == LOAD and read_axis(n) == OFFSET)


def block_reads(*exprs) -> tuple:
    """The reads of ``exprs`` at whole blocks of positions (``read_axis`` ``BLOCKS``)."""
    return _tile_reads_of(exprs, lambda n: n.op == LOAD and read_axis(n) == BLOCKS)


def dense_reads(*exprs) -> tuple:
    """The reads of ``exprs`` per score (``read_axis`` ``DENSE``)."""
    return _tile_reads_of(exprs, lambda n: n.op == LOAD and read_axis(n) == DENSE)


def position_values(exprs, refs, bi, hi, q0, k0, shape, keys_down=False,
                    interpret=False) -> dict:
    """``{read: its values on the tile}`` for the reads of ``exprs`` the kernels make
    from the tile's positions themselves: at whole blocks (``block_values``) and per
    score (``dense_values``); the arguments as theirs."""
    return {**block_values(block_reads(*exprs), refs, bi, hi, q0, k0, shape, keys_down),
            **dense_values(dense_reads(*exprs), refs, bi, hi, q0, k0, shape, keys_down,
                           interpret)}


def dense_values(reads, refs, bi, hi, q0, k0, shape, keys_down=False, interpret=False) -> dict:
    """``{read: its values on the tile}`` for reads per score (``dense_reads``) on a
    tile of ``shape`` whose first query is ``q0`` and first key ``k0`` (queries
    down, or keys down with ``keys_down``): each thread loads its own elements
    from global memory (``dense_gather``) at the sum of its row's and its column's
    offsets (each index evaluated and clamped as reads clamp once per vector, then
    times its axis's stride: one add per score)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    out = {}
    dims_of = {"q_idx": 1 if keys_down else 0, "kv_idx": 0 if keys_down else 1}
    layout = {0: plgpu.Layout.WGMMA.reduce(1), 1: plgpu.Layout.WGMMA.reduce(0)}

    def offset(read, axes, inputs):  # the position with the other axes' indices at 0
        values = dict(zip(axes, codegen.evaluate_tile([read.args[1 + i] for i in axes],
                                                      inputs, {}, rules=TILE_RULES)))
        return codegen.flat_index(read, [values.get(i, 0) for i in range(len(read.args) - 1)])

    for read in reads:
        sides = dict(zip(_TILE_AXES, dense_sides(read)))
        lead = [i for i in range(len(read.args) - 1) if i not in sides["q_idx"] + sides["kv_idx"]]
        offsets = {}
        for axis, start in (("q_idx", q0), ("kv_idx", k0)):
            dim = dims_of[axis]
            at = start + plgpu.broadcasted_iota(jnp.int32, (shape[dim],), 0, layout=layout[dim])
            offsets[dim] = offset(read, sides[axis], {"b": bi, "h": hi, axis: at})
        offsets[0] = offsets[0] + offset(read, lead, {"b": bi, "h": hi}) if lead else offsets[0]
        at = (lax.broadcast_in_dim(offsets[0], shape, [0])
              + lax.broadcast_in_dim(offsets[1], shape, [1]))
        x = dense_gather(refs[read.args[0].attr[0]], at, interpret, read.dtype == F32)
        out[read] = x != 0 if read.dtype == ir.BOOL else x
    return out


def dense_gather(ref, index, interpret, floats=True):
    """``ref[index]`` as float32 (``floats``) or int32 for a flat array ``ref`` in
    global memory (float32 or 16-bit floats; int32 or int8: a mask) and an int32
    ``index`` tile in the WGMMA layout: each thread loads its own elements, widened
    as loaded (a register's two neighbours in one row sit side by side in a
    row-major array, so a warp's loads fill whole 32-byte sectors). Pallas has no
    such gather, so on the GPU it is written in Mosaic GPU itself
    (``inline_mgpu``); interpret mode takes jax.numpy's."""
    dtype = jnp.float32 if floats else jnp.int32
    if interpret:
        return ref[...][index].astype(dtype)
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.lib.mlir import ir as mlir
    from jax._src.lib.mlir.dialects import arith, memref, vector

    shape = index.shape
    try:  # a read-only input (jax 0.12 tracks writes through inlined code; 0.11 has no flag)
        source = plgpu.RefType(write=False)
    except TypeError:
        source = plgpu.RefType()

    @plgpu.inline_mgpu(arg_types=(source, plgpu.Layout.WGMMA),
                       return_type=plgpu.ShapeDtypeStruct(shape, dtype,
                                                          layout=plgpu.Layout.WGMMA))
    def gather(ctx, gmem, at):
        del ctx
        wide = mlir.F32Type.get() if floats else mlir.IntegerType.get_signless(32)
        vec_type = mlir.VectorType.get((mgpu.WGMMA_LAYOUT.vector_length,), wide)
        regs = at.registers.copy()
        for i, reg in enumerate(at.registers.flat):
            out = None
            for e in range(mgpu.WGMMA_LAYOUT.vector_length):
                pos = vector.extract(reg, dynamic_position=[],
                                     static_position=mlir.DenseI64ArrayAttr.get([e]))
                x = memref.load(gmem, [arith.index_cast(mlir.IndexType.get(), pos)])
                if x.type != wide:  # a 16-bit float or 8-bit int array: widened
                    x = arith.extf(wide, x) if floats else arith.extsi(wide, x)
                if out is None:
                    out = vector.broadcast(vec_type, x)
                else:
                    out = vector.insert(x, out, dynamic_position=[],
                                        static_position=mlir.DenseI64ArrayAttr.get([e]))
            regs.flat[i] = out
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT,
                                    _is_signed=None if floats else True)

    return gather(ref, index)


def block_values(reads, refs, bi, hi, q0, k0, shape, keys_down=False) -> dict:
    """``{read: its values on the tile}`` for reads at whole blocks of positions
    (``block_reads``), on a tile of ``shape`` whose first query is ``q0`` and
    first key ``k0`` (queries down, or keys down with ``keys_down``): each block
    the tile meets is read once, at its first position (scalar loads of the
    index and the value), and the blocks' values are laid over the tile by
    comparisons of the positions with the blocks' edges. A bool array's int
    values are laid out, then compared with 0 (no bit broadcasts)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    layout = plgpu.Layout.WGMMA
    q_dim, k_dim = (1, 0) if keys_down else (0, 1)
    out = {}
    for read in reads:
        sizes = block_sizes(read)
        t, u = sizes["q_idx"], sizes["kv_idx"]
        first_q, first_k = lax.div(q0, jnp.int32(t)) * t, lax.div(k0, jnp.int32(u)) * u
        n_q, n_k = blocks_along(t, shape[q_dim]), blocks_along(u, shape[k_dim])

        def value(i, j):  # the block i down the queries and j across the keys
            inputs = {"b": bi, "h": hi, "q_idx": first_q + i * t, "kv_idx": first_k + j * u}
            index = codegen.evaluate_tile(list(read.args[1:]), inputs, refs, gather=scalar_load,
                                          rules=TILE_RULES)
            x = refs[read.args[0].attr[0]][codegen.flat_index(read, index)]
            return plgpu.layout_cast(jnp.broadcast_to(x, shape), layout)

        def edge(dim, at):  # the tile's positions along dim at or past position ``at``
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout) >= at - (
                q0 if dim == q_dim else k0)

        tile = None
        for i in range(n_q):
            row = None
            for j in range(n_k):
                x = value(i, j)
                row = x if row is None else jnp.where(edge(k_dim, first_k + j * u), x, row)
            tile = row if tile is None else jnp.where(edge(q_dim, first_q + i * t), row, tile)
        out[read] = tile != 0 if read.dtype == ir.BOOL else tile
    return out


def offset_source(read):
    """The read as a function of ``b``, ``h`` and ``q_idx`` standing for
    ``q_idx - kv_idx`` (the value every tile evaluates on its diagonals)."""
    return difference_form(read)


def offset_sources(reads) -> tuple:
    return tuple(dict.fromkeys(offset_source(r) for r in reads))


def _second_offset_source(expr):
    """The first read of ``expr`` at q_idx - kv_idx whose source is not the first's, or None."""
    reads = offset_reads(expr)
    first = offset_source(reads[0]) if reads else None
    return next((r for r in reads if offset_source(r) is not first), None)


def offset_values(reads, tiles) -> dict:
    """``{read: its values on the tile}`` for reads at q_idx - kv_idx, from ``tiles``
    (``{source: the loaded tile}``); a bool array compared with 0."""
    out = {}
    for read in reads:
        x = tiles[offset_source(read)]
        out[read] = x != 0 if read.dtype == ir.BOOL else x
    return out


@dataclasses.dataclass(frozen=True)
class OffsetDiagonals:
    """Reads at q_idx - kv_idx as one vector per batch and head: its value on
    each diagonal of the score matrix.

    ``arrays[k][bb, hh, j]`` is source ``k`` at ``q_idx - kv_idx = first + j``
    (``[B or 1, Hq or 1, q_len + kv_len]``, float32, or int32 for int and bool
    arrays), evaluated as the reference path reads (clamped). A program whose
    queries start at q0 and keys at k0, ``rows`` queries by ``cols`` keys, sees
    the ``rows + cols - 1`` diagonals from ``q0 - k0 - cols + 1`` on: its window
    (``at``, ``rows + cols`` values, 16-byte aligned), which the kernels copy
    with TMA and spread over their tiles in registers (``tile``). So a step
    moves ``rows + cols`` values, not ``rows * cols``."""

    sources: tuple
    arrays: tuple
    first: int
    rows: int
    cols: int

    @classmethod
    def build(cls, sources, names, operands, b, hq, rows, cols, q_len, kv_len):
        first = 1 - kv_len  # the last key against the first query
        diff = first + jnp.arange(q_len + kv_len, dtype=jnp.int32)
        return cls(tuple(sources), per_program(sources, names, operands, b, hq, diff),
                   first, rows, cols)

    @property
    def window(self) -> int:
        return self.rows + self.cols

    def start(self, q0, k0):
        """The first entry of the window of the program at (q0, k0): a multiple of 4
        (q0, k0 and kv_len are of 64s), so the copy's source is 16-byte aligned."""
        return q0 - k0 - (self.cols - 1) - self.first

    def at(self, ref, src, bi, hi, q0, k0):
        """The window of ``ref`` (source ``src``'s array) for the program at (q0, k0)."""
        import jax.experimental.pallas as pl

        return ref.at[(*vector_row(src, bi, hi), pl.ds(self.start(q0, k0), self.window))]

    def scratch(self, slots):
        """Shared memory for ``slots`` windows of each source."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        return [plgpu.SMEM((slots, self.window), x.dtype) for x in self.arrays]

    def tile(self, window, row, shape, keys_down, interpret, col=0):
        """The values on a tile of ``shape`` whose first query is the program's query
        ``row`` and first key its key ``col`` (static or not): queries down and keys
        across, or (``keys_down``, the dK/dV kernel's) keys down and queries across."""
        import jax.experimental.pallas as pl

        keys, queries = shape if keys_down else shape[::-1]
        # The tile's diagonals run from row - col - keys + 1; the window's from -(cols - 1).
        view = window.at[pl.ds(row - col + self.cols - keys, queries + keys - 1)]
        return diagonal_gather(view, keys - 1, -1 if keys_down else 1, shape, interpret)


def diagonal_gather(ref, start, sign, shape, interpret):
    """``[rows, cols]`` in the WGMMA layout whose element (r, c) is ``ref[start +
    sign * (r - c)]`` (``ref`` a vector in shared memory): each thread loads its
    elements' values from shared memory. Pallas has no such gather, so on the GPU
    it is written in Mosaic GPU itself (``inline_mgpu``); interpret mode, which
    cannot run that, takes jax.numpy's."""
    rows, cols = shape
    if interpret:
        r = jnp.arange(rows, dtype=jnp.int32)[:, None]
        c = jnp.arange(cols, dtype=jnp.int32)[None, :]
        return ref[...][start + sign * (r - c)]
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import numpy as np
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, memref, vector

    dtype = jnp.dtype(ref.dtype)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct(shape, dtype,
                                                          layout=plgpu.Layout.WGMMA))
    def gather(ctx, smem):
        del ctx
        layout = mgpu.WGMMA_LAYOUT
        index = ir.IndexType.get()
        vec_type = layout.registers_element_type(ir.MemRefType(smem.type).element_type)
        regs = np.empty(layout.registers_shape(shape), dtype=object)
        for (row, col), at in zip(layout.thread_idxs(shape), np.ndindex(regs.shape)):
            # The register holds (row, col + e) for e < vector_length: at
            # start + sign * (row - col) - sign * e.
            diff = arith.subi(row, col) if sign > 0 else arith.subi(col, row)
            base = arith.addi(diff, arith.constant(index, start))
            reg = None
            for e in range(layout.vector_length):
                pos = arith.addi(base, arith.constant(index, -sign * e)) if e else base
                x = memref.load(smem, [pos])
                if reg is None:
                    reg = vector.broadcast(vec_type, x)
                else:
                    reg = vector.insert(x, reg, dynamic_position=[],
                                        static_position=ir.DenseI64ArrayAttr.get([e]))
            regs[at] = reg
        signed = None if jnp.issubdtype(dtype, jnp.floating) else True
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=signed)

    return gather(ref)


def vector_source(read):
    """The read as a function of ``b``, ``h`` and ``q_idx`` (its axis renamed):
    ``doc[b, q_idx]`` and ``doc[b, kv_idx]`` share one vector array."""
    return ir.substitute(read, {ir.var("kv_idx"): ir.var("q_idx")})


def vector_sources(reads) -> tuple:
    return tuple(dict.fromkeys(vector_source(r) for r in reads))


def vector_arrays(sources, names, operands, b, hq, length) -> tuple:
    """Per source, its values at every position ``0..length-1`` of the axis, for
    every batch (if it reads ``b``) and query head (if it reads ``h``): an array
    ``[B or 1, Hq or 1, length]`` (int32 for int and bool arrays, float32), read by
    the kernels a tile's slice at a time. Computed as the reference path reads
    (indices clamped), so positions past the arrays' ends (the tiles' padding)
    read what the mod reads there."""
    return per_program(sources, names, operands, b, hq, jnp.arange(length, dtype=jnp.int32))


def per_program(sources, names, operands, b, hq, positions) -> tuple:
    """Per source (a function of ``b``, ``h`` and ``q_idx``), its values with
    ``q_idx`` at ``positions`` (int32, any shape), for every batch if it reads
    ``b`` and query head if it reads ``h``: ``[B or 1, Hq or 1, *positions.shape]``,
    in the kernels' dtypes, evaluated as the reference path reads (clamped)."""
    named = dict(zip(names, operands))
    lead = (1,) * positions.ndim
    out = []
    for src in sources:
        used = ir.variables(src)
        values = {n.attr[0]: jnp.reshape(named[n.attr[0]], n.attr[1])
                  for n in ir.operands_of(src)}
        inputs = {"b": jnp.arange(b, dtype=jnp.int32).reshape((b, 1) + lead) if "b" in used
                  else 0,
                  "h": jnp.arange(hq, dtype=jnp.int32).reshape((1, hq) + lead) if "h" in used
                  else 0,
                  "q_idx": positions[None, None]}
        x = evaluate(src, inputs, values).astype(codegen.KERNEL_DTYPE[src.dtype])
        out.append(jnp.broadcast_to(x, (b if "b" in used else 1, hq if "h" in used else 1)
                                    + positions.shape))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class CopiedReads:
    """The captured-array reads of a kernel's expressions that the kernel copies
    beside its tiles rather than gathers per score: those along one tile axis
    (``vector_reads``) as one array per source over the whole axis, a tile's
    slice per step, ``side[axis]`` naming the sources read along each axis;
    those at q_idx - kv_idx as a window of diagonals per step
    (``offsets``). ``arrays`` are the kernel's inputs for them: the sources'
    arrays, then the diagonals'. Forward and backward kernels build it alike,
    for tiles of ``rows`` queries by ``cols`` keys."""

    sources: tuple
    side: dict
    offsets: OffsetDiagonals
    arrays: tuple

    @classmethod
    def build(cls, exprs, names, operands, b, hq, rows, cols, q_len, kv_len):
        reads = vector_reads(*exprs)
        sources = vector_sources(reads)
        side = {axis: tuple(dict.fromkeys(vector_source(r) for r in reads
                                          if read_axis(r) == axis))
                for axis in _TILE_AXES}
        offsets = OffsetDiagonals.build(offset_sources(offset_reads(*exprs)), names, operands,
                                        b, hq, rows, cols, q_len, kv_len)
        vectors = vector_arrays(sources, names, operands, b, hq, max(q_len, kv_len))
        return cls(sources, side, offsets, vectors + offsets.arrays)


def vector_row(src, bi, hi):
    """The (batch, head) row of a source's array that program (bi, hi) reads."""
    used = ir.variables(src)
    return (bi if "b" in used else 0), (hi if "h" in used else 0)


def tile_reads(reads, vectors, dims, shape) -> dict:
    """``{read: its values on the tile}``: each read's vector (``vectors[axis][source]``,
    laid out along the tile's dimension ``dims[axis]``) broadcast over the other
    dimension; a bool array compared with 0 after the broadcast (the int values
    broadcast, not bits)."""
    out = {}
    for read in reads:
        axis = read_axis(read)
        x = lax.broadcast_in_dim(vectors[axis][vector_source(read)], shape, [dims[axis]])
        out[read] = x != 0 if read.dtype == ir.BOOL else x
    return out


def prepared(expr):
    """``(expr', factor, in_log2)``: the mod as the kernel evaluates it, with
    ``mod(score) == expr'(score * factor)``, times log2(e) if ``in_log2``.

    The softmax runs base 2, so the kernel wants the modded score times
    log2(e): pushed into the mod's constants where its value is a constant,
    a constant multiple or a ``where`` of those (softcap's ``30 * tanh(..)``,
    a mask's ``-inf``), then the score's one constant factor (softcap's
    ``score / 30``, or that log2(e)) joins the scale: one multiply per score
    for both, where the mod allows. Products of a difference of the positions are
    split first (``split_axes``): the terms of one position alone run on vectors."""
    if expr is None:
        return None, 1.0, False
    expr = split_axes(expr)
    pushed = _times(expr, LOG2E)
    in_log2 = pushed is not None
    expr, factor = score_factor(pushed if in_log2 else expr)
    return expr, factor, in_log2


def _times(node, k):
    """``node * k`` with ``k`` in the constants, or None where that takes a
    multiply of its own."""
    if node.dtype != F32:
        return None
    if node.op == CONST:
        return ir.const(float(node.attr) * k, F32)
    if node is ir.var("score"):
        return ir.build("mul", node, ir.const(k, F32))
    if node.op == "mul":
        a, b = node.args
        for x, c in ((a, b), (b, a)):
            if c.op == CONST and math.isfinite(float(c.attr)):
                return ir.build("mul", x, ir.const(float(c.attr) * k, F32))
        for x, c in ((a, b), (b, a)):
            if _one_axis(c):  # the factor of one position takes k on its vector
                return ir.build("mul", x, ir.build("mul", c, ir.const(k, F32)))
    if node.op == "where":
        cond, a, b = node.args
        a, b = _times(a, k), _times(b, k)
        if a is not None and b is not None:
            return ir.build("where", cond, a, b)
    if node.op in ("add", "sub"):
        a, b = (_times(x, k) for x in node.args)
        if a is not None and b is not None:
            return ir.build(node.op, a, b)
    if _one_axis(node):
        return ir.build("mul", node, ir.const(k, F32))  # a one-axis part: on its vector
    return None


def _one_axis(node, used=None) -> bool:
    """Whether float ``node`` reads one position and not the score (``axis_parts``);
    ``used``: the variables it reads, where the caller has them."""
    used = ir.variables(node) if used is None else used
    return (node.dtype == F32 and len(used & _POSITIONS) == 1
            and not used & {ir.SCORE, ir.COTANGENT})


def uses_var(expr, name, whole=()) -> bool:
    """Whether ``expr`` reads variable ``name`` other than in the index of a vector
    read or a read at q_idx - kv_idx (the kernels take their values whole), or in
    the nodes ``whole`` (one-axis parts: ``axis_parts``)."""
    return expr is not None and any(
        n.op == ir.VAR and n.attr == name
        for n in ir.toposort(expr, stop=lambda m: m in whole or _is_tile_read(m)))


# --------------------------------------------------------------------------- #
# One-axis parts: a float term with one value per row (or column) of the tile is
# computed on that vector, once per compute warpgroup (or key tile), and added
# broadcast, not evaluated on every score.

_POSITIONS = frozenset(("q_idx", "kv_idx"))


def split_axes(expr):
    """``expr`` with each product of a difference of the positions split into one
    term per position: ``c * f32(kv_idx - q_idx)`` becomes ``c * f32(kv_idx) - c *
    f32(q_idx)`` (ALiBi), and a lone ``f32(kv_idx - q_idx)`` ``f32(kv_idx) - f32(q_idx)``
    (exact), where ``c`` reads neither position nor the score: each term then has
    one value per column or row (``axis_parts``). The products round separately
    (at most half an ulp of ``c * S`` each, in float32; the reference rounds once)."""
    if expr is None:
        return None
    deps = dependencies(expr)

    def difference(n):  # f32(a - b) of the two positions, as (f32(a), f32(b))
        if n.op != F32 or len(n.args) != 1 or n.args[0].op != "sub":
            return None
        a, b = n.args[0].args
        if {a.op, b.op} != {ir.VAR} or {a.attr, b.attr} != _POSITIONS:
            return None
        return ir.build(F32, a), ir.build(F32, b)

    mapping = {}
    for n in ir.toposort(expr):
        if n.op == "mul" and n.dtype == F32:
            for c, x in (n.args, n.args[::-1]):
                split = difference(x)
                if split is not None and not deps[c] & (_POSITIONS | {ir.SCORE}):
                    mapping[n] = ir.build("sub", ir.build("mul", c, split[0]),
                                          ir.build("mul", c, split[1]))
                    break
    for n in ir.toposort(expr, stop=mapping.__contains__):
        split = difference(n) if n not in mapping else None
        if split is not None:
            mapping[n] = ir.build("sub", *split)
    return ir.substitute(expr, mapping) if mapping else expr


@functools.lru_cache(maxsize=256)
def axis_parts(expr) -> tuple:
    """The largest float subexpressions of ``expr`` that read one position (q_idx or
    kv_idx), not the score, with work in them and no read of an array along it
    (the kernels copy those whole, and a term over one failed Mosaic GPU's layout
    inference: a token-kind table's chain): ``((node, axis), ...)``. Indices are
    not looked into."""
    if expr is None:
        return ()
    deps = dependencies(expr)
    found, seen = [], set()

    def visit(n):
        if n in seen:
            return
        seen.add(n)
        if _one_axis(n, deps[n]) and n.op not in (ir.VAR, CONST) and not vector_reads(n):
            found.append((n, next(iter(deps[n] & _POSITIONS))))
            return
        if n.op != LOAD:
            for a in n.args:
                visit(a)

    visit(expr)
    return tuple(found)


def part_vectors(parts, axis, positions, bi, hi, refs) -> dict:
    """``{node: its float32 values along the axis}`` for the one-axis ``parts``
    along ``axis``, each evaluated on ``positions`` (that axis's int32 vector)."""
    return {node: codegen.evaluate_tile([node], {"b": bi, "h": hi, axis: positions}, refs,
                                        gather=scalar_load, rules=TILE_RULES)[0].astype(
                                            jnp.float32)
            for node, along in parts if along == axis}


@dataclasses.dataclass(frozen=True)
class MosaicSpec:
    """Everything static about one call's forward kernel (hashable)."""

    expr: object  # the mod's IR node, or None for plain attention
    operand_names: tuple  # in the order the operand arrays are passed
    scale: float
    sq: int  # real lengths (the arrays are padded to whole tiles)
    skv: int
    groups: int  # query heads per key/value head
    # The mod on tiles the map marks full (every score live: the mask
    # conditions dropped), or None: the whole mod everywhere.
    full_expr: object = None
    # Run in Mosaic GPU's interpret mode (a CPU simulation: for tests), where
    # products add into fresh accumulators and left operands pass through
    # shared memory (what it can simulate).
    interpret: bool = False
    # Programs per query tile, each taking an equal part of the tile's list of key
    # tiles (``forward``): for calls with too few query tiles to fill the GPU (decoding).
    parts: int = 1


def scalar_load(ref, flat, dtype):
    """``ref[flat]`` at a scalar position (Mosaic GPU loads scalars, not gathers)."""
    out = ref[flat]
    if dtype == ir.BOOL:
        return out != 0
    return out.astype(codegen.JNP_DTYPE[dtype])


def accumulate(spec, issue, accs):
    """``accs`` plus the products ``issue(acc_refs)`` issues (wgmma), as arrays:
    on the GPU the products accumulate into ``accs`` in place."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if not spec.interpret:
        return pl.run_state(issue)(tuple(plgpu.ACC.init(a) for a in accs))

    def fresh(*refs):
        issue(refs)
        return tuple(r[...] for r in refs)

    products = pl.run_scoped(fresh, *(plgpu.ACC(a.shape, jnp.float32) for a in accs))
    return tuple(a + x for a, x in zip(accs, products))


def left_operand(spec, x, staging, i):
    """``x`` (registers) as a wgmma left operand: in interpret mode through slot
    ``i`` of ``staging`` in shared memory (it multiplies shared-memory operands only)."""
    if not spec.interpret:
        return x
    staging.at[i][...] = x
    return staging.at[i]


def staging(spec, n, rows, cols, dtype):
    """Shared memory for ``n`` left operands in interpret mode (none on the GPU)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if not spec.interpret:
        return []
    return [plgpu.SMEM((n, rows, cols), dtype, transforms=swizzled())]


def interpret_params(spec):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams() if spec.interpret else None


def swizzled(dtype=jnp.bfloat16):
    """Shared-memory transforms of a 2-byte (or, by ``dtype``, 4-byte) tile for
    TMA and wgmma: 128-byte rows of the tiling, swizzled."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(128))


def page_copies(page: int) -> int | None:
    """Copies per key tile from a paged cache of ``page`` keys a page (one where a
    page holds whole tiles), or None where tiles and pages do not nest: a page
    smaller than a tile must be whole rows of its swizzled tile (8) and divide it."""
    if page % BLOCK_KV == 0:
        return 1
    if BLOCK_KV % page == 0 and page % 8 == 0:
        return BLOCK_KV // page
    return None


def paged_rows(table, page: int, skv: int, num_pages: int):
    """A page table [B, pages] as ``forward`` reads it: the pages of ``skv`` keys
    padded to whole key tiles, past the table its last page (keys past ``skv``
    are masked), page numbers clipped into the cache (as a gather clips them), int32."""
    tiles = -(-skv // BLOCK_KV)
    need = -(-tiles * BLOCK_KV // page)
    table = jnp.clip(jnp.asarray(table, jnp.int32)[:, :need], 0, num_pages - 1)
    if table.shape[1] < need:
        table = jnp.concatenate([table, jnp.repeat(table[:, -1:], need - table.shape[1], 1)], 1)
    return table


def forward(spec: MosaicSpec, bmap, q, k, v, operands, pages=None, part_sizes=None):
    """O [B, Sq, Hq, Dv] (q's dtype) and LSE [B, Hq, Sq] (float32, natural log)
    on arrays padded to whole tiles (Sq to ``TILE_Q``, Skv to ``BLOCK_KV``).

    With ``pages`` (int32 [B, key tiles * BLOCK_KV / page size], a paged cache's
    table: ``paged_rows``), K and V are the cache's pages [num_pages, page size,
    Hkv, D] and each key tile is fetched from the pages that hold it: one copy per
    page (``page_copies``), no gathered copy of the cache in memory.

    Reads of captured arrays along one tile axis (``vector_reads``) come from
    arrays of their values over the whole axis (``vector_arrays``): a compute
    warpgroup copies its rows' slice once, the memory warpgroup copies each key
    tile's slice beside the key and value tiles, and the mod takes them
    broadcast over the tile (one shared-memory vector load per key tile).

    With ``spec.parts`` = n > 1, n programs share each query tile, each taking
    a part of the tile's key list (``part_sizes``, int32 like the map's counts: the
    key tiles of each part; by default an equal share), and O and LSE hold each
    part's rows (part ``j``'s row ``i`` at ``j * Sq + i``; a part with no key: O 0,
    LSE -inf), which the caller joins by their LSEs."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    dtype = q.dtype
    n_tiles = sq // TILE_Q
    parts = spec.parts
    n_ops = len(operands)
    counts, blocks = bmap.q_counts, bmap.q_blocks
    if parts > 1:  # each tile's list length and its parts' size, side by side
        xp = np if isinstance(counts, np.ndarray) and part_sizes is None else jnp
        if part_sizes is None:
            part_sizes = (counts + (parts - 1)) // parts
        counts = xp.stack([counts, xp.asarray(part_sizes, counts.dtype)], -1)
    # The full-tile flags, read only with a full-tile mod; else the block ids stand in
    # (flags of one value, a constant, would cost XLA a broadcast kernel per call).
    full = blocks if spec.full_expr is None else bmap.q_full.astype(jnp.int32)
    shared_b, shared_h = counts.shape[0] == 1, counts.shape[1] == 1
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    general = prepared(spec.expr)
    on_full = None if spec.full_expr is None else prepared(spec.full_expr)
    exprs = [e for e, _, _ in (general, on_full or general)]
    parts_of = {e: axis_parts(e) for e in exprs}
    whole = {n for found in parts_of.values() for n, _ in found}
    part_axes = {a for found in parts_of.values() for _, a in found}
    needs_kv_idx = (any(uses_var(e, "kv_idx", whole) for e in exprs)
                    or spec.skv % BLOCK_KV != 0)
    needs_q_idx = any(uses_var(e, "q_idx", whole) for e in exprs)
    has_blocks = bool(block_reads(*exprs) or dense_reads(*exprs))  # they read at kv0
    # Reads along a tile axis: the query rows' slice per warpgroup, the key tile's
    # per step; reads at q_idx - kv_idx: a window of diagonals per step, beside the key tile.
    copied = CopiedReads.build(exprs, spec.operand_names, operands, b, hq, TILE_Q, BLOCK_KV,
                               sq, k.shape[1])
    sources, side, offsets, vectors = copied.sources, copied.side, copied.offsets, copied.arrays
    n_vec = len(vectors)
    # A call whose live rows fit one compute warpgroup (a decode step's packed rows) runs
    # one: a second would only multiply padding rows, as long as the first.
    wgs = 1 if SHORT_ONE_WARPGROUP and spec.sq <= BLOCK_Q else COMPUTE_WGS
    turns = wgs > 1  # the compute warpgroups alternate on the tensor cores
    # One compute warpgroup takes the most a thread can hold (as JAX's warp-specialized
    # pipeline gives a single one: 256), two share what the memory warpgroup leaves.
    registers = COMPUTE_REGISTERS if turns else 256
    page = None if pages is None else k.shape[1]
    copies = 1 if pages is None else page_copies(page)

    def program(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, pages_ref, operand_refs,
                vector_refs, o_ref, lse_ref, scoped):
        (qo_smem2, k_smem, v_smem, off_smem, lse_smem2, *staged), \
            (k_ready, v_ready, q_ready), (k_free, v_free), turn, (qvec_smem, kvvec_smem), \
            (qvec_ready, kvvec_ready), off_ready = scoped
        staged = staged[0] if staged else None  # interpret mode's
        wg = lax.axis_index("wg")
        bi, hi = lax.axis_index("batch"), lax.axis_index("heads")
        mb = 0 if shared_b else bi
        mh = 0 if shared_h else hi
        if parts == 1:
            tile = n_tiles - 1 - lax.axis_index("q_seq")  # the last (under causal masks,
            # the longest) query tiles start first, which shortens the tail
            first, count, out_row0 = 0, counts_ref[mb, mh, tile], tile * TILE_Q
        else:  # this program's part of the tile's key list: entries first.. (count of them)
            program = lax.axis_index("q_seq")
            part = lax.rem(program, jnp.int32(parts))
            tile = n_tiles - 1 - lax.div(program, jnp.int32(parts))
            listed, per = counts_ref[mb, mh, tile, 0], counts_ref[mb, mh, tile, 1]
            first = part * per
            count = jnp.clip(listed - first, 0, per)
            out_row0 = part * sq + tile * TILE_Q  # where its rows' O and LSE go
        by_source = dict(zip(sources, vector_refs))
        offset_refs = vector_refs[len(sources):]

        def vector_slice(src, start, n):
            return by_source[src].at[(*vector_row(src, bi, hi), pl.ds(start, n))]

        def kv_start(step):
            return blocks_ref[mb, mh, tile, step + first] * BLOCK_KV

        def take_turn():  # the two compute warpgroups alternate on the tensor cores
            if turns:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(registers, action="increase")
            qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
            row0 = tile * TILE_Q + wg * BLOCK_Q
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(row0, BLOCK_Q), hi], qo_smem,
                                    q_ready.at[wg])
            for src, smem, ready in zip(side["q_idx"], qvec_smem, qvec_ready):
                plgpu.copy_gmem_to_smem(vector_slice(src, row0, BLOCK_Q), smem.at[wg],
                                        ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
            # The query rows' vectors, held in registers for the whole loop.
            own = {}
            for src, smem, ready in zip(side["q_idx"], qvec_smem, qvec_ready):
                plgpu.barrier_wait(ready.at[wg])
                own[src] = plgpu.load(smem.at[wg], layout=row_layout)
            refs = dict(zip(spec.operand_names, operand_refs))
            # The mod's terms of the query alone, on the rows' vector, for the whole loop.
            row_parts = {}
            if "q_idx" in part_axes:
                rows = row0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q,), 0,
                                                     layout=row_layout)
                row_parts = {n: x for found in parts_of.values() for n, x in part_vectors(
                    found, "q_idx", rows, bi, hi, refs).items()}

            @pl.when(count > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])

            pl.when(wg == 1)(take_turn)

            def modded(qk, kv0, is_full, slot):
                """The score tile of keys kv0.. after the mod (on a full tile, the
                mod without its mask) and the tail mask, in log2 units."""
                if general[0] is None and not needs_kv_idx:
                    return qk * jnp.float32(spec.scale * LOG2E)
                inputs = {"b": bi, "h": hi}
                if needs_q_idx:
                    inputs["q_idx"] = row0 + plgpu.broadcasted_iota(
                        jnp.int32, (BLOCK_Q, BLOCK_KV), 0, layout=wgmma_layout)
                if needs_kv_idx:
                    inputs["kv_idx"] = kv0 + plgpu.broadcasted_iota(
                        jnp.int32, (BLOCK_Q, BLOCK_KV), 1, layout=wgmma_layout)
                for ready in kvvec_ready + off_ready:  # every step (each wait takes one phase)
                    plgpu.barrier_wait(ready.at[slot])

                def run(variant):
                    expr, factor, in_log2 = variant
                    s = qk * jnp.float32(spec.scale * factor)
                    if expr is not None:
                        mine = vector_reads(expr)
                        diagonal = offset_reads(expr)  # spread over this warpgroup's tile
                        known = offset_values(diagonal, {
                            src: offsets.tile(smem.at[slot], wg * BLOCK_Q, (BLOCK_Q, BLOCK_KV),
                                              False, spec.interpret)
                            for src, smem in zip(offsets.sources, off_smem)} if diagonal else {})
                        if mine:  # the key tile's vectors, loaded where this variant reads them
                            keys = {src: plgpu.load(smem.at[slot], layout=col_layout)
                                    for src, smem in zip(side["kv_idx"], kvvec_smem)}
                            known.update(tile_reads(
                                mine, {"q_idx": own, "kv_idx": keys}, {"q_idx": 0, "kv_idx": 1},
                                (BLOCK_Q, BLOCK_KV)))
                        known.update(position_values([expr], refs, bi, hi, row0, kv0,
                                                     (BLOCK_Q, BLOCK_KV),
                                                     interpret=spec.interpret))
                        if parts_of[expr]:  # one-axis terms: the key tile's on its columns
                            by_axis = {"q_idx": row_parts, "kv_idx": {}}
                            if any(a == "kv_idx" for _, a in parts_of[expr]):
                                cols = kv0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV,), 0,
                                                                    layout=col_layout)
                                by_axis["kv_idx"] = part_vectors(parts_of[expr], "kv_idx", cols,
                                                                 bi, hi, refs)
                            known.update({n: lax.broadcast_in_dim(
                                by_axis[a][n], (BLOCK_Q, BLOCK_KV), [0 if a == "q_idx" else 1])
                                for n, a in parts_of[expr]})
                        (s,) = codegen.evaluate_tile([expr], dict(inputs, score=s), refs,
                                                     gather=tile_load(spec.interpret),
                                                     rules=TILE_RULES, known=known)
                        s = s.astype(jnp.float32)
                    return s if in_log2 else s * jnp.float32(LOG2E)

                if on_full is None:
                    s = run(general)
                else:
                    s = lax.cond(is_full != 0, lambda: run(on_full), lambda: run(general))
                if spec.skv % BLOCK_KV:
                    s = jnp.where(inputs["kv_idx"] < spec.skv, s, NEG_INF)
                return s

            def step_fn(step, carry):
                acc, m, l = carry
                slot = lax.rem(step, STAGES)
                # The tile's first key, read ahead of the product that it waits on.
                kv0 = (kv_start(step) if needs_kv_idx or has_blocks or "kv_idx" in part_axes
                       else None)
                is_full = full_ref[mb, mh, tile, step + first] if on_full is not None else None

                def scores(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    take_turn()
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((BLOCK_Q, BLOCK_KV), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                s = modded(s, kv0, is_full, slot)
                m_new = jnp.maximum(m, s.max(axis=1))
                # A row masked so far has m = -inf: shift by 0 so that it adds nothing.
                shift = jnp.where(m_new == NEG_INF, 0.0, m_new)
                alpha = jnp.exp2(m - shift)
                p = jnp.exp2(s - lax.broadcast_in_dim(shift, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p = p.astype(dtype)
                # Keep the softmax ahead of the turn's barriers (the order matters for speed).
                acc, l, m_new, p = lax.optimization_barrier((acc, l, m_new, p))
                if turns:
                    plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready.at[slot])
                if turns:
                    plgpu.barrier_wait(turn)

                def products(acc_refs):
                    plgpu.wgmma(acc_refs[0], left_operand(spec, p, staged, wg), v_smem.at[slot])
                    nxt = step + 1

                    @pl.when(nxt < count)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(nxt, STAGES)])

                (acc,) = accumulate(spec, products, (acc,))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            init = (plgpu.layout_cast(jnp.zeros((BLOCK_Q, dv), jnp.float32), wgmma_layout),
                    plgpu.layout_cast(jnp.full((BLOCK_Q,), NEG_INF, jnp.float32), row_layout),
                    plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), row_layout))
            acc, m, l = lax.fori_loop(0, count, step_fn, init)
            pl.when(wg == 0)(take_turn)

            empty = l == 0.0  # every score of the row masked: O 0, LSE -inf
            safe = jnp.where(empty, 1.0, l)
            inv = jnp.where(empty, 0.0, 1.0 / safe)
            qo_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
            shift = jnp.where(m == NEG_INF, 0.0, m)
            lse_smem[...] = jnp.where(empty, NEG_INF, shift * jnp.float32(LN2) + jnp.log(safe))
            plgpu.commit_smem()
            out_rows = pl.ds(row0 if parts == 1 else out_row0 + wg * BLOCK_Q, BLOCK_Q)
            plgpu.copy_smem_to_gmem(qo_smem, o_ref.at[bi, out_rows, hi])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, hi, out_rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
            kv_head = lax.div(hi, jnp.int32(spec.groups))

            def copy_keys(ref, smem, ready, start):  # one key tile, from its pages if paged
                if pages is None:
                    plgpu.copy_gmem_to_smem(ref.at[bi, pl.ds(start, BLOCK_KV), kv_head], smem,
                                            ready)
                elif page >= BLOCK_KV:  # one page holds the tile
                    at = pages_ref[bi, lax.div(start, jnp.int32(page))]
                    rows = pl.ds(lax.rem(start, jnp.int32(page)), BLOCK_KV)
                    plgpu.copy_gmem_to_smem(ref.at[at, rows, kv_head], smem, ready)
                else:  # the tile's pages, each into its rows (the barrier takes every copy)
                    first = lax.div(start, jnp.int32(page))
                    for j in range(copies):
                        plgpu.copy_gmem_to_smem(ref.at[pages_ref[bi, first + j], :, kv_head],
                                                smem.at[pl.ds(j * page, page)], ready)

            def fetch(step, slot, wait):
                start = kv_start(step)
                if wait:
                    plgpu.barrier_wait(k_free.at[slot])
                copy_keys(k_ref, k_smem.at[slot], k_ready.at[slot], start)
                if wait:
                    plgpu.barrier_wait(v_free.at[slot])
                copy_keys(v_ref, v_smem.at[slot], v_ready.at[slot], start)
                # The key tile's vectors: read by the mod before the slot's v_free.
                for src, smem, ready in zip(side["kv_idx"], kvvec_smem, kvvec_ready):
                    plgpu.copy_gmem_to_smem(vector_slice(src, start, BLOCK_KV), smem.at[slot],
                                            ready.at[slot])
                # The window of the diagonals: read by the mod before the slot's v_free.
                for ref, src, smem, ready in zip(offset_refs, offsets.sources, off_smem,
                                                 off_ready):
                    plgpu.copy_gmem_to_smem(offsets.at(ref, src, bi, hi, tile * TILE_Q, start),
                                            smem.at[slot], ready.at[slot])

            for step in range(STAGES):
                pl.when(step < count)(functools.partial(fetch, step, step, False))

            def refill(step, carry):
                fetch(step, lax.rem(step, STAGES), True)
                return carry

            lax.fori_loop(STAGES, jnp.maximum(count, STAGES), refill, None)

            # Wait out the frees no fetch waited for, so that this warpgroup has seen
            # every phase of those barriers (Mosaic GPU's interpret mode checks it).
            def drain(step, carry):
                plgpu.barrier_wait(k_free.at[lax.rem(step, STAGES)])
                plgpu.barrier_wait(v_free.at[lax.rem(step, STAGES)])
                return carry

            lax.fori_loop(jnp.maximum(count - STAGES, 0), count, drain, None)

    def entry(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, *rest):
        pages_ref, rest = (rest[0], rest[1:]) if pages is not None else (None, rest)
        operand_refs, vector_refs = rest[:n_ops], rest[n_ops:n_ops + n_vec]
        o_ref, lse_ref = rest[n_ops + n_vec:]
        smem = [plgpu.SMEM((wgs, BLOCK_Q, d), dtype, transforms=swizzled()),
                plgpu.SMEM((STAGES, BLOCK_KV, d), dtype, transforms=swizzled()),
                plgpu.SMEM((STAGES, BLOCK_KV, dv), dtype, transforms=swizzled()),
                offsets.scratch(STAGES),
                plgpu.SMEM((wgs, BLOCK_Q), jnp.float32)]
        smem += staging(spec, wgs, BLOCK_Q, BLOCK_KV, dtype)
        ready = (plgpu.Barrier(num_arrivals=copies, num_barriers=STAGES),
                 plgpu.Barrier(num_arrivals=copies, num_barriers=STAGES),
                 plgpu.Barrier(num_barriers=wgs))
        free = (plgpu.Barrier(num_arrivals=wgs, num_barriers=STAGES),) * 2
        turn = plgpu.Barrier(num_arrivals=wgs)
        kernel_dtype = {src: vectors[sources.index(src)].dtype for src in sources}
        vec_smem = ([plgpu.SMEM((wgs, BLOCK_Q), kernel_dtype[s]) for s in side["q_idx"]],
                    [plgpu.SMEM((STAGES, BLOCK_KV), kernel_dtype[s]) for s in side["kv_idx"]])
        vec_ready = ([plgpu.Barrier(num_barriers=wgs) for _ in side["q_idx"]],
                     [plgpu.Barrier(num_barriers=STAGES) for _ in side["kv_idx"]])
        diagonal = [plgpu.Barrier(num_barriers=STAGES) for _ in offsets.sources]
        pl.run_scoped(
            lambda *scoped: program(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref,
                                    pages_ref, operand_refs, vector_refs, o_ref, lse_ref,
                                    scoped),
            smem, ready, free, turn, vec_smem, vec_ready, diagonal, collective_axes="wg")

    # With parts, each part's O and LSE (rows part * sq + i), joined by the caller.
    out_type = (jax.ShapeDtypeStruct((b, parts * sq, hq, dv), dtype),
                jax.ShapeDtypeStruct((b, hq, parts * sq), jnp.float32))
    return plgpu.kernel(
        entry, out_type=out_type, grid=(hq, n_tiles * parts, b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=wgs + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(spec),
    )(counts, blocks, full, q, k, v, *(() if pages is None else (pages,)), *operands, *vectors)
