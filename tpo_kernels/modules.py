"""``nn.Module`` wrappers of the functional API: the loss hyper-parameters live on the module,
the batch (and its grouping) is passed to ``forward``."""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from . import functional as F


class TPOLoss(nn.Module):
    """Module form of :func:`tpo_kernels.tpo_loss`.

    Example::

        loss_fn = TPOLoss(eta=1.0, temperature=0.7)
        loss = loss_fn(logits, labels, scores, group_size=8)
    """

    def __init__(
        self,
        *,
        eta: float = 1.0,
        anchor: bool = True,
        temperature: float = 1.0,
        beta: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "mean",
        backend: str = "auto",
        inplace_backward: bool = True,
    ) -> None:
        super().__init__()
        self.eta, self.anchor, self.temperature, self.beta = eta, anchor, temperature, beta
        self.ignore_index, self.reduction, self.backend = ignore_index, reduction, backend
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
        return F.tpo_loss(
            logits, labels, scores,
            group_size=group_size, group_ids=group_ids, cu_seqlens=cu_seqlens, mask=mask,
            ignore_index=self.ignore_index, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
            beta=self.beta, eta=self.eta, anchor=self.anchor, temperature=self.temperature,
            reduction=self.reduction, backend=self.backend, inplace_backward=self.inplace_backward,
            return_aux=return_aux,
        )

    def extra_repr(self) -> str:
        return (
            f"eta={self.eta}, anchor={self.anchor}, temperature={self.temperature}, beta={self.beta}, "
            f"reduction={self.reduction!r}, backend={self.backend!r}"
        )
