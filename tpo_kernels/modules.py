"""``nn.Module`` wrappers of the functional API: the loss hyper-parameters live on the module,
the batch (and its grouping) is passed to ``forward``."""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from .functional import fused_linear_token_tpo_loss, fused_linear_tpo_loss, token_tpo_loss, tpo_loss


class _TPOSettings(nn.Module):
    """Holds the loss hyper-parameters shared by every TPO module."""

    def __init__(self, *, eta: float = 1.0, anchor: bool = True, temperature: float = 1.0,
                 logit_scale: float = 1.0, logit_softcap: Optional[float] = None,
                 reduction: str = "mean", backend: str = "auto") -> None:
        super().__init__()
        self.eta, self.anchor, self.temperature = eta, anchor, temperature
        self.logit_scale, self.logit_softcap = logit_scale, logit_softcap
        self.reduction, self.backend = reduction, backend

    def settings(self) -> dict:
        return dict(eta=self.eta, anchor=self.anchor, temperature=self.temperature, logit_scale=self.logit_scale,
                    logit_softcap=self.logit_softcap, reduction=self.reduction, backend=self.backend)

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={value!r}" for key, value in self.settings().items())


class _SequenceTPOSettings(_TPOSettings):
    """Adds the sequence-level settings: the k3 KL weight and ignore_index."""

    def __init__(self, *, beta: float = 0.0, ignore_index: int = -100, **settings) -> None:
        super().__init__(**settings)
        self.beta, self.ignore_index = beta, ignore_index

    def settings(self) -> dict:
        return dict(super().settings(), beta=self.beta, ignore_index=self.ignore_index)


class TPOLoss(_SequenceTPOSettings):
    """Module form of :func:`tpo_kernels.tpo_loss`.

    Example::

        loss_fn = TPOLoss(eta=1.0, temperature=0.7)             # Gemma 2: logit_softcap=30.0
        loss = loss_fn(logits, labels, scores, group_size=8)
    """

    def __init__(self, *, inplace_backward: bool = True, **settings) -> None:
        super().__init__(**settings)
        self.inplace_backward = inplace_backward

    def forward(
        self,
        logits: Tensor,
        labels: Tensor,
        scores: Tensor,
        *,
        group_size: Optional[int] = None,
        group_ids: Optional[Tensor] = None,
        cu_seqlens: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        old_logprobs: Optional[Tensor] = None,
        ref_logprobs: Optional[Tensor] = None,
        return_aux: bool = False,
    ):
        return tpo_loss(
            logits, labels, scores, group_size=group_size, group_ids=group_ids, cu_seqlens=cu_seqlens,
            mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, return_aux=return_aux,
            inplace_backward=self.inplace_backward, **self.settings(),
        )


class FusedLinearTPOLoss(_SequenceTPOSettings):
    """Module form of :func:`tpo_kernels.fused_linear_tpo_loss`: TPO on ``hidden @ weight.T``
    without materializing the logits.

    Example::

        loss_fn = FusedLinearTPOLoss(temperature=0.7)
        loss = loss_fn(hidden, lm_head.weight, labels, scores, group_size=8)
    """

    def __init__(self, *, chunk_size: Optional[int] = None, logits_cache_bytes: int = 0, **settings) -> None:
        super().__init__(**settings)
        self.chunk_size, self.logits_cache_bytes = chunk_size, logits_cache_bytes

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        scores: Tensor,
        *,
        bias: Optional[Tensor] = None,
        group_size: Optional[int] = None,
        group_ids: Optional[Tensor] = None,
        cu_seqlens: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        old_logprobs: Optional[Tensor] = None,
        ref_logprobs: Optional[Tensor] = None,
        return_aux: bool = False,
    ):
        return fused_linear_tpo_loss(
            hidden, weight, labels, scores, bias=bias, group_size=group_size, group_ids=group_ids,
            cu_seqlens=cu_seqlens, mask=mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
            return_aux=return_aux, chunk_size=self.chunk_size, logits_cache_bytes=self.logits_cache_bytes,
            **self.settings(),
        )


class TokenTPOLoss(_TPOSettings):
    """Module form of :func:`tpo_kernels.token_tpo_loss` (K scored candidate tokens per state)."""

    def forward(
        self,
        logits: Tensor,
        candidates: Tensor,
        scores: Tensor,
        *,
        old_logprobs: Optional[Tensor] = None,
        return_aux: bool = False,
    ):
        return token_tpo_loss(
            logits, candidates, scores, old_logprobs=old_logprobs, return_aux=return_aux, **self.settings()
        )


class FusedLinearTokenTPOLoss(_TPOSettings):
    """Module form of :func:`tpo_kernels.fused_linear_token_tpo_loss`: O(R*K*H), no ``[R, V]``."""

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        candidates: Tensor,
        scores: Tensor,
        *,
        bias: Optional[Tensor] = None,
        old_logprobs: Optional[Tensor] = None,
        return_aux: bool = False,
    ):
        return fused_linear_token_tpo_loss(
            hidden, weight, candidates, scores, bias=bias, old_logprobs=old_logprobs,
            return_aux=return_aux, **self.settings(),
        )
