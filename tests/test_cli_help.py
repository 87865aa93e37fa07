"""The command line's help: plain text, printed without importing torch, each in a fresh process."""

import os
import pathlib
import subprocess
import sys

import pytest

import tpo_kernels

pytestmark = pytest.mark.quick

_HELP = """
import sys
from tpo_kernels import cli
try:
    cli.main(sys.argv[1:])
except SystemExit:
    pass
print("TORCH_IMPORTED" if "torch" in sys.modules else "NO_TORCH")
"""


def _help(*args):
    env = dict(os.environ)  # the child imports the tpo_kernels this test imported (tree or installed)
    package_parent = str(pathlib.Path(tpo_kernels.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", _HELP, *args], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("args", [["--help"], ["check", "--help"], ["demo", "--help"], ["status", "--help"],
                                  ["bench", "--help"]],
                         ids=["main", "check", "demo", "status", "bench"])
def test_help_does_not_import_torch(args):
    out = _help(*args)
    assert out.rstrip().endswith("NO_TORCH") and "usage: tpo-kernels" in out


def test_check_help_states_the_exit_statuses():
    assert "1 a numerical failure, 2 a usage error" in " ".join(_help("check", "--help").split())


def test_bench_help_is_plain_text():
    out = _help("bench", "--help")
    assert "usage: tpo-kernels bench" in out and "examples:" in out
    assert "``" not in out and "::" not in out
