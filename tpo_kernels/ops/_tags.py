"""Tags of the custom ops that read device values back on the host.

A CUDA graph replays device work only: an op that waits for a device value on the host (a
``tolist()``, an output sized by the values such as ``unique_consecutive``) cannot be captured,
and under ``torch.compile(mode="reduce-overhead")`` Inductor must keep it out of the graph it
captures. ``torch.Tag.cudagraph_unsafe`` says so: with it, Inductor splits the graph around the
op (graph partitioning) or, where it does not partition, runs that graph without CUDA graphs.
The tag exists in recent torch only, and ``torch.library.custom_op`` takes ``tags=`` from torch
2.5; older versions get no tag (and should not graph-capture these paths).
"""

from __future__ import annotations

import inspect
from typing import Dict, Tuple

import torch

CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)  # None where this torch lacks it


def host_sync_tags() -> Dict[str, Tuple[torch.Tag, ...]]:
    """Keyword arguments of ``torch.library.custom_op`` for an op that reads back: the
    ``cudagraph_unsafe`` tag where this torch has it and ``custom_op`` takes tags, else none."""
    if CUDAGRAPH_UNSAFE is None or "tags" not in inspect.signature(torch.library.custom_op).parameters:
        return {}
    return {"tags": (CUDAGRAPH_UNSAFE,)}
