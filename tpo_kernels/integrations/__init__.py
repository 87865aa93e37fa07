"""Drop-in integrations with RL trainers.

Each integration lives in its own submodule and is imported explicitly, e.g.
``from tpo_kernels.integrations.trl import TargetPOTrainer, TargetPOConfig`` (TRL) or
``tpo_kernels.integrations.verl`` (verl, which also loads it itself as a plugin). Nothing is
imported here, so ``import tpo_kernels`` never imports a trainer library.
"""
