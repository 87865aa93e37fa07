"""Orchestration (layer 3): backend-agnostic autograd.Functions.

Every sequence-level path reduces to one primitive: per-token target log-probs whose backward is
a per-token scalar ``g[t]`` times ``(onehot - softmax) / tau``. :class:`TPOObjective` is the tiny
``[N]``-sized step in between (group op, reduction, optional k3 KL term) and turns the incoming
loss gradient into ``g``; the logits path here and the fused-linear path share it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._validate import PreparedBatch
from .backends import Backend
from .targets import GroupTargets, group_sum, segment_sum


class TPOObjective:
    """The group stage of sequence-level TPO for one batch (see DESIGN.md section 1)."""

    def __init__(
        self, batch: PreparedBatch, *, eta: float, anchor: bool, reduction: str, beta: float
    ) -> None:
        self.batch = batch
        self.eta, self.anchor, self.reduction, self.beta = eta, anchor, reduction, beta
        self.targets: Optional[GroupTargets] = None
        self.token_logprobs: Optional[Tensor] = None

    def forward(self, token_logprobs: Tensor, backend: Backend) -> Tensor:
        """Loss from flat ``[M]`` token log-probs (0 on rows that do not count)."""
        b = self.batch
        self.token_logprobs = token_logprobs
        self.targets = t = backend.group_targets(
            token_logprobs, b.layout, b.scores, b.old_seq_logprobs, self.eta, self.anchor, self.reduction
        )
        loss = {"mean": t.group_loss.mean, "sum": t.group_loss.sum, "none": lambda: t.group_loss}[self.reduction]()
        if self.beta > 0:
            diff = b.ref_logprobs - token_logprobs
            k3 = torch.where(b.valid, torch.exp(diff) - diff - 1.0, 0.0)
            if self.reduction == "mean":
                loss = loss + self.beta * k3.sum() / b.num_valid
            elif self.reduction == "sum":
                loss = loss + self.beta * k3.sum()
            else:
                loss = loss + self.beta * self._group_token_sum(k3) / self._group_token_count()
        return loss

    def _group_token_sum(self, token_values: Tensor) -> Tensor:
        return group_sum(segment_sum(token_values, self.batch.layout), self.batch.layout)

    def _group_token_count(self) -> Tensor:
        return self._group_token_sum(self.batch.valid.to(self.token_logprobs.dtype))

    def token_grad(self, grad_loss: Tensor) -> Tensor:
        """``g[t] = dLoss/d lp[t]`` for every flat row (0 on rows that do not count)."""
        b, layout = self.batch, self.batch.layout
        grad_loss = grad_loss.to(self.token_logprobs.dtype)
        coef = self.targets.coef  # w * (p - q), per completion
        if self.reduction == "none":
            coef = coef * grad_loss[layout.seq_group]
        else:
            coef = coef * grad_loss
        seq = layout.token_seq.clamp(min=0)
        g = torch.where(b.valid, coef[seq], 0.0)
        if self.beta > 0:
            # d k3 / d lp = 1 - exp(r - lp)
            dk3 = torch.where(b.valid, 1.0 - torch.exp(b.ref_logprobs - self.token_logprobs), 0.0)
            if self.reduction == "mean":
                g = g + (self.beta / b.num_valid) * grad_loss * dk3
            elif self.reduction == "sum":
                g = g + self.beta * grad_loss * dk3
            else:
                per_group = self.beta * grad_loss / self._group_token_count()
                g = g + per_group[layout.seq_group[seq]] * dk3
        return g

    def aux(self) -> dict:
        """Detached per-token, per-completion and per-group quantities for logging and reuse."""
        t = self.targets
        return {
            "token_logprobs": self.token_logprobs.detach().view(self.batch.token_shape),
            "seq_logprobs": t.seq_logprobs.detach(),
            "p": t.p.detach(),
            "q": t.q.detach(),
            "u": t.u.detach(),
            "coef": t.coef.detach(),
            "group_loss": t.group_loss.detach(),
        }


def bump_version(tensor: Tensor) -> None:
    """Mark ``tensor`` as modified in place, so that any graph node that saved it fails loudly
    with PyTorch's standard in-place error instead of reading overwritten values."""
    torch.autograd.graph.increment_version(tensor)


class TPOLogitsFunction(torch.autograd.Function):
    """Logits path: row forward -> group op -> (backward) row backward, in place when allowed."""

    @staticmethod
    def forward(ctx, logits: Tensor, objective: TPOObjective, backend: Backend, inv_temperature: float, inplace: bool):
        labels = objective.batch.labels
        lse, target, _ = backend.row_forward(logits, labels, inv_temperature, False)
        token_logprobs = target - lse  # both 0 on skipped rows
        loss = objective.forward(token_logprobs, backend)
        ctx.save_for_backward(logits, lse)
        ctx.objective, ctx.backend, ctx.inv_temperature, ctx.inplace = objective, backend, inv_temperature, inplace
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        logits, lse = ctx.saved_tensors
        objective = ctx.objective
        grad_logprob = objective.token_grad(grad_loss)
        out = logits if ctx.inplace else torch.empty_like(logits)
        ctx.backend.row_backward(
            logits, objective.batch.labels, lse, grad_logprob, None, None, ctx.inv_temperature, out
        )
        if ctx.inplace:
            bump_version(logits)
        return out, None, None, None, None


class SelectiveLogprobsFunction(torch.autograd.Function):
    """Per-token log-probs (and entropies) whose backward is the generic row backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, backend: Backend, inv_temperature: float, with_entropy: bool):
        lse, target, entropy = backend.row_forward(logits, labels, inv_temperature, with_entropy)
        token_logprobs = target - lse
        ctx.save_for_backward(logits, labels, lse, entropy if with_entropy else None)
        ctx.backend, ctx.inv_temperature = backend, inv_temperature
        if with_entropy:
            return token_logprobs, entropy
        return token_logprobs

    @staticmethod
    def backward(ctx, grad_logprob: Tensor, grad_entropy: Optional[Tensor] = None):
        logits, labels, lse, entropy = ctx.saved_tensors
        skipped = labels < 0  # rows that were never read have no gradient
        grad_logprob = torch.where(skipped, 0.0, grad_logprob.to(lse.dtype))
        if grad_entropy is not None:
            grad_entropy = torch.where(skipped, 0.0, grad_entropy.to(lse.dtype))
        out = torch.empty_like(logits)
        ctx.backend.row_backward(logits, labels, lse, grad_logprob, grad_entropy, entropy, ctx.inv_temperature, out)
        return out, None, None, None, None
