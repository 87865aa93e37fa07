"""Drop-in integrations with RL trainers.

Each integration lives in its own submodule and is imported explicitly, e.g.
``from tpo_kernels.integrations.trl import TargetPOTrainer, TargetPOConfig`` (TRL) or
``tpo_kernels.integrations.verl`` (verl, which also loads it itself as a plugin). Nothing is
imported here, so ``import tpo_kernels`` never imports a trainer library.

Each is an adapter from its trainer's batch to the public losses, built on the integration kit
(:mod:`tpo_kernels.kit`: the one score standardization, constant group members, and the
collectives a trainer needs of its own: a row gather, sums and a token mean over ranks). An
integration imports only the package's top-level names and the kit, and issues no collective
itself (``tests/test_integration_kit.py``); a new trainer is a new folder of the same shape.
"""
