"""The trainer step benchmark (bench.trainer_step) on a tiny Qwen2-shaped model.

All four variants run once, each in a fresh process, on the same seed: every one must finish with
a finite loss and a positive loss-phase memory, and the three TPO variants (eager on logits,
tpo_loss on logits, TargetPOTrainer's fused head) must compute the same loss and gradient.
"""

import math

import pytest

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from bench import trainer_step  # noqa: E402

TINY = trainer_step.StepSpec(vocab=512, hidden=32, layers=1, intermediate=64, heads=4, kv_heads=2, groups=2,
                             group_size=4, prompt_len=4, completion_len=8, warmup=1, reps=1, threads=1)
TPO_VARIANTS = ("eager", "tpo_loss", "fused")


@pytest.fixture(scope="module")
def report():
    return trainer_step.run(TINY, list(trainer_step.VARIANTS), log=lambda line: None)


def result(report, variant):
    return next(r for r in report["results"] if r["variant"] == variant)


@pytest.mark.parametrize("variant", list(trainer_step.VARIANTS))
def test_variant_runs_in_a_fresh_process(report, variant):
    r = result(report, variant)
    assert "error" not in r, r.get("error")
    assert all(math.isfinite(x) for x in r["losses"])
    assert len(r["losses"]) == TINY.warmup + TINY.reps
    assert r["peak_mib"] > 0 and r["time_s"]["median"] > 0
    assert r["grad_norm"] > 0 and math.isfinite(r["grad_norm"])


def test_repeated_steps_give_the_same_loss(report):
    # no optimizer update between steps: every step sees the same model and batch
    for r in report["results"]:
        assert len(set(r["losses"])) == 1, r["variant"]


@pytest.mark.parametrize("variant", ["tpo_loss", "fused"])
def test_tpo_variants_agree_with_the_eager_one(report, variant):
    eager, other = result(report, "eager"), result(report, variant)
    assert other["loss"] == pytest.approx(eager["loss"], rel=1e-5)  # fp32, 8 tokens per completion
    assert other["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-5)


def test_ratios_are_relative_to_stock_trl(report):
    base = result(report, "trl")
    assert base["memory_vs_trl"] == 1.0 and base["time_vs_trl"] == 1.0
    for r in report["results"]:
        assert r["memory_vs_trl"] == pytest.approx(r["peak_mib"] / base["peak_mib"])


def test_markdown_has_a_row_per_variant(report):
    table = trainer_step.markdown(report)
    for variant, label in trainer_step.VARIANTS.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
        assert f"{result(report, variant)['peak_mib']:.0f}" in row
    assert "V=512" in table and f"{TINY.loss_tokens} loss tokens" in table


def test_a_failing_worker_is_reported_not_raised():
    # threads=-1 fails in the worker at once (torch.set_num_threads), before the trainer imports
    r = trainer_step.run_fresh("fused", trainer_step.StepSpec(**{**TINY.__dict__, "threads": -1}))
    assert r["error"].startswith("worker exited with 1") and "positive integer" in r["error"]
