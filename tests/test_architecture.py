"""The package's shape holds: imports flow one way, modules keep their private
names to themselves, and lowering switches are options, not module globals."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "scoremod"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_module(name):
    return name in FILES


def _imports(name, top_level_only):
    """(imported module, alias, imported private names) per import statement of ``name``."""
    tree = ast.parse(FILES[name].read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # imports under `if TYPE_CHECKING:` and try blocks count too
        nodes = [n for stmt in tree.body for n in ast.walk(stmt)
                 if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
    package = name if FILES[name].name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "scoremod":
                    out.append((a.name, a.asname or a.name.split(".")[0], []))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([node.module] if node.module else []))
            if base.split(".")[0] != "scoremod":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                if _is_module(sub):
                    out.append((sub, a.asname or a.name, []))
                else:
                    out.append((base, None, [a.name] if a.name.startswith("_") else []))
    return out


def _graph(top_level_only):
    return {m: {target for target, _, _ in _imports(m, top_level_only) if target != m}
            for m in FILES}


def _cycle(graph):
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_module_level_imports_have_no_cycle():
    graph = _graph(top_level_only=True)
    assert "scoremod.lowering.cudnn.backend" in graph  # the walk sees the packages
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_cycle_even_counting_imports_inside_functions():
    graph = _graph(top_level_only=False)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def _function_level_imports(name):
    """scoremod modules imported inside functions or classes of module ``name``."""
    top = {target for target, _, _ in _imports(name, top_level_only=True)}
    return sorted({target for target, _, _ in _imports(name, top_level_only=False)} - top)


def test_the_dsl_imports_its_own_modules_at_module_level_only():
    # An import inside a function is how an import cycle hides: the DSL's
    # modules are layered (ir < grad < rewrite < ops < text, trace, ...).
    bad = {m: _function_level_imports(m) for m in FILES if m.startswith("scoremod.dsl")}
    assert not {m: t for m, t in bad.items() if t}, bad


def test_the_function_level_import_check_can_fail(tmp_path, monkeypatch):
    fake = tmp_path / "scoremod" / "dsl" / "fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from scoremod.dsl import ir\n\ndef f():\n    from scoremod.dsl.ops import apply\n")
    monkeypatch.setitem(FILES, "scoremod.dsl.fake", fake)
    assert _function_level_imports("scoremod.dsl.fake") == ["scoremod.dsl.ops"]
    graph = {"scoremod.dsl.ir": {"scoremod.dsl.fake"}, "scoremod.dsl.fake": {"scoremod.dsl.ir"}}
    assert _cycle(graph) == ["scoremod.dsl.fake", "scoremod.dsl.ir", "scoremod.dsl.fake"]


def test_the_dsl_never_imports_lowering_or_the_front_door():
    above = ("scoremod.lowering", "scoremod.attention", "scoremod.flax", "scoremod.cli")
    bad = [(m, t) for m, targets in _graph(top_level_only=False).items()
           if m.startswith("scoremod.dsl") for t in targets if t.startswith(above)]
    assert not bad


def test_lowering_imports_no_front_door():
    above = ("scoremod.attention", "scoremod.flax", "scoremod.cli")
    bad = [(m, t) for m, targets in _graph(top_level_only=False).items()
           if m.startswith("scoremod.lowering") for t in targets if t.startswith(above)]
    assert not bad


def _private_uses(name):
    text = FILES[name].read_text()
    found = []
    for target, alias, privates in _imports(name, top_level_only=False):
        found += [f"from {target} import {p}" for p in privates]
        if alias and target != name:
            found += [f"{alias}.{m}" for m in re.findall(rf"(?<![\w.]){re.escape(alias)}\.(_[a-z]\w*)", text)]
    return found


def test_no_module_reads_another_modules_private_names():
    bad = {m: _private_uses(m) for m in FILES if _private_uses(m)}
    assert not bad


def test_the_private_name_check_can_fail(tmp_path, monkeypatch):
    fake = tmp_path / "scoremod" / "fake.py"
    fake.parent.mkdir()
    fake.write_text("from scoremod.lowering.cudnn import graph as cg\nx = cg._cache\n"
                    "from scoremod.device import _host_available\n")
    monkeypatch.setitem(FILES, "scoremod.fake", fake)
    assert _private_uses("scoremod.fake") == ["cg._cache", "from scoremod.device import _host_available"]


def test_lowering_switches_are_options_read_in_one_place():
    readers = sorted(m for m, p in FILES.items()
                     if re.search(r"SCOREMOD_(NATIVE_MASKS|SPLIT_BLOCKS|FOLD_SCALE)", p.read_text()))
    assert readers == ["scoremod.options"]
    for m, p in FILES.items():
        if m.startswith("scoremod.lowering"):
            assert "os.environ" not in p.read_text(), m
            tree = ast.parse(p.read_text())
            # no module-level `global` rebinding and no upper-case switch read at import
            assert not any(isinstance(n, ast.Global) for n in ast.walk(tree)), m


@pytest.mark.parametrize("name", sorted(n for n in FILES if n.startswith("scoremod.lowering")))
def test_lowering_modules_import_cleanly_in_a_fresh_order(name):
    import importlib

    assert importlib.import_module(name).__name__ == name
