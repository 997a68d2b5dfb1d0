"""How big scoremod's Mosaic GPU kernels are next to JAX's own Mosaic GPU attention
(`pallas.ops.gpu.attention_mgpu`), runs on a CPU: each fwd+bwd program is lowered
for CUDA with the device taken for a Hopper GPU (as the CPU tests' `hopper_here`
does), and the probe prints the lowering time and the size of each Mosaic GPU
kernel's serialized module. XLA compiles each such module on the first call (about
a second each on the H200), so equal sizes point at equal compile times. With
--digests, each kernel's SHA-256 without its debug locations as well: two checkouts
that print the same digests lower to the same kernels (a refactor's check on a CPU).

    python benchmarks/probes/kernel_sizes.py [--seq 4096] [--digests]
"""

import argparse
import hashlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import scoremod  # noqa: E402
from scoremod import device  # noqa: E402


def pretend_hopper():
    try:  # where Triton's lowering reads the compute capability (jax 0.12.1 moved it)
        from jax._src import gpu_info
        gpu_info.get_gpu_info  # noqa: B018
    except (ImportError, AttributeError):
        from jax._src.pallas.triton import gpu_info
    gpu_info.get_gpu_info = lambda *a, **k: SimpleNamespace(compute_capability=90)
    device.current = lambda: device.Device("gpu", "NVIDIA H200", 9, 132)


def programs(s, h, table, doc):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as ref
    ref.cuda_versions = SimpleNamespace(cuda_runtime_get_version=lambda: 13000)  # no GPU here
    cfg = ref.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, block_q_dkv=64,
                           block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    mods = {"none": None,
            "softcap": lambda sc, bi, hi, qi, ki: 30.0 * jnp.tanh(sc / 30.0),
            "relbias": lambda sc, bi, hi, qi, ki: sc + table[hi, qi - ki + s - 1],
            # ids read along both tile axes (a vector per tile), causal inside
            "document": lambda sc, bi, hi, qi, ki: jnp.where(
                (doc[bi, qi] == doc[bi, ki]) & (qi >= ki), sc, -jnp.inf)}
    if s % 128 == 0:  # it takes whole key blocks only; its backward float16 only (jax 0.11.2)
        yield "jax attention_mgpu", lambda q, k, v: ref.attention(
            *(x.astype(jnp.float16) for x in (q, k, v)), cfg)
    for name, mod in mods.items():
        yield f"scoremod {name}", (lambda mod: lambda q, k, v: scoremod.attention(
            q, k, v, mod, implementation="pallas"))(mod)


def digest(module_bytes):
    """SHA-256 of a serialized Mosaic GPU module's text without debug locations
    (which name this checkout's paths and line numbers)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jaxlib.mlir._mlir_libs import _mosaic_gpu_ext

    ctx = mlir.make_ir_context()
    ctx.allow_unregistered_dialects = True
    _mosaic_gpu_ext.register_dialect(ctx)
    with ctx:
        text = ir.Module.parse(module_bytes).operation.get_asm(enable_debug_info=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--digests", action="store_true", help="each kernel's digest too")
    a = ap.parse_args(argv)
    pretend_hopper()
    from jax.experimental.mosaic.gpu import core  # KNOWN_KERNELS: each lowered module
    b, s, h, d = 4, a.seq, 16, 128
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    table = jnp.zeros((h, 2 * s - 1), jnp.float32)
    doc = jnp.repeat(jnp.arange(4, dtype=jnp.int32), s // 4)[None].repeat(b, 0)
    for name, f in programs(s, h, table, doc):
        grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)),
                        argnums=(0, 1, 2))
        before = set(core.KNOWN_KERNELS)
        t = time.perf_counter()
        jax.jit(grad).trace(q, q, q).lower(lowering_platforms=("cuda",))
        t = time.perf_counter() - t
        kernels = [v for k, v in core.KNOWN_KERNELS.items() if k not in before]
        print(f"{name}: fwd+bwd lowered in {t:.2f} s, {len(kernels)} Mosaic GPU kernels of "
              f"{', '.join(f'{len(x) / 1024:.0f}' for x in kernels)} KiB"
              + (f", digests {' '.join(digest(x) for x in kernels)}" if a.digests else ""),
              flush=True)


if __name__ == "__main__":
    main()
