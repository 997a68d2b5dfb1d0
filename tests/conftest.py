"""GPU tests (marked ``gpu``) skip cleanly on machines without an NVIDIA GPU."""

import jax
import pytest


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
