"""TargetPOTrainer with a truncating sampler (top-k / top-p) on transformers generation: the kept
sets are recorded during generation and replayed by every log-prob the loss reads; vLLM with a
truncating config is refused; without truncation nothing changes (no mask at all).

The checks are independent of the trainer's code path: the kept sets are recomputed from the
policy's own logits by the samplers' rule (top-k, then top-p over the renormalized rest, as
transformers applies them), token log-probs by a float64 masked log-softmax, and the loss by
``tpo_kernels.reference.tpo_loss`` in float64 with the same sets.
"""

import dataclasses

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

from _trl_tiny import dataset, even_words, sampler_kept_sets  # noqa: E402

from tpo_kernels import SamplingMask, reference  # noqa: E402
from tpo_kernels.integrations.trl import TargetPOConfig, TargetPOTrainer  # noqa: E402
from tpo_kernels.integrations.trl.generation_batch import padded_to_width, take_rows  # noqa: E402
from tpo_kernels.integrations.trl.kept_sets import (KEPT_COUNTS, KEPT_IDS, KeptSetRecorder,  # noqa: E402
                                                    kept_set_rows, sampling_mask_of)
from tpo_kernels.integrations.trl.private_api import signature_problems  # noqa: E402
from tpo_kernels.integrations.trl.request import TPORequest  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

K, TOP_K, TOP_P, TAU = 4, 5, 0.9, 0.7


class KeptSetTrainer(TargetPOTrainer):
    """Records each loss call's request, batch and unscaled loss, and the policy's float64 logits
    of the batch (an ordinary forward under the loss call's parameters)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def _tpo_request(self, inputs, mode, detached=None):
        self._last_request = super()._tpo_request(inputs, mode, detached)
        return self._last_request

    def _compute_loss(self, model, inputs):
        step = self.state.global_step
        loss = super()._compute_loss(model, inputs)
        completion_ids = inputs["completion_ids"]
        with torch.no_grad():
            input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            logits = logits[:, -completion_ids.shape[1] - 1 : -1].double()
        self.records.append(dict(step=step, inputs=dict(inputs), request=self._last_request, logits=logits,
                                 loss=loss.item() * self.current_gradient_accumulation_steps))
        return loss


def config(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=K,
                  max_completion_length=8, max_steps=2, learning_rate=1e-2, bf16=False, use_cpu=True,
                  report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                  tpo_backend="cpu", temperature=TAU, top_k=TOP_K, top_p=TOP_P)
    kwargs.update(overrides)
    return TargetPOConfig(**kwargs)


def train(tiny, tmp_path, **overrides):
    path, tokenizer = tiny
    trainer = KeptSetTrainer(model=path, reward_funcs=even_words, args=config(tmp_path, **overrides),
                             train_dataset=dataset(), processing_class=tokenizer)
    trainer.train()
    return trainer


def counted(inputs):
    return inputs["completion_mask"].bool()


def kept_of(inputs, vocab):
    """[N, C, V] bool from the batch's recorded kept sets."""
    labels = inputs["completion_ids"]
    return reference.kept_mask(sampling_mask_of(inputs[KEPT_IDS], inputs[KEPT_COUNTS]), labels.shape, vocab)


def masked_logprobs(logits, labels, keep, temperature):
    """float64 log-softmax of the tempered logits over each token's kept set, at the label."""
    z = (logits.double() / temperature).masked_fill(~keep, float("-inf"))
    return z.log_softmax(dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def truncated_run(tiny, tmp_path_factory):
    """top_k=5, top_p=0.9; one generation serves two optimizer steps (old log-probs), beta > 0 (a
    reference model): every log-prob the loss reads goes through the kept sets."""
    return train(tiny, tmp_path_factory.mktemp("truncated"), steps_per_generation=2, beta=0.05)


def test_every_counted_token_is_in_its_recorded_set(truncated_run):
    vocab = truncated_run.model.config.vocab_size
    for record in truncated_run.records:
        inputs = record["inputs"]
        keep, mask = kept_of(inputs, vocab), counted(inputs)
        sizes = keep.sum(dim=-1)
        labels = inputs["completion_ids"]
        assert keep.gather(-1, labels.unsqueeze(-1)).squeeze(-1)[mask].all()
        assert (sizes[mask] >= 1).all() and (sizes[mask] <= TOP_K).all()
        assert (sizes[~mask] == 0).all()  # after EOS and padding: empty sets
        assert (sizes[mask] < TOP_K).any()  # top-p cut some sets below top_k


def test_recorded_sets_are_the_samplers(truncated_run):
    """At the first optimizer step the parameters are the sampler's: the recorded sets are exactly
    the top-k-then-top-p sets of the policy's logits (the recorder ran after the warpers)."""
    first = [r for r in truncated_run.records if r["step"] == 0]
    assert first
    for record in first:
        inputs = record["inputs"]
        mask = counted(inputs)
        expected = sampler_kept_sets(record["logits"], TOP_K, TOP_P, TAU)
        recorded = kept_of(inputs, expected.shape[-1])
        assert torch.equal(recorded[mask], expected[mask])


def test_loss_is_the_float64_replay_on_the_kept_sets(truncated_run):
    for record in truncated_run.records:
        inputs, request = record["inputs"], record["request"]
        assert isinstance(request.sampling_mask, SamplingMask)
        labels = inputs["completion_ids"].masked_fill(~counted(inputs), -100)
        common = dict(group_size=K, old_logprobs=inputs["old_per_token_logps"].double(),
                      ref_logprobs=inputs["ref_per_token_logps"].double(), beta=0.05, eta=1.0, temperature=TAU)
        expected = reference.tpo_loss(record["logits"], labels, inputs["tpo_scores"].double(),
                                      sampling_mask=request.sampling_mask, **common)
        full_vocabulary = reference.tpo_loss(record["logits"], labels, inputs["tpo_scores"].double(), **common)
        assert record["loss"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
        assert abs(record["loss"] - full_vocabulary.item()) > 1e-4  # the replay matters here


def test_old_and_ref_logprobs_are_on_the_kept_sets(truncated_run):
    """At step 0 the policy, its rollout version and the reference are the same weights: the old
    and reference log-probs are the policy's masked log-softmax (TRL's would be full-vocabulary)."""
    record = next(r for r in truncated_run.records if r["step"] == 0)
    inputs = record["inputs"]
    mask, labels = counted(inputs), inputs["completion_ids"]
    keep = kept_of(inputs, record["logits"].shape[-1])
    expected = masked_logprobs(record["logits"], labels, keep, TAU)
    full = masked_logprobs(record["logits"], labels, torch.ones_like(keep), TAU)
    assert (expected - full)[mask].abs().max() > 1e-3
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        torch.testing.assert_close(inputs[key].double()[mask], expected[mask], rtol=1e-5, atol=1e-5)


def window_replay(records, temperature, sampling=True):
    """float64 reference loss of the whole groups of a window's micro-batches (same generation)."""
    batches = [r["inputs"] for r in records]
    logits = torch.cat([r["logits"] for r in records])
    width = max(b[KEPT_IDS].shape[1] for b in batches)
    kept_ids = torch.cat([padded_to_width(b[KEPT_IDS], width, -1) for b in batches])
    counts = torch.cat([b[KEPT_COUNTS] for b in batches])
    mask = torch.cat([counted(b) for b in batches])
    labels = torch.cat([b["completion_ids"] for b in batches]).masked_fill(~mask, -100)
    return reference.tpo_loss(logits, labels, torch.cat([b["tpo_scores"] for b in batches]).double(),
                              group_ids=torch.cat([b["tpo_group_ids"] for b in batches]), temperature=temperature,
                              sampling_mask=sampling_mask_of(kept_ids, counts) if sampling else None).item()


def test_groups_spanning_micro_steps_replay_the_detached_rows_sets(tiny, tmp_path):
    """2 rows per micro-step, groups of 4: each loss call takes its group's other rows detached,
    with their log-probs on their own kept sets; the loss is the whole groups' float64 replay.
    (Seed 2 at temperature 1 samples groups whose rewards differ.)"""
    trainer = train(tiny, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=1,
                    seed=2, temperature=1.0)
    assert len(trainer.records) == 4
    gaps = []
    for first in (0, 2):
        window = trainer.records[first : first + 2]
        expected = window_replay(window, 1.0)
        gaps.append(abs(expected - window_replay(window, 1.0, sampling=False)))
        for record in window:
            assert record["request"].detached is not None
            assert record["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert max(gaps) > 1e-4  # the replay matters in some window


def test_no_truncation_passes_no_mask(tiny, tmp_path):
    trainer = train(tiny, tmp_path, top_k=0, top_p=1.0, max_steps=1)
    for record in trainer.records:
        assert record["request"].sampling_mask is None
        assert KEPT_IDS not in record["inputs"] and KEPT_COUNTS not in record["inputs"]


@pytest.mark.parametrize("setting", [dict(top_p=0.95), dict(top_k=20), dict(min_p=0.05),
                                     dict(generation_kwargs={"top_k": 20})])
def test_vllm_with_truncation_is_refused(tmp_path, setting):
    name = next(iter(setting.get("generation_kwargs", setting)))
    with pytest.raises(ValueError, match=rf"{name}=.*use_vllm=True.*full-vocabulary.*use_vllm=False"):
        config(tmp_path, **{"top_k": 0, "top_p": 1.0, "use_vllm": True, **setting})


@pytest.mark.parametrize("no_top_k", [0, -1])
def test_vllm_without_truncation_is_accepted(tmp_path, no_top_k):
    args = config(tmp_path, top_k=no_top_k, top_p=1.0, min_p=0.0, use_vllm=True)
    assert args.use_vllm


def test_kept_set_rows_are_the_recorded_support():
    """Per-row CSR from the recorder's steps: a step where every row keeps the vocabulary records
    nothing; the tokens outside the mask get empty sets; a row's ids run token after token."""
    recorder = KeptSetRecorder()
    vocab = 4
    full = torch.zeros(2, vocab)
    cut = torch.tensor([[0.0, -float("inf"), 1.0, -float("inf")], [-float("inf"), 2.0, -float("inf"), -float("inf")]])
    for scores in (cut, full, cut):
        assert recorder(None, scores) is scores  # the scores go on untouched
    assert recorder.steps[1] is None
    mask = torch.tensor([[True, True, True], [True, True, False]])
    ids, counts = kept_set_rows(recorder, mask)
    assert counts.tolist() == [[2, 4, 2], [1, 4, 0]]
    assert ids.tolist() == [[0, 2, 0, 1, 2, 3, 0, 2], [1, 0, 1, 2, 3, -1, -1, -1]]
    csr = sampling_mask_of(ids, counts)
    assert csr.offsets.tolist() == [0, 2, 6, 8, 9, 13, 13]
    assert csr.token_ids.tolist() == [0, 2, 0, 1, 2, 3, 0, 2, 1, 0, 1, 2, 3]
    one = take_rows({KEPT_IDS: ids, KEPT_COUNTS: counts}, torch.tensor([1]))  # rows carry their sets
    assert sampling_mask_of(one[KEPT_IDS], one[KEPT_COUNTS]).token_ids.tolist() == [1, 0, 1, 2, 3]
    untouched = KeptSetRecorder()
    untouched(None, full)
    assert kept_set_rows(untouched, mask) is None  # no truncation: no mask


def test_a_second_generation_under_one_recorder_is_an_error():
    recorder = KeptSetRecorder().start()
    with pytest.raises(RuntimeError, match="second generate"):
        recorder.start()


def test_request_is_a_frozen_keyword_record(tiny, tmp_path):
    labels, mask = torch.zeros(4, 3, dtype=torch.long), torch.ones(4, 3, dtype=torch.bool)
    settings = dict(temperature=1.0, backend="cpu", cast_lm_head_to_fp32=False, token_entropy=True)
    request = TPORequest(labels=labels, mask=mask, scores=torch.zeros(4), group_size=4, **settings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.beta = 1.0
    with pytest.raises(TypeError):
        TPORequest(labels, mask, 1.0, "cpu", False, True)  # keywords only
    with pytest.raises(ValueError, match="scores"):
        TPORequest(labels=labels, mask=mask, group_size=4, **settings)
    with pytest.raises(ValueError, match="group_size and group_ids"):
        TPORequest(labels=labels, mask=mask, scores=torch.zeros(4), **settings)
    assert TPORequest(labels=labels, mask=mask, logprobs_only=True, **settings).scores is None


def test_trainer_request_carries_the_settings(tiny, tmp_path):
    trainer = train(tiny, tmp_path, top_k=0, top_p=1.0, max_steps=1, beta=0.02, tpo_eta=0.5, tpo_score_eps=0.0)
    request = trainer.records[0]["request"]
    assert isinstance(request, TPORequest)
    assert (request.beta, request.eta, request.score_eps, request.temperature) == (0.02, 0.5, 0.0, TAU)
    assert request.group_size == K and request.group_ids is None and request.detached is None
    assert request.ref_logprobs is not None and request.sampling_mask is None and not request.logprobs_only


def test_the_patched_generation_method_is_checked():
    class NoProcessorBuilder:
        pass

    problems = signature_problems(generation_cls=NoProcessorBuilder)
    assert any("GenerationMixin._get_logits_processor" in line for line in problems)
    assert signature_problems() == []
