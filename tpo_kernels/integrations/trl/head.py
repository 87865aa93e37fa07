"""The TPO loss head: the fused-linear TPO loss computed inside the model's forward."""

from __future__ import annotations

import functools
import types
from typing import Any, Dict, Optional

import torch
from torch import Tensor

from ... import SamplingMask, fused_linear_logprobs, fused_linear_tpo_loss, kit, tpo_loss_from_logprobs
from .request import TPORequest


def _logit_multiplier(text_config) -> float:
    """The constant a model multiplies its logits by (1.0 for most models): ``logit_scale`` of the
    TPO loss."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is not None:  # Granite / MiniCPM3 divide by it, HyperCLOVA X multiplies
        return float(scaling) if text_config.model_type == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def add_tpo_head(model) -> None:
    """Patch ``model.forward`` so that ``model(input_ids, attention_mask, tpo_request=request)``
    returns the TPO loss computed from the final hidden states (see :func:`_tpo_head`), or, for a
    request with ``logprobs_only``, the completions' token log-probs (:func:`_tpo_logprobs`); calls
    without ``tpo_request`` go to the previous forward unchanged (TRL's fused head, generation).

    ``model`` is the transformers causal LM (the base model under PEFT). Idempotent.
    """
    if getattr(model.forward, "_tpo_head", False):
        return
    previous = model.forward
    text_config = model.config.get_text_config()
    transform = dict(logit_scale=_logit_multiplier(text_config),
                     logit_softcap=getattr(text_config, "final_logit_softcapping", None))  # Gemma 2 / 3

    @functools.wraps(type(model).forward)  # keep the signature: generate() validates its kwargs against it
    def forward(self, *args, tpo_request=None, **kwargs):
        if tpo_request is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        # Looked up on each call: FSDP and PEFT replace the backbone and the head after patching.
        backbone, head = self.base_model, self.get_output_embeddings()
        if tpo_request.logprobs_only:
            return _tpo_logprobs(backbone(*args, **kwargs).last_hidden_state, head, tpo_request, **transform)
        if not tpo_request.router_aux_loss:
            return _tpo_head(backbone(*args, **kwargs).last_hidden_state, head, tpo_request, **transform)
        # MoE: the model's own forward computes its load-balancing loss from the router logits (as
        # for TRL's GRPOTrainer); its logits are kept for one position only, and the backbone's
        # last hidden states are taken on the way for the fused loss.
        captured = []
        hook = backbone.register_forward_hook(lambda module, inputs, output: captured.append(output.last_hidden_state))
        try:
            outputs = previous(*args, output_router_logits=True, logits_to_keep=1, **kwargs)
        finally:
            hook.remove()
        out = _tpo_head(captured[0], head, tpo_request, **transform)
        out["router_aux_loss"] = outputs.aux_loss
        return out

    forward._tpo_head = True
    model.forward = types.MethodType(forward, model)


def _head_tensors(hidden: Tensor, head, cast_fp32: bool):
    """hidden, weight and bias of the lm_head in one dtype, as the model would compute its logits."""
    weight, bias = head.weight, head.bias
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        DTensor = ()
    if DTensor and isinstance(weight, DTensor):  # FSDP2: gather the head once, as TRL's fused head does
        weight = weight.full_tensor()
        if bias is not None:
            bias = bias.full_tensor()
    hidden = hidden.to(weight.device)
    device_type = hidden.device.type
    if cast_fp32:
        dtype = torch.float32
    elif torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)  # what autocast would run the head's matmul in
    else:
        dtype = weight.dtype
    # The matmul runs in ``dtype``, as the model's F.linear would. A narrower hidden state under
    # an fp32 head needs no [tokens, H] copy: the loss casts it tile by tile (mixed-dtype heads
    # compute in the wider dtype). Under autocast the weight is cast, as F.linear does there.
    if not (cast_fp32 and hidden.dtype.itemsize <= 4):
        hidden = hidden.to(dtype)
    weight = weight.to(dtype)
    bias = None if bias is None else bias.to(dtype)
    return hidden, weight, bias


def _completion_hidden(hidden_all: Tensor, head, request: TPORequest):
    """The hidden states that predict the completion tokens (position t predicts token t), with
    the lm_head's weight and bias, in the head's compute dtype; labels and mask on their device."""
    labels, mask = request.labels, request.mask
    hidden = hidden_all[:, -labels.shape[1] - 1 : -1]
    hidden, weight, bias = _head_tensors(hidden, head, request.cast_lm_head_to_fp32)
    return hidden, weight, bias, labels.to(hidden.device), mask.to(hidden.device)


def _kept_sets(request: TPORequest, device: torch.device) -> Optional[SamplingMask]:
    """The request's kept sets on ``device`` (None: the full vocabulary)."""
    kept = request.sampling_mask
    if kept is None:
        return None
    return SamplingMask(token_ids=kept.token_ids.to(device), offsets=kept.offsets.to(device))


def _vocab_pass(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, mask: Tensor,
                request: TPORequest, logit_scale: float, logit_softcap: Optional[float]):
    """Tempered token log-probs (0 where the mask is off) and, with ``token_entropy``, their entropy
    (else None), by the fused-linear kernel; over each token's kept set with ``sampling_mask``."""
    with torch.autocast(hidden.device.type, enabled=False):
        out = fused_linear_logprobs(hidden, weight, labels.masked_fill(~mask, -100), bias=bias,
                                    temperature=request.temperature, logit_scale=logit_scale,
                                    logit_softcap=logit_softcap, return_entropy=request.token_entropy,
                                    backend=request.backend, sampling_mask=_kept_sets(request, hidden.device))
    return out if request.token_entropy else (out, None)


def _tpo_logprobs(hidden_all: Tensor, head, request: TPORequest, *, logit_scale: float = 1.0,
                  logit_softcap: Optional[float] = None) -> Dict[str, Any]:
    """The completions' ``token_logprobs`` and ``token_entropy`` (see :func:`_vocab_pass`), as
    :func:`_tpo_head` computes them, for rows that enter another micro-step's loss call detached
    (``request`` as there; only the fields of its vocabulary pass are read: ``labels``, ``mask``,
    ``sampling_mask``, ``temperature``, ``backend``, ``cast_lm_head_to_fp32``, ``token_entropy``)."""
    hidden, weight, bias, labels, mask = _completion_hidden(hidden_all, head, request)
    token_logprobs, entropy = _vocab_pass(hidden, weight, bias, labels, mask, request, logit_scale, logit_softcap)
    return {"token_logprobs": token_logprobs, "token_entropy": entropy}


def _tpo_head(hidden_all: Tensor, head, request: TPORequest, *, logit_scale: float = 1.0,
              logit_softcap: Optional[float] = None) -> Dict[str, Any]:
    """The TPO loss of a micro-batch from the backbone's last hidden states ``[N, P + C, H]``; the
    model's logits are ``softcap(logit_scale * (hidden @ W.T + b))`` (see the public functions).

    ``request``: a :class:`~.request.TPORequest` (its fields' meaning there). ``detached`` rows
    (a group spanning micro-steps) enter the loss call after the N rows without gradient
    (:func:`tpo_kernels.kit.add_constant_members`; their token log-probs computed under the same
    parameters, on their own kept sets; ``group_ids`` then required). ``sampling_mask`` covers the
    N rows only.
    Returns ``loss``, ``aux`` (tpo_kernels' aux, with ``token_entropy`` on request; None when no
    completion has a counted token), ``kept`` ([N (+ D)] bool: completions with a counted token and a
    weight above 0), and
    ``mask``, ``ref_logprobs`` of the call's rows on the hidden states' device.

    Completions without a counted token are left out of their group by tpo_kernels itself.
    """
    hidden, weight, bias, labels, mask = _completion_hidden(hidden_all, head, request)
    device = hidden.device
    scores = request.scores.to(device)
    old, ref = request.old_logprobs, request.ref_logprobs
    old = None if old is None else old.to(device)
    ref = None if ref is None else ref.to(device)
    group_ids = None if request.group_ids is None else request.group_ids.to(device)
    log_weights = request.seq_log_weights
    log_weights = None if log_weights is None else log_weights.to(device)
    detached = request.detached
    rows = None
    if detached is not None:
        # The same vocabulary pass on this micro-step's rows, then the group stage on whole groups:
        # the detached rows take part in each group's p and q but carry no gradient.
        token_logprobs, entropy = _vocab_pass(hidden, weight, bias, labels, mask, request, logit_scale, logit_softcap)
        rows = kit.add_constant_members(
            kit.LossRows(logprobs=token_logprobs, scores=scores, group_ids=group_ids, mask=mask, old_logprobs=old,
                         ref_logprobs=ref, token_entropy=entropy, seq_log_weights=log_weights),
            detached)
        mask, ref, log_weights = rows.mask, rows.ref_logprobs, rows.seq_log_weights
    kept = mask.any(dim=1)
    if log_weights is not None:  # a weight of 0 leaves a completion out of its group
        kept = kept & (log_weights > float("-inf"))
    out: Dict[str, Any] = {"kept": kept, "mask": mask, "ref_logprobs": ref}
    if request.process_group is None and not bool(kept.any()):
        # tpo_kernels refuses a batch without any counted token; return a differentiable zero
        # connected to every parameter the loss would touch, so that DDP / FSDP see them all.
        # (With groups spanning processes every process calls the loss: it gathers.)
        zero = hidden.sum() * 0.0 + weight.sum() * 0.0
        out.update(loss=zero if bias is None else zero + bias.sum() * 0.0, aux=None)
        return out
    entropy_coef = float(request.entropy_coef)
    settings = dict(group_size=request.group_size, process_group=request.process_group, beta=request.beta,
                    eta=request.eta, anchor=request.anchor, score_eps=request.score_eps,
                    length_normalize=request.length_normalize, reduction="mean", backend=request.backend,
                    return_aux=True)
    if rows is None:
        with torch.autocast(device.type, enabled=False):
            loss, aux = fused_linear_tpo_loss(
                hidden, weight, labels, scores, bias=bias, mask=mask, group_ids=group_ids, old_logprobs=old,
                ref_logprobs=ref, seq_log_weights=log_weights, temperature=request.temperature,
                logit_scale=logit_scale,
                logit_softcap=logit_softcap, return_entropy=request.token_entropy, entropy_coef=entropy_coef,
                sampling_mask=_kept_sets(request, device), **settings)
    else:
        loss, aux = tpo_loss_from_logprobs(**rows.loss_inputs(), **settings)
        if entropy_coef != 0.0:
            # H over the call's counted tokens (own and detached rows; every process's with
            # process_group), its gradient through this micro-step's rows only.
            loss = loss - entropy_coef * kit.token_mean(rows.token_entropy, rows.mask, request.process_group)
        if rows.token_entropy is not None:
            aux["token_entropy"] = rows.token_entropy.detach()
    out.update(loss=loss, aux=aux)
    return out


def trl_fused_head_missing() -> bool:
    """True when TRL's fused lm_head has no kernel to run: TRL 1.15 sets its chunked log-prob
    function to None when its Triton kernels do not import (TRL 1.16 falls back to torch)."""
    import trl.trainer.utils as trl_utils

    return getattr(trl_utils, "_ChunkedLogProbFunction", object) is None


def serve_trl_fused_head(model, *, temperature: float, cast_lm_head_to_fp32: bool, backend: str = "auto") -> None:
    """Patch ``model.forward`` so that TRL's fused-head calls (``model(..., labels=labels,
    fused_lm_head=True)``, its old and reference log-probs) are computed by
    :func:`tpo_kernels.fused_linear_logprobs` from the final hidden states, as TRL's own fused head
    computes them (labels shifted unless ``shift_labels`` is given; ``-100`` not scored; logits
    tempered after the model's logit multiplier and soft-cap; float32 head with
    ``cast_lm_head_to_fp32``); every other call goes to the previous forward. For a TRL whose fused
    head has no kernel (:func:`trl_fused_head_missing`). Idempotent."""
    if getattr(model.forward, "_tpo_serves_trl_head", False):
        return
    from trl.trainer.utils import FusedCausalLMOutput

    previous = model.forward
    text_config = model.config.get_text_config()
    logit_scale = _logit_multiplier(text_config)
    logit_softcap = getattr(text_config, "final_logit_softcapping", None)

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not fused_lm_head:
            for name, value in (("labels", labels), ("shift_labels", shift_labels),
                                ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[name] = value
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        head = self.get_output_embeddings()
        hidden, weight, bias = _head_tensors(hidden, head, cast_lm_head_to_fp32)
        targets = targets.to(hidden.device)
        mask = targets != -100
        with torch.autocast(hidden.device.type, enabled=False):
            log_probs, entropy = fused_linear_logprobs(hidden, weight, targets, bias=bias, temperature=temperature,
                                                       logit_scale=logit_scale, logit_softcap=logit_softcap,
                                                       return_entropy=True, backend=backend)
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / denominator, log_probs=log_probs, entropy=entropy,
                                   label_mask=mask)

    forward._tpo_serves_trl_head = True
    model.forward = types.MethodType(forward, model)
