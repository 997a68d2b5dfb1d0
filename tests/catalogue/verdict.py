"""What planning the fused cuDNN path says about a mod, in one line.

Planning is pure Python (no GPU): the support check, then the plan of the
call (``lowering/cudnn/plan.py``) at a shape, with a fixed SM count so the
query-block split is the one an H200 (132 SMs) gets.

- ``refused: `op```: the support check names an op the fused path cannot run;
- ``native Band(...)``: a pure band mask, run as cuDNN's own diagonal mask;
- ``split into N query blocks``: a band-limited mod run as N fused calls that
  skip the masked tiles;
- ``materialized [dims]: why``: an input tensor computed by XLA over the
  index grid ahead of the kernel, with its dims (``B``, ``H``, ``Sq``,
  ``Skv`` where it spans that axis, else 1) and why: ``data mask`` (a
  condition on values read from arrays, which cuDNN cannot compare),
  ``computed index`` (an array read at a computed position),
  ``computed from arrays`` (a value derived from array reads), ``kv-only
  tensor`` (a [.., 1, Skv] read, laid out [.., Sq, Skv]);
- ``fused``: one fused kernel, reading captured arrays directly if any;
- ``block-sparse Pallas kernels, mask in the kernel``: a mask of captured
  arrays that the Pallas kernels claim from cuDNN (``claims``);
- ``block-sparse Pallas kernels, table per diagonal``: a table read at
  q_idx - kv_idx that cuDNN yields to the Pallas kernels' Mosaic GPU engine
  on an H200 (decided from the IR here: the engine's own refusals, not this
  machine's GPU or jax);
- ``block-sparse Pallas kernels, values from arrays in the kernel``: a float
  value cuDNN's plan would compute ahead from arrays read at both positions (an
  [.., Sq, Skv] tensor), which the Mosaic GPU engine evaluates per tile;
- ``block-sparse Pallas kernels, static block map``: a static mask whose
  block map keeps far fewer tiles than cuDNN's plan computes, claimed by the
  Mosaic GPU engine the same way;
- ``block-sparse Pallas kernels, static mask in the kernel``: a static mask
  through ops cuDNN's graphs lack (bit operations), which its plan would
  compute ahead as an [.., Sq, Skv] tensor, claimed by the Mosaic GPU engine
  where its tiles take no more modelled time than cuDNN's plan.
"""

from __future__ import annotations

import math
import re

import scoremod
from scoremod.dsl.ir import CONST, LOAD, MATERIALIZE, VAR
from scoremod.errors import UnsupportedOpError
from scoremod.lowering.cudnn import rules
from scoremod.lowering import patterns
from scoremod.lowering import lowrank, segments
from scoremod.lowering.cudnn.plan import Plan
from scoremod.lowering.pallas import mosaic, selects
from scoremod.lowering.cudnn.backend import CUDNN
from scoremod.lowering.pallas.backend import CLAIM_MARGIN, MOSAIC_TILE_COST, PALLAS
from scoremod.lowering.problem import Problem

H200_SMS = 132
AXIS_NAMES = ("B", "H", "Sq", "Skv")


def problem(shape, d=128, dtype="bfloat16") -> Problem:
    return Problem(shape.b, shape.sq, shape.skv, shape.h, shape.h, d, d, dtype)


def plan_of(mod, shape, d=128, sms=H200_SMS) -> Plan:
    return Plan(mod, problem(shape, d), 1.0 / math.sqrt(d), scoremod.LoweringOptions(sms=sms))


def materialized(plan: Plan):
    """``(dims, why)`` of every input tensor XLA computes ahead of the kernel."""
    out = []
    for part in plan.parts:
        for load in part.loads:
            if load.operand is not None:
                continue
            node = load.node
            if node.op == MATERIALIZE:
                why = "data mask" if node.args[0].op == "where" else "computed from arrays"
            elif node.op == LOAD and any(a.op not in (VAR, CONST) for a in node.args[1:]):
                why = "computed index"
            else:
                why = "kv-only tensor"
            out.append((load.spec.dims, why))
    return out


def spans_scores(dims) -> bool:
    """Whether a tensor has both the query and the key axis: [.., Sq, Skv] memory."""
    return dims[2] > 1 and dims[3] > 1


def _dims_text(dims):
    return "[" + ",".join(AXIS_NAMES[i] if n > 1 else "1" for i, n in enumerate(dims)) + "]"


def planned(mod, shape, d=128, sms=H200_SMS):
    """(notes, backend name, the cuDNN plan or None) of ``mod`` at ``shape`` as
    ``attention()`` runs it: a low-rank bias folded into the head dim first,
    then a segment mask on ``"cudnn-varlen"``, a mask of captured arrays on
    ``"pallas"``, else the fused cuDNN plan."""
    notes = []
    found = lowrank.find(mod, problem(shape, d), 1.0 / math.sqrt(d))
    if isinstance(found, lowrank.LowRank):
        notes.append(f"low-rank bias of rank {found.rank} in the head dim")
        d, mod = d + found.rank + found.pad, found.mod
    # A segment mask on the plain score runs as ragged sequences ("cudnn-varlen",
    # tried before "cudnn"); ids that are not runs take the dense route at run time.
    if isinstance(segments.recognize(mod.expr, problem(shape, d)), segments.Segments):
        return notes, "cudnn-varlen", None
    # Arrays read per score (Flax's bias or mask, a distance matrix): no claim from
    # cuDNN until measured (Pallas.claims).
    if mosaic.dense_reads(mod.expr):
        return notes, "cudnn", plan_of(mod, shape, d, sms)
    # A mask of captured arrays (packed documents) cuDNN yields to the Pallas kernels'
    # Mosaic GPU engine (the H200's jax deprecates their Triton engine: Pallas.claims).
    if (patterns.mask_from_data(mod.expr) is not None
            and PALLAS.why_not(problem(shape, d), mod, automatic=False) is None
            and mosaic.refusal(mod.expr, mod.sources) is None):
        return notes, "pallas", None
    # A relative-position table: to the Mosaic GPU engine, where it reads the mod.
    if mosaic.offset_reads(mod.expr) and mosaic.refusal(mod.expr, mod.sources) is None:
        return notes + ["table per diagonal"], "pallas", None
    # A float value cuDNN would compute ahead from arrays read at both positions (a
    # paged cache's logical positions, a bias between token kinds): to the Mosaic GPU
    # engine where it takes the mod (Pallas.claims' rule).
    if (CUDNN.data_tensor_ahead(problem(shape, d), mod, scoremod.LoweringOptions(sms=sms))
            is not None and PALLAS.why_not(problem(shape, d), mod, automatic=False) is None
            and mosaic.refusal(selects.spelled(mod.expr), mod.sources) is None):
        return notes + ["values from arrays in the kernel"], "pallas", None
    # A static mask whose block map keeps far fewer tiles than cuDNN's plan computes:
    # to the Mosaic GPU engine where it takes the mod (Pallas.claims' rule).
    options = scoremod.LoweringOptions(sms=sms)
    ours = PALLAS.tile_share(problem(shape, d), mod, options)
    theirs = CUDNN.tile_share(problem(shape, d), mod, options)
    if (ours * MOSAIC_TILE_COST <= CLAIM_MARGIN * theirs
            and mosaic.refusal(mod.expr, mod.sources) is None):
        return notes + ["static block map"], "pallas", None
    # A static mask cuDNN's graphs cannot compute (bit operations), which its plan
    # would compute ahead as an [.., Sq, Skv] tensor: to the Mosaic GPU engine where
    # its modelled time is no more than cuDNN's tiles' (the same claim).
    if (CUDNN.static_tensor_ahead(problem(shape, d), mod, options) is not None
            and ours * MOSAIC_TILE_COST <= theirs
            and mosaic.refusal(mod.expr, mod.sources) is None):
        return notes + ["static mask in the kernel"], "pallas", None
    return notes, "cudnn", plan_of(mod, shape, d, sms)


def verdict(mod, shape, d=128, sms=H200_SMS) -> str:
    """The one-line verdict of ``mod`` (a ScoreMod) at ``shape``."""
    try:
        rules.check_supported(mod.expr, mod.sources)
    except UnsupportedOpError as e:
        op = re.search(r"cannot run `(\w+)`", str(e))
        return f"refused: `{op.group(1) if op else '?'}`"
    said, backend, plan = planned(mod, shape, d, sms)
    if backend == "pallas":
        what = (said[-1] if said[-1:] in (["table per diagonal"], ["static block map"],
                                          ["static mask in the kernel"],
                                          ["values from arrays in the kernel"])
                else "mask in the kernel")
        return ", ".join([n for n in said if n != what] + [f"block-sparse Pallas kernels, {what}"])
    if plan is None:
        return ", ".join(said + ["ragged sequences (cudnn-varlen)"])
    band = plan.parts[0].band
    if band is not None:
        return ", ".join(said + [f"native {band}"])
    rest = []
    if plan.split:
        rest.append(f"split into {len(plan.blocks)} query blocks")
    tensors = sorted({f"{_dims_text(dims)}: {why}" for dims, why in materialized(plan)})
    if tensors:
        rest.append("materialized " + "; ".join(tensors))
    return ", ".join(said + (rest or ["fused"]))
