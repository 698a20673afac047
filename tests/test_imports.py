"""The diffkv package imports itself one way: no module reaches itself again through its imports.

The graph is read from the source with ``ast`` (nothing is imported).  Its nodes are the
package's modules (``python/diffkv/**/*.py``, plus ``_C``, the extension, known by its stub
``_C.pyi``); an edge A -> B means "running A's code imports B".  Collected:

- every ``import`` and ``from ... import`` statement, at module level and inside functions,
  methods, classes and ``if`` / ``try`` blocks alike: an import deferred into a function is
  still a dependency, and a circle closed only there is still a circle (it merely moves the
  failure from import time to the first call);
- relative imports resolved against the importing module's package (a package's
  ``__init__`` is its own package);
- ``from P import x``: an import of the submodule ``P.x`` when ``x`` is one, else of ``P``
  itself (``from diffkv import name`` is an import of ``diffkv/__init__``);
- importing ``diffkv.a.b`` also runs ``diffkv/a/__init__``: an edge to every package on the
  way to the target that is not a package of the importer itself.

The package ``__init__`` files need one rule.  Python runs every package of a module before
the module, so each module "imports" its packages; counted as edges, these would put every
module that ``diffkv/__init__`` imports on a circle.  They are not counted: a package that
contains the importer has already run (or is running) when the importer runs.  An explicit
import of such a package -- ``import diffkv``, ``from diffkv import name``, ``from .. import
name`` -- is counted like any other edge, so it closes a circle exactly when that package's
``__init__`` imports the importer, directly or through other modules.  That is the harmful
case: the importer then runs while the ``__init__`` is half done and reads names it may not
have defined yet.  ``diffkv/__main__.py`` doing ``import diffkv`` is fine (the ``__init__``
never imports ``__main__``); ``diffkv/adapter.py`` doing ``from diffkv import BlockPool``
would be a circle (the ``__init__`` imports ``adapter``).

Not counted: imports of other packages, and imports spelled as strings
(``importlib.import_module``), which the package does not use for its own modules.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "python" / "diffkv"


def _modules(package_dir: Path) -> tuple[dict[str, Path | None], set[str]]:
    """({module name: source file, or None for a compiled module known by its stub},
    {package names}) of the package rooted at package_dir."""
    root = package_dir.name
    modules: dict[str, Path | None] = {}
    packages: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = Path(dirpath).relative_to(package_dir.parent)
        prefix = ".".join(rel.parts)
        if "__init__.py" not in filenames:
            dirnames[:] = []  # not a package: nothing below it is importable as part of ours
            continue
        packages.add(prefix)
        for name in sorted(filenames):
            stem, ext = os.path.splitext(name)
            if ext == ".py":
                modules[prefix if stem == "__init__" else f"{prefix}.{stem}"] = Path(dirpath) / name
            elif ext == ".pyi":
                modules.setdefault(f"{prefix}.{stem}", None)
    assert root in packages, f"{package_dir} is not a package (no __init__.py)"
    return modules, packages


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name ``from <level dots><target> import ...`` means inside module."""
    if level == 0:
        assert target is not None
        return target
    parts = module.split(".") if is_package else module.split(".")[:-1]
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, by the rules of this file's docstring."""
    modules, packages = _modules(package_dir)
    root = package_dir.name
    graph: dict[str, set[str]] = {name: set() for name in modules}

    def ours(name: str) -> bool:
        return name == root or name.startswith(root + ".")

    for module, path in modules.items():
        if path is None:
            continue
        is_package = module in packages
        own_packages = {module} if is_package else set()
        parts = module.split(".")
        own_packages |= {".".join(parts[:i]) for i in range(1, len(parts))}
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if ours(alias.name)}
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                if not ours(base):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        for target in targets:
            if target not in modules:
                raise AssertionError(f"{module} imports {target}, which is not a module of {root}")
            tparts = target.split(".")
            chain = {".".join(tparts[:i]) for i in range(1, len(tparts))} | {target}
            graph[module] |= {t for t in chain if t not in own_packages or t == target}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle [a, b, ..., a] for every strongly connected group of modules that has one
    (Tarjan's algorithm; a module importing itself counts)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = []
    for group in groups:
        members, start = set(group), group[0]
        # Shortest way back to start inside the group (breadth first).
        previous: dict[str, str] = {}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        found = v
                        break
                    if w not in previous:
                        previous[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v != start:
            path.append(v)
            v = previous[v]
        cycles.append([start] + path[1:][::-1] + [start])
    return cycles


def test_package_has_no_import_cycle():
    graph = import_graph(PACKAGE_DIR)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in diffkv:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_graph_sees_the_package():
    """The reader finds the imports it must: module level, relative, inside a function, and the
    package's own re-exports (so an empty graph cannot pass the test above)."""
    graph = import_graph(PACKAGE_DIR)
    assert "diffkv.selector" in graph["diffkv.adapter"]
    assert {"diffkv.backends.diffkv", "diffkv.platform"} <= graph["diffkv.selector"]
    assert {"diffkv._C", "diffkv.ops", "diffkv.backends.abstract"} <= graph["diffkv.backends.diffkv"]
    assert "diffkv.native" in graph["diffkv.platform"]  # imported inside a method
    assert {"diffkv.adapter", "diffkv.backends", "diffkv.backends.diffkv"} <= graph["diffkv"]
    assert "diffkv" in graph["diffkv.__main__"]  # `import diffkv as dk`, harmless by the rule
    assert "diffkv.platform" not in graph["diffkv.platform"]


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_cycle_rules_on_a_small_package(tmp_path):
    """The rules of the docstring on a package made for them: a circle closed inside a
    function, one closed by ``from pkg import name`` while ``pkg/__init__`` imports the
    importer, and the harmless ``import pkg`` from a module the ``__init__`` never imports."""
    pkg = _write(
        tmp_path / "a",
        {
            "pkg/__init__.py": "from .core import Thing\n",
            "pkg/core.py": "from pkg import helper_name\n\nThing = 1\n",
            "pkg/__main__.py": "import pkg\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/left.py": "from . import right\n",
            "pkg/sub/right.py": "def f():\n    from .left import g\n    return g\n",
            "pkg/_ext.pyi": "def g() -> None: ...\n",
            "pkg/uses_ext.py": "from . import _ext\nimport os\n",
        },
    )
    graph = import_graph(pkg)
    assert graph["pkg.core"] == {"pkg"}
    assert graph["pkg.__main__"] == {"pkg"}
    assert graph["pkg.sub.left"] == {"pkg.sub.right"}
    assert graph["pkg.sub.right"] == {"pkg.sub.left"}
    assert graph["pkg.uses_ext"] == {"pkg._ext"}
    assert sorted(find_cycles(graph)) == [
        ["pkg", "pkg.core", "pkg"],
        ["pkg.sub.left", "pkg.sub.right", "pkg.sub.left"],
    ]


def test_importing_a_subpackage_runs_its_init(tmp_path):
    """``from pkg.sub.mod import x`` runs ``pkg/sub/__init__``: a circle through that
    ``__init__`` is found; the importer's own packages are not implied."""
    pkg = _write(
        tmp_path / "b",
        {
            "pkg/__init__.py": "",
            "pkg/top.py": "from pkg.sub.mod import x\n",
            "pkg/sub/__init__.py": "from ..top import y\n",
            "pkg/sub/mod.py": "x = 1\n",
            "pkg/sub/other.py": "from .mod import x\n",
        },
    )
    graph = import_graph(pkg)
    assert graph["pkg.top"] == {"pkg.sub", "pkg.sub.mod"}
    assert graph["pkg.sub.other"] == {"pkg.sub.mod"}
    assert find_cycles(graph) == [["pkg.sub", "pkg.top", "pkg.sub"]]


def test_c_imports_no_python_module():
    """Data flows one way: the C boundary (csrc/) imports no Python module -- neither the
    package's (the layer call reads no diffkv.adapter object) nor torch's (tensors come in
    through DLPack, the fallback's to_dlpack is handed over by diffkv/__init__.py)."""
    root = Path(__file__).resolve().parent.parent
    offenders = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in sorted((root / "csrc").rglob("*.[ch]"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "PyImport_" in line
    ]
    assert offenders == []
