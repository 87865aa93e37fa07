"""Test configuration: Triton kernels run under the CPU interpreter when there is no GPU, the
tests import the installed package when the tree they sit in is an unbuilt source tree, and the
tree's ``bench`` (experiments run from a clone) is importable either way."""

import importlib.util
import os
import sys
from pathlib import Path

import torch


def _prefer_the_installed_package() -> None:
    """In an unpacked sdist (a tree whose tpo_kernels has no built extension), ``python -m pytest``
    puts the tree first on sys.path and would test its unbuilt sources: drop the tree from the path
    when an installed tpo_kernels is found without it."""
    root = Path(__file__).resolve().parents[1]
    tree = root / "tpo_kernels"
    if not tree.is_dir() or any(tree.glob("_C_cpu*")):
        return
    kept = [p for p in sys.path if Path(p or os.getcwd()).resolve() != root]
    saved, sys.path[:] = list(sys.path), kept
    spec = importlib.util.find_spec("tpo_kernels")
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parent == tree:
        sys.path[:] = saved  # no installed package (or an editable one): test the tree


def _the_workshop_importable() -> None:
    """``bench`` (the experiments the tests run) is never installed: the tree's root goes last on
    sys.path when absent (plain ``pytest`` adds only tests/; the installed-package choice above
    may have dropped the root), after any installed tpo_kernels."""
    root = Path(__file__).resolve().parents[1]
    if (root / "bench" / "__init__.py").is_file() and \
            all(Path(p or os.getcwd()).resolve() != root for p in sys.path):
        sys.path.append(str(root))


_prefer_the_installed_package()
_the_workshop_importable()

if not torch.cuda.is_available():
    # Must be set before triton is imported anywhere.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# The shared helpers (tests/_*.py) assert too: pytest rewrites their asserts as it does the tests',
# so a failing comparison inside one shows its values. Registered before any of them is imported.
pytest.register_assert_rewrite(*sorted(path.stem for path in Path(__file__).parent.glob("_*.py")))

import tpo_kernels  # noqa: E402
from _backends import HAS_GPU  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, tokenizer) of the tiny OLMo2 the TRL tests train (tests/_trl_tiny.py),
    saved once per test module."""
    from _trl_tiny import build_tiny_olmo2  # noqa: PLC0415 - needs transformers: only where used

    path = tmp_path_factory.mktemp("tiny_olmo2")
    return str(path), build_tiny_olmo2(str(path))
