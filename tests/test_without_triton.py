"""Triton is not a requirement of the package (pyproject.toml: only the [test] extra brings it):
everything but the ``triton`` backend works where ``import triton`` fails.

Each check runs in a fresh process whose first act replaces the path finder of ``sys.meta_path`` by
one that does not find ``triton`` (or a submodule): ``importlib.util.find_spec("triton")`` is None and
``import triton`` raises ModuleNotFoundError, as on a machine without it."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import tpo_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]

BLOCK_TRITON = textwrap.dedent("""
    import importlib.machinery
    import sys

    class _PathFinderWithoutTriton(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                return None
            return super().find_spec(name, path, target)

    sys.meta_path[:] = [_PathFinderWithoutTriton if finder is importlib.machinery.PathFinder else finder
                        for finder in sys.meta_path]
""")


def run_without_triton(code: str, *, interpret: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)  # the child imports the tpo_kernels this test imported (tree or installed)
    package_parent = str(pathlib.Path(tpo_kernels.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    if interpret:
        env["TRITON_INTERPRET"] = "1"  # asks for the Triton backend on CPU: it must still be refused
    else:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", BLOCK_TRITON + textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_the_hook_blocks_triton():
    """The premise of the other tests: in the child, Triton looks not installed."""
    result = run_without_triton("""
        import importlib.util
        print("spec:", importlib.util.find_spec("triton"))
        try:
            import triton
        except ModuleNotFoundError as exc:
            print("blocked:", exc)
    """)
    assert result.returncode == 0, result.stderr
    assert "spec: None" in result.stdout and "blocked: No module named 'triton'" in result.stdout


@pytest.mark.parametrize("backend", ["torch", "cpu", "auto"])
def test_losses_run_without_triton(backend):
    """tpo_loss (against the reference), fused_linear_tpo_loss and token_tpo_loss, forward and
    backward, on a backend that does not use Triton."""
    result = run_without_triton(f"""
        import torch
        import tpo_kernels
        from tpo_kernels import reference

        backend = {backend!r}
        if backend != "torch" and tpo_kernels.backend_status()["cpu"] != "available":
            print("SKIP cpu extension:", tpo_kernels.backend_status()["cpu"])
            raise SystemExit(0)
        torch.manual_seed(0)
        N, T, V, H, K = 4, 5, 11, 8, 2
        labels = torch.randint(0, V, (N, T))
        scores = torch.tensor([1.0, 0.0, 0.5, 0.25])
        logits = torch.randn(N, T, V, dtype=torch.float64, requires_grad=True)
        loss = tpo_kernels.tpo_loss(logits, labels, scores, group_size=K, backend=backend)
        grad, = torch.autograd.grad(loss, logits)
        expected = reference.tpo_loss(logits, labels, scores, group_size=K)
        expected_grad, = torch.autograd.grad(expected, logits)
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(grad, expected_grad)

        hidden = torch.randn(N, T, H, requires_grad=True)
        weight = torch.randn(V, H, requires_grad=True)
        tpo_kernels.fused_linear_tpo_loss(hidden, weight, labels, scores, group_size=K, backend=backend).backward()
        assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()

        candidates = torch.randint(0, V, (6, 3))
        states = torch.randn(6, V, requires_grad=True)
        tpo_kernels.token_tpo_loss(states, candidates, torch.randn(6, 3), backend=backend).backward()
        assert torch.isfinite(states.grad).all()
        print("ran on", backend)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    if "SKIP cpu extension" in result.stdout:
        pytest.skip(result.stdout.strip())
    assert f"ran on {backend}" in result.stdout


def test_status_command_reports_triton_missing():
    """``tpo-kernels status`` runs, says Triton is not installed and names the reason the triton
    backend is not usable; the others keep their own status."""
    result = run_without_triton("""
        import runpy
        sys.argv = ["tpo-kernels", "status"]
        runpy.run_module("tpo_kernels.cli", run_name="__main__")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "triton not installed" in lines[0], result.stdout
    triton_line = next(line for line in lines if line.split()[:1] == ["triton"])
    assert "not importable: No module named 'triton'" in triton_line, result.stdout
    torch_line = next(line for line in lines if line.split()[:1] == ["torch"])
    assert torch_line.split()[1] == "available", result.stdout


def test_triton_backend_refused_with_the_reason():
    """Asking for backend="triton" explicitly raises one clear error naming the missing module."""
    result = run_without_triton("""
        import torch
        import tpo_kernels

        logits = torch.randn(2, 3, 7)
        try:
            tpo_kernels.tpo_loss(logits, torch.zeros(2, 3, dtype=torch.long), torch.tensor([1.0, 0.0]),
                                 group_size=2, backend="triton")
        except RuntimeError as exc:
            print("refused:", exc)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: backend 'triton' is not usable here: not importable: No module named 'triton'" in result.stdout


@pytest.mark.skipif(not (ROOT / "pyproject.toml").is_file(), reason="not a source tree")
def test_triton_is_a_test_extra_not_a_requirement():
    """pyproject.toml: Triton is not in the package's dependencies; the [test] extra brings it
    (Linux) for the interpreter tests, with pybind11 and setuptools for the build checks."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("triton")]
    test_extra = project["optional-dependencies"]["test"]
    names = {re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower() for d in test_extra}
    assert {"pytest", "hypothesis", "pybind11", "setuptools", "triton"} <= names
    assert any(d.startswith("triton") and "platform_system == 'Linux'" in d for d in test_extra)


def test_check_command_passes_without_triton():
    """``tpo-kernels check`` (a tiny shape) runs every backend that runs here against the reference
    and passes, the triton backend left out."""
    result = run_without_triton("""
        import runpy
        sys.argv = ["tpo-kernels", "check", "--device", "cpu", "--no-gradcheck", "--no-edge-cases",
                    "-N", "4", "-K", "2", "-T", "4", "-V", "32", "-H", "8"]
        runpy.run_module("tpo_kernels.cli", run_name="__main__")
    """)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert re.search(r"\d+ checks, 0 failed, .*: PASS", result.stdout + result.stderr), result.stdout[-2000:]
