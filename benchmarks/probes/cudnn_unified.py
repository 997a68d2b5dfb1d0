"""Whether cuDNN's unified SDPA node (``implementation=cudnn.attention_implementation.UNIFIED``)
takes a score_mod with a native diagonal band (causal; window 128) or a ``block_mask``
(empty key tiles skipped), forward and backward (score_mod + score_mod_bprop), and what
softcap + causal costs that way (needs a GPU, torch and the cuDNN frontend 1.32; graphs
run through the frontend's own execute on torch tensors, the cuDNN torch loads).

The block mask's layout is cudnn-frontend's (test/python/sdpa/fp16.py, fp16_ref.py,
samples/cpp/sdpa/fp16_fwd_with_block_mask.cpp): UINT8 [b, h_q, ceil(s_q/128),
ceil(ceil(s_kv/128)/8)], row-major; bit j (LSB first) of byte n is key tile 8n + j of
that 128-row query tile, 1 = computed. The sample runs it on Blackwell only, so each
block-mask forward also runs with the bits MSB first. The 1.32 headers give
sdpa_backward neither ``implementation`` nor ``block_mask`` and refuse a score_mod
with a band before any implementation is chosen (sdpa_support_surface.h,
_sdpa_validate.py): passed anyway, the refusals printed. The causal mask also goes in
the score_mod (gen_index, cmp_ge, binary_select, as scoremod lowers it), with and
without the block mask. One line per variant: builds (the plan's engine) or the
refusal, errors against float32 torch at b2 h4 s640 d128 (the backward on the
reference's O and LSE); then fwd and fwd+bwd times at b4 h16 s4096 d128 bf16.

    python benchmarks/probes/cudnn_unified.py
"""

import collections
import math

import torch

import cudnn
from cudnn_sinks import build, new_graph  # the sibling probe's graph and build steps

B, H, S, D = 2, 4, 640, 128
WINDOW, CAP, TILE = 128, 30.0, 128
F32, I32, BOOL = cudnn.data_type.FLOAT, cudnn.data_type.INT32, cudnn.data_type.BOOLEAN
UNIFIED, AUTO = cudnn.attention_implementation.UNIFIED, cudnn.attention_implementation.AUTO
# cap: 30 tanh(s / 30) as score_mod; band: native mask; inmod: causal inside the
# score_mod; block: the causal key tiles' block mask
Spec = collections.namedtuple("Spec", "label cap band inmod block")
SPECS = (
    Spec("softcap", True, None, False, False),
    Spec("causal band (no score_mod)", False, "causal", False, False),
    Spec("softcap + causal band", True, "causal", False, False),
    Spec("softcap + window band", True, "window", False, False),
    Spec("softcap + causal-tile block mask", True, None, False, True),
    Spec("softcap + causal in score_mod", True, None, True, False),
    Spec("softcap + causal in score_mod + block mask", True, None, True, True),
    Spec("causal band + block mask (no score_mod)", False, "causal", False, True),
)


def reference(q, k, v, do, mask, cap):
    """O, LSE and the gradients, float32, BHSD."""
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if cap:
        s = CAP * torch.tanh(s / CAP)
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v)
    grads = torch.autograd.grad(o, (q, k, v), do.float())
    return tuple(x.detach() for x in (o, torch.logsumexp(s, -1)) + grads)


def causal_tiles(s):
    return torch.arange(-(-s // TILE))[:, None] >= torch.arange(-(-s // TILE))[None, :]


def element_mask(spec, s):
    q, kv = torch.arange(s)[:, None], torch.arange(s)[None, :]
    m = (q >= kv) | (not (spec.band or spec.inmod))
    if spec.band == "window":
        m &= kv > q - WINDOW
    if spec.block:
        m &= causal_tiles(s)[q // TILE, kv // TILE]
    return m.cuda()


def block_mask(b, h, s, msb=False):
    keep = causal_tiles(s)
    tq, tk = keep.shape
    n = -(-tk // 8)
    bits = torch.zeros(tq, n * 8, dtype=torch.int32)
    bits[:, :tk] = keep.int()
    weights = 2 ** torch.arange(8, dtype=torch.int32)
    packed = (bits.reshape(tq, n, 8) * (weights.flip(0) if msb else weights)).sum(-1)
    return packed.to(torch.uint8).expand(b, h, tq, n).contiguous().cuda()


def typed(t, dtype=F32):
    return t.set_data_type(dtype)


def scalar(g, extras, value):
    cpu = torch.full((1, 1, 1, 1), value, dtype=torch.float32)
    t = g.tensor(name=f"c{len(extras)}", dim=list(cpu.shape), stride=list(cpu.stride()),
                 is_pass_by_value=True, data_type=F32)
    extras[t] = cpu
    return t


def callbacks(g, extras, spec, backward):
    """score_mod (and score_mod_bprop) for softcap and / or causal in the callback."""
    if not (spec.cap or spec.inmod):
        return {}
    c = {n: scalar(g, extras, x) for n, x, need in (
        ("inv", 1 / CAP, spec.cap), ("cap", CAP, spec.cap), ("ninf", -math.inf, spec.inmod),
        ("one", 1.0, spec.cap and backward), ("zero", 0.0, spec.inmod and backward)) if need}
    env = {}

    def causal(gg, x):
        r = typed(gg.gen_index(input=x, axis=2), I32)
        k = typed(gg.gen_index(input=x, axis=3), I32)
        return typed(gg.cmp_ge(input=r, comparison=k, compute_data_type=BOOL), BOOL)

    def score_mod(gg, s):
        out = s
        if spec.cap:
            env["t"] = typed(gg.tanh(input=typed(gg.mul(a=s, b=c["inv"]))))
            out = typed(gg.mul(a=env["t"], b=c["cap"]))
        if spec.inmod:
            out = typed(gg.binary_select(input0=out, input1=c["ninf"], mask=causal(gg, s)))
        return out

    def score_mod_bprop(gg, dp):
        out = dp
        if spec.inmod:
            out = typed(gg.binary_select(input0=out, input1=c["zero"], mask=causal(gg, dp)))
        if spec.cap:  # d(30 tanh(s / 30)) / ds = 1 - tanh(s / 30)^2
            t2 = typed(gg.mul(a=env["t"], b=env["t"]))
            out = typed(gg.mul(a=out, b=typed(gg.sub(a=c["one"], b=t2))))
        return out

    return {"score_mod": score_mod, **({"score_mod_bprop": score_mod_bprop} if backward else {})}


def runner(g, pack, handle):
    """Runs the built graph once; returns a function that runs it again."""
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    g.execute(pack, ws, handle=handle)
    torch.cuda.synchronize()
    return lambda: g.execute(pack, ws, handle=handle)


def extra_kwargs(g, extras, spec, impl, bm, backward):
    kw = callbacks(g, extras, spec, backward)
    if spec.band is not None:
        kw.update(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)
    if spec.band == "window":
        kw["diagonal_band_left_bound"] = WINDOW
    if impl is not None:
        kw["implementation"] = impl
    if bm is not None:
        tb = g.tensor_like(bm)
        extras[tb] = bm
        kw["block_mask"] = tb
    return kw


def forward(handle, q, k, v, spec, impl, bm):
    g, extras = new_graph(handle), {}
    tq, tk, tv = g.tensor_like(q), g.tensor_like(k), g.tensor_like(v)
    o, stats = g.sdpa(name="sdpa", q=tq, k=tk, v=tv, attn_scale=1 / math.sqrt(q.shape[-1]),
                      generate_stats=True, **extra_kwargs(g, extras, spec, impl, bm, False))
    o.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride()))
    stats.set_output(True).set_data_type(F32)
    build(g)
    out = torch.empty_like(q), torch.empty(*q.shape[:3], 1, device="cuda", dtype=torch.float32)
    return g, runner(g, {tq: q, tk: k, tv: v, o: out[0], stats: out[1], **extras}, handle), out


def backward(handle, q, k, v, o, do, stats, spec, impl, bm):
    g, extras = new_graph(handle), {}
    tq, tk, tv, to, tdo, tst = (g.tensor_like(x) for x in (q, k, v, o, do, stats))
    grads = g.sdpa_backward(name="sdpa_backward", q=tq, k=tk, v=tv, o=to, dO=tdo, stats=tst,
                            attn_scale=1 / math.sqrt(q.shape[-1]),
                            **extra_kwargs(g, extras, spec, impl, bm, True))
    out = tuple(torch.empty_like(x) for x in (q, k, v))
    for t, like in zip(grads, out):
        t.set_output(True).set_dim(list(like.shape)).set_stride(list(like.stride()))
    build(g)
    pack = {tq: q, tk: k, tv: v, to: o, tdo: do, tst: stats, **dict(zip(grads, out)), **extras}
    return g, runner(g, pack, handle), out


def err(a, b):
    return float((a.float() - b.float()).abs().max())


def attempt(label, fn):
    """fn()'s result, or None with the refusal printed verbatim."""
    try:
        return fn()
    except Exception as e:
        print(f"{label}: refused (or failed): {type(e).__name__}: {str(e)[:400]}", flush=True)


def bshd_tensor(b, s, h, d, seed):  # BHSD views of BSHD memory: scoremod's layout
    torch.manual_seed(seed)
    return torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16).permute(0, 2, 1, 3)


def timed(fn, iters=20):
    [fn() for _ in range(3)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    [fn() for _ in range(iters)]
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def check(handle):
    q, k, v, do = (bshd_tensor(B, S, H, D, i) for i in range(4))
    refs = {spec: reference(q, k, v, do, element_mask(spec, S), spec.cap) for spec in SPECS}
    for spec, impl, msb in ((s, i, m) for s in SPECS for i in (UNIFIED, AUTO)
                            for m in ((False, True) if s.block else (False,))):
        bits = (", bits MSB first" if msb else ", bits LSB first") if spec.block else ""
        label = f"fwd {spec.label} [{impl.name}{bits}]"
        bm = block_mask(B, H, S, msb) if spec.block else None
        built = attempt(label, lambda: forward(handle, q, k, v, spec, impl, bm))
        if built is not None:
            (o, stats), ref = built[2], refs[spec]
            print(f"{label}: builds ({built[0].get_plan_name_at_index(0)}); |O - ref| "
                  f"{err(o, ref[0]):.2e}, |stats - LSE| {err(stats[..., 0], ref[1]):.2e}", flush=True)
    for spec, impl in [(spec, None) for spec in SPECS] + [(SPECS[5], UNIFIED)]:
        ref = refs[spec]
        o, stats = torch.empty_like(q).copy_(ref[0]), ref[1][..., None].contiguous()
        label = f"bwd {spec.label}{' [implementation=UNIFIED]' if impl is not None else ''}"
        bm = block_mask(B, H, S) if spec.block else None
        built = attempt(label, lambda: backward(handle, q, k, v, o, do, stats, spec, impl, bm))
        if built is not None:
            line = ", ".join(f"|{n} - ref| {err(x, r):.2e}"
                             for n, x, r in zip(("dQ", "dK", "dV"), built[2], ref[2:]))
            print(f"{label}: builds ({built[0].get_plan_name_at_index(0)}); {line}", flush=True)


def time_routes(handle):
    """softcap + causal by each route, against softcap alone (all tiles) and plain causal."""
    b, h, s, d = 4, 16, 4096, 128
    q, k, v, do = (bshd_tensor(b, s, h, d, i) for i in range(4))
    for spec in (SPECS[1], SPECS[0], SPECS[2], SPECS[5], SPECS[6]):
        bm = block_mask(b, h, s) if spec.block else None
        tag = f"time {spec.label} b{b} h{h} s{s} d{d}"
        for impl in (UNIFIED, AUTO):
            fwd = attempt(f"{tag} [{impl.name}] forward",
                          lambda: forward(handle, q, k, v, spec, impl, bm))
            if fwd is not None:
                break
        if fwd is None:
            continue
        g, run, (o, stats) = fwd
        line = f"{tag} [{impl.name}, {g.get_plan_name_at_index(0)}]: fwd {timed(run):.3f} ms"
        bwd = attempt(f"{tag} backward", lambda: backward(handle, q, k, v, o, do, stats, spec, None, bm))
        note = ""
        if bwd is None and spec.block:  # the same function without the block mask
            note = " (backward without the block mask)"
            bwd = attempt(f"{tag} backward without the block mask", lambda: backward(
                handle, q, k, v, o, do, stats, spec._replace(block=False), None, None))
        if bwd is None:
            print(f"{line}; no backward", flush=True)
            continue
        both = timed(lambda: (run(), bwd[1]()))
        print(f"{line}, fwd+bwd {both:.3f} ms ({bwd[0].get_plan_name_at_index(0)}){note}", flush=True)


def main():
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    print(f"cuDNN backend {cudnn.backend_version()}, frontend {cudnn.__version__}, torch "
          f"{torch.__version__}, {torch.cuda.get_device_name()}; block mask: UINT8 [b, h, "
          f"ceil(s_q/{TILE}), ceil(ceil(s_kv/{TILE})/8)], bit j of byte n = key tile 8n + j, "
          f"1 = computed", flush=True)
    check(handle)
    time_routes(handle)


if __name__ == "__main__":
    main()
