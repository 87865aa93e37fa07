"""``tpo_kernels.check`` / ``tpo-kernels check``: it passes on the backends that run here, its
table and JSON carry every path and quantity, it fails (exit status 1) on a deliberately
perturbed backend, refuses bad usage (exit status 2) before any work, and its chunked float64
reference gives the chunk size's verdicts and errors whatever the chunk size."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

import tpo_kernels
from tpo_kernels import cli
from tpo_kernels.backends import get_backend
from tpo_kernels.backends import TorchBackend
from tpo_kernels.selfcheck import PATHS, CheckReport, heartbeat, inputs as check_inputs, report as check_report
from tpo_kernels.selfcheck.paths import _REFERENCE_RUNNERS as check_runners

from _dispatch import OpRecorder

SMALL = dict(N=4, K=2, T=6, V=48, H=16)


def _native():
    return "cpu" if tpo_kernels.backend_status()["cpu"] == "available" else "torch"


def test_check_passes_on_every_section_and_path():
    report = tpo_kernels.check(backends=[_native()], long_tokens=2048, **SMALL)
    assert isinstance(report, CheckReport)
    assert report.passed, report.table()
    assert {r.path for r in report.rows if r.section != "edge"} == set(PATHS)
    assert {r.section for r in report.rows} == {"gradcheck", "reference", "edge"}
    transformed = {r.path for r in report.rows if r.section == "gradcheck" and "softcap" in r.quantity}
    assert transformed == set(PATHS) - {"tpo_loss_from_logprobs"}
    quantities = {r.quantity for r in report.rows if r.path == "fused_linear_tpo_loss" and r.section == "reference"}
    assert {"loss", "token_logprobs", "seq_logprobs", "p", "q", "grad_hidden", "grad_weight", "grad_bias"} <= quantities
    table = report.table()
    assert "FAIL" not in table and table.rstrip().endswith("PASS") and "tolerances:" in table
    data = json.loads(report.to_json())
    assert data["passed"] is True and len(data["rows"]) == len(report.rows) and "token" in data["tolerances"]
    assert "issue" not in (table + report.to_json()).lower()  # no internal tracking numbers


def test_public_functions_are_the_checked_paths():
    public = {name for name in tpo_kernels.__all__ if callable(getattr(tpo_kernels, name))
              and (name.endswith("_loss") or name.endswith("logprobs"))}
    assert public == set(PATHS)


@pytest.mark.parametrize("transform", [dict(logit_scale=0.25), dict(logit_softcap=3.0),
                                       dict(logit_scale=0.5, logit_softcap=2.0)], ids=["scale", "softcap", "both"])
def test_check_reference_section_with_logit_transforms(transform):
    report = tpo_kernels.check(backends=[_native()], gradcheck=False, edge_cases=False, **transform, **SMALL)
    assert report.passed, report.table()


def test_chunked_reference_gives_the_same_errors_as_one_chunk(monkeypatch):
    """The float64 reference runs a chunk of rows at a time; the chunk size changes nothing but
    memory and the float64 matmul's rounding (relative errors are per chunk, so only the absolute
    ones are compared)."""
    kw = dict(backends=["torch"], gradcheck=False, edge_cases=False, **SMALL)
    whole = tpo_kernels.check(**kw)
    monkeypatch.setattr(check_inputs, "CHUNK_ELEMENTS", 2 * SMALL["V"] + 5)  # 2 rows a chunk
    chunked = tpo_kernels.check(**kw)
    assert whole.passed and chunked.passed
    assert [(r.path, r.quantity) for r in whole.rows] == [(r.path, r.quantity) for r in chunked.rows]
    for a, b in zip(whole.rows, chunked.rows):
        assert a.max_abs == pytest.approx(b.max_abs, rel=1e-4, abs=1e-15), (a.path, a.quantity)
        assert a.tolerance.split()[0] == b.tolerance.split()[0], (a.path, a.quantity)
        assert float(a.tolerance.split()[-1]) == pytest.approx(float(b.tolerance.split()[-1]), rel=0.02)


class _Float64Sizes(OpRecorder):
    """The element counts of every float64 tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.sizes = [0]

    def record(self, func, args, kwargs, out):
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.sizes.append(t.numel())


@pytest.mark.parametrize("path", PATHS)
def test_reference_never_forms_a_float64_tensor_of_every_row(monkeypatch, path):
    """The float64 reference runs a chunk of rows at a time: with 256 rows of V = 128, no float64
    tensor comes near ``[rows, V]`` (the [V, H] weight and [rows, H] hidden copies are 8x smaller)."""
    monkeypatch.setattr(check_inputs, "CHUNK_ELEMENTS", 2 * 128 + 5)  # 2 rows a chunk
    shapes = dict(N=8, K=2, T=32, V=128, H=8)
    with _Float64Sizes() as recorder:
        report = tpo_kernels.check(backends=["torch"], paths=[path], gradcheck=False, edge_cases=False, **shapes)
    assert report.passed, report.table()
    assert max(recorder.sizes) <= 2 * 256 * 8 < 256 * 128


@pytest.mark.parametrize("bound_shape", [(40, 16), (16,), ()], ids=["elementwise", "per_column", "scalar"])
def test_large_comparisons_run_a_slice_of_rows_at_a_time(monkeypatch, bound_shape):
    """A [V, H]-sized gradient is compared 4 rows (64 entries) at a time: no float64 temporary
    of the whole, the same verdict and largest error as one comparison, a bad entry in the last
    slice still caught."""
    gen = torch.Generator().manual_seed(0)
    expected = torch.randn(40, 16, generator=gen, dtype=torch.float64)
    actual = (expected + 1e-4 * torch.randn(40, 16, generator=gen, dtype=torch.float64)).float()
    bound = torch.full(bound_shape, 1e-3, dtype=torch.float64)
    whole = check_report._Accumulated()
    whole.add(actual, expected, bound)
    monkeypatch.setattr(check_report, "_COMPARE_ELEMENTS", 64)
    sliced = check_report._Accumulated()
    with _Float64Sizes() as recorder:
        sliced.add(actual, expected, bound)
    assert max(recorder.sizes) <= 64
    assert sliced.ok and whole.ok and sliced.max_abs == whole.max_abs and sliced.max_bound == whole.max_bound
    actual[-1, -1] += 1.0
    caught = check_report._Accumulated()
    caught.add(actual, expected, bound)
    assert not caught.ok


def test_check_reports_progress_first_and_per_path():
    lines = []
    tpo_kernels.check(backends=["torch"], paths=["tpo_loss", "selective_logprobs"], gradcheck=False,
                      long_tokens=64, progress=lines.append, **SMALL)
    assert lines[0].startswith("tpo_kernels check on") and "estimated peak memory" in lines[1]
    assert [line.split()[0] for line in lines[2:]] == ["[1/3]", "[2/3]", "[3/3]"]
    assert "tpo_loss" in lines[2] and "edge cases" in lines[4] and all("PASS" in line for line in lines[2:])


def _slow_path(seconds):
    """A reference runner that takes ``seconds`` (a stand-in for one path at a large shape)."""
    def run(rows, backend, inputs):
        time.sleep(seconds)
        rows.add("slow stand-in", 0.0, 0.0, "none", True)

    return run


def test_check_prints_a_progress_line_while_a_slow_step_runs(monkeypatch):
    """A step longer than the progress interval gets a line naming it before it ends (the
    command's interval is 15 s; 0.1 s here)."""
    monkeypatch.setitem(check_runners, "tpo_loss", _slow_path(1.0))
    lines = []
    tpo_kernels.check(backends=["torch"], paths=["tpo_loss"], gradcheck=False, edge_cases=False,
                      progress=lines.append, progress_interval=0.1, **SMALL)
    done = next(i for i, line in enumerate(lines) if line.startswith("[1/1]"))
    beats = [line for line in lines[:done] if "still running" in line]
    assert beats and all("[1/1] torch tpo_loss: reference" in line for line in beats), lines


def test_check_progress_interval_defaults_to_the_heartbeat_constant(monkeypatch):
    monkeypatch.setattr(heartbeat, "PROGRESS_INTERVAL_S", 0.1)
    monkeypatch.setitem(check_runners, "tpo_loss", _slow_path(1.0))
    lines = []
    tpo_kernels.check(backends=["torch"], paths=["tpo_loss"], gradcheck=False, edge_cases=False,
                      progress=lines.append, **SMALL)
    assert any("still running" in line for line in lines), lines
    assert heartbeat.PROGRESS_INTERVAL_S < 20  # the commands promise a line at least every 20 s


def test_cli_check_prints_progress_while_a_slow_step_runs(monkeypatch, capsys):
    monkeypatch.setattr(heartbeat, "PROGRESS_INTERVAL_S", 0.1)
    monkeypatch.setitem(check_runners, "tpo_loss", _slow_path(1.0))
    assert cli.main(["check", "--backends", "torch", "--paths", "tpo_loss", "--no-gradcheck", "--no-edge-cases",
                     "-N", "4", "-K", "2", "-T", "6", "-V", "48", "-H", "16"]) == 0
    err = capsys.readouterr().err
    assert "tpo_loss: reference: still running" in err, err


def test_heartbeat_stays_quiet_without_a_progress_callback(monkeypatch):
    """tpo_kernels.check without ``progress`` starts no thread and prints nothing."""
    started = []
    monkeypatch.setattr(heartbeat.Heartbeat, "__enter__", lambda self: started.append(self) or self)
    tpo_kernels.check(backends=["torch"], paths=["tpo_loss"], gradcheck=False, edge_cases=False, **SMALL)
    assert not started


def test_estimated_memory_of_the_readme_example_is_under_4_gib():
    assert tpo_kernels.selfcheck.estimate_peak_bytes(torch.bfloat16, 16, 512, 32000, 1024) < 4 * 2**30


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_check_other_dtypes_reference_section(dtype):
    report = tpo_kernels.check(backends=["torch"], dtype=dtype, gradcheck=False, edge_cases=False, **SMALL)
    assert report.passed, report.table()


class _Perturbed(TorchBackend):
    """The torch backend with a wrong row op: log-probs off by ``shift``, gradients scaled."""

    def __init__(self, shift=0.0, grad_scale=1.0):
        self.shift, self.grad_scale = shift, grad_scale

    def row_forward(self, logits, labels, *, inv_temperature, with_entropy):
        summary = super().row_forward(logits, labels, inv_temperature=inv_temperature, with_entropy=with_entropy)
        return dataclasses.replace(summary, label_logprob=summary.label_logprob + self.shift)

    def row_backward(self, logits, labels, summary, grad_logprob, *, out, **kwargs):
        super().row_backward(logits, labels, summary, grad_logprob, out=out, **kwargs)
        out.mul_(self.grad_scale)


@pytest.mark.parametrize("shift,grad_scale,broken", [(1e-4, 1.0, "logprobs"), (0.0, 1.001, "grad")],
                         ids=["logprob_off_by_1e-4", "gradient_off_by_0.1%"])
def test_check_catches_a_perturbed_backend(shift, grad_scale, broken):
    report = tpo_kernels.check(backends=[_Perturbed(shift, grad_scale)], gradcheck=False, edge_cases=False,
                               paths=["tpo_loss", "selective_logprobs", "fused_linear_logprobs"], **SMALL)
    assert not report.passed
    assert any(broken in r.quantity for r in report.failures), report.table()
    assert "FAIL" in report.table()


@pytest.mark.quick
def test_cli_check_table_json_and_exit_status(tmp_path, capsys, monkeypatch):
    args = ["check", "--backends", "torch", "--paths", "tpo_loss,selective_logprobs", "--no-gradcheck",
            "--no-edge-cases", "-N", "4", "-K", "2", "-T", "5", "-V", "32", "-H", "8"]
    path = tmp_path / "report.json"
    assert cli.main(args + ["--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "selective_logprobs" in out and out.rstrip().endswith("PASS")
    data = json.loads(path.read_text())
    assert data["passed"] and {r["path"] for r in data["rows"]} == {"tpo_loss", "selective_logprobs"}
    assert cli.main(args + ["--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"]

    # A broken kernel: the registered torch backend's row forward returns shifted log-probs.
    torch_backend = get_backend("torch", torch.device("cpu"))
    original = torch_backend.row_forward

    def shifted(*a, **kw):
        summary = original(*a, **kw)
        return dataclasses.replace(summary, label_logprob=summary.label_logprob + 1e-3)

    monkeypatch.setattr(torch_backend, "row_forward", shifted)
    assert cli.main(args) == 1
    assert "FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--paths", "nope"])
    assert exc.value.code == 2


@pytest.mark.quick
@pytest.mark.parametrize("where", ["missing_folder", "a_folder"])
def test_cli_check_refuses_an_unwritable_json_path_before_any_work(where, tmp_path, capsys, monkeypatch):
    def must_not_run(**kwargs):
        raise AssertionError("check ran")

    monkeypatch.setattr(tpo_kernels.selfcheck, "check", must_not_run)
    path = tmp_path / "no" / "report.json" if where == "missing_folder" else tmp_path
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--json", str(path)])
    assert exc.value.code == 2
    assert "--json" in capsys.readouterr().err


def test_cli_usage_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--no-such-option"])
    assert exc.value.code == 2
