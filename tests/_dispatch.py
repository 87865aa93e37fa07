"""A TorchDispatchMode that also sees the ops inside tpo_kernels' custom ops.

A dispatch mode normally sees a custom op as one opaque call; the tests that count matmuls or
measure what an op allocates need the ops it runs, so the op's Python implementation is run
under the mode instead of the op itself.
"""

from __future__ import annotations

from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode


class OpRecorder(TorchDispatchMode):
    """Calls :meth:`record` with every op dispatched while active, and its result."""

    def record(self, func, args, kwargs, out) -> None:
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "tpo_kernels":
            with self:
                out = OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out


class OutputSizes(OpRecorder):
    """Records ``(shape, bytes)`` of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def record(self, func, args, kwargs, out):
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if hasattr(t, "shape") and hasattr(t, "element_size"):
                self.outputs.append((tuple(t.shape), t.numel() * t.element_size()))

    @property
    def largest(self) -> int:
        """Most elements of any tensor produced."""
        return max((_numel(shape) for shape, _ in self.outputs), default=0)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
