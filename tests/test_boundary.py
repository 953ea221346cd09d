"""The package boundary, read from the source with ``ast`` (nothing is imported).

- ``jgptq`` never imports torch or transformers, and reaches the torch side ``jgptq_torch`` only through its lazy
  face (the module ``__getattr__`` of ``jgptq/__init__.py``); the command line is part of the torch side;
- no module of either package imports the face ``jgptq`` itself (the package ``__init__``): they import the
  submodules they use, so the face can import them without a loop;
- the module-level imports form no cycle, and no cycle crosses the two packages even counting the imports made
  inside functions.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jgptq", "jgptq_torch")
TORCH_SIDE = ("torch", "transformers")
FACE_TABLE = "_PUBLIC"   # in jgptq/__init__.py: public name -> module, imported by the face's __getattr__


class Import(NamedTuple):
    source: str        # importing module
    target: str        # imported module (``from a import b`` names ``a.b`` when it is a module, else ``a``)
    function: str      # enclosing function ("" at module level)
    line: int


def module_names() -> dict:
    """Dotted module name -> file, for every module of the packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> list:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, function or child.name)
                continue
            if isinstance(child, ast.Import):
                found.extend(Import(name, a.name, function, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module != "__future__":
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    found.append(Import(name, sub if sub in modules else base, function, child.lineno))
            visit(child, function)

    visit(tree, "")
    return found


def face_imports() -> list:
    """The imports the face makes on first access (``importlib``, invisible as import statements): one per
    module named in its table, counted as made inside ``__getattr__``."""
    path = ROOT / "jgptq" / "__init__.py"
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == FACE_TABLE for t in targets):
            table = ast.literal_eval(node.value)
            return [Import("jgptq", module, "__getattr__", node.lineno) for module in sorted(set(table.values()))]
    raise AssertionError(f"jgptq/__init__.py has no table {FACE_TABLE}")


def all_imports() -> list:
    modules = module_names()
    return [imp for name, path in modules.items() for imp in _imports(name, path, modules)] + face_imports()


def _top(target: str) -> str:
    return target.split(".")[0]


def _where(imp: Import) -> str:
    return f"{imp.source}:{imp.line}" + (f" (in {imp.function})" if imp.function else "")


def test_jgptq_never_imports_the_torch_side():
    bad = [f"{_where(i)} imports {i.target}" for i in all_imports()
           if _top(i.source) == "jgptq" and _top(i.target) in TORCH_SIDE]
    assert not bad, "\n".join(bad)


def test_jgptq_reaches_the_torch_side_only_through_its_face():
    bad = [f"{_where(i)} imports {i.target}" for i in all_imports()
           if _top(i.source) == "jgptq" and _top(i.target) == "jgptq_torch"
           and (i.source, i.function) != ("jgptq", "__getattr__")]
    assert not bad, "\n".join(bad)
    assert {i.target for i in face_imports()} >= {"jgptq_torch.pipeline.layerwise", "jgptq_torch.export.checkpoint", "jgptq.config"}


def test_no_module_imports_the_face():
    bad = [f"{_where(i)} imports the face 'jgptq' (import the submodule instead)" for i in all_imports()
           if i.target == "jgptq" and i.source != "jgptq"]
    assert not bad, "\n".join(bad)


def _cycles(edges: dict) -> list:
    """The strongly connected components of more than one module (or with a self-loop), Tarjan's algorithm."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1 or v in edges.get(v, ()):
                out.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def _graph(imports, module_level_only: bool) -> dict:
    modules = module_names()
    edges: dict = {}
    for i in imports:
        if i.target in modules and i.target != i.source and not (module_level_only and i.function):
            edges.setdefault(i.source, set()).add(i.target)
    return edges


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"c"}}) == [["c"]]
    assert _cycles({"a": {"b", "c"}, "b": {"c"}}) == []


def test_no_import_cycle_at_module_level():
    assert _cycles(_graph(all_imports(), module_level_only=True)) == []


def test_no_import_cycle_across_the_packages():
    crossing = [c for c in _cycles(_graph(all_imports(), module_level_only=False))
                if {_top(m) for m in c} == set(PACKAGES)]
    assert crossing == []


def test_the_version_lives_in_a_leaf_module_that_packaging_reads():
    leaf = ROOT / "jgptq" / "version.py"
    assert _imports("jgptq.version", leaf, module_names()) == []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "jgptq.version.__version__"}
