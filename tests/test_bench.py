"""The benchmark harness end to end on tiny shapes, and the CLI entry points (seconds on CPU)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import tpo_kernels
from tpo_kernels.bench import cases as C
from tpo_kernels.bench import inputs as I
from tpo_kernels.bench import presets as PR
from tpo_kernels.bench import report as R
from tpo_kernels.bench import run as bench_run

# the folder that holds the tpo_kernels under test (a checkout or site-packages)
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(tpo_kernels.__file__)))
FAST = ["--reps", "2", "--warmup", "1", "--device", "cpu", "--threads", "1"]


def _env(pythonpath=PACKAGE_PARENT):
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("TRITON_INTERPRET", None)
    return env


def _load(out):
    with open(out / "results.json") as f:
        return json.load(f)


def test_smoke_preset_every_case(tmp_path, capsys):
    rc = bench_run.main(["--preset", "smoke", "--no-isolate", "--no-plots", "--out", str(tmp_path)] + FAST)
    assert rc == 0
    run = _load(tmp_path)
    ok = [r for r in run["results"] if r["status"] == "ok"]
    errors = [r for r in run["results"] if r["status"] != "ok"]
    assert not errors, errors
    # every case measured at least its eager reference; logits in all three modes
    assert {r["case"] for r in ok} == set(C.CASES)
    assert {r["mode"] for r in ok if r["case"] == "logits"} == {"forward", "backward", "full"}
    for r in ok:
        assert r["time_s"]["median"] > 0 and r["reps"] == 2
        assert isinstance(r["peak_bytes"], int) and r["input_bytes"] > 0
    # our providers that exist here are compared with the reference, and agree with it
    ours = [r for r in ok if r["role"] == "ours" and r.get("check_vs_reference")]
    assert ours, "no tpo_kernels provider ran"
    assert all(r["check_vs_reference"]["ok"] for r in ours), [r["check_vs_reference"] for r in ours]
    assert all("naive" in r["vs"] for r in ours)
    # the installed package is described: its version, commit (or 'unknown') and location
    pkg = run["meta"]["package"]
    assert pkg["version"] == tpo_kernels.__version__ and pkg["commit"]
    assert pkg["location"] == os.path.dirname(os.path.abspath(tpo_kernels.__file__))
    assert f"tpo_kernels {tpo_kernels.__version__} at commit {pkg['commit'][:12]}" in run["meta"]["software"]
    md = (tmp_path / "results.md").read_text()
    assert "| shape | provider | mode |" in md and "## logits" in md
    assert "results.md" in capsys.readouterr().out


def test_plots_and_throughput(tmp_path):
    pytest.importorskip("matplotlib")
    shapes = ["G=1,K=4,T=8,V=256", "G=1,K=4,T=8,V=1024", "G=2,K=4,T=8,V=1024"]
    args = ["--case", "logits", "--providers", "naive,tpo:torch", "--mode", "full", "--variant", "dense", "--no-isolate", "--out", str(tmp_path)]
    for s in shapes:
        args += ["--shape", s]
    assert bench_run.main(args + FAST) == 0
    run = _load(tmp_path)
    assert len(run["results"]) == 6 and all(r["status"] == "ok" for r in run["results"])
    for r in run["results"]:
        assert r["throughput"]["unit"] == "GB/s" and r["throughput"]["value"] > 0
    pngs = sorted(p for p in os.listdir(tmp_path) if p.endswith(".png"))
    assert pngs == ["logits-fp32-dense-vs-tokens.png", "logits-fp32-dense-vs-vocab.png"]
    for p in pngs:
        with open(tmp_path / p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert run["plots"] == pngs or sorted(run["plots"]) == pngs


def test_isolated_subprocess_measurement(tmp_path):
    args = ["--case", "logprobs", "--shape", "M=64,V=256", "--providers", "naive", "--mode", "forward,full", "--isolate", "--no-plots", "--out", str(tmp_path)]
    assert bench_run.main(args + FAST) == 0
    run = _load(tmp_path)
    assert run["meta"]["memory_method"] == "rss-subprocess"
    assert [r["mode"] for r in run["results"]] == ["forward", "full"]
    for r in run["results"]:
        assert r["status"] == "ok", r
        assert r["peak_bytes"] >= 0
    # --report rebuilds the tables from results.json without measuring; presets it does not know
    # (e.g. renamed since) are named and their targets left out
    run["meta"]["presets"] = ["no-such-preset"]
    (tmp_path / "results.md").unlink()
    with open(tmp_path / "results.json", "w") as f:
        json.dump(run, f)
    assert bench_run.main(["--report", str(tmp_path), "--no-plots"]) == 0
    assert "| M=64 V=256 | naive | full |" in (tmp_path / "results.md").read_text()
    assert _load(tmp_path)["targets"] == []


def test_unavailable_provider_is_skipped_with_reason(tmp_path, monkeypatch):
    # as if the torch backend could not run here
    status = dict(tpo_kernels.backend_status(), torch="not available: test")
    monkeypatch.setattr(tpo_kernels, "backend_status", lambda: status)
    args = ["--case", "logprobs", "--shape", "M=32,V=128", "--providers", "tpo:torch,tpo:cuda,cce,naive", "--mode", "full", "--no-isolate", "--no-plots", "--out", str(tmp_path)]
    assert bench_run.main(args + FAST) == 0
    run = _load(tmp_path)
    reasons = {s["provider"]: s["reason"] for s in run["skipped"]}
    assert reasons["tpo:torch"] == "backend 'torch': not available: test"
    assert "needs a CUDA device" in reasons["tpo:cuda"]
    assert "cce" not in reasons  # cce is not a logprobs provider: the glob simply matches nothing
    assert [r["provider"] for r in run["results"]] == ["naive"]
    md = (tmp_path / "results.md").read_text()
    assert "## Skipped providers" in md and "not available: test" in md
    # and a GPU-only baseline on CPU
    reason = C.CASES["fused_linear"].provider("cce").available(torch.device("cpu"))
    assert reason and "GPU only" in reason


def test_target_evaluation():
    row = {"case": "fused_linear", "variant": "dense", "mode": "full", "dtype": "fp32", "shape": {"G": 1}, "status": "ok"}
    results = [
        dict(row, provider="tpo:cpu", role="ours", time_s={"median": 1.0}, peak_bytes=100, extra_bytes=10),
        dict(row, provider="torch_lce", role="baseline", time_s={"median": 2.0}, peak_bytes=50, extra_bytes=5),
    ]
    targets = [
        PR.Target("time", "fused_linear", "dense", "full", "time", "ratio", "ours", "torch_lce", "<=", 1.0, preset="x"),
        PR.Target("mem", "fused_linear", "dense", "full", "peak", "ratio", "ours", "torch_lce", "<=", 1.0, preset="x"),
        PR.Target("speed", "fused_linear", "dense", "full", "time", "speedup", "ours", "torch_lce", ">=", 2.0, preset="x"),
        PR.Target("missing", "fused_linear", "dense", "full", "time", "ratio", "ours", "naive", "<=", 1.0, preset="x"),
    ]
    ev = R.evaluate_targets(targets, results)
    assert [e["status"] for e in ev] == ["PASS", "FAIL", "PASS", "baseline naive not measured"]
    assert ev[0]["value"] == pytest.approx(0.5) and ev[1]["value"] == pytest.approx(2.0)
    assert all(e["preset"] == "x" for e in ev)
    assert "PASS" in R.targets_text(ev)


def test_presets_settings():
    fl = PR.PRESETS["fused-linear-cpu"].jobs[0]
    assert fl.shapes == [{"G": 8, "K": 8, "T": 128, "H": 512, "V": 32768}] and fl.dtypes == ["fp32"]
    assert set(fl.variants) == {"dense", "sparse90"} and {"naive", "torch_lce"} <= set(fl.providers)
    assert PR.PRESETS["logits-speedup-gpu"].jobs[0].shapes == [{"G": 16, "K": 8, "T": 128, "V": 151936}]
    assert PR.PRESETS["token-level-speedup-cpu"].jobs[0].shapes == [{"R": 2048, "K": 8, "H": 512, "V": 32768}]
    # every target knows its preset; names say what is measured, one name each
    for name, p in PR.PRESETS.items():
        assert all(t.preset == name for t in p.targets)
        assert "issue" not in name
    # grid settings live in GridPoint fields, never in the shape dicts
    for case in C.CASES.values():
        for points in case.grids.values():
            for pt in points:
                assert isinstance(pt, C.GridPoint) and set(pt.shape) <= set(case.params) | {"M"}
    # 90%-tied variant: floor(0.9 G) groups tie, the rest do not
    s, tied = I.make_scores(8, 8, "sparse90", I.Generators(0, "cpu"), "cpu")
    row_tied = (s.amax(1) == s.amin(1)).sum().item()
    assert tied == 7 and row_tied == 7


def test_default_grid_plan_keeps_costly_providers_at_main_shapes():
    """torch_lce runs at the main shape only, where this torch has F.linear_cross_entropy (2.13
    does, 2.11 does not); elsewhere the plan skips it with that reason."""
    from tpo_kernels.bench.baselines import torch_lce_available
    from tpo_kernels.bench.plan import plan

    args = bench_run.build_parser().parse_args(["--case", "fused_linear"])
    specs, skipped, targets, title = plan(args, torch.device("cpu"))
    main_shape = C.CASES["fused_linear"].grids["cpu"][0].shape
    lce = [s for s in specs if s["provider"] == "torch_lce"]
    missing = torch_lce_available()
    if missing is None:
        assert lce and all(s["shape"] == main_shape and s["variant"] == "dense" for s in lce)
    else:
        assert not lce and {"case": "fused_linear", "provider": "torch_lce", "reason": missing} in skipped
    assert {s["variant"] for s in specs if s["provider"] == "naive" and s["shape"] == main_shape} == {"dense", "sparse90"}
    assert specs[0]["shape"] == main_shape and not targets and title == "default grid on cpu"


def test_cli_status_and_demo():
    for cmd in (["status"], ["demo"]):
        proc = subprocess.run([sys.executable, "-m", "tpo_kernels"] + cmd, capture_output=True, text=True, env=_env(), timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if cmd == ["status"]:
            assert "torch" in proc.stdout and "available" in proc.stdout
        else:
            assert "-> OK" in proc.stdout and "loss" in proc.stdout


def test_cli_bench_dispatch(capsys):
    from tpo_kernels import cli

    assert cli.main(["bench", "--list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "case fused_linear" in out and "fused-linear-cpu" in out


def test_cli_bench_needs_no_checkout(tmp_path):
    """The harness ships in the package: a copy of tpo_kernels alone (no checkout, no bench/
    folder, no tests/) runs ``tpo-kernels bench`` from an unrelated working folder."""
    site, work = tmp_path / "site", tmp_path / "work"
    shutil.copytree(os.path.dirname(os.path.abspath(tpo_kernels.__file__)), site / "tpo_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    work.mkdir()
    env = _env(str(site))
    here = "import tpo_kernels.bench as b; print(b.__file__)"
    proc = subprocess.run([sys.executable, "-c", here], cwd=work, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith(str(site)), proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-m", "tpo_kernels", "bench", "--help"], cwd=work, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and "--preset" in proc.stdout, proc.stderr
    cmd = [sys.executable, "-m", "tpo_kernels.bench", "--case", "logprobs", "--shape", "M=32,V=128", "--providers", "naive,tpo:cpu",
           "--mode", "full", "--isolate", "--no-plots", "--out", "out"] + FAST
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = _load(work / "out")
    assert [r["status"] for r in run["results"]] == ["ok", "ok"], run["results"]
    assert run["meta"]["package"]["location"] == str(site / "tpo_kernels")


# --------------------------------------------------------------------------- Zipf candidates


def test_zipf_candidates_are_skewed_distinct_and_seeded():
    cand = I.zipf_candidates(2048, 8, 32768, seed=5)
    assert cand.shape == (2048, 8) and cand.dtype == torch.int64
    assert int(cand.min()) >= 0 and int(cand.max()) < 32768
    ordered = cand.sort(dim=1).values
    assert not (ordered[:, 1:] == ordered[:, :-1]).any(), "candidates repeat within a state"
    assert torch.equal(cand, I.zipf_candidates(2048, 8, 32768, seed=5))
    stats = I.candidate_stats(cand)
    uniform = I.candidate_stats(torch.randint(0, 32768, (2048, 8), generator=torch.Generator().manual_seed(0)))
    # Zipf(1) over 32768 ids: the most frequent id has p ~ 1/11, so it sits in ~1/11 of the states
    assert stats["max_pairs_per_id"] > 20 * uniform["max_pairs_per_id"]
    assert stats["distinct_candidates"] < uniform["distinct_candidates"] / 2
    with pytest.raises(ValueError, match="token cases only"):
        I.make_logits_inputs({"G": 1, "K": 2, "T": 2, "V": 16}, torch.float32, "cpu", "zipf", 0)


def test_zipf_variant_of_the_token_cases(tmp_path):
    args = ["--case", "token", "--shape", "R=48,K=4,H=32,V=512", "--providers", "naive,tpo:cpu", "--variant", "dense,zipf",
            "--mode", "full", "--no-isolate", "--no-plots", "--out", str(tmp_path)]
    assert bench_run.main(args + FAST) == 0
    run = _load(tmp_path)
    assert {(r["provider"], r["variant"]) for r in run["results"]} == {
        (p, v) for p in ("naive", "tpo:cpu") for v in ("dense", "zipf")}
    assert all(r["status"] == "ok" for r in run["results"]), run["results"]
    for r in run["results"]:
        if r["role"] == "ours":
            assert r["check_vs_reference"]["ok"], r
        assert ("input_stats" in r) == (r["variant"] == "zipf")
    stats = next(r["input_stats"] for r in run["results"] if r["variant"] == "zipf")
    assert stats["candidate_pairs"] == 48 * 4 and stats["max_pairs_per_id"] > 1
    assert "Zipf candidates:" in (tmp_path / "results.md").read_text()


# --------------------------------------------------------------------------- calibration, kernel-only times, clocks


def test_kernel_only_times_and_copy_calibration_on_cpu(tmp_path):
    args = ["--case", "logits", "--shape", "G=2,K=4,T=8,V=512", "--providers", "naive,tpo:cpu,tpo:torch", "--mode",
            "forward,full", "--variant", "dense,sparse90", "--no-isolate", "--no-plots", "--kernels", "--calibrate",
            "--calibrate-bytes", str(8 << 20), "--out", str(tmp_path)]
    assert bench_run.main(args + FAST) == 0
    run = _load(tmp_path)
    cal = run["calibration"]
    assert cal["device"] == "cpu" and cal["buffer_bytes"] == 8 << 20
    assert cal["copy"]["bytes"] == 2 * (8 << 20) and cal["copy"]["gbps"] > 0 and cal["read"]["gbps"] > 0
    ours = [r for r in run["results"] if r["role"] == "ours"]
    assert ours and all(r["status"] == "ok" for r in run["results"])
    for r in ours:
        # kernel-only stages sit on the full (fwd+bwd) result, next to its end-to-end time
        assert ("kernel" in r) == (r["mode"] == "full"), r
        if r["mode"] != "full":
            continue
        k = r["kernel"]
        assert set(k) >= {"row_forward", "group", "row_backward", "total_s", "throughput"}, k
        assert k["total_s"] == pytest.approx(sum(k[s]["median"] for s in ("row_forward", "group", "row_backward")))
        assert k["throughput"]["unit"] == "GB/s" and k["throughput"]["vs_copy"] == pytest.approx(
            k["throughput"]["value"] / cal["copy"]["gbps"])
        assert r["throughput"]["vs_copy"] == pytest.approx(r["throughput"]["value"] / cal["copy"]["gbps"])
    assert not any("kernel" in r for r in run["results"] if r["role"] != "ours")
    md = (tmp_path / "results.md").read_text()
    assert "## Kernel-only times next to the end-to-end call" in md and "of copy" in md
    assert "copy-bandwidth calibration (same run, same device): copy" in md
    # without --calibrate a CPU run says why there is no calibration, and no kernel-only times
    assert bench_run.main(["--case", "logprobs", "--shape", "M=16,V=64", "--providers", "naive", "--mode", "full",
                           "--no-isolate", "--no-plots", "--out", str(tmp_path / "plain")] + FAST) == 0
    plain = _load(tmp_path / "plain")
    assert plain["calibration"] == {"skipped": "off on a CPU unless --calibrate"}
    assert "kernel" not in plain["results"][0]


def test_bandwidth_targets_relative_to_the_copy_calibration():
    row = {"case": "logits", "variant": "dense", "mode": "full", "dtype": "bf16", "shape": {"G": 1}, "status": "ok",
           "provider": "tpo:cuda", "role": "ours", "time_s": {"median": 1.0}, "peak_bytes": 1, "extra_bytes": 0,
           "throughput": {"value": 3000.0, "unit": "GB/s"}, "kernel": {"total_s": 0.9, "throughput": {"value": 3700.0, "unit": "GB/s"}}}
    targets = [t for t in PR.PRESETS["logits-speedup-gpu"].targets if t.relative == "copy"]
    assert [(t.metric, t.threshold) for t in targets] == [("kernel_throughput", 0.90), ("throughput", 0.80)]
    ev = R.evaluate_targets(targets, [row], {"copy": {"gbps": 4000.0}})
    assert [e["status"] for e in ev] == ["PASS", "FAIL"]
    assert ev[0]["value"] == pytest.approx(0.925) and ev[1]["value"] == pytest.approx(0.75)
    assert "measured copy bandwidth (4000 GB/s)" in ev[0]["formula"]
    missing = R.evaluate_targets(targets, [row], None)
    assert [e["status"] for e in missing] == ["not measured (no copy-bandwidth calibration in this run)"] * 2
    # the GPU presets: the token level also with Zipf candidates
    for name in ("token-level-speedup-gpu", "token-level-speedup-cpu"):
        preset = PR.PRESETS[name]
        assert preset.jobs[0].variants == ["dense", "zipf"]
        assert {t.variant for t in preset.targets if t.metric == "time"} == {"dense", "zipf"}
    assert "zipf" in C.CASES["token"].grids["cuda"][0].variants


FAKE_SMI = """#!/bin/sh
case "$*" in
  *loop-ms*) while true; do echo "2026/01/01 00:00:00.000, 1980, 3201, 1980, 3201, 612.40, 700.00, 58, P0"; sleep 0.05; done ;;
  *clocks_event_reasons*) echo "0x0000000000000000" ;;
  *) echo "2026/01/01 00:00:00.000, 1755, 3201, 1980, 3201, 95.10, 700.00, 41, P0" ;;
esac
"""


def test_clock_monitor_with_a_stand_in_nvidia_smi(tmp_path):
    from tpo_kernels.bench import calibrate as CAL

    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monitor = CAL.ClockMonitor("0", interval_ms=50, exe=str(smi)).start()
    import time

    time.sleep(0.6)
    clocks = monitor.stop()
    assert clocks["available"] and clocks["gpu"] == "0"
    assert clocks["start"]["clocks.sm"] == 1755 and clocks["start"]["clock_event_reasons"] == "0x0000000000000000"
    during = clocks["during"]
    assert during["samples"] >= 2 and during["clocks.sm"] == {"min": 1980, "median": 1980, "max": 1980}
    assert during["power.draw"]["max"] == pytest.approx(612.4) and during["pstates"] == ["P0"]
    text = CAL.clocks_text(clocks)
    assert "SM clock min/median/max 1980/1980/1980 MHz" in text and "limit 700.0 W" in text
    # no nvidia-smi: the reason is recorded, nothing fails
    absent = CAL.ClockMonitor("0", exe=None)
    absent.exe, absent.reason = None, "nvidia-smi not found"
    assert absent.start().stop() == {"available": False, "reason": "nvidia-smi not found"}
    assert CAL.clocks_text({"available": False, "reason": "nvidia-smi not found"}) == "not recorded (nvidia-smi not found)"


def test_nvidia_smi_device_id(monkeypatch):
    from tpo_kernels.bench.calibrate import smi_gpu_id

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert smi_gpu_id(torch.device("cuda", 1)) == "5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234,MIG-abc")
    assert smi_gpu_id(torch.device("cuda", 0)) == "GPU-1234" and smi_gpu_id(torch.device("cuda", 1)) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert smi_gpu_id(torch.device("cuda", 2)) == "2"


# --------------------------------------------------------------------------- peers, rounds, float64 check

PEER_SHAPE = {"G": 1, "K": 2, "T": 4, "H": 8, "V": 64}


def _measure_spec(provider, **changes):
    from tpo_kernels.bench import harness

    spec = dict(case="fused_linear", shape=dict(PEER_SHAPE), dtype="fp32", variant="dense", provider=provider,
                modes=["full"], device="cpu", seed=0, warmup=1, min_reps=1, max_reps=1, target_time=0.0,
                check=True, prime=False)
    spec.update(changes)
    return harness.measure(spec)


@pytest.mark.parametrize("provider", ["tpo:torch", "tpo_cached:torch", "liger_chunked", "cce_compile"])
def test_providers_agree_in_float64_before_timing(provider):
    reason = C.CASES["fused_linear"].provider(provider).available(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    (result,) = _measure_spec(provider)
    assert result["status"] == "ok", result
    # ours match the float64 reference to float64 rounding; peers that compute in fp32 to fp32's
    limit = 1e-12 if provider.startswith("tpo") else 1e-4
    assert result["check_fp64"]["max_rel_diff"] <= limit, result["check_fp64"]


def test_a_provider_that_disagrees_in_float64_is_not_timed(monkeypatch):
    from tpo_kernels.bench import providers as P

    case = C.CASES["fused_linear"]
    wrong = P.Provider("wrong", "baseline", "the eager loss, doubled", lambda d: None,
                       lambda inp, shape: P.LossRunner(lambda: 2 * P._linear_call(P.B.naive_tpo_linear, inp, shape), inp))
    monkeypatch.setattr(case, "providers", case.providers + [wrong])
    (result,) = _measure_spec("wrong")
    assert result["status"] == "error" and "float64 check against naive failed" in result["error"]
    assert "time_s" not in result


def test_peer_providers_skip_with_a_message_when_not_installed(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_peers(name, *args, **kwargs):
        if name.split(".")[0] in ("liger_kernel", "cut_cross_entropy"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peers)
    case = C.CASES["fused_linear"]
    for name, package in (("cce_compile", "cut-cross-entropy"), ("liger_chunked", "liger-kernel")):
        reason = case.provider(name).available(torch.device("cpu"))
        assert reason is not None and f"pip install {package}" in reason


@pytest.mark.parametrize("provider, matmuls", [("matmul4", 4), ("matmul3", 3)])
def test_matmul_floors_run_four_or_three_products(provider, matmuls):
    inputs = C.CASES["fused_linear"].make_inputs(PEER_SHAPE, torch.float32, torch.device("cpu"), "dense", 0)
    runner = C.CASES["fused_linear"].provider(provider).build(inputs, PEER_SHAPE)
    calls = []
    real_matmul = torch.Tensor.__matmul__
    try:
        torch.Tensor.__matmul__ = lambda a, b: calls.append(1) or real_matmul(a, b)
        runner.backward(runner.forward())
    finally:
        torch.Tensor.__matmul__ = real_matmul
    assert len(calls) == matmuls


def test_rounds_merge_into_the_median_of_medians_and_the_largest_peak():
    row = {"case": "fused_linear", "variant": "dense", "mode": "full", "dtype": "fp32", "shape": {"G": 1},
           "provider": "tpo:cpu", "role": "ours", "status": "ok", "input_bytes": 10, "kept_grad_bytes": 5}
    rounds = [[dict(row, time_s={"median": m, "min": m - 1, "max": m + 1, "mean": m}, reps=2, peak_bytes=p)]
              for m, p in ((3.0, 40), (1.0, 60), (2.0, 50))]
    rounds[1].append(dict(row, provider="naive", status="error", error="x"))
    merged = R.merge_rounds(rounds)
    ours = next(r for r in merged if r["provider"] == "tpo:cpu")
    assert ours["time_s"]["median"] == 2.0 and ours["time_s"]["min"] == 0.0 and ours["time_s"]["max"] == 4.0
    assert ours["round_medians"] == [3.0, 1.0, 2.0] and ours["reps"] == 6
    assert ours["peak_bytes"] == 60 and ours["extra_bytes"] == 45
    assert next(r for r in merged if r["provider"] == "naive")["status"] == "error"


def test_rounds_run_the_plan_interleaved(tmp_path, capsys):
    args = ["--case", "logprobs", "--shape", "M=32,V=128", "--providers", "naive,tpo:torch", "--mode", "full",
            "--rounds", "2", "--no-isolate", "--no-plots", "--out", str(tmp_path)]
    assert bench_run.main(args + FAST) == 0
    order = [line.split()[-2] for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert order == ["naive", "tpo:torch", "naive", "tpo:torch"]
    results = _load(tmp_path)["results"]
    assert [len(r["round_medians"]) for r in results] == [2, 2]


def test_peak_over_the_gradients_target_metric():
    row = {"case": "fused_linear", "variant": "dense", "mode": "full", "dtype": "fp32", "shape": {"G": 1},
           "status": "ok", "provider": "tpo:cpu", "role": "ours", "time_s": {"median": 1.0}, "peak_bytes": 190,
           "input_bytes": 80, "kept_grad_bytes": 100, "extra_bytes": 10}
    target = PR.Target("floor", "fused_linear", "dense", "full", "over_grads", "value", "tpo:cpu", None, "<=", 1.25)
    (verdict,) = R.evaluate_targets([target], [row])
    assert verdict["value"] == pytest.approx(1.1) and verdict["status"] == "PASS"


def test_peers_preset_names_its_targets_providers():
    preset = PR.PRESETS["fused-linear-peers-cpu"]
    measured = set(preset.jobs[0].providers)
    for target in preset.targets:
        assert target.num in measured and (target.den is None or target.den in measured)
    gpu = PR.PRESETS["fused-linear-gpu"].jobs[0].providers
    assert {"cce", "liger", "liger_chunked", "cce_compile", "compile", "matmul3", "tpo_cached:cuda"} <= set(gpu)


# --------------------------------------------------------------------------- memory targets with the logits cache

GIB = 1 << 30


def _fused_gpu_row(provider, extra_gib, cache_gib=None):
    row = {"case": "fused_linear", "variant": "dense", "mode": "full", "dtype": "bf16", "status": "ok",
           "shape": {"G": 16, "K": 8, "T": 128, "V": 151936, "H": 4096}, "provider": provider, "role": "ours",
           "time_s": {"median": 1.0}, "peak_bytes": 0, "input_bytes": 0, "kept_grad_bytes": 0,
           "extra_bytes": int(extra_gib * GIB)}
    if cache_gib is not None:
        row["logits_cache_bytes"] = int(cache_gib * GIB)
    return row


def _memory_verdicts(rows):
    targets = [t for t in PR.PRESETS["fused-linear-gpu"].targets if t.metric.startswith("extra")]
    return {(e["target"].split(":")[0], e["provider"]): (e["status"], e["value"])
            for e in R.evaluate_targets(targets, rows)}


def test_fused_linear_gpu_memory_target_applies_to_the_uncached_providers_only():
    """'extra memory < 2 GiB' judges tpo:* only: a cached provider holding its 4.64 GiB cache is
    not failed by it."""
    cache = 16384 * 151936 * 2 / GIB
    verdicts = _memory_verdicts([_fused_gpu_row("tpo:cuda", 1.5), _fused_gpu_row("tpo:triton", 2.5),
                                 _fused_gpu_row("tpo_cached:cuda", cache + 1.0, cache)])
    uncached = {p: v for (text, p), v in verdicts.items() if text == "without the cache"}
    assert uncached == {"tpo:cuda": ("PASS", pytest.approx(1.5)), "tpo:triton": ("FAIL", pytest.approx(2.5))}


@pytest.mark.parametrize("over_budget_gib, status", [(1.0, "PASS"), (1.99, "PASS"), (2.5, "FAIL")])
def test_fused_linear_gpu_cached_providers_are_bound_by_their_budget_plus_2_gib(over_budget_gib, status):
    cache = 16384 * 151936 * 2 / GIB
    verdicts = _memory_verdicts([_fused_gpu_row("tpo_cached:triton", cache + over_budget_gib, cache)])
    assert verdicts[("with the cache", "tpo_cached:triton")] == (status, pytest.approx(over_budget_gib, abs=1e-6))
    (target,) = [t for t in PR.PRESETS["fused-linear-gpu"].targets if t.metric == "extra_beyond_cache"]
    assert "4.64 GiB" in target.text and "plus 2 GiB" in target.text and target.threshold == 2.0


def test_cached_memory_target_without_a_recorded_budget_is_not_measured():
    (verdict,) = R.evaluate_targets([t for t in PR.PRESETS["fused-linear-gpu"].targets
                                     if t.metric == "extra_beyond_cache"], [_fused_gpu_row("tpo_cached:cuda", 5.0)])
    assert verdict["status"] == "not measured (no logits cache budget recorded)" and verdict["value"] is None


def test_cached_provider_records_its_logits_cache_budget():
    """A tpo_cached:* measurement carries the budget it was given (every token's logits: M*V*itemsize);
    the uncached one carries none."""
    from tpo_kernels.bench import harness as H

    shape = {"G": 1, "K": 2, "T": 4, "V": 64, "H": 8}
    spec = dict(case="fused_linear", shape=shape, dtype="fp32", variant="dense", modes=["full"], device="cpu", seed=0,
                warmup=1, min_reps=1, max_reps=1, target_time=0.01, check=False)
    (cached,) = H.measure(dict(spec, provider="tpo_cached:torch"))
    (plain,) = H.measure(dict(spec, provider="tpo:torch"))
    assert cached["status"] == "ok" and plain["status"] == "ok", (cached, plain)
    assert cached["logits_cache_bytes"] == 1 * 2 * 4 * 64 * 4
    assert "logits_cache_bytes" not in plain


# --------------------------------------------------------------------------- progress


def test_bench_prints_a_progress_line_while_a_slow_measurement_runs(tmp_path, capsys, monkeypatch):
    """A measurement longer than the progress interval gets a line naming it before it ends (15 s
    in the command; 0.1 s here)."""
    import time

    from tpo_kernels.bench import harness as H
    from tpo_kernels.selfcheck import heartbeat

    def slow(spec):
        time.sleep(1.0)
        return [dict({k: spec[k] for k in ("case", "shape", "dtype", "variant", "provider")}, mode=m,
                     status="error", error="slow stand-in") for m in spec["modes"]]

    monkeypatch.setattr(heartbeat, "PROGRESS_INTERVAL_S", 0.1)
    monkeypatch.setattr(H, "measure", slow)
    args = ["--case", "logprobs", "--shape", "M=8,V=16", "--providers", "naive", "--mode", "full", "--no-isolate",
            "--no-plots", "--out", str(tmp_path)]
    assert bench_run.main(args + FAST) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("[1/1] logprobs"))
    end = next(i for i, line in enumerate(lines) if "ERROR slow stand-in" in line)
    beats = lines[start + 1:end]
    assert beats and all("[1/1] logprobs M=8 V=16 fp32 dense naive: still running" in line for line in beats), lines


# --------------------------------------------------------------------------- the fused backward against its floor


def test_fused_backward_preset_times_the_backward_alone_against_two_and_three_matmuls():
    preset = PR.PRESETS["fused-backward-cpu"]
    (job,) = preset.jobs
    assert preset.device == "cpu" and job.modes == ["backward"] and job.case == "fused_linear"
    assert set(job.providers) == {"tpo:cpu", "tpo_cached:cpu", "matmul3", "matmul4"}
    pairs = {(t.num, t.den, t.mode) for t in preset.targets}
    assert pairs == {("tpo_cached:cpu", "matmul3", "backward"), ("tpo:cpu", "matmul4", "backward")}


def test_fused_linear_traffic_is_the_tile_plan_account():
    """At the fused-linear-gpu shape the backward's one-matmul blocks move 16 GB less than the plan
    before them (their dW accumulator: fill, 3 chunks' read-modify-writes, conversion, zeros_like)."""
    shape = PR._FL_GPU
    new = C.fused_linear_traffic(shape, "bf16", "cuda")
    old = C.fused_linear_traffic(shape, "bf16", "cuda", one_gemm=False)
    assert new["forward"] == old["forward"]
    weight_bytes = 151936 * 4096 * 2
    old_dw = old["backward"]["dW: zero fill"] + old["backward"]["dW: block accumulator fill"] \
        + old["backward"]["dW: accumulate over chunks"] + old["backward"]["dW: convert"]
    assert old_dw == weight_bytes * (1 + 2 + 3 * 2 * 2 + 3)
    assert new["backward"]["dW: write"] == weight_bytes and new["backward"]["dW: zero fill"] == 0
    assert old["backward"]["total"] - new["backward"]["total"] > 16e9
    row = dict(shape=shape, dtype="bf16", variant="dense", mode="full")
    assert C.pass_traffic("fused_linear", provider="tpo_cached:cuda", device_type="cuda", **row) == \
        new["forward"]["total"] + new["backward"]["total"]
    assert C.pass_traffic("fused_linear", provider="matmul4", device_type="cuda", **row) is None


def test_report_prints_the_traffic_beside_the_times(tmp_path):
    shape = "G=1,K=4,T=8,H=32,V=256"
    args = ["--case", "fused_linear", "--providers", "tpo:torch,matmul4", "--mode", "backward", "--variant", "dense",
            "--shape", shape, "--no-isolate", "--no-plots", "--out", str(tmp_path)]
    assert bench_run.main(args + FAST) == 0
    expected = C.fused_linear_traffic({"G": 1, "K": 4, "T": 8, "H": 32, "V": 256}, "fp32", "cpu")["backward"]["total"]
    lines = (tmp_path / "results.md").read_text().splitlines()
    ours = next(line for line in lines if "| tpo:torch | backward |" in line)
    floor = next(line for line in lines if "| matmul4 | backward |" in line)
    assert f"; {expected / 1e9:.3g} GB beyond matmuls" in ours and "beyond matmuls" not in floor
