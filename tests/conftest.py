"""GPU tests (marked ``gpu``) skip cleanly on machines without an NVIDIA GPU."""

import os

import jax
import pytest

# Tests never read or write the user's cuDNN plan cache (a warm cache would
# turn the build counts they check into disk hits); tests of the cache give
# their own directory.
os.environ["SCOREMOD_CACHE_DIR"] = ""

# float32 comparisons in the tests mean float32 arithmetic: GPUs default to
# TF32 matmuls, which differ from float32 by about 1e-3.
jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu():
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with -m gpu on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
