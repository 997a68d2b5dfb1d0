"""A paged KV cache read through its page table by the kernel that runs the call.

``scoremod.attention(..., page_table=)`` takes K and V as a cache of pages
[num_pages, page_size, Hkv, D]. Gathering the pages into rows first costs a
copy of every row's cache (read and written once more than the attention
reads it: a decode step, which only reads, runs at a third of the bandwidth).
Where the routed backend's forward fetches each key tile from its pages
itself (``Backend.fetches_pages``: the Pallas kernels' Mosaic GPU engine),
:func:`execute` runs it on the pages, the short-query fold packing the query
heads as for any call. Its gradients (a decode step is rarely differentiated)
are those of the same call on the gathered rows, through the one pipeline,
and reach the pages by the gather's transpose; under ``jax.vmap`` the gathered
call runs (its pipeline folds the mapped axes into the batch). Elsewhere the
pages are gathered (``positions.gather_pages``) and the call runs as any other.
"""

from __future__ import annotations

import functools

import jax
import jax.custom_batching  # noqa: F401 - jax.custom_batching.custom_vmap
from jax.interpreters import ad

from scoremod import positions
from scoremod.lowering import decode
from scoremod.lowering import sinks as attention_sinks
from scoremod.lowering.backend import execute as execute_rows


def fetched(route, page_size: int, arrays) -> bool:
    """Whether ``route``'s call reads the pages itself: its backend fetches pages of
    ``page_size`` for its plan, no low-rank bias is appended to K (per key row),
    V is not checked for non-finite values (a second forward), a short-query fold
    only packs heads (no key chunks: those cut rows, not pages), and ``arrays``
    carry no forward-mode or vmap tracer (the gathered call has those rules)."""
    call = route.call
    if route.low_rank is not None or call.options.check_values or call.backend.differentiable:
        return False
    if not call.backend.fetches_pages(call.plan, page_size):
        return False
    folded = decode.choose(call)
    if folded is not None and folded[0].splits > 1:
        return False
    return not any(isinstance(x, ad.JVPTracer) for x in jax.tree.leaves(arrays))


def note(route, page_size: int, arrays) -> str:
    """How ``route``'s call reads a paged cache of ``page_size`` keys a page, in words."""
    title = route.call.backend.title
    if fetched(route, page_size, arrays):
        return f"{title} fetches each key tile from its pages through the page table"
    return (f"the pages are gathered into rows first: this call's route ({title}) does not "
            f"fetch pages of {page_size} keys itself")


def execute(call, q, key_pages, value_pages, table, operands, sinks=None):
    """``(O, LSE)`` of ``call`` (planned for the rows' shapes) on a paged cache, read
    by the backend's kernel through ``table`` (where ``fetched``); differentiable in
    q, the pages, the operands and the sinks as the gathered call is."""
    return _paged(call, q, key_pages, value_pages, table, tuple(operands), sinks)


def _forward(call, q, key_pages, value_pages, table, operands, sinks):
    """The kernel on the pages; under ``jax.vmap``, the gathered call (whose
    pipeline folds the mapped axes into the batch) vmapped instead."""
    def kernel(q, key_pages, value_pages, table, operands, sinks):
        def run(inner, q, k, v, ops):
            return inner.backend.paged_forward(inner.plan, q, k, v, table, ops)

        folded = decode.choose(call)
        if folded is not None:  # heads packed only (``fetched``): the pages pass as they are
            o, lse = decode.forward(call, folded, q, key_pages, value_pages, operands, run)
        else:
            o, lse = run(call, q, key_pages, value_pages, operands)
        return (o, lse) if sinks is None else attention_sinks.combine(o, lse, sinks)

    batched = jax.custom_batching.custom_vmap(kernel)

    @batched.def_vmap
    def _(axis_size, in_batched, *args):
        axes = tuple(jax.tree.map(lambda mapped: 0 if mapped else None, b) for b in in_batched)
        out = jax.vmap(functools.partial(_on_rows, call), in_axes=axes,
                       axis_size=axis_size)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return batched(q, key_pages, value_pages, table, operands, sinks)


def _on_rows(call, q, key_pages, value_pages, table, operands, sinks):
    k, v = positions.gather_pages(key_pages, value_pages, table)
    return execute_rows(call, q, k, v, operands, sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _paged(call, q, key_pages, value_pages, table, operands, sinks):
    return _forward(call, q, key_pages, value_pages, table, operands, sinks)


def _paged_fwd(call, q, key_pages, value_pages, table, operands, sinks):
    out = _forward(call, q, key_pages, value_pages, table, operands, sinks)
    return out, (q, key_pages, value_pages, table, operands, sinks)


def _paged_bwd(call, saved, cotangents):
    q, key_pages, value_pages, table, operands, sinks = saved

    def on_rows(q, key_pages, value_pages, operands, sinks):
        return _on_rows(call, q, key_pages, value_pages, table, operands, sinks)

    _, pull = jax.vjp(on_rows, q, key_pages, value_pages, operands, sinks)
    dq, dk, dv, doperands, dsinks = pull(cotangents)
    return dq, dk, dv, None, doperands, dsinks


_paged.defvjp(_paged_fwd, _paged_bwd)
