"""Benchmark harness for tpo_kernels (see bench/README.md).

Run it as ``tpo-kernels bench`` (console script), ``python -m tpo_kernels bench`` or
``python -m bench`` from the repository root. Modules: ``cases`` (cases, providers, grids,
presets), ``baselines`` (what users would otherwise use), ``harness`` (timing and memory of one
measurement), ``report`` (ratios, targets, JSON / Markdown / PNG), ``run`` (the CLI).
"""
