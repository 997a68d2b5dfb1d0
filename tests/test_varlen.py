"""Segment masks on cuDNN's variable-length attention, checked on a CPU.

- every spelling of a segment mask is recognized, and what is not one is
  refused with a reason;
- the runs, offsets and lengths XLA computes agree with a NumPy loop;
- the ragged graphs have the dims, strides, uids and ragged offsets they
  should (a recording stand-in for the cuDNN frontend);
- the whole backend (both routes of its run-time choice, forward and
  backward through the custom_vjp) against the reference path, with the
  ragged kernel replaced by an emulator that follows cuDNN's ragged
  semantics and leaves unwritten rows NaN (so a missing zero shows).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering import registry
from scoremod.lowering import segments as segs
from scoremod.lowering.cudnn.backend import CUDNN
from scoremod.lowering.cudnn_varlen import backend as vb
from scoremod.lowering.cudnn_varlen import graph as vg
from scoremod.lowering.cudnn_varlen import layout as lay
from scoremod.lowering.problem import Problem
from tests.test_graph_emission import recorder  # noqa: F401 (the recording cuDNN stand-in)

NEG = -jnp.inf
B, S = 2, 64
SEG = jnp.asarray(np.repeat(np.arange(4), 16)[None].repeat(B, 0), jnp.int32)
LEN = jnp.array([40, 64], jnp.int32)
P = Problem(B, S, S, 4, 4, 64, 64, "bfloat16")



def _rec(fn, problem=P, *arrays):
    return segs.recognize(scoremod.trace(fn).expr, problem)


SPELLINGS = {  # name: (mod, expected fields)
    "equality": (lambda s, b, h, q, k: jnp.where(SEG[b, q] == SEG[b, k], s, NEG), {}),
    "not_equal": (lambda s, b, h, q, k: jnp.where(SEG[b, q] != SEG[b, k], NEG, s), {}),
    "additive": (lambda s, b, h, q, k: s + jnp.where(SEG[b, q] == SEG[b, k], 0.0, NEG), {}),
    "additive_not_equal": (lambda s, b, h, q, k: s + jnp.where(SEG[b, k] != SEG[b, q], NEG, 0.0), {}),
    "flipped_sides": (lambda s, b, h, q, k: jnp.where(SEG[b, k] == SEG[b, q], s, NEG), {}),
    "causal": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (q >= k), s, NEG),
               {"causal": True}),
    "causal_nested": (lambda s, b, h, q, k: jnp.where(SEG[b, q] == SEG[b, k],
                                                      jnp.where(k <= q, s, NEG), NEG), {"causal": True}),
    "causal_not_or": (lambda s, b, h, q, k: jnp.where((SEG[b, q] != SEG[b, k]) | (k > q), NEG, s),
                      {"causal": True}),
    "window": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (q >= k) & (q - k < 8), s, NEG),
               {"causal": True, "window": 8}),
    "key_length": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (k < LEN[b]), s, NEG),
                   {"length": segs.Length("c1", None, True)}),
    "key_length_constant": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (k < 50), s, NEG),
                            {"length": segs.Length(None, 50)}),
    "pad_id_keys": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (SEG[b, k] != 3), s, NEG),
                    {"pad_kv": 3}),
    "pad_id_queries": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (SEG[b, q] != 0), s, NEG),
                       {"pad_q": 0}),
    "shared_row": (lambda s, b, h, q, k: jnp.where(SEG[0, q] == SEG[0, k], s, NEG), {}),
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_every_spelling_is_recognized(name):
    fn, fields = SPELLINGS[name]
    found = _rec(fn)
    assert isinstance(found, segs.Segments), found
    expected = dict(causal=False, window=None, length=None, pad_q=None, pad_kv=None,
                    self_attention=True)
    expected.update(fields)
    for field, value in expected.items():
        assert getattr(found, field) == value, (field, found)
    assert found.q_array == found.kv_array
    assert found.q_array.batched == (name != "shared_row")


def test_cross_attention_has_two_arrays_and_refuses_bands():
    kv = jnp.zeros((B, 32), jnp.int32)
    cross = Problem(B, S, 32, 4, 4, 64, 64, "bfloat16")
    found = _rec(lambda s, b, h, q, k: jnp.where(SEG[b, q] == kv[b, k], s, NEG), cross)
    assert isinstance(found, segs.Segments) and not found.self_attention
    assert found.q_array.operand != found.kv_array.operand
    why = _rec(lambda s, b, h, q, k: jnp.where((SEG[b, q] == kv[b, k]) & (q >= k), s, NEG), cross)
    assert isinstance(why, str) and "self-attention" in why


REFUSED = {
    "softcap": (lambda s, b, h, q, k: jnp.where(SEG[b, q] == SEG[b, k], 30 * jnp.tanh(s / 30), NEG),
                "not the plain score"),
    "no_segments": (lambda s, b, h, q, k: jnp.where(q >= k, s, NEG), "exactly one"),
    "no_mask": (lambda s, b, h, q, k: s * 2.0, "not a mask"),
    "future": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (q <= k), s, NEG),
               "only causal bands"),
    "strictly_causal": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (q > k), s, NEG),
                        "only causal bands"),
    "prefix_lm": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & ((q >= k) | (k < 4)), s, NEG),
                  "is not part of a segment mask"),
    "per_head": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (h == 0), s, NEG),
                 "is not part of a segment mask"),
    "float_ids": (lambda s, b, h, q, k: jnp.where(SEG.astype(jnp.float32)[b, q] == SEG.astype(jnp.float32)[b, k], s, NEG),
                  "segment mask"),
    "two_pad_ids": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (SEG[b, k] != 1) & (SEG[b, k] != 2), s, NEG),
                    "two pad ids"),
    "disjunction": (lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) | (q >= k), s, NEG),
                    "is not part of a segment mask"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_is_not_a_segment_mask_is_refused_with_a_reason(name):
    fn, words = REFUSED[name]
    why = _rec(fn)
    assert isinstance(why, str) and words in why, why


# --- runs and offsets against NumPy ------------------------------------------


def numpy_runs(row):
    out, start = [], 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[start]:
            out.append((start, i - start, row[start]))
            start = i
    return out


def random_ids(rng, b, s, docs, pad=None, shuffle=False):
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), size=docs - 1, replace=False)) if docs > 1 else []
        lens = np.diff(np.concatenate([[0], cuts, [s]]))
        ids = np.arange(len(lens)) * 3 + 1
        if shuffle:
            rng.shuffle(ids)
        if pad is not None:  # some documents are padding, and so is a tail
            ids[rng.random(len(ids)) < 0.3] = pad
        row = np.repeat(ids, lens)
        if pad is not None:
            row[s - int(rng.integers(0, s // 4)):] = pad
        rows.append(row)
    return np.stack(rows).astype(np.int32)


@pytest.mark.parametrize("seed", range(6))
def test_runs_match_numpy(seed):
    rng = np.random.default_rng(seed)
    ids = random_ids(rng, 3, 50, int(rng.integers(1, 9)), pad=-1 if seed % 2 else None)
    n = 12
    starts, lens, run_ids, count, rank = (np.asarray(x) for x in jax.jit(lay.runs, static_argnums=1)(jnp.asarray(ids), n))
    for r, row in enumerate(ids):
        expected = numpy_runs(list(row))
        assert count[r] == len(expected)
        for j, (st, ln, i) in enumerate(expected[:n]):
            assert (starts[r, j], lens[r, j], run_ids[r, j]) == (st, ln, i)
        assert (lens[r, len(expected):] == 0).all() and (starts[r, len(expected):] == 50).all()
        assert (rank[r] == np.repeat(np.arange(len(expected)), [e[1] for e in expected])).all()


def test_increasing_accepts_exactly_increasing_runs():
    check = lambda x, pads=(): bool(lay.increasing(jnp.asarray([x], jnp.int32), pads))  # noqa: E731
    assert check([1, 1, 2, 2, 2, 5])
    assert check([0, 0, 0, 0])
    assert not check([1, 1, 2, 1])  # an id reappears
    assert not check([2, 2, 1, 1])  # contiguous, but decreasing: the dense route
    assert check([1, 1, -1, 2, -1, -1, 3], (-1,))  # pads anywhere
    assert not check([1, 1, -1, 1], (-1,))  # a run split by a pad is two runs of one id
    assert not check([1, 1, -1, 1])  # without the pad id it is not increasing either


def numpy_ok(row, pads):
    """Every non-pad id one run, increasing along the row."""
    seen = [i for i, _, _ in [(r[2], 0, 0) for r in numpy_runs(list(row))] if i not in pads]
    return len(seen) == len(set(seen)) and seen == sorted(seen)


@pytest.mark.parametrize("seed", range(8))
def test_runs_are_documents_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    ids = random_ids(rng, 3, 30, int(rng.integers(1, 7)), pad=-1 if seed % 2 else None,
                     shuffle=True)
    if seed % 3 == 0:
        ids[1, -4:] = ids[1, 0]  # the first document again
    found = _rec(lambda s, b, h, q, k: jnp.where((SEG[b, q] == SEG[b, k]) & (SEG[b, k] != -1), s, NEG))
    pads = {-1} if seed % 2 else set()
    found = dataclasses.replace(found, pad_kv=-1 if pads else None)
    for n in (3, 8):
        got = bool(lay.runs_are_documents(found, {"c0": jnp.asarray(ids)}, 3, 30, n))
        want = all(len(numpy_runs(list(r))) <= n and _one_run_each(r, pads) for r in ids)
        assert got == want, (ids, n)


def _one_run_each(row, pads):
    seen = [r[2] for r in numpy_runs(list(row)) if r[2] not in pads]
    return len(seen) == len(set(seen))


def numpy_sequences(segments, ids_q, ids_kv, length, n):
    """(q_start, q_len, kv_start, kv_len) per row and slot, by a plain loop."""
    out = []
    for r in range(ids_q.shape[0]):
        qr, kr = numpy_runs(list(ids_q[r])), numpy_runs(list(ids_kv[r]))
        row = []
        for st, ln, i in qr[:n]:
            if segments.self_attention:
                ks, kl = st, ln
            else:
                hits = [(s2, l2) for s2, l2, i2 in kr if i2 == i and i2 != segments.pad_kv]
                ks, kl = hits[0] if hits else (0, 0)
            if i == segments.pad_kv:
                kl = 0
            if i == segments.pad_q:
                ln = 0
            if length is not None:
                kl = max(0, min(ks + kl, length[r]) - ks)
            if kl == 0:
                ln = 0
            if segments.window is not None:
                ln = min(ln, kl + segments.window - 1)
            row.append((st, ln, ks, kl if ln else 0))
        out.append(row)
    return out


LAYOUT_CASES = {
    "self": (lambda ids, kv, ln: lambda s, b, h, q, k: jnp.where(ids[b, q] == ids[b, k], s, NEG), False),
    "self_length_window": (lambda ids, kv, ln: lambda s, b, h, q, k: jnp.where(
        (ids[b, q] == ids[b, k]) & (q >= k) & (q - k < 5) & (k < ln[b]), s, NEG), False),
    "self_pad": (lambda ids, kv, ln: lambda s, b, h, q, k: jnp.where(
        (ids[b, q] == ids[b, k]) & (ids[b, k] != -1), s, NEG), False),
    "cross_length_pad": (lambda ids, kv, ln: lambda s, b, h, q, k: jnp.where(
        (ids[b, q] == kv[b, k]) & (k < ln[b]) & (kv[b, k] != -1), s, NEG), True),
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_sequences_match_numpy(case, seed):
    rng = np.random.default_rng(seed)
    make, cross = LAYOUT_CASES[case]
    sq, skv, n = 40, (24 if cross else 40), 8
    ids = random_ids(rng, 3, sq, int(rng.integers(1, 6)), pad=-1 if "pad" in case else None)
    kv = random_ids(rng, 3, skv, int(rng.integers(1, 6)), pad=-1 if "pad" in case else None)
    if cross:  # some query documents have keys, some do not
        kv = np.where(kv > 6, kv - 2, kv)
    ln = rng.integers(0, skv + 1, size=3).astype(np.int32)
    mod = scoremod.trace(make(jnp.asarray(ids), jnp.asarray(kv), jnp.asarray(ln)))
    found = segs.recognize(mod.expr, Problem(3, sq, skv, 2, 2, 64, 64, "float16"))
    assert isinstance(found, segs.Segments), found
    named = dict(zip(mod.operand_names, mod.operands))
    got = jax.jit(lambda: lay.compute(found, named, 3, sq, skv, n))()
    want = numpy_sequences(found, ids, kv, ln if found.length is not None else None, n)
    pads = {found.pad_q, found.pad_kv} - {None}
    ok = all(numpy_ok(row, pads) and len(numpy_runs(list(row))) <= n
             for rows in ((ids,) if found.self_attention else (ids, kv)) for row in rows)
    assert bool(got.ok) == ok
    for r in range(3):
        for j, (qs, ql, ks, kl) in enumerate(want[r] if ok else []):
            assert int(got.q_len[r, j]) == ql and int(got.kv_len[r, j]) == kl, (r, j, want[r])
            if ql:
                assert int(got.q_start[r, j]) == qs
            if kl:
                assert int(got.kv_start[r, j]) == ks
    offsets = lay.ragged(got, 3, sq, skv, 4, 2, 64, 32)
    q_tok = np.asarray(offsets.q) // (4 * 64)
    assert (np.diff(q_tok) >= 0).all() and q_tok[-1] == 3 * sq
    assert (np.asarray(offsets.o) == q_tok * 4 * 32).all() and (np.asarray(offsets.stats) == q_tok * 4).all()
    k_tok = np.asarray(offsets.k) // (2 * 64)
    assert (np.asarray(offsets.v) == k_tok * 2 * 32).all() and (np.diff(k_tok) >= 0).all()


def test_too_many_segments_or_reappearing_ids_are_not_ok():
    mod = SPELLINGS["equality"][0]
    found = _rec(mod)
    many = jnp.asarray(np.arange(S)[None].repeat(B, 0) // 4, jnp.int32)  # 16 runs per row
    assert not bool(lay.compute(found, {"c0": many}, B, S, S, 8).ok)
    assert bool(lay.compute(found, {"c0": many}, B, S, S, 16).ok)
    again = np.asarray(SEG).copy()
    again[1, 60:] = 0  # document 0 reappears at the end of row 1
    assert not bool(lay.compute(found, {"c0": jnp.asarray(again)}, B, S, S, 8).ok)


# --- the ragged graphs --------------------------------------------------------


@pytest.mark.parametrize("causal,window,deterministic",
                         [(False, None, False), (True, None, True), (True, 16, False)])
def test_ragged_graphs_have_the_layout_of_packed_tokens(recorder, causal, window, deterministic):
    shape = Problem(2, 96, 80, 8, 2, 64, 32, "bfloat16")
    spec = vg.RaggedSpec(shape, 2 * 5, 0.125, causal, window, deterministic)
    for direction, build in (("sdpa", vg.build_forward), ("sdpa_backward", vg.build_backward)):
        recorder.calls.clear()
        built = build(spec, lambda: "test")
        (call,) = [kw for n, kw in recorder.calls if n == direction]
        assert call["attn_scale"] == 0.125 and call["use_padding_mask"] is True
        assert ("diagonal_band_right_bound" in call) == causal
        assert call.get("diagonal_band_left_bound") == window
        assert call.get("diagonal_alignment") == ("TOP_LEFT" if causal else None)
        assert "score_mod" not in call
        seq_q, seq_kv = call["seq_len_q"].props, call["seq_len_kv"].props
        assert seq_q["uid"] == vg.UID_SEQ_Q and seq_q["dim"] == [10, 1, 1, 1]
        assert seq_kv["uid"] == vg.UID_SEQ_KV and seq_kv["data_type"] == "INT32"
        expect = {"q": (vg.UID_Q, [10, 8, 96, 64], [96 * 8 * 64, 64, 8 * 64, 1], vg.UID_RO_Q),
                  "k": (vg.UID_K, [10, 2, 80, 64], [80 * 2 * 64, 64, 2 * 64, 1], vg.UID_RO_K),
                  "v": (vg.UID_V, [10, 2, 80, 32], [80 * 2 * 32, 32, 2 * 32, 1], vg.UID_RO_V)}
        if direction == "sdpa_backward":
            expect.update({"o": (vg.UID_O, [10, 8, 96, 32], [96 * 8 * 32, 32, 8 * 32, 1], vg.UID_RO_O),
                           "dO": (vg.UID_DO, [10, 8, 96, 32], [96 * 8 * 32, 32, 8 * 32, 1], vg.UID_RO_O),
                           "stats": (vg.UID_STATS, [10, 8, 96, 1], [96 * 8, 1, 8, 1], vg.UID_RO_STATS)})
            assert call["max_total_seq_len_q"] == 2 * 96 and call["max_total_seq_len_kv"] == 2 * 80
            assert call["use_deterministic_algorithm"] is deterministic
        for name, (uid, dim, stride, ro) in expect.items():
            t = call[name].props
            assert (t["uid"], t["dim"], t["stride"]) == (uid, dim, stride), name
            offsets = t["ragged_offset"].props
            assert offsets["uid"] == ro and offsets["dim"] == [11, 1, 1, 1], name
        outs = [t for t in recorder.tensors if t.origin.startswith(direction + "_out")]
        if direction == "sdpa":
            o, stats = outs
            assert o.props["uid"] == vg.UID_O and o.props["ragged_offset"].props["uid"] == vg.UID_RO_O
            assert o.props["stride"] == [96 * 8 * 32, 32, 8 * 32, 1]
            assert stats.props["dim"] == [10, 8, 96, 1] and stats.props["stride"] == [96 * 8, 1, 8, 1]
            assert stats.props["ragged_offset"].props["uid"] == vg.UID_RO_STATS
            assert built.in_uids == (vg.UID_Q, vg.UID_K, vg.UID_V) + vg.RAGGED_UIDS
        else:
            for t, uid, ro, dim in zip(outs, (vg.UID_DQ, vg.UID_DK, vg.UID_DV),
                                       (vg.UID_RO_Q, vg.UID_RO_K, vg.UID_RO_V),
                                       ([10, 8, 96, 64], [10, 2, 80, 64], [10, 2, 80, 32])):
                assert t.props["uid"] == uid and t.props["dim"] == dim
                assert t.props["ragged_offset"].props["uid"] == ro
            assert built.out_uids == (vg.UID_DQ, vg.UID_DK, vg.UID_DV)
        assert built.scalar_uids == () and built.graph_id == scoremod.kernels_ffi.hash_graph(built.blob)


# --- the whole backend, with an emulated ragged kernel -----------------------


def emulate(spec, built, inputs, out_shapes, carried):
    """cuDNN's ragged SDPA as documented: sequence j reads tokens from its
    element offset on, seq_len rows; rows of no sequence are not written."""
    s = spec.shape
    named = dict(zip(built.in_uids, inputs))
    q_tok = named[vg.UID_RO_Q] // (s.hq * s.d)
    k_tok = named[vg.UID_RO_K] // (s.hkv * s.d)
    lq, lk = named[vg.UID_SEQ_Q], named[vg.UID_SEQ_KV]
    n = spec.sequences
    tq, tk = jnp.arange(s.b * s.sq), jnp.arange(s.b * s.skv)
    local_q = tq[None] - q_tok[:n, None]
    local_k = tk[None] - k_tok[:n, None]
    in_q = (local_q >= 0) & (local_q < lq[:, None])
    in_k = (local_k >= 0) & (local_k < lk[:, None])
    # No token may be in two sequences (the backward's writes would collide):
    # such a layout poisons every output.
    overlap = (jnp.max(jnp.sum(in_q, 0)) > 1) | (jnp.max(jnp.sum(in_k & (lq[:, None] > 0), 0)) > 1)
    see = in_q[:, :, None] & in_k[:, None, :]
    if spec.causal:
        see &= local_k[:, None, :] <= local_q[:, :, None]
        if spec.window is not None:
            see &= local_q[:, :, None] - local_k[:, None, :] < spec.window
    mask = jnp.any(see, 0)  # [Tq, Tk]
    covered_q = jnp.any(in_q, 0)
    covered_k = jnp.any(in_k & (lq[:, None] > 0), 0)
    g = s.hq // s.hkv

    def attend(q, k, v):
        q = q.reshape(-1, s.hq, s.d).astype(jnp.float32)
        k = jnp.repeat(k.reshape(-1, s.hkv, s.d).astype(jnp.float32), g, axis=1)
        v = jnp.repeat(v.reshape(-1, s.hkv, s.dv).astype(jnp.float32), g, axis=1)
        sc = jnp.einsum("qhd,khd->hqk", q, k) * spec.scale
        sc = jnp.where(mask[None], sc, -jnp.inf)
        m = jax.lax.stop_gradient(jnp.max(sc, -1, keepdims=True))
        m = jnp.where(jnp.isfinite(m), m, 0)
        p = jnp.exp(sc - m)
        den = jnp.sum(p, -1, keepdims=True)
        o = jnp.einsum("hqk,khd->qhd", p / jnp.where(den == 0, 1, den), v)
        return o, (jnp.log(den) + m)[..., 0].T

    def unwritten(x, written, rows):
        want = out_shapes[len(written)]
        fill = carried[len(written)] if carried else jnp.full(want.shape, jnp.nan, want.dtype)
        keep = rows.reshape((fill.shape[0], fill.shape[1]) + (1,) * (fill.ndim - 2))
        return jnp.where(overlap, jnp.nan, jnp.where(keep, x.astype(fill.dtype), fill))

    if built.out_uids == (vg.UID_O, vg.UID_STATS):
        o, lse = attend(named[vg.UID_Q], named[vg.UID_K], named[vg.UID_V])
        o = unwritten(o.reshape(out_shapes[0].shape), [], covered_q)
        stats = jnp.where(covered_q.reshape(s.b, s.sq)[..., None], lse.reshape(s.b, s.sq, s.hq), jnp.nan)
        return [o, stats]
    _, vjp = jax.vjp(lambda *a: attend(*a)[0], named[vg.UID_Q], named[vg.UID_K], named[vg.UID_V])
    do = named[vg.UID_DO].reshape(-1, s.hq, s.dv).astype(jnp.float32)
    dq, dk, dv = vjp(do)
    written = []
    for x, shape, rows in zip((dq, dk, dv), out_shapes, (covered_q, covered_k, covered_k)):
        written.append(unwritten(x.reshape(shape.shape), written, rows))
    return written


@pytest.fixture
def emulated(monkeypatch, recorder):
    """The backend runs here: the ragged kernel emulated, the dense route on the reference path."""
    routes = []
    monkeypatch.setattr(CUDNN, "why_not", lambda problem, mod, automatic, options=None: None)

    def call(built, inputs, out_shapes, carried):
        spec = next(key[1] for key, b in vb.cg.cache_entries().items() if b is built)
        jax.debug.callback(lambda: routes.append("varlen"))
        return emulate(spec, built, inputs, out_shapes, carried)

    def dense_forward(plan, q, k, v, operands):
        jax.debug.callback(lambda: routes.append("dense"))
        return _reference(plan.mod, operands, plan.scale)(q, k, v)

    def dense_backward(plan, q, k, v, o, lse, do, operands):
        _, vjp = jax.vjp(lambda *a: _reference(plan.mod, operands, plan.scale)(*a)[0], q, k, v)
        return vjp(do)

    monkeypatch.setattr(vb, "_call", call)
    monkeypatch.setattr(CUDNN, "forward", dense_forward)
    monkeypatch.setattr(CUDNN, "backward", dense_backward)
    vb.cg.cache_clear()
    yield routes
    vb.cg.cache_clear()


def _reference(mod, operands, scale):
    bound = scoremod.ScoreMod(mod.expr, tuple(operands))
    return lambda q, k, v: scoremod.attention(q, k, v, bound, scale=scale, implementation="xla",
                                              return_lse=True)


def _check(mod, q, k, v, routes, route):
    """The backend against the reference, with the ids closed over (route chosen
    when traced) and as arguments of a jitted function (chosen by lax.cond)."""
    out = {}
    for way in ("closed", "traced", "xla"):
        def f(q, k, v, ops, impl="xla" if way == "xla" else "cudnn-varlen"):
            m = scoremod.ScoreMod(mod.expr, ops) if way == "traced" else mod
            o, lse = scoremod.attention(q, k, v, m, implementation=impl, return_lse=True)
            return o, jax.lax.stop_gradient(lse)

        def run(q, k, v, ops):
            (o, lse), vjp = jax.vjp(lambda q, k, v: f(q, k, v, ops), q, k, v)
            do = jax.random.normal(jax.random.PRNGKey(7), o.shape, o.dtype)
            return (o, lse) + vjp((do, jnp.zeros_like(lse)))

        del routes[:]
        out[way] = (jax.jit(run) if way == "traced" else run)(q, k, v, tuple(mod.operands))
        jax.effects_barrier()
        if way != "xla":
            assert routes and set(routes) == {route}, (way, routes)
    for name, a, b in [(n, x, y) for way in ("closed", "traced")
                       for n, x, y in zip(("O", "LSE", "dQ", "dK", "dV"), out[way], out["xla"])]:
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.array_equal(np.isneginf(a), np.isneginf(b)), name
        fin = np.isfinite(b)
        assert np.isfinite(a[fin]).all(), name
        err = np.max(np.abs(a[fin] - b[fin]), initial=0)
        assert err < 2e-2 * max(1.0, np.max(np.abs(b[fin]), initial=0)), (name, err)


def _qkv(b, sq, skv, hq, hkv, d=64, dtype=jnp.float16, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (b, sq, hq, d), dtype),
            jax.random.normal(ks[1], (b, skv, hkv, d), dtype),
            jax.random.normal(ks[2], (b, skv, hkv, d), dtype))


BACKEND_CASES = {  # name: (ids [B, S] maker, mod maker, route)
    "equal_causal": (lambda rng: np.repeat(np.arange(4), 12)[None].repeat(2, 0),
                     lambda ids: lambda s, b, h, q, k: jnp.where((ids[b, q] == ids[b, k]) & (q >= k), s, NEG),
                     "varlen"),
    "random_lengths": (lambda rng: random_ids(rng, 2, 48, 5),
                       lambda ids: lambda s, b, h, q, k: jnp.where(ids[b, q] == ids[b, k], s, NEG),
                       "varlen"),
    "length_one_segments_window": (lambda rng: np.array([[0, 1, 2] + [3] * 40 + [4] * 5] * 2),
                                   lambda ids: lambda s, b, h, q, k: jnp.where(
                                       (ids[b, q] == ids[b, k]) & (q >= k) & (q - k < 4), s, NEG),
                                   "varlen"),
    "pad_id_and_length": (lambda rng: random_ids(rng, 2, 48, 3, pad=-1),
                          lambda ids: lambda s, b, h, q, k: jnp.where(
                              (ids[b, q] == ids[b, k]) & (ids[b, k] != -1) & (k < jnp.array([30, 48])[b]),
                              s, NEG),
                          "varlen"),
    "window_and_length": (lambda rng: random_ids(rng, 2, 48, 2),
                          lambda ids: lambda s, b, h, q, k: jnp.where(
                              (ids[b, q] == ids[b, k]) & (q >= k) & (q - k < 3) & (k < jnp.array([20, 7])[b]),
                              s, NEG),
                          "varlen"),
    "all_padding_row": (lambda rng: np.stack([np.full(48, -1), np.repeat([1, 2], 24)]),
                        lambda ids: lambda s, b, h, q, k: jnp.where(
                            (ids[b, q] == ids[b, k]) & (ids[b, q] != -1), s, NEG),
                        "varlen"),
    "reappearing_ids": (lambda rng: np.array([[0] * 10 + [1] * 10 + [0] * 28] * 2),
                        lambda ids: lambda s, b, h, q, k: jnp.where((ids[b, q] == ids[b, k]) & (q >= k), s, NEG),
                        "dense"),
    "decreasing_ids": (lambda rng: np.array([[5] * 20 + [2] * 28] * 2),  # runs: the second check
                       lambda ids: lambda s, b, h, q, k: jnp.where(ids[b, q] == ids[b, k], s, NEG),
                       "varlen"),
    "undeclared_zero_padding": (lambda rng: np.array([[1] * 20 + [2] * 20 + [0] * 8] * 2),
                                lambda ids: lambda s, b, h, q, k: jnp.where(
                                    (ids[b, q] == ids[b, k]) & (q >= k), s, NEG),
                                "varlen"),
    "too_many_segments": (lambda rng: np.arange(48)[None].repeat(2, 0) // 4,
                          lambda ids: lambda s, b, h, q, k: jnp.where((ids[b, q] == ids[b, k]) & (q >= k), s, NEG),
                          "dense"),
}


@pytest.mark.parametrize("name", sorted(BACKEND_CASES))
def test_backend_matches_the_reference(name, emulated):
    make_ids, make_mod, route = BACKEND_CASES[name]
    ids = jnp.asarray(make_ids(np.random.default_rng(1)), jnp.int32)
    mod = scoremod.trace(make_mod(ids))
    assert scoremod.which_implementation(*_qkv(2, 48, 48, 4, 2), mod)[0] == "cudnn-varlen"
    _check(mod, *_qkv(2, 48, 48, 4, 2), emulated, route)


@pytest.mark.parametrize("pad", [False, True])
def test_cross_attention_with_other_lengths(emulated, pad):
    rng = np.random.default_rng(3)
    ids_q = jnp.asarray(random_ids(rng, 2, 40, 3), jnp.int32)
    ids_kv = np.asarray(random_ids(rng, 2, 24, 4))
    ids_kv = np.where(ids_kv == 7, 8, ids_kv)  # query document 7 has no keys
    if pad:
        ids_kv[:, -3:] = -1
    ids_kv = jnp.asarray(ids_kv, jnp.int32)
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(
        (ids_q[b, q] == ids_kv[b, k]) & (ids_kv[b, k] != -1), s, NEG))
    _check(mod, *_qkv(2, 40, 24, 4, 4, seed=2), emulated, "varlen")


def test_cross_attention_with_decreasing_ids_takes_the_dense_route(emulated):
    ids_q = jnp.asarray(np.array([[4] * 20 + [1] * 20] * 2), jnp.int32)
    ids_kv = jnp.asarray(np.array([[4] * 10 + [1] * 14] * 2), jnp.int32)
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(ids_q[b, q] == ids_kv[b, k], s, NEG))
    _check(mod, *_qkv(2, 40, 24, 4, 4, seed=2), emulated, "dense")


def test_bf16_and_jit(emulated):
    ids = jnp.asarray(random_ids(np.random.default_rng(4), 2, 48, 3), jnp.int32)
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where((ids[b, q] == ids[b, k]) & (q >= k), s, NEG))
    q, k, v = _qkv(2, 48, 48, 2, 2, dtype=jnp.bfloat16)
    f = jax.jit(lambda q, k, v: scoremod.attention(q, k, v, mod, implementation="cudnn-varlen"))
    ref = scoremod.attention(q, k, v, mod, implementation="xla")
    np.testing.assert_allclose(np.asarray(f(q, k, v), np.float32), np.asarray(ref, np.float32),
                               atol=3e-2)


def test_native_masks_off_keeps_the_dense_route(emulated):
    ids = jnp.asarray(np.repeat(np.arange(4), 12)[None].repeat(2, 0), jnp.int32)
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(ids[b, q] == ids[b, k], s, NEG))
    q, k, v = _qkv(2, 48, 48, 2, 2)
    scoremod.attention(q, k, v, mod, implementation="cudnn-varlen",
                       options=scoremod.LoweringOptions(native_masks=False)).block_until_ready()
    jax.effects_barrier()
    assert emulated == ["dense"]


def test_registered_before_cudnn_and_chosen_for_segment_masks(monkeypatch):
    assert registry.names().index("cudnn-varlen") < registry.names().index("cudnn")
    monkeypatch.setattr(CUDNN, "why_not", lambda problem, mod, automatic, options=None: None)
    q, k, v = _qkv(2, 64, 64, 4, 4, dtype=jnp.bfloat16)
    choice = scoremod.which_implementation(q, k, v, SPELLINGS["causal"][0])
    assert choice.implementation == "cudnn-varlen" and choice.reason.startswith("cudnn-varlen:")
    choice = scoremod.which_implementation(q, k, v, lambda s, b, h, qi, ki: jnp.tanh(s))
    # The reason is cuDNN's own: a specialized backend refusing another kind of mod is normal.
    assert choice.implementation == "cudnn" and choice.reason.startswith("cudnn:")
    assert "segment" not in choice.reason and "not a segment mask" in choice.verdicts["cudnn-varlen"]
    plan = vb.CUDNN_VARLEN.plan(Problem.of(q, k, v), scoremod.trace(SPELLINGS["causal"][0]), 0.125,
                                scoremod.LoweringOptions(max_segments=4), False)
    assert plan.spec.sequences == 2 * 4 and "ragged sequences" in plan.describe()
    assert hash(plan) == hash(vb.CUDNN_VARLEN.plan(Problem.of(q, k, v), scoremod.trace(
        SPELLINGS["causal"][0]), 0.125, scoremod.LoweringOptions(max_segments=4), False))


def test_refused_by_name_with_the_reason():
    q, k, v = _qkv(2, 64, 64, 4, 4, dtype=jnp.bfloat16)
    with pytest.raises(scoremod.ScoreModError, match="cudnn-varlen.*not a segment mask"):
        scoremod.attention(q, k, v, lambda s, b, h, qi, ki: s * 2.0, implementation="cudnn-varlen")


def test_max_segments_must_be_positive():
    with pytest.raises(scoremod.ScoreModError, match="max_segments"):
        scoremod.LoweringOptions(max_segments=0)


def test_known_ids_compute_their_sequences_when_traced(monkeypatch, recorder):
    """Ids the mod closes over: the offsets are constants of the program (no
    XLA work per call), equal to those computed in the program from the same
    ids, and plans of other ids differ."""
    monkeypatch.setattr(CUDNN, "why_not", lambda problem, mod, automatic, options=None: None)
    seen = []

    def call(built, inputs, out_shapes, carried):
        seen.append(inputs[3:])
        return [jnp.zeros(s.shape, s.dtype) for s in out_shapes]

    monkeypatch.setattr(vb, "_call", call)
    ids = jnp.asarray(random_ids(np.random.default_rng(5), 2, 48, 3), jnp.int32)
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where((ids[b, q] == ids[b, k]) & (q >= k), s, NEG))
    q, k, v = _qkv(2, 48, 48, 2, 2, dtype=jnp.bfloat16)
    problem, opts = Problem.of(q, k, v), scoremod.LoweringOptions()
    plan = vb.CUDNN_VARLEN.plan(problem, mod, 0.125, opts, False)
    assert plan.route == "ragged" and plan.known is not None
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: scoremod.attention(
        q, k, v, mod, implementation="cudnn-varlen"))(q, k, v))
    for primitive in ("cumsum", "cummax", "scatter", "sort"):
        assert primitive not in jaxpr, primitive
    traced = plan.ragged_inputs(plan.layout(tuple(mod.operands)))
    for known, computed in zip(plan.known.ragged, traced):
        np.testing.assert_array_equal(known, np.asarray(computed))
    other = jnp.asarray(random_ids(np.random.default_rng(6), 2, 48, 3), jnp.int32)
    other_plan = vb.CUDNN_VARLEN.plan(problem, scoremod.ScoreMod(mod.expr, (other,)), 0.125, opts,
                                      False)
    assert other_plan != plan
