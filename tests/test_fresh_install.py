"""CI's fresh-install job (.ci/fresh_install.sh) runs the README's own install block and test command
in a new venv: what it would run is read from README.md, so the two cannot drift."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from _backends import ROOT

SCRIPT = ROOT / ".ci" / "fresh_install.sh"
README = ROOT / "README.md"
pytestmark = pytest.mark.skipif(not (SCRIPT.is_file() and README.is_file()) or shutil.which("bash") is None,
                                reason="not a source tree with .ci/ and README.md, or no bash")


def _readme_block(section: str) -> list:
    text = README.read_text()
    body = re.search(rf"^## {section}\n(.*?)(?=^## )", text, re.S | re.M).group(1)
    return re.search(r"^```bash\n(.*?)^```", body, re.S | re.M).group(1).splitlines()


def _printed_commands() -> list:
    out = subprocess.run(["bash", str(SCRIPT), "--print-commands"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if not line.startswith(("set ", "step"))]


def test_the_job_runs_the_readme_install_block_and_quick_test_line_as_written():
    commands = _printed_commands()
    install = [line for line in _readme_block("Install") if line.strip() and not line.lstrip().startswith("#")]
    clone = re.compile(r"git clone \S+ tpo_kernels && cd tpo_kernels")
    assert clone.fullmatch(commands[0]) and install[0] == "git clone <this repository> tpo_kernels && cd tpo_kernels"
    assert commands[1:len(install)] == install[1:]  # every other line verbatim, in order
    quick = [line for line in _readme_block("Tests") if " -m quick" in line]
    assert len(quick) == 1 and commands[len(install)] == quick[0]
    assert commands[len(install) + 1] == "python -m pytest -q --collect-only tests > /dev/null"


def test_every_extra_test_target_exists():
    """Each FRESH_TESTS target after the quick line names an existing file (and test function)."""
    targets = _printed_commands()[-1].split()[5:]
    assert "tests/test_native_build.py" in targets and "tests/test_without_triton.py" in targets
    for target in targets:
        path, _, function = target.partition("::")
        assert (ROOT / path).is_file(), target
        assert not function or re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.M), target


def test_install_block_installs_the_cpu_wheel_and_names_the_gpu_line():
    """Copied as it is on a CPU-only machine without torch, the block installs torch's CPU wheel
    (an unpinned ``pip install torch`` would pull the multi-GB CUDA build) before the package; the
    GPU machine's line sits beside it, commented."""
    block = _readme_block("Install")
    torch_lines = [i for i, line in enumerate(block) if re.match(r"pip install torch\b", line)]
    package = next(i for i, line in enumerate(block) if line.startswith('pip install -e ".[test]"'))
    assert len(torch_lines) == 1 and torch_lines[0] < package
    assert "--index-url https://download.pytorch.org/whl/cpu" in block[torch_lines[0]]
    assert any(re.match(r"# pip install torch\S*\s+# .*GPU", line) for line in block)


def test_ci_runs_the_job_before_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in ci if line.strip() and not line.strip().startswith("#")]
    job = [i for i, c in enumerate(commands) if c.startswith("bash .ci/fresh_install.sh")]
    assert job and max(job) < commands.index("python3 -m pytest -q tests")
