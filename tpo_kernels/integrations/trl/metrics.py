"""The TPO metrics of a loss call, logged through TRL's metrics (see the package docstring for
what each one means): one gather of a per-completion table over processes, then sums by group.
:class:`~.trainer.TargetPOTrainer` calls :func:`log_tpo_metrics` after every loss call.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
from torch import Tensor


def log_tpo_metrics(metrics: Dict[str, List[float]], gather: Callable[[Tensor], Tensor], out: Dict[str, Any],
                    request: Dict[str, Any]) -> None:
    """Metrics over the step's micro-batch of every process. Per-group quantities are sums of
    per-completion terms (``KL(q || p) = sum_i q_i log(q_i / p_i)``, ``H(p) = -sum_i p_i log p_i``),
    so they hold when a group spans processes; groups are counted by their global id.

    ``metrics``: the trainer's metric lists of the mode (TRL's ``_metrics[mode]``, a ``defaultdict(list)``), appended
    to;
    ``gather``: the accelerator's gather over processes; ``out`` and ``request``: the loss call's
    output and request (:meth:`~.trainer.TargetPOTrainer._tpo_request`)."""
    loss = out["loss"].detach().float()
    mask = out["mask"]  # the call's rows: this micro-step's, then any detached ones
    columns = torch.zeros(mask.shape[0], 9, device=loss.device)
    columns[:, 0] = request["metric_group_ids"].to(loss.device).float()
    aux = out["aux"]
    if aux is not None:  # left-out completions have p = q = u = 0
        p, q = aux["p"].float(), aux["q"].float()
        xlogy = torch.special.xlogy
        columns[:, 1] = out["kept"].float()
        columns[:, 2] = (aux["u"] != 0).float()
        columns[:, 3] = xlogy(q, q) - xlogy(q, p)
        columns[:, 4] = -xlogy(p, p)
        columns[:, 5] = -xlogy(q, q)
        columns[:, 6] = mask.sum(dim=1).float()
        if request["token_entropy"]:
            columns[:, 7] = (aux["token_entropy"].float() * mask).sum(dim=1)
        if request["beta"] != 0.0:
            diff = out["ref_logprobs"].float() - aux["token_logprobs"].float()
            columns[:, 8] = ((torch.exp(diff) - diff - 1.0) * mask).sum(dim=1)
    rows = gather(columns).cpu()  # every process's completions: one read-back
    losses = gather(loss.reshape(1)).cpu()  # and each process's loss
    ids, kept, signal = rows[:, 0], rows[:, 1] > 0, rows[:, 2] > 0
    num_groups = ids.unique().numel()
    kept_groups = ids[kept].unique().numel()
    kl_sum, hp_sum, hq_sum, tokens, ent_sum, k3_sum = rows[:, 3:].sum(dim=0).tolist()

    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else float("nan")

    metrics["tpo/loss"].append(losses.mean().item())  # each process's loss (the same one when groups are split)
    metrics["tpo/kl_q_p"].append(ratio(kl_sum, kept_groups))
    metrics["tpo/entropy_p"].append(ratio(hp_sum, kept_groups))
    metrics["tpo/entropy_q"].append(ratio(hq_sum, kept_groups))
    metrics["tpo/frac_zero_signal_groups"].append(ratio(num_groups - ids[signal].unique().numel(), num_groups))
    metrics["tpo/frac_excluded_completions"].append(ratio(float((~kept).sum()), ids.numel()))
    if request["token_entropy"]:
        metrics["tpo/token_entropy"].append(ratio(ent_sum, tokens))
    if request["beta"] != 0.0:
        metrics["tpo/kl_k3"].append(ratio(k3_sum, tokens))
