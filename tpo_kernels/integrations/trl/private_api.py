"""The private TRL methods and helpers TargetPOTrainer overrides or calls, the transformers generation
method it patches, and the signature each must have: checked on import, so that a release that
changes one fails there, naming it, instead of training wrongly (TRL 1.15 and 1.16 and transformers
5.24 / 5.25 have these signatures)."""

from __future__ import annotations

import inspect
from typing import Callable, Dict, Tuple

# name -> the parameter names (after ``self`` for methods) the trainer relies on, in order. A
# trailing parameter with a default that is not listed is allowed (a new optional keyword).
GRPO_TRAINER_METHODS: Dict[str, Tuple[str, ...]] = {
    # overridden: the raw rewards kept for TPO's scores
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    # overridden: tpo_scores, tpo_group_ids, tpo_sampler_kept, the kept sets (replay.py) added to TRL's batch
    "_generate_and_score_completions": ("inputs",),
    # overridden: whole-group micro-batches instead of TRL's row shuffle
    "_prepare_inputs": ("generation_batch",),
    # overridden: the TPO loss (compute_loss calls it with these arguments)
    "_compute_loss": ("model", "inputs"),
}

HELPERS: Dict[str, Tuple[str, ...]] = {
    "trl.models.utils.disable_gradient_checkpointing": ("model", "gradient_checkpointing_kwargs"),
    "trl.trainer.utils.split_tensor_dict": ("tensor_dict", "num_chunks"),
    "trl.trainer.utils.split_pixel_values_by_grid": ("batch",),
    "trl.trainer.utils.unsplit_pixel_values_by_grid": ("batch",),
}


# transformers.GenerationMixin methods patched on the policy: the kept-set recorder is appended to the
# processor list it returns (kept_sets.install_kept_set_recorder), after the sampling warpers.
GENERATION_METHODS: Dict[str, Tuple[str, ...]] = {
    "_get_logits_processor": ("generation_config",),
}


def _required(func: Callable, skip_self: bool) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(the parameter names, the names of those without a default), ``self`` dropped for methods."""
    params = list(inspect.signature(func).parameters.values())
    if skip_self:
        params = params[1:]
    names = tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    required = tuple(p.name for p in params
                     if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return names, required


def signature_problems(grpo_trainer_cls=None, resolve=None, generation_cls=None) -> list:
    """One line per private method or helper whose signature is not the one relied on (empty when
    all match). ``grpo_trainer_cls`` / ``resolve`` (dotted name -> object) / ``generation_cls`` for tests."""
    if grpo_trainer_cls is None:
        from trl import GRPOTrainer as grpo_trainer_cls
    if generation_cls is None:
        from transformers import GenerationMixin as generation_cls
    if resolve is None:
        import importlib

        def resolve(dotted: str):
            module, _, name = dotted.rpartition(".")
            return getattr(importlib.import_module(module), name, None)

    problems = []

    def check(label: str, func, expected: Tuple[str, ...], skip_self: bool) -> None:
        if func is None or not callable(func):
            problems.append(f"{label}: not found (expected parameters {expected})")
            return
        names, required = _required(func, skip_self)
        # Ours must lead; anything after them must be optional.
        if names[: len(expected)] != expected or any(name not in expected for name in required):
            problems.append(f"{label}{inspect.signature(func)}: expected parameters {expected}")

    for name, expected in GRPO_TRAINER_METHODS.items():
        check(f"GRPOTrainer.{name}", getattr(grpo_trainer_cls, name, None), expected, True)
    for name, expected in GENERATION_METHODS.items():
        check(f"transformers.GenerationMixin.{name}", getattr(generation_cls, name, None), expected, True)
    for dotted, expected in HELPERS.items():
        check(dotted, resolve(dotted), expected, False)
    return problems


def check_private_api(grpo_trainer_cls=None, resolve=None, generation_cls=None) -> None:
    """Raise ``ImportError`` naming every private TRL (or transformers) method or helper whose
    signature changed."""
    problems = signature_problems(grpo_trainer_cls, resolve, generation_cls)
    if problems:
        import trl

        raise ImportError(
            f"tpo_kernels.integrations.trl: TRL {trl.__version__} changed private GRPOTrainer API that TargetPOTrainer "
            "overrides or calls (or transformers changed the generation method it patches): " + "; ".join(problems)
            + ". This release is not supported."
        )
