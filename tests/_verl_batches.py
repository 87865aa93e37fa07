"""verl-shaped batches for the verl integration tests (one rank and split over ranks), and a stub
of verl's engine that trains a mini-batch in micro-batches as verl 0.9.1's FSDP engine forms them."""

from __future__ import annotations

import types

import numpy as np
import torch

from tpo_kernels import reference
from tpo_kernels.integrations.verl import compute_tpo_outcome_advantage

K, T, V = 4, 6, 11


def rollout(groups: int = 3, dtype=torch.float64, seed: int = 0):
    """A verl-shaped batch of ``groups`` groups of K responses: logits (the policy's), responses,
    right-padded response mask, old log-probs of a nearby policy, token-level rewards on the last
    response token, uids. Group 1 ties (no reward signal)."""
    rows = K * groups
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, T, V, generator=gen, dtype=torch.float64)
    responses = torch.randint(0, V, (rows, T), generator=gen)
    lengths = torch.randint(1, T + 1, (rows,), generator=gen)
    mask = torch.arange(T) < lengths.unsqueeze(1)
    rewards = torch.randint(0, 3, (rows,), generator=gen).to(torch.float64)
    rewards[K : 2 * K] = 1.0
    token_rewards = torch.zeros(rows, T, dtype=dtype)
    token_rewards[torch.arange(rows), lengths - 1] = rewards.to(dtype)
    old_logits = logits + 0.1 * torch.randn(rows, T, V, generator=gen, dtype=torch.float64)
    old_log_prob = reference.token_logprobs(old_logits, responses).masked_fill(~mask, 0.0).to(dtype)
    uids = np.array([f"prompt-{b // K}" for b in range(rows)], dtype=object)
    return dict(logits=logits, responses=responses, mask=mask, rewards=rewards, token_rewards=token_rewards,
                old_log_prob=old_log_prob, uids=uids)


def reorder(batch, order: torch.Tensor):
    """The batch's rows in ``order`` (as verl's ``DataProto.reorder``)."""
    rows = len(batch["uids"])
    out = {name: value[order] if isinstance(value, torch.Tensor) and value.shape[:1] == (rows,) else value
           for name, value in batch.items()}
    out["uids"] = batch["uids"][order.numpy()]
    return out


def actor_config(**overrides):
    """The fields of verl's ActorConfig the loss reads (a dict has the same ``.get``)."""
    config = dict(rollout_n=K, use_dynamic_bsz=False, shuffle=False, global_batch_info={})
    config.update(overrides)
    return config


def policy_inputs(batch, dtype=torch.float64, advantages=None):
    """(logits leaf, log_prob, the loss's keyword arguments) with advantages from the tpo
    estimator on the whole ``batch`` unless given (rows of a batch the estimator saw whole)."""
    logits = batch["logits"].clone().requires_grad_()
    log_prob = reference.token_logprobs(logits, batch["responses"]).to(dtype)
    if advantages is None:
        advantages, _ = compute_tpo_outcome_advantage(batch["token_rewards"], batch["mask"].to(dtype), batch["uids"])
    kwargs = dict(old_log_prob=batch["old_log_prob"], log_prob=log_prob, advantages=advantages,
                  response_mask=batch["mask"])
    return logits, log_prob, kwargs


PROMPT = 2  # prompt tokens of every row


def verl_mini_batch(batch, advantages, micro_batch_size: int, use_dynamic_bsz: bool = False):
    """The mini-batch TensorDict verl's engine ``train_batch`` receives (padded layout: prompts,
    right-padded responses, attention mask over both), with the batching keys verl's
    ``TrainingWorker.train_batch`` adds; ``row`` says which row of the policy's logits a row is."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    rows = len(batch["uids"])
    mask = batch["mask"]
    data = TensorDict(dict(
        prompts=torch.zeros(rows, PROMPT, dtype=torch.int64), responses=batch["responses"],
        input_ids=torch.cat([torch.zeros(rows, PROMPT, dtype=torch.int64), batch["responses"]], dim=1),
        attention_mask=torch.cat([torch.ones(rows, PROMPT, dtype=torch.int64), mask.long()], dim=1),
        response_mask=mask.long(), loss_mask=mask.long(), old_log_probs=batch["old_log_prob"], advantages=advantages,
        row=torch.arange(rows)), batch_size=[rows])
    tu.assign_non_tensor(data, global_batch_size=rows, use_dynamic_bsz=use_dynamic_bsz,
                         micro_batch_size_per_gpu=micro_batch_size, max_token_len_per_gpu=PROMPT + T + micro_batch_size)
    return data


class TinyEngine:
    """verl 0.9.1's engine contract as tpo_kernels uses it (``infer_batch``, ``train_batch``,
    ``get_data_parallel_group``), on one rank, with FSDPEngine's micro-batching (fixed
    ``micro_batch_size_per_gpu`` chunks, or verl's ``rearrange_micro_batches`` by token count with
    ``use_dynamic_bsz``); the policy is a leaf of per-row logits ``[B, T, V]``. Its model output is
    verl's no-padding log-probs: one value per valid token of each sequence, the log-prob of the
    next token."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits
        self.micro_batch_rows = []  # the rows of each micro-batch of the last call
        self.forward_only_calls = 0

    def get_data_parallel_group(self):
        return None

    def _micro_batches(self, data):
        from verl.utils import tensordict_utils as tu
        from verl.utils.seqlen_balancing import rearrange_micro_batches

        if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            micro_batches, indices = rearrange_micro_batches(data, max_token_len=data["max_token_len_per_gpu"])
            return micro_batches, [index for part in indices for index in part]
        return tu.chunk_tensordict(data, len(data) // data["micro_batch_size_per_gpu"]), list(range(len(data)))

    def _model_output(self, micro_batch):
        token_logprobs = reference.token_logprobs(self.logits[micro_batch["row"]], micro_batch["responses"])
        lengths = micro_batch["attention_mask"].sum(1).tolist()
        pad = token_logprobs.new_zeros(PROMPT - 1)  # positions predicting prompt tokens; the last predicts nothing
        return {"log_probs": torch.cat([torch.cat([pad, token_logprobs[b, : length - PROMPT], pad.new_zeros(1)])
                                        for b, length in enumerate(lengths)])}

    def _forward_backward(self, data, loss_function, forward_only):
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["response_mask"].sum()))
        micro_batches, order = self._micro_batches(data)
        self.micro_batch_rows = [micro_batch["row"].tolist() for micro_batch in micro_batches]
        outputs, losses = [], []
        for micro_batch in micro_batches:
            output = self._model_output(micro_batch)
            if forward_only:
                outputs.append(output["log_probs"].split(micro_batch["attention_mask"].sum(1).tolist()))
                continue
            loss, _ = loss_function(model_output=output, data=micro_batch, dp_group=None)
            loss.backward()
            losses.append(loss.detach())
        if forward_only:  # back in the mini-batch's row order, as verl restores it
            per_row = [row for part in outputs for row in part]
            restored = [None] * len(per_row)
            for position, index in enumerate(order):
                restored[index] = per_row[position]
            return {"model_output": {"log_probs": torch.cat(restored)}}
        return {"loss": losses}

    def infer_batch(self, data, loss_function=None):
        self.forward_only_calls += 1
        with torch.no_grad():
            return self._forward_backward(data, loss_function, forward_only=True)

    def train_batch(self, data, loss_function):
        self.logits.grad = None
        return self._forward_backward(data, loss_function, forward_only=False)


def fsdp_engine_class():
    """A subclass of verl 0.9.1's real FSDPEngine (its micro-batch loop ``forward_backward_batch``,
    ``prepare_micro_batches``, ``postprocess_batch_func`` and BaseEngine's ``train_batch`` /
    ``infer_batch``) whose model is TinyEngine's per-row logits; no FSDP wrapping, optimizer step or
    device. Needs verl's full dependencies; call under a 1-rank process group, with verl's device
    lookups pointed at the CPU."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    class LogitsEngine(FSDPEngine):
        def __init__(self, logits: torch.Tensor):  # FSDPEngine's builds a model, mesh and optimizer
            self.tiny = TinyEngine(logits)
            self.logits = logits
            self.module = torch.nn.Module()  # not FSDP-wrapped: no gradient-sync deferral
            self.engine_config = types.SimpleNamespace()
            self.ulysses_sequence_parallel_size, self.ulysses_device_mesh = 1, None
            self.forward_only_calls = 0

        def forward_step(self, micro_batch, loss_function, forward_only):
            flat = self.tiny._model_output(micro_batch)["log_probs"]
            lengths = micro_batch["attention_mask"].sum(1).tolist()
            nested = torch.nested.as_nested_tensor(list(flat.split(lengths)), layout=torch.jagged)
            if loss_function is None:
                loss, metrics = torch.tensor(1.0), {}
            else:
                loss, metrics = loss_function(model_output={"log_probs": nested}, data=micro_batch,
                                              dp_group=self.get_data_parallel_group())
            return loss, {"model_output": {"log_probs": nested.detach()}, "loss": loss.detach().item(),
                          "metrics": metrics}

        def infer_batch(self, data, loss_function=None):
            self.forward_only_calls += 1
            return super().infer_batch(data, loss_function)

        def optimizer_zero_grad(self):
            self.logits.grad = None

        def optimizer_step(self):
            return 0.0

        def is_mp_src_rank_with_outputs(self):
            return True

    return LogitsEngine

