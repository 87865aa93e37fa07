"""The layering the design promises (DESIGN.md section 2): ops/ and distributed/ are leaves below
the pipeline. ops/ imports neither distributed/ nor checks/, and neither raises the
ValueError / TypeError of a user-input check (those live in checks/). backends/ is the bottom:
it imports nothing of the package above it (only group_math, the portable group op)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tpo_kernels"


def _modules(folder: str):
    return sorted((PACKAGE / folder).rglob("*.py"))


def _imports(path: pathlib.Path):
    """Absolute module names a file imports (relative imports resolved)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


@pytest.mark.parametrize("path", _modules("ops"), ids=lambda p: p.name)
def test_ops_imports_neither_distributed_nor_validation(path):
    forbidden = [name for name in _imports(path)
                 if name.startswith(("tpo_kernels.distributed", "tpo_kernels.checks", "tpo_kernels.functional"))]
    assert not forbidden, f"{path.name} imports {forbidden}"


@pytest.mark.parametrize("path", _modules("backends"), ids=lambda p: p.name)
def test_backends_import_nothing_above_them(path):
    above = ("tpo_kernels.checks", "tpo_kernels.ops", "tpo_kernels.distributed",
             "tpo_kernels.functional", "tpo_kernels.integrations")
    forbidden = [name for name in _imports(path) if name.startswith(above)]
    assert not forbidden, f"{path.name} imports {forbidden}"


@pytest.mark.parametrize("path", _modules("ops") + _modules("distributed"), ids=lambda p: p.name)
def test_no_user_input_checks_below_the_pipeline(path):
    raised = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
              and getattr(node.exc.func, "id", None) in ("ValueError", "TypeError")]
    assert not raised, f"{path.name} raises ValueError/TypeError at lines {raised}: move the check to checks/"


def test_distributed_holds_no_autograd_function():
    for path in _modules("distributed"):
        tree = ast.parse(path.read_text())
        bases = [ast.unparse(b) for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for b in node.bases]
        assert not any("autograd.Function" in b for b in bases), path.name


@pytest.mark.parametrize("path", _modules("checks") + _modules("plan"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_check_pass_and_its_checks_import_no_distributed(path):
    """The plan resolves the vocabulary itself (plan/vocabulary.py); distributed/ may read the plan,
    never the reverse: no import circle between the packages. checks/ holds primitive checks and
    imports nothing of plan/."""
    above = ("tpo_kernels.distributed", "tpo_kernels.functional") + (
        ("tpo_kernels.plan",) if path.parent.name == "checks" else ())
    forbidden = [name for name in _imports(path) if name.startswith(above)]
    assert not forbidden, f"{path.name} imports {forbidden}"
