"""Block-sparse Pallas kernels generated from the IR, as a backend.

The mod is compiled into three Pallas kernels (``kernels``): a forward that
visits the tiles a :class:`~scoremod.lowering.block_maps.BlockMap` lists, and a
FlashAttention-2 backward (one kernel for dK and dV, one for dQ) that visits
the same tiles. The mod and its derivatives are evaluated on each score tile
by ``codegen``, so any mod of the op table runs, with integer index math,
float comparisons and captured arrays (gathers from small tables included),
and its gradients reach the captured float arrays too.

The forward runs on one of two engines, ``LoweringOptions.pallas_engine``:
``"triton"`` (``kernels``: Pallas's Triton lowering, any GPU, interpret mode
off one; float32 too) or ``"mosaic"`` (``mosaic``: Pallas's Mosaic GPU
lowering for Hopper, wgmma and TMA; float16 and bfloat16, head dim 64 or 128,
captured arrays read at scalar positions or along one tile axis, as document
ids are, not gathered); ``"auto"``, the default, takes the Mosaic engine where
it runs the call and the Triton one elsewhere (``Pallas.engine``; the plan's
description says which and why). Both return the same O and
natural-log LSE. The backward follows: with the Mosaic engine it runs on
Mosaic GPU kernels too (``mosaic_backward``) where they can evaluate the
mod's derivative, decided when the call is planned, gradients of captured
float arrays included: read at one position per program (``slopes[h]``, a
learned scalar), along the keys or queries, at whole blocks, per score
(gathers too: ``_dense_gradients``), and tables read at q_idx - kv_idx (a
kernel per block diagonal, ``mosaic_backward.diagonal_sums``); the few
operands those refuse (``_mosaic_unlearnable``), and everything under the
Triton engine, run on the Triton backward kernels.

The calls run through the pipeline every fused backend does
(``lowering.backend.execute``); the backward takes the LSE's cotangent and
computes the gradients of captured float arrays (``operand_gradients``).
The calls are not partitioned: under a mesh XLA gathers their inputs, and a
backward with the LSE's cotangent or operand gradients is batched under
``jax.vmap`` by Pallas itself. Off a GPU the kernels run in Pallas's
interpret mode (as slow as it sounds: for tests).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from scoremod import device, support
from scoremod import options as lowering_options
from scoremod.dsl import ir
from scoremod.dsl.scoremod import ScoreMod
from scoremod.dsl.text import format_expr
from scoremod.errors import ScoreModError
from scoremod.lowering import block_maps, decode, patterns
from scoremod.lowering.backend import Backend
from scoremod.lowering.pallas import codegen, kernels, mosaic, mosaic_backward, selects
from scoremod.lowering.problem import Problem

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 128)
# A captured array whose gradient is computed has one partial row per
# (batch, query head, key block), covering the axes not read at the program's
# own batch or head: rows of up to this many elements (a relative-position
# table per head, slopes, a scalar), not score-sized ones.
MAX_GRADIENT_ELEMENTS = 1 << 16
# The Mosaic GPU kernels' time per tile against cuDNN's, forward and backward of dense
# softcap at b4 h16 s4096 d128 on the H200 (5.146 / 3.901 ms, 2026-12-05, two compute
# warpgroups in the backward, docs/performance.md: the forward level, the backward at
# 0.69x); and how much less modelled time a claim on tile counts needs (a margin for
# what the model leaves out: partial tiles' masks, smaller kernels' last waves), as
# the query-block split asks of its own.
MOSAIC_TILE_COST = 5.146 / 3.901
CLAIM_MARGIN = 0.8
# A Mosaic GPU forward with fewer programs than multiprocessors (decoding: a few query
# rows per head) splits each query tile's key list into parts, one program each
# (``key_parts``), down to parts of this many key tiles (1024 keys: the join's cost
# stays small beside a part's reads).
MIN_PART_TILES = 8
MAX_PARTS = 64
# A program's fixed cost (its start, its query tile, its O and LSE written, the join's
# share), in key tiles: fitted to the softcap decode on the H200 (b8, 32 query heads on
# 8, 32768 keys, one row: 256 tiles per query tile; 0.510 ms in one part, 64 programs
# on 132 multiprocessors; 0.273 in four parts, two waves; 2026-12-06, run_s21_call1):
# 1.95 us a tile and 12 us a program, one program per multiprocessor at a time.
PART_FIXED_TILES = 6


def dense_map(problem: Problem, block_q: int, block_kv: int, operands) -> block_maps.BlockMap:
    """Every tile: right for any mod."""
    del operands
    return block_maps.dense_block_map(sq=problem.sq, skv=problem.skv, block_q=block_q,
                                      block_kv=block_kv)


@dataclasses.dataclass(frozen=True)
class AnalysedMap:
    """The tiles of ``expr`` from the IR (``lowering.block_maps``): on the host where
    it reads no captured array (a static mask), else built in the program."""

    expr: object

    def __call__(self, problem, block_q, block_kv, operands):
        if not ir.operands_of(self.expr):
            return block_maps.static_block_map(self.expr, problem, block_q, block_kv)
        return block_maps.block_map(self.expr, operands, problem, block_q, block_kv)


@dataclasses.dataclass(frozen=True)
class PallasPlan:
    """The static description of one call (hashable)."""

    mod: ScoreMod | None  # the expression only: operand values travel beside it
    scale: float
    return_lse: bool
    problem: Problem
    forward_blocks: tuple  # (block_q, block_kv)
    backward_blocks: tuple
    num_warps: tuple  # (forward, backward)
    num_stages: int
    interpret: bool
    # (problem, block_q, block_kv, operand values by name) -> BlockMap; the
    # tiles to visit. A map that leaves out a tile with an unmasked score is wrong.
    block_map: object = dense_map
    # The mod on the tiles the map marks full (every score live), or None:
    # the whole mod everywhere. It must equal the mod on every such tile.
    full_expr: object = None
    engine: str = "triton"  # the forward's: LoweringOptions.pallas_engine
    # The backward's engine: "mosaic" where the Mosaic GPU forward runs and its
    # backward kernels can evaluate the mod's derivative, else "triton" (with
    # ``backward_note`` saying why). It learns captured float arrays too, except
    # those in ``triton_operands``.
    backward_engine: str = "triton"
    backward_note: str | None = None
    # ((name, why), ...): float operands whose gradients the Mosaic backward
    # cannot compute (a read that varies over the tile); a call asking for one
    # runs the Triton backward.
    triton_operands: tuple = ()
    # Why the Triton backward cannot run this mod (an op its lowering lacks, such
    # as erf), or None: a Mosaic GPU call that would need it refuses its backward.
    triton_refusal: str | None = None
    # Float operands read at q_idx - kv_idx only, whose gradients the Mosaic backward's
    # per-block-diagonal kernel sums (mosaic_backward.diagonal_sums).
    diagonal_operands: tuple = ()
    # Whether pallas_engine="auto" chose ``engine``; where it chose the Triton
    # engine, why the Mosaic GPU engine does not take the call.
    auto_engine: bool = False
    engine_note: str | None = None
    # The Mosaic GPU forward's programs per query tile (``key_parts``); with key lists
    # that differ by row at run time, the multiprocessors their tiles are spread over
    # (``spread_parts``: a long list takes more of the programs than a short one; 0:
    # each list in ``key_parts`` equal parts).
    key_parts: int = 1
    part_spread: int = 0
    # Whether the Mosaic backward's dK/dV kernel computes dQ as well (unless the call
    # asks for deterministic gradients: its reduce-adds come in any order); else a
    # dQ kernel does.
    fused_dq: bool = False
    # The mod as the Mosaic GPU kernels evaluate it (``selects.spelled``: short-axis
    # gathers as chains of selects), where that differs from ``mod``'s; ``mod``
    # keeps the caller's operand order, which the operand arrays follow.
    spelled: object = None

    @property
    def expr(self):
        """The mod's expression as the kernels evaluate it (None: plain attention)."""
        if self.spelled is not None:
            return self.spelled
        return None if self.mod is None else self.mod.expr

    def spec(self, blocks_, warps) -> kernels.KernelSpec:
        p = self.problem
        return kernels.KernelSpec(
            expr=self.expr,
            full_expr=None if self.mod is None else self.full_expr,
            operand_names=() if self.mod is None else self.mod.operand_names,
            scale=self.scale, sq=p.sq, skv=p.skv, groups=p.hq // p.hkv,
            block_q=blocks_[0], block_kv=blocks_[1], num_warps=warps,
            num_stages=self.num_stages, interpret=self.interpret)

    def mosaic_spec(self) -> mosaic.MosaicSpec:
        p = self.problem
        return mosaic.MosaicSpec(
            expr=self.expr,
            operand_names=() if self.mod is None else self.mod.operand_names,
            scale=self.scale, sq=p.sq, skv=p.skv, groups=p.hq // p.hkv,
            full_expr=None if self.mod is None else self.full_expr, interpret=self.interpret,
            parts=self.key_parts)

    def mosaic_backward_spec(self, learned=()) -> mosaic_backward.BackwardSpec:
        forward = self.mosaic_spec()
        return mosaic_backward.BackwardSpec(
            **{f.name: getattr(forward, f.name) for f in dataclasses.fields(forward)
               if f.name != "parts"},
            learned=tuple(learned))

    def describe(self):
        what = "plain attention" if self.mod is None else f"score_mod `{self.mod}`"
        chosen = ("" if not self.auto_engine else
                  "pallas_engine=\"auto\": " + (self.engine_note or "it takes the call") + "; ")
        if self.engine != "mosaic":
            engines = f"Triton engine, {chosen}" if self.auto_engine else ""
        elif self.backward_engine == "mosaic" and not self.triton_operands:
            engines = ("Mosaic GPU forward and backward, gradients of captured arrays included; "
                       f"{chosen}")
        elif self.backward_engine == "mosaic":
            names = ", ".join(f"`{name}`" for name, _ in self.triton_operands)
            engines = (f"Mosaic GPU forward and backward, the Triton backward where the gradient "
                       f"of {names} is asked for: {self.triton_operands[0][1]}; {chosen}")
        else:
            engines = f"Mosaic GPU forward, Triton backward: {self.backward_note}; {chosen}"
        return (f"{what} as block-sparse Pallas kernels ({engines}forward tiles "
                f"{self.forward_blocks}, backward tiles {self.backward_blocks}"
                f"{', interpret mode' if self.interpret else ''})")


class Pallas(Backend):
    name = "pallas"
    title = "the Pallas block-sparse kernels"
    operand_gradients = True
    repeatable_backward = True  # no atomics in either engine's kernels; fixed-order sums
    partitioned = False
    hint = "Use implementation=\"xla\", or implementation=None to choose automatically."

    def present(self):
        return device.current().family is not None

    def why_not(self, problem, mod, automatic, options=None):
        options = lowering_options.current() if options is None else options
        engine, _ = self.engine(problem, mod, options)
        if mod is not None:
            # The ops the Triton lowering lacks: the Mosaic GPU engine runs them, and
            # refuses a backward that would need the Triton kernels (_backward).
            why = codegen.refusal(mod.expr, mod.sources, ops=engine != "mosaic")
            if why:
                return why
        if engine == "mosaic":  # "auto" chose it because it has no refusal
            return None if options.pallas_engine == "auto" else self._why_not_mosaic(problem, mod)
        if automatic and self.triton_beside_mosaic(problem, mod, options):
            # Not chosen where JAX deprecates the Triton engine (Hopper, jax 0.11 or
            # later: the Mosaic engine runs this problem but refuses the mod).
            return (f"JAX deprecates Pallas's Triton engine, and here its Mosaic GPU engine "
                    f"refuses the mod: {self._why_not_mosaic(problem, mod, advice=False)}; "
                    "implementation=\"pallas\" runs it on the Triton engine by name")
        if problem.dtype not in DTYPES:
            return f"it takes float16, bfloat16 or float32 inputs, got {problem.dtype}"
        if problem.d not in HEAD_DIMS or problem.dv not in HEAD_DIMS:
            return (f"its kernels are built for head dims {' and '.join(map(str, HEAD_DIMS))}, "
                    f"got {problem.d} (queries, keys) and {problem.dv} (values)")
        platform = device.current().platform
        if platform == "gpu" and device.current().family is None:
            return "Pallas's Triton lowering needs an NVIDIA GPU"
        gone = support.pallas_triton_missing() if platform == "gpu" else None
        if gone:
            return (f"its Triton engine cannot compile here: {gone}; its Mosaic GPU engine "
                    "(Hopper GPUs, jax 0.11 or later) runs the calls it takes")
        if automatic and problem.dtype == "float32":
            return ("float32 inputs make its tile products IEEE float32 dots, slower than the "
                    "reference path's; ask by name")
        if automatic and platform != "gpu":
            return "off a GPU the kernels run in Pallas's interpret mode (slow); ask by name"
        return None

    def engine(self, problem, mod, options):
        """``(engine, note)``: the engine that runs the call under ``options``
        (``"triton"`` or ``"mosaic"``) and, where ``pallas_engine="auto"`` gave it to
        the Triton engine, why the Mosaic GPU engine does not take it (else None)."""
        if options.pallas_engine != "auto":
            return options.pallas_engine, None
        why = self._why_not_mosaic(problem, mod, advice=False)
        return ("triton", why) if why else ("mosaic", None)

    def variant(self, problem, mod, options):
        engine, note = self.engine(problem, mod, options)
        how = ("the Mosaic GPU engine" if engine == "mosaic" else "the Triton engine")
        if options.pallas_engine != "auto":
            return f"{how} (pallas_engine=\"{engine}\")"
        if note:
            return f"{how} (pallas_engine=\"auto\": {note})"
        return f"{how} (pallas_engine=\"auto\": it takes the call)"

    def claims(self, problem, mod, options, over):
        # Short queries (decoding): the Mosaic engine packs a group's query heads and
        # splits each tile's key list over programs (key_parts); against cuDNN's fold
        # at b8 hq32 hkv8, 32768 keys, one row (docs/performance.md, 2026-12-06): ALiBi
        # 0.298 against 0.431 ms, a 4096 window 0.076 against 0.091 (traced: 0.071
        # against 0.079), softcap 0.275 against 0.281.
        if (over.name == "cudnn" and options.decode_splits != 0 and decode.short(problem)
                and self.engine(problem, mod, options)[0] == "mosaic"):
            return ("short queries: the Mosaic GPU engine packs each key/value head's query "
                    "heads and splits the key tiles over programs, reading K and V once "
                    "per group at most of the GPU's bandwidth")
        # A mask or bias read per score (Flax's), or any other read per score (a gather),
        # on the Mosaic GPU engine: not measured against cuDNN's tensor of it, so not
        # claimed from cuDNN (by the claims below).
        if mod is not None and self.engine(problem, mod, options)[0] == "mosaic":
            spelled = selects.spelled(mod.expr)
            if mosaic.dense_reads(spelled) or any(
                    n.op == ir.LOAD and mosaic.gathered(n) for n in ir.toposort(spelled)):
                return None
        # Measured against cuDNN's dense graph (docs/performance.md): 4 documents per
        # row with a softcap, the kernels run 2.8x its forward and 4x its fwd+bwd at 4096.
        # Not on the Triton engine where the Mosaic GPU engine runs this problem but
        # refuses the mod (Hopper, jax 0.11 or later): JAX deprecates Pallas's Triton
        # backend there, and cuDNN computing the mask ahead is what a user gets from
        # the supported stack (JetSpec's tree: a 2-D window of its ancestor table).
        cond = None if mod is None or over.name != "cudnn" else patterns.mask_from_data(mod.expr)
        if cond is not None and not self.triton_beside_mosaic(problem, mod, options):
            return (f"the mask `{format_expr(cond)}` reads captured arrays; cuDNN would "
                    "compute it ahead as a [.., Sq, Skv] tensor and visit every tile, the "
                    "Pallas kernels compute it in the kernel and skip the tiles it empties")
        # A relative-position table (a read at q_idx - kv_idx): cuDNN materializes it as a
        # [.., Sq, Skv] bias (O(S^2) memory); the Mosaic GPU engine reads it per diagonal
        # tile (measured in docs/performance.md; the Triton engine's gather is slower than
        # cuDNN there, so only for the Mosaic engine).
        reads = () if mod is None else mosaic.offset_reads(mod.expr)
        if reads and self.engine(problem, mod, options)[0] == "mosaic":
            return (f"`{format_expr(reads[0])}` reads a table at q_idx - kv_idx, which other "
                    "backends compute ahead as a [.., Sq, Skv] tensor; the Mosaic GPU engine "
                    "reads it a value per diagonal")
        # A float value cuDNN computes ahead from captured arrays over the whole score
        # matrix (a small table read through other arrays: a bias between token kinds),
        # which the Mosaic GPU engine evaluates per tile (``selects``): by the bytes, a
        # [B, H, Sq, Skv] float32 tensor written and read (4 GiB at b4 h16 s4096, past
        # the H200's memory at 32768) against none.
        ahead = (None if mod is None or over.name != "cudnn"
                 or self.engine(problem, mod, options)[0] != "mosaic"
                 else over.data_tensor_ahead(problem, mod, options))
        if ahead is not None:
            return (f"cuDNN would read {ahead}; the Mosaic GPU engine evaluates it per tile "
                    "from the arrays")
        # A static mask whose block map keeps far fewer tiles than the other backend's
        # plan computes (NATTEN, STA, block masks: cuDNN's query blocks take each
        # block's keys from its first to its last live tile): per tile, the Mosaic GPU
        # kernels take MOSAIC_TILE_COST of cuDNN's time, forward and backward.
        ours = self.tile_share(problem, mod, options)
        theirs = over.tile_share(problem, mod, options)
        if theirs is None or self.engine(problem, mod, options)[0] != "mosaic":
            return None
        if ours * MOSAIC_TILE_COST <= CLAIM_MARGIN * theirs:
            return (f"its block map of the mask keeps {ours:.0%} of the tiles, where "
                    f"{over.name}'s plan computes {theirs:.0%} (forward and backward weighted "
                    f"1 : 2.5), at {MOSAIC_TILE_COST:.2f}x cuDNN's time per tile")
        # A static mask the other plan computes ahead as a tensor of the whole
        # [.., Sq, Skv] score matrix (an op cuDNN's graphs lack: bit operations): the
        # kernels evaluate it per tile. The tile counts leave that tensor out (XLA's
        # pass over it, its reads per score, O(Sq * Skv) memory whatever the mask
        # keeps), all on the other side, so no margin: no more modelled time.
        ahead = None if mod is None else over.static_tensor_ahead(problem, mod, options)
        if ahead is not None and ours * MOSAIC_TILE_COST <= theirs:
            return (f"{over.name}'s graphs lack {ahead}; the kernels evaluate it per "
                    f"tile, and their block map keeps {ours:.0%} of the tiles, where "
                    f"{over.name}'s plan computes {theirs:.0%} (forward and backward weighted "
                    f"1 : 2.5), at {MOSAIC_TILE_COST:.2f}x cuDNN's time per tile")
        return None

    def triton_beside_mosaic(self, problem, mod, options) -> bool:
        """Whether ``pallas_engine="auto"`` would run this call on the Triton engine
        only because the Mosaic GPU engine, which takes this problem here, refuses the
        mod (a choice the planner does not make for a faster backend's call)."""
        return (options.pallas_engine == "auto" and mod is not None
                and self._why_not_mosaic(problem, None) is None
                and mosaic.refusal(selects.spelled(mod.expr), mod.sources) is not None)

    def claims_forward(self, problem, mod, options, over):
        # Measured forwards on the H200 (docs/performance.md): the Mosaic GPU kernels
        # beat cuDNN's score_mod graphs (softcap + causal, ALiBi, softcap + prefix-LM)
        # where their backward does not; off by default until the benchmarks say where.
        if (not options.mosaic_forward or over.name != "cudnn" or decode.short(problem)
                or not over.evaluates_mod(problem, mod, options)
                or self.engine(problem, mod, options)[0] != "mosaic"):
            return None
        return ("LoweringOptions(mosaic_forward=True): the Mosaic GPU engine's forward, "
                "for a mod cuDNN evaluates per score")

    def tile_share(self, problem, mod, options):
        # The kernels visit the tiles the block map keeps, forward and backward.
        if mod is None:
            return 1.0
        kept = block_maps.static_tiles(mod.expr, problem.sq, problem.skv)
        return 1.0 if kept is None else float(kept.mean())

    def _why_not_mosaic(self, problem, mod, advice=True):
        """The Mosaic GPU forward's refusals (its backward falls back to the Triton
        kernels, chosen in ``plan``, where its own cannot run the mod); ``advice``:
        saying that the Triton engine runs the call."""
        if mod is not None:
            why = mosaic.refusal(selects.spelled(mod.expr), mod.sources, advice=advice)
            if why:
                return why
        switch = "; LoweringOptions(pallas_engine=\"triton\") runs it" if advice else ""
        if problem.dtype not in mosaic.DTYPES:
            return (f"its Mosaic GPU engine takes float16 or bfloat16 inputs (wgmma), got "
                    f"{problem.dtype}{switch}")
        if problem.d != problem.dv or problem.d not in mosaic.HEAD_DIMS:
            return (f"its Mosaic GPU engine is built for equal query and value head dims of "
                    f"{' or '.join(map(str, mosaic.HEAD_DIMS))}, got {problem.d} (queries, keys) "
                    f"and {problem.dv} (values){switch}")
        too_old = support.mosaic_missing()
        if too_old:
            return f"its Mosaic GPU engine is {too_old}{switch}"
        here = device.current()
        if here.platform != "gpu" or here.family != 9:
            found = f"compute capability {here.family}.x" if here.family else here.platform
            return (f"its Mosaic GPU engine needs a Hopper GPU (compute capability 9.x), "
                    f"found {found}{switch}")
        return None

    def plan(self, problem, mod, scale, options, return_lse):
        interpret = device.current().platform != "gpu"
        engine, engine_note = self.engine(problem, mod, options)
        fwd = (options.pallas_block_q, options.pallas_block_kv)
        if engine == "mosaic":  # its tiles are fixed by its warpgroups
            fwd = (mosaic.TILE_Q, mosaic.BLOCK_KV)
        bwd = (options.pallas_backward_block_q, options.pallas_backward_block_kv)
        warps = options.pallas_num_warps
        if warps is None:  # wide head dims hold bigger tiles: more warps to share them
            big = max(problem.d, problem.dv) > 64
            warps = (8 if big else 4, 8 if big else 4)
        else:
            warps = (warps, warps)
        # The mod's own tiles: masked ones skipped, full ones run the mod without its mask.
        block_map, full_expr, expr = dense_map, None, None
        if mod is not None:
            expr = selects.spelled(mod.expr) if engine == "mosaic" else mod.expr
            block_map = AnalysedMap(expr)
            full_expr = _full_expr(expr)
        backward_engine, backward_note, triton_operands, diagonal_operands = "triton", None, (), ()
        if engine == "mosaic":
            sources = mod.sources if mod is not None else {}
            backward_note = _mosaic_backward_refusal(expr, full_expr, sources)
            if backward_note is None:  # its tiles are fixed by its warpgroups too
                backward_engine = "mosaic"
                bwd = (mosaic_backward.TILE, mosaic_backward.TILE)  # the padding's
                triton_operands, diagonal_operands = _mosaic_unlearnable(expr, full_expr,
                                                                         problem, sources)
            elif not interpret and support.pallas_triton_missing():
                backward_engine = None  # the backward refuses, saying why (_backward)
        return PallasPlan(
            mod=None if mod is None else ScoreMod(mod.expr), scale=float(scale),
            return_lse=bool(return_lse), problem=problem, forward_blocks=fwd,
            backward_blocks=bwd, num_warps=warps, num_stages=options.pallas_num_stages,
            interpret=interpret, block_map=block_map, full_expr=full_expr, engine=engine,
            backward_engine=backward_engine, backward_note=backward_note,
            triton_operands=triton_operands, diagonal_operands=diagonal_operands,
            triton_refusal=(codegen.refusal(mod.expr, mod.sources)
                            if mod is not None and engine == "mosaic" else None),
            auto_engine=options.pallas_engine == "auto",
            engine_note=engine_note,
            **(spread_parts(problem, mod, options) if engine == "mosaic" else {}),
            fused_dq=(mosaic_backward.FUSE_DQ and backward_engine == "mosaic"
                      and not options.deterministic),
            spelled=None if mod is None or expr is mod.expr else expr)

    def forward(self, plan, q, k, v, operands):
        return _forward(plan, q, k, v, tuple(operands))

    def splits_keys(self, plan):
        return plan.engine == "mosaic"

    def fetches_pages(self, plan, page_size):
        return plan.engine == "mosaic" and mosaic.page_copies(page_size) is not None

    def paged_forward(self, plan, q, key_pages, value_pages, table, operands):
        return _forward(plan, q, key_pages, value_pages, tuple(operands), table)

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        if dlse is None:
            dlse = jnp.zeros(lse.shape, jnp.float32)
        return _backward(plan, q, k, v, o, lse, do, dlse, tuple(operands), tuple(wanted))


PALLAS = Pallas()


def key_parts(problem: Problem, mod, options) -> int:
    """Programs per query tile for the Mosaic GPU forward (``mosaic.forward``'s
    parts): ``options.decode_splits`` if given for short queries (0 or 1: one;
    ``lowering.decode``'s limits), else the power of two whose programs finish
    first in waves over the multiprocessors (``PART_FIXED_TILES``), each part
    keeping at least ``MIN_PART_TILES`` of the key tiles the mask keeps (a static
    mask's share; every tile for a mask known only at run time: a part then takes
    its share of whatever the run's list holds)."""
    if options.decode_splits is not None:  # short queries only, as the option says
        given = options.decode_splits if problem.sq <= decode.MAX_ROWS else 1
        return max(1, min(given, MAX_PARTS))
    programs = problem.b * problem.hq * -(-problem.sq // mosaic.TILE_Q)
    sms = decode.multiprocessors(options)
    kept = block_maps.static_tiles(mod.expr, problem.sq, problem.skv) if mod is not None else None
    tiles = -(-problem.skv // mosaic.BLOCK_KV)
    if kept is not None:
        tiles = int(kept.sum(axis=1).max())  # the longest list of a query tile
    # The parts (a power of two) whose programs finish first: waves of programs over
    # the multiprocessors, each wave as long as a part's tiles and its fixed cost. One
    # wave of twice the parts is no faster than that; a second wave adds a fixed cost.
    def finish(parts):
        return -(-programs * parts // sms) * (-(-tiles // parts) + PART_FIXED_TILES)

    parts, tried = 1, 1
    while tried * 2 <= MAX_PARTS and tiles >= 2 * tried * MIN_PART_TILES:
        tried *= 2
        if finish(tried) < finish(parts):
            parts = tried
    return parts


def spread_parts(problem: Problem, mod, options) -> dict:
    """The plan's ``key_parts`` and ``part_spread``. Where the mask's key lists
    depend on captured arrays (``kv_lengths``, document ids, a traced position), one
    row's list may be 1000 keys and another's 32768: equal parts per row would leave
    the run as long as the longest row's parts, whatever the rest read. There the
    grid gets twice ``key_parts``' programs per query tile and each row takes as many
    as its list's share of the run's tiles (``part_sizes``), the rest left empty: a
    row of uniform lengths still runs in ``key_parts`` parts (an empty program's
    start and end are what it adds), a long row beside short ones in up to twice."""
    parts = key_parts(problem, mod, options)
    if parts == 1 or options.decode_splits is not None or not _lists_vary(mod):
        return dict(key_parts=parts)
    tiles = -(-problem.skv // mosaic.BLOCK_KV)
    most = max(1, min(MAX_PARTS, tiles // MIN_PART_TILES))
    return dict(key_parts=min(2 * parts, 1 << (most.bit_length() - 1)),
                part_spread=decode.multiprocessors(options))


def _lists_vary(mod) -> bool:
    """Whether the mod masks keys by a condition that reads captured arrays: its key
    lists are known at run time only, and may differ by row."""
    if mod is None:
        return False
    conds, _ = patterns.mask_conditions(mod.expr)
    deps = patterns.dependencies(mod.expr)
    return any("kv_idx" in deps[c] and ir.operands_of(c) for c in conds)


def part_sizes(counts, parts: int, spread: int, rows: int):
    """int32 like ``counts`` (a map's query-tile list lengths [Bm, Hm, tiles], each
    standing for ``rows`` // its size (batch x heads) program rows): the key tiles each
    of a tile's ``parts`` programs takes. The run's tiles over ``spread``
    multiprocessors give a target share (at least ``MIN_PART_TILES``); a list takes
    one part per whole share, from one to ``parts``, in equal parts."""
    total = jnp.sum(counts, dtype=jnp.int32) * (rows // (counts.shape[0] * counts.shape[1]))
    target = jnp.maximum(MIN_PART_TILES, (total + spread - 1) // spread)
    active = jnp.clip(counts // target, 1, parts)
    return (counts + active - 1) // active


def _full_expr(expr):
    """The mod on tiles the block map marks full, or None where that is the mod."""
    full = patterns.when_full(expr)
    return None if full is expr else full


def _mosaic_backward_refusal(expr, full_expr, sources):
    """Why the Mosaic GPU backward kernels cannot run the mod ``expr`` (its derivative,
    or the mod on full tiles), or None: the plan then takes the Triton backward."""
    if expr is None:
        return None
    why = mosaic_backward.refusal(expr, sources)
    if why is None and full_expr is not None:
        why = mosaic_backward.refusal(full_expr, sources)
    return why


# The most float32 entries of the dK/dV kernel's per-step sums of reads at whole blocks
# ([B, Hq, reads, Sq / 64, block rows, Skv]: 512 MiB); past it those gradients take the
# Triton backward.
MAX_STEP_SUMS = 1 << 27
# The most float32 entries of the dQ kernel's cotangents of reads per score ([B, Hq,
# reads, Sq, Skv]: 4 GiB); past it those gradients take the Triton backward.
MAX_DENSE_SUMS = 1 << 30


def _mosaic_unlearnable(expr, full_expr, problem, sources) -> tuple:
    """``(((name, why), ...), diagonal names)``: the float operands of ``expr`` whose
    gradients the Mosaic GPU backward cannot compute (``learning_refusal``, and
    not read at q_idx - kv_idx alone: ``diagonal_refusal``; reads at whole blocks
    whose per-step sums would pass ``MAX_STEP_SUMS``), and those read at q_idx -
    kv_idx, which its per-block-diagonal kernel sums."""
    out, diagonal = [], []
    exprs = [expr] + ([full_expr] if full_expr is not None else []) if expr is not None else []
    nodes = ir.operands_of(expr) if expr is not None else ()
    names = tuple(n.attr[0] for n in nodes)
    blocks = mosaic_backward.block_loads(expr, names) if expr is not None else ()
    step_sums = (problem.b * problem.hq * len(blocks) * -(-problem.sq // mosaic_backward.BLOCK)
                 * max(map(mosaic_backward.step_blocks, blocks), default=1) * problem.skv)
    for name, node in zip(names, nodes):
        if node.dtype != ir.F32:
            continue
        why = next((w for e in exprs
                    if (w := mosaic_backward.learning_refusal(e, name, sources))), None)
        if why is None and step_sums > MAX_STEP_SUMS and any(
                n.args[0].attr[0] == name for n in blocks):
            why = (f"its sums of a read at whole blocks per step of {mosaic_backward.BLOCK} "
                   f"queries, block row and key would take {step_sums} float32 entries, past "
                   f"{MAX_STEP_SUMS}")
        dense = len(mosaic_backward.dense_loads(expr, (name,))) if why is None else 0
        if dense and problem.b * problem.hq * dense * problem.sq * problem.skv > MAX_DENSE_SUMS:
            why = (f"the cotangents of its reads per score would take "
                   f"{problem.b * problem.hq * dense * problem.sq * problem.skv} float32 "
                   f"entries (batch x query heads x Sq x Skv), past {MAX_DENSE_SUMS}")
        if why is None:
            why = _one_hot_refusal(expr, name, node, problem)
        if why is None:
            continue
        if all(mosaic_backward.diagonal_refusal(e, name, sources) is None for e in exprs):
            diagonal.append(name)
        else:
            out.append((name, why))
    return tuple(out), tuple(diagonal)


def _one_hot_refusal(expr, name, node, problem) -> str | None:
    """Why the gradient of ``name``'s reads along one axis through captured arrays
    cannot be placed by a one-hot product (``_place_by_value``) of at most
    ``_MAX_MEMBERS`` entries, or None."""
    size = math.prod(node.attr[1][a] for a in _window_axes(expr, name, node))
    for read in mosaic_backward.learned_loads(expr, (name,)):
        keys = mosaic_backward.along_keys(read)
        if not (keys or mosaic_backward.along_queries(read)) \
                or not mosaic_backward.reads_arrays(read):
            continue
        entries = problem.b * problem.hq * (problem.skv if keys else problem.sq) * size
        if entries > _MAX_MEMBERS:
            return (f"its read `{format_expr(read)}` along the "
                    f"{'keys' if keys else 'queries'} through captured arrays is placed by a "
                    f"one-hot product of {entries} entries, past {_MAX_MEMBERS}")
    return None


# --------------------------------------------------------------------------- #


def _pad(x, axis, to):
    extra = to - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _padded(n, block):
    return block_maps.num_blocks(n, block) * block


def _kernel_operands(plan, operands, mosaic_kernels=True):
    """The captured arrays as the kernels read them (``codegen.kernel_operand``); on
    the Mosaic engine (``mosaic_kernels``: the forward's engine, or the backward's) an
    array read only per score stays 16-bit if it is (a bool mask: 8-bit), as
    ``mosaic.dense_gather`` widens each value as it loads it: no 4-byte copy of a
    [.., Sq, Skv] array per call."""
    if plan.mod is None:
        return ()
    out = []
    for x, name, node in zip(operands, plan.mod.operand_names, plan.mod.operand_nodes):
        reads = codegen.reads_of(plan.expr, name)
        dense = mosaic_kernels and reads and all(
            mosaic.read_axis(r) == mosaic.DENSE for r in reads)
        if dense and jnp.dtype(x.dtype) in (jnp.bfloat16, jnp.float16):
            out.append(jnp.ravel(x))
        elif dense and node.dtype == ir.BOOL:
            out.append(jnp.ravel(x).astype(jnp.int8))
        else:
            out.append(codegen.kernel_operand(x, node))
    return tuple(out)


def _map(plan, blocks_, operands):
    named = dict(zip(plan.mod.operand_names, operands)) if plan.mod is not None else {}
    return plan.block_map(plan.problem, blocks_[0], blocks_[1], named)


def _forward(plan, q, k, v, operands, table=None):
    """O and LSE; with ``table`` (Mosaic engine only: ``fetches_pages``) K and V are a
    paged cache that the kernel reads through it."""
    p = plan.problem
    bq, bk = plan.forward_blocks
    if plan.engine == "mosaic":
        bmap = _map(plan, plan.forward_blocks, operands)
        sq, skv = _padded(p.sq, bq), _padded(p.skv, bk)
        pages = None
        if table is None:
            k, v = _pad(k, 1, skv), _pad(v, 1, skv)
        else:
            pages = mosaic.paged_rows(table, k.shape[1], p.skv, k.shape[0])
        spec = _uniform_full(plan.mosaic_spec(), bmap.q_full)
        sizes = None
        if plan.part_spread:
            sizes = part_sizes(bmap.q_counts, plan.key_parts, plan.part_spread, p.b * p.hq)
        o, lse = mosaic.forward(spec, bmap, _pad(q, 1, sq), k, v,
                                _kernel_operands(plan, operands), pages=pages,
                                part_sizes=sizes)
        return _join_parts(o, lse, plan.key_parts, p.sq)
    spec = plan.spec(plan.forward_blocks, plan.num_warps[0])
    bmap = _map(plan, plan.forward_blocks, operands)
    sq, skv = _padded(p.sq, bq), _padded(p.skv, bk)
    o, lse = kernels.forward(spec, bmap, _pad(q, 1, sq), _pad(k, 1, skv), _pad(v, 1, skv),
                             _kernel_operands(plan, operands, mosaic_kernels=False))
    return o[:, :p.sq], lse[:, :, :p.sq]


def _uniform_full(spec, full):
    """``spec`` for a map known when tracing whose tiles are all full (or none): one
    mod on every tile, the full tiles' (or the whole), with no per-tile flags and no
    branch (a decode step's window: the kernels then pass no flags). A backward that
    learns keeps the whole mod on full tiles: its sums are laid out by ``spec.expr``'s
    reads."""
    if spec.full_expr is None or isinstance(full, jax.core.Tracer):
        return spec
    full = np.asarray(full)
    if full.size == 0 or not (full.all() or not full.any()):
        return spec
    if full.all() and getattr(spec, "learned", ()):
        return spec
    return dataclasses.replace(spec, expr=spec.full_expr if full.all() else spec.expr,
                               full_expr=None)


def _join_parts(o, lse, parts, sq):
    """O [B, sq, Hq, Dv] and LSE [B, Hq, sq] of the Mosaic forward's key parts (O
    [B, parts * padded Sq, ..], LSE [B, Hq, parts * padded Sq]: ``mosaic.forward``),
    by their LSEs, the padded rows dropped first (a decode step's 4 live rows of 128
    are all the join reads)."""
    if parts == 1:
        return o[:, :sq], lse[:, :, :sq]
    b, rows, hq, dv = o.shape
    padded = rows // parts
    lse = lse.reshape(b, hq, parts, padded)[..., :sq].transpose(0, 2, 3, 1)  # as O's rows
    o, lse = decode.join_by_lse(o.reshape(b, parts, padded, hq, dv)[:, :, :sq], lse)
    return o, lse.transpose(0, 2, 1)


def _names(plan):
    return plan.mod.operand_names if plan.mod is not None else ()


def _windows(plan, wanted) -> tuple:
    """``(name, axes, elements)`` per float operand whose gradient is computed:
    the axes one program's partial row covers (those not read at the
    program's own batch or head) and their element count."""
    out = []
    for name, node in zip(_names(plan), plan.mod.operand_nodes if plan.mod else ()):
        if name not in wanted or node.dtype != ir.F32:
            continue
        axes = _window_axes(plan.expr, name, node)
        out.append((name, axes, math.prod(node.attr[1][a] for a in axes)))
    return tuple(out)


def _window_axes(expr, name, node):
    """The axes of operand ``name`` (its node) that one program's partial row of its
    gradient covers: those its reads do not index by the program's b or h."""
    fixed = codegen.program_axes(expr, name)
    return tuple(a for a in range(len(node.attr[1])) if a not in fixed)


def _refuse_too_large(plan, windows, unbounded):
    """A partial row past ``MAX_GRADIENT_ELEMENTS`` is refused, except for the
    operands in ``unbounded`` (the per-block-diagonal kernel's: O(Sq + Skv) per head)."""
    for name, _, size in windows:
        if size > MAX_GRADIENT_ELEMENTS and name not in unbounded:
            shape = plan.mod.operand_nodes[_names(plan).index(name)].attr[1]
            raise ScoreModError(_too_large_to_learn(plan.mod, name, shape, size))


def _too_large_to_learn(mod, name, shape, size) -> str:
    """The refusal of a learned array whose part one program sums into is too large:
    the read and the user's line, the sizes, and the ways to run the call."""
    reads = codegen.reads_of(mod.expr, name)
    read = reads[0] if reads else None
    where = ir.source_of(read, mod.expr, mod.sources) if read is not None else None
    what = f"`{format_expr(read)}`" if read is not None else name
    relative = read is not None and mosaic.read_axis(read) == mosaic.OFFSET
    return (
        f"implementation=\"pallas\" cannot compute the gradient of the captured array "
        f"{list(shape)} read in {what}{' at ' + where if where else ''}: its backward sums "
        f"each kernel program's share of the gradient (the axes not indexed by b or h) in "
        f"a row of at most {MAX_GRADIENT_ELEMENTS} elements, and this read's share has "
        f"{size}"
        + (" (a table read at q_idx - kv_idx needs Sq + Skv - 1 entries per head: up to "
           "seq 32768 on the Triton backward; the Mosaic GPU backward, on Hopper, learns a "
           "table read at q_idx - kv_idx with an index of the positions alone at any length)"
           if relative else "")
        + ". Keep it fixed (jax.lax.stop_gradient), learn a smaller array (a bucketed "
        "relative table, as T5's), or use implementation=\"xla\" (O(S^2) memory).")


def _operand_gradient(part, node, expr, b, hq):
    """The gradient of operand ``node`` from its partial rows [B, Hq, key blocks,
    window]: summed over key blocks, then each (batch, head)'s row placed at the
    position it read along the axes it fixes (a one-hot contraction: no scatter,
    so the sum is the same on every run)."""
    name, shape, _ = node.attr
    fixed = codegen.program_axes(expr, name)
    window = [shape[a] for a in range(len(shape)) if a not in fixed]
    rows = part.sum(2).reshape((b, hq) + tuple(window))
    letters = "ijklmnopqrstuvwxyz"
    out = "".join(letters[a] for a in range(len(shape)))
    terms, arrays = ["bh" + "".join(letters[a] for a in range(len(shape)) if a not in fixed)], [rows]
    for a, var in fixed.items():
        extent = b if var == "b" else hq
        at = jnp.minimum(jnp.arange(extent), shape[a] - 1)  # reads clamp
        arrays.append((at[:, None] == jnp.arange(shape[a])[None, :]).astype(jnp.float32))
        terms.append(var + letters[a])
    return jnp.einsum(",".join(terms) + "->" + out, *arrays,
                      precision=jax.lax.Precision.HIGHEST)


def _diagonal_parts(plan, spec, sums, windows, nq, nk) -> dict:
    """The partial rows [B, Hq, 1, window] of each operand read at q_idx - kv_idx
    (``windows``: (name, axes, size)) from ``diagonal_sums``' sums (over ``nq`` x
    ``nk`` tiles): the sum along each real diagonal placed at the
    position its read takes there, the read's index evaluated when tracing
    (it reads no captured array: ``diagonal_refusal``); each position sums its
    diagonals in a fixed order (a gather and a sum: the same bits on every run)."""
    p = plan.problem
    blk = mosaic_backward.BLOCK
    per_diagonal = mosaic_backward.diagonal_gradient(sums, nq, nk)  # [B, Hq, reads, P]
    first = nk * blk - 1  # the padded matrix's diagonal 0 (q_idx == kv_idx)
    d = np.arange(-(p.skv - 1), p.sq)  # the real diagonals q_idx - kv_idx
    values = per_diagonal[..., first + d]
    loads = mosaic_backward.learned_loads(spec.expr, spec.learned)
    parts = {}
    for name, axes, size in windows:
        part = jnp.zeros((p.b, p.hq, 1, size), jnp.float32)
        for r, node in enumerate(loads):
            if node.args[0].attr[0] != name:
                continue
            at = _static_positions(patterns.difference_form(node), axes, d, p.b, p.hq)
            part = part + _place(values[:, :, r], _members(at, size, len(d)))
        parts[name] = part
    return parts


def _place(values, members):
    """[B, Hq, 1, size]: per position, the sum of ``values`` [B, Hq, n] at its
    ``members`` ([Bx, Hx, size, m] indices into the last axis, ascending, padded
    with n): a gather and a sum in a fixed order, the same bits on every run."""
    b, hq, _ = values.shape
    padded = jnp.pad(values, [(0, 0), (0, 0), (0, 1)])  # index n reads a zero
    rows = jnp.broadcast_to(members, (b, hq) + members.shape[2:])
    gathered = jnp.take_along_axis(padded[:, :, None, :], rows.reshape(b, hq, 1, -1), -1)
    return gathered.reshape(rows.shape).sum(-1)[:, :, None, :]


def _operands_read(plan, *kinds) -> tuple:
    """The float operands with a read of one of ``kinds`` (``mosaic_backward``'s
    predicates: ``along_keys``, ...), in order."""
    if plan.mod is None:
        return ()
    return tuple(dict.fromkeys(
        n.args[0].attr[0] for n in mosaic_backward.learned_loads(
            plan.expr, plan.mod.operand_names) if any(kind(n) for kind in kinds)))


def _along_axes(plan) -> tuple:
    """The learned operands with a read along the keys or the queries, at whole
    blocks, or per score: placed per position, not summed in a program's row."""
    return _operands_read(plan, mosaic_backward.along_keys, mosaic_backward.along_queries,
                          mosaic_backward.along_blocks, mosaic_backward.along_dense)


def _dense_gradients(plan, spec, sums, q_map, operands) -> dict:
    """{name: gradient} of the operands read per score (``along_dense``) from the dQ
    kernel's cotangents ``sums`` [B, Hq, reads, padded Sq, padded Skv]
    (``dense_loads`` order): the tiles the map did not visit zeroed (the kernel
    leaves them unwritten), the padding dropped, and each cotangent added into the
    entry its read takes there. Where q_idx or kv_idx indexes an axis by itself, each
    row of scores along it (by batch, head and query; by key where only the queries
    do) is added into the row of the array its other indices read, known when
    tracing (a gather and a sum in a fixed order); else (gathers, reads whose index
    reads captured arrays) each score's position is evaluated at run time and the
    cotangents are summed by position (``_sum_by_position``). The same bits on every
    run. Entries past the sequences read by a position stay zero (``attention``
    refuses an axis indexed by a position that is shorter than its range, and the
    tracer reads a one-entry axis at 0)."""
    p = plan.problem
    b, hq, _, sq, skv = sums.shape
    tile_q, blk = mosaic_backward.DQ_BLOCKS
    visited = _listed(q_map.q_counts, q_map.q_blocks, skv // blk)
    visited = jnp.repeat(jnp.repeat(visited, tile_q, 2), blk, 3)[:, :, None, :sq, :skv]
    sums = jnp.where(visited, sums, 0.0)[..., :p.sq, :p.skv]
    refs = dict(zip(_names(plan), operands))
    out = {}
    for r, read in enumerate(mosaic_backward.dense_loads(spec.expr, spec.learned)):
        name, shape, _ = read.args[0].attr
        x = sums[:, :, r]
        along = None if mosaic_backward.reads_arrays(read) else next(
            (a for a in ("kv_idx", "q_idx") if mosaic.bare_axis(read, a) is not None), None)
        if along is None:
            # The batch (heads) summed first where the index does not read b (h): a
            # table shared by the batch sorts a B-th of the cotangents.
            at = _run_positions(read, None, p.sq, p.b, p.hq, refs, keys=p.skv)
            x = x.sum(tuple(a for a in (0, 1) if at.shape[a] == 1), keepdims=True)
            total = _sum_by_position(x.reshape(-1), at.reshape(-1), math.prod(shape))
            total = total.reshape(shape)
        else:
            # Rows of scores along the axis a position indexes by itself (the keys',
            # else the queries'), each placed by the other indices.
            axis, d, ks = mosaic.bare_axis(read, along), range(p.sq), (0,)
            if along == "q_idx":
                x, d, ks = jnp.swapaxes(x, 2, 3), (0,), range(p.skv)
            rest = [i for i in range(len(shape)) if i != axis]
            n = x.shape[2]
            at = _static_positions(read, rest, d, p.b, p.hq, ks=ks)  # [Bx, Hx, n]
            at = np.broadcast_to(at, (p.b, p.hq, n)).reshape(1, 1, -1)
            members = _members(at, math.prod(shape[i] for i in rest), p.b * p.hq * n,
                               f"`{format_expr(read)}`", "rows of scores")
            rows = _pad(x, 3, shape[axis]).reshape(-1, shape[axis])
            rows = jnp.concatenate([rows, jnp.zeros((1, shape[axis]), rows.dtype)])
            total = rows[members[0, 0]].sum(1).reshape(*(shape[i] for i in rest), shape[axis])
            total = jnp.moveaxis(total, -1, axis)
        out[name] = total if name not in out else out[name] + total
    return out


def _sum_by_position(values, at, size):
    """float32 [size]: per position, the sum of ``values`` [n] over the entries whose
    ``at`` [n] (int32 in [0, size)) is that position. No scatter-add (atomics on a
    GPU): a stable sort by position, a segmented sum in a fixed tree order
    (``associative_scan``), and each position's total read at the end of its run:
    the same bits on every run."""
    at, values = jax.lax.sort((at, values), num_keys=1, is_stable=True)

    def add_within_runs(a, b):  # a precedes b; a run is one position's entries
        (pa, xa), (pb, xb) = a, b
        return pb, jnp.where(pa == pb, xa + xb, xb)

    _, totals = jax.lax.associative_scan(add_within_runs, (at, values))
    positions = jnp.arange(size, dtype=at.dtype)
    start = jnp.searchsorted(at, positions, side="left")
    end = jnp.searchsorted(at, positions, side="right")
    return jnp.where(end > start, totals[jnp.maximum(end - 1, 0)], 0.0)


def _listed(counts, blocks, n):
    """bool [Bm, Hm, rows, n]: whether each program (row) of a kernel's map lists each
    of the ``n`` blocks it may visit (``counts`` [Bm, Hm, rows], ``blocks`` [Bm, Hm,
    rows, L]: a map's lists; a max over a scatter of flags: the same on every run)."""
    bm, hm, rows = counts.shape
    valid = jnp.arange(blocks.shape[-1]) < counts[..., None]
    idx = (jnp.arange(bm)[:, None, None, None], jnp.arange(hm)[None, :, None, None],
           jnp.arange(rows)[None, None, :, None], blocks)
    return jnp.zeros((bm, hm, rows, n), bool).at[idx].max(valid)


def _block_parts(plan, spec, steps, kv_map, windows) -> dict:
    """The partial rows [B, Hq, 1, window] of the reads at whole blocks
    (``mosaic_backward.block_loads``) of each learned operand (``windows``), from
    the dK/dV kernel's per-step sums ``steps`` [B, Hq, reads, Sq / BLOCK, rows, Skv]
    (``mosaic_backward.dkdv``): the steps the map did not run dropped, each block's
    keys summed, and each (step's block row, key block)'s total placed at the
    position its read takes there (the index evaluated when tracing; a gather and a
    sum in a fixed order)."""
    p = plan.problem
    blk = mosaic_backward.BLOCK
    b, hq, _, _, _, skv = steps.shape
    nq = kv_map.block_counts[0]  # the map's query blocks (the arrays may be padded further)
    # [Bm, Hm, nq, key tiles]: whether each key tile's program runs each query block
    visited = jnp.swapaxes(_listed(kv_map.kv_counts, kv_map.kv_blocks, nq), -1, -2)
    visited = jnp.repeat(visited, skv // visited.shape[-1], axis=-1)[:, :, None, :, None]
    steps = jnp.where(visited, steps[:, :, :, :nq], 0.0)
    loads = mosaic_backward.block_loads(spec.expr, spec.learned)
    parts = {}
    for name, axes, size in windows:
        part = None
        for r, node in enumerate(loads):
            if node.args[0].attr[0] != name:
                continue
            t, u = (mosaic.block_sizes(node)[a] for a in ("q_idx", "kv_idx"))
            rows = mosaic_backward.step_blocks(node)
            n_q, n_k = -(-p.sq // blk), -(-p.skv // u)
            x = jnp.pad(steps[:, :, r, :n_q, :rows, :p.skv],
                        [(0, 0)] * 4 + [(0, n_k * u - p.skv)])
            totals = x.reshape(b, hq, n_q, rows, n_k, u).sum(-1).reshape(b, hq, -1)
            # step i's row a: the block row from query (i * BLOCK // t + a) * t, by key block
            qs = ((np.arange(n_q)[:, None] * blk // t + np.arange(rows)[None, :]) * t).ravel()
            at = _static_positions(node, axes, qs, p.b, p.hq, ks=np.arange(n_k) * u)
            members = _members(at, size, n_q * rows * n_k, f"`{format_expr(node)}`", "blocks")
            total = _place(totals, members)
            part = total if part is None else part + total
        if part is not None:
            parts[name] = part
    return parts


def _position_parts(plan, loads, sums, windows, operands) -> dict:
    """The partial rows [B, Hq, 1, window] of the reads along the keys or the queries
    among ``loads`` (a kernel's learned reads, in the order of its ``sums`` [B, Hq,
    reads, positions]: the cotangents of each read summed per key, or per query)
    of each learned operand (``windows``: (name, axes, size)): each real key's (or
    query's) sum placed at the position its read takes there, the read's index
    evaluated when tracing (each position sums its keys in a fixed order: a gather
    and a sum), or where it reads captured arrays (``operands``: the kernels'
    flat arrays), at run time (a one-hot product); the same bits on every run."""
    p = plan.problem
    refs = dict(zip(_names(plan), operands))
    parts = {}
    for name, axes, size in windows:
        part = None
        for r, node in enumerate(loads):
            keys = mosaic_backward.along_keys(node)
            if node.args[0].attr[0] != name or not (keys or mosaic_backward.along_queries(node)):
                continue
            where = np.arange(p.skv if keys else p.sq)
            if mosaic_backward.reads_arrays(node):
                at = _run_positions(mosaic.vector_source(node), axes, len(where), p.b, p.hq,
                                    refs)
                total = _place_by_value(sums[:, :, r, :len(where)], at, size)
            else:
                at = _static_positions(mosaic.vector_source(node), axes, where, p.b, p.hq)
                members = _members(at, size, len(where), f"`{format_expr(node)}`",
                                   "keys" if keys else "queries")
                total = _place(sums[:, :, r, :len(where)], members)
            part = total if part is None else part + total
        if part is not None:
            parts[name] = part
    return parts


def _static_positions(read, axes, d, b, hq, ks=(0,)):
    """int [Bx, Hx, len(d) * len(ks)]: the flat position along ``axes`` that ``read``
    (a function of b, h and q_idx standing for q_idx - kv_idx, or for kv_idx; or of
    both q_idx and kv_idx, at the keys ``ks``) takes at each diagonal (or key, or
    query) ``d``, ``d`` major, clamped as reads clamp; Bx, Hx 1 where it does not
    read b, h."""
    used = ir.variables(read)
    grid = {"q_idx": np.asarray(d, np.int32)[None, None, :, None],
            "kv_idx": np.asarray(ks, np.int32)[None, None, None, :],
            "b": np.arange(b if "b" in used else 1, dtype=np.int32)[:, None, None, None],
            "h": np.arange(hq if "h" in used else 1, dtype=np.int32)[None, :, None, None]}
    with jax.ensure_compile_time_eval():
        index = codegen.evaluate_tile(list(read.args[1:]), grid, {})
        flat = codegen.flat_index(read, index, axes)
        shape = (grid["b"].shape[0], grid["h"].shape[1], len(d), len(ks))
        return np.broadcast_to(np.asarray(flat), shape).reshape(shape[0], shape[1], -1)


def _run_positions(read, axes, n, b, hq, refs, keys=None):
    """int32 [Bx, Hx, n]: the flat position along ``axes`` (None: all) that ``read``
    (a function of b, h and q_idx standing for the axis it is read along, whose
    index reads captured arrays: ``refs``, their flat values) takes at each position
    ``0..n-1``; with ``keys``, [Bx, Hx, n, keys] at each query ``0..n-1`` and key
    ``0..keys-1`` (a read per score). Clamped as reads clamp; Bx, Hx 1 where it
    does not read b, h."""
    used = ir.variables(read)
    bx, hx = (b if "b" in used else 1), (hq if "h" in used else 1)
    tail = (n,) if keys is None else (n, keys)
    ones = (1,) * len(tail)
    grid = {"q_idx": jnp.arange(n, dtype=jnp.int32).reshape((1, 1, n) + ones[1:]),
            "b": jnp.arange(bx, dtype=jnp.int32).reshape((bx, 1) + ones),
            "h": jnp.arange(hx, dtype=jnp.int32).reshape((1, hx) + ones)}
    if keys is not None:
        grid["kv_idx"] = jnp.arange(keys, dtype=jnp.int32).reshape(1, 1, 1, keys)
    index = codegen.evaluate_tile(list(read.args[1:]), grid, refs)
    return jnp.broadcast_to(codegen.flat_index(read, index, axes), (bx, hx) + tail)


def _place_by_value(values, at, size):
    """[B, Hq, 1, size]: per position, the sum of ``values`` [B, Hq, n] over the
    entries whose ``at`` ([Bx, Hx, n], known at run time) is that position: a
    product with the one-hot of ``at`` (a matmul: the same bits on every run)."""
    b, hq, n = values.shape  # b * hq * n * size <= _MAX_MEMBERS: the plan's _one_hot_refusal
    hot = (jnp.broadcast_to(at, (b, hq, n))[..., None] == jnp.arange(size)).astype(jnp.float32)
    return jnp.einsum("bhn,bhns->bhs", values, hot,
                      precision=jax.lax.Precision.HIGHEST)[:, :, None, :]


_MAX_MEMBERS = 1 << 26


def _members(at, size, none, what="a table read at q_idx - kv_idx", by="diagonals"):
    """int [Bx, Hx, size, m]: per position, the diagonals (or keys: indices into
    ``at``'s last axis) that land there in ascending order, padded with ``none``."""
    m = max(1, max(int(np.bincount(row, minlength=size).max()) for row in at.reshape(
        -1, at.shape[-1])))
    if at.shape[0] * at.shape[1] * size * m > _MAX_MEMBERS:
        raise ScoreModError(
            f"implementation=\"pallas\" cannot place the gradient of {what}: up to {m} "
            f"{by} share one of its {size} entries (more than the backward gathers); use "
            "implementation=\"xla\", or keep the array fixed (jax.lax.stop_gradient)")
    out = np.full(at.shape[:2] + (size, m), none, np.int32)
    for bi in range(at.shape[0]):
        for hi in range(at.shape[1]):
            row = at[bi, hi]
            order = np.argsort(row, kind="stable")  # ascending diagonals within a position
            landed = row[order]
            rank = np.arange(len(row)) - np.searchsorted(landed, landed)
            out[bi, hi, landed, rank] = order
    return out


def _refuse_without_triton(plan, learned_on_triton, on_triton):
    """The error for a backward that needs the Triton kernels where they cannot run
    it: this jax cannot compile them (support.pallas_triton_missing), or the mod
    has an op their lowering lacks (``plan.triton_refusal``); needed where the
    Mosaic GPU backward refused the mod, or the gradient of a captured array asked
    for (``learned_on_triton``: their names)."""
    gone = None if plan.interpret else support.pallas_triton_missing()
    if gone:
        gone = f"cannot compile: {gone}"
    elif plan.triton_refusal:
        gone = f"cannot run this mod: {plan.triton_refusal}"
    if gone is None or (plan.backward_engine == "mosaic" and not learned_on_triton):
        return
    first = learned_on_triton[0] if learned_on_triton else None
    why = (f"the gradient of `{first}` ({on_triton[first]})" if first
           else f"this mod ({plan.backward_note or 'the Triton engine runs it'})")
    raise ScoreModError(
        f"the Pallas kernels cannot compute this backward here: the Mosaic GPU backward "
        f"does not take {why}, and the Triton backward {gone}. "
        "implementation=\"xla\" computes it (O(S^2) memory); jax.lax.stop_gradient on a "
        "captured array keeps it fixed.")


def _backward(plan, q, k, v, o, lse, do, dlse, operands, wanted):
    """dQ, dK, dV and {operand name: gradient} (those in ``wanted`` that are float)."""
    p = plan.problem
    bq, bk = plan.backward_blocks
    spec = plan.spec(plan.backward_blocks, plan.num_warps[1])
    sq, skv = _padded(p.sq, bq), _padded(p.skv, bk)
    f32 = jnp.float32
    # D = rowsum(dO * O) - dLSE: LSE's gradient dLSE * P joins dS = P * (dP - D).
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(f32), o.astype(f32)) - dlse.astype(f32)
    delta = jnp.where(jnp.isfinite(lse), delta, 0.0)
    lse_p = _pad(lse, 2, sq)
    if sq != p.sq:  # padded rows: LSE -inf, P = 0
        lse_p = lse_p.at[:, :, p.sq:].set(-jnp.inf)
    qp, kp, vp = _pad(q, 1, sq), _pad(k, 1, skv), _pad(v, 1, skv)
    dop, deltap = _pad(do, 1, sq), _pad(delta, 2, sq)
    windows = _windows(plan, wanted)
    on_triton = dict(plan.triton_operands)
    learned_on_triton = [w[0] for w in windows if w[0] in on_triton]
    mosaic = plan.backward_engine == "mosaic" and not learned_on_triton
    kops = _kernel_operands(plan, operands, mosaic_kernels=mosaic)
    along_axes = _along_axes(plan) if mosaic else ()
    _refuse_too_large(plan, windows, plan.diagonal_operands + along_axes if mosaic else ())
    _refuse_without_triton(plan, learned_on_triton, on_triton)
    dense = {}  # operand name: its gradient, from reads per score
    if mosaic:
        # P = exp2(s * log2(e) - LSE * log2(e)); +inf on rows that see no key makes P 0.
        lse2 = jnp.where(lse_p == -jnp.inf, jnp.inf, lse_p * jnp.float32(mosaic_backward.LOG2E))
        diagonal = tuple(w for w in windows if w[0] in plan.diagonal_operands)
        # Read per score (only so: ``learning_refusal``): whole from the dQ kernel's tiles.
        per_score = tuple(w for w in windows
                          if w[0] in _operands_read(plan, mosaic_backward.along_dense))
        per_key = tuple(w for w in windows if w not in diagonal and w not in per_score)
        mspec = plan.mosaic_backward_spec(learned=(w[0] for w in per_key + per_score))
        # Each kernel's own map: a program's rows by a streamed tile. dQ in the dK/dV
        # kernel where the plan says, unless the dQ kernel's sums are wanted.
        fused = plan.fused_dq and not (mosaic_backward.query_loads(mspec.expr, mspec.learned)
                                       or per_score)
        query_sums = dense_sums = None
        if not fused:
            q_map = _map(plan, mosaic_backward.DQ_BLOCKS, operands)
            dq, query_sums, dense_sums = mosaic_backward.dq(
                _uniform_full(mspec, q_map.q_full), q_map, qp, kp, vp, dop, lse2, deltap, kops)
        kv_map = _map(plan, mosaic_backward.DKDV_BLOCKS, operands)
        dk, dv, sums, fused_dq, step_sums = mosaic_backward.dkdv(
            _uniform_full(mspec, kv_map.kv_full), kv_map, qp, kp, vp, dop, lse2, deltap, kops,
            with_dq=fused)
        if fused:
            dq = fused_dq.astype(q.dtype)
        parts = {} if sums is None else mosaic_backward.operand_parts(mspec, sums, kops, per_key)
        # Reads along the keys (the dK/dV kernel's sums) and the queries (the dQ kernel's).
        for along, found in ((mosaic_backward.key_loads, sums),
                             (mosaic_backward.query_loads, query_sums)):
            if found is None:
                continue
            loads = along(mspec.expr, mspec.learned)
            for name, part in _position_parts(plan, loads, found, per_key, kops).items():
                parts[name] = (parts[name].sum(2, keepdims=True) + part if name in parts
                               else part)
        if step_sums is not None:  # reads at whole blocks: the dK/dV kernel's steps
            for name, part in _block_parts(plan, mspec, step_sums, kv_map, per_key).items():
                parts[name] = (parts[name].sum(2, keepdims=True) + part if name in parts
                               else part)
        if dense_sums is not None:  # reads per score: the dQ kernel's tiles
            dense = _dense_gradients(plan, mspec, dense_sums, q_map, kops)
        if diagonal:
            dspec = plan.mosaic_backward_spec(learned=(w[0] for w in diagonal))
            dmap = _map(plan, mosaic_backward.DIAGONAL_BLOCKS, operands)
            sums = mosaic_backward.diagonal_sums(dspec, dmap, qp, kp, vp, dop, lse2, deltap, kops)
            parts.update(_diagonal_parts(plan, dspec, sums, diagonal, *dmap.block_counts))
    else:  # the Triton backward: it learns any captured float array (``windows``)
        bmap = _map(plan, plan.backward_blocks, operands)
        dq = kernels.dq(spec, bmap, qp, kp, vp, dop, lse_p, deltap, kops)
        dk, dv, parts = kernels.dkdv(spec, bmap, qp, kp, vp, dop, lse_p, deltap, kops, windows)
    g = p.hq // p.hkv

    def per_kv_head(x, like):  # sum the query heads of each group, in float32
        b, s, _, d = x.shape
        return x.reshape(b, s, p.hkv, g, d).sum(3)[:, :p.skv].astype(like.dtype)

    grads = {}
    for name, node, x in zip(_names(plan), plan.mod.operand_nodes if plan.mod else (), operands):
        if name in parts:
            grads[name] = _operand_gradient(parts[name], node, plan.expr, p.b,
                                            p.hq).astype(x.dtype)
        elif name in dense:
            grads[name] = dense[name].astype(x.dtype)
    return dq[:, :p.sq], per_kv_head(dk, k), per_kv_head(dv, v), grads
