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
- ``fused``: one fused kernel, reading captured arrays directly if any.
"""

from __future__ import annotations

import math
import re

import scoremod
from scoremod.dsl.ir import CONST, LOAD, MATERIALIZE, VAR
from scoremod.errors import UnsupportedOpError
from scoremod.lowering.cudnn import rules
from scoremod.lowering.cudnn.plan import Plan
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


def verdict(mod, shape, d=128, sms=H200_SMS) -> str:
    """The one-line verdict of ``mod`` (a ScoreMod) at ``shape``."""
    try:
        rules.check_supported(mod.expr, mod.sources)
    except UnsupportedOpError as e:
        op = re.search(r"cannot run `(\w+)`", str(e))
        return f"refused: `{op.group(1) if op else '?'}`"
    plan = plan_of(mod, shape, d, sms)
    band = plan.parts[0].band
    if band is not None:
        return f"native {band}"
    said = []
    if plan.split:
        said.append(f"split into {len(plan.blocks)} query blocks")
    tensors = sorted({f"{_dims_text(dims)}: {why}" for dims, why in materialized(plan)})
    if tensors:
        said.append("materialized " + "; ".join(tensors))
    return ", ".join(said) or "fused"
