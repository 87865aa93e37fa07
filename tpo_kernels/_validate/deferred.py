"""Value checks read back from the device together, once per call.

A check of values (label ranges, finite scores, ...) needs its result on the host to raise an
error, and every read-back makes the host wait for the device. The value checks of one call are
therefore computed on the device as 0-d bool tensors, stacked and read back with one
``tolist()``; only when a check fails is more read, to word its error.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import Tensor


class ValueChecks:
    """Conditions gathered during a call and read back by :meth:`read`, in the order added."""

    def __init__(self) -> None:
        self._conditions: List[Tensor] = []
        self._errors: List[Optional[Callable[[], Exception]]] = []

    def require(self, holds: Tensor, error: Callable[[], Exception]) -> None:
        """At :meth:`read`, raise ``error()`` unless the 0-d bool ``holds`` is True."""
        self._conditions.append(holds)
        self._errors.append(error)

    def observe(self, value: Tensor) -> int:
        """Read the 0-d bool ``value`` back with the checks; returns its index in :meth:`read`."""
        self._conditions.append(value)
        self._errors.append(None)
        return len(self._conditions) - 1

    def read(self) -> List[bool]:
        """One read-back of every condition; raises the error of the first that fails."""
        if not self._conditions:
            return []
        values = torch.stack([c.reshape(()) for c in self._conditions]).tolist()
        for holds, error in zip(values, self._errors):
            if error is not None and not holds:
                raise error()
        return values
