"""tpo_kernels: fused kernels for the Target Policy Optimization (TPO) loss.

Public API::

    tpo_loss(logits, labels, scores, ...)                        sequence-level TPO on logits
    tpo_loss_from_logprobs(logprobs, scores, ...)                the same on per-token log-probs
    fused_linear_tpo_loss(hidden, weight, labels, scores, ...)   same on hidden @ weight.T, chunked
    token_tpo_loss(logits, candidates, scores, ...)              token-level TPO, K candidates per state
    fused_linear_token_tpo_loss(hidden, weight, candidates, ...) same from hidden states, O(R*K*H)
    selective_logprobs(logits, labels, ...)                      per-token log-probs (+ entropy)
    fused_linear_logprobs(hidden, weight, labels, ...)           same without materialized logits
    TPOLoss, FusedLinearTPOLoss, TokenTPOLoss, FusedLinearTokenTPOLoss   nn.Module forms
    backend_status()                                             which backends run here
    check(...)                                                   numerical self-check on this machine
    reference                                                    plain-PyTorch ground truth
"""

__version__ = "0.1.0"

from . import reference
from .backends import Backend, backend_status
from .functional import (
    fused_linear_logprobs,
    fused_linear_token_tpo_loss,
    fused_linear_tpo_loss,
    selective_logprobs,
    token_tpo_loss,
    tpo_loss,
    tpo_loss_from_logprobs,
)
from .modules import FusedLinearTokenTPOLoss, FusedLinearTPOLoss, TokenTPOLoss, TPOLoss
from .ops import TilePolicy

from .selfcheck import check

__all__ = [
    "__version__",
    "Backend",
    "TilePolicy",
    "backend_status",
    "check",
    "reference",
    "tpo_loss",
    "tpo_loss_from_logprobs",
    "fused_linear_tpo_loss",
    "token_tpo_loss",
    "fused_linear_token_tpo_loss",
    "selective_logprobs",
    "fused_linear_logprobs",
    "TPOLoss",
    "FusedLinearTPOLoss",
    "TokenTPOLoss",
    "FusedLinearTokenTPOLoss",
]
