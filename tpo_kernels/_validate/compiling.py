"""What a call checks when Dynamo traces it (``torch.compile``).

Two things cannot be part of a single graph: the value checks of ``validate=True`` (they read a
result back to the host to decide whether to raise) and the collectives of a distributed call
(the agreement of the ranks and the gathers run eagerly). Without ``fullgraph=True`` Dynamo
breaks the graph there and runs them eagerly, which works; with it, Dynamo stops with an error
about ``Tensor.tolist()`` or a skipped function that names neither cause. A call traced as one
graph therefore stops first, with an error that says what to change.
"""

from __future__ import annotations

import torch


@torch.compiler.assume_constant_result
def _refuse_in_one_graph(message: str) -> bool:
    """Raise ``RuntimeError(message)`` while Dynamo traces with ``fullgraph=True`` (or under
    ``torch._dynamo.error_on_graph_break(True)``), where a graph break is an error; False
    otherwise. Runs at trace time (``assume_constant_result``): Dynamo's current frame can be
    read there, and an error raised there reaches the user with its own words first (inside
    Dynamo's ``InternalTorchDynamoError``; traced code raising would read "Observed exception").
    A Dynamo without these fields gives no verdict (False), which leaves Dynamo's own error."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator  # noqa: PLC0415

        tx = InstructionTranslator.current_tx()
        one_graph = bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))
    except Exception:  # noqa: BLE001 - another Dynamo: no verdict
        return False
    if one_graph:
        raise RuntimeError(message)
    return False


def check_traceable(function: str, validate: bool, distributed_keywords: tuple) -> None:
    """Raise one clear error when ``function`` is traced as a single graph with value checks
    (``validate=True``) or distributed keywords (``distributed_keywords``: the names of those
    that are set); nothing outside ``torch.compile``. Runs before any other check."""
    if not torch.compiler.is_compiling():
        return
    if distributed_keywords:
        names = " and ".join(distributed_keywords)
        _refuse_in_one_graph(
            f"{function} with {names} cannot be traced into one graph: distributed calls run eagerly (the ranks "
            f"agree on their inputs and gather rows with collectives). Call it outside the compiled region, or "
            f"compile without fullgraph=True so that Dynamo runs it eagerly between graphs")
    elif validate is True:
        _refuse_in_one_graph(
            f"{function} with validate=True cannot be traced into one graph: its value checks read results back "
            f"to the host. Pass validate=False under torch.compile(fullgraph=True) (or compile without "
            f"fullgraph, which runs the checks eagerly between graphs)")
