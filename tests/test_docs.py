"""docs/ops.md is generated from the op table and must stay in step with it."""

import re

import pytest

from scoremod import docs_gen
from scoremod.dsl.ops import OPS


def test_ops_md_is_up_to_date():
    assert docs_gen.OPS_MD.exists(), "docs/ops.md is missing; run python -m scoremod.docs_gen"
    assert docs_gen.OPS_MD.read_text() == docs_gen.ops_markdown(), (
        "docs/ops.md is stale; regenerate it with python -m scoremod.docs_gen"
    )


def test_every_op_has_a_row_and_a_derivative():
    rows = {}
    for line in docs_gen.ops_table().splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows[cells[0].strip("`")] = cells
    assert list(rows) == list(OPS)
    for name, cells in rows.items():
        assert len(cells) == 6, name
        assert OPS[name].derivative.strip(), name
        assert cells[4], f"{name} has no derivative text"
        assert cells[5], f"{name} has no doc"


def test_missing_derivative_text_is_an_error(monkeypatch):
    import dataclasses

    monkeypatch.setitem(OPS, "tanh", dataclasses.replace(OPS["tanh"], derivative=""))
    with pytest.raises(KeyError, match="tanh"):
        docs_gen.ops_markdown()


# --- the code examples of the docs run ---------------------------------------

_FENCE = re.compile(r"^( *)```python\n(.*?)^\1```", re.M | re.S)


def python_blocks(path):
    """The ```python blocks of a markdown file, dedented, in order."""
    import textwrap

    return [textwrap.dedent(m.group(2)) for m in _FENCE.finditer(path.read_text())]


@pytest.mark.parametrize("name", ["README.md", "docs/guide.md", "docs/api.md"])
def test_doc_examples_run(name, capsys):
    path = docs_gen.OPS_MD.parent.parent / name
    blocks = python_blocks(path)
    assert blocks, f"no python examples found in {name}"
    namespace = {"__name__": f"docs_example_{path.stem}"}
    for i, block in enumerate(blocks):
        code = compile(block, f"{name} [python block {i + 1}]", "exec")
        exec(code, namespace)


# --- links and install commands ----------------------------------------------

ROOT = docs_gen.OPS_MD.parent.parent
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("name", ["README.md", "benchmarks/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in [*(ROOT / "docs").glob("*.md"),
                                        *(ROOT / "benchmarks" / "results").rglob("*.md")])])
def test_relative_links_point_at_files(name):
    path = ROOT / name
    for target in _LINK.findall(path.read_text()):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{name} links to missing {target}"


def test_install_page_pins_what_the_build_uses():
    from scoremod import support
    from scoremod.kernels_ffi import find_headers

    text = (ROOT / "docs" / "install.md").read_text()
    pins = dict(re.findall(r"(nvidia-[\w-]+)==([\w.]+)", text))
    wanted = dict(re.fullmatch(r"(nvidia-[a-z0-9-]+)(.+)", r).groups()
                  for r in find_headers.HEADER_PACKAGES_BY_CUDA[13])
    assert set(pins) == set(wanted), set(pins) ^ set(wanted)  # the offline route, each package
    for name, version in pins.items():
        if name == find_headers.FRONTEND_PACKAGE:  # a version of the range the build takes
            assert find_headers.frontend_in_range(tuple(map(int, version.split(".")))), version
        else:
            assert wanted[name] == f"=={version}", name
    assert find_headers.FRONTEND_REQUIREMENT in text
    assert support.cudnn_range_text() in text and support.cudnn_requirement() in text
    assert "SCOREMOD_CUDA=13 python -m pip install --no-deps -e ." in text
