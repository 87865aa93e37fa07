"""A TorchDispatchMode that also sees the ops inside tpo_kernels' custom ops.

A dispatch mode normally sees a custom op as one opaque call; the tests that count matmuls or
measure what an op allocates need the ops it runs, so the op's Python implementation is run
under the mode instead of the op itself.
"""

from __future__ import annotations

import torch
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


# Ops whose result the host must wait for: a scalar read (item, bool, int), or an output whose
# shape depends on the values (nonzero, boolean-mask indexing, unique, bincount, repeat_interleave
# without output_size).
_SCALAR_READS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"}
_VALUE_SHAPED = {"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
                 "aten::unique_consecutive", "aten::bincount", "aten::argwhere"}


def _is_mask(index) -> bool:
    return hasattr(index, "dtype") and index.dtype in (torch.bool, torch.uint8)


class ReadBacks(OpRecorder):
    """Counts the operations that force a device-to-host read-back, by name.

    ``Tensor.tolist`` reads values without dispatching an op, so it is counted by wrapping it
    while the recorder is active."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def record(self, func, args, kwargs, out):
        name = func._schema.name
        if name in _SCALAR_READS or name in _VALUE_SHAPED:
            self.reads.append(name)
        elif name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
            _is_mask(i) for i in (args[1] or ())
        ):
            self.reads.append(name + " (bool mask)")
        elif name == "aten::repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None:
            self.reads.append(name)

    def __enter__(self):
        # The recorder re-enters itself around custom ops: wrap tolist on the outermost entry only.
        self._depth = getattr(self, "_depth", 0) + 1
        if self._depth == 1:
            reads = self.reads

            def tolist(tensor):
                reads.append("Tensor.tolist")
                return torch._C.TensorBase.tolist(tensor)

            torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            del torch.Tensor.tolist  # back to TensorBase.tolist
        return super().__exit__(*exc)
