"""What the experiments of bench/ share (bench/experiment.py): a child ``python -m bench.<name>``
finds both bench and the tpo_kernels imported here from any folder, and the summary statistics and
results files both learning experiments report."""

import json
import os
import subprocess
import sys

import pytest

import tpo_kernels
from bench import experiment as ex


def test_a_child_process_imports_bench_and_the_same_tpo_kernels_from_any_folder(tmp_path):
    probe = "import bench.experiment, tpo_kernels; print(bench.experiment.__file__); print(tpo_kernels.__file__)"
    env = ex.child_env(TPO_PROBE="1")
    assert env["TPO_PROBE"] == "1"
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert paths[:2] == list(dict.fromkeys([os.path.dirname(os.path.dirname(tpo_kernels.__file__)), ex.REPOSITORY]))
    assert len(paths) == len(set(paths))
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    bench_file, package_file = done.stdout.split()
    assert bench_file == os.path.abspath(ex.__file__) and package_file == os.path.abspath(tpo_kernels.__file__)


def test_bench_importable_in_children_restores_the_environment(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    with ex.bench_importable_in_children():
        assert ex.REPOSITORY in os.environ["PYTHONPATH"].split(os.pathsep)
    assert os.environ["PYTHONPATH"] == "/elsewhere"
    monkeypatch.delenv("PYTHONPATH")
    with ex.bench_importable_in_children():
        pass
    assert "PYTHONPATH" not in os.environ


def test_summary_statistics_of_an_error_curve():
    runs = [{"seed": 1, "curves": {"error": [0.9, 0.5, 0.1, 0.0]}}, {"seed": 0, "curves": {"error": [0.8, 0.7, 0.6]}}]
    assert ex.final_error(runs[0], 2) == pytest.approx(0.05) and ex.final_error(runs[1], 10) == pytest.approx(0.7)
    assert ex.first_at_or_below(runs[0], 0.1) == 3 and ex.first_at_or_below(runs[1], 0.1) is None
    assert ex.median([3, 1, 2]) == 2 and ex.median([4, 1, 2, 3]) == 2.5
    assert ex.median_curve([[1, 2, 3], [3, 4], [2, 0, 9]]) == [2, 2]
    assert [r["seed"] for r in ex.runs_of({"runs": runs})] == [0, 1]
    row = ex.summary_row(ex.runs_of({"runs": runs}), [0.7, 0.05], 0.1, "step")
    assert row == {"seeds": [0, 1], "median_final_error": 0.375, "final_error": [0.7, 0.05],
                   "first_step_at_threshold": [None, 3]}


def test_results_files_round_floats_and_keep_one_line_per_run(tmp_path):
    class Report:
        @staticmethod
        def markdown(results):
            return f"{len(results['runs'])} runs\n"

    results = {"config": {"lr": 1 / 3}, "runs": [{"curves": {"error": [2 / 3]}}, {"curves": {"error": [0.25]}}]}
    paths = ex.write_report(results, str(tmp_path / "out"), Report, "unused.png", plot=False)
    assert [os.path.basename(p) for p in paths] == ["results.json", "results.md"]
    text = open(paths[0]).read()
    assert json.loads(text) == {"config": {"lr": 0.333333}, "runs": [{"curves": {"error": [0.666667]}},
                                                                     {"curves": {"error": [0.25]}}]}
    assert sum(line.strip().startswith('{"curves"') for line in text.splitlines()) == 2
    assert open(paths[1]).read() == "2 runs\n"
    assert ex.command_line("trl_rlvr", ["--smoke"]) == "python -m bench.trl_rlvr --smoke"
