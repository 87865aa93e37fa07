"""Records between stages are built by keyword: a positional call of a record with five or more
fields reads as a row of values whose meaning hides in the class definition, and silently
reassigns them when a field is added or reordered."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tpo_kernels"
MIN_FIELDS = 5


def _sources():
    # tpo_kernels/bench is the microbenchmark's own harness: its records are its business.
    return sorted(p for p in PACKAGE.rglob("*.py") if "bench" not in p.relative_to(PACKAGE).parts)


def _records() -> dict:
    """Record name -> field names, for the dataclasses and NamedTuples of the package with at
    least MIN_FIELDS fields (a name defined twice is left out: its calls are ambiguous)."""
    found = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
            named_tuple = any("NamedTuple" in ast.unparse(b) for b in node.bases)
            if dataclass or named_tuple:
                fields = [s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                          and not ast.unparse(s.annotation).startswith("ClassVar")]
                found.setdefault(node.name, []).append(fields)
    return {name: defs[0] for name, defs in found.items() if len(defs) == 1 and len(defs[0]) >= MIN_FIELDS}


RECORDS = _records()


def test_the_records_are_found():
    """The scan sees the records the stages hand over (a scan that finds none cannot fail)."""
    assert {"Plan", "PreparedBatch", "BatchLayout", "GroupResult", "RowSummary", "Options"} <= set(RECORDS)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_records_are_built_by_keyword(path):
    positional = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        if name in RECORDS and node.args:
            positional.append(f"line {node.lineno}: {name}({len(node.args)} positional)")
    assert not positional, f"{path.name} builds records positionally: {positional}"
