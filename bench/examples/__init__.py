"""Runnable examples, from the repository root: ``torchrun ... -m bench.examples.<name>``."""
