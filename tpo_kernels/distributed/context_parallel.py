"""Completions split over context-parallel ranks: the sum the group stage runs when each
completion's positions live on several ranks.

Every rank of ``context_parallel_group`` holds the same completions and its own positions of
each. A sequence log-prob is a sum over tokens, and so is every other per-completion quantity the
group stage needs (counted tokens, old log-probs, the k3 and entropy terms), so each rank reduces
its tokens to ``[N, C]`` float64 partials and one all-reduce adds them up
(:class:`tpo_kernels.ops.group.GroupObjective` with a ``context`` seam); every rank then runs the
same group stage on the same sums. Nothing token-, vocabulary- or hidden-sized crosses ranks.

Gradient scale, derived (``S`` context ranks, ``D`` data ranks, each 1 when absent). Every rank
computes the same loss ``L = F(R)`` of the summed partials ``R = sum_s R_s``, so each holds the same
``G = dF/dR``. Seen from the ranks together, the sum feeds ``S`` identical copies of ``F``: its true
backward gives every rank's partials the sum of their ``S`` gradients, ``S * G``, with no collective.
The data gather adds ``D`` the same way, so rank (d, s) gives its tokens ``D * S * dL/dz``; summed over
the ``D * S`` ranks that is ``D * S * dL/dtheta``, and a wrapper that averages the gradients over
data x context (FSDP2 / HSDP over a mesh dimension that includes the context ranks, torchtitan's
``dp_shard_cp``) gives every parameter exactly the one-process gradient ``dL/dtheta``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch.distributed as dist
from torch import Tensor

from .collectives import all_reduce_sum


@dataclass(frozen=True)
class ContextSum:
    """The context seam of the group stage (:class:`tpo_kernels.ops.group.RowSum`): every rank's
    per-completion partials summed over ``group``. ``any_counted``: some rank of the group holds
    a counted token (the agreed verdict; what the data record reports for these completions)."""

    group: object
    any_counted: bool = True

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def sum(self, partials: Tensor) -> Tensor:
        """``[N, C]``: every rank's ``partials`` added up (one all-reduce of ``8 N C`` bytes in
        float64); ``partials`` itself is left as it is."""
        return all_reduce_sum(partials.detach().clone(), self.group, "context_partials")


__all__: List[str] = ["ContextSum"]
