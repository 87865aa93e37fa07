"""Runnable examples: ``python -m tpo_kernels.examples.<name>`` (or ``torchrun ... -m``)."""
