"""``python -m bench.compare BASE`` (bench/compare/): the base commit is built in a temporary git
worktree, each side is timed in fresh processes that import their own tree, every case gets both
sides' medians, the ratio and its spread (or n/a with the reason where a side cannot run it), and the
worktree is gone afterwards, however the comparison ends.

One real comparison of HEAD against itself at the tiny shape (one round, a few cases) serves the
tests that need one: it builds the base's CPU extension (about 20 s on 2 cores). Its timings are
not checked: times on shared cores are no test."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def _git_checkout() -> bool:
    try:
        return _git("rev-parse", "--is-inside-work-tree") == "true" and (ROOT / "bench" / "compare").is_dir()
    except (OSError, subprocess.CalledProcessError):
        return False


pytestmark = [
    pytest.mark.skipif(not _git_checkout(), reason="bench.compare builds the base from git: needs a git checkout"),
    pytest.mark.skipif(importlib.util.find_spec("pybind11") is None, reason="building the base needs pybind11"),
]

# One case per kind of path: the native backend's logits loss, the cached fused head, the group stage
# alone on the torch backend and, with Triton installed, a launch under its interpreter.
CASES = ["tpo_loss/cpu", "fused_linear_tpo_loss/cpu/cached", "tpo_loss_from_logprobs/torch"]
if importlib.util.find_spec("triton") is not None:
    CASES.append("selective_logprobs/triton-interp")


def _compare(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run([sys.executable, "-m", "bench.compare", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """(the finished process, its --json record) of HEAD against HEAD, tiny and quick."""
    out = tmp_path_factory.mktemp("compare") / "result.json"
    proc = _compare("HEAD", "--quick", "--rounds", "1", "--warmup", "0", "--repeats", "1", "--device", "cpu",
                    "--cases", ",".join(CASES), "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def _processes(result, side):
    return [p for p in result["processes"] if p["side"] == side]


def test_the_base_process_imports_the_built_worktree_of_the_base_commit(comparison):
    _, result = comparison
    base_tree = Path(result["base"]["tree"])
    assert result["base"]["commit"] == _git("rev-parse", "HEAD")  # the worktree's rev-parse, taken before removal
    for process in _processes(result, "base"):
        assert process["build_info"]["commit"] == result["base"]["commit"]
        assert Path(process["package_file"]).is_relative_to(base_tree)
        assert process["cwd"] == str(base_tree)


def test_the_head_process_imports_the_current_checkout(comparison):
    _, result = comparison
    for process in _processes(result, "head"):
        assert Path(process["package_file"]).is_relative_to(ROOT.resolve())


def test_each_side_runs_in_a_fresh_process_of_its_own(comparison):
    _, result = comparison
    pids = [p["pid"] for p in result["processes"]]
    assert sorted(p["side"] for p in result["processes"]) == ["base", "head"]
    assert len(set(pids)) == len(pids) and os.getpid() not in pids


def test_the_processes_wait_passively_unless_the_caller_chose_a_policy(comparison):
    """libgomp's spinning threads take the cores from the cpu backend's on a loaded machine."""
    _, result = comparison
    expected = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    assert [p["omp_wait_policy"] for p in result["processes"]] == [expected, expected]


def test_every_case_has_both_medians_the_ratio_and_its_spread(comparison):
    proc, result = comparison
    assert [c["case"] for c in result["cases"]] == CASES
    for case in result["cases"]:
        assert case["base_ms"] > 0 and case["head_ms"] > 0
        assert case["ratio_min"] <= case["ratio"] <= case["ratio_max"]
        number = r"\d+\.\d+"
        row = rf"^{re.escape(case['case'])}\s+{number}\s+{number}\s+{number}\s+{number}-{number}"
        assert re.search(row, proc.stdout, re.MULTILINE), proc.stdout


def test_the_output_names_each_sides_commit_and_the_thread_count(comparison):
    proc, result = comparison
    commit = result["base"]["commit"][:12]
    assert f"base: HEAD = {commit}" in proc.stdout
    assert f"built from {commit}" in proc.stdout
    assert "torch threads [2]" in proc.stdout


def test_the_worktree_is_removed_afterwards(comparison):
    _, result = comparison
    base_tree = Path(result["base"]["tree"])
    assert not base_tree.exists() and not base_tree.parent.exists()  # the temporary folder too
    assert f"worktree {base_tree}" not in _git("worktree", "list", "--porcelain").splitlines()


def test_an_interrupted_comparison_removes_the_worktree():
    from bench.compare.worktree import base_worktree, listed

    with pytest.raises(KeyboardInterrupt):
        with base_worktree(ROOT, _git("rev-parse", "HEAD")) as tree:
            assert listed(ROOT, tree) and (tree / "setup.py").is_file()
            raise KeyboardInterrupt
    assert not tree.parent.exists() and not listed(ROOT, tree)


def test_a_base_that_is_no_commit_stops_before_any_worktree():
    before = _git("worktree", "list", "--porcelain")
    proc = _compare("no-such-ref-anywhere", timeout=120)
    assert proc.returncode == 2
    assert "BASE 'no-such-ref-anywhere' names no commit" in proc.stderr
    assert _git("worktree", "list", "--porcelain") == before


def test_a_case_one_side_cannot_run_is_na_with_the_reason():
    from bench.compare.report import summarize, table

    def process(side, cases):
        return {"side": side, "round": 0, "cases": cases}

    timed = {"seconds": 0.01, "cpu_seconds": 0.02}
    missing = {"error": "TypeError: tpo_loss() got an unexpected keyword argument 'logits_cache_bytes'"}
    processes = [process("base", {"a": timed, "b": missing}), process("head", {"a": timed, "b": timed})]
    cases = summarize(["a", "b"], processes)
    assert cases[0]["ratio"] == 1.0 and "na" not in cases[0]
    assert cases[1]["ratio"] is None and cases[1]["na"] == f"base: {missing['error']}"
    lines = table(cases)
    assert re.search(r"^b\s+n/a\s+10\.0+\s+n/a$", "\n".join(lines), re.MULTILINE), lines
    assert f"  b: base: {missing['error']}" in lines
