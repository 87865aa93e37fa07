"""``tpo_kernels.check`` / ``tpo-kernels check``: it passes on the backends that run here, its
table and JSON carry every path and quantity, and it fails (exit status 1) on a deliberately
perturbed backend."""

from __future__ import annotations

import json

import pytest
import torch

import tpo_kernels
from tpo_kernels import cli
from tpo_kernels.backends import get_backend
from tpo_kernels.backends.pytorch import TorchBackend
from tpo_kernels.selfcheck import PATHS, CheckReport

SMALL = dict(N=4, K=2, T=6, V=48, H=16)


def _native():
    return "cpu" if tpo_kernels.backend_status()["cpu"] == "available" else "torch"


def test_check_passes_on_every_section_and_path():
    report = tpo_kernels.check(backends=[_native()], long_tokens=2048, **SMALL)
    assert isinstance(report, CheckReport)
    assert report.passed, report.table()
    assert {r.path for r in report.rows if r.section != "edge"} == set(PATHS)
    assert {r.section for r in report.rows} == {"gradcheck", "reference", "edge"}
    quantities = {r.quantity for r in report.rows if r.path == "fused_linear_tpo_loss" and r.section == "reference"}
    assert {"loss", "token_logprobs", "seq_logprobs", "p", "q", "grad_hidden", "grad_weight", "grad_bias"} <= quantities
    table = report.table()
    assert "FAIL" not in table and table.rstrip().endswith("PASS") and "tolerances:" in table
    data = json.loads(report.to_json())
    assert data["passed"] is True and len(data["rows"]) == len(report.rows) and "token" in data["tolerances"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_check_other_dtypes_reference_section(dtype):
    report = tpo_kernels.check(backends=["torch"], dtype=dtype, gradcheck=False, edge_cases=False, **SMALL)
    assert report.passed, report.table()


class _Perturbed(TorchBackend):
    """The torch backend with a wrong row op: log-probs off by ``shift``, gradients scaled."""

    def __init__(self, shift=0.0, grad_scale=1.0):
        self.shift, self.grad_scale = shift, grad_scale

    def row_forward(self, logits, labels, *, inv_temperature, with_entropy):
        stats, logprob, entropy = super().row_forward(logits, labels, inv_temperature=inv_temperature,
                                                      with_entropy=with_entropy)
        return stats, logprob + self.shift, entropy

    def row_backward(self, logits, labels, stats, logprob, grad_logprob, *, out, **kwargs):
        super().row_backward(logits, labels, stats, logprob, grad_logprob, out=out, **kwargs)
        out.mul_(self.grad_scale)


@pytest.mark.parametrize("shift,grad_scale,broken", [(1e-4, 1.0, "logprobs"), (0.0, 1.001, "grad")],
                         ids=["logprob_off_by_1e-4", "gradient_off_by_0.1%"])
def test_check_catches_a_perturbed_backend(shift, grad_scale, broken):
    report = tpo_kernels.check(backends=[_Perturbed(shift, grad_scale)], gradcheck=False, edge_cases=False,
                               paths=["tpo_loss", "selective_logprobs", "fused_linear_logprobs"], **SMALL)
    assert not report.passed
    assert any(broken in r.quantity for r in report.failures), report.table()
    assert "FAIL" in report.table()


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
        stats, lp, ent = original(*a, **kw)
        return stats, lp + 1e-3, ent

    monkeypatch.setattr(torch_backend, "row_forward", shifted)
    assert cli.main(args) == 1
    assert "FAIL" in capsys.readouterr().out
    assert cli.main(["check", "--paths", "nope"]) == 2
