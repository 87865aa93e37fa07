"""TargetPOTrainer (tpo_kernels.integrations.trl) on CPU, offline: a tiny OLMo-2 built from a config
and a word-level tokenizer built with the tokenizers library (tests/_trl_tiny.py).

Every micro-batch is checked inside the trainer (a recording subclass): its groups are whole, the
scores it carries are the weighted sum of the raw rewards, and the loss the trainer returns equals
``tpo_kernels.reference.tpo_loss`` on the logits of the same batch, recomputed with the model's
ordinary forward, with those scores and the config's ``tpo_score_eps``.
"""

import math
import pathlib
import re

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from _trl_tiny import dataset, even_words  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from tpo_kernels import kit, reference  # noqa: E402
from tpo_kernels.integrations import trl as tpo_trl  # noqa: E402
from tpo_kernels.integrations.trl import TargetPOConfig, TargetPOTrainer, shuffle_groups  # noqa: E402
from tpo_kernels.integrations.trl.generation_batch import tpo_scores_from_rewards  # noqa: E402
from tpo_kernels.integrations.trl.request import TPORequest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

K = 4


def distinct_words(completions, **kwargs):
    return [float(len(set(text.split()))) for text in completions]


class RecordingTrainer(TargetPOTrainer):
    """Checks every micro-batch the trainer computes a loss on, and records what it saw."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records, self.eval_records = [], []
        self.score_checks = []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._raw_rewards = rewards.clone()
        return rewards

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        # The scores are the weighted sum of the raw rewards (sum_then_normalize; one process).
        combined = (self._raw_rewards.double() * self.reward_weights.double().unsqueeze(0)).sum(dim=1)
        self.score_checks.append(float((out["tpo_scores"].double() - combined).abs().max()))
        return out

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        record = self._check_micro_batch(model, inputs, loss)
        (self.records if self.model.training else self.eval_records).append(record)
        return loss

    def _check_micro_batch(self, model, inputs, loss):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        num_rows, length = completion_ids.shape
        training = self.model.training
        assert num_rows == (self.args.per_device_train_batch_size if training else self.args.per_device_eval_batch_size)
        assert num_rows % K == 0, "micro-batch is not a whole number of groups"
        blocks = prompt_ids.view(num_rows // K, K, -1)
        whole = bool((blocks == blocks[:, :1]).all())  # each block of K rows is one prompt...
        distinct = len({tuple(row.tolist()) for row in prompt_ids}) == num_rows // K  # ...and blocks differ

        generate_every = self.args.steps_per_generation * self.num_iterations
        reused = training and self.args.gradient_accumulation_steps % generate_every != 0
        old = inputs.get("old_per_token_logps") if reused else None
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        mask = inputs["completion_mask"].bool()
        kept = mask.any(dim=1)
        with torch.no_grad():
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -length - 1 : -1]
            labels = completion_ids.masked_fill(~mask, -100)
            group_ids = torch.arange(num_rows) // K
            if bool(kept.any()):
                expected = reference.tpo_loss(
                    logits[kept].double(),
                    labels[kept],
                    inputs["tpo_scores"][kept].double(),
                    group_ids=group_ids[kept],
                    old_logprobs=None if old is None else old[kept].double(),
                    ref_logprobs=None if ref is None else ref[kept].double(),
                    beta=self.beta,
                    eta=self.args.tpo_eta,
                    anchor=self.args.tpo_anchor,
                    score_eps=self.args.tpo_score_eps,
                    temperature=self.temperature,
                ).item()
            else:
                expected = 0.0
            off_policy_gap = 0.0
            if old is not None:
                current = reference.token_logprobs(logits, completion_ids, temperature=self.temperature)
                off_policy_gap = float(((current - old.double()).abs() * mask).max())
        return {
            "loss": loss.item() * (self.current_gradient_accumulation_steps if training else 1),  # unscaled
            "expected": expected,
            "whole": whole and distinct,
            "used_old": old is not None,
            "off_policy_gap": off_policy_gap,
            "excluded": int((~kept).sum()),
        }


def make_config(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=K,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-3,
        bf16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        tpo_backend="cpu",
    )
    kwargs.update(overrides)
    return TargetPOConfig(**kwargs)


def train(tiny, tmp_path, reward_funcs=even_words, eval_dataset=None, **overrides):
    path, tokenizer = tiny
    trainer = RecordingTrainer(
        model=path,
        reward_funcs=reward_funcs,
        args=make_config(tmp_path, **overrides),
        train_dataset=dataset(),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [name for name, p in trainer.model.named_parameters() if not torch.equal(before[name], p.detach())]
    logs = [entry for entry in trainer.state.log_history if "tpo/loss" in entry]
    return trainer, changed, logs


def check_run(trainer, changed, logs, micro_batches):
    assert len(trainer.records) == micro_batches
    for record in trainer.records:
        assert record["whole"], "a micro-batch split a group"
        assert math.isfinite(record["loss"])
        assert record["loss"] == pytest.approx(record["expected"], rel=1e-4, abs=1e-5)
    assert trainer.score_checks and max(trainer.score_checks) <= 1e-12
    assert "lm_head.weight" in changed and any("layers.0" in name for name in changed)
    assert len(logs) == trainer.args.max_steps
    for entry in logs:
        for key in ("tpo/loss", "tpo/kl_q_p", "tpo/entropy_p", "tpo/entropy_q", "tpo/frac_zero_signal_groups",
                    "tpo/token_entropy"):
            assert key in entry
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["tpo/loss"])


def test_two_steps_on_policy(tiny, tmp_path):
    trainer, changed, logs = train(
        tiny, tmp_path, temperature=0.7, tpo_eta=0.5,
        eval_dataset=dataset(2), eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8,
    )
    check_run(trainer, changed, logs, micro_batches=2)
    evals = [entry for entry in trainer.state.log_history if "eval_tpo/loss" in entry]
    assert len(evals) == 1 and math.isfinite(evals[0]["eval_tpo/loss"])
    assert len(trainer.eval_records) == 1  # eval: same loss on whole groups, on-policy, no GA scaling
    record = trainer.eval_records[0]
    assert record["whole"] and record["loss"] == pytest.approx(record["expected"], rel=1e-4, abs=1e-5)
    assert not any(r["used_old"] for r in trainer.records)  # on-policy: p_old = p
    assert 0.0 <= logs[0]["tpo/frac_zero_signal_groups"] < 1.0
    assert logs[0]["tpo/entropy_p"] <= math.log(K) + 1e-6 and logs[0]["tpo/kl_q_p"] >= 0.0


def test_gradient_accumulation_two_rewards(tiny, tmp_path):
    # 4 groups generated per optimizer step, shuffled by group into 2 micro-batches of 2 groups.
    trainer, changed, logs = train(
        tiny, tmp_path, reward_funcs=[even_words, distinct_words], reward_weights=[1.0, 0.25],
        gradient_accumulation_steps=2,
    )
    check_run(trainer, changed, logs, micro_batches=4)
    assert not any(r["used_old"] for r in trainer.records)  # generation aligned with the optimizer step
    # TRL's logged loss is the sum of the returned (GA-scaled) losses: the mean of the unscaled ones.
    for step, entry in enumerate(logs):
        window = [r["loss"] for r in trainer.records[2 * step : 2 * step + 2]]
        assert entry["loss"] == pytest.approx(sum(window) / 2, rel=1e-4, abs=1e-6)


def test_steps_per_generation_uses_old_logprobs(tiny, tmp_path):
    # One generation serves two optimizer steps: the second trains off-policy against p_old.
    trainer, changed, logs = train(tiny, tmp_path, steps_per_generation=2, learning_rate=1e-2)
    check_run(trainer, changed, logs, micro_batches=2)
    assert all(r["used_old"] for r in trainer.records)
    assert trainer.records[1]["off_policy_gap"] > 1e-6  # the policy moved between the two steps


def test_beta_kl_with_fp32_head(tiny, tmp_path):
    trainer, changed, logs = train(tiny, tmp_path, beta=0.05, cast_lm_head_to_fp32=True, learning_rate=1e-2)
    check_run(trainer, changed, logs, micro_batches=2)
    assert all("tpo/kl_k3" in entry and entry["tpo/kl_k3"] >= 0.0 for entry in logs)
    assert logs[1]["tpo/kl_k3"] > 0.0  # the policy left the reference after the first step
    # and under GRPOTrainer's name, over the micro-step's tokens (here the call's: one micro-step per step)
    assert [entry["kl"] for entry in logs] == pytest.approx([entry["tpo/kl_k3"] for entry in logs], rel=1e-6)


def test_mask_truncated_completions(tiny, tmp_path):
    trainer, changed, logs = train(tiny, tmp_path, mask_truncated_completions=True, tpo_anchor=False)
    assert sum(r["excluded"] for r in trainer.records) > 0  # truncated completions are left out
    assert any(r["excluded"] < 8 for r in trainer.records)  # and some remain
    check_run(trainer, changed, logs, micro_batches=2)
    assert any(entry["tpo/frac_excluded_completions"] > 0 for entry in logs)


def test_group_spanning_optimizer_steps_is_refused(tiny, tmp_path):
    # 2 rows per micro-step, groups of 4: a group spans 2 micro-steps, which must be in one optimizer step.
    spanning = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=4, steps_per_generation=2,
                    use_cpu=True, bf16=False, report_to="none")
    GRPOConfig(**spanning)  # TRL accepts it: its per-token loss does not care which step holds a completion
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps \(1\) must be a multiple of 2"):
        TargetPOConfig(**spanning)
    TargetPOConfig(**{**spanning, "gradient_accumulation_steps": 2})  # the group within one optimizer step
    args = make_config(tmp_path)
    args.per_device_train_batch_size = 6  # changed after the config checked it
    path, tokenizer = tiny
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps \(1\) must be a multiple of 2"):
        TargetPOTrainer(model=path, reward_funcs=even_words, args=args, train_dataset=dataset(),
                        processing_class=tokenizer)
    with pytest.raises(TypeError, match="TargetPOConfig"):
        grpo_args = GRPOConfig(**{**spanning, "per_device_train_batch_size": 4})
        TargetPOTrainer(model=path, reward_funcs=even_words, args=grpo_args, train_dataset=dataset(),
                        processing_class=tokenizer)


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="tpo_eta"):
        make_config(tmp_path, tpo_eta=0.0)
    with pytest.raises(ValueError, match="tpo_backend"):
        make_config(tmp_path, tpo_backend="gpu")
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        make_config(tmp_path, top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match="use_bias_correction_kl"):
        make_config(tmp_path, beta=0.1, use_bias_correction_kl=True)


@pytest.mark.parametrize("score_eps", [-1e-6, float("nan"), float("inf"), 1e-40, True, "1e-6"])
def test_bad_score_eps_is_refused(tmp_path, score_eps):
    with pytest.raises(ValueError, match="tpo_score_eps must be 0 or a number"):
        make_config(tmp_path, tpo_score_eps=score_eps)


def scaled_even_words(scale):
    def reward(completions, **kwargs):
        return [scale * r for r in even_words(completions)]

    reward.__name__ = "scaled_even_words"
    return reward


class GradientRecorder(RecordingTrainer):
    """Also keeps the gradient of the (one-micro-step) optimizer step."""

    def training_step(self, model, inputs, num_items_in_batch):
        out = super().training_step(model, inputs, num_items_in_batch)
        self.grads = torch.cat([p.grad.detach().flatten().clone() for p in self.model.parameters()])
        return out


def gradient_at_spread(tiny, tmp_path, spread, **overrides):
    path, tokenizer = tiny
    trainer = GradientRecorder(model=path, reward_funcs=scaled_even_words(spread),
                               args=make_config(tmp_path, max_steps=1, **overrides), train_dataset=dataset(),
                               processing_class=tokenizer)
    trainer.train()
    assert len(trainer.records) == 1 and max(trainer.score_checks) <= 1e-12
    record = trainer.records[0]  # the loss is reference.tpo_loss on the raw rewards with tpo_score_eps
    assert record["loss"] == pytest.approx(record["expected"], rel=1e-5, abs=1e-6)
    return trainer.grads


def test_score_eps_applies_to_the_raw_rewards(tiny, tmp_path):
    """A within-group reward spread of 1e-7 is noise under the default tpo_score_eps (1e-6): its
    gradient is at most 1e-6 of the one at spread 1. With tpo_score_eps=0 every group is standardized,
    so the gradient is the one at spread 1 (TRL's advantages divide by std + 1e-4, which would turn
    the small spread into a 1e-3 signal)."""
    full = gradient_at_spread(tiny, tmp_path / "full", 1.0)
    noise = gradient_at_spread(tiny, tmp_path / "noise", 1e-7)
    standardized = gradient_at_spread(tiny, tmp_path / "standardized", 1e-7, tpo_score_eps=0.0)
    assert full.norm() > 1e-3
    assert noise.norm() <= 1e-6 * full.norm()
    assert noise.norm() > 0  # the spread still carries its own, tiny, signal
    torch.testing.assert_close(standardized, full, rtol=1e-4, atol=1e-6 * float(full.abs().max()))


def test_scores_from_rewards():
    """tpo_scores_from_rewards: weighted sums; an unscored completion (NaN everywhere) takes its
    group's mean; normalize_then_sum standardizes each reward in its group under the tie rule."""
    nan = float("nan")
    rewards = torch.tensor([[1.0, 0.0], [2.0, nan], [3.0, 1.0], [nan, nan],  # group 0
                            [5.0, 1.0], [5.0, 2.0], [5.0, 3.0], [5.0, 4.0]])  # group 1: reward 0 ties
    weights = torch.tensor([1.0, 0.5])
    sums = tpo_scores_from_rewards(rewards, weights, 4, "sum_then_normalize", 1e-6)
    assert sums[:3].tolist() == [1.0, 2.0, 3.5] and sums[3].item() == pytest.approx(6.5 / 3)
    assert sums[4:].tolist() == [5.5, 6.0, 6.5, 7.0]
    normalized = tpo_scores_from_rewards(rewards, weights, 4, "normalize_then_sum", 1e-6)
    first = reference.standardize(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    second = reference.standardize(torch.tensor([0.0, 1.0], dtype=torch.float64))
    expected = torch.stack([first[0] + 0.5 * second[0], first[1], first[2] + 0.5 * second[1]])
    torch.testing.assert_close(normalized[:3], expected)
    assert normalized[3].item() == pytest.approx(expected.mean().item())
    torch.testing.assert_close(normalized[4:], 0.5 * reference.standardize(torch.arange(1.0, 5.0).double()))
    near_tie = torch.tensor([[0.0], [1e-7], [2e-7], [3e-7]])  # std about 1.1e-7 <= score_eps: centered only
    centered = tpo_scores_from_rewards(near_tie, torch.ones(1), 4, "normalize_then_sum", 1e-6)
    torch.testing.assert_close(centered, near_tie.double().view(-1) - near_tie.double().mean())


def test_shuffle_groups_keeps_groups_whole():
    rows = torch.arange(24)
    batch = {"ids": torch.arange(24).view(24, 1), "names": [f"r{i}" for i in range(24)], "n": torch.tensor(7),
             "none": None}
    generator = torch.Generator().manual_seed(1)
    out = shuffle_groups(batch, 4, generator=generator)
    ids = out["ids"].view(6, 4)
    assert torch.equal(ids - ids[:, :1], torch.arange(4).expand(6, 4))  # each group intact, in order
    assert (ids[:, 0] % 4 == 0).all() and sorted(ids[:, 0].tolist()) == list(range(0, 24, 4))
    assert not torch.equal(out["ids"].view(24), rows)  # and the groups moved
    assert out["names"] == [f"r{i}" for i in out["ids"].view(24).tolist()]
    assert out["n"].item() == 7 and out["none"] is None
    with pytest.raises(ValueError):
        shuffle_groups(batch, 5)


def test_untested_trl_version_is_refused(monkeypatch):
    import trl

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.delenv(tpo_trl._ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(ImportError, match="tested with trl"):
        tpo_trl._check_trl_version()
    monkeypatch.setenv(tpo_trl._ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(RuntimeWarning, match="tested with trl"):
        tpo_trl._check_trl_version()


def _trl_example() -> str:
    """The TRL guide's example (a ```python trl block in tpo_kernels/integrations/trl/README.md, the
    guide the README links to), or the proposed section's before merge."""
    root = pathlib.Path(__file__).resolve().parents[1]
    for name in ("tpo_kernels/integrations/trl/README.md", "docs-trl-section.md"):
        path = root / name
        if path.exists():
            blocks = re.findall(r"```python trl\n(.*?)```", path.read_text(), re.S)
            if blocks:
                return "\n".join(blocks)
    pytest.skip("no TRL example found")


def test_readme_trl_example_runs(tiny, tmp_path, monkeypatch):
    source = _trl_example()
    source, count = re.subn(r'^model_id = ".*"$', f"model_id = {tiny[0]!r}", source, flags=re.M)
    assert count == 1, "the example must name its model on one `model_id = ...` line"
    # On this CPU machine: TRL's default bf16 then runs under CPU autocast (the head's bf16 path).
    cpu_run = "TargetPOConfig(use_cpu=True, report_to='none', disable_tqdm=True, max_steps=1, "
    source, count = re.subn(r"TargetPOConfig\(", cpu_run, source)
    assert count == 1
    monkeypatch.chdir(tmp_path)  # the example writes its output_dir
    namespace = {}
    exec(compile(source, "tpo_kernels/integrations/trl/README.md (TRL example)", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step > 0
    assert any("tpo/loss" in entry and math.isfinite(entry["tpo/loss"]) for entry in trainer.state.log_history)


@pytest.mark.parametrize("cast_fp32", [False, True])
@pytest.mark.parametrize("length_normalize", [False, True])
def test_tpo_head_applies_logit_multiplier_and_leaves_out_empty_completions(cast_fp32, length_normalize):
    """The head alone: a Cohere-style logit multiplier (logit_scale), a bf16 hidden
    state under an fp32 head, completions without a counted token left out of their group, and
    length-normalized sequence log-probs on request."""
    torch.manual_seed(0)
    num_rows, prompt, length, width, vocab = 12, 3, 5, 16, 50
    hidden_all = torch.randn(num_rows, prompt + length, width).to(torch.bfloat16).requires_grad_()
    head = torch.nn.Linear(width, vocab)
    labels = torch.randint(0, vocab, (num_rows, length))
    mask = torch.rand(num_rows, length) > 0.3
    mask[:, 0] = True
    mask[1] = False  # one completion of group 0 has no counted token
    mask[4:8] = False  # group 1 has none at all
    scores = torch.randn(num_rows)
    request = TPORequest(labels=labels, mask=mask, scores=scores, group_size=4, old_logprobs=None, ref_logprobs=None,
                        group_ids=None, process_group=None, detached=None, score_eps=0.0, beta=0.0, eta=0.7,
                         anchor=True,
                        temperature=0.8, backend="cpu", cast_lm_head_to_fp32=cast_fp32, token_entropy=True,
                        length_normalize=length_normalize)
    out = tpo_trl.head._tpo_head(hidden_all, head, request, logit_scale=2.0)

    logits = 2.0 * head(hidden_all[:, prompt - 1 : -1].float()).double()
    kept = mask.any(dim=1)
    expected = reference.tpo_loss(
        logits[kept], labels.masked_fill(~mask, -100)[kept], scores[kept].double(),
        group_ids=(torch.arange(num_rows) // 4)[kept], eta=0.7, temperature=0.8, length_normalize=length_normalize,
        score_eps=0.0,
    )
    assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert out["kept"].tolist() == kept.tolist()
    assert out["aux"]["group_loss"].numel() == 2  # group 1 has no counted completion: left out
    entropy = reference.token_entropy(logits, temperature=0.8)
    assert torch.allclose(out["aux"]["token_entropy"].double()[mask], entropy[mask], atol=1e-4)
    out["loss"].backward()
    assert hidden_all.grad[1].abs().sum() == 0 and hidden_all.grad[4:8].abs().sum() == 0
    assert hidden_all.grad[0].abs().sum() > 0 and head.weight.grad.abs().sum() > 0


def test_tpo_head_matches_a_soft_capped_model():
    """Gemma 2: the patched forward's loss equals reference.tpo_loss on the model's own logits,
    which are soft-capped (``final_logit_softcapping``) and scaled by nothing else."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                          final_logit_softcapping=2.0, attn_logit_softcapping=None)
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():  # a small cap only bites when the logits are large
        model.lm_head.weight.mul_(10.0)
    tpo_trl.head.add_tpo_head(model)
    num_rows, prompt, length = 8, 3, 5
    input_ids = torch.randint(0, 64, (num_rows, prompt + length))
    labels = input_ids[:, prompt:]
    mask = torch.ones(num_rows, length, dtype=torch.bool)
    scores = torch.randn(num_rows)
    request = TPORequest(labels=labels, mask=mask, scores=scores, group_size=4, old_logprobs=None, ref_logprobs=None,
                        group_ids=None, process_group=None, detached=None, score_eps=0.0, beta=0.0, eta=0.7,
                         anchor=True,
                        temperature=0.8, backend="cpu", cast_lm_head_to_fp32=False, token_entropy=False,
                        router_aux_loss=False, length_normalize=False)
    out = model(input_ids=input_ids, tpo_request=request)
    logits = model(input_ids=input_ids).logits[:, prompt - 1 : -1].double()
    assert logits.abs().max() <= 2.0  # the model's logits are capped
    expected = reference.tpo_loss(logits, labels, scores.double(), group_size=4, eta=0.7, temperature=0.8,
                                  score_eps=0.0)
    assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)


def test_tpo_head_with_detached_rows_is_the_whole_groups_loss():
    """A group spanning micro-steps: this micro-step's rows carry gradient, the window's other rows
    enter with their token log-probs detached (as the trainer passes them). The loss is the one of
    the whole groups; the gradient is the whole groups' gradient with the other rows held constant
    (so the other micro-step's call adds the rest). Dropping the detached rows, or letting them
    carry gradient, fails."""
    torch.manual_seed(0)
    num_rows, own, prompt, length, width, vocab = 8, 4, 3, 5, 16, 50
    hidden_all = torch.randn(num_rows, prompt + length, width)
    head = torch.nn.Linear(width, vocab)
    labels = torch.randint(0, vocab, (num_rows, length))
    mask = torch.rand(num_rows, length) > 0.3
    mask[:, 0] = True
    scores = torch.randn(num_rows)
    group_ids = torch.tensor([7, 9, 7, 9, 9, 7, 9, 7])  # two groups, each half in either micro-step
    ref = -torch.rand(num_rows, length) - 3.0
    settings = dict(temperature=0.8, backend="cpu", cast_lm_head_to_fp32=False, token_entropy=True)
    with torch.no_grad():
        theirs = tpo_trl.head._tpo_logprobs(hidden_all[own:], head, TPORequest(
            logprobs_only=True, labels=labels[own:], mask=mask[own:], **settings))
    detached = kit.LossRows(logprobs=theirs["token_logprobs"], token_entropy=theirs["token_entropy"], mask=mask[own:],
                            scores=scores[own:], group_ids=group_ids[own:], ref_logprobs=ref[own:])
    hidden = hidden_all[:own].clone().requires_grad_()
    request = TPORequest(labels=labels[:own], mask=mask[:own], scores=scores[:own], group_size=None,
                        group_ids=group_ids[:own], process_group=None, old_logprobs=None, ref_logprobs=ref[:own],
                        detached=detached, score_eps=1e-6, beta=0.1, eta=0.7, anchor=True, length_normalize=False,
                        **settings)
    out = tpo_trl.head._tpo_head(hidden, head, request)
    out["loss"].backward()

    hidden64 = hidden_all.double()[:own].requires_grad_()
    weight64, bias64 = head.weight.detach().double().requires_grad_(), head.bias.detach().double().requires_grad_()
    logits = torch.cat([hidden64[:, prompt - 1 : -1] @ weight64.T + bias64,
                        (hidden_all.double()[own:, prompt - 1 : -1] @ weight64.T + bias64).detach()])
    expected = reference.tpo_loss(logits, labels.masked_fill(~mask, -100), scores.double(), group_ids=group_ids,
                                  ref_logprobs=ref.double(), beta=0.1, eta=0.7, temperature=0.8)
    expected.backward()
    assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(hidden.grad.double(), hidden64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.weight.grad.double(), weight64.grad, rtol=1e-4, atol=1e-6)
    assert out["aux"]["p"].shape == (num_rows,) and out["aux"]["token_entropy"].shape == (num_rows, length)
    assert out["mask"].shape == (num_rows, length) and out["kept"].all()


def test_tiny_model_is_built_from_its_seed_and_leaves_the_callers_random_state():
    """The guide's offline model: the same weights for the same seed, other weights for another
    seed, the caller's torch random state untouched; its tokenizer maps the words to 3 ... 39."""
    torch.manual_seed(123)
    state = torch.get_rng_state()
    model, tokenizer = tpo_trl.tiny_model_and_tokenizer()
    assert torch.equal(torch.get_rng_state(), state)
    again, _ = tpo_trl.tiny_model_and_tokenizer(seed=0)
    other, _ = tpo_trl.tiny_model_and_tokenizer(seed=1)
    weights = [model.state_dict(), again.state_dict(), other.state_dict()]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert not torch.equal(weights[0]["lm_head.weight"], weights[2]["lm_head.weight"])
    assert model.config.vocab_size == 40 and tokenizer("w0 w36")["input_ids"] == [3, 39]
    with pytest.raises(TypeError, match="seed"):
        tpo_trl.tiny_model_and_tokenizer(seed=0.5)
