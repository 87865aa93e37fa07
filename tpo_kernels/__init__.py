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
    kit                                                          what trainer integrations share
"""

__version__ = "0.1.0"

import importlib

# Where each public name lives. The package imports them (and torch) on the first access of any of
# them, not at ``import tpo_kernels``: the command line (``tpo-kernels --help``) then starts
# without importing torch.
_PUBLIC = {
    "reference": (".reference", None),
    "Backend": (".backends", "Backend"),
    "backend_status": (".backends", "backend_status"),
    "fused_linear_logprobs": (".functional", "fused_linear_logprobs"),
    "fused_linear_token_tpo_loss": (".functional", "fused_linear_token_tpo_loss"),
    "fused_linear_tpo_loss": (".functional", "fused_linear_tpo_loss"),
    "selective_logprobs": (".functional", "selective_logprobs"),
    "token_tpo_loss": (".functional", "token_tpo_loss"),
    "tpo_loss": (".functional", "tpo_loss"),
    "tpo_loss_from_logprobs": (".functional", "tpo_loss_from_logprobs"),
    "FusedLinearTokenTPOLoss": (".modules", "FusedLinearTokenTPOLoss"),
    "FusedLinearTPOLoss": (".modules", "FusedLinearTPOLoss"),
    "TokenTPOLoss": (".modules", "TokenTPOLoss"),
    "TPOLoss": (".modules", "TPOLoss"),
    "TilePolicy": (".ops", "TilePolicy"),
    "SamplingMask": (".requests", "SamplingMask"),
    "check": (".selfcheck", "check"),
    "kit": (".kit", None),
}


def _import_public() -> None:
    for name, (module, attr) in _PUBLIC.items():
        loaded = importlib.import_module(module, __name__)
        globals()[name] = loaded if attr is None else getattr(loaded, attr)


def __getattr__(name: str):
    if name in _PUBLIC:
        _import_public()
        return globals()[name]
    raise AttributeError(f"module 'tpo_kernels' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = ["__version__", *_PUBLIC]
