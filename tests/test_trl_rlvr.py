"""Smoke tests of the TRL RLVR benchmark (bench/trl_rlvr.py): the reverse-copy task
through TRL's reward-function interface, and a few TargetPOTrainer steps on the easy setting (H=2:
a random completion is right with probability 1/4) where TPO's reward rises and its loss falls on
each generation it trains on twice. Bounded: well under a minute on 2 cores."""

import json

import pytest

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from bench import trl_rlvr  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# num_iterations=2: every generation is trained on for two optimizer steps, so the TPO loss of its
# second step (TRL logs one loss per step) shows whether the first step moved toward the target.
EASY = dict(horizon=2, steps=12, prompts=8, group=4, lr=1e-2, num_iterations=2, log_every=0)


def _mean(xs):
    return sum(xs) / len(xs)


def test_reward_function_scores_only_the_exact_reversal():
    prompts = ["0 1 1 =", "0 1 1 =", "1 0 0 =", "1 0 0 ="]
    completions = ["1 1 0", "1 0 0", "0 0 1", "0 0 1 1"]
    assert trl_rlvr.reverse_exact(prompts, completions) == [1.0, 0.0, 1.0, 0.0]


def test_tokenizer_round_trip_and_suppressed_tokens():
    tokenizer = trl_rlvr.build_tokenizer()
    ids = tokenizer("0 1 1 =")["input_ids"]
    assert len(ids) == 4 and tokenizer.decode(ids) == "0 1 1 ="
    kept = set(range(len(tokenizer))) - set(trl_rlvr.suppressed_ids(tokenizer))
    assert sorted(tokenizer.convert_ids_to_tokens(sorted(kept))) == ["0", "1"]


@pytest.fixture(scope="module")
def tpo_run():
    return trl_rlvr.train_run(trl_rlvr.TRLRunSpec(method="tpo", seed=0, **EASY), log=lambda _: None)


def test_tpo_reward_rises_through_trl(tpo_run):
    reward = tpo_run["curves"]["reward"]
    assert len(reward) == EASY["steps"] // EASY["num_iterations"]  # one per generation
    assert _mean(reward[-2:]) > _mean(reward[:2]) + 0.2, reward
    assert tpo_run["greedy_final_error"] < 0.75  # greedy decoding beats chance (3/4 wrong) on all 4 prompts


def test_tpo_loss_falls_on_reused_generations(tpo_run):
    # steps 2i+1 and 2i+2 train on generation i toward the same target q (anchored on the rollout
    # policy): the second step sees the policy after one Adam step toward q, so its loss is lower on
    # most generations and on average (one Adam step at lr 1e-2 can overshoot on a generation)
    loss, informative = tpo_run["curves"]["loss"], tpo_run["curves"]["informative_groups"]
    assert len(loss) == EASY["steps"]
    pairs = [(loss[2 * i], loss[2 * i + 1]) for i in range(len(informative)) if informative[i] > 0]
    assert len(pairs) >= 4
    assert sum(second < first for first, second in pairs) >= 0.75 * len(pairs), pairs
    assert sum(second for _, second in pairs) < sum(first for first, _ in pairs), pairs


def test_no_learning_at_lr_zero():
    # the rise above is not vacuous: with lr 0 the reward stays near chance (1/4)
    run = trl_rlvr.train_run(trl_rlvr.TRLRunSpec(method="tpo", seed=0, **{**EASY, "lr": 0.0, "steps": 6}),
                             log=lambda _: None)
    assert _mean(run["curves"]["reward"]) < 0.45


def test_supervised_check_learns_the_reversal():
    # the capacity check itself must be able to reach 0: at H=2 cross-entropy on the 4 reversals
    curve = trl_rlvr.supervised_run(trl_rlvr.TRLRunSpec(method="supervised", seed=0, horizon=2, steps=100,
                                                        prompts=8, lr=1e-2), eval_every=50)
    assert curve["step"] == [50, 100]
    assert curve["greedy_error"][-1] == 0.0, curve


def test_summary_and_report_from_results_json(tmp_path, tpo_run):
    run = {**tpo_run, "final_error": 0.5}
    results = {"config": {**vars(trl_rlvr.build_parser().parse_args([])), "methods": ["tpo"], "processes": [1],
                          "argv": []},
               "machine": {"cpu_count": 2, "loadavg": [1.0, 1.0, 1.0]}, "runs": [run]}
    paths = trl_rlvr.write_outputs(results, str(tmp_path), plot=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["runs"][0]["method"] == "tpo" and saved["runs"][0]["final_error"] == 0.5
    assert saved["summary"][0]["median_final_error"] == 0.5
    assert "| tpo | 1 | **50.0** |" in (tmp_path / "results.md").read_text()
    assert len(paths) == 2


class _FakeProcess:
    """Stands in for a run's subprocess: finishes on its second poll, writing its run file."""

    def __init__(self, spec, out_path, live):
        self.spec, self.out_path, self.live, self.polls, self.returncode = spec, out_path, live, 0, None
        live.append(spec)

    def poll(self):
        self.polls += 1
        if self.polls < 2:
            return None
        self.live.remove(self.spec)
        with open(self.out_path, "w") as f:
            json.dump({**trl_rlvr.asdict(self.spec), "name": self.spec.name}, f)
        self.returncode = 0
        return 0


@pytest.fixture
def fake_launch(monkeypatch, tmp_path):
    """Replaces the subprocess launch; returns (launched specs, the most processes live at once)."""
    launched, live, peak = [], [], [0]

    def launch(spec, tmp):
        launched.append(spec)
        proc = _FakeProcess(spec, str(tmp_path / f"{len(launched)}.json"), live)
        peak[0] = max(peak[0], sum(s.processes for s in live))
        return proc, proc.out_path

    monkeypatch.setattr(trl_rlvr, "_launch", launch)
    monkeypatch.setattr(trl_rlvr.time, "sleep", lambda _: None)
    return launched, peak


@pytest.mark.parametrize("jobs, peak_processes", [(1, 2), (2, 2), (3, 3)])
def test_jobs_counts_the_processes_of_torchrun_runs(fake_launch, jobs, peak_processes):
    # jobs 1: a 2-process run still starts (alone); jobs 3: a 2-process run shares with one 1-process run
    launched, peak = fake_launch
    specs = [trl_rlvr.TRLRunSpec(method=m, seed=s) for s in range(2) for m in trl_rlvr.METHODS]
    specs += [trl_rlvr.TRLRunSpec(method=m, seed=0, processes=2) for m in trl_rlvr.METHODS]
    runs = trl_rlvr.run_all(specs, jobs)
    assert [r["name"] for r in runs] == [s.name for s in specs]
    assert peak[0] == peak_processes


def test_resume_reads_back_only_runs_of_the_same_spec(fake_launch, tmp_path):
    launched, _ = fake_launch
    runs_dir = str(tmp_path / "runs")
    done, changed = trl_rlvr.TRLRunSpec(method="tpo", seed=0), trl_rlvr.TRLRunSpec(method="grpo", seed=0)
    trl_rlvr.run_all([done, trl_rlvr.TRLRunSpec(method="grpo", seed=0, steps=5)], 2, runs_dir)
    launched.clear()
    runs = trl_rlvr.run_all([done, changed], 2, runs_dir, resume=True)
    assert [s.name for s in launched] == [changed.name]  # grpo's file holds steps=5: run again
    assert [r["steps"] for r in runs] == [done.steps, changed.steps]
