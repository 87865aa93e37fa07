"""The plan of a call (layer 4, below the pipeline): its check pass (:mod:`.call`) runs the
primitive checks of :mod:`tpo_kernels.checks` in call order and builds the frozen records the work
reads (:mod:`.records`: :class:`Plan`, the row records; each stage's settings record is built by
:func:`tpo_kernels.checks.arguments.check_options`); a vocabulary split over ranks or a DTensor is
resolved by :mod:`.vocabulary`. Nothing here runs a collective."""

from .call import check_call
from .records import CandidateRows, CheckedCall, HeadRows, LogitsRows, LogprobRows, Plan, RankGroups

__all__ = ["CandidateRows", "CheckedCall", "HeadRows", "LogitsRows", "LogprobRows", "Plan", "RankGroups",
           "check_call"]
