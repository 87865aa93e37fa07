"""TargetPOTrainer under the sampler-trainer mismatch correction, without vLLM: a stub generation
(tests/_trl_mismatch.py) returns sampler log-probs through TRL's own field, so that TRL computes
the trainer's old log-probs, the importance-sampling ratio and its metrics as under vLLM.

The masking modes leave the completions whose ratio lies outside TRL's bounds out of their group:
exactly zero gradient for them, and the loss and gradient of the float64 replay of TPO on the kept
completions only. ``sequence_truncate`` weighs each completion in its group with its truncated
ratio (the float64 replay with those weights). Equal log-probs change nothing; ``token_truncate``
is refused.
"""

import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from _trl_mismatch import K, gradient_error, make_trainer, no_gap  # noqa: E402

from tpo_kernels.integrations.trl import TargetPOConfig  # noqa: E402
from tpo_kernels.integrations.trl.generation_batch import sampler_kept  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


# Per generation-batch row, the gap old - sampler: (token position, value) pairs. With
# vllm_importance_sampling_clip_min=0.5 and clip_max=3.0 (TRL's default):
#   row 1: +2.0 on the first token: ratio e^2 = 7.4 > 3, masked by both modes;
#   row 4: -1.0 on the first token: ratio e^-1 = 0.37 < 0.5, masked by both modes;
#   row 6: +1.5 then -1.5: the sequence ratio is 1 (kept by sequence_mask), the first token's
#          e^1.5 = 4.5 > 3 (masked by token_mask);
#   row 2: +0.5 on the first token: ratio 1.65, kept by both.
GAPS = {1: [(0, 2.0)], 4: [(0, -1.0)], 6: [(0, 1.5), (1, -1.5)], 2: [(0, 0.5)]}
MASKED = {"sequence_mask": {1, 4}, "token_mask": {1, 4, 6}}


def gaps(row, length):
    delta = torch.zeros(length)
    for position, value in GAPS.get(row, []):
        if position < length:
            delta[position] = value
    return delta


def run(tiny, tmp_path, delta, **overrides):
    path, tokenizer = tiny
    trainer = make_trainer(path, tokenizer, str(tmp_path), delta, **overrides)
    trainer.train()
    return trainer


@pytest.mark.parametrize("mode", ["sequence_mask", "token_mask"])
def test_masked_completions_leave_their_group(tiny, tmp_path, mode):
    trainer = run(tiny, tmp_path, gaps, vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.5)
    loss64, _, kept, rows = trainer.replays[0]
    # The replay keeps what the injected gaps and TRL's bounds keep; row 6 needs two tokens.
    lengths = [len(d) for d in trainer.deltas[0]]
    expected_masked = {row for row in MASKED[mode] if row != 6 or lengths[6] >= 2}
    hidden_grad = trainer.hidden_grads[0]
    for i, row in enumerate(rows.tolist()):
        if row in expected_masked:
            assert not kept[i]
            assert torch.count_nonzero(hidden_grad[i]) == 0, f"masked row {row} got a gradient"
        elif kept[i]:
            assert torch.count_nonzero(hidden_grad[i]) > 0
    assert (~kept).sum() >= 2
    assert float(trainer.losses[0]) == pytest.approx(float(loss64), rel=1e-5, abs=1e-6)
    assert gradient_error(trainer) <= 1e-4
    logs = [entry for entry in trainer.state.log_history if "tpo/loss" in entry]
    assert logs[0]["tpo/frac_masked_by_sampler"] == pytest.approx(len(expected_masked) / 8)
    for key in ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                "sampling/importance_sampling_ratio/max"):
        assert key in logs[0] and math.isfinite(logs[0][key])
    assert logs[0]["sampling/sampling_logp_difference/max"] == pytest.approx(2.0, abs=1e-3)


def test_reused_generation_anchors_on_the_trainers_old_logprobs(tiny, tmp_path):
    # One generation, two optimizer steps: p_old is TRL's old_per_token_logps (the trainer's no-grad
    # forward at generation time), not the sampler's log-probs, which differ by the injected gaps.
    trainer = run(tiny, tmp_path, gaps, steps_per_generation=2, max_steps=2, vllm_importance_sampling_clip_min=0.5)
    assert len(trainer.replays) == 2
    for step in range(2):
        loss64 = trainer.replays[step][0]
        assert float(trainer.losses[step]) == pytest.approx(float(loss64), rel=1e-5, abs=1e-6)
        assert gradient_error(trainer, step) <= 1e-4


def test_equal_logprobs_change_nothing(tiny, tmp_path):
    """The sampler agreeing with the trainer: no completion is masked, and the loss and gradient
    are bit for bit those of the same run without the correction (no vLLM)."""
    corrected = run(tiny, tmp_path / "corrected", no_gap)
    plain = run(tiny, tmp_path / "plain", no_gap, vllm_importance_sampling_correction=False)
    logs = [entry for entry in corrected.state.log_history if "tpo/loss" in entry]
    assert logs[0]["tpo/frac_masked_by_sampler"] == 0.0
    assert not any("tpo/frac_masked_by_sampler" in entry or "sampling/importance_sampling_ratio/mean" in entry
                   for entry in plain.state.log_history)
    assert torch.equal(corrected.losses[0], plain.losses[0])
    for name, grad in plain.grads[0].items():
        assert torch.equal(corrected.grads[0][name], grad), name


def test_sampler_kept_reads_trls_ratio():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    sequence = torch.tensor([[1.2], [0.0], [2.9], [1.0]])
    assert sampler_kept(sequence, mask).tolist() == [True, False, True, True]
    token = torch.tensor([[1.0, 1.1, 0.0], [1.0, 0.0, 1.0], [0.9, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # a 0 outside the counted tokens (padding) does not mask
    assert sampler_kept(token, mask).tolist() == [True, False, True, True]
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        sampler_kept(torch.ones(4), mask)
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        sampler_kept(torch.ones(4, 2), mask)


def test_sequence_truncate_weighs_each_completion_with_its_truncated_ratio(tiny, tmp_path):
    """``sequence_truncate``: every completion counts in its group with TRL's truncated sequence
    ratio ``min(max(rho, clip_min), clip_max)`` as its weight (the loss's ``seq_log_weights``): the
    loss and gradient of the float64 replay with those weights; no completion is left out."""
    trainer = run(tiny, tmp_path, gaps, vllm_importance_sampling_mode="sequence_truncate",
                  vllm_importance_sampling_clip_min=0.5)
    loss64, _, kept, _ = trainer.replays[0]
    assert bool(kept.all())
    assert float(trainer.losses[0]) == pytest.approx(float(loss64), rel=1e-5, abs=1e-6)
    assert gradient_error(trainer) <= 1e-4
    logs = [entry for entry in trainer.state.log_history if "tpo/loss" in entry]
    assert logs[0]["tpo/frac_masked_by_sampler"] == 0.0


def test_sequence_truncate_weights_are_not_the_mask(tiny, tmp_path):
    """The weights matter: the truncated run's loss differs from the same run without correction."""
    weighted = run(tiny, tmp_path / "weighted", gaps, vllm_importance_sampling_mode="sequence_truncate",
                   vllm_importance_sampling_clip_min=0.5)
    plain = run(tiny, tmp_path / "plain", gaps, vllm_importance_sampling_correction=False)
    assert not torch.equal(weighted.losses[0], plain.losses[0])


def test_token_truncate_is_refused_with_vllm(tmp_path):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=K, use_cpu=True,
                    bf16=False, report_to="none", vllm_importance_sampling_mode="token_truncate")
    refusal = (r"vllm_importance_sampling_mode='token_truncate'.*'sequence_mask', 'token_mask' or "
               r"'sequence_truncate'.*Per-token weights would change")
    with pytest.raises(ValueError, match=refusal):
        TargetPOConfig(use_vllm=True, **settings)
    TargetPOConfig(use_vllm=True, vllm_importance_sampling_correction=False, **settings)  # correction off
    TargetPOConfig(**settings)  # no vLLM: TRL computes no ratio, nothing changes
    TargetPOConfig(use_vllm=True, **dict(settings, vllm_importance_sampling_mode="sequence_truncate"))
