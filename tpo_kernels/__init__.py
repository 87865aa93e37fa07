"""tpo_kernels: fused kernels for the Target Policy Optimization (TPO) loss.

Public API::

    tpo_loss(logits, labels, scores, *, group_size=..., ...)   sequence-level TPO on logits
    selective_logprobs(logits, labels, ...)                     per-token log-probs (+ entropy)
    TPOLoss                                                     nn.Module form
    backend_status()                                            which backends run here
    reference                                                   plain-PyTorch ground truth
"""

__version__ = "0.1.0"

from . import reference
from .backends import backend_status
from .functional import selective_logprobs, tpo_loss
from .modules import TPOLoss

__all__ = [
    "__version__",
    "backend_status",
    "reference",
    "selective_logprobs",
    "tpo_loss",
    "TPOLoss",
]
