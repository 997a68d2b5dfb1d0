"""The examples in docstrings run, and say what they show."""

import doctest
import importlib
import pkgutil

import pytest

import scoremod

# The command line and the benchmark harness print to the terminal and time
# GPUs; their docstrings hold no examples.
SKIP = {"scoremod.__main__", "scoremod.cli", "scoremod.kernels_ffi"}
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(scoremod.__path__, "scoremod.")
    if m.name not in SKIP and not m.name.startswith("scoremod.kernels_ffi."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name == "scoremod.flax":
        pytest.importorskip("flax")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_every_public_name_has_an_example():
    import scoremod.flax  # noqa: F401

    missing = []
    for module in (scoremod, scoremod.flax):
        for name in module.__all__:
            obj = getattr(module, name)
            if not callable(obj):  # OPS, a table: documented by docs/ops.md
                continue
            doc = obj.__doc__ or ""
            if not any(mark in doc for mark in (">>>", "```", "Example")):
                missing.append(f"{module.__name__}.{name}")
    assert not missing, f"docstrings without an example: {missing}"
