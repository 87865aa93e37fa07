"""The TPO metrics of a loss call, logged through TRL's metrics (see the package docstring for
what each one means): one gather of a per-completion table over processes, then sums by group.
:class:`~.trainer.TargetPOTrainer` calls :func:`log_tpo_metrics` after every loss call.

Beside the ``tpo/*`` metrics, the loss call logs the GRPOTrainer metrics that have a TPO meaning,
under TRL's names and as GRPOTrainer computes them, so that TRL's dashboards and tests find them:
``entropy`` and ``kl`` (``beta > 0``), token means over this micro-step's counted tokens on every
process, and ``policy_loss`` (with the entropy bonus on), the loss before the bonus.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
from torch import Tensor

from .request import TPORequest


def log_tpo_metrics(metrics: Dict[str, List[float]], gather: Callable[[Tensor], Tensor], out: Dict[str, Any],
                    request: TPORequest, entropy_bonus: bool = False) -> None:
    """Metrics over the step's micro-batch of every process. Per-group quantities are sums of
    per-completion terms (``KL(q || p) = sum_i q_i log(q_i / p_i)``, ``H(p) = -sum_i p_i log p_i``),
    so they hold when a group spans processes; groups are counted by their global id.

    ``metrics``: the trainer's metric lists of the mode (TRL's ``_metrics[mode]``, a ``defaultdict(list)``), appended
    to;
    ``gather``: the accelerator's gather over processes; ``out`` and ``request``: the loss call's
    output and :class:`~.request.TPORequest` (:meth:`~.trainer.TargetPOTrainer._tpo_request`);
    ``entropy_bonus``: the
    trainer's entropy bonus is on (GRPOTrainer's condition for logging ``policy_loss``; the
    coefficient this call applied is ``request.entropy_coef``, 0 while the adaptive controller
    holds the bonus back)."""
    loss = out["loss"].detach().float()
    mask = out["mask"]  # the call's rows: this micro-step's, then any detached ones
    columns = torch.zeros(mask.shape[0], 10, device=loss.device)
    columns[:, 0] = request.metric_group_ids.to(loss.device).float()
    columns[: request.labels.shape[0], 9] = 1.0  # this micro-step's rows (then any detached ones)
    aux = out["aux"]
    bonus_entropy = torch.zeros((), device=loss.device)  # the bonus's H on this process
    if aux is not None:  # left-out completions have p = q = u = 0
        p, q = aux["p"].float(), aux["q"].float()
        xlogy = torch.special.xlogy
        columns[:, 1] = out["kept"].float()
        columns[:, 2] = (aux["u"] != 0).float()
        columns[:, 3] = xlogy(q, q) - xlogy(q, p)
        columns[:, 4] = -xlogy(p, p)
        columns[:, 5] = -xlogy(q, q)
        columns[:, 6] = mask.sum(dim=1).float()
        if request.token_entropy:
            columns[:, 7] = (aux["token_entropy"].float() * mask).sum(dim=1)
            bonus_entropy = columns[:, 7].sum() / columns[:, 6].sum().clamp(min=1.0)
        if request.beta != 0.0:
            diff = out["ref_logprobs"].float() - aux["token_logprobs"].float()
            columns[:, 8] = ((torch.exp(diff) - diff - 1.0) * mask).sum(dim=1)
    rows = gather(columns).cpu()  # every process's completions: one read-back
    losses = gather(torch.stack([loss, bonus_entropy]).reshape(1, 2)).cpu()  # and each process's loss and H
    ids, kept, signal, own = rows[:, 0], rows[:, 1] > 0, rows[:, 2] > 0, rows[:, 9] > 0
    num_groups = ids.unique().numel()
    kept_groups = ids[kept].unique().numel()
    kl_sum, hp_sum, hq_sum, tokens, ent_sum, k3_sum, _ = rows[:, 3:].sum(dim=0).tolist()
    own_tokens, own_ent_sum, own_k3_sum = rows[own][:, 6:9].sum(dim=0).tolist()

    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else float("nan")

    metrics["tpo/loss"].append(losses[:, 0].mean().item())  # each process's loss (the same one when groups are split)
    metrics["tpo/kl_q_p"].append(ratio(kl_sum, kept_groups))
    metrics["tpo/entropy_p"].append(ratio(hp_sum, kept_groups))
    metrics["tpo/entropy_q"].append(ratio(hq_sum, kept_groups))
    metrics["tpo/frac_zero_signal_groups"].append(ratio(num_groups - ids[signal].unique().numel(), num_groups))
    metrics["tpo/frac_excluded_completions"].append(ratio(float((~kept).sum()), ids.numel()))
    if request.token_entropy:
        metrics["tpo/token_entropy"].append(ratio(ent_sum, tokens))
        # GRPOTrainer's global_masked_mean: 0 over no token
        metrics["entropy"].append(own_ent_sum / max(own_tokens, 1.0))
    if request.beta != 0.0:
        metrics["tpo/kl_k3"].append(ratio(k3_sum, tokens))
        metrics["kl"].append(own_k3_sum / max(own_tokens, 1.0))
    if entropy_bonus:
        # GRPOTrainer's policy_loss: the loss before the bonus ``- c * H``, each process's, averaged.
        # The bonus's H is each process's token mean over the call's rows, or, when the call gathers
        # groups over processes, the mean over every process's tokens.
        entropy = losses[:, 1] if request.process_group is None else torch.tensor(ratio(ent_sum, tokens))
        metrics["policy_loss"].append((losses[:, 0] + request.entropy_coef * entropy).nanmean().item())
