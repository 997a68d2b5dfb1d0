"""Whether the loaded cuDNN takes the frontend's ``sink_token`` (one learned logit
per head joining each row's softmax) in its SDPA graphs on this GPU, with which
masks and with a score_mod, what its O and stats mean, and what it costs (needs a
GPU, torch and the cuDNN frontend; the graphs run through the frontend's own
execute on torch tensors, so the cuDNN is the one torch's process loads: printed).

Per variant, one line: whether the forward graph builds, its O and stats against a
float32 reference with the sink in the softmax, whether a backward graph with
``sink_token`` (and with ``dSink_token``) builds and its dQ/dK/dV/dSink errors, and
whether the plain backward given the sink-including stats gives the same
gradients (the way scoremod joins sinks today). Then, at batch 4, 16 heads, 4096,
d128 bf16: the forward time with and without the sink, and the backward's with
``dSink_token`` against the plain one, whether its dSink repeats bitwise, with
and without cuDNN's deterministic algorithm.

    python benchmarks/probes/cudnn_sinks.py
"""

import math

import torch

import cudnn
from scoremod.lowering.cudnn.graph import PYTHON_ENGINE_NAMES

B, H, S, D = 2, 4, 384, 64
WINDOW = 128


def reference(q, k, v, sink, mask, mod, do):
    """O, LSE (with the sink) and the gradients, float32, BHSD."""
    q, k, v, sink = (x.detach().float().requires_grad_() for x in (q, k, v, sink))
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if mod:
        s = torch.tanh(s)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    col = sink.reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    lse = torch.logsumexp(torch.cat([s, col], -1), -1)
    o = torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - lse[..., None]), v)
    dq, dk, dv, dsink = torch.autograd.grad(o, (q, k, v, sink), do.float())
    return o, lse, dq, dk, dv, dsink


def masks(s):
    q = torch.arange(s, device="cuda")[:, None]
    kv = torch.arange(s, device="cuda")[None, :]
    return {"none": None, "causal": q >= kv, "window": (q >= kv) & (kv > q - WINDOW)}


def mask_args(name):
    if name == "none":
        return {}
    args = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT,
            "diagonal_band_right_bound": 0}
    if name == "window":
        args["diagonal_band_left_bound"] = WINDOW
    return args


def new_graph(handle):
    return cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                         intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=handle)


def build(g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.deselect_engines(list(PYTHON_ENGINE_NAMES))  # as scoremod builds its graphs
    g.check_support()
    g.build_plans()


def execute(g, pack, handle):
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    g.execute(pack, ws, handle=handle)
    torch.cuda.synchronize()


def forward_graph(handle, q, k, v, sink, mask, mod):
    g = new_graph(handle)
    tq, tk, tv = g.tensor_like(q), g.tensor_like(k), g.tensor_like(v)
    extra = {}
    ts = None
    if sink is not None:
        ts = g.tensor_like(sink)
        extra["sink_token"] = ts
    if mod:
        extra["score_mod"] = lambda gg, score: gg.tanh(input=score)
    o, stats = g.sdpa(name="sdpa", q=tq, k=tk, v=tv, attn_scale=1 / math.sqrt(q.shape[-1]),
                      generate_stats=True, **mask_args(mask), **extra)
    o.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride()))
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    build(g)
    return g, (tq, tk, tv, ts, o, stats)


def run_forward(handle, q, k, v, sink, mask, mod):
    g, (tq, tk, tv, ts, to, tstats) = forward_graph(handle, q, k, v, sink, mask, mod)
    o = torch.empty_like(q)
    stats = torch.empty(q.shape[0], q.shape[1], q.shape[2], 1, device="cuda", dtype=torch.float32)
    pack = {tq: q, tk: k, tv: v, to: o, tstats: stats}
    if ts is not None:
        pack[ts] = sink
    execute(g, pack, handle)
    return g, pack, o, stats[..., 0]


def backward_graph(handle, q, k, v, o, do, stats, sink, mask, with_sink, with_dsink,
                   deterministic=False):
    """Native masks only: a score_mod's backward is not probed here. The graph, its
    variant pack and its outputs (dSink_token's buffer zeroed: cuDNN adds into it)."""
    g = new_graph(handle)
    tq, tk, tv, to, tdo = (g.tensor_like(x) for x in (q, k, v, o, do))
    st = stats[..., None].contiguous()
    tst = g.tensor_like(st)
    extra = {}
    if with_sink:
        ts = g.tensor_like(sink)
        extra["sink_token"] = ts
    if with_dsink:
        dsink = torch.zeros_like(sink)
        tds = g.tensor_like(dsink)
        extra["dSink_token"] = tds
    if deterministic:
        extra["use_deterministic_algorithm"] = True
    dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=tq, k=tk, v=tv, o=to, dO=tdo, stats=tst,
                                 attn_scale=1 / math.sqrt(q.shape[-1]), **mask_args(mask), **extra)
    for t, like in ((dq, q), (dk, k), (dv, v)):
        t.set_output(True).set_dim(list(like.shape)).set_stride(list(like.stride()))
    build(g)
    out = {n: torch.empty_like(x) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    pack = {tq: q, tk: k, tv: v, to: o, tdo: do, tst: st, dq: out["dq"], dk: out["dk"], dv: out["dv"]}
    if with_sink:
        pack[ts] = sink
    if with_dsink:
        pack[tds] = dsink
        out["dsink"] = dsink
    return g, pack, out


def run_backward(handle, *args):
    g, pack, out = backward_graph(handle, *args)
    execute(g, pack, handle)
    return out


def timed(g, pack, handle, reps=50, before=None):
    """ms per execute (``before`` runs ahead of each, inside the timing)."""
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    for _ in range(5):
        g.execute(pack, ws, handle=handle)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        if before is not None:
            before()
        g.execute(pack, ws, handle=handle)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def sink_gradient_at_scale(handle):
    """At b4 h16 s4096 d128: the backward's time with sink_token and dSink_token
    against the plain backward on the sink's stats, whether dSink repeats bitwise
    over 20 runs, and its error against the closed form
    ``-sum_i exp(sink - LSE_i) * rowsum(dO_i * O_i)`` in float64."""
    b, h, s, d = 4, 16, 4096, 128
    q, k, v, do = (bshd_tensor(b, s, h, d, i) for i in range(4))
    sink = torch.linspace(-1.0, 2.0, h, device="cuda").reshape(1, h, 1, 1).float().contiguous()
    for mask_name in ("causal", "window"):
        _, _, o, stats = run_forward(handle, q, k, v, sink, mask_name, False)
        rowsum = (do.double() * o.double()).sum(-1)
        closed = -(torch.exp(sink.double().reshape(1, h, 1) - stats.double()) * rowsum).sum((0, 2))
        for deterministic in (False, True):
            label = f"{mask_name} (window {WINDOW}) b{b} h{h} s{s} d{d} deterministic={deterministic}"
            try:
                plain = backward_graph(handle, q, k, v, o, do, stats, sink, mask_name,
                                       False, False, deterministic)
                fused = backward_graph(handle, q, k, v, o, do, stats, sink, mask_name,
                                       True, True, deterministic)
            except Exception as e:
                print(f"backward {label}: refused: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            dsink = fused[2]["dsink"]
            seen = set()
            for _ in range(20):
                dsink.zero_()
                execute(fused[0], fused[1], handle)
                seen.add(dsink.cpu().numpy().tobytes())
            error = float((dsink.flatten().double() - closed).abs().max())
            scale = float(closed.abs().max())
            t_plain = timed(*plain[:2], handle)
            t_fused = timed(*fused[:2], handle, before=dsink.zero_)
            print(f"backward {label}: plain {t_plain:.4f} ms, with sink and dSink "
                  f"{t_fused:.4f} ms ({t_fused / t_plain:.3f}x); dSink {len(seen)} distinct "
                  f"result(s) in 20 runs, |dSink - closed form| {error:.2e} (max |dSink| "
                  f"{scale:.2e})", flush=True)


def err(a, b):
    return float((a.float() - b.float()).abs().max())


def bshd_tensor(b, s, h, d, seed):  # BHSD views of BSHD memory: scoremod's layout
    torch.manual_seed(seed)
    return torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16).permute(0, 2, 1, 3)


def main():
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    print(f"cuDNN backend {cudnn.backend_version()}, frontend {cudnn.__version__}, "
          f"torch {torch.__version__} (torch's cuDNN {torch.backends.cudnn.version()})", flush=True)
    q, k, v, do = (bshd_tensor(B, S, H, D, i) for i in range(4))
    sink = torch.linspace(-1.0, 2.0, H, device="cuda").reshape(1, H, 1, 1).float().contiguous()
    for mod in (False, True):
        for mask_name, mask in masks(S).items():
            label = f"{'tanh ' if mod else ''}{mask_name}"
            ref = reference(q, k, v, sink.flatten(), mask, mod, do)
            try:
                g, _, o, stats = run_forward(handle, q, k, v, sink, mask_name, mod)
            except Exception as e:
                print(f"{label}: forward with sink_token refused: {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)
                continue
            print(f"{label}: forward builds ({g.get_plan_name_at_index(0)}); |O - ref| {err(o, ref[0]):.2e}, "
                  f"|stats - LSE with sink| {err(stats, ref[1]):.2e}", flush=True)
            if mod:
                continue
            for with_sink, with_dsink in ((False, False), (True, False), (True, True)):
                what = ("plain backward on the sink's stats" if not with_sink else
                        "backward with sink_token" + (" and dSink_token" if with_dsink else ""))
                try:
                    g = run_backward(handle, q, k, v, o, do, stats, sink, mask_name,
                                     with_sink, with_dsink)
                except Exception as e:
                    print(f"  {what}: refused: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                line = ", ".join(f"{n} {err(g[n], r):.2e}" for n, r in
                                 zip(("dq", "dk", "dv"), ref[2:5]))
                if "dsink" in g:
                    line += f", dsink {err(g['dsink'].flatten(), ref[5]):.2e}"
                print(f"  {what}: {line}", flush=True)
    # the forward's cost with and without the sink, native masks
    b, h, s, d = 4, 16, 4096, 128
    q, k, v = (bshd_tensor(b, s, h, d, i) for i in range(3))
    sink = torch.zeros(1, h, 1, 1, device="cuda")
    for mask_name in ("causal", "window"):
        for with_sink in (False, True):
            try:
                g, pack, _, _ = run_forward(handle, q, k, v, sink if with_sink else None,
                                            mask_name, False)
            except Exception as e:
                print(f"time {mask_name} sink={with_sink}: refused: {str(e)[:200]}")
                continue
            ms = timed(g, pack, handle)
            print(f"time {mask_name} (window {WINDOW}) b{b} h{h} s{s} d{d} sink={with_sink}: "
                  f"{ms:.4f} ms per forward", flush=True)
    sink_gradient_at_scale(handle)


if __name__ == "__main__":
    main()
