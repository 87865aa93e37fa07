"""Every usage error of the command line (``tpo-kernels check``, ``demo``, ``status``, ``bench``)
ends the command with exit status 2 and one line on stderr naming the option, before any work:
the commands run in-process through ``tpo_kernels.cli.main`` with the work itself replaced by a
function that fails the test if it is reached; one subprocess run proves the console entry's
exit status."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import tpo_kernels
from tpo_kernels import cli, selfcheck
from tpo_kernels.bench import harness


def _unavailable_cuda() -> str:
    """A CUDA device that is not there: cuda without CUDA, else one index past the last device."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def _run(argv, capsys):
    """(exit status, stderr lines, stdout) of ``tpo-kernels *argv`` in this process."""
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.err.splitlines(), captured.out


def _assert_usage_error(argv, capsys, prog, option):
    status, err, out = _run(argv, capsys)
    assert status == 2, (status, err)
    assert len(err) == 1, err
    assert err[0].startswith(f"{prog}: error: ") and option in err[0], err
    assert "Traceback" not in err[0]
    return err[0], out


@pytest.fixture
def no_work(monkeypatch):
    """Every command's work fails the test when reached: the check, the demo's loss, a measurement."""
    def reached(*args, **kwargs):
        raise AssertionError("the command started its work")

    monkeypatch.setattr(selfcheck, "check", reached)
    monkeypatch.setattr(tpo_kernels, "tpo_loss", reached)
    monkeypatch.setattr(harness, "measure", reached)
    monkeypatch.setattr(harness, "run_fresh_worker", reached)


BAD_NUMBERS = ["0", "-1", "inf", "nan"]


# ----------------------------------------------------------------------------- check


@pytest.mark.parametrize("option", ["--eta", "--temperature", "--logit-softcap", "--logit-scale"])
@pytest.mark.parametrize("value", BAD_NUMBERS)
def test_check_refuses_a_bad_hyper_parameter(option, value, capsys, no_work):
    line, out = _assert_usage_error(["check", option, value], capsys, "tpo-kernels check", option)
    assert "finite number > 0" in line and not out


def test_check_refuses_a_soft_cap_outside_float32(capsys, no_work):
    """The library's own rule for the transform's float32 factors: a cap of 1e-39 makes
    logit_scale / logit_softcap overflow float32."""
    line, _ = _assert_usage_error(["check", "--logit-softcap", "1e-39"], capsys, "tpo-kernels check",
                                  "--logit-softcap")
    assert "logit_scale / logit_softcap must lie in" in line


@pytest.mark.parametrize("argv, option", [
    (["--device", _unavailable_cuda()], "--device"),
    (["--device", "nonsense"], "--device"),
    (["--device", "meta"], "--device"),
    (["--backends", "cpuu"], "--backends"),
    (["--backends", "torch,cpuu"], "--backends"),
    (["--paths", "nope"], "--paths"),
    (["--dtype", "float8"], "--dtype"),
    (["-V", "0"], "-V"),
    (["-N", "8", "-K", "3"], "-K"),
    (["--long-tokens", "0"], "--long-tokens"),
    (["-N", "x"], "-N"),
    (["--eta", "x"], "--eta"),
    (["--no-such-option"], "--no-such-option"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_check_refuses_a_bad_option(argv, option, capsys, no_work):
    _assert_usage_error(["check", *argv], capsys, "tpo-kernels check", option)


@pytest.mark.parametrize("where", ["missing_folder", "a_folder", "under_a_file"])
def test_check_refuses_an_unwritable_json_path(where, tmp_path, capsys, no_work):
    (tmp_path / "file").write_text("")
    path = {"missing_folder": tmp_path / "no" / "report.json", "a_folder": tmp_path,
            "under_a_file": tmp_path / "file" / "report.json"}[where]
    _assert_usage_error(["check", "--json", str(path)], capsys, "tpo-kernels check", "--json")
    assert not (tmp_path / "no").exists()


def test_check_library_function_refuses_before_any_work(monkeypatch):
    """tpo_kernels.check itself: an ArgumentError (a ValueError) naming the argument, before inputs exist."""
    def reached(*args, **kwargs):
        raise AssertionError("inputs were made")

    monkeypatch.setattr(selfcheck, "_make_inputs", reached)
    for kwargs, name in ((dict(eta=0.0), "eta"), (dict(temperature=float("inf")), "temperature"),
                         (dict(logit_softcap=0.0), "logit_softcap"), (dict(device=_unavailable_cuda()), "device"),
                         (dict(backends=["cpuu"]), "backends"), (dict(gradcheck="yes"), "gradcheck"),
                         (dict(progress=print, progress_interval=0.0), "progress_interval")):
        with pytest.raises(selfcheck.ArgumentError) as info:
            selfcheck.check(**kwargs)
        assert info.value.argument == name and name.rstrip("s") in str(info.value)


# ----------------------------------------------------------------------------- demo, status, top level


@pytest.mark.parametrize("argv, option", [
    (["--backend", "cpuu"], "--backend"),
    (["--backend", "cuda", "--device", "cpu"], "--backend"),
    (["--device", _unavailable_cuda()], "--device"),
    (["--device", "nonsense"], "--device"),
    (["--seed", "x"], "--seed"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_demo_refuses_a_bad_option(argv, option, capsys, no_work):
    if argv[:2] == ["--backend", "cuda"] and torch.cuda.is_available():
        pytest.skip("the cuda backend runs here (on CUDA tensors; this asks for CPU ones)")
    _, out = _assert_usage_error(["demo", *argv], capsys, "tpo-kernels demo", option)
    assert not out


@pytest.mark.parametrize("argv, prog, words", [
    (["status", "--backend", "cpuu"], "tpo-kernels status", "--backend"),
    (["stauts"], "tpo-kernels", "stauts"),
    (["--no-such-option"], "tpo-kernels", "--no-such-option"),
], ids=["status", "unknown_command", "unknown_option"])
def test_status_and_top_level_refuse_a_bad_option(argv, prog, words, capsys):
    _assert_usage_error(argv, capsys, prog, words)


# ----------------------------------------------------------------------------- bench


@pytest.mark.parametrize("argv, option", [
    (["--device", _unavailable_cuda()], "--device"),
    (["--device", "nonsense"], "--device"),
    (["--providers", "tpo:cpuu"], "--providers"),
    (["--providers", "naive,tpo_cahced:*"], "--providers"),
    (["--exclude", "nieve"], "--exclude"),
    (["--case", "logitz"], "--case"),
    (["--preset", "nope"], "--preset"),
    (["--variant", "sparse"], "--variant"),
    (["--dtype", "fp8"], "--dtype"),
    (["--mode", "fwd"], "--mode"),
    (["--shape", "G=a,K=2"], "--shape"),
    (["--shape", "G=0,K=2,T=4,V=16"], "--shape"),
    (["--rounds", "0"], "--rounds"),
    (["--reps", "0"], "--reps"),
    (["--warmup", "-1"], "--warmup"),
    (["--threads", "0"], "--threads"),
    (["--timeout", "0"], "--timeout"),
    (["--target-time", "nan"], "--target-time"),
    (["--budget", "-1"], "--budget"),
    (["--calibrate-bytes", "0"], "--calibrate-bytes"),
    (["--no-such-option"], "--no-such-option"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_bench_refuses_a_bad_option(argv, option, tmp_path, capsys, no_work):
    out_dir = tmp_path / "out"
    base = ["bench", "--case", "logprobs", "--shape", "M=8,V=16", "--no-plots", "--out", str(out_dir)]
    if option in ("--case", "--preset", "--shape"):
        base = ["bench", "--no-plots", "--out", str(out_dir)]
    _, out = _assert_usage_error([*base, *argv], capsys, "tpo-kernels bench", option)
    assert "measurements in" not in out  # the run never started


@pytest.mark.parametrize("where", ["missing_folder", "a_file", "under_a_file"])
def test_bench_refuses_an_unwritable_out_folder(where, tmp_path, capsys, no_work):
    (tmp_path / "file").write_text("")
    path = {"missing_folder": tmp_path / "no" / "out", "a_file": tmp_path / "file",
            "under_a_file": tmp_path / "file" / "out"}[where]
    argv = ["bench", "--case", "logprobs", "--shape", "M=8,V=16", "--no-plots", "--out", str(path)]
    _assert_usage_error(argv, capsys, "tpo-kernels bench", "--out")
    assert not (tmp_path / "no").exists()  # a mistyped parent is refused, not created


def test_bench_makes_a_missing_out_folder_under_an_existing_one(tmp_path, capsys, monkeypatch):
    """The out folder itself may be new (its parent exists): made before the run."""
    monkeypatch.setattr(harness, "measure", lambda spec: [
        dict({k: spec[k] for k in ("case", "shape", "dtype", "variant", "provider")}, mode=m, status="error",
             error="stand-in") for m in spec["modes"]])
    argv = ["bench", "--case", "logprobs", "--shape", "M=8,V=16", "--providers", "naive", "--mode", "full",
            "--no-isolate", "--no-plots", "--device", "cpu", "--out", str(tmp_path / "new")]
    status, err, _ = _run(argv, capsys)
    assert status == 0, err
    assert (tmp_path / "new" / "results.json").is_file()


def test_bench_report_of_a_folder_without_results(tmp_path, capsys, no_work):
    _assert_usage_error(["bench", "--report", str(tmp_path)], capsys, "tpo-kernels bench", "--report")


def test_bench_module_entry_reports_the_same_one_line(tmp_path, capsys, no_work):
    """``python -m tpo_kernels.bench`` (bench.run.main) prints the line itself and exits 2."""
    from tpo_kernels.bench import run

    with pytest.raises(SystemExit) as info:
        run.main(["--providers", "tpo:cpuu", "--out", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("tpo-kernels bench: error: --providers"), err


# ----------------------------------------------------------------------------- the console entry


def test_console_entry_exits_2_with_one_line():
    """The console script (``tpo-kernels = tpo_kernels.cli:main``, run as ``sys.exit(main())``)
    and ``python -m tpo_kernels``: exit status 2, one line on stderr, nothing on stdout."""
    env = dict(os.environ)
    package_parent = str(pathlib.Path(tpo_kernels.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    entry = "import sys; from tpo_kernels.cli import main; sys.exit(main())"
    for command in ([sys.executable, "-c", entry, "demo", "--backend", "cpuu"],
                    [sys.executable, "-m", "tpo_kernels", "check", "--eta", "0"]):
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
        assert len(proc.stderr.splitlines()) == 1 and "error: --" in proc.stderr, proc.stderr
        assert proc.stdout == ""
