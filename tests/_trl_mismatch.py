"""A vLLM stand-in for the sampler-trainer mismatch tests, and the mismatch experiment.

:class:`StubSamplerTrainer` generates with transformers, as without vLLM, and returns sampler
per-token log-probs through TRL's own field (``_generate_single_turn``'s second output, which vLLM
fills): the trainer's token log-probs minus an injected per-token ``delta`` (``delta(row, length)``
over the generation batch's rows), so that ``old - sampler = delta`` up to the trainer's own
rounding. With ``use_vllm`` set on the trainer, TRL then computes the trainer's old log-probs,
the importance-sampling ratio and its mismatch metrics exactly as under vLLM.

:func:`replay64` recomputes the loss and its parameter gradient in float64 from the model's plain
logits (``reference.tpo_loss``) on the kept completions only.

Run ``PYTHONPATH=. python tests/_trl_mismatch.py`` for the experiment: a stub sampler whose log-probs
carry Gaussian per-token noise of standard deviation sigma; per sigma, the masked fraction, and the
trainer's loss and gradient against the float64 replay on the kept completions.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _trl_tiny import build_tiny_olmo2, dataset, even_words  # noqa: E402

from tpo_kernels import reference  # noqa: E402
from tpo_kernels.integrations.trl import TargetPOConfig, TargetPOTrainer  # noqa: E402

K = 4


class StubSamplerTrainer(TargetPOTrainer):
    """TargetPOTrainer whose 'vLLM' is transformers generation plus injected sampler log-probs.

    ``delta(row, length) -> Tensor[length]``: the injected gap ``old - sampler`` of each token of
    the generation batch's row ``row``. Records, per generation, each row's delta (``deltas``), and,
    per loss call, the float64 replay (``replays``) and the gradient the micro-step produced."""

    def __init__(self, *args, delta, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_vllm = True  # TRL's condition for the sampler's log-probs, the ratio and its metrics
        self.delta = delta
        self.deltas = []
        self.replays, self.losses, self.grads, self.hidden_grads = [], [], [], []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        self.use_vllm = False  # generate with transformers
        try:
            completion_ids, _ = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                              *args, **kwargs)
        finally:
            self.use_vllm = True
        trainer_logps = self._plain_token_logprobs(prompt_ids, completion_ids)
        deltas = [self.delta(row, len(lp)).double() for row, lp in enumerate(trainer_logps)]
        self.deltas.append(deltas)
        sampler = [(lp.double() - d).tolist() for lp, d in zip(trainer_logps, deltas)]
        return completion_ids, sampler

    @torch.no_grad()
    def _plain_token_logprobs(self, prompt_ids, completion_ids):
        """The policy's tempered token log-probs of each completion, from its plain logits."""
        model = self.accelerator.unwrap_model(self.model)
        out = []
        for prompt, completion in zip(prompt_ids, completion_ids):
            ids = torch.tensor([list(prompt) + list(completion)], device=self.accelerator.device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / self.temperature
            labels = torch.tensor(completion, device=ids.device)
            out.append(logits.log_softmax(-1).gather(-1, labels[:, None])[:, 0].cpu())
        return out

    def _compute_loss(self, model, inputs):
        self.replays.append(replay64(self, inputs))
        backbone = self.accelerator.unwrap_model(self.model).model
        captured = []

        def keep_grad(module, args, output):
            if output.last_hidden_state.requires_grad:
                output.last_hidden_state.register_hook(lambda grad: captured.append(grad.detach().clone()))

        hook = backbone.register_forward_hook(keep_grad)
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            hook.remove()
        self.losses.append(loss.detach())
        self._captured_hidden_grads = captured
        return loss

    def training_step(self, model, inputs, num_items_in_batch):
        for p in self.model.parameters():
            p.grad = None  # one micro-step per optimizer step here: the step's gradient alone
        out = super().training_step(model, inputs, num_items_in_batch)
        self.grads.append({name: p.grad.detach().clone() for name, p in self.model.named_parameters()})
        self.hidden_grads.append(self._captured_hidden_grads[0])
        return out


def no_gap(row, length):
    """A sampler that agrees with the trainer: no per-token gap."""
    return torch.zeros(length)


def generation_rows(inputs) -> torch.Tensor:
    """Each micro-batch row's index in the generation batch: groups move whole and keep their order."""
    group_ids = inputs["tpo_group_ids"].cpu()
    position = torch.arange(group_ids.numel()) % K
    return group_ids * K + position


def replay64(trainer: StubSamplerTrainer, inputs):
    """(loss, {parameter name: gradient}, kept [rows] bool, generation_rows) of ``reference.tpo_loss`` in float64 on
    the micro-batch's completions that the injected deltas keep under TRL's bounds (and that have a
    counted token), from the model's plain logits; the anchor is the trainer's stored old log-probs
    when the generation is reused, else p itself."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    model64 = type(model)(model.config)
    model64.load_state_dict(model.state_dict())
    model64 = model64.double().train(trainer.model.training)
    rows = generation_rows(inputs)
    deltas = trainer.deltas[-1]
    lo = trainer.args.vllm_importance_sampling_clip_min
    hi = trainer.args.vllm_importance_sampling_clip_max
    lo = -math.inf if lo is None else lo
    hi = math.inf if hi is None else hi
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"].bool()
    mode = trainer.args.vllm_importance_sampling_mode
    kept, log_weights = [], []
    for i, row in enumerate(rows.tolist()):
        d = deltas[row][: int(completion_mask[i].sum())]
        if mode == "sequence_truncate":  # every completion, weighted by min(max(rho, lo), hi)
            log_weights.append(math.log(min(max(math.exp(float(d.sum())), lo), hi)))
            kept.append(bool(completion_mask[i].any()))
            continue
        if mode == "sequence_mask":
            ratios = [math.exp(float(d.sum()))]
        else:
            ratios = [math.exp(float(x)) for x in d]
        kept.append(all(lo <= r <= hi for r in ratios) and bool(completion_mask[i].any()))
    kept = torch.tensor(kept)
    log_weights = torch.tensor(log_weights, dtype=torch.float64)[kept] if log_weights else None
    names = [name for name, _ in model64.named_parameters()]
    if not bool(kept.any()):  # every completion left out: the trainer's loss is a zero without gradient
        return (torch.zeros((), dtype=torch.float64), {name: torch.zeros_like(p) for name, p in
                                                        model64.named_parameters()}, kept, rows)
    length = completion_ids.shape[1]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1).cpu()
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1).cpu()
    logits = model64(input_ids=input_ids, attention_mask=attention_mask).logits[:, -length - 1 : -1]
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    reused = trainer.model.training and trainer.args.gradient_accumulation_steps % generate_every != 0
    old = inputs["old_per_token_logps"].cpu().double() if reused else None
    labels = completion_ids.cpu().masked_fill(~completion_mask.cpu(), -100)
    loss = reference.tpo_loss(
        logits[kept], labels[kept], inputs["tpo_scores"].cpu().double()[kept],
        group_ids=inputs["tpo_group_ids"].cpu()[kept],
        old_logprobs=None if old is None else old[kept], seq_log_weights=log_weights,
        eta=trainer.args.tpo_eta, anchor=trainer.args.tpo_anchor, score_eps=trainer.args.tpo_score_eps,
        temperature=trainer.temperature, entropy_coef=trainer._applied_entropy_coef())
    grads = torch.autograd.grad(loss, [p for _, p in model64.named_parameters()], allow_unused=True)
    grads = {name: torch.zeros_like(p) if g is None else g
             for name, p, g in zip(names, model64.parameters(), grads)}
    return loss.detach(), grads, kept, rows


def make_trainer(path, tokenizer, tmp_dir, delta, **overrides) -> StubSamplerTrainer:
    kwargs = dict(output_dir=os.path.join(tmp_dir, "out"), per_device_train_batch_size=8, num_generations=K,
                  max_completion_length=8, max_steps=1, learning_rate=1e-3, bf16=False, use_cpu=True,
                  report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                  tpo_backend="cpu", tpo_score_eps=0.0)
    kwargs.update(overrides)
    return StubSamplerTrainer(model=path, reward_funcs=even_words, args=TargetPOConfig(**kwargs),
                              train_dataset=dataset(), processing_class=tokenizer, delta=delta)


def gradient_error(trainer: StubSamplerTrainer, step: int = 0) -> float:
    """max |trainer gradient - float64 replay gradient| over the parameters, relative to the
    replay's largest entry (absolute when the replay's gradient is exactly zero: every group
    without a signal, e.g. when the sampler check leaves at most one completion in each)."""
    replay = trainer.replays[step][1]
    scale = max(float(g.abs().max()) for g in replay.values())
    diff = max(float((trainer.grads[step][name].double().cpu() - g).abs().max()) for name, g in replay.items())
    return diff / scale if scale > 0 else diff


def experiment(sigmas=(0.0, 0.2, 0.5, 1.0, 2.0), steps: int = 3, modes=("sequence_mask", "token_mask")) -> None:
    import tempfile
    import warnings

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tiny_olmo2(tmp)
        print("per mode and sigma, over the steps: TRL's mean |old - sampler|, the masked fraction, max |loss - "
              "replay|, max |grad - replay| / max |replay grad| (TRL's default bounds: clip_max 3, no clip_min)")
        for mode in modes:
            for sigma in sigmas:
                generator = torch.Generator().manual_seed(1)

                def delta(row, length):
                    return sigma * torch.randn(length, generator=generator)

                trainer = make_trainer(tmp, tokenizer, os.path.join(tmp, f"{mode}{sigma}"), delta, max_steps=steps,
                                       vllm_importance_sampling_mode=mode)
                trainer.train()
                logs = [entry for entry in trainer.state.log_history if "tpo/frac_masked_by_sampler" in entry]
                masked = [entry["tpo/frac_masked_by_sampler"] for entry in logs]
                gap = sum(entry["sampling/sampling_logp_difference/mean"] for entry in logs) / len(logs)
                loss_err = max(abs(float(loss) - float(replay[0]))
                               for loss, replay in zip(trainer.losses, trainer.replays))
                grad_err = max(gradient_error(trainer, step) for step in range(len(trainer.grads)))
                print(f"{mode:13s} sigma {sigma:4.2f}  |old - sampler| {gap:.3f}  "
                      f"masked {sum(masked) / len(masked):.3f}  "
                      f"loss err {loss_err:.2e}  grad err {grad_err:.2e}")


if __name__ == "__main__":
    # optional: a mode and sigmas, e.g. ``token_mask 1.0 2.0``
    if len(sys.argv) > 1:
        experiment(sigmas=tuple(float(x) for x in sys.argv[2:]) or (0.0, 0.2, 0.5, 1.0, 2.0), modes=(sys.argv[1],))
    else:
        experiment()
