"""bench/gpu_check.sh without a GPU: the dry run of both stages (the plan, each step's time budget
within the 5-minute limit, the presets it names exist, the versions CI tests), and both stages run
end to end with a stand-in Python that records what it is asked to run and with which
TPO_CUDA_ARCHS (order of the steps, pytest's -rfE and -k arguments intact, no CPU-only test file
in either stage, one CUDA arch for the build and the tests, benchmarks before the long tail of
tests, time limits enforced)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
VERSIONS = ROOT / "bench" / "gpu_machine_versions.txt"
PYTHON = os.environ.get("PYTHON", "python3")


def _run(args, env=None, timeout=120):
    return subprocess.run(["bash", str(SCRIPT)] + args, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _plan(output):
    """{step: seconds} from the dry run's table."""
    steps = {}
    for line in output.splitlines():
        m = re.match(r"^  (\S+)\s+(\d+)s(?:  |$)", line)
        if m:
            steps[m.group(1)] = int(m.group(2))
    return steps


@pytest.mark.parametrize("stage", [1, 2])
def test_dry_run_prints_the_plan_and_budgets(stage, tmp_path):
    out = tmp_path / "out"
    proc = _run(["--dry-run", "--stage", str(stage), str(out)], env={"PYTHON": PYTHON, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = _plan(proc.stdout)
    total = steps.pop("total")
    assert total <= 295 and sum(steps.values()) == total
    assert not out.exists(), "a dry run must not write anything"
    if stage == 1:
        assert list(steps) == ["env", "build", "status", "gpu-tests", "bench-logits"]
        assert "-rfE" in proc.stdout and "logits-speedup-gpu" in proc.stdout
        assert "presets found: logits-speedup-gpu (cuda)" in proc.stdout
    else:
        assert list(steps) == ["env", "check-build", "bench-fused", "bench-token", "rest-tests"]
        assert "build_ext" not in proc.stdout  # stage 2 never rebuilds
        assert "presets found: fused-linear-gpu (cuda), token-level-speedup-gpu (cuda)" in proc.stdout
    pins = [line for line in VERSIONS.read_text().splitlines() if line and not line.startswith("#")]
    assert {p.split("==")[0] for p in pins} >= {"torch", "triton", "numpy", "setuptools"}
    assert f"versions CI's compatibility job tests ({VERSIONS.name}): {' '.join(pins)}" in proc.stdout


def test_bad_arguments():
    assert _run(["--stage", "3", "/tmp/x"]).returncode == 2
    assert _run(["--dry-run", "/tmp/x"]).returncode == 2


FAKE_PYTHON = """#!/usr/bin/env bash
# records its arguments and TPO_CUDA_ARCHS (one JSON object per line) and pretends: pytest sleeps
# FAKE_PYTEST_SLEEP; the GPU's compute capability is FAKE_CAPABILITY
printf '%s\\0' "$@" | python3 -c 'import json,os,sys; print(json.dumps({"args": sys.stdin.read().split(chr(0))[:-1], "archs": os.environ.get("TPO_CUDA_ARCHS")}))' >> "$FAKE_LOG"
case " $* " in
  *get_device_capability*) echo "${FAKE_CAPABILITY:-90}" ;;
  *" pytest "*) sleep "${FAKE_PYTEST_SLEEP:-0}"; echo "3 passed in 0.01s" ;;
  *" tpo_kernels.bench "*) echo "Targets:"; echo "[PASS] fake target"; echo ;;
  *) cat > /dev/null 2>&1 < /dev/null; echo ok ;;
esac
"""


def _fake_env(tmp_path, **extra):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    return {"PYTHON": str(fake), "FAKE_LOG": str(log), "GPU_CHECK_SKIP_BUILD": "1", **extra}, log


def _records(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def _calls(log):
    return [record["args"] for record in _records(log)]


def test_both_stages_run_their_steps_in_order(tmp_path):
    env, log = _fake_env(tmp_path)
    out = tmp_path / "out"
    first = _run(["--stage", "1", str(out)], env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    summary = (out / "stage1" / "summary.txt").read_text()
    for name in ("env", "build", "status", "gpu-tests", "bench-logits"):
        assert re.search(rf"\] {name}: rc=0", summary), summary
    assert "skipped (GPU_CHECK_SKIP_BUILD=1)" in summary and "[PASS] fake target" in summary
    calls = _calls(log)
    pytest_calls = [c for c in calls if "pytest" in c]
    assert len(pytest_calls) == 1
    assert "-rfE" in pytest_calls[0] and pytest_calls[0][pytest_calls[0].index("-k") + 1] == "gpu or triton or cuda"
    bench = [c for c in calls if "tpo_kernels.bench" in c]
    assert len(bench) == 1 and bench[0][bench[0].index("--preset") + 1] == "logits-speedup-gpu"
    assert int(bench[0][bench[0].index("--budget") + 1]) <= 110 - 35
    assert calls.index(pytest_calls[0]) < calls.index(bench[0])

    log.unlink()
    second = _run(["--stage", "2", str(out)], env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    summary = (out / "stage2" / "summary.txt").read_text()
    calls = _calls(log)
    assert not any("setup.py" in c for c in calls), "stage 2 rebuilt"
    presets = [c[c.index("--preset") + 1] for c in calls if "tpo_kernels.bench" in c]
    assert presets == ["fused-linear-gpu", "token-level-speedup-gpu"]
    tests = [c for c in calls if "pytest" in c]
    assert len(tests) == 1 and tests[0][tests[0].index("-k") + 1] == "not (gpu or triton or cuda)"
    assert max(i for i, c in enumerate(calls) if "tpo_kernels.bench" in c) < calls.index(tests[0])  # benchmarks first
    assert "rest-tests: rc=0" in summary and "3 passed" in summary and "done in" in summary


def test_a_step_past_its_time_limit_is_stopped_and_the_stage_ends_on_time(tmp_path):
    env, log = _fake_env(tmp_path, FAKE_PYTEST_SLEEP="60", GPU_CHECK_BUDGET="30")
    out = tmp_path / "out"
    proc = _run(["--stage", "2", str(out)], env=env, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "stage2" / "summary.txt").read_text()
    assert re.search(r"rest-tests: rc=124 \(time limit\)", summary), summary
    elapsed = int(re.search(r"done in (\d+)s", summary).group(1))
    assert elapsed <= 30


CPU_ONLY_TEST_FILES = ("tests/test_gpu_check.py", "tests/test_kernel_report.py", "tests/test_bench.py")


def test_neither_stage_runs_the_cpu_only_test_files(tmp_path):
    """Stage 1's -k 'gpu or triton or cuda' matches these files by name (test_gpu_check.py whole,
    the kernel report's Triton tests), yet they need no GPU and CI runs them: both stages leave
    them out."""
    env, log = _fake_env(tmp_path)
    for stage in ("1", "2"):
        assert _run(["--stage", stage, str(tmp_path / "out")], env=env).returncode == 0
    tests = [c for c in _calls(log) if "pytest" in c]
    assert len(tests) == 2
    for call in tests:
        for path in CPU_ONLY_TEST_FILES:
            assert (ROOT / path).is_file() and f"--ignore={path}" in call, (path, call)


@pytest.mark.parametrize("preset", [None, "80"])
def test_the_cuda_arch_is_decided_once_for_the_build_and_the_tests(tmp_path, preset):
    """The build compiles for the GPU's own arch (or TPO_CUDA_ARCHS when set), and the tests that
    check the build's cubins see the same TPO_CUDA_ARCHS."""
    env, log = _fake_env(tmp_path, FAKE_CAPABILITY="86", GPU_CHECK_SKIP_BUILD="0")
    env["TPO_CUDA_ARCHS"] = preset or ""
    proc = _run(["--stage", "1", str(tmp_path / "out")], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = _records(log)
    build = [r for r in records if "setup.py" in r["args"]]
    tests = [r for r in records if "pytest" in r["args"]]
    assert len(build) == 1 and len(tests) == 1
    assert build[0]["archs"] == tests[0]["archs"] == (preset or "86")


def test_ci_runs_the_compatibility_job_on_the_versions_gpu_check_prints():
    """.ci/run runs .ci/gpu_compat.sh before the test suite; the job installs the versions file
    that gpu_check's env step compares against (one file), and every test file it names exists."""
    commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    compat = [i for i, c in enumerate(commands) if c.startswith("bash .ci/gpu_compat.sh")]
    assert compat and compat[0] < commands.index("python3 -m pytest -q tests")
    job = (ROOT / ".ci" / "gpu_compat.sh").read_text()
    assert f"VERSIONS={VERSIONS.relative_to(ROOT)}\n" in job and '-r "$VERSIONS"' in job
    assert f'VERSIONS="$REPO/{VERSIONS.relative_to(ROOT)}"' in SCRIPT.read_text()
    listed = re.search(r"COMPAT_TESTS=\(\n(.*?)\n\)", job, re.S).group(1).split()
    assert listed and all((ROOT / target.split("::")[0]).is_file() for target in listed), listed
