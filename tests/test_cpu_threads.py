"""How the cpu backend's row ops use threads (csrc/cpu/parallel.h): the budget is
torch.get_num_threads(), small calls stay on the calling thread, results do not depend on the
thread count, and the helper threads wait passively (they sleep, not spin, between calls). Also
the load benchmark's smallest mode (bench/cpu_load.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _backends import needs_cpu, stats_logprob_entropy
from _native_helpers import DTYPES, cpu_backend, cpu_ext, make_rows

REPO = Path(__file__).resolve().parents[1]
GRAIN = 32768  # ATen's grain: csrc/cpu/parallel.h kGrainElements


@pytest.fixture
def torch_threads():
    """Sets torch.set_num_threads for the test (restored after)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _all_ops(logits, labels, candidates):
    """Every row op of the cpu backend on the inputs: forward, backward (token-level candidates run
    on the kept-set ops: PyTorch's gather and scatter, no kernel of the extension)."""
    backend = cpu_backend()
    summary = backend.row_forward(logits, labels, inv_temperature=0.8, with_entropy=True)
    stats, lp, ent = stats_logprob_entropy(summary)
    g = torch.linspace(-1.0, 1.0, lp.numel(), dtype=lp.dtype)
    g[::7] = 0.0  # zero-signal rows take the memset branch
    grad = torch.empty_like(logits)
    backend.row_backward(logits, labels, summary, g, grad_entropy=g.flip(0), inv_temperature=0.8,
                         out=grad)
    return [stats, lp, ent, grad]


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_results_bitwise_equal_for_any_thread_count(dtype, torch_threads):
    logits, labels = make_rows(96, 3000, dtype)  # 9 chunks of 11 rows: every budget goes parallel
    labels[5] = -100
    candidates = torch.randint(0, 3000, (96, 6), generator=torch.Generator().manual_seed(3))
    results = {}
    for threads in (1, 2, 3):
        torch_threads(threads)
        results[threads] = _all_ops(logits, labels, candidates)
        assert cpu_ext().last_threads() == threads
    for threads in (2, 3):
        for got, want in zip(results[threads], results[1]):
            assert got.dtype == want.dtype and torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


@needs_cpu
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_thread_budget_follows_torch_get_num_threads(threads, torch_threads):
    torch_threads(threads)
    logits, labels = make_rows(64, 4 * GRAIN // 64 * 4, torch.float32)  # 16 grains of work
    cpu_backend().row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
    assert cpu_ext().last_threads() == threads
    if threads > 1:
        assert len(cpu_ext().pool_thread_ids()) >= threads - 1


@needs_cpu
def test_small_call_stays_on_the_calling_thread(torch_threads):
    torch_threads(4)
    logits, labels = make_rows(8, GRAIN // 8, torch.float32)  # one grain in all
    cpu_backend().row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
    assert cpu_ext().last_threads() == 1


@needs_cpu
def test_thread_plan_is_one_thread_per_grain():
    ext = cpu_ext()
    assert ext.row_threads(1, 10**6, 8) == 1  # one row: nothing to split
    assert ext.row_threads(64, 512, 8) == 1  # 64 x 512 = one grain
    assert ext.row_threads(128, 512, 8) == 2  # two grains
    assert ext.row_threads(1000, 50000, 3) == 3  # capped by the budget
    assert ext.row_threads(1000, 50000, 1) == 1
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        ext.row_threads(10, 10, 0)


@needs_cpu
def test_extension_rejects_a_bad_thread_budget():
    logits, labels = make_rows(4, 8, torch.float32)
    stats = torch.empty(2, 4)
    lp = torch.empty(4)
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        cpu_ext().row_forward(dtype=0, rows=4, vocab=8, row_stride=8, logits=logits.data_ptr(),
                              labels=labels.data_ptr(), inv_temperature=1.0, row_max=stats[0].data_ptr(),
                              log_sum=stats[1].data_ptr(), logprob=lp.data_ptr(), num_threads=0)


def _thread_stat(tid: int):
    """(state letter, utime + stime in clock ticks) of one thread of this process."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[11]) + int(fields[12])


@needs_cpu
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_helpers_sleep_between_calls(torch_threads):
    """The helpers wait on a condition variable: right after a call they are asleep and use no CPU
    (OpenMP's default policy spins for milliseconds after every parallel region)."""
    torch_threads(2)
    logits, labels = make_rows(256, 2048, torch.float32)
    cpu_backend().row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
    assert cpu_ext().last_threads() == 2
    deadline = time.monotonic() + 5.0
    while 0 in cpu_ext().pool_thread_ids() and time.monotonic() < deadline:
        time.sleep(0.01)
    helpers = cpu_ext().pool_thread_ids()
    assert helpers and 0 not in helpers
    for _ in range(20):  # a helper may still be finishing its chunk or be queued on a busy machine
        cpu_backend().row_forward(logits, labels, inv_temperature=1.0, with_entropy=False)
        time.sleep(0.005)
        states = [_thread_stat(tid)[0] for tid in helpers]
        if all(s == "S" for s in states):
            break
    assert all(s == "S" for s in states), states
    before = [_thread_stat(tid)[1] for tid in helpers]
    time.sleep(0.3)
    after = [_thread_stat(tid)[1] for tid in helpers]
    assert after == before  # no CPU at all while idle (a spinning thread gains ticks)


@needs_cpu
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_starts_its_own_pool(torch_threads):
    """A child forked after the pool started has none of its threads: the row ops must still run
    there (on a fresh pool), not wait forever for helpers that do not exist."""
    torch_threads(2)
    logits, labels = make_rows(256, 2048, torch.float32)
    want = cpu_backend().row_forward(logits, labels, inv_temperature=1.0, with_entropy=False).label_logprob
    assert cpu_ext().last_threads() == 2
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report success through the exit status only
        ok = 1
        try:
            got = cpu_backend().row_forward(logits, labels, inv_temperature=1.0, with_entropy=False).label_logprob
            ok = 0 if torch.equal(got, want) and cpu_ext().last_threads() == 2 else 1
        finally:
            os._exit(ok)
    os.close(write)
    os.close(read)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in a row op")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@needs_cpu
def test_concurrent_callers_get_their_own_results(torch_threads):
    """Two Python threads in row ops at once (the GIL is released): one gets the pool, the other
    runs on its own thread; both results are exact."""
    import threading

    torch_threads(2)
    inputs = [make_rows(128, 4096, torch.float32) for _ in range(2)]
    want = [cpu_backend().row_forward(x, y, inv_temperature=1.0, with_entropy=True) for x, y in inputs]
    failures = []

    def worker(i):
        x, y = inputs[i]
        for _ in range(20):
            got = cpu_backend().row_forward(x, y, inv_temperature=1.0, with_entropy=True)
            if not all(torch.equal(a, b) for a, b in zip(stats_logprob_entropy(got),
                                                           stats_logprob_entropy(want[i]))):
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and failures == []


# --------------------------------------------------------------------------------------------
# bench/cpu_load.py
# --------------------------------------------------------------------------------------------


needs_bench = pytest.mark.skipif(not (REPO / "bench" / "cpu_load.py").is_file(),
                                 reason="bench/cpu_load.py is not here (not a source tree)")


def _bench_module():
    sys.path.insert(0, str(REPO))
    try:
        from bench import cpu_load
    finally:
        sys.path.remove(str(REPO))
    return cpu_load


@needs_bench
def test_load_processes_are_killed_even_on_error():
    cpu_load = _bench_module()
    load = cpu_load.Load(2)
    with pytest.raises(RuntimeError, match="boom"):
        with load:
            children = list(load.children)
            assert len(children) == 2 and all(c.poll() is None for c in children)
            raise RuntimeError("boom")
    assert all(c.poll() is not None for c in children)


@needs_cpu
@needs_bench
def test_bench_smoke_mode(tmp_path):
    out = tmp_path / "cpu_load.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cpu_load", "--smoke", "--load-procs", "1", "--budget", "0.05",
         "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert set(result["paths"]) == {"logits", "fused", "rowops"}
    for path, row in result["paths"].items():
        for name in ("ours", "eager"):
            assert row[name]["idle_s"] > 0 and row[name]["loaded_s"] > 0
            assert row[name]["slowdown"] == pytest.approx(row[name]["loaded_s"] / row[name]["idle_s"])
            assert min(row[name]["reps"].values()) >= 3
        assert row["slowdown_vs_eager"] == pytest.approx(row["ours"]["slowdown"] / row["eager"]["slowdown"])
        assert f"| {path} " in proc.stdout
    assert "ours / eager slowdown (target <= 1.5)" in proc.stdout
    assert result["load_procs"] == 1 and result["rounds"] == 1


@needs_bench
def test_bench_rejects_bad_arguments(capsys):
    cpu_load = _bench_module()
    for argv, message in ((["--rounds", "0"], "--rounds must be >= 1"),
                          (["--load-procs", "-1"], "--load-procs must be >= 0"),
                          (["--threads", "0"], "--threads must be >= 1")):
        with pytest.raises(SystemExit):
            cpu_load.main(argv)
        assert message in capsys.readouterr().err
