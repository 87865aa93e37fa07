"""TargetPOTrainer with TRL's entropy bonus: ``loss - entropy_coef * H`` (H the mean tempered token
entropy of the loss call's counted tokens) from the loss's own vocabulary pass, static or under
TRL's adaptive controller, against a float64 replay (``reference.tpo_loss(..., entropy_coef=)``)."""

import collections

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from _trl_mismatch import gradient_error, make_trainer, no_gap  # noqa: E402

from tpo_kernels import kit, reference  # noqa: E402
from tpo_kernels.integrations import trl as tpo_trl  # noqa: E402
from tpo_kernels.integrations.trl import TargetPOConfig  # noqa: E402
from tpo_kernels.integrations.trl.metrics import log_tpo_metrics  # noqa: E402
from tpo_kernels.integrations.trl.request import TPORequest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def run(tiny, tmp_path, **overrides):
    """The stub trainer without the sampler correction (as without vLLM), so that the float64 replay
    of tests/_trl_mismatch.py applies to every completion."""
    path, tokenizer = tiny
    trainer = make_trainer(path, tokenizer, str(tmp_path), no_gap, vllm_importance_sampling_correction=False,
                           **overrides)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def bonus_runs(tiny, tmp_path_factory):
    """One optimizer step on the same batch with ``entropy_coef=0.3`` and without the bonus."""
    return (run(tiny, tmp_path_factory.mktemp("bonus"), entropy_coef=0.3),
            run(tiny, tmp_path_factory.mktemp("without")))


def test_entropy_bonus_matches_the_replay(bonus_runs):
    trainer, without = bonus_runs
    assert float(trainer.losses[0]) == pytest.approx(float(trainer.replays[0][0]), rel=1e-5, abs=1e-6)
    assert gradient_error(trainer) <= 1e-4
    logs = [entry for entry in trainer.state.log_history if "tpo/loss" in entry]
    # The bonus is in the trained loss: it moves it by -0.3 times the logged token entropy.
    assert float(trainer.losses[0] - without.losses[0]) == pytest.approx(-0.3 * logs[0]["tpo/token_entropy"],
                                                                         rel=1e-4)
    assert logs[0]["entropy_coef"] == 0.3  # logged on optimizer-step boundaries, as TRL does


def test_grpo_metric_names_are_logged_with_the_bonus(bonus_runs):
    """GRPOTrainer's own metrics under their names (TRL's dashboards read them): ``policy_loss``, the
    loss before the bonus (the float64 replay of TPO alone on the same batch), and ``entropy``, the
    mean tempered token entropy of the step's counted tokens (the bonus's H, in float64: the replays'
    difference over the coefficient); ``tpo/loss`` is the trained loss, bonus included."""
    trainer, without = bonus_runs
    entry = next(entry for entry in trainer.state.log_history if "tpo/loss" in entry)
    tpo_alone = float(without.replays[0][0])
    entropy = (tpo_alone - float(trainer.replays[0][0])) / 0.3
    assert entry["policy_loss"] == pytest.approx(tpo_alone, rel=1e-5, abs=1e-6)
    assert entry["entropy"] == pytest.approx(entropy, rel=1e-4)
    assert entry["tpo/loss"] == pytest.approx(tpo_alone - 0.3 * entropy, rel=1e-5, abs=1e-6)


def test_grpo_metric_names_without_the_bonus(bonus_runs):
    """Without the bonus, as GRPOTrainer: ``entropy`` is logged, ``policy_loss`` is not."""
    _, without = bonus_runs
    entry = next(entry for entry in without.state.log_history if "tpo/loss" in entry)
    assert "policy_loss" not in entry
    assert entry["entropy"] == pytest.approx(entry["tpo/token_entropy"], rel=1e-6)


def test_grpo_metrics_read_this_micro_steps_rows():
    """A loss call with detached rows (a group spanning micro-steps), on one process: ``entropy`` and
    ``kl`` are token means over this micro-step's own rows, as GRPOTrainer's over its micro-batch;
    ``tpo/token_entropy`` and ``tpo/kl_k3`` over the call's rows; ``policy_loss`` adds back the
    applied bonus ``c * H``, H over the call's rows (as the loss reduces it)."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)  # 2 own rows, 2 detached
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [4.0, 5.0, 6.0], [7.0, 9.0, 9.0]])
    token_logprobs = -torch.rand(4, 3)
    ref = token_logprobs + 0.5 * torch.randn(4, 3)
    half = torch.full((4,), 0.5)
    aux = dict(p=half, q=half, u=torch.tensor([1.0, -1.0, -1.0, 1.0]), token_entropy=entropy,
               token_logprobs=token_logprobs)
    out = dict(loss=torch.tensor(0.7), mask=mask, kept=mask.any(dim=1), aux=aux, ref_logprobs=ref)
    request = metrics_request(labels=torch.zeros(2, 3, dtype=torch.long), metric_group_ids=torch.tensor([0, 1, 0, 1]),
                              beta=0.1, entropy_coef=0.25, process_group=None)
    metrics = collections.defaultdict(list)
    log_tpo_metrics(metrics, lambda tensor: tensor, out, request, entropy_bonus=True)
    diff = (ref - token_logprobs).double()
    k3 = (diff.exp() - diff - 1) * mask
    assert metrics["entropy"] == [pytest.approx((1 + 2 + 3) / 3)]
    assert metrics["tpo/token_entropy"] == [pytest.approx((1 + 2 + 3 + 4 + 5 + 6 + 7) / 7)]
    assert metrics["kl"] == [pytest.approx(float(k3[:2].sum() / 3), rel=1e-6)]
    assert metrics["tpo/kl_k3"] == [pytest.approx(float(k3.sum() / 7), rel=1e-6)]
    assert metrics["policy_loss"] == [pytest.approx(0.7 + 0.25 * 28 / 7)]
    assert metrics["tpo/loss"] == [pytest.approx(0.7)]


def metrics_request(labels, metric_group_ids, **fields):
    """A loss call's request with the fields :func:`log_tpo_metrics` reads (the others neutral)."""
    return TPORequest(labels=labels, mask=torch.ones(labels.shape, dtype=torch.bool), temperature=1.0, backend="cpu",
                      cast_lm_head_to_fp32=False, token_entropy=True, scores=torch.zeros(labels.shape[0]),
                      group_ids=metric_group_ids[: labels.shape[0]], metric_group_ids=metric_group_ids, **fields)


def _loss_call(mask, entropy, loss, process_group):
    """A loss call's output and request as :func:`log_tpo_metrics` reads them (no detached rows)."""
    half = torch.full((mask.shape[0],), 0.5)
    aux = dict(p=half, q=half, u=torch.ones(mask.shape[0]), token_entropy=entropy,
               token_logprobs=torch.zeros(mask.shape))
    out = dict(loss=torch.tensor(loss), mask=mask, kept=mask.any(dim=1), aux=aux, ref_logprobs=None)
    request = metrics_request(labels=torch.zeros(mask.shape, dtype=torch.long), metric_group_ids=torch.tensor([0, 1]),
                              beta=0.0, entropy_coef=0.5, process_group=process_group)
    return out, request


def test_policy_loss_with_groups_split_over_processes():
    """Groups gathered over 2 processes: every process returns the same loss, and the bonus's H is
    the token mean over both processes' tokens (not each process's own mean), as the loss reduces
    it; ``entropy`` is that mean too (GRPOTrainer's mean over every process's tokens)."""
    mask_a = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)  # 4 tokens, entropy sum 4
    mask_b = torch.tensor([[1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # 1 token, entropy sum 6
    entropy_a, entropy_b = torch.ones(2, 3), torch.full((2, 3), 6.0)
    sent_by_b = []  # process b's tensors, as the gather receives them
    log_tpo_metrics(collections.defaultdict(list), lambda tensor: sent_by_b.append(tensor) or tensor,
                    *_loss_call(mask_b, entropy_b, 0.7, process_group="world"), entropy_bonus=True)
    from_b = iter(sent_by_b)
    metrics = collections.defaultdict(list)
    log_tpo_metrics(metrics, lambda tensor: torch.cat([tensor, next(from_b)]),
                    *_loss_call(mask_a, entropy_a, 0.7, process_group="world"), entropy_bonus=True)
    assert metrics["entropy"] == [pytest.approx(10 / 5)]
    assert metrics["policy_loss"] == [pytest.approx(0.7 + 0.5 * 10 / 5)]


@pytest.mark.parametrize("target", [100.0, 0.0])
def test_adaptive_entropy_follows_trls_controller(tiny, tmp_path, target):
    """Skywork-OR1's controller as GRPOTrainer runs it: the coefficient applies only while the last
    window's entropy is at most entropy_target (never in the first step: no window yet), and moves
    by entropy_coef_delta after each optimizer step, within [entropy_coef_min, entropy_coef_max]."""
    trainer = run(tiny, tmp_path, max_steps=2, use_adaptive_entropy=True, entropy_coef=0.3, entropy_coef_delta=0.01,
                  entropy_target=target)
    for step in range(2):
        assert float(trainer.losses[step]) == pytest.approx(float(trainer.replays[step][0]), rel=1e-5, abs=1e-6)
        assert gradient_error(trainer, step) <= 1e-4
    logs = [entry for entry in trainer.state.log_history if "tpo/loss" in entry]
    if target > 1:  # entropy below the target: applied from step 2, coefficient raised each step
        assert [entry["entropy_coef"] for entry in logs] == pytest.approx([0.31, 0.32])
        assert trainer._applied_entropy_coef() == pytest.approx(0.32)
    else:  # entropy above the target: never applied, coefficient lowered
        assert [entry["entropy_coef"] for entry in logs] == pytest.approx([0.29, 0.28])
        assert trainer._applied_entropy_coef() == 0.0
    world = trainer._last_world_entropy
    assert 0 < world < 4 and abs(world - logs[1]["tpo/token_entropy"]) < 1e-4  # one micro-step per window


def test_tpo_head_entropy_bonus_with_detached_rows():
    """A group spanning micro-steps: the bonus's H is the mean over the call's counted tokens (own
    and detached rows), its gradient through this micro-step's rows only."""
    torch.manual_seed(0)
    num_rows, own, prompt, length, width, vocab = 8, 4, 3, 5, 16, 50
    hidden_all = torch.randn(num_rows, prompt + length, width)
    head = torch.nn.Linear(width, vocab)
    labels = torch.randint(0, vocab, (num_rows, length))
    mask = torch.rand(num_rows, length) > 0.3
    mask[:, 0] = True
    scores = torch.randn(num_rows)
    group_ids = torch.tensor([7, 9, 7, 9, 9, 7, 9, 7])
    settings = dict(temperature=0.8, backend="cpu", cast_lm_head_to_fp32=False, token_entropy=True)
    with torch.no_grad():
        theirs = tpo_trl.head._tpo_logprobs(hidden_all[own:], head, TPORequest(
            logprobs_only=True, labels=labels[own:], mask=mask[own:], **settings))
    detached = kit.LossRows(logprobs=theirs["token_logprobs"], token_entropy=theirs["token_entropy"], mask=mask[own:],
                            scores=scores[own:], group_ids=group_ids[own:], ref_logprobs=None)
    hidden = hidden_all[:own].clone().requires_grad_()
    request = TPORequest(labels=labels[:own], mask=mask[:own], scores=scores[:own], group_size=None,
                         group_ids=group_ids[:own], process_group=None, old_logprobs=None, ref_logprobs=None,
                         detached=detached, score_eps=1e-6, beta=0.0, eta=0.7, anchor=True, length_normalize=False,
                         entropy_coef=0.25, **settings)
    out = tpo_trl.head._tpo_head(hidden, head, request)
    out["loss"].backward()

    hidden64 = hidden_all.double()[:own].requires_grad_()
    weight64, bias64 = head.weight.detach().double().requires_grad_(), head.bias.detach().double().requires_grad_()
    logits = torch.cat([hidden64[:, prompt - 1 : -1] @ weight64.T + bias64,
                        (hidden_all.double()[own:, prompt - 1 : -1] @ weight64.T + bias64).detach()])
    expected = reference.tpo_loss(logits, labels.masked_fill(~mask, -100), scores.double(), group_ids=group_ids,
                                  eta=0.7, temperature=0.8, entropy_coef=0.25)
    expected.backward()
    assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(hidden.grad.double(), hidden64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.weight.grad.double(), weight64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("field, value", [("entropy_coef", -0.1), ("entropy_coef", float("nan")),
                                          ("entropy_coef_min", -0.1)])
def test_negative_entropy_coef_is_refused(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number >= 0"):
        TargetPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, use_cpu=True,
                       bf16=False, report_to="none", use_adaptive_entropy=True, **{field: value})
