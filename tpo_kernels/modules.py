"""``nn.Module`` wrappers of the functional API: every keyword of the function that is not part
of the batch (hyper-parameters, backend, tiles, validation, the distributed groups) is a
constructor keyword and lives on the module; the batch (and its grouping) is passed to
``forward``. A keyword passed to ``forward`` overrides the module's for that call."""

from __future__ import annotations

import inspect
from typing import Callable, Tuple

from torch import nn

from .functional import fused_linear_token_tpo_loss, fused_linear_tpo_loss, token_tpo_loss, tpo_loss

# Per-call keywords: the batch and its grouping, and what to return.
_SEQUENCE_BATCH = ("group_size", "group_ids", "cu_seqlens", "mask", "old_logprobs", "ref_logprobs", "seq_log_weights",
                   "sampling_mask", "return_aux",
                   "bias")
_TOKEN_BATCH = ("old_logprobs", "return_aux", "bias")


class _LossModule(nn.Module):
    """Holds the settings of ``function`` (checked against its signature)."""

    function: Callable
    batch_keywords: Tuple[str, ...]

    def __init__(self, **settings) -> None:
        super().__init__()
        parameters = inspect.signature(type(self).function).parameters
        allowed = [name for name, p in parameters.items()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in self.batch_keywords]
        unknown = sorted(set(settings) - set(allowed))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected keyword(s) {unknown}; it takes {allowed} "
                            f"(and {list(self.batch_keywords)} in forward)")
        self.settings = {name: settings.get(name, parameters[name].default) for name in allowed}

    def __getattr__(self, name: str):
        settings = self.__dict__.get("settings", {})
        if name in settings:
            return settings[name]
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={value!r}" for key, value in self.settings.items())

    def _call(self, *tensors, **batch):
        unknown = sorted(set(batch) - set(self.batch_keywords) - set(self.settings))
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward got unexpected keyword(s) {unknown}")
        return type(self).function(*tensors, **{**self.settings, **batch})


class TPOLoss(_LossModule):
    """Module form of :func:`tpo_kernels.tpo_loss`.

    Example::

        loss_fn = TPOLoss(eta=1.0, temperature=0.7)             # Gemma 2: logit_softcap=30.0
        loss = loss_fn(logits, labels, scores, group_size=8)
    """

    function = staticmethod(tpo_loss)
    batch_keywords = _SEQUENCE_BATCH

    def forward(self, logits, labels, scores, **batch):
        return self._call(logits, labels, scores, **batch)


class FusedLinearTPOLoss(_LossModule):
    """Module form of :func:`tpo_kernels.fused_linear_tpo_loss`: TPO on ``hidden @ weight.T``
    without materializing the logits.

    Example::

        loss_fn = FusedLinearTPOLoss(temperature=0.7)
        loss = loss_fn(hidden, lm_head.weight, labels, scores, group_size=8)
    """

    function = staticmethod(fused_linear_tpo_loss)
    batch_keywords = _SEQUENCE_BATCH

    def forward(self, hidden, weight, labels, scores, **batch):
        return self._call(hidden, weight, labels, scores, **batch)


class TokenTPOLoss(_LossModule):
    """Module form of :func:`tpo_kernels.token_tpo_loss` (K scored candidate tokens per state)."""

    function = staticmethod(token_tpo_loss)
    batch_keywords = _TOKEN_BATCH

    def forward(self, logits, candidates, scores, **batch):
        return self._call(logits, candidates, scores, **batch)


class FusedLinearTokenTPOLoss(_LossModule):
    """Module form of :func:`tpo_kernels.fused_linear_token_tpo_loss`: O(R*K*H), no ``[R, V]``."""

    function = staticmethod(fused_linear_token_tpo_loss)
    batch_keywords = _TOKEN_BATCH

    def forward(self, hidden, weight, candidates, scores, **batch):
        return self._call(hidden, weight, candidates, scores, **batch)
