"""The package's imports run one way: no circle between sibling packages or modules, and no import
that runs back up (a module of a subpackage importing a module above it that imports the subpackage).

The graph is read from the source with ``ast``, not by importing: every ``import`` and ``from ...
import`` of every module of ``tpo_kernels``, at module level and inside functions (both run, the
latter later), relative ones resolved; ``from A import B`` is an edge to ``A.B`` when that is a
module, else to ``A``. Imports under ``if TYPE_CHECKING:`` never run and are left out; so are the
parent packages' ``__init__`` that Python runs before a module (every module would otherwise import
its parents), and ``importlib`` calls (``tpo_kernels/__init__.py`` loads its public names so).

``python tests/test_import_layers.py`` prints every circle and every import back up.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import pathlib
import sys
import textwrap
from collections import defaultdict
from typing import Dict, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "tpo_kernels"


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted
    file: str  # the importing module's file, from the repository root
    line: int
    in_function: bool  # inside a def: runs when the function is called

    def __str__(self) -> str:
        where = "in a function" if self.in_function else "module level"
        return f"{self.source} -> {self.target} ({self.file}:{self.line}, {where})"


def package_modules(root: pathlib.Path = ROOT, package: str = PACKAGE) -> Dict[str, pathlib.Path]:
    """Dotted name -> file of every module of ``package`` (a package is its ``__init__.py``)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: pathlib.Path, modules: Dict[str, pathlib.Path], root: pathlib.Path = ROOT
               ) -> List[Import]:
    """The imports of ``module`` that land in its top package, resolved to modules of ``modules``."""
    is_package = path.name == "__init__.py"
    package = module.split(".")[0]
    file = path.relative_to(root).as_posix()
    found: List[Import] = []

    def resolve(name: str) -> str:  # the module itself, else its nearest enclosing package
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is the module's own package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, inner)
            return
        for target in dict.fromkeys(targets):
            if target == package or target.startswith(package + "."):
                target = resolve(target)
                if target != module:
                    found.append(Import(source=module, target=target, file=file, line=node.lineno,
                                        in_function=in_function))

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def import_graph(root: pathlib.Path = ROOT, package: str = PACKAGE) -> List[Import]:
    modules = package_modules(root, package)
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules, root)]


def _package_of(module: str, modules) -> str:
    """The package a module belongs to: itself for a package, else its parent."""
    return module if modules[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def sibling_edges(imports: List[Import]) -> Dict[Tuple[str, str], List[Import]]:
    """Each import between two siblings of one package (modules or subpackages, a subpackage
    standing for everything in it), keyed by (importing sibling, imported sibling)."""
    edges = defaultdict(list)
    for imp in imports:
        a, b = imp.source.split("."), imp.target.split(".")
        common = len(list(itertools.takewhile(lambda pair: pair[0] == pair[1], zip(a, b))))
        if common < len(a) and common < len(b):  # not a parent package's __init__ on either side
            edges[(".".join(a[:common + 1]), ".".join(b[:common + 1]))].append(imp)
    return edges


def circles(edges: Dict[Tuple[str, str], List[Import]]) -> List[List[str]]:
    """Every elementary circle of the sibling graph, each once, starting at its smallest name."""
    graph: Dict[str, Set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    found = []

    def walk(start: str, path: List[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                found.append(list(path))
            elif nxt > start and nxt not in path:
                walk(start, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def imports_back_up(imports: List[Import], modules) -> List[Tuple[Import, List[Import]]]:
    """Each import from a module of a subpackage S to a module above S (in a package that holds S)
    that itself imports something in S, with those imports."""
    by_source = defaultdict(list)
    for imp in imports:
        by_source[imp.source].append(imp)
    found = []
    for imp in imports:
        sub = _package_of(imp.source, modules)
        above = _package_of(imp.target, modules)
        if _within(imp.target, sub) or not _within(sub, above) or above == sub:
            continue
        back = [b for b in by_source[imp.target] if _within(b.target, sub)]
        if back:
            found.append((imp, back))
    return found


def layer_problems(root: pathlib.Path = ROOT, package: str = PACKAGE) -> Tuple[List[str], List[str]]:
    """(circles, imports back up), each as readable lines with the imports that make it."""
    modules = package_modules(root, package)
    imports = import_graph(root, package)
    edges = sibling_edges(imports)
    circle_lines = []
    for circle in circles(edges):
        hops = zip(circle, circle[1:] + circle[:1])
        circle_lines.append(" <-> ".join(circle) + ": " + "; ".join(str(imp) for hop in hops for imp in edges[hop]))
    back_lines = [f"{imp}, which imports back: " + "; ".join(str(b) for b in back)
                  for imp, back in imports_back_up(imports, modules)]
    return circle_lines, back_lines


# Circles known and left, each a substring of its line. Inside plan/: the vocabulary resolution
# reads is_dtensor from the check pass, which imports it back only for a sharded vocabulary (in a
# function); is_dtensor stays in plan/call.py because every call's check pass asks it, and a call
# into another file would be two more hops of the check pass on every call.
KNOWN: Tuple[str, ...] = ("tpo_kernels.plan.call <-> tpo_kernels.plan.vocabulary",)


def _not_known(lines: List[str]) -> List[str]:
    return [line for line in lines if not any(known in line for known in KNOWN)]


def _write_package(root: pathlib.Path, files: Dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


# A package with one circle (pkg.a <-> pkg.sub) made of an import back up (pkg.sub.c -> pkg.a).
_TANGLED = {
    "pkg/__init__.py": "",
    "pkg/a.py": """
        from typing import TYPE_CHECKING
        from . import b
        from .sub import c

        if TYPE_CHECKING:
            from . import d

        def later():
            from .sub.c import thing
        """,
    "pkg/b.py": "import os\n",
    "pkg/d.py": "",
    "pkg/sub/__init__.py": "",
    "pkg/sub/c.py": "from .. import b\nfrom ..a import later\nthing = 1\n",
}


def test_graph_resolves_relative_imports_at_module_and_function_level(tmp_path):
    """Relative imports resolve to modules (a name that is not a module: to its package), at module
    level and inside functions; what runs only under TYPE_CHECKING and outside the package is left out."""
    _write_package(tmp_path, _TANGLED)
    edges = {(i.source, i.target, i.in_function) for i in import_graph(tmp_path, "pkg")}
    assert edges == {("pkg.a", "pkg.b", False), ("pkg.a", "pkg.sub.c", False), ("pkg.a", "pkg.sub.c", True),
                     ("pkg.sub.c", "pkg.b", False), ("pkg.sub.c", "pkg.a", False)}


def test_layer_problems_name_the_circle_and_the_import_back_up(tmp_path):
    _write_package(tmp_path, _TANGLED)
    circle_lines, back_lines = layer_problems(tmp_path, "pkg")
    assert [line.split(":")[0] for line in circle_lines] == ["pkg.a <-> pkg.sub"]
    assert len(back_lines) == 1 and back_lines[0].startswith("pkg.sub.c -> pkg.a (pkg/sub/c.py:2, module level)")


def test_command_line_imports_the_bench_inside_a_function():
    """``tpo-kernels bench`` loads the harness only when it runs (``--help`` stays light)."""
    assert any(i.source == "tpo_kernels.cli" and i.target == "tpo_kernels.bench.run" and i.in_function
               for i in import_graph())


def test_the_usage_module_is_a_leaf():
    """The command lines' shared usage errors import nothing of the package."""
    assert "tpo_kernels.usage" in package_modules()
    assert [str(i) for i in import_graph() if i.source == "tpo_kernels.usage"] == []


def test_the_bench_never_imports_the_command_line():
    assert [str(i) for i in import_graph()
            if _within(i.source, "tpo_kernels.bench") and i.target == "tpo_kernels.cli"] == []


def test_no_circle_between_sibling_packages_or_modules():
    circle_lines, _ = layer_problems()
    assert _not_known(circle_lines) == []


def test_every_known_circle_is_still_there():
    """A circle removed leaves the known list too, so that it cannot come back unseen."""
    circle_lines, back_lines = layer_problems()
    for known in KNOWN:
        assert any(known in line for line in circle_lines + back_lines), f"{known!r} is gone: drop it from KNOWN"


def test_no_import_runs_back_up():
    _, back_lines = layer_problems()
    assert _not_known(back_lines) == []


if __name__ == "__main__":
    circle_lines, back_lines = layer_problems()
    print(f"{len(circle_lines)} circle(s) between sibling packages or modules:")
    print("\n".join("  " + line for line in circle_lines))
    print(f"{len(back_lines)} import(s) back up:")
    print("\n".join("  " + line for line in back_lines))
    sys.exit(1 if circle_lines or back_lines else 0)
