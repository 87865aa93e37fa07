"""Orchestration (layer 3): the kernels as ``torch.library`` custom ops with fake (meta)
implementations and autograd rules, so that eager calls and ``torch.compile`` see the same ops.

=================================  ===============================================  ==========
op                                 computes                                         module
=================================  ===============================================  ==========
``tpo_kernels::logprobs``          token log-probs (+ entropy) of logits            logprobs
``tpo_kernels::linear_logprobs``   the same of ``hidden @ W.T``, tile by tile        linear
``tpo_kernels::group_targets``     the group op: ell, u, p, q, per-group loss        group
``tpo_kernels::candidate_logits``  K candidate logits per state (token-level)       candidates
``tpo_kernels::linear_candidate_logits``  the same as K dot products per state      candidates
``tpo_kernels::kept_logits``       the logits of each token's kept set (replay)     kept
``tpo_kernels::linear_kept_logits``  the same as dot products, no ``[M, V]``          kept
``tpo_kernels::ragged_logprobs``   token log-probs (+ entropy) over kept sets       kept
=================================  ===============================================  ==========

Each op takes its stage's settings as one record, flattened at the op boundary by one method:
:class:`~tpo_kernels.backends.rows.RowRequest` for the row ops,
:class:`~tpo_kernels.group_math.GroupRule` for the group op
(:class:`~tpo_kernels.ops.group.LossWeights`: what the group stage applies around it).

Every loss is a composition: a row op (one of the log-prob or candidate ops) feeds the group op,
whose backward gives each token ``(p - q) * dLoss/d group_loss``; autograd chains the two
backwards. The backend travels as a string key (:func:`tpo_kernels.backends.backend_key`).
"""

from .candidates import candidate_logits, linear_candidate_logits
from .linear import linear_logprobs
from ..backends.rows import RowRequest
from .logprobs import token_logprobs
from .tiles import HeadTiles, TilePolicy

__all__ = ["HeadTiles", "RowRequest", "TilePolicy", "candidate_logits", "linear_candidate_logits", "linear_logprobs",
           "token_logprobs"]
